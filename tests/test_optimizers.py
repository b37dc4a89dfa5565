import contextlib
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numbactr.kernels import optimizers as opt
from numbactr.embedding.hugectr_optimizers import sparse_optimizer_spec
from tests.kernel_util import SIMULATED, dev, f32_arrays, host

RTOL, ATOL = 1e-5, 1e-6

lrs = st.floats(1e-4, 1.0)
scalers = st.sampled_from([1.0, 128.0, 1024.0])  # Solver scaler: 1 or a mixed-precision value
betas1 = st.floats(0.5, 0.99)
betas2 = st.floats(0.9, 0.9999)
epss = st.sampled_from([1e-7, 1e-8, 1e-3])
steps = st.integers(1, 50)
vecs = f32_arrays(st.integers(0, 200))


def moments(draw, shape):
    """Plausible Adam state: m anything, v >= 0."""
    m = draw(f32_arrays(shape, -1.0, 1.0))
    v = draw(f32_arrays(shape, 0.0, 1.0))
    return m, v


@st.composite
def sparse_case(draw, max_rows=12, max_d=6):
    """table, m, v (V, D) f32; unique rows (U,) i64 in first-seen order; grads (U, D) f32."""
    n_rows = draw(st.integers(1, max_rows))
    d = draw(st.integers(1, max_d))
    table = draw(f32_arrays((n_rows, d)))
    m, v = moments(draw, (n_rows, d))
    rows = draw(st.lists(st.integers(0, n_rows - 1), unique=True, max_size=n_rows))
    rows = np.array(rows, np.int64)
    grads = draw(f32_arrays((rows.size, d)))
    return table, m, v, rows, grads


def close(got, want, before, rtol=RTOL, atol=ATOL):
    """got == want up to float32 rounding of an update `before -> want`.

    The error of `a - step` (or `b*a + c`) in float32 scales with the operands, not with the result,
    which can cancel to ~0: tolerance is rtol * (|before| + |want - before|) + atol.
    """
    got, want, before = (np.asarray(a, np.float64) for a in (got, want, before))
    tol = rtol * (np.abs(before) + np.abs(want - before)) + atol
    bad = np.abs(got - want) > tol
    assert not bad.any(), f"{bad.sum()} mismatches: got {got[bad][:5]}, want {want[bad][:5]}"


# ---- dense ------------------------------------------------------------------------------------
@given(data=st.data(), w=vecs, lr=lrs, scaler=scalers)
def test_sgd_kernel_matches_ref(data, w, lr, scaler):
    g = data.draw(f32_arrays(w.shape))
    got = dev(w)
    opt.sgd_update(got, dev(g), lr, scaler)
    close(host(got), opt.sgd_update_ref(w, g, lr, scaler), w)


@given(data=st.data(), w=vecs, lr=lrs, b1=betas1, b2=betas2, eps=epss, t=steps, scaler=scalers)
def test_adam_kernel_matches_ref(data, w, lr, b1, b2, eps, t, scaler):
    g = data.draw(f32_arrays(w.shape))
    m, v = moments(data.draw, w.shape)
    dw, dm, dv = dev(w), dev(m), dev(v)
    opt.adam_update(dw, dm, dv, dev(g), lr, b1, b2, eps, t, scaler)
    want = opt.adam_update_ref(w, m, v, g, lr, b1, b2, eps, t, scaler)
    for got, ref, before in zip((dw, dm, dv), want, (w, m, v)):
        close(host(got), ref, before)


def test_adam_first_step_by_hand():
    # t=1, m=v=0: m = (1-b1) g, v = (1-b2) g^2, alpha_1 = lr sqrt(1-b2)/(1-b1)
    # => w -= lr * g/|g| / (1 + eps/((1-b2)^0.5 |g|)) ~= lr * sign(g)
    # (betas exact in float32: with 0.999, 1 - float32(b2) is off by 1e-5 relative)
    lr, b1, b2, eps, scaler = 0.01, 0.875, 1 - 2.0**-10, 1e-7, 2.0
    w = np.array([1.0, 1.0, 1.0], np.float32)
    g = np.array([4.0, -0.5, 0.0], np.float32)  # g/scaler = 2, -0.25, 0
    gs = g / scaler
    want_w = w - lr * gs / (np.abs(gs) + eps / math.sqrt(1 - b2))
    want_w[2] = 1.0  # zero gradient: no move
    for w_new, m_new, v_new in (
        opt.adam_update_ref(w, 0 * w, 0 * w, g, lr, b1, b2, eps, 1, scaler),
        _adam_kernel(w, g, lr, b1, b2, eps, 1, scaler),
    ):
        np.testing.assert_allclose(w_new, want_w, rtol=1e-6)
        np.testing.assert_allclose(m_new, (1 - b1) * gs, rtol=1e-6)
        np.testing.assert_allclose(v_new, (1 - b2) * gs * gs, rtol=1e-6)


def _adam_kernel(w, g, lr, b1, b2, eps, t, scaler):
    dw, dm, dv = dev(w), dev(np.zeros_like(w)), dev(np.zeros_like(w))
    opt.adam_update(dw, dm, dv, dev(g), lr, b1, b2, eps, t, scaler)
    return host(dw), host(dm), host(dv)


def test_sgd_by_hand_and_empty():
    w = np.array([1.0, -2.0], np.float32)
    got = dev(w)
    opt.sgd_update(got, dev(np.array([8.0, 4.0], np.float32)), 0.5, 4.0)
    np.testing.assert_array_equal(host(got), [0.0, -2.5])
    empty = np.zeros(0, np.float32)
    opt.sgd_update(empty, empty, 0.1, 1.0)
    opt.adam_update(empty, empty, empty, empty, 0.1, 0.9, 0.999, 1e-7, 1, 1.0)


def test_alpha_t():
    assert opt.adam_alpha_t(0.001, 0.9, 0.999, 1) == np.float32(0.001 * math.sqrt(0.001) / 0.1)
    assert opt.adam_alpha_t(0.001, 0.9, 0.999, 1).dtype == np.float32
    with pytest.raises(ValueError):
        opt.adam_alpha_t(0.001, 0.9, 0.999, 0)


# ---- sparse: HugeCTR's rules, run by the embedding engine as fused optimizers -------------------
# This module's sparse functions are NumPy references over unique rows; the embedding engine (built from
# a CreateOptimizer by optim.sparse_optimizer_spec) runs the same rules fused with the row-gradient
# reduction. A pooling-NONE lookup of U unique keys, back-propagated with grads (U, D), hands its update
# exactly those row gradients.
def _hc(o_name, u_name, **kw):
    from numbactr.config import CreateOptimizer
    from numbactr.enums import Optimizer_t, Update_t

    return CreateOptimizer(optimizer_type=Optimizer_t[o_name], update_type=Update_t[u_name], **kw)


