import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.kernels import bce
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host

EXTREMES = np.array([80.0, -80.0, 1e4, -1e4, 0.0, 1e-3, -1e-3, 17.0, -17.0, 88.8, -88.8, 3.4e38], np.float32)


@st.composite
def batch(draw, max_rows=40):
    n = draw(st.integers(1, max_rows))
    x = draw(f32_arrays((n,), -20.0, 20.0))
    y = draw(f32_arrays((n,), 0.0, 1.0))  # fractional labels included
    b = draw(st.integers(0, n))
    scale = draw(st.floats(1e-3, 10.0))
    return x, y, b, scale


def _run(x, y, b, scale, kernel=None, grid=None):
    """-> (summed loss, dx) from the kernel; dx starts as garbage to prove every row is written."""
    dx = dev(np.full(x.shape, np.nan, np.float32))
    loss_out = dev(np.zeros(1, np.float32))
    if kernel is None:
        bce.bce_forward_backward(dev(x), dev(y), dx, loss_out, b, scale)
    else:
        kernel[grid](dev(x), dev(y), dx, loss_out, np.int64(b), np.float32(scale))
    return float(host(loss_out)[0]), host(dx)


def _check(x, y, b, scale, got_sum, got_dx, rtol=1e-5):
    mean, dx = bce.bce_forward_backward_ref(x.astype(np.float64), y.astype(np.float64), b, scale)
    np.testing.assert_allclose(got_sum, mean * b, rtol=rtol, atol=1e-4)
    np.testing.assert_allclose(got_dx, dx, rtol=rtol, atol=1e-7 * scale)
    assert np.all(got_dx[b:] == 0.0)


@given(data=batch())
def test_bce_kernel_matches_ref(data):
    x, y, b, scale = data
    _check(x, y, b, scale, *_run(x, y, b, scale))


@given(data=batch(max_rows=24), tpb=st.sampled_from([1, 2, 8, 16]), blocks=st.integers(1, 3))
def test_bce_kernel_any_grid_and_block(data, tpb, blocks):
    x, y, b, scale = data
    _check(x, y, b, scale, *_run(x, y, b, scale, bce.make_bce_kernel(tpb), (blocks, tpb)))


def test_bce_extreme_logits_stay_finite():
    x = np.concatenate([EXTREMES, EXTREMES])
    y = np.concatenate([np.zeros_like(EXTREMES), np.ones_like(EXTREMES)])
    y[[4, 5]] = 0.25
    got_sum, got_dx = _run(x, y, x.size, 0.5)
    assert np.isfinite(got_sum) and np.all(np.isfinite(got_dx))
    _check(x, y, x.size, 0.5, got_sum, got_dx)
    # saturated sigmoid: (1 - 0) * 0.5 and (0 - 1) * 0.5
    assert got_dx[2] == 0.5 and got_dx[len(EXTREMES) + 3] == -0.5


def test_bce_invalid_rows_get_zero_grad_and_no_loss():
    x = np.array([1.0, -2.0, 50.0, -50.0], np.float32)
    y = np.array([1.0, 0.0, 0.0, 1.0], np.float32)
    got_sum, got_dx = _run(x, y, 2, 1.0)  # rows 2, 3 would add ~100 loss
    np.testing.assert_allclose(got_sum, np.log1p(np.exp(-1.0)) + np.log1p(np.exp(-2.0)), rtol=1e-6)
    np.testing.assert_array_equal(got_dx[2:], [0.0, 0.0])
    _, zero_dx = _run(x, y, 0, 1.0)
    np.testing.assert_array_equal(zero_dx, np.zeros(4, np.float32))


def test_bce_adds_to_loss_out_and_accepts_column_shape():
    x = np.array([[0.5], [-0.5], [2.0]], np.float32)  # (B, 1) as the layer holds it
    y = np.array([[1.0], [0.0], [0.3]], np.float32)
    loss_out = dev(np.array([10.0], np.float32))
    dx = dev(np.zeros_like(x))
    bce.bce_forward_backward(dev(x), dev(y), dx, loss_out, 3, 1 / 3)
    mean, want_dx = bce.bce_forward_backward_ref(x, y, 3, 1 / 3)
    np.testing.assert_allclose(host(loss_out)[0], 10.0 + 3 * mean, rtol=1e-6)
    np.testing.assert_allclose(host(dx).reshape(-1), want_dx, rtol=1e-6)


