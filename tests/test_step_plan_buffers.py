"""The planned step's buffers (numbactr.train.plan_buffers) and fusions (numbactr.train.plan_fuse): ops write into
arrays the plan owns, the same arrays every step; gradients share buffers only where their values are dead;
Linear + ReLU fused into FcBiasAct gives the bits of the two ops; and a buffer shared by two live values would
be caught by the zoo's bit-for-bit comparison."""

import contextlib
import io

import numpy as np
from hypothesis import given as hgiven, settings
from hypothesis import strategies as st
import pytest

import numbactr as hugectr
from numbactr import ops
from numbactr.autograd import Context
from numbactr.bench import zoo_models as Z
from numbactr.train import plan_buffers
from numbactr.train.plan_buffers import Sizing, Value, assign

from tests.test_step_plan import same_bits, train


def planned_model(name: str, batch: int, steps: int, monkeypatch):
    monkeypatch.setenv("NUMBACTR_STEP_PLAN", "1")
    spec = Z.SPECS[name]
    with contextlib.redirect_stdout(io.StringIO()):
        model = Z.build(hugectr, spec, batch, seed=5)
    Z.feed(model, Z.make_batches(spec, batch, 3, seed=7))
    for _ in range(steps):
        model.train()
    (plan,) = model._plans.values()
    return model, plan


# ---- the allocator ------------------------------------------------------------------------------------
def test_two_live_values_never_share_a_buffer_and_dead_ones_do():
    f = np.float32
    vals = [
        Value(0, 0, (4, 8), f, born=0, dies=3),
        Value(1, 0, (4, 8), f, born=2, dies=5),  # alive while the first is: its own buffer
        Value(2, 0, (4, 8), f, born=4, dies=6),  # the first is dead (read last at 3): its buffer
        Value(3, 0, (4, 8), f, born=5, dies=7),  # the second was read at 5, when this one is written: not shared
        Value(4, 0, (2, 8), f, born=9, dies=9),  # another shape: never shares with (4, 8)
        Value(5, 0, (4, 8), np.float16, born=9, dies=9),  # another dtype: the same
    ]
    got = assign(vals)
    assert got[0] != got[1] and got[2] == got[0] and got[3] not in (got[1], got[2])
    assert len(set(got)) == 5


def test_a_view_of_a_gradient_keeps_its_buffer_alive():
    """A Reshape's or Concat's backward hands on a view of the gradient it got: reading the view at a later
    step is reading the buffer, and an embedding's lookup holds what it is given to the end."""
    from numbactr.ops.dense import Linear
    from numbactr.train.plan import Op

    s = Sizing()
    op = Op(Linear, (0, 1, 2), (3,), {}, (True, True, True), None, False)
    g = np.zeros((4, 6), np.float32)
    s.wrote(0, op, (g, None, None), t=1)
    assert len(s.values) == 1 and s.values[0].dies == 1
    s.read([g.reshape(2, 12)[:, :3]], t=4)  # a view, read three steps later
    assert s.values[0].dies == 4
    s.read([g.T], t=plan_buffers.END)
    assert s.values[0].dies == plan_buffers.END


