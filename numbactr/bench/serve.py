"""``numbactr bench serve``: ``numbactr serve`` under load over loopback, beside InferenceSession in-process.

    numbactr bench serve [--quick] [--seconds S] [--clients 1,8,64] [--batches 1,64,512] [--delay-us N]
                         [--faults] [--json PATH]

The model is ``numbactr bench inference``'s DLRM (13 dense features, 26 one-hot slots, random weights;
--quick: 500 keys a slot), written into a Triton repository by serve-export (dynamic batching: max_batch_size
the largest --batches x 8, preferred sizes none, --delay-us queue delay) and served by a ``numbactr serve``
process on a free 127.0.0.1 port, stopped at the end. For each number of clients and batch size the
clients (threads of this process, each with its own tritonclient.http connection, binary tensors) send
requests back to back for --seconds; every answer is compared with InferenceSession.predict of the same
request computed beforehand (equal to float rounding: a request batched with others may round its last
bit differently), so the table counts failed and wrong answers beside the throughput and the p50 / p99
latency. The in-process row is InferenceSession.predict called directly with the same requests: the
difference is the server's own cost (HTTP, JSON, batching). The clients share this process's GIL, so many
clients measure the client side too: the figures are a floor of what the server does.

With --faults, a second table (fault_run): under 8 clients' load a damaged version is copied into the
repository, then the server is killed (SIGKILL) and restarted; it counts the answers, the wrong ones, the
failed (first fault) and the retried and lost requests (second fault: the clients retry on new
connections while the server is down), and what the server serves afterwards. Third (redis_fault, when a
redis-server is installed): the model served through an HPS JSON (--backend-config) with a Redis volatile
tier in front of RocksDB and no embedding cache (so that every batch's lookups reach Redis); under the same load
Redis is killed (SIGKILL) and started again, empty, on the same port. The server answers from RocksDB
meanwhile (numbactr.serve.tiers), so no request may fail or be wrong; the row says how long Redis was
down, how many lookups RocksDB answered alone, and how many rows Redis holds again afterwards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from numbactr.bench.common import Table
from numbactr.bench.inference import _ints, _params, build_model, make_requests

QUICK = dict(clients=(1, 8), batches=(1, 64), seconds=0.5, keys=500)
FULL = dict(clients=(1, 8, 64), batches=(1, 64, 512), seconds=3.0, keys=10_000)
START_TIMEOUT = 300.0  # seconds for the server to load (a cold numba cache compiles the kernels)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(httpclient, request):
    out = []
    for name, a, dt in zip(("DES", "CATCOLUMN", "ROWINDEX"), request, ("FP32", "INT64", "INT32")):
        a = np.ascontiguousarray(a.reshape(1, -1), {"FP32": np.float32, "INT64": np.int64, "INT32": np.int32}[dt])
        t = httpclient.InferInput(name, list(a.shape), dt)
        t.set_data_from_numpy(a, binary_data=True)
        out.append(t)
    return out


def drive(url: str, model: str, requests: list, expected: list, clients: int, seconds: float, retry_s=0.0) -> dict:
    """`clients` threads sending requests (cycling; each at least one) for `seconds`: {"latencies" (s, per
    answer), "failed", "wrong", "retried", "lost", "wall"}; an answer is wrong when it is not expected's to
    float rounding. With retry_s a request that fails (the server gone, say) is sent again on a new
    connection until answered or retry_s after the end: "retried" counts the failed tries, "lost" the
    requests never answered, and its latency includes the retries."""
    import tritonclient.http as httpclient

    lat, lock = [], threading.Lock()
    counts = {"failed": 0, "wrong": 0, "retried": 0, "lost": 0}
    start = time.perf_counter()
    end = start + seconds

    def count(key):
        with lock:
            counts[key] += 1

    def client(k):
        c = httpclient.InferenceServerClient(url, network_timeout=120.0)
        mine, i = [], k
        while i == k or time.perf_counter() < end:
            r, got = i % len(requests), None
            i += clients
            t = time.perf_counter()
            while got is None:
                try:
                    got = c.infer(model, _inputs(httpclient, requests[r])).as_numpy("OUTPUT0").reshape(-1)
                except Exception:  # noqa: BLE001 (a failure is counted; the load goes on)
                    if not retry_s or time.perf_counter() > end + retry_s:
                        count("lost" if retry_s else "failed")
                        break
                    count("retried")
                    time.sleep(0.05)
                    c = httpclient.InferenceServerClient(url, network_timeout=120.0)
            if got is None:
                continue
            mine.append(time.perf_counter() - t)
            if not (got.shape == expected[r].shape and np.allclose(got, expected[r], rtol=2e-6, atol=1e-7)):
                count("wrong")
        c.close()
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return dict(latencies=np.asarray(lat), wall=time.perf_counter() - start, **counts)


def start_server(repo: str, port: int, log_path: str, extra=()):
    cmd = [sys.executable, "-c", "import sys; from numbactr.cli import main; sys.exit(main())", "serve"]
    cmd += ["--model-repository", repo, "--http-port", str(port), "--http-address", "127.0.0.1", *extra]
    log = open(log_path, "a")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    import tritonclient.http as httpclient

    client, deadline = httpclient.InferenceServerClient(f"127.0.0.1:{port}"), time.monotonic() + START_TIMEOUT
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"numbactr serve exited ({proc.returncode}): {open(log_path).read()[-2000:]}")
        try:
            if client.is_server_ready():
                return proc
        except Exception:  # noqa: BLE001 (not listening yet)
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"numbactr serve was not ready in {START_TIMEOUT:.0f} s")
        time.sleep(0.2)


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)


def repository(folder: str, keys: int, mbs: int, delay_us: int, seed: int) -> dict:
    """The benchmark model's files, exported as model "dlrm" version 1 of <folder>/repo."""
    from numbactr.serve.command import export

    files = build_model(folder, keys, seed)
    files["repo"] = os.path.join(folder, "repo")
    export(
        argparse.Namespace(
            graph=files["graph"], dense=files["dense"], sparse=files["sparse"], model_repository=files["repo"],
            model="dlrm", version=1, max_batch_size=mbs, preferred_batch_size=[], max_queue_delay_us=delay_us,
            i32_keys=False, gpucacheper=1.0, hit_rate_threshold=1.0,
        )
    )  # fmt: skip
    return files


