"""`numbactr bench cache --quick`: the table against cache size (the in-memory row, LRU, LFU, LRU + prefetch
at each size), hit rates that grow with the cache, the plot written where --plot says; the Zipf batches."""

import numpy as np

from numbactr.bench import cli as bench, cache as bench_cache
from numbactr.runtime import device


def test_bench_cache_quick_writes_its_table_and_plot(tmp_path, capsys):
    before = device.kind()
    device.set_device("cpu")
    try:
        plot = tmp_path / "cache.png"
        assert bench.main(["cache", "--quick", "--no-torch", "--plot", str(plot)]) == 0
    finally:
        device.set_device(before)
    text = capsys.readouterr().out
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert lines[0].strip("| ").split(" | ")[:3] == ["impl", "policy", "cache / table"]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[1:]]
    assert rows[0][0] == "in memory" and rows[0][5] == "1.00"
    cached = [r for r in rows if r[0] == "cached" and r[1] == "lru"]
    assert [r[2] for r in cached] == ["0.1", "0.25"]
    hits = [float(r[5]) for r in cached]
    assert 0 < hits[0] <= hits[1] < 1  # a bigger cache misses less, never all
    assert {r[0] for r in rows} == {"in memory", "cached", "cached+prefetch"}
    assert all(float(r[-1].replace(",", "")) > 0 for r in rows)
    assert plot.exists() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_zipf_batches_are_skewed_and_in_range():
    data = bench_cache.zipf_batches(
        np.random.default_rng(0), rows=1000, batches=3, batch=50, features=2, hot=4, alpha=1.1
    )
    idx = np.concatenate([i for i, _ in data])
    assert idx.min() >= 0 and idx.max() < 1000 and data[0][1].tolist() == list(range(0, 401, 4))
    counts = np.sort(np.bincount(idx, minlength=1000))[::-1]
    assert counts[:10].sum() > 0.2 * idx.size  # the ten hottest rows take a fifth of the lookups
