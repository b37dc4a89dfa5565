import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.kernels import multi_cross_entropy as mce
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host

EXTREMES = np.array([80.0, -80.0, 1e4, -1e4, 0.0, 1e-3, -1e-3, 17.0, -17.0, 88.8, -88.8, 1e30], np.float32)


@st.composite
def batch(draw, max_rows=16, max_targets=5):
    n = draw(st.integers(1, max_rows))
    t = draw(st.integers(1, max_targets))
    x = draw(f32_arrays((n, t), -20.0, 20.0))
    y = draw(f32_arrays((n, t), 0.0, 1.0))
    ignored = draw(f32_arrays((n, t), 0.0, 1.0)) < 0.3
    y = np.where(ignored, np.float32(-1.0), y).astype(np.float32)  # some labels missing
    tw = draw(f32_arrays((t,), 0.0, 3.0))
    b = draw(st.integers(0, n))
    scale = draw(st.floats(1e-3, 10.0))
    return x, y, tw, b, scale


def _run(x, y, tw, b, scale, kernel=None, grid=None):
    dx = dev(np.full(x.shape, np.nan, np.float32))
    loss_out = dev(np.zeros(1, np.float32))
    if kernel is None:
        mce.multi_cross_entropy_forward_backward(dev(x), dev(y), dev(tw), dx, loss_out, b, scale)
    else:
        kernel[grid](
            dev(x).reshape(-1),
            dev(y).reshape(-1),
            dev(tw),
            dx.reshape(-1),
            loss_out,
            np.int64(b * x.shape[1]),
            np.float32(scale),
        )
    return float(host(loss_out)[0]), host(dx)


def _check(x, y, tw, b, scale, got_sum, got_dx, rtol=1e-5):
    mean, dx = mce.multi_cross_entropy_forward_backward_ref(
        x.astype(np.float64), y.astype(np.float64), tw.astype(np.float64), b, scale
    )
    np.testing.assert_allclose(got_sum, mean * b * x.shape[1], rtol=rtol, atol=1e-4)
    np.testing.assert_allclose(got_dx, dx, rtol=rtol, atol=1e-7 * scale * max(1.0, float(tw.max())))
    assert np.all(got_dx[b:] == 0.0)
    assert np.all(got_dx[y < -0.5] == 0.0)


@given(data=batch())
def test_mce_kernel_matches_ref(data):
    _check(*data, *_run(*data))


@given(data=batch(max_rows=8, max_targets=3), tpb=st.sampled_from([1, 2, 8, 16]), blocks=st.integers(1, 3))
def test_mce_kernel_any_grid_and_block(data, tpb, blocks):
    _check(*data, *_run(*data, kernel=mce.make_mce_kernel(tpb), grid=(blocks, tpb)))


def test_mce_known_values_ignored_labels_count_in_normalization():
    x = np.array([[0.0, 2.0, -3.0], [1.0, 1.0, 1.0]], np.float32)
    y = np.array([[1.0, -1.0, 0.0], [0.0, 1.0, -0.6]], np.float32)
    tw = np.array([1.0, 2.0, 0.5], np.float32)
    got_sum, got_dx = _run(x, y, tw, 2, 1.0 / 6)
    softplus = lambda v: np.log1p(np.exp(v))  # noqa: E731
    want = softplus(0.0) + 0.5 * softplus(-3.0) + softplus(1.0) + 2.0 * softplus(-1.0)
    np.testing.assert_allclose(got_sum, want, rtol=1e-6)
    mean, _ = mce.multi_cross_entropy_forward_backward_ref(x, y, tw, 2, 1.0)
    np.testing.assert_allclose(mean, want / 6, rtol=1e-6)  # / (b*T), ignored included
    assert got_dx[0, 1] == 0.0 and got_dx[1, 2] == 0.0
    np.testing.assert_allclose(got_dx[0, 0], (0.5 - 1.0) / 6, rtol=1e-6)
    # label -0.5 itself is NOT ignored (HugeCTR: label < -0.5)
    _, dx = _run(x[:1, :1], np.array([[-0.5]], np.float32), tw[:1], 1, 1.0)
    np.testing.assert_allclose(dx[0, 0], 0.5 + 0.5, rtol=1e-6)


