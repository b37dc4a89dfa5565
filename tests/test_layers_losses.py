"""CrossEntropyLoss / MultiCrossEntropyLoss layers through the HugeCTR API: add()-time validation,
tape forward/backward on sim equal to cpu, predictions, regularizer settings, graph-JSON keys, and a
tiny model that learns with each loss."""

import os

import numpy as np
import pytest

import numbactr as hugectr
from numbactr import hugectr_exact as compat
from numbactr.runtime import device
from numbactr.autograd import Tape, Tensor
from numbactr.data.file_list import write_file_list
from numbactr.data.norm import write_norm_file
from numbactr.layers import RunInfo, build
from numbactr.layers.losses import CrossEntropyLoss, RegularizedLoss

L = hugectr.Layer_t


@pytest.fixture
def exact_mode():
    before = compat.hugectr_exact()
    yield compat.set_hugectr_exact
    compat.set_hugectr_exact(before)


def _model(label_dim=2, dense_dim=3, source=("/nonexistent/_file_list.txt",), batch=8, lr=0.001):
    s = hugectr.CreateSolver(batchsize=batch, batchsize_eval=batch, i64_input_key=True, lr=lr)
    r = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=list(source),
        eval_source=source[0],
        check_type=hugectr.Check_t.Sum,
    )
    m = hugectr.Model(s, r, hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.SGD))
    m.add(
        hugectr.Input(
            label_dim=label_dim,
            label_name="label",
            dense_dim=dense_dim,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 2)],
        )
    )
    return m


# ---- validation at add() -----------------------------------------------------------------------
def test_cross_entropy_validation():
    m = _model(label_dim=2)
    m.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc3"], num_output=3))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc2"], num_output=2))
    with pytest.raises(hugectr.ModelError, match=r"CrossEntropyLoss.*logits 'fc3' must be \(B, 2\).*\(8, 3\)"):
        m.add(hugectr.DenseLayer(L.CrossEntropyLoss, ["fc3", "label"], ["loss"]))
    with pytest.raises(hugectr.ModelError, match=r"label 'fc3' \(8, 3\) does not match logits 'fc2' \(8, 2\)"):
        m.add(hugectr.DenseLayer(L.CrossEntropyLoss, ["fc2", "fc3"], ["loss"]))
    with pytest.raises(hugectr.ModelError, match="expects 2 bottom"):
        m.add(hugectr.DenseLayer(L.CrossEntropyLoss, ["fc2"], ["loss"]))
    with pytest.raises(hugectr.ModelError, match=r"lambda must be a finite number >= 0, got -0.5"):
        m.add(
            hugectr.DenseLayer(L.CrossEntropyLoss, ["fc2", "label"], ["loss"], use_regularizer=True, **{"lambda": -0.5})
        )
    with pytest.raises(hugectr.ModelError, match=r"regularizer_type must be Regularizer_t.L1 or .*'L3'"):
        m.add(
            hugectr.DenseLayer(
                L.CrossEntropyLoss,
                ["fc2", "label"],
                ["loss"],
                use_regularizer=True,
                regularizer_type="L3",
                **{"lambda": 0.1},
            )
        )
    m.add(hugectr.DenseLayer(L.CrossEntropyLoss, ["fc2", "label"], ["loss"]))
    assert m.layers[-1].regularizer is None


def test_cross_entropy_accepts_class_label_column():
    m = _model(label_dim=1)
    m.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc2"], num_output=2))
    m.add(hugectr.DenseLayer(L.CrossEntropyLoss, ["fc2", "label"], ["loss"]))
    assert m.layers[-1].out_shapes == [(1,)]


