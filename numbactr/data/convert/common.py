"""What every converter shares: reading text in chunks with line numbers, vocabularies, the split writers
and the summary files.

Output layout (the one ``numbactr data criteo`` writes)::

    OUT/train/_file_list.txt, part_<k>.data | part_<k>.parquet [+ _metadata.json]   (Norm, Parquet)
    OUT/train/data.raw                                                  (Raw: one file, no file list)
    OUT/eval/...                                                        likewise
    OUT/slot_size_array.json                                            [size_0, ..., size_{S-1}]
    OUT/conversion.json                                                 what was done (see ConversionResult)

Keys: every converter hands the writers per-slot ids, slot k's in ``[0, slot_size_array[k])``.
Norm keys are used verbatim by HugeCTR's hash embeddings, so the Norm writer adds the slot offsets
(``id + sum(slot_size_array[:k])``, keys unique across slots); Parquet stores the per-slot id and the
reader adds the same offsets from ``DataReaderParams.slot_size_array``; Raw stores the per-slot id as
HugeCTR's one-hot embeddings expect (they add the offsets themselves).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

from numbactr import log
from numbactr.data.file_list import write_file_list
from numbactr.data.norm_write import NormWriter
from numbactr.data.parquet import ParquetDatasetWriter
from numbactr.data.raw import write_raw_file
from numbactr.data.validation import slot_offsets
from numbactr.enums import Check_t

__all__ = [
    "FORMATS",
    "ConversionResult",
    "SplitWriter",
    "Vocab",
    "add_common_args",
    "finish",
    "make_splits",
    "read_blocks",
    "run_main",
]

FORMATS = ("norm", "raw", "parquet")


# ---------------------------------------------------------------------------------------------------
# reading


def _open(path: str, what: str):
    try:
        return open(path, "rb")
    except OSError as e:
        raise ValueError(f"{what} file {path!r} cannot be read ({e})") from None


def read_blocks(
    path: str, what: str, chunk_lines: int = 500_000, encoding: str = "utf-8", skip_header=None, hint: bool = True
):
    """Yield ``(lines, numbers)`` for chunks of up to ``chunk_lines`` lines of a text file.

    lines: the decoded non-blank lines without their line ends; numbers: their 1-based line numbers in
    the file (blank lines count in the numbering and are skipped: they hold no record). ``skip_header``:
    None, or a function of the first non-blank line that says whether it is a header to skip. A line
    that is not valid ``encoding`` raises ValueError naming the file and the line (with ``hint``, the
    message suggests the converter's encoding option). The progress bar
    counts bytes of the file read.
    """
    size = os.path.getsize(path) if os.path.isfile(path) else None
    number = 0
    first = True
    with (
        _open(path, what) as f,
        log.progress(total=size, desc=f"{what}: read {os.path.basename(path)}", unit="B") as bar,
    ):
        while True:
            raw = list(itertools.islice(f, chunk_lines))
            if not raw:
                return
            bar.update(sum(map(len, raw)))
            lines, numbers = [], []
            for b in raw:
                number += 1
                b = b.rstrip(b"\r\n")
                if not b.strip():
                    continue
                try:
                    s = b.decode(encoding)
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"{what} file {path!r}, line {number}: byte {b[e.start : e.start + 1]!r} at column "
                        f"{e.start + 1} is not {encoding} text ({e.reason})"
                        + ("; pass the file's encoding (e.g. encoding='latin-1', --encoding latin-1)" if hint else "")
                    ) from None
                if first:
                    first = False
                    if skip_header is not None and skip_header(s):
                        continue
                lines.append(s)
                numbers.append(number)
            if lines:
                yield lines, np.asarray(numbers, dtype=np.int64)


def split_fields(lines, numbers, sep: str, n_fields, path: str, what: str, layout: str):
    """Split every line at ``sep``; every line must have ``n_fields`` fields (an int, or a tuple of the
    accepted counts). Returns the list of field lists; a line with another count raises ValueError
    naming the file, the line and the expected ``layout``."""
    ok = (n_fields,) if isinstance(n_fields, int) else tuple(n_fields)
    rows = [ln.split(sep) for ln in lines]
    for r, num in zip(rows, numbers):
        if len(r) not in ok:
            raise ValueError(
                f"{what} file {path!r}, line {num}: {len(r)} {sep!r}-separated fields, expected "
                f"{' or '.join(map(str, ok))} ({layout})"
            )
    return rows


def to_numbers(values, numbers, path: str, what: str, column: str, dtype=np.int64) -> np.ndarray:
    """Strings -> numbers of ``dtype`` (int64, or a float type: finite values only); a value that is not
    one raises ValueError naming the file and the line."""
    a = np.asarray(values)
    is_int = np.dtype(dtype).kind in "iu"
    try:
        out = a.astype(np.int64 if is_int else np.float64)
        if is_int or np.isfinite(out).all():
            return out.astype(dtype)
    except (ValueError, OverflowError):
        pass
    conv = int if is_int else float
    for v, num in zip(values, numbers):
        try:
            if not np.isfinite(conv(v)):
                raise ValueError
        except (ValueError, OverflowError):
            raise ValueError(
                f"{what} file {path!r}, line {num}: {column} {v!r} is not "
                f"{'an integer' if is_int else 'a finite number'}"
            ) from None
    raise ValueError(f"{what} file {path!r}: column {column} cannot be parsed")  # not reached


# ---------------------------------------------------------------------------------------------------
# vocabularies


class Vocab:
    """Category counts, then ids: values seen at least ``min_count`` times get ids ``1..K`` in ascending
    order of value, everything else (rare, unseen) shares id 0, so the slot's size is K + 1.

    v = Vocab(); v.count(values); v.freeze(min_count); ids = v.encode(values)   # (n,) int64
    """

    def __init__(self):
        self._counts: dict = {}
        self.values = None  # sorted array of the kept values, after freeze()

    def count(self, values) -> None:
        u, c = np.unique(np.asarray(values), return_counts=True)
        get = self._counts.get
        for v, n in zip(u.tolist(), c.tolist()):
            self._counts[v] = get(v, 0) + n

    def freeze(self, min_count: int = 1) -> int:
        """Fix the ids; returns the slot size K + 1."""
        kept = sorted(v for v, n in self._counts.items() if n >= min_count)
        self.values = np.asarray(kept) if kept else np.zeros(0)
        self.rare = sum(1 for n in self._counts.values() if n < min_count)
        self._counts = {}
        return len(kept) + 1

    @property
    def size(self) -> int:
        return len(self.values) + 1

    def encode(self, values) -> np.ndarray:
        a = np.asarray(values)
        v = self.values
        if len(v) == 0 or len(a) == 0:
            return np.zeros(len(a), dtype=np.int64)
        pos = np.searchsorted(v, a)
        pos = np.minimum(pos, len(v) - 1)
        return np.where(v[pos] == a, pos + 1, 0).astype(np.int64)


# ---------------------------------------------------------------------------------------------------
# writing


class SplitWriter:
    """Writes one split (``OUT/train`` or ``OUT/eval``) in one format, a new file every
    ``samples_per_file`` rows (Norm, Parquet) or one file (Raw).

    write(label (n, L), dense (n, D), ids): ids is an (n, S) matrix of one-hot per-slot ids or a list of
    S entries, each (n,) or a ragged pair (ids (M,), lengths (n,)) for a multi-hot slot. The slot offsets
    are added for Norm (see the module docstring). close() returns the source to give
    DataReaderParams: the file list (Norm, Parquet) or the Raw file.
    """

    def __init__(
        self,
        d,
        fmt,
        label_names,
        dense_names,
        slot_names,
        slot_size_array,
        samples_per_file=1_000_000,
        i64_keys=True,
        check=Check_t.Sum,
    ):
        self.d, self.fmt, self.spf = d, fmt, int(samples_per_file)
        self.L, self.D, self.S = len(label_names), len(dense_names), len(slot_names)
        self.offsets = slot_offsets(slot_size_array) if len(slot_size_array) else np.zeros(0, np.int64)
        self.check, self.i64 = check, i64_keys
        self.rows, self.in_file, self.files, self.w = 0, 0, [], None
        os.makedirs(d, exist_ok=True)
        if fmt == "parquet":
            self.pq = ParquetDatasetWriter(
                d, self.L, self.D, self.S, label_names=label_names, dense_names=dense_names, cat_names=slot_names
            )
        elif fmt == "raw":
            self.raw_path = os.path.join(d, "data.raw")
            open(self.raw_path, "wb").close()

    def write(self, label, dense, ids) -> None:
        label = np.asarray(label, np.float32).reshape(-1, self.L)
        n = label.shape[0]
        dense = np.asarray(dense, np.float32).reshape(n, self.D) if self.D else np.zeros((n, 0), np.float32)
        if n == 0:
            return
        if self.fmt == "raw":
            ids = np.asarray(ids if isinstance(ids, np.ndarray) else np.stack(ids, axis=1), dtype=np.int64)
            write_raw_file(self.raw_path, label, dense, ids, float_label_dense=True, append=True)
            self.rows += n
            return
        a = 0
        while a < n:
            if self.in_file == 0 or self.in_file == self.spf:
                self._next()
            b = min(n, a + self.spf - self.in_file)
            self._write(label[a:b], dense[a:b], _rows(ids, a, b))
            self.in_file += b - a
            a = b
        self.rows += n

    def _write(self, label, dense, ids):
        if self.fmt == "parquet":
            self.pq.append(label, dense, ids)
            return
        if isinstance(ids, np.ndarray):
            self.w.write(label, dense, ids + self.offsets)
        else:
            self.w.write(label, dense, [_shift(s, int(o)) for s, o in zip(ids, self.offsets)])

    def _next(self):
        k = len(self.files)
        if self.fmt == "parquet":
            if k:
                self.pq.end_file()
            self.pq.begin_file(f"part_{k}.parquet")
            self.files.append(os.path.join(self.d, f"part_{k}.parquet"))
        else:
            if self.w is not None:
                self.w.close()
            path = os.path.join(self.d, f"part_{k}.data")
            self.w = NormWriter(path, self.L, self.D, self.S, self.check, np.int64 if self.i64 else np.uint32)
            self.files.append(path)
        self.in_file = 0

    def close(self):
        """Finish the files; returns the source path (None when nothing was written)."""
        if self.fmt == "raw":
            return self.raw_path if self.rows else None
        if not self.files:
            return None
        if self.fmt == "parquet":
            self.pq.end_file()
            return self.pq.close()
        self.w.close()
        lst = os.path.join(self.d, "_file_list.txt")
        write_file_list(lst, self.files)
        return lst


def _rows(ids, a, b):
    """Rows [a, b) of a one-hot matrix or of a list of per-slot entries (ragged pairs included)."""
    if isinstance(ids, np.ndarray):
        return ids[a:b]
    out = []
    for s in ids:
        if isinstance(s, tuple):
            vals, lens = s
            off = np.zeros(len(lens) + 1, dtype=np.int64)
            np.cumsum(lens, out=off[1:])
            out.append((vals[off[a] : off[b]], lens[a:b]))
        else:
            out.append(s[a:b])
    return out


def _shift(s, o):
    return (s[0] + o, s[1]) if isinstance(s, tuple) else s + o


@dataclass
class ConversionResult:
    """What a converter did; written to ``OUT/conversion.json`` (every field, JSON-encoded).

    train_source / eval_source: what to give ``DataReaderParams(source=[...], eval_source=...)``: the
    file lists (Norm, Parquet) or the Raw files (then num_samples / eval_num_samples are num_train /
    num_eval). keys: how keys are stored (see numbactr.data.convert.common). dropped: reason -> rows.
    extra: the converter's own facts (for MovieLens eval_group_size, user_slot, item_slot, ...).
    """

    converter: str
    inputs: list
    out_dir: str
    format: str
    train_source: str
    eval_source: str | None
    num_train: int
    num_eval: int
    label_dim: int
    dense_dim: int
    slot_num: int
    slot_names: list
    slot_size_array: list
    max_nnz_per_slot: list
    label: str
    keys: str
    i64_input_key: bool
    rows_read: int
    dropped: dict = field(default_factory=dict)
    split: str = ""
    seed: int | None = None
    dense_names: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def __getattr__(self, name):  # extra's facts read like fields: result.eval_group_size
        extra = self.__dict__.get("extra") or {}
        if name in extra:
            return extra[name]
        raise AttributeError(name)


KEYS_TEXT = {
    "norm": "Norm: id + sum(slot_size_array[:k]), unique across slots (hash embeddings use keys verbatim)",
    "parquet": "Parquet: per-slot id in [0, slot_size_array[k]); the reader adds the slot offsets",
    "raw": "Raw: per-slot id in [0, slot_size_array[k]) (HugeCTR's one-hot convention); "
    "labels and dense values are float32 (float_label_dense=True)",
}


def make_splits(
    out_dir,
    fmt,
    label_names,
    dense_names,
    slot_names,
    slot_size_array,
    samples_per_file=1_000_000,
    i64_keys=True,
    check=Check_t.Sum,
):
    """The train and eval SplitWriters under out_dir (a dict)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if samples_per_file < 1:
        raise ValueError(f"samples_per_file must be >= 1, got {samples_per_file}")
    out_dir = os.path.abspath(out_dir)
    return {
        name: SplitWriter(
            os.path.join(out_dir, name),
            fmt,
            label_names,
            dense_names,
            slot_names,
            slot_size_array,
            samples_per_file,
            i64_keys,
            check,
        )
        for name in ("train", "eval")
    }


def finish(splits, out_dir, verbose=True, **facts) -> ConversionResult:
    """Close both splits, write slot_size_array.json and conversion.json; returns the ConversionResult.
    facts: the ConversionResult fields the converter knows (everything but the sources and counts)."""
    train_src, eval_src = splits["train"].close(), splits["eval"].close()
    if train_src is None:
        raise ValueError(f"{facts['converter']}: no training rows were written (dropped: {facts.get('dropped')})")
    fmt = splits["train"].fmt
    res = ConversionResult(
        out_dir=os.path.abspath(out_dir),
        format=fmt,
        train_source=train_src,
        eval_source=eval_src,
        num_train=splits["train"].rows,
        num_eval=splits["eval"].rows,
        keys=KEYS_TEXT[fmt],
        **facts,
    )
    with open(os.path.join(out_dir, "slot_size_array.json"), "w") as f:
        json.dump(res.slot_size_array, f)
    with open(os.path.join(out_dir, "conversion.json"), "w") as f:
        json.dump(asdict(res), f, indent=1, default=_jsonable)
    if verbose:
        print(
            f"[numbactr] {res.converter}: {res.num_train} train and {res.num_eval} eval rows as {fmt} in "
            f"{res.out_dir}; dropped {res.dropped or 'nothing'}"
        )
        print(f"slot_size_array: {res.slot_size_array}")
    return res


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON: {type(x).__name__}")


# ---------------------------------------------------------------------------------------------------
# command line


def add_common_args(ap: argparse.ArgumentParser, default_format: str = "parquet") -> None:
    """The options every converter takes: --format, --samples-per-file, --seed, --key-type, --check,
    --chunk-size, --quiet."""
    ap.add_argument("--format", choices=FORMATS, default=default_format, help="HugeCTR format (default %(default)s)")
    ap.add_argument("--samples-per-file", type=int, default=1_000_000, help="rows per Norm/Parquet file")
    ap.add_argument("--seed", type=int, default=0, help="seed of every random choice (default %(default)s)")
    ap.add_argument("--key-type", choices=["i64", "u32"], default="i64", help="Norm key type (i64_input_key)")
    ap.add_argument("--check", choices=["sum", "non"], default="sum", help="Norm checksum framing")
    ap.add_argument("--chunk-size", type=int, default=500_000, help="input lines per chunk")
    ap.add_argument("--quiet", action="store_true", help="no summary lines")


def common_kwargs(a) -> dict:
    """The keyword arguments add_common_args' options map to."""
    return dict(
        fmt=a.format,
        samples_per_file=a.samples_per_file,
        seed=a.seed,
        i64_keys=a.key_type == "i64",
        check=Check_t.Sum if a.check == "sum" else Check_t.Non,
        chunk_size=a.chunk_size,
        verbose=not a.quiet,
    )


def run_main(prog: str, fn, *args, **kw) -> int:
    """Call a converter for a command line: a ValueError is one line on stderr and exit status 1."""
    try:
        fn(*args, **kw)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    return 0
