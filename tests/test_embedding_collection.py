"""EmbeddingCollection (numbactr/embedding/collection.py) on one rank: lookups against a NumPy reference,
one fused update per table, dynamic tables that grow, training equal to the SparseEmbedding model it
mirrors, the samples/ftrl DLRM shape on DataGenerator Parquet data, embedding_dump/embedding_load, and
clear errors for bad configurations and inputs."""

import json
import os
import struct

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.data.errors import DataFormatError
from numbactr.distributed.comm import world
from numbactr.embedding import collection as C
from numbactr.embedding import collection_plan, collection_tables
from numbactr.kernels import embedding_init as EI
from numbactr.model import ModelError
from numbactr.tools import DataGenerator, DataGeneratorParams
from tests.model_util import tiny_data

O, U, L = hugectr.Optimizer_t, hugectr.Update_t, hugectr.Layer_t
SGD = dict(optimizer_type=O.SGD, update_type=U.Local)


@pytest.fixture(autouse=True)
def cpu_device():
    """The cpu device (compiled CPU ops): the model tests would take minutes in the simulator; the first test
    also runs its tiny lookup there (the engine's numba.cuda kernels)."""
    device.set_device("cpu")


def sparse_param(name, hot):
    return hugectr.DataReaderSparseParam(name, hot, False, 1)


def collection(cfg, params, opt=SGD, seed=3):
    return C.EmbeddingCollection(cfg, 0, {p.top_name: p for p in params}, hugectr.CreateOptimizer(**opt), seed, world())


def csr(rng, batch, hot, vocab, empty=True):
    lens = rng.integers(0 if empty else 1, hot + 1, batch)
    keys = rng.integers(0, vocab, int(lens.sum())).astype(np.int64)
    return keys, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def pooled_ref(table, keys, offsets, combiner, hot):
    """NumPy reference of one lookup: (B, width)."""
    B, D = offsets.shape[0] - 1, table.shape[1]
    out = np.zeros((B, hot * D if combiner == "concat" else D), np.float32)
    for b in range(B):
        v = table[keys[offsets[b] : offsets[b + 1]]]
        if combiner == "concat":
            out[b, : v.size] = v.reshape(-1)
        elif v.shape[0]:
            out[b] = v.sum(0) / (v.shape[0] if combiner in ("average", "mean") else 1)
    return out


def host(a):
    return np.asarray(device.to_host(a))


