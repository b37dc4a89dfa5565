"""Helpers for layer tests: run one layer through the tape on a device; build a tiny model."""

from __future__ import annotations

import numpy as np

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.autograd import Tape, Tensor
from numbactr.layers import RunInfo, build


def run_layer(dev: str, cfg, shape, training=True, seed=1, param_noise=0.1):
    """Forward + backward of one layer on ``dev``; returns (layer, outputs, x.grad, param grads, x, params).

    Parameters are the layer's own init plus a little noise (so zero/one inits still exercise every
    path); the upstream gradient is random. Same seed => same data on every device."""
    device.set_device(dev)
    xp = device.xp()
    layer = build(cfg, [shape])
    r = np.random.default_rng(seed)
    layer.params = [
        Tensor(
            xp.asarray(
                np.asarray(p, np.float32) + np.float32(param_noise) * r.normal(size=np.shape(p)).astype(np.float32)
            ),
            requires_grad=True,
        )
        for p in layer.init_params(r)
    ]
    x = Tensor(xp.asarray(r.normal(size=shape).astype(np.float32)), requires_grad=True)
    tape = Tape()
    outs = layer.forward(tape, [x], RunInfo(training=training, valid=shape[0]))
    y = outs[0]
    dy = xp.asarray(r.normal(size=y.shape).astype(np.float32))
    tape.backward({id(y): (y, dy)})
    host = device.to_host
    return (
        layer,
        [host(o.data) for o in outs],
        host(x.grad),
        [None if p.grad is None else host(p.grad) for p in layer.params],
        host(x.data),
        [host(p.data) for p in layer.params],
    )


def assert_sim_matches_cpu(cfg, shape, training=True, rtol=1e-4, atol=1e-5):
    before = device.kind()
    try:
        _, y0, dx0, g0, _, _ = run_layer("cpu", cfg, shape, training)
        _, y1, dx1, g1, _, _ = run_layer("sim", cfg, shape, training)
    finally:
        device.set_device(before)
    for a, b in zip(y0, y1):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=atol)
    np.testing.assert_allclose(dx1, dx0, rtol=rtol, atol=atol)
    assert len(g0) == len(g1)
    for a, b in zip(g0, g1):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(b, a, rtol=rtol, atol=atol)


def small_model(data, batch=8, dense=2):
    """A Model with an Input (label, dense (B, dense), data1 3 slots) for add() validation tests."""
    tr, ev = data
    s = hugectr.CreateSolver(batchsize=batch, batchsize_eval=batch, i64_input_key=True)
    r = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[tr], eval_source=ev, check_type=hugectr.Check_t.Sum
    )
    m = hugectr.Model(s, r, hugectr.CreateOptimizer())
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=dense,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 3)],
        )
    )
    return m
