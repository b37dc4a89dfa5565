"""`numbactr predict` (every sample of a source once, CSV or Parquet) and `numbactr bench inference --quick`."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

import numbactr as hugectr
from numbactr.cli import main
from numbactr.inference import InferenceModel
from tests.test_inference import train


def test_predict_command_writes_every_sample_once(tmp_path, capsys):
    hugectr.device.set_device("cpu")
    tr = train("mmoe", tmp_path / "model")
    base = [
        "predict",
        tr.graph,
        "--dense",
        tr.dense,
        "--sparse",
        *tr.sparse,
        "--source",
        tr.eval_source,
        "--batch-size",
        "48",
    ]  # 128 samples: 48 + 48 + a partial 32
    assert main(base + ["--output", str(tmp_path / "p.csv")]) == 0
    csv = np.loadtxt(tmp_path / "p.csv", delimiter=",", skiprows=1)
    header = (tmp_path / "p.csv").read_text().splitlines()[0]
    assert header == "income,married"
    ref = InferenceModel(tr.graph, tr.params()).predict(
        4, tr.eval_source, hugectr.DataReaderType_t.Norm, hugectr.Check_t.Sum
    )
    assert csv.shape == (128, 2)
    np.testing.assert_allclose(csv, ref, rtol=1e-6, atol=1e-8)
    assert main(base + ["--output", str(tmp_path / "p.parquet")]) == 0
    table = pq.read_table(tmp_path / "p.parquet")
    assert table.column_names == ["income", "married"]
    np.testing.assert_array_equal(
        np.stack([table[c].to_numpy() for c in table.column_names], 1), csv.astype(np.float32)
    )
    capsys.readouterr()
    assert main(base + ["--output", str(tmp_path / "p.txt")]) == 1
    err = capsys.readouterr().err
    assert "numbactr predict: error: --output" in err and "must be .csv or .parquet" in err
    assert (
        main(
            base[:1]
            + [
                tr.graph,
                "--dense",
                tr.dense,
                "--sparse",
                "--source",
                tr.eval_source,
                "--output",
                str(tmp_path / "q.csv"),
            ]
        )
        == 1
    )
    assert "0 sparse_model_files for the 1 embedding tables" in capsys.readouterr().err
    # without --sparse: the snapshot's folders beside the dense file, by HugeCTR's names
    assert main(base[:4] + base[5 + len(tr.sparse) :] + ["--output", str(tmp_path / "r.csv")]) == 0
    np.testing.assert_array_equal(np.loadtxt(tmp_path / "r.csv", delimiter=",", skiprows=1), csv)


def test_bench_inference_quick(capsys):
    hugectr.device.set_device("cpu")
    assert main(["bench", "inference", "--quick", "--min-time", "0.01", "--batches", "1,8"]) == 0
    out = capsys.readouterr().out
    assert "| batch | numbactr preds/s |" in out and "| 8 |" in out
    assert "| cache % of table | slots | hit rate |" in out
    rates = [
        float(line.split("|")[3]) for line in out.splitlines() if line.startswith("| 5%") or line.startswith("| 50%")
    ]
    assert len(rates) == 2 and 0 <= rates[0] <= rates[1] <= 1  # a bigger cache holds more of the keys
