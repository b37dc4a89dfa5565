"""BatchNorm, LayerNorm, PReLU_Dice: kernels (sim) vs references, float64 gradient checks, eval mode,
running stats, layer sim == cpu, and validation at Model.add()."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import numbactr as hugectr
from numbactr import hugectr_exact as compat
from numbactr.config import DenseLayer
from numbactr.autograd import Tensor
from numbactr.enums import Layer_t
from numbactr.kernels import batch_norm as bn
from numbactr.kernels import layer_norm as ln
from numbactr.kernels import prelu_dice as dice
from numbactr.layers import LayerError, RunInfo, build
from tests.gradcheck import assert_grad_close, numeric_grad
from tests.kernel_util import dev, f32_arrays, host
from tests.layer_util import assert_sim_matches_cpu, run_layer, small_model
from tests.model_util import tiny_data
from tests.test_cpu_compiled import each_thread_count

POW2 = st.sampled_from([1, 2, 4, 8, 16, 32])


@st.composite
def matrices(draw, max_rows=12, max_cols=4, lo=-4.0, hi=4.0):
    m = draw(st.integers(1, max_rows))
    n = draw(st.integers(1, max_cols))
    return draw(f32_arrays((m, n), lo, hi))


def _f64(*a):
    return [np.asarray(v, np.float64) for v in a]


# ---- BatchNorm kernels -------------------------------------------------------------------------
@given(x=matrices(), tpb=POW2, blocks=st.integers(1, 3), factor=st.sampled_from([1.0, 0.5, 0.0]))
def test_bn_train_kernels_any_grid_match_ref(x, tpb, blocks, factor):
    f = x.shape[1]
    rng = np.random.default_rng(f)
    gamma, beta = rng.normal(size=f).astype(np.float32), rng.normal(size=f).astype(np.float32)
    rm0, rv0 = rng.normal(size=f).astype(np.float32), rng.random(f).astype(np.float32) + 0.5
    y, mean, inv, rm, rv = (dev(np.full_like(a, np.nan)) for a in (x, gamma, gamma, gamma, gamma))
    rm, rv = dev(rm0), dev(rv0)
    bn.make_bn_forward_train_kernel(tpb)[blocks, tpb](
        dev(x), dev(gamma), dev(beta), np.float32(1e-5), np.float32(factor), y, mean, inv, rm, rv
    )
    ry, rmean, rinv, rrm, rrv = bn.batch_norm_forward_ref(*_f64(x, gamma, beta), 1e-5, True, *_f64(rm0, rv0), factor)
    np.testing.assert_allclose(host(mean), rmean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(host(y), ry, rtol=2e-4, atol=2e-3)
    np.testing.assert_allclose(host(rm), rrm, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(host(rv), rrv, rtol=1e-4, atol=1e-4)
    dy = np.random.default_rng(7).normal(size=x.shape).astype(np.float32)
    dx, dg, db = dev(np.full_like(x, np.nan)), dev(np.full_like(gamma, np.nan)), dev(np.full_like(gamma, np.nan))
    bn.make_bn_backward_kernel(tpb)[blocks, tpb](dev(x), dev(dy), dev(gamma), mean, inv, np.int32(1), dx, dg, db)
    rdx, rdg, rdb = bn.batch_norm_backward_ref(*_f64(x, dy, gamma, host(mean), host(inv)), True)
    np.testing.assert_allclose(host(db), rdb, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(host(dg), rdg, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(host(dx), rdx, rtol=1e-3, atol=2e-2)


@given(x=matrices())
def test_bn_eval_kernels_match_ref(x):
    f = x.shape[1]
    rng = np.random.default_rng(f)
    gamma, beta, rm = (rng.normal(size=f).astype(np.float32) for _ in range(3))
    rv = rng.random(f).astype(np.float32) + 0.1
    y, inv = dev(np.full_like(x, np.nan)), dev(np.full_like(gamma, np.nan))
    bn.batch_norm_forward_eval(dev(x), dev(gamma), dev(beta), dev(rm), dev(rv), 1e-5, y, inv)
    ry, _, rinv, _, _ = bn.batch_norm_forward_ref(*_f64(x, gamma, beta), 1e-5, False, *_f64(rm, rv))
    np.testing.assert_allclose(host(y), ry, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(host(inv), rinv, rtol=1e-6)
    dy = rng.normal(size=x.shape).astype(np.float32)
    dx, dg, db = dev(np.zeros_like(x)), dev(np.zeros_like(gamma)), dev(np.zeros_like(gamma))
    bn.batch_norm_backward(dev(x), dev(dy), dev(gamma), dev(rm), inv, False, dx, dg, db)
    rdx, rdg, rdb = bn.batch_norm_backward_ref(*_f64(x, dy, gamma, rm, host(inv)), False)
    np.testing.assert_allclose(host(dx), rdx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(host(dg), rdg, rtol=1e-4, atol=1e-4)


def test_bn_at_256_threads_more_rows_than_threads_and_single_row():
    rng = np.random.default_rng(3)
    for rows in (300, 1):
        x = (rng.normal(size=(rows, 2)) * 3 + 1).astype(np.float32)
        g, b = np.ones(2, np.float32), np.zeros(2, np.float32)
        y, mean, inv = dev(np.zeros_like(x)), dev(np.zeros(2, np.float32)), dev(np.zeros(2, np.float32))
        rm, rv = dev(np.zeros(2, np.float32)), dev(np.ones(2, np.float32))
        bn.batch_norm_forward_train(dev(x), dev(g), dev(b), 1e-5, 1.0, y, mean, inv, rm, rv, threads=256)
        ry, _, _, rrm, rrv = bn.batch_norm_forward_ref(*_f64(x, g, b), 1e-5, True, *_f64(np.zeros(2), np.ones(2)))
        np.testing.assert_allclose(host(y), ry, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(host(rv), rrv, rtol=1e-4, atol=1e-6)  # unbiased; B=1: biased (0)


def test_bn_empty_batch_is_a_no_op():
    x = np.zeros((0, 3), np.float32)
    g = np.ones(3, np.float32)
    bn.batch_norm_forward_train(dev(x), dev(g), dev(g), 1e-5, 1.0, dev(x), dev(g), dev(g), dev(g), dev(g))
    dg = dev(np.full(3, np.nan, np.float32))
    bn.batch_norm_backward(dev(x), dev(x), dev(g), dev(g), dev(g), True, dev(x), dg, dev(g))
    assert np.all(host(dg) == 0)


@pytest.mark.parametrize("training", [True, False])
def test_bn_reference_gradients_float64(training):
    rng = np.random.default_rng(0)
    x, dy = rng.normal(size=(6, 3)), rng.normal(size=(6, 3))
    gamma, beta = rng.normal(size=3), rng.normal(size=3)
    rm, rv = rng.normal(size=3), rng.random(3) + 0.5

    def fwd(x_=x, g_=gamma, b_=beta):
        return bn.batch_norm_forward_ref(x_, g_, b_, 1e-5, training, rm, rv)[0]

    _, mean, inv, _, _ = bn.batch_norm_forward_ref(x, gamma, beta, 1e-5, training, rm, rv)
    dx, dg, db = bn.batch_norm_backward_ref(x, dy, gamma, mean, inv, training)
    assert_grad_close(dx, lambda v: fwd(x_=v), x, dy, rtol=1e-5, atol=1e-6)
    assert_grad_close(dg, lambda v: fwd(g_=v), gamma, dy, rtol=1e-5, atol=1e-6)
    assert_grad_close(db, lambda v: fwd(b_=v), beta, dy, rtol=1e-5, atol=1e-6)


def test_bn_layer_running_stats_eval_mode_and_ntp_roundtrip():
    cfg = DenseLayer(Layer_t.BatchNorm, ["a"], ["b"], factor=1.0)
    layer, (y_train,), _, _, x, (gamma, beta) = run_layer("sim", cfg, (8, 3), training=True)
    # factor=1: the running stats are this batch's mean and UNBIASED variance
    rm, rv = host(layer.running_mean), host(layer.running_var)
    np.testing.assert_allclose(rm, x.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rv, x.astype(np.float64).var(axis=0, ddof=1), rtol=1e-4)
    entry = layer.ntp_entry()
    assert entry["type"] == "BatchNorm" and entry["mean"] == pytest.approx(list(rm))
    # a fresh layer loads them (as from .ntp.json) and its eval forward uses them, unchanged
    layer2 = build(cfg, [(8, 3)])
    layer2.load_ntp_entry(entry)
    layer2.params = [Tensor(gamma), Tensor(beta)]
    out = host(layer2.forward(None, [Tensor(x)], RunInfo(training=False, valid=8))[0].data)
    np.testing.assert_allclose(out, gamma * (x - rm) / np.sqrt(rv + 1e-5) + beta, rtol=1e-4, atol=1e-5)
    assert not np.allclose(out, y_train, rtol=1e-3)  # unbiased vs biased variance
    np.testing.assert_allclose(host(layer2.running_mean), rm)  # eval does not move the stats
    with pytest.raises(LayerError, match="does not fit"):
        layer2.load_ntp_entry({"type": "BatchNorm", "mean": [0.0], "var": [1.0]})


def test_bn_running_average_with_factor():
    cfg = DenseLayer(Layer_t.BatchNorm, ["a"], ["b"], factor=0.25)
    for dev_name in ("cpu", "sim"):
        layer, _, _, _, x, _ = run_layer(dev_name, cfg, (5, 2))
        np.testing.assert_allclose(host(layer.running_mean), 0.25 * x.mean(axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            host(layer.running_var), 0.75 + 0.25 * x.astype(np.float64).var(axis=0, ddof=1), rtol=1e-5
        )


# ---- LayerNorm kernels -------------------------------------------------------------------------
@given(x=matrices(max_rows=4, max_cols=12), tpb=POW2, blocks=st.integers(1, 3))
def test_ln_kernels_any_grid_match_ref(x, tpb, blocks):
    h = x.shape[1]
    rng = np.random.default_rng(h)
    gamma, beta = rng.normal(size=h).astype(np.float32), rng.normal(size=h).astype(np.float32)
    y, mean, inv = (
        dev(np.full_like(x, np.nan)),
        dev(np.zeros(x.shape[0], np.float32)),
        dev(np.zeros(x.shape[0], np.float32)),
    )
    ln.make_ln_forward_kernel(tpb)[blocks, tpb](dev(x), dev(gamma), dev(beta), np.float32(1e-5), y, mean, inv)
    ry, rmean, rinv = ln.layer_norm_forward_ref(*_f64(x, gamma, beta), 1e-5)
    np.testing.assert_allclose(host(y), ry, rtol=2e-4, atol=2e-3)
    dy = rng.normal(size=x.shape).astype(np.float32)
    dx, dg, db = dev(np.full_like(x, np.nan)), dev(np.full_like(gamma, np.nan)), dev(np.full_like(gamma, np.nan))
    ln.make_ln_backward_dx_kernel(tpb)[blocks, tpb](dev(x), dev(dy), dev(gamma), mean, inv, dx)
    ln.make_ln_param_grad_kernel(tpb)[blocks, tpb](dev(x), dev(dy), mean, inv, dg, db)
    rdx, rdg, rdb = ln.layer_norm_backward_ref(*_f64(x, dy, gamma, host(mean), host(inv)))
    np.testing.assert_allclose(host(db), rdb, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(host(dg), rdg, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(host(dx), rdx, rtol=1e-3, atol=2e-2)


def test_ln_reference_gradients_float64():
    rng = np.random.default_rng(0)
    x, dy = rng.normal(size=(2, 3, 5)), rng.normal(size=(2, 3, 5))
    gamma, beta = rng.normal(size=5), rng.normal(size=5)

    def fwd(x_=x, g_=gamma, b_=beta):
        return ln.layer_norm_forward_ref(x_, g_, b_, 1e-5)[0]

    _, mean, inv = ln.layer_norm_forward_ref(x, gamma, beta, 1e-5)
    dx, dg, db = ln.layer_norm_backward_ref(x, dy, gamma, mean, inv)
    assert_grad_close(dx, lambda v: fwd(x_=v), x, dy, rtol=1e-5, atol=1e-6)
    assert_grad_close(dg, lambda v: fwd(g_=v), gamma, dy, rtol=1e-5, atol=1e-6)
    assert_grad_close(db, lambda v: fwd(b_=v), beta, dy, rtol=1e-5, atol=1e-6)


# ---- LayerNorm compiled CPU version (the cpu device) against the reference ----------------------------
def _ln_cpu(x, dy, gamma, beta):
    m = x.shape[0]
    y, mean, inv = np.full_like(x, np.nan), np.full(m, np.nan, np.float32), np.full(m, np.nan, np.float32)
    ln.layer_norm_forward_cpu(x, gamma, beta, 1e-5, y, mean, inv)
    dx, dg, db = np.full_like(x, np.nan), np.full_like(gamma, np.nan), np.full_like(gamma, np.nan)
    ln.layer_norm_backward_cpu(x, dy, gamma, mean, inv, dx, dg, db)
    return y, mean, inv, dx, dg, db


def _assert_ln_cpu_matches_ref(x, dy, gamma, beta, got):
    y, mean, inv, dx, dg, db = got
    ry, rmean, rinv = ln.layer_norm_forward_ref(x, gamma, beta, np.float32(1e-5))
    np.testing.assert_allclose(mean, rmean, rtol=1e-5, atol=1e-5 * (1 + np.abs(x).max(initial=0)))
    np.testing.assert_allclose(inv, rinv, rtol=1e-4)
    np.testing.assert_allclose(y, ry, rtol=1e-4, atol=1e-4)
    rdx, rdg, rdb = ln.layer_norm_backward_ref(x, dy, gamma, mean, inv)
    np.testing.assert_allclose(dx, rdx, rtol=1e-4, atol=1e-4)
    # column sums over the M rows, in another order: float32 rounding grows with M
    tol = 1e-5 * (1 + x.shape[0]) * (1 + np.abs(dy).max(initial=0))
    np.testing.assert_allclose(dg, rdg, rtol=1e-4, atol=tol)
    np.testing.assert_allclose(db, rdb, rtol=1e-4, atol=tol)


@given(
    m=st.integers(0, 600),
    h=st.integers(1, 40),
    shift=st.sampled_from([0.0, 100.0]),
    seed=st.integers(0, 2**16),
)
def test_ln_compiled_cpu_matches_ref(m, h, shift, seed):
    """B = 1 (m 1), one column (h 1: variance 0), rows past one chunk (256), an offset mean; the same bits on
    1 and 2 numba threads."""
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(m, h)) * 3 + shift).astype(np.float32)
    dy = rng.normal(size=(m, h)).astype(np.float32)
    gamma, beta = rng.normal(size=h).astype(np.float32), rng.normal(size=h).astype(np.float32)
    got = each_thread_count(lambda: _ln_cpu(x, dy, gamma, beta))
    _assert_ln_cpu_matches_ref(x, dy, gamma, beta, got)
    if m == 0:
        assert not got[4].any() and not got[5].any()  # no rows: zero parameter gradients


def test_ln_compiled_cpu_parallel_branch_and_shapes():
    from numbactr.kernels.parallel_cpu import PARALLEL_MIN

    rng = np.random.default_rng(6)
    m, h = PARALLEL_MIN // 32 + 7, 32  # past PARALLEL_MIN: the parallel twin, a partial last chunk
    x, dy = rng.normal(size=(m, h)).astype(np.float32), rng.normal(size=(m, h)).astype(np.float32)
    gamma, beta = rng.normal(size=h).astype(np.float32), rng.normal(size=h).astype(np.float32)
    _assert_ln_cpu_matches_ref(x, dy, gamma, beta, each_thread_count(lambda: _ln_cpu(x, dy, gamma, beta)))
    with pytest.raises(ValueError, match=r"layer_norm: x \(4, 3\) must be \(M, H\)"):
        ln.layer_norm_forward_cpu(x[:4, :3], gamma, beta, 1e-5, np.empty((4, 3), np.float32), x[0], x[1])


# ---- PReLU_Dice --------------------------------------------------------------------------------
@given(x=matrices(), tpb=POW2, blocks=st.integers(1, 3), alpha=st.sampled_from([0.0, 0.25, 1.0]), exact=st.booleans())
def test_dice_kernels_any_grid_match_ref(x, tpb, blocks, alpha, exact):
    y, mean, inv = (
        dev(np.full_like(x, np.nan)),
        dev(np.zeros(x.shape[1], np.float32)),
        dev(np.zeros(x.shape[1], np.float32)),
    )
    dice.make_dice_forward_kernel(tpb)[blocks, tpb](dev(x), np.float32(alpha), np.float32(1e-3), y, mean, inv)
    ry, rmean, rinv = dice.prelu_dice_forward_ref(*_f64(x), alpha, 1e-3)
    np.testing.assert_allclose(host(y), ry, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(host(inv), rinv, rtol=1e-4, atol=1e-4)
    dy = np.random.default_rng(x.shape[0]).normal(size=x.shape).astype(np.float32)
    dx = dev(np.full_like(x, np.nan))
    dice.make_dice_backward_kernel(tpb)[blocks, tpb](dev(x), dev(dy), np.float32(alpha), mean, inv, np.int32(exact), dx)
    rdx = dice.prelu_dice_backward_ref(*_f64(x, dy), alpha, *_f64(host(mean), host(inv)), hugectr_exact=exact)
    np.testing.assert_allclose(host(dx), rdx, rtol=1e-3, atol=1e-3)


def test_dice_constant_feature_uses_the_guard():
    x = np.full((5, 2), 3.0, np.float32)
    y, mean, inv = dev(np.zeros_like(x)), dev(np.zeros(2, np.float32)), dev(np.ones(2, np.float32))
    dice.prelu_dice_forward(dev(x), 0.1, 0.0, y, mean, inv)
    assert np.all(host(inv) == 0)  # Var + eps < 1e-8: inv = 0, p = 1/2
    np.testing.assert_allclose(host(y), x * (0.1 + 0.9 * 0.5), rtol=1e-6)


# ---- PReLU_Dice, compiled CPU version (the cpu device's path) vs the float32 reference ---------------
def _dice_cpu(x, dy, alpha, eps, exact):
    """Forward and backward of the compiled CPU version, outputs pre-filled with NaN (all must be written)."""
    y, dx = np.full_like(x, np.nan), np.full_like(x, np.nan)
    mean, inv = np.full(x.shape[1], np.nan, np.float32), np.full(x.shape[1], np.nan, np.float32)
    dice.prelu_dice_forward_cpu(x, alpha, eps, y, mean, inv)
    dice.prelu_dice_backward_cpu(x, dy, alpha, mean, inv, exact, dx)
    return y, mean, inv, dx


def _assert_dice_cpu_matches_ref(x, alpha, eps, exact, seed=0):
    dy = np.random.default_rng(seed).normal(size=x.shape).astype(np.float32)
    y, mean, inv, dx = _dice_cpu(x, dy, alpha, eps, exact)
    a32, e32 = np.float32(alpha), np.float32(eps)
    ry, rmean, rinv = dice.prelu_dice_forward_ref(x, a32, e32)
    np.testing.assert_allclose(mean, rmean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inv, rinv, rtol=1e-5)
    np.testing.assert_allclose(y, ry, rtol=1e-5, atol=1e-6)
    # the backward from the same statistics, so that only its own rounding is compared
    rdx = dice.prelu_dice_backward_ref(x, dy, a32, mean, inv, hugectr_exact=exact)
    np.testing.assert_allclose(dx, rdx, rtol=1e-4, atol=1e-5)


@given(x=matrices(), alpha=st.sampled_from([0.0, 0.25, 1.0]), exact=st.booleans())
def test_dice_compiled_cpu_matches_ref(x, alpha, exact):
    _assert_dice_cpu_matches_ref(x, alpha, 1e-3, exact, seed=x.shape[0])


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (2, 3), (257, 5), (600, 33), (3, 301)])
@pytest.mark.parametrize("exact", [False, True])
def test_dice_compiled_cpu_odd_shapes(shape, exact):
    """B = 1 (every s = 0), sizes off the vector width, batches over one chunk of rows (ROW_CHUNK = 256)."""
    x = (np.random.default_rng(shape[0]).normal(size=shape) * 2 + 0.5).astype(np.float32)
    _assert_dice_cpu_matches_ref(x, 0.2, 1e-8, exact)


def test_dice_compiled_cpu_non_finite_values_as_the_reference():
    x = np.random.default_rng(2).normal(size=(6, 4)).astype(np.float32)
    x[2, 1], x[4, 3] = np.nan, np.inf  # a NaN and an inf make their features' statistics NaN
    dy = np.ones_like(x)
    y, mean, inv, dx = _dice_cpu(x, dy, 0.2, 1e-5, False)
    with np.errstate(invalid="ignore"):  # (inf - inf in the reference)
        ry, rmean, rinv = dice.prelu_dice_forward_ref(x, np.float32(0.2), np.float32(1e-5))
        rdx = dice.prelu_dice_backward_ref(x, dy, np.float32(0.2), mean, inv)
    np.testing.assert_allclose(y, ry, rtol=1e-5, atol=1e-6)  # NaN where the reference has NaN
    np.testing.assert_allclose(dx, rdx, atol=1e-5)
    assert np.isnan(y[:, 1]).all() and np.isfinite(y[:, [0, 2]]).all()


def test_dice_compiled_cpu_parallel_branch_same_bits_on_two_threads():
    """Past PARALLEL_MIN the passes run under prange: the same bits on 1 and 2 threads (fixed chunks)."""
    import numba

    from numbactr.kernels.parallel_cpu import PARALLEL_MIN

    rng = np.random.default_rng(3)
    x = rng.normal(size=(PARALLEL_MIN // 64 + 3, 64)).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    before, runs = numba.get_num_threads(), []
    try:
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(n)
            runs.append(_dice_cpu(x, dy, 0.3, 1e-5, False) + _dice_cpu(x, dy, 0.3, 1e-5, True)[3:])
    finally:
        numba.set_num_threads(before)
    for a, b in zip(runs[0], runs[-1]):
        np.testing.assert_array_equal(a, b)
    _, mean, inv, dx, dx_exact = runs[0]
    np.testing.assert_allclose(dx, dice.prelu_dice_backward_ref(x, dy, np.float32(0.3), mean, inv), atol=1e-5)
    rdx = dice.prelu_dice_backward_ref(x, dy, np.float32(0.3), mean, inv, hugectr_exact=True)
    np.testing.assert_allclose(dx_exact, rdx, rtol=1e-4, atol=1e-5)


def test_dice_compiled_cpu_constant_feature_and_bad_arrays():
    x = np.full((5, 2), 3.0, np.float32)
    y, mean, inv, _ = _dice_cpu(x, np.ones_like(x), 0.1, 0.0, False)
    assert np.all(inv == 0)  # Var + eps < 1e-8: inv = 0, p = 1/2
    np.testing.assert_allclose(y, x * (0.1 + 0.9 * 0.5), rtol=1e-6)
    with pytest.raises(ValueError, match=r"prelu_dice_forward_cpu: x must be a C-contiguous float32"):
        dice.prelu_dice_forward_cpu(x.T, 0.1, 0.0, y.T, mean, inv)
    with pytest.raises(ValueError, match=r"prelu_dice_backward_cpu: dx must be float32 \(5, 2\)"):
        dice.prelu_dice_backward_cpu(x, x, 0.1, mean, inv, False, np.empty((5, 3), np.float32))


def test_dice_compiled_exp_within_one_ulp():
    """The vectorizable e^x of the compiled sigmoid: within 1 ulp of float64 over the normal range, 0 below,
    NaN for NaN."""
    import numba

    @numba.njit
    def loop(t, out):
        for i in range(t.size):
            out[i] = dice._exp_neg(t[i])

    t = -np.linspace(0.0, 87.0, 200_001).astype(np.float32)
    out = np.empty_like(t)
    loop(t, out)
    want = np.exp(t.astype(np.float64))
    assert np.max(np.abs(out - want) / np.spacing(want.astype(np.float32))) <= 1.0
    tail = np.array([-87.5, -100.0, -np.inf, np.nan], np.float32)
    loop(tail, out[:4])
    assert np.all(out[:3] == 0) and np.isnan(out[3])


@pytest.mark.parametrize("exact", [False, True])
def test_dice_layer_compiled_cpu_matches_reference_ops(cpu, exact):
    from numbactr.runtime import device

    cfg = DenseLayer(Layer_t.PReLU_Dice, ["a"], ["b"], elu_alpha=0.2, eps=1e-6)
    compat.set_hugectr_exact(exact)
    try:
        got = run_layer("cpu", cfg, (33, 2, 3))
        with device.reference_ops():
            want = run_layer("cpu", cfg, (33, 2, 3))
    finally:
        compat.set_hugectr_exact(False)
    np.testing.assert_allclose(got[1][0], want[1][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-4, atol=1e-5)


def test_dice_default_backward_is_the_gradient_and_hugectr_formula_is_not():
    rng = np.random.default_rng(0)
    x, dy = rng.normal(size=(6, 3)), rng.normal(size=(6, 3))
    alpha, eps = 0.2, 1e-3
    _, mean, inv = dice.prelu_dice_forward_ref(x, alpha, eps)

    def fwd(v):
        return dice.prelu_dice_forward_ref(v, alpha, eps)[0]

    full = dice.prelu_dice_backward_ref(x, dy, alpha, mean, inv)
    assert_grad_close(full, fwd, x, dy, rtol=1e-5, atol=1e-6)
    hugectr = dice.prelu_dice_backward_ref(x, dy, alpha, mean, inv, hugectr_exact=True)
    assert not np.allclose(hugectr, numeric_grad(fwd, x, dy), rtol=1e-3, atol=1e-4)
    # HugeCTR's formula is exactly the DIAGONAL of the Jacobian: dy_i/dx_i, statistics included
    for i, j in [(0, 0), (3, 2), (5, 1)]:
        e = np.zeros_like(x)
        e[i, j] = 1.0
        diag = numeric_grad(fwd, x, e)[i, j]
        assert dice.prelu_dice_backward_ref(x, e, alpha, mean, inv, hugectr_exact=True)[i, j] == pytest.approx(
            diag, rel=1e-5
        )


def test_dice_layer_uses_hugectr_formula_under_compat():
    cfg = DenseLayer(Layer_t.PReLU_Dice, ["a"], ["b"], elu_alpha=0.1, eps=1e-4)
    dx_default = run_layer("cpu", cfg, (6, 2))[2]
    compat.set_hugectr_exact(True)
    try:
        dx_exact = run_layer("cpu", cfg, (6, 2))[2]
        assert_sim_matches_cpu(cfg, (6, 2))  # the kernel's exact branch as well
    finally:
        compat.set_hugectr_exact(False)
    assert not np.allclose(dx_default, dx_exact)


# ---- layer level: sim == cpu ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg,shape,training",
    [
        (DenseLayer(Layer_t.BatchNorm, ["a"], ["b"], factor=0.9), (7, 3), True),
        (DenseLayer(Layer_t.BatchNorm, ["a"], ["b"]), (7, 3), False),
        (DenseLayer(Layer_t.LayerNorm, ["a"], ["b"]), (3, 2, 5), True),
        (DenseLayer(Layer_t.PReLU_Dice, ["a"], ["b"], elu_alpha=0.2, eps=1e-6), (9, 2, 2), True),
    ],
    ids=["bn-train", "bn-eval", "ln-3d", "dice"],
)
def test_layer_sim_matches_cpu(cfg, shape, training):
    assert_sim_matches_cpu(cfg, shape, training)


# ---- validation at Model.add() -----------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("norm")), n_train=16, n_eval=16)


def test_norm_layers_validate_at_add(data):
    m = small_model(data)
    L = hugectr.Layer_t
    with pytest.raises(hugectr.ModelError, match=r"BatchNorm.*eps must be a number >= 1e-05.*1e-06"):
        m.add(hugectr.DenseLayer(L.BatchNorm, ["dense"], ["bn"], eps=1e-6))
    with pytest.raises(hugectr.ModelError, match=r"BatchNorm.*factor.*\[0, 1\].*1.5"):
        m.add(hugectr.DenseLayer(L.BatchNorm, ["dense"], ["bn"], factor=1.5))
    m.add(hugectr.SparseEmbedding(hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, 4, "sum", "emb", "data1"))
    with pytest.raises(hugectr.ModelError, match=r"BatchNorm.*'emb' must be 2-D \(B, F\).*\(8, 3, 4\)"):
        m.add(hugectr.DenseLayer(L.BatchNorm, ["emb"], ["bn"]))
    with pytest.raises(hugectr.ModelError, match=r"LayerNorm.*eps must be a positive number"):
        m.add(hugectr.DenseLayer(L.LayerNorm, ["emb"], ["ln"], eps=0.0))
    with pytest.raises(hugectr.ModelError, match=r"PReLU_Dice.*eps must be a number >= 0"):
        m.add(hugectr.DenseLayer(L.PReLU_Dice, ["dense"], ["d"], eps=-1.0))
    with pytest.raises(hugectr.ModelError, match=r"expects 1 bottom"):
        m.add(hugectr.DenseLayer(L.LayerNorm, ["dense", "emb"], ["ln"]))
    m.add(hugectr.DenseLayer(L.BatchNorm, ["dense"], ["bn"], factor=0.5))
    m.add(hugectr.DenseLayer(L.LayerNorm, ["emb"], ["ln"]))
    m.add(hugectr.DenseLayer(L.PReLU_Dice, ["bn"], ["dice"], elu_alpha=0.3))
    assert m.shapes["ln"] == (8, 3, 4) and m.shapes["dice"] == (8, 2)
    bn_layer = m.layers[0]
    assert bn_layer.param_shapes() == [(2,), (2,)]
    assert [list(a) for a in bn_layer.init_params(None)] == [[1.0, 1.0], [0.0, 0.0]]
    assert bn_layer.json_params() == {"bn_param": {"factor": 0.5, "eps": 1e-5}}
    assert m.layers[2].json_params() == {"prelu_dice_param": {"alpha": 0.3, "eps": 1e-5}}


@pytest.mark.gpu
def test_norm_kernels_on_gpu():
    rng = np.random.default_rng(0)
    for rows, cols, tpb in [(5000, 7, 1024), (3, 300, 32), (1025, 33, 256)]:
        x = (rng.normal(size=(rows, cols)) * 2 + 1).astype(np.float32)
        g, b = rng.normal(size=cols).astype(np.float32), rng.normal(size=cols).astype(np.float32)
        y, mean, inv = dev(np.zeros_like(x)), dev(np.zeros(cols, np.float32)), dev(np.zeros(cols, np.float32))
        bn.batch_norm_forward_train(
            dev(x),
            dev(g),
            dev(b),
            1e-5,
            1.0,
            y,
            mean,
            inv,
            dev(np.zeros(cols, np.float32)),
            dev(np.ones(cols, np.float32)),
            threads=tpb,
        )
        np.testing.assert_allclose(host(y), bn.batch_norm_forward_ref(*_f64(x, g, b), 1e-5)[0], rtol=1e-3, atol=1e-3)
        yd = dev(np.zeros_like(x))
        dice.prelu_dice_forward(dev(x), 0.2, 1e-5, yd, mean, inv, threads=tpb)
        np.testing.assert_allclose(host(yd), dice.prelu_dice_forward_ref(*_f64(x), 0.2, 1e-5)[0], rtol=1e-3, atol=1e-3)
        xt = np.ascontiguousarray(x.T)
        gl, bl = rng.normal(size=rows).astype(np.float32), rng.normal(size=rows).astype(np.float32)
        yl = dev(np.zeros_like(xt))
        ln.layer_norm_forward(
            dev(xt),
            dev(gl),
            dev(bl),
            1e-5,
            yl,
            dev(np.zeros(cols, np.float32)),
            dev(np.zeros(cols, np.float32)),
            threads=tpb,
        )
        np.testing.assert_allclose(
            host(yl), ln.layer_norm_forward_ref(*_f64(xt, gl, bl), 1e-5)[0], rtol=1e-3, atol=1e-3
        )
