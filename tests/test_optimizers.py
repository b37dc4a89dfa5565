import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.kernels import optimizers as opt
from tests.kernel_util import dev, f32_arrays, host

RTOL, ATOL = 1e-5, 1e-6

lrs = st.floats(1e-4, 1.0)
scalers = st.sampled_from([1.0, 128.0, 1024.0])       # Solver scaler: 1 or a mixed-precision value
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
    lr, b1, b2, eps, scaler = 0.01, 0.875, 1 - 2.0 ** -10, 1e-7, 2.0
    w = np.array([1.0, 1.0, 1.0], np.float32)
    g = np.array([4.0, -0.5, 0.0], np.float32)                 # g/scaler = 2, -0.25, 0
    gs = g / scaler
    want_w = w - lr * gs / (np.abs(gs) + eps / math.sqrt(1 - b2))
    want_w[2] = 1.0                                             # zero gradient: no move
    for w_new, m_new, v_new in (opt.adam_update_ref(w, 0 * w, 0 * w, g, lr, b1, b2, eps, 1, scaler),
                                _adam_kernel(w, g, lr, b1, b2, eps, 1, scaler)):
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


# ---- sparse -----------------------------------------------------------------------------------
@given(case=sparse_case(), lr=lrs, scaler=scalers)
def test_sparse_sgd_kernel_matches_ref(case, lr, scaler):
    table, _, _, rows, grads = case
    got = dev(table)
    opt.sparse_sgd_update(got, dev(rows), dev(grads), lr, scaler)
    close(host(got), opt.sparse_sgd_update_ref(table, rows, grads, lr, scaler), table)


@given(case=sparse_case(), lr=lrs, b1=betas1, b2=betas2, eps=epss, t=steps, scaler=scalers)
def test_sparse_adam_local_kernel_matches_ref(case, lr, b1, b2, eps, t, scaler):
    table, m, v, rows, grads = case
    dw, dm, dv = dev(table), dev(m), dev(v)
    opt.sparse_adam_local_update(dw, dm, dv, dev(rows), dev(grads), lr, b1, b2, eps, t, scaler)
    want = opt.sparse_adam_local_update_ref(table, m, v, rows, grads, lr, b1, b2, eps, t, scaler)
    for got, ref, before in zip((dw, dm, dv), want, (table, m, v)):
        close(host(got), ref, before)
    cold = np.setdiff1d(np.arange(table.shape[0]), rows)
    np.testing.assert_array_equal(host(dw)[cold], table[cold])          # Local leaves cold rows alone


@given(case=sparse_case(), b1=betas1, b2=betas2, scaler=scalers)
def test_sparse_adam_global_hot_kernel_matches_ref(case, b1, b2, scaler):
    _, m, v, rows, grads = case
    dm, dv = dev(m), dev(v)
    opt.sparse_adam_global_hot(dm, dv, dev(rows), dev(grads), b1, b2, scaler)
    want_m, want_v = opt.sparse_adam_global_hot_ref(m, v, rows, grads, b1, b2, scaler)
    close(host(dm), want_m, m)
    close(host(dv), want_v, v)


@given(case=sparse_case(), data=st.data(), lr=lrs, b1=betas1, b2=betas2, eps=epss, t=steps)
def test_sparse_adam_global_all_kernel_matches_ref(case, data, lr, b1, b2, eps, t):
    table, m, v, _, _ = case
    n_rows = data.draw(st.integers(0, table.shape[0]))                 # a prefix of the pool is live
    dw, dm, dv = dev(table), dev(m), dev(v)
    opt.sparse_adam_global_all(dw, dm, dv, n_rows, lr, b1, b2, eps, t)
    want = opt.sparse_adam_global_all_ref(table, m, v, n_rows, lr, b1, b2, eps, t)
    for got, ref, before in zip((dw, dm, dv), want, (table, m, v)):
        close(host(got), ref, before)
    np.testing.assert_array_equal(host(dw)[n_rows:], table[n_rows:])


def _dense_adam64(table, m, v, rows, grads, lr, b1, b2, eps, t, scaler):
    """Plain Adam on EVERY row of the table, cold rows having g = 0 (float64, flat)."""
    g = np.zeros(table.shape)
    g[rows] = grads                                                   # (V, D); cold rows 0
    flat = [np.asarray(a, np.float64).reshape(-1) for a in (table, m, v, g)]
    return [a.reshape(table.shape) for a in opt.adam_update_ref(*flat, lr, b1, b2, eps, t, scaler)]


@given(case=sparse_case(), lr=lrs, b1=betas1, b2=betas2, eps=epss, t=steps, scaler=scalers)
def test_adam_global_equals_dense_adam_with_zero_cold_grads(case, lr, b1, b2, eps, t, scaler):
    """hot + all (HugeCTR's two passes) == plain Adam on every row, cold rows having g = 0."""
    table, m, v, rows, grads = case
    n = table.shape[0]
    # the references, in float64: equal to rounding
    dense = _dense_adam64(table, m, v, rows, grads, lr, b1, b2, eps, t, scaler)
    m64, v64 = opt.sparse_adam_global_hot_ref(m.astype(np.float64), v.astype(np.float64), rows,
                                              grads.astype(np.float64), b1, b2, scaler)
    two_pass = opt.sparse_adam_global_all_ref(table.astype(np.float64), m64, v64, n, lr, b1, b2, eps, t)
    for got, want in zip(two_pass, dense):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # the kernels, in float32, against plain Adam with the float32-rounded scalars they receive
    b1, b2, eps, scaler = (float(np.float32(x)) for x in (b1, b2, eps, scaler))
    dense = _dense_adam64(table, m, v, rows, grads, lr, b1, b2, eps, t, scaler)
    dw, dm, dv = dev(table), dev(m), dev(v)
    opt.sparse_adam_global_hot(dm, dv, dev(rows), dev(grads), b1, b2, scaler)
    opt.sparse_adam_global_all(dw, dm, dv, n, lr, b1, b2, eps, t)
    for got, want, before in zip((dw, dm, dv), dense, (table, m, v)):
        close(host(got), want, before, rtol=1e-4)


