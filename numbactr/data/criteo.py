"""Criteo click logs (TSV) -> HugeCTR Norm or Parquet, the way HugeCTR's pandas tool prepares them.

    numbactr data criteo day_0.tsv out/ --format parquet      # or: python -m numbactr.data.criteo ...

Input: one sample per line, 40 tab-separated fields: label (0/1), I1..I13 integer counts, C1..C26
categorical values as hex hashes (any field but the label may be empty = missing).
Transform (HugeCTR tools/criteo_script/preprocess.py, which the pandas path of tools/preprocess.sh runs):
  dense  missing -> 0, then log(x + 1) for x > -1 and -1 otherwise (--no-log-dense keeps the counts)
  cats   missing is a category of its own; per slot, categories seen fewer than --min-count times (6,
         HugeCTR's threshold) all map to id 0; the others are label-encoded 1..K in ascending order of
         their hash value (missing first). slot_size_array[k] = K + 1.
  keys   Norm: id + sum(slot_size_array[:k]) (globally unique, Norm keys are used verbatim);
         Parquet: the per-slot id (the reader adds the same offsets from DataReaderParams.slot_size_array).
The file is streamed twice in chunks (--chunk-size lines): pass 1 counts categories, pass 2 encodes and
writes, so inputs larger than memory convert (the per-slot category counts must fit). The first lines go
to train, the last --eval-fraction of them to eval (no shuffling; HugeCTR's script shuffles with `shuf`
beforehand). Output:
  OUT/train/{_file_list.txt, part_<k>.data | part_<k>.parquet [+ _metadata.json]}, OUT/eval/... likewise
and the slot_size_array is printed (and written to OUT/slot_size_array.json).
Bad input raises ValueError naming the file and the 1-based line (blank lines count in the numbering,
and are skipped: they hold no sample): a byte that is not ASCII (Criteo's files are ASCII, so such a byte
means a damaged or foreign file: it is refused, with its column and byte offset, rather than decoded as
some other encoding), a line with more or fewer than 40 fields (with lenient=True /
--pad-short-lines, a short line is padded with missing values instead), a count that is not a finite
number, a non-hex category, a label other than 0/1.
HugeCTR: tools/criteo_script/preprocess.py, tools/criteo_script/criteo2hugectr.cpp, tools/preprocess.sh.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import sys
from dataclasses import dataclass

import numpy as np

from numbactr import log
from numbactr.enums import Check_t
from numbactr.data.validation import slot_offsets
from numbactr.data.file_list import write_file_list
from numbactr.data.norm import NormWriter
from numbactr.data.parquet import ParquetDatasetWriter

__all__ = ["CRITEO_COLUMNS", "CriteoResult", "preprocess_criteo", "main"]

DENSE = [f"I{i}" for i in range(1, 14)]
CATS = [f"C{i}" for i in range(1, 27)]
CRITEO_COLUMNS = ["label"] + DENSE + CATS
MISSING = -1  # the hash value that stands for an empty categorical field


@dataclass
class CriteoResult:
    out_dir: str
    format: str  # "norm" or "parquet"
    train_list: str
    eval_list: str | None
    slot_size_array: list
    num_train: int
    num_eval: int
    i64_keys: bool
    check: object = Check_t.Sum
    dense_dim: int = 13
    slot_num: int = 26


# ---------------------------------------------------------------------------------------------------
# parsing

_LUT = np.full(256, 255, dtype=np.int64)
_LUT[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_LUT[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_LUT[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


def _hex_column(col, path, lines, name) -> np.ndarray:
    """pandas Series of hex strings / NaN -> (n,) int64 hash values, MISSING for empty fields.
    lines (n,): the 1-based file line of every row (for messages)."""
    miss = col.isna().to_numpy()
    strs = col.to_numpy(dtype=object)
    strs[miss] = ""
    try:
        b = np.array(strs, dtype="S17")  # up to 16 hex digits; 17 bytes detects longer ones
    except UnicodeEncodeError:
        bad = next(i for i, x in enumerate(strs) if not str(x).isascii())
        raise ValueError(
            f"Criteo file {path!r}, line {lines[bad]}: column {name} holds a non-ASCII value {strs[bad]!r}"
        ) from None
    u = b.view(np.uint8).reshape(len(b), 17)
    lens = (u != 0).sum(axis=1)
    val = np.zeros(len(b), dtype=np.uint64)
    bad = lens > 16
    for j in range(16):
        c = _LUT[u[:, j]]
        act = j < lens
        bad |= act & (c == 255)
        val = np.where(act, val * np.uint64(16) + c.astype(np.uint64), val)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"Criteo file {path!r}, line {lines[i]}: column {name} value {strs[i]!r} is not "
            f"a hex hash of at most 16 digits"
        )
    out = (val & np.uint64(0x7FFFFFFFFFFFFFFF)).astype(np.int64)  # keep it non-negative: MISSING is -1
    out[lens == 0] = MISSING
    return out


FIELDS = len(CRITEO_COLUMNS)  # 40


def _field_counts(block: bytes, path: str, first_line: int, lenient: bool):
    """Check the field count of every line of `block` (whole lines, each ending in a newline).

    Returns (block with short lines padded when lenient, line (n,) 1-based file line of every non-blank
    line, number of padded lines). Blank lines carry no sample and are skipped, but they count in the
    line numbers. A line with more than 40 fields, or fewer without `lenient`, raises ValueError
    naming the file and the line."""
    buf = np.frombuffer(block, dtype=np.uint8)
    ends = np.flatnonzero(buf == 10)  # (m,) position of each '\n'
    starts = np.r_[0, ends[:-1] + 1]
    length = ends - starts  # without the newline
    has_cr = length > 0
    has_cr[has_cr] = buf[ends[has_cr] - 1] == 13
    blank = length - has_cr == 0  # "" or "\r"
    tabs = np.add.reduceat(buf == 9, starts, dtype=np.int64) if len(starts) else np.zeros(0, np.int64)
    tabs[length == 0] = 0  # reduceat of an empty line: 1 item
    fields = tabs + 1
    bad = ~blank & ((fields > FIELDS) | ((fields < FIELDS) & (not lenient)))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"Criteo file {path!r}, line {first_line + i}: {int(fields[i])} tab-separated fields, "
            f"expected {FIELDS} (label, I1..I13, C1..C26)"
            + ("" if fields[i] > FIELDS else "; lenient=True (--pad-short-lines) pads short lines with missing values")
        )
    short = np.flatnonzero(~blank & (fields < FIELDS))
    if len(short):  # lenient: append the missing (empty) fields
        pieces, a = [], 0
        for i in short:
            e = int(ends[i]) - int(has_cr[i])
            pieces += [block[a:e], b"\t" * int(FIELDS - fields[i])]
            a = e
        pieces.append(block[a:])
        block = b"".join(pieces)
    return block, first_line + np.flatnonzero(~blank), len(short)


def _chunks(path: str, chunk_size: int, lenient: bool = False, stats: dict | None = None):
    """Yield (line (n,) 1-based file lines, label (n,) float32, dense (n, 13) float64 with NaN,
    cats (n, 26) int64) for chunks of up to chunk_size lines. stats["padded"] counts padded lines."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("Criteo preprocessing needs pandas: pip install 'numbactr[parquet]'") from None
    dtypes = {"label": "float64", **{c: "float64" for c in DENSE}, **{c: "string" for c in CATS}}
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"Criteo file {path!r} cannot be read ({e})") from None
    first, at = 1, 0  # the block's first line (1-based) and byte offset in the file
    with f:
        while True:
            raw_lines = list(itertools.islice(f, chunk_size))
            if not raw_lines:
                return
            block = b"".join(raw_lines)
            _check_ascii(block, path, first, at)
            at += len(block)
            if not block.endswith(b"\n"):
                block += b"\n"  # a last line without newline
            block, lines, padded = _field_counts(block, path, first, lenient)
            if stats is not None:
                stats["padded"] = stats.get("padded", 0) + padded
            if len(lines):
                df = _parse(pd, block, dtypes, path, lines)
                label = df["label"].to_numpy()
                bad = ~np.isin(label, (0.0, 1.0))
                if bad.any():
                    i = int(np.argmax(bad))
                    raise ValueError(f"Criteo file {path!r}, line {lines[i]}: label must be 0 or 1, got {label[i]}")
                dense = df[DENSE].to_numpy(dtype=np.float64)
                if np.isinf(dense).any():
                    i, j = np.unravel_index(int(np.argmax(np.isinf(dense))), dense.shape)
                    raise ValueError(
                        f"Criteo file {path!r}, line {lines[i]}: column {DENSE[j]} value "
                        f"{dense[i, j]} is not a finite count"
                    )
                cats = np.empty((len(lines), 26), dtype=np.int64)
                for k, c in enumerate(CATS):
                    cats[:, k] = _hex_column(df[c], path, lines, c)
                yield lines, label.astype(np.float32), dense, cats
            first += len(raw_lines)


