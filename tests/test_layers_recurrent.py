"""GRU: per-step kernels (sim) vs the step formulas, whole-sequence float64 gradient check of the
reference BPTT (input, W, U, b, h0), layer sim == cpu in every input layout, HugeCTR-exact mode,
weight layout/init, validation at Model.add()."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import numbactr as hugectr
from numbactr import hugectr_exact as compat
from numbactr.config import DenseLayer
from numbactr.enums import Layer_t
from numbactr.kernels import gru
from numbactr.layers import build
from numbactr.layers.recurrent import gru_weight_count, split_gru_weights
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, host
from tests.layer_util import assert_sim_matches_cpu, run_layer, small_model
from tests.model_util import tiny_data


def _sig(a):
    return 1 / (1 + np.exp(-a))


@given(b=st.integers(1, 4), h=st.integers(1, 5), steps=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_gru_step_kernels_match_step_formulas(b, h, steps, seed):
    rng = np.random.default_rng(seed)
    t = int(rng.integers(0, steps))
    gx = rng.normal(size=(b, steps, 3 * h)).astype(np.float32)
    bias = rng.normal(size=3 * h).astype(np.float32)
    gh = rng.normal(size=(b, 3 * h)).astype(np.float32)
    hs0 = rng.normal(size=(b, steps + 1, h)).astype(np.float32)
    hs, gates = dev(hs0), dev(np.full((b, steps, 4 * h), np.nan, np.float32))
    gru.gru_step_forward(dev(gx), dev(bias), dev(gh), hs, gates, t)
    a = gx[:, t].astype(np.float64) + bias
    r = _sig(a[:, :h] + gh[:, :h])
    z = _sig(a[:, h : 2 * h] + gh[:, h : 2 * h])
    n = np.tanh(a[:, 2 * h :] + r * gh[:, 2 * h :])
    np.testing.assert_allclose(host(hs)[:, t + 1], (1 - z) * n + z * hs0[:, t], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(host(gates)[:, t], np.concatenate([r, z, n, gh[:, 2 * h :]], 1), rtol=1e-5, atol=1e-6)
    # backward step with a random carry
    dy = rng.normal(size=(b, steps, h)).astype(np.float32)
    mm, dr0 = rng.normal(size=(b, h)).astype(np.float32), rng.normal(size=(b, h)).astype(np.float32)
    dgx, dgh = dev(np.full_like(gx, np.nan)), dev(np.full_like(gx, np.nan))
    d_dir = dev(dr0)
    gru.gru_step_backward(dev(dy), dev(mm), d_dir, gates, hs, t, dgx, dgh)
    dh = dy[:, t].astype(np.float64) + mm + dr0
    a_n = dh * (1 - z) * (1 - n * n)
    a_z = dh * (hs0[:, t] - n) * z * (1 - z)
    a_r = a_n * gh[:, 2 * h :] * r * (1 - r)
    np.testing.assert_allclose(host(dgx)[:, t], np.concatenate([a_r, a_z, a_n], 1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(host(dgh)[:, t], np.concatenate([a_r, a_z, a_n * r], 1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(host(d_dir), dh * z, rtol=1e-5, atol=1e-6)


def test_gru_reference_bptt_gradient_whole_sequence_float64():
    rng = np.random.default_rng(0)
    b, steps, v, h = 2, 4, 3, 3
    x, dy = rng.normal(size=(b, steps, v)), rng.normal(size=(b, steps, h))
    w, u = rng.normal(size=(3 * h, v)) * 0.6, rng.normal(size=(3 * h, h)) * 0.6
    bias, h0 = rng.normal(size=3 * h) * 0.5, rng.normal(size=(b, h)) * 0.5
    _, cache = gru.gru_forward_ref(x, w, u, bias, h0)
    dx, dw, du, db, dh0 = gru.gru_backward_ref(dy, x, w, u, cache)

    def f(x_=x, w_=w, u_=u, b_=bias, h_=h0):
        return gru.gru_forward_ref(x_, w_, u_, b_, h_)[0]

    assert_grad_close(dx, lambda a: f(x_=a), x, dy)
    assert_grad_close(dw, lambda a: f(w_=a), w, dy)
    assert_grad_close(du, lambda a: f(u_=a), u, dy)
    assert_grad_close(db, lambda a: f(b_=a), bias, dy)
    assert_grad_close(dh0, lambda a: f(h_=a), h0, dy)


def _cfg(**kw):
    p = dict(num_output=3, batchsize=4, SeqLength=3, vector_size=2)
    p.update(kw)
    return DenseLayer(Layer_t.GRU, ["x"], ["g"], **p)


@pytest.mark.parametrize("shape", [(4, 6), (12, 2), (4, 3, 2)], ids=["B,TV", "BT,V", "B,T,V"])
def test_gru_layer_sim_matches_cpu(shape):
    assert_sim_matches_cpu(_cfg(), shape)


def test_gru_layer_shapes_weights_and_zero_init():
    layer = build(_cfg(), [(4, 6)])
    assert layer.out_shapes == [(4, 9)]
    assert build(_cfg(), [(12, 2)]).out_shapes == [(12, 3)]  # HugeCTR's (rows, num_output)
    assert layer.param_shapes() == [(1, gru_weight_count(3, 2)), (1, 12)]
    assert gru_weight_count(3, 2) == 3 * 3 * (2 + 3 + 1)  # single input bias
    assert all(not np.any(p) for p in layer.init_params(np.random.default_rng(0)))
    assert layer.json_params() == {"gru_param": {"num_output": 3, "batchsize": 4, "SeqLength": 3, "vector_size": 2}}


def test_gru_layer_is_batch_major_and_uses_hx():
    """Sample b's sequence is row b of (B, T*V); hx is the initial state."""
    layer, (y,), dx, (dw, dhx), x, (wflat, hx) = run_layer("cpu", _cfg(), (4, 6))
    w, u, b = split_gru_weights(wflat, 3, 2)
    want, _ = gru.gru_forward_ref(x.reshape(4, 3, 2), w, u, b, hx.reshape(4, 3))
    np.testing.assert_allclose(y, want.reshape(4, 9), rtol=1e-5, atol=1e-6)
    assert np.any(dhx)


