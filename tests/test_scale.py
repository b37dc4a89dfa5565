"""kernels/scale.py: repeat elements (axis 0) / rows (axis 1); correct and HugeCTR-exact backward."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numbactr.kernels import scale
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host

SHAPES_2D = hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=12)


def _out_shape(shape, axis, f):
    b, n = shape
    return (b, n * f) if axis == 0 else (b * f, n)


@given(x=f32_arrays(SHAPES_2D), axis=st.integers(0, 1), f=st.integers(1, 5))
def test_scale_forward_matches_ref(x, axis, f):
    y = dev(np.full(_out_shape(x.shape, axis, f), np.nan, np.float32))
    scale.scale_forward(dev(x), y, axis, f)
    np.testing.assert_array_equal(host(y), scale.scale_forward_ref(x, axis, f))


@given(x=f32_arrays(SHAPES_2D), axis=st.integers(0, 1), f=st.integers(1, 5), first=st.booleans(), data=st.data())
def test_scale_backward_matches_ref(x, axis, f, first, data):
    dy = data.draw(f32_arrays(_out_shape(x.shape, axis, f)))
    dx = dev(np.full(x.shape, np.nan, np.float32))
    scale.scale_backward(dev(dy), dx, axis, f, first_only=first)
    np.testing.assert_allclose(host(dx), scale.scale_backward_ref(dy, axis, f, first_only=first), rtol=1e-6, atol=1e-5)


def test_scale_layouts_by_hand():
    x = np.array([[1, 2], [3, 4]], np.float32)
    np.testing.assert_array_equal(scale.scale_forward_ref(x, 0, 2), [[1, 1, 2, 2], [3, 3, 4, 4]])
    np.testing.assert_array_equal(scale.scale_forward_ref(x, 1, 2), [[1, 2], [1, 2], [3, 4], [3, 4]])
    dy = np.arange(8, dtype=np.float32).reshape(2, 4)  # axis 0: copies sit side by side
    np.testing.assert_array_equal(scale.scale_backward_ref(dy, 0, 2), [[1, 5], [9, 13]])
    np.testing.assert_array_equal(scale.scale_backward_ref(dy, 0, 2, first_only=True), [[0, 2], [4, 6]])
    dy = np.arange(8, dtype=np.float32).reshape(4, 2)  # axis 1: copies are consecutive rows
    np.testing.assert_array_equal(scale.scale_backward_ref(dy, 1, 2), [[2, 4], [10, 12]])
    np.testing.assert_array_equal(scale.scale_backward_ref(dy, 1, 2, first_only=True), [[0, 1], [4, 5]])
    for axis in (0, 1):
        dx = np.zeros((2, 2), np.float32)
        scale.scale_backward(dy.reshape(_out_shape((2, 2), axis, 2)).copy(), dx, axis, 2)
        np.testing.assert_array_equal(dx, scale.scale_backward_ref(dy.reshape(_out_shape((2, 2), axis, 2)), axis, 2))


def test_scale_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="should be"):
        scale.scale_forward(np.zeros((2, 3), np.float32), np.zeros((2, 5), np.float32), 0, 2)
    with pytest.raises(ValueError, match="axis 0/1"):
        scale.scale_forward(np.zeros((2, 3), np.float32), np.zeros((2, 6), np.float32), 2, 2)


def test_scale_reference_gradient():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 4))
    for axis in (0, 1):
        dy = rng.normal(size=_out_shape(x.shape, axis, 3))
        assert_grad_close(scale.scale_backward_ref(dy, axis, 3), lambda v: scale.scale_forward_ref(v, axis, 3), x, dy)


@pytest.mark.gpu
@given(axis=st.integers(0, 1), f=st.integers(1, 7), first=st.booleans())
def test_scale_on_gpu(axis, f, first):
    rng = np.random.default_rng(f)
    x = rng.normal(size=(1031, 67)).astype(np.float32)
    y = dev(np.zeros(_out_shape(x.shape, axis, f), np.float32))
    scale.scale_forward(dev(x), y, axis, f)
    np.testing.assert_array_equal(host(y), scale.scale_forward_ref(x, axis, f))
    dx = dev(np.zeros_like(x))
    scale.scale_backward(y, dx, axis, f, first_only=first)
    np.testing.assert_allclose(host(dx), scale.scale_backward_ref(host(y), axis, f, first), rtol=1e-5)