def test_mce_extreme_logits_stay_finite():
    x = np.stack([EXTREMES, -EXTREMES], axis=1)
    y = np.tile(np.array([[0.0, 1.0]], np.float32), (x.shape[0], 1))
    tw = np.array([1.0, 0.5], np.float32)
    got_sum, got_dx = _run(x, y, tw, x.shape[0], 0.25)
    assert np.isfinite(got_sum) and np.all(np.isfinite(got_dx))
    _check(x, y, tw, x.shape[0], 0.25, got_sum, got_dx)


def test_mce_in_place_and_wrapper_validation():
    x = np.array([[3.0, -1.0]], np.float32)
    y = np.array([[0.0, 1.0]], np.float32)
    tw = np.array([1.0, 2.0], np.float32)
    buf = dev(x)
    mce.multi_cross_entropy_forward_backward(buf, dev(y), dev(tw), buf, dev(np.zeros(1, np.float32)), 1, 0.5)
    np.testing.assert_allclose(host(buf), mce.multi_cross_entropy_forward_backward_ref(x, y, tw, 1, 0.5)[1], rtol=1e-6)
    z = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="valid rows"):
        mce.multi_cross_entropy_forward_backward(z, z, np.ones(3, np.float32), z, np.zeros(1, np.float32), 3, 1.0)
    with pytest.raises(ValueError, match="tw"):
        mce.multi_cross_entropy_forward_backward(z, z, np.ones(2, np.float32), z, np.zeros(1, np.float32), 2, 1.0)
    e = np.zeros((0, 3), np.float32)
    loss_out = np.zeros(1, np.float32)
    mce.multi_cross_entropy_forward_backward(e, e, np.ones(3, np.float32), e, loss_out, 0, 1.0)
    assert loss_out[0] == 0.0
    with pytest.raises(ValueError):
        mce.make_mce_kernel(3)


def test_mce_reference_gradient():
    rng = np.random.default_rng(2)
    x = rng.normal(scale=3.0, size=(6, 3))
    y = rng.uniform(size=(6, 3))
    y[0, 1] = y[3, 2] = -1.0  # ignored
    tw = np.array([1.0, 0.3, 2.0])
    b = 5  # row 5 is padding
    _, dx = mce.multi_cross_entropy_forward_backward_ref(x, y, tw, b, 1.0 / (b * 3))

    def mean_loss(xx):
        return np.array(mce.multi_cross_entropy_forward_backward_ref(xx, y, tw, b, 1.0)[0])

    assert_grad_close(dx, mean_loss, x, np.array(1.0))


@pytest.mark.gpu
@given(
    n=st.integers(1, 20_000),
    t=st.integers(1, 16),
    frac=st.floats(0.0, 1.0),
    tpb=st.sampled_from([32, 256, 1024]),
    seed=st.integers(0, 2**32 - 1),
)
def test_mce_on_gpu(n, t, frac, tpb, seed):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, t)) * 10).astype(np.float32)
    y = rng.uniform(size=(n, t)).astype(np.float32)
    y[rng.uniform(size=(n, t)) < 0.2] = -1.0
    tw = rng.uniform(0, 2, t).astype(np.float32)
    b = int(n * frac)
    scale = 1.0 / max(b * t, 1)
    dx = dev(np.full((n, t), np.nan, np.float32))
    loss_out = dev(np.zeros(1, np.float32))
    mce.multi_cross_entropy_forward_backward(dev(x), dev(y), dev(tw), dx, loss_out, b, scale, threads=tpb)
    mean, want = mce.multi_cross_entropy_forward_backward_ref(
        x.astype(np.float64), y.astype(np.float64), tw.astype(np.float64), b, scale
    )
    np.testing.assert_allclose(float(host(loss_out)[0]), mean * b * t, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(host(dx), want, rtol=1e-4, atol=1e-9)
