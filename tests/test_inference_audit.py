"""Inference behaviours checked against HugeCTR v23.08.00 by an audit:

* initial_cache_rate < 1 loses no embedding: HugeCTR's HierParameterServer puts every key of a sparse file
  into the volatile database; the rate only matters for a table larger than the database's capacity
  (overflow_margin x num_partitions), where numbactr applies it only when a persistent database holds all;
* volatile_db.address in HugeCTR's documented form "host-1[:port],host-2[:port],...": the first node is used
  (src/hps/redis_backend.cpp), also when it is a Redis cluster node; numbactr's ';' form still works;
* HPS.lookup_fromdlpack(keys, out_tensor, model_name, table_id, device_id=0) (include/pybind/hps_wrapper.hpp,
  notebooks/hps_demo.ipynb): DLPack capsules read without being consumed, torch tensors, NumPy arrays;
* hit_rate_threshold takes any finite float: > 1 fetches every miss at once (no asynchronous insert);
* DatabaseType_t, DatabaseOverflowPolicy_t, UpdateSourceType_t on the top-level module with HugeCTR's member
  names (include/pybind/common_wrapper.hpp): ``from hugectr import DatabaseType_t``, ``.redis_cluster``;
* default_value_for_each_table of the wrong length warns and gives every table its first value
  (src/hps/inference_utils.cpp); dense_model_file "" loads no dense weights (src/inference/inference_session.cpp).
"""

from __future__ import annotations

import math
import os
import time
import warnings

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.config import IgnoredArgumentWarning
from numbactr.inference import (
    HPS,
    CreateInferenceSession,
    DatabaseType_t,
    InferenceParams,
    ParameterServerConfig,
    PersistentDatabaseParams,
    VolatileDatabaseParams,
)
from tests import redis_util
from tests.redis_util import REDIS

WIDTHS = (4, 8)
N_KEYS = 300


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """Two sparse model folders (key int64, emb_vector float32): keys 0..N-1 and 1000..1000+N-1, shuffled."""
    root = tmp_path_factory.mktemp("audit_tables")
    rng = np.random.default_rng(3)
    out = []
    for t, width in enumerate(WIDTHS):
        folder = root / f"audit{t}_sparse_0.model"
        folder.mkdir()
        keys = (rng.permutation(N_KEYS) + 1000 * t).astype("<i8")
        vectors = rng.uniform(-1, 1, (N_KEYS, width)).astype("<f4")
        keys.tofile(folder / "key")
        vectors.tofile(folder / "emb_vector")
        out.append((str(folder), keys, vectors))
    return out


def _hps(tables, volatile_db=None, persistent_db=None, **kw) -> HPS:
    args = dict(
        model_name="audit",
        max_batchsize=N_KEYS,
        hit_rate_threshold=1.0,
        dense_model_file="",
        sparse_model_files=[f for f, _, _ in tables],
        use_gpu_embedding_cache=True,
        cache_size_percentage=0.5,
        i64_input_key=True,
    )
    args.update(kw)
    p = InferenceParams(**args)
    return HPS(
        ParameterServerConfig(
            {"audit": ["sparse_embedding1", "sparse_embedding2"]},
            {"audit": list(WIDTHS)},
            {"audit": [1, 1]},
            [p],
            volatile_db,
            persistent_db,
        )
    )


def _wrong_rows(hps, tables, t: int) -> int:
    _, keys, vectors = tables[t]
    return int((np.abs(hps.lookup(keys, "audit", t) - vectors).max(1) > 0).sum())


# ---- 1. initial_cache_rate ---------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [0.5, 0.0])
def test_initial_cache_rate_below_one_loses_no_embedding(tables, rate):
    """No persistent database: every saved key comes back with its vector, the volatile tier holds them all."""
    hps = _hps(tables, VolatileDatabaseParams(initial_cache_rate=rate), PersistentDatabaseParams())
    try:
        for t in range(2):
            assert hps.ps.volatile.size(f"hps_et.audit.sparse_embedding{t + 1}") == N_KEYS
            assert _wrong_rows(hps, tables, t) == 0
    finally:
        hps.ps.close()