def test_bce_in_place_gradient_over_logits():
    x = np.array([3.0, -1.0, 0.0], np.float32)
    y = np.array([0.0, 1.0, 0.5], np.float32)
    buf = dev(x)
    bce.bce_forward_backward(buf, dev(y), buf, dev(np.zeros(1, np.float32)), 3, 1.0)
    np.testing.assert_allclose(host(buf), bce.bce_forward_backward_ref(x, y, 3, 1.0)[1], rtol=1e-6)


def test_bce_wrapper_validation_and_empty():
    with pytest.raises(ValueError):
        bce.bce_forward_backward(
            np.zeros(3, np.float32), np.zeros(3, np.float32), np.zeros(3, np.float32), np.zeros(1, np.float32), 4, 1.0
        )
    loss_out = np.zeros(1, np.float32)
    e = np.zeros(0, np.float32)
    bce.bce_forward_backward(e, e, e, loss_out, 0, 1.0)
    assert loss_out[0] == 0.0
    with pytest.raises(ValueError):
        bce.make_bce_kernel(6)


@given(x=f32_arrays((17,), -100.0, 100.0))
def test_sigmoid_kernel_matches_ref(x):
    y = dev(np.full_like(x, np.nan))
    bce.sigmoid_forward(dev(x), y)
    np.testing.assert_allclose(host(y), bce.sigmoid_ref(x.astype(np.float64)), rtol=1e-6, atol=1e-30)


def test_sigmoid_extremes_in_place():
    buf = dev(EXTREMES.reshape(-1, 1))
    bce.sigmoid_forward(buf, buf)
    got = host(buf).reshape(-1)
    assert np.all(np.isfinite(got)) and np.all((got >= 0) & (got <= 1))
    np.testing.assert_allclose(got, bce.sigmoid_ref(EXTREMES.astype(np.float64)), rtol=1e-6, atol=1e-30)
    assert got[2] == 1.0 and got[3] == 0.0


def test_bce_reference_extremes_finite():
    x = EXTREMES.astype(np.float64)
    for label in (0.0, 1.0, 0.7):
        mean, dx = bce.bce_forward_backward_ref(x, np.full_like(x, label), x.size, 1.0)
        assert np.isfinite(mean) and np.all(np.isfinite(dx))


def test_bce_reference_gradient():
    rng = np.random.default_rng(0)
    x = rng.normal(scale=3.0, size=9)
    y = rng.uniform(size=9)
    y[:3] = [0.0, 1.0, 1.0]
    b = 7  # rows 7, 8 are padding
    _, dx = bce.bce_forward_backward_ref(x, y, b, 1.0 / b)

    def mean_loss(xx):
        return np.array(bce.bce_forward_backward_ref(xx, y, b, 1.0)[0])

    assert_grad_close(dx, mean_loss, x, np.array(1.0))


@pytest.mark.gpu
@given(
    n=st.integers(1, 200_000),
    frac=st.floats(0.0, 1.0),
    tpb=st.sampled_from([32, 256, 1024]),
    seed=st.integers(0, 2**32 - 1),
)
def test_bce_on_gpu(n, frac, tpb, seed):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=n) * 10).astype(np.float32)
    y = rng.uniform(size=n).astype(np.float32)
    b = int(n * frac)
    dx = dev(np.full(n, np.nan, np.float32))
    loss_out = dev(np.zeros(1, np.float32))
    bce.bce_forward_backward(dev(x), dev(y), dx, loss_out, b, 1.0 / max(b, 1), threads=tpb)
    mean, want = bce.bce_forward_backward_ref(x.astype(np.float64), y.astype(np.float64), b, 1.0 / max(b, 1))
    np.testing.assert_allclose(float(host(loss_out)[0]), mean * b, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(host(dx), want, rtol=1e-4, atol=1e-9)
