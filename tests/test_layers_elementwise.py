"""numbactr/layers/elementwise.py: each layer through the tape on sim equals cpu; HugeCTR-exact
switches; Dropout eval/seed/step behaviour; WeightMultiply init; graph-JSON keys; add() validation."""

import math

import numpy as np
import pytest

import numbactr as hugectr
from numbactr import hugectr_exact as compat
from numbactr.runtime import device
from numbactr.autograd import Tape, Tensor
from numbactr.kernels import dropout as dropout_k
from numbactr.layers import RunInfo, build

L = hugectr.Layer_t
B = 6


@pytest.fixture
def exact():
    before = compat.hugectr_exact()
    yield compat.set_hugectr_exact
    compat.set_hugectr_exact(before)


def _layer(layer_type, in_shapes, **params):
    bottoms = [f"in{i}" for i in range(len(in_shapes))]
    return build(hugectr.DenseLayer(layer_type, bottoms, ["top"], **params), in_shapes)


def run_layer(dev, layer_type, inputs, dy=None, weights=(), training=True, seed=0, step=0, **params):
    """(output, input grads, weight grads) of one forward + backward through the tape on ``dev``."""
    device.set_device(dev)
    layer = _layer(layer_type, [x.shape for x in inputs], **params)
    assert list(layer.out_shapes) == [layer.out_shapes[0]]
    layer.params = [Tensor(np.asarray(w, np.float32).copy(), requires_grad=True) for w in weights]
    xs = [Tensor(np.asarray(x, np.float32).copy(), requires_grad=True) for x in inputs]
    tape = Tape()
    (out,) = layer.forward(tape, xs, RunInfo(training=training, valid=inputs[0].shape[0], seed=seed, step=step))
    assert out.shape == layer.out_shapes[0]
    if dy is None:
        dy = np.random.default_rng(99).normal(size=out.shape).astype(np.float32)
    tape.backward({id(out): (out, dy)})
    return np.array(out.data), [x.grad for x in xs], [p.grad for p in layer.params]


def assert_sim_equals_cpu(layer_type, inputs, weights=(), rtol=1e-5, atol=1e-6, **params):
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    res = {d: run_layer(d, layer_type, inputs, weights=weights, **params) for d in ("cpu", "sim")}
    (y0, g0, w0), (y1, g1, w1) = res["cpu"], res["sim"]
    np.testing.assert_allclose(y1, y0, rtol=rtol, atol=atol)
    for a, b in zip(g1 + w1, g0 + w0):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)
    return res["cpu"]


def _rand(*shape, seed=0, lo=-2.0, hi=2.0):
    return np.random.default_rng(seed + len(shape) * 7 + shape[-1]).uniform(lo, hi, shape).astype(np.float32)


# ---- sim (kernels) == cpu (references), one per layer ---------------------------------------
@pytest.mark.parametrize("layer_type,n_in", [(L.Add, 3), (L.Sub, 2), (L.ElementwiseMultiply, 3)])
def test_n_ary_layers_sim_equals_cpu(on_device, layer_type, n_in):
    xs = [_rand(B, 5, seed=k) for k in range(n_in)]
    y, grads, _ = assert_sim_equals_cpu(layer_type, xs)
    if layer_type == L.Add:
        np.testing.assert_allclose(y, xs[0] + xs[1] + xs[2], rtol=1e-6)
    if layer_type == L.Sub:
        np.testing.assert_allclose(grads[1], -grads[0])


@pytest.mark.parametrize(
    "layer_type,params", [(L.ELU, {"elu_alpha": 0.7}), (L.Sigmoid, {}), (L.ReLUHalf, {}), (L.Cast, {})]
)
def test_activation_layers_sim_equals_cpu(on_device, layer_type, params):
    x = _rand(B, 3, 4, lo=-5.0, hi=5.0)
    y, (g,), _ = assert_sim_equals_cpu(layer_type, [x], **params)
    if layer_type == L.ReLUHalf:
        np.testing.assert_array_equal(y, np.maximum(x, 0))
    if layer_type == L.Cast:
        np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("axis,factor", [(0, 3), (1, 2.9)])
