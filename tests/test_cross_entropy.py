import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.kernels import cross_entropy as ce
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host

EXTREMES = np.array(
    [80.0, -80.0, 1e4, -1e4, 0.0, 1e-3, -1e-3, 17.0, -17.0, 88.8, -88.8, 1e30, -1e30, 710.0], np.float32
)


@st.composite
def batch(draw, max_rows=30):
    n = draw(st.integers(1, max_rows))
    x = draw(f32_arrays((n, 2), -20.0, 20.0))
    width = draw(st.sampled_from([1, 2]))
    y = draw(f32_arrays((n, width), 0.0, 1.0))  # anything: class = label < 0.5 ? 0 : 1
    b = draw(st.integers(0, n))
    scale = draw(st.floats(1e-3, 10.0))
    exact = draw(st.booleans())
    return x, y, b, scale, exact


def _run(x, y, b, scale, exact=False, kernel=None, grid=None):
    """-> (summed loss, dx) from the kernel; dx starts as NaN to prove every element is written."""
    dx = dev(np.full(x.shape, np.nan, np.float32))
    loss_out = dev(np.zeros(1, np.float32))
    if kernel is None:
        ce.cross_entropy_forward_backward(dev(x), dev(y), dx, loss_out, b, scale, hugectr_label=exact)
    else:
        stride = 1 if exact else y.shape[1]
        kernel[grid](
            dev(x).reshape(-1),
            dev(y).reshape(-1),
            dx.reshape(-1),
            loss_out,
            np.int64(b),
            np.int64(stride),
            np.float32(scale),
        )
    return float(host(loss_out)[0]), host(dx)


def _check(x, y, b, scale, exact, got_sum, got_dx, rtol=1e-5):
    mean, dx = ce.cross_entropy_forward_backward_ref(
        x.astype(np.float64), y.astype(np.float64), b, scale, hugectr_label=exact
    )
    np.testing.assert_allclose(got_sum, mean * b, rtol=rtol, atol=1e-4)
    np.testing.assert_allclose(got_dx, dx, rtol=rtol, atol=1e-7 * scale)
    assert np.all(got_dx[b:] == 0.0)


@given(data=batch())
def test_ce_kernel_matches_ref(data):
    x, y, b, scale, exact = data
    _check(x, y, b, scale, exact, *_run(x, y, b, scale, exact))


@given(data=batch(max_rows=20), tpb=st.sampled_from([1, 2, 8, 16]), blocks=st.integers(1, 3))
def test_ce_kernel_any_grid_and_block(data, tpb, blocks):
    x, y, b, scale, exact = data
    _check(x, y, b, scale, exact, *_run(x, y, b, scale, exact, ce.make_ce_kernel(tpb), (blocks, tpb)))


def test_ce_extreme_logits_stay_finite():
    n = EXTREMES.size
    x = np.stack([EXTREMES, EXTREMES[::-1]], axis=1)  # (n, 2), large differences
    x = np.concatenate([x, x])
    y = np.concatenate([np.zeros((n, 1)), np.ones((n, 1))]).astype(np.float32)
    got_sum, got_dx = _run(x, y, 2 * n, 0.5)
    assert np.isfinite(got_sum) and np.all(np.isfinite(got_dx))
    _check(x, y, 2 * n, 0.5, False, got_sum, got_dx)
    # a saturated softmax gives +-grad_scale, and the two entries of a row sum to 0
    np.testing.assert_allclose(got_dx.sum(axis=1), 0.0, atol=1e-6)
    assert got_dx[2, 0] == -0.5 and got_dx[2, 1] == 0.5  # x = (1e4, 1e30), class 0


def test_ce_known_values_and_padding():
    x = np.array([[0.0, 0.0], [2.0, -1.0], [30.0, -30.0]], np.float32)
    y = np.array([[1.0], [0.0], [1.0]], np.float32)
    got_sum, got_dx = _run(x, y, 2, 1.0)  # row 2 is padding
    want = np.log(2.0) + np.log1p(np.exp(-3.0))
    np.testing.assert_allclose(got_sum, want, rtol=1e-6)
    np.testing.assert_allclose(got_dx[0], [0.5, -0.5], rtol=1e-6)
    np.testing.assert_array_equal(got_dx[2], [0.0, 0.0])


def test_ce_label_read_column_zero_vs_hugectr_buffer():
    # (B, 2) label: numbactr reads column 0 of each row; HugeCTR reads the first B floats
    x = np.zeros((3, 2), np.float32)
    y = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], np.float32)
    np.testing.assert_array_equal(ce.ce_classes_ref(y, 3), [1, 0, 0])
    np.testing.assert_array_equal(ce.ce_classes_ref(y, 3, hugectr_label=True), [1, 0, 0])  # flat 1 0 0 1 0 0
    y2 = np.array([[0.0, 1.0], [1.0, 0.0], [1.0, 1.0]], np.float32)  # flat: 0 1 1 0 1 1
    np.testing.assert_array_equal(ce.ce_classes_ref(y2, 3), [0, 1, 1])
    np.testing.assert_array_equal(ce.ce_classes_ref(y2, 3, hugectr_label=True), [0, 1, 1])
    y3 = np.array([[0.0, 1.0], [0.0, 0.0], [1.0, 1.0]], np.float32)  # flat: 0 1 0 0 1 1
    np.testing.assert_array_equal(ce.ce_classes_ref(y3, 3), [0, 0, 1])
    np.testing.assert_array_equal(ce.ce_classes_ref(y3, 3, hugectr_label=True), [0, 1, 0])
    _, dx_col = _run(x, y3, 3, 1.0, exact=False)
    _, dx_buf = _run(x, y3, 3, 1.0, exact=True)
    np.testing.assert_allclose(dx_col[:, 1], [0.5, 0.5, -0.5])
    np.testing.assert_allclose(dx_buf[:, 1], [0.5, -0.5, 0.5])