def test_initial_cache_rate_with_persistent_database_fills_every_tier(tables, tmp_path):
    """With the default (unlimited) overflow_margin HugeCTR's volatile tier takes every key whatever the rate;
    the persistent one too."""
    hps = _hps(
        tables,
        VolatileDatabaseParams(initial_cache_rate=0.25),
        PersistentDatabaseParams(backend=DatabaseType_t.RocksDB, path=str(tmp_path / "rocks")),
    )
    try:
        tag = "hps_et.audit.sparse_embedding1"
        assert hps.ps.volatile.size(tag) == N_KEYS and hps.ps.persistent.size(tag) == N_KEYS
        assert _wrong_rows(hps, tables, 0) == 0
    finally:
        hps.ps.close()


def test_initial_cache_rate_applies_to_a_table_beyond_the_volatile_capacity(tables, tmp_path, capsys):
    """overflow_margin x num_partitions below the table's keys: with a persistent database holding them all,
    the volatile tier takes round(rate x capacity) of them (HugeCTR's volatile_cache_amount); without one it
    keeps every key (nothing is lost) and says so."""
    with pytest.warns(IgnoredArgumentWarning, match="overflow_margin=50 is ignored except at start"):
        vol = VolatileDatabaseParams(initial_cache_rate=0.5, overflow_margin=50, num_partitions=2)
    hps = _hps(tables, vol, PersistentDatabaseParams(backend=DatabaseType_t.RocksDB, path=str(tmp_path / "r")))
    try:
        assert hps.ps.volatile.size("hps_et.audit.sparse_embedding1") == 50  # 0.5 x (50 x 2)
        assert _wrong_rows(hps, tables, 0) == 0 and _wrong_rows(hps, tables, 1) == 0
        assert hps.ps.stats["persistent"].found > 0
    finally:
        hps.ps.close()
    capsys.readouterr()
    hps = _hps(tables, vol, PersistentDatabaseParams())
    try:
        assert hps.ps.volatile.size("hps_et.audit.sparse_embedding1") == N_KEYS
        assert _wrong_rows(hps, tables, 0) == 0
        assert "no persistent database filled at start holds them" in capsys.readouterr().err
    finally:
        hps.ps.close()


# ---- 2. Redis address --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def redis_port(tmp_path_factory):
    if REDIS is None:
        pytest.skip("redis-server is not installed")
    proc, port, client = redis_util.start(tmp_path_factory.mktemp("redis"))
    client.close()
    yield port
    redis_util.stop(proc)


def _redis_hps(tables, address):
    vol = VolatileDatabaseParams(type=DatabaseType_t.RedisCluster, address=address, num_partitions=2)
    return _hps(tables, vol, PersistentDatabaseParams(), use_gpu_embedding_cache=False)


def test_redis_address_in_hugectrs_comma_form(tables, redis_port):
    """HugeCTR's documented "host-1[:port],host-2[:port],...": the first node is the one used (the others,
    here nothing listens, are not contacted), as src/hps/redis_backend.cpp does."""
    import redis

    redis.Redis(port=redis_port).flushall()
    for address in (
        f"127.0.0.1:{redis_port},127.0.0.1:1,127.0.0.1:2",
        f"127.0.0.1:{redis_port}",
        f"127.0.0.1:{redis_port};",
    ):
        hps = _redis_hps(tables, address)
        try:
            assert _wrong_rows(hps, tables, 1) == 0, address
        finally:
            hps.ps.close()
    from numbactr.inference.backends import BackendError

    with pytest.raises(BackendError, match="cannot be reached"):
        _redis_hps(tables, f"127.0.0.1:1,127.0.0.1:{redis_port}")  # HugeCTR, too, uses only the first
    with pytest.raises(BackendError, match="is not host\\[:port\\]"):
        _redis_hps(tables, "127.0.0.1:port,127.0.0.1:1")


