import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numbactr.runtime import device
from numbactr.enums import Regularizer_t
from numbactr.kernels import regularizer as reg
from numbactr.layers import losses
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host

KINDS = st.sampled_from(["L1", "L2"])


@st.composite
def case(draw, max_size=600):
    w = draw(f32_arrays(hnp.array_shapes(min_dims=1, max_dims=1, min_side=0, max_side=max_size), -5.0, 5.0))
    return w, draw(KINDS), draw(st.floats(0.0, 10.0)), draw(st.integers(1, 4096))


def _term(w, kind, lam, b, kernel=None, grid=None):
    out = dev(np.array([0.25], np.float32))  # the kernel ADDS: start from non-zero
    if kernel is None:
        reg.regularizer_term_add(dev(w), out, kind, lam, b)
    else:
        alpha = lam / (2.0 * b) if kind == "L2" else lam / b
        kernel[grid](dev(w), out, np.int64(reg.KINDS[kind]), np.float32(alpha))
    return float(host(out)[0]) - 0.25


@given(data=case())
def test_term_kernel_matches_ref(data):
    w, kind, lam, b = data
    want = reg.regularizer_term_ref(w.astype(np.float64), kind, lam, b)
    np.testing.assert_allclose(_term(w, kind, lam, b), want, rtol=1e-5, atol=1e-6)


@given(data=case(max_size=100), tpb=st.sampled_from([1, 2, 8, 16]), blocks=st.integers(1, 3))
def test_term_kernel_any_grid_and_block(data, tpb, blocks):
    w, kind, lam, b = data
    if w.size == 0:
        return
    got = _term(w, kind, lam, b, reg.make_regularizer_term_kernel(tpb), (blocks, tpb))
    np.testing.assert_allclose(got, reg.regularizer_term_ref(w, kind, lam, b), rtol=1e-5, atol=1e-6)


@given(data=case(), accumulate=st.booleans())
def test_grad_kernel_matches_ref(data, accumulate):
    w, kind, lam, b = data
    start = np.linspace(-1, 1, w.size).astype(np.float32) if accumulate else np.full_like(w, np.nan)
    out = dev(start)
    reg.regularizer_grad_init(dev(w), out, kind, lam, b, accumulate=accumulate)
    want = reg.regularizer_grad_ref(w, kind, lam, b) + (start if accumulate else 0)
    np.testing.assert_allclose(host(out), want, rtol=1e-6, atol=1e-7)


def test_known_values_and_sign_of_zero():
    w = np.array([3.0, -4.0, 0.0, 0.5], np.float32)
    assert reg.regularizer_term_ref(w, "L2", 2.0, 4) == pytest.approx(2.0 / 8 * 25.25)
    assert reg.regularizer_term_ref(w, "L1", 2.0, 4) == pytest.approx(0.5 * 7.5)
    np.testing.assert_allclose(reg.regularizer_grad_ref(w, "L2", 2.0, 4), 0.5 * w)
    np.testing.assert_array_equal(reg.regularizer_grad_ref(w, "L1", 2.0, 4), [0.5, -0.5, -0.5, 0.5])
    out = dev(np.zeros_like(w))
    reg.regularizer_grad_init(dev(w), out, "L1", 2.0, 4)
    np.testing.assert_array_equal(host(out), [0.5, -0.5, -0.5, 0.5])  # sign(0) = -1 (HugeCTR)
    np.testing.assert_allclose(_term(w, "L2", 2.0, 4), 2.0 / 8 * 25.25, rtol=1e-6)


def test_validation_and_empty():
    w = np.ones(3, np.float32)
    with pytest.raises(ValueError, match="kind"):
        reg.regularizer_term_ref(w, "L3", 1.0, 2)
    with pytest.raises(ValueError, match="batch size"):
        reg.regularizer_grad_init(w, w.copy(), "L2", 1.0, 0)
    with pytest.raises(ValueError):
        reg.make_regularizer_term_kernel(5)
    out = np.zeros(1, np.float32)
    reg.regularizer_term_add(np.zeros(0, np.float32), out, "L2", 1.0, 2)
    reg.regularizer_grad_init(np.zeros(0, np.float32), np.zeros(0, np.float32), "L1", 1.0, 2)
    assert out[0] == 0.0


@pytest.mark.parametrize("kind", ["L1", "L2"])
def test_reference_gradient_of_rterm_is_wgrad_init(kind):
    rng = np.random.default_rng(3)
    w = rng.normal(size=12)
    w[np.abs(w) < 1e-2] = 0.3  # away from L1's kink at 0
    lam, b = 0.7, 5
    assert_grad_close(
        reg.regularizer_grad_ref(w, kind, lam, b),
        lambda v: np.array(reg.regularizer_term_ref(v, kind, lam, b)),
        w,
        np.array(1.0),
    )


@pytest.mark.parametrize("kind", [Regularizer_t.L1, Regularizer_t.L2, "L2", None])
def test_layer_level_functions_sim_equal_cpu(on_device, kind):
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    rng = np.random.default_rng(4)
    w = rng.normal(size=300).astype(np.float32)
    w[:3] = 0.0
    got = {}
    for name in ("cpu", "sim"):
        on_device(name)
        g = np.full(300, np.nan, np.float32)
        losses.regularizer_grad(w, kind, 0.1, 64, g)
        got[name] = (losses.regularizer_term(w, kind, 0.1, 64), g)
    assert got["cpu"][0] == pytest.approx(got["sim"][0], rel=1e-5)
    np.testing.assert_allclose(got["sim"][1], got["cpu"][1], rtol=1e-6)
    if kind is None:
        assert got["cpu"][0] == 0.0 and not got["cpu"][1].any()
    # accumulate=True adds to gradients already there (layers first, regularizer after)
    for name in ("cpu", "sim"):
        on_device(name)
        g = np.ones(300, np.float32)
        losses.regularizer_grad(w, kind, 0.1, 64, g, accumulate=True)
        np.testing.assert_allclose(g, 1.0 + got["cpu"][1], rtol=1e-6)
    with pytest.raises(ValueError, match="regularizer kind"):
        losses.regularizer_term(w, "L0", 0.1, 64)


@pytest.mark.gpu
@given(n=st.integers(1, 3_000_000), kind=KINDS, tpb=st.sampled_from([32, 256, 1024]), seed=st.integers(0, 2**32 - 1))
def test_regularizer_on_gpu(n, kind, tpb, seed):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=n).astype(np.float32)
    out = dev(np.zeros(1, np.float32))
    reg.regularizer_term_add(dev(w), out, kind, 0.5, 1024, threads=tpb)
    np.testing.assert_allclose(float(host(out)[0]), reg.regularizer_term_ref(w, kind, 0.5, 1024), rtol=1e-4)
    g = dev(np.zeros_like(w))
    reg.regularizer_grad_init(dev(w), g, kind, 0.5, 1024, threads=tpb)
    np.testing.assert_allclose(host(g), reg.regularizer_grad_ref(w, kind, 0.5, 1024), rtol=1e-6)
