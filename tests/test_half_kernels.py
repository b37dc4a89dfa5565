"""Mixed precision's float16 kernels on the sim device (issue 13, item 1): the ops marked half_native
(InnerProduct, FusedInnerProduct/MLP's FcBiasAct, ReLU, Interaction) take float16 tensors themselves,
compute in float32 inside their kernels, round once on the store, and run their matrix products in
float16 with float32 accumulation on a float16 copy of the float32 master weights. Each op's forward and
backward equal a NumPy model of exactly that rounding, bit for bit; the kernels' float16 signatures
compile to PTX (tests/test_ptx.py, from each module's PTX_CHECKS)."""

import numpy as np
import pytest

from numbactr.runtime import device
from numbactr import ops
from numbactr.autograd import Tape, Tensor
from numbactr.autograd.tape import autocast
from numbactr.kernels import bias, fused_bias_act, interaction, relu
from numbactr.ops.dense import FcBiasAct

F16, F32 = np.float16, np.float32


def r16(a):
    return np.asarray(a, F32).astype(F16)


def mm16(a, b):
    """The GEMM model: float16 operands, float32 products and sums, one rounding."""
    return (np.asarray(a, F16).astype(F32) @ np.asarray(b, F16).astype(F32)).astype(F16)


def run(fn, arrays, grad_of_out, **params):
    """fn under autocast(float16) on a tape: (output, input gradients) as host arrays, and its Context."""
    tape = Tape()
    ts = [Tensor(device.xp().asarray(a), requires_grad=True) for a in arrays]
    with autocast(F16):
        y = fn.apply(tape, *ts, **params)
    ctx = tape.entries[0][1]
    tape.backward({id(y): (y, device.xp().asarray(grad_of_out(y.data)))})
    return (
        np.asarray(device.to_host(y.data)),
        [None if t.grad is None else np.asarray(device.to_host(t.grad)) for t in ts],
        ctx,
    )


@pytest.fixture
def sim(on_device, monkeypatch):
    monkeypatch.delenv("NUMBACTR_HALF_KERNELS", raising=False)
    on_device("sim")


def test_linear_runs_in_float16_with_float32_accumulation(sim):
    rng = np.random.default_rng(0)
    x, w, b = r16(rng.normal(size=(6, 5))), rng.normal(size=(5, 3)).astype(F32), rng.normal(size=3).astype(F32)
    dy = r16(rng.normal(size=(6, 3)))
    y, (dx, dw, db), ctx = run(ops.Linear, [x, w, b], lambda y: dy)
    assert ctx.native_half and y.dtype == F16 and dx.dtype == F16 and dw.dtype == F32 and db.dtype == F32
    np.testing.assert_array_equal(y, r16(mm16(x, w).astype(F32) + b))
    np.testing.assert_array_equal(dx, mm16(dy, r16(w).T))
    np.testing.assert_array_equal(dw, mm16(x.T, dy).astype(F32))
    np.testing.assert_allclose(db, dy.astype(F32).sum(0), rtol=1e-6)


@pytest.mark.parametrize("act,has_bias", [(True, True), (False, True), (True, False)])
def test_fc_bias_act_runs_in_float16(sim, act, has_bias):
    rng = np.random.default_rng(1)
    x, w = r16(rng.normal(size=(7, 4))), rng.normal(size=(4, 5)).astype(F32)
    b = [rng.normal(size=(1, 5)).astype(F32)] if has_bias else []
    dy = r16(rng.normal(size=(7, 5)))
    y, grads, _ = run(FcBiasAct, [x, w, *b], lambda y: dy, relu=act)
    pre = mm16(x, w).astype(F32) + (b[0].reshape(-1) if has_bias else 0)
    want = r16(np.maximum(pre, 0) if act else pre)
    assert y.dtype == F16
    np.testing.assert_array_equal(y, want)
    d = np.where(want > 0, dy, F16(0)) if act else dy
    np.testing.assert_array_equal(grads[0], mm16(d, r16(w).T))
    np.testing.assert_array_equal(grads[1], mm16(x.T, d).astype(F32))
    if has_bias:
        np.testing.assert_allclose(grads[2].reshape(-1), d.astype(F32).sum(0), rtol=1e-6)