def _engine(o, table, live=None, impl=None, **kw):
    """A one-table engine holding `table` (V, D), with HugeCTR's sparse optimizer `o`: a keyed table whose
    first `live` rows (default: all) hold keys 0..live-1 (key = row), so Global's all-rows pass covers
    exactly the rows [0, live) in use. Pooling NONE unless kw (TableBatchedEmbedding's) says otherwise."""
    from numbactr.runtime import device
    from numbactr.embedding.engine import Pooling, TableBatchedEmbedding, TableSpec
    from numbactr.embedding.hugectr_optimizers import sparse_optimizer_spec

    kw.setdefault("pooling", Pooling.NONE)
    try:
        eng = TableBatchedEmbedding(
            [TableSpec(*table.shape, keyed=True)], optimizer=sparse_optimizer_spec(o, "test"), impl=impl, **kw
        )
    except NotImplementedError as e:  # an engine path that is not built (yet)
        pytest.skip(str(e))
    xp = device.xp()
    eng.hash_tables[0].insert(xp.asarray(np.arange(table.shape[0] if live is None else live, dtype=np.uint64)))
    eng.split_weights()[0][...] = xp.asarray(table)
    return eng


def _set_states(eng, states) -> None:
    from numbactr.runtime import device

    for view, s in zip(eng.split_optimizer_states()[0], states):
        view[...] = device.xp().asarray(np.asarray(s))


def _engine_step(eng, rows, grads, lr, scaler) -> None:
    """One fused update at the engine's next step: rows (U,) unique (key = row) take grads (U, D)."""
    from numbactr.runtime import device

    xp = device.xp()
    eng.set_hyper_parameters(learning_rate=lr, scaler=scaler)
    _, ctx = eng.forward(xp.asarray(np.asarray(rows, np.int64)), xp.asarray(np.array([0, len(rows)], np.int64)))
    eng.backward(ctx, xp.asarray(np.asarray(grads, np.float32)))


@contextlib.contextmanager
def _device_for(impl):
    """The device an engine path runs on: cpu for the host paths ('ref', 'cpu'), the kernels' device (the
    simulator, or the GPU of a gpu run) for 'kernels'."""
    from numbactr.runtime import device

    before = device.kind()
    device.set_device("cpu" if impl != "kernels" else "sim" if SIMULATED else "gpu")
    try:
        yield
    finally:
        device.set_device(before)


def _engine_arrays(eng) -> list:
    """[table (V, D), *states] on the host: per-element states (V, D), per-row ones (V,)."""
    return [host(eng.split_weights()[0]).copy()] + [host(s).copy() for s in eng.split_optimizer_states()[0]]


def _sparse_ref(o, table, states, rows, grads, lr, scaler, t, live):
    """HugeCTR's sparse update (sparse_optimizer.cu's order) through this module's references: new
    [table, *states] after the unique rows (U,) took grads (U, D) at step t, Global's all-rows pass over
    the rows [0, live). Arrays stay float32 (the references round the scalars as the kernels receive
    them); LazyGlobal's previous step is per row (V,), as the engine keeps it."""
    name, update = o.optimizer_type.name, o.update_type.name
    f, b1, b2, eps = o.momentum_factor, o.beta1, o.beta2, o.epsilon
    w, s, g = np.array(table), [np.array(x) for x in states], np.asarray(grads, np.float32)

    def hot(rule, arrays, *args):  # the rule on the gathered hot rows
        new = rule(*[a[rows] for a in arrays], g, *args)
        for a, b in zip(arrays, new if isinstance(new, tuple) else (new,)):
            a[rows] = b

    def every_live(rule, arrays, *args):  # an all-rows pass over the rows in use
        for a, b in zip(arrays, rule(*[a[:live] for a in arrays], live, *args)):
            a[:live] = b

    if name == "SGD":
        hot(opt.sgd_update_ref, [w], lr, scaler)
    elif name == "AdaGrad":
        hot(opt.adagrad_update_ref, [w, s[0]], lr, eps, scaler)
    elif name == "MomentumSGD" and update == "Global" and f != 0:
        s[0] = opt.sparse_momentum_sgd_global_hot_ref(s[0], rows, g, lr, f, scaler)
        every_live(opt.sparse_momentum_sgd_global_all_ref, [w, s[0]], f)
    elif name == "MomentumSGD":
        if update == "Global":  # factor 0: every live m *= 0 first (numbactr.optim)
            every_live(opt.sparse_momentum_sgd_global_all_ref, [w, s[0]], 0.0)
        hot(opt.momentum_sgd_update_ref, [w, s[0]], lr, f, scaler)
    elif name == "Nesterov" and update == "Global":
        every_live(opt.sparse_nesterov_global_all_ref, [w, s[0]], f)
        w, s[0] = opt.sparse_nesterov_global_hot_ref(w, s[0], rows, g, lr, f, scaler)
    elif name == "Nesterov":
        hot(opt.nesterov_update_ref, [w, s[0]], lr, f, scaler)
    elif update == "Global":
        s[0], s[1] = opt.sparse_adam_global_hot_ref(s[0], s[1], rows, g, b1, b2, scaler)
        every_live(opt.sparse_adam_global_all_ref, [w, s[0], s[1]], lr, b1, b2, eps, t)
    elif update == "LazyGlobal":
        prev = np.repeat(s[2][rows, None], w.shape[1], axis=1)
        w[rows], s[0][rows], s[1][rows], _ = opt.adam_lazy_update_ref(
            w[rows], s[0][rows], s[1][rows], prev, g, lr, b1, b2, eps, t, scaler
        )
        s[2][rows] = t
    else:
        hot(opt.adam_update_ref, [w, s[0], s[1]], lr, b1, b2, eps, t, scaler)
    return [w] + s


def _sparse_cases():
    from numbactr.optim import SUPPORTED

    return [
        (o.name, u.name, f)
        for o, u in sorted(SUPPORTED, key=lambda c: (c[0].name, c[1].name))
        for f in ((0.0, 0.9) if o.name in ("MomentumSGD", "Nesterov") else (None,))
    ]


