"""The planned training step (numbactr.train.plan) trains every zoo model to the same bits as the general step,
on cpu and in the simulator; it falls back where it must, and re-plans when what it was made for changes."""

import contextlib
import dataclasses
import io

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.bench import zoo_models as Z
from numbactr.runtime import device


def small(spec: Z.Spec) -> Z.Spec:
    """The spec at simulator size: hidden widths at most 16 (DLRM's bottom MLP ends at D = 16), vocabularies
    of at most 12 ids; embedding widths, layer and expert counts as they are."""
    keep = {"D", "gmf", "mlp", "cross", "experts", "alpha"}

    def shrink(k, v):
        if k in keep or isinstance(v, float):
            return v
        if isinstance(v, (tuple, list)):
            return type(v)(min(x, 16) for x in v)
        return min(v, 16) if isinstance(v, int) else v

    return dataclasses.replace(
        spec,
        kw={k: shrink(k, v) for k, v in spec.kw.items()},
        inputs=[(n, [min(s, 12) for s in sizes]) for n, sizes in spec.inputs],
        dense=min(spec.dense, 3),
    )


def train(spec, batch: int, steps: int, planned: bool, monkeypatch, batches=None):
    """(losses, final state) of ``steps`` training steps from the spec's seeded initial state."""
    monkeypatch.setenv("NUMBACTR_STEP_PLAN", "1" if planned else "0")
    with contextlib.redirect_stdout(io.StringIO()):
        model = Z.build(hugectr, spec, batch, seed=5)
    Z.feed(model, batches if batches is not None else Z.make_batches(spec, batch, 3, seed=7))
    losses = []
    for _ in range(steps):
        model.train()
        losses.append(model.get_current_loss())
    return model, losses, state(model)


def state(model) -> list:
    """Every number training changes: dense weights and optimizer states, each embedding's keys, vectors
    and optimizer states (host copies)."""
    out = [np.array(device.to_host(model.weights))]
    out += [np.array(device.to_host(s)) for s in model.dense_optimizer.states]
    for e in model.embeddings:
        out += [*e.dump(), *e.dump_states()]
    return out


def same_bits(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(Z.SPECS))
def test_planned_step_gives_the_general_steps_bits_on_cpu(name, cpu, monkeypatch):
    spec = Z.SPECS[name]
    general, l0, s0 = train(spec, 32, 4, False, monkeypatch)
    planned, l1, s1 = train(spec, 32, 4, True, monkeypatch)
    assert general._plans == {} and general._plan_why == "NUMBACTR_STEP_PLAN=0"
    assert planned._plan_why is None and len(planned._plans) == 1  # traced once, then planned
    assert l0 == l1
    assert same_bits(s0, s1), name


@pytest.mark.parametrize("name", list(Z.SPECS))
def test_planned_step_gives_the_general_steps_bits_in_the_simulator(name, on_device, monkeypatch):
    on_device("sim")
    spec = small(Z.SPECS[name])
    _, l0, s0 = train(spec, 4, 3, False, monkeypatch)
    planned, l1, s1 = train(spec, 4, 3, True, monkeypatch)
    assert planned._plan_why is None and len(planned._plans) == 1
    assert l0 == l1
    assert same_bits(s0, s1), name
