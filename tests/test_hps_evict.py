"""The parameter server follows a training table that evicts (numbactr/inference/hps_update.py): an
incremental dump's rows replace the cached and stored ones, its evicted keys leave the embedding cache and
every tier (the next request gets the default, not a stale row), with the in-process map, a real Redis
server and RocksDB; and an evicting SparseEmbedding's lower tier (evict_to) in Redis or RocksDB keeps the
rows of evicted keys and gives them back."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.autograd import Tape
from numbactr.embedding.factory import make_embedding
from numbactr.inference import (
    HPS,
    DatabaseType_t,
    InferenceParams,
    ParameterServerConfig,
    PersistentDatabaseParams,
    VolatileDatabaseParams,
)
from numbactr.inference.backends import RedisClusterBackend, RocksDBBackend
from numbactr.runtime import device
from tests import redis_util
from tests.redis_util import REDIS

E, O, U = hugectr.Embedding_t, hugectr.Optimizer_t, hugectr.Update_t
S, D, B = 2, 4, 8

pytestmark = pytest.mark.usefixtures("cpu")


@pytest.fixture(scope="module")
def redis_address(tmp_path_factory):
    """A redis-server of this test module (tests/test_hps.py's way: 127.0.0.1, a free port)."""
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run installs it)")
    proc, port, client = redis_util.start(tmp_path_factory.mktemp("redis"))
    client.close()
    yield f"127.0.0.1:{port}"
    redis_util.stop(proc)


def embedding(**kw):
    cfg = hugectr.SparseEmbedding(E.DistributedSlotSparseEmbeddingHash, 1, D, "sum", "emb", "data", **kw)
    return make_embedding(
        cfg,
        hugectr.DataReaderSparseParam("data", 2, False, S),
        hugectr.CreateOptimizer(optimizer_type=O.AdaGrad, update_type=U.Local),
        seed=5,
    )


def train_on(emb, first: int, rng, n: int = B * S) -> None:
    """One step over n keys first.. (one a bag, the last B*S - n bags empty)."""
    keys = np.arange(first, first + n, dtype=np.int64) * 7919 + 3
    offsets = np.minimum(np.arange(B * S + 1, dtype=np.int64), n)
    tape = Tape()
    out = emb.forward(tape, keys, offsets, B, training=True)
    tape.backward({id(out): (out, rng.normal(size=out.data.shape).astype(np.float32))})
    emb.update(0.1, 1.0)