def bench_serve(clients, batches, seconds, keys, delay_us=500, seed=0) -> Table:
    from numbactr.inference import CreateInferenceSession

    rng = np.random.default_rng(seed)
    table = Table(
        "numbactr serve over loopback (tritonclient.http, binary tensors) vs InferenceSession in-process",
        ["clients", "batch", "requests", "preds/s", "p50 ms", "p99 ms", "failed", "wrong"],
    )
    with tempfile.TemporaryDirectory(prefix="numbactr-bench-serve-") as folder:
        mbs = max(batches) * 8
        files = repository(folder, keys, mbs, delay_us, seed)
        repo = files["repo"]
        session = CreateInferenceSession(files["graph"], _params(files, mbs, 1.0))
        work = {}
        for b in batches:
            reqs = [(d, k, r.astype(np.int32)) for d, k, r in make_requests(b, 8, keys, rng)]
            work[b] = (reqs, [np.float32(session.predict(*r)) for r in reqs])
            t0, times, i = time.perf_counter(), [], 0
            while time.perf_counter() - t0 < seconds or len(times) < 3:
                t = time.perf_counter()
                session.predict(*reqs[i % len(reqs)])
                times.append(time.perf_counter() - t)
                i += 1
            ms = np.percentile(times, [50, 99]) * 1e3
            table.add("in-process", b, len(times), b * len(times) / sum(times), ms[0], ms[1], 0, 0)
        session.close()
        port = _free_port()
        proc = start_server(repo, port, os.path.join(folder, "server.log"))
        try:
            for c in clients:
                for b in batches:
                    reqs, want = work[b]
                    drive(f"127.0.0.1:{port}", "dlrm", reqs[:1], want[:1], 1, 0.0)  # a warm connection path
                    r = drive(f"127.0.0.1:{port}", "dlrm", reqs, want, c, seconds)
                    n = r["latencies"].size
                    ms = np.percentile(r["latencies"], [50, 99]) * 1e3 if n else (float("nan"),) * 2
                    table.add(c, b, n, b * n / r["wall"], ms[0], ms[1], r["failed"], r["wrong"])
        finally:
            stop(proc)
    table.notes.append(
        f"model: DLRM, 26 slots x {keys} keys, 13 dense; max_batch_size {mbs}, max_queue_delay {delay_us} us; "
        f"{seconds} s per row; clients are threads of one process (its GIL limits them)"
    )
    return table


