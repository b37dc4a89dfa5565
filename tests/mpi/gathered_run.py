"""Key-owned (Distributed) SparseEmbeddings whose bags hold one key each (and one table with two), on R ranks, with the gathered exchange
(numbactr.embedding.sharded: allgather of the keys, lookup of the owned ones, reduce-scatter of the vectors, and
the gradients allgathered) or the alltoall exchange; rank 0 saves the results.

    mpiexec -n R python tests/mpi/gathered_run.py OUT.npz [gathered|alltoall]

Every rank builds the same global batches (hash keys, some beyond 2**32, repeated within and across ranks;
evaluation keys partly unseen) and dLoss/dout, takes its contiguous rows, and runs forward -> backward ->
update; in gathered mode each training lookup is given the step's fixed key ("gathered", N) as numbactr.model
gives it when a step may be a CUDA graph. Rank 0 writes every step's pooled outputs (gathered over the
ranks), the evaluation output, and every key's vector and optimizer states (from their owners, sorted by key),
plus how many lookups took the gathered exchange on each rank. tests/test_gathered_exchange.py compares R = 2
and 3 with R = 1 bit for bit.
"""

import os
import sys

os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402

import numbactr as hugectr  # noqa: E402  (first: starts MPI)
from numbactr.runtime import device  # noqa: E402
from numbactr.autograd import Tape  # noqa: E402
from numbactr.data.batch import Batch  # noqa: E402
from numbactr.distributed.comm import world  # noqa: E402
from numbactr.distributed.sharding import rank_rows, split_batch  # noqa: E402
from numbactr.embedding import sharded  # noqa: E402
from numbactr.embedding.factory import make_embedding  # noqa: E402
from tests.mpi.embedding_sharded_run import gathered_table  # noqa: E402  (every key's row, from its owner)

E, O, U = hugectr.Embedding_t, hugectr.Optimizer_t, hugectr.Update_t
B, S, D, STEPS = 12, 3, 4, 4
#: name -> (combiner, optimizer, keys per bag)
CONFIGS = {
    "sgd_sum": ("sum", dict(optimizer_type=O.SGD, update_type=U.Local), 1),
    "adam_global_mean": ("mean", dict(optimizer_type=O.Adam, update_type=U.Global), 1),
    "adam_lazy_sum": ("sum", dict(optimizer_type=O.Adam, update_type=U.LazyGlobal), 1),
    "adagrad_sum": ("sum", dict(optimizer_type=O.AdaGrad, update_type=U.Local), 1),
    "multihot_adam_mean": ("mean", dict(optimizer_type=O.Adam, update_type=U.Global), 2),  # fixed length 2
}


def global_batch(rng, vocab: int, nnz: int = 1) -> Batch:
    """B samples x S slots, nnz keys per bag from a per-slot key range (slot s: s * 2**33 + [0, vocab))."""
    keys = (np.arange(S)[:, None] * (1 << 33) + rng.integers(0, vocab, (B, S, nnz))).reshape(-1).astype(np.int64)
    offsets = np.arange(0, B * S * nnz + 1, nnz, dtype=np.int64)
    return Batch(np.zeros((B, 1), np.float32), np.zeros((B, 0), np.float32), [(keys, offsets)])


def main():
    out_path = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "gathered"
    comm = world()
    r0, r1 = rank_rows(B, comm.rank, comm.size)
    used = {"gathered": 0}
    real = sharded.ShardedTable._lookup_gathered

    def counted(self, *args, **kwargs):
        used["gathered"] += 1
        return real(self, *args, **kwargs)

    sharded.ShardedTable._lookup_gathered = counted
    saved = {}
    for name, (combiner, opt, nnz) in CONFIGS.items():
        cfg = hugectr.SparseEmbedding(E.DistributedSlotSparseEmbeddingHash, 1, D, combiner, name, "data")
        emb = make_embedding(
            cfg, hugectr.DataReaderSparseParam("data", nnz, True, S), hugectr.CreateOptimizer(**opt), seed=5, comm=comm
        )
        rng = np.random.default_rng(7)  # the same global data on every rank
        outs = []
        for _ in range(STEPS):
            batch = global_batch(rng, vocab=9, nnz=nnz)
            dy = rng.normal(size=(B, S, D)).astype(np.float32)
            keys, offsets = split_batch(batch, comm.rank, comm.size).sparse[0]
            if mode == "gathered" and emb._sharded is not None:
                part = emb.exchange_key_part(keys, offsets)
                key = emb._sharded.step_key([part] * comm.size)  # every rank has the same N here
                assert key == ("gathered", (r1 - r0) * S * nnz), key
                emb._sharded.fixed_key = key
            tape = Tape()
            out = emb.forward(tape, keys, offsets, r1 - r0, True)
            tape.backward({id(out): (out, dy[r0:r1])})
            emb.update(0.05, 2.0)
            outs.append(comm.allgather_rows(device.to_host(out.data)))
        emb.check_pending()
        keys, offsets = split_batch(global_batch(rng, vocab=12, nnz=nnz), comm.rank, comm.size).sparse[0]
        evaluated = emb.forward(None, keys, offsets, r1 - r0, False)  # keys 9..11 of each slot are unseen
        saved[f"{name}:outs"] = np.stack(outs)
        saved[f"{name}:eval"] = comm.allgather_rows(device.to_host(evaluated.data))
        saved.update({f"{name}:{k}": v for k, v in gathered_table(comm, emb).items()})
    counts = comm.allgather_rows(np.array([used["gathered"]], np.int64))
    if comm.rank == 0:
        np.savez(out_path, **saved)
        print(f"gathered lookups per rank: {counts.tolist()}", flush=True)


if __name__ == "__main__":
    main()
