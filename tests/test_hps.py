"""The hierarchical parameter server: every tier combination predicts the same numbers, lookups fall through
the tiers and fill them, the cache's hit-rate modes and refresh, the Redis and RocksDB tiers outlive the
inference process, HugeCTR's HPS JSON, and clear errors for bad or unreachable configurations.

Redis is a real redis-server started on 127.0.0.1 on a free port (skipped only when the binary is absent;
`.ci/run` installs it from the system's packages); RocksDB is rocksdict's embedded RocksDB.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.files.checkpoint import read_sparse_model
from numbactr.inference import (
    HPS,
    BackendError,
    CreateInferenceSession,
    DatabaseType_t,
    InferenceModel,
    ParameterServerConfig,
    PersistentDatabaseParams,
    UpdateSourceParams,
    UpdateSourceType_t,
    VolatileDatabaseParams,
)
from tests import redis_util
from tests.redis_util import REDIS
from tests.test_inference import csr_request, eval_batches, train

NORM, SUM = hugectr.DataReaderType_t.Norm, hugectr.Check_t.Sum


@pytest.fixture(scope="module")
def redis_address(tmp_path_factory):
    """A redis-server of this test module: 127.0.0.1, a free port, its own folder, no persistence."""
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run installs it)")
    proc, port, client = redis_util.start(tmp_path_factory.mktemp("redis"))
    client.close()
    yield f"127.0.0.1:{port}"
    redis_util.stop(proc)


@pytest.fixture(scope="module")
def dcn(tmp_path_factory):
    hugectr.device.set_device("cpu")
    tr = train("dcn", tmp_path_factory.mktemp("hps_dcn"))
    tr.request = csr_request(tr, eval_batches(tr, 1)[0])
    return tr


def _flush(address):
    import redis

    host, port = address.split(":")
    redis.Redis(host=host, port=int(port)).flushall()


def test_every_tier_combination_predicts_the_same(dcn, redis_address, tmp_path):
    """Device cache on (a small one: evictions) or off x volatile HashMap / Redis / off x persistent RocksDB /
    off, the volatile tier holding all or half the keys: the predictions of two passes (the second through a
    warm cache) are the model's, bit for bit."""
    ref = np.asarray(CreateInferenceSession(dcn.graph, dcn.params(use_gpu_embedding_cache=False)).predict(*dcn.request))
    volatile = {
        "hashmap": DatabaseType_t.ParallelHashMap,
        "redis": DatabaseType_t.RedisCluster,
        "off": DatabaseType_t.Disabled,
    }
    for k, (cache, vol, per, rate) in enumerate(itertools.product((True, False), volatile, (True, False), (1.0, 0.5))):
        if (vol == "off" and not per) or (rate < 1 and (vol == "off" or not per)):
            continue  # no tier at all, or a half-filled volatile tier with nothing behind it
        if vol == "redis":
            _flush(redis_address)
        # a rate below 1 limits the volatile tier only for a table past its capacity (overflow_margin x
        # num_partitions keys; HugeCTR loads every key otherwise)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", hugectr.IgnoredArgumentWarning)
            vdb = VolatileDatabaseParams(
                type=volatile[vol],
                address=redis_address,
                initial_cache_rate=rate,
                num_partitions=3,
                **(dict(overflow_margin=2) if rate < 1 else {}),
            )
        p = dcn.params(
            use_gpu_embedding_cache=cache,
            cache_size_percentage=0.05,
            volatile_db=vdb,
            persistent_db=PersistentDatabaseParams(
                backend=DatabaseType_t.RocksDB if per else DatabaseType_t.Disabled, path=str(tmp_path / f"rocks{k}")
            ),
        )
        session = CreateInferenceSession(dcn.graph, p)
        for _ in range(2):
            got = np.asarray(session.predict(*dcn.request))
            assert np.array_equal(got, ref), (cache, vol, per, rate)
        if vol != "off" and per and rate < 1:
            assert session.ps.stats["persistent"].found > 0  # the rest came from RocksDB
        session.close()