def test_redis_comma_address_of_a_cluster_node(tables, tmp_path):
    """A first node in cluster mode: the client is a cluster client started from it (HugeCTR always uses
    redis-plus-plus's RedisCluster)."""
    if REDIS is None:
        pytest.skip("redis-server is not installed")
    proc, port, client = redis_util.start(
        tmp_path, "--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf")
    )
    try:
        try:
            client.execute_command("CLUSTER", "ADDSLOTS", *range(16384))
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"cannot make a one-node cluster: {e}")
        deadline = time.monotonic() + 20
        while client.execute_command("CLUSTER", "INFO").decode().find("cluster_state:ok") < 0:
            if time.monotonic() > deadline:
                pytest.skip("the one-node cluster did not become ready")
            time.sleep(0.1)
        from redis.cluster import RedisCluster

        hps = _redis_hps(tables, f"127.0.0.1:{port},127.0.0.1:1")
        try:
            assert isinstance(hps.ps.volatile.client, RedisCluster)
            assert _wrong_rows(hps, tables, 0) == 0
        finally:
            hps.ps.close()
    finally:
        client.close()
        redis_util.stop(proc)


# ---- 3. lookup_fromdlpack ----------------------------------------------------------------------------------
def test_lookup_fromdlpack_with_torch_capsules_as_in_hps_demo(tables):
    """The notebook's form: capsules of torch CPU tensors, out (1, n x D); the out capsule is not consumed."""
    torch = pytest.importorskip("torch")
    import torch.utils.dlpack as tdl

    hps = _hps(tables)
    try:
        _, keys, vectors = tables[0]
        sel = keys[[5, 1, 5, 200]]
        key = torch.tensor(sel, dtype=torch.int64)
        out = torch.empty((1, sel.size * WIDTHS[0]), dtype=torch.float32)
        out_capsule = tdl.to_dlpack(out)
        assert hps.lookup_fromdlpack(tdl.to_dlpack(key), out_capsule, "audit", 0) is None
        got = tdl.from_dlpack(out_capsule)  # still a valid capsule
        np.testing.assert_array_equal(got.numpy().reshape(-1, WIDTHS[0]), vectors[[5, 1, 5, 200]])
        np.testing.assert_array_equal(out.numpy().reshape(-1, WIDTHS[0]), vectors[[5, 1, 5, 200]])
        # tensors themselves (__dlpack__), 2-D keys, an out larger than needed: the rest is left alone
        k2 = torch.tensor(keys[:6].reshape(2, 3))
        big = torch.full((8, WIDTHS[0]), 7.0)
        hps.lookup_fromdlpack(k2, big, "audit", 0, device_id=0)
        np.testing.assert_array_equal(big.numpy()[:6], vectors[:6])
        assert (big.numpy()[6:] == 7.0).all()
        with pytest.raises(ValueError, match="already consumed"):
            hps.lookup_fromdlpack(tdl.to_dlpack(key), out_capsule, "audit", 0)
        with pytest.raises(ValueError, match="not C-contiguous"):
            hps.lookup_fromdlpack(key, torch.zeros((WIDTHS[0], 8)).t(), "audit", 0)
        with pytest.raises(TypeError, match="float32"):
            hps.lookup_fromdlpack(key, torch.zeros(sel.size * WIDTHS[0], dtype=torch.float64), "audit", 0)
        with pytest.raises(TypeError, match="integer"):
            hps.lookup_fromdlpack(torch.tensor([1.0, 2.0]), torch.zeros(8), "audit", 0)
        with pytest.raises(TypeError, match="cannot be exported through DLPack"):
            hps.lookup_fromdlpack(key, torch.zeros(16, requires_grad=True), "audit", 0)
    finally:
        hps.ps.close()