# ---- lookups and the fused update ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["cpu", "sim"])
def test_static_lookups_and_one_update_per_shared_table(kind):
    """Three lookups, two reading one static table with different combiners, multi-hot with empty samples:
    every top equals the NumPy reference; one SGD step moves each row by -lr * (sum of all lookups'
    gradients of the row), i.e. the shared table takes ONE update."""
    if kind == "sim" and not device._numba_simulated():
        pytest.skip("needs the simulator")
    device.set_device(kind)
    rng = np.random.default_rng(0)
    B, D, V = 6, 4, 9
    ta = hugectr.EmbeddingTableConfig("a", V, D)
    tb = hugectr.EmbeddingTableConfig("b", 5, 3)
    cfg = hugectr.EmbeddingCollectionConfig()
    cfg.embedding_lookup(ta, "x", "sum_a", "sum")
    cfg.embedding_lookup(ta, "y", "avg_a", "average")
    cfg.embedding_lookup(tb, "y", "cat_b", "concat")
    coll = collection(cfg, [sparse_param("x", 3), sparse_param("y", 2)])
    inputs = {"x": csr(rng, B, 3, V), "y": csr(rng, B, 2, 5)}
    a0, b0 = host(coll.table("a").weight).copy(), host(coll.table("b").weight).copy()
    bound = np.sqrt(1 / V)
    assert (np.abs(a0) <= bound).all() and a0.std() > bound / 4  # HugeCTR's static init range
    outs = dict(zip([n for n, _ in coll.tops(B)], coll.lookup(inputs, training=True)))
    assert [s for _, s in coll.tops(B)] == [(B, 1, D), (B, 1, D), (B, 1, 2 * 3)]
    np.testing.assert_allclose(host(outs["sum_a"])[:, 0], pooled_ref(a0, *inputs["x"], "sum", 3), rtol=1e-6)
    np.testing.assert_allclose(host(outs["avg_a"])[:, 0], pooled_ref(a0, *inputs["y"], "average", 2), rtol=1e-6)
    np.testing.assert_allclose(host(outs["cat_b"])[:, 0], pooled_ref(b0, *inputs["y"], "concat", 2), rtol=1e-6)

    dys = [rng.normal(size=(B, 1, w)).astype(np.float32) for w in (D, D, 6)]
    coll.hold_gradients([device.xp().asarray(d) for d in dys])
    lr = 0.5
    coll.update(lr, 1.0)
    want_a, want_b = a0.copy(), b0.copy()
    for b in range(B):
        kx, ky = (inputs[n][0][inputs[n][1][b] : inputs[n][1][b + 1]] for n in ("x", "y"))
        for k in kx:
            want_a[k] -= lr * dys[0][b, 0]
        for k in ky:
            want_a[k] -= lr * dys[1][b, 0] / len(ky)
        for j, k in enumerate(ky):
            want_b[k] -= lr * dys[2][b, 0, j * 3 : (j + 1) * 3]
    np.testing.assert_allclose(host(coll.table("a").weight), want_a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(host(coll.table("b").weight), want_b, rtol=1e-5, atol=1e-6)
    assert coll.table("a").engine.step == 1 and coll.table("b").engine.step == 1


def test_batch_major_list_form():
    """embedding_lookup([tables], [bottoms], top, [combiners]): one (B, sum of widths) top, the lookups side by
    side, their gradients split back."""
    rng = np.random.default_rng(1)
    B = 5
    t1, t2 = hugectr.EmbeddingTableConfig("t1", 7, 2), hugectr.EmbeddingTableConfig("t2", 4, 3)
    cfg = hugectr.EmbeddingCollectionConfig()
    cfg.embedding_lookup([t1, t2], ["x", "y"], "emb", ["sum", "concat"])
    coll = collection(cfg, [sparse_param("x", 2), sparse_param("y", 2)])
    assert coll.tops(B) == [("emb", (B, 2 + 6))]
    inputs = {"x": csr(rng, B, 2, 7), "y": csr(rng, B, 2, 4)}
    w1, w2 = host(coll.table("t1").weight).copy(), host(coll.table("t2").weight).copy()
    (out,) = coll.lookup(inputs, training=True)
    want = np.concatenate([pooled_ref(w1, *inputs["x"], "sum", 2), pooled_ref(w2, *inputs["y"], "concat", 2)], 1)
    np.testing.assert_allclose(host(out), want, rtol=1e-6)
    dy = np.zeros((B, 8), np.float32)
    dy[:, :2] = 1.0  # only t1's part has a gradient
    coll.hold_gradients([device.xp().asarray(dy)])
    coll.update(0.1, 1.0)
    np.testing.assert_array_equal(host(coll.table("t2").weight), w2)
    assert not np.array_equal(host(coll.table("t1").weight), w1)


def test_dynamic_table_inserts_grows_and_evaluates(monkeypatch):
    """max_vocabulary_size=-1: any 64-bit key; rows grow past the first size (rows, states and steps kept:
    the result equals a table that never grew); evaluation does not insert, an unseen key adds zero but counts
    in an average's length."""
    monkeypatch.setattr(collection_tables, "DYNAMIC_START_ROWS", 4)
    rng = np.random.default_rng(2)
    B, D = 8, 4
    adam = dict(optimizer_type=O.Adam, update_type=U.Global)

    def build():
        t = hugectr.EmbeddingTableConfig("dyn", -1, D)
        cfg = hugectr.EmbeddingCollectionConfig()
        cfg.embedding_lookup(t, "x", "s", "sum")
        cfg.embedding_lookup(t, "x", "m", "mean")
        return collection(cfg, [sparse_param("x", 3)], opt=adam)

    small = build()
    monkeypatch.setattr(collection_tables, "DYNAMIC_START_ROWS", 4096)
    big = build()
    batches = []
    for step in range(4):
        keys, off = csr(rng, B, 3, 40, empty=False)
        keys = keys * (1 << 40) + 7  # keys far beyond 32 bits
        batches.append({"x": (keys, off)})
        dys = [device.xp().asarray(rng.normal(size=(B, 1, D)).astype(np.float32)) for _ in range(2)]
        outs = []
        for coll in (small, big):
            outs.append([host(o) for o in coll.lookup(batches[-1], training=True)])
            coll.hold_gradients(dys)
            coll.update(0.05, 1.0)
        for a, b in zip(*outs):
            np.testing.assert_array_equal(a, b)
    assert int(small.table("dyn").engine.rows[0]) > 4  # it grew
    ks, vs = small.table("dyn").local_rows()
    kb, vb = big.table("dyn").local_rows()
    np.testing.assert_array_equal(ks, kb)
    np.testing.assert_array_equal(vs, vb)
    states = [t.engine.split_optimizer_states()[0] for t in (small.table("dyn"), big.table("dyn"))]
    for a, b in zip(*states):
        np.testing.assert_array_equal(host(a)[: len(ks)], host(b)[: len(kb)])
    # evaluation: one seen key and one never-seen key in a bag
    seen = int(ks[0])
    before = small.table("dyn").engine.hash_tables[0].size
    keys = np.array([seen, 12345], np.int64)
    s, m = small.lookup({"x": (keys, np.array([0, 2, 2, 2, 2, 2, 2, 2, 2]))}, training=False)
    assert small.table("dyn").engine.hash_tables[0].size == before
    np.testing.assert_allclose(host(s)[0, 0], vs[0], rtol=1e-6)
    np.testing.assert_allclose(host(m)[0, 0], vs[0] / 2, rtol=1e-6)
    assert not host(s)[1:].any()


# ---- models ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def norm_data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("ebc")), n_train=192, n_eval=64, slots=3, keys_per_slot=6)


def solver(**kw):
    args = dict(
        batchsize=32,
        batchsize_eval=32,
        max_eval_batches=2,
        lr=0.05,
        vvgpu=[[0]],
        i64_input_key=True,
        use_embedding_collection=True,
        seed=11,
    )
    args.update(kw)
    return hugectr.CreateSolver(**args)


def norm_reader(data):
    return hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=[data[0]],
        eval_source=data[1],
        check_type=hugectr.Check_t.Sum,
    )


