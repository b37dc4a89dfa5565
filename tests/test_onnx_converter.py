"""ONNX export (issue 12): a model trained with the HugeCTR API, saved, converted with HugeCTR's
``hugectr2onnx.converter.convert`` and run by onnxruntime predicts what numbactr's eval forward predicts
(sigmoid / softmax in place of the loss, as HugeCTR's inference) within 1e-5, for every layer type.

Layer types, by the graph that carries them (test_every_layer_type_is_covered checks the union is every
layer numbactr builds):
  dcn      Reshape, Concat, MultiCross (v1), InnerProduct, ReLU, Dropout, BinaryCrossEntropyLoss; multi-hot
           input (2 keys per slot, sum), HugeCTR's auto-Slice
  wdl      two embeddings, ReduceSum, Add
  deepfm   Slice, WeightMultiply, FmOrder2, ReduceSum, a 3-input Add
  gmf      ElementwiseMultiply
  din      Scale (axis 0 and 1), Sub, PReLU_Dice, Softmax, Reshape(shape=...)
  bst      SequenceMask, MultiHeadAttention (all three modes), masked Softmax, LayerNorm, ReduceMean,
           InnerProduct on 3-D input
  mmoe     two heads (two labels, two BinaryCrossEntropyLoss)
  dlrm     Interaction (hash and one-hot tables)
  mean     multi-hot slots with the mean combiner
  zoo      the rest: Reshape selected / time_step, 3-D Concat (both axes), FusedReshapeConcat(+General),
           Select, Gather, MatrixMultiply (3-D and 2-D x 3-D), BatchNorm (.ntp.json), ELU, Sigmoid, Cast,
           ReLUHalf, MLP, FusedInnerProduct (Head/Body/Tail), MultiCross v2, GRU (numbactr's and
           HugeCTR-exact layout), CrossEntropyLoss, MultiCrossEntropyLoss, a LocalizedSlot table with
           mean, a OneHot table
Batches: the model's eval batches, and ragged ones of another size with keys the tables do not hold
and empty bags (padded with -1).
"""

import json
import os

import numpy as np
import pytest

import numbactr as hugectr
from numbactr import hugectr_exact as compat
from numbactr.runtime import device
from numbactr.train import step as train_step
from numbactr.data.batch import Batch
from numbactr.onnx_converter import OnnxExportError, export, hugectr2onnx
from numbactr.onnx_converter.runtime import OnnxPredictor, onnxruntime_predictor, pad_bags
from tests import sample_graphs
from tests.model_util import tiny_data, tiny_dlrm

L = hugectr.Layer_t
ATOL = 1e-5


# ---- helpers ---------------------------------------------------------------------------------------
def save(m, folder, it=3):
    """graph JSON + snapshot files of a trained model: (graph, dense, [sparse folders])."""
    graph = os.path.join(folder, "graph.json")
    m.graph_to_json(graph)
    prefix = os.path.join(folder, "m")
    m.save_params_to_files(prefix, it)
    return graph, f"{prefix}_dense_{it}.model", [f"{prefix}{i}_sparse_{it}.model" for i in range(len(m.embeddings))]


def convert(m, folder, **kw):
    """Save m, convert with HugeCTR's interface, open it in onnxruntime."""
    graph, dense, sparse = save(m, folder)
    path = os.path.join(folder, "m.onnx")
    hugectr2onnx.converter.convert(path, graph, dense, True, sparse, **kw)
    return OnnxPredictor(path, threads=1)


def numbactr_predictions(m, batch) -> dict:
    """{label: (B, k)} of numbactr's eval forward: each loss layer's sigmoid / softmax."""
    train_step.forward(m, batch, False, None)
    return {layer.cfg.bottom_names[1]: np.asarray(device.to_host(layer.predictions())) for layer, _ in m.losses}


def assert_same(m, predictor, batch):
    want, got = numbactr_predictions(m, batch), predictor.predict_batch(batch)
    assert list(got) == [n for n in m.input.label_names if n in want]
    for name, p in want.items():
        assert got[name].shape == p.shape, name
        np.testing.assert_allclose(got[name], p, rtol=0, atol=ATOL, err_msg=name)