def test_lookup_fromdlpack_with_numpy_arrays(tables):
    hps = _hps(tables, default_value_for_each_table=[0.0, 0.5])
    try:
        _, keys, vectors = tables[1]
        sel = np.array([keys[3], 10**9, keys[0]], np.int64)  # a key no tier has: the default value
        out = np.zeros((3, WIDTHS[1]), np.float32)
        hps.lookup_fromdlpack(sel, out, "audit", 1)
        np.testing.assert_array_equal(out, np.stack([vectors[3], np.full(WIDTHS[1], 0.5, np.float32), vectors[0]]))
        np.testing.assert_array_equal(out, hps.lookup(sel, "audit", 1))
        with pytest.raises(ValueError, match="holds 8 values; 3 keys x embedding_vec_size 8 of table 1 = 24"):
            hps.lookup_fromdlpack(sel, np.zeros(8, np.float32), "audit", 1)
        with pytest.raises(ValueError, match="read-only"):
            ro = np.zeros(24, np.float32)
            ro.flags.writeable = False
            hps.lookup_fromdlpack(sel, ro, "audit", 1)
        with pytest.raises(TypeError, match="DLPack capsule"):
            hps.lookup_fromdlpack([1, 2], out, "audit", 1)
        with pytest.raises(ValueError, match="at most"):
            hps.lookup_fromdlpack(np.zeros(N_KEYS + 1, np.int64), np.zeros((N_KEYS + 1) * 8, np.float32), "audit", 1)
        with pytest.raises(KeyError, match="does not exist in HPS"):
            hps.lookup_fromdlpack(sel, out, "nope", 1)
        with pytest.raises(IndexError, match="tables 0..1"):
            hps.lookup_fromdlpack(sel, out, "audit", 2)
    finally:
        hps.ps.close()


# ---- 4. hit_rate_threshold ---------------------------------------------------------------------------------
def test_hit_rate_threshold_above_one_disables_asynchronous_inserts(tables):
    """> 1 (HugeCTR's documented way to turn asynchronous inserts off): a request whose misses a 10% cache
    cannot hold is answered exactly; 0 (and a negative value, which HugeCTR accepts alike) answers a cold
    request's misses with the default value."""
    for thr in (1.5, 2, 1e9):
        p = InferenceParams(
            model_name="m",
            max_batchsize=8,
            hit_rate_threshold=thr,
            dense_model_file="",
            sparse_model_files=["x"],
            use_gpu_embedding_cache=True,
            cache_size_percentage=0.5,
            i64_input_key=True,
        )
        assert p.hit_rate_threshold == thr
    for bad in (math.nan, math.inf, "1"):
        with pytest.raises(ValueError, match="hit_rate_threshold"):
            InferenceParams(
                model_name="m",
                max_batchsize=8,
                hit_rate_threshold=bad,
                dense_model_file="",
                sparse_model_files=["x"],
                use_gpu_embedding_cache=True,
                cache_size_percentage=0.5,
                i64_input_key=True,
            )
    _, keys, vectors = tables[0]
    for thr, exact in ((2.0, True), (0.0, False), (-1.0, False)):
        hps = _hps(tables, hit_rate_threshold=thr, cache_size_percentage=0.1, default_value_for_each_table=[0.25])
        try:
            for rep in range(3):
                idx = np.random.default_rng(rep).permutation(N_KEYS)[:200]
                got = hps.lookup(keys[idx], "audit", 0)
                wrong = np.abs(got - vectors[idx]).max(1) > 0
                if exact:
                    assert not wrong.any(), (thr, rep)
                else:
                    assert wrong.any() and (got[wrong] == 0.25).all(), (thr, rep)
        finally:
            hps.ps.close()


