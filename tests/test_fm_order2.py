"""kernels/fm_order2.py: FM second-order term per embedding component, kernels vs references."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.kernels import fm_order2 as fm
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host


@st.composite
def fm_inputs(draw, max_b=8, max_s=8, max_v=8):
    b, s, v = draw(st.integers(0, max_b)), draw(st.integers(0, max_s)), draw(st.integers(1, max_v))
    x = draw(f32_arrays((b, s * v), -3.0, 3.0))
    dy = draw(f32_arrays((b, v), -3.0, 3.0))
    return x, dy, v


@given(args=fm_inputs())
def test_fm_order2_forward_matches_ref(args):
    x, _, v = args
    y = dev(np.full((x.shape[0], v), np.nan, np.float32))
    fm.fm_order2_forward(dev(x), y)
    np.testing.assert_allclose(host(y), fm.fm_order2_forward_ref(x, v), rtol=1e-5, atol=1e-4)


@given(args=fm_inputs())
def test_fm_order2_backward_matches_ref(args):
    x, dy, v = args
    dx = dev(np.full(x.shape, np.nan, np.float32))
    fm.fm_order2_backward(dev(x), dev(dy), dx)
    np.testing.assert_allclose(host(dx), fm.fm_order2_backward_ref(x, dy, v), rtol=1e-5, atol=1e-5)


def test_fm_order2_is_the_sum_of_pairwise_products():
    rng = np.random.default_rng(3)
    b, s, v = 2, 4, 3
    x = rng.normal(size=(b, s * v))
    e = x.reshape(b, s, v)
    want = sum(e[:, i] * e[:, j] for i in range(s) for j in range(i + 1, s))
    np.testing.assert_allclose(fm.fm_order2_forward_ref(x, v), want, rtol=1e-12)
    y = np.zeros((b, v), np.float32)
    fm.fm_order2_forward(x.astype(np.float32), y)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_fm_order2_rejects_a_width_that_does_not_split():
    with pytest.raises(ValueError, match="does not split"):
        fm.fm_order2_forward(np.zeros((2, 7), np.float32), np.zeros((2, 3), np.float32))


def test_fm_order2_reference_gradient():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, 5 * 4))
    dy = rng.normal(size=(3, 4))
    assert_grad_close(fm.fm_order2_backward_ref(x, dy, 4), lambda v: fm.fm_order2_forward_ref(v, 4), x, dy)


@pytest.mark.gpu
@given(args=fm_inputs(max_b=2000, max_s=40, max_v=64))
def test_fm_order2_on_gpu(args):
    x, dy, v = args
    y = dev(np.zeros((x.shape[0], v), np.float32))
    fm.fm_order2_forward(dev(x), y)
    np.testing.assert_allclose(host(y), fm.fm_order2_forward_ref(x, v), rtol=1e-4, atol=1e-3)
    dx = dev(np.zeros_like(x))
    fm.fm_order2_backward(dev(x), dev(dy), dx)
    np.testing.assert_allclose(host(dx), fm.fm_order2_backward_ref(x, dy, v), rtol=1e-4, atol=1e-3)
