"""instance_group (numbactr.serve.instances) on a real ``numbactr serve`` process: a model with two
instances runs its batches in the compute thread and in a worker process, both answer what the
InferenceSession answers, a refresh reaches both, and stopping the server stops the worker."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import time

import numpy as np
import pytest

from numbactr.cli import main as cli
from numbactr.inference import CreateInferenceSession
from numbactr.runtime import device
from numbactr.serve.refresh import write_dump
from tests.sample_graphs import build
from tests.serve_util import serve_process
from tests.test_serve import _cut, _eval_batch, _infer, _params, _post

httpclient = pytest.importorskip("tritonclient.http")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _children(pid: int) -> list:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _metric(port, name) -> dict:
    """{instance: value} of a per-instance counter on /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    got = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            got[labels.split('instance="')[1].split('"')[0]] = float(value)
    return got


def test_two_instances_answer_alike_take_refreshes_and_stop_with_the_server(tmp_path):
    device.set_device("cpu")
    folder, repo = str(tmp_path / "wdl"), str(tmp_path / "repo")
    m = build("wdl", folder)
    m.fit(max_iter=2, display=0, eval_interval=1000, snapshot=0)
    graph, prefix = os.path.join(folder, "wdl.json"), os.path.join(folder, "wdl")
    m.graph_to_json(graph)
    m.save_params_to_files(prefix, 2)
    files = (graph, f"{prefix}_dense_2.model", [f"{prefix}{i}_sparse_2.model" for i in range(2)], None)
    argv = ["serve-export", graph, "--dense", files[1], "--sparse", *files[2], "--model-repository", repo]
    assert cli(argv + ["--model", "wdl", "--max-batch-size", "32"]) == 0
    config = os.path.join(repo, "wdl", "config.pbtxt")
    with open(config, "a") as f:
        f.write("instance_group [ { count: 2 kind: KIND_CPU } ]\n")
    session = CreateInferenceSession(graph, _params("wdl", files))
    request = _eval_batch((graph, files[1], files[2], os.path.join(folder, "eval", "_file_list.txt")), session)
    cuts = [_cut(session, request, n) for n in (1, 3, 8)]
    want = [np.float32(session.predict(*c)) for c in cuts]
    log = str(tmp_path / "server.log")
    args = ("--model-control-mode", "explicit")
    with serve_process(repo, log, *args, ready_s=300, stop_s=30) as (proc, port, client), contextlib.closing(session):
        assert client.get_model_config("wdl")["instance_group"] == [{"count": 2, "kind": "KIND_CPU"}]

        def one(i):
            c = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
            return i % 3, _infer(c, "wdl", cuts[i % 3]).reshape(-1)

        def hammer():
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                return list(pool.map(one, range(40)))

        for r, got in hammer():  # no dynamic batching: each request is a batch of its own, bit for bit
            assert np.array_equal(got, want[r])
        runs = _metric(port, "numbactr_instance_exec_count_total")
        assert set(runs) == {"0", "1"} and sum(runs.values()) == 40, runs
        # a refresh reaches both instances: every answer after it is the new rows'
        names = session.ps.config.models["wdl"].names
        keys = np.arange(0, 40, dtype=np.uint64)
        rows, found = session.ps.lookup("wdl", 1, keys)
        keys, rows = keys[found], rows[found] * np.float32(3.0)
        write_dump(os.path.join(repo, "wdl", "dump.npz"), {names[1]: (keys, rows)})
        session.ps.update("wdl", 1, keys, rows)
        want = [np.float32(session.predict(*c)) for c in cuts]
        status, body = _post(
            {"port": port}, "/v2/repository/models/wdl/refresh", json.dumps({"dump": "dump.npz"}).encode()
        )
        assert status == 200, body
        before = _metric(port, "numbactr_instance_exec_count_total")
        for r, got in hammer():
            assert np.array_equal(got, want[r])
        after = _metric(port, "numbactr_instance_exec_count_total")
        assert all(after[i] > before[i] for i in ("0", "1")), (before, after)
        workers = _children(proc.pid)
        assert workers
    deadline = time.monotonic() + 15
    while any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z" for p in workers):
        assert time.monotonic() < deadline, "a worker outlived the server"
        time.sleep(0.1)
