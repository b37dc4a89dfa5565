"""Every ``numbactr bench ...`` command writes its figures as JSON with --json (numbactr/bench/results.py):
each command at its smallest size, the file checked against the schema, its figures finite, the peers
that took part listed with their versions. Also the writer's and the check's own behaviour."""

import contextlib
import datetime
import importlib.util
import io
import json
import math
import os

import pytest

from numbactr.bench import results
from numbactr.bench.common import Table
from numbactr.cli import main

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_FBGEMM = importlib.util.find_spec("fbgemm_gpu") is not None
HAS_ORT = importlib.util.find_spec("onnxruntime") is not None
QUICK = ["--quick", "--min-time", "0"]


@pytest.fixture(autouse=True)
def _cpu(on_device):
    """The benchmarks on the cpu device (the suite's default device is the CUDA simulator: far too slow)."""
    on_device("cpu")


def run_bench(tmp_path, *argv) -> dict:
    """`numbactr bench *argv --json FILE` in this process; the checked document."""
    path = tmp_path / "out" / "result.json"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["bench", *argv, "--json", str(path)]) == 0
    assert f"results written to {path}" in out.getvalue()
    doc = results.load(path)  # raises on any schema problem
    assert doc["command"] == ["numbactr", "bench", *argv, "--json", str(path)]
    when = datetime.datetime.fromisoformat(doc["date"])
    assert when.utcoffset() == datetime.timedelta(0)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()) < 3600
    assert doc["machine"]["cores"] == os.cpu_count() and doc["machine"]["device"]
    assert os.uname().nodename not in json.dumps(doc["machine"])  # no host name
    assert all(math.isfinite(r["value"]) for r in doc["results"])
    for r in doc["results"]:
        for peer in results.peers_of(r["implementation"]):
            assert doc["versions"][peer], f"{r['implementation']} took part but {peer}'s version is missing"
    assert not list(path.parent.glob("*.tmp"))  # written whole, then renamed
    return doc


def impls(doc) -> set:
    return {r["implementation"] for r in doc["results"]}


def test_bench_hash_json(tmp_path):
    doc = run_bench(tmp_path, "hash", *QUICK)
    assert {"ms", "Mkeys/s"} == {r["metric"] for r in doc["results"]}
    assert {r["op"] for r in doc["results"]} == {"insert-new", "insert-known", "find"}
    assert {r["keys"] for r in doc["results"]} == {"uniform", "power-law"}
    if HAS_TORCH:
        assert "torch-cpu" in impls(doc) and doc["versions"]["torch"]
        assert doc["threads"]["torch"] >= 1


def test_bench_hash_json_without_torch_lists_no_peer(tmp_path):
    doc = run_bench(tmp_path, "hash", *QUICK, "--no-torch")
    assert impls(doc) == {"numbactr"}
    assert set(doc["versions"]) == {"numbactr", "numpy", "numba"}


def test_bench_dlrm_json(tmp_path):
    doc = run_bench(tmp_path, "dlrm", *QUICK)
    sps = [r for r in doc["results"] if r["metric"] == "samples/s"]
    assert sps and all(r["batch"] == 128 and r["slots"] == 26 and r["threads"] == 1 for r in sps)
    if HAS_TORCH:
        assert {"numbactr", "torch-cpu", "torch+numbactr-tbe"} <= impls(doc)
    if HAS_FBGEMM:
        assert "torch+fbgemm-tbe" in impls(doc) and doc["versions"]["fbgemm_gpu"]


def test_bench_dlrm_mlperf_json(tmp_path):
    doc = run_bench(tmp_path, "dlrm", "--model", "mlperf", *QUICK, "--optimizer", "sgd")
    ours = {r["metric"] for r in doc["results"] if r["implementation"] == "numbactr"}
    assert {"step ms", "samples/s", "eager ms", "embedding ms", "GEMMs ms", "rest ms", "embedding GB/s"} <= ours
    assert {r["optimizer"] for r in doc["results"]} == {"sgd"}


def test_bench_cache_json(tmp_path):
    doc = run_bench(tmp_path, "cache", *QUICK, "--plot", str(tmp_path / "cache.png"))
    rates = [r for r in doc["results"] if r["metric"] == "hit rate"]
    assert rates and all(0 <= r["value"] <= 1 for r in rates)
    assert {"in memory", "cached"} <= impls(doc)


def test_bench_data_json(tmp_path):
    argv = ["--samples", "4000", "--batch-size", "1024", "--repeats", "1", "--workers", "1", "--files", "1"]
    doc = run_bench(tmp_path, "data", *argv, "--formats", "norm,raw")
    assert {(r["format"], r["workers"], r["metric"]) for r in doc["results"]} == {
        ("norm", 1, "samples/s"),
        ("raw", 1, "samples/s"),
    }


