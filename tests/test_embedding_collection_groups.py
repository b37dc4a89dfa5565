"""EmbeddingCollection tables grouped into shared engines (numbactr/embedding/collection.py, _group_tables), and
Optimizer_t.Ftrl on collection tables.

Grouping: the tables of one placement and optimizer share one TableBatchedEmbedding; a grouped collection
gives the same tops, rows and optimizer states as the same collection with one engine per table
(collection.GROUP_TABLES = False), bit for bit, over steps in which dynamic tables grow at different times.
Ftrl: one step equals a float64 NumPy rendering of HugeCTR's rule on the touched rows."""

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.distributed.comm import world
from numbactr.embedding import collection as C
from numbactr.embedding import collection_tables

O, U = hugectr.Optimizer_t, hugectr.Update_t


@pytest.fixture(autouse=True)
def cpu_device():
    device.set_device("cpu")


def host(a):
    return np.asarray(device.to_host(a))


def csr(rng, batch, hot, vocab, empty=True):
    lens = rng.integers(0 if empty else 1, hot + 1, batch)
    keys = rng.integers(0, vocab, int(lens.sum())).astype(np.int64)
    return keys, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


HOT = {"x": 3, "y": 2, "z": 1}
VOCAB = 11


def mixed_config():
    """Static tables of widths 4 and 3 with the model's optimizer (sum / average: one pooled group), a static
    table read by a concat lookup, a static table with its own Adam, two dynamic tables (sum / average: one
    pooled dynamic group) and a dynamic Ftrl table with its own optimizer."""
    ftrl = hugectr.CreateOptimizer(optimizer_type=O.Ftrl, update_type=U.Global, beta=0.5, lambda1=0.01, lambda2=0.1)
    adam = hugectr.CreateOptimizer(optimizer_type=O.Adam, update_type=U.Global)
    t = {
        "s4": hugectr.EmbeddingTableConfig("s4", VOCAB, 4),
        "s3": hugectr.EmbeddingTableConfig("s3", VOCAB, 3),
        "cat": hugectr.EmbeddingTableConfig("cat", VOCAB, 4),
        "adam": hugectr.EmbeddingTableConfig("adam", VOCAB, 4, opt_params_or_empty=adam),
        "d1": hugectr.EmbeddingTableConfig("d1", -1, 4),
        "d2": hugectr.EmbeddingTableConfig("d2", -1, 2),
        "dftrl": hugectr.EmbeddingTableConfig("dftrl", -1, 3, opt_params_or_empty=ftrl),
    }
    cfg = hugectr.EmbeddingCollectionConfig()
    for table, bottom, top, comb in [
        ("s4", "x", "s4x", "sum"),
        ("d1", "x", "d1x", "sum"),
        ("s3", "y", "s3y", "mean"),
        ("s4", "y", "s4y", "average"),
        ("cat", "y", "caty", "concat"),
        ("adam", "z", "adamz", "sum"),
        ("d2", "y", "d2y", "average"),
        ("d1", "z", "d1z", "mean"),
        ("dftrl", "x", "fx", "sum"),
        ("dftrl", "y", "fy", "average"),
        ("s3", "x", "s3x", "sum"),
    ]:
        cfg.embedding_lookup(t[table], bottom, top, comb)
    return cfg


def build(cfg):
    """The model's optimizer: Adam Local (states to keep when a dynamic table grows)."""
    params = {n: hugectr.DataReaderSparseParam(n, h, False, 1) for n, h in HOT.items()}
    return C.EmbeddingCollection(
        cfg, 0, params, hugectr.CreateOptimizer(optimizer_type=O.Adam, update_type=U.Local), 7, world()
    )


def test_groups_share_engines():
    coll = build(mixed_config())
    groups = [sorted(t.name for t in g.tables) for g in coll.groups]
    assert sorted(groups) == sorted([["s3", "s4"], ["cat"], ["adam"], ["d1", "d2"], ["dftrl"]])
    assert coll.table("s4").engine is coll.table("s3").engine
    assert coll.table("d1").engine is coll.table("d2").engine
    assert coll.table("s4").engine is not coll.table("cat").engine
    eng = coll.table("s4").engine
    assert eng.n_features == 4 and len(eng.tables) == 2  # s4x, s3y, s4y, s3x on two tables
    # equal-sized dynamic tables in one engine still start from their own rows (a hash of their own seed)
    rng = np.random.default_rng(0)
    keys, off = csr(rng, 5, 1, VOCAB, empty=False)
    inputs = {"x": (keys, off), "y": (keys, off), "z": (keys, off)}
    outs = dict(zip([n for n, _ in coll.tops(5)], coll.lookup(inputs, training=True)))
    assert not np.array_equal(host(outs["d1x"])[:, 0, :2], host(outs["d2y"])[:, 0])