def test_ce_nan_label_is_class_one_like_hugectr():
    x = np.zeros((1, 2), np.float32)
    _, dx = _run(x, np.array([[np.nan]], np.float32), 1, 1.0)
    np.testing.assert_allclose(dx[0], [0.5, -0.5])


def test_ce_in_place_gradient_over_logits():
    x = np.array([[3.0, -1.0], [0.0, 2.0]], np.float32)
    y = np.array([[0.0], [1.0]], np.float32)
    buf = dev(x)
    ce.cross_entropy_forward_backward(buf, dev(y), buf, dev(np.zeros(1, np.float32)), 2, 0.5)
    np.testing.assert_allclose(host(buf), ce.cross_entropy_forward_backward_ref(x, y, 2, 0.5)[1], rtol=1e-6)


def test_ce_wrapper_validation_and_empty():
    z = np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match="valid rows"):
        ce.cross_entropy_forward_backward(z, z, z, np.zeros(1, np.float32), 4, 1.0)
    with pytest.raises(ValueError, match=r"\(B, 2\)"):
        ce.cross_entropy_forward_backward(np.zeros((3, 3), np.float32), z, z, np.zeros(1, np.float32), 3, 1.0)
    with pytest.raises(ValueError, match="rows"):
        ce.cross_entropy_forward_backward(z, np.zeros((2, 2), np.float32), z, np.zeros(1, np.float32), 2, 1.0)
    loss_out = np.zeros(1, np.float32)
    e = np.zeros((0, 2), np.float32)
    ce.cross_entropy_forward_backward(e, np.zeros((0, 1), np.float32), e, loss_out, 0, 1.0)
    assert loss_out[0] == 0.0
    with pytest.raises(ValueError):
        ce.make_ce_kernel(12)


@given(x=f32_arrays((9, 2), -100.0, 100.0))
def test_softmax2_kernel_matches_ref(x):
    y = dev(np.full_like(x, np.nan))
    ce.softmax2_forward(dev(x), y)
    want = ce.softmax2_ref(x.astype(np.float64))
    np.testing.assert_allclose(host(y), want, rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(host(y).sum(axis=1), 1.0, rtol=1e-6)


def test_softmax2_extremes_in_place_and_vs_naive():
    x = np.stack([EXTREMES, EXTREMES[::-1]], axis=1)
    buf = dev(x)
    ce.softmax2_forward(buf, buf)
    got = host(buf)
    assert np.all(np.isfinite(got)) and np.all((got >= 0) & (got <= 1))
    xs = np.array([[0.3, -1.2], [4.0, 4.5]])
    naive = np.exp(xs) / np.exp(xs).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(ce.softmax2_ref(xs), naive, rtol=1e-12)


def test_ce_reference_extremes_finite():
    x = np.stack([EXTREMES, EXTREMES[::-1]], axis=1).astype(np.float64)
    for label in (0.0, 1.0):
        mean, dx = ce.cross_entropy_forward_backward_ref(x, np.full((x.shape[0], 1), label), x.shape[0], 1.0)
        assert np.isfinite(mean) and np.all(np.isfinite(dx))


@pytest.mark.parametrize("exact", [False, True])
def test_ce_reference_gradient(exact):
    rng = np.random.default_rng(1)
    x = rng.normal(scale=3.0, size=(8, 2))
    y = (rng.uniform(size=(8, 2)) > 0.5).astype(np.float64)
    b = 6  # rows 6, 7 are padding
    _, dx = ce.cross_entropy_forward_backward_ref(x, y, b, 1.0 / b, hugectr_label=exact)

    def mean_loss(xx):
        return np.array(ce.cross_entropy_forward_backward_ref(xx, y, b, 1.0, hugectr_label=exact)[0])

    assert_grad_close(dx, mean_loss, x, np.array(1.0))


@pytest.mark.gpu
@given(
    n=st.integers(1, 100_000),
    frac=st.floats(0.0, 1.0),
    tpb=st.sampled_from([32, 256, 1024]),
    exact=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_ce_on_gpu(n, frac, tpb, exact, seed):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, 2)) * 10).astype(np.float32)
    y = (rng.uniform(size=(n, 2)) > 0.5).astype(np.float32)
    b = int(n * frac)
    dx = dev(np.full((n, 2), np.nan, np.float32))
    loss_out = dev(np.zeros(1, np.float32))
    ce.cross_entropy_forward_backward(
        dev(x), dev(y), dx, loss_out, b, 1.0 / max(b, 1), hugectr_label=exact, threads=tpb
    )
    mean, want = ce.cross_entropy_forward_backward_ref(
        x.astype(np.float64), y.astype(np.float64), b, 1.0 / max(b, 1), hugectr_label=exact
    )
    np.testing.assert_allclose(float(host(loss_out)[0]), mean * b, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(host(dx), want, rtol=1e-4, atol=1e-9)
