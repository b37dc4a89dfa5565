"""Tiered tables (numbactr.embedding.tiered): training through the cache gives exactly (bit for bit) the
outputs, gradients, weights and optimizer states of training the same engine with every row in the fast
tier, for every optimizer and update type, LRU and LFU, host and memmap backing tiers, with prefetch (also
on a thread); a table 4x larger than the cache's byte budget trains; over-capacity batches, a second
backward and FP16 stochastic rounding are clear errors."""

import gc

import numpy as np
import pytest

from numbactr.runtime import device
from numbactr.embedding.cache import CacheCapacityError
from numbactr.embedding.engine import (
    BoundsCheck,
    CounterRegularization,
    CounterWeightDecay,
    OptimizerSpec,
    Optim,
    Pooling,
    Precision,
    TableBatchedEmbedding,
    UpdateType,
    WeightDecay,
)
from numbactr.embedding.tiered import CacheConfig, TieredEmbedding, cache_rows
from tests.engine_cases import OPTIMIZER_CASES, Case

TABLES, FMAP = [(40, 5), (30, 3)], [0, 1, 0]
KERNEL_TESTS = {
    "test_kernels_in_the_simulator_through_the_cache_equal_the_whole_table",
    "test_fp16_stochastic_rounding_of_the_kernels_through_the_cache",
}


@pytest.fixture(autouse=True)
def _host_impls_on_the_cpu_device(request):
    """Engines with impl 'cpu' or 'ref' hold host arrays, which the gpu device refuses (ValueError): on a GPU
    the tests of those impls run on the cpu device (on sim they run as they are); the kernel tests keep the
    process's device."""
    if device.kind() == "gpu" and request.function.__name__ not in KERNEL_TESTS:
        device.set_device("cpu")


#: COUNTER settings a tiered table runs (max_counter is not read): COUNTER_SGD above an absolute threshold,
#: L2 decay with a halflife
TIERED_COUNTER = CounterRegularization(
    CounterWeightDecay.L2,
    halflife=3,
    adjustment_iter=1,
    adjustment_ub=0.5,
    learning_rate_mode=2,
    tail_id_threshold=1.0,
    max_counter_update_freq=1,
)


