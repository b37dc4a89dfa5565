"""Loss weights reach the gradients (issue 8.1).

A weighted loss Σ w_i·loss_i must have the gradient Σ w_i·∇loss_i. Before the fix the loss Functions'
backward dropped the seed (``return ctx.dx, None``), so every weight acted as 1 in the gradient while
the reported loss was weighted. These tests check the gradient THROUGH the seed: at the Function level
against central differences of the weighted loss value, and at the model level by linearity over the
two losses of a multi-task graph. Under numbactr.hugectr_exact.hugectr_exact() the weights scale only the
reported loss, as in HugeCTR.
"""

import numpy as np
import pytest

from numbactr import hugectr_exact as compat
from numbactr.runtime import device
from numbactr.autograd import Tape, Tensor
from numbactr.ops.losses import CrossEntropy, MultiCrossEntropy
from numbactr.ops import BinaryCrossEntropy
from tests.sample_graphs import GRAPHS, make_data

DEVICES = ["cpu"] + (["sim"] if device._numba_simulated() else [])


def _cases(rng):
    """(Function, x, y, extra kwargs) for each loss, tiny shapes."""
    b = 5
    x1 = rng.normal(size=(b, 1)).astype(np.float32)
    y1 = rng.integers(0, 2, size=(b, 1)).astype(np.float32)
    x2 = rng.normal(size=(b, 2)).astype(np.float32)
    y2 = rng.integers(0, 2, size=(b, 1)).astype(np.float32)
    x3 = rng.normal(size=(b, 3)).astype(np.float32)
    y3 = rng.integers(0, 2, size=(b, 3)).astype(np.float32)
    tw = np.array([1.0, 0.5, 2.0], np.float32)
    return [(BinaryCrossEntropy, x1, y1, {}), (CrossEntropy, x2, y2, {}), (MultiCrossEntropy, x3, y3, {"tw": tw})]


def _loss_and_grad(fn, x, y, kw, seed):
    tape = Tape()
    xt = Tensor(x.copy(), requires_grad=True)
    # the layers' grad_scale: 1/b, and 1/(b·T) for MultiCrossEntropy, whose loss is a mean over b·T
    per = x.shape[0] * (x.shape[1] if fn is MultiCrossEntropy else 1)
    loss = fn.apply(tape, xt, Tensor(y), valid=x.shape[0], grad_scale=1.0 / per, **kw)
    tape.backward({id(loss): (loss, np.full((1,), seed, np.float32))})
    return float(np.asarray(loss.data)[0]), np.asarray(xt.grad)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("which", [0, 1, 2], ids=["BCE", "CrossEntropy", "MultiCrossEntropy"])
def test_seed_scales_the_gradient_to_the_weighted_loss(on_device, dev, which):
    """x.grad of seed·loss(x) equals the central difference of seed·loss(x), for a seed that is not 1."""
    on_device(dev)
    fn, x, y, kw = _cases(np.random.default_rng(which))[which]
    seed = 0.37
    _, g = _loss_and_grad(fn, x, y, kw, seed)
    h = 1e-2
    num = np.zeros_like(x, dtype=np.float64)
    for i in np.ndindex(x.shape):
        xp_, xm = x.copy(), x.copy()
        xp_[i] += h
        xm[i] -= h
        lp, _ = _loss_and_grad(fn, xp_, y, kw, 1.0)
        lm, _ = _loss_and_grad(fn, xm, y, kw, 1.0)
        num[i] = seed * (lp - lm) / (2 * h)
    np.testing.assert_allclose(g, num, rtol=2e-2, atol=2e-4)
    _, g1 = _loss_and_grad(fn, x, y, kw, 1.0)
    np.testing.assert_array_equal(_loss_and_grad(fn, x, y, kw, 1.0)[1], g1)  # seed 1: dX itself
    assert not np.allclose(g, g1)  # the seed matters


def _mmoe_step(folder, weights, exact):
    """One training step of the two-loss MMoE graph; returns its flat dense gradient."""
    fn, inputs, dense, labels, _ = GRAPHS["mmoe"]
    data = make_data(folder, inputs, dense=dense, labels=labels)
    m = fn(data, batch=8, lr=0.01)
    m.compile(loss_names=["income", "married"], loss_weights=list(weights))
    m.start_data_reading()  # the readers as usual: exact mode below is about the step only
    compat.set_hugectr_exact(exact)
    try:
        assert m.train()
    finally:
        compat.set_hugectr_exact(False)
    return np.array(m.wgrads, dtype=np.float64), m.get_current_loss()


@pytest.mark.parametrize("dev", DEVICES)
def test_model_gradient_is_the_weighted_sum_of_the_loss_gradients(tmp_path, on_device, dev):
    on_device(dev)
    g_income, _ = _mmoe_step(str(tmp_path / "a"), (1.0, 0.0), False)
    g_married, _ = _mmoe_step(str(tmp_path / "b"), (0.0, 1.0), False)
    g, loss = _mmoe_step(str(tmp_path / "c"), (0.25, 2.0), False)
    assert np.abs(g_income).max() > 0 and np.abs(g_married).max() > 0
    np.testing.assert_allclose(g, 0.25 * g_income + 2.0 * g_married, rtol=1e-4, atol=1e-7)
    assert np.isfinite(loss)


def test_hugectr_exact_weights_scale_only_the_reported_loss(tmp_path, on_device):
    on_device("cpu")
    g_one, loss_one = _mmoe_step(str(tmp_path / "a"), (1.0, 1.0), True)
    g, loss = _mmoe_step(str(tmp_path / "b"), (0.25, 2.0), True)
    np.testing.assert_array_equal(g, g_one)  # gradients ignore the weights
    assert loss != pytest.approx(loss_one)  # the reported loss does not
