"""The cpu impl's small-table pipeline (engine/impl_cpu.py: tbe_cpu.forward_onehot and small_update, no sort)
trains bit for bit as its general path (linearize, radix sort, fused_update): the same outputs, weights,
optimizer states and gradients after several steps, for every optimizer the engine runs, both layouts,
every pooling, per-sample weights, FP16 weights with stochastic rounding and keyed tables; and the engine
takes the general path where the small one does not apply (optimizer NONE, many rows)."""

import numpy as np
import pytest
from hypothesis import given, settings

from numbactr.embedding.engine import Layout, Optim, Pooling, Precision, TableSpec, UpdateType
from numbactr.embedding.engine.impl_cpu import _CpuImpl
from numbactr.kernels import tbe_cpu
from tests.engine_cases import OPTIMIZER_CASES, Case, cases, random_steps

pytestmark = pytest.mark.usefixtures("cpu")  # conftest.py: the cpu device for every test


def bits(a) -> np.ndarray:
    """The array's raw bits (float32 or float16): equal bits, not merely close values (-0.0, NaN)."""
    a = np.ascontiguousarray(np.asarray(a))
    return a.view({4: np.uint32, 2: np.uint16, 8: np.uint64}[a.dtype.itemsize]) if a.dtype.kind == "f" else a


def train(case: Case, small: bool, keyed_rows=None) -> tuple:
    """(engine, outputs, grads) after the case's steps, with the small-table pipeline allowed or not."""
    e = case.engine("cpu")
    e._impl.small_rows = _CpuImpl.small_rows if small else -1
    outs, grads = [], []
    for indices, offsets, psw, seed in case.steps:
        out, ctx = e.forward(indices, offsets, psw)
        outs.append(out)
        dy = np.random.default_rng(seed).normal(size=out.shape).astype(np.float32)
        grads.append(e.backward(ctx, dy))
    return e, outs, grads


def assert_bit_identical(a: tuple, b: tuple) -> None:
    (ea, outs_a, grads_a), (eb, outs_b, grads_b) = a, b
    for oa, ob in zip(outs_a, outs_b):
        np.testing.assert_array_equal(bits(oa), bits(ob))
    for ga, gb in zip(grads_a, grads_b):
        if ga.per_sample_weights is not None:
            np.testing.assert_array_equal(bits(ga.per_sample_weights), bits(gb.per_sample_weights))
    for wa, wb in zip(ea.split_weights(), eb.split_weights()):
        np.testing.assert_array_equal(bits(wa), bits(wb))
    for sa, sb in zip(ea.split_optimizer_states(), eb.split_optimizer_states()):
        for x, y in zip(sa, sb):
            np.testing.assert_array_equal(bits(x), bits(y))
    assert ea.step == eb.step
    for t, table in ea.hash_tables.items():
        np.testing.assert_array_equal(table.keys_by_row(), eb.hash_tables[t].keys_by_row())
    touched = ea._impl.touched
    assert touched is None or not touched.any(), "small_update leaves every row's flag cleared"


TRAINED = [c for c in OPTIMIZER_CASES if c[0] != Optim.NONE]


@pytest.mark.parametrize("kind,update,wd_mode", TRAINED, ids=[f"{k.name}-{u.name}-{m.name}" for k, u, m in TRAINED])
@pytest.mark.parametrize("layout", list(Layout))
def test_every_optimizer_bit_identical(kind, update, wd_mode, layout):
    """Widths 16 and 32 (the literal-width copies) and 5 (the general loop); MEAN bags, ragged, empty and
    repeated; per-sample weights on the even steps; max-norm and gradient clipping."""
    rng = np.random.default_rng(int(kind) * 7 + int(update) + 3 * int(layout))
    tables, fmap = [(6, 16), (4, 32), (7, 5)], [0, 1, 2, 0]
    steps = random_steps(rng, tables, fmap, n_steps=4, batch=5)
    steps = [(i, o, p if s % 2 == 0 else None, s) for i, o, p, s in steps]
    case = Case(
        tables, fmap, kind=kind, update=update, wd_mode=wd_mode, layout=layout, pooling=Pooling.MEAN,
        max_norm=0.9, clip=True, steps=steps,
    )  # fmt: skip
    assert_bit_identical(train(case, True), train(case, False))