# ---- 5. top-level enums ------------------------------------------------------------------------------------
def test_database_enums_on_the_top_level_module():
    import hugectr as hc  # numbactr's alias
    from hugectr import DatabaseOverflowPolicy_t, DatabaseType_t as DT, UpdateSourceType_t  # noqa: F401

    assert hc.DatabaseType_t.redis_cluster is DT.RedisCluster is hugectr.inference.DatabaseType_t.RedisCluster
    assert hc.DatabaseType_t.rocks_db is DT.RocksDB and hc.DatabaseType_t.parallel_hash_map is DT.ParallelHashMap
    assert hc.DatabaseOverflowPolicy_t.evict_least_used is DatabaseOverflowPolicy_t.EvictLeastUsed
    assert hc.UpdateSourceType_t.kafka_message_queue is UpdateSourceType_t.KafkaMessageQueue
    # pybind's export_values(): the members under HugeCTR's names on the module itself
    assert hc.redis_cluster is DT.RedisCluster and hc.hash_map is DT.HashMap and hc.null is UpdateSourceType_t.Null
    assert hc.evict_oldest is DatabaseOverflowPolicy_t.EvictOldest
    assert hugectr.inference.dynamic is hugectr.inference.EmbeddingCacheType_t.Dynamic
    assert [m.name for m in DT] == [
        "Disabled",
        "HashMap",
        "ParallelHashMap",
        "MultiProcessHashMap",
        "RedisCluster",
        "RocksDB",
    ]
    vol = VolatileDatabaseParams(type=hc.DatabaseType_t.redis_cluster, overflow_policy=hc.evict_random)
    assert vol.type is DT.RedisCluster
    with pytest.raises(
        ValueError,
        match=r"\(Disabled, HashMap, ParallelHashMap, MultiProcessHashMap, "
        r"RedisCluster, RocksDB\)",
    ):
        PersistentDatabaseParams(backend="rocks_db")


# ---- 6. default_value_for_each_table, dense_model_file "" --------------------------------------------------
def test_default_values_of_the_wrong_length_warn_and_use_the_first(tables):
    with pytest.warns(IgnoredArgumentWarning, match="3 values for 2 embedding tables.*first value \\(0.5\\)"):
        hps = _hps(tables, default_value_for_each_table=[0.5, 0.1, 0.2])
    try:
        assert hps.config.models["audit"].params.default_value_for_each_table == [0.5, 0.5]
        for t in range(2):
            np.testing.assert_array_equal(
                hps.lookup(np.array([10**9]), "audit", t), np.full((1, WIDTHS[t]), 0.5, np.float32)
            )
    finally:
        hps.ps.close()
    with pytest.warns(IgnoredArgumentWarning, match="0 values for 2"):
        hps = _hps(tables, default_value_for_each_table=[])
    hps.ps.close()
    assert hps.config.models["audit"].params.default_value_for_each_table == [0.0, 0.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one value for every table: no warning
        hps = _hps(tables, default_value_for_each_table=[0.3])
    hps.ps.close()


def test_empty_dense_model_file_loads_no_dense_weights(tmp_path, capsys):
    """HugeCTR's InferenceSession loads the dense model only when its name is not empty: the weights stay as
    created (numbactr: zeros, so every prediction of a sigmoid head is 0.5), with a warning."""
    from numbactr.runtime import device
    from tests.test_inference import csr_request, eval_batches, train

    device.set_device("cpu")
    tr = train("multihot_mean", tmp_path)
    request = csr_request(tr, eval_batches(tr, 1)[0])
    capsys.readouterr()
    session = CreateInferenceSession(tr.graph, tr.params(dense_model_file=""))
    assert "dense_model_file is empty" in capsys.readouterr().err
    got = np.asarray(session.predict(*request))
    assert got.size and (got == 0.5).all()
    session.close()
    trained = CreateInferenceSession(tr.graph, tr.params())
    assert not (np.asarray(trained.predict(*request)) == 0.5).all()
    trained.close()
    assert not os.path.exists(os.path.join(str(tmp_path), ".ntp.json"))
