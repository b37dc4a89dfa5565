"""The README's main job, end to end on the cpu device: it must close >= 90% of the AUC gap, quietly,
and leave the learning curve (PNG + CSV). Data reuse: tests/test_planted_cache.py."""

import os
import re
import subprocess
import sys

import pytest


def run_demo(out, *extra):
    env = dict(os.environ, NUMBACTR_DEVICE="cpu")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    r = subprocess.run(
        [sys.executable, "-m", "numbactr.cli", "demo", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "warning" not in (r.stdout + r.stderr).lower(), r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_demo_closes_90_percent_of_the_gap_to_the_bayes_auc(tmp_path):
    r = run_demo(tmp_path)
    assert r.stdout.startswith("numbactr: device=cpu (NUMBACTR_DEVICE=cpu")  # the start-up line first
    assert "threads: compute " in r.stdout
    assert "Iter: " in r.stdout and "Evaluation, AUC: " in r.stdout  # HugeCTR-style log lines
    m = re.search(r"final eval AUC ([\d.]+)\s+Bayes-optimal AUC ([\d.]+)\s+gap closed ([\d.]+)%", r.stdout)
    assert m, r.stdout[-2000:]
    auc, bayes, closed = map(float, m.groups())
    assert 0.7 < bayes < 0.85
    assert closed >= 90.0, r.stdout[-2000:]
    assert (tmp_path / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    csv = (tmp_path / "learning_curve.csv").read_text().splitlines()
    assert csv[0].startswith("# Bayes-optimal AUC: ") and csv[1] == "iteration,train_loss,lr,eval_auc"
    assert re.search(r"written in [\d.]+s: .*planted-[0-9a-f]{12} \(\d+ MiB\)", r.stdout)
