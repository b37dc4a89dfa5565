"""libFM and libSVM text files (Frappe, MovieLens-tag and the other BARS / FM-family files) -> HugeCTR data.

    numbactr data libfm frappe.train.libfm out/ --eval-input frappe.validation.libfm
    numbactr data libsvm a9a out/ --fields position

Input: one sample per line, whitespace-separated: a label, then the features,
  libFM   ``label field:feature:value ...``   (fields given, 0-based integers)
  libSVM  ``label feature:value ...``          (fields inferred, see ``fields``)
Labels: -1 or 0 -> 0 and 1 -> 1 (``regression=True`` keeps any finite label). A feature whose value is
0 is absent (dropped, counted); any other value keeps the feature (HugeCTR's sparse inputs hold keys,
not weights: conversion.json counts the values other than 1). Blank lines are skipped.
Fields (libSVM): ``"position"`` (default): the k-th feature of a line is field k (Frappe's files list
one feature per field, in field order); ``"single"``: every feature in one multi-hot slot; a list of
ascending feature-index boundaries ``[b_0, b_1, ...]``: field k holds features ``[b_k, b_{k+1})``.
Slots: field k is slot k (slot_num = the largest field + 1). Per slot, feature indices seen at least
``min_count`` (1) times over all inputs get ids 1..K in ascending order, so slot_size_array[k] = K + 1;
id 0 stands for a rare feature and, in a one-hot slot, for a sample without a feature in that field.
A slot is multi-hot when some sample has more than one feature in it (max_nnz_per_slot in
conversion.json); Raw holds one key per slot and refuses multi-hot data. Both inputs are streamed
twice (pass 1 counts, pass 2 encodes). Split: ``eval_source`` (Frappe's and BARS's validation file) or
the last ``eval_fraction`` of the lines.
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
)
from numbactr.enums import Check_t

__all__ = ["convert_libfm", "main"]


def _parse(lines, nums, path, kind, fields, regression, stats):
    """-> label (n,) float32, row (M,), field (M,), feature (M,) int64 for the features of n lines."""
    what = "libFM" if kind == "libfm" else "libSVM"
    want = 3 if kind == "libfm" else 2
    labels, row, fld, feat = [], [], [], []
    for r, (ln, num) in enumerate(zip(lines, nums)):
        tok = ln.split()
        try:
            y = float(tok[0])
        except ValueError:
            raise ValueError(f"{what} file {path!r}, line {num}: label {tok[0]!r} is not a number") from None
        if not regression:
            if y not in (-1.0, 0.0, 1.0):
                raise ValueError(
                    f"{what} file {path!r}, line {num}: label {tok[0]!r} is not -1, 0 or 1 "
                    f"(regression=True / --regression keeps other labels)"
                )
            y = max(y, 0.0)
        elif not np.isfinite(y):
            raise ValueError(f"{what} file {path!r}, line {num}: label {tok[0]!r} is not finite")
        labels.append(y)
        for pos, t in enumerate(tok[1:]):
            p = t.split(":")
            try:
                if len(p) != want:
                    raise ValueError
                v = float(p[-1])
                ints = [int(x) for x in p[:-1]]
                if min(ints) < 0 or not np.isfinite(v):
                    raise ValueError
            except ValueError:
                shape = "field:feature:value" if kind == "libfm" else "feature:value"
                raise ValueError(
                    f"{what} file {path!r}, line {num}: {t!r} is not {shape} (non-negative integers, a finite value)"
                ) from None
            if v == 0:
                stats["zero_values_dropped"] += 1
                continue
            if v != 1:
                stats["non_unit_values_kept_as_keys"] += 1
            f = ints[0] if kind == "libfm" else pos if isinstance(fields, str) and fields == "position" else 0
            row.append(r)
            fld.append(f)
            feat.append(ints[-1])
    row, fld, feat = (np.asarray(a, np.int64) for a in (row, fld, feat))
    if isinstance(fields, np.ndarray):
        fld = np.searchsorted(fields, feat, side="right") - 1
        if (fld < 0).any():
            i = int(np.argmax(fld < 0))
            raise ValueError(
                f"{what} file {path!r}, line {nums[row[i]]}: feature {feat[i]} lies before the first field boundary"
            )
    return np.asarray(labels, np.float32), row, fld, feat


def convert_libfm(
    source: str,
    out_dir: str,
    fmt: str = "parquet",
    kind: str = "libfm",
    fields="position",
    eval_source: str | None = None,
    eval_fraction: float = 0.1,
    min_count: int = 1,
    regression: bool = False,
    seed: int = 0,
    samples_per_file: int = 1_000_000,
    i64_keys: bool = True,
    check=Check_t.Sum,
    chunk_size: int = 500_000,
    encoding: str = "utf-8",
    verbose: bool = True,
):
    """Convert a libFM (kind="libfm") or libSVM (kind="libsvm") file; see the module docstring."""
    if kind not in ("libfm", "libsvm"):
        raise ValueError(f"kind must be 'libfm' or 'libsvm', got {kind!r}")
    if not (isinstance(fields, (list, tuple, np.ndarray)) or fields in ("position", "single")):
        raise ValueError(f"fields must be 'position', 'single' or a list of boundaries, got {fields!r}")
    if isinstance(fields, (list, tuple, np.ndarray)):
        fields = np.asarray(fields, np.int64)
        if len(fields) == 0 or (np.diff(fields) <= 0).any():
            raise ValueError(f"field boundaries must be a non-empty ascending list, got {fields.tolist()}")
    if min_count < 1 or not 0 <= eval_fraction < 1:
        raise ValueError("min_count must be >= 1 and 0 <= eval_fraction < 1")
    what = "libFM" if kind == "libfm" else "libSVM"
    files = [source] + ([eval_source] if eval_source else [])
    stats = {"zero_values_dropped": 0, "non_unit_values_kept_as_keys": 0}

    def chunks(path):
        for lines, nums in read_blocks(path, what, chunk_size, encoding):
            yield _parse(lines, nums, path, kind, fields, regression, stats)

    # pass 1: slots, vocabularies, keys per slot per sample
    vocab, max_nnz, counts = {}, {}, []
    with log.progress(desc=f"{what} pass 1/2: count features", unit="line") as bar:
        for path in files:
            n = 0
            for label, row, fld, feat in chunks(path):
                for f in np.unique(fld).tolist():
                    m = fld == f
                    vocab.setdefault(f, Vocab()).count(feat[m])
                    max_nnz[f] = max(max_nnz.get(f, 0), int(np.bincount(row[m]).max()))
                n += len(label)
                bar.update(len(label))
            counts.append(n)
    S = max(vocab) + 1 if vocab else 0
    if S == 0:
        raise ValueError(f"{what} file {source!r} has no features")
    sizes = [vocab[k].freeze(min_count) if k in vocab else 1 for k in range(S)]
    nnz = [max_nnz.get(k, 1) for k in range(S)]
    if fmt == "raw" and max(nnz) > 1:
        k = int(np.argmax(nnz))
        raise ValueError(f"{what}: field {k} has up to {nnz[k]} features per sample; Raw holds one key per slot")
    names = [f"field_{k}" for k in range(S)]
    if eval_source:
        n_train, split = counts[0], "the eval input"
    else:
        n_eval = min(int(round(counts[0] * eval_fraction)), counts[0] - 1)
        n_train, split = counts[0] - n_eval, f"the last {eval_fraction} of the lines (file order)"

    # pass 2: encode and write
    splits = make_splits(out_dir, fmt, ["label"], [], names, sizes, samples_per_file, i64_keys, check)
    stats = {k: 0 for k in stats}  # pass 2 counts them again
    row0 = 0
    for fi, path in enumerate(files):
        for label, row, fld, feat in chunks(path):
            n = len(label)
            slots = []
            for k in range(S):
                m = fld == k
                ids = vocab[k].encode(feat[m]) if k in vocab else np.zeros(0, np.int64)
                if nnz[k] == 1:
                    one = np.zeros(n, np.int64)
                    one[row[m]] = ids
                    slots.append(one)
                else:
                    order = np.argsort(row[m], kind="stable")
                    slots.append((ids[order], np.bincount(row[m], minlength=n).astype(np.int64)))
            if eval_source:
                cut = n if fi == 0 else 0
            else:
                cut = min(max(n_train - row0, 0), n)
            for name, a, b in (("train", 0, cut), ("eval", cut, n)):
                if b > a:
                    part = [_slice(s, a, b) for s in slots]
                    splits[name].write(label[a:b], None, np.stack(part, 1) if max(nnz) == 1 else part)
            row0 += n
    return finish(
        splits,
        out_dir,
        verbose,
        converter=kind,
        inputs=[os.path.abspath(p) for p in files],
        label_dim=1,
        dense_dim=0,
        slot_num=S,
        slot_names=names,
        slot_size_array=sizes,
        max_nnz_per_slot=nnz,
        label="the label as given (regression)" if regression else "1 = label 1, 0 = label -1 or 0",
        i64_input_key=i64_keys,
        rows_read=sum(counts),
        dropped={"features with value 0 (absent)": stats["zero_values_dropped"]}
        if stats["zero_values_dropped"]
        else {},
        split=split,
        seed=seed,
        extra={
            "fields": fields.tolist() if isinstance(fields, np.ndarray) else ("given" if kind == "libfm" else fields),
            "min_count": min_count,
            "non_unit_values_kept_as_keys": stats["non_unit_values_kept_as_keys"],
        },
    )


def _slice(s, a, b):
    if not isinstance(s, tuple):
        return s[a:b]
    vals, lens = s
    off = np.concatenate([[0], np.cumsum(lens)])
    return vals[off[a] : off[b]], lens[a:b]


def main(argv=None, kind: str = "libfm") -> int:
    what = "libFM" if kind == "libfm" else "libSVM"
    ap = argparse.ArgumentParser(prog=f"numbactr data {kind}", description=f"{what} text files -> HugeCTR data.")
    ap.add_argument("input", help=f"{what} file (training data, or all of it with --eval-fraction)")
    ap.add_argument("out_dir", help="output folder: OUT/train, OUT/eval, slot_size_array.json, conversion.json")
    ap.add_argument("--eval-input", default=None, help="eval file (e.g. Frappe's validation file)")
    ap.add_argument("--eval-fraction", type=float, default=0.1, help="without --eval-input: last fraction")
    if kind == "libsvm":
        ap.add_argument(
            "--fields",
            default="position",
            help="'position' (k-th feature = field k), 'single' (one multi-hot slot) or comma-separated "
            "ascending feature-index boundaries of the fields",
        )
    ap.add_argument("--min-count", type=int, default=1, help="rarer features share id 0 (default 1)")
    ap.add_argument("--regression", action="store_true", help="keep labels as they are (default: -1/0/1 -> 0/1)")
    ap.add_argument("--encoding", default="utf-8", help="text encoding of the input (default utf-8)")
    add_common_args(ap)
    a = ap.parse_args(argv)
    fields = getattr(a, "fields", "position")
    if fields not in ("position", "single"):
        try:
            fields = [int(x) for x in fields.split(",")]
        except ValueError:
            ap.error(f"--fields: expected position, single or integers separated by commas, got {fields!r}")
    return run_main(
        ap.prog,
        convert_libfm,
        a.input,
        a.out_dir,
        kind=kind,
        fields=fields,
        eval_source=a.eval_input,
        eval_fraction=a.eval_fraction,
        min_count=a.min_count,
        regression=a.regression,
        encoding=a.encoding,
        **common_kwargs(a),
    )


if __name__ == "__main__":
    sys.exit(main())
