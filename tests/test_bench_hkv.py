"""`numbactr bench hkv --quick`: the evicting table's four operations at load factor 0.5 and 1.0 beside the fixed
table's insert and find at 0.5, the load factors as measured, and the same figures in the --json file."""

import pytest

from numbactr.bench import cli as bench
from numbactr.bench import hkv as bench_hkv
from numbactr.bench import results

pytestmark = pytest.mark.usefixtures("cpu")

EVICTING_OPS = ["find", "insert_or_assign", "insert_and_evict", "find_or_insert"]


def _rows(text):
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return header, [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[1:]]


def test_bench_hkv_quick_table_and_json(tmp_path, capsys):
    out = tmp_path / "hkv.json"
    assert bench.main(["hkv", "--quick", "--min-time", "0", "--no-torch", "--json", str(out)]) == 0
    header, rows = _rows(capsys.readouterr().out)
    assert header == bench_hkv.COLUMNS  # no published column off a GPU
    evicting = [r for r in rows if r["impl"] == "EvictingTable"]
    fixed = [r for r in rows if r["impl"] == "HashTable (fixed)"]
    assert [r["op"] for r in evicting] == EVICTING_OPS * 2
    assert [float(r["load factor"]) for r in evicting] == [0.5] * 4 + [1.0] * 4  # measured after the fill
    assert [(r["op"], r["keys"], r["load factor"]) for r in fixed] == [
        ("insert", "new", "0.5"),
        ("find", "known", "0.5"),
    ]
    assert all(r["capacity"] == "4,096" and r["batch keys"] == "256" for r in rows)
    assert all(float(r["M-KV/s"].replace(",", "")) > 0 for r in rows)

    doc = results.load(out)  # validated
    figs = [r for r in doc["results"] if r["metric"] == "M-KV/s"]
    assert len(figs) == len(rows) == len([r for r in doc["results"] if r["metric"] == "ms"])
    assert {r["implementation"] for r in figs} == {"EvictingTable", "HashTable (fixed)"}
    row = next(r for r in figs if r["op"] == "insert_and_evict" and r["load factor"] == 1.0)
    assert row["D"] == 8 and row["keys"] == "new" and row["value"] > 0
    assert "D" not in next(r for r in figs if r["implementation"] == "HashTable (fixed)")  # '-': no values


def test_published_figures_only_where_hierarchicalkv_published_them():
    assert bench_hkv.published("find", 8, 0.5) == 2500.0
    assert bench_hkv.published("insert_and_evict", 8, 0.5) == 1100.0
    assert bench_hkv.published("find", 32, 0.5) is None
    assert bench_hkv.published("insert_or_assign", 8, 1.0) is None
    assert bench_hkv.published("find_or_insert", 8, 0.5) is None


def test_bench_hkv_refuses_a_capacity_that_is_not_whole_buckets():
    from numbactr.bench.common import Env

    with pytest.raises(ValueError, match="power of two of whole 128-slot buckets"):
        bench_hkv.bench_hkv(Env(use_torch=False), capacity=1000, batch=10)
