"""EmbeddingCollection dynamic tables with numbactr's max_capacity (numbactr/embedding/collection_evicting.py):
below the capacity they train bit for bit as HugeCTR's growing table; a stream of ten times the capacity
trains without error and keeps at most max_capacity keys; their rows dump and load; bad options are clear
errors."""

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.distributed.comm import world
from numbactr.embedding import collection as C
from numbactr.embedding.collection_config import CollectionError

O, U = hugectr.Optimizer_t, hugectr.Update_t
ADAM = dict(optimizer_type=O.Adam, update_type=U.Local)


@pytest.fixture(autouse=True)
def cpu_device():
    device.set_device("cpu")


def build(**table_kw):
    t = hugectr.EmbeddingTableConfig("dyn", -1, 4, **table_kw)
    cfg = hugectr.EmbeddingCollectionConfig()
    cfg.embedding_lookup(t, "x", "s", "sum")
    cfg.embedding_lookup(t, "x", "m", "mean")
    params = {"s": hugectr.DataReaderSparseParam("x", 3, False, 1)}
    params = {p.top_name: p for p in params.values()}
    return C.EmbeddingCollection(cfg, 0, params, hugectr.CreateOptimizer(**ADAM), 3, world())


def step(coll, keys, offsets, rng):
    outs = [np.array(device.to_host(o)) for o in coll.lookup({"x": (keys, offsets)}, training=True)]
    B = offsets.shape[0] - 1
    coll.hold_gradients([device.xp().asarray(rng.normal(size=(B, 1, 4)).astype(np.float32)) for _ in range(2)])
    coll.update(0.05, 1.0)
    return outs


def batch(rng, first: int, n: int):
    """n fresh keys from first, in bags of 1..3 (plus a few repeats of recent keys)."""
    keys = np.arange(first, first + n, dtype=np.int64) * 7919 + 11
    keys[::5] = keys[0]
    lens = []
    left = n
    while left:
        lens.append(min(left, int(rng.integers(1, 4))))
        left -= lens[-1]
    return keys, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def test_below_its_capacity_an_evicting_table_trains_as_the_growing_one():
    grow, evict = build(), build(max_capacity=4096, max_bucket_size=64)
    r1, r2 = np.random.default_rng(0), np.random.default_rng(0)
    rng = np.random.default_rng(1)
    for s in range(4):
        keys, off = batch(rng, s * 30, 60)  # overlapping batches: found keys and new ones
        for a, b in zip(step(grow, keys, off, r1), step(evict, keys, off, r2)):
            np.testing.assert_array_equal(a, b)
    kg, vg = grow.table("dyn").local_rows()
    ke, ve = evict.table("dyn").local_rows()
    og, oe = np.argsort(kg), np.argsort(ke)
    np.testing.assert_array_equal(kg[og], ke[oe])
    np.testing.assert_array_equal(vg[og], ve[oe])


def test_a_stream_of_ten_times_the_capacity_trains_and_keeps_at_most_the_capacity():
    coll = build(max_capacity=128, max_bucket_size=16)
    group = coll.table("dyn").group
    rng, grads = np.random.default_rng(2), np.random.default_rng(3)
    for s in range(20):  # 1280 distinct keys
        keys, off = batch(rng, s * 64, 64)
        outs = step(coll, keys, off, grads)
        assert all(np.isfinite(o).all() for o in outs)
        assert group.size() <= 128
    keys, rows = coll.table("dyn").local_rows()
    assert 64 < keys.shape[0] <= 128 and group.index.capacity() == 128
    last = np.arange(19 * 64, 20 * 64) * 7919 + 11
    assert np.isin(last[1:][np.arange(1, 64) % 5 != 0], keys).all()  # the last batch's keys are held (kLru)
    # evaluation finds without inserting; a missing key adds zero
    s, _ = coll.lookup({"x": (np.array([keys[0], 5], np.int64), np.array([0, 1, 2], np.int64))}, training=False)
    np.testing.assert_allclose(np.array(device.to_host(s))[:, 0], [rows[0], np.zeros(4)], rtol=1e-6)
    assert group.size() == keys.shape[0]
    fresh = build(max_capacity=128, max_bucket_size=16)
    fresh.table("dyn").load_rows(keys, rows)
    k2, r2 = fresh.table("dyn").local_rows()
    o, o2 = np.argsort(keys), np.argsort(k2)
    np.testing.assert_array_equal(k2[o2], keys[o])
    np.testing.assert_array_equal(r2[o2], rows[o])


def test_strategies_and_bad_options():
    for strategy in ("kLfu", "kEpochLru", "kEpochLfu"):
        coll = build(max_capacity=32, max_bucket_size=8, evict_strategy=strategy)
        rng = np.random.default_rng(4)
        for s in range(4):
            step(coll, *batch(rng, s * 40, 40), rng)
        assert coll.table("dyn").group.size() <= 32
    with pytest.raises(CollectionError, match="max_capacity is for dynamic tables"):
        hugectr.EmbeddingTableConfig("s", 10, 4, max_capacity=8)
    with pytest.raises(CollectionError, match="evict_strategy"):
        hugectr.EmbeddingTableConfig("d", -1, 4, max_capacity=8, evict_strategy="kFifo")
    with pytest.raises(CollectionError, match="max_capacity must be"):
        hugectr.EmbeddingTableConfig("d", -1, 4, max_capacity=0)