def test_relu_and_interaction_equal_their_float32_kernels_rounded_once(sim, monkeypatch):
    """ReLU and Interaction do their float32 arithmetic on the float16 values, in the same order as the
    float32 kernels on float32 copies (NUMBACTR_HALF_KERNELS=0): the results are those rounded once."""
    rng = np.random.default_rng(2)
    dense, emb = r16(rng.normal(size=(3, 4))), r16(rng.normal(size=(3, 5, 4)))
    width = interaction.interaction_out_width(5, 4)
    dy = r16(rng.normal(size=(3, width)))
    native = run(ops.Interaction, [dense, emb], lambda y: dy)
    monkeypatch.setenv("NUMBACTR_HALF_KERNELS", "0")
    converted = run(ops.Interaction, [dense, emb], lambda y: dy)
    assert native[2].native_half and not converted[2].native_half
    assert native[0].dtype == native[1][0].dtype == native[1][1].dtype == F16
    np.testing.assert_array_equal(native[0], converted[0])
    for a, b in zip(native[1], converted[1]):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setenv("NUMBACTR_HALF_KERNELS", "1")
    x = r16(rng.normal(size=(4, 6)))
    g = r16(rng.normal(size=(4, 6)))
    y, (dx,), ctx = run(ops.ReLU, [x], lambda y: g)
    assert ctx.native_half and y.dtype == dx.dtype == F16
    np.testing.assert_array_equal(y, np.maximum(x, F16(0)))
    np.testing.assert_array_equal(dx, np.where(x > 0, g, F16(0)))


@pytest.mark.parametrize("axis", [1, 2])
def test_concat_and_reshape_copy_float16(sim, axis):
    rng = np.random.default_rng(3)
    a, b = r16(rng.normal(size=(2, 3, 4))), r16(rng.normal(size=(2, 3, 2)) if axis == 2 else rng.normal(size=(2, 1, 4)))
    dy = r16(rng.normal(size=np.concatenate([a, b], axis=axis).shape))
    y, (da, db), ctx = run(ops.Concat, [a, b], lambda y: dy, axis=axis)
    assert ctx.native_half and y.dtype == da.dtype == db.dtype == F16
    np.testing.assert_array_equal(y, np.concatenate([a, b], axis=axis))
    np.testing.assert_array_equal(np.concatenate([da, db], axis=axis), dy)
    y, (dx,), ctx = run(ops.Reshape, [a], lambda y: y * F16(2), shape=(-1, 12))
    assert ctx.native_half and y.dtype == dx.dtype == F16 and dx.shape == a.shape
    np.testing.assert_array_equal(dx, a * F16(2))


def test_switch_and_devices(on_device, monkeypatch):
    """float16 kernels only where kernels run (gpu, sim) and only for float16; NUMBACTR_HALF_KERNELS=0
    turns them off, and a bad value is a clear error."""
    from numbactr.autograd.tape import _native_half

    on_device("cpu")
    assert not _native_half(np.dtype(F16))
    on_device("sim")
    monkeypatch.delenv("NUMBACTR_HALF_KERNELS", raising=False)
    assert _native_half(np.dtype(F16))
    assert not _native_half(np.dtype("float32"))
    monkeypatch.setenv("NUMBACTR_HALF_KERNELS", "0")
    assert not _native_half(np.dtype(F16))
    monkeypatch.setenv("NUMBACTR_HALF_KERNELS", "yes")
    with pytest.raises(ValueError, match="NUMBACTR_HALF_KERNELS='yes'"):
        _native_half(np.dtype(F16))


def test_float16_signatures_are_in_the_ptx_checks():
    for mod, kernel in (
        (relu, relu.relu_forward_kernel),
        (bias, bias.bias_add_kernel),
        (fused_bias_act, fused_bias_act.bias_act_forward_kernel),
        (interaction, interaction.interaction_forward_block_kernel),
    ):
        assert any(k is kernel and "float16" in sig for k, sig in mod.PTX_CHECKS), mod.__name__


