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
system's page cache in between.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import numpy as np

__all__ = ["BufferSpec", "HostStore", "MemmapStore", "make_store"]

_CHUNK = 1 << 22               # elements per step when filling a buffer (bounds the temporary memory)


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
        self.flat = [self._new(b, int((self.row_offsets if b.per_row else self.elem_offsets)[-1]))
                     for b in self.buffers]
        self.arrays = [[self._view(flat, b, t) for flat, b in zip(self.flat, self.buffers)]
                       for t in range(len(self.rows))]

    def _new(self, b: BufferSpec, size: int) -> np.ndarray:
        if self.pinned:
            import cupyx
            a = cupyx.empty_pinned(size, b.dtype)
        else:
            a = np.empty(size, b.dtype)
        for lo in range(0, size, _CHUNK):
            a[lo:lo + _CHUNK] = b.initial
        return a

    def _view(self, flat, b: BufferSpec, t: int) -> np.ndarray:
        if b.per_row:
            return flat[self.row_offsets[t]:self.row_offsets[t + 1]]
        return flat[self.elem_offsets[t]:self.elem_offsets[t + 1]].reshape(self.rows[t], self.dims[t])

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
                a[lo:lo + _CHUNK] = b.initial
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
