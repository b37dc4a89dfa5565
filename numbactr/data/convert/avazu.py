"""Avazu click logs (Kaggle's CSV) -> HugeCTR data for DeepFM, DCN, DLRM.

    numbactr data avazu train.csv out/ --format parquet

Input: a header line ``id,click,hour,C1,banner_pos,site_id,...,C21`` (24 columns in Kaggle's train
file), then one impression per line. ``click`` (0/1) is the label; ``hour`` is YYMMDDHH; every other
column but ``id`` is categorical (hex ids, small integers, all kept as text). Kaggle's test file has no
``click`` column and cannot be converted (there is nothing to learn from).
Features: ``hour`` becomes two slots, the hour of the day (0-23) and the weekday (0 = Monday), as in
the BARS / FuxiCTR preprocessing; each other column is one slot. Per slot, values seen fewer than
``min_count`` (2) times in the whole file share id 0 and the others get ids 1..K in ascending order of
value (the Criteo converter's rule), so slot_size_array[k] = K + 1. 23 one-hot slots, no dense features.
The file is streamed twice (pass 1 counts, pass 2 encodes and writes), so files larger than memory
convert. Split: the last ``eval_fraction`` of the lines (Avazu is in time order; no shuffling), or an
explicit ``eval_source`` file with the same header.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from numbactr import log
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

__all__ = ["convert_avazu", "main"]

WHAT = "Avazu"


def _header(path: str, encoding: str) -> list:
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"{WHAT} file {path!r} cannot be read ({e})") from None
    with f:
        for line in f:
            if line.strip():
                break
        else:
            raise ValueError(f"{WHAT} file {path!r} is empty")
    cols = line.decode(encoding, errors="replace").strip().split(",")
    for need in ("click", "hour"):
        if need not in cols:
            raise ValueError(
                f"{WHAT} file {path!r}, line 1: the header {cols[:4]}... has no {need!r} column "
                f"(expected Kaggle's train.csv header id,click,hour,C1,...; the test file has no labels)"
            )
    return cols


def _chunks(path, cols, chunk_size, encoding):
    """Yield (label (n,) float32, features {name: (n,) values}) per chunk, hour split in two."""
    ic, ih = cols.index("click"), cols.index("hour")
    cats = [k for k, c in enumerate(cols) if c not in ("id", "click", "hour")]
    header = lambda s: s.split(",")[0] == cols[0]  # noqa: E731
    for lines, nums in read_blocks(path, WHAT, chunk_size, encoding, skip_header=header):
        rows = split_fields(lines, nums, ",", len(cols), path, WHAT, f"the header's {len(cols)} columns")
        fields = list(zip(*rows))
        label = to_numbers(fields[ic], nums, path, WHAT, "click", np.int64)
        if not np.isin(label, (0, 1)).all():
            i = int(np.argmax(~np.isin(label, (0, 1))))
            raise ValueError(f"{WHAT} file {path!r}, line {nums[i]}: click must be 0 or 1, got {label[i]}")
        hour = np.asarray(fields[ih])
        bad = (np.char.str_len(hour) != 8) | ~np.char.isdigit(hour)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{WHAT} file {path!r}, line {nums[i]}: hour {str(hour[i])!r} is not YYMMDDHH")
        h = hour.astype(np.int64)
        day = np.array([f"20{d[:2]}-{d[2:4]}-{d[4:6]}" for d in hour.tolist()], dtype="datetime64[D]")
        feats = {"hour_of_day": h % 100, "weekday": (day.astype(np.int64) + 3) % 7}  # 1970-01-01 is a Thursday
        for k in cats:
            feats[cols[k]] = np.asarray(fields[k])
        yield label.astype(np.float32), feats


def convert_avazu(
    source: str,
    out_dir: str,
    fmt: str = "parquet",
    eval_source: str | None = None,
    eval_fraction: float = 0.1,
    min_count: int = 2,
    seed: int = 0,
    samples_per_file: int = 1_000_000,
    i64_keys: bool = True,
    check=Check_t.Sum,
    chunk_size: int = 500_000,
    encoding: str = "utf-8",
    verbose: bool = True,
):
    """Convert an Avazu CSV; see the module docstring. Returns a ConversionResult."""
    if min_count < 1 or not 0 <= eval_fraction < 1:
        raise ValueError("min_count must be >= 1 and 0 <= eval_fraction < 1")
    cols = _header(source, encoding)
    files = [source] + ([eval_source] if eval_source else [])
    if eval_source and _header(eval_source, encoding) != cols:
        raise ValueError(f"{WHAT} file {eval_source!r}: its header differs from {source!r}'s")
    names = ["hour_of_day", "weekday"] + [c for c in cols if c not in ("id", "click", "hour")]
    vocab = {nm: Vocab() for nm in names}
    counts = []
    with log.progress(desc=f"{WHAT} pass 1/2: count categories", unit="line") as bar:
        for path in files:
            n = 0
            for label, feats in _chunks(path, cols, chunk_size, encoding):
                for nm in names:
                    vocab[nm].count(feats[nm])
                n += len(label)
                bar.update(len(label))
            counts.append(n)
    sizes = [vocab[nm].freeze(min_count) for nm in names]
    if eval_source:
        n_train, split = counts[0], "the eval input"
    else:
        n_eval = min(int(round(counts[0] * eval_fraction)), counts[0] - 1)
        n_train, split = counts[0] - n_eval, f"the last {eval_fraction} of the lines (time order)"
    splits = make_splits(out_dir, fmt, ["click"], [], names, sizes, samples_per_file, i64_keys, check)
    row = 0
    for fi, path in enumerate(files):
        for label, feats in _chunks(path, cols, chunk_size, encoding):
            ids = np.stack([vocab[nm].encode(feats[nm]) for nm in names], axis=1)
            if eval_source:
                cut = len(label) if fi == 0 else 0  # the first file trains, the eval input evaluates
            else:
                cut = min(max(n_train - row, 0), len(label))  # rows [0, cut) of this chunk train
            splits["train"].write(label[:cut], None, ids[:cut])
            splits["eval"].write(label[cut:], None, ids[cut:])
            row += len(label)
    return finish(
        splits,
        out_dir,
        verbose,
        converter="avazu",
        inputs=[os.path.abspath(p) for p in files],
        label_dim=1,
        dense_dim=0,
        slot_num=len(names),
        slot_names=names,
        slot_size_array=sizes,
        max_nnz_per_slot=[1] * len(names),
        label="1 = click, 0 = no click",
        i64_input_key=i64_keys,
        rows_read=sum(counts),
        dropped={},
        split=split,
        seed=seed,
        extra={
            "min_count": min_count,
            "rare_values_per_slot": {nm: vocab[nm].rare for nm in names},
        },
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="numbactr data avazu", description="Avazu CSV click logs -> HugeCTR data.")
    ap.add_argument("input", help="Kaggle's train.csv (or a part of it with the header line)")
    ap.add_argument("out_dir", help="output folder: OUT/train, OUT/eval, slot_size_array.json, conversion.json")
    ap.add_argument("--eval-input", default=None, help="eval file with the same header (default: a fraction)")
    ap.add_argument("--eval-fraction", type=float, default=0.1, help="last fraction of the lines for eval")
    ap.add_argument("--min-count", type=int, default=2, help="rarer values share id 0 (default 2)")
    ap.add_argument("--encoding", default="utf-8", help="text encoding of the input (default utf-8)")
    add_common_args(ap)
    a = ap.parse_args(argv)
    return run_main(
        ap.prog,
        convert_avazu,
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