@pytest.mark.parametrize("impl", ["ref", "cpu", "kernels"])
@pytest.mark.parametrize("o_name,u_name,f", _sparse_cases(), ids=lambda v: str(v))
@settings(max_examples=5)
@given(case=sparse_case(), data=st.data(), lr=lrs, scaler=scalers, t=steps)
def test_fused_sparse_update_matches_the_references(impl, o_name, u_name, f, case, data, lr, scaler, t):
    """Every HugeCTR sparse optimizer x update type, on every engine path: the touched rows follow the rule,
    Global's pass moves every row in use and no row past them."""
    table, m, v, rows, grads = case
    o = _hc(o_name, u_name, **({} if f is None else {"momentum_factor": f}))
    live = data.draw(st.integers(int(rows.max(initial=-1)) + 1, table.shape[0]))
    states = {"SGD": [], "AdaGrad": [v], "MomentumSGD": [m], "Nesterov": [m], "Adam": [m, v]}[o_name]
    if u_name == "LazyGlobal":  # each row last updated at some step before t
        states = states + [data.draw(hnp.arrays(np.int64, table.shape[0], elements=st.integers(1, t)))]
    with _device_for(impl):
        eng = _engine(o, table, live, impl)
        _set_states(eng, states)
        eng.step = t - 1
        _engine_step(eng, rows, grads, lr, scaler)
        got = _engine_arrays(eng)
    want = _sparse_ref(o, table, states, rows, grads, lr, scaler, t, live)
    for a, b, before in zip(got, want, [table] + states):
        close(a, b, before, rtol=3e-5 if u_name == "LazyGlobal" else RTOL)  # powf vs float64 pow
    np.testing.assert_array_equal(got[0][live:], table[live:])


@pytest.mark.parametrize("o_name,u_name,f", _sparse_cases(), ids=lambda v: str(v))
def test_pooled_steps_with_repeated_rows_match_the_references(o_name, u_name, f):
    """Four steps of HugeCTR's layout (2 slots of one table, sample-major bags, SUM) with rows repeated
    within and across bags and new rows appearing: the engine's fused update == the references applied to
    each touched row's summed gradient."""
    from numbactr.embedding.engine import Layout, Pooling
    from numbactr.kernels import embedding_bag as EB

    hp = {
        "MomentumSGD": dict(momentum_factor=f),
        "Nesterov": dict(momentum_factor=f),
        "AdaGrad": dict(initial_accu_value=0.1, epsilon=1e-7),
        "Adam": dict(beta1=0.9, beta2=0.99, epsilon=1e-7),
    }.get(o_name, {})
    o = _hc(o_name, u_name, **hp)
    rng = np.random.default_rng(1)
    table = rng.normal(size=(12, 4)).astype(np.float32)
    eng = _engine(o, table, feature_table_map=[0, 0], layout=Layout.SAMPLE_MAJOR, pooling=Pooling.SUM)
    want = _engine_arrays(eng)  # the initial states (AdaGrad's accumulator at 0.1)
    for step in range(4):
        rows = rng.integers(0, 12 if step else 6, size=9)  # rows 6.. first touched at step 2+
        offsets = np.array([0, 2, 5, 6, 9])  # bags (sample, slot): 2, 3, 1, 3 keys
        eng.set_hyper_parameters(learning_rate=0.05, scaler=2.0)
        out, ctx = eng.forward(rows, offsets)
        dy = rng.normal(size=out.shape).astype(np.float32)
        eng.backward(ctx, dy)
        uniq, grads = EB.embedding_bag_backward_ref(dy.reshape(-1, 4), rows, offsets, EB.SUM)
        want = _sparse_ref(o, want[0], want[1:], uniq, grads, 0.05, 2.0, step + 1, 12)
    for got, ref in zip(_engine_arrays(eng), want):
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-6)


def _dense_adam64(table, m, v, rows, grads, lr, b1, b2, eps, t, scaler):
    """Plain Adam on EVERY row of the table, cold rows having g = 0 (float64, flat)."""
    g = np.zeros(table.shape)
    g[rows] = grads  # (V, D); cold rows 0
    flat = [np.asarray(a, np.float64).reshape(-1) for a in (table, m, v, g)]
    return [a.reshape(table.shape) for a in opt.adam_update_ref(*flat, lr, b1, b2, eps, t, scaler)]


@given(case=sparse_case(), lr=lrs, b1=betas1, b2=betas2, eps=epss, t=steps, scaler=scalers)
def test_adam_global_equals_dense_adam_with_zero_cold_grads(case, lr, b1, b2, eps, t, scaler):
    """hot + all (HugeCTR's two passes) == plain Adam on every row, cold rows having g = 0."""
    table, m, v, rows, grads = case
    n = table.shape[0]
    # the references, in float64: equal to rounding
    dense = _dense_adam64(table, m, v, rows, grads, lr, b1, b2, eps, t, scaler)
    m64, v64 = opt.sparse_adam_global_hot_ref(
        m.astype(np.float64), v.astype(np.float64), rows, grads.astype(np.float64), b1, b2, scaler
    )
    two_pass = opt.sparse_adam_global_all_ref(table.astype(np.float64), m64, v64, n, lr, b1, b2, eps, t)
    for got, want in zip(two_pass, dense):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # the engine's fused update, in float32, against plain Adam with the float32-rounded scalars it receives
    b1, b2, eps, scaler = (float(np.float32(x)) for x in (b1, b2, eps, scaler))
    dense = _dense_adam64(table, m, v, rows, grads, lr, b1, b2, eps, t, scaler)
    eng = _engine(_hc("Adam", "Global", beta1=b1, beta2=b2, epsilon=eps), table)
    _set_states(eng, [m, v])
    eng.step = t - 1
    _engine_step(eng, rows, grads, lr, scaler)
    for got, want, before in zip(_engine_arrays(eng), dense, (table, m, v)):
        close(got, want, before, rtol=1e-4)


def test_sparse_adam_global_cold_rows_drift():
    # a row with momentum but no gradient still moves under Global, not under Local
    table = np.zeros((2, 1), np.float32)
    m = np.array([[0.5], [0.0]], np.float32)
    v = np.array([[0.25], [0.0]], np.float32)
    rows, grads = np.array([1], np.int64), np.array([[1.0]], np.float32)
    w_loc = table.copy()
    w_loc[rows] = opt.adam_update_ref(table[rows], m[rows], v[rows], grads, 0.1, 0.9, 0.999, 1e-7, 3, 1.0)[0]
    assert w_loc[0, 0] == 0.0 and w_loc[1, 0] != 0.0
    m2, v2 = opt.sparse_adam_global_hot_ref(m, v, rows, grads, 0.9, 0.999, 1.0)
    w_glb, m_glb, _ = opt.sparse_adam_global_all_ref(table, m2, v2, 2, 0.1, 0.9, 0.999, 1e-7, 3)
    assert w_glb[0, 0] < 0.0 and m_glb[0, 0] == np.float32(0.45)


