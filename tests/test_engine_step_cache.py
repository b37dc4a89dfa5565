"""What the engine keeps from step to step (core.py: _step_constants, _state_buffers; lookup_rows.py: the
one-keyed-table path of _rows_of_keys) never goes stale: a hyper-parameter changed between steps is the
next step's, adopted state buffers are the ones updated, a keyed table grown by new keys gives the rows the
general path gives."""

import dataclasses

import numpy as np
import pytest

from numbactr.embedding.engine import (
    CounterRegularization,
    CounterWeightDecay,
    Optim,
    OptimizerSpec,
    TableBatchedEmbedding,
    TableSpec,
    UpdateType,
    WeightDecay,
)
from numbactr.kernels import tbe

pytestmark = pytest.mark.usefixtures("cpu")  # conftest.py: the cpu device for every test

SPECS = [
    OptimizerSpec(Optim.HUGECTR_ADAM, learning_rate=0.05, update_type=UpdateType.GLOBAL, scaler=2.0),
    OptimizerSpec(Optim.ADAM, learning_rate=0.05, weight_decay=0.01),
    OptimizerSpec(
        Optim.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.05,
        weight_decay=0.01,
        weight_decay_mode=WeightDecay.COUNTER,
        counter=CounterRegularization(CounterWeightDecay.DECOUPLE, halflife=2, max_counter_update_freq=1),
    ),
]


def _engine(opt, impl="cpu", keyed=False):
    e = TableBatchedEmbedding([TableSpec(8, 5, keyed), TableSpec(6, 3, keyed)], [0, 1, 0], optimizer=opt, impl=impl)
    e.init_uniform(-0.5, 0.5, seed=3)
    return e


def _step(e, seed):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, 6, size=9).astype(np.int64)
    off = np.array([0, 1, 3, 3, 5, 6, 9], np.int64)  # F 3, B 2
    out, ctx = e.forward(idx, off)
    e.backward(ctx, rng.normal(size=out.shape).astype(np.float32))


@pytest.mark.parametrize("opt", SPECS, ids=[s.kind.name for s in SPECS])
def test_step_scalars_follow_every_change(opt):
    """_ks_ki / _global_ks (kept arrays, the step's entries filled in) equal the builders run afresh, before
    and after the learning rate and other hyper-parameters change between steps."""
    e = _engine(opt)
    for t, change in enumerate([{}, {"learning_rate": 0.5}, {"eps": 1e-3, "beta1": 0.8, "scaler": 4.0}], start=1):
        if change:
            e.set_hyper_parameters(**change)
        ks, ki = e._ks_ki(None, t, batch=2)
        o = e.optimizer
        want_ks = tbe.kernel_scalars(o.hp(), t, o.counter, float(e.max_counter[0]), e._max_counter_refresh(t))
        want_ki = tbe.kernel_ints(
            o.kind, o.update_type, o.weight_decay_mode, t, False, e.pooling, e.layout, 2, o.counter, False
        )
        np.testing.assert_array_equal(ks, want_ks)
        np.testing.assert_array_equal(ki, want_ki)
        np.testing.assert_array_equal(e._global_ks(t), tbe.kernel_scalars(o.hp(), t))
        _step(e, t)
    with pytest.raises(dataclasses.FrozenInstanceError):  # a spec changes by replacement only
        e.optimizer.learning_rate = 1.0


@pytest.mark.parametrize("opt", SPECS, ids=[s.kind.name for s in SPECS])
def test_rate_change_between_steps_trains_as_the_reference(opt):
    """The compiled engine, whose step constants are kept, trains as the NumPy reference through a learning
    rate changed every step (a schedule) and a hyper-parameter change (a stale rate would differ by 10x)."""
    a, b = _engine(opt, "cpu"), _engine(opt, "ref")
    for t in range(1, 5):
        for e in (a, b):
            e.learning_rate = 0.05 * 10 ** (t % 2)
            if t == 3:
                e.set_hyper_parameters(eps=1e-2)
            _step(e, t)
    np.testing.assert_allclose(a.weights, b.weights, rtol=2e-5, atol=2e-6)
    for x, y in zip(a.states, b.states):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6)


def test_adopted_state_buffers_are_the_ones_updated():
    e = _engine(OptimizerSpec(Optim.EXACT_ADAGRAD, learning_rate=0.1))
    _step(e, 1)  # _state_buffers now holds the first buffer
    old = e.states[0]
    mine = old.copy()
    e.adopt_host_buffers(states={0: mine})
    before_old, before_mine = old.copy(), mine.copy()
    _step(e, 2)
    np.testing.assert_array_equal(old, before_old)  # no longer the engine's: untouched
    assert not np.array_equal(mine, before_mine)  # the adopted one took the step
    assert e._state_buffers()[0] is mine


@pytest.mark.parametrize("first", [0, 2])
def test_one_keyed_table_rows_as_the_general_path(first):
    """Every feature on one keyed table: the lookup inserts all N keys at once (first bag at 0) or takes the
    general path (positions before the first bag: no row). An all-False skip forces the general path: both
    engines give the same rows, outputs and weights, bit for bit, while the table grows by new keys."""
    opt = OptimizerSpec(Optim.HUGECTR_ADAM, learning_rate=0.05, update_type=UpdateType.GLOBAL)
    engines = [TableBatchedEmbedding([TableSpec(40, 4, True)], [0, 0], optimizer=opt, seed=5) for _ in range(2)]
    rng = np.random.default_rng(first)
    sizes = []
    for s in range(4):
        n = 10
        idx = rng.integers(0, 8 * (s + 1), size=n).astype(np.uint64)  # new keys every step
        off = np.concatenate([[first], np.sort(rng.integers(first, n + 1, size=5)), [n]]).astype(np.int64)
        (out_a, ctx_a), (out_b, ctx_b) = (
            engines[0].forward(idx, off),
            engines[1].forward(idx, off, skip=np.zeros(n, bool)),
        )
        np.testing.assert_array_equal(ctx_a.rows, ctx_b.rows)
        np.testing.assert_array_equal(out_a, out_b)
        assert (ctx_a.rows[:first] == -1).all() and (ctx_a.rows[first:] >= 0).all()
        dy = np.ones(out_a.shape, np.float32)
        engines[0].backward(ctx_a, dy)
        engines[1].backward(ctx_b, dy)
        sizes.append(engines[0].hash_tables[0].size)
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]  # the table grew
    np.testing.assert_array_equal(engines[0].weights, engines[1].weights)
    for x, y in zip(engines[0].states, engines[1].states):
        np.testing.assert_array_equal(x, y)