def _elementwise_cases():
    from numbactr.ops import elementwise as E

    rng = np.random.default_rng(4)
    x = [r16(rng.normal(size=(4, 6))) for _ in range(3)]
    pos = [r16(rng.uniform(0.5, 1.5, size=(4, 6))) for _ in range(2)]
    return [
        (E.AddFn, x, {}),
        (E.SubFn, x[:2], {}),
        (E.MultiplyFn, x, {}),
        (E.MultiplyFn, pos, {"exact": True}),
        (E.ELUFn, x[:1], {"alpha": 0.7}),
        (E.SigmoidFn, x[:1], {}),
        (E.ScaleFn, x[:1], {"axis": 0, "factor": 3}),
        (E.ScaleFn, x[:1], {"axis": 1, "factor": 2}),
        (E.DropoutFn, x[:1], {"rate": 0.5, "seed": 7, "step": 3, "layer_id": 2}),
        (E.FmOrder2Fn, [r16(rng.normal(size=(4, 12)))], {"out_dim": 3}),
        (E.WeightMultiplyFn, [x[0], rng.normal(size=(6, 3)).astype(F32)], {}),
    ]


@pytest.mark.parametrize("case", range(11))
def test_elementwise_ops_equal_their_float32_kernels_rounded_once(sim, monkeypatch, case):
    """Add, Sub, ElementwiseMultiply (both gradients), ELU, Sigmoid, Scale, Dropout, FmOrder2 and
    WeightMultiply: float16 in and out (WeightMultiply's W and dW float32),
    the same float32 arithmetic as on float32 copies (NUMBACTR_HALF_KERNELS=0), rounded once; a backward
    that reads the op's output (Sigmoid, HugeCTR's quotient rule) reads it stored in float16, as HugeCTR."""
    fn, xs, params = _elementwise_cases()[case]
    dy = None

    def grad(y):
        nonlocal dy
        if dy is None:
            dy = r16(np.random.default_rng(5).normal(size=y.shape))
        return dy

    native = run(fn, xs, grad, **params)
    monkeypatch.setenv("NUMBACTR_HALF_KERNELS", "0")
    converted = run(fn, xs, grad, **params)
    assert native[2].native_half and not converted[2].native_half
    assert native[0].dtype == F16
    assert [g.dtype for g in native[1]] == [x.dtype for x in xs]  # float16 activations, float32 weights
    np.testing.assert_array_equal(native[0], converted[0])
    for a, b in zip(native[1], converted[1]):
        if params.get("exact") or fn.__name__ == "SigmoidFn":
            # these backwards read the op's own output y: float16 here, float32 when converting
            np.testing.assert_allclose(a.astype(F32), b.astype(F32), rtol=2e-3)
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("version", [1, 2])
def test_multicross_runs_in_float16(sim, monkeypatch, version):
    """MultiCross v1/v2 (3 layers): float16 x_l and gradients, float32 parameter gradients; each layer's
    output is rounded to float16 (HugeCTR's fp16 MultiCross), so the result stays within float16's
    precision of the same stack computed in float32 on converted copies."""
    from numbactr.ops.dense import MultiCrossV1, MultiCrossV2

    rng = np.random.default_rng(6)
    x0 = r16(rng.normal(size=(5, 8)) * 0.5)
    if version == 1:
        fn, params = MultiCrossV1, [rng.normal(size=(1, 8)).astype(F32) * 0.3 for _ in range(6)]
    else:
        fn = MultiCrossV2
        params = []
        for _ in range(3):
            params += [
                rng.normal(size=(8, 3)).astype(F32) * 0.3,
                rng.normal(size=(3, 8)).astype(F32) * 0.3,
                rng.normal(size=(1, 8)).astype(F32) * 0.3,
            ]
    dy = r16(rng.normal(size=(5, 8)))
    native = run(fn, [x0, *params], lambda y: dy)
    monkeypatch.setenv("NUMBACTR_HALF_KERNELS", "0")
    converted = run(fn, [x0, *params], lambda y: dy)
    assert native[2].native_half and native[0].dtype == F16
    assert [g.dtype for g in native[1]] == [F16] + [F32] * len(params)
    np.testing.assert_allclose(native[0].astype(F32), converted[0].astype(F32), rtol=1e-2, atol=1e-2)
    for a, b in zip(native[1], converted[1]):
        scale = max(1.0, float(np.abs(b.astype(F32)).max()))
        np.testing.assert_allclose(a.astype(F32), b.astype(F32), rtol=2e-2, atol=1e-2 * scale)
    assert not np.array_equal(native[1][1], converted[1][1])  # the float16 path did run


