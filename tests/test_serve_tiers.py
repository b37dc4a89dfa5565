"""A Redis volatile tier that goes down under the server (numbactr.serve.tiers) with a real redis-server
stopped and started again on the same port: with RocksDB behind it every lookup stays exact and fast, a
refresh is refused, and the tier is used (and refilled) again once it is back; without a persistent tier
a lookup fails with BackendError (the server's 503) instead of answering default rows."""

from __future__ import annotations

import subprocess
import time
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.inference import (
    HPS,
    BackendError,
    DatabaseType_t,
    InferenceParams,
    ParameterServerConfig,
    PersistentDatabaseParams,
    VolatileDatabaseParams,
)
from numbactr.serve import refresh
from numbactr.serve.tiers import GuardedTier, guard
from tests import redis_util
from tests.redis_util import REDIS

D, N = 4, 50


def _redis(folder, port):
    """A redis-server on the given port (its data lost when it stops: no persistence)."""
    import redis

    proc = subprocess.Popen(
        [REDIS, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(folder), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client, deadline = redis.Redis(port=port), time.monotonic() + 30
    while True:
        try:
            client.ping()
            client.close()
            return proc
        except redis.ConnectionError:
            assert proc.poll() is None and time.monotonic() < deadline, f"redis-server on {port} did not start"
            time.sleep(0.05)


def _hps(folder, port, persistent: bool):
    rng = np.random.default_rng(0)
    keys, rows = np.arange(N, dtype=np.int64) * 13 + 1, rng.normal(size=(N, D)).astype(np.float32)
    (folder / "emb").mkdir(exist_ok=True)
    keys.astype("<i8").tofile(folder / "emb" / "key")
    rows.astype("<f4").tofile(folder / "emb" / "emb_vector")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hugectr.IgnoredArgumentWarning)
        vdb = VolatileDatabaseParams(
            type=DatabaseType_t.RedisCluster,
            address=f"127.0.0.1:{port}",
            num_partitions=2,
            cache_missed_embeddings=True,
        )
    pdb = PersistentDatabaseParams(
        backend=DatabaseType_t.RocksDB if persistent else DatabaseType_t.Disabled, path=str(folder / "rocks")
    )
    p = InferenceParams(
        model_name="m",
        max_batchsize=64,
        hit_rate_threshold=1.0,
        dense_model_file=str(folder / "dense.model"),
        sparse_model_files=[str(folder / "emb")],
        use_gpu_embedding_cache=False,
        cache_size_percentage=1.0,
        i64_input_key=True,
        volatile_db=vdb,
        persistent_db=pdb,
    )
    return HPS(ParameterServerConfig({"m": ["emb"]}, {"m": [D]}, {"m": [2]}, [p], vdb, pdb)).ps, keys, rows


@pytest.fixture
def port(tmp_path):
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run installs it)")
    return redis_util.free_port()


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def test_redis_restart_with_rocksdb_behind_answers_exactly_and_recovers(tmp_path, port, capfd):
    proc = _redis(tmp_path, port)
    ps, keys, rows = _hps(tmp_path, port, persistent=True)
    try:
        guard(ps)
        tier = ps.volatile
        assert isinstance(tier, GuardedTier) and tier.fallback
        order = np.random.default_rng(1).permutation(N)
        ask = keys[order].astype(np.uint64)
        got, found = ps.lookup("m", 0, ask)
        assert found.all() and np.array_equal(got, rows[order])
        redis_util.stop(proc)  # the tier goes away (and its rows with it)
        for _ in range(3):
            (got, found), took = _timed(lambda: ps.lookup("m", 0, ask))
            assert found.all() and np.array_equal(got, rows[order]) and took < 2.0
        assert tier.down_since is not None and tier.skipped >= 2
        with pytest.raises(BackendError, match="is down"):  # a refresh needs every tier
            tier.strict = True
            try:
                ps.update("m", 0, keys[:2], np.zeros((2, D), np.float32))
            finally:
                tier.strict = False
        assert np.array_equal(ps.lookup("m", 0, keys[:2].astype(np.uint64))[0], rows[:2])  # nothing written
        proc = _redis(tmp_path, port)  # back, empty
        deadline = time.monotonic() + 10
        while tier.down_since is not None:
            assert time.monotonic() < deadline, "the tier was not put back within 10 s"
            time.sleep(0.05)
        got, found = ps.lookup("m", 0, ask)
        assert found.all() and np.array_equal(got, rows[order])
        assert tier.size("hps_et.m.emb") == N  # the persistent tier's answers moved up into Redis again
        log = capfd.readouterr().err
        assert '"event":"hps_tier_down"' in log and '"answers":"from the persistent tier"' in log
        assert '"event":"hps_tier_up"' in log
    finally:
        ps.close()
        redis_util.stop(proc)