def test_sparse_refs_reject_duplicate_rows():
    table = np.zeros((4, 2), np.float32)
    rows = np.array([1, 3, 1], np.int64)
    grads = np.ones((3, 2), np.float32)
    with pytest.raises(AssertionError):
        opt.sparse_adam_global_hot_ref(table, table, rows, grads, 0.9, 0.999, 1.0)
    with pytest.raises(AssertionError):
        opt.sparse_momentum_sgd_global_hot_ref(table, rows, grads, 0.1, 0.9, 1.0)
    with pytest.raises(AssertionError):
        opt.sparse_nesterov_global_hot_ref(table, table, rows, grads, 0.1, 0.9, 1.0)


@pytest.mark.parametrize("o_name", ["SGD", "MomentumSGD", "Nesterov", "AdaGrad", "Adam"])
def test_an_empty_batch_leaves_a_local_table_alone(o_name):
    eng = _engine(_hc(o_name, "Local"), np.ones((3, 2), np.float32))
    before = _engine_arrays(eng)
    _engine_step(eng, np.zeros(0, np.int64), np.zeros((0, 2), np.float32), 0.1, 1.0)
    for a, b in zip(_engine_arrays(eng), before):
        np.testing.assert_array_equal(a, b)


# ---- helpers for the rest of the optimizers ---------------------------------------------------
factors = st.sampled_from([0.0, 0.5, 0.9, 0.99])  # momentum_factor (0 is CreateOptimizer's default)


def _kernel(fn, arrays, *args):
    """Run a launch wrapper on device copies of `arrays` (those it updates in place); host results."""
    d = [dev(a) for a in arrays]
    fn(*d, *args)
    return [host(a) for a in d]


def _close_all(got, want, before, rtol=RTOL):
    for g, w, b in zip(got, want, before):
        close(g, w, b, rtol=rtol)


# ---- dense: MomentumSGD, Nesterov, AdaGrad ----------------------------------------------------
@given(data=st.data(), w=vecs, lr=lrs, f=factors, scaler=scalers)
def test_momentum_sgd_kernel_matches_ref(data, w, lr, f, scaler):
    g, m = data.draw(f32_arrays(w.shape)), data.draw(f32_arrays(w.shape, -1.0, 1.0))
    got = _kernel(lambda dw, dm: opt.momentum_sgd_update(dw, dm, dev(g), lr, f, scaler), (w, m))
    _close_all(got, opt.momentum_sgd_update_ref(w, m, g, lr, f, scaler), (w, m))


@given(data=st.data(), w=vecs, lr=lrs, mu=factors, scaler=scalers)
def test_nesterov_kernel_matches_ref(data, w, lr, mu, scaler):
    g, a = data.draw(f32_arrays(w.shape)), data.draw(f32_arrays(w.shape, -1.0, 1.0))
    got = _kernel(lambda dw, da: opt.nesterov_update(dw, da, dev(g), lr, mu, scaler), (w, a))
    _close_all(got, opt.nesterov_update_ref(w, a, g, lr, mu, scaler), (w, a))


@given(data=st.data(), w=vecs, lr=lrs, eps=epss, scaler=scalers)
def test_adagrad_kernel_matches_ref(data, w, lr, eps, scaler):
    g, acc = data.draw(f32_arrays(w.shape)), data.draw(f32_arrays(w.shape, 0.0, 5.0))
    got = _kernel(lambda dw, da: opt.adagrad_update(dw, da, dev(g), lr, eps, scaler), (w, acc))
    _close_all(got, opt.adagrad_update_ref(w, acc, g, lr, eps, scaler), (w, acc))


def test_dense_rules_by_hand():
    w, g = np.array([1.0, -1.0], np.float32), np.array([4.0, -2.0], np.float32)  # g/scaler = 2, -1
    m = np.array([0.5, 0.25], np.float32)
    w1, m1 = opt.momentum_sgd_update_ref(w, m, g, 0.5, 0.5, 2.0)  # m = 0.5 m - 0.5 g; w += m
    np.testing.assert_array_equal(m1, [-0.75, 0.625])
    np.testing.assert_array_equal(w1, [0.25, -0.375])
    w2, a2 = opt.nesterov_update_ref(w, m, g, 0.5, 0.5, 2.0)  # w += -0.5 a + 1.5 a_new
    np.testing.assert_array_equal(a2, m1)
    np.testing.assert_array_equal(w2, w - 0.5 * m + 1.5 * m1)
    w3, acc3 = opt.adagrad_update_ref(w, np.ones(2, np.float32) * 5, g, 0.5, 0.0, 2.0)  # acc = 9, 6
    np.testing.assert_allclose(acc3, [9.0, 6.0])
    np.testing.assert_allclose(w3, [1.0 - 0.5 * 2 / 3, -1.0 + 0.5 / math.sqrt(6)], rtol=1e-6)
    for fn, arrays, args in (
        (opt.momentum_sgd_update, (w, m), (0.5, 0.5, 2.0)),
        (opt.nesterov_update, (w, m), (0.5, 0.5, 2.0)),
        (opt.adagrad_update, (w, np.full(2, 5, np.float32)), (0.5, 0.0, 2.0)),
    ):
        got = _kernel(lambda *d: fn(*d, dev(g), *args), arrays)
        want = {opt.momentum_sgd_update: (w1, m1), opt.nesterov_update: (w2, a2), opt.adagrad_update: (w3, acc3)}[fn]
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    empty = np.zeros(0, np.float32)
    opt.momentum_sgd_update(empty, empty, empty, 0.1, 0.9, 1.0)
    opt.nesterov_update(empty, empty, empty, 0.1, 0.9, 1.0)
    opt.adagrad_update(empty, empty, empty, 0.1, 1e-7, 1.0)
    opt.ftrl_update(empty, empty, empty, empty, 0.1, 0.0, 0.0, 0.0, 1.0)


