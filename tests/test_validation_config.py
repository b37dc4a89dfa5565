"""Validation of configuration (issue 8, item 5): hyperparameter ranges, arguments that are accepted but
ignored (warned, never silent), loss bottoms, a non-finite loss stopping train() at its step, the
hash-table-full message, and graph JSON files with a missing or bad key (the file, layer and key named;
no parameter silently defaults)."""

import copy
import json
import math
import warnings

import numpy as np
import pytest

import numbactr as hugectr
from numbactr import IgnoredArgumentWarning, ModelError
from numbactr.embedding.hash_table import HashTableFullError
from tests import sample_graphs
from tests.model_util import tiny_data, tiny_dlrm

O, U, T = hugectr.Optimizer_t, hugectr.Update_t, hugectr.DataReaderType_t
NAN, INF = float("nan"), float("inf")


# ---- ranges ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,pattern",
    [
        (dict(lr=NAN), "lr must be finite, got nan"),
        (dict(lr=INF), "lr must be finite"),
        (dict(lr=0.0), r"lr must lie in \(0.0, inf\), got 0.0"),
        (dict(lr=-0.1), "lr must lie in"),
        (dict(end_lr=-1e-3), r"end_lr must lie in \[0.0, inf\)"),
        (dict(end_lr=NAN), "end_lr must be finite"),
        (dict(warmup_steps=-1), "warmup_steps must lie in"),
        (dict(warmup_steps=1.5), "warmup_steps must be an integer"),
        (dict(decay_start=-2), "decay_start must lie in"),
        (dict(decay_steps=0), r"decay_steps must lie in \[1, inf\)"),
        (dict(decay_power=0.5), "decay_power must lie in"),
        (dict(decay_power=NAN), "decay_power must be finite"),
        (dict(scaler=0.0), "scaler must lie in"),
        (dict(scaler=INF), "scaler must be finite"),
        (dict(batchsize=0), "batchsize must lie in"),
        (dict(batchsize_eval=-4), "batchsize_eval must lie in"),
        (dict(max_eval_batches=-1), "max_eval_batches must lie in"),
        (dict(seed=-1), "seed must lie in"),
        (dict(lr="0.1"), "lr must be a number"),
        (dict(metrics_spec={"AUC": 0.5}), "metrics_spec must map"),
        (dict(metrics_spec={hugectr.MetricsType.AUC: NAN}), "metrics_spec.*must be finite"),
    ],
)
def test_solver_rejects_out_of_range(kw, pattern):
    with pytest.raises(ValueError, match="CreateSolver: " + pattern):
        hugectr.CreateSolver(**kw)


@pytest.mark.parametrize(
    "kw,pattern",
    [
        (dict(beta1=1.0), r"beta1 must lie in \[0.0, 1.0\), got 1.0"),
        (dict(beta1=-0.1), "beta1 must lie in"),
        (dict(beta1=NAN), "beta1 must be finite"),
        (dict(beta2=1.5), "beta2 must lie in"),
        (dict(epsilon=0.0), r"epsilon must lie in \(0.0, inf\)"),
        (dict(epsilon=INF), "epsilon must be finite"),
        (dict(optimizer_type=O.MomentumSGD, momentum_factor=1.0), "momentum_factor must lie in"),
        (dict(optimizer_type=O.Nesterov, momentum_factor=NAN), "momentum_factor must be finite"),
        (dict(optimizer_type=O.AdaGrad, initial_accu_value=-1.0), "initial_accu_value must lie in"),
        (dict(optimizer_type=O.Ftrl, beta=-0.5), "beta must lie in"),
        (dict(optimizer_type=O.Ftrl, lambda1=NAN), "lambda1 must be finite"),
        (dict(optimizer_type=O.Ftrl, lambda2=-1.0), "lambda2 must lie in"),
        (dict(optimizer_type=O.SGD, atomic_update="yes"), "atomic_update must be a bool"),
    ],
)
def test_optimizer_rejects_out_of_range(kw, pattern):
    with pytest.raises(ValueError, match="CreateOptimizer: " + pattern):
        hugectr.CreateOptimizer(**kw)