def dense_head(model, bottom):
    model.add(hugectr.DenseLayer(layer_type=L.Reshape, bottom_names=[bottom], top_names=["flat"], leading_dim=12))
    model.add(hugectr.DenseLayer(layer_type=L.Concat, bottom_names=["flat", "dense"], top_names=["x"]))
    model.add(hugectr.DenseLayer(layer_type=L.InnerProduct, bottom_names=["x"], top_names=["fc1"], num_output=8))
    model.add(hugectr.DenseLayer(layer_type=L.ReLU, bottom_names=["fc1"], top_names=["r1"]))
    model.add(hugectr.DenseLayer(layer_type=L.InnerProduct, bottom_names=["r1"], top_names=["fc2"], num_output=1))
    model.add(
        hugectr.DenseLayer(layer_type=L.BinaryCrossEntropyLoss, bottom_names=["fc2", "label"], top_names=["loss"])
    )


def ebc_model(data, opt, table="t", vocab=-1, sol=None):
    m = hugectr.Model(sol or solver(), norm_reader(data), hugectr.CreateOptimizer(**opt))
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam(f"s{i}", 1, True, 1) for i in range(3)],
        )
    )
    t = hugectr.EmbeddingTableConfig(table, vocab, 4)
    cfg = hugectr.EmbeddingCollectionConfig(use_exclusive_keys=True)
    for i in range(3):
        cfg.embedding_lookup(t, f"s{i}", f"e{i}", "sum")
    m.add(cfg)
    m.add(hugectr.DenseLayer(layer_type=L.Concat, bottom_names=["e0", "e1", "e2"], top_names=["emb"]))
    dense_head(m, "emb")
    m.compile()
    return m