def test_lookups_fall_through_and_fill_the_tiers(dcn, tmp_path):
    keys, vectors = read_sparse_model(dcn.sparse[0], "sparse_embedding1", 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hugectr.IgnoredArgumentWarning)
        vdb = VolatileDatabaseParams(
            initial_cache_rate=0.25, cache_missed_embeddings=True, overflow_margin=8, num_partitions=1
        )
    p = dcn.params(
        cache_size_percentage=1.0,
        volatile_db=vdb,
        persistent_db=PersistentDatabaseParams(backend=DatabaseType_t.RocksDB, path=str(tmp_path / "rocks")),
    )
    config = ParameterServerConfig(
        {"dcn": ["sparse_embedding1"]}, {"dcn": [4]}, {"dcn": [8]}, [p], p.volatile_db, p.persistent_db
    )
    hps = HPS(config)
    tag = "hps_et.dcn.sparse_embedding1"
    n = keys.size
    assert hps.ps.volatile.size(tag) == 2 and hps.ps.persistent.size(tag) == n  # 0.25 x its 8 keys
    order = np.random.default_rng(0).permutation(n)
    got = hps.lookup(keys[order].astype(np.int64), "dcn", 0)
    np.testing.assert_array_equal(got, vectors[order])
    cache = hps.ps.cache("dcn")
    assert cache.hits[0] == 0 and cache.queried[0] == n
    assert hps.ps.volatile.size(tag) == n  # the persistent tier's answers moved up
    np.testing.assert_array_equal(hps.lookup(keys.astype(np.int64), "dcn", 0), vectors)
    assert cache.hits[0] == n  # the second time every key is cached
    unknown = hps.lookup(np.array([10**9, int(keys[0])]), "dcn", 0)
    np.testing.assert_array_equal(unknown, np.stack([np.zeros(4, np.float32), vectors[0]]))
    hps.ps.close()


def test_hit_rate_threshold_modes_and_refresh(dcn):
    """hit rate >= threshold: the misses answer with the default now and are cached for the next request
    (HugeCTR's asynchronous mode); refresh_embedding_cache re-reads every cached key from the databases."""
    keys, vectors = read_sparse_model(dcn.sparse[0], "sparse_embedding1", 4)
    p = dcn.params(
        hit_rate_threshold=0.0,
        cache_size_percentage=1.0,
        default_value_for_each_table=[0.25],
        cache_refresh_percentage_per_iteration=0.3,
        init_ec=False,
    )
    config = ParameterServerConfig({"dcn": ["sparse_embedding1"]}, {"dcn": [4]}, {"dcn": [8]}, [p], p.volatile_db)
    hps = HPS(config)
    k = keys[:6].astype(np.int64)
    np.testing.assert_array_equal(hps.lookup(k, "dcn", 0), np.full((6, 4), 0.25, np.float32))
    np.testing.assert_array_equal(hps.lookup(k, "dcn", 0), vectors[:6])
    new = vectors[:6] + 1
    hps.ps.volatile.insert("hps_et.dcn.sparse_embedding1", keys[:6], new)
    np.testing.assert_array_equal(hps.lookup(k, "dcn", 0), vectors[:6])  # still the cached vectors
    hps.ps.refresh_embedding_cache("dcn")
    np.testing.assert_array_equal(hps.lookup(k, "dcn", 0), new)
    hps.ps.close()


def test_init_ec_fills_the_cache_at_start(dcn):
    keys, vectors = read_sparse_model(dcn.sparse[0], "sparse_embedding1", 4)
    p = dcn.params(cache_size_percentage=1.0, cache_refresh_percentage_per_iteration=0.5)
    session = CreateInferenceSession(dcn.graph, p)
    cache = session.cache
    session.predict(*dcn.request)
    assert cache.hits[0] == cache.queried[0] > 0  # every key was there before the request
    session.close()