def _check_ascii(block: bytes, path: str, first_line: int, at: int) -> None:
    """ValueError naming the file, line, column and byte offset of the first byte >= 128 of ``block`` (whole
    lines from line first_line, at byte offset ``at`` of the file)."""
    buf = np.frombuffer(block, dtype=np.uint8)
    high = buf >= 128
    if not high.any():
        return
    pos = int(np.argmax(high))
    before = buf[:pos]
    newlines = np.flatnonzero(before == 10)
    start = int(newlines[-1]) + 1 if newlines.size else 0
    field = int(np.count_nonzero(before[start:] == 9))
    column = CRITEO_COLUMNS[field] if field < FIELDS else f"field {field + 1}"
    raise ValueError(
        f"Criteo file {path!r}, line {first_line + newlines.size}: byte 0x{int(buf[pos]):02x} at byte offset "
        f"{at + pos} (column {column}) is not ASCII; Criteo's files are ASCII (a label, counts and hex "
        "hashes), so the file is damaged or not a Criteo click log"
    )


def _parse(pd, block: bytes, dtypes: dict, path: str, lines: np.ndarray):
    """DataFrame of the non-blank lines of `block` (every line has 40 fields: checked before)."""
    opts = dict(
        sep="\t", header=None, names=CRITEO_COLUMNS, keep_default_na=False, na_values=[""], quoting=3, engine="c"
    )
    try:
        return pd.read_csv(io.BytesIO(block), dtype=dtypes, **opts)
    except ValueError:
        pass
    # a field that is not a number: parse as text to name the line and the column
    df = pd.read_csv(io.BytesIO(block), dtype=str, **opts)
    for c in ["label"] + DENSE:
        num = pd.to_numeric(df[c], errors="coerce")
        bad = (num.isna() & df[c].notna()).to_numpy()
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"Criteo file {path!r}, line {lines[i]}: column {c} value {df[c].iloc[i]!r} is not a number"
            ) from None
    raise ValueError(f"Criteo file {path!r}, lines {lines[0]}-{lines[-1]}: cannot be parsed")