@pytest.mark.parametrize("opt", [SGD, dict(optimizer_type=O.Adam, update_type=U.Local)], ids=["sgd", "adam"])
def test_training_equals_sparse_embedding(norm_data, opt):
    """A dynamic table read by three sum lookups (Concat -> (B, 3, D)) trains as the Distributed hash
    SparseEmbedding of one 3-slot input, from the same starting vectors: same losses, dense weights, rows."""
    se = hugectr.Model(solver(use_embedding_collection=False), norm_reader(norm_data), hugectr.CreateOptimizer(**opt))
    se.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data", 1, True, 3)],
        )
    )
    se.add(hugectr.SparseEmbedding(hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, 4, "sum", "emb", "data"))
    dense_head(se, "emb")
    se.compile()
    eb = ebc_model(norm_data, opt)
    # the SparseEmbedding's key k starts from the hash of (seed, k): give the dynamic table the same rows
    keys = np.arange(18, dtype=np.uint64)
    folder = os.path.join(os.path.dirname(os.path.dirname(norm_data[0])), "start")
    os.makedirs(os.path.join(folder, "t"), exist_ok=True)
    keys.astype("<i8").tofile(os.path.join(folder, "t", "key"))
    EI.row_values_ref(keys, 4, 11, -0.05, 0.05).astype("<f4").tofile(os.path.join(folder, "t", "emb_vector"))
    eb.embedding_load(folder)
    for _ in range(8):
        se.train()
        eb.train()
        np.testing.assert_allclose(eb.get_current_loss(), se.get_current_loss(), rtol=1e-6)
    np.testing.assert_allclose(host(eb.weights), host(se.weights), rtol=1e-5, atol=1e-7)
    k_se, v_se = se.embeddings[0].dump()
    k_eb, v_eb = eb.collections[0].table("t").local_rows()
    order = np.argsort(k_se)
    np.testing.assert_allclose(
        v_eb[np.searchsorted(k_eb.view(np.uint64), k_se[order])], v_se[order], rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(
        eb.check_out_tensor("emb", hugectr.Tensor_t.Train),
        se.check_out_tensor("emb", hugectr.Tensor_t.Train),
        rtol=1e-6,
    )


def hugectr_files(folder, c=0):
    """{name: bytes} of one collection's folder in HugeCTR's dump layout."""
    d = os.path.join(folder, f"embedding_collection_{c}")
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def parse_key_file(data, kind, table_id, dtype):
    head = np.frombuffer(data[:128], "<i4")
    assert head[0] == kind and head[1] == table_id and not head[2:].any()
    return np.frombuffer(data[128:], dtype)


def write_hugectr_dump(folder, keys, vecs, key_type=0, table_id=0, ev=4, n_meta=None, heads=(1, 2)):
    """A dump as HugeCTR v23.08 writes one (parameter_IO.cpp), built here byte by byte: no manifest."""
    d = os.path.join(folder, "embedding_collection_0")
    os.makedirs(d, exist_ok=True)
    n = len(keys) if n_meta is None else n_meta
    with open(os.path.join(d, "meta_data"), "wb") as f:
        f.write(
            struct.pack("<5i", 1, key_type, 0, 0, 0)
            + struct.pack("<i", table_id)
            + struct.pack("<Q", n)
            + struct.pack("<i", ev)
        )
    kfmt = "<%d%s" % (len(keys), "I" if key_type == 0 else "q")
    for name, head, body in (
        (f"key{table_id}", heads[0], struct.pack(kfmt, *keys)),
        (f"weight{table_id}", heads[1], np.asarray(vecs, "<f4").tobytes()),
    ):
        with open(os.path.join(d, name), "wb") as f:
            f.write(struct.pack("<2i", head, table_id) + bytes(120) + body)


def test_load_reads_a_hugectr_dump_and_says_what_is_wrong_with_a_bad_one(norm_data, tmp_path):
    """HugeCTR's files, written as HugeCTR writes them (uint32 keys in its table order, no manifest), load into
    a dynamic table; a dump that does not fit the model or is damaged fails with the file and the reason, and
    changes nothing."""
    m = ebc_model(norm_data, SGD)
    keys = [7, 3, 4000000000]  # uint32 keys, not sorted (a hash table's order)
    vecs = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    write_hugectr_dump(tmp_path / "ok", keys, vecs)
    m.embedding_load(str(tmp_path / "ok"))
    got_keys, got = m.collections[0].table("t").local_rows()
    for k, v in zip(keys, vecs):
        np.testing.assert_array_equal(got[list(got_keys).index(k)], v)

    before = m.collections[0].table("t").local_rows()
    bad = {
        "ev": (dict(ev=8), "ev_size 8"),
        "id": (dict(table_id=3), "lists table ids \\[3\\]"),
        "count": (dict(n_meta=5), "meta_data says 5 keys"),
        "head": (dict(heads=(2, 2)), "not a HugeCTR key file"),
        "dup": (dict(keys=[7, 7, 9]), "appears twice"),
    }
    for name, (kw, match) in bad.items():
        args = dict(keys=keys, vecs=vecs)
        args.update(kw)
        write_hugectr_dump(tmp_path / name, **args)
        with pytest.raises(DataFormatError, match=match):
            m.embedding_load(str(tmp_path / name))
    with pytest.raises(FileNotFoundError, match="holds no dump"):
        m.embedding_load(str(tmp_path))
    after = m.collections[0].table("t").local_rows()
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])


