import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numbactr.kernels import softmax as sm
from numbactr.kernels.parallel_cpu import PARALLEL_MIN
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host
from tests.test_cpu_compiled import each_thread_count

ROWS = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6)


def _forward(x, subtract_max=True, threads=8):
    y = dev(np.full(x.shape, np.nan, np.float32))
    sm.softmax_forward(dev(x), y, subtract_max, threads=threads)
    return host(y)


@given(x=f32_arrays(ROWS), subtract_max=st.booleans(), threads=st.sampled_from([4, 8]))
def test_forward_kernel_matches_ref(x, subtract_max, threads):
    np.testing.assert_allclose(
        _forward(x, subtract_max, threads), sm.softmax_forward_ref(x, subtract_max), rtol=1e-5, atol=1e-7
    )


@given(y_logits=f32_arrays(ROWS), factor=st.sampled_from([1.0, 0.125]), data=st.data())
def test_backward_kernel_matches_ref(y_logits, factor, data):
    y = sm.softmax_forward_ref(y_logits)
    dy = data.draw(f32_arrays(y.shape))
    dx = dev(np.full(y.shape, np.nan, np.float32))
    sm.softmax_backward(dev(y), dev(dy), dx, factor, threads=8)
    np.testing.assert_allclose(host(dx), sm.softmax_backward_ref(y, dy, factor), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 12, 32])
def test_rows_longer_than_the_block_and_odd_block_sizes(threads):
    rng = np.random.default_rng(threads)
    x = (rng.normal(size=(3, 77)) * 4).astype(np.float32)
    y = _forward(x, True, threads)
    np.testing.assert_allclose(y, sm.softmax_forward_ref(x), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(y.sum(-1), 1.0, rtol=1e-5)
    dy = rng.normal(size=x.shape).astype(np.float32)
    dx = dev(np.zeros_like(x))
    sm.softmax_backward(dev(y), dev(dy), dx, threads=threads)
    np.testing.assert_allclose(host(dx), sm.softmax_backward_ref(y, dy), rtol=1e-4, atol=1e-6)


def test_max_subtraction_avoids_overflow_that_hugectr_form_hits():
    x = np.array([[100.0, 101.0, 99.0]], np.float32)  # exp(100) overflows float32
    stable = _forward(x, True)
    np.testing.assert_allclose(stable, sm.softmax_forward_ref(x.astype(np.float64)), rtol=1e-5)
    assert not np.isfinite(_forward(x, False)).all()  # HugeCTR's exp(x)/sum(exp(x))
    small = np.array([[0.5, -1.0, 2.0]], np.float32)  # without overflow both forms agree
    np.testing.assert_allclose(_forward(small, False), _forward(small, True), rtol=1e-6)


def test_in_place_forward():
    x = np.random.default_rng(0).normal(size=(4, 9)).astype(np.float32)
    buf = dev(x)
    sm.softmax_forward(buf, buf, threads=4)
    np.testing.assert_allclose(host(buf), sm.softmax_forward_ref(x), rtol=1e-5, atol=1e-7)


def test_empty_input_is_a_no_op():
    x = np.zeros((0, 5), np.float32)
    sm.softmax_forward(dev(x), dev(x))
    sm.softmax_backward(dev(x), dev(x), dev(x))


@st.composite
def masked_case(draw):
    b, h, lf, lt = (draw(st.integers(1, 3)) for _ in range(4))
    x = draw(f32_arrays((b, h, lf, lt)))
    mshape = draw(st.sampled_from([(b, 1, lf, lt), (b, 1, 1, lt)]))
    mask = draw(hnp.arrays(np.float32, mshape, elements=st.sampled_from([0.0, 1.0])))
    return x, mask


@given(case=masked_case(), factor=st.sampled_from([1.0, 0.5]))
def test_masked_forward_kernel_matches_ref(case, factor):
    x, mask = case
    y = dev(np.full(x.shape, np.nan, np.float32))
    sm.masked_softmax_forward(dev(x), dev(mask), y, factor, threads=8)
    np.testing.assert_allclose(host(y), sm.masked_softmax_forward_ref(x, mask, factor), rtol=1e-5, atol=1e-7)


def test_masked_entries_get_no_weight_and_the_mask_is_per_row():
    x = np.zeros((1, 1, 2, 3), np.float32)
    mask = np.array([[[[1, 1, 0], [1, 0, 0]]]], np.float32)  # row 0 sees 2 keys, row 1 sees 1
    y = dev(np.zeros_like(x))
    sm.masked_softmax_forward(dev(x), dev(mask), y, 1.0, threads=4)
    np.testing.assert_allclose(host(y)[0, 0], [[0.5, 0.5, 0], [1, 0, 0]], atol=1e-6)


def test_reference_gradients():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5))
    dy = rng.normal(size=x.shape)
    assert_grad_close(sm.softmax_backward_ref(sm.softmax_forward_ref(x), dy), sm.softmax_forward_ref, x, dy)
    assert_grad_close(
        sm.softmax_backward_ref(sm.softmax_forward_ref(x, False), dy), lambda z: sm.softmax_forward_ref(z, False), x, dy
    )
    # masked: z = x*factor - penalty, eps in the denominator; dX = factor * y * (dY - sum dY*y) is exact
    xm = rng.normal(size=(2, 2, 3, 4))
    mask = (rng.random((2, 1, 3, 4)) < 0.7).astype(np.float64)
    dym = rng.normal(size=xm.shape)
    y = sm.masked_softmax_forward_ref(xm, mask, 0.5)
    assert_grad_close(
        sm.softmax_backward_ref(y, dym, 0.5), lambda z: sm.masked_softmax_forward_ref(z, mask, 0.5), xm, dym, atol=1e-6
    )


