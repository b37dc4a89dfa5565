"""The real-data examples (examples/*.py): every one answers --help, and dlrm_criteo.py runs end to end on
the repository's tiny Criteo fixture without torch, writing its --json results."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest

from numbactr.runtime import device

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)
NAMES = ["ncf_movielens", "wdl_census", "deepfm_libfm", "din_taobao", "dlrm_criteo"]


@pytest.mark.parametrize("name", NAMES)
def test_help(name, capsys):
    mod = importlib.import_module(name)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--seeds" in out and "--json" in out and "--no-torch" in out


def test_dlrm_runs_on_the_tiny_criteo_sample(tmp_path, capsys):
    device.set_device("cpu")
    mod = importlib.import_module("dlrm_criteo")
    js = str(tmp_path / "r.json")
    mod.main(["--no-torch", "--epochs", "1", "--seeds", "2", "--json", js, "--out", str(tmp_path / "data")])
    out = capsys.readouterr().out
    assert "540 training rows, 60 eval rows" in out and "AUC" in out
    r = json.load(open(js))
    assert r["runs"]["pytorch"] == [] and len(r["runs"]["numbactr"]) == 2
    auc = r["summary"]["AUC"]["numbactr"]
    assert 0.0 <= auc["mean"] <= 1.0 and len(auc["values"]) == 2
    assert r["summary"]["LogLoss"]["numbactr"]["mean"] > 0