# ---- dense: Ftrl ------------------------------------------------------------------------------
def _ftrl_spec64(w, z, n, g, lr, beta, l1, l2, scaler):
    """Spec §3.2 transcribed element by element in float64 (E = FLT_EPSILON, sign(0) = +1)."""
    E = 2.0**-23
    w, z, n = (np.array(a, np.float64) for a in (w, z, n))
    for i in range(w.size):
        gi = float(g[i]) / scaler
        n_new = n[i] + gi * gi
        z[i] = z[i] + gi + (math.sqrt(n[i] + E) - math.sqrt(n_new + E)) * w[i] / lr
        if abs(z[i]) > l1:
            sign = 1.0 if z[i] >= 0 else -1.0
            w[i] = (l1 * sign - z[i]) / (math.sqrt(n_new + E) / lr + l2 + beta / lr)
        else:
            w[i] = 0.0
        n[i] = n_new
    return w, z, n


def test_ftrl_ref_matches_spec_transcription_float64():
    rng = np.random.default_rng(5)
    for lr, beta, l1, l2, scaler in (
        (0.1, 0.0, 0.0, 0.0, 1.0),
        (0.05, 0.5, 0.3, 0.01, 4.0),
        (1.0, 1.0, 2.0, 0.5, 1024.0),
    ):
        w, z, n = rng.normal(size=64), np.zeros(64), np.zeros(64)
        ws, zs, ns = w.copy(), z.copy(), n.copy()
        zeroed = 0
        for _ in range(5):  # several steps: z and n feed back
            g = rng.normal(size=64) * scaler
            w, z, n = opt.ftrl_update_ref(w, z, n, g, lr, beta, l1, l2, scaler)
            ws, zs, ns = _ftrl_spec64(ws, zs, ns, g, lr, beta, l1, l2, scaler)
            zeroed += int((w == 0).sum())
        for got, want in ((w, ws), (z, zs), (n, ns)):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
        assert (l1 == 0) == (zeroed == 0)  # lambda1 > 0 zeroes the small-|z| weights


def _ftrl_w_from_state(z, n, lr, beta, l1, l2):
    """The closed-form weight from (z, n_new) in float64 with the kernel's float32 scalars."""
    l2p = float(opt.ftrl_lambda2(lr, beta, l2))
    lr, l1, eps = float(np.float32(lr)), float(np.float32(l1)), float(opt.FLT_EPSILON)
    z, n = np.asarray(z, np.float64), np.asarray(n, np.float64)
    w = (l1 * np.where(np.signbit(z), -1.0, 1.0) - z) / (np.sqrt(n + eps) / lr + l2p)
    return np.where(np.abs(z) > l1, w, 0.0)


@given(
    data=st.data(),
    w=vecs,
    lr=st.sampled_from([0.0, 0.01, 0.1, 1.0]),
    beta=st.floats(0.0, 1.0),
    l1=st.floats(0.0, 1.0),
    l2=st.floats(0.0, 1.0),
    scaler=scalers,
)
def test_ftrl_kernel_matches_ref(data, w, lr, beta, l1, l2, scaler):
    g = data.draw(f32_arrays(w.shape))
    z, n = data.draw(f32_arrays(w.shape)), data.draw(f32_arrays(w.shape, 0.0, 10.0))
    gw, gz, gn = _kernel(lambda *d: opt.ftrl_update(*d, dev(g), lr, beta, l1, l2, scaler), (w, z, n))
    ww, wz, wn = opt.ftrl_update_ref(w, z, n, g, lr, beta, l1, l2, scaler)
    close(gn, wn, n)
    # z = z + g + (sqrt(n + E) - sqrt(n_new + E)) w / lr: float32 error scales with the terms
    w64, n64, gs = (np.asarray(a, np.float64) for a in (w, n, g / np.float32(scaler)))
    terms = np.abs(z) + np.abs(gs)
    if lr:
        terms += (np.sqrt(n64) + np.sqrt(n64 + gs * gs) + 1e-3) * np.abs(w64) / lr
    assert (np.abs(gz - wz) <= 1e-5 * terms + 1e-6).all()
    if lr == 0:  # frozen: weights stay, sums still take g
        np.testing.assert_array_equal(gw, w)
        return
    # the weight is the closed form of the kernel's own (z, n); skip |z| within rounding of lambda1
    want_w = _ftrl_w_from_state(gz, gn, lr, beta, l1, l2)
    far = np.abs(np.abs(gz.astype(np.float64)) - np.float32(l1)) > 1e-5 * (np.abs(gz) + l1) + 1e-7
    np.testing.assert_allclose(gw[far], want_w[far], rtol=1e-5, atol=1e-7)


def test_ftrl_first_step_by_hand_and_frozen():
    # z = n = 0, w = 0: z = g, n = g^2, w = -(z - l1 sign z) / (sqrt(g^2 + E)/lr + l2 + beta/lr)
    g = np.array([3.0, -0.5, 0.1], np.float32)
    lr, beta, l1, l2 = 0.5, 1.0, 0.2, 0.25
    zero = np.zeros(3, np.float32)
    E = float(opt.FLT_EPSILON)
    den = np.sqrt(g.astype(np.float64) ** 2 + E) / lr + l2 + beta / lr
    want_w = np.array([-(3.0 - 0.2) / den[0], (0.5 - 0.2) / den[1], 0.0])
    for w1, z1, n1 in (
        opt.ftrl_update_ref(zero, zero, zero, g, lr, beta, l1, l2, 1.0),
        _kernel(lambda *d: opt.ftrl_update(*d, dev(g), lr, beta, l1, l2, 1.0), (zero, zero, zero)),
    ):
        np.testing.assert_allclose(z1, g, rtol=1e-6)
        np.testing.assert_allclose(n1, g * g, rtol=1e-6)
        np.testing.assert_allclose(w1, want_w, rtol=1e-5)
    w = np.array([0.5, -0.5, 2.0], np.float32)
    for w0, z0, n0 in (
        opt.ftrl_update_ref(w, zero, zero, g, 0.0, beta, l1, l2, 1.0),
        _kernel(lambda *d: opt.ftrl_update(*d, dev(g), 0.0, beta, l1, l2, 1.0), (w, zero, zero)),
    ):
        np.testing.assert_array_equal(w0, w)
        np.testing.assert_array_equal(z0, g)
        np.testing.assert_array_equal(n0, g * g)


# ---- sparse: MomentumSGD and Nesterov Global, as HugeCTR's two passes -------------------------
def _every_row64(row_ref, arrays, rows, grads, *args):
    """The Local rule applied to EVERY row, cold rows having g = 0 (float64)."""
    g = np.zeros(arrays[0].shape)
    g[rows] = grads
    return row_ref(*[np.asarray(a, np.float64) for a in arrays], g, *args)


