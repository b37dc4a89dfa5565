"""HugeCTR Parquet datasets: `_metadata.json`, writer and row-group decoder (spec §2.5, §10.9).

A dataset is a file list (§2.2, conventionally `<dir>/_file_list.txt`) of Parquet files plus
`_metadata.json` in the directory of the FIRST listed file:
  {"file_stats": [{"file_name": "gen_0.parquet", "num_rows": 4096}, ...],
   "labels": [{"col_name": "label", "index": 0}], "conts": [{"col_name": "I1", "index": 1}, ...],
   "cats": [{"col_name": "C1", "index": 14}, ...]}
Columns are taken by `index` = top-level column position in the Parquet file, each group sorted by
index ascending (HugeCTR puts indices in a std::set; the JSON order does not matter). A row becomes
  label  = the label columns by index          (B, L) float32
  dense  = the cont columns by index           (B, D) float32
  slot k = the k-th cat column by index; slots are handed to the sparse inputs in order (the first
           slot_num to input 0, ...). An integer column is one key per row; a list<integer> column is a
           multi-hot slot with a variable number of keys per row (at most nnz_per_slot[k]).
  key    = stored key + sum(slot_size_array[:k]) (empty slot_size_array: no offset; zeros allowed so
           several slots can share one key space).
Label and cont columns may be any numeric type (cast to float32). Nulls are not allowed anywhere.

Integrity: the writer stores a CRC-32 checksum in every page header (pyarrow write_page_checksum) and
the reader verifies every page that carries one (page_checksum_verification), so a flipped bit in a
data or dictionary page is a DataFormatError naming the file, row group and column. Files from other
writers without page checksums are read unverified. Page headers and the footer are not covered by
the checksums: damage there is caught only when it breaks decoding or the checks below.

Validation (DataFormatError naming the file, the record = row in the file, the row group and the column;
no byte offset: values are encoded and compressed, and the footer accessors that would give a column
chunk's offset abort the whole process inside pyarrow when the footer is damaged, which the fuzz test
found): a file missing from file_stats, num_rows disagreeing with the file, a
metadata index beyond the file's columns ("missing column"), a col_name that disagrees with the
file's column at that index, a label/cont column that is not numeric, a cat column that is not integer
or list<integer>, nulls, negative keys, keys beyond 2^32 - 1 with 32-bit keys, more than nnz_per_slot
keys in one slot of one row, and (checked by the reader) non-finite label/dense values.
Deviations: HugeCTR ignores col_name and does not check nulls, key signs or nnz bounds.
HugeCTR: HugeCTR/src/data_readers/metadata.cpp, src/pybind/add_input.cpp, include/data_readers/
parquet_data_reader_worker.hpp, src/data_readers/parquet_data_converter.cu, src/data_generator.cpp.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from numbactr.data.errors import DataFormatError
from numbactr.data.file_list import write_file_list

__all__ = [
    "ParquetFormatError",
    "ParquetMetadata",
    "read_parquet_metadata",
    "metadata_path_for",
    "ParquetDatasetWriter",
    "ParquetFile",
    "slot_offsets_of",
]


class ParquetFormatError(DataFormatError):
    def __init__(self, path, offset, message, record=None):
        super().__init__("Parquet", path, offset, message, record)


def _pa():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("the Parquet format needs pyarrow: pip install 'numbactr[parquet]'") from None
    return pa, pq


# ---------------------------------------------------------------------------------------------------
# metadata


@dataclass
class ParquetMetadata:
    path: str
    file_stats: dict  # basename -> num_rows
    labels: list  # [(col_name, index)] sorted by index
    conts: list
    cats: list

    def to_json(self) -> dict:
        cols = lambda group: [{"col_name": n, "index": i} for n, i in group]  # noqa: E731
        return {
            "file_stats": [{"file_name": f, "num_rows": n} for f, n in self.file_stats.items()],
            "labels": cols(self.labels),
            "conts": cols(self.conts),
            "cats": cols(self.cats),
        }


def metadata_path_for(first_file: str) -> str:
    """`_metadata.json` in the directory of the first listed Parquet file."""
    return os.path.join(os.path.dirname(first_file) or ".", "_metadata.json")


def read_parquet_metadata(path: str) -> ParquetMetadata:
    """Parse and check `_metadata.json`; groups come back sorted by index."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(
            f"Parquet metadata {path!r} cannot be read ({e}); it must sit next to the first file of the file list"
        ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"Parquet metadata {path!r}: not UTF-8 text at byte offset {e.start}") from None
    try:
        j = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"Parquet metadata {path!r}: invalid JSON at byte offset {e.pos} ({e.msg})") from None
    if not isinstance(j, dict):
        raise ValueError(f"Parquet metadata {path!r}: expected a JSON object")
    for key in ("file_stats", "labels", "conts", "cats"):
        if not isinstance(j.get(key), list):
            raise ValueError(f"Parquet metadata {path!r}: missing or non-list {key!r}")
    stats = {}
    for k, e in enumerate(j["file_stats"]):
        if (
            not isinstance(e, dict)
            or not isinstance(e.get("file_name"), str)
            or not isinstance(e.get("num_rows"), int)
            or e["num_rows"] < 0
        ):
            raise ValueError(
                f"Parquet metadata {path!r}: file_stats[{k}] must be "
                f'{{"file_name": str, "num_rows": int >= 0}}, got {e!r}'
            )
        stats[os.path.basename(e["file_name"])] = int(e["num_rows"])
    groups, seen = {}, {}
    for key in ("labels", "conts", "cats"):
        out = []
        for k, e in enumerate(j[key]):
            if (
                not isinstance(e, dict)
                or not isinstance(e.get("col_name"), str)
                or not isinstance(e.get("index"), int)
                or isinstance(e.get("index"), bool)
                or e["index"] < 0
            ):
                raise ValueError(
                    f'Parquet metadata {path!r}: {key}[{k}] must be {{"col_name": str, "index": int >= 0}}, got {e!r}'
                )
            if e["index"] in seen:
                raise ValueError(
                    f"Parquet metadata {path!r}: column index {e['index']} is used twice "
                    f"({seen[e['index']]} and {key}[{k}])"
                )
            seen[e["index"]] = f"{key}[{k}]"
            out.append((e["col_name"], int(e["index"])))
        groups[key] = sorted(out, key=lambda t: t[1])
    return ParquetMetadata(path, stats, groups["labels"], groups["conts"], groups["cats"])