def test_reader_params_reject_out_of_range():
    base = dict(data_reader_type=T.Norm, source=["a"], eval_source="b", check_type=hugectr.Check_t.Sum)
    for kw, pattern in [
        (dict(num_workers=0), "num_workers must lie in"),
        (dict(data_reader_type=T.Raw, num_samples=-5), "num_samples must lie in"),
        (
            dict(data_reader_type=T.Parquet, slot_size_array=[3, -1]),
            r"slot_size_array\[1\] must be a whole number >= 0",
        ),
    ]:
        with pytest.raises(ValueError, match="DataReaderParams: " + pattern):
            hugectr.DataReaderParams(**{**base, **kw})


# ---- ignored arguments -------------------------------------------------------------------------
def _norm(**kw):
    return hugectr.DataReaderParams(
        **{**dict(data_reader_type=T.Norm, source=["a"], eval_source="b", check_type=hugectr.Check_t.Sum), **kw}
    )


IGNORED = [
    (lambda: hugectr.CreateSolver(train_intra_iteration_overlap=True), "train_intra_iteration_overlap=True"),
    (lambda: hugectr.CreateSolver(eval_inter_iteration_overlap=True), "eval_inter_iteration_overlap=True"),
    (lambda: hugectr.CreateSolver(all_reduce_algo=hugectr.AllReduceAlgo.OneShot), "all_reduce_algo="),
    (lambda: hugectr.CreateSolver(grouped_all_reduce=True), "grouped_all_reduce=True"),
    (lambda: hugectr.CreateSolver(device_layout=hugectr.DeviceLayout.NodeFirst), "device_layout="),
    (lambda: hugectr.CreateSolver(perf_logging=True), "perf_logging=True"),
    (lambda: hugectr.CreateSolver(kafka_brockers="host:9092"), "kafka_brockers='host:9092'"),
    (lambda: hugectr.CreateSolver(vvgpu=[[0, 1], [2]]), "vvgpu=[[0, 1], [2]]"),
    (
        lambda: hugectr.CreateSolver(data_source_params=hugectr.data.DataSourceParams(use_hdfs=True)),
        "data_source_params=DataSourceParams(source=FileSystemType_t.HDFS",
    ),
    (lambda: hugectr.Model(hugectr.CreateSolver(), _norm(keyset=["k"]), hugectr.CreateOptimizer()), "keyset=['k']"),
    (lambda: _norm(cache_eval_data=10), "cache_eval_data=10"),
    (lambda: _norm(num_samples=100), "num_samples=100"),
    (lambda: _norm(eval_num_samples=100), "eval_num_samples=100"),
    (lambda: _norm(float_label_dense=True), "float_label_dense=True"),
    (lambda: _norm(read_file_sequentially=True), "read_file_sequentially=True"),
    (lambda: _norm(slot_size_array=[3, 4]), "slot_size_array=[3, 4]"),
    (lambda: _norm(data_reader_type=T.Raw, source="r.bin", slot_size_array=[3, 4]), "slot_size_array=[3, 4]"),
    (lambda: _norm(async_param=hugectr.AsyncParam(2, 4, shuffle=False)), "async_param=AsyncParam("),
    (lambda: _norm(data_reader_type=T.RawAsync, source="r.bin", float_label_dense=True), "float_label_dense=True"),
    (lambda: hugectr.CreateOptimizer(optimizer_type=O.SGD, beta1=0.5), "beta1=0.5"),
    (lambda: hugectr.CreateOptimizer(optimizer_type=O.Adam, momentum_factor=0.9), "momentum_factor=0.9"),
    (lambda: hugectr.CreateOptimizer(optimizer_type=O.MomentumSGD, epsilon=1e-3), "epsilon=0.001"),
    (lambda: hugectr.CreateOptimizer(optimizer_type=O.Adam, lambda1=0.1), "lambda1=0.1"),
    (lambda: hugectr.CreateOptimizer(optimizer_type=O.Ftrl, initial_accu_value=0.1), "initial_accu_value=0.1"),
    (lambda: hugectr.CreateOptimizer(optimizer_type=O.Adam, atomic_update=False), "atomic_update=False"),
    (
        lambda: hugectr.SparseEmbedding(
            hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, 4, "sum", "e", "d", slot_size_array=[3, 3]
        ),
        "slot_size_array=[3, 3]",
    ),
    (
        lambda: hugectr.SparseEmbedding(
            hugectr.Embedding_t.LocalizedSlotSparseEmbeddingHash, 1, 4, "sum", "e", "d", hybrid_embedding_param=object()
        ),
        "hybrid_embedding_param=",
    ),
]


