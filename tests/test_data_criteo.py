"""Criteo TSV preprocessing (numbactr.data.criteo) and its fixture datasets/criteo/tiny_criteo.tsv."""

import json
import os
import pathlib
import sys

import numpy as np
import pandas as pd
import pytest

from numbactr.config import DataReaderParams
from numbactr.data import make_reader
from numbactr.data.criteo import CATS, CRITEO_COLUMNS, DENSE, main, preprocess_criteo, transform_dense
from numbactr.data.norm import read_norm_file
from numbactr.enums import Check_t, DataReaderType_t as T

ROOT = pathlib.Path(__file__).resolve().parent.parent
TSV = ROOT / "datasets" / "criteo" / "tiny_criteo.tsv"
sys.path.insert(0, str(ROOT / "datasets" / "criteo"))
import make_fixture  # noqa: E402


def test_fixture_is_reproducible_and_criteo_shaped():
    lines = TSV.read_text().splitlines()
    assert lines == make_fixture.make_lines(600, 2024)  # the committed file is the script's output
    rows = [ln.split("\t") for ln in lines]
    assert {len(r) for r in rows} == {40}
    assert {r[0] for r in rows} == {"0", "1"}
    assert any(r[2].startswith("-") for r in rows)  # negative I2 values, as in Criteo
    assert any(r[1] == "" for r in rows) and any("" in r[14:] for r in rows)  # missing values
    assert all(len(v) == 8 for r in rows for v in r[14:] if v)


def reference(min_count, log=True):
    """Independent pandas version of the transform, whole file in memory."""
    df = pd.read_csv(
        TSV,
        sep="\t",
        header=None,
        names=CRITEO_COLUMNS,
        dtype={c: str for c in CATS},
        keep_default_na=False,
        na_values=[""],
    )
    dense = df[DENSE].fillna(0.0).to_numpy(np.float64)
    if log:
        dense = np.where(dense > -1, np.log(np.where(dense > -1, dense, 0) + 1), -1)
    ids, sizes = [], []
    for c in CATS:
        v = df[c].fillna("").map(lambda x: int(x, 16) if x else -1)
        counts = v.value_counts()
        freq = sorted(k for k, n in counts.items() if n >= min_count)
        code = {k: i + 1 for i, k in enumerate(freq)}
        ids.append(v.map(lambda x: code.get(x, 0)).to_numpy())
        sizes.append(len(freq) + 1)
    return df["label"].to_numpy(np.float32), dense.astype(np.float32), np.stack(ids, 1), sizes


@pytest.mark.parametrize("chunk", [7, 10_000])
def test_parquet_output_matches_reference(tmp_path, chunk):
    r = preprocess_criteo(
        str(TSV),
        str(tmp_path),
        "parquet",
        min_count=4,
        eval_fraction=0.25,
        chunk_size=chunk,
        samples_per_file=200,
        verbose=False,
    )
    label, dense, ids, sizes = reference(4)
    assert r.slot_size_array == sizes and r.num_train == 450 and r.num_eval == 150
    assert json.load(open(tmp_path / "slot_size_array.json")) == sizes
    assert open(r.train_list).read().splitlines()[0] == "3"  # 200 + 200 + 50 rows
    p = DataReaderParams(T.Parquet, r.train_list, r.eval_list, Check_t.Non, slot_size_array=sizes)
    got = []
    for lst in (r.train_list, r.eval_list):
        got += list(make_reader(p, lst, 64, 1, 13, [26], [[1] * 26], True, False))
    lab = np.concatenate([b.label[: b.size, 0] for b in got])
    den = np.concatenate([b.dense[: b.size] for b in got])
    keys = np.concatenate([b.sparse[0][0][: 26 * b.size] for b in got]).reshape(-1, 26)
    np.testing.assert_array_equal(lab, label)
    np.testing.assert_allclose(den, dense, rtol=1e-6)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    np.testing.assert_array_equal(keys, ids + offsets)
    assert (ids == 0).any() and (ids > 0).any()  # rare bucket and frequent ids


def test_norm_output_is_globally_offset(tmp_path):
    r = preprocess_criteo(
        str(TSV),
        str(tmp_path),
        "norm",
        min_count=6,
        eval_fraction=0.0,
        chunk_size=100,
        samples_per_file=250,
        check=Check_t.Non,
        i64_keys=False,
        verbose=False,
    )
    label, dense, ids, sizes = reference(6)
    assert r.eval_list is None and r.num_train == 600
    files = open(r.train_list).read().split()[1:]
    assert len(files) == 3
    b = [read_norm_file(f, 1, 13, [26], Check_t.Non, np.uint32) for f in files]
    keys = np.concatenate([x.sparse[0][0] for x in b]).reshape(-1, 26)
    np.testing.assert_array_equal(keys, ids + np.concatenate([[0], np.cumsum(sizes)[:-1]]))
    np.testing.assert_allclose(np.concatenate([x.dense for x in b]), dense, rtol=1e-6)


def test_transform_dense():
    x = np.array([[np.nan, -3, -1, 0, 1, 1e9]])
    np.testing.assert_allclose(transform_dense(x), [[0, -1, -1, 0, np.log(2), np.log(1e9 + 1)]], rtol=1e-6)
    np.testing.assert_array_equal(transform_dense(x, log=False), [[0, -3, -1, 0, 1, 1e9]])


@pytest.mark.parametrize(
    "line,pattern",
    [
        ("2" + "\t" * 39, r"line 3: label must be 0 or 1, got 2.0"),
        ("1\tx" + "\t" * 38, r"line 3: column I1 value 'x' is not a number"),
        ("1" + "\t" * 14 + "zz12" + "\t" * 25, r"line 3: column C1 value 'zz12' is not a hex hash"),
        ("1" + "\t" * 40, r"line 3: 41 tab-separated fields, expected 40"),
        ("1" + "\t" * 38, r"line 3: 39 tab-separated fields, expected 40 .*pads short lines"),
        ("1\t\tinf" + "\t" * 37, r"line 3: column I2 value inf is not a finite count"),
    ],
)
def test_bad_lines(tmp_path, line, pattern):
    good = TSV.read_text().splitlines()[:2]
    f = tmp_path / "bad.tsv"
    f.write_text("\n".join(good + [line]) + "\n")
    with pytest.raises(ValueError, match=pattern) as e:
        preprocess_criteo(str(f), str(tmp_path / "out"), verbose=False)
    assert "bad.tsv" in str(e.value)


def test_cli(tmp_path, capsys):
    assert main([str(TSV), str(tmp_path / "o"), "--format", "norm", "--min-count", "6", "--chunk-size", "128"]) == 0
    out = capsys.readouterr().out
    sizes = json.loads(out.split("slot_size_array: ")[1].splitlines()[0])
    assert len(sizes) == 26 and sizes == json.load(open(tmp_path / "o" / "slot_size_array.json"))
    assert os.path.exists(tmp_path / "o" / "train" / "_file_list.txt")
    assert main([str(tmp_path / "missing.tsv"), str(tmp_path / "o2")]) == 1
    assert "cannot be read" in capsys.readouterr().err