def test_redis_down_without_a_persistent_tier_is_an_error_not_default_rows(tmp_path, port):
    proc = _redis(tmp_path, port)
    ps, keys, rows = _hps(tmp_path, port, persistent=False)
    try:
        guard(ps)
        assert not ps.volatile.fallback and ps.volatile.rows == {"hps_et.m.emb": N}
        assert np.array_equal(ps.lookup("m", 0, keys.astype(np.uint64))[0], rows)
        # a refresh that evicts two keys: the tier must come back holding N - 2 rows
        session = SimpleNamespace(params=SimpleNamespace(model_name="m"), ps=ps)
        none, gone = np.zeros(0, np.uint64), keys[:2].astype(np.uint64)
        refresh.apply(session, [refresh.Update(0, "emb", none, np.zeros((0, D), np.float32), gone)])
        assert ps.volatile.rows == {"hps_et.m.emb": N - 2} and not ps.volatile.strict
        redis_util.stop(proc)
        for _ in range(2):
            with pytest.raises(BackendError, match=f"127.0.0.1:{port}.*is down"):
                ps.lookup("m", 0, keys.astype(np.uint64))
        proc = _redis(tmp_path, port)  # back, but empty: its rows are lost, not answered as defaults
        deadline = time.monotonic() + 10
        while not ps.volatile.lost:
            assert time.monotonic() < deadline, "the lost rows were not noticed within 10 s"
            time.sleep(0.05)
        with pytest.raises(BackendError, match=f"without its rows \\(hps_et.m.emb: 0 of {N - 2}\\)"):
            ps.lookup("m", 0, keys.astype(np.uint64))
    finally:
        ps.close()
        redis_util.stop(proc)


def test_the_server_answers_503_while_its_only_tier_is_down_and_again_after_a_restart(tmp_path, port, monkeypatch):
    """``numbactr serve`` through an HPS JSON with Redis alone: 503 naming the tier while Redis is down and
    after it came back empty; a restarted server fills it again and answers exactly."""
    httpclient = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import InferenceServerException

    from numbactr.bench.inference import _params, make_requests
    from numbactr.bench.serve import _free_port, _inputs, hps_json, repository, start_redis, start_server, stop
    from numbactr.inference import CreateInferenceSession

    folder = str(tmp_path)
    files = repository(folder, 20, 8, 0, 0)
    session = CreateInferenceSession(files["graph"], _params(files, 8, 1.0))
    (req,) = [(d, k, r.astype(np.int32)) for d, k, r in make_requests(4, 1, 20, np.random.default_rng(0))]
    want = np.float32(session.predict(*req))
    ps = hps_json(folder, files, session.graph, port, 8, rocksdb=False)
    session.close()
    redis = start_redis(folder, port)
    proc, http = None, _free_port()
    try:
        monkeypatch.setenv("NUMBACTR_DEVICE", "cpu")  # the server process's device
        proc = start_server(files["repo"], http, str(tmp_path / "server.log"), [f"--backend-config=hugectr,ps={ps}"])
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
        ask = lambda: client.infer("dlrm", _inputs(httpclient, req)).as_numpy("OUTPUT0").reshape(-1)  # noqa: E731
        assert np.array_equal(ask(), want)
        redis.kill()
        redis.wait()
        with pytest.raises(InferenceServerException, match="unavailable: the volatile database tier .* is down"):
            ask()
        redis = start_redis(folder, port)  # back, empty
        deadline = time.monotonic() + 10
        while True:
            with pytest.raises(InferenceServerException, match="is down") as e:
                ask()
            if "without its rows" in str(e.value):
                break
            assert time.monotonic() < deadline, "the lost rows were not reported within 10 s"
            time.sleep(0.1)
        assert "load the model again" in str(e.value)
        stop(proc)
        proc = start_server(files["repo"], http, str(tmp_path / "server.log"), [f"--backend-config=hugectr,ps={ps}"])
        assert np.array_equal(ask(), want)  # a restarted server filled Redis again
    finally:
        if proc is not None:
            stop(proc)
        redis.kill()
        redis.wait()