def test_dump_of_a_uint32_model_writes_uint32_keys(norm_data, tmp_path):
    """i64_input_key=False: meta_data's key type is 0 and key0 holds uint32 keys (HugeCTR's key_t); a
    HugeCTR dump loaded and dumped again comes back with its keys sorted and their vectors."""
    m = ebc_model(norm_data, SGD, sol=solver(i64_input_key=False))
    keys = [7, 3, 4000000000]
    vecs = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    write_hugectr_dump(tmp_path / "in", keys, vecs)
    m.embedding_load(str(tmp_path / "in"))
    m.embedding_dump(str(tmp_path / "d"))
    files = hugectr_files(tmp_path / "d")
    assert files["meta_data"] == struct.pack("<5i", 1, 0, 0, 0, 0) + struct.pack("<iQi", 0, 3, 4)
    np.testing.assert_array_equal(parse_key_file(files["key0"], 1, 0, "<u4"), [3, 7, 4000000000])
    np.testing.assert_array_equal(parse_key_file(files["weight0"], 2, 0, "<f4").reshape(3, 4), vecs[[1, 0, 2]])


def test_dump_load_round_trip_and_files(norm_data, tmp_path):
    """embedding_dump writes HugeCTR's layout (embedding_collection_0/meta_data, key0, weight0: ascending
    keys) with a manifest; a fresh model that loads them evaluates as the trained one; table_names selects;
    damaged files fail before any change."""
    m = ebc_model(norm_data, SGD, vocab=18)
    for _ in range(5):
        m.train()
    m.embedding_dump(str(tmp_path / "d"))
    files = hugectr_files(tmp_path / "d")
    assert sorted(files) == ["key0", "meta_data", "weight0"]
    # meta_data: [1 table, key type 1 (int64: i64_input_key), value type 0, 0, 0], id 0, 18 keys, ev_size 4
    assert files["meta_data"] == struct.pack("<5i", 1, 1, 0, 0, 0) + struct.pack("<i", 0) + struct.pack(
        "<Q", 18
    ) + struct.pack("<i", 4)
    keys = parse_key_file(files["key0"], 1, 0, "<i8")
    np.testing.assert_array_equal(keys, np.arange(18))
    vec = parse_key_file(files["weight0"], 2, 0, "<f4").reshape(18, 4)
    np.testing.assert_array_equal(vec, host(m.collections[0].table("t").weight))
    assert (tmp_path / "d" / "embedding_collection_0.manifest.json").exists()

    fresh = ebc_model(norm_data, SGD, vocab=18)
    fresh.weights[...] = m.weights  # the dense part; the tables come from the dump
    assert not np.array_equal(host(fresh.collections[0].table("t").weight), vec)
    fresh.embedding_load(str(tmp_path / "d"), ["t"])
    np.testing.assert_array_equal(host(fresh.collections[0].table("t").weight), vec)
    m.eval()
    fresh.eval()
    np.testing.assert_array_equal(
        fresh.check_out_tensor("fc2", hugectr.Tensor_t.Evaluate), m.check_out_tensor("fc2", hugectr.Tensor_t.Evaluate)
    )

    with pytest.raises(ValueError, match="no table named"):
        fresh.embedding_load(str(tmp_path / "d"), ["nope"])
    wpath = tmp_path / "d" / "embedding_collection_0" / "weight0"
    raw = bytearray(wpath.read_bytes())
    raw[130] ^= 1
    wpath.write_bytes(bytes(raw))
    fresh.collections[0].table("t").weight[...] = 0
    with pytest.raises(DataFormatError, match="sha256"):
        fresh.embedding_load(str(tmp_path / "d"))
    assert not host(fresh.collections[0].table("t").weight).any()  # nothing changed

    # save_params_to_files: the dense files and the tables beside them
    m.save_params_to_files(str(tmp_path / "snap"), 5)
    assert (tmp_path / "snap_dense_5.model").exists()
    np.testing.assert_array_equal(
        parse_key_file(hugectr_files(tmp_path / "snap_embedding_collection_5")["weight0"], 2, 0, "<f4"), vec.reshape(-1)
    )
    # graph JSON: as HugeCTR's writer, the Data layer and the dense layers, no entry for the collection
    m.graph_to_json(str(tmp_path / "g.json"))
    with open(tmp_path / "g.json") as f:
        layers = json.load(f)["layers"]
    assert [x["type"] for x in layers][:3] == ["Data", "Concat", "Reshape"]
    assert layers[1]["bottom"] == ["e0", "e1", "e2"]
    assert [s["slot_num"] for s in layers[0]["sparse"]] == [1, 1, 1]


