"""``numbactr bench serve --quick --faults`` end to end: the load table and the three faults (a damaged
version, kill -9 and restart, a Redis restart when redis-server is installed) run against real server
processes, with zero failed, wrong or lost answers in the JSON it writes. The bench runs in its own process
group with a time limit; when it runs over, the whole group (the bench, its servers, its redis-server) is
killed, and at the end no process of the group may be left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("tritonclient.http")
pytest.importorskip("uvicorn")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT_S = 240  # about 25 s on an idle two-core machine; the limit is for a loaded one


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_bench_serve_quick_with_faults_answers_everything(tmp_path):
    out = tmp_path / "serve.json"
    env = dict(os.environ, NUMBACTR_DEVICE="cpu", PYTHONPATH=ROOT, NUMBACTR_PROGRESS="0")
    cmd = [sys.executable, "-c", "import sys; from numbactr.cli import main; sys.exit(main())"]
    cmd += ["bench", "serve", "--quick", "--faults", "--json", str(out)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True, text=True
    )
    try:
        text, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate(timeout=30)
        pytest.fail(f"numbactr bench serve --quick --faults ran over {LIMIT_S} s:\n{text[-3000:]}")
    deadline = time.monotonic() + 10
    while not _gone(proc.pid):  # the servers the bench started are stopped by it
        assert time.monotonic() < deadline, "a process of the bench is still running"
        time.sleep(0.1)
    assert proc.returncode == 0, text[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["results"]
    load = [r for r in rows if "fault" not in r]
    assert {(r["clients"], r["batch"]) for r in load} == {(c, b) for c in (0, 1, 8) for b in (1, 64)}
    assert all(r["value"] == 0 for r in load if r["metric"] in ("failed", "wrong"))
    assert all(r["value"] > 0 for r in load if r["metric"] == "preds/s")
    faults = {}
    for r in rows:
        if "fault" in r:
            faults.setdefault(r["fault"], {})[r["metric"]] = r["value"]
    want = ["damaged version 2", "kill -9, restart"] + (["Redis restart"] if shutil.which("redis-server") else [])
    assert sorted(faults) == sorted(want), text[-3000:]
    for name, got in faults.items():
        assert got["answered"] > 0 and got["wrong"] == got["failed"] == got["lost"] == 0, (name, got)
    assert "fault 'damaged version 2': serves version 1; reason shown: True" in doc["notes"]
    assert "machine load" in doc["notes"]
    if "Redis restart" in faults:
        (line,) = [n for n in doc["notes"].splitlines() if n.startswith("fault 'Redis restart'")]
        assert "tier down 1x, back 1x" in line, line
