import numpy as np
import pytest
from hypothesis import given
from hypothesis.extra import numpy as hnp

from numbactr.kernels import relu
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host

SHAPES = hnp.array_shapes(min_dims=1, max_dims=3, max_side=12)


@given(x=f32_arrays(SHAPES))
def test_relu_forward_kernel_matches_ref(x):
    y = dev(np.zeros_like(x))
    relu.relu_forward(dev(x), y)
    np.testing.assert_array_equal(host(y), relu.relu_forward_ref(x))


@given(x=f32_arrays(SHAPES), data=f32_arrays(SHAPES))
def test_relu_backward_kernel_matches_ref(x, data):
    y = relu.relu_forward_ref(x)
    dy = np.resize(data, x.shape).astype(np.float32)
    dx = dev(np.zeros_like(x))
    relu.relu_backward(dev(y), dev(dy), dx)
    np.testing.assert_array_equal(host(dx), relu.relu_backward_ref(y, dy))


def test_relu_reference_gradient():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 7))
    x[np.abs(x) < 1e-3] = 0.5  # keep away from the kink at 0
    dy = rng.normal(size=x.shape)
    assert_grad_close(relu.relu_backward_ref(relu.relu_forward_ref(x), dy), relu.relu_forward_ref, x, dy)


def test_relu_empty_input_is_a_no_op():
    x = np.zeros((0,), np.float32)
    relu.relu_forward(dev(x), dev(x))


@pytest.mark.gpu
@given(x=f32_arrays(hnp.array_shapes(min_dims=1, max_dims=2, max_side=2000)))
def test_relu_on_gpu(x):
    y = dev(np.zeros_like(x))
    relu.relu_forward(dev(x), y)
    np.testing.assert_array_equal(host(y), relu.relu_forward_ref(x))
