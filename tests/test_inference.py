"""HugeCTR's inference API against the training that wrote the model, as NVIDIA's own inference tests check it
(test/inference/inference_model/*.py: a model trains, export_predictions writes the last evaluation batch,
InferenceModel predicts the same samples from the snapshot files, and the two must agree).

Here they agree exactly: InferenceModel's predictions of the exported batch, printed as HugeCTR prints them,
are the exported text; the CSR requests of InferenceSession give the same bits; for DCN (multi-hot sum),
Wide&Deep (two tables), DeepFM, DLRM (hash and one-hot tables), MMoE (two heads) and a multi-hot mean table.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.train import cuda_graphs
from numbactr.runtime import device
from numbactr.data import make_reader
from numbactr.data.errors import DataFormatError
from numbactr.inference import CreateInferenceSession, InferenceModel, InferenceParams
from numbactr.metrics import roc_auc
from tests.model_util import one_hot_lists, tiny_data, tiny_dlrm
from tests.sample_graphs import build

L = hugectr.Layer_t
ITER = 8


@dataclass
class Trained:
    """A trained model's files: graph JSON, snapshot, the exported last eval batch (its index among the eval
    batches), and the eval file list."""

    name: str
    folder: str
    graph: str
    dense: str
    sparse: list
    eval_source: str
    batch: int
    exported_batch: int
    model: object

    def params(self, **kw) -> InferenceParams:
        args = dict(
            model_name=self.name,
            max_batchsize=self.batch,
            hit_rate_threshold=1.0,
            dense_model_file=self.dense,
            sparse_model_files=self.sparse,
            use_gpu_embedding_cache=True,
            cache_size_percentage=0.5,
            i64_input_key=True,
        )
        args.update(kw)
        return InferenceParams(**args)


def multihot_mean(folder):
    """A multi-hot table with the mean combiner: 2 slots of up to 3 keys (ragged), 4 dense features."""
    rng = np.random.default_rng(1)
    from numbactr.data.file_list import write_file_list
    from numbactr.data.norm import NormWriter

    lists = []
    for name, n in (("train", 256), ("eval", 64)):
        path = os.path.join(folder, name, "part0.data")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lens = [rng.integers(1, 4, n) for _ in range(2)]  # ragged: 1..3 keys per bag
        slot_keys = [
            (rng.integers(s * 10, s * 10 + 10, int(ln.sum())).astype(np.int64), ln) for s, ln in enumerate(lens)
        ]
        x = rng.normal(0, 1, (n, 4)).astype(np.float32)
        y = (rng.random((n, 1)) < 0.5).astype(np.float32)
        with NormWriter(path, 1, 4, 2, key_dtype=np.int64) as w:
            w.write(y, x, slot_keys)
        write_file_list(os.path.join(folder, name, "_file_list.txt"), [path])
        lists.append(os.path.join(folder, name, "_file_list.txt"))
    solver = hugectr.CreateSolver(
        batchsize=32, batchsize_eval=32, max_eval_batches=2, lr=0.01, vvgpu=[[0]], i64_input_key=True
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=[lists[0]],
        eval_source=lists[1],
        check_type=hugectr.Check_t.Sum,
    )
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer())
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=4,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 3, False, 2)],
        )
    )
    m.add(hugectr.SparseEmbedding(hugectr.Embedding_t.LocalizedSlotSparseEmbeddingHash, 1, 6, "mean", "emb", "data1"))
    m.add(hugectr.DenseLayer(L.Reshape, ["emb"], ["flat"], leading_dim=12))
    m.add(hugectr.DenseLayer(L.Concat, ["flat", "dense"], ["cat"]))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["cat"], ["fc1"], num_output=8))
    m.add(hugectr.DenseLayer(L.ReLU, ["fc1"], ["relu1"]))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["relu1"], ["fc2"], num_output=1))
    m.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc2", "label"], ["loss"]))
    m.compile()
    return m, lists[1], 32, 2


def make_model(name, folder):
    """(model, eval file list, eval batch, eval batches per evaluation)."""
    if name == "multihot_mean":
        return multihot_mean(folder)
    if name.startswith("dlrm"):
        train, evl = tiny_data(folder, n_train=256, n_eval=128)
        emb = (
            hugectr.Embedding_t.LocalizedSlotSparseEmbeddingOneHot
            if name == "dlrm_onehot"
            else hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash
        )
        # the eval list the model reads (a one-hot table's: tiny_data's per-slot twin)
        return tiny_dlrm(train, evl, batch=32, embedding=emb), one_hot_lists(emb, evl)[0], 32, 4
    return build(name, folder), os.path.join(folder, "eval", "_file_list.txt"), 32, 2


def train(name, folder) -> Trained:
    """Train ITER steps (one evaluation at the end), export its last batch, write the graph and snapshot."""
    folder = str(folder)
    m, evl, batch, per_eval = make_model(name, folder)
    m.fit(max_iter=ITER, display=0, eval_interval=ITER, snapshot=0)
    m.export_predictions(os.path.join(folder, "pred"), os.path.join(folder, "label"))
    m.graph_to_json(os.path.join(folder, "graph.json"))
    prefix = os.path.join(folder, name)
    m.save_params_to_files(prefix, ITER)
    sparse = [f"{prefix}{i}_sparse_{ITER}.model" for i in range(len(m.embeddings))]
    return Trained(
        name,
        folder,
        os.path.join(folder, "graph.json"),
        f"{prefix}_dense_{ITER}.model",
        sparse,
        evl,
        batch,
        per_eval - 1,
        m,
    )


GRAPHS = ["dcn", "wdl", "deepfm", "mmoe", "dlrm", "dlrm_onehot", "multihot_mean"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    device.set_device("cpu")
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = train(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def exported_text(tr: Trained) -> str:
    with open(os.path.join(tr.folder, "pred")) as f:
        return f.read()


def as_hugectr_text(values) -> str:
    return "".join(f"{v:g} " for v in np.asarray(values, np.float32).reshape(-1).tolist())


def eval_batches(tr: Trained, count: int):
    """The first `count` eval batches as the inference reader reads them."""
    inp = tr.model.input
    params = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=[tr.eval_source],
        eval_source=tr.eval_source,
        check_type=hugectr.Check_t.Sum,
    )
    reader = make_reader(
        params,
        tr.eval_source,
        tr.batch,
        inp.label_dim,
        inp.dense_dim,
        [sp.slot_num for sp in inp.sparse],
        [sp.nnz_per_slot for sp in inp.sparse],
        True,
        True,
    )
    it = iter(reader)
    out = [next(it) for _ in range(count)]
    reader.close()
    return out


def csr_request(tr: Trained, batch):
    """HugeCTR's CSR request of a batch: dense flattened, each table's keys and row_ptrs one after the other."""
    m = tr.model
    keys, ptrs = [], []
    for e in m.embeddings:
        k, off = batch.sparse[m.sparse_inputs[e.cfg.bottom_name]]
        keys.append(np.asarray(k).astype(np.int64))
        ptrs.append(np.asarray(off, np.int64))
    return batch.dense.reshape(-1).tolist(), np.concatenate(keys).tolist(), np.concatenate(ptrs).tolist()


@pytest.mark.parametrize("name", GRAPHS)
def test_inference_model_equals_export_predictions(trained, name):
    """NVIDIA's check, exactly: InferenceModel's predictions of the exported batch print as the export."""
    tr = trained(name)
    model = InferenceModel(tr.graph, tr.params())
    preds = model.predict(tr.exported_batch + 1, tr.eval_source, hugectr.DataReaderType_t.Norm, hugectr.Check_t.Sum)
    heads = 2 if name == "mmoe" else 1
    assert preds.shape == ((tr.exported_batch + 1) * tr.batch, heads)
    last = preds[tr.exported_batch * tr.batch :]
    assert as_hugectr_text(last) == exported_text(tr)
    # and the model's own evaluation of those samples, bit for bit
    assert np.array_equal(last, tr.model._last_eval[0])
    model.close()


@pytest.mark.parametrize("name", ["dcn", "wdl", "mmoe", "dlrm_onehot", "multihot_mean"])
def test_session_csr_requests_equal_inference_model(trained, name):
    tr = trained(name)
    batches = eval_batches(tr, tr.exported_batch + 1)
    session = CreateInferenceSession(tr.graph, tr.params(use_gpu_embedding_cache=False))
    out = session.predict(*csr_request(tr, batches[-1]))
    assert isinstance(out, list)
    got = np.asarray(out, np.float32).reshape(tr.batch, -1)
    assert np.array_equal(got, tr.model._last_eval[0])
    # a request of fewer samples (the first 5) answers those samples
    few = batches[-1]
    dense, keys, ptrs = csr_request(tr, few)
    m, k0, cut_keys, cut_ptrs, r0 = tr.model, 0, [], [], 0
    for e in m.embeddings:
        s = m.input.sparse[m.sparse_inputs[e.cfg.bottom_name]].slot_num
        off = np.asarray(ptrs[r0 : r0 + tr.batch * s + 1])
        cut_ptrs += off[: 5 * s + 1].tolist()
        cut_keys += keys[k0 : k0 + off[5 * s]]
        k0, r0 = k0 + off[-1], r0 + tr.batch * s + 1
    five = session.predict(dense[: 5 * m.input.dense_dim], cut_keys, cut_ptrs)
    np.testing.assert_allclose(np.asarray(five).reshape(5, -1), got[:5], rtol=1e-6, atol=1e-7)
    # the file-based session predict: (num_batches * B,) for one head
    files = session.predict(tr.exported_batch + 1, tr.eval_source, hugectr.DataReaderType_t.Norm, hugectr.Check_t.Sum)
    assert files.shape == (
        ((tr.exported_batch + 1) * tr.batch,)
        if got.shape[1] == 1
        else ((tr.exported_batch + 1) * tr.batch, got.shape[1])
    )
    session.close()


def test_evaluate_is_the_auc_of_the_predictions(trained):
    tr = trained("dcn")
    model = InferenceModel(tr.graph, tr.params())
    auc = model.evaluate(2, tr.eval_source, hugectr.DataReaderType_t.Norm, hugectr.Check_t.Sum)
    preds = model.predict(2, tr.eval_source, hugectr.DataReaderType_t.Norm, hugectr.Check_t.Sum)
    labels = np.concatenate([b.label for b in eval_batches(tr, 2)])
    assert auc == pytest.approx(roc_auc(labels[:, 0], preds[:, 0]), abs=1e-12)


def test_check_out_tensor_matches_training_evaluation(trained):
    tr = trained("dlrm")
    model = InferenceModel(tr.graph, tr.params())
    model.predict(tr.exported_batch + 1, tr.eval_source, hugectr.DataReaderType_t.Norm, hugectr.Check_t.Sum)
    for name in ("emb", "inter", "fc3"):
        np.testing.assert_array_equal(
            model.check_out_tensor(name), tr.model.check_out_tensor(name, hugectr.Tensor_t.Evaluate)
        )
    assert model.check_out_tensor("loss").shape == (tr.batch, 1)  # the loss top holds the sigmoid
    with pytest.raises(ValueError, match="cannot find tensor with name 'nope'"):
        model.check_out_tensor("nope")
    with pytest.raises(hugectr.ModelError, match="cannot find tensor"):
        tr.model.check_out_tensor("data1", hugectr.Tensor_t.Train)  # a sparse input is no tensor
    assert tr.model.check_out_tensor("emb", hugectr.Tensor_t.Train).shape == (32, 3, 4)


def test_export_predictions_format_and_append(tmp_path, trained):
    tr = trained("mmoe")
    text = exported_text(tr)
    assert text.endswith(" ") and "\n" not in text
    assert np.loadtxt(os.path.join(tr.folder, "pred")).shape == (2 * tr.batch,)  # two heads, row-major
    labels = np.loadtxt(os.path.join(tr.folder, "label"))
    assert set(np.unique(labels)) <= {0.0, 1.0}
    out = tmp_path / "again"
    tr.model.export_predictions(str(out), str(tmp_path / "l"))
    tr.model.export_predictions(str(out), str(tmp_path / "l"))  # appends, as HugeCTR
    assert out.read_text() == 2 * text
    fresh, _, _, _ = make_model("dcn", str(tmp_path / "fresh"))
    with pytest.raises(hugectr.ModelError, match="no evaluation batch yet"):
        fresh.export_predictions(str(tmp_path / "p"), str(tmp_path / "q"))
    with pytest.raises(hugectr.ModelError, match="cannot open output file"):
        tr.model.export_predictions(str(tmp_path / "no" / "dir" / "p"), str(tmp_path / "q"))


@pytest.mark.parametrize("name", GRAPHS)
@pytest.mark.parametrize("where", ["cpu", "sim"])
def test_the_forward_plan_gives_every_tensor_of_the_layer_forwards(trained, name, where, on_device):
    """The session's plan (each layer's inference_fn: its op forwards without Tensors or tape) gives every
    tensor of the layers' own forward(), bit for bit, on the cpu device and on the kernels (sim)."""
    if where == "sim" and not device._numba_simulated():
        pytest.skip("needs the simulator")
    tr = trained(name)
    rows = 4 if where == "sim" else tr.batch
    session = CreateInferenceSession(tr.graph, tr.params(use_gpu_embedding_cache=False))
    session.predict(*csr_request(tr, eval_batches(tr, 1)[0]))
    g = session.graph
    names = [g.input.dense_name] + [e.sparse_embedding_name for e in g.embeddings]
    arrays = [np.array(session._last[k][:rows]) for k in names]
    on_device(where)
    planned = session._forward(names, arrays)
    layered = session._forward(names, arrays, plan=False)
    assert planned.keys() == layered.keys()
    for k in layered:
        assert planned[k].dtype == layered[k].dtype and np.array_equal(planned[k], layered[k]), k
    kinds = {type(layer).__name__ for layer, fn in session._plan() if fn is None}
    assert not kinds & {
        "InnerProduct",
        "ReLU",
        "Interaction",
        "Concat",
        "Reshape",
        "MultiCross",
        "Dropout",
        "Add",
        "ReduceSum",
        "FmOrder2",
        "WeightMultiply",
        "Slice",
        "FusedInnerProduct",
    }, kinds