def eval_batches(m, n=2):
    reader = iter(m._make_reader(m.reader_params.eval_source, m.solver.batchsize_eval, False, eval=True))
    return [next(reader) for _ in range(n)]


def ragged_batch(m, rng, rows, unseen=True):
    """A batch of ``rows`` samples: per sparse input each bag 0..max nnz keys (1 for one-key slots), mostly
    keys the table holds, some it does not (hash tables)."""
    sparse = []
    for p in m.input.sparse:
        e = next(e for e in m.embeddings if e.cfg.bottom_name == p.top_name)
        known = e.dump()[0].astype(np.int64)
        width = max(p.nnz_per_slot)
        nnz = rng.integers(0 if width > 1 else 1, width + 1, rows * p.slot_num)
        keys = rng.choice(known, int(nnz.sum()))
        if e.table is None:  # a one-hot table takes per-slot keys (it adds the slot offsets)
            sizes = np.asarray(e.cfg.slot_size_array, np.int64)
            slot = np.repeat(np.arange(rows * p.slot_num) % p.slot_num, nnz)
            keys = rng.integers(0, sizes[slot])
        if unseen and e.table is not None:
            miss = rng.random(keys.shape[0]) < 0.2
            keys[miss] = 10**7 + rng.integers(0, 100, int(miss.sum()))
        sparse.append((keys, np.concatenate([[0], np.cumsum(nnz)]).astype(np.int64)))
    return Batch(
        np.zeros((rows, m.input.label_dim), np.float32),
        rng.normal(0, 1, (rows, m.input.dense_dim)).astype(np.float32),
        sparse,
    )


def mean_graph(data):
    m = sample_graphs._model(data, [("data1", 2, 3)], 3)
    sample_graphs.emb(m, "data1", "emb", 4, combiner="mean")
    sample_graphs.D(m, L.Reshape, ["emb"], ["flat"], leading_dim=8)
    sample_graphs.D(m, L.Concat, ["flat", "dense"], ["cat"])
    sample_graphs.D(m, L.InnerProduct, ["cat"], ["fc1"], num_output=1)
    sample_graphs.D(m, L.BinaryCrossEntropyLoss, ["fc1", "label"], ["loss"])
    m.compile()
    return m


def trained(name, folder):
    """A tiny model of graph ``name`` after a few training steps."""
    if name.startswith("dlrm"):
        tr, ev = tiny_data(folder, n_train=128, n_eval=64)
        emb = (
            hugectr.Embedding_t.LocalizedSlotSparseEmbeddingOneHot
            if name == "dlrm_onehot"
            else hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash
        )
        m = tiny_dlrm(tr, ev, batch=32, embedding=emb)
    elif name == "mean":
        m = mean_graph(sample_graphs.make_data(folder, [("data1", 2, 3)], dense=3))
    else:
        m = sample_graphs.build(name, folder)
    for _ in range(4):
        assert m.train()
    return m


TRAINED = sorted(sample_graphs.GRAPHS) + ["dlrm", "dlrm_onehot", "mean"]


# ---- trained sample graphs ---------------------------------------------------------------------------
def test_one_bottom_sequence_mask_exports(tmp_path, cpu):
    """BST with HugeCTR v23.06's one-bottom SequenceMask (its ONNX converter test script's form)."""
    m = sample_graphs.build("bst", str(tmp_path), one_bottom_mask=True)
    for _ in range(2):
        assert m.train()
    predictor = convert(m, str(tmp_path))
    for batch in eval_batches(m):
        assert_same(m, predictor, batch)


@pytest.mark.parametrize("name", TRAINED)
def test_trained_graph_predicts_the_same_under_onnxruntime(tmp_path, cpu, capfd, name):
    m = trained(name, str(tmp_path))
    capfd.readouterr()
    predictor = convert(m, str(tmp_path))
    assert "onnxruntime" not in capfd.readouterr().err  # no onnxruntime warning (unused initializers, ...)
    for batch in eval_batches(m):
        assert_same(m, predictor, batch)
    rng = np.random.default_rng(1)
    for rows in (7, 1):
        assert_same(m, predictor, ragged_batch(m, rng, rows))