# ---- buffers in a planned step --------------------------------------------------------------------------
def test_a_planned_step_writes_into_the_same_buffers_every_step(cpu, monkeypatch):
    model, plan = planned_model("DLRM", 32, 3, monkeypatch)  # a traced step, the sizing step, a buffered one
    assert plan.sized
    owned = [op for op in plan.ops if op.out]
    assert {op.fn for op in owned} >= {ops.FcBiasAct, ops.Linear}
    outs = [o for op in owned for o in op.out]
    grads = [b for op in plan.ops for b in op.grad_bufs.values()]
    assert len({id(b) for b in grads}) == plan.grad_buffers < len(grads)  # gradients share buffers
    fused = next(iter(plan.fused.values()))
    before = model._last_tensors[True][fused].data
    calls = []

    def watch(fn):  # each op must return the very arrays the plan handed it
        forward, backward = fn.forward, fn.backward

        def fwd(ctx, *a, **k):
            y = forward(ctx, *a, **k)
            calls.append(("out", (y,) if not isinstance(y, tuple) else y, ctx.out))
            return y

        def bwd(ctx, *g):
            dx = backward(ctx, *g)
            calls.append(("grad", dx, ctx.grad_into))
            return dx

        monkeypatch.setattr(fn, "forward", staticmethod(fwd))
        monkeypatch.setattr(fn, "backward", staticmethod(bwd))

    for fn in (ops.FcBiasAct, ops.Linear, ops.ReLU, ops.Concat):
        watch(fn)
    model.train()
    model.train()
    assert [o for op in owned for o in op.out] == outs and all(
        a is b for a, b in zip(outs, [o for op in owned for o in op.out])
    )
    assert model._last_tensors[True][fused].data is before  # the same array, the next step's values
    handed = 0
    for kind, got, given in calls:
        if kind == "out" and given:
            assert all(a is b for a, b in zip(got, given))
            handed += 1
        if kind == "grad":
            for pos, buf in given.items():
                if pos < len(got) and got[pos] is not None:
                    assert got[pos] is buf or got[pos].base is buf, (pos, got[pos].shape)
                    handed += 1
    assert handed >= 2 * len(owned)


def test_without_buffers_every_op_allocates_and_the_bits_are_the_same(cpu, monkeypatch):
    spec = Z.SPECS["MMoE"]
    monkeypatch.setenv("NUMBACTR_PLAN_BUFFERS", "0")
    bare, l0, s0 = train(spec, 32, 4, True, monkeypatch)
    monkeypatch.setenv("NUMBACTR_PLAN_BUFFERS", "1")
    kept, l1, s1 = train(spec, 32, 4, True, monkeypatch)
    (p0,) = bare._plans.values()
    (p1,) = kept._plans.values()
    assert not p0.sized and not any(op.out or op.grad_bufs for op in p0.ops)
    assert p1.sized and p1.grad_buffers > 0
    assert l0 == l1 and same_bits(s0, s1)


def test_an_aliasing_bug_is_caught_by_the_bit_comparison(cpu, monkeypatch):
    """Gradients of one shape made to share a buffer while both are live (MMoE's four experts each give the
    shared input a gradient, summed as they come): the planned training no longer gives the general step's
    bits, so the zoo test would fail on such a bug."""

    def by_shape_only(values):  # the liveness left out: every value of a shape in one buffer
        first = {}
        return [first.setdefault((v.shape, v.dtype), i) for i, v in enumerate(values)]

    spec = Z.SPECS["MMoE"]
    _, l0, s0 = train(spec, 32, 4, False, monkeypatch)
    monkeypatch.setattr(plan_buffers, "assign", by_shape_only)
    _, l1, s1 = train(spec, 32, 4, True, monkeypatch)
    assert not same_bits(s0, s1)


# ---- the fusion ---------------------------------------------------------------------------------------
def _on(device_name, on_device):
    from numbactr.runtime import device

    if device_name == "sim":
        on_device("sim")
    else:
        device.set_device("cpu")
    return lambda a: device.xp().asarray(a), lambda a: np.asarray(device.to_host(a))


def _ctxs(n):
    out = [Context() for _ in range(n)]
    for c in out:
        c.needs_input_grad = (True, True, True)
    return out