def test_dynamic_dump_load(norm_data, tmp_path):
    m = ebc_model(norm_data, SGD)
    for _ in range(3):
        m.train()
    m.embedding_dump(str(tmp_path / "d"))
    k, v = m.collections[0].table("t").local_rows()
    fresh = ebc_model(norm_data, SGD)
    fresh.embedding_load(str(tmp_path / "d"))
    k2, v2 = fresh.collections[0].table("t").local_rows()
    order, order2 = np.argsort(k), np.argsort(k2)
    np.testing.assert_array_equal(k[order], k2[order2])
    np.testing.assert_array_equal(v[order], v2[order2])


def test_ftrl_sample_dlrm_shape_on_parquet(tmp_path):
    """samples/ftrl/dlrm_train_ftrl.py's graph, scaled down: 26 Parquet features of one key each, 26 static
    tables (one per feature, sized by the generator's slot sizes), sum lookups, Concat -> (B, 26, D),
    Interaction with the bottom MLP, BCE; trains and evaluates."""
    sizes = [3 + i for i in range(26)]
    p = DataGeneratorParams(
        hugectr.DataReaderType_t.Parquet,
        1,
        13,
        26,
        True,
        str(tmp_path / "pq" / "_file_list.txt"),
        str(tmp_path / "pq" / "_file_list_eval.txt"),
        sizes,
        num_files=1,
        eval_num_files=1,
        num_samples_per_file=256,
        seed=0,
    )
    DataGenerator(p).generate()
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Parquet,
        source=[p.source],
        eval_source=p.eval_source,
        check_type=hugectr.Check_t.Non,
    )
    m = hugectr.Model(
        solver(batchsize=64, batchsize_eval=64, metrics_spec={hugectr.MetricsType.AverageLoss: 0.0}),
        reader,
        hugectr.CreateOptimizer(optimizer_type=O.SGD, update_type=U.Local, atomic_update=True),
    )
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=13,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam(f"data{i}", 1, False, 1) for i in range(26)],
        )
    )
    tables = [hugectr.EmbeddingTableConfig(name=str(i), max_vocabulary_size=sizes[i], ev_size=8) for i in range(26)]
    cfg = hugectr.EmbeddingCollectionConfig(use_exclusive_keys=True)
    for i in range(26):
        cfg.embedding_lookup(table_config=tables[i], bottom_name=f"data{i}", top_name=f"emb_vec{i}", combiner="sum")
    cfg.shard(shard_matrix=[[str(i) for i in range(26)]], shard_strategy=[("mp", [str(i) for i in range(26)])])
    m.add(cfg)
    m.add(
        hugectr.DenseLayer(
            layer_type=L.Concat, bottom_names=[f"emb_vec{i}" for i in range(26)], top_names=["sparse_embedding1"]
        )
    )
    m.add(hugectr.DenseLayer(layer_type=L.InnerProduct, bottom_names=["dense"], top_names=["fc1"], num_output=8))
    m.add(hugectr.DenseLayer(layer_type=L.ReLU, bottom_names=["fc1"], top_names=["relu1"]))
    m.add(
        hugectr.DenseLayer(
            layer_type=L.Interaction, bottom_names=["relu1", "sparse_embedding1"], top_names=["interaction1"]
        )
    )
    m.add(hugectr.DenseLayer(layer_type=L.InnerProduct, bottom_names=["interaction1"], top_names=["fc8"], num_output=1))
    m.add(hugectr.DenseLayer(layer_type=L.BinaryCrossEntropyLoss, bottom_names=["fc8", "label"], top_names=["loss"]))
    m.graph_to_json(str(tmp_path / "dlrm.json"))  # before compile, as HugeCTR's dgx_a100 scripts do
    m.compile()
    assert m.shapes["sparse_embedding1"] == (64, 26, 8)
    before = host(m.collections[0].table("0").weight).copy()
    m.fit(max_iter=6, display=3, eval_interval=6, snapshot=1000000, snapshot_prefix=str(tmp_path / "dlrm"))
    assert np.isfinite(m.get_current_loss())
    assert not np.array_equal(host(m.collections[0].table("0").weight), before)
    assert m.eval()
    assert np.isfinite(dict(m.get_eval_metrics())["AverageLoss"])


