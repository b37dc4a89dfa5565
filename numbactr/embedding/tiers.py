"""Backing tiers of a tiered embedding table: where every row lives while the cache holds the hot ones.

A backing tier stores, per table t, one array per buffer: the weights (V_t, D_t) in the weights'
precision, each optimizer state ((V_t, D_t) per element, (V_t,) per row) and the LFU count (V_t,) int64.
It is addressed by (table, local rows) and knows nothing of caches or engines:

    store.read(t, rows)            -> [array (n, ...) per buffer]       rows (n,) int64, distinct
    store.write(t, rows, values)   values: one array per buffer, as read() returns them
    store.views(t)                 -> [array (V_t, ...) per buffer]      the tier's own memory

HostStore keeps the arrays in host memory (on a GPU, pinned host memory, so the cache's loads and
write-backs are DMA copies). MemmapStore keeps each array in a file (numpy.memmap) in a directory: a
table larger than RAM trains with the hot rows in RAM (the cache) and the rest on disk, the operating
system's page cache in between. Both have a fixed number of rows per table.

LmdbStore is for tables whose row count is not known up front (keyed tables of a dynamic vocabulary): an
embedded LMDB environment (a B+tree in one memory-mapped file, no server) holds one record per row that
was ever written, keyed by the row number, and the table's keys (row -> key), so that a table reopens
with its vocabulary; rows never written read as their initial values, and the store grows as rows are
written. Why LMDB: reads (the cache's loads) are memory-mapped B+tree lookups without copies in the
engine, a batch of reads or writes is one transaction, and it is a 0.6 MB wheel with no dependencies;
RocksDB (rocksdict) measured about the same per key on this path (both are bound by Python's per-key
cost, ~5 us) and SQLite's batched writes were 3-4x slower (numbers in the README). The row data of a
table whose size IS known belongs in a memmap, which copies rows with one vectorized NumPy operation.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import numpy as np

__all__ = ["BufferSpec", "HostStore", "MemmapStore", "LmdbStore", "make_store"]

_CHUNK = 1 << 22  # elements per step when filling a buffer (bounds the temporary memory)


@dataclass(frozen=True)
class BufferSpec:
    """One buffer of a table: name, per_row (one value per row) or per element (D_t values), dtype, the
    value new rows start from."""

    name: str
    per_row: bool
    dtype: object
    initial: float = 0.0

    def shape(self, rows: int, dim: int) -> tuple:
        return (rows,) if self.per_row else (rows, dim)


class HostStore:
    """The backing tier in host memory: one flat array per buffer for all tables (FBGEMM's weights_uvm /
    momentum*_uvm layout: table after table, rows of D_t values, or one value for a per-row state), with
    per-table views. Args: buffers (the BufferSpecs, weights first), rows (T,), dims (T,), pinned: allocate
    page-locked memory through cupy (the gpu device)."""

    def __init__(self, buffers, rows, dims, *, pinned: bool = False):
        self.buffers = list(buffers)
        self.rows = [int(r) for r in rows]
        self.dims = [int(d) for d in dims]
        self.pinned = bool(pinned)
        rows_, dims_ = np.array(self.rows, np.int64), np.array(self.dims, np.int64)
        self.row_offsets = np.concatenate([[0], np.cumsum(rows_)]).astype(np.int64)
        self.elem_offsets = np.concatenate([[0], np.cumsum(rows_ * dims_)]).astype(np.int64)
        self.flat = [
            self._new(b, int((self.row_offsets if b.per_row else self.elem_offsets)[-1])) for b in self.buffers
        ]
        self.arrays = [
            [self._view(flat, b, t) for flat, b in zip(self.flat, self.buffers)] for t in range(len(self.rows))
        ]

    def _new(self, b: BufferSpec, size: int) -> np.ndarray:
        if self.pinned:
            import cupyx

            a = cupyx.empty_pinned(size, b.dtype)
        else:
            a = np.empty(size, b.dtype)
        for lo in range(0, size, _CHUNK):
            a[lo : lo + _CHUNK] = b.initial
        return a

    def _view(self, flat, b: BufferSpec, t: int) -> np.ndarray:
        if b.per_row:
            return flat[self.row_offsets[t] : self.row_offsets[t + 1]]
        return flat[self.elem_offsets[t] : self.elem_offsets[t + 1]].reshape(self.rows[t], self.dims[t])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.flat)

    def read(self, t: int, rows: np.ndarray) -> list:
        """[buffer[rows] for every buffer] (copies)."""
        return [a[rows] for a in self.arrays[t]]

    def write(self, t: int, rows: np.ndarray, values: list) -> None:
        """buffer[rows] = value for every buffer whose value is not None."""
        for a, v in zip(self.arrays[t], values):
            if v is not None:
                a[rows] = v

    def views(self, t: int) -> list:
        """The tier's arrays of table t (writes land in the tier)."""
        return self.arrays[t]

    def flush(self) -> None:
        """Make the tier durable where it can be (files); nothing for memory."""

    def close(self) -> None:
        self.arrays, self.flat = [], []