def slot_offsets_of(slot_size_array, slot_num: int) -> np.ndarray:
    """(S,) int64 prefix-sum offsets; zeros when slot_size_array is empty."""
    sizes = [int(v) for v in (slot_size_array or [])]
    if not sizes:
        return np.zeros(slot_num, dtype=np.int64)
    if len(sizes) != slot_num:
        raise ValueError(
            f"slot_size_array has {len(sizes)} entries but the sparse inputs have {slot_num} slots in total"
        )
    if min(sizes) < 0:
        raise ValueError(f"slot_size_array entries must be >= 0, got {sizes}")
    out = np.zeros(slot_num, dtype=np.int64)
    np.cumsum(sizes[:-1], out=out[1:])
    return out


# ---------------------------------------------------------------------------------------------------
# writer


@dataclass
class ParquetDatasetWriter:
    """Writes Parquet files, then `_metadata.json` and the file list at close().

    w = ParquetDatasetWriter(out_dir, label_dim=1, dense_dim=13, slot_num=26)
    w.write_file("part_0.parquet", label (n, 1), dense (n, 13), slots)   # -> path
    w.close()                            # writes out_dir/_metadata.json and out_dir/_file_list.txt
    slots: slot_num entries, each (n,) one key per row (int64 column), (n, k) k keys per row, or
    (keys (M,), lengths (n,)) ragged; entries for slots listed in `multi_hot` (or any 2-D/ragged entry)
    become list<int64> columns. Default names follow HugeCTR's DataGenerator: label{i}, C{L+i} for
    conts and C{L+D+k} for cats; columns are laid out labels, conts, cats, index = position.
    """

    out_dir: str
    label_dim: int
    dense_dim: int
    slot_num: int
    label_names: list = None
    dense_names: list = None
    cat_names: list = None
    multi_hot: set = field(default_factory=set)
    list_path: str = None  # default <out_dir>/_file_list.txt
    row_group_size: int = None
    compression: str = "snappy"

    def __post_init__(self):
        self.out_dir = os.fspath(self.out_dir)
        L, D, S = self.label_dim, self.dense_dim, self.slot_num
        self.label_names = list(self.label_names or [f"label{i}" for i in range(L)])
        self.dense_names = list(self.dense_names or [f"C{L + i}" for i in range(D)])
        self.cat_names = list(self.cat_names or [f"C{L + D + k}" for k in range(S)])
        if (len(self.label_names), len(self.dense_names), len(self.cat_names)) != (L, D, S):
            raise ValueError("one name per label, dense and cat column")
        names = self.label_names + self.dense_names + self.cat_names
        if len(set(names)) != len(names):
            raise ValueError(f"column names must be unique, got {names}")
        self.multi_hot = set(self.multi_hot)
        self.list_path = self.list_path or os.path.join(self.out_dir, "_file_list.txt")
        self.files: list[str] = []
        self.stats: dict = {}
        os.makedirs(self.out_dir, exist_ok=True)

    def write_file(self, name: str, label, dense, slots) -> str:
        """Write one whole file; returns its path."""
        self.begin_file(name)
        self.append(label, dense, slots)
        return self.end_file()

    def begin_file(self, name: str) -> None:
        """Start a file written in pieces with append() (one row group per append) and end_file()."""
        if getattr(self, "_open", None) is not None:
            raise ValueError("ParquetDatasetWriter: end_file() the previous file first")
        self._open = [os.path.join(self.out_dir, name), None, 0]  # path, pq.ParquetWriter, rows

    def append(self, label, dense, slots) -> None:
        _, pq = _pa()
        if getattr(self, "_open", None) is None:
            raise ValueError("ParquetDatasetWriter: begin_file() first")
        table = self._table(label, dense, slots)
        if self._open[1] is None:
            # page checksums (CRC-32 of every data page), verified by ParquetFile on read
            self._open[1] = pq.ParquetWriter(
                self._open[0], table.schema, compression=self.compression, write_page_checksum=True
            )
        self._open[1].write_table(table, row_group_size=self.row_group_size)
        self._open[2] += table.num_rows

    def end_file(self) -> str:
        path, writer, n = self._open
        self._open = None
        if writer is None:
            raise ValueError(f"ParquetDatasetWriter: file {path!r} has no rows")
        writer.close()
        self.files.append(path)
        self.stats[os.path.basename(path)] = n
        return path

    def _table(self, label, dense, slots):
        pa, _ = _pa()
        label = np.asarray(label, dtype=np.float32).reshape(-1, self.label_dim) if self.label_dim else None
        n = label.shape[0] if label is not None else _rows_of(slots)
        dense = np.asarray(dense, dtype=np.float32).reshape(n, self.dense_dim) if self.dense_dim else None
        if isinstance(slots, np.ndarray) and slots.ndim == 2:
            slots = list(slots.T)
        slots = list(slots)
        if len(slots) != self.slot_num:
            raise ValueError(f"expected {self.slot_num} slots, got {len(slots)}")
        cols = {}
        for i, nm in enumerate(self.label_names):
            cols[nm] = pa.array(label[:, i])
        for i, nm in enumerate(self.dense_names):
            cols[nm] = pa.array(dense[:, i])
        for k, (nm, sl) in enumerate(zip(self.cat_names, slots)):
            if isinstance(sl, tuple):
                vals, lens = np.asarray(sl[0], dtype=np.int64), np.asarray(sl[1], dtype=np.int64)
                if lens.shape != (n,) or lens.sum() != vals.shape[0] or (lens < 0).any():
                    raise ValueError(f"slot {k}: ragged (keys, lengths) needs {n} lengths summing to len(keys)")
                offs = np.zeros(n + 1, dtype=np.int32)
                np.cumsum(lens, out=offs[1:])
                cols[nm] = pa.ListArray.from_arrays(pa.array(offs), pa.array(vals))
            else:
                a = np.asarray(sl, dtype=np.int64)
                if a.shape[0] != n or a.ndim not in (1, 2):
                    raise ValueError(f"slot {k}: expected (n,) or (n, k) keys with n={n}, got {a.shape}")
                if a.ndim == 2 or k in self.multi_hot:
                    a = a.reshape(n, -1)
                    offs = (np.arange(n + 1) * a.shape[1]).astype(np.int32)
                    cols[nm] = pa.ListArray.from_arrays(pa.array(offs), pa.array(a.reshape(-1)))
                else:
                    cols[nm] = pa.array(a)
        return pa.table(cols)

    def metadata(self) -> ParquetMetadata:
        L, D = self.label_dim, self.dense_dim
        return ParquetMetadata(
            os.path.join(self.out_dir, "_metadata.json"),
            dict(self.stats),
            [(nm, i) for i, nm in enumerate(self.label_names)],
            [(nm, L + i) for i, nm in enumerate(self.dense_names)],
            [(nm, L + D + k) for k, nm in enumerate(self.cat_names)],
        )

    def close(self) -> str:
        """Write _metadata.json and the file list; returns the file list path."""
        meta = self.metadata()
        with open(meta.path, "w") as f:
            json.dump(meta.to_json(), f, indent=1)
        write_file_list(self.list_path, self.files)
        return self.list_path


