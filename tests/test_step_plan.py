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
    """The spec at simulator size: hidden widths at most 16 (DLRM's bottom MLP ends at D = 16), at most 4 slots
    of at most 12 ids an input (DIN's and BST's histories: 3 steps); embedding widths, layer and expert
    counts as they are."""
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
        inputs=[(n, [min(s, 12) for s in sizes[:4]]) for n, sizes in spec.inputs],  # at most 4 slots an input
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
    assert next(iter(planned._plans.values())).sized  # (and the last two steps ran in its buffers)
    assert l0 == l1
    assert same_bits(s0, s1), name


@pytest.mark.parametrize("name", list(Z.SPECS))
def test_planned_step_gives_the_general_steps_bits_in_the_simulator(name, on_device, monkeypatch):
    on_device("sim")
    spec = small(Z.SPECS[name])
    # (the simulator is slow: a traced step, the planned step that sizes the buffers, one that uses them)
    _, l0, s0 = train(spec, 4, 3, False, monkeypatch)
    planned, l1, s1 = train(spec, 4, 3, True, monkeypatch)
    assert planned._plan_why is None and len(planned._plans) == 1
    assert next(iter(planned._plans.values())).sized
    assert l0 == l1
    assert same_bits(s0, s1), name


def _with_dropout(add, L, s):
    """NCF's tower with a Dropout after its first ReLU: a layer whose op parameters change every step."""
    add(L.Reshape, ["emb"], ["flat"], leading_dim=2 * s.kw["mlp"])
    add(L.InnerProduct, ["flat"], ["fc0"], num_output=8)
    add(L.ReLU, ["fc0"], ["relu0"])
    add(L.Dropout, ["relu0"], ["drop0"], dropout_rate=0.5)
    add(L.InnerProduct, ["drop0"], ["logit"], num_output=1)


DROPOUT = dataclasses.replace(Z.SPECS["NCF"], name="NCF+Dropout", layers=_with_dropout)


def test_a_dropout_mask_is_drawn_anew_each_planned_step(cpu, monkeypatch):
    _, l0, s0 = train(DROPOUT, 16, 5, False, monkeypatch)
    planned, l1, s1 = train(DROPOUT, 16, 5, True, monkeypatch)
    assert planned._plan_why is None and len(planned._plans) == 1
    assert l0 == l1 and same_bits(s0, s1)


def test_a_partial_batch_runs_the_general_step_and_the_plan_is_kept(cpu, monkeypatch):
    spec = Z.SPECS["GMF"]
    full = Z.make_batches(spec, 8, 2, seed=1)
    part = Z.make_batches(spec, 8, 1, seed=2)[0]
    part.size = part.global_size = 5  # 5 valid rows, 3 padding
    monkeypatch.setenv("NUMBACTR_STEP_PLAN", "1")
    with contextlib.redirect_stdout(io.StringIO()):
        model = Z.build(hugectr, spec, 8, seed=5)
    model.solver = dataclasses.replace(model.solver, drop_incomplete_batch=False)
    Z.feed(model, [*full, part, *full])
    whys = []
    for _ in range(5):
        model.train()
        whys.append(model._plan_why)
    assert whys == [None, None, "a partial batch", None, None]
    assert len(model._plans) == 1


def test_a_changed_loss_scaler_makes_a_second_plan_with_the_general_steps_bits(cpu, monkeypatch):
    spec = Z.SPECS["NCF"]

    def run(planned):
        monkeypatch.setenv("NUMBACTR_STEP_PLAN", "1" if planned else "0")
        with contextlib.redirect_stdout(io.StringIO()):
            model = Z.build(hugectr, spec, 16, seed=5)
        Z.feed(model, Z.make_batches(spec, 16, 2, seed=7))
        for k in range(6):
            if k == 3:
                model.solver = dataclasses.replace(model.solver, scaler=128.0)
            model.train()
        return model, state(model)

    general, s0 = run(False)
    planned, s1 = run(True)
    assert len(planned._plans) == 2 and same_bits(s0, s1)


def test_what_the_plan_refuses(monkeypatch):
    from types import SimpleNamespace

    from numbactr.data.batch import Batch
    from numbactr.train import plan

    rows = np.zeros((4, 1), np.float32)
    full, part = Batch(rows, rows), Batch(rows, rows, size=3)
    model = SimpleNamespace(half=None, collections=[])
    assert plan.why_not(model, full) is None
    assert plan.why_not(model, part) == "a partial batch"
    assert "mixed precision" in plan.why_not(SimpleNamespace(half=np.float16, collections=[]), full)
    assert plan.why_not(SimpleNamespace(half=None, collections=[object()]), full) == "an embedding collection"
    monkeypatch.setenv("NUMBACTR_STEP_PLAN", "0")
    assert plan.why_not(model, full) == "NUMBACTR_STEP_PLAN=0"
    monkeypatch.setenv("NUMBACTR_STEP_PLAN", "yes")
    with pytest.raises(ValueError, match="NUMBACTR_STEP_PLAN must be 0 or 1"):
        plan.why_not(model, full)


def test_a_layer_computing_outside_its_ops_is_not_planned(cpu, monkeypatch):
    """The recorder proves a plan sound or refuses it: a top its layer's ops did not make."""
    from numbactr.autograd import Tensor
    from numbactr.layers.core import ReLU

    def forward(self, tape, xs, run):  # a ReLU computed in NumPy, off the tape
        return [Tensor(np.maximum(xs[0].data, 0), requires_grad=xs[0].requires_grad)]

    monkeypatch.setattr(ReLU, "forward", forward)
    spec = Z.SPECS["NCF"]
    monkeypatch.setenv("NUMBACTR_STEP_PLAN", "1")
    with contextlib.redirect_stdout(io.StringIO()):
        model = Z.build(hugectr, spec, 8, seed=5)
    Z.feed(model, Z.make_batches(spec, 8, 2, seed=7))
    model.train()
    model.train()
    assert "outside its ops" in model._plan_why  # (the next layer reads what ReLU made off the ops)
    assert list(model._plans.values()) == [None]  # not traced again for this key
