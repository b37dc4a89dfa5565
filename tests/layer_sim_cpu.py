"""Run one dense layer forward and backward through the autograd tape on a device; compare devices.

Used by the layer tests to check that a layer built from a DenseLayer config computes the same on
``sim`` (numba.cuda kernels in the simulator) as on ``cpu`` (NumPy references).
"""

from __future__ import annotations

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.autograd import Tape, Tensor
from numbactr.layers import REGISTRY, RunInfo


def run_layer(layer_type, xs, tops, dev_kind, *, cls=None, grad_inputs=None, seed=0, **params):
    """Build the layer for inputs ``xs`` on ``dev_kind``; return (layer, outputs, input grads).

    Every output gets a seeded random upstream gradient. ``grad_inputs`` (default: all) says which
    inputs require a gradient; the others report None.
    """
    device.set_device(dev_kind)
    bottoms = [f"in{i}" for i in range(len(xs))]
    cfg = hugectr.DenseLayer(layer_type, bottoms, list(tops), **params)
    layer = (cls or REGISTRY[layer_type])(cfg, [x.shape for x in xs])
    grad_inputs = [True] * len(xs) if grad_inputs is None else grad_inputs
    ts = [Tensor(np.array(x, np.float32), name=n, requires_grad=g) for x, n, g in zip(xs, bottoms, grad_inputs)]
    tape = Tape()
    outs = layer.forward(tape, ts, RunInfo(training=True, valid=xs[0].shape[0]))
    rng = np.random.default_rng(seed)
    seeds = {}
    for o in outs:
        seeds[id(o)] = (o, rng.normal(size=o.shape).astype(np.float32))
    tape.backward(seeds)
    host = [device.to_host(o.data) for o in outs]
    grads = [None if t.grad is None else device.to_host(t.grad) for t in ts]
    return layer, host, grads


def assert_sim_matches_cpu(layer_type, xs, tops, *, rtol=1e-5, atol=1e-6, **kw):
    """Same outputs and input gradients on sim and cpu; outputs have the shapes infer() declared."""
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    before = device.kind()
    try:
        layer, out_cpu, g_cpu = run_layer(layer_type, xs, tops, "cpu", **kw)
        _, out_sim, g_sim = run_layer(layer_type, xs, tops, "sim", **kw)
    finally:
        device.set_device(before)
    assert [o.shape for o in out_cpu] == [tuple(s) for s in layer.out_shapes]
    for a, b in zip(out_sim, out_cpu):
        assert a.dtype == np.float32 and b.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
    for a, b in zip(g_sim, g_cpu):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == np.float32 and b.dtype == np.float32
            np.testing.assert_allclose(a, b, rtol=rtol * 10, atol=atol * 10)
    return layer, out_cpu, g_cpu