@pytest.mark.parametrize("pooling", list(Pooling))
def test_fp16_stochastic_rounding_and_one_hot_bit_identical(pooling):
    """FP16 weights rounded stochastically (the rounding hashes the row, not its place in the update
    order), one-hot bags (the gather forward) beside empty ones and -1 rows."""
    rng = np.random.default_rng(int(pooling))
    tables, fmap = [(9, 16), (5, 16)], [0, 1, 1]
    steps = []
    for s in range(4):
        lens = rng.integers(0, 2, size=len(fmap) * 6)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        steps.append((rng.integers(-1, 5, size=int(offsets[-1])).astype(np.int64), offsets, None, s))
    case = Case(
        tables, fmap, kind=Optim.HUGECTR_ADAM, update=UpdateType.GLOBAL, weights=Precision.FP16,
        output=Precision.FP16, pooling=pooling, layout=Layout.SAMPLE_MAJOR, steps=steps,
    )  # fmt: skip
    assert_bit_identical(train(case, True), train(case, False))


def test_keyed_table_bit_identical():
    """HugeCTR's hash embedding's shape: a keyed table, two one-hot slots, sample-major, Adam GLOBAL; new
    keys arrive every step, and their rows are the same in both paths."""
    rng = np.random.default_rng(2)
    steps = []
    for s in range(4):
        keys = rng.integers(0, 40, size=2 * 32).astype(np.int64) * 1000003
        steps.append((keys, np.arange(keys.shape[0] + 1, dtype=np.int64), None, s))
    case = Case(
        [TableSpec(64, 16, keyed=True)], [0, 0], kind=Optim.HUGECTR_ADAM, update=UpdateType.GLOBAL,
        layout=Layout.SAMPLE_MAJOR, steps=steps,
    )  # fmt: skip
    assert_bit_identical(train(case, True), train(case, False))


@settings(max_examples=25, deadline=None)
@given(case=cases(kinds=[k for k in Optim if k != Optim.NONE]))
def test_random_configurations_bit_identical(case):
    assert_bit_identical(train(case, True), train(case, False))


def _forbid_small(monkeypatch):
    def refuse(*args):
        raise AssertionError("the small-table path ran where the general one must")

    monkeypatch.setattr(tbe_cpu, "small_update", refuse)
    monkeypatch.setattr(tbe_cpu, "forward_onehot", refuse)


def test_optimizer_none_takes_the_general_path(monkeypatch):
    """Optimizer NONE returns the summed gradient per row in row order: the sorted path's output."""
    rng = np.random.default_rng(0)
    tables, fmap = [(6, 4)], [0, 0]
    case = Case(tables, fmap, kind=Optim.NONE, steps=random_steps(rng, tables, fmap, n_steps=1, psw=False))
    indices, offsets, _, _ = case.steps[0]
    e = case.engine("cpu")
    out, ctx = e.forward(indices, offsets)  # the forward may gather
    _forbid_small(monkeypatch)
    grads = e.backward(ctx, np.ones(out.shape, np.float32))
    rows = grads.sparse.per_table()[0][0]
    np.testing.assert_array_equal(rows, np.unique(indices[indices >= 0]))


def test_many_rows_take_the_general_path(monkeypatch):
    """Tables of more linear rows than small_rows keep the sort; small_rows itself is the boundary."""
    rng = np.random.default_rng(1)
    tables, fmap = [(6, 4), (7, 4)], [0, 1]
    case = Case(tables, fmap, kind=Optim.EXACT_ADAGRAD, steps=random_steps(rng, tables, fmap, n_steps=2))
    e = case.engine("cpu")
    e._impl.small_rows = 12  # 13 linear rows
    _forbid_small(monkeypatch)
    for indices, offsets, psw, _ in case.steps:
        out, ctx = e.forward(indices, offsets)
        e.backward(ctx, np.ones(out.shape, np.float32))
    monkeypatch.undo()
    e._impl.small_rows = 13
    calls = []
    monkeypatch.setattr(tbe_cpu, "small_update", lambda *a: calls.append(1) or _small(*a))
    out, ctx = e.forward(*case.steps[0][:2])
    e.backward(ctx, np.ones(out.shape, np.float32))
    assert calls == [1]


_small = tbe_cpu.small_update