def test_multi_cross_entropy_validation():
    m = _model(label_dim=3)
    m.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc3"], num_output=3))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc2"], num_output=2))
    with pytest.raises(hugectr.ModelError, match=r"target_weight_vec is required.*3 for logits 'fc3' \(8, 3\)"):
        m.add(hugectr.DenseLayer(L.MultiCrossEntropyLoss, ["fc3", "label"], ["loss"]))
    with pytest.raises(
        hugectr.ModelError,
        match=r"target_weight_vec has 2 weights, but logits 'fc3' \(8, 3\) "
        r"have 3 targets",
    ):
        m.add(hugectr.DenseLayer(L.MultiCrossEntropyLoss, ["fc3", "label"], ["loss"], target_weight_vec=[1, 2]))
    with pytest.raises(hugectr.ModelError, match=r"label 'label' \(8, 3\) must have the shape of logits 'fc2'"):
        m.add(hugectr.DenseLayer(L.MultiCrossEntropyLoss, ["fc2", "label"], ["loss"], target_weight_vec=[1, 1]))
    with pytest.raises(hugectr.ModelError, match="target_weight_vec must be finite"):
        m.add(
            hugectr.DenseLayer(
                L.MultiCrossEntropyLoss, ["fc3", "label"], ["loss"], target_weight_vec=[1, float("nan"), 1]
            )
        )
    with pytest.raises(hugectr.ModelError, match="target_weight_vec must hold numbers"):
        m.add(hugectr.DenseLayer(L.MultiCrossEntropyLoss, ["fc3", "label"], ["loss"], target_weight_vec=[1, "a", 1]))
    m.add(
        hugectr.DenseLayer(
            L.MultiCrossEntropyLoss,
            ["fc3", "label"],
            ["loss"],
            target_weight_vec=[1, 0.5, 2],
            use_regularizer=True,
            regularizer_type=hugectr.Regularizer_t.L1,
            **{"lambda": 0.01},
        )
    )
    layer = m.layers[-1]
    assert layer.regularizer == (hugectr.Regularizer_t.L1, 0.01)
    assert layer.label_name == "label"
    assert layer.json_params() == {"target_weight": [1.0, 0.5, 2.0], "regularizer": "L1", "lambda": 0.01}


def test_json_params_and_mixin():
    cfg = hugectr.DenseLayer(
        L.CrossEntropyLoss,
        ["x", "y"],
        ["loss"],
        use_regularizer=True,
        regularizer_type=hugectr.Regularizer_t.L2,
        **{"lambda": 2},
    )
    layer = build(cfg, [(4, 2), (4, 2)])
    assert isinstance(layer, CrossEntropyLoss) and isinstance(layer, RegularizedLoss) and layer.is_loss
    assert layer.regularizer == (hugectr.Regularizer_t.L2, 2.0)
    assert layer.json_params() == {"regularizer": "L2", "lambda": 2.0}
    plain = build(hugectr.DenseLayer(L.CrossEntropyLoss, ["x", "y"], ["loss"], **{"lambda": 2}), [(4, 2), (4, 1)])
    assert plain.regularizer is None and plain.json_params() == {}


# ---- tape forward/backward: sim equals cpu ----------------------------------------------------
def _run_layer(layer, x, y, valid, scaler=1.0, ranks=1):
    xt = Tensor(x.copy(), name="x", requires_grad=True)
    yt = Tensor(y.copy(), name="y")
    tape = Tape()
    (loss,) = layer.forward(tape, [xt, yt], RunInfo(training=True, valid=valid, ranks=ranks, scaler=scaler))
    tape.backward({id(loss): (loss, np.ones((1,), np.float32))})
    return float(np.asarray(loss.data)[0]), np.asarray(xt.grad), np.asarray(layer.predictions())