def test_sim_kernels_and_missing_keys_with_a_default(trained, on_device):
    """The sim device (the cache and pooling kernels) gives the cpu predictions; keys no tier holds take
    default_value_for_each_table."""
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    tr = trained("dlrm")
    dense, keys, ptrs = csr_request(tr, eval_batches(tr, 1)[0])
    n = 4
    req = (dense[: n * 2], keys[: n * 3], ptrs[: n * 3 + 1])
    ref = CreateInferenceSession(tr.graph, tr.params(max_batchsize=n)).predict(*req)
    on_device("sim")
    got = CreateInferenceSession(tr.graph, tr.params(max_batchsize=n, cache_size_percentage=0.1)).predict(*req)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    on_device("cpu")
    unseen = [k + 10**6 for k in req[1]]
    zero = CreateInferenceSession(tr.graph, tr.params(max_batchsize=n)).predict(req[0], unseen, req[2])
    half = CreateInferenceSession(tr.graph, tr.params(max_batchsize=n, default_value_for_each_table=[0.5]))
    s = half.predict(req[0], unseen, req[2])
    emb = half.check_out_tensor("emb")
    assert np.all(emb == 0.5)  # one key per slot: the pooled default
    assert not np.allclose(s, zero)


def test_bad_inputs_name_what_and_where(trained, tmp_path):
    tr = trained("wdl")
    with pytest.raises(ValueError, match="2 sparse_model_files|1 sparse_model_files"):
        InferenceModel(tr.graph, tr.params(sparse_model_files=tr.sparse[:1]))
    bad = json.load(open(tr.graph))
    del bad["layers"][1]["sparse_embedding_hparam"]["embedding_vec_size"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"bad\.json.*layer 1.*embedding_vec_size"):
        InferenceModel(str(path), tr.params())
    short = tmp_path / "short_dense.model"
    short.write_bytes(open(tr.dense, "rb").read()[:-4])
    with pytest.raises(DataFormatError, match="short_dense.model"):
        InferenceModel(tr.graph, tr.params(dense_model_file=str(short)))
    broken = tmp_path / "broken_sparse.model"
    broken.mkdir()
    (broken / "key").write_bytes(np.arange(3, dtype="<i8").tobytes())
    (broken / "emb_vector").write_bytes(np.zeros(5, "<f4").tobytes())
    with pytest.raises(DataFormatError, match="emb_vector"):
        InferenceModel(tr.graph, tr.params(sparse_model_files=[str(broken), tr.sparse[1]]))
    with pytest.raises(TypeError, match="'i64_input_key' is required"):
        InferenceParams(
            model_name="m",
            max_batchsize=4,
            hit_rate_threshold=1.0,
            dense_model_file="",
            sparse_model_files=[],
            use_gpu_embedding_cache=True,
            cache_size_percentage=0.5,
        )
    assert tr.params(hit_rate_threshold=1.5).hit_rate_threshold == 1.5  # > 1: no asynchronous inserts
    with pytest.raises(ValueError, match="hit_rate_threshold must be finite"):
        tr.params(hit_rate_threshold=float("nan"))
    with pytest.raises(ValueError, match="model_name 'a b' is invalid"):
        tr.params(model_name="a b")
    session = CreateInferenceSession(tr.graph, tr.params(i64_input_key=False))
    dense, keys, ptrs = csr_request(tr, eval_batches(tr, 1)[0])
    with pytest.raises(ValueError, match="row_ptrs do not describe whole samples"):
        session.predict(dense, keys, ptrs[:-1])
    with pytest.raises(ValueError, match="dense_feature has"):
        session.predict(dense[:-1], keys, ptrs)
    nan, dd = np.array(dense, np.float32), session.graph.input.dense_dim
    nan[dd + 1] = np.nan
    with pytest.raises(ValueError, match=rf"dense_feature\[{dd + 1}\] = nan \(sample 1, feature 1\) is not finite"):
        session.predict(nan, keys, ptrs)
    with pytest.raises(ValueError, match="embeddingcolumns has"):
        session.predict(dense, keys[:-1], ptrs)
    with pytest.raises(ValueError, match=r"key 4294967296 at position 0 does not fit the 32-bit keys"):
        session.predict(dense, [2**32] + keys[1:], ptrs)
    wrong = list(ptrs)
    wrong[3] = wrong[2] - 1
    with pytest.raises(ValueError, match="never decrease"):
        session.predict(dense, keys, wrong)
    big = CreateInferenceSession(tr.graph, tr.params(max_batchsize=2))
    with pytest.raises(ValueError, match="exceed max_batchsize 2"):
        big.predict(dense, keys, ptrs)


