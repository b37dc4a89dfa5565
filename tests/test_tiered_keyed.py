"""Keyed tables through the cache (numbactr.embedding.tiered): keys become rows in order of first occurrence,
new rows start from the hash of their key, so a keyed tiered table trains exactly like the engine's keyed
table (host, memmap, and LMDB backing tiers; uint64 keys above 2**63; evaluation misses); a table of unknown
size on LMDB grows and reopens with its vocabulary; bounded tables fill with a clear error."""

import numpy as np
import pytest

from numbactr.runtime import device
from numbactr.embedding import tiered
from numbactr.embedding.engine import (
    BoundsCheck,
    OptimizerSpec,
    Optim,
    Pooling,
    TableBatchedEmbedding,
    TableSpec,
    UpdateType,
)
from numbactr.embedding.hash_table import HashTableFullError
from numbactr.embedding.tiered import CacheConfig, TieredEmbedding

pytest.importorskip("lmdb")

OPT = OptimizerSpec(Optim.HUGECTR_ADAM, learning_rate=0.05, update_type=UpdateType.LAZY_GLOBAL)
FMAP = [1, 0, 1]  # features 0 and 2 read the keyed table 1


@pytest.fixture(autouse=True)
def _host_impls_on_the_cpu_device(request):
    """On a GPU (NUMBACTR_DEVICE=gpu) the engines of impl 'cpu' run on the cpu device (the gpu device refuses
    host impls); the kernel test keeps the process's device (as tests/test_tiered.py does)."""
    if device.kind() == "gpu" and request.function.__name__ != "test_keyed_tables_in_the_simulator":
        device.set_device("cpu")


