"""An EmbeddingCollection on R ranks; rank 0 saves what tests/test_embedding_collection_mpi.py compares with R = 1.

    mpiexec -n R python tests/mpi/ebc_run.py OUT.npz TRAIN_LIST EVAL_LIST

Part 1, the collection alone: every rank builds the same global multi-hot batches (empty bags included) and
dLoss/dtop, takes its contiguous rows, and runs lookup -> gradients -> update over three tables: "a" static,
model parallel on rank 0 only (sum and average lookups, the model's Adam Global); "b" dynamic, model parallel
over every rank, key % R (concat and sum lookups, its own SGD); "c" static, data parallel (average lookup,
the model's Adam). Evaluation looks up keys partly never seen. Saved: every step's tops (gathered over the
ranks), the evaluation tops, and every table's keys and rows (gathered from their owners, sorted by key).
Part 2, a Model on Norm files with the same placement: the losses of a few train() steps, an evaluation's
output, and the bytes of embedding_dump.
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
from numbactr.embedding.collection import EmbeddingCollection  # noqa: E402

O, U, L = hugectr.Optimizer_t, hugectr.Update_t, hugectr.Layer_t
B, STEPS, HOT = 12, 4, 3


def shard(cfg, comm):
    """a: rank 0 (mp); b: every rank (mp, row-wise); c: every rank (dp)."""
    rows = [["a", "b", "c"]] + [["b", "c"] for _ in range(comm.size - 1)]
    cfg.shard(rows, [("mp", ["a", "b"]), ("dp", ["c"])])


def config(vocab_a, vocab_c, bottoms):
    a = hugectr.EmbeddingTableConfig("a", vocab_a, 4)
    b = hugectr.EmbeddingTableConfig(
        "b", -1, 3, opt_params_or_empty=hugectr.CreateOptimizer(optimizer_type=O.SGD, update_type=U.Local)
    )
    c = hugectr.EmbeddingTableConfig("c", vocab_c, 4)
    cfg = hugectr.EmbeddingCollectionConfig()
    x, y = bottoms
    cfg.embedding_lookup(a, x, "a_sum", "sum")
    cfg.embedding_lookup(b, x, "b_cat", "concat")
    cfg.embedding_lookup(a, y, "a_avg", "average")
    cfg.embedding_lookup(b, y, "b_sum", "sum")
    cfg.embedding_lookup(c, y, "c_avg", "average")
    return cfg


def global_csr(rng, vocab, empty=True):
    lens = rng.integers(0 if empty else 1, HOT + 1, B)
    keys = rng.integers(0, vocab, int(lens.sum())).astype(np.int64)
    return keys, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def rows_of(csr, r0, r1):
    keys, off = csr
    return keys[off[r0] : off[r1]], off[r0 : r1 + 1] - off[r0]


def tables(comm, coll) -> dict:
    out = {}
    for t in coll.tables:
        keys, vecs = t.local_rows()
        keys, vecs = comm.allgather_rows(keys), comm.allgather_rows(np.ascontiguousarray(vecs))
        order = np.argsort(keys, kind="stable")
        out[f"{t.name}_keys"], out[f"{t.name}_rows"] = keys[order], vecs[order]
    return out


def part1(comm, saved):
    rng = np.random.default_rng(7)
    r0, r1 = rank_rows(B, comm.rank, comm.size)
    cfg = config(10, 8, ("x", "y"))
    shard(cfg, comm)
    params = {n: hugectr.DataReaderSparseParam(n, HOT, False, 1) for n in ("x", "y")}
    coll = EmbeddingCollection(
        cfg, 0, params, hugectr.CreateOptimizer(optimizer_type=O.Adam, update_type=U.Global), 5, comm
    )
    widths = [w for _, (_, _, w) in coll.tops(B)]
    for step in range(STEPS):
        batch = {"x": global_csr(rng, 7), "y": global_csr(rng, 8)}
        dys = [rng.normal(size=(B, 1, w)).astype(np.float32) for w in widths]
        outs = coll.lookup({k: rows_of(v, r0, r1) for k, v in batch.items()}, training=True)
        for (name, _), o in zip(coll.tops(B), outs):
            saved[f"p1_step{step}_{name}"] = comm.allgather_rows(np.ascontiguousarray(device.to_host(o)))
        coll.hold_gradients([device.xp().asarray(d[r0:r1]) for d in dys])
        coll.update(0.05, 1.0)
    batch = {"x": global_csr(rng, 10), "y": global_csr(rng, 8)}  # x keys 8, 9: never seen by "b"
    for (name, _), o in zip(coll.tops(B), coll.lookup({k: rows_of(v, r0, r1) for k, v in batch.items()}, False)):
        saved[f"p1_eval_{name}"] = comm.allgather_rows(np.ascontiguousarray(device.to_host(o)))
    saved.update({f"p1_{k}": v for k, v in tables(comm, coll).items()})


def part2(comm, saved, train, evl, dump):
    solver = hugectr.CreateSolver(
        batchsize=24,
        batchsize_eval=24,
        max_eval_batches=2,
        lr=0.05,
        vvgpu=[[0]],
        i64_input_key=True,
        use_embedding_collection=True,
        seed=3,
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[train], eval_source=evl, check_type=hugectr.Check_t.Sum
    )
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer(optimizer_type=O.Adam, update_type=U.Global))
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam(n, 1, True, 1) for n in ("s0", "s1", "s2")],
        )
    )
    cfg = config(18, 18, ("s0", "s2"))
    shard(cfg, comm)
    m.add(cfg)
    tops = ["a_sum", "b_cat", "a_avg", "b_sum", "c_avg"]
    m.add(hugectr.DenseLayer(layer_type=L.Concat, bottom_names=tops, top_names=["cat"], axis=2))
    m.add(hugectr.DenseLayer(layer_type=L.Reshape, bottom_names=["cat"], top_names=["flat"], leading_dim=18))
    m.add(hugectr.DenseLayer(layer_type=L.Concat, bottom_names=["flat", "dense"], top_names=["x"]))
    m.add(hugectr.DenseLayer(layer_type=L.InnerProduct, bottom_names=["x"], top_names=["fc"], num_output=1))
    m.add(hugectr.DenseLayer(layer_type=L.BinaryCrossEntropyLoss, bottom_names=["fc", "label"], top_names=["loss"]))
    m.compile()
    losses = []
    for _ in range(6):
        m.train()
        losses.append(m.get_current_loss())
    saved["p2_losses"] = np.array(losses)
    m.eval()
    saved["p2_eval"] = m.check_out_tensor("fc", hugectr.Tensor_t.Evaluate)
    m.embedding_dump(dump)
    if comm.rank == 0:  # HugeCTR's layout: key<id>, weight<id> (after 128 bytes)
        ids = {t.name: j for j, t in enumerate(m.collections[0].tables)}
        for t in ("a", "b", "c"):
            for f, name in (("key", "key"), ("emb_vector", "weight")):
                path = os.path.join(dump, "embedding_collection_0", f"{name}{ids[t]}")
                saved[f"p2_{t}_{f}"] = np.frombuffer(open(path, "rb").read()[128:], np.uint8)
    # every rank reads its keys back into a model trained one more step: the rows return to the dump's
    tables = {t.name: t.local_rows() for t in m.collections[0].tables}
    m.train()
    m.embedding_load(dump)
    for t in m.collections[0].tables:
        keys, rows = t.local_rows()
        want_keys, want_rows = tables[t.name]
        assert np.array_equal(np.sort(keys), np.sort(want_keys)), t.name
        assert np.array_equal(rows[np.argsort(keys)], want_rows[np.argsort(want_keys)]), t.name
    saved["p2_reloaded"] = np.ones(1)


def main():
    out, train, evl = sys.argv[1:4]
    comm = world()
    saved = {}
    part1(comm, saved)
    part2(comm, saved, train, evl, out + ".dump")
    if comm.rank == 0:
        np.savez(out, **saved)


if __name__ == "__main__":
    main()