def test_scale_layer_sim_equals_cpu(on_device, axis, factor):
    x = _rand(B, 4)
    y, (g,), _ = assert_sim_equals_cpu(L.Scale, [x], axis=axis, factor=factor)
    assert y.shape == ((B, 12) if axis == 0 else (B * 2, 4))


def test_dropout_layer_sim_equals_cpu(on_device):
    x = _rand(B, 7, lo=0.5, hi=2.0)  # no zeros: dropped elements are exactly the 0s
    y, (g,), _ = assert_sim_equals_cpu(L.Dropout, [x], dropout_rate=0.4, seed=5, step=3)
    assert 0 < (y == 0).sum() < y.size
    np.testing.assert_array_equal(g == 0, y == 0)  # the backward uses the forward's mask


def test_weight_multiply_layer_sim_equals_cpu(on_device):
    x, w = _rand(B, 3), _rand(3, 4, seed=1)
    y, (gx,), (gw,) = assert_sim_equals_cpu(L.WeightMultiply, [x], weights=[w], weight_dims=[3, 4])
    assert y.shape == (B, 12) and gx.shape == (B, 3) and gw.shape == (3, 4)


def test_fm_order2_layer_sim_equals_cpu(on_device):
    x = _rand(B, 20)
    y, (g,), _ = assert_sim_equals_cpu(L.FmOrder2, [x], out_dim=4)
    assert y.shape == (B, 4)


# ---- HugeCTR-exact switches ------------------------------------------------------------------
def test_multiply_gradient_switches_with_compat(on_device, exact):
    x0 = np.array([[0.0, 2.0]], np.float32)
    x1 = np.array([[3.0, 5.0]], np.float32)
    dy = np.ones((1, 2), np.float32)
    for dev in ("cpu", "sim") if device._numba_simulated() else ("cpu",):
        exact(False)
        _, (g0, g1), _ = run_layer(dev, L.ElementwiseMultiply, [x0, x1], dy)
        np.testing.assert_array_equal(g0, [[3.0, 5.0]])  # product rule
        np.testing.assert_array_equal(g1, [[0.0, 2.0]])
        exact(True)
        _, (g0, g1), _ = run_layer(dev, L.ElementwiseMultiply, [x0, x1], dy)
        np.testing.assert_array_equal(g0, [[0.0, 5.0]])  # HugeCTR: 0 wherever y == 0
        np.testing.assert_array_equal(g1, [[0.0, 2.0]])


def test_scale_gradient_switches_with_compat(on_device, exact):
    x = np.array([[1.0, 2.0]], np.float32)
    dy = np.array([[1.0, 10.0, 100.0, 1000.0]], np.float32)  # axis 0, factor 2
    for dev in ("cpu", "sim") if device._numba_simulated() else ("cpu",):
        exact(False)
        _, (g,), _ = run_layer(dev, L.Scale, [x], dy, axis=0, factor=2)
        np.testing.assert_array_equal(g, [[11.0, 1100.0]])
        exact(True)
        _, (g,), _ = run_layer(dev, L.Scale, [x], dy, axis=0, factor=2)
        np.testing.assert_array_equal(g, [[1.0, 100.0]])


