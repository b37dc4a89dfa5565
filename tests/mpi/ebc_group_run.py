"""Grouped EmbeddingCollection tables on R ranks; rank 0 saves what tests/test_embedding_collection_groups_mpi.py
compares (with R = 1, and grouped with one engine per table).

    mpiexec -n R python tests/mpi/ebc_group_run.py OUT.npz

Every rank builds the same global multi-hot batches (empty bags included) and dLoss/dtop, takes its contiguous
rows, and runs lookup -> gradients -> update on two collections of the same config: grouped (the default) and
one engine per table (collection.GROUP_TABLES = False). Tables: "p" and "q" static, model parallel over every
rank (key % R), the model's Adam, width 4 (one engine: their keys travel with their table beside them), read by
sum, average and concat lookups (p twice); "r" static, model parallel on rank 0 only; "d1", "d2" dynamic, model
parallel over every rank, their own Ftrl, width 3 (one engine); "u", "v" static, data parallel, average and sum
(one pooled engine). Saved per collection: every step's tops (gathered over the ranks), evaluation tops, and
every table's keys and rows (gathered from their owners, sorted by key).
"""

import os
import sys

os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402

import numbactr as hugectr  # noqa: E402
from numbactr.runtime import device  # noqa: E402
from numbactr.distributed.comm import world  # noqa: E402
from numbactr.distributed.sharding import rank_rows  # noqa: E402
from numbactr.embedding import collection as C  # noqa: E402

O, U = hugectr.Optimizer_t, hugectr.Update_t
B, STEPS, HOT, V = 12, 4, 3, 10


def config(comm):
    ftrl = hugectr.CreateOptimizer(optimizer_type=O.Ftrl, update_type=U.Global, beta=0.2, lambda1=0.001, lambda2=0.01)
    t = {
        "p": hugectr.EmbeddingTableConfig("p", V, 4),
        "q": hugectr.EmbeddingTableConfig("q", V, 4),
        "r": hugectr.EmbeddingTableConfig("r", V, 4),
        "d1": hugectr.EmbeddingTableConfig("d1", -1, 3, opt_params_or_empty=ftrl),
        "d2": hugectr.EmbeddingTableConfig("d2", -1, 3, opt_params_or_empty=ftrl),
        "u": hugectr.EmbeddingTableConfig("u", V, 2),
        "v": hugectr.EmbeddingTableConfig("v", V, 5),
    }
    cfg = hugectr.EmbeddingCollectionConfig()
    for table, bottom, top, comb in [
        ("p", "x", "p_sum", "sum"),
        ("q", "y", "q_cat", "concat"),
        ("p", "y", "p_avg", "average"),
        ("r", "x", "r_sum", "sum"),
        ("d1", "x", "d1_sum", "sum"),
        ("d2", "y", "d2_cat", "concat"),
        ("d1", "y", "d1_avg", "mean"),
        ("u", "y", "u_avg", "average"),
        ("v", "x", "v_sum", "sum"),
    ]:
        cfg.embedding_lookup(t[table], bottom, top, comb)
    every = ["p", "q", "d1", "d2", "u", "v"]
    cfg.shard(
        [every + ["r"]] + [every for _ in range(comm.size - 1)],
        [("mp", ["p", "q", "r", "d1", "d2"]), ("dp", ["u", "v"])],
    )
    return cfg


def global_csr(rng, vocab):
    lens = rng.integers(0, HOT + 1, B)
    keys = rng.integers(0, vocab, int(lens.sum())).astype(np.int64)
    return keys, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def rows_of(csr, r0, r1):
    keys, off = csr
    return keys[off[r0] : off[r1]], off[r0 : r1 + 1] - off[r0]


def run(comm, saved, prefix):
    rng = np.random.default_rng(11)
    r0, r1 = rank_rows(B, comm.rank, comm.size)
    params = {n: hugectr.DataReaderSparseParam(n, HOT, False, 1) for n in ("x", "y")}
    coll = C.EmbeddingCollection(
        config(comm), 0, params, hugectr.CreateOptimizer(optimizer_type=O.Adam, update_type=U.Global), 5, comm
    )
    saved[f"{prefix}_groups"] = np.array([len(coll.groups)])
    widths = [w for _, (_, _, w) in coll.tops(B)]
    for step in range(STEPS + 1):
        training = step < STEPS
        batch = {"x": global_csr(rng, 8 if training else V), "y": global_csr(rng, 8 if training else V)}
        outs = coll.lookup({k: rows_of(v, r0, r1) for k, v in batch.items()}, training)
        tag = f"step{step}" if training else "eval"
        for (name, _), o in zip(coll.tops(B), outs):
            saved[f"{prefix}_{tag}_{name}"] = comm.allgather_rows(np.ascontiguousarray(device.to_host(o)))
        if training:
            dys = [rng.normal(size=(B, 1, w)).astype(np.float32) for w in widths]
            coll.hold_gradients([device.xp().asarray(d[r0:r1]) for d in dys])
            coll.update(0.05, 1.0)
    for t in coll.tables:
        keys, vecs = t.local_rows()
        keys, vecs = comm.allgather_rows(keys), comm.allgather_rows(np.ascontiguousarray(vecs))
        order = np.argsort(keys, kind="stable")
        saved[f"{prefix}_{t.name}_keys"], saved[f"{prefix}_{t.name}_rows"] = keys[order], vecs[order]


def main():
    comm = world()
    saved = {}
    run(comm, saved, "grouped")
    C.GROUP_TABLES = False
    run(comm, saved, "separate")
    if comm.rank == 0:
        np.savez(sys.argv[1], **saved)


if __name__ == "__main__":
    main()