class _SimForwardGraphs(cuda_graphs.ForwardGraphs):
    """ForwardGraphs with the host standing in for the GPU: a "capture" runs the forward once and keeps its
    output arrays; a "launch" runs the captured function again, from the bucket's buffers, and writes its
    results into those same arrays, as a replayed graph writes its captured outputs."""

    LEAST_ROWS = 4

    def _capture(self, fn):
        out = fn()

        def replay():
            for k, v in fn().items():
                out[k][...] = v

        return replay, out

    def _launch(self, graph):
        graph()


def _cut(tr, request, n):
    """The first n samples of a CSR request."""
    dense, keys, ptrs = request
    m, k0, r0, cut_keys, cut_ptrs = tr.model, 0, 0, [], []
    for e in m.embeddings:
        s = m.input.sparse[m.sparse_inputs[e.cfg.bottom_name]].slot_num
        off = np.asarray(ptrs[r0 : r0 + tr.batch * s + 1])
        cut_ptrs += off[: n * s + 1].tolist()
        cut_keys += keys[k0 : k0 + off[n * s]]
        k0, r0 = k0 + off[-1], r0 + tr.batch * s + 1
    return dense[: n * m.input.dense_dim], cut_keys, cut_ptrs


@pytest.mark.parametrize("name", ["dcn", "mmoe"])
def test_forward_graphs_pad_requests_into_buckets_and_replay(trained, name):
    """use_cuda_graph: requests of n samples run on a bucket of rows whose input buffers keep their
    addresses; the first forward of a bucket is eager, the second captured, later ones replayed. Every
    request's predictions and tensors equal an eager session's, whatever larger request used the bucket
    before (its rows are zeroed)."""
    tr = trained(name)
    request = csr_request(tr, eval_batches(tr, 1)[0])
    eager = CreateInferenceSession(tr.graph, tr.params())
    graphed = CreateInferenceSession(tr.graph, tr.params())
    g = graphed._graphs = _SimForwardGraphs(tr.batch)
    sizes = [32, 7, 5, 7, 3, 32, 5, 6, 32, 1]
    for n in sizes:
        req = _cut(tr, request, n)
        want = np.asarray(eager.predict(*req))
        got = np.asarray(graphed.predict(*req))
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=f"{n} samples")
        for t in sorted(eager.tensors):
            np.testing.assert_allclose(
                graphed.check_out_tensor(t),
                eager.check_out_tensor(t),
                rtol=1e-6,
                atol=1e-7,
                err_msg=f"{t}, {n} samples",
            )
    # buckets of 32 rows (3 requests), 8 (7, 5, 7, 5, 6 samples) and 4 (3, 1): each one eager forward, one
    # capture, the rest replays
    assert sorted(g.buckets) == [4, 8, 32]
    assert all((b.eager, b.graph is not None) == (1, True) for b in g.buckets.values())
    assert (g.captures, g.replays) == (3, 1 + 3)
    # the 8-row bucket last held 6 samples: rows 6, 7 are zero (7 samples were there before)
    assert all(not np.asarray(buf[6:]).any() for buf in g.buckets[8].buffers)
    # use_cuda_graph=False, or off the GPU: eager forwards
    assert CreateInferenceSession(tr.graph, tr.params(use_cuda_graph=False))._forward_graphs() is None
    assert eager._forward_graphs() is None
    for s in (eager, graphed):
        s.close()