def window_steps(rng, tables, fmap, n_steps=5, batch=3, window=8, max_len=3, psw=True):
    """Lookups whose rows of each table come from a moving window of `window` rows (so a batch fits a
    cache of `window` slots per table) with repeats, empty bags and -1 rows."""
    steps = []
    for s in range(n_steps):
        lens = rng.integers(0, max_len + 1, size=len(fmap) * batch)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        feat = np.repeat(np.arange(len(fmap) * batch) // batch, lens)
        start = {t: int(rng.integers(0, rows - window + 1)) for t, (rows, _) in enumerate(tables)}
        tab = np.asarray(fmap)[feat]
        idx = np.array([start[t] for t in tab], np.int64) + rng.integers(0, window, size=feat.size)
        idx[rng.random(feat.size) < 0.1] = -1
        w = rng.normal(size=feat.size).astype(np.float32) if psw else None
        steps.append((idx, offsets, w, s))
    return steps


def train(e, steps, prefetch=False):
    """Forward + backward of every step (prefetching the next step's rows before the backward when asked):
    outputs, per-sample-weight gradients and sparse gradients per step."""
    outs, grads = [], []
    for k, (idx, offsets, psw, seed) in enumerate(steps):
        out, ctx = e.forward(idx, offsets, psw)
        if prefetch and k + 1 < len(steps):
            e.prefetch(steps[k + 1][0], steps[k + 1][1])
        outs.append(device.to_host(out))
        dy = np.random.default_rng(seed).normal(size=out.shape).astype(np.float32)
        grads.append(e.backward(ctx, dy))
    return outs, grads


def assert_identical(ref, tier, a, b):
    for oa, ob in zip(a[0], b[0]):
        np.testing.assert_array_equal(oa, ob)
    for ga, gb in zip(a[1], b[1]):
        if ga.per_sample_weights is not None:
            np.testing.assert_array_equal(device.to_host(ga.per_sample_weights), device.to_host(gb.per_sample_weights))
        if ga.sparse is not None:
            for (ra, va), (rb, vb) in zip(ga.sparse.per_table(), gb.sparse.per_table()):
                np.testing.assert_array_equal(ra, rb)
                np.testing.assert_array_equal(va, vb)
    for wa, wb in zip(ref.split_weights(), tier.split_weights()):
        np.testing.assert_array_equal(device.to_host(wa), np.asarray(wb))
    for sa, sb in zip(ref.split_optimizer_states(), tier.split_optimizer_states()):
        for x, y in zip(sa, sb):
            np.testing.assert_array_equal(device.to_host(x), np.asarray(y))


def pair(case: Case, impl: str, cache: CacheConfig, backing="host", tmp_path=None, sr=True, **extra):
    ref = case.engine(impl)
    ref.stochastic_rounding = sr
    tier = TieredEmbedding(
        case.tables,
        case.fmap,
        cache=cache,
        backing=backing,
        path=tmp_path,
        pooling=case.pooling,
        layout=case.layout,
        optimizer=ref.optimizer,
        weights_precision=case.weights,
        output_dtype=case.output,
        bounds_check=case.bounds,
        stochastic_rounding=sr,
        seed=11,
        impl=impl,
        **extra,
    )
    tier.init_uniform(-0.5, 0.5, seed=4)
    return ref, tier


@pytest.mark.parametrize(
    "kind,update,wd_mode", OPTIMIZER_CASES, ids=[f"{k.name}-{u.name}-{m.name}" for k, u, m in OPTIMIZER_CASES]
)
def test_every_optimizer_through_the_cache_equals_the_whole_table(kind, update, wd_mode):
    rng = np.random.default_rng(int(kind) * 7 + int(update) * 3 + int(wd_mode))
    case = Case(
        TABLES,
        FMAP,
        kind=kind,
        update=update,
        wd_mode=wd_mode,
        pooling=Pooling.MEAN,
        max_norm=0.9,
        clip=True,
        steps=window_steps(rng, TABLES, FMAP),
        counter=TIERED_COUNTER if wd_mode == WeightDecay.COUNTER else None,
    )
    policy = "lfu" if int(kind) % 2 else "lru"
    ref, tier = pair(case, "cpu", CacheConfig(policy, load_factor=0.05, min_slots=9))
    a, b = train(ref, case.steps), train(tier, case.steps)
    assert tier.stats.evictions > 0  # the cache really was too small for the steps
    assert_identical(ref, tier, a, b)


@pytest.mark.parametrize("impl", ["cpu", "ref"])
def test_counter_settings_that_read_max_counter_renew_it_over_every_row(impl):
    # max_counter is 1 + the largest row counter of every row, cached or not: the tier flushes the cache at a
    # renewing step and reads the backing tier's counters (COUNTER_DEFAULTS: a ratio tail-id threshold that
    # reads it, renewed every step)
    rng = np.random.default_rng(21)
    case = Case(
        TABLES,
        FMAP,
        kind=Optim.EXACT_ROWWISE_ADAGRAD,
        wd_mode=WeightDecay.COUNTER,
        pooling=Pooling.SUM,
        steps=window_steps(rng, TABLES, FMAP, n_steps=6),
    )
    assert case.counter is None and case.engine(impl).optimizer.counter.uses_max_counter()
    ref, tier = pair(case, impl, CacheConfig("lru", load_factor=0.05, min_slots=9))
    a, b = train(ref, case.steps), train(tier, case.steps)
    assert tier.stats.evictions > 0
    assert float(ref.max_counter[0]) > 1 and float(tier.engine.max_counter[0]) == float(ref.max_counter[0])
    assert_identical(ref, tier, a, b)


def test_rowwise_bias_correction_is_cached():
    rng = np.random.default_rng(12)
    case = Case(TABLES, FMAP, kind=Optim.ADAM, rowwise_bias_correction=True, steps=window_steps(rng, TABLES, FMAP))
    ref, tier = pair(case, "cpu", CacheConfig("lfu", load_factor=0.05, min_slots=9))
    assert [n for n, _, _ in tier._specs] == ["momentum1", "momentum2", "row_counter"]
    assert_identical(ref, tier, train(ref, case.steps), train(tier, case.steps))


@pytest.mark.parametrize(
    "kind,update",
    [
        (Optim.HUGECTR_ADAM, UpdateType.GLOBAL),
        (Optim.HUGECTR_NESTEROV, UpdateType.GLOBAL),
        (Optim.HUGECTR_ADAM, UpdateType.LAZY_GLOBAL),
        (Optim.LAMB, UpdateType.LOCAL),
    ],
)
def test_reference_impl_through_the_cache_equals_the_whole_table(kind, update):
    rng = np.random.default_rng(5)
    case = Case(
        TABLES, FMAP, kind=kind, update=update, pooling=Pooling.SUM, steps=window_steps(rng, TABLES, FMAP, n_steps=4)
    )
    ref, tier = pair(case, "ref", CacheConfig("lru", load_factor=0.05, min_slots=9))
    assert_identical(ref, tier, train(ref, case.steps), train(tier, case.steps))


@pytest.mark.parametrize(
    "kind,update", [(Optim.EXACT_ROWWISE_ADAGRAD, UpdateType.LOCAL), (Optim.HUGECTR_ADAM, UpdateType.GLOBAL)]
)
def test_kernels_in_the_simulator_through_the_cache_equal_the_whole_table(kind, update):
    if not device.uses_kernels():
        pytest.skip("needs the sim or gpu device")
    rng = np.random.default_rng(9)
    tables, fmap = [(24, 3), (20, 2)], [0, 1]
    case = Case(
        tables,
        fmap,
        kind=kind,
        update=update,
        pooling=Pooling.SUM,
        steps=window_steps(rng, tables, fmap, n_steps=6, batch=3, window=4),
    )
    ref, tier = pair(case, "kernels", CacheConfig("lfu", load_factor=0.1, min_slots=8))  # 2 windows: prefetch
    assert_identical(ref, tier, train(ref, case.steps), train(tier, case.steps, prefetch=True))
    assert tier.stats.evictions > 0


def test_fp16_stochastic_rounding_of_the_kernels_through_the_cache():
    if not device.uses_kernels():
        pytest.skip("needs the sim or gpu device")
    rng = np.random.default_rng(4)
    tables, fmap = [(24, 3)], [0]
    case = Case(
        tables,
        fmap,
        kind=Optim.HUGECTR_MOMENTUM_SGD,
        update=UpdateType.GLOBAL,
        weights=Precision.FP16,
        steps=window_steps(rng, tables, fmap, n_steps=4, batch=3, window=4),
    )
    ref, tier = pair(case, "kernels", CacheConfig(capacities=[8]))  # 2 windows: prefetch
    assert_identical(ref, tier, train(ref, case.steps), train(tier, case.steps, prefetch=True))
    assert tier.stats.evictions > 0


@pytest.mark.parametrize("thread", [False, True])
def test_prefetch_pipeline_on_memmap_equals_the_whole_table(tmp_path, thread):
    rng = np.random.default_rng(2)
    case = Case(TABLES, FMAP, kind=Optim.ADAM, pooling=Pooling.SUM, steps=window_steps(rng, TABLES, FMAP, n_steps=6))
    # the forward's rows and the prefetched ones are both held: two windows' worth of slots
    ref, tier = pair(
        case,
        "cpu",
        CacheConfig("lru", load_factor=0.05, min_slots=18, prefetch_thread=thread),
        backing="memmap",
        tmp_path=tmp_path / "tier",
    )
    b = train(tier, case.steps, prefetch=True)
    assert_identical(ref, tier, train(ref, case.steps), b)
    assert list((tmp_path / "tier").iterdir())  # the rows live in files
    tier.close()


def test_table_four_times_the_byte_budget_trains_exactly(tmp_path):
    tables, fmap = [(400, 8)], [0, 0]
    rng = np.random.default_rng(4)
    case = Case(
        tables,
        fmap,
        kind=Optim.EXACT_ROWWISE_ADAGRAD,
        pooling=Pooling.SUM,
        steps=window_steps(rng, tables, fmap, n_steps=8, batch=4, window=20),
    )
    table_bytes = 400 * (8 * 4 + 4)  # weights and the rowwise state
    budget = table_bytes // 4
    ref, tier = pair(case, "cpu", CacheConfig("lfu", budget_bytes=budget), backing="memmap", tmp_path=tmp_path)
    slots = tier.capacities[0]
    assert 20 <= slots <= 100 and slots * (8 * 4 + 4) <= budget
    assert_identical(ref, tier, train(ref, case.steps), train(tier, case.steps))
    st = tier.stats
    assert st.lookups == st.hits + st.misses and st.unique_misses > slots


FP16_CASES = [
    (Optim.EXACT_ADAGRAD, UpdateType.LOCAL, True, "cpu"),
    (Optim.EXACT_ADAGRAD, UpdateType.LOCAL, False, "cpu"),
    (Optim.LAMB, UpdateType.LOCAL, True, "ref"),
    (Optim.HUGECTR_ADAM, UpdateType.GLOBAL, True, "cpu"),
    (Optim.HUGECTR_NESTEROV, UpdateType.GLOBAL, True, "ref"),
]


@pytest.mark.parametrize(
    "kind,update,sr,impl", FP16_CASES, ids=[f"{k.name}-{u.name}-sr{int(s)}-{i}" for k, u, s, i in FP16_CASES]
)
def test_fp16_weights_round_through_the_cache_as_on_the_whole_table(kind, update, sr, impl):
    # stochastic rounding hashes each row's number: the slot engine hashes the row its slot holds
    rng = np.random.default_rng(1)
    case = Case(
        TABLES,
        FMAP,
        kind=kind,
        update=update,
        weights=Precision.FP16,
        output=Precision.FP16,
        steps=window_steps(rng, TABLES, FMAP, n_steps=4),
    )
    ref, tier = pair(case, impl, CacheConfig(load_factor=0.05, min_slots=9), sr=sr)
    assert_identical(ref, tier, train(ref, case.steps), train(tier, case.steps))
    assert tier.stats.evictions > 0


def test_optimizer_none_returns_row_gradients_of_the_tables():
    rng = np.random.default_rng(6)
    tables, fmap = [(40, 4), (30, 4)], [0, 1, 0]
    case = Case(tables, fmap, kind=Optim.NONE, steps=window_steps(rng, tables, fmap, n_steps=3))
    ref, tier = pair(case, "cpu", CacheConfig(load_factor=0.05, min_slots=9))
    assert_identical(ref, tier, train(ref, case.steps), train(tier, case.steps))


def test_over_capacity_batch_is_an_error_and_changes_nothing():
    tier = TieredEmbedding([(50, 4)], cache=CacheConfig(load_factor=0.1), impl="cpu")  # 5 slots
    ok = np.arange(5, dtype=np.int64)
    out, ctx = tier.forward(ok, np.array([0, 5]))
    tier.backward(ctx, np.ones((1, 4), np.float32))
    before = tier.split_weights()[0].copy()
    with pytest.raises(CacheCapacityError, match="needs 6 rows loaded but only 5"):
        tier.forward(np.arange(10, 16), np.array([0, 6]))
    # six distinct rows of which five are cached still cannot fit: the pinned / used slots count
    out, ctx = tier.forward(ok, np.array([0, 5]))
    with pytest.raises(CacheCapacityError):
        tier.forward(np.array([7]), np.array([0, 1]))  # all five slots are pinned by the pending lookup
    tier.backward(ctx, np.zeros((1, 4), np.float32))
    np.testing.assert_array_equal(tier.split_weights()[0], before)


def test_backward_needs_a_pending_training_lookup():
    tier = TieredEmbedding([(20, 2)], cache=CacheConfig(load_factor=0.5), impl="cpu")
    out, ctx = tier.forward(np.array([1, 2]), np.array([0, 2]))
    with pytest.raises(ValueError, match="grad_output"):
        tier.backward(ctx, np.ones((1, 3), np.float32))  # refused: the lookup keeps its slots
    tier.backward(ctx, np.ones((1, 2), np.float32))
    with pytest.raises(RuntimeError, match="already ran"):
        tier.backward(ctx, np.ones((1, 2), np.float32))
    out, ctx = tier.forward(np.array([1, 2]), np.array([0, 2]), training=False)
    with pytest.raises(RuntimeError, match="evaluation"):
        tier.backward(ctx, np.ones((1, 2), np.float32))


def test_a_dropped_lookup_releases_its_slots():
    tier = TieredEmbedding([(20, 2)], cache=CacheConfig(load_factor=0.25), impl="cpu")  # 5 slots
    for start in (0, 5, 10):  # each lookup uses all five slots; none ever runs its backward
        out, ctx = tier.forward(np.arange(start, start + 5), np.array([0, 5]))
        del ctx
        gc.collect()
    assert int(tier.cache.pins.sum()) == 0


def test_cache_sizes_from_load_factor_and_budget():
    assert cache_rows([(1000, 4), (10, 4)], CacheConfig(load_factor=0.2)) == [200, 2]
    assert cache_rows([(1000, 4)], CacheConfig(load_factor=0.0001, min_slots=3)) == [3]
    per_slot = 16 + 29  # 4 float32 weights + bookkeeping
    assert cache_rows([(1000, 4)], CacheConfig(budget_bytes=100 * per_slot)) == [100]
    with pytest.raises(ValueError, match="load_factor"):
        cache_rows([(10, 4)], CacheConfig(load_factor=1.5))


def test_bounds_check_sees_the_whole_table():
    tier = TieredEmbedding([(20, 2)], cache=CacheConfig(load_factor=0.25), bounds_check=BoundsCheck.FATAL, impl="cpu")
    tier.forward(np.array([19]), np.array([0, 1]))  # beyond the 5 slots, inside the table
    with pytest.raises(Exception, match="20"):
        tier.forward(np.array([20]), np.array([0, 1]))


def test_eval_lookups_do_not_dirty_rows():
    tier = TieredEmbedding(
        [(20, 2)],
        cache=CacheConfig(load_factor=0.25),
        optimizer=OptimizerSpec(Optim.EXACT_SGD, learning_rate=0.1),
        impl="cpu",
    )
    tier.init_uniform(-1, 1)
    for start in (0, 5, 10, 15, 0):
        tier.forward(np.arange(start, start + 5), np.array([0, 5]), training=False)
    assert tier.stats.evictions == 20 and tier.stats.writebacks == 0  # the last batch was evicted too
    assert tier.stats.unique_misses == 25 and tier.stats.hits == 0


def test_unknown_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="rows=0"):
        TieredEmbedding([(0, 2)], impl="cpu")
    with pytest.raises(ValueError, match="backing"):
        TieredEmbedding([(10, 2)], backing="tape", impl="cpu")
    with pytest.raises(ValueError, match="policy"):
        TieredEmbedding([(10, 2)], cache=CacheConfig("fifo"), impl="cpu")
    ref = TableBatchedEmbedding([(10, 2)], impl="cpu")
    assert ref.initial_state_value("prev_step") == 1


def test_an_evicted_dirty_row_is_in_the_backing_tier_with_its_state():
    opt = OptimizerSpec(Optim.EXACT_ADAGRAD, learning_rate=0.3)
    tier = TieredEmbedding([(10, 3)], cache=CacheConfig(capacities=[2]), optimizer=opt, impl="cpu")
    twin = TableBatchedEmbedding([(10, 3)], optimizer=opt, impl="cpu")
    for e in (tier, twin):
        e.init_uniform(-1, 1)
        out, ctx = e.forward(np.array([4, 4, 6]), np.array([0, 3]))
        e.backward(ctx, np.full((1, 3), 0.5, np.float32))
    weights, accum = tier.store.views(0)[:2]
    assert not np.array_equal(weights[4], twin.split_weights()[0][4])  # updated in the cache only
    tier.forward(np.array([1, 2]), np.array([0, 2]), training=False)  # evicts rows 4 and 6
    np.testing.assert_array_equal(weights[[4, 6]], twin.split_weights()[0][[4, 6]])
    np.testing.assert_array_equal(accum[[4, 6]], twin.split_optimizer_states()[0][0][[4, 6]])
    assert tier.stats.writebacks == 2 and tier.stats.evictions == 2
