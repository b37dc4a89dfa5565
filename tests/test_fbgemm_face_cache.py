"""FBGEMM's MANAGED_CACHING on numbactr (numbactr/fbgemm_gpu/array_tbe.py over embedding/tiered.py): cached
training equals DEVICE training bit for bit for every FBGEMM optimizer, with and without prefetch(), LRU and
LFU, mixed locations; FBGEMM's cache sizing (cache_load_factor, cache_sets, cache_reserved_memory); its
counters (record_cache_metrics, gather_uvm_cache_stats); its refusals; and the torch module (autograd,
prefetch with tensors, state_dict / load_state_dict through the cache)."""

import numpy as np
import pytest

from numbactr.fbgemm_gpu import tbe_cache
from numbactr.fbgemm_gpu.array_tbe import SUPPORTED_OPTIMIZERS, ArrayTBE
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    CacheAlgorithm,
    ComputeDevice,
    EmbeddingLocation,
    OptimType,
    RecordCacheMetrics,
    SparseType,
)

CACHED, DEV = (EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA), (EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
SPECS = [(300, 8), (200, 4)]


pytestmark = pytest.mark.usefixtures("cpu")  # conftest.py: the cpu device for every test


def batches(rng, n=5, batch=6, rows=(300, 200)):
    out = []
    for _ in range(n):
        lens = rng.integers(0, 4, size=len(rows) * batch)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        feat = np.repeat(np.arange(len(rows) * batch) // batch, lens)
        out.append((np.array([rng.integers(0, rows[f]) for f in feat], np.int64), offsets))
    return out


def faces(locations, **kw):
    cached = ArrayTBE([(r, d, *loc) for (r, d), loc in zip(SPECS, locations)], **kw)
    plain = ArrayTBE(
        [(r, d, *DEV) for r, d in SPECS],
        **{
            k: v
            for k, v in kw.items()
            if not k.startswith("cache")
            and k not in ("record_cache_metrics", "prefetch_pipeline", "gather_uvm_cache_stats")
        },
    )
    for f in (cached, plain):
        f.init_embedding_weights_uniform(-0.5, 0.5)
    return cached, plain


def train_both(cached, plain, steps, prefetch):
    rng = np.random.default_rng(1)
    for k, (idx, off) in enumerate(steps):
        a, b = cached(idx, off), plain(idx, off)
        if prefetch and k + 1 < len(steps):
            cached.prefetch(*steps[k + 1])
        np.testing.assert_array_equal(a, b)
        dy = rng.normal(size=a.shape).astype(np.float32)
        cached.backward(dy)
        plain.backward(dy)
    for x, y in zip(cached.split_embedding_weights(), plain.split_embedding_weights()):
        np.testing.assert_array_equal(x, y)
    if cached.optimizer != OptimType.EXACT_SGD:
        for xs, ys in zip(cached.split_optimizer_states(), plain.split_optimizer_states()):
            for x, y in zip(xs, ys):
                np.testing.assert_array_equal(x, y)


OPTIMIZERS = [o for o in SUPPORTED_OPTIMIZERS if o != OptimType.NONE]


@pytest.mark.parametrize("k", range(len(OPTIMIZERS)), ids=[o.name for o in OPTIMIZERS])
def test_managed_caching_trains_like_device_for_every_optimizer(k):
    rng = np.random.default_rng(k)
    algo = CacheAlgorithm.LFU if k % 2 else CacheAlgorithm.LRU
    cached, plain = faces(
        [CACHED, CACHED],
        optimizer=OPTIMIZERS[k],
        learning_rate=0.05,
        weight_decay=0.01,
        cache_algorithm=algo,
        cache_load_factor=0.1,
    )
    assert cached.engine.capacities == [38, 25]  # two sets of 32 rows, split 3:2
    train_both(cached, plain, batches(rng, n=10, batch=4), prefetch=k % 3 == 0)
    assert cached.engine.stats.evictions > 0


@pytest.mark.parametrize("pipeline", [False, True])
def test_prefetch_and_mixed_locations(pipeline):
    rng = np.random.default_rng(3)
    cached, plain = faces([CACHED, DEV], optimizer=OptimType.ADAM, cache_load_factor=0.2, prefetch_pipeline=pipeline)
    assert cached.engine.capacities == [64, 200]  # ceil(300 * 0.2 / 32) sets of 32; DEVICE whole
    train_both(cached, plain, batches(rng, n=6), prefetch=True)


def test_cache_sizes_follow_fbgemm(monkeypatch):
    tbe = ArrayTBE([(1000, 4, *CACHED), (3000, 4, *CACHED)], cache_load_factor=0.1)
    assert tbe.engine.capacities == [104, 312]  # 400 rows = 12.5 -> 13 sets of 32 = 416, split
    tbe = ArrayTBE([(1000, 4, *CACHED)], cache_sets=2)
    assert tbe.engine.capacities == [64]
    monkeypatch.setattr(tbe_cache, "_fast_tier_free_bytes", lambda: 10_000)
    tbe = ArrayTBE([(1000, 4, *CACHED)], cache_load_factor=0.5, cache_reserved_memory=4000.0)
    # 6000 free bytes / (16 bytes of weights + 29 of bookkeeping) = 133 slots -> 4 sets of 32
    assert tbe.engine.capacities == [128]
    with pytest.raises(ValueError, match="cache_reserved_memory"):
        ArrayTBE([(1000, 4, *CACHED)], cache_reserved_memory=1e6)


def test_cache_counters_are_fbgemms():
    tbe = ArrayTBE(
        [(100, 4, *CACHED)],
        cache_load_factor=0.32,
        record_cache_metrics=RecordCacheMetrics(True, True),
        gather_uvm_cache_stats=True,
    )
    assert tbe.engine.capacities == [32]
    tbe(np.array([1, 2, 2, 3]), np.array([0, 4]))  # 3 unique misses
    tbe.prefetch(np.array([1, 5]), np.array([0, 2]))  # 1 unique miss, counted at the prefetch
    tbe(np.array([1, 5]), np.array([0, 2]))  # consumes the prefetch: not counted again
    tbe(np.array([2, 3]), np.array([0, 2]))  # all hits
    np.testing.assert_array_equal(tbe.get_cache_miss_counter(), [2, 4, 7, 8])
    np.testing.assert_array_equal(tbe.get_table_wise_cache_miss(), [4])
    np.testing.assert_array_equal(tbe.get_uvm_cache_stats(), [3, 8, 7, 4, 0, 0])
    tbe.reset_cache_miss_counter()
    tbe.reset_uvm_cache_stats()
    np.testing.assert_array_equal(tbe.get_cache_miss_counter(), [0, 0, 0, 0])
    np.testing.assert_array_equal(tbe.get_uvm_cache_stats(), [0] * 6)
    plain = ArrayTBE([(100, 4, *CACHED)])
    with pytest.raises(AssertionError, match="record_cache_miss_counter"):
        plain.get_cache_miss_counter()
    with pytest.raises(AssertionError, match="gather_uvm_cache_stats"):
        plain.get_uvm_cache_stats()


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(prefetch_pipeline=True, cache_algorithm=CacheAlgorithm.LFU), ValueError, "Only LRU"),
        (dict(optimizer=OptimType.NONE), ValueError, "OptimType.NONE"),
        (dict(cache_load_factor=0.0), ValueError, "cache_load_factor"),
        (dict(cache_precision=SparseType.FP16), NotImplementedError, "cache_precision"),
    ],
)
def test_cache_refusals(kwargs, error, match):
    with pytest.raises(error, match=match):
        ArrayTBE([(100, 4, *CACHED)], **kwargs)