CHILD = r"""
import json, sys
import numpy as np
import numbactr as hugectr
from numbactr.inference import (CreateInferenceSession, DatabaseType_t, InferenceParams,
                                PersistentDatabaseParams, VolatileDatabaseParams)
cfg = json.loads(sys.argv[1])
hugectr.device.set_device("cpu")
vol = VolatileDatabaseParams(type=getattr(DatabaseType_t, cfg["volatile"]), address=cfg["address"],
                             initialize_after_startup=cfg["fill"])
per = PersistentDatabaseParams(backend=getattr(DatabaseType_t, cfg["persistent"]), path=cfg["path"],
                               initialize_after_startup=cfg["fill"], read_only=not cfg["fill"])
p = InferenceParams(model_name="dcn", max_batchsize=cfg["batch"], hit_rate_threshold=1.0,
                    dense_model_file=cfg["dense"], sparse_model_files=cfg["sparse"], use_gpu_embedding_cache=True,
                    cache_size_percentage=0.5, i64_input_key=True, volatile_db=vol, persistent_db=per)
session = CreateInferenceSession(cfg["graph"], p)
print(json.dumps(session.predict(*cfg["request"])))
session.close()
"""


def _child(cfg: dict) -> list:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "NUMBACTR_DEVICE": "cpu"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tier", ["redis", "rocksdb"])
def test_tiers_survive_a_restart_of_the_inference_process(dcn, redis_address, tmp_path, tier):
    """Process 1 fills the tier from the sparse model files; process 2 starts without filling anything, with
    the vectors file gone, and predicts the same numbers from what the tier kept."""
    _flush(redis_address)
    sparse = str(tmp_path / "sparse.model")
    shutil.copytree(dcn.sparse[0], sparse)
    cfg = dict(
        volatile="RedisCluster" if tier == "redis" else "Disabled",
        address=redis_address,
        persistent="RocksDB" if tier == "rocksdb" else "Disabled",
        path=str(tmp_path / "rocks"),
        fill=True,
        batch=dcn.batch,
        dense=dcn.dense,
        sparse=[sparse],
        graph=dcn.graph,
        request=list(dcn.request),
    )
    first = _child(cfg)
    os.remove(os.path.join(sparse, "emb_vector"))  # nothing can come from the file any more
    second = _child({**cfg, "fill": False})
    ref = CreateInferenceSession(dcn.graph, dcn.params(use_gpu_embedding_cache=False)).predict(*dcn.request)
    assert first == second == ref


