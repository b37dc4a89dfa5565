"""SparseEmbeddings alone on R ranks: a few training steps and an evaluation lookup; rank 0 saves the results.

    mpiexec -n R python tests/mpi/embedding_sharded_run.py OUT.npz

Every rank builds the same global batches (multi-hot bags, empty ones included; evaluation keys partly
unseen) and dLoss/dout, takes its contiguous rows of them, and runs forward -> backward -> update. Rank 0
writes, per embedding: the pooled outputs of every step (gathered over the ranks), the evaluation output,
and every key's vector, optimizer states and recorded slot (gathered from their owners, sorted by key).
tests/test_embedding_sparse.py compares R = 2, 3 with R = 1 bit for bit.
"""

import os
import sys

os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402

import numbactr as hugectr  # noqa: E402
from numbactr.runtime import device  # noqa: E402
from numbactr.autograd import Tape  # noqa: E402
from numbactr.data.batch import Batch  # noqa: E402
from numbactr.distributed.comm import world  # noqa: E402
from numbactr.distributed.sharding import rank_rows, split_batch  # noqa: E402
from numbactr.embedding.factory import make_embedding  # noqa: E402

E, O, U = hugectr.Embedding_t, hugectr.Optimizer_t, hugectr.Update_t
B, S, D, STEPS = 12, 3, 4, 4
ONE_HOT_SIZES = [5, 6, 7]
#: name -> (embedding type, combiner, optimizer)
CONFIGS = {
    "dist_adam_global_mean": (
        E.DistributedSlotSparseEmbeddingHash,
        "mean",
        dict(optimizer_type=O.Adam, update_type=U.Global),
    ),
    "dist_adam_lazy_sum": (
        E.DistributedSlotSparseEmbeddingHash,
        "sum",
        dict(optimizer_type=O.Adam, update_type=U.LazyGlobal),
    ),
    "local_momentum_global_mean": (
        E.LocalizedSlotSparseEmbeddingHash,
        "mean",
        dict(optimizer_type=O.MomentumSGD, update_type=U.Global, momentum_factor=0.9),
    ),
    "onehot_nesterov_sum": (
        E.LocalizedSlotSparseEmbeddingOneHot,
        "sum",
        dict(optimizer_type=O.Nesterov, update_type=U.Local, momentum_factor=0.9),
    ),
}


def global_batch(rng, one_hot: bool, vocab: int) -> Batch:
    """B samples x S slots; hash keys: 0..3 per bag from a per-slot key range (some beyond 2**32);
    one-hot: one per-slot key per bag (the embedding adds the slot offsets)."""
    lens = np.ones((B, S), np.int64) if one_hot else rng.integers(0, 4, (B, S))
    base = np.zeros(S, np.int64) if one_hot else np.arange(S) * (1 << 33)
    high = np.array(ONE_HOT_SIZES) if one_hot else np.full(S, vocab)
    keys = np.concatenate(
        [base[s] + rng.integers(0, high[s], n) for (_, s), n in np.ndenumerate(lens)] + [np.zeros(0, np.int64)]
    ).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens.reshape(-1))]).astype(np.int64)
    return Batch(np.zeros((B, 1), np.float32), np.zeros((B, 0), np.float32), [(keys, offsets)])


def gathered_table(comm, emb) -> dict:
    """Every key's vector, states and slot, from their owners, sorted by key."""
    keys, vecs = emb.dump()
    n = keys.shape[0]
    parts = {"keys": keys, "vecs": vecs}
    for i, s in enumerate(emb.dump_states()):
        parts[f"state{i}"] = s[:n]
    slots = emb.dump_slots()
    if slots is not None:
        parts["slots"] = slots
    whole = {k: comm.allgather_rows(np.ascontiguousarray(v)) for k, v in parts.items()}
    order = np.argsort(whole["keys"], kind="stable")
    return {k: v[order] for k, v in whole.items()}


def main():
    out_path = sys.argv[1]
    comm = world()
    r0, r1 = rank_rows(B, comm.rank, comm.size)
    saved = {}
    for name, (etype, combiner, opt) in CONFIGS.items():
        one_hot = etype == E.LocalizedSlotSparseEmbeddingOneHot
        cfg = hugectr.SparseEmbedding(
            etype, 1, D, combiner, name, "data", slot_size_array=ONE_HOT_SIZES if one_hot else []
        )
        emb = make_embedding(
            cfg, hugectr.DataReaderSparseParam("data", 3, False, S), hugectr.CreateOptimizer(**opt), seed=5, comm=comm
        )
        rng = np.random.default_rng(7)  # the same global data on every rank
        outs = []
        for _ in range(STEPS):
            batch = global_batch(rng, one_hot, vocab=9)
            dy = rng.normal(size=(B, S, D)).astype(np.float32)  # dLoss/dout of the global batch
            keys, offsets = split_batch(batch, comm.rank, comm.size).sparse[0]
            tape = Tape()
            out = emb.forward(tape, keys, offsets, r1 - r0, True)
            tape.backward({id(out): (out, dy[r0:r1])})
            emb.update(0.05, 2.0)
            outs.append(comm.allgather_rows(device.to_host(out.data)))
        keys, offsets = split_batch(global_batch(rng, one_hot, vocab=12), comm.rank, comm.size).sparse[0]
        evaluated = emb.forward(None, keys, offsets, r1 - r0, False)  # keys 9..11 of each slot are unseen
        saved[f"{name}:outs"] = np.stack(outs)
        saved[f"{name}:eval"] = comm.allgather_rows(device.to_host(evaluated.data))
        saved.update({f"{name}:{k}": v for k, v in gathered_table(comm, emb).items()})
    if comm.rank == 0:
        np.savez(out_path, **saved)


if __name__ == "__main__":
    main()