class MemmapStore(HostStore):
    """The backing tier in files: one numpy.memmap per buffer in `path` (a new temporary directory, removed
    on close(), when None). Files are created sparse and filled with each buffer's initial value in chunks,
    so making a table larger than RAM needs no more than a chunk of memory."""

    def __init__(self, buffers, rows, dims, *, path=None):
        self._tmp = tempfile.TemporaryDirectory(prefix="numbactr-tier-") if path is None else None
        self.path = self._tmp.name if path is None else os.fspath(path)
        os.makedirs(self.path, exist_ok=True)
        super().__init__(buffers, rows, dims)

    def _new(self, b: BufferSpec, size: int) -> np.ndarray:
        if size == 0:
            return np.zeros(0, b.dtype)
        a = np.memmap(os.path.join(self.path, f"{b.name}.bin"), dtype=b.dtype, mode="w+", shape=(size,))
        if b.initial:
            for lo in range(0, size, _CHUNK):
                a[lo : lo + _CHUNK] = b.initial
        return a

    def flush(self) -> None:
        for a in self.flat:
            if isinstance(a, np.memmap):
                a.flush()

    def close(self) -> None:
        self.flush()
        super().close()
        if self._tmp is not None:
            self._tmp.cleanup()


class LmdbStore:
    """The backing tier in an LMDB environment at `path` (a new temporary directory, removed on close(),
    when None): per table t a database "rows{t}" of records row (8 bytes big-endian, so a cursor walks
    the rows in order) -> the row's buffers back to back (a NumPy structured record), and "keys{t}" of
    row -> key for keyed tables. rows (T,): the tables' sizes when the store is made (grow() adds rows).
    An existing environment is opened as it is (its tables must have the same dims and buffers)."""

    def __init__(self, buffers, rows, dims, *, path=None, map_size: int = 1 << 40):
        import lmdb

        self._tmp = tempfile.TemporaryDirectory(prefix="numbactr-lmdb-") if path is None else None
        self.path = self._tmp.name if path is None else os.fspath(path)
        os.makedirs(self.path, exist_ok=True)
        self.buffers = list(buffers)
        self.rows = [int(r) for r in rows]
        self.dims = [int(d) for d in dims]
        # writemap + no sync per commit: commits are cheap and flush() makes the file durable
        self.env = lmdb.open(
            self.path,
            map_size=map_size,
            max_dbs=2 * len(self.rows) + 1,
            writemap=True,
            sync=False,
            metasync=False,
            readahead=False,
        )
        self._rows_db = [self.env.open_db(f"rows{t}".encode()) for t in range(len(self.rows))]
        self._keys_db = [self.env.open_db(f"keys{t}".encode()) for t in range(len(self.rows))]
        self.records = [np.dtype([(b.name, b.dtype, b.shape(1, d)[1:]) for b in self.buffers]) for d in self.dims]

    @staticmethod
    def _row_keys(rows) -> list:
        """LMDB keys of rows: 8 bytes big-endian each (numeric order = byte order)."""
        raw = np.asarray(rows, np.int64).astype(">i8").tobytes()
        return [raw[i : i + 8] for i in range(0, len(raw), 8)]

    def _initial(self, t: int, n: int) -> np.ndarray:
        rec = np.empty(n, self.records[t])
        for b in self.buffers:
            rec[b.name] = b.initial
        return rec

    def _read_records(self, t: int, rows: np.ndarray) -> np.ndarray:
        rec = self._initial(t, len(rows))
        with self.env.begin(db=self._rows_db[t]) as txn, txn.cursor() as cur:
            found = cur.getmulti(self._row_keys(rows))
        if found:  # the rows that have a record, in any order
            have = np.frombuffer(b"".join(k for k, _ in found), ">i8").astype(np.int64)
            order = np.argsort(rows)
            rec[order[np.searchsorted(rows, have, sorter=order)]] = np.frombuffer(
                b"".join(v for _, v in found), self.records[t]
            )
        return rec

    def read(self, t: int, rows: np.ndarray) -> list:
        """[buffer values of the rows (n, ...) for every buffer]; unwritten rows: their initial values."""
        rec = self._read_records(t, np.asarray(rows, np.int64))
        return [np.ascontiguousarray(rec[b.name]) for b in self.buffers]

    def write(self, t: int, rows: np.ndarray, values: list) -> None:
        """Write rows; buffers whose value is None keep what the store has."""
        rows = np.asarray(rows, np.int64)
        if rows.size == 0:
            return
        rec = self._read_records(t, rows) if any(v is None for v in values) else np.empty(len(rows), self.records[t])
        for b, v in zip(self.buffers, values):
            if v is not None:
                rec[b.name] = np.asarray(v).reshape(rec[b.name].shape)
        data = rec.tobytes()
        size = self.records[t].itemsize
        pairs = [(k, data[i * size : (i + 1) * size]) for i, k in enumerate(self._row_keys(rows))]
        with self.env.begin(write=True, db=self._rows_db[t]) as txn, txn.cursor() as cur:
            cur.putmulti(pairs)

    def views(self, t: int) -> list:
        """Copies of every buffer of table t's rows 0..rows[t] (an LMDB store has no arrays to view:
        writes to these copies do not reach it)."""
        return self.read(t, np.arange(self.rows[t], dtype=np.int64))

    def grow(self, t: int, rows: int) -> None:
        self.rows[t] = max(self.rows[t], int(rows))

    def put_keys(self, t: int, rows: np.ndarray, keys: np.ndarray) -> None:
        """Record the keys of new rows of keyed table t."""
        raw = np.asarray(keys, np.uint64).astype("<u8").tobytes()
        pairs = list(zip(self._row_keys(rows), [raw[i : i + 8] for i in range(0, len(raw), 8)]))
        with self.env.begin(write=True, db=self._keys_db[t]) as txn, txn.cursor() as cur:
            cur.putmulti(pairs)

    def keys(self, t: int) -> np.ndarray:
        """(n,) uint64 the keys of table t in row order (rows 0..n-1, as recorded)."""
        with self.env.begin(db=self._keys_db[t]) as txn, txn.cursor() as cur:
            vals = [v for _, v in cur.iternext(keys=True, values=True)]
        return np.frombuffer(b"".join(vals), "<u8").astype(np.uint64) if vals else np.zeros(0, np.uint64)

    @property
    def nbytes(self) -> int:
        return int(self.env.info()["last_pgno"] + 1) * int(self.env.stat()["psize"])

    def flush(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()
        if self._tmp is not None:
            self._tmp.cleanup()


def make_store(kind, buffers, rows, dims, *, path=None, pinned: bool = False):
    """A backing tier by name: "host" (HostStore), "memmap" (MemmapStore in `path`) or "lmdb" (LmdbStore
    in `path`); a store object is returned as it is."""
    if not isinstance(kind, str):
        return kind
    if kind == "host":
        return HostStore(buffers, rows, dims, pinned=pinned)
    if kind == "memmap":
        return MemmapStore(buffers, rows, dims, path=path)
    if kind == "lmdb":
        return LmdbStore(buffers, rows, dims, path=path)
    raise ValueError(f"backing tier must be 'host', 'memmap', 'lmdb' or a store object, got {kind!r}")