@pytest.mark.parametrize("sr", [True, False])
def test_fp16_weights_cache_exactly(sr):
    rng = np.random.default_rng(8)
    cached, plain = faces(
        [CACHED, CACHED],
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        weights_precision=SparseType.FP16,
        stochastic_rounding=sr,
        cache_load_factor=0.1,
    )
    train_both(cached, plain, batches(rng, n=8, batch=4), prefetch=True)
    assert cached.engine.stats.evictions > 0


def test_torch_module_through_the_cache():
    torch = pytest.importorskip("torch")
    from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen as TBE,
    )

    rng = np.random.default_rng(5)
    mods = []
    for loc in (CACHED, DEV):
        torch.manual_seed(0)
        m = TBE(
            [(r, d, *loc) for r, d in SPECS],
            optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=0.1,
            cache_load_factor=0.2,
        )
        m.init_embedding_weights_uniform(-0.5, 0.5)
        mods.append(m)
    steps = batches(rng, n=4)
    for k, (idx, off) in enumerate(steps):
        outs = []
        for m in mods:
            out = m(torch.from_numpy(idx), torch.from_numpy(off))
            if m is mods[0] and k + 1 < len(steps):
                m.prefetch(torch.from_numpy(steps[k + 1][0]), torch.from_numpy(steps[k + 1][1]))
            (out * out).sum().backward()
            outs.append(out.detach())
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    sd = mods[0].state_dict()
    assert {"weights_uvm", "momentum1_uvm"} <= set(sd) and "lxu_cache_weights" not in sd
    for a, b in zip(mods[0].split_embedding_weights(), mods[1].split_embedding_weights()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fresh = TBE([(r, d, *CACHED) for r, d in SPECS], optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, cache_load_factor=0.2)
    fresh(torch.from_numpy(steps[0][0]), torch.from_numpy(steps[0][1]))  # fills its cache with zero rows
    fresh.load_state_dict(sd)
    idx, off = (torch.from_numpy(a) for a in steps[-1])
    torch.testing.assert_close(fresh(idx, off), mods[1](idx, off), rtol=0, atol=0)


def test_reset_cache_states_empties_the_cache_and_loses_no_update():
    """FBGEMM's reset_cache_states (TorchRec's purge): the cache is emptied between steps; numbactr writes its
    updated rows back first, so training equals the uncached tables'."""
    rng = np.random.default_rng(5)
    cached, plain = faces(
        [CACHED, CACHED], optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05, cache_load_factor=0.2
    )
    steps = batches(rng, n=6, batch=4)
    for k, (idx, off) in enumerate(steps):
        a, b = cached(idx, off), plain(idx, off)
        np.testing.assert_array_equal(a, b)
        dy = rng.normal(size=a.shape).astype(np.float32)
        cached.backward(dy)
        plain.backward(dy)
        cached.reset_cache_states()
        assert cached.engine.cache.held()[0].size == 0  # no slot holds a row
    for x, y in zip(cached.split_embedding_weights(), plain.split_embedding_weights()):
        np.testing.assert_array_equal(x, y)


def test_counter_regularization_reading_max_counter_through_the_cache():
    """COUNTER with a tail-id learning-rate mode and a ratio threshold reads max_counter, renewed every 2
    iterations over every row: cached training equals DEVICE training bit for bit."""
    from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        CounterBasedRegularizationDefinition,
        CounterWeightDecayMode,
        LearningRateMode,
        TailIdThreshold,
        WeightDecayMode,
    )

    counter = CounterBasedRegularizationDefinition(
        counter_weight_decay_mode=CounterWeightDecayMode.DECOUPLE,
        counter_halflife=2,
        adjustment_iter=1,
        adjustment_ub=0.5,
        learning_rate_mode=LearningRateMode.TAIL_ID_LR_DECREASE,
        tail_id_threshold=TailIdThreshold(val=0.3, is_ratio=True),
        max_counter_update_freq=2,
    )
    cached, plain = faces(
        [CACHED, CACHED],
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.05,
        weight_decay=0.01,
        weight_decay_mode=WeightDecayMode.COUNTER,
        counter_based_regularization=counter,
        cache_load_factor=0.1,
    )
    train_both(cached, plain, batches(np.random.default_rng(5), n=10, batch=4), prefetch=True)
    assert cached.engine.stats.evictions > 0
    assert float(cached.max_counter[0]) == float(plain.max_counter[0]) > 1
