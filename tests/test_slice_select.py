import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numbactr.kernels import slice_select as ss
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host


@st.composite
def sorted_ranges(draw, width):
    """1..5 HugeCTR-valid ranges: a < b <= width, starts and ends non-decreasing (overlaps allowed)."""
    k = draw(st.integers(1, 5))
    starts = sorted(draw(st.lists(st.integers(0, width - 1), min_size=k, max_size=k)))
    ranges, end = [], 0
    for a in starts:
        end = draw(st.integers(max(end, a + 1), width))
        ranges.append((a, end))
    return ranges


@st.composite
def slice_case(draw):
    shape = draw(hnp.array_shapes(min_dims=2, max_dims=3, min_side=1, max_side=6))
    return draw(f32_arrays(shape)), draw(sorted_ranges(shape[-1]))


@given(case=slice_case())
def test_slice_forward_and_backward_kernels_match_ref(case):
    x, ranges = case
    starts = [a for a, _ in ranges]
    ys = [dev(np.full(x.shape[:-1] + (b - a,), np.nan, np.float32)) for a, b in ranges]
    ss.slice_forward(dev(x), ys, starts)
    for y, ref in zip(ys, ss.slice_forward_ref(x, ranges)):
        np.testing.assert_array_equal(host(y), ref)
    dys = [np.random.default_rng(i).normal(size=host(y).shape).astype(np.float32) for i, y in enumerate(ys)]
    dx = dev(np.full(x.shape, 123.0, np.float32))  # garbage: backward must zero it first
    ss.slice_backward([dev(d) for d in dys], dx, starts)
    np.testing.assert_allclose(host(dx), ss.slice_backward_ref(dys, ranges, x.shape), rtol=1e-6, atol=1e-6)


def test_slice_backward_sums_overlaps_and_skips_unused_tops():
    dys = [np.ones((2, 3), np.float32), np.full((2, 2), 2.0, np.float32)]
    dx = dev(np.full((2, 5), 9.0, np.float32))
    ss.slice_backward([dev(dys[0]), dev(dys[1])], dx, [0, 2])
    np.testing.assert_array_equal(host(dx)[0], [1, 1, 3, 2, 0])
    ss.slice_backward([None, dev(dys[1])], dx, [0, 2])
    np.testing.assert_array_equal(host(dx)[0], [0, 0, 2, 2, 0])


@st.composite
def select_case(draw):
    shape = draw(hnp.array_shapes(min_dims=2, max_dims=3, min_side=1, max_side=5))
    dim = draw(st.integers(0, len(shape) - 1))
    index = draw(st.lists(st.integers(0, shape[dim] - 1), min_size=1, max_size=6))  # duplicates allowed
    return draw(f32_arrays(shape)), dim, np.asarray(index, np.int64)


@given(case=select_case())
def test_select_forward_and_backward_kernels_match_ref(case):
    x, dim, index = case
    ref = ss.select_forward_ref(x, dim, index)
    y = dev(np.full(ref.shape, np.nan, np.float32))
    ss.select_forward(dev(x), dev(index), y, dim)
    np.testing.assert_array_equal(host(y), ref)
    dy = np.random.default_rng(0).normal(size=ref.shape).astype(np.float32)
    dx = dev(np.full(x.shape, 5.0, np.float32))
    ss.select_backward(dev(dy), dev(index), dx, dim)
    np.testing.assert_allclose(host(dx), ss.select_backward_ref(dy, x.shape, dim, index), rtol=1e-5, atol=1e-6)


def test_select_backward_zero_fills_unselected_and_adds_duplicates():
    dy = np.array([[1.0, 2.0, 4.0]], np.float32)  # (1, 3) from index [2, 0, 2] of 4 columns
    dx = dev(np.full((1, 4), 7.0, np.float32))
    ss.select_backward(dev(dy), dev(np.array([2, 0, 2], np.int64)), dx, 1)
    np.testing.assert_array_equal(host(dx), [[2, 0, 5, 0]])


def test_empty_inputs_are_no_ops():
    x = np.zeros((0, 4), np.float32)
    ss.slice_forward(dev(x), [dev(np.zeros((0, 2), np.float32))], [1])
    ss.slice_backward([dev(np.zeros((0, 2), np.float32))], dev(x), [1])
    ss.select_forward(dev(x), dev(np.array([1], np.int64)), dev(np.zeros((0, 1), np.float32)), 1)
    ss.select_backward(dev(np.zeros((0, 1), np.float32)), dev(np.array([1], np.int64)), dev(x), 1)


def test_slice_reference_gradient():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 2, 6))
    ranges = [(0, 3), (1, 4), (4, 6)]
    dys = [rng.normal(size=x.shape[:-1] + (b - a,)) for a, b in ranges]
    analytic = ss.slice_backward_ref(dys, ranges, x.shape)
    # the Jacobian of the stacked outputs: flatten them against the flattened dY_i
    flat_dy = np.concatenate([d.reshape(-1) for d in dys])
    assert_grad_close(
        analytic, lambda z: np.concatenate([p.reshape(-1) for p in ss.slice_forward_ref(z, ranges)]), x, flat_dy
    )


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_select_reference_gradient_with_duplicates(dim):
    rng = np.random.default_rng(dim)
    x = rng.normal(size=(3, 4, 2))
    index = [1, 0, 1]
    dy = rng.normal(size=ss.select_forward_ref(x, dim, index).shape)
    assert_grad_close(
        ss.select_backward_ref(dy, x.shape, dim, index), lambda z: ss.select_forward_ref(z, dim, index), x, dy
    )


@pytest.mark.gpu
@given(shape=hnp.array_shapes(min_dims=2, max_dims=3, min_side=1, max_side=100), data=st.data())
def test_select_on_gpu(shape, data):
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    index = np.asarray(data.draw(st.lists(st.integers(0, shape[1] - 1), min_size=1, max_size=300)), np.int64)
    ref = ss.select_forward_ref(x, 1, index)
    y = dev(np.zeros(ref.shape, np.float32))
    ss.select_forward(dev(x), dev(index), y, 1)
    np.testing.assert_array_equal(host(y), ref)
    dx = dev(np.zeros(x.shape, np.float32))
    ss.select_backward(dev(ref), dev(index), dx, 1)
    np.testing.assert_allclose(host(dx), ss.select_backward_ref(ref, x.shape, 1, index), rtol=1e-4, atol=1e-4)