def _both_devices(on_device, layer, x, y, valid, **kw):
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    out = {}
    for name in ("cpu", "sim"):
        on_device(name)
        out[name] = _run_layer(layer, x, y, valid, **kw)
    (l0, g0, p0), (l1, g1, p1) = out["cpu"], out["sim"]
    assert l1 == pytest.approx(l0, rel=1e-5)
    np.testing.assert_allclose(g1, g0, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(p1, p0, rtol=1e-5, atol=1e-8)
    return out["cpu"]


@pytest.mark.parametrize("exact", [False, True])
def test_cross_entropy_layer_sim_equals_cpu(on_device, exact_mode, exact):
    exact_mode(exact)
    rng = np.random.default_rng(5)
    x = rng.normal(scale=2.0, size=(12, 2)).astype(np.float32)
    y = (rng.uniform(size=(12, 2)) > 0.5).astype(np.float32)
    layer = build(hugectr.DenseLayer(L.CrossEntropyLoss, ["x", "y"], ["loss"]), [(12, 2), (12, 2)])
    loss, grad, pred = _both_devices(on_device, layer, x, y, valid=10, scaler=4.0, ranks=2)
    from numbactr.kernels import cross_entropy as ce

    want_loss, want_dx = ce.cross_entropy_forward_backward_ref(x, y, 10, 4.0 / (10 * 2), hugectr_label=exact)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    np.testing.assert_allclose(grad, want_dx, rtol=1e-6)
    assert not grad[10:].any()
    np.testing.assert_allclose(pred.sum(axis=1), 1.0, rtol=1e-6)


def test_cross_entropy_exact_mode_reads_the_label_buffer(on_device, exact_mode):
    on_device("cpu")
    x = np.zeros((3, 2), np.float32)
    y = np.array([[0.0, 1.0], [0.0, 0.0], [1.0, 1.0]], np.float32)  # flat 0 1 0 0 1 1
    layer = build(hugectr.DenseLayer(L.CrossEntropyLoss, ["x", "y"], ["loss"]), [(3, 2), (3, 2)])
    exact_mode(False)
    _, g_col, _ = _run_layer(layer, x, y, 3)
    exact_mode(True)
    _, g_buf, _ = _run_layer(layer, x, y, 3)
    np.testing.assert_allclose(g_col[:, 1] * 3, [0.5, 0.5, -0.5])  # classes 0 0 1 (column 0)
    np.testing.assert_allclose(g_buf[:, 1] * 3, [0.5, -0.5, 0.5])  # classes 0 1 0 (first 3 floats)


def test_multi_cross_entropy_layer_sim_equals_cpu(on_device):
    rng = np.random.default_rng(6)
    x = rng.normal(scale=2.0, size=(9, 3)).astype(np.float32)
    y = rng.uniform(size=(9, 3)).astype(np.float32)
    y[rng.uniform(size=(9, 3)) < 0.25] = -1.0
    tw = [1.0, 0.5, 2.0]
    layer = build(
        hugectr.DenseLayer(L.MultiCrossEntropyLoss, ["x", "y"], ["loss"], target_weight_vec=tw), [(9, 3), (9, 3)]
    )
    loss, grad, pred = _both_devices(on_device, layer, x, y, valid=7, scaler=2.0)
    from numbactr.kernels import multi_cross_entropy as mce

    want_loss, want_dx = mce.multi_cross_entropy_forward_backward_ref(x, y, np.array(tw, np.float32), 7, 2.0 / (7 * 3))
    assert loss == pytest.approx(want_loss, rel=1e-6)
    np.testing.assert_allclose(grad, want_dx, rtol=1e-6)
    assert not grad[7:].any() and not grad[y < -0.5].any()
    np.testing.assert_allclose(pred, 1 / (1 + np.exp(-x)), rtol=1e-6)


# ---- a tiny model learns with each loss (cpu) ---------------------------------------------------
def _data(folder, n, label_dim, kind):
    rng = np.random.default_rng(11)
    dense = rng.normal(size=(n, 3)).astype(np.float32)
    score = dense @ np.array([1.5, -2.0, 1.0])
    if kind == "ce":
        cls = (score > 0).astype(np.float32)
        label = np.stack([cls, 1 - cls], axis=1)  # column 0 is the class
    else:
        label = np.stack([(score > 0), (score < 0.5), (dense[:, 0] > 0)], axis=1).astype(np.float32)
        label[rng.uniform(size=label.shape) < 0.1] = -1.0  # some labels missing
    keys = rng.integers(0, 4, (n, 2)).astype(np.int64)
    path = os.path.join(folder, "part0.data")
    write_norm_file(path, label, dense, keys, key_dtype=np.int64)
    lst = os.path.join(folder, "_file_list.txt")
    write_file_list(lst, [path])
    return lst


@pytest.mark.parametrize("kind", ["ce", "mce"])
def test_tiny_model_learns(tmp_path, on_device, kind):
    on_device("cpu")
    label_dim = 2 if kind == "ce" else 3
    lst = _data(str(tmp_path), 256, label_dim, kind)
    m = _model(label_dim=label_dim, source=(lst,), batch=32, lr=0.5)
    m.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc1"], num_output=8))
    m.add(hugectr.DenseLayer(L.ReLU, ["fc1"], ["relu1"]))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["relu1"], ["out"], num_output=label_dim))
    if kind == "ce":
        m.add(hugectr.DenseLayer(L.CrossEntropyLoss, ["out", "label"], ["loss"]))
    else:
        m.add(
            hugectr.DenseLayer(L.MultiCrossEntropyLoss, ["out", "label"], ["loss"], target_weight_vec=[1.0, 1.0, 0.5])
        )
    m.compile()
    losses = []
    for _ in range(80):
        assert m.train()
        losses.append(m.get_current_loss())
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-8:]) < 0.7 * np.mean(losses[:8]), (losses[:8], losses[-8:])