def transform_dense(dense: np.ndarray, log: bool = True) -> np.ndarray:
    """HugeCTR's dense preprocessing: missing -> 0, then log(x + 1) if x > -1 else -1."""
    d = np.nan_to_num(dense, nan=0.0)
    if log:
        ok = d > -1
        d = np.where(ok, np.log1p(np.where(ok, d, 0.0)), -1.0)
    return d.astype(np.float32)


# ---------------------------------------------------------------------------------------------------
# pass 1: category counts


class _Counter:
    """Per slot sorted (values, counts), merged lazily so a chunk costs one np.unique."""

    def __init__(self, slots: int):
        self.pending = [[] for _ in range(slots)]

    def add(self, cats: np.ndarray) -> None:
        for k in range(cats.shape[1]):
            self.pending[k].append(np.unique(cats[:, k], return_counts=True))
            if len(self.pending[k]) >= 16:
                self.pending[k] = [self._merge(self.pending[k])]

    @staticmethod
    def _merge(parts):
        vals = np.concatenate([p[0] for p in parts])
        cnts = np.concatenate([p[1] for p in parts])
        u, inv = np.unique(vals, return_inverse=True)
        return u, np.bincount(inv, weights=cnts, minlength=len(u)).astype(np.int64)

    def result(self, k: int):
        parts = self.pending[k]
        return self._merge(parts) if parts else (np.zeros(0, np.int64), np.zeros(0, np.int64))


# ---------------------------------------------------------------------------------------------------
# writers that rotate files every samples_per_file rows