def test_bucket_rows():
    assert [cuda_graphs.bucket_rows(n, 1000) for n in (0, 1, 64, 65, 128, 129, 999, 1000)] == [
        64,
        64,
        64,
        128,
        128,
        256,
        1000,
        1000,
    ]
    assert cuda_graphs.bucket_rows(5, 32, 4) == 8 and cuda_graphs.bucket_rows(3, 2, 1) == 2


@pytest.mark.gpu
def test_forward_graphs_on_a_gpu(trained, monkeypatch):
    """On a GPU with NUMBACTR_CUDA_GRAPHS=1: captured and replayed forwards predict what eager ones do."""
    if device.kind() != "gpu":
        pytest.skip("needs the gpu device")
    tr = trained("dlrm")
    request = csr_request(tr, eval_batches(tr, 1)[0])
    eager = CreateInferenceSession(tr.graph, tr.params(use_cuda_graph=False))
    monkeypatch.setenv(cuda_graphs.ENV, "1")
    graphed = CreateInferenceSession(tr.graph, tr.params())
    for n in (32, 32, 32, 7, 7, 5, 32):
        req = _cut(tr, request, n)
        np.testing.assert_allclose(graphed.predict(*req), eager.predict(*req), rtol=1e-5, atol=1e-6)
    g = graphed._graphs
    assert g is not None and g.disabled is None, g.disabled
    assert g.captures == 2 and g.replays == 2
