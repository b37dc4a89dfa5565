"""kernels/weight_multiply.py: X (B, S) * W (S, V) -> (B, S*V), dX and dW kernels vs references."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.kernels import weight_multiply as wm
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host


@st.composite
def wm_inputs(draw, max_b=10, max_s=8, max_v=8):
    b, s, v = draw(st.integers(0, max_b)), draw(st.integers(1, max_s)), draw(st.integers(1, max_v))
    return (
        draw(f32_arrays((b, s), -3.0, 3.0)),
        draw(f32_arrays((s, v), -3.0, 3.0)),
        draw(f32_arrays((b, s * v), -3.0, 3.0)),
    )


@given(args=wm_inputs())
def test_weight_multiply_forward_matches_ref(args):
    x, w, _ = args
    y = dev(np.full((x.shape[0], w.size), np.nan, np.float32))
    wm.weight_multiply_forward(dev(x), dev(w), y)
    np.testing.assert_array_equal(host(y), wm.weight_multiply_forward_ref(x, w))


@given(args=wm_inputs())
def test_weight_multiply_backward_matches_ref(args):
    x, w, dy = args
    dx = dev(np.full(x.shape, np.nan, np.float32))
    dw = dev(np.full(w.shape, np.nan, np.float32))
    wm.weight_multiply_backward(dev(x), dev(w), dev(dy), dx, dw)
    want_dx, want_dw = wm.weight_multiply_backward_ref(x, w, dy)
    np.testing.assert_allclose(host(dx), want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(host(dw), want_dw, rtol=1e-5, atol=1e-5)


def test_empty_batch_gives_zero_weight_gradient():
    x, w, dy = np.zeros((0, 3), np.float32), np.ones((3, 2), np.float32), np.zeros((0, 6), np.float32)
    dw = np.full((3, 2), np.nan, np.float32)
    wm.weight_multiply_backward(x, w, dy, None, dw)
    np.testing.assert_array_equal(dw, 0)


def test_weight_multiply_layout_by_hand():
    x = np.array([[2.0, 3.0]], np.float32)
    w = np.array([[1.0, 10.0, 100.0], [-1.0, -2.0, -3.0]], np.float32)
    np.testing.assert_array_equal(wm.weight_multiply_forward_ref(x, w), [[2, 20, 200, -3, -6, -9]])


def test_weight_multiply_rejects_mismatched_weight():
    with pytest.raises(ValueError, match="do not fit"):
        wm.weight_multiply_forward(
            np.zeros((2, 3), np.float32), np.zeros((4, 2), np.float32), np.zeros((2, 8), np.float32)
        )


def test_weight_multiply_reference_gradients():
    rng = np.random.default_rng(5)
    x, w, dy = rng.normal(size=(4, 3)), rng.normal(size=(3, 5)), rng.normal(size=(4, 15))
    dx, dw = wm.weight_multiply_backward_ref(x, w, dy)
    assert_grad_close(dx, lambda v: wm.weight_multiply_forward_ref(v, w), x, dy)
    assert_grad_close(dw, lambda v: wm.weight_multiply_forward_ref(x, v), w, dy)


@pytest.mark.gpu
@given(args=wm_inputs(max_b=3000, max_s=40, max_v=32))
def test_weight_multiply_on_gpu(args):
    x, w, dy = args
    dx, dw = dev(np.zeros_like(x)), dev(np.zeros_like(w))
    wm.weight_multiply_backward(dev(x), dev(w), dev(dy), dx, dw)
    want_dx, want_dw = wm.weight_multiply_backward_ref(x, w, dy)
    np.testing.assert_allclose(host(dx), want_dx, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(host(dw), want_dw, rtol=1e-4, atol=1e-2)