def test_export_predictions_equal_onnxruntime(tmp_path, cpu):
    """The training side's own hook: Model.eval + export_predictions (6 significant digits) == onnxruntime."""
    m = trained("dcn", str(tmp_path))
    predictor = convert(m, str(tmp_path))
    batch = eval_batches(m, 1)[0]
    m._eval_reader = None  # eval() reads the same first batch
    assert m.eval()
    m.export_predictions(str(tmp_path / "pred.txt"), str(tmp_path / "label.txt"))
    exported = np.array((tmp_path / "pred.txt").read_text().split(), np.float64)
    got = predictor.predict_batch(batch)["label"][: batch.size, 0]
    np.testing.assert_allclose(got, exported, rtol=1e-5, atol=1e-6)


# ---- every other layer type ------------------------------------------------------------------------
ZOO_ROWS = 4  # GRU's batchsize and the rows Gather reads


def zoo_model(folder):
    """Every layer type the sample graphs leave out, on random weights (no training: set below)."""
    solver = hugectr.CreateSolver(batchsize=ZOO_ROWS, batchsize_eval=ZOO_ROWS, i64_input_key=True, vvgpu=[[0]])
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=["unused"],
        eval_source="unused",
        check_type=hugectr.Check_t.Sum,
    )
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer())
    m.add(
        hugectr.Input(
            label_dims=[1, 1, 2],
            label_names=["y_bce", "y_ce", "y_mce"],
            dense_dim=6,
            dense_name="dense",
            data_reader_sparse_param_array=[
                hugectr.DataReaderSparseParam("keys", 3, False, 3),
                hugectr.DataReaderSparseParam("onehot", 1, True, 2),
            ],
        )
    )
    m.add(hugectr.SparseEmbedding(hugectr.Embedding_t.LocalizedSlotSparseEmbeddingHash, 1, 4, "mean", "emb", "keys"))
    m.add(
        hugectr.SparseEmbedding(
            hugectr.Embedding_t.LocalizedSlotSparseEmbeddingOneHot, 1, 4, "sum", "oh", "onehot", slot_size_array=[5, 7]
        )
    )

    def d(t, bottoms, tops, **kw):
        m.add(hugectr.DenseLayer(t, bottoms, tops, **kw))

    d(L.Reshape, ["emb"], ["sel"], selected=True, selected_slots=[2, 0])  # (B, 8)
    d(L.Reshape, ["emb"], ["steps"], leading_dim=4, time_step=3)  # (B, 3, 4)
    d(L.Concat, ["emb", "steps"], ["wide3"], axis=2)  # (B, 3, 8)
    d(L.Concat, ["emb", "oh"], ["tall3"], axis=1)  # (B, 5, 4)
    d(L.FusedReshapeConcat, ["emb", "steps"], ["item", "ad"])  # (B*2, 8), (B, 8)
    d(L.FusedReshapeConcatGeneral, ["steps", "wide3"], ["rows12"])  # (B*3, 12)
    d(L.Select, ["tall3"], ["picked"], dim=1, index=[4, 0, 0])  # (B, 3, 4)
    d(L.Reshape, ["wide3"], ["rhs"], shape=[-1, 4, 6])  # (B, 4, 6)
    d(L.MatrixMultiply, ["picked", "rhs"], ["mm"])  # (B, 3, 6)
    d(L.ReduceMean, ["mm"], ["mm_mean"], axis=2)  # (B, 3, 1)
    d(L.Reshape, ["mm_mean"], ["mm_flat"], leading_dim=3)  # (B, 3)
    d(L.ReduceSum, ["rows12"], ["rows_sum"], axis=1)  # (B*3, 1)
    d(L.Reshape, ["rows_sum"], ["rows_flat"], leading_dim=3)  # (B, 3)
    d(L.Reshape, ["item"], ["item_flat"], leading_dim=16)  # (B, 16)
    d(L.InnerProduct, ["dense"], ["lhs"], num_output=4)  # (B, 4)
    d(L.Reshape, ["tall3"], ["tall_t"], shape=[-1, 4, 5])  # (B, 4, 5): rhs of a 2-D x 3-D
    d(L.Reshape, ["lhs"], ["lhs4"], shape=[-1, ZOO_ROWS])  # (B, B): needs B rows of rhs
    d(L.MatrixMultiply, ["lhs4", "tall_t"], ["mm23"])  # (B, 4, 5)
    d(L.Reshape, ["mm23"], ["mm23_flat"], leading_dim=20)
    d(L.BatchNorm, ["dense"], ["bn"], factor=0.5, eps=1e-4)
    d(L.ELU, ["bn"], ["elu"], elu_alpha=0.7)
    d(L.Sigmoid, ["elu"], ["sig"])
    d(L.Cast, ["sig"], ["cast"])
    d(L.ReLUHalf, ["dense"], ["rh"])
    d(L.Concat, ["sel", "cast", "rh", "ad", "mm_flat", "rows_flat", "item_flat", "mm23_flat"], ["feat"])  # (B, 70)
    d(
        L.MLP,
        ["feat"],
        ["mlp"],
        num_outputs=[12, 8],
        activations=[hugectr.Activation_t.Relu, hugectr.Activation_t.Non],
        biases=[True, False],
    )
    d(L.FusedInnerProduct, ["mlp"], ["h0", "h1", "h2", "h3"], num_output=8, pos_type=hugectr.FcPosition_t.Head)
    d(
        L.FusedInnerProduct,
        ["h0", "h1", "h2", "h3"],
        ["b0", "b1", "b2", "b3"],
        num_output=8,
        pos_type=hugectr.FcPosition_t.Body,
    )
    d(
        L.FusedInnerProduct,
        ["b0", "b1", "b2", "b3"],
        ["tail"],
        num_output=6,
        pos_type=hugectr.FcPosition_t.Tail,
        act_type=hugectr.Activation_t.Non,
    )
    d(L.MultiCross, ["tail"], ["mc2"], num_layers=2, projection_dim=3)
    d(L.GRU, ["steps"], ["gru"], num_output=3, batchsize=ZOO_ROWS, SeqLength=3, vector_size=4)  # (B, 3, 3)
    d(L.Reshape, ["gru"], ["gru_flat"], leading_dim=9)
    d(L.Gather, ["gru_flat"], ["reordered"], indices=[3, 2, 1, 0])  # (4, 9)
    d(L.Concat, ["mc2", "reordered"], ["head_in"])  # (B, 15)
    d(L.InnerProduct, ["head_in"], ["logit1"], num_output=1)
    d(L.InnerProduct, ["head_in"], ["logit2"], num_output=2)
    d(L.InnerProduct, ["head_in"], ["logit3"], num_output=2)
    d(L.BinaryCrossEntropyLoss, ["logit1", "y_bce"], ["l1"])
    d(L.CrossEntropyLoss, ["logit2", "y_ce"], ["l2"])
    d(L.MultiCrossEntropyLoss, ["logit3", "y_mce"], ["l3"], target_weight_vec=[1.0, 0.5])
    m.compile()
    rng = np.random.default_rng(0)
    m.weights[...] = rng.normal(0, 0.5, m.weights.shape).astype(np.float32)  # every weight non-trivial
    bn = next(layer for layer in m.layers if layer.type_name == "BatchNorm")
    bn.load_ntp_entry({"mean": rng.normal(0, 1, 6).tolist(), "var": rng.uniform(0.5, 2, 6).tolist()})
    keys = np.arange(100, 130, dtype=np.uint64)
    m.embeddings[0].load(keys, rng.normal(0, 1, (30, 4)).astype(np.float32), np.zeros(30, np.int64))
    return m, keys