def test_gru_hugectr_exact_mode_is_seq_major_with_zero_h0():
    compat.set_hugectr_exact(True)
    try:
        layer, (y,), dx, (dw, dhx), x, (wflat, hx) = run_layer("cpu", _cfg(), (12, 2))
        assert_sim_matches_cpu(_cfg(), (12, 2))
    finally:
        compat.set_hugectr_exact(False)
    w, u, b = split_gru_weights(wflat, 3, 2)
    xb = x.reshape(3, 4, 2).transpose(1, 0, 2)  # cuDNN's [T][B][V]
    want, _ = gru.gru_forward_ref(xb, w, u, b, np.zeros((4, 3)))
    np.testing.assert_allclose(y, want.transpose(1, 0, 2).reshape(12, 3), rtol=1e-5, atol=1e-6)
    assert not np.any(dhx)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("gru")), n_train=16, n_eval=16)


def test_gru_validates_at_add(data):
    m = small_model(data, dense=6)
    L = hugectr.Layer_t
    with pytest.raises(hugectr.ModelError, match=r"GRU.*SeqLength must be a positive int, got 0"):
        m.add(hugectr.DenseLayer(L.GRU, ["dense"], ["g"], num_output=2, batchsize=8, SeqLength=0, vector_size=2))
    with pytest.raises(
        hugectr.ModelError,
        match=r"GRU.*'dense' \(8, 6\) must be 2-D or 3-D holding "
        r"batchsize\*SeqLength\*vector_size = 8\*2\*2 = 32 floats, got 48",
    ):
        m.add(hugectr.DenseLayer(L.GRU, ["dense"], ["g"], num_output=2, batchsize=8, SeqLength=2, vector_size=2))
    m.add(hugectr.DenseLayer(L.GRU, ["dense"], ["g"], num_output=5, batchsize=8, SeqLength=3, vector_size=2))
    assert m.shapes["g"] == (8, 15)


@pytest.mark.gpu
def test_gru_kernels_on_gpu():
    from numbactr.runtime import device

    device.set_device("gpu")
    cfg = DenseLayer(Layer_t.GRU, ["x"], ["g"], num_output=64, batchsize=300, SeqLength=5, vector_size=16)
    _, (y1,), dx1, g1, x, params = run_layer("gpu", cfg, (300, 80))
    _, (y0,), dx0, g0, _, _ = run_layer("cpu", cfg, (300, 80))
    np.testing.assert_allclose(y1, y0, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(host(dx1), dx0, rtol=1e-3, atol=1e-4)
