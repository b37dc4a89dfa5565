import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numbactr.kernels import reduce_axis as ra
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host


@st.composite
def shape_and_axis(draw, max_side=5):
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=max_side))
    return shape, draw(st.integers(0, len(shape) - 1))


def _forward(x, axis, mean, threads):
    y = dev(np.full(ra.reduce_axis_forward_ref(x, axis).shape, np.nan, np.float32))
    ra.reduce_axis_forward(dev(x), y, axis, mean, threads=threads)
    return host(y)


@given(sa=shape_and_axis(), mean=st.booleans(), threads=st.sampled_from([4, 8]), data=st.data())
def test_forward_kernel_matches_ref(sa, mean, threads, data):
    shape, axis = sa
    x = data.draw(f32_arrays(shape))
    np.testing.assert_allclose(
        _forward(x, axis, mean, threads), ra.reduce_axis_forward_ref(x, axis, mean), rtol=1e-5, atol=1e-5
    )


@given(sa=shape_and_axis(), mean=st.booleans(), data=st.data())
def test_backward_kernel_matches_ref(sa, mean, data):
    shape, axis = sa
    out = list(shape)
    out[axis] = 1
    dy = data.draw(f32_arrays(tuple(out)))
    dx = dev(np.full(shape, np.nan, np.float32))
    ra.reduce_axis_backward(dev(dy), dx, axis, mean)
    np.testing.assert_allclose(host(dx), ra.reduce_axis_backward_ref(dy, shape, axis, mean), rtol=1e-6)


@pytest.mark.parametrize("threads", [1, 6, 32])
def test_reduced_axis_longer_than_the_block_and_odd_block_sizes(threads):
    # 70 values per output: every thread folds several before the (non power of two) tree reduction
    x = np.random.default_rng(1).normal(size=(2, 70, 3)).astype(np.float32)
    np.testing.assert_allclose(_forward(x, 1, False, threads), x.sum(1, keepdims=True), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_forward(x, 1, True, threads), x.mean(1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_axis_zero_reduces_over_the_batch():
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_array_equal(_forward(x, 0, False, 4), [[18, 22, 26]])


def test_empty_output_is_a_no_op():
    x = np.zeros((0, 3), np.float32)
    ra.reduce_axis_forward(dev(x), dev(np.zeros((0, 1), np.float32)), 1)
    ra.reduce_axis_backward(dev(np.zeros((0, 1), np.float32)), dev(x), 1)


@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_reference_gradient(axis, mean):
    rng = np.random.default_rng(axis)
    x = rng.normal(size=(3, 4, 2))
    dy = rng.normal(size=ra.reduce_axis_forward_ref(x, axis).shape)
    assert_grad_close(
        ra.reduce_axis_backward_ref(dy, x.shape, axis, mean), lambda z: ra.reduce_axis_forward_ref(z, axis, mean), x, dy
    )


@pytest.mark.gpu
@given(sa=shape_and_axis(max_side=100), mean=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_reduce_on_gpu(sa, mean, seed):
    shape, axis = sa
    x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    np.testing.assert_allclose(
        _forward(x, axis, mean, None), ra.reduce_axis_forward_ref(x, axis, mean), rtol=1e-4, atol=1e-3
    )