# ---- errors ------------------------------------------------------------------------------------------
def test_config_errors():
    t = hugectr.EmbeddingTableConfig("t", 10, 4)
    cfg = hugectr.EmbeddingCollectionConfig()
    with pytest.raises(ValueError, match="combiner 'max' is not supported"):
        cfg.embedding_lookup(t, "x", "e", "max")
    with pytest.raises(ValueError, match="max_vocabulary_size must be -1"):
        hugectr.EmbeddingTableConfig("u", 0, 4)
    with pytest.raises(ValueError, match="ev_size must be"):
        hugectr.EmbeddingTableConfig("u", 5, 0)
    with pytest.raises(ValueError, match="name must be"):
        hugectr.EmbeddingTableConfig("a/b", 5, 4)
    cfg.embedding_lookup(t, "x", "e", "sum")
    with pytest.raises(ValueError, match="two different tables are named 't'"):
        cfg.embedding_lookup(hugectr.EmbeddingTableConfig("t", 11, 4), "x", "f", "sum")
    with pytest.raises(ValueError, match="already a lookup's top"):
        cfg.embedding_lookup(t, "x", "e", "sum")
    with pytest.raises(ValueError, match="only embedding_lookup call"):
        cfg.embedding_lookup([t], ["x"], "g", ["sum"])