class _NormSplit:
    def __init__(self, d, samples_per_file, check, i64, offsets):
        self.d, self.spf, self.check = d, samples_per_file, check
        self.kd = np.int64 if i64 else np.uint32
        self.offsets = offsets
        self.files, self.w, self.rows = [], None, 0

    def write(self, label, dense, ids):
        keys = ids + self.offsets  # (n, 26) globally offset
        a = 0
        while a < len(label):
            if self.w is None or self.rows == self.spf:
                self._next()
            b = min(len(label), a + self.spf - self.rows)
            self.w.write(label[a:b].reshape(-1, 1), dense[a:b], keys[a:b])
            self.rows += b - a
            a = b

    def _next(self):
        if self.w is not None:
            self.w.close()
        path = os.path.join(self.d, f"part_{len(self.files)}.data")
        self.w = NormWriter(path, 1, 13, 26, self.check, self.kd)
        self.files.append(path)
        self.rows = 0

    def close(self):
        if self.w is not None:
            self.w.close()
        if not self.files:
            return None
        lst = os.path.join(self.d, "_file_list.txt")
        write_file_list(lst, self.files)
        return lst


class _ParquetSplit:
    def __init__(self, d, samples_per_file):
        self.w = ParquetDatasetWriter(d, 1, 13, 26, label_names=["label"], dense_names=DENSE, cat_names=CATS)
        self.spf, self.rows, self.nfiles, self.open = samples_per_file, 0, 0, False

    def write(self, label, dense, ids):
        a = 0
        while a < len(label):
            if not self.open or self.rows == self.spf:
                if self.open:
                    self.w.end_file()
                self.w.begin_file(f"part_{self.nfiles}.parquet")
                self.nfiles += 1
                self.open, self.rows = True, 0
            b = min(len(label), a + self.spf - self.rows)
            self.w.append(label[a:b], dense[a:b], ids[a:b])
            self.rows += b - a
            a = b

    def close(self):
        if self.open:
            self.w.end_file()
        return self.w.close() if self.w.files else None


# ---------------------------------------------------------------------------------------------------


