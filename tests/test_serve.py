"""``numbactr serve`` as a real process, called with NVIDIA's own client (tritonclient.http).

Two tiny trained models are written into a Triton repository by ``numbactr serve-export``: a DLRM with a
one-hot table (per-slot ids, so out-of-range keys exist) and a Wide&Deep with two hash tables. One server
process serves both on a free 127.0.0.1 port for the whole module (stopped in the fixture's teardown).
Its predictions equal InferenceModel's and InferenceSession's on the same rows bit for bit, with binary
and JSON tensors, one client or many at once (dynamic batching); every bad request gets a 4xx naming
what is wrong and the server answers the next one; /metrics and the JSON access log say what happened.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import socket
import time

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.cli import main as cli
from numbactr.data import make_reader
from numbactr.inference import CreateInferenceSession, InferenceModel, InferenceParams
from numbactr.runtime import device
from tests.model_util import one_hot_lists, tiny_data, tiny_dlrm
from tests.sample_graphs import build
from tests.serve_util import free_port, serve_process

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITER = 2


def _train(name, folder):
    """(graph, dense, sparse, eval list) of a model trained ITER steps."""
    if name == "dlrm":
        emb = hugectr.Embedding_t.LocalizedSlotSparseEmbeddingOneHot
        train, evl = tiny_data(folder, n_train=128, n_eval=64)
        m, evl = tiny_dlrm(train, evl, batch=32, embedding=emb), one_hot_lists(emb, evl)[0]
    else:
        m, evl = build(name, folder), os.path.join(folder, "eval", "_file_list.txt")
    m.fit(max_iter=ITER, display=0, eval_interval=1000, snapshot=0)
    graph, prefix = os.path.join(folder, f"{name}.json"), os.path.join(folder, name)
    m.graph_to_json(graph)
    m.save_params_to_files(prefix, ITER)
    return (
        graph,
        f"{prefix}_dense_{ITER}.model",
        [f"{prefix}{i}_sparse_{ITER}.model" for i in range(len(m.embeddings))],
        evl,
    )


_free_port = free_port  # (the other server tests import it from here)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{"url", "port", "log", "models": {name: (graph, dense, sparse, eval)}, "repo"}, the server running."""
    device.set_device("cpu")
    base = tmp_path_factory.mktemp("serve")
    repo, models = str(base / "repo"), {}
    for name, extra in (("dlrm", ["--preferred-batch-size", "32", "--max-queue-delay-us", "20000"]), ("wdl", [])):
        models[name] = _train(name, str(base / name))
        graph, dense, sparse, _ = models[name]
        argv = ["serve-export", graph, "--dense", dense, "--sparse", *sparse, "--model-repository", repo]
        assert cli(argv + ["--model", name, "--max-batch-size", "32", *extra]) == 0
    metrics_port, log = _free_port(), str(base / "server.log")
    args = ["--model-control-mode", "poll", "--repository-poll-secs", "0.3", "--metrics-port", str(metrics_port)]
    with serve_process(repo, log, *args) as (proc, port, client):
        yield {
            "url": f"127.0.0.1:{port}",
            "port": port,
            "metrics_port": metrics_port,
            "log": log,
            "models": models,
            "repo": repo,
            "client": client,
        }


def _params(name, files, batch=32):
    graph, dense, sparse, _ = files
    return InferenceParams(
        model_name=name,
        max_batchsize=batch,
        hit_rate_threshold=1.0,
        dense_model_file=dense,
        sparse_model_files=sparse,
        use_gpu_embedding_cache=True,
        cache_size_percentage=0.5,
        i64_input_key=True,
    )


def _eval_batch(files, session):
    """The first eval batch of 32 as HugeCTR's CSR request: (dense (n*d,), keys, row_ptrs)."""
    g, evl = session.graph, files[3]
    params = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[evl], eval_source=evl, check_type=hugectr.Check_t.Sum
    )
    inp = g.input
    reader = make_reader(
        params, evl, 32, inp.label_dim, inp.dense_dim, [s.slot_num for s in inp.sparse],
        [s.nnz_per_slot for s in inp.sparse], True, True,
    )  # fmt: skip
    batch = next(iter(reader))
    reader.close()
    keys, rows = [], []
    for e in g.embeddings:
        k, off = batch.sparse[g.sparse_inputs[e.bottom_name]]
        keys.append(np.asarray(k, np.int64))
        rows.append(np.asarray(off, np.int32))
    return batch.dense.reshape(-1).astype(np.float32), np.concatenate(keys), np.concatenate(rows)