def zoo_batch(rng, keys, rows=ZOO_ROWS):
    nnz = rng.integers(0, 4, rows * 3)
    k = rng.choice(keys.astype(np.int64), int(nnz.sum()))
    k[rng.random(k.shape[0]) < 0.2] = 7  # not in the table
    onehot = np.stack([rng.integers(0, 5, rows), rng.integers(0, 7, rows)], 1).reshape(-1)  # per-slot keys
    return Batch(
        np.zeros((rows, 4), np.float32),
        rng.normal(0, 1, (rows, 6)).astype(np.float32),
        [
            (k, np.concatenate([[0], np.cumsum(nnz)]).astype(np.int64)),
            (onehot, np.arange(rows * 2 + 1, dtype=np.int64)),
        ],
    )


@pytest.mark.parametrize("exact", [False, True], ids=["numbactr", "hugectr_exact"])
def test_every_other_layer_type_predicts_the_same(tmp_path, cpu, capfd, exact):
    compat.set_hugectr_exact(exact)
    try:
        m, keys = zoo_model(str(tmp_path))
        capfd.readouterr()
        predictor = convert(m, str(tmp_path))
        assert "onnxruntime" not in capfd.readouterr().err
        rng = np.random.default_rng(2)
        for _ in range(3):
            assert_same(m, predictor, zoo_batch(rng, keys))
    finally:
        compat.set_hugectr_exact(False)