# ---- Dropout: eval mode, seed/step/layer id -------------------------------------------------
def test_dropout_eval_is_identity_and_train_masks_follow_seed_and_step(on_device):
    x = _rand(B, 9, lo=0.5, hi=2.0)
    y, (g,), _ = run_layer("cpu", L.Dropout, [x], training=False, dropout_rate=0.5)
    np.testing.assert_array_equal(y, x)
    masks = {}
    for key in [(0, 0), (0, 1), (1, 0)]:
        y, _, _ = run_layer("cpu", L.Dropout, [x], seed=key[0], step=key[1], dropout_rate=0.5)
        masks[key] = y == 0
        kept = ~masks[key]
        np.testing.assert_allclose(y[kept], x[kept] * 2.0, rtol=1e-6)
    assert not np.array_equal(masks[(0, 0)], masks[(0, 1)])
    assert not np.array_equal(masks[(0, 0)], masks[(1, 0)])
    layer = _layer(L.Dropout, [x.shape], dropout_rate=0.5)
    want = ~dropout_k.dropout_mask_ref(x.size, 0.5, 0, 1, layer.layer_id).reshape(x.shape)
    np.testing.assert_array_equal(masks[(0, 1)], want)


def test_dropout_layer_ids_differ_by_top_name():
    a = build(hugectr.DenseLayer(L.Dropout, ["x"], ["drop_a"]), [(4, 4)])
    b = build(hugectr.DenseLayer(L.Dropout, ["x"], ["drop_b"]), [(4, 4)])
    assert a.layer_id != b.layer_id


# ---- WeightMultiply weights ------------------------------------------------------------------
def test_weight_multiply_params_and_initializers():
    s, v = 5, 3
    rng = np.random.default_rng(0)
    layer = _layer(L.WeightMultiply, [(B, s)], weight_dims=[s, v])
    assert layer.param_shapes() == [(s, v)]
    (w,) = layer.init_params(rng)
    assert w.shape == (s, v)
    big = build(hugectr.DenseLayer(L.WeightMultiply, ["x"], ["y"], weight_dims=[200, 50]), [(B, 200)])
    fan = 200 + 200 * 50
    (w,) = big.init_params(rng)  # Default = XavierUniform
    assert np.abs(w).max() <= math.sqrt(6.0 / fan) and np.abs(w).max() > 0.9 * math.sqrt(6.0 / fan)
    for kind, check in [
        (hugectr.Initializer_t.Uniform, lambda w: 0.9 / fan < np.abs(w).max() <= 1.0 / fan),
        (hugectr.Initializer_t.Zero, lambda w: not w.any()),
        (
            hugectr.Initializer_t.XavierNorm,
            lambda w: abs(w.std() - math.sqrt(2.0 / fan) / 0.87962566103423978) < 0.05 * w.std(),
        ),
    ]:
        layer = build(
            hugectr.DenseLayer(L.WeightMultiply, ["x"], ["y"], weight_dims=[200, 50], weight_init_type=kind), [(B, 200)]
        )
        (w,) = layer.init_params(rng)
        assert check(w), kind


# ---- graph JSON keys -------------------------------------------------------------------------
def test_json_params():
    I = hugectr.Initializer_t
    assert _layer(L.Dropout, [(B, 4)], dropout_rate=0.3).json_params() == {"rate": 0.3}
    assert _layer(L.ELU, [(B, 4)], elu_alpha=0.5).json_params() == {"elu_param": {"alpha": 0.5}}
    assert _layer(L.Scale, [(B, 4)], axis=0, factor=3).json_params() == {"scale_param": {"axis": 0, "factor": 3.0}}
    assert _layer(L.FmOrder2, [(B, 8)], out_dim=4).json_params() == {"out_dim": 4}
    assert _layer(L.WeightMultiply, [(B, 2)], weight_dims=[2, 3]).json_params() == {"weight_dims": [2, 3]}
    assert _layer(L.WeightMultiply, [(B, 2)], weight_dims=[2, 3], weight_init_type=I.Uniform).json_params() == {
        "weight_dims": [2, 3],
        "weight_init": "Uniform",
    }
    for t, n in [(L.Add, 2), (L.Sub, 2), (L.ElementwiseMultiply, 2), (L.Sigmoid, 1), (L.Cast, 1), (L.ReLUHalf, 1)]:
        assert _layer(t, [(B, 4)] * n).json_params() == {}


