"""The committed benchmark results (docs/benchmarks/results/*.json) hold to the schema of
numbactr/bench/results.py, keep every figure they were given (the README's measured figures were moved
into them), and each is shown on the Benchmarks page (docs/benchmarks.md) by the bench-results directive
of docs/_ext/benchplots.py, whose helpers are checked here too."""

import json
import pathlib
import re
import sys

import pytest

from numbactr.bench import results

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
FILES = sorted(RESULTS.glob("*.json"))
DIRECTIVE = re.compile(r"^```\{bench-results\}\s+(\S+)\s*$", re.M)
#: results per file when the README's figures were transcribed: a file may gain results, never lose one
TRANSCRIBED = {
    "cache-2026-11-25": 7,
    "data-2026-11-22": 9,
    "data-rawasync-2026-11-23": 15,
    "demo-2026-11-23": 7,
    "dlrm-2026-11-24": 8,
    "dlrm-2026-11-25": 8,
    "dlrm-serial-twins-2026-11-25": 29,
    "dlrm-tbe-profile-2026-11-29": 22,
    "embedding-2026-11-24": 216,
    "embedding-changes-2026-11-24": 8,
    "embedding-collection-step": 4,
    "embedding-remeasured-2026-11-24": 10,
    "fbgemm-tests-2026-11-25": 12,
    "hash-2026-11-25": 24,
    "hash-compiled-insert-2026-11-25": 10,
    "hugectr-scripts-2026-11-24": 7,
    "inference-2026-11-24": 59,
    "inference-2026-11-25": 42,
    "inference-num-threads-2026-11-29": 10,
    "inference-op-overhead-2026-11-25": 7,
    "inference-plan-2026-12-02": 13,
    "kernel-resources-2026-12-02": 39,
    "mixed-precision-cpu-2026-11-24": 8,
    "mixed-precision-sim-2026-11-24": 6,
    "mlperf-cpu-2026-12-02": 14,
    "serial-borrow-2026-11-25": 8,
    "snapshots-2026-11-23": 6,
    "sok-2026-11-23": 20,
    "step-launches-sim": 15,
    "tiered-whole-table-init": 6,
}


def test_there_are_result_files():
    assert FILES, f"no result files in {RESULTS}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_result_file_holds_to_the_schema(path):
    doc = results.load(path)  # raises with the file's problems
    if re.search(r"\d{4}-\d\d-\d\d$", path.stem):  # a dated name is the run's date
        assert doc["date"].startswith(path.stem[-10:]), (path.name, doc["date"])
    for i, r in enumerate(doc["results"]):
        assert all(isinstance(v, (str, int, float)) for v in r.values()), f"{path.name} results[{i}]: {r}"
    keys = [json.dumps(r, sort_keys=True) for r in doc["results"]]
    assert len(keys) == len(set(keys)), f"{path.name}: a result is listed twice"


@pytest.mark.parametrize("stem", sorted(TRANSCRIBED))
def test_no_transcribed_figure_is_lost(stem):
    path = RESULTS / f"{stem}.json"
    assert path.exists(), f"{path.name} (the README's figures) is gone"
    doc = results.load(path)
    assert len(doc["results"]) >= TRANSCRIBED[stem]
    assert doc.get("source", "").startswith("README of 2026-12-06"), "a transcribed file says where it came from"


def test_transcribed_spot_checks():
    """A few figures read back as the README gave them (a mis-typed table shifts these)."""

    def value(stem, **match):
        found = [r["value"] for r in results.load(RESULTS / f"{stem}.json")["results"] if match.items() <= r.items()]
        assert len(found) == 1, (stem, match, found)
        return found[0]

    assert value("hash-2026-11-25", implementation="numbactr", keys="power-law", op="find", threads=2) == 238
    assert (
        value(
            "embedding-2026-11-24",
            implementation="torch-cpu",
            pooling="mean",
            L=20,
            D=128,
            threads=1,
            optimizer="rowwise_adagrad",
        )
        == 10852
    )
    assert (
        value("embedding-2026-11-24", implementation="fbgemm", pooling="sum", L=1, D=16, threads=2, metric="fwd ms")
        == 4.5
    )
    assert value("inference-2026-11-24", implementation="onnxruntime", batch=16384, metric="p99 ms") == 259
    assert value("dlrm-2026-11-25", implementation="torch+fbgemm-tbe", threads=2) == 146_800
    assert value("sok-2026-11-23", implementation="numbactr.sok no hash", ranks=2, metric="step ms") == 2878


def test_every_result_file_is_on_the_benchmarks_page():
    shown = {pathlib.PurePosixPath(arg).name for arg in DIRECTIVE.findall(PAGE.read_text())}
    missing = sorted(p.name for p in FILES if p.name not in shown)
    assert not missing, f"docs/benchmarks.md shows no bench-results for {missing}"
    for arg in DIRECTIVE.findall(PAGE.read_text()):
        assert (PAGE.parent / arg).exists(), f"docs/benchmarks.md: {arg} does not exist"


# ---- the directive's helpers -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def benchplots():
    pytest.importorskip("sphinx")
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import benchplots
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    return benchplots


def test_figures_are_formatted_as_the_bench_tables_print_them(benchplots):
    fmt = benchplots._fmt
    assert [fmt(v) for v in (146800.0, 238, 46.0, 4.5, 0.0395, 1.2e-7, "sum")] == [
        "146,800",
        "238",
        "46.0",
        "4.5",
        "0.0395",
        "1.2e-07",
        "sum",
    ]


def test_where_filters_and_refuses_what_it_cannot_read(benchplots):
    pairs = benchplots._where("pooling=sum; threads=1")
    assert benchplots._matches({"pooling": "sum", "threads": 1}, pairs)
    assert not benchplots._matches({"pooling": "mean", "threads": 1}, pairs)
    assert benchplots._matches({"batch": 1}, benchplots._where("range=None"))
    with pytest.raises(ValueError, match="field=value"):
        benchplots._where("pooling")


def test_draw_writes_a_png(benchplots, tmp_path):
    rows = results.load(RESULTS / "dlrm-2026-11-25.json")["results"]
    target = tmp_path / "g" / "x.png"
    benchplots._draw(str(target), rows, ["samples/s"], "implementation", ["threads"], False, "t")
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