def test_every_layer_type_is_covered(tmp_path, cpu):
    """The graphs above use every layer type numbactr builds, and the converter writes each of them."""
    from numbactr.layers import REGISTRY

    used = set()
    for name in TRAINED:
        folder = tmp_path / name
        folder.mkdir()
        if name.startswith("dlrm"):
            m = tiny_dlrm(*tiny_data(str(folder), n_train=32, n_eval=32))
        elif name == "mean":
            m = mean_graph(sample_graphs.make_data(str(folder), [("data1", 2, 3)], n_train=32, n_eval=32))
        else:
            m = sample_graphs.build(name, str(folder))
        used |= {layer.type_name for layer in m.layers}
    zoo, _ = zoo_model(str(tmp_path))
    used |= {layer.type_name for layer in zoo.layers}
    assert used == {cls.type_name for cls in REGISTRY.values()}
    assert used == set(export.supported_layer_types())


# ---- inputs: hashed keys, vectors, HugeCTR's CSR request -------------------------------------------------
def test_hashed_uint64_keys_use_a_hash_map(tmp_path, cpu):
    """Keys far apart (hashed 64-bit ids) go through an ai.onnx.ml LabelEncoder instead of a lookup array."""
    m = trained("wdl", str(tmp_path))
    rng = np.random.default_rng(3)
    e = m.embeddings[1]
    keys = rng.integers(2**40, 2**63, 15, dtype=np.int64).astype(np.uint64)
    keys[0] = np.uint64(2**64 - 2)  # a key whose int64 is negative
    e.load(keys, rng.normal(0, 1, (15, e.vec)).astype(np.float32), None)
    predictor = convert(m, str(tmp_path))
    ops = {n.op_type for n in predictor_model(tmp_path).graph.node}
    assert "LabelEncoder" in ops and "Clip" in ops  # one table each way
    batch = ragged_batch(m, rng, 9)
    assert_same(m, predictor, batch)


def predictor_model(folder):
    import onnx

    return onnx.load(str(folder / "m.onnx"))


def test_dense_only_model_takes_embedding_vectors(tmp_path, cpu):
    """convert_embedding=False: the model's inputs are the embeddings' outputs (HugeCTR's dense-only export)."""
    m = trained("wdl", str(tmp_path))
    graph, dense, _ = save(m, str(tmp_path))
    path = str(tmp_path / "dense.onnx")
    hugectr2onnx.converter.convert(path, graph, dense)
    predictor = OnnxPredictor(path)
    assert [i.name for i in predictor.session.get_inputs()] == ["dense", "sparse_embedding2", "sparse_embedding1"]
    batch = ragged_batch(m, np.random.default_rng(4), 5)
    t = train_step.forward(m, batch, False, None)
    vectors = [np.asarray(device.to_host(t[e.name].data)) for e in m.embeddings]
    got = predictor.predict(batch.dense, vectors)["label"]
    np.testing.assert_allclose(got, numbactr_predictions(m, batch)["label"], rtol=0, atol=ATOL)