def _cut(session, request, n):
    """The first n samples of a CSR request."""
    dense, keys, rows = request
    d = session.graph.input.dense_dim
    out_k, out_r, r0, k0 = [], [], 0, 0
    for e in session.graph.embeddings:
        s = session.graph.sparse_param(e).slot_num
        total = (rows.size - len(session.graph.embeddings)) // sum(
            session.graph.sparse_param(x).slot_num for x in session.graph.embeddings
        )
        off = rows[r0 : r0 + total * s + 1]
        out_r.append(off[: n * s + 1])
        out_k.append(keys[k0 : k0 + off[n * s]])
        r0, k0 = r0 + total * s + 1, k0 + off[-1]
    return dense[: n * d], np.concatenate(out_k), np.concatenate(out_r)


def _infer(client, model, request, binary=True, binary_out=True):
    inputs = []
    for name, a in zip(("DES", "CATCOLUMN", "ROWINDEX"), request):
        a = a.reshape(1, -1)
        t = httpclient.InferInput(
            name, list(a.shape), {"float32": "FP32", "int64": "INT64", "int32": "INT32"}[a.dtype.name]
        )
        t.set_data_from_numpy(a, binary_data=binary)
        inputs.append(t)
    out = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary_out)]
    return client.infer(model, inputs, outputs=out).as_numpy("OUTPUT0")


@pytest.fixture(scope="module")
def sessions(served):
    made = {name: CreateInferenceSession(files[0], _params(name, files)) for name, files in served["models"].items()}
    yield made
    for s in made.values():
        s.close()


def test_health_metadata_and_config(served):
    c = served["client"]
    assert c.is_server_live() and c.is_server_ready()
    assert c.get_server_metadata()["name"] == "numbactr"
    meta = c.get_model_metadata("wdl")
    assert meta["versions"] == ["1"] and [t["name"] for t in meta["inputs"]] == ["DES", "CATCOLUMN", "ROWINDEX"]
    assert [t["datatype"] for t in meta["inputs"]] == ["FP32", "INT64", "INT32"]
    assert c.is_model_ready("dlrm") and c.is_model_ready("dlrm", "1")
    cfg = c.get_model_config("dlrm")
    assert cfg["max_batch_size"] == 32 and cfg["dynamic_batching"]["preferred_batch_size"] == [32]
    assert cfg["parameters"]["des_feature_num"]["string_value"] == "2"
    assert cfg["parameters"]["slots"]["string_value"] == "3"


@pytest.mark.parametrize("name", ["dlrm", "wdl"])
def test_predictions_equal_inference_model_bit_for_bit(served, sessions, name):
    files, session = served["models"][name], sessions[name]
    model = InferenceModel(files[0], _params(name, files))
    expected = model.predict(1, files[3], hugectr.DataReaderType_t.Norm, hugectr.Check_t.Sum).reshape(-1)
    model.close()
    request = _eval_batch(files, session)
    for binary in (True, False):
        got = _infer(served["client"], name, request, binary=binary, binary_out=binary)
        assert got.dtype == np.float32 and got.shape == (1, 32)
        assert np.array_equal(got.reshape(-1), expected)
    # fewer samples: the session's predictions of the same rows
    for n in (1, 7):
        cut = _cut(session, request, n)
        assert np.array_equal(_infer(served["client"], name, cut).reshape(-1), np.float32(session.predict(*cut)))


def test_concurrent_clients_are_batched_and_answered_exactly(served, sessions):
    session = sessions["dlrm"]
    request = _eval_batch(served["models"]["dlrm"], session)
    cuts = [_cut(session, request, 1 + i % 8) for i in range(24)]
    expected = [np.float32(session.predict(*c)) for c in cuts]
    before = _metric(served, 'nv_inference_exec_count_total{model="dlrm",version="1"}')

    def one(i):
        client = httpclient.InferenceServerClient(served["url"])
        return _infer(client, "dlrm", cuts[i], binary=i % 2 == 0).reshape(-1)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        got = list(pool.map(one, range(len(cuts))))
    # a request batched with others runs in a larger matrix product, whose float sums may round
    # differently in the last bit (BLAS blocking): equal to rounding, and exact alone (above) and for
    # the same batch (test_a_batch_is_one_session_call_split_back)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=2e-6, atol=1e-7)
    batches = _metric(served, 'nv_inference_exec_count_total{model="dlrm",version="1"}') - before
    assert 1 <= batches <= len(cuts)