def keyed_steps(rng, n_steps=8, batch=3, n_keys=40, evaluate=(5,)):
    """(indices uint64, offsets, training) per step: table 0's rows, table 1's keys (some above 2**63)."""
    keys = rng.integers(0, 2**64 - 2, size=n_keys, dtype=np.uint64)
    steps = []
    for s in range(n_steps):
        lens = rng.integers(0, 4, size=len(FMAP) * batch)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        feat = np.repeat(np.arange(len(FMAP) * batch) // batch, lens)
        idx = np.where(
            np.asarray(FMAP)[feat] == 0,
            rng.integers(0, 50, feat.size).astype(np.uint64),
            keys[rng.integers(0, n_keys, feat.size)],
        )
        steps.append((idx.astype(np.uint64), offsets, s not in evaluate))
    return steps


def run(e, steps):
    rng = np.random.default_rng(7)
    outs = []
    for idx, offsets, training in steps:
        out, ctx = e.forward(idx, offsets, training=training)
        outs.append(device.to_host(out))
        if training:
            e.backward(ctx, rng.normal(size=out.shape).astype(np.float32))
    return outs


def assert_same(ref, tier, outs_ref, outs_tier):
    for a, b in zip(outs_ref, outs_tier):
        np.testing.assert_array_equal(a, b)
    n = ref.live_rows(1)
    assert tier.live_rows(1) == n
    np.testing.assert_array_equal(device.to_host(ref.hash_tables[1].keys_by_row()), device.to_host(tier.keys(1)))
    wa, wb = ref.split_weights(), tier.split_weights()
    np.testing.assert_array_equal(device.to_host(wa[0]), wb[0])
    np.testing.assert_array_equal(device.to_host(wa[1])[:n], wb[1][:n])
    for t, (sa, sb) in enumerate(zip(ref.split_optimizer_states(), tier.split_optimizer_states())):
        for x, y in zip(sa, sb):
            np.testing.assert_array_equal(device.to_host(x)[:n] if t else device.to_host(x), y[:n] if t else y)


def pair(impl, backing, tmp_path=None, keyed_rows=300, caps=(10, 12), pooling=Pooling.MEAN):
    ref = TableBatchedEmbedding([(50, 3), TableSpec(300, 4, True)], FMAP, optimizer=OPT, impl=impl, pooling=pooling)
    ref.init_uniform(-0.1, 0.1)
    tier = TieredEmbedding(
        [(50, 3), TableSpec(keyed_rows, 4, True)],
        FMAP,
        cache=CacheConfig(capacities=list(caps)),
        backing=backing,
        path=tmp_path,
        optimizer=OPT,
        impl=impl,
        pooling=pooling,
    )
    tier.init_uniform(-0.1, 0.1)
    return ref, tier


@pytest.mark.parametrize("backing", ["host", "memmap", "lmdb"])
def test_keyed_tables_through_the_cache_equal_the_engine(tmp_path, backing):
    steps = keyed_steps(np.random.default_rng(1))
    ref, tier = pair("cpu", backing, tmp_path / "tier", keyed_rows=0 if backing == "lmdb" else 300)
    assert_same(ref, tier, run(ref, steps), run(tier, steps))
    assert tier.stats.evictions > 0


def test_keyed_tables_in_the_simulator(tmp_path):
    if not device.uses_kernels():
        pytest.skip("needs the sim or gpu device")
    steps = keyed_steps(np.random.default_rng(2), n_steps=5, n_keys=25)
    ref, tier = pair("kernels", "lmdb", tmp_path / "tier", keyed_rows=0)
    assert_same(ref, tier, run(ref, steps), run(tier, steps))


def test_a_growing_table_doubles_and_keeps_every_row(tmp_path, monkeypatch):
    monkeypatch.setattr(tiered, "_FIRST_KEYS", 4)
    steps = keyed_steps(np.random.default_rng(3), n_steps=10, n_keys=60, evaluate=())
    ref, tier = pair("cpu", "lmdb", tmp_path / "tier", keyed_rows=0, caps=(10, 16))
    assert tier.key_index[1].max_rows == 4
    assert_same(ref, tier, run(ref, steps), run(tier, steps))
    assert tier.key_index[1].max_rows >= 32 and tier.cache.row_offsets[-1] == 50 + tier.key_index[1].max_rows


def test_an_lmdb_table_reopens_with_its_vocabulary(tmp_path):
    steps = keyed_steps(np.random.default_rng(4), n_steps=8, evaluate=())
    ref, tier = pair("cpu", "lmdb", tmp_path / "db", keyed_rows=0)
    run(ref, steps[:5])
    run(tier, steps[:5])
    tier.flush()
    tier.close()
    again = TieredEmbedding(
        [(50, 3), TableSpec(0, 4, True)],
        FMAP,
        cache=CacheConfig(capacities=[10, 12]),
        backing="lmdb",
        path=tmp_path / "db",
        optimizer=OPT,
        impl="cpu",
        pooling=Pooling.MEAN,
    )
    again.step = tier.step  # the optimizer's step is the caller's to keep
    np.testing.assert_array_equal(again.keys(1), device.to_host(ref.hash_tables[1].keys_by_row()))
    assert_same(ref, again, run(ref, steps[5:]), run(again, steps[5:]))
    again.close()


def test_keyed_refusals(tmp_path):
    glob = OptimizerSpec(Optim.HUGECTR_ADAM, update_type=UpdateType.GLOBAL)
    with pytest.raises(NotImplementedError, match="GLOBAL"):
        TieredEmbedding(
            [TableSpec(0, 4, True)],
            cache=CacheConfig(capacities=[4]),
            backing="lmdb",
            path=tmp_path / "g",
            optimizer=glob,
            impl="cpu",
        )
    with pytest.raises(ValueError, match="rows=0"):
        TieredEmbedding([TableSpec(0, 4, True)], cache=CacheConfig(capacities=[4]), backing="host", impl="cpu")
    with pytest.raises(ValueError, match="capacities"):
        TieredEmbedding([TableSpec(0, 4, True)], backing="lmdb", path=tmp_path / "c", impl="cpu")
    two = TieredEmbedding(
        [TableSpec(5, 2, True), (4, 2)],
        cache=CacheConfig(capacities=[3, 2]),
        impl="cpu",
        bounds_check=BoundsCheck.FATAL,
    )
    with pytest.raises(Exception, match="index 9"):  # table 1 has 4 rows
        two.forward(np.array([70, 71, 9]), np.array([0, 2, 3]))
    assert two.live_rows(0) == 0  # refused before any key was inserted
    tier = TieredEmbedding([TableSpec(3, 2, True)], cache=CacheConfig(capacities=[3]), impl="cpu")
    tier.forward(np.array([5, 6, 7]), np.array([0, 3]))
    tier.forward(np.array([7, 5, 6, 7, 5]), np.array([0, 5]))  # full, but only known keys: fine
    with pytest.raises(HashTableFullError, match="at most rows=3"):
        tier.forward(np.array([8]), np.array([0, 1]))