@given(case=sparse_case(), lr=lrs, f=st.floats(0.1, 0.99), scaler=scalers)
def test_momentum_global_equals_every_row_local(case, lr, f, scaler):
    table, m, _, rows, grads = case
    n = table.shape[0]
    want = _every_row64(opt.momentum_sgd_update_ref, (table, m), rows, grads, lr, f, scaler)
    m64 = opt.sparse_momentum_sgd_global_hot_ref(m.astype(np.float64), rows, grads.astype(np.float64), lr, f, scaler)
    got = opt.sparse_momentum_sgd_global_all_ref(table.astype(np.float64), m64, n, f)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@given(case=sparse_case(), lr=lrs, mu=factors, scaler=scalers)
def test_nesterov_global_equals_every_row_local(case, lr, mu, scaler):
    table, a, _, rows, grads = case
    want = _every_row64(opt.nesterov_update_ref, (table, a), rows, grads, lr, mu, scaler)
    after_all = opt.sparse_nesterov_global_all_ref(table.astype(np.float64), a.astype(np.float64), table.shape[0], mu)
    got = opt.sparse_nesterov_global_hot_ref(*after_all, rows, grads.astype(np.float64), lr, mu, scaler)
    for x, y in zip(got, want):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)


# ---- sparse: Adam LazyGlobal ------------------------------------------------------------------
def test_lazy_adam_hot_every_step_is_plain_adam_one_step_late():
    """A row hot at every step: the weight gets plain Adam's update of the PREVIOUS step."""
    rng = np.random.default_rng(11)
    lr, b1, b2, eps, scaler = 0.01, 0.9, 0.999, 1e-7, 1.0
    w0 = rng.normal(size=(3, 4))
    zeros = np.zeros_like(w0)
    lazy = (w0, zeros, zeros, np.ones(w0.shape, np.int64))
    adam = [(w0, zeros, zeros)]
    grads = [rng.normal(size=w0.shape) for _ in range(7)]
    for t, g in enumerate(grads, start=1):
        lazy = opt.adam_lazy_update_ref(*lazy, g, lr, b1, b2, eps, t, scaler)
        adam.append(opt.adam_update_ref(*adam[-1], g, lr, b1, b2, eps, t, scaler))
        np.testing.assert_allclose(lazy[0], adam[t - 1][0], rtol=1e-12)  # w one step late
        np.testing.assert_allclose(lazy[1], adam[t][1], rtol=1e-12)  # m, v in step
        np.testing.assert_allclose(lazy[2], adam[t][2], rtol=1e-12)
    # and the engine's fused update, in float32
    eng = _engine(_hc("Adam", "LazyGlobal", beta1=b1, beta2=b2, epsilon=eps), w0.astype(np.float32))
    for g in grads:
        _engine_step(eng, np.arange(3), g, lr, scaler)
    w, m, _, prev = _engine_arrays(eng)
    np.testing.assert_allclose(w, adam[6][0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(m, adam[7][1], rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(prev, 7)


def _hugectr_lazy64(w, steps, lr, b1, b2, eps):
    """HugeCTR's opt_adam_kernel_lazy, element by element in float64. steps: [(rows, grads), ...]."""
    w = np.array(w, np.float64)
    m, v, prev = np.zeros_like(w), np.zeros_like(w), np.ones(w.shape, np.int64)
    for t, (rows, grads) in enumerate(steps, start=1):
        for u, r in enumerate(rows):
            for d in range(w.shape[1]):
                p = int(prev[r, d])
                skipped = t - p
                alpha = lr / (1 - b1) * math.sqrt(1 - b2**p) / (1 - b1**p) * (1 - b1**skipped)
                w[r, d] -= alpha * m[r, d] / (math.sqrt(v[r, d]) + eps)
                gi = float(grads[u, d])
                m[r, d] = b1**skipped * m[r, d] + (1 - b1) * gi
                v[r, d] = b2**skipped * v[r, d] + (1 - b2) * gi * gi
                prev[r, d] = t
    return w, m, v, prev


def test_lazy_adam_catch_up_after_skipped_steps_matches_hugectr_formula():
    from numbactr.runtime import device

    rng = np.random.default_rng(2)
    lr, b1, b2, eps = 0.05, 0.875, 1 - 2.0**-10, 1e-7  # exact in float32
    w0 = rng.normal(size=(6, 3)).astype(np.float32)
    steps = []
    for _ in range(12):  # rows hot at random; 5 never hot
        rows = np.flatnonzero(rng.random(5) < 0.4).astype(np.int64)
        steps.append((rows, rng.normal(size=(rows.size, 3)).astype(np.float32)))
    want = _hugectr_lazy64(w0, steps, lr, b1, b2, eps)
    assert (want[3][:5] > 1).any() and (np.diff([s[0].size for s in steps]) != 0).any()
    assert any(s[0].size == 0 for s in steps)  # a step with no row at all
    o = _hc("Adam", "LazyGlobal", beta1=b1, beta2=b2, epsilon=eps)
    before = device.kind()
    try:
        for kind in ("cpu", before):
            device.set_device(kind)
            eng = _engine(o, w0)
            for rows, grads in steps:
                _engine_step(eng, rows, grads, lr, 1.0)
            table, m, v, prev = _engine_arrays(eng)
            np.testing.assert_allclose(table, want[0], rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(m, want[1], rtol=1e-4, atol=1e-7)
            np.testing.assert_allclose(v, want[2], rtol=1e-4, atol=1e-9)
            np.testing.assert_array_equal(prev, want[3][:, 0])  # HugeCTR's per-element prev_time: one per row
            np.testing.assert_array_equal(table[5], w0[5])
    finally:
        device.set_device(before)


# ---- AdaGrad's initial accumulator (compat switch) --------------------------------------------
def _f32_bytes(b):
    return np.frombuffer(bytes([b] * 4), "<f4")[0]


@pytest.mark.parametrize(
    "value,exact,want",
    [
        (0.0, False, 0.0),
        (0.1, False, np.float32(0.1)),
        (2.5, False, 2.5),
        (0.0, True, 0.0),
        (0.1, True, 0.0),
        (0.99, True, 0.0),
        (1.0, True, _f32_bytes(1)),
        (2.5, True, _f32_bytes(2)),
        (256.0, True, 0.0),
        (257.9, True, _f32_bytes(1)),
    ],
)
def test_adagrad_initial_accumulator(value, exact, want):
    got = opt.adagrad_initial_accumulator(value, exact)
    assert got.dtype == np.float32 and got == np.float32(want)


def test_adagrad_initial_accumulator_exact_bytes():
    assert opt.adagrad_initial_accumulator(1.0, True) == np.float32(2.3694278e-38)  # 0x01010101
    assert np.isnan(opt.adagrad_initial_accumulator(-1.0, True))  # 0xFFFFFFFF


def test_adagrad_state_follows_compat_switch():
    from numbactr import hugectr_exact as compat
    from numbactr.config import CreateOptimizer
    from numbactr.enums import Optimizer_t, Update_t
    from numbactr.optim import DenseOptimizer

    o = CreateOptimizer(optimizer_type=Optimizer_t.AdaGrad, update_type=Update_t.Local, initial_accu_value=0.5)
    was = compat.hugectr_exact()

    def sparse_state():
        return host(_engine(o, np.zeros((4, 2), np.float32)).split_optimizer_states()[0][0])

    try:
        compat.set_hugectr_exact(False)
        assert (np.asarray(DenseOptimizer(o, 5).states[0]) == np.float32(0.5)).all()
        assert (sparse_state() == np.float32(0.5)).all()
        compat.set_hugectr_exact(True)
        assert (np.asarray(DenseOptimizer(o, 5).states[0]) == 0).all()
        assert (sparse_state() == 0).all()
    finally:
        compat.set_hugectr_exact(was)


# ---- the optimizer classes: combinations, states, scaler, freezing, sim == cpu ---------------
def _classes():
    from numbactr.config import CreateOptimizer
    from numbactr.enums import Optimizer_t, Update_t
    from numbactr import optim

    return CreateOptimizer, Optimizer_t, Update_t, optim


def test_every_hugectr_combination_builds_and_the_rest_raise_with_names():
    CreateOptimizer, O, U, optim = _classes()
    for t in O:
        for u in U:
            o = CreateOptimizer(optimizer_type=t, update_type=u)
            if t == O.RMSProp:  # not in HugeCTR's dense network nor SparseEmbedding
                with pytest.raises(NotImplementedError, match="RMSProp"):
                    optim.DenseOptimizer(o, 4)
            else:
                d = optim.DenseOptimizer(o, 4)  # dense ignores update_type
                assert len(d.states) == o.n_states or u == U.LazyGlobal
            if (t, u) in optim.SUPPORTED:
                states = _engine(o, np.zeros((3, 2), np.float32)).split_optimizer_states()[0]
                assert len(states) == o.n_states  # LazyGlobal: m, v and the per-row previous step
                elem = states[:-1] if u == U.LazyGlobal else states
                assert all(a.shape == (3, 2) and a.dtype == np.float32 for a in elem)
            else:
                with pytest.raises(NotImplementedError, match=rf"SparseEmbedding 'e'.*{t.name} with Update_t.{u.name}"):
                    sparse_optimizer_spec(o, "SparseEmbedding 'e'")
    assert len(optim.SUPPORTED) == 11
    for b1, b2 in ((0.0, 0.999), (0.9, 0.0)):
        o = CreateOptimizer(optimizer_type=O.Adam, update_type=U.Global, beta1=b1, beta2=b2)
        with pytest.raises(ValueError, match="Adam with Update_t.Global needs beta1 > 0 and beta2 > 0"):
            sparse_optimizer_spec(o, "e")
        sparse_optimizer_spec(CreateOptimizer(optimizer_type=O.Adam, update_type=U.Local, beta1=b1, beta2=b2), "e")


def _one_step(o, sparse, dev_kind, scaler=1.0, gscale=1.0, lr=0.1, steps=1, seed=0):
    """Run `steps` updates of a DenseOptimizer / the engine's sparse optimizer on device `dev_kind`; host
    arrays [w, *states]."""
    from numbactr.runtime import device
    from numbactr.optim import DenseOptimizer

    rng = np.random.default_rng(seed)
    before = device.kind()
    device.set_device(dev_kind)
    try:
        w = rng.normal(size=(7, 3) if sparse else 21).astype(np.float32)
        so = _engine(o, w, live=6) if sparse else DenseOptimizer(o, w.size)  # row 6 is never live
        for _ in range(steps):
            g = (rng.normal(size=(4, 3) if sparse else 21) * gscale).astype(np.float32)
            if sparse:
                _engine_step(so, rng.permutation(6)[:4], g, lr, scaler)
            else:
                so.step(w, g, lr, scaler)
        return _engine_arrays(so) if sparse else [w] + [np.array(s) for s in so.states]
    finally:
        device.set_device(before)


def _all_combos(momentum_factor=0.9):
    CreateOptimizer, O, U, optim = _classes()
    hp = {
        O.MomentumSGD: dict(momentum_factor=momentum_factor),
        O.Nesterov: dict(momentum_factor=momentum_factor),
        O.Ftrl: dict(beta=0.1, lambda1=0.01, lambda2=0.01),
    }  # each type gets only its own (others warn)
    out = [
        (CreateOptimizer(optimizer_type=t, update_type=u, **hp.get(t, {})), True)
        for t, u in sorted(optim.SUPPORTED, key=lambda c: (c[0].name, c[1].name))
    ]
    hp[O.AdaGrad] = dict(initial_accu_value=0.1)
    out += [
        (CreateOptimizer(optimizer_type=t, update_type=U.Local, **hp.get(t, {})), False)
        for t in sorted(optim.DENSE_SUPPORTED, key=lambda t: t.name)
    ]
    return out


def _combo_id(c):
    o, sparse = c
    return f"{'sparse' if sparse else 'dense'}-{o.optimizer_type.name}-{o.update_type.name}"


@pytest.mark.parametrize("combo", _all_combos(), ids=_combo_id)
def test_optimizer_sim_matches_cpu_over_steps(combo):
    from numbactr.runtime import device

    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    o, sparse = combo
    cpu, sim = _one_step(o, sparse, "cpu", steps=3), _one_step(o, sparse, "sim", steps=3)
    for a, b in zip(sim, cpu):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("combo", _all_combos(), ids=_combo_id)
def test_scaler_divides_every_gradient(combo):
    from numbactr.runtime import device

    o, sparse = combo
    for kind in ("cpu", device.kind()):
        base = _one_step(o, sparse, kind, steps=2)
        scaled = _one_step(o, sparse, kind, scaler=1024.0, gscale=1024.0, steps=2)
        unscaled = _one_step(o, sparse, kind, scaler=1024.0, steps=2)
        for a, b in zip(scaled, base):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert not np.allclose(unscaled[0], base[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("combo", _all_combos(momentum_factor=0.5), ids=_combo_id)
def test_lr_zero_freezes_weights_but_states_update(combo):
    from numbactr.runtime import device

    o, sparse = combo
    from numbactr.optim import DenseOptimizer

    for kind in ("cpu", device.kind()):
        warm = _one_step(o, sparse, kind, steps=1, seed=3)  # w and states after a real step
        before = device.kind()
        device.set_device(kind)
        try:
            g = np.random.default_rng(4).normal(size=(4, 3) if sparse else warm[0].size).astype(np.float32)
            if sparse:
                eng = _engine(o, warm[0], live=6)
                _set_states(eng, warm[1:])
                eng.step = 1
                _engine_step(eng, np.array([0, 2, 3, 5]), g, 0.0, 1.0)
                w, states = _engine_arrays(eng)[0], _engine_arrays(eng)[1:]
            else:
                w = warm[0].copy()
                so = DenseOptimizer(o, w.size)
                for s, val in zip(so.states, warm[1:]):
                    s[...] = val
                so.t = 1
                so.step(w, g, 0.0, 1.0)
                states = so.states
        finally:
            device.set_device(before)
        name = o.optimizer_type.name
        if name in ("MomentumSGD", "Nesterov"):
            # HugeCTR's freeze is lr = 0: the weights keep moving on the remaining momentum
            m_old = warm[1]
            drift = 0.5 * m_old if name == "MomentumSGD" else 0.25 * m_old  # f m  /  mu^2 a
            if sparse and o.update_type.name == "Local":
                keep = np.ones(7, bool)
                keep[[0, 2, 3, 5]] = False
                drift[keep] = 0
            elif sparse:
                drift[6] = 0
            np.testing.assert_allclose(w, warm[0] + drift, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(w, warm[0])
        if name != "SGD":
            changed = [not np.array_equal(np.asarray(s), old) for s, old in zip(states, warm[1:])]
            assert all(changed), (name, changed)


def test_states_in_hugectr_file_order():
    """One step from zero state with w = 0 tells each state apart: Adam [m, v], Ftrl [z, n], ..."""
    CreateOptimizer, O, U, optim = _classes()
    from numbactr.runtime import device

    before = device.kind()
    device.set_device("cpu")
    try:
        g = np.array([2.0, -4.0], np.float32)
        for t, want in (
            (O.Adam, [0.1 * g, 0.001 * g * g]),
            (O.Ftrl, [g, g * g]),
            (O.AdaGrad, [g * g]),
            (O.MomentumSGD, [-0.5 * g]),
            (O.Nesterov, [-0.5 * g]),
            (O.SGD, []),
        ):
            d = optim.DenseOptimizer(CreateOptimizer(optimizer_type=t, beta1=0.9, beta2=0.999), 2)
            d.step(np.zeros(2, np.float32), g, 0.5, 1.0)
            assert len(d.states) == len(want), t
            for s, w in zip(d.states, want):
                np.testing.assert_allclose(s, w, rtol=1e-4, err_msg=t.name)  # 1 - f32(0.9)
        m, v, prev = _engine(
            CreateOptimizer(optimizer_type=O.Adam, update_type=U.LazyGlobal), np.zeros((3, 2), np.float32)
        ).split_optimizer_states()[0]
        assert m.shape == v.shape == (3, 2) and prev.dtype == np.int64 and (prev == 1).all()
    finally:
        device.set_device(before)


def test_momentum_global_with_zero_factor_is_every_row_local():
    """momentum_factor = 0 (the default): HugeCTR's two passes would divide by 0; ours give the semantics."""
    CreateOptimizer, O, U, optim = _classes()
    from numbactr.runtime import device

    o = CreateOptimizer(optimizer_type=O.MomentumSGD, update_type=U.Global, momentum_factor=0.0)
    rng = np.random.default_rng(8)
    table, m = rng.normal(size=(5, 2)).astype(np.float32), rng.normal(size=(5, 2)).astype(np.float32)
    rows, grads = np.array([3, 1], np.int64), rng.normal(size=(2, 2)).astype(np.float32)
    want = _every_row64(opt.momentum_sgd_update_ref, (table, m), rows, grads, 0.1, 0.0, 1.0)
    before = device.kind()
    try:
        for kind in ("cpu", before):
            device.set_device(kind)
            eng = _engine(o, table)
            _set_states(eng, [m])
            _engine_step(eng, rows, grads, 0.1, 1.0)
            w, m_new = _engine_arrays(eng)
            assert np.isfinite(w).all()
            np.testing.assert_allclose(w, want[0], rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(m_new, want[1], rtol=1e-6, atol=1e-7)
    finally:
        device.set_device(before)


# ---- a larger launch on a real GPU ------------------------------------------------------------
@pytest.mark.gpu
def test_optimizers_on_gpu():
    rng = np.random.default_rng(3)
    p = 300000
    w = rng.normal(size=p).astype(np.float32)
    g = rng.normal(size=p).astype(np.float32)
    m, v = rng.normal(size=p).astype(np.float32), rng.random(p).astype(np.float32)
    dw, dm, dv = dev(w), dev(m), dev(v)
    opt.adam_update(dw, dm, dv, dev(g), 0.01, 0.9, 0.999, 1e-7, 7, 1024.0)
    for got, ref in zip((dw, dm, dv), opt.adam_update_ref(w, m, v, g, 0.01, 0.9, 0.999, 1e-7, 7, 1024.0)):
        np.testing.assert_allclose(host(got), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_other_optimizers_on_gpu():
    rng = np.random.default_rng(4)
    p = 300000
    w, g = rng.normal(size=p).astype(np.float32), rng.normal(size=p).astype(np.float32)
    s1, s2 = rng.normal(size=p).astype(np.float32), rng.random(p).astype(np.float32)
    dense = [
        (opt.momentum_sgd_update, opt.momentum_sgd_update_ref, (w, s1), (0.01, 0.9, 8.0)),
        (opt.nesterov_update, opt.nesterov_update_ref, (w, s1), (0.01, 0.9, 8.0)),
        (opt.adagrad_update, opt.adagrad_update_ref, (w, s2), (0.01, 1e-7, 8.0)),
        (opt.ftrl_update, opt.ftrl_update_ref, (w, s1, s2), (0.05, 0.1, 0.01, 0.01, 8.0)),
    ]
    for fn, ref, arrays, args in dense:
        got = _kernel(lambda *a: fn(*a, dev(g), *args), arrays)
        want = ref(*arrays, g, *args)
        for a, b in zip(got[:-1] if fn is opt.ftrl_update else got, want):  # Ftrl w: see the property test
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
