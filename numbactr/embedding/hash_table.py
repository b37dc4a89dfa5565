"""Key -> row hash table of one embedding's value pool (per device).

``HashTable(max_rows, use_kernels=...)`` owns the slot arrays (see numbactr.kernels.hash_table) and the
row counter: a new key gets the next free row, in order of its first occurrence in the batch, exactly
as the NumPy reference (cpu device) and the numba.cuda kernels (gpu/sim) both compute it.
"""

from __future__ import annotations

import math

import numpy

from numbactr.kernels import hash_table as _k
from numbactr.kernels import hash_table_cpu as _cpu
from numbactr.runtime.hostmem import host_full
from numbactr.kernels.scan import scan_partials_size
from numbactr.kernels.hash_table import EMPTY_KEY, HashTableFullError

__all__ = ["HashTable", "HashTableFullError", "EMPTY_KEY"]


class HashTable:
    """Open-addressing table of ``capacity = max(ceil(max_rows / load_factor), 1)`` slots.

    use_kernels: True launches the numba.cuda kernels on arrays from ``xp`` (cupy on a GPU, numpy in
    the simulator); False runs the NumPy reference (``xp`` must then be numpy), or, with compiled=True,
    the numba-compiled CPU code (kernels/hash_table_cpu.py: the cpu device's fast path, same rows), which
    keeps a direct index of the small keys' rows in front of the table unless direct=False.
    """

    #: the compiled insert's choice (kernels/hash_table_cpu.hash_insert_cpu): tables of up to this many
    #: slots take a batch in one serial pass, larger ones a parallel find first (tests set 0 to force it)
    serial_slots = _cpu.SERIAL_SLOTS
    #: the compiled path's direct index (kernels/hash_table_cpu.direct_rows) covers keys below
    #: min(DIRECT_PER_SLOT x capacity, DIRECT_MAX): 8 bytes a key, at most 8 MiB (0 turns it off)
    DIRECT_PER_SLOT = 2
    DIRECT_MAX = 1 << 20

    def __init__(
        self,
        max_rows: int,
        *,
        load_factor: float = 0.75,
        use_kernels: bool,
        xp=numpy,
        scan_threads: int | None = None,
        compiled: bool = False,
        direct: bool = True,
    ):
        max_rows = int(max_rows)
        if max_rows < 0:
            raise ValueError(f"max_rows must be >= 0, got {max_rows}")
        if not 0.0 < load_factor <= 1.0:
            raise ValueError(f"load_factor must be in (0, 1], got {load_factor}")
        if not use_kernels and xp is not numpy:
            raise ValueError("the NumPy reference path (use_kernels=False) needs xp=numpy")
        self._max_rows = max_rows
        self.load_factor = float(load_factor)
        self.use_kernels = bool(use_kernels)
        self.compiled = bool(compiled) and not self.use_kernels
        self.xp = xp
        self.scan_threads = scan_threads
        self.capacity = max(math.ceil(max_rows / load_factor), 1)
        # host slots in huge pages when big (numbactr.runtime.hostmem): every probe is a random read
        full = host_full if xp is numpy else (lambda n, v, dt: xp.full(n, v, dtype=dt))
        self._tkeys = full(self.capacity, EMPTY_KEY, numpy.uint64)  # (C,)
        self._trows = full(self.capacity, -1, numpy.int64)  # (C,)
        self._tfirst = (
            xp.full(self.capacity, _k.INT64_MAX, dtype=numpy.int64) if self.use_kernels else None
        )  # (C,) kernel scratch
        self._scratch_n = -1  # batch size the kernel scratch below was sized for (grown, reused)
        self._size = 0
        # the deferred insert's device state (insert_deferred): the row counter and the error record; the
        # host's _size is stale after a deferred insert until size is read
        self._dsize = xp.zeros(1, dtype=numpy.int64) if self.use_kernels else None
        # the compiled path's direct index: the row of each key below its length, -1 for keys not held
        span = min(self.DIRECT_PER_SLOT * self.capacity, self.DIRECT_MAX)
        self._direct = numpy.full(span, -1, numpy.int64) if self.compiled and direct and span > 0 else None
        self._err = self._new_err() if self.use_kernels else None
        self._size_stale = False
        self._unchecked = False

    # ---- properties ---------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Rows in use (= distinct keys inserted); after a deferred insert, one read of the device counter."""
        if self._size_stale:
            from numbactr.runtime import device

            self._size = int(device.to_host(self._dsize)[0])
            self._size_stale = False
        return self._size

    @property
    def device_size(self):
        """(1,) int64 device array: the rows in use, kept on the device (kernels only)."""
        return self._dsize

    @property
    def max_rows(self) -> int:
        return self._max_rows

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        path = "kernels" if self.use_kernels else "compiled" if self.compiled else "reference"
        return f"HashTable(size={self.size}, max_rows={self._max_rows}, capacity={self.capacity}, {path})"

    # ---- operations ---------------------------------------------------------------------------
    def insert(self, keys):
        """rows (N,) int64 of keys (N,): known keys keep their row, new keys take rows size, size+1, ...
        in order of first occurrence. HashTableFullError (table unchanged) when rows run out."""
        keys = self._as_keys(keys)
        n = keys.shape[0]
        self._sync_size()
        if self.compiled:
            rows, n_new = self.xp.empty(n, dtype=numpy.int64), 0
            direct = self._direct
            if n and (direct is None or _cpu.direct_rows(direct, keys, rows) < n):
                n_new = _cpu.hash_insert_cpu(
                    self._tkeys,
                    self._trows,
                    keys,
                    self._size,
                    self._max_rows,
                    rows,
                    numpy.empty(n, dtype=numpy.int64),
                    numpy.empty(n, dtype=numpy.int64),
                    self.serial_slots,
                )
            if n_new < 0:  # rolled back: count the distinct new keys
                missing = keys[_k.hash_find_ref(self._tkeys, self._trows, keys) == _k.NO_ROW]
                raise HashTableFullError(int(numpy.unique(missing).size), self._size, self._max_rows)
            if n and direct is not None and n_new:
                _cpu.direct_note(direct, keys, rows)
        elif not self.use_kernels:
            rows, n_new = _k.hash_insert_ref(self._tkeys, self._trows, keys, self._size, self._max_rows)
        else:
            slots, flags, pos, status = self._scratch(n)
            rows = self.xp.empty(n, dtype=numpy.int64)
            n_new = _k.hash_insert(
                self._tkeys,
                self._trows,
                self._tfirst,
                keys,
                self._size,
                self._max_rows,
                slots,
                flags,
                pos,
                rows,
                status,
                self._no_mask,
                self._err,
                scan_threads=self.scan_threads,
                partials=self._partials,
            )
        self._size += n_new
        if self.use_kernels and n_new:
            self._dsize[0] = self._size  # a host-to-device write: the deferred insert's counter
        return rows

    def insert_deferred(self, keys, occ_table=None, t: int = -1, rows_out=None):
        """insert() with no host read (kernels only; a GPU training step's path): (rows (N,) int64, flags (N,)
        int64 = 1 at each new key's first occurrence, keys (N,) uint64 as inserted). With occ_table (N,) int64,
        only the occurrences with occ_table == t are inserted and rows_out (given) keeps the others' values.

        What insert() raises is recorded on the device instead and raised by check(): a batch that does not
        fit is rolled back on the device (its new keys get row -1: looked up as nothing, never updated) and a
        reserved key (2**64-1) gets row -1. The size is read from the device when asked for."""
        if not self.use_kernels:
            raise RuntimeError("insert_deferred runs the kernels (gpu/sim); use insert() on the cpu device")
        xp = self.xp
        keys = self._as_keys(keys, check_reserved=False)
        n = keys.shape[0]
        rows = rows_out if rows_out is not None else xp.empty(n, dtype=numpy.int64)
        if n == 0:
            return rows, xp.zeros(0, dtype=numpy.int64), keys
        slots, flags, pos, status = self._scratch(n)
        if occ_table is None:
            occ_table, t = self._no_mask, -1
        _k.hash_insert_deferred(
            self._tkeys,
            self._trows,
            self._tfirst,
            keys,
            occ_table,
            int(t),
            self._dsize,
            self._max_rows,
            slots,
            flags,
            pos,
            rows,
            status,
            self._err,
            scan_threads=self.scan_threads,
            partials=self._partials,
        )
        self._size_stale = self._unchecked = True
        from numbactr.runtime import step_values  # a replayed step marks the record again (cuda_graphs)

        step_values.on_replay(("hash", id(self)), self._mark_deferred)
        return rows, flags, keys

    def _mark_deferred(self, run=None) -> None:
        self._size_stale = self._unchecked = True

    def check(self) -> None:
        """Raise what deferred inserts since the last check recorded (one host read, none when there was no
        deferred insert): HashTableFullError for the first batch that did not fit (it and the batches after
        it that did not fit either were dropped: their new keys were looked up as nothing), ValueError for a
        reserved key. The record is cleared first, so a caller that handles the error can go on."""
        if not self._unchecked:
            return
        from numbactr.runtime import device

        err = device.to_host(self._err).astype(numpy.int64)
        self._unchecked = False
        if err[0] == 0 and err[3] == _k.INT64_MAX:
            return
        self._err[...] = self.xp.asarray(self._new_err(numpy))
        if err[0]:
            hint = f"all {self.capacity} hash slots taken" if err[0] == _k.ERR_NO_SLOT else ""
            raise HashTableFullError(int(err[1]), int(err[2]), self._max_rows, hint=hint)
        raise ValueError(
            f"key 18446744073709551615 (2**64-1, int64 -1) at position {int(err[3])} of a batch is "
            "reserved: it marks empty hash-table slots and cannot be used as an embedding key "
            "(that occurrence was looked up as nothing)"
        )

    def _new_err(self, xp=None):
        err = (xp or self.xp).zeros(4, dtype=numpy.int64)
        err[3] = _k.INT64_MAX
        return err

    def _sync_size(self) -> None:
        """Before an eager operation: the host's count equals the device's."""
        if self._size_stale:
            self.size  # noqa: B018 (reads the device counter)

    def find(self, keys):
        """rows (N,) int64 of keys (N,), -1 for keys not in the table; never inserts."""
        keys = self._as_keys(keys)
        if self.compiled:
            rows = numpy.empty(keys.shape[0], dtype=numpy.int64)
            if self._direct is None:
                _cpu.hash_find_cpu(self._tkeys, self._trows, keys, rows)
            else:
                _cpu.direct_find_cpu(self._direct, self._tkeys, self._trows, keys, rows)
            return rows
        if not self.use_kernels:
            return _k.hash_find_ref(self._tkeys, self._trows, keys)
        rows = self.xp.empty(keys.shape[0], dtype=numpy.int64)
        _k.hash_find(self._tkeys, self._trows, keys, rows)
        return rows

    def probe_arrays(self):
        """(keys (C,) uint64, rows (C,) int64): the open-addressing arrays themselves, for compiled code
        that probes the table inside a larger pass (kernels/hash_table_cpu.serve_cached_cpu). Read only."""
        return self._tkeys, self._trows

    def keys_by_row(self):
        """keys (size,) uint64 with keys[r] = the key stored in row r (for dumping the table)."""
        out = self.xp.empty(self.size, dtype=numpy.uint64)
        if self._size == 0:
            return out
        if self.use_kernels:
            _k.hash_dump(self._tkeys, self._trows, out)
        else:
            used = self._trows >= 0
            out[self._trows[used]] = self._tkeys[used]
        return out

    def clear(self) -> None:
        """Forget every key; rows are handed out from 0 again."""
        self._tkeys.fill(EMPTY_KEY)
        self._trows.fill(-1)
        if self._direct is not None:
            self._direct.fill(-1)
        if self._tfirst is not None:
            self._tfirst.fill(_k.INT64_MAX)
        self._size = 0
        if self._dsize is not None:
            self._dsize.fill(0)
        self._size_stale = False

    # ---- helpers ------------------------------------------------------------------------------
    def _as_keys(self, keys, check_reserved: bool = True):
        """Any integer array -> contiguous (N,) uint64 on xp (signed keys wrap: int64 -1 -> 2**64-1);
        the reserved EMPTY_KEY raises ValueError naming the key and its position (check_reserved=False: the
        deferred insert's kernel records it instead of a host read here)."""
        xp = self.xp
        keys = xp.asarray(keys)
        if keys.dtype.kind not in "iu":
            raise TypeError(f"hash table keys must be integers (uint32/int64/uint64), got {keys.dtype}")
        flat = keys.reshape(-1)
        k64 = xp.ascontiguousarray(flat.astype(numpy.uint64, copy=False))
        if not check_reserved:
            return k64
        reserved = k64 == EMPTY_KEY
        if k64.shape[0] and bool(reserved.any()):
            at = int(xp.argmax(reserved))
            raise ValueError(
                f"key {int(flat[at])} at position {at} is reserved: 2**64-1 (int64 -1) "
                "marks empty hash-table slots and cannot be used as an embedding key"
            )
        return k64

    def _scratch(self, n: int):
        """Kernel scratch views for a batch of n keys: slots, flags (n,) int64, pos (n + 1,) int64,
        status (1,) int32. Buffers grow to the largest batch seen and are reused."""
        if n > self._scratch_n:
            xp = self.xp
            self._slots = xp.empty(n, dtype=numpy.int64)
            self._flags = xp.empty(n, dtype=numpy.int64)
            self._pos = xp.empty(n + 1, dtype=numpy.int64)
            self._status = xp.zeros(1, dtype=numpy.int32)
            self._partials = xp.empty(scan_partials_size(n, self.scan_threads), dtype=numpy.int64)
            self._no_mask = xp.zeros(1, dtype=numpy.int64)
            self._scratch_n = n
        return self._slots[:n], self._flags[:n], self._pos[: n + 1], self._status