@pytest.mark.parametrize("make,arg", IGNORED, ids=[a for _, a in IGNORED])
def test_ignored_argument_warns_once_naming_it(make, arg):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("default")  # Python's default: once per call site
        for _ in range(3):
            make()
    got = [w for w in rec if issubclass(w.category, IgnoredArgumentWarning)]
    assert len(got) == 1, [str(w.message) for w in rec]
    msg = str(got[0].message)
    assert arg in msg and "is ignored:" in msg
    assert got[0].filename == __file__  # points at the caller's line


def test_defaults_and_used_arguments_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hugectr.CreateSolver()
        hugectr.CreateSolver(
            use_cuda_graph=False,
            use_algorithm_search=False,
            vvgpu=[[0]],
            lr=0.1,
            warmup_steps=0,
            all_reduce_algo=hugectr.AllReduceAlgo.NCCL,
            use_mixed_precision=False,
            end_lr=0.0,
        )
        _norm()
        _norm(source=["only"], num_workers=2)
        hugectr.DataReaderParams(
            T.Raw, "r.bin", "e.bin", hugectr.Check_t.Non, num_samples=10, eval_num_samples=5, float_label_dense=True
        )
        hugectr.DataReaderParams(
            T.Parquet, "l.txt", "e.txt", hugectr.Check_t.Non, slot_size_array=[3, 4], read_file_sequentially=True
        )
        hugectr.CreateOptimizer()
        hugectr.CreateOptimizer(optimizer_type=O.Adam, beta1=0.8, beta2=0.99, epsilon=1e-6)
        hugectr.CreateOptimizer(optimizer_type=O.AdaGrad, initial_accu_value=0.1, epsilon=1e-5)
        hugectr.CreateOptimizer(optimizer_type=O.MomentumSGD, momentum_factor=0.9)
        hugectr.CreateOptimizer(optimizer_type=O.Nesterov, momentum_factor=0.9)
        hugectr.CreateOptimizer(optimizer_type=O.Ftrl, beta=0.1, lambda1=0.1, lambda2=0.1)
        hugectr.CreateOptimizer(optimizer_type=O.SGD, atomic_update=False)
        hugectr.CreateOptimizer(optimizer_type=O.SGD, beta1=0.9, beta2=0.999, momentum_factor=0.0)  # = defaults
        hugectr.SparseEmbedding(
            hugectr.Embedding_t.LocalizedSlotSparseEmbeddingOneHot, 1, 4, "sum", "e", "d", slot_size_array=[3, 3]
        )


def test_fit_warns_about_the_other_modes_argument(tmp_path):
    tr, ev = tiny_data(str(tmp_path), n_train=64, n_eval=64)
    m = tiny_dlrm(tr, ev, batch=32)
    with pytest.warns(IgnoredArgumentWarning, match=r"Model.fit: num_epochs=3 is ignored"):
        m.fit(num_epochs=3, max_iter=1, display=0, eval_interval=0, snapshot=0)
    with pytest.raises(ModelError, match=r"must come from CreateETC\(\)"):
        hugectr.Model(m.solver, m.reader_params, m.opt_params, etc_params=object())


