"""numbactr.bench.data runs end to end on a small dataset and prints its markdown tables."""

import re

from numbactr.bench.data import main


def test_bench_data_small(tmp_path, capsys):
    assert (
        main(
            [
                "--samples",
                "12000",
                "--files",
                "2",
                "--batch-size",
                "1000",
                "--workers",
                "1,2",
                "--repeats",
                "1",
                "--step-ms",
                "1",
                "--dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| format | 1 worker | 2 workers |" in out
    for fmt in ("norm", "raw", "parquet"):
        rows = re.findall(rf"^\| {fmt} \| (.+) \|$", out, re.M)
        assert len(rows) == 2  # throughput and wait tables
        assert all(float(c.split()[0]) > 0 for c in rows[0].split(" | "))
