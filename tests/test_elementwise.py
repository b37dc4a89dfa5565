"""kernels/elementwise.py: Add, Sub, ElementwiseMultiply, ELU, Sigmoid kernels vs their references."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numbactr.kernels import elementwise as ew
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host

SHAPES = hnp.array_shapes(min_dims=1, max_dims=3, max_side=10)


@st.composite
def same_shape_inputs(draw, k_min=2, k_max=4, lo=-4.0, hi=4.0):
    shape = draw(SHAPES)
    k = draw(st.integers(k_min, k_max))
    return [draw(f32_arrays(shape, lo, hi)) for _ in range(k)]


def _stacked(xs):
    out = dev(np.zeros((len(xs), xs[0].size), np.float32))
    ew.stack([dev(x) for x in xs], out)
    return out


# ---- kernels vs references -------------------------------------------------------------------
@given(xs=same_shape_inputs())
def test_stack_add_and_multiply_forward_match_ref(xs):
    s = _stacked(xs)
    np.testing.assert_array_equal(host(s), np.stack([x.reshape(-1) for x in xs]))
    y = dev(np.zeros_like(xs[0]))
    ew.add_forward(s, y)
    np.testing.assert_allclose(host(y), ew.add_forward_ref(xs), rtol=1e-6, atol=1e-6)
    ew.multiply_forward(s, y)
    np.testing.assert_allclose(host(y), ew.multiply_forward_ref(xs), rtol=1e-5, atol=1e-6)


@given(xs=same_shape_inputs(), exact=st.booleans(), zeros=st.integers(0, 3), data=st.data())
def test_multiply_backward_matches_ref(xs, exact, zeros, data):
    # plant exact zeros: the place where the correct and HugeCTR gradients differ
    for _ in range(zeros):
        k = data.draw(st.integers(0, len(xs) - 1))
        i = data.draw(st.integers(0, xs[0].size - 1))
        xs[k].reshape(-1)[i] = 0.0
    dy = data.draw(f32_arrays(xs[0].shape, -2.0, 2.0))
    y = ew.multiply_forward_ref(xs)
    dxs = dev(np.zeros((len(xs), xs[0].size), np.float32))
    ew.multiply_backward(_stacked(xs), dev(dy), dxs, exact=exact, y=dev(y))
    want = ew.multiply_backward_ref(xs, dy, exact=exact, y=y)
    for k in range(len(xs)):
        np.testing.assert_allclose(host(dxs)[k].reshape(dy.shape), want[k], rtol=1e-5, atol=1e-5)


@given(a=f32_arrays(SHAPES), data=st.data())
def test_sub_forward_backward_match_ref(a, data):
    b = data.draw(f32_arrays(a.shape))
    y = dev(np.zeros_like(a))
    ew.sub_forward(dev(a), dev(b), y)
    np.testing.assert_array_equal(host(y), ew.sub_forward_ref(a, b))
    da, db = dev(np.zeros_like(a)), dev(np.zeros_like(a))
    ew.sub_backward(dev(a), da, db)  # use a as dY
    wa, wb = ew.sub_backward_ref(a)
    np.testing.assert_array_equal(host(da), wa)
    np.testing.assert_array_equal(host(db), wb)


@given(x=f32_arrays(SHAPES, -30.0, 30.0), alpha=st.floats(0.0625, 3.0, width=32), data=st.data())
def test_elu_matches_ref(x, alpha, data):
    dy = data.draw(f32_arrays(x.shape))
    y = dev(np.zeros_like(x))
    ew.elu_forward(dev(x), y, alpha)
    np.testing.assert_allclose(host(y), ew.elu_forward_ref(x, alpha), rtol=1e-5, atol=1e-6)
    dx = dev(np.zeros_like(x))
    ew.elu_backward(dev(x), dev(dy), dx, alpha)
    np.testing.assert_allclose(host(dx), ew.elu_backward_ref(x, dy, alpha), rtol=1e-5, atol=1e-6)


@given(x=f32_arrays(SHAPES, -100.0, 100.0), data=st.data())
def test_sigmoid_matches_ref(x, data):
    dy = data.draw(f32_arrays(x.shape))
    y = dev(np.zeros_like(x))
    ew.sigmoid_forward(dev(x), y)
    want = ew.sigmoid_forward_ref(x)
    np.testing.assert_allclose(host(y), want, rtol=1e-5, atol=1e-7)
    dx = dev(np.zeros_like(x))
    ew.sigmoid_backward(dev(want), dev(dy), dx)
    np.testing.assert_allclose(host(dx), ew.sigmoid_backward_ref(want, dy), rtol=1e-5, atol=1e-7)


# ---- edge cases ------------------------------------------------------------------------------
def test_empty_inputs_are_no_ops():
    e = np.zeros((0, 3), np.float32)
    s = dev(np.zeros((2, 0), np.float32))
    ew.stack([e, e], s)
    ew.add_forward(s, e)
    ew.multiply_forward(s, e)
    ew.multiply_backward(s, e, s)
    ew.sub_forward(e, e, e)
    ew.elu_forward(e, e, 1.0)
    ew.sigmoid_forward(e, e)


def test_sigmoid_extremes_do_not_overflow():
    x = np.array([-1e4, -88.8, 0.0, 88.8, 1e4, np.float32(3.4e38)], np.float32)
    y = dev(np.zeros_like(x))
    ew.sigmoid_forward(dev(x), y)
    assert np.all(np.isfinite(host(y)))
    np.testing.assert_allclose(host(y), [0.0, 0.0, 0.5, 1.0, 1.0, 1.0], atol=1e-30)


def test_multiply_gradient_at_zeros_correct_vs_hugectr():
    x0 = np.array([0.0, 2.0, 0.0], np.float32)
    x1 = np.array([3.0, 4.0, 0.0], np.float32)
    dy = np.ones(3, np.float32)
    correct = ew.multiply_backward_ref([x0, x1], dy)
    np.testing.assert_array_equal(correct[0], [3.0, 4.0, 0.0])  # d(x0*x1)/dx0 = x1, even where x0 == 0
    np.testing.assert_array_equal(correct[1], [0.0, 2.0, 0.0])
    hugectr = ew.multiply_backward_ref([x0, x1], dy, exact=True)
    np.testing.assert_array_equal(hugectr[0], [0.0, 4.0, 0.0])  # zeroed wherever y == 0
    np.testing.assert_array_equal(hugectr[1], [0.0, 2.0, 0.0])
    s, dxs = _stacked([x0, x1]), dev(np.zeros((2, 3), np.float32))
    ew.multiply_backward(s, dev(dy), dxs)
    np.testing.assert_array_equal(host(dxs), np.stack(correct))
    ew.multiply_backward(s, dev(dy), dxs, exact=True, y=dev(x0 * x1))
    np.testing.assert_array_equal(host(dxs), np.stack(hugectr))


def test_stack_rejects_a_wrong_size():
    with pytest.raises(ValueError, match="input 1 has 2 elements"):
        ew.stack([np.zeros(3, np.float32), np.zeros(2, np.float32)], np.zeros((2, 3), np.float32))


# ---- float64 gradient checks of the reference backwards --------------------------------------
def test_reference_gradients():
    rng = np.random.default_rng(0)
    shape = (3, 4)
    xs = [rng.normal(size=shape) for _ in range(3)]
    dy = rng.normal(size=shape)
    for k in range(3):

        def f(xk, k=k):
            return ew.add_forward_ref(xs[:k] + [xk] + xs[k + 1 :])

        def g(xk, k=k):
            return ew.multiply_forward_ref(xs[:k] + [xk] + xs[k + 1 :])

        assert_grad_close(ew.add_backward_ref(dy, 3)[k], f, xs[k], dy)
        assert_grad_close(ew.multiply_backward_ref(xs, dy)[k], g, xs[k], dy)
        # with no zeros the quotient form is the same gradient
        assert_grad_close(ew.multiply_backward_ref(xs, dy, exact=True)[k], g, xs[k], dy, rtol=1e-4)
    a, b = xs[0], xs[1]
    da, db = ew.sub_backward_ref(dy)
    assert_grad_close(da, lambda a_: ew.sub_forward_ref(a_, b), a, dy)
    assert_grad_close(db, lambda b_: ew.sub_forward_ref(a, b_), b, dy)
    x = rng.normal(size=shape)
    x[np.abs(x) < 1e-3] = 0.5  # keep away from ELU's kink at 0 (alpha != 1)
    for alpha in (1.0, 0.3):
        assert_grad_close(ew.elu_backward_ref(x, dy, alpha), lambda v: ew.elu_forward_ref(v, alpha), x, dy)
    x = rng.normal(scale=4.0, size=shape)
    assert_grad_close(ew.sigmoid_backward_ref(ew.sigmoid_forward_ref(x), dy), ew.sigmoid_forward_ref, x, dy)


# ---- real GPU --------------------------------------------------------------------------------
@pytest.mark.gpu
@given(xs=same_shape_inputs(k_max=5), data=st.data())
def test_multiply_on_gpu(xs, data):
    big = [np.resize(x, (300, 257)).astype(np.float32) for x in xs]
    dy = np.resize(data.draw(f32_arrays(xs[0].shape)), big[0].shape).astype(np.float32)
    s = _stacked(big)
    y = dev(np.zeros_like(big[0]))
    ew.multiply_forward(s, y)
    np.testing.assert_allclose(host(y), ew.multiply_forward_ref(big), rtol=1e-5, atol=1e-6)
    dxs = dev(np.zeros((len(big), big[0].size), np.float32))
    ew.multiply_backward(s, dev(dy), dxs)
    for k, w in enumerate(ew.multiply_backward_ref(big, dy)):
        np.testing.assert_allclose(host(dxs)[k].reshape(w.shape), w, rtol=1e-4, atol=1e-5)