def test_bench_inference_json(tmp_path):
    doc = run_bench(tmp_path, "inference", *QUICK, "--batches", "1,64")
    lat = [r for r in doc["results"] if r["metric"] == "p50 ms" and r["implementation"] == "numbactr"]
    assert sorted(r["batch"] for r in lat) == [1, 64]
    assert {r["cache_percent"] for r in doc["results"] if r["metric"] == "hit rate"} == {5.0, 50.0}
    if HAS_ORT:
        assert "onnxruntime" in impls(doc) and doc["versions"]["onnxruntime"]


def test_bench_embedding_tables_as_json(tmp_path):
    """The embedding tables' columns (forward and backward) through the writer, at a tiny shape."""
    from numbactr.bench.cli import run
    from numbactr.bench.common import Env

    small = dict(features=2, hots=(1,), poolings=("sum",), optimizers=("sgd",))
    with contextlib.redirect_stdout(io.StringIO()):
        tables = run("embedding", Env(), quick=True, min_time=0, options={"embedding": small})
    path = results.write_tables(tmp_path / "e.json", tables, ["numbactr", "bench", "embedding"])
    doc = results.load(path)
    metrics = {(r["implementation"], r["metric"]) for r in doc["results"]}
    assert {("numbactr", "fwd GB/s"), ("numbactr", "bwd+upd ms")} <= metrics
    if HAS_FBGEMM:
        assert ("fbgemm", "fwd ms") in metrics and doc["versions"]["fbgemm_gpu"]


@pytest.mark.slow
@pytest.mark.parametrize("what", ["embedding", "all"])
def test_bench_embedding_and_all_json(tmp_path, what):
    doc = run_bench(tmp_path, what, *QUICK)
    names = {r["name"] for r in doc["results"]}
    assert any(n.startswith("TBE forward") for n in names)
    assert any(n.startswith("hash table") for n in names) == (what == "all")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="bench sok needs torch")
def test_bench_sok_json(tmp_path):
    doc = run_bench(tmp_path, "sok", *QUICK)
    assert {"torch nn.Embedding", "numbactr.sok"} <= impls(doc)


# ---- the writer and the check ----------------------------------------------------------------------
def test_from_table_splits_measured_cells_from_parameters():
    tab = Table("t", ["impl", "threads", "B", "fwd ms", "fwd GB/s", "fwd % peak"])
    tab.add("numbactr", 2, 4096, 1.5, 20.0, "12.5%")
    tab.add("torch-cpu", "-", 4096, None, float("nan"), "-")
    got = results.from_table(tab)
    assert got == [
        {"name": "t", "implementation": "numbactr", "metric": m, "value": v, "threads": 2, "B": 4096}
        for m, v in (("fwd ms", 1.5), ("fwd GB/s", 20.0), ("fwd % peak", 12.5))
    ]


def _valid():
    return {
        "schema": 1,
        "command": ["numbactr", "bench", "hash"],
        "date": "2026-12-07T00:00:00+00:00",
        "machine": dict(platform="Linux", python="3.11", cpu="x", cores=2, gpu=None),
        "threads": {"numbactr": 1},
        "versions": {"numbactr": "0.1.0", "numpy": "2", "numba": "0.6", "torch": "2.13"},
        "results": [
            {"name": "n", "implementation": "numbactr", "metric": "ms", "value": 1.0},
            {"name": "n", "implementation": "torch-cpu", "metric": "ms", "value": 2.0},
        ],
    }


@pytest.mark.parametrize(
    "spoil, says",
    [
        (lambda d: d.update(schema=2), "schema"),
        (lambda d: d.update(date="yesterday"), "date"),
        (lambda d: d["machine"].pop("cpu"), "machine: no 'cpu'"),
        (lambda d: d["versions"].pop("numba"), "versions: no 'numba'"),
        (lambda d: d["versions"].pop("torch"), "versions: no 'torch'"),
        (lambda d: d["results"][1].update(value=float("inf")), "results[1]"),
        (lambda d: d["results"][0].pop("metric"), "results[0]: no metric"),
        (lambda d: d.update(results=[]), "results"),
        (lambda d: d.update(command="numbactr bench"), "command"),
    ],
)
def test_validate_names_each_problem(spoil, says):
    doc = _valid()
    assert results.validate(doc) == []
    spoil(doc)
    problems = results.validate(doc)
    assert problems and any(says in p for p in problems), problems


def test_write_refuses_an_invalid_document_and_leaves_no_file(tmp_path):
    doc = _valid()
    doc["results"][0]["value"] = float("nan")
    with pytest.raises(ValueError, match="results\\[0\\]"):
        results.write(tmp_path / "bad.json", doc)
    assert not list(tmp_path.iterdir())


def test_write_then_load_round_trips(tmp_path):
    path = results.write(tmp_path / "sub" / "ok.json", _valid())
    assert results.load(path) == _valid()
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json: not JSON"):
        results.load(tmp_path / "broken.json")
