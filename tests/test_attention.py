"""Head split/merge kernels and the matrix-product references of MatrixMultiply / MultiHeadAttention; the
cpu device's versions (views, row-major BLAS operands) against the references, alone and through the tape."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import numbactr as hugectr
from numbactr.kernels import attention as att
from numbactr.runtime import device
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host
from tests.layer_sim_cpu import run_layer


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


# ---- cpu versions ---------------------------------------------------------------------------------------
@given(b=st.integers(1, 3), heads=st.integers(1, 3), l=st.integers(1, 4), d=st.integers(1, 4), data=st.data())
def test_cpu_split_and_merge_are_views_of_the_reference_values(b, heads, l, d, data):
    x = data.draw(f32_arrays((b, l, heads * d)))
    y = att.split_heads_cpu(x, heads)
    np.testing.assert_array_equal(y, att.split_heads_ref(x, heads))
    assert np.shares_memory(y, x)  # no copy
    z = att.merge_heads_cpu(y)
    np.testing.assert_array_equal(z, x)
    assert np.shares_memory(z, x)  # the merge of a split view is a view
    c = att.split_heads_ref(x, heads)  # a contiguous (B, H, L, d): merged by a copy
    np.testing.assert_array_equal(att.merge_heads_cpu(c), att.merge_heads_ref(c))


def test_cpu_matmul_transposed_operands_scale_and_layout():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 5, 2 * 4)).astype(np.float32)
    q = att.split_heads_cpu(x, 2)  # (3, 2, 5, 4), a strided view
    k = rng.normal(size=(3, 2, 7, 4)).astype(np.float32)
    s = att.scaled_qk_forward_cpu(q, k, 0.5)  # Kᵀ: a transposed operand
    np.testing.assert_allclose(s, att.scaled_qk_forward_ref(q, k, 0.5), rtol=1e-5, atol=1e-6)
    ds = rng.normal(size=s.shape).astype(np.float32)
    dq, dk = att.scaled_qk_backward_cpu(q, k, ds, 0.5)
    rdq, rdk = att.scaled_qk_backward_ref(q, k, ds, 0.5)
    np.testing.assert_allclose(dq, rdq, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dk, rdk, rtol=1e-5, atol=1e-6)
    assert dq.strides == q.strides and dk.flags.c_contiguous  # each gradient in its input's layout
    assert np.shares_memory(att.merge_heads_cpu(dq), dq)
    p = rng.normal(size=(3, 2, 5, 5)).astype(np.float32)  # attention's P V with V = q: out in q's layout
    o = att.matmul_cpu(p, q, like=q)
    np.testing.assert_allclose(o, p @ q, rtol=1e-5, atol=1e-6)
    assert np.shares_memory(att.merge_heads_cpu(o), o)
    # 2-D and 3-D products; a ``like`` of another shape is ignored
    for a_shape, b_shape in (((4, 3), (3, 2)), ((2, 6, 5), (2, 5, 1))):
        a, b = rng.normal(size=a_shape).astype(np.float32), rng.normal(size=b_shape).astype(np.float32)
        at = np.ascontiguousarray(a.swapaxes(-1, -2)).swapaxes(-1, -2)  # a, seen through a transpose
        y = att.matmul_cpu(at, b, like=np.empty((1, 1), np.float32))
        np.testing.assert_allclose(y, a @ b, rtol=1e-5, atol=1e-6)
        assert y.shape == a_shape[:-1] + b_shape[-1:]


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (2, 3, 4, 2, 3), (5, 10, 10, 4, 8)])
def test_cpu_attention_through_the_tape_matches_references(shape):
    """Masked MultiHeadAttention (split, scaled QK, masked softmax, matmul, merge) forward and backward on the
    cpu device: its compiled versions and views against the NumPy references (reference_ops)."""
    b, lf, lt, heads, d = shape
    rng = np.random.default_rng(sum(shape))
    q, k, v = (rng.normal(size=(b, n, heads * d)).astype(np.float32) for n in (lf, lt, lt))
    mask = (rng.random((b, 1, 1, lt)) < 0.6).astype(np.float32)
    mask[..., 0] = 1.0
    args = (hugectr.Layer_t.MultiHeadAttention, [q, k, v, mask], ["o"], "cpu")
    kw = dict(num_attention_heads=heads, grad_inputs=[True, True, True, False])
    _, (o,), grads = run_layer(*args, **kw)
    with device.reference_ops():
        _, (ro,), rgrads = run_layer(*args, **kw)
    np.testing.assert_allclose(o, ro, rtol=1e-5, atol=1e-6)
    for g, rg in zip(grads[:3], rgrads[:3]):
        np.testing.assert_allclose(g, rg, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@given(b=st.integers(1, 64), heads=st.integers(1, 8), l=st.integers(1, 50), d=st.integers(1, 64))
def test_split_heads_on_gpu(b, heads, l, d):
    x = np.random.default_rng(0).normal(size=(b, l, heads * d)).astype(np.float32)
    y = dev(np.zeros((b, heads, l, d), np.float32))
    att.split_heads(dev(x), y)
    np.testing.assert_array_equal(host(y), att.split_heads_ref(x, heads))