def test_predict_csr_and_the_files_helper(tmp_path, cpu):
    """onnxruntime_predictor (the benchmark's helper) from the files, fed HugeCTR's CSR request."""
    m = trained("wdl", str(tmp_path))
    graph, dense, sparse = save(m, str(tmp_path))
    predictor = onnxruntime_predictor(graph, dense, sparse, threads=2)
    assert predictor.session.get_session_options().intra_op_num_threads == 2
    batch = ragged_batch(m, np.random.default_rng(5), 6)
    # HugeCTR's request: keys of the tables in the graph's order (wide_data's table was added first)
    tables = {p.top_name: kv for p, kv in zip(m.input.sparse, batch.sparse)}
    order = [e.cfg.bottom_name for e in m.embeddings]
    cols = np.concatenate([tables[n][0] for n in order])
    ptrs = np.concatenate([tables[n][1] for n in order])
    got = predictor.predict_csr(batch.dense.reshape(-1).tolist(), cols.tolist(), ptrs.tolist())
    np.testing.assert_allclose(got, numbactr_predictions(m, batch)["label"], rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match="row_ptrs holds 10 entries"):
        predictor.predict_csr(batch.dense.reshape(-1), cols, ptrs[:10])


def test_large_models_keep_their_tensors_beside_the_file(tmp_path, cpu, monkeypatch):
    m = trained("dcn", str(tmp_path))
    monkeypatch.setattr(export, "MAX_INLINE_BYTES", 1024)
    predictor = convert(m, str(tmp_path))
    assert (tmp_path / "m.onnx.data").stat().st_size >= 1024  # the tables went there
    assert_same(m, predictor, eval_batches(m, 1)[0])


def test_pad_bags():
    keys = np.array([5, 6, 7, 8], np.uint64)
    out = pad_bags(keys, np.array([0, 2, 2, 3, 4]), 2, 2, 2)
    np.testing.assert_array_equal(out, [[[5, 6], [-1, -1]], [[7, -1], [8, -1]]])
    with pytest.raises(ValueError, match="sample 0, slot 0 holds 2 keys; the model takes at most 1"):
        pad_bags(keys, np.array([0, 2, 2, 3, 4]), 2, 2, 1)
    with pytest.raises(ValueError, match="offsets must have B\\*S \\+ 1 = 2\\*2 \\+ 1 = 5 entries"):
        pad_bags(keys, np.array([0, 2, 4]), 2, 2, 2)


# ---- errors ---------------------------------------------------------------------------------------------
def test_clear_errors_for_missing_and_malformed_files(tmp_path, cpu):
    m = trained("dcn", str(tmp_path))
    graph, dense, sparse = save(m, str(tmp_path))
    out = str(tmp_path / "x.onnx")
    conv = hugectr2onnx.converter.convert
    with pytest.raises(FileNotFoundError, match="dense_model .*nope.model' does not exist"):
        conv(out, graph, str(tmp_path / "nope.model"), True, sparse)
    with pytest.raises(FileNotFoundError, match="sparse model .*missing' is not a folder"):
        conv(out, graph, dense, True, [str(tmp_path / "missing")])
    with pytest.raises(OnnxExportError, match="convert_embedding=True needs sparse_models"):
        conv(out, graph, dense, True)
    with pytest.raises(ValueError, match="2 files for 1 embeddings"):
        conv(out, graph, dense, True, sparse * 2)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layers": [json.loads(open(graph).read())["layers"][0], {"type": "Concat"}]}))
    with pytest.raises(ValueError, match="bad.json.*layer 1 .*missing key 'bottom'"):
        conv(out, str(bad), dense, True, sparse)
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="bad.json.*not valid JSON"):
        conv(out, str(bad), dense, True, sparse)
    short = tmp_path / "short_dense.model"  # a file that is not this graph's weights
    short.write_bytes(open(dense, "rb").read()[:-8])
    with pytest.raises(
        ValueError,
        match=f"short_dense.model.*holds {os.path.getsize(short)} bytes; this model needs exactly {m.n_params * 4}",
    ):
        conv(out, graph, str(short), True, sparse)
    vec = os.path.join(sparse[0], "emb_vector")  # a table one float short
    with open(vec, "rb+") as f:
        f.truncate(os.path.getsize(vec) - 4)
    with pytest.raises(ValueError, match="emb_vector"):
        conv(out, graph, dense, True, sparse)
    assert not os.path.exists(out)  # nothing half-written