def preprocess_criteo(
    input_path: str,
    out_dir: str,
    fmt: str = "parquet",
    min_count: int = 6,
    eval_fraction: float = 0.1,
    chunk_size: int = 500_000,
    samples_per_file: int = 1_000_000,
    log_dense: bool = True,
    check=Check_t.Sum,
    i64_keys: bool = True,
    verbose: bool = True,
    lenient: bool = False,
) -> CriteoResult:
    """Convert a Criteo TSV file; see the module docstring. Returns the lists and slot_size_array.
    lenient=True pads lines with fewer than 40 fields with missing values instead of failing."""
    fmt = fmt.lower()
    if fmt not in ("norm", "parquet"):
        raise ValueError(f"format must be 'norm' or 'parquet', got {fmt!r}")
    if min_count < 1 or chunk_size < 1 or samples_per_file < 1 or not 0 <= eval_fraction < 1:
        raise ValueError("min_count, chunk_size and samples_per_file must be >= 1 and 0 <= eval_fraction < 1")
    say = print if verbose else (lambda *a, **k: None)

    # pass 1: count
    counter = _Counter(26)
    total = 0
    stats = {"padded": 0}
    with log.progress(desc="criteo pass 1/2: count categories", unit="line") as bar:
        for _, label, _, cats in _chunks(input_path, chunk_size, lenient, stats):
            counter.add(cats)
            total += len(label)
            bar.update(len(label))
    if total == 0:
        raise ValueError(f"Criteo file {input_path!r} has no samples")
    vocab, sizes = [], []
    for k in range(26):
        u, c = counter.result(k)
        frequent = u[c >= min_count]  # sorted ascending (np.unique)
        vocab.append(frequent)
        sizes.append(int(len(frequent)) + 1)  # + the shared rare bucket, id 0
    n_eval = int(round(total * eval_fraction))
    if eval_fraction > 0:
        n_eval = min(max(n_eval, 1), total - 1)
    n_train = total - n_eval
    if n_train < 1:
        raise ValueError(f"Criteo file {input_path!r}: {total} sample(s) leave none for training")
    say(
        f"[numbactr] Criteo {input_path}: {total} samples, train {n_train}, eval {n_eval}, "
        f"min_count {min_count}" + (f", {stats['padded']} short line(s) padded" if lenient else "")
    )

    # pass 2: encode and write
    offsets = slot_offsets(sizes)
    if not i64_keys and sum(sizes) > 0xFFFFFFFF:
        raise ValueError(f"the {sum(sizes)} keys do not fit uint32 keys; use i64 keys")
    out_dir = os.path.abspath(out_dir)
    splits = {}
    for name in ("train", "eval"):
        d = os.path.join(out_dir, name)
        os.makedirs(d, exist_ok=True)
        splits[name] = (
            _NormSplit(d, samples_per_file, check, i64_keys, offsets)
            if fmt == "norm"
            else _ParquetSplit(d, samples_per_file)
        )
    row = 0
    bar = log.progress(total=total, desc=f"criteo pass 2/2: write {fmt}", unit="line")
    for _, label, dense, cats in _chunks(input_path, chunk_size, lenient):
        bar.update(len(label))
        ids = np.empty_like(cats)
        for k in range(26):
            v = vocab[k]
            pos = np.searchsorted(v, cats[:, k])
            hit = pos < len(v)
            hit[hit] = v[pos[hit]] == cats[hit, k]
            ids[:, k] = np.where(hit, pos + 1, 0)
        d = transform_dense(dense, log_dense)
        cut = min(max(n_train - row, 0), len(label))  # rows [0, cut) of this chunk are train
        if cut:
            splits["train"].write(label[:cut], d[:cut], ids[:cut])
        if cut < len(label):
            splits["eval"].write(label[cut:], d[cut:], ids[cut:])
        row += len(label)
    bar.close()
    train_list = splits["train"].close()
    eval_list = splits["eval"].close()
    with open(os.path.join(out_dir, "slot_size_array.json"), "w") as f:
        json.dump(sizes, f)
    say(f"[numbactr] wrote {fmt} data to {out_dir} (train list {train_list}, eval list {eval_list})")
    say(f"slot_size_array: {sizes}")
    return CriteoResult(out_dir, fmt, train_list, eval_list, sizes, n_train, n_eval, i64_keys, check)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="numbactr data criteo",
        description="Criteo TSV -> HugeCTR Norm or Parquet (HugeCTR's pandas preprocessing, streamed in chunks).",
    )
    ap.add_argument("input", help="Criteo TSV file (label, I1..I13, C1..C26)")
    ap.add_argument("out_dir", help="output folder: OUT/train, OUT/eval, OUT/slot_size_array.json")
    ap.add_argument(
        "--format",
        choices=["parquet", "norm"],
        default="parquet",
        help="HugeCTR data format to write (default: %(default)s)",
    )
    ap.add_argument(
        "--min-count", type=int, default=6, help="categories seen fewer times share id 0 (default 6, as HugeCTR)"
    )
    ap.add_argument("--eval-fraction", type=float, default=0.1, help="last fraction of lines for eval")
    ap.add_argument("--chunk-size", type=int, default=500_000, help="lines per chunk")
    ap.add_argument(
        "--samples-per-file", type=int, default=1_000_000, help="samples per output file (default: %(default)s)"
    )
    ap.add_argument("--no-log-dense", action="store_true", help="keep raw counts (missing -> 0)")
    ap.add_argument("--check", choices=["sum", "non"], default="sum", help="Norm checksum framing")
    ap.add_argument(
        "--key-type",
        choices=["i64", "u32"],
        default="i64",
        help="Norm key type (i64_input_key=True / False); Parquet keys are always int64",
    )
    ap.add_argument(
        "--pad-short-lines",
        action="store_true",
        help="pad lines with fewer than 40 fields with missing values (default: an error)",
    )
    a = ap.parse_args(argv)
    try:
        preprocess_criteo(
            a.input,
            a.out_dir,
            a.format,
            a.min_count,
            a.eval_fraction,
            a.chunk_size,
            a.samples_per_file,
            not a.no_log_dense,
            Check_t.Sum if a.check == "sum" else Check_t.Non,
            a.key_type == "i64",
            lenient=a.pad_short_lines,
        )
    except ValueError as e:
        print(f"numbactr data criteo: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
