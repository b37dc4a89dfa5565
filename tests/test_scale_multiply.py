"""kernels/scale_multiply.py: the fused Scale+Multiply kernels against their NumPy references, on ragged tiny
shapes in the simulator (bit for bit: each element is the one float32 product the reference computes)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.kernels import scale_multiply as sm
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host


@st.composite
def case(draw):
    b, n, f = draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.integers(1, 6))
    g = draw(f32_arrays((b, n)))
    x, dy = draw(f32_arrays((b, n * f))), draw(f32_arrays((b, n * f)))
    return g, x, dy, f, draw(st.booleans())


@given(c=case())
def test_forward_and_backward_kernels_equal_the_references(c):
    g, x, dy, f, g_first = c
    y = dev(np.full(x.shape, np.nan, np.float32))  # garbage: every element must be written
    sm.scale_multiply(dev(g), dev(x), y, f, g_first)
    assert host(y).tobytes() == sm.scale_multiply_ref(g, x, f, g_first).tobytes()
    dx, ds = dev(np.full(x.shape, np.nan, np.float32)), dev(np.full(x.shape, np.nan, np.float32))
    sm.scale_multiply_backward(dev(g), dev(x), dev(dy), f, dx, ds)
    want_dx, want_ds = sm.scale_multiply_backward_ref(g, x, dy, f)
    assert host(dx).tobytes() == want_dx.tobytes() and host(ds).tobytes() == want_ds.tobytes()


def test_shapes_that_do_not_match_are_refused():
    g, x = np.ones((2, 3), np.float32), np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match=r"repeated 3 times does not match x \(2, 8\)"):
        sm.scale_multiply(dev(g), dev(x), dev(np.empty_like(x)), 3, True)


@pytest.mark.parametrize("g_first", [True, False])
def test_reference_gradients_by_central_differences_in_float64(g_first):
    """dx is the reference's backward; dg is the Scale's backward of ds: the sum of ds over each g's f copies."""
    rng = np.random.default_rng(int(g_first))
    b, n, f = 3, 2, 4
    g, x, dy = rng.normal(size=(b, n)), rng.normal(size=(b, n * f)), rng.normal(size=(b, n * f))
    dx, ds = sm.scale_multiply_backward_ref(g, x, dy, f)
    assert_grad_close(dx, lambda z: sm.scale_multiply_ref(g, z, f, g_first), x, dy)
    assert_grad_close(ds.reshape(b, n, f).sum(axis=2), lambda z: sm.scale_multiply_ref(z, x, f, g_first), g, dy)