@pytest.mark.parametrize("steps", [5])
def test_grouped_equals_one_engine_per_table(monkeypatch, steps):
    """Every top (training and evaluation), every row and every optimizer state of the grouped collection
    equal those of the one-engine-per-table collection, bit for bit; the grouped dynamic tables start small
    and grow (each when it fills) while the separate ones never fill."""
    monkeypatch.setattr(collection_tables, "DYNAMIC_START_ROWS", 4)
    grouped = build(mixed_config())
    monkeypatch.setattr(collection_tables, "DYNAMIC_START_ROWS", 4096)
    monkeypatch.setattr(C, "GROUP_TABLES", False)
    separate = build(mixed_config())
    assert len(separate.groups) == len(separate.tables) == 7 and len(grouped.groups) == 5
    rng = np.random.default_rng(3)
    B = 9
    widths = [s[-1] for _, s in grouped.tops(B)]
    for step in range(steps + 1):
        training = step < steps
        vocab = min(VOCAB, 3 + 2 * step)  # more keys each step: the dynamic tables grow after updates
        inputs = {n: csr(rng, B, h, vocab) for n, h in HOT.items()}  # keys valid for the static tables too
        outs = [[host(o) for o in coll.lookup(inputs, training)] for coll in (grouped, separate)]
        for (name, _), a, b in zip(grouped.tops(B), *outs):
            np.testing.assert_array_equal(a, b, err_msg=f"step {step} top {name}")
        if training:
            dys = [device.xp().asarray(rng.normal(size=(B, 1, w)).astype(np.float32)) for w in widths]
            for coll in (grouped, separate):
                coll.hold_gradients(dys)
                coll.update(0.05, 2.0)
    assert int(grouped.table("dftrl").engine.rows[grouped.table("dftrl").index]) > 4  # they grew
    assert int(grouped.table("d1").engine.rows[grouped.table("d1").index]) > 4
    for t in grouped.tables:
        u = separate.table(t.name)
        k1, v1 = t.local_rows()
        k2, v2 = u.local_rows()
        np.testing.assert_array_equal(k1, k2, err_msg=t.name)
        np.testing.assert_array_equal(v1, v2, err_msg=t.name)
        n = k1.shape[0]
        for a, b in zip(t.engine.split_optimizer_states()[t.index], u.engine.split_optimizer_states()[u.index]):
            np.testing.assert_array_equal(host(a)[:n], host(b)[:n], err_msg=t.name)
        assert t.engine.step == u.engine.step == steps
    gf, sf = grouped.table("dftrl").group, separate.table("dftrl").group
    n = grouped.table("dftrl").local_rows()[0].shape[0]
    for a, b in zip(gf.ftrl_states[0], sf.ftrl_states[0]):
        assert host(a)[:n].any()
        np.testing.assert_array_equal(host(a)[:n], host(b)[:n])


def ftrl_ref(w, z, n, g, lr, beta, l1, l2):
    """HugeCTR's Ftrl on rows (float64): n' = n + g^2; z += g + (sqrt(n + e) - sqrt(n' + e)) w / lr;
    w = (l1 sign(z) - z) / (sqrt(n' + e) / lr + l2 + beta / lr) where |z| > l1, else 0."""
    e = 2.0**-23
    n2 = n + g * g
    z = z + g + (np.sqrt(n + e) - np.sqrt(n2 + e)) * w / lr
    w = np.where(np.abs(z) > l1, (l1 * np.where(z < 0, -1.0, 1.0) - z) / (np.sqrt(n2 + e) / lr + l2 + beta / lr), 0.0)
    return w, z, n2