@pytest.mark.parametrize("where,rows", [("cpu", 5), ("cpu", 3000)])  # (3000: the parallel passes; cpu only:
# on gpu/sim the ReLU kernel clamps a NaN to 0 where the fused one keeps it, so the plan fuses on cpu only)
def test_fc_bias_act_gives_the_bits_of_linear_then_relu(where, rows, on_device):
    dev, host = _on(where, on_device)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows, 24), dtype=np.float32)
    w = rng.standard_normal((24, 40), dtype=np.float32)
    b = rng.standard_normal((1, 40), dtype=np.float32)
    x[0, :] = 0.0  # a row of zeros: pre-activations equal to b (some exactly 0)
    b[0, :3] = [0.0, -0.0, np.nan]  # a NaN stays NaN through either
    dy = rng.standard_normal((rows, 40), dtype=np.float32)
    x, w, b, dy = dev(x), dev(w), dev(b), dev(dy)
    c1, c2, c3 = _ctxs(3)
    y = ops.ReLU.forward(c2, ops.Linear.forward(c1, x, w, b))
    yf = ops.FcBiasAct.forward(c3, x, w, b, relu=True)
    y, yf = host(y), host(yf)
    assert np.array_equal(y, yf, equal_nan=True) and np.array_equal(np.signbit(y), np.signbit(yf))
    dx, dw, db = ops.Linear.backward(c1, ops.ReLU.backward(c2, dy))
    fx, fw, fb = ops.FcBiasAct.backward(c3, dy)
    for a, f in ((dx, fx), (dw, fw), (db.reshape(b.shape), fb)):  # (Linear's db is (N,) for a (1, N) b)
        assert a.shape == f.shape and np.array_equal(host(a), host(f), equal_nan=True)


@pytest.mark.parametrize("where", ["cpu", "sim"])  # (cpu: the NumPy reference; sim: the kernels)
@pytest.mark.parametrize("g_first", [True, False])
def test_scale_multiply_gives_the_bits_of_scale_then_multiply(where, g_first, on_device):
    from numbactr.ops.elementwise import MultiplyFn, ScaleFn
    from numbactr.ops.fused import ScaleMultiplyFn

    dev, host = _on(where, on_device)
    rng = np.random.default_rng(5)
    b, n, f = 6, 3, 16 if where == "sim" else 64
    g = rng.random((b, n), dtype=np.float32)
    x = rng.standard_normal((b, n * f), dtype=np.float32)
    x[0, :4] = [np.inf, -0.0, 0.0, np.nan]
    dy = rng.standard_normal((b, n * f), dtype=np.float32)
    g, x, dy = dev(g), dev(x), dev(dy)
    c1, c2, c3 = _ctxs(3)
    s = ScaleFn.forward(c1, g, axis=0, factor=f)
    y = MultiplyFn.forward(c2, *((s, x) if g_first else (x, s)))
    yf = ScaleMultiplyFn.forward(c3, g, x, factor=f, g_first=g_first)
    assert np.array_equal(host(y), host(yf), equal_nan=True)
    d = MultiplyFn.backward(c2, dy)
    ds, dx = (d[0], d[1]) if g_first else (d[1], d[0])
    dg = ScaleFn.backward(c1, ds)
    fg, fx = ScaleMultiplyFn.backward(c3, dy)
    assert np.array_equal(host(dg), host(fg), equal_nan=True) and np.array_equal(host(dx), host(fx), equal_nan=True)


def test_fused_tops_are_reported_and_kept_when_fusion_is_off(cpu, monkeypatch):
    model, plan = planned_model("NCF", 16, 3, monkeypatch)
    assert plan.fused == {
        "fc0": "fcrelu0",
        "fc1": "fcrelu1",
        "fc2": "fcrelu2",
        "user_mlp": "mlp_in",  # (the Slice whose pieces the Concat joins again: WholeSliceFn)
        "item_mlp": "mlp_in",
    }
    assert ops.ReLU not in {op.fn for op in plan.ops}
    with pytest.raises(hugectr.ModelError, match="fused with the one after it"):
        model.check_out_tensor("fc0", hugectr.Tensor_t.Train)
    monkeypatch.setenv("NUMBACTR_FUSE_BIAS_RELU", "0")
    model.train()  # a new key: traced again, planned unfused
    assert len(model._plans) == 2
    pre = model.check_out_tensor("fc0", hugectr.Tensor_t.Train)
    post = model.check_out_tensor("fcrelu0", hugectr.Tensor_t.Train)
    assert np.array_equal(np.maximum(pre, 0), post)