# ---- compiled CPU versions (the cpu device) against the references -------------------------------------
@given(x=f32_arrays(ROWS), subtract_max=st.booleans(), factor=st.sampled_from([1.0, 0.125]), data=st.data())
def test_compiled_cpu_matches_ref(x, subtract_max, factor, data):
    dy = data.draw(f32_arrays(x.shape))

    def run():
        y, dx = np.full_like(x, np.nan), np.full_like(x, np.nan)
        sm.softmax_forward_cpu(x, y, subtract_max)
        sm.softmax_backward_cpu(y, dy, dx, factor)
        return y, dx

    y, dx = each_thread_count(run)  # the same bits on 1 and 2 numba threads
    np.testing.assert_allclose(y, sm.softmax_forward_ref(x, subtract_max), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dx, sm.softmax_backward_ref(y, dy, factor), rtol=1e-4, atol=1e-5)


@given(case=masked_case(), factor=st.sampled_from([1.0, 0.5]))
def test_compiled_cpu_masked_matches_ref(case, factor):
    x, mask = case
    y = np.full_like(x, np.nan)
    sm.masked_softmax_forward_cpu(x, mask, y, factor)
    np.testing.assert_allclose(y, sm.masked_softmax_forward_ref(x, mask, factor), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mask_rows", [True, False])
def test_compiled_cpu_masked_odd_shapes_in_place_and_bad_mask(mask_rows):
    rng = np.random.default_rng(4)
    for shape in ((1, 1, 1, 1), (1, 3, 7, 9), (5, 4, 10, 10), (300, 2, 3, 5)):  # B = 1; rows past one chunk
        b, _, lf, lt = shape
        x = (rng.normal(size=shape) * 5).astype(np.float32)
        mask = (rng.random((b, 1, lf if mask_rows else 1, lt)) < 0.6).astype(np.float32)
        want = sm.masked_softmax_forward_ref(x, mask, 0.5)
        sm.masked_softmax_forward_cpu(x, mask, x, 0.5)  # y may be x
        np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="does not fit x"):
        sm.masked_softmax_forward_cpu(x, mask[:, :, :, :1], np.empty_like(x), 1.0)
    with pytest.raises(ValueError, match="not x's shape"):
        sm.softmax_forward_cpu(x, np.empty(x.shape[:-1], np.float32))


def test_compiled_cpu_parallel_branch():
    """Past PARALLEL_MIN elements the parallel twin splits the rows across threads: still the reference,
    and the same bits on 1 and 2 threads."""
    rng = np.random.default_rng(5)
    b = PARALLEL_MIN // 400 + 3  # (B, 4, 10, 10): a partial last chunk of rows
    x, dy = rng.normal(size=(b, 4, 10, 10)).astype(np.float32), rng.normal(size=(b, 4, 10, 10)).astype(np.float32)
    mask = (rng.random((b, 1, 1, 10)) < 0.7).astype(np.float32)

    def run():
        y, ym, dx = np.empty_like(x), np.empty_like(x), np.empty_like(x)
        sm.softmax_forward_cpu(x, y)
        sm.masked_softmax_forward_cpu(x, mask, ym, 1.0)
        sm.softmax_backward_cpu(ym, dy, dx, 0.5)
        return y, ym, dx

    y, ym, dx = each_thread_count(run)
    np.testing.assert_allclose(y, sm.softmax_forward_ref(x), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ym, sm.masked_softmax_forward_ref(x, mask, 1.0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dx, sm.softmax_backward_ref(ym, dy, 0.5), rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@given(rows=st.integers(1, 300), n=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1))
def test_softmax_on_gpu(rows, n, seed):
    x = (np.random.default_rng(seed).normal(size=(rows, n)) * 10).astype(np.float32)
    np.testing.assert_allclose(_forward(x, True, None), sm.softmax_forward_ref(x), rtol=1e-4, atol=1e-7)