# ---- validation at add() through the real API -----------------------------------------------
def _model():
    solver = hugectr.CreateSolver(batchsize=8, batchsize_eval=8, i64_input_key=True)
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=["train.txt"],
        eval_source="eval.txt",
        check_type=hugectr.Check_t.Sum,
    )
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer())
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=12,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 3)],
        )
    )
    m.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc4"], num_output=4))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc3"], num_output=3))
    m.add(hugectr.DenseLayer(L.Reshape, ["dense"], ["r3d"], leading_dim=4, time_step=3))
    return m


BAD = [
    (L.Add, ["fc4"], {}, r"Add layer .*expects >= 2 bottom tensor\(s\), got 1"),
    (L.Add, ["fc4", "fc3"], {}, r"input 'fc3' has shape \(8, 3\), but 'fc4' has \(8, 4\)"),
    (L.ElementwiseMultiply, ["fc4", "fc4", "dense"], {}, r"input 'dense' has shape \(8, 12\), but 'fc4'"),
    (L.Sub, ["fc4", "fc4", "fc4"], {}, r"Sub layer .*expects 2 bottom tensor\(s\), got 3"),
    (L.Sigmoid, ["fc4", "fc4"], {}, r"expects 1 bottom tensor\(s\), got 2"),
    (L.ELU, ["fc4"], {"elu_alpha": "big"}, r"elu_alpha must be a finite number, got 'big'"),
    (L.Dropout, ["fc4"], {"dropout_rate": 1.0}, r"dropout_rate must be in \(0, 1\), got 1.0"),
    (L.Dropout, ["fc4"], {"dropout_rate": 0}, r"dropout_rate must be in \(0, 1\), got 0"),
    (L.Scale, ["r3d"], {"axis": 0, "factor": 2}, r"input 'r3d' must be 2-D \(B, N\), got shape \(8, 3, 4\)"),
    (L.Scale, ["fc4"], {"axis": 2, "factor": 2}, r"axis must be 0 .* or 1 .*, got 2"),
    (L.Scale, ["fc4"], {"axis": 0, "factor": 0.5}, r"factor must be >= 1 after the cast to int, got factor=0.5 -> 0"),
    (L.WeightMultiply, ["fc4"], {}, r"weight_dims must be two positive ints \[S, V\], got \(\)"),
    (
        L.WeightMultiply,
        ["fc4"],
        {"weight_dims": [5, 2]},
        r"weight_dims\[0\] = 5 must equal the width S = 4 of input 'fc4' \(8, 4\)",
    ),
    (L.WeightMultiply, ["r3d"], {"weight_dims": [3, 2]}, r"input 'r3d' must be 2-D \(B, S\)"),
    (L.FmOrder2, ["dense"], {"out_dim": 5}, r"width 12 of input 'dense' \(8, 12\) is not a multiple of out_dim = 5"),
    (L.FmOrder2, ["dense"], {}, r"out_dim must be a positive int .*, got 0"),
    (L.FmOrder2, ["r3d"], {"out_dim": 4}, r"input 'r3d' must be 2-D"),
]


@pytest.mark.parametrize("layer_type,bottoms,params,msg", BAD, ids=[f"{b[0].name}-{i}" for i, b in enumerate(BAD)])
def test_bad_layers_fail_at_add_with_names(layer_type, bottoms, params, msg):
    m = _model()
    with pytest.raises(hugectr.ModelError, match=msg):
        m.add(hugectr.DenseLayer(layer_type, bottoms, ["out"], **params))


