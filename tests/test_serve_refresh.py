"""Live embedding refresh (``POST /v2/repository/models/{m}/refresh``, numbactr.serve.refresh) on a real
``numbactr serve`` process: under continuous requests from several clients, a newer training snapshot's
sparse files and then an incremental dump change the answers to what an InferenceSession with the new rows
gives, with no failed request; bad refreshes (wrong width, unknown table, a damaged file, a path outside the
repository) get a 400 naming the fault and change nothing."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import numpy as np
import pytest

from numbactr.cli import main as cli
from numbactr.inference import CreateInferenceSession
from numbactr.runtime import device
from numbactr.serve.refresh import write_dump
from tests.sample_graphs import build
from tests.serve_util import serve_process
from tests.test_serve import _cut, _eval_batch, _infer, _params, _post, _wait

httpclient = pytest.importorskip("tritonclient.http")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A Wide&Deep trained 2 steps (served) and 4 steps (the newer snapshot), the server running."""
    device.set_device("cpu")
    base = tmp_path_factory.mktemp("refresh")
    folder, repo = str(base / "wdl"), str(base / "repo")
    m = build("wdl", folder)
    graph, prefix = os.path.join(folder, "wdl.json"), os.path.join(folder, "wdl")
    m.graph_to_json(graph)
    files = {}
    for it in (2, 4):
        m.fit(max_iter=2, display=0, eval_interval=1000, snapshot=0)
        m.save_params_to_files(prefix, it)
        files[it] = (
            graph,
            f"{prefix}_dense_{it}.model",
            [f"{prefix}{i}_sparse_{it}.model" for i in range(len(m.embeddings))],
            os.path.join(folder, "eval", "_file_list.txt"),
        )
    graph, dense, sparse, _ = files[2]
    argv = ["serve-export", graph, "--dense", dense, "--sparse", *sparse, "--model-repository", repo]
    assert cli(argv + ["--model", "wdl", "--max-batch-size", "32", "--max-queue-delay-us", "2000"]) == 0
    drop = os.path.join(repo, "wdl", "refresh")  # the newer snapshot's folders, inside the repository
    os.makedirs(drop)
    for s in files[4][2]:
        shutil.copytree(s, os.path.join(drop, os.path.basename(s)))
    log = str(base / "server.log")
    with serve_process(repo, log, "--model-control-mode", "explicit") as (proc, port, client):
        yield dict(url=f"127.0.0.1:{port}", port=port, log=log, repo=repo, files=files, drop=drop, client=client)


def _refresh(served, doc) -> tuple:
    status, body = _post(served, "/v2/repository/models/wdl/refresh", json.dumps(doc).encode())
    return status, json.loads(body) if body else None