def same_grad(seed):
    """grad_of_out for run(): one float16 gradient drawn for the output's shape, the same on every call (so
    the float16-kernel and converting runs get the same dY)."""
    held = {}

    def grad(y):
        if "dy" not in held:
            held["dy"] = r16(np.random.default_rng(seed).normal(size=y.shape))
        return held["dy"]

    return grad


def _norm_layer(features):
    """What BatchNormFn reads from its layer: eps, factor and the running statistics (updated in place)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        eps=1e-5, factor=0.1, running_mean=device.xp().zeros(features, F32), running_var=device.xp().ones(features, F32)
    )


def _norm_and_reduce_cases():
    from numbactr.ops.attention import MaskedSoftmaxFn, SoftmaxFn
    from numbactr.ops.normalization import BatchNormFn, LayerNormFn, PReLUDiceFn
    from numbactr.ops.shape import ReduceAxis

    rng = np.random.default_rng(7)
    x3 = r16(rng.normal(size=(3, 4, 5)))
    x2 = r16(rng.normal(size=(6, 5)) * 2 + 1)
    mask = (rng.random(size=(2, 1, 3, 4)) < 0.7).astype(F16)  # (B, 1, Lf, Lt): a float16 input tensor
    gamma, beta = (rng.normal(size=5) * 0.5 + 1).astype(F32), rng.normal(size=5).astype(F32)
    return [
        ("ReduceSum", ReduceAxis, [x3], {"axis": 1}),
        ("ReduceMean", ReduceAxis, [x3], {"axis": 2, "mean": True}),
        ("LayerNorm", LayerNormFn, [x3, gamma, beta], {"eps": 1e-5}),
        ("BatchNorm train", BatchNormFn, [x2, gamma, beta], {"training": True}),
        ("BatchNorm eval", BatchNormFn, [x2, gamma, beta], {"training": False}),
        ("Softmax", SoftmaxFn, [x3], {}),
        ("Softmax no max", SoftmaxFn, [x2], {"subtract_max": False}),
        ("PReLU_Dice", PReLUDiceFn, [x2], {"alpha": 0.25, "eps": 1e-5}),
        ("masked Softmax", MaskedSoftmaxFn, [r16(rng.normal(size=(2, 2, 3, 4)) * 3), mask], {"factor": 0.5}),
    ]


@pytest.mark.parametrize("case", range(9))
def test_norms_softmax_and_reductions_equal_their_float32_kernels_rounded_once(sim, monkeypatch, case):
    """ReduceSum/Mean, LayerNorm, BatchNorm (training and eval), PReLU_Dice and Softmax (plain and masked) take float16 tensors
    on gpu/sim: float16 x, y and gradients, float32 parameters, statistics and parameter gradients, the
    float32 kernels' arithmetic on the float16 values, rounded once. Softmax's backward reads its own
    output y, stored in float16 here and float32 when converting (as Sigmoid's)."""
    name, fn, xs, params = _norm_and_reduce_cases()[case]
    grad = same_grad(8)

    def once():
        extra = {"layer": _norm_layer(xs[0].shape[1])} if fn.__name__ == "BatchNormFn" else {}
        out = run(fn, xs, grad, **params, **extra)
        return out, extra.get("layer")

    (native, n_layer) = once()
    monkeypatch.setenv("NUMBACTR_HALF_KERNELS", "0")
    (converted, c_layer) = once()
    assert native[2].native_half and not converted[2].native_half, name
    assert native[0].dtype == F16
    # float16 activations, float32 parameters (a mask gets no gradient)
    assert [None if g is None else g.dtype for g in native[1]] == [
        None if fn.__name__ == "MaskedSoftmaxFn" and i == 1 else x.dtype for i, x in enumerate(xs)
    ]
    np.testing.assert_array_equal(native[0], converted[0])
    for a, b in zip(native[1], converted[1]):
        if a is None:
            assert b is None
        elif fn.__name__ in ("SoftmaxFn", "MaskedSoftmaxFn"):
            np.testing.assert_allclose(a.astype(F32), b.astype(F32), rtol=5e-3, atol=1e-4)
        else:
            np.testing.assert_array_equal(a, b)
    if n_layer is not None:  # the running statistics too
        np.testing.assert_array_equal(device.to_host(n_layer.running_mean), device.to_host(c_layer.running_mean))
        np.testing.assert_array_equal(device.to_host(n_layer.running_var), device.to_host(c_layer.running_var))


@pytest.mark.parametrize("ranges", [((0, 2), (2, 5)), ((0, 4), (1, 3)), ((1, 3),)])
def test_slice_copies_float16_and_adds_overlaps_in_float32(sim, monkeypatch, ranges):
    """Slice on gpu/sim: float16 pieces; backward zero-fills dX and adds each piece's gradient in float32,
    rounded on the store: with two overlapping pieces that is the float32 sum rounded once, what the
    converting path gives (an unused or missing column gets 0)."""
    from numbactr.ops.shape import SliceFn

    rng = np.random.default_rng(9)
    x = r16(rng.normal(size=(4, 5)))
    dys = [r16(rng.normal(size=(4, b - a))) for a, b in ranges]

    def once():
        tape = Tape()
        t = Tensor(device.xp().asarray(x), requires_grad=True)
        with autocast(F16):
            ys = SliceFn.apply(tape, t, ranges=ranges)
        ctx = tape.entries[0][1]
        tape.backward({id(y): (y, device.xp().asarray(d)) for y, d in zip(ys, dys)})
        return [np.asarray(device.to_host(y.data)) for y in ys], np.asarray(device.to_host(t.grad)), ctx

    ys, dx, ctx = once()
    monkeypatch.setenv("NUMBACTR_HALF_KERNELS", "0")
    ys32, dx32, ctx32 = once()
    assert ctx.native_half and not ctx32.native_half and dx.dtype == F16
    for (a, b), y, y32 in zip(ranges, ys, ys32):
        assert y.dtype == F16
        np.testing.assert_array_equal(y, x[:, a:b])
        np.testing.assert_array_equal(y, y32)
    np.testing.assert_array_equal(dx, dx32)
    want = np.zeros((4, 5), F32)
    for (a, b), d in zip(ranges, dys):
        want[:, a:b] += d.astype(F32)
    np.testing.assert_array_equal(dx, want.astype(F16))


def _attention_cases():
    from numbactr.ops.attention import MatMulFn, MergeHeadsFn, ScaledQKFn, SplitHeadsFn

    rng = np.random.default_rng(10)
    q, k = r16(rng.normal(size=(2, 2, 3, 4))), r16(rng.normal(size=(2, 2, 5, 4)))
    return [
        ("MatMul batched", MatMulFn, [q, r16(rng.normal(size=(2, 2, 4, 3)))], {}),
        ("MatMul flat rhs", MatMulFn, [r16(rng.normal(size=(3, 4))), r16(rng.normal(size=(4, 2, 5)))], {}),
        ("ScaledQK", ScaledQKFn, [q, k], {"scale": 0.5}),
        ("SplitHeads", SplitHeadsFn, [r16(rng.normal(size=(2, 3, 8)))], {"heads": 2}),
        ("MergeHeads", MergeHeadsFn, [q], {}),
    ]


@pytest.mark.parametrize("case", range(5))
def test_attention_ops_equal_their_float32_forms_rounded_once(sim, monkeypatch, case):
    """MatrixMultiply and MultiHeadAttention's products (float16 GEMMs with float32 accumulation; the
    simulator's model rounds once, the scale of Q Kᵀ included) and head reshuffles (copies) take float16
    tensors on gpu/sim and equal the float32 forms on float32 copies, rounded once."""
    name, fn, xs, params = _attention_cases()[case]
    grad = same_grad(11)
    native = run(fn, xs, grad, **params)
    monkeypatch.setenv("NUMBACTR_HALF_KERNELS", "0")
    converted = run(fn, xs, grad, **params)
    assert native[2].native_half and not converted[2].native_half, name
    assert native[0].dtype == F16 and all(g.dtype == F16 for g in native[1])
    np.testing.assert_array_equal(native[0], converted[0])
    for a, b in zip(native[1], converted[1]):
        np.testing.assert_array_equal(a, b)


def test_norm_and_reduce_float16_signatures_are_in_the_ptx_checks():
    from numbactr.kernels import attention, batch_norm, layer_norm, prelu_dice, reduce_axis, slice_select, softmax

    for mod in (attention, batch_norm, layer_norm, prelu_dice, reduce_axis, slice_select, softmax):
        assert any("float16" in sig for _, sig in mod.PTX_CHECKS), mod.__name__