def _post(served, path, body: bytes, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", served["port"], timeout=30)
    try:
        conn.request("POST", path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _json_request(request, **change):
    """A JSON body of request's tensors; change: name -> dict of fields to override (None drops the input)."""
    inputs = []
    for name, a, dt in zip(("DES", "CATCOLUMN", "ROWINDEX"), request, ("FP32", "INT64", "INT32")):
        item = {"name": name, "datatype": dt, "shape": [1, int(a.size)], "data": a.tolist()}
        if name in change:
            if change[name] is None:
                continue
            item.update(change[name])
        inputs.append(item)
    inputs += change.get("extra", [])
    return json.dumps({"inputs": inputs}).encode()


def _bad_requests(request, dlrm_rows):
    """(what, path, body, headers, expected status, words the error must hold)."""
    dense, keys, rows = request
    nan = dense.tolist()
    nan[3] = float("nan")
    out_of_range = keys.copy()
    out_of_range[4] = 6  # slot 1 of sample 1: per-slot ids are in [0, 6)
    bad_rows = rows.copy()
    bad_rows[2] = 0
    head = json.dumps(
        {"inputs": [{"name": n, "datatype": dt, "shape": [1, int(a.size)], "parameters": {"binary_data_size": a.nbytes}}
                    for n, a, dt in zip(("DES", "CATCOLUMN", "ROWINDEX"), request, ("FP32", "INT64", "INT32"))]}
    ).encode()  # fmt: skip
    raw = b"".join(a.tobytes() for a in request)
    infer = "/v2/models/dlrm/infer"
    return [
        ("unknown model", "/v2/models/nope/infer", _json_request(request), {}, 404, ["unknown model 'nope'"]),
        ("unknown version", "/v2/models/dlrm/versions/7/infer", _json_request(request), {}, 404, ["no version 7"]),
        ("missing input", infer, _json_request(request, ROWINDEX=None), {}, 400, ["missing input", "ROWINDEX"]),
        (
            "extra input",
            infer,
            _json_request(request, extra=[{"name": "X", "datatype": "FP32", "shape": [1, 1], "data": [1]}]),
            {},
            400,
            ["unknown input", "'X'"],
        ),  # fmt: skip
        (
            "wrong datatype",
            infer,
            _json_request(request, CATCOLUMN={"datatype": "INT32"}),
            {},
            400,
            ["CATCOLUMN", "INT64"],
        ),
        ("shape vs data", infer, _json_request(request, DES={"shape": [1, 5]}), {}, 400, ["DES", "shape [1, 5]"]),
        (
            "ROWINDEX vs slots",
            infer,
            _json_request(request, ROWINDEX={"data": rows[:-1].tolist(), "shape": [1, rows.size - 1]}),
            {},
            400,
            ["ROWINDEX", "need"],
        ),  # fmt: skip
        (
            "decreasing offsets",
            infer,
            _json_request(request, ROWINDEX={"data": bad_rows.tolist()}),
            {},
            400,
            ["ROWINDEX", "never decrease"],
        ),  # fmt: skip
        (
            "key count",
            infer,
            _json_request(request, CATCOLUMN={"data": keys[:-1].tolist(), "shape": [1, keys.size - 1]}),
            {},
            400,
            ["CATCOLUMN", "keys"],
        ),  # fmt: skip
        (
            "over max_batch_size",
            infer,
            _json_request((np.zeros(2 * 33, np.float32), np.zeros(99, np.int64), np.arange(100, dtype=np.int32))),
            {},
            400,
            ["33 samples", "max_batch_size 32"],
        ),  # fmt: skip
        ("malformed JSON", infer, b'{"inputs": [', {}, 400, ["not valid JSON"]),
        (
            "truncated binary",
            infer,
            head + raw[:-5],
            {"Inference-Header-Content-Length": str(len(head))},
            400,
            ["truncated"],
        ),  # fmt: skip
        ("non-finite dense", infer, _json_request(request, DES={"data": nan}), {}, 400, ["not finite", "sample 1"]),
        (
            "key out of its slot",
            infer,
            _json_request(request, CATCOLUMN={"data": out_of_range.tolist()}),
            {},
            400,
            ["key 6", "slot 1", "vocabulary"],
        ),  # fmt: skip
    ]


def test_bad_requests_get_4xx_naming_the_fault_and_the_server_keeps_serving(served, sessions):
    session = sessions["dlrm"]
    request = _cut(session, _eval_batch(served["models"]["dlrm"], session), 4)
    good = np.float32(session.predict(*request))
    for what, path, body, headers, status, words in _bad_requests(request, None):
        got, text = _post(served, path, body, headers)
        assert got == status, (what, got, text)
        err = json.loads(text)["error"]
        for w in words:
            assert w in err, (what, err)
        assert np.array_equal(_infer(served["client"], "dlrm", request).reshape(-1), good), what
    with pytest.raises(InferenceServerException, match="unknown model"):
        _infer(served["client"], "nope", request)
    # a hash table's reserved key -1: refused alone, before it could fail a batch shared with others
    wdl = _cut(sessions["wdl"], _eval_batch(served["models"]["wdl"], sessions["wdl"]), 3)
    keys = wdl[1].copy()
    keys[2] = -1
    status, text = _post(served, "/v2/models/wdl/infer", _json_request((wdl[0], keys, wdl[2])))
    assert status == 400 and "key -1 at position 2 is reserved" in json.loads(text)["error"]
    assert np.array_equal(_infer(served["client"], "wdl", wdl).reshape(-1), np.float32(sessions["wdl"].predict(*wdl)))


def _metric(served, line_start: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", served["metrics_port"], timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return 0.0


def test_metrics_and_access_log(served, sessions):
    session = sessions["wdl"]
    _infer(served["client"], "wdl", _cut(session, _eval_batch(served["models"]["wdl"], session), 3))
    conn = http.client.HTTPConnection("127.0.0.1", served["port"], timeout=30)
    conn.request("GET", "/metrics")
    assert conn.getresponse().status == 404  # --metrics-port: /metrics is there, not on the HTTP port
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", served["metrics_port"], timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    for name in (
        'nv_inference_request_success_total{model="wdl",version="1"}',
        "nv_inference_request_failure_total",
        'nv_inference_count_total{model="wdl",version="1"}',
        "nv_inference_queue_duration_us_total",
        "nv_inference_compute_infer_duration_us_total",
        'numbactr_batch_samples_bucket{le="4.0",model="wdl"}',
        'numbactr_embedding_cache_hit_rate{model="wdl",table=',
    ):
        assert name in text, name
    assert _metric(served, 'nv_inference_request_success_total{model="wdl",version="1"}') >= 1
    time.sleep(0.2)
    lines = [json.loads(x) for x in open(served["log"]) if x.startswith("{")]
    infers = [x for x in lines if x["path"].endswith("/infer")]
    assert any(x["status"] == 200 and x["model"] == "wdl" and x["bytes_in"] > 0 for x in infers)
    assert {"ts", "client", "method", "ms", "bytes_out"} <= set(infers[0])


def test_a_batch_is_one_session_call_split_back(served, sessions):
    """In-process: three requests queued together form one batch (dynamic_batching of dlrm: 20 ms, preferred
    32) whose predictions are the session's of the three requests' rows stacked, split back in order."""
    import asyncio

    from numbactr.serve import infer
    from numbactr.serve.batcher import Batcher, compute_executor
    from numbactr.serve.protocol import InferRequest, Tensor
    from numbactr.serve.repository import load_model

    session = sessions["dlrm"]
    request = _eval_batch(served["models"]["dlrm"], session)
    parts = [_cut(session, request, n) for n in (12, 12, 8)]  # rows 0..11, 0..11, 0..7
    model = load_model(served["repo"], "dlrm")
    seen = []
    executor = compute_executor()
    batcher = Batcher(executor, lambda m, n, q, c: seen.append(n))

    def job(part):
        names = ("DES", "CATCOLUMN", "ROWINDEX")
        tensors = {k: Tensor(k, dt, [1, a.size], a) for k, a, dt in zip(names, part, ("FP32", "INT64", "INT32"))}
        return infer.check(model, InferRequest(None, tensors, {}, False))

    async def go():
        out = await asyncio.gather(*(batcher.submit(job(p)) for p in parts))
        await batcher.close()
        return out

    try:
        got = asyncio.run(go())
    finally:
        executor.shutdown()
        model.close()
    assert seen == [32]  # one batch: the preferred size
    dense = np.concatenate([p[0] for p in parts])  # one table: keys and offsets joined as infer.run does
    keys = np.concatenate([p[1] for p in parts])
    rows = np.concatenate(
        [parts[0][2]] + [p[2][1:] + sum(q[1].size for q in parts[:i]) for i, p in enumerate(parts) if i]
    )
    whole = np.float32(session.predict(dense, keys, rows))
    assert np.array_equal(np.concatenate([g[1] for g in got]), whole)
    assert [g[1].size for g in got] == [12, 12, 8]


def test_models_served_through_one_hps_json(served, sessions, tmp_path):
    """--backend-config=hugectr,ps=ps.json: HugeCTR's HPS JSON gives the files (relative to the JSON) and one
    parameter server serves both models; the predictions are the sessions' of the same rows."""
    from numbactr.serve import infer
    from numbactr.serve.command import backend_ps, load_repository
    from numbactr.serve.protocol import InferRequest, Tensor

    entries = []
    for name, (graph, dense, sparse, _) in served["models"].items():
        g = sessions[name].graph
        entries.append(
            {
                "model": name,
                "sparse_files": [os.path.relpath(s, tmp_path) for s in sparse],
                "dense_file": os.path.relpath(dense, tmp_path),
                "network_file": graph,
                "deployed_device_list": [0],
                "max_batch_size": 32,
                "hit_rate_threshold": 1.0,
                "gpucacheper": 0.5,
                "default_value_for_each_table": [0.0] * len(sparse),
                "embedding_vecsize_per_table": [e.embedding_vec_size for e in g.embeddings],
                "maxnum_catfeature_query_per_table_per_sample": [
                    g.sparse_param(e).max_feature_num for e in g.embeddings
                ],
            }
        )
    ps = tmp_path / "ps.json"
    ps.write_text(json.dumps({"supportlonglong": True, "models": entries}))
    models, hps, _ = load_repository(served["repo"], backend_ps([f"hugectr,ps={ps}"]))
    try:
        assert [m.name for m in models] == ["dlrm", "wdl"]
        assert models[0].session.ps is models[1].session.ps  # one parameter server
        for m in models:
            session = sessions[m.name]
            part = _cut(session, _eval_batch(served["models"][m.name], session), 5)
            names = ("DES", "CATCOLUMN", "ROWINDEX")
            tensors = {k: Tensor(k, dt, [1, a.size], a) for k, a, dt in zip(names, part, ("FP32", "INT64", "INT32"))}
            (got,) = infer.run([infer.check(m, InferRequest(None, tensors, {}, False))])
            assert np.array_equal(got, np.float32(session.predict(*part)))
    finally:
        for m in models:
            m.close()
        hps.close()


def test_a_client_that_leaves_mid_request_harms_nobody(served, sessions):
    session = sessions["wdl"]
    request = _cut(session, _eval_batch(served["models"]["wdl"], session), 2)
    with socket.create_connection(("127.0.0.1", served["port"]), timeout=10) as s:
        s.sendall(b'POST /v2/models/wdl/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n{"inputs": [')
    got = _infer(served["client"], "wdl", request).reshape(-1)
    assert np.array_equal(got, np.float32(session.predict(*request)))


def test_load_generator_counts_answers_and_wrong_ones(served, sessions):
    """numbactr.bench.serve.drive (``numbactr bench serve``'s clients) against the running server."""
    from numbactr.bench.serve import drive

    session = sessions["dlrm"]
    request = _eval_batch(served["models"]["dlrm"], session)
    reqs = [_cut(session, request, n) for n in (1, 5, 9)]
    want = [np.float32(session.predict(*r)) for r in reqs]
    r = drive(served["url"], "dlrm", reqs, want, clients=3, seconds=0.3)
    assert r["failed"] == 0 and r["wrong"] == 0 and r["latencies"].size >= 3
    r = drive(served["url"], "dlrm", reqs, [w + 0.01 for w in want], clients=2, seconds=0.1)
    assert r["wrong"] == r["latencies"].size >= 2
    r = drive(served["url"], "nope", reqs, want, clients=2, seconds=0.1)
    assert r["failed"] >= 2 and r["latencies"].size == 0
    # a server that is gone: retried until retry_s after the end, then lost
    r = drive(f"127.0.0.1:{_free_port()}", "dlrm", reqs, want, clients=1, seconds=0.0, retry_s=0.3)
    assert r["lost"] == 1 and r["retried"] >= 2 and r["failed"] == 0 and r["latencies"].size == 0


def _new_version(repo, name, source: int, version: int, change) -> None:
    """<repo>/<name>/<version>/, a copy of version `source` with change(dense file path) applied, made in a
    staging folder and renamed into place (it appears whole)."""
    import shutil

    stage = os.path.join(repo, f".stage{version}")
    shutil.copytree(os.path.join(repo, name, str(source)), stage)
    (dense,) = [f for f in os.listdir(stage) if "_dense_" in f and f.endswith(".model")]
    change(os.path.join(stage, dense))
    os.rename(stage, os.path.join(repo, name, str(version)))


def _halve_weights(path):
    np.fromfile(path, np.float32).__mul__(np.float32(0.5)).tofile(path)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _wait(what, fn, seconds=60):
    deadline = time.monotonic() + seconds
    while not fn():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.1)


def test_live_update_swaps_versions_without_dropping_a_request(served, sessions):
    """(Last: it changes what wdl serves.) Version 2 appears -> served without a failed request; a damaged
    version 3 leaves version 2 answering and says why on /v2/models/wdl, the index and the log."""
    import threading

    repo, client = served["repo"], served["client"]
    session = sessions["wdl"]
    request = _cut(session, _eval_batch(served["models"]["wdl"], session), 6)
    seen, errors, stop = [], [], threading.Event()

    def hammer():
        c = httpclient.InferenceServerClient(served["url"])
        while not stop.is_set():
            try:
                inputs = []
                for name, a in zip(("DES", "CATCOLUMN", "ROWINDEX"), request):
                    t = httpclient.InferInput(
                        name, [1, a.size], {"float32": "FP32", "int64": "INT64", "int32": "INT32"}[a.dtype.name]
                    )
                    t.set_data_from_numpy(a.reshape(1, -1))
                    inputs.append(t)
                r = c.infer("wdl", inputs)
                seen.append((r.get_response()["model_version"], r.as_numpy("OUTPUT0").reshape(-1)))
            except Exception as e:  # noqa: BLE001 (every failure is the test's finding)
                errors.append(repr(e))

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        _wait("requests before the update", lambda: len(seen) >= 3)
        _new_version(repo, "wdl", 1, 2, _halve_weights)
        _wait("version 2 served", lambda: client.get_model_metadata("wdl")["versions"] == ["2"])
        n2 = len(seen)
        _wait("requests after the update", lambda: len(seen) >= n2 + 3)
        _new_version(repo, "wdl", 2, 3, _truncate)
        _wait(
            "version 3's failure shown",
            lambda: "version 3" in client.get_model_metadata("wdl").get("last_load_error", ""),
        )
        n3 = len(seen)
        _wait("requests after the failure", lambda: len(seen) >= n3 + 3)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert errors == []
    graph, dense, sparse, evl = served["models"]["wdl"]
    v2 = os.path.join(repo, "wdl", "2")
    files2 = (
        graph,
        os.path.join(v2, os.path.basename(dense)),
        [os.path.join(v2, os.path.basename(s)) for s in sparse],
        evl,
    )
    s2 = CreateInferenceSession(graph, _params("wdl", files2))
    want = {"1": np.float32(session.predict(*request)), "2": np.float32(s2.predict(*request))}
    s2.close()
    assert not np.array_equal(want["1"], want["2"])
    versions = [v for v, _ in seen]
    assert versions == sorted(versions) and versions[0] == "1" and versions[-1] == "2"  # swapped once, never back
    for v, got in seen:
        assert np.array_equal(got, want[v]), v
    meta = client.get_model_metadata("wdl")
    assert meta["versions"] == ["2"] and "dense" in meta["last_load_error"]
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["wdl"]["version"] == "2" and "version 3" in index["wdl"]["reason"]
    with pytest.raises(InferenceServerException, match="was not loaded: version 3"):
        client.load_model("wdl")
    time.sleep(0.2)
    events = [json.loads(x) for x in open(served["log"]) if x.startswith('{"ts"') and '"event"' in x]
    assert {"event": "model_loaded", "model": "wdl", "version": 2, "replaced": 1}.items() <= events[0].items()
    assert any(e["event"] == "model_load_failed" and e["version"] == 3 for e in events)
    # a restart now serves the last good version: 2, with version 3's failure as the reason
    from numbactr.serve.command import load_repository

    models, _, failed = load_repository(repo, None)
    try:
        assert {m.name: m.version for m in models} == {"dlrm": 1, "wdl": 2}
        assert failed["dlrm"] == [] and [v for v, _, _ in failed["wdl"]] == [3] and "dense" in failed["wdl"][0][2]
    finally:
        for m in models:
            m.close()