def test_ftrl_equals_reference():
    """The model's Ftrl on a static table read by a sum and an average lookup (multi-hot, empty samples): two
    steps move exactly the touched rows as HugeCTR's rule with each row's summed gradient / scaler."""
    rng = np.random.default_rng(5)
    B, D, V = 7, 4, 30
    lr, scaler, beta, l1, l2 = 0.2, 4.0, 0.3, 0.002, 0.05
    t = hugectr.EmbeddingTableConfig("t", V, D)
    cfg = hugectr.EmbeddingCollectionConfig()
    cfg.embedding_lookup(t, "x", "s", "sum")
    cfg.embedding_lookup(t, "y", "m", "average")
    params = {n: hugectr.DataReaderSparseParam(n, 3, False, 1) for n in ("x", "y")}
    ftrl = hugectr.CreateOptimizer(optimizer_type=O.Ftrl, update_type=U.Global, beta=beta, lambda1=l1, lambda2=l2)
    coll = C.EmbeddingCollection(cfg, 0, params, ftrl, 1, world())
    w = host(coll.table("t").weight).astype(np.float64)
    z, n = np.zeros_like(w), np.zeros_like(w)
    for step in range(2):
        inputs = {"x": csr(rng, B, 3, V), "y": csr(rng, B, 3, V)}
        coll.lookup(inputs, training=True)
        dys = [rng.normal(size=(B, 1, D)).astype(np.float32) for _ in range(2)]
        coll.hold_gradients([device.xp().asarray(d) for d in dys])
        coll.update(lr, scaler)
        g = np.zeros_like(w)
        touched = np.zeros(V, bool)
        for (keys, off), dy, mean in zip((inputs["x"], inputs["y"]), dys, (False, True)):
            for b in range(B):
                ks = keys[off[b] : off[b + 1]]
                for k in ks:
                    g[k] += dy[b, 0] / (len(ks) if mean else 1)
                    touched[k] = True
        nw, nz, nn = ftrl_ref(w, z, n, g / scaler, lr, beta, l1, l2)
        w[touched], z[touched], n[touched] = nw[touched], nz[touched], nn[touched]
        assert 0 < touched.sum() < V  # untouched rows must stay
        np.testing.assert_allclose(host(coll.table("t").weight), w, rtol=2e-5, atol=1e-6)
        w = host(coll.table("t").weight).astype(np.float64)  # follow the float32 trajectory
    zs, ns = coll.table("t").group.ftrl_states[0]
    np.testing.assert_allclose(host(ns), n, rtol=1e-5, atol=1e-9)


def test_model_with_ftrl_tables(tmp_path):
    """samples/ftrl's choice of a model Ftrl without table optimizers: the tables train with Ftrl too (they
    share one engine), the loss stays finite and only touched rows move."""
    from tests.model_util import tiny_data

    train, evl = tiny_data(str(tmp_path), n_train=96, n_eval=32, slots=3, keys_per_slot=6)
    solver = hugectr.CreateSolver(
        batchsize=16,
        batchsize_eval=16,
        max_eval_batches=1,
        lr=0.1,
        vvgpu=[[0]],
        i64_input_key=True,
        use_embedding_collection=True,
        seed=2,
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[train], eval_source=evl, check_type=hugectr.Check_t.Sum
    )
    m = hugectr.Model(
        solver,
        reader,
        hugectr.CreateOptimizer(optimizer_type=O.Ftrl, update_type=U.Global, beta=0.1, lambda1=0.001, lambda2=0.01),
    )
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam(f"s{i}", 1, True, 1) for i in range(3)],
        )
    )
    cfg = hugectr.EmbeddingCollectionConfig()
    for i in range(3):
        cfg.embedding_lookup(hugectr.EmbeddingTableConfig(f"t{i}", 64, 4), f"s{i}", f"e{i}", "sum")
    m.add(cfg)
    L = hugectr.Layer_t
    m.add(hugectr.DenseLayer(layer_type=L.Concat, bottom_names=["e0", "e1", "e2"], top_names=["emb"]))
    m.add(hugectr.DenseLayer(layer_type=L.Reshape, bottom_names=["emb"], top_names=["flat"], leading_dim=12))
    m.add(hugectr.DenseLayer(layer_type=L.Concat, bottom_names=["flat", "dense"], top_names=["x"]))
    m.add(hugectr.DenseLayer(layer_type=L.InnerProduct, bottom_names=["x"], top_names=["fc"], num_output=1))
    m.add(hugectr.DenseLayer(layer_type=L.BinaryCrossEntropyLoss, bottom_names=["fc", "label"], top_names=["loss"]))
    m.compile()
    coll = m.collections[0]
    assert len(coll.groups) == 1 and coll.groups[0].ftrl == (0.1, 0.001, 0.01)
    before = [host(coll.table(f"t{i}").weight).copy() for i in range(3)]
    for _ in range(4):
        m.train()
    assert np.isfinite(m.get_current_loss())
    for i in range(3):
        w = host(coll.table(f"t{i}").weight)
        moved = (w != before[i]).any(axis=1)
        assert moved.any() and not moved.all()  # keys 0..5 of 64 rows: the rest untouched
        assert host(coll.groups[0].ftrl_states[i][1])[moved].min() > 0  # n = sum of g^2 on moved rows
