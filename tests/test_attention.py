"""Head split/merge kernels and the matrix-product references of MatrixMultiply / MultiHeadAttention."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.kernels import attention as att
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host


@given(b=st.integers(1, 3), heads=st.integers(1, 3), l=st.integers(1, 4), d=st.integers(1, 4), data=st.data())
def test_split_and_merge_kernels_match_ref(b, heads, l, d, data):
    x = data.draw(f32_arrays((b, l, heads * d)))
    y = dev(np.full((b, heads, l, d), np.nan, np.float32))
    att.split_heads(dev(x), y)
    np.testing.assert_array_equal(host(y), att.split_heads_ref(x, heads))
    z = dev(np.full(x.shape, np.nan, np.float32))
    att.merge_heads(y, z)
    np.testing.assert_array_equal(host(z), x)
    np.testing.assert_array_equal(att.merge_heads_ref(att.split_heads_ref(x, heads)), x)


def test_head_h_takes_columns_h_d_onward():
    x = np.arange(2 * 6, dtype=np.float32).reshape(1, 2, 6)  # L = 2, H = 3, d = 2
    y = dev(np.zeros((1, 3, 2, 2), np.float32))
    att.split_heads(dev(x), y)
    np.testing.assert_array_equal(host(y)[0, 1], [[2, 3], [8, 9]])


def test_empty_is_a_no_op():
    att.split_heads(dev(np.zeros((0, 2, 4), np.float32)), dev(np.zeros((0, 2, 2, 2), np.float32)))


def test_reference_gradients():
    rng = np.random.default_rng(0)
    for a_shape, b_shape in (((3, 4), (4, 2)), ((2, 3, 4), (2, 4, 5)), ((2, 2, 3, 4), (2, 2, 4, 1))):
        a, b = rng.normal(size=a_shape), rng.normal(size=b_shape)
        dy = rng.normal(size=(a @ b).shape)
        da, db = att.matmul_backward_ref(a, b, dy)
        assert_grad_close(da, lambda z: att.matmul_forward_ref(z, b), a, dy)
        assert_grad_close(db, lambda z: att.matmul_forward_ref(a, z), b, dy)
    q, k = rng.normal(size=(2, 2, 3, 4)), rng.normal(size=(2, 2, 5, 4))
    ds = rng.normal(size=(2, 2, 3, 5))
    dq, dk = att.scaled_qk_backward_ref(q, k, ds, 0.5)
    assert_grad_close(dq, lambda z: att.scaled_qk_forward_ref(z, k, 0.5), q, ds)
    assert_grad_close(dk, lambda z: att.scaled_qk_forward_ref(q, z, 0.5), k, ds)
    # split's gradient is merge (a permutation's adjoint is its inverse)
    x, dy = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 2, 3, 2))
    assert_grad_close(att.merge_heads_ref(dy), lambda z: att.split_heads_ref(z, 2), x, dy)


@pytest.mark.gpu
@given(b=st.integers(1, 64), heads=st.integers(1, 8), l=st.integers(1, 50), d=st.integers(1, 64))
def test_split_heads_on_gpu(b, heads, l, d):
    x = np.random.default_rng(0).normal(size=(b, l, heads * d)).astype(np.float32)
    y = dev(np.zeros((b, heads, l, d), np.float32))
    att.split_heads(dev(x), y)
    np.testing.assert_array_equal(host(y), att.split_heads_ref(x, heads))