def test_refresh_under_load_changes_answers_to_the_new_rows_and_bad_ones_change_nothing(served, tmp_path):
    graph, dense2, sparse2, _ = served["files"][2]
    old = CreateInferenceSession(graph, _params("wdl", served["files"][2]))
    request = _eval_batch(served["files"][2], old)
    cuts = [_cut(old, request, n) for n in (1, 4, 9)]
    # what the refreshed server must give: the served dense model with the newer snapshot's rows
    new = CreateInferenceSession(graph, _params("wdl", (graph, dense2, served["files"][4][2], None)))
    want_old = [np.float32(old.predict(*c)) for c in cuts]
    want_new = [np.float32(new.predict(*c)) for c in cuts]
    assert not any(np.array_equal(a, b) for a, b in zip(want_old, want_new))

    seen, errors, stop = [], [], threading.Event()

    def hammer(k):
        c = httpclient.InferenceServerClient(served["url"])
        i = k
        while not stop.is_set():
            r = i % len(cuts)
            i += 1
            try:
                seen.append((time.monotonic(), r, _infer(c, "wdl", cuts[r]).reshape(-1)))
            except Exception as e:  # noqa: BLE001 (every failure is the test's finding)
                errors.append(repr(e))

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        _wait("requests before the refresh", lambda: len(seen) >= 6)
        # bad refreshes: 400 naming the fault, nothing changed
        names = new.ps.config.models["wdl"].names
        bad_width = str(tmp_path / "wide.npz")
        write_dump(bad_width, {names[0]: (np.array([1, 2]), np.zeros((2, 99), np.float32))})
        unknown = str(tmp_path / "unknown.npz")
        write_dump(unknown, {"nope": (np.array([1]), np.zeros((1, 1), np.float32))})
        damaged = os.path.join(served["repo"], "wdl", "damaged.npz")
        write_dump(damaged, {names[0]: (np.array([1, 2]), np.zeros((2, 1), np.float32))})
        with open(damaged, "r+b") as f:
            f.truncate(os.path.getsize(damaged) // 2)
        cut_snapshot = os.path.join(served["repo"], "wdl", "cut")
        shutil.copytree(served["drop"], cut_snapshot)
        folders = sorted(os.listdir(cut_snapshot))
        with open(os.path.join(cut_snapshot, folders[1], "emb_vector"), "r+b") as f:
            f.truncate(8)
        for doc, fault in (
            ({"dump": shutil.copy(bad_width, served["repo"])}, "needs float"),
            ({"dump": shutil.copy(unknown, served["repo"])}, "unknown table 'nope'"),
            ({"dump": "damaged.npz"}, "not a whole .npz"),
            ({"dump": bad_width}, "outside the model repository"),
            ({"sparse_files": [f"cut/{f}" for f in folders]}, "sparse_files[1]"),
            ({"sparse_files": ["refresh"]}, "one per table"),
            ({"snapshot": "x"}, "the body must be"),
        ):
            status, body = _refresh(served, doc)
            assert status == 400 and fault in body["error"], (doc, status, body)
        n_bad = len(seen)
        _wait("requests after the bad refreshes", lambda: len(seen) >= n_bad + 6)
        # a newer snapshot's sparse files
        newer = [f"refresh/{os.path.basename(s)}" for s in served["files"][4][2]]
        status, body = _refresh(served, {"sparse_files": newer})
        assert status == 200, body
        assert body["version"] == "1" and sorted(body["tables"]) == sorted(names)
        t_new = time.monotonic()
        n1 = len(seen)
        _wait("requests after the refresh", lambda: len(seen) >= n1 + 6)
        # an incremental dump: table 0's first keys go back to their old rows, two keys are evicted
        rows0, found = old.ps.lookup("wdl", 0, np.arange(4, dtype=np.uint64))
        assert found.all()
        dump = os.path.join(served["repo"], "wdl", "dump.npz")
        write_dump(dump, {names[0]: (np.arange(4), rows0, np.array([4, 5]))})
        new.ps.update("wdl", 0, np.arange(4), rows0, np.array([4, 5]))  # the same rows, in-process
        want_dump = [np.float32(new.predict(*c)) for c in cuts]
        t_sent = time.monotonic()
        status, body = _refresh(served, {"dump": "dump.npz"})
        assert status == 200 and body["tables"] == {names[0]: {"updated": 4, "evicted": 2}}, body
        t_dump = time.monotonic()
        n2 = len(seen)
        _wait("requests after the dump", lambda: len(seen) >= n2 + 6)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        old.close()
        new.close()
    assert errors == []
    assert any(not np.array_equal(a, b) for a, b in zip(want_new, want_dump))
    close = lambda a, b: np.allclose(a, b, rtol=2e-6, atol=1e-7)  # noqa: E731 (batched: float rounding)
    for t, r, got in seen:
        # each answer is wholly the old rows, the snapshot's or the dump's; after each refresh answered, the new
        phases = [want_old[r], want_new[r], want_dump[r]]
        assert any(close(got, p) for p in phases)
        if t > t_dump + 0.5:
            assert close(got, want_dump[r])
        elif t_new + 0.5 < t < t_sent:
            assert close(got, want_new[r])
    for r, c in enumerate(cuts):  # alone, bit for bit
        assert np.array_equal(_infer(served["client"], "wdl", c).reshape(-1), want_dump[r])
    time.sleep(0.2)
    events = [json.loads(x) for x in open(served["log"]) if x.startswith('{"ts"') and '"event"' in x]
    assert sum(e["event"] == "embeddings_refresh_failed" for e in events) == 7
    assert [e["tables"] for e in events if e["event"] == "embeddings_refreshed"][-1] == {
        names[0]: {"updated": 4, "evicted": 2}
    }
