"""HybridSparseEmbedding beside LocalizedSlotSparseEmbeddingOneHot on R ranks; rank 0 saves the results.

    mpiexec -n R python tests/mpi/hybrid_run.py OUT.npz

Every rank builds the same global batches (one per-slot id per slot, skewed so that some categories are
frequent and others not) and dLoss/dout, and takes its contiguous rows. The hybrid embedding takes its
statistics from the first batches, then both embeddings train STEPS SGD steps on the same rows (the one-hot
one on the same per-slot ids) and look up an evaluation batch. Rank 0 writes the gathered outputs of
every step, the evaluation outputs and both tables as dumped (the one-hot format), sorted by key.
tests/test_hybrid_embedding.py compares them with each other and with R = 1.
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
from numbactr.distributed.sharding import split_batch  # noqa: E402
from numbactr.embedding.factory import make_embedding  # noqa: E402

E = hugectr.Embedding_t
B, D, STEPS, STAT_ITERS = 12, 4, 4, 4
SIZES = [20, 30, 4]
S = len(SIZES)


def global_batch(rng) -> Batch:
    """B samples x S slots, one per-slot id each, skewed toward small ids."""
    ids = np.minimum(rng.geometric(0.3, (B, S)) - 1, np.array(SIZES) - 1).astype(np.int64)
    offsets = np.arange(B * S + 1, dtype=np.int64)
    return Batch(np.zeros((B, 1), np.float32), np.zeros((B, 0), np.float32), [(ids.reshape(-1), offsets)])


def build(etype, comm, param=None):
    cfg = hugectr.SparseEmbedding(etype, 1, D, "sum", "e", "data", slot_size_array=SIZES, hybrid_embedding_param=param)
    return make_embedding(
        cfg,
        hugectr.DataReaderSparseParam("data", 1, True, S),
        hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.SGD),
        seed=3,
        comm=comm,
    )


def step(emb, keys, offsets, rows, dy, training=True):
    tape = Tape() if training else None
    out = emb.forward(tape, keys, offsets, rows, training)
    if training:
        tape.backward({id(out): (out, dy)})
        emb.update(0.5, 1.0)
    return np.ascontiguousarray(device.to_host(out.data)).reshape(rows, S * D)


def main(path: str) -> None:
    comm = world()
    rng = np.random.default_rng(0)
    param = hugectr.HybridEmbeddingParam(
        1000,
        -1,
        0.26,
        1.3e11,
        1.9e11,
        1.0,
        hugectr.CommunicationType.NVLink_SingleNode,
        hugectr.HybridEmbeddingType.Distributed,
    )
    hyb, one = build(E.HybridSparseEmbedding, comm, param), build(E.LocalizedSlotSparseEmbeddingOneHot, comm)
    stats = [split_batch(global_batch(rng), comm.rank, comm.size) for _ in range(STAT_ITERS)]
    hyb.take_statistics([(b.sparse[0][0], b.sparse[0][1], b.size) for b in stats], B, STAT_ITERS)
    res = {"frequent": np.sort(hyb.frequent)}
    batches = [global_batch(rng) for _ in range(STEPS + 1)]
    for t, gb in enumerate(batches):
        mine = split_batch(gb, comm.rank, comm.size)
        keys, offsets = mine.sparse[0]
        rows = mine.label.shape[0]
        dy = np.random.default_rng(100 + t).normal(0, 1, (B, S, D)).astype(np.float32)
        r0 = comm.rank * rows
        dy = device.xp().asarray(dy[r0 : r0 + rows])
        training = t < STEPS
        out_h = step(hyb, device.xp().asarray(keys), offsets, rows, dy, training)
        out_o = step(one, device.xp().asarray(keys), offsets, rows, dy, training)
        name = f"step{t}" if training else "eval"
        for tag, out in (("hyb", out_h), ("one", out_o)):
            g = comm.gather_rows(out)
            if comm.rank == 0:
                res[f"{tag}:{name}"] = g
    for tag, emb in (("hyb", hyb), ("one", one)):
        keys, vecs = emb.dump()
        slots = emb.dump_slots()
        k, v, s = (
            comm.gather_rows(keys.astype(np.int64)),
            comm.gather_rows(vecs),
            comm.gather_rows(slots.astype(np.int64)),
        )
        if comm.rank == 0:
            order = np.argsort(k)
            res[f"{tag}:keys"], res[f"{tag}:vecs"], res[f"{tag}:slots"] = k[order], v[order], s[order]
    # the one-hot table loaded into a fresh hybrid one (each rank gets its share, slot % R, as a snapshot load
    # hands it out), before its statistics; its dump after them is the same table
    keys, vecs = one.dump()
    fresh = build(E.HybridSparseEmbedding, comm, param)
    fresh.load(keys, vecs)
    fresh.take_statistics([(b.sparse[0][0], b.sparse[0][1], b.size) for b in stats], B, STAT_ITERS)
    keys, vecs = fresh.dump()
    k, v = comm.gather_rows(keys.astype(np.int64)), comm.gather_rows(vecs)
    if comm.rank == 0:
        order = np.argsort(k)
        res["fresh:keys"], res["fresh:vecs"] = k[order], v[order]
        np.savez(path, **res)


if __name__ == "__main__":
    main(sys.argv[1])
