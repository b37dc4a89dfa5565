"""The real-data examples (examples/*.py): every one answers --help, and dlrm_criteo.py runs end to end on
the repository's tiny Criteo fixture without torch, writing its --json results."""

from __future__ import annotations

import importlib
import json
import os
import sys
from types import SimpleNamespace

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


@pytest.mark.parametrize("model", ["gmf", "ncf", "neumf"])
def test_ncf_graphs_build_and_train_on_a_small_ratings_file(model, tmp_path):
    """The three NCF graphs (their Slice ranges, towers and concats) compile and train one epoch; the
    eval groups are each user's positive and its 9 negatives (so HR@10 is 1 whatever the scores)."""
    import numpy as np

    from numbactr.data.convert import convert_movielens

    device.set_device("cpu")
    rng = np.random.default_rng(0)
    path = tmp_path / "u.data"
    lines = [
        f"{u}\t{i}\t4\t{1000 + k}" for u in range(1, 31) for k, i in enumerate(rng.choice(60, 8, replace=False) + 1)
    ]
    path.write_text("\n".join(lines) + "\n")
    res = convert_movielens(str(path), str(tmp_path / "out"), test_negatives=9, verbose=False)
    ncf = importlib.import_module("ncf_movielens")
    common = importlib.import_module("_common")
    args = SimpleNamespace(model=model, batch=32, lr=0.01, factors=4, mlp_factors=8, tower=[8, 4])
    got = common.fit_and_eval(ncf.build(args, res, seed=0), epochs=1)
    assert got["HitRate@10"] == 1.0  # 10 rows per user: every positive is in the top 10
    assert 1 / np.log2(11) <= got["NDCG@10"] <= 1.0


def test_streaming_ids_sok_example_runs_and_its_evicting_tables_stay_within_capacity(tmp_path, capsys):
    """examples/streaming_ids.py --quick: every run is in the printed table, the evicting runs fill their
    tables and never hold more keys than their capacity (in any window), the unbounded runs hold every
    distinct key, and the --json file is a valid result document with a figure per run."""
    pytest.importorskip("torch")
    from numbactr.bench import results

    mod = importlib.import_module("streaming_ids")
    js = str(tmp_path / "stream.json")
    got = mod.main(["--quick", "--json", js])
    out = capsys.readouterr().out
    total = sum(got["distinct"].values())
    labels = ["unbounded", "unbounded hybrid"]
    labels += [f"{s} {f:.0%}" for f in mod.FRACTIONS for s in mod.STRATEGIES]
    for label in labels:
        assert f"| {label} |" in out
    summary = {row[0]: dict(zip(got["summary"].columns, row)) for row in got["summary"].raw}
    assert set(summary) == set(labels)
    for label in labels[:2]:
        assert summary[label]["final keys"] == total  # every lookup inserts: all keys are held
    for label in labels[2:]:
        cap = summary[label]["capacity"]
        assert summary[label]["final keys"] == cap  # full, and evicting
        windows = [dict(zip(got["per_window"].columns, row)) for row in got["per_window"].raw]
        kept = [w["keys"] for w in windows if w["run"] == label]
        assert len(kept) == mod.SIZES["quick"]["windows"] and max(kept) <= cap
        assert summary[label]["MB"] < summary["unbounded"]["MB"]
    assert 10 * min(summary[label]["capacity"] for label in labels[2:]) <= total  # 10x the smallest tables
    assert 0.5 < summary["unbounded"]["AUC (last half)"] <= got["oracle"]
    doc = results.load(js)
    runs = {r["run"] for r in doc["results"] if r["metric"] == "AUC (last half)"}
    assert runs == set(labels)