def test_hps_json(dcn, tmp_path):
    keys, vectors = read_sparse_model(dcn.sparse[0], "sparse_embedding1", 4)
    doc = {
        "supportlonglong": True,
        "volatile_db": {"type": "hash_map", "initial_cache_rate": 0.5, "cache_missed_embeddings": True},
        "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
        "models": [
            {
                "model": "dcn",
                "sparse_files": dcn.sparse,
                "dense_file": dcn.dense,
                "num_of_worker_buffer_in_pool": 2,
                "deployed_device_list": [0],
                "max_batch_size": 32,
                "default_value_for_each_table": [0.0],
                "maxnum_catfeature_query_per_table_per_sample": [8],
                "embedding_vecsize_per_table": [4],
                "embedding_table_names": ["sparse_embedding1"],
                "gpucacheper": 0.5,
                "hit_rate_threshold": 1.0,
                "gpucache": True,
            }
        ],
    }
    path = tmp_path / "hps.json"
    path.write_text(json.dumps(doc))
    hps = HPS(str(path))
    p = hps.config.models["dcn"].params
    assert (p.volatile_db.type, p.persistent_db.backend) == (DatabaseType_t.HashMap, DatabaseType_t.RocksDB)
    assert p.volatile_db.initial_cache_rate == 0.5 and p.cache_size_percentage == 0.5
    np.testing.assert_array_equal(hps.lookup(keys.astype(np.int64), "dcn", 0), vectors)
    with pytest.raises(KeyError, match="model name 'wdl' does not exist"):
        hps.lookup(keys[:2].astype(np.int64), "wdl", 0)
    with pytest.raises(ValueError, match="at most maxnum_catfeature_query_per_table_per_sample"):
        hps.lookup(np.arange(8 * 32 + 1), "dcn", 0)
    hps.ps.close()

    def bad(edit, match, exc=ValueError):
        d = json.loads(json.dumps(doc))
        edit(d)
        path.write_text(json.dumps(d))
        with pytest.raises(exc, match=match):
            HPS(str(path))

    bad(lambda d: d.pop("supportlonglong"), r"hps\.json.*missing key 'supportlonglong'")
    bad(lambda d: d["models"][0].pop("embedding_vecsize_per_table"), r"models\[0\].*'embedding_vecsize_per_table'")
    bad(lambda d: d["volatile_db"].update(type="memcached"), r"volatile_db.*'type' is 'memcached', not one of")
    bad(lambda d: d["models"][0].update(gpucacheper="half"), r"models\[0\].*'gpucacheper' must be a number")
    bad(lambda d: d["models"][0].update(embedding_table_names=["a", "b"]), "2 entries for 1 'sparse_files'")
    bad(
        lambda d: (
            d["update_source"].update(type="kafka_message_queue")
            if "update_source" in d
            else d.update(update_source={"type": "kafka_message_queue"})
        ),
        "no Kafka consumer",
        NotImplementedError,
    )
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        HPS(str(path))
    d = json.loads(json.dumps(doc))
    d["models"][0]["gpu_cache"] = True  # a misspelled key warns instead of defaulting
    path.write_text(json.dumps(d))
    with pytest.warns(hugectr.IgnoredArgumentWarning, match="unknown key 'gpu_cache'"):
        HPS(str(path)).ps.close()


def test_missing_or_unreachable_backends_are_clear_errors(dcn, tmp_path):
    with pytest.raises(BackendError, match=r"RedisCluster\) at '127.0.0.1:1' cannot be reached.*volatile_db.address"):
        InferenceModel(
            dcn.graph,
            dcn.params(volatile_db=VolatileDatabaseParams(type=DatabaseType_t.RedisCluster, address="127.0.0.1:1")),
        )
    with pytest.raises(
        BackendError, match=r"RocksDB\) at path '.*nowhere' cannot be opened read-only.*persistent_db.path"
    ):
        InferenceModel(
            dcn.graph,
            dcn.params(
                persistent_db=PersistentDatabaseParams(
                    backend=DatabaseType_t.RocksDB,
                    path=str(tmp_path / "nowhere"),
                    read_only=True,
                    initialize_after_startup=False,
                )
            ),
        )
    with pytest.raises(NotImplementedError, match="MultiProcessHashMap.*volatile_db.type"):
        VolatileDatabaseParams(type=DatabaseType_t.MultiProcessHashMap)
    with pytest.raises(ValueError, match="RocksDB is a persistent database"):
        VolatileDatabaseParams(type=DatabaseType_t.RocksDB)
    with pytest.raises(NotImplementedError, match="KafkaMessageQueue"):
        UpdateSourceParams(type=UpdateSourceType_t.KafkaMessageQueue)
    with pytest.raises(ValueError, match="num_partitions must"):
        VolatileDatabaseParams(num_partitions=0)
    with pytest.warns(hugectr.IgnoredArgumentWarning, match="overflow_margin=100 is ignored"):
        VolatileDatabaseParams(overflow_margin=100)
    with pytest.raises(FileNotFoundError, match="has no key file"):
        InferenceModel(
            dcn.graph,
            dcn.params(
                sparse_model_files=[str(tmp_path)],
                volatile_db=VolatileDatabaseParams(type=DatabaseType_t.Disabled),
                persistent_db=PersistentDatabaseParams(
                    backend=DatabaseType_t.RocksDB, path=str(tmp_path / "r"), initialize_after_startup=False
                ),
            ),
        )