# ---- DIN's activation-unit input (kernels/activation_unit.py) ---------------------------------------------
SPECIALS = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-30], np.float32)


def _with_specials(rng, shape):
    a = rng.standard_normal(shape).astype(np.float32)
    flat = a.reshape(-1)
    if flat.size:
        at = rng.integers(0, flat.size, size=max(1, flat.size // 5))
        flat[at] = rng.choice(SPECIALS, size=at.size)
    return a


@hgiven(b=st.integers(0, 4), f=st.integers(1, 5), n=st.integers(1, 6), prior=st.booleans(), seed=st.integers(0, 999))
@settings(max_examples=40, deadline=None)
def test_activation_unit_gives_the_bits_of_its_four_layers(b, f, n, prior, seed):
    from numbactr.kernels import activation_unit as au

    rng = np.random.default_rng(seed)
    x, h = _with_specials(rng, (b, n)), _with_specials(rng, (b * f, n))
    dy = _with_specials(rng, (b * f, 4 * n))
    dh0 = _with_specials(rng, (b * f, n)) if prior else None
    # the same bits where a value is a number (-0.0 is not 0.0 here); NaN where the layers give NaN, whatever
    # its sign bit (compiled code may compute x + (-y) as x - y, which keeps the NaN of y unnegated)
    bits = lambda a: np.where(np.isnan(a), np.int32(-1), a.view(np.int32))  # noqa: E731
    with np.errstate(all="ignore"):
        _activation_unit_case(au, x, h, f, dy, dh0, bits)


def _activation_unit_case(au, x, h, f, dy, dh0, bits):
    b, n = x.shape
    assert np.array_equal(bits(au.activation_input(x, h, f)), bits(au.activation_input_ref(x, h, f)))
    out = np.full((b * f, 4 * n), 7.0, np.float32)
    assert au.activation_input(x, h, f, out) is out and np.array_equal(
        bits(out), bits(au.activation_input_ref(x, h, f))
    )
    dx, dh = au.activation_input_backward(x, h, f, dy, None if dh0 is None else dh0.copy())
    rx, rh = au.activation_input_backward_ref(x, h, f, dy, dh0)
    assert np.array_equal(bits(dx), bits(rx)) and np.array_equal(bits(dh), bits(rh))
    with pytest.raises(ValueError, match="does not fit"):
        au.activation_input(x, np.zeros((b * f + 1, n), np.float32), f)


def test_din_plans_one_activation_unit_with_the_unfused_bits(cpu, monkeypatch):
    from numbactr.ops.elementwise import SubFn
    from numbactr.ops.fused import ActivationUnitInputFn

    spec = Z.SPECS["DIN"]
    monkeypatch.setenv("NUMBACTR_PLAN_FUSE", "0")
    bare, l0, s0 = train(spec, 32, 4, True, monkeypatch)
    monkeypatch.setenv("NUMBACTR_PLAN_FUSE", "1")
    fused, l1, s1 = train(spec, 32, 4, True, monkeypatch)
    (p0,) = bare._plans.values()
    (p1,) = fused._plans.values()
    assert SubFn in {op.fn for op in p0.ops} and ActivationUnitInputFn not in {op.fn for op in p0.ops}
    assert [op.fn for op in p1.ops].count(ActivationUnitInputFn) == 1 and SubFn not in {op.fn for op in p1.ops}
    assert {k: v for k, v in p1.fused.items() if v == "att_in"} == {
        "item_rep": "att_in",
        "sub_ih": "att_in",
        "mul_ih": "att_in",
    }
    assert l0 == l1 and same_bits(s0, s1)
    with pytest.raises(hugectr.ModelError, match="fused"):
        fused.check_out_tensor("sub_ih", hugectr.Tensor_t.Train)


def test_activation_unit_in_chunks_past_the_parallel_size():
    from numbactr.kernels import activation_unit as au
    from numbactr.kernels.parallel_cpu import PARALLEL_MIN

    rng = np.random.default_rng(3)
    b, f, n = 2000, 4, 36  # y has more than PARALLEL_MIN elements: the chunked loops (parallel with threads)
    assert b * f * 4 * n > PARALLEL_MIN
    x, h = rng.standard_normal((b, n), dtype=np.float32), rng.standard_normal((b * f, n), dtype=np.float32)
    dy, dh0 = rng.standard_normal((b * f, 4 * n), dtype=np.float32), rng.standard_normal((b * f, n), dtype=np.float32)
    assert np.array_equal(au.activation_input(x, h, f), au.activation_input_ref(x, h, f))
    got, want = au.activation_input_backward(x, h, f, dy, dh0), au.activation_input_backward_ref(x, h, f, dy, dh0)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_whole_slice_gives_the_bits_of_slice_then_concat(cpu):
    from numbactr.ops.fused import WholeSliceFn
    from numbactr.ops.shape import SliceFn
    from numbactr.train.plan import Op
    from numbactr.train.plan_fuse import _whole_slice

    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 6), dtype=np.float32)
    dy = rng.standard_normal((5, 6), dtype=np.float32)
    dy[0, :3] = [-0.0, np.inf, np.nan]
    ranges = ((0, 2), (2, 6))
    c1, c2, c3 = _ctxs(3)
    pieces = SliceFn.forward(c1, x, ranges=ranges)
    y = ops.Concat.forward(c2, *pieces, axis=1)
    assert WholeSliceFn.forward(c3, x) is x and np.array_equal(x, y)
    dx = SliceFn.backward(c1, *ops.Concat.backward(c2, dy))
    got = WholeSliceFn.backward(c3, dy)
    assert np.array_equal(np.where(np.isnan(got), 0, got).view(np.int32), np.where(np.isnan(dx), 0, dx).view(np.int32))
    # only ranges that tile the last dim in order, all joined in order by the Concat alone, are rewritten
    arrays, readers = {0: x}, {1: 1, 2: 1}

    def pair(rngs, cat_ins=(1, 2), axis=1):
        return [
            Op(SliceFn, (0,), (1, 2), {"ranges": rngs}, (True,), None, True),
            Op(ops.Concat, cat_ins, (3,), {"axis": axis}, (True, True), None, False),
        ]

    assert _whole_slice(pair(ranges), arrays, readers, set()).fn is WholeSliceFn
    assert _whole_slice(pair(((0, 2), (3, 6))), arrays, readers, set()) is None  # a gap
    assert _whole_slice(pair(((2, 6), (0, 2))), arrays, readers, set()) is None  # out of order
    assert _whole_slice(pair(ranges, (2, 1)), arrays, readers, set()) is None  # joined the other way round
    assert _whole_slice(pair(ranges), arrays, {1: 2, 2: 1}, set()) is None  # a piece read elsewhere too
    assert _whole_slice(pair(ranges), arrays, readers, {1}) is None  # a piece kept (a loss)


def test_activation_unit_reference_backward_is_the_gradient_in_float64():
    from numbactr.kernels import activation_unit as au

    rng = np.random.default_rng(4)
    b, f, n = 3, 4, 5
    x, h = rng.standard_normal((b, n)), rng.standard_normal((b * f, n))
    wy, wh = rng.standard_normal((b * f, 4 * n)), rng.standard_normal((b * f, n))
    dh0 = wh  # the history's gradient from its other reader, loss term sum(wh * h)

    def loss(x, h):
        return float((au.activation_input_ref(x, h, f) * wy).sum() + (wh * h).sum())

    dx, dh = au.activation_input_backward_ref(x, h, f, wy, dh0)
    eps = 1e-6
    for a, grad in ((x, dx), (h, dh)):
        num = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            keep = a[i]
            a[i] = keep + eps
            up = loss(x, h)
            a[i] = keep - eps
            down = loss(x, h)
            a[i] = keep
            num[i] = (up - down) / (2 * eps)
        np.testing.assert_allclose(grad, num, rtol=1e-6, atol=1e-8)
