"""Backing tiers of a tiered embedding table: where every row lives while the cache holds the hot ones.

A backing tier stores, per table t, one array per buffer: the weights (V_t, D_t) in the weights'
precision, each optimizer state ((V_t, D_t) per element, (V_t,) per row) and the LFU count (V_t,) int64.
It is addressed by (table, local rows) and knows nothing of caches or engines:

    store.read(t, rows)            -> [array (n, ...) per buffer]       rows (n,) int64, distinct
    store.write(t, rows, values)   values: one array per buffer, as read() returns them
    store.views(t)                 -> [array (V_t, ...) per buffer]      the tier's own memory
    store.grow(t, rows)            a keyed table's new rows (initialized like the first ones)

HostStore keeps the arrays in host memory (on a GPU, pinned host memory, so the cache's loads and
write-backs are DMA copies). MemmapStore keeps each array in a file (numpy.memmap) in a directory: a
table larger than RAM trains with the hot rows in RAM (the cache) and the rest on disk, the operating
system's page cache in between. Both grow by whole chunks (memmap: the file is extended and mapped again).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import numpy as np

__all__ = ["BufferSpec", "HostStore", "MemmapStore", "make_store"]

_CHUNK_ROWS = 1 << 16          # rows per step when filling or growing (bounds the temporary memory)


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
    """The backing tier in host memory. Args: buffers (the BufferSpecs, weights first), rows (T,), dims (T,),
    pinned: allocate page-locked memory through cupy (the gpu device)."""

    def __init__(self, buffers, rows, dims, *, pinned: bool = False):
        self.buffers = list(buffers)
        self.rows = [int(r) for r in rows]
        self.dims = [int(d) for d in dims]
        self.pinned = bool(pinned)
        self.arrays = [[self._new(t, b, self.rows[t]) for b in self.buffers] for t in range(len(self.rows))]

    def _alloc(self, t: int, b: BufferSpec, rows: int) -> np.ndarray:
        shape = b.shape(rows, self.dims[t])
        if self.pinned:
            import cupyx
            return cupyx.empty_pinned(shape, b.dtype)
        return np.empty(shape, b.dtype)

    def _new(self, t: int, b: BufferSpec, rows: int) -> np.ndarray:
        a = self._alloc(t, b, rows)
        a[...] = b.initial
        return a

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for per_table in self.arrays for a in per_table)

    def read(self, t: int, rows: np.ndarray) -> list:
        """[buffer[rows] for every buffer] (copies)."""
        return [a[rows] for a in self.arrays[t]]

    def write(self, t: int, rows: np.ndarray, values: list) -> None:
        for a, v in zip(self.arrays[t], values):
            a[rows] = v

    def views(self, t: int) -> list:
        """The tier's arrays of table t (writes land in the tier)."""
        return self.arrays[t]

    def grow(self, t: int, rows: int) -> None:
        """Table t holds `rows` rows from now on (never fewer); new rows start from their initial values."""
        rows = int(rows)
        old = self.rows[t]
        if rows <= old:
            return
        new = [self._new(t, b, rows) for b in self.buffers]
        for a, n in zip(self.arrays[t], new):
            for lo in range(0, old, _CHUNK_ROWS):
                n[lo:lo + _CHUNK_ROWS] = a[lo:lo + _CHUNK_ROWS]
        self.arrays[t], self.rows[t] = new, rows

    def flush(self) -> None:
        """Make the tier durable where it can be (files); nothing for memory."""

    def close(self) -> None:
        self.arrays = []


class MemmapStore(HostStore):
    """The backing tier in files, one numpy.memmap per table and buffer, in `path` (a new temporary
    directory, removed on close(), when None). Files are created sparse and filled with each buffer's
    initial value in chunks, so making a table larger than RAM needs no more than a chunk of memory."""

    def __init__(self, buffers, rows, dims, *, path=None):
        self._tmp = tempfile.TemporaryDirectory(prefix="numbactr-tier-") if path is None else None
        self.path = self._tmp.name if path is None else os.fspath(path)
        os.makedirs(self.path, exist_ok=True)
        super().__init__(buffers, rows, dims)

    def _file(self, t: int, b: BufferSpec) -> str:
        return os.path.join(self.path, f"table{t}.{b.name}.bin")

    def _new(self, t: int, b: BufferSpec, rows: int, keep: int = 0) -> np.ndarray:
        """The file of (t, b) mapped with `rows` rows: created (keep = 0) or extended past its first `keep`
        rows, which stay; the rest is set to the initial value."""
        shape = b.shape(rows, self.dims[t])
        if rows == 0:
            return np.zeros(shape, b.dtype)
        name = self._file(t, b)
        if keep:
            with open(name, "r+b") as f:                         # extend the file (sparse), then map it
                f.truncate(int(np.prod(shape)) * np.dtype(b.dtype).itemsize)
        a = np.memmap(name, dtype=b.dtype, mode="r+" if keep else "w+", shape=shape)
        if b.initial:
            for lo in range(keep, rows, _CHUNK_ROWS):
                a[lo:lo + _CHUNK_ROWS] = b.initial
        return a

    def grow(self, t: int, rows: int) -> None:
        rows = int(rows)
        old = self.rows[t]
        if rows <= old:
            return
        for a in self.arrays[t]:
            if isinstance(a, np.memmap):
                a.flush()
        self.arrays[t] = [self._new(t, b, rows, keep=old) for b in self.buffers]
        self.rows[t] = rows

    def flush(self) -> None:
        for per_table in self.arrays:
            for a in per_table:
                if isinstance(a, np.memmap):
                    a.flush()

    def close(self) -> None:
        self.flush()
        self.arrays = []
        if self._tmp is not None:
            self._tmp.cleanup()


def make_store(kind, buffers, rows, dims, *, path=None, pinned: bool = False):
    """A backing tier by name: "host" (HostStore) or "memmap" (MemmapStore in `path`); a store object is
    returned as it is."""
    if not isinstance(kind, str):
        return kind
    if kind == "host":
        return HostStore(buffers, rows, dims, pinned=pinned)
    if kind == "memmap":
        return MemmapStore(buffers, rows, dims, path=path)
    raise ValueError(f"backing tier must be 'host', 'memmap' or a store object, got {kind!r}")