def test_sparse_adam_global_cold_rows_drift():
    # a row with momentum but no gradient still moves under Global, not under Local
    table = np.zeros((2, 1), np.float32)
    m = np.array([[0.5], [0.0]], np.float32)
    v = np.array([[0.25], [0.0]], np.float32)
    rows, grads = np.array([1], np.int64), np.array([[1.0]], np.float32)
    w_loc, _, _ = opt.sparse_adam_local_update_ref(table, m, v, rows, grads, 0.1, 0.9, 0.999, 1e-7, 3, 1.0)
    assert w_loc[0, 0] == 0.0 and w_loc[1, 0] != 0.0
    m2, v2 = opt.sparse_adam_global_hot_ref(m, v, rows, grads, 0.9, 0.999, 1.0)
    w_glb, m_glb, _ = opt.sparse_adam_global_all_ref(table, m2, v2, 2, 0.1, 0.9, 0.999, 1e-7, 3)
    assert w_glb[0, 0] < 0.0 and m_glb[0, 0] == np.float32(0.45)


def test_sparse_refs_reject_duplicate_rows():
    table = np.zeros((4, 2), np.float32)
    rows = np.array([1, 3, 1], np.int64)
    grads = np.ones((3, 2), np.float32)
    with pytest.raises(AssertionError):
        opt.sparse_sgd_update_ref(table, rows, grads, 0.1, 1.0)
    with pytest.raises(AssertionError):
        opt.sparse_adam_local_update_ref(table, table, table, rows, grads, 0.1, 0.9, 0.999, 1e-7, 1, 1.0)
    with pytest.raises(AssertionError):
        opt.sparse_adam_global_hot_ref(table, table, rows, grads, 0.9, 0.999, 1.0)


def test_sparse_empty_rows_is_a_no_op():
    table = np.ones((3, 2), np.float32)
    rows, grads = np.zeros(0, np.int64), np.zeros((0, 2), np.float32)
    opt.sparse_sgd_update(table, rows, grads, 0.1, 1.0)
    opt.sparse_adam_local_update(table, table, table, rows, grads, 0.1, 0.9, 0.999, 1e-7, 1, 1.0)
    opt.sparse_adam_global_hot(table, table, rows, grads, 0.9, 0.999, 1.0)
    opt.sparse_adam_global_all(table, table, table, 0, 0.1, 0.9, 0.999, 1e-7, 1)
    np.testing.assert_array_equal(table, 1.0)
    with pytest.raises(ValueError):
        opt.sparse_adam_global_all(table, table, table, 4, 0.1, 0.9, 0.999, 1e-7, 1)


# ---- a larger launch on a real GPU ------------------------------------------------------------
@pytest.mark.gpu
def test_optimizers_on_gpu():
    rng = np.random.default_rng(3)
    v_rows, d, p = 20000, 64, 300000
    w = rng.normal(size=p).astype(np.float32)
    g = rng.normal(size=p).astype(np.float32)
    m, v = rng.normal(size=p).astype(np.float32), rng.random(p).astype(np.float32)
    dw, dm, dv = dev(w), dev(m), dev(v)
    opt.adam_update(dw, dm, dv, dev(g), 0.01, 0.9, 0.999, 1e-7, 7, 1024.0)
    for got, ref in zip((dw, dm, dv), opt.adam_update_ref(w, m, v, g, 0.01, 0.9, 0.999, 1e-7, 7, 1024.0)):
        np.testing.assert_allclose(host(got), ref, rtol=1e-5, atol=1e-6)
    table = rng.normal(size=(v_rows, d)).astype(np.float32)
    tm, tv = np.zeros_like(table), np.zeros_like(table)
    rows = rng.permutation(v_rows)[:5000].astype(np.int64)
    grads = rng.normal(size=(rows.size, d)).astype(np.float32)
    dw, dm, dv = dev(table), dev(tm), dev(tv)
    opt.sparse_adam_global_hot(dm, dv, dev(rows), dev(grads), 0.9, 0.999, 1.0)
    opt.sparse_adam_global_all(dw, dm, dv, v_rows, 0.01, 0.9, 0.999, 1e-7, 2)
    m2, v2 = opt.sparse_adam_global_hot_ref(tm, tv, rows, grads, 0.9, 0.999, 1.0)
    want = opt.sparse_adam_global_all_ref(table, m2, v2, v_rows, 0.01, 0.9, 0.999, 1e-7, 2)
    for got, ref in zip((dw, dm, dv), want):
        np.testing.assert_allclose(host(got), ref, rtol=1e-4, atol=1e-5)