def test_good_layers_get_their_shapes_at_add():
    m = _model()
    for layer_type, bottoms, top, params, shape in [
        (L.Add, ["fc4", "fc4", "fc4"], "add", {}, (8, 4)),
        (L.Sub, ["fc4", "add"], "sub", {}, (8, 4)),
        (L.ElementwiseMultiply, ["r3d", "r3d"], "mul", {}, (8, 3, 4)),
        (L.ELU, ["mul"], "elu", {}, (8, 3, 4)),
        (L.Sigmoid, ["elu"], "sig", {}, (8, 3, 4)),
        (L.ReLUHalf, ["sig"], "rh", {}, (8, 3, 4)),
        (L.Cast, ["rh"], "cast", {}, (8, 3, 4)),
        (L.Dropout, ["cast"], "drop", {"dropout_rate": 0.2}, (8, 3, 4)),
        (L.Scale, ["fc3"], "sc0", {"axis": 0, "factor": 2.5}, (8, 6)),
        (L.Scale, ["fc3"], "sc1", {"factor": 4}, (32, 3)),  # default axis is 1
        (L.WeightMultiply, ["fc3"], "wm", {"weight_dims": [3, 5]}, (8, 15)),
        (L.FmOrder2, ["dense"], "fm", {"out_dim": 4}, (8, 4)),
    ]:
        m.add(hugectr.DenseLayer(layer_type, bottoms, [top], **params))
        assert m.shapes[top] == shape, (top, m.shapes[top])


# ---- a model built from these layers: one training step on sim equals cpu -------------------
def _mixed_model(train, evl, batch=16):
    solver = hugectr.CreateSolver(
        batchsize=batch, batchsize_eval=batch, lr=0.05, vvgpu=[[0]], i64_input_key=True, seed=3
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[train], eval_source=evl, check_type=hugectr.Check_t.Sum
    )
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.Adam))
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 3)],
        )
    )
    m.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=4,
            combiner="sum",
            sparse_embedding_name="emb",
            bottom_name="data1",
        )
    )
    for layer_type, bottoms, top, params in [
        (L.Reshape, ["emb"], "flat", {"leading_dim": 12}),
        (L.FmOrder2, ["flat"], "fm", {"out_dim": 4}),
        (L.WeightMultiply, ["dense"], "wm", {"weight_dims": [2, 6]}),
        (L.Add, ["flat", "wm"], "add", {}),
        (L.Sub, ["flat", "wm"], "sub", {}),
        (L.ElementwiseMultiply, ["add", "sub", "flat"], "mul", {}),
        (L.ELU, ["mul"], "elu", {"elu_alpha": 0.5}),
        (L.Dropout, ["elu"], "drop", {"dropout_rate": 0.25}),
        (L.Cast, ["drop"], "cast", {}),
        (L.Scale, ["cast"], "scale", {"axis": 0, "factor": 2}),
        (L.InnerProduct, ["scale"], "fc1", {"num_output": 4}),
        (L.Sigmoid, ["fc1"], "sig", {}),
        (L.ReLUHalf, ["fm"], "rh", {}),
        (L.Concat, ["sig", "rh"], "cat", {}),
        (L.InnerProduct, ["cat"], "fc2", {"num_output": 1}),
        (L.BinaryCrossEntropyLoss, ["fc2", "label"], "loss", {}),
    ]:
        m.add(hugectr.DenseLayer(layer_type, bottoms, [top], **params))
    m.compile()
    return m


def test_model_with_these_layers_trains_one_step_on_sim_like_cpu(tmp_path, on_device):
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    from tests.model_util import tiny_data

    data = tiny_data(str(tmp_path), n_train=64, n_eval=32)
    states = {}
    for dev in ("cpu", "sim"):
        on_device(dev)
        model = _mixed_model(*data)
        assert model.train() and model.train()  # two steps: two dropout masks
        states[dev] = (model.get_current_loss(), np.array(model.weights))
    (l0, w0), (l1, w1) = states["cpu"], states["sim"]
    assert math.isfinite(l0)
    assert l1 == pytest.approx(l0, rel=1e-5)
    np.testing.assert_allclose(w1, w0, rtol=1e-4, atol=1e-6)
