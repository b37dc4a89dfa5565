"""MLP, FusedInnerProduct, MultiCross: fused bias+act and cross kernels (sim) vs references, float64
gradient checks (inputs and weights), layer sim == cpu, init distributions, validation at add()."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import numbactr as hugectr
from numbactr.config import DenseLayer
from numbactr.enums import Activation_t, FcPosition_t, Initializer_t, Layer_t
from numbactr.kernels import fused_bias_act as fba
from numbactr.kernels import multi_cross as mc
from numbactr.layers import build
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host
from tests.layer_util import assert_sim_matches_cpu, run_layer, small_model
from tests.model_util import tiny_data

POW2 = st.sampled_from([1, 2, 4, 8, 16, 32])


@st.composite
def matrices(draw, max_rows=10, max_cols=6):
    m = draw(st.integers(1, max_rows))
    n = draw(st.integers(1, max_cols))
    return draw(f32_arrays((m, n), -3.0, 3.0))


# ---- fused bias + activation -------------------------------------------------------------------
@given(y=matrices(), relu=st.booleans(), has_bias=st.booleans())
def test_bias_act_forward_kernel_matches_ref(y, relu, has_bias):
    b = np.linspace(-1, 1, y.shape[1]).astype(np.float32) if has_bias else None
    d = dev(y)
    fba.bias_act_forward(d, dev(b) if has_bias else None, relu)
    np.testing.assert_allclose(host(d), fba.bias_act_forward_ref(y, b, relu), rtol=1e-6, atol=1e-6)


@given(
    pre=matrices(max_rows=20),
    relu=st.booleans(),
    has_bias=st.booleans(),
    chunk=st.integers(1, 7),
    gx=st.integers(1, 3),
    gy=st.integers(1, 3),
)
def test_bias_act_backward_kernel_any_grid_matches_ref(pre, relu, has_bias, chunk, gx, gy):
    """The tiled backward (columns coalesced, rows in chunks, chunk partials summed in order): the masked
    gradient exactly, the bias gradient to rounding, and the same bits whatever the grid."""
    y = fba.bias_act_forward_ref(pre, None, relu)
    dy = np.random.default_rng(pre.size).normal(size=pre.shape).astype(np.float32)
    got = []
    for grid in ((gx, gy), (1, 1)):
        d, db = dev(np.full_like(y, np.nan)), dev(np.full(y.shape[1], np.nan, np.float32))
        fba.bias_act_backward(dev(y), dev(dy), relu, d, db if has_bias else None, chunk=chunk, grid=grid)
        got.append((host(d).copy(), host(db).copy()))
    rd, rdb = fba.bias_act_backward_ref(y, dy.astype(np.float64), relu, has_bias)
    np.testing.assert_allclose(got[0][0], rd, rtol=1e-6)
    np.testing.assert_array_equal(got[0][0], got[1][0])
    if has_bias:
        np.testing.assert_allclose(got[0][1], rdb, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got[0][1], got[1][1])
    else:
        assert np.all(np.isnan(got[0][1]))  # untouched without a bias


def test_bias_act_wrappers_edge_cases():
    y = np.array([[0.0, -1.0], [2.0, 0.0]], np.float32)  # exact zeros: ReLU mask is y > 0
    d, db = dev(np.zeros_like(y)), dev(np.zeros(2, np.float32))
    fba.bias_act_backward(dev(y), dev(np.ones_like(y)), True, d, db)
    np.testing.assert_array_equal(host(d), [[0, 0], [1, 0]])
    np.testing.assert_array_equal(host(db), [1, 0])
    empty = np.zeros((0, 2), np.float32)
    db = dev(np.full(2, np.nan, np.float32))
    fba.bias_act_backward(dev(empty), dev(empty), True, dev(empty), db)
    np.testing.assert_array_equal(host(db), [0, 0])
    fba.bias_act_forward(dev(empty), dev(np.zeros(2, np.float32)), True)
    with pytest.raises(ValueError):
        fba.bias_act_forward(dev(y), dev(np.zeros(3, np.float32)), True)


def test_fc_bias_act_reference_gradients_float64():
    from numbactr.runtime import device
    from numbactr.ops.dense import FcBiasAct
    from numbactr.autograd import Context

    before = device.kind()
    device.set_device("cpu")
    try:
        rng = np.random.default_rng(0)
        x, w, b = rng.normal(size=(5, 4)), rng.normal(size=(4, 3)), rng.normal(size=3)
        dy = rng.normal(size=(5, 3))
        ctx = Context()
        ctx.needs_input_grad = (True, True, True)
        with device.reference_ops():  # the float64 references, not the float32 compiled ops
            FcBiasAct.forward(ctx, x, w, b, relu=True)
            dx, dw, db = FcBiasAct.backward(ctx, dy)

        def f(x_=x, w_=w, b_=b):
            return fba.bias_act_forward_ref(x_ @ w_, b_, True)

        assert_grad_close(dx, lambda v: f(x_=v), x, dy)
        assert_grad_close(dw, lambda v: f(w_=v), w, dy)
        assert_grad_close(db, lambda v: f(b_=v), b, dy)
    finally:
        device.set_device(before)


# ---- MultiCross kernels ------------------------------------------------------------------------
@given(x0=matrices(max_rows=4, max_cols=12), tpb=POW2, blocks=st.integers(1, 3), first=st.booleans())
def test_multicross_v1_kernels_any_grid_match_ref(x0, tpb, blocks, first):
    b, d = x0.shape
    rng = np.random.default_rng(d)
    xl, g = rng.normal(size=(b, d)).astype(np.float32), rng.normal(size=(b, d)).astype(np.float32)
    w, bias = rng.normal(size=d).astype(np.float32), rng.normal(size=d).astype(np.float32)
    out, h = dev(np.full_like(x0, np.nan)), dev(np.full(b, np.nan, np.float32))
    mc.make_v1_forward_kernel(tpb)[blocks, tpb](dev(x0), dev(xl), dev(w), dev(bias), out, h)
    h64 = xl.astype(np.float64) @ w
    np.testing.assert_allclose(host(h), h64, rtol=1e-4, atol=1e-3)
    # downstream checks use the kernel's own h / dh, so float32 rounding of a long dot product
    # (|h| up to ~100) is not amplified into the comparison
    np.testing.assert_allclose(host(out), x0 * host(h)[:, None] + xl + bias, rtol=1e-5, atol=1e-4)
    acc0 = rng.normal(size=(b, d)).astype(np.float32)
    dx0, dxl, dh = dev(acc0), dev(np.full_like(x0, np.nan)), dev(np.full(b, np.nan, np.float32))
    mc.make_v1_backward_rows_kernel(tpb)[blocks, tpb](dev(g), dev(x0), dev(w), h, np.int32(first), dx0, dxl, dh)
    dh64 = (g.astype(np.float64) * x0).sum(axis=1)
    np.testing.assert_allclose(host(dh), dh64, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(host(dx0), (0 if first else acc0) + g * host(h)[:, None], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(host(dxl), g + host(dh)[:, None] * w, rtol=1e-5, atol=1e-4)
    dw, db = dev(np.full(d, np.nan, np.float32)), dev(np.full(d, np.nan, np.float32))
    mc.make_v1_param_grad_kernel(tpb)[blocks, tpb](dev(g), dev(xl), dh, dw, db)
    np.testing.assert_allclose(host(dw), xl.T.astype(np.float64) @ host(dh), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(host(db), g.sum(axis=0), rtol=1e-5, atol=1e-5)


@given(x0=matrices(max_rows=6, max_cols=5), first=st.booleans())
def test_multicross_v2_elementwise_kernels_match_ref(x0, first):
    rng = np.random.default_rng(x0.size)
    xl, z, g, acc = (rng.normal(size=x0.shape).astype(np.float32) for _ in range(4))
    b = rng.normal(size=x0.shape[1]).astype(np.float32)
    out = dev(np.zeros_like(x0))
    mc.v2_forward(dev(x0), dev(xl), dev(z), dev(b), out)
    np.testing.assert_allclose(host(out), x0 * (z + b) + xl, rtol=1e-5, atol=1e-5)
    dz, dx0 = dev(np.zeros_like(x0)), dev(acc)
    mc.v2_backward(dev(g), dev(x0), dev(z), dev(b), first, dz, dx0)
    np.testing.assert_allclose(host(dz), g * x0, rtol=1e-6)
    np.testing.assert_allclose(host(dx0), (0 if first else acc) + g * (z + b), rtol=1e-5, atol=1e-5)


# ---- MultiCross, compiled CPU versions (the cpu device's path) ---------------------------------------
@given(x0=matrices(max_rows=9, max_cols=13), first=st.booleans())
def test_multicross_v1_compiled_cpu_matches_formulas(x0, first):
    b, d = x0.shape
    rng = np.random.default_rng(x0.size)
    xl, g, acc0 = (rng.normal(size=(b, d)).astype(np.float32) for _ in range(3))
    w, bias = rng.normal(size=d).astype(np.float32), rng.normal(size=d).astype(np.float32)
    out, h = np.full_like(x0, np.nan), np.full(b, np.nan, np.float32)
    mc.v1_forward_cpu(x0, xl, w, bias, out, h)
    np.testing.assert_allclose(h, xl.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, x0 * h[:, None] + xl + bias, rtol=1e-6, atol=1e-6)
    dx0, dxl, dh = acc0.copy(), np.full_like(x0, np.nan), np.full(b, np.nan, np.float32)
    dw, db = np.full(d, np.nan, np.float32), np.full(d, np.nan, np.float32)
    mc.v1_backward_cpu(g, x0, xl, w, h, first, dx0, dxl, dh, dw, db)
    np.testing.assert_allclose(dh, (g.astype(np.float64) * x0).sum(axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx0, (0 if first else acc0) + g * h[:, None], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dxl, g + dh[:, None] * w, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dw, xl.T.astype(np.float64) @ dh, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, g.sum(axis=0), rtol=1e-5, atol=1e-6)


@given(x0=matrices(max_rows=9, max_cols=13), first=st.booleans(), with_gm=st.booleans())
def test_multicross_v2_compiled_cpu_elementwise_matches_formulas(x0, first, with_gm):
    rng = np.random.default_rng(x0.size)
    xl, z, g, gm, acc = (rng.normal(size=x0.shape).astype(np.float32) for _ in range(5))
    b = rng.normal(size=x0.shape[1]).astype(np.float32)
    out = np.full_like(x0, np.nan)
    mc.v2_forward_cpu(x0, xl, z, b, out)
    np.testing.assert_array_equal(out, x0 * (z + b) + xl)  # the same float32 operations in the same order
    gl = (g + gm) if with_gm else g  # the layer's gradient
    gm_arg = gm.copy() if with_gm else None
    dz, dx0, db = np.full_like(x0, np.nan), acc.copy(), np.full(x0.shape[1], np.nan, np.float32)
    mc.v2_backward_cpu(g, gm_arg, x0, z, b, first, dz, dx0, db)
    np.testing.assert_array_equal(dz, gl * x0)
    np.testing.assert_array_equal(dx0, gl * (z + b) if first else acc + gl * (z + b))
    np.testing.assert_allclose(db, (gl * x0).sum(axis=0), rtol=1e-5, atol=1e-6)
    if with_gm:
        np.testing.assert_array_equal(gm_arg, gl)  # gm now holds the layer's gradient


def test_multicross_compiled_cpu_parallel_branch_same_bits_on_two_threads():
    """Past PARALLEL_MIN the row passes run under prange: the same bits on 1 and 2 threads (fixed chunks)."""
    import numba

    from numbactr.kernels.parallel_cpu import PARALLEL_MIN

    rng = np.random.default_rng(5)
    x0, xl, g, z = (rng.normal(size=(PARALLEL_MIN // 64 + 3, 64)).astype(np.float32) for _ in range(4))
    w, bias = rng.normal(size=64).astype(np.float32), rng.normal(size=64).astype(np.float32)

    def run():
        out, h = np.empty_like(x0), np.empty(x0.shape[0], np.float32)
        mc.v1_forward_cpu(x0, xl, w, bias, out, h)
        dx0, dxl, dh, dw, db = (
            np.empty_like(x0),
            np.empty_like(x0),
            np.empty_like(h),
            np.empty_like(w),
            np.empty_like(w),
        )
        mc.v1_backward_cpu(g, x0, xl, w, h, True, dx0, dxl, dh, dw, db)
        out2, dz, dx02, db2, gm = np.empty_like(x0), np.empty_like(x0), np.zeros_like(x0), np.empty_like(w), xl.copy()
        mc.v2_forward_cpu(x0, xl, z, bias, out2)
        mc.v2_backward_cpu(g, gm, x0, z, bias, False, dz, dx02, db2)
        return out, h, dx0, dxl, dh, dw, db, out2, dz, dx02, db2

    before, runs = numba.get_num_threads(), []
    try:
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(n)
            runs.append(run())
    finally:
        numba.set_num_threads(before)
    for a, b in zip(runs[0], runs[-1]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(runs[0][5], xl.T.astype(np.float64) @ runs[0][4], rtol=1e-4, atol=1e-2)
    np.testing.assert_allclose(runs[0][10], ((g + xl) * x0).sum(axis=0), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (3, 5), (257, 17), (600, 3)])
@pytest.mark.parametrize("proj", [0, 1, 4])
def test_multicross_layer_compiled_cpu_matches_reference_ops(cpu, shape, proj):
    """The whole stack on the cpu device, compiled vs NumPy references: output, input and parameter gradients."""
    from numbactr.runtime import device

    cfg = DenseLayer(Layer_t.MultiCross, ["a"], ["b"], num_layers=3, projection_dim=proj)
    got = run_layer("cpu", cfg, shape, param_noise=0.3)
    with device.reference_ops():
        want = run_layer("cpu", cfg, shape, param_noise=0.3)
    np.testing.assert_allclose(got[1][0], want[1][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-4, atol=1e-4)
    for a, b in zip(got[3], want[3]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(b).max())))


def test_multicross_v1_reference_gradients_float64():
    rng = np.random.default_rng(0)
    bsz, d, n = 4, 5, 3
    x0, dy = rng.normal(size=(bsz, d)), rng.normal(size=(bsz, d))
    ws = [rng.normal(size=d) * 0.5 for _ in range(n)]
    bs = [rng.normal(size=d) for _ in range(n)]
    _, xs, hs = mc.multi_cross_v1_forward_ref(x0, ws, bs)
    dx, dws, dbs = mc.multi_cross_v1_backward_ref(dy, x0, ws, xs, hs)
    assert_grad_close(dx, lambda v: mc.multi_cross_v1_forward_ref(v, ws, bs)[0], x0, dy)
    for layer in range(n):

        def fw(v, layer=layer):
            return mc.multi_cross_v1_forward_ref(x0, ws[:layer] + [v] + ws[layer + 1 :], bs)[0]

        def fb(v, layer=layer):
            return mc.multi_cross_v1_forward_ref(x0, ws, bs[:layer] + [v] + bs[layer + 1 :])[0]

        assert_grad_close(dws[layer], fw, ws[layer], dy)
        assert_grad_close(dbs[layer], fb, bs[layer], dy)


def test_multicross_v2_reference_gradients_float64():
    rng = np.random.default_rng(1)
    bsz, d, p, n = 3, 4, 2, 2
    x0, dy = rng.normal(size=(bsz, d)), rng.normal(size=(bsz, d))
    us = [rng.normal(size=(d, p)) * 0.5 for _ in range(n)]
    vs = [rng.normal(size=(p, d)) * 0.5 for _ in range(n)]
    bs = [rng.normal(size=d) for _ in range(n)]
    _, xs, zs = mc.multi_cross_v2_forward_ref(x0, us, vs, bs)
    dx, dus, dvs, dbs = mc.multi_cross_v2_backward_ref(dy, x0, us, vs, bs, xs, zs)
    assert_grad_close(dx, lambda v: mc.multi_cross_v2_forward_ref(v, us, vs, bs)[0], x0, dy)

    def swap(lst, i, v):
        return lst[:i] + [v] + lst[i + 1 :]

    for i in range(n):
        assert_grad_close(
            dus[i], lambda v, i=i: mc.multi_cross_v2_forward_ref(x0, swap(us, i, v), vs, bs)[0], us[i], dy
        )
        assert_grad_close(
            dvs[i], lambda v, i=i: mc.multi_cross_v2_forward_ref(x0, us, swap(vs, i, v), bs)[0], vs[i], dy
        )
        assert_grad_close(
            dbs[i], lambda v, i=i: mc.multi_cross_v2_forward_ref(x0, us, vs, swap(bs, i, v))[0], bs[i], dy
        )


# ---- layer level: sim == cpu -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg,shape",
    [
        (
            DenseLayer(
                Layer_t.MLP,
                ["a"],
                ["b"],
                num_outputs=[5, 4, 2],
                biases=[True, False, True],
                activations=[Activation_t.Relu, Activation_t.Relu, Activation_t.Non],
            ),
            (6, 3),
        ),
        (DenseLayer(Layer_t.FusedInnerProduct, ["a"], ["b"], num_output=3), (5, 4)),
        (DenseLayer(Layer_t.MultiCross, ["a"], ["b"], num_layers=3), (4, 6)),
        (DenseLayer(Layer_t.MultiCross, ["a"], ["b"], num_layers=2, projection_dim=2), (4, 6)),
    ],
    ids=["mlp", "fused-ip", "dcn-v1", "dcn-v2"],
)
def test_layer_sim_matches_cpu(cfg, shape):
    assert_sim_matches_cpu(cfg, shape)


def test_mlp_params_order_and_default_init_distribution():
    layer = build(DenseLayer(Layer_t.MLP, ["a"], ["b"], num_outputs=[400, 3], use_bias=False), [(2, 100)])
    assert layer.out_shapes == [(2, 3)]
    assert layer.param_shapes() == [(100, 400), (400,), (400, 3), (3,)]  # biases allocated anyway
    w0, b0, w1, b1 = layer.init_params(np.random.default_rng(0))
    for a, fan_in in ((w0, 100), (b0, 100), (w1, 400), (b1, 400)):
        lim = np.sqrt(1.0 / fan_in)
        assert np.abs(a).max() <= lim and (a.size < 100 or np.abs(a).max() > 0.9 * lim)
    assert np.std(w0) == pytest.approx(np.sqrt(1.0 / 100) / np.sqrt(3), rel=0.02)


def test_multicross_param_order_and_init():
    v1 = build(DenseLayer(Layer_t.MultiCross, ["a"], ["b"], num_layers=2), [(2, 400)])
    assert v1.param_shapes() == [(1, 400)] * 4
    w0, b0, w1, b1 = v1.init_params(np.random.default_rng(0))
    assert np.std(w0) == pytest.approx(np.sqrt(1 / 400), rel=0.1) and not b0.any() and not b1.any()
    v2 = build(DenseLayer(Layer_t.MultiCross, ["a"], ["b"], num_layers=1, projection_dim=20), [(2, 400)])
    assert v2.param_shapes() == [(400, 20), (20, 400), (1, 400)]
    u, v, b = v2.init_params(np.random.default_rng(0))
    assert np.std(u) == pytest.approx(np.sqrt(2 / 420), rel=0.05) and not b.any()
    assert v2.json_params() == {"mc_param": {"num_layers": 1, "projection_dim": 20}}


def test_fused_inner_product_chain_head_body_tail():
    """Head/Body tops 2-3 alias top 1 and top 4 is (1, N) zeros; a chain computes act(XW+b) per step."""
    from numbactr.runtime import device
    from numbactr.autograd import Tape, Tensor
    from numbactr.layers import RunInfo

    device.set_device("cpu")
    x = Tensor(np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32), requires_grad=True)
    head = build(
        DenseLayer(Layer_t.FusedInnerProduct, ["x"], ["h", "hm", "hd", "hb"], num_output=5, pos_type=FcPosition_t.Head),
        [(4, 3)],
    )
    assert head.out_shapes == [(4, 5), (4, 5), (4, 5), (1, 5)]
    tail = build(
        DenseLayer(
            Layer_t.FusedInnerProduct,
            ["h", "hm", "hd", "hb"],
            ["t"],
            num_output=2,
            pos_type=FcPosition_t.Tail,
            act_type=Activation_t.Non,
        ),
        head.out_shapes,
    )
    rng = np.random.default_rng(1)
    for layer in (head, tail):
        layer.params = [Tensor(np.asarray(p, np.float32), requires_grad=True) for p in layer.init_params(rng)]
    tape = Tape()
    run = RunInfo(training=True, valid=4)
    outs = head.forward(tape, [x], run)
    assert outs[1] is outs[0] and outs[2] is outs[0] and not np.any(outs[3].data)
    (y,) = tail.forward(tape, outs, run)
    w1, b1 = (p.data for p in head.params)
    w2, b2 = (p.data for p in tail.params)
    np.testing.assert_allclose(y.data, np.maximum(x.data @ w1 + b1, 0) @ w2 + b2, rtol=1e-5, atol=1e-6)
    tape.backward({id(y): (y, np.ones_like(y.data))})
    assert x.grad is not None and head.params[0].grad is not None


# ---- validation at Model.add() -----------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("dense")), n_train=16, n_eval=16)


def test_dense_layers_validate_at_add(data):
    m = small_model(data)
    L = hugectr.Layer_t
    with pytest.raises(hugectr.ModelError, match=r"MLP.*num_outputs must be a non-empty list"):
        m.add(hugectr.DenseLayer(L.MLP, ["dense"], ["mlp"]))
    with pytest.raises(hugectr.ModelError, match=r"MLP.*activations has 1 entries for 2 layers"):
        m.add(hugectr.DenseLayer(L.MLP, ["dense"], ["mlp"], num_outputs=[4, 2], activations=[Activation_t.Relu]))
    with pytest.raises(hugectr.ModelError, match=r"MLP.*biases has 3 entries for 2 layers"):
        m.add(hugectr.DenseLayer(L.MLP, ["dense"], ["mlp"], num_outputs=[4, 2], biases=[True] * 3))
    with pytest.raises(hugectr.ModelError, match=r"MLP.*second bottom 'label' .* must have the first's shape"):
        m.add(hugectr.DenseLayer(L.MLP, ["dense", "label"], ["mlp"], num_outputs=[4]))
    with pytest.raises(hugectr.ModelError, match=r"FusedInnerProduct.*pos_type Head needs 1 or 2 bottom\(s\) and 4"):
        m.add(hugectr.DenseLayer(L.FusedInnerProduct, ["dense"], ["f"], num_output=4, pos_type=FcPosition_t.Head))
    with pytest.raises(hugectr.ModelError, match=r"FusedInnerProduct.*act_type Non is allowed only at pos_type Tail"):
        m.add(hugectr.DenseLayer(L.FusedInnerProduct, ["dense"], ["f"], num_output=4, act_type=Activation_t.Non))
    with pytest.raises(hugectr.ModelError, match=r"MultiCross.*num_layers must be a positive int, got 0"):
        m.add(hugectr.DenseLayer(L.MultiCross, ["dense"], ["mc"], num_layers=0))
    with pytest.raises(hugectr.ModelError, match=r"MultiCross.*projection_dim must be an int >= 0.*-2"):
        m.add(hugectr.DenseLayer(L.MultiCross, ["dense"], ["mc"], num_layers=1, projection_dim=-2))
    m.add(
        hugectr.DenseLayer(
            L.MLP, ["dense"], ["mlp"], num_outputs=[4, 3], use_bias=False, weight_init_type=Initializer_t.XavierUniform
        )
    )
    m.add(hugectr.DenseLayer(L.FusedInnerProduct, ["mlp"], ["f"], num_output=4))
    m.add(hugectr.DenseLayer(L.MultiCross, ["f"], ["mc"], num_layers=2))
    assert (m.shapes["mlp"], m.shapes["f"], m.shapes["mc"]) == ((8, 3), (8, 4), (8, 4))
    assert m.layers[0].json_params() == {
        "mlp_param": {
            "num_output": 1,
            "num_outputs": [4, 3],
            "use_bias": False,
            "activation": "Relu",
            "weight_init": "XavierUniform",
        }
    }
    assert m.layers[1].json_params() == {"position": "None", "activation": "Relu", "fc_param": {"num_output": 4}}


def test_dcn_trains_through_the_model_on_cpu(data):
    from numbactr.runtime import device

    device.set_device("cpu")
    m = small_model(data)
    L = hugectr.Layer_t
    m.add(hugectr.DenseLayer(L.MultiCross, ["dense"], ["mc"], num_layers=2))
    m.add(
        hugectr.DenseLayer(
            L.MLP, ["mc"], ["mlp"], num_outputs=[4, 1], activations=[Activation_t.Relu, Activation_t.Non]
        )
    )
    m.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["mlp", "label"], ["loss"]))
    m.compile()
    before = np.array(m.weights)
    assert m.train()
    assert np.isfinite(m.get_current_loss()) and not np.array_equal(before, np.array(m.weights))


@pytest.mark.gpu
def test_dense_kernels_on_gpu():
    rng = np.random.default_rng(0)
    for rows, cols, tpb in [(5000, 7, 1024), (3, 300, 32), (1025, 33, 256), (65536, 1024, 256)]:
        y = rng.normal(size=(rows, cols)).astype(np.float32)
        dy = rng.normal(size=(rows, cols)).astype(np.float32)
        d, db = dev(np.zeros_like(y)), dev(np.zeros(cols, np.float32))
        fba.bias_act_backward(dev(y), dev(dy), True, d, db)
        rd, rdb = fba.bias_act_backward_ref(y, dy.astype(np.float64))
        np.testing.assert_allclose(host(d), rd)
        np.testing.assert_allclose(host(db), rdb, rtol=1e-3, atol=1e-3)
        w, b = rng.normal(size=cols).astype(np.float32), rng.normal(size=cols).astype(np.float32)
        out, h = dev(np.zeros_like(y)), dev(np.zeros(rows, np.float32))
        mc.v1_forward(dev(y), dev(dy), dev(w), dev(b), out, h, threads=tpb)
        h64 = dy.astype(np.float64) @ w
        np.testing.assert_allclose(host(out), y * h64[:, None] + dy + b, rtol=1e-3, atol=1e-3)