def test_epoch_mode_fit_warns_about_max_iter(tmp_path):
    tr, ev = tiny_data(str(tmp_path), n_train=64, n_eval=64)
    s = hugectr.CreateSolver(batchsize=32, batchsize_eval=32, i64_input_key=True, repeat_dataset=False)
    m = hugectr.Model(s, _norm(source=[tr], eval_source=ev), hugectr.CreateOptimizer())
    ref = tiny_dlrm(tr, ev, batch=32)
    m.add(ref.input)
    for e in ref.embeddings:
        m.add(e.cfg)
    for layer in ref.layers:
        m.add(layer.cfg)
    m.compile()
    with pytest.warns(IgnoredArgumentWarning, match=r"Model.fit: max_iter=5 is ignored: in epoch mode"):
        m.fit(num_epochs=1, max_iter=5, display=0, eval_interval=0, snapshot=0)


# ---- loss bottoms --------------------------------------------------------------------------------
def _dense_model(loss_bottoms, loss=hugectr.Layer_t.BinaryCrossEntropyLoss, label_dim=1):
    s = hugectr.CreateSolver(batchsize=8, batchsize_eval=8, i64_input_key=True)
    m = hugectr.Model(s, _norm(), hugectr.CreateOptimizer())
    m.add(
        hugectr.Input(
            label_dim=label_dim,
            label_name="label",
            dense_dim=3,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 2)],
        )
    )
    m.add(hugectr.DenseLayer(hugectr.Layer_t.InnerProduct, ["dense"], ["fc1"], num_output=label_dim))
    m.add(hugectr.DenseLayer(hugectr.Layer_t.InnerProduct, ["dense"], ["fc2"], num_output=label_dim))
    kw = {"target_weight_vec": [1.0] * label_dim} if loss == hugectr.Layer_t.MultiCrossEntropyLoss else {}
    m.add(hugectr.DenseLayer(loss, loss_bottoms, ["loss"], **kw))
    return m


@pytest.mark.parametrize(
    "loss,label_dim",
    [
        (hugectr.Layer_t.BinaryCrossEntropyLoss, 1),
        (hugectr.Layer_t.MultiCrossEntropyLoss, 1),
        (hugectr.Layer_t.CrossEntropyLoss, 2),
    ],
)
def test_loss_bottoms_must_be_prediction_then_input_label(loss, label_dim):
    _dense_model(["fc1", "label"], loss, label_dim).compile()
    with pytest.raises(
        hugectr.ModelError,
        match=rf"{loss.name} \(top 'loss'\) has bottoms \['label', 'fc1'\]; "
        r"they must be \[prediction, label\].*look swapped",
    ):
        _dense_model(["label", "fc1"], loss, label_dim).compile()
    with pytest.raises(hugectr.ModelError, match=r"bottoms \['fc1', 'fc2'\].*Input's label tensors \['label'\]"):
        _dense_model(["fc1", "fc2"], loss, label_dim).compile()


# ---- non-finite loss -----------------------------------------------------------------------------
@pytest.mark.parametrize("summary", [True, False])
def test_non_finite_loss_stops_at_its_step(tmp_path, summary):
    tr, ev = tiny_data(str(tmp_path), n_train=256, n_eval=64)
    s = hugectr.CreateSolver(batchsize=32, batchsize_eval=32, i64_input_key=True, gen_loss_summary=summary)
    m = hugectr.Model(s, _norm(source=[tr], eval_source=ev), hugectr.CreateOptimizer(optimizer_type=O.SGD))
    ref = tiny_dlrm(tr, ev, batch=32)
    m.add(ref.input)
    for e in ref.embeddings:
        m.add(e.cfg)
    for layer in ref.layers:
        m.add(layer.cfg)
    m.compile()
    assert m.train() and m.train()
    fc2 = next(layer for layer in m.layers if layer.cfg.top_names == ["fc2"])
    fc2.params[0].data[0, 0] = np.inf  # a weight blows up between steps 2 and 3
    before = np.array(m.weights).copy()
    with (
        pytest.raises(
            FloatingPointError,
            match=r"non-finite training loss at iteration 3: BinaryCrossEntropyLoss "
            r"'loss' = nan; the first non-finite output is InnerProduct 'fc2' "
            r"\(its weights are non-finite\)",
        ),
        np.errstate(all="ignore"),
    ):
        m.train()  # (NumPy's own inf * 0 warnings silenced)
    assert m.step == 2
    np.testing.assert_array_equal(np.array(m.weights), before)  # no update at the bad step