def test_a_shard_matrix_for_more_gpus_than_ranks_folds_onto_the_ranks():
    # HugeCTR's scripts shard over every GPU one process drives (8 rows on one node); numbactr runs one GPU
    # per rank, so GPU g's tables go to rank g * R // G (here all to rank 0), with a warning
    cfg = hugectr.EmbeddingCollectionConfig()
    cfg.embedding_lookup(hugectr.EmbeddingTableConfig("t", 10, 4), "x", "e", "sum")
    cfg.embedding_lookup(hugectr.EmbeddingTableConfig("u", 10, 4), "y", "f", "sum")
    cfg.shard([["t"], [], ["u"], ["u"]], [("mp", ["t"]), ("dp", ["u"])])
    with pytest.warns(
        hugectr.IgnoredArgumentWarning,
        match="shard_matrix rows=4 is ignored: numbactr runs one GPU per rank: this job has 1 rank",
    ):
        c = collection(cfg, [sparse_param("x", 1), sparse_param("y", 1)])
    assert collection_plan.placement(c.cfg, c.comm, c.name, {"t": None, "u": None}) == {
        "t": ("mp", [0]),
        "u": ("dp", [0]),
    }


@pytest.mark.parametrize(
    "matrix,strategy,match",
    [
        ([["t", "zz"]], [("mp", ["t"])], "names table 'zz'"),
        ([["t"]], [("mp", ["t", "zz"])], "shard_strategy names table 'zz'"),
        ([["t"]], [("xp", ["t"])], "kind 'xp'"),
        ([[]], [("mp", ["t"])], "table 't' is on no rank"),
        ([["t"]], [], r"tables \['t'\] are in no shard_strategy"),
        ([["t"]], [("mp", ["t"]), ("dp", ["t"])], "appears twice"),
    ],
)
def test_shard_errors(matrix, strategy, match):
    cfg = hugectr.EmbeddingCollectionConfig()
    cfg.embedding_lookup(hugectr.EmbeddingTableConfig("t", 10, 4), "x", "e", "sum")
    cfg.shard(matrix, strategy)
    with pytest.raises(ValueError, match=match):
        collection(cfg, [sparse_param("x", 1)])


def test_model_errors(norm_data):
    def start(sol=None):
        m = hugectr.Model(sol or solver(), norm_reader(norm_data), hugectr.CreateOptimizer(**SGD))
        m.add(
            hugectr.Input(
                label_dim=1,
                label_name="label",
                dense_dim=2,
                dense_name="dense",
                data_reader_sparse_param_array=[
                    hugectr.DataReaderSparseParam("s0", 1, True, 1),
                    hugectr.DataReaderSparseParam("multi", 1, True, 2),
                ],
            )
        )
        return m

    def one(bottom="s0", name="t", vocab=6):
        cfg = hugectr.EmbeddingCollectionConfig()
        cfg.embedding_lookup(hugectr.EmbeddingTableConfig(name, vocab, 4), bottom, f"e_{name}", "sum")
        return cfg

    with pytest.raises(ModelError, match="use_embedding_collection=True"):
        start(solver(use_embedding_collection=False)).add(one())
    with pytest.raises(ModelError, match="reads bottom_name 'nope', which is not a sparse input"):
        start().add(one("nope"))
    with pytest.raises(ModelError, match="slot_num=2"):
        start().add(one("multi"))
    m = start()
    m.add(one())
    with pytest.raises(ModelError, match=r"table name\(s\) \['t'\] are already"):
        m.add(one())
    # a static table given keys beyond its rows: the keys of s0 are 0..5, its table holds 3 rows
    m = start()
    m.add(one(vocab=3))
    m.add(hugectr.DenseLayer(layer_type=L.Reshape, bottom_names=["e_t"], top_names=["f"], leading_dim=4))
    m.add(hugectr.DenseLayer(layer_type=L.InnerProduct, bottom_names=["f"], top_names=["fc"], num_output=1))
    m.add(hugectr.DenseLayer(layer_type=L.BinaryCrossEntropyLoss, bottom_names=["fc", "label"], top_names=["loss"]))
    m.compile()
    with pytest.raises(ValueError, match=r"outside static table 't'.s rows \[0, 3\)"):
        for _ in range(6):
            m.train()
