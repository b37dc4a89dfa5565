import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.kernels import interaction as ia
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host


@st.composite
def inputs(draw):
    b, s, v = draw(st.integers(0, 3)), draw(st.integers(0, 4)), draw(st.integers(1, 5))
    dense = draw(f32_arrays((b, v), -2.0, 2.0))
    emb = draw(f32_arrays((b, s, v), -2.0, 2.0))
    dy = draw(f32_arrays((b, ia.interaction_out_width(s, v)), -2.0, 2.0))
    return dense, emb, dy


def _forward(dense, emb, **kw):
    out = dev(
        np.full((dense.shape[0], ia.interaction_out_width(emb.shape[1], dense.shape[1])), np.nan, np.float32)
    )  # the pad must be written too
    ia.interaction_forward(dev(dense), dev(emb), out, **kw)
    return host(out)


def _backward(dense, emb, dy, **kw):
    d_dense = dev(np.full(dense.shape, np.nan, np.float32))
    d_emb = dev(np.full(emb.shape, np.nan, np.float32))
    ia.interaction_backward(dev(dense), dev(emb), dev(dy), d_dense, d_emb, **kw)
    return host(d_dense), host(d_emb)


def _f64(*arrays):
    return [a.astype(np.float64) for a in arrays]


@given(data=inputs(), tpb=st.sampled_from([1, 7, 32]))
def test_interaction_forward_kernel_matches_ref(data, tpb):
    dense, emb, _ = data
    got = _forward(dense, emb, threads=tpb)
    np.testing.assert_allclose(got, ia.interaction_forward_ref(*_f64(dense, emb)), rtol=1e-5, atol=1e-5)
    assert np.all(got[:, -1] == 0.0)


@given(data=inputs(), tpb=st.sampled_from([1, 7, 32]))
def test_interaction_backward_kernel_matches_ref(data, tpb):
    dense, emb, dy = data
    d_dense, d_emb = _backward(dense, emb, dy, threads=tpb)
    want_dense, want_emb = ia.interaction_backward_ref(*_f64(dense, emb, dy))
    np.testing.assert_allclose(d_dense, want_dense, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_emb, want_emb, rtol=1e-5, atol=1e-5)


def test_interaction_hand_example():
    # Z = [2, 3, 5] (V = 1): pairs (1,0)=6, (2,0)=10, (2,1)=15, then the pad
    dense = np.array([[2.0]], np.float32)
    emb = np.array([[[3.0], [5.0]]], np.float32)
    np.testing.assert_array_equal(_forward(dense, emb), [[2, 6, 10, 15, 0]])
    np.testing.assert_array_equal(ia.interaction_forward_ref(dense, emb), [[2, 6, 10, 15, 0]])
    # dy on pair (2,0) only: dZ_0 = Z_2 = 5, dZ_2 = Z_0 = 2; the pad's dy is ignored
    dy = np.array([[1.0, 0.0, 1.0, 0.0, 100.0]], np.float32)
    d_dense, d_emb = _backward(dense, emb, dy)
    np.testing.assert_array_equal(d_dense, [[1 + 5]])
    np.testing.assert_array_equal(d_emb, [[[0], [2]]])


def test_interaction_pair_order_for_dlrm_slot_count():
    # 26 slots -> 27 vectors -> 351 pairs: Z_k = k + 1 (V = 1) makes every pair's value unique
    z = np.arange(1, 28, dtype=np.float32)
    dense, emb = z[None, :1], z[None, 1:, None]
    got = _forward(dense, emb)
    want = [z[i] * z[j] for i in range(1, 27) for j in range(i)]
    assert got.shape == (1, 1 + 351 + 1)
    np.testing.assert_array_equal(got[0, 1:-1], want)
    np.testing.assert_array_equal(got, ia.interaction_forward_ref(dense, emb))


def test_interaction_no_slots_is_dense_plus_pad():
    dense = np.array([[1.0, -2.0]], np.float32)
    emb = np.zeros((1, 0, 2), np.float32)
    np.testing.assert_array_equal(_forward(dense, emb), [[1, -2, 0]])
    d_dense, d_emb = _backward(dense, emb, np.array([[3.0, 4.0, 9.0]], np.float32))
    np.testing.assert_array_equal(d_dense, [[3, 4]])
    assert d_emb.shape == (1, 0, 2)


def test_interaction_rejects_bad_shapes():
    dense, emb = np.zeros((2, 3), np.float32), np.zeros((2, 2, 3), np.float32)
    with pytest.raises(ValueError):
        ia.interaction_forward(dense, emb, np.zeros((2, 3 + 3), np.float32))  # width 7 expected
    with pytest.raises(ValueError):
        ia.interaction_forward(dense, np.zeros((2, 2, 4), np.float32), np.zeros((2, 7), np.float32))


def test_interaction_reference_gradient():
    rng = np.random.default_rng(0)
    dense = rng.normal(size=(2, 3))
    emb = rng.normal(size=(2, 4, 3))
    dy = rng.normal(size=(2, ia.interaction_out_width(4, 3)))
    d_dense, d_emb = ia.interaction_backward_ref(dense, emb, dy)
    assert_grad_close(d_dense, lambda d: ia.interaction_forward_ref(d, emb), dense, dy)
    assert_grad_close(d_emb, lambda e: ia.interaction_forward_ref(dense, e), emb, dy)


@pytest.mark.gpu
@given(
    b=st.integers(0, 512),
    s=st.sampled_from([0, 1, 26]),
    v=st.sampled_from([1, 16, 128]),
    seed=st.integers(0, 2**32 - 1),
)
def test_interaction_on_gpu(b, s, v, seed):
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(b, v)).astype(np.float32)
    emb = rng.normal(size=(b, s, v)).astype(np.float32)
    dy = rng.normal(size=(b, ia.interaction_out_width(s, v))).astype(np.float32)
    np.testing.assert_allclose(
        _forward(dense, emb), ia.interaction_forward_ref(*_f64(dense, emb)), rtol=1e-4, atol=1e-3
    )
    got = _backward(dense, emb, dy)
    for g, w in zip(got, ia.interaction_backward_ref(*_f64(dense, emb, dy))):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3)