@pytest.mark.parametrize("threshold,default", [(1.0, 0.0), (1.0, 0.5), (0.3, 0.25)])
def test_occurrence_lookup_equals_lookup_of_the_distinct_keys(dcn, threshold, default, tmp_path):
    """InferenceSession's path (every occurrence found in the key -> row table, de-duplicated in one pass,
    no sort) answers, counts and moves the cache exactly as lookup() of np.unique(keys) does: a small
    cache (evictions), duplicates, keys no tier has (default 0 or not), both hit-rate modes."""
    folder = tmp_path / "big0_sparse_0.model"  # 1000 keys in HugeCTR's layout: a cache of 10%
    folder.mkdir()
    rng = np.random.default_rng(1)
    rng.permutation(1000).astype("<i8").tofile(folder / "key")
    rng.uniform(-1, 1, (1000, 4)).astype("<f4").tofile(folder / "emb_vector")
    keys, vectors = read_sparse_model(str(folder), "sparse_embedding1", 4)
    p = dcn.params(
        cache_size_percentage=0.1,
        hit_rate_threshold=threshold,
        default_value_for_each_table=[default],
        sparse_model_files=[str(folder)],
        max_batchsize=1000,
    )
    config = ParameterServerConfig({"dcn": ["sparse_embedding1"]}, {"dcn": [4]}, {"dcn": [8]}, [p], p.volatile_db)
    a, b = HPS(config).ps, HPS(config).ps
    ca, cb = a.cache("dcn"), b.cache("dcn")
    pool = np.concatenate([keys, np.array([10**9, 10**9 + 7], np.uint64)])
    assert ca.capacities[0] < keys.size // 2
    evictions, all_hit, cached_a = 0, 0, set()
    for step in range(16):
        req = rng.choice(pool[: rng.integers(10, pool.size + 1)], size=int(rng.integers(1, 200))).astype(np.uint64)
        if step % 4 == 3:
            req = np.concatenate([req, pool[-2:], pool[-2:]])  # unknown keys, repeated
        if step >= 12:  # only keys the cache holds, repeated: the all-hit path
            req = rng.choice(np.array(sorted(cached_a), np.uint64), size=60)
        hits_before = cb.hits[0]
        uniq, inv = np.unique(req, return_inverse=True)
        blk_a = np.zeros((uniq.size + 1, 4), np.float32)
        rows_a = ca.lookup(0, uniq, blk_a)[inv.reshape(-1)]
        blocks = []

        def block_for(n):
            blocks.append(np.zeros((n, 4), np.float32))
            return blocks[-1]

        rows_b = cb.lookup_occurrences(0, req, block_for)
        va = np.where((rows_a >= 0)[:, None], blk_a[np.maximum(rows_a, 0)], 0)
        vb = np.where((rows_b >= 0)[:, None], blocks[-1][np.maximum(rows_b, 0)], 0)
        np.testing.assert_array_equal(va, vb)
        assert (ca.hits, ca.queried) == (cb.hits, cb.queried)
        assert ca.cache.clock == cb.cache.clock
        evictions += int(ca.index[0].size > ca.capacities[0])
        held_a = {int(k): int(s) for k, s in zip(ca.index[0].keys_by_row(), ca.cache.row_slot[: ca.index[0].size])}
        held_b = {int(k): int(s) for k, s in zip(cb.index[0].keys_by_row(), cb.cache.row_slot[: cb.index[0].size])}
        cached_a = {k for k, s in held_a.items() if s >= 0}
        assert cached_a == {k for k, s in held_b.items() if s >= 0}
        for k in cached_a:  # the same LRU clock and LFU count on every cached key
            sa, sb = held_a[k], held_b[k]
            assert (ca.cache.stamp[sa], ca.cache.freq[sa]) == (cb.cache.stamp[sb], cb.cache.freq[sb])
        all_hit += int(cb.hits[0] - hits_before == np.unique(req).size)
    exact = rows_b >= 0
    known = np.isin(req, keys)
    if threshold == 1.0:  # exact answers: the model's vectors, defaults elsewhere
        pos = {int(k): i for i, k in enumerate(keys)}
        want = np.array([vectors[pos[int(k)]] if int(k) in pos else np.full(4, default, np.float32) for k in req])
        np.testing.assert_array_equal(vb if default else np.where(exact[:, None], vb, 0), want)
    assert known.any() and evictions and all_hit >= 4
    a.close()
    b.close()


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_warm_request_fast_path_equals_the_block_path(dcn, combiner, tmp_path):
    """The session's one-pass warm path (ModelCache.serve_pooled: find, read the cache's vectors, pool,
    stamp) pools, counts and moves the LRU state exactly as lookup_occurrences + the pooling engine; it
    answers only when every key is known and cached and otherwise returns None with nothing changed.
    Multi-hot bags with duplicates and empty bags, a cache of 10% with evictions between."""
    from types import SimpleNamespace

    from numbactr.inference.session import _Pooler

    folder = tmp_path / "big0_sparse_0.model"
    folder.mkdir()
    rng = np.random.default_rng(7)
    rng.permutation(1000).astype("<i8").tofile(folder / "key")
    rng.uniform(-1, 1, (1000, 4)).astype("<f4").tofile(folder / "emb_vector")
    keys, _ = read_sparse_model(str(folder), "sparse_embedding1", 4)
    p = dcn.params(
        cache_size_percentage=0.1, hit_rate_threshold=1.0, sparse_model_files=[str(folder)], max_batchsize=1000
    )
    config = ParameterServerConfig({"dcn": ["sparse_embedding1"]}, {"dcn": [4]}, {"dcn": [8]}, [p], p.volatile_db)
    a, b = HPS(config).ps, HPS(config).ps
    ca, cb = a.cache("dcn"), b.cache("dcn")
    pooler = _Pooler(SimpleNamespace(embedding_vec_size=4, combiner=combiner), 3)
    fast = declined = 0
    for step in range(24):
        n = int(rng.integers(1, 40))
        lengths = rng.integers(0, 4, n * 3)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        held = [int(k) for k, s in zip(cb.index[0].keys_by_row(), cb.cache.row_slot[: cb.index[0].size]) if s >= 0]
        source = np.array(held, np.uint64) if step % 3 and held else keys[: rng.integers(50, 1000)]
        req = rng.choice(source, size=int(offsets[-1])).astype(np.uint64)
        if step % 6 == 5:
            req[-1:] = 10**9  # a key no tier has
        rows = ca.lookup_occurrences(0, req, pooler.block)
        want = np.asarray(pooler.pool(rows, offsets, n))
        before = (cb.cache.stamp.copy(), cb.cache.freq.copy(), cb.cache.clock, list(cb.hits), list(cb.queried))
        got = cb.serve_pooled(0, req, offsets, combiner == "mean")
        if got is None:
            declined += 1
            after = (cb.cache.stamp, cb.cache.freq, cb.cache.clock, cb.hits, cb.queried)
            for x, y in zip(before, after):
                np.testing.assert_array_equal(x, y)
            got = np.asarray(pooler.pool(cb.lookup_occurrences(0, req, pooler.block), offsets, n))
        else:
            fast += 1
            got = got.reshape(n, 3, 4)
        np.testing.assert_array_equal(got, want)
        assert (ca.hits, ca.queried, ca.cache.clock) == (cb.hits, cb.queried, cb.cache.clock)
        sa = {int(k): int(s) for k, s in zip(ca.index[0].keys_by_row(), ca.cache.row_slot[: ca.index[0].size])}
        sb = {int(k): int(s) for k, s in zip(cb.index[0].keys_by_row(), cb.cache.row_slot[: cb.index[0].size])}
        assert {k for k, s in sa.items() if s >= 0} == {k for k, s in sb.items() if s >= 0}
        for k, s in sa.items():
            if s >= 0:
                assert (ca.cache.stamp[s], ca.cache.freq[s]) == (cb.cache.stamp[sb[k]], cb.cache.freq[sb[k]])
    assert fast >= 6 and declined >= 4
    a.close()
    b.close()
