"""The interaction's one-block-per-sample kernels (shared memory; kernels/interaction.py, method='block'):
equal to the NumPy reference, and on the simulator bit for bit equal to the elementwise kernels (the same
products summed in the same order); the choice between them and the fallback when shared memory is short."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.kernels import interaction as ia
from numbactr.kernels import launch
from tests.kernel_util import SIMULATED, dev, f32_arrays, host


@st.composite
def inputs(draw):
    # up to 5 samples: more than the simulator's 2 blocks, so blocks take several samples in turn
    b, s, v = draw(st.integers(0, 5)), draw(st.integers(0, 4)), draw(st.integers(1, 6))
    dense = draw(f32_arrays((b, v), -2.0, 2.0))
    emb = draw(f32_arrays((b, s, v), -2.0, 2.0))
    dy = draw(f32_arrays((b, ia.interaction_out_width(s, v)), -2.0, 2.0))
    return dense, emb, dy


def _forward(dense, emb, **kw):
    out = dev(
        np.full((dense.shape[0], ia.interaction_out_width(emb.shape[1], dense.shape[1])), np.nan, np.float32)
    )  # every element must be written
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
def test_block_forward_matches_ref_and_elementwise(data, tpb):
    dense, emb, _ = data
    got = _forward(dense, emb, threads=tpb, method="block")
    np.testing.assert_allclose(got, ia.interaction_forward_ref(*_f64(dense, emb)), rtol=1e-5, atol=1e-5)
    assert np.all(got[:, -1] == 0.0)
    if SIMULATED:
        np.testing.assert_array_equal(got, _forward(dense, emb, threads=tpb, method="elementwise"))


@given(data=inputs(), tpb=st.sampled_from([1, 7, 32]))
def test_block_backward_matches_ref_and_elementwise(data, tpb):
    dense, emb, dy = data
    d_dense, d_emb = _backward(dense, emb, dy, threads=tpb, method="block")
    want_dense, want_emb = ia.interaction_backward_ref(*_f64(dense, emb, dy))
    np.testing.assert_allclose(d_dense, want_dense, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_emb, want_emb, rtol=1e-5, atol=1e-5)
    if SIMULATED:
        e_dense, e_emb = _backward(dense, emb, dy, threads=tpb, method="elementwise")
        np.testing.assert_array_equal(d_dense, e_dense)
        np.testing.assert_array_equal(d_emb, e_emb)


def test_block_is_the_default_where_it_fits():
    assert ia.block_smem_bytes(26, 128, False) == 4 * 27 * 129
    assert ia.block_smem_bytes(26, 128, True) == 4 * (27 * 129 + 351)
    assert ia._method(None, 26, 128, False) == ia._method(None, 26, 128, True) == "block"  # DLRM, V = 128
    assert ia._method(None, 100, 512, False) == "elementwise"  # 200 KB: too big
    assert ia._method("elementwise", 2, 4, True) == "elementwise"
    with pytest.raises(ValueError, match=r"method 'block' needs 207252 bytes .* 100 slots of width 512"):
        ia._method("block", 100, 512, False)
    with pytest.raises(ValueError, match=r"method must be one of \('block', 'elementwise'\), got 'gemm'"):
        ia._method("gemm", 2, 4, False)


def test_fallback_when_shared_memory_is_short(monkeypatch):
    rng = np.random.default_rng(1)
    dense = rng.normal(size=(3, 4)).astype(np.float32)
    emb = rng.normal(size=(3, 2, 4)).astype(np.float32)
    dy = rng.normal(size=(3, ia.interaction_out_width(2, 4))).astype(np.float32)
    used = []
    for name in (
        "interaction_forward_kernel",
        "interaction_backward_kernel",
        "interaction_forward_block_kernel",
        "interaction_backward_block_kernel",
    ):
        kernel = getattr(ia, name)

        class Spy:
            def __getitem__(self, config, kernel=kernel, name=name):
                used.append(name)
                return kernel[config]

        monkeypatch.setattr(ia, name, Spy())
    launch.reset_counts()
    want = ia.interaction_forward_ref(dense, emb)
    np.testing.assert_allclose(_forward(dense, emb), want, rtol=1e-6, atol=1e-6)
    _backward(dense, emb, dy)
    assert used == ["interaction_forward_block_kernel", "interaction_backward_block_kernel"]
    assert launch.reset_counts()["launches"] == 2  # one launch each way
    monkeypatch.setattr(ia, "BLOCK_SMEM_BYTES", 16)
    used.clear()
    np.testing.assert_allclose(_forward(dense, emb), want, rtol=1e-6, atol=1e-6)
    got = _backward(dense, emb, dy)
    for g, w in zip(got, ia.interaction_backward_ref(*_f64(dense, emb, dy))):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert used == ["interaction_forward_kernel", "interaction_backward_kernel"]


def test_block_hand_example():
    # Z = [2, 3, 5] (V = 1): pairs (1,0)=6, (2,0)=10, (2,1)=15, then the pad
    dense = np.array([[2.0]], np.float32)
    emb = np.array([[[3.0], [5.0]]], np.float32)
    np.testing.assert_array_equal(_forward(dense, emb, method="block"), [[2, 6, 10, 15, 0]])
    dy = np.array([[1.0, 0.0, 1.0, 0.0, 100.0]], np.float32)
    d_dense, d_emb = _backward(dense, emb, dy, method="block")
    np.testing.assert_array_equal(d_dense, [[1 + 5]])
    np.testing.assert_array_equal(d_emb, [[[0], [2]]])


def test_block_pair_order_for_dlrm_slot_count():
    # 26 slots -> 27 vectors -> 351 pairs; Z_k = k + 1 (V = 1) makes every pair's value unique
    z = np.arange(1, 28, dtype=np.float32)
    dense, emb = z[None, :1], z[None, 1:, None]
    got = _forward(dense, emb, method="block")
    np.testing.assert_array_equal(got, ia.interaction_forward_ref(dense, emb))


@pytest.mark.gpu
@given(
    b=st.integers(0, 2048),
    s=st.sampled_from([0, 1, 26]),
    v=st.sampled_from([1, 16, 64, 128]),
    tpb=st.sampled_from([None, 32, 256]),
    seed=st.integers(0, 2**32 - 1),
)
def test_block_on_gpu(b, s, v, tpb, seed):
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(b, v)).astype(np.float32)
    emb = rng.normal(size=(b, s, v)).astype(np.float32)
    dy = rng.normal(size=(b, ia.interaction_out_width(s, v))).astype(np.float32)
    np.testing.assert_allclose(
        _forward(dense, emb, threads=tpb, method="block"),
        ia.interaction_forward_ref(*_f64(dense, emb)),
        rtol=1e-4,
        atol=1e-3,
    )
    got = _backward(dense, emb, dy, threads=tpb, method="block")
    for g, w in zip(got, ia.interaction_backward_ref(*_f64(dense, emb, dy))):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3)


def test_block_dlrm_shape_both_ways():
    # 26 slots of width 8, 3 samples: block == elementwise (bit for bit on the simulator) == reference
    rng = np.random.default_rng(3)
    dense = rng.normal(size=(3, 8)).astype(np.float32)
    emb = rng.normal(size=(3, 26, 8)).astype(np.float32)
    dy = rng.normal(size=(3, ia.interaction_out_width(26, 8))).astype(np.float32)
    got = _forward(dense, emb, method="block")
    np.testing.assert_allclose(got, ia.interaction_forward_ref(*_f64(dense, emb)), rtol=1e-5, atol=1e-5)
    grads = _backward(dense, emb, dy, method="block")
    for g, w in zip(grads, ia.interaction_backward_ref(*_f64(dense, emb, dy))):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    if SIMULATED:
        np.testing.assert_array_equal(got, _forward(dense, emb, method="elementwise"))
        for g, e in zip(grads, _backward(dense, emb, dy, method="elementwise")):
            np.testing.assert_array_equal(g, e)