def _background(fn):
    """(a dict that gets fn()'s result, the thread running it)."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(fn()))
    thread.start()
    return out, thread


def _damage(repo: str, version: int) -> None:
    """<repo>/dlrm/<version>/: version 1 with its dense file cut in half, renamed into place whole."""
    stage = os.path.join(repo, f".stage{version}")
    shutil.copytree(os.path.join(repo, "dlrm", "1"), stage)
    (dense,) = [f for f in os.listdir(stage) if "_dense_" in f]
    with open(os.path.join(stage, dense), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(stage, dense)) // 2)
    os.rename(stage, os.path.join(repo, "dlrm", str(version)))


def fault_run(seconds, keys, clients=8, batch=16, delay_us=500, seed=0) -> Table:
    """Two faults under the load of `clients` clients (requests of `batch` samples), each answer checked:
    a damaged version copied into the repository (the server, polling, must keep serving version 1 and
    say why), then ``kill -9`` of the server and a restart on the same port (the clients retry on new
    connections; the restarted server must serve version 1, the last good one, again)."""
    import tritonclient.http as httpclient

    from numbactr.inference import CreateInferenceSession

    rng = np.random.default_rng(seed)
    table = Table(
        f"numbactr serve under faults: {clients} clients, {batch} samples a request, every answer checked",
        ["fault", "answered", "wrong", "failed", "retried", "lost", "after"],
    )
    with tempfile.TemporaryDirectory(prefix="numbactr-bench-serve-faults-") as folder:
        files = repository(folder, keys, batch * clients, delay_us, seed)
        session = CreateInferenceSession(files["graph"], _params(files, batch, 1.0))
        reqs = [(d, k, r.astype(np.int32)) for d, k, r in make_requests(batch, 8, keys, rng)]
        want = [np.float32(session.predict(*r)) for r in reqs]
        graph = session.graph
        session.close()
        port, log = _free_port(), os.path.join(folder, "server.log")
        url, poll = f"127.0.0.1:{port}", ["--model-control-mode", "poll", "--repository-poll-secs", "0.2"]
        proc = start_server(files["repo"], port, log, poll)
        try:
            out, thread = _background(lambda: drive(url, "dlrm", reqs, want, clients, 2 * seconds))
            time.sleep(seconds / 2)
            _damage(files["repo"], 2)
            thread.join()
            meta = httpclient.InferenceServerClient(url).get_model_metadata("dlrm")
            after = (
                f"serves version {meta['versions'][0]}; reason shown: {'version 2' in meta.get('last_load_error', '')}"
            )
            table.add("damaged version 2", out["latencies"].size, out["wrong"], out["failed"], 0, 0, after)
            out, thread = _background(lambda: drive(url, "dlrm", reqs, want, clients, 2 * seconds, START_TIMEOUT))
            time.sleep(seconds / 2)
            proc.kill()  # kill -9
            proc.wait()
            down = time.perf_counter()
            proc = start_server(files["repo"], port, log, poll)
            down = time.perf_counter() - down
            thread.join()
            meta = httpclient.InferenceServerClient(url).get_model_metadata("dlrm")
            after = f"down {down:.1f} s; serves version {meta['versions'][0]}"
            table.add("kill -9, restart", out["latencies"].size, out["wrong"], 0, out["retried"], out["lost"], after)
        finally:
            stop(proc)
        if shutil.which("redis-server") is None:
            table.notes.append("Redis restart: not run (no redis-server installed)")
        else:
            redis_fault(table, folder, files, graph, reqs, want, seconds, clients, batch * clients)
    return table


def redis_fault(table, folder, files, graph, reqs, want, seconds, clients, mbs) -> None:
    """The third fault (module docstring): a row of `table`."""
    import json

    rport, port = _free_port(), _free_port()
    log = os.path.join(folder, "server-redis.log")
    redis = start_redis(folder, rport)
    proc = None
    try:
        ps = hps_json(folder, files, graph, rport, mbs)
        proc = start_server(files["repo"], port, log, [f"--backend-config=hugectr,ps={ps}"])
        url = f"127.0.0.1:{port}"
        out, thread = _background(lambda: drive(url, "dlrm", reqs, want, clients, 2 * seconds + 1.0))
        time.sleep(seconds / 2)
        redis.kill()  # kill -9: the tier and its rows are gone
        redis.wait()
        time.sleep(0.5 + seconds / 2)
        redis = start_redis(folder, rport)  # back on the same port, empty
        thread.join()
        time.sleep(0.3)
        events = [json.loads(x) for x in open(log) if x.startswith('{"ts"') and '"event"' in x]
        up = [e for e in events if e["event"] == "hps_tier_up"]
        down = sum(e["event"] == "hps_tier_down" for e in events)
        after = (
            f"tier down {down}x, back {len(up)}x after {up[-1]['down_s'] if up else '-'} s; "
            f"{sum(e['lookups_answered_below'] for e in up)} lookups answered by RocksDB alone; "
            f"Redis holds {_redis_rows(rport)} rows again"
        )
        table.add("Redis restart", out["latencies"].size, out["wrong"], out["failed"], 0, 0, after)
        table.notes.append(
            "Redis restart: HPS JSON with a Redis volatile tier (every key at start, cache_missed_embeddings) "
            "before RocksDB, embedding cache off; Redis killed (SIGKILL) and started empty on the same port"
        )
    finally:
        if proc is not None:
            stop(proc)
        redis.kill()
        redis.wait()


def start_redis(folder: str, port: int):
    """A redis-server on 127.0.0.1:port (no persistence: a restart starts it empty), answering PING."""
    import redis

    cmd = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--dir", folder, "--save", ""]
    proc = subprocess.Popen(cmd + ["--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client, deadline = redis.Redis(port=port), time.monotonic() + 30
    try:
        while True:
            try:
                client.ping()
                return proc
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"redis-server on port {port} did not start") from None
                time.sleep(0.05)
    finally:
        client.close()


def _redis_rows(port: int) -> int:
    import redis

    client = redis.Redis(port=port)
    try:
        return sum(client.hlen(k) for k in client.scan_iter())
    finally:
        client.close()


def hps_json(folder: str, files: dict, graph, redis_port: int, mbs: int, rocksdb: bool = True) -> str:
    """An HPS JSON serving the benchmark model (graph: its InferenceSession's) through Redis (volatile)
    and RocksDB (persistent; none without rocksdb), without an embedding cache."""
    import json

    vdir = os.path.join(files["repo"], "dlrm", "1")
    model = {
        "model": "dlrm",
        "network_file": os.path.join(vdir, os.path.basename(files["graph"])),
        "dense_file": os.path.join(vdir, os.path.basename(files["dense"])),
        "sparse_files": [os.path.join(vdir, os.path.basename(s.rstrip(os.sep))) for s in files["sparse"]],
        "deployed_device_list": [0],
        "max_batch_size": mbs,
        "hit_rate_threshold": 1.0,
        "gpucache": False,  # every lookup goes to the tiers: Redis is used by every batch
        "gpucacheper": 0.05,
        "default_value_for_each_table": [0.0] * len(graph.embeddings),
        "embedding_vecsize_per_table": [e.embedding_vec_size for e in graph.embeddings],
        "maxnum_catfeature_query_per_table_per_sample": [
            graph.sparse_param(e).max_feature_num for e in graph.embeddings
        ],
    }
    doc = {
        "supportlonglong": True,
        "volatile_db": {
            "type": "redis_cluster",
            "address": f"127.0.0.1:{redis_port}",
            "num_partitions": 4,
            "initial_cache_rate": 1.0,
            "cache_missed_embeddings": True,
        },
        "persistent_db": {"type": "rocks_db" if rocksdb else "disabled", "path": os.path.join(folder, "rocks")},
        "models": [model],
    }
    path = os.path.join(folder, "ps.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="numbactr bench serve",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    ap.add_argument("--quick", action="store_true", help="1 and 8 clients, batches 1 and 64, 0.5 s a row")
    ap.add_argument("--seconds", type=float, default=None, help="seconds of load per row (default 3, --quick 0.5)")
    ap.add_argument("--clients", type=_ints, default=None, help="comma-separated client counts (default 1,8,64)")
    ap.add_argument(
        "--batches", type=_ints, default=None, help="comma-separated samples per request (default 1,64,512)"
    )
    ap.add_argument("--delay-us", type=int, default=500, help="max_queue_delay_microseconds (default: %(default)s)")
    ap.add_argument("--faults", action="store_true", help="then the faults: a damaged version, kill -9 and restart")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the results there as JSON")
    args = ap.parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL)
    for key in ("clients", "batches", "seconds"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    if sizes["seconds"] <= 0 or sizes["seconds"] > 60:
        ap.error(f"--seconds must be in (0, 60], got {sizes['seconds']}")
    load = [os.getloadavg()]
    table = bench_serve(delay_us=args.delay_us, **sizes)
    print(table.markdown(), flush=True)
    faults = None
    if args.faults:
        faults = fault_run(sizes["seconds"], sizes["keys"], delay_us=args.delay_us)
        print(faults.markdown(), flush=True)
    load.append(os.getloadavg())
    if args.json:
        from numbactr.bench import results

        rows = []
        for clients, batch, n, rate, p50, p99, failed, wrong in table.raw:
            impl = "InferenceSession" if clients == "in-process" else "numbactr serve"
            shape = dict(batch=batch, clients=0 if clients == "in-process" else clients)
            for metric, v in (
                ("preds/s", rate),
                ("p50 ms", p50),
                ("p99 ms", p99),
                ("failed", failed),
                ("wrong", wrong),
            ):
                rows.append(dict(name=table.title, implementation=impl, metric=metric, value=float(v), **shape))
        for fault, *counts, _ in faults.raw if faults else []:
            for metric, v in zip(faults.columns[1:-1], counts):
                rows.append(
                    dict(name=faults.title, implementation="numbactr serve", metric=metric, value=float(v), fault=fault)
                )
        notes = list(table.notes) + (faults.notes if faults else [])
        notes += [f"fault {fault!r}: {after}" for fault, *_, after in (faults.raw if faults else [])]
        notes.append(
            f"machine load (1/5/15-minute averages, {os.cpu_count()} cores, shared): at the start "
            + ", at the end ".join("/".join(f"{x:.1f}" for x in avg) for avg in load)
        )
        doc = results.document(rows, command=["numbactr", "bench", "serve", *(argv or [])], notes="\n".join(notes))
        print(f"numbactr bench serve: results written to {results.write(args.json, doc)}")
    return 0