def server(folder, vol, per, redis_address=None):
    """An HPS over the folder's table 'emb' of model 'm' (cache on, every answer exact)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hugectr.IgnoredArgumentWarning)
        vdb = VolatileDatabaseParams(type=vol, address=redis_address or "127.0.0.1:6379", num_partitions=2)
    pdb = PersistentDatabaseParams(backend=per, path=str(folder / "rocks"))
    p = InferenceParams(
        model_name="m",
        max_batchsize=64,
        hit_rate_threshold=1.0,
        dense_model_file=str(folder / "dense.model"),
        sparse_model_files=[str(folder / "emb")],
        use_gpu_embedding_cache=True,
        cache_size_percentage=1.0,
        i64_input_key=True,
        volatile_db=vdb,
        persistent_db=pdb,
    )
    return HPS(ParameterServerConfig({"m": ["emb"]}, {"m": [D]}, {"m": [S]}, [p], vdb, pdb))


TIERS = [
    ("hashmap", DatabaseType_t.ParallelHashMap, DatabaseType_t.Disabled),
    ("redis", DatabaseType_t.RedisCluster, DatabaseType_t.Disabled),
    ("rocksdb", DatabaseType_t.Disabled, DatabaseType_t.RocksDB),
    ("hashmap+rocksdb", DatabaseType_t.ParallelHashMap, DatabaseType_t.RocksDB),
]


@pytest.mark.parametrize("name,vol,per", TIERS, ids=[t[0] for t in TIERS])
def test_evicted_keys_leave_the_cache_and_every_tier(name, vol, per, tmp_path, request):
    address = request.getfixturevalue("redis_address") if name == "redis" else None
    emb, rng = embedding(max_capacity=16, max_bucket_size=16), np.random.default_rng(0)
    train_on(emb, 0, rng)
    keys, rows = emb.dump()
    (tmp_path / "emb").mkdir()
    keys.astype("<i8").tofile(tmp_path / "emb" / "key")
    rows.astype("<f4").tofile(tmp_path / "emb" / "emb_vector")
    emb.incremental_dump()  # the snapshot is the baseline
    hps = server(tmp_path, vol, per, address)
    try:
        ask = keys.view(np.int64)
        np.testing.assert_array_equal(hps.lookup(ask, "m", 0), rows)  # every key now cached
        assert hps.ps.cache("m").hit_rates[0] == 0.0
        train_on(emb, 0, rng)  # the cached keys train on
        train_on(emb, 100, rng, n=8)  # 8 new keys push out the 8 of them least recently used
        new_keys, new_rows, evicted = emb.incremental_dump()
        held, held_rows = emb.dump()
        # every key that left since the snapshot is reported (keys that came and left since are too:
        # erasing what the server never had is harmless); no key held is
        assert np.isin(keys[~np.isin(keys, held)], evicted).all() and not np.isin(evicted, held).any()
        hps.ps.update("m", "emb", new_keys, new_rows, evicted)
        # evicted keys: the default (0), from the cache and from every tier
        np.testing.assert_array_equal(hps.lookup(evicted.view(np.int64), "m", 0), np.zeros((evicted.size, D)))
        values, found = hps.ps.lookup("m", 0, evicted)
        assert not found.any()
        # the keys held: their trained rows (the kept old keys through the cache)
        np.testing.assert_array_equal(hps.lookup(held.view(np.int64), "m", 0), held_rows)
        # the 8 kept keys came from the cache, where the update wrote their new rows
        kept = np.isin(keys, held)
        assert kept.sum() == 8
        cache = hps.ps.cache("m")
        hits = cache.hits[0]
        now = dict(zip(held.tolist(), held_rows))
        want = np.stack([now[k] for k in keys[kept].tolist()])
        np.testing.assert_array_equal(hps.lookup(keys[kept].view(np.int64), "m", 0), want)
        assert cache.hits[0] == hits + 8
        assert not np.array_equal(want, rows[kept])  # they did change
    finally:
        hps.ps.close()


def test_an_update_names_its_table_and_shapes(tmp_path):
    (tmp_path / "emb").mkdir()
    np.arange(4, dtype="<i8").tofile(tmp_path / "emb" / "key")
    np.zeros((4, D), "<f4").tofile(tmp_path / "emb" / "emb_vector")
    hps = server(tmp_path, DatabaseType_t.ParallelHashMap, DatabaseType_t.Disabled)
    try:
        with pytest.raises(ValueError, match="has no table 'other'"):
            hps.ps.update("m", "other", np.zeros(0, np.uint64), np.zeros((0, D)))
        with pytest.raises(ValueError, match=r"values must be \(2, 4\)"):
            hps.ps.update("m", 0, np.array([1, 2], np.uint64), np.zeros((2, 3)))
        with pytest.raises(ValueError, match="key 1 is both updated and evicted"):
            hps.ps.update("m", 0, np.array([1], np.uint64), np.zeros((1, D)), np.array([1], np.uint64))
        with pytest.raises(KeyError, match="no model named 'x'"):
            hps.ps.update("x", 0, np.zeros(0, np.uint64), np.zeros((0, D)))
    finally:
        hps.ps.close()


@pytest.mark.parametrize("kind", ["redis", "rocksdb"])
def test_a_lower_tier_keeps_evicted_rows_and_gives_them_back(kind, tmp_path, request):
    if kind == "redis":
        address = request.getfixturevalue("redis_address")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", hugectr.IgnoredArgumentWarning)
            tier = RedisClusterBackend(
                VolatileDatabaseParams(type=DatabaseType_t.RedisCluster, address=address, num_partitions=2)
            )
        tier.client.flushall()
    else:
        tier = RocksDBBackend(PersistentDatabaseParams(backend=DatabaseType_t.RocksDB, path=str(tmp_path / "r")))
    try:
        emb, rng = embedding(max_capacity=16, max_bucket_size=16, evict_to=tier), np.random.default_rng(1)
        train_on(emb, 0, rng)
        k0, v0 = emb.dump()
        by_key = dict(zip(k0.tolist(), v0))
        train_on(emb, 100, rng)
        gone = k0[~np.isin(k0, emb.dump()[0])]
        assert gone.size and tier.size("emb") == gone.size
        values, found = tier.fetch("emb", gone, D)
        assert found.all()
        np.testing.assert_array_equal(values, np.stack([by_key[k] for k in gone.tolist()]))
        # incremental dumps keep them in the model: rows, not evictions
        keys, rows, evicted = emb.incremental_dump()
        assert evicted.size == 0 and np.isin(gone, keys).all()
        # a training lookup brings one back with its row, and the tier lets it go
        back = np.full(B * S, int(gone[0]), np.int64)
        out = emb.forward(Tape(), back, np.arange(B * S + 1, dtype=np.int64), B, training=True)
        np.testing.assert_array_equal(np.array(device.to_host(out.data))[0, 0], by_key[int(gone[0])])
        assert not tier.fetch("emb", gone[:1], D)[1][0]
    finally:
        tier.close()


def test_the_in_process_map_stays_bounded_under_keys_that_come_and_go():
    """A stream of keys each inserted then erased (a training table's evictions): the map rebuilds from its
    held rows when it grows, so its index stays near twice what it holds, and the held rows keep their values."""
    from numbactr.inference.backends import HashMapBackend

    store = HashMapBackend()
    kept = np.arange(10, dtype=np.int64)
    store.insert("t", kept, np.tile(kept[:, None].astype(np.float32), (1, 3)))
    for step in range(50):
        keys = np.arange(1000 + 100 * step, 1100 + 100 * step, dtype=np.int64)
        store.insert("t", keys, np.full((100, 3), step, np.float32))
        store.erase("t", keys[:90])
    assert store.size("t") == 10 + 50 * 10
    assert store.tables["t"][0].max_rows <= 2048  # 5,010 distinct keys went through it
    vals, found = store.fetch("t", kept, 3)
    assert found.all() and (vals == kept[:, None]).all()
    vals, found = store.fetch("t", np.array([1000, 1095, 5995], np.int64), 3)
    assert found.tolist() == [False, True, True] and vals[1:, 0].tolist() == [0.0, 49.0]