def _rows_of(slots) -> int:
    s = slots[0] if len(slots) else None
    if s is None:
        return 0
    return len(s[1]) if isinstance(s, tuple) else np.asarray(s).shape[0]


# ---------------------------------------------------------------------------------------------------
# reading


def _is_int(t, pa) -> bool:
    return pa.types.is_integer(t)


def _is_numeric(t, pa) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


class ParquetFile:
    """One Parquet file checked against the dataset metadata; chunks() yields one decoded row group at a
    time as (row_start, label (m, L), dense (m, D), slots [(values, offsets (m+1,) or None)])."""

    def __init__(
        self,
        path: str,
        meta: ParquetMetadata,
        label_dim: int,
        dense_dim: int,
        slot_num: int,
        nnz_per_slot=None,
        i64_input_key: bool = True,
    ):
        pa, pq = _pa()
        self.path = path
        self.meta = meta
        self.i64 = bool(i64_input_key)
        try:
            self.pf = pq.ParquetFile(path, page_checksum_verification=True)
        except FileNotFoundError:
            raise ParquetFormatError(path, None, "file does not exist") from None
        except Exception as e:  # pyarrow raises ArrowInvalid/OSError for a broken footer
            raise ParquetFormatError(path, None, f"not a readable Parquet file ({type(e).__name__}: {e})") from None
        md = self.pf.metadata
        base = os.path.basename(path)
        if base not in meta.file_stats:
            raise ParquetFormatError(path, None, f"file {base!r} is not listed in the file_stats of {meta.path!r}")
        if meta.file_stats[base] != md.num_rows:
            raise ParquetFormatError(
                path, None, f"{meta.path!r} says num_rows={meta.file_stats[base]} but the file has {md.num_rows} rows"
            )
        if len(meta.labels) != label_dim or len(meta.conts) != dense_dim or len(meta.cats) != slot_num:
            raise ParquetFormatError(
                path,
                None,
                f"{meta.path!r} lists {len(meta.labels)} labels, "
                f"{len(meta.conts)} conts, {len(meta.cats)} cats but the "
                f"model's Input has label_dim {label_dim}, dense_dim "
                f"{dense_dim} and {slot_num} slots",
            )
        schema = self.pf.schema_arrow
        names = schema.names
        self.cols = []  # (group, name, index, is_list)
        for group, items in (("label", meta.labels), ("cont", meta.conts), ("cat", meta.cats)):
            for nm, idx in items:
                if idx >= len(names):
                    raise ParquetFormatError(
                        path,
                        None,
                        f"missing column: {meta.path!r} lists {group} "
                        f"{nm!r} at index {idx} but the file has only "
                        f"{len(names)} columns {names}",
                    )
                if names[idx] != nm:
                    raise ParquetFormatError(
                        path,
                        None,
                        f"{meta.path!r} says column {idx} is {group} "
                        f"{nm!r} but the file's column {idx} is "
                        f"{names[idx]!r} (columns: {names})",
                    )
                if names.count(nm) > 1:
                    raise ParquetFormatError(path, None, f"column name {nm!r} appears twice")
                t = schema.field(idx).type
                is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
                if group == "cat":
                    if not (_is_int(t, pa) or (is_list and _is_int(t.value_type, pa))):
                        raise ParquetFormatError(
                            path,
                            None,
                            f"cat column {nm!r} (index {idx}) has type {t}; "
                            f"expected an integer or list<integer> column",
                        )
                elif not _is_numeric(t, pa):
                    raise ParquetFormatError(
                        path, None, f"{group} column {nm!r} (index {idx}) has type {t}; expected a numeric column"
                    )
                self.cols.append((group, nm, idx, is_list))
        self.nnz_per_slot = list(nnz_per_slot) if nnz_per_slot is not None else None
        self.num_rows = md.num_rows
        rg_rows = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        if sum(rg_rows) != md.num_rows:  # a damaged footer: pyarrow would read sum(rg_rows)
            raise ParquetFormatError(
                path,
                None,
                f"the footer's row groups hold {sum(rg_rows)} rows {rg_rows} "
                f"but its num_rows is {md.num_rows} (damaged footer)",
            )
        self.max_rows = 65536

    def _fail(self, rg, row_start, row, name, msg):
        raise ParquetFormatError(
            self.path, None, f"row group {rg}, column {name!r}: {msg}", None if row is None else row_start + row
        )

    def _bad_column(self, rg: int, wanted: list) -> str:
        """The first of `wanted` whose column chunk in row group rg fails to decode alone (failure path
        only: pyarrow's messages, e.g. a page CRC mismatch, do not name the column)."""
        for nm in wanted:
            try:
                self.pf.read_row_group(rg, columns=[nm], use_threads=False)
            except Exception:  # noqa: BLE001
                return nm
        return ", ".join(wanted)

    def chunks(self, stop=None):
        """Yield (row_start, label (m, L), dense (m, D), slots) per slice of at most max_rows rows."""
        md = self.pf.metadata
        wanted = [nm for _, nm, _, _ in self.cols]
        row_start = 0
        for rg in range(md.num_row_groups):
            if stop is not None and stop.is_set():
                return
            m = md.row_group(rg).num_rows
            try:
                table = self.pf.read_row_group(rg, columns=wanted, use_threads=True)
            except Exception as e:  # noqa: BLE001 (pyarrow: OSError, ArrowInvalid, ...)
                why = " ".join(str(e).split())
                what = "page checksum mismatch, the data is damaged" if "CRC" in why else "cannot be decoded"
                self._fail(rg, row_start, None, self._bad_column(rg, wanted), f"{what} ({type(e).__name__}: {why})")
            if table.num_rows != m:
                self._fail(
                    rg, row_start, None, wanted[0] if wanted else "", f"decoded {table.num_rows} rows, footer says {m}"
                )
            # hand the row group out in slices of at most max_rows rows (zero-copy in Arrow): small
            # NumPy arrays are reused by the allocator, huge fresh ones page-fault
            for a in range(0, max(m, 1), self.max_rows):
                mm = min(self.max_rows, m - a)
                yield row_start + a, *self._convert(table.slice(a, mm), mm, rg, row_start + a)
                if stop is not None and stop.is_set():
                    return
            row_start += m

    def _convert(self, table, m, rg, row_start):
        n_lab = sum(1 for g, *_ in self.cols if g == "label")
        n_den = sum(1 for g, *_ in self.cols if g == "cont")
        ld = np.empty((m, n_lab + n_den), dtype=np.float32)
        slots = []
        for j, (group, nm, idx, is_list) in enumerate(self.cols):
            col = table.column(j)
            arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
            if arr.null_count:
                first = int(np.argmax(np.asarray(arr.is_null())))
                self._fail(rg, row_start, first, nm, "null value (nulls are not allowed)")
            if group != "cat":
                ld[:, j] = arr.to_numpy(zero_copy_only=False)
                continue
            if is_list:
                offs = np.asarray(arr.offsets, dtype=np.int64)
                offs = offs - offs[0]
                vals_arr = arr.flatten()  # this slice's keys only
                if vals_arr.null_count:
                    pos = int(np.argmax(np.asarray(vals_arr.is_null())))
                    self._fail(
                        rg,
                        row_start,
                        int(np.searchsorted(offs, pos, "right") - 1),
                        nm,
                        "null key inside a list (nulls are not allowed)",
                    )
                vals = np.asarray(vals_arr.to_numpy(zero_copy_only=False))
                lens = np.diff(offs)
                k = len(slots)
                if self.nnz_per_slot is not None and lens.size and lens.max() > self.nnz_per_slot[k]:
                    r = int(np.argmax(lens > self.nnz_per_slot[k]))
                    self._fail(
                        rg,
                        row_start,
                        r,
                        nm,
                        f"{int(lens[r])} keys in one row but nnz_per_slot of slot {k} is {self.nnz_per_slot[k]}",
                    )
            else:
                vals = arr.to_numpy(zero_copy_only=False)
                offs = None
            self._check_keys(vals, offs, rg, row_start, nm)
            slots.append((vals, offs))
        return ld[:, :n_lab], ld[:, n_lab:], slots

    def _check_keys(self, vals, offs, rg, row_start, nm):
        if not vals.size:
            return
        if vals.dtype.kind == "i" and vals.min() < 0:
            pos = int(np.argmax(vals < 0))
            row = pos if offs is None else int(np.searchsorted(offs, pos, "right") - 1)
            self._fail(rg, row_start, row, nm, f"negative key {int(vals[pos])}")
        if not self.i64 and vals.max() > np.iinfo(np.uint32).max:
            pos = int(np.argmax(vals > np.iinfo(np.uint32).max))
            row = pos if offs is None else int(np.searchsorted(offs, pos, "right") - 1)
            self._fail(rg, row_start, row, nm, f"key {int(vals[pos])} does not fit 32 bits (i64_input_key=False)")