def test_non_finite_loss_device_flag_names_the_first_step(tmp_path, monkeypatch):
    """gen_loss_summary=False on a GPU reads no loss per step: a device-side flag keeps the first
    non-finite iteration and is read every NONFINITE_CHECK_EVERY iterations (emulated here by treating
    the host arrays as device memory)."""
    import numbactr.model as model_mod
    from numbactr.train import overflow

    monkeypatch.setattr(overflow, "_host_memory", lambda a: False)
    monkeypatch.setattr(model_mod.Model, "NONFINITE_CHECK_EVERY", 4)
    tr, ev = tiny_data(str(tmp_path), n_train=512, n_eval=64)
    s = hugectr.CreateSolver(batchsize=32, batchsize_eval=32, i64_input_key=True, gen_loss_summary=False)
    m = hugectr.Model(s, _norm(source=[tr], eval_source=ev), hugectr.CreateOptimizer(optimizer_type=O.SGD))
    ref = tiny_dlrm(tr, ev, batch=32)
    m.add(ref.input)
    for e in ref.embeddings:
        m.add(e.cfg)
    for layer in ref.layers:
        m.add(layer.cfg)
    m.compile()
    for _ in range(5):
        assert m.train()  # iterations 1..5, the flag read at 4 is clean
    fc2 = next(layer for layer in m.layers if layer.cfg.top_names == ["fc2"])
    fc2.params[0].data[0, 0] = np.inf
    with np.errstate(all="ignore"):
        assert m.train() and m.train()  # 6 (first non-finite) and 7: not read yet
        with pytest.raises(
            FloatingPointError,
            match=r"non-finite training loss first at iteration 6, found at "
            r"iteration 8 \(with gen_loss_summary=False a GPU run checks "
            r"every 4 iterations\)",
        ):
            m.train()


# ---- hash table full -----------------------------------------------------------------------------
def test_hash_table_full_states_the_workspace_needed(tmp_path, cpu):  # cpu: raised at the step itself
    tr, ev = tiny_data(str(tmp_path), n_train=64, n_eval=64, keys_per_slot=40)
    s = hugectr.CreateSolver(batchsize=64, batchsize_eval=64, i64_input_key=True)
    m = hugectr.Model(s, _norm(source=[tr], eval_source=ev), hugectr.CreateOptimizer())  # Adam: 2 states
    ref = tiny_dlrm(tr, ev, batch=64)
    m.add(ref.input)
    m.add(
        hugectr.SparseEmbedding(
            hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 0.0001, 4, "sum", "emb", "data1"
        )
    )  # floor(0.0001 * 2^20 / (3 * 4 * 4)) = 2 rows
    for layer in ref.layers:
        m.add(layer.cfg)
    m.compile()
    with pytest.raises(HashTableFullError) as e:
        m.train()
    msg = str(e.value)
    need = e.value.used + e.value.needed
    mb = math.ceil(need * 3 * 4 * 4 / 2**20)
    assert e.value.max_rows == 2
    assert f"the keys seen so far need {need} rows" in msg
    assert (
        f"ceil(rows * (1 + 2 Adam state arrays) * 4 bytes * embedding_vec_size 4 / 2^20) = {mb} MB" in msg
        and f"set workspace_size_per_gpu_in_mb to at least {mb}" in msg
    )


# ---- graph JSON ----------------------------------------------------------------------------------
# keys whose absence the format defines (see numbactr.files.graph_json.construct); every other key is required
OPTIONAL = {
    "max_vocabulary_size_global",
    "model_name",
    "optimizer",
    "time_step",
    "axis@Concat",
    "type@sparse",
    "factor@Softmax",
    "workspace_size_per_gpu_in_mb@slot_size_array",
}