def test_a_missing_batchnorm_statistics_file_is_named(tmp_path, cpu):
    m, _ = zoo_model(str(tmp_path))
    graph, dense, sparse = save(m, str(tmp_path))
    os.remove(dense + ".ntp.json")
    with pytest.raises(FileNotFoundError, match=r"BatchNorm statistics.*\.ntp\.json' does not exist"):
        hugectr2onnx.converter.convert(str(tmp_path / "x.onnx"), graph, dense, True, sparse)
    with pytest.raises(FileNotFoundError, match="elsewhere.ntp.json' does not exist"):
        hugectr2onnx.converter.convert(
            str(tmp_path / "x.onnx"), graph, dense, True, sparse, ntp_file=str(tmp_path / "elsewhere.ntp.json")
        )


def test_an_unsupported_layer_type_is_named(tmp_path, cpu, monkeypatch):
    m = trained("dlrm", str(tmp_path))
    from numbactr.onnx_converter import layers

    monkeypatch.delitem(layers.EMITTERS, "Interaction")
    with pytest.raises(
        OnnxExportError,
        match=r"Interaction layer \(bottom \['relu1', 'emb_slice0'\] -> top "
        r"\['inter'\]\): layer type Interaction is not supported",
    ):
        convert(m, str(tmp_path))


def test_mismatched_shapes_are_clear_errors(tmp_path, cpu):
    m = trained("dcn", str(tmp_path))
    graph, dense, sparse = save(m, str(tmp_path))
    g = json.loads(open(graph).read())
    concat = next(d for d in g["layers"] if d.get("top") == "concat2")
    concat["type"] = "Add"  # (B, 16) + (B, 19): shapes differ
    del concat["axis"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(g))
    with pytest.raises(ValueError, match="Add layer.*has shape .*all inputs must have the same shape"):
        hugectr2onnx.converter.convert(str(tmp_path / "x.onnx"), str(bad), dense, True, sparse)
    predictor = convert(m, str(tmp_path))
    batch = eval_batches(m, 1)[0]
    with pytest.raises(ValueError, match=r"dense 'dense': expected \(B, 3\) features, got shape \(32, 4\)"):
        predictor.predict(np.zeros((32, 4), np.float32), batch.sparse)
    with pytest.raises(ValueError, match=r"input 'data1': expected shape \(32, 4, 2\), got \(32, 4, 3\)"):
        predictor.predict(batch.dense, [np.zeros((32, 4, 3), np.int64)])
    with pytest.raises(ValueError, match="expected 1 sparse inputs"):
        predictor.predict(batch.dense, [])


@pytest.mark.parametrize("name", ["dcn", "dlrm"])
def test_kernel_forward_on_sim_predicts_the_same(tmp_path, on_device, name):
    """numbactr's numba.cuda kernels (in the simulator) on the reloaded files == the exported model."""
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    on_device("cpu")
    m = trained(name, str(tmp_path))
    graph, dense, sparse = save(m, str(tmp_path))
    predictor = convert(m, str(tmp_path))
    rng = np.random.default_rng(6)
    batch = ragged_batch(m, rng, 5)
    on_device("sim")
    reloaded = export.load_trained_model(graph, dense, sparse)
    assert_same(reloaded, predictor, batch)