def _key_paths(obj, prefix=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _key_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            if isinstance(v, (dict, list)):
                yield from _key_paths(v, prefix + (i,))


def _optional(graph, path):
    key = path[-1]
    layer = graph["layers"][path[1]] if len(path) > 1 and path[0] == "layers" else {}
    return (
        key in OPTIONAL
        or f"{key}@{layer.get('type')}" in OPTIONAL
        or (key == "type" and "sparse" in path[:-1])
        or (key == "leading_dim" and "shape" in layer)  # numbactr's shape form beside HugeCTR's 0
        or (key == "workspace_size_per_gpu_in_mb" and "slot_size_array" in layer.get("sparse_embedding_hparam", {}))
    )


@pytest.mark.parametrize("name", sorted(sample_graphs.GRAPHS))
def test_graph_json_missing_key_names_layer_and_key(tmp_path, name):
    m = sample_graphs.build(name, str(tmp_path))
    good = tmp_path / "good.json"
    m.graph_to_json(str(good))
    graph = json.loads(good.read_text())
    bad = tmp_path / "bad.json"
    checked = 0
    for path in _key_paths(graph):
        if path == ("layers",) or (len(path) == 3 and path[2] == "type" and path[1] == 0):
            continue  # the structure itself: its own message, tested below
        g = copy.deepcopy(graph)
        parent = g
        for k in path[:-1]:
            parent = parent[k]
        del parent[path[-1]]
        bad.write_text(json.dumps(g))
        m2 = hugectr.Model(m.solver, m.reader_params, hugectr.CreateOptimizer())
        try:
            m2.construct_from_json(str(bad), include_dense_network=True)
        except ValueError as e:
            msg = str(e)
            assert repr(str(bad)) in msg, msg
            if path[0] == "layers":
                assert f"layer {path[1]} (" in msg, msg
                assert repr(path[-1]) in msg or ".".join(str(p) for p in path[2:]) in msg, (path, msg)
            checked += 1
            continue
        assert _optional(graph, path), f"removing {path} silently defaulted"
    assert checked > 20


def test_graph_json_structure_errors(tmp_path):
    tr, ev = tiny_data(str(tmp_path))
    m = tiny_dlrm(tr, ev)
    good = tmp_path / "good.json"
    m.graph_to_json(str(good))
    graph = json.loads(good.read_text())
    bad = tmp_path / "bad.json"
    cases = [
        (b"\xff\xfe{}", r"not UTF-8 text at byte offset 0"),
        (b"[1, 2]", "'layers' must be a list starting with the Data layer"),
        (json.dumps({"layers": [graph["layers"][1]]}).encode(), "starting with the Data layer"),
        (json.dumps({"layers": graph["layers"][:2] + [7]}).encode(), r"layer 2 \(None.*must be a JSON object"),
    ]
    for mutate, pattern in [
        (lambda g: g["layers"][2].update(type="Dense"), r"layer 2: layer type 'Dense' is not one of"),
        (lambda g: g["layers"][2].update(fc_param=[4]), r"layer 2 \(InnerProduct, top 'fc1'\): fc_param must be"),
        (lambda g: g["layers"][1]["optimizer"].update(type="Adamm"), r"layer 1 .*optimizer type 'Adamm'"),
        (lambda g: g["layers"][1]["optimizer"]["adam_hparam"].update(beta1=1.5), r"layer 1 .*beta1 must lie in"),
        (lambda g: g["layers"][-1].update(regularizer="L3", **{"lambda": 0.1}), r"regularizer 'L3' is not one of"),
        (lambda g: g["layers"][-1].update(bottom=["label", "fc3"]), r"bottoms \['label', 'fc3'\].*swapped"),
        (lambda g: g["layers"][0]["sparse"][0].update(slot_num=0), r"layer 0 \(Data\).*slot_num must be"),
        (lambda g: g["layers"][1]["sparse_embedding_hparam"].update(embedding_vec_size="4"), r"embedding_vec_size"),
    ]:
        g = copy.deepcopy(graph)
        mutate(g)
        cases.append((json.dumps(g).encode(), pattern))
    for data, pattern in cases:
        bad.write_bytes(data)
        m2 = hugectr.Model(m.solver, m.reader_params, hugectr.CreateOptimizer())
        with pytest.raises(ValueError, match=pattern) as e:
            m2.construct_from_json(str(bad), include_dense_network=True)
            m2.compile()
        if "swapped" not in pattern:
            assert repr(str(bad)) in str(e.value)


def test_graph_json_unknown_key_warns(tmp_path):
    """A misspelled optional key would silently leave its parameter at the default: it warns instead."""
    tr, ev = tiny_data(str(tmp_path))
    m = tiny_dlrm(tr, ev)
    path = tmp_path / "g.json"
    m.graph_to_json(str(path))
    g = json.loads(path.read_text())
    g["layers"][2]["fc_param"]["weight_innit"] = "XavierNorm"
    g["layers"][1]["sparse_embedding_hparam"]["combinr"] = "mean"
    path.write_text(json.dumps(g))
    m2 = hugectr.Model(m.solver, m.reader_params, hugectr.CreateOptimizer())
    with pytest.warns(IgnoredArgumentWarning) as rec:
        m2.construct_from_json(str(path), include_dense_network=True)
    msgs = [str(w.message) for w in rec]
    assert any(
        "layer 2 (InnerProduct, top 'fc1'): unknown key 'fc_param.weight_innit'='XavierNorm' is ignored" in x
        for x in msgs
    ), msgs
    assert any(
        "layer 1 (DistributedSlotSparseEmbeddingHash, top 'emb'): unknown key 'sparse_embedding_hparam.combinr'" in x
        for x in msgs
    ), msgs


def test_dense_layer_parameter_table_matches_the_layers():
    """Every DenseLayer parameter a layer class reads is in config._LAYER_PARAMS for its type, so no
    parameter a layer uses is ever warned about as ignored (and unused ones are)."""
    import ast
    import inspect
    import textwrap
    from numbactr.config import _DENSE_DEFAULTS, _LAYER_PARAMS
    from numbactr.layers import REGISTRY
    from numbactr.layers.shape import ReshapeSelected

    names = {("lambda_" if k == "lambda" else k) for k in _DENSE_DEFAULTS} - {"shape", "index"}  # array attrs
    for layer_type, cls in list(REGISTRY.items()) + [(hugectr.Layer_t.Reshape, ReshapeSelected)]:
        read = set()
        for klass in inspect.getmro(cls):
            if klass.__module__.startswith("numbactr.layers"):
                tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
                read |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in names}
        table = {("lambda_" if k == "lambda" else k) for k in _LAYER_PARAMS.get(layer_type.name, ())}
        assert read <= table, (layer_type.name, read - table)
    with pytest.warns(
        IgnoredArgumentWarning,
        match=r"DenseLayer ReLU \['r'\]: num_output=4 is ignored: "
        r"Layer_t.ReLU does not use it",
    ):
        hugectr.DenseLayer(hugectr.Layer_t.ReLU, ["x"], ["r"], num_output=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hugectr.DenseLayer(hugectr.Layer_t.ReLU, ["x"], ["r"], num_output=1, ranges=[])  # defaults: silent
        hugectr.DenseLayer(
            hugectr.Layer_t.BinaryCrossEntropyLoss,
            ["x", "y"],
            ["l"],
            use_regularizer=True,
            regularizer_type=hugectr.Regularizer_t.L2,
            **{"lambda": 0.1},
        )


def test_use_embedding_collection_is_accepted_without_a_warning():
    """EmbeddingCollection is supported (tests/test_embedding_collection.py): its solver flag is used, not ignored."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hugectr.CreateSolver(use_embedding_collection=True).use_embedding_collection
