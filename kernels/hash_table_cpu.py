"""The key -> row hash table compiled for the CPU (numba.njit): the cpu device's fast path.

The same table layout and the same results as kernels/hash_table.py (open addressing over uint64 keys,
linear probing from fmix64(key) % C, EMPTY_KEY = 2**64 - 1 marks a free slot, rows handed out in order of
first occurrence in the batch); see that module for the formulas and the NumPy reference, the oracle.

    insert  the known keys are found in parallel (as find; a table small enough to stay in cache takes one
            serial pass instead); then the misses, in batch order, claim the first free slot of their probe
            sequence and take the next row, so rows come out in first-occurrence order by construction.
            When the rows would run past max_rows (or no slot is free) every slot this batch claimed is
            emptied again: the table is exactly as before (removing only keys of this
            batch cannot break the probe chain of an older key, which was inserted before them).
    find    in parallel over the keys (threads only read the table).
The slot a key lands in may differ from the numba.cuda kernels' (their CAS order varies); rows never do.

A direct index in front of the table (numbactr.embedding.hash_table keeps it): ``direct`` (D,) int64 holds
the row of every key below D that the table holds, -1 for the others, so a small key's row is one read, no
hash and no probe. ``direct_rows`` serves a batch from it while every key is small and known (the steady
state of a table over small ids: MovieLens' users and items, the zoo's slots); the first key that is not sends
the whole batch to the hashed insert, after which ``direct_note`` records its small keys' rows.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, uint64

from .parallel_cpu import pjit

from .tbe_cpu import pool_dispatch, prefetch

_EMPTY = 0xFFFFFFFFFFFFFFFF
_FIND_PF = 16             # keys ahead whose home slot a find prefetches
#: tables of up to this many slots (16 bytes each: 4 MiB) stay in cache, where one serial insert pass beats
#: the parallel find + serial claim of a larger table (2026-11-25, 1M power-law keys into 145k slots, 1
#: thread: 4.9 against 6.4 ms when every key is known; 6.5 against 9.4 ms into an empty table)
SERIAL_SLOTS = 1 << 18


@njit(cache=True, inline="always")
def _home_slot(key, cap):
    """murmur3's fmix64 of the key modulo the capacity (compiled code wraps uint64 products natively)."""
    h = key ^ (key >> uint64(33))
    h = h * uint64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> uint64(33))
    h = h * uint64(0xC4CEB9FE1A85EC53)
    h = h ^ (h >> uint64(33))
    return np.int64(h % uint64(cap))


@njit(cache=True, inline="always")
def _probe_from(tkeys, trows, key, s):
    """Probe for key from slot s on: its row, or -1 - (the first free slot) when it is absent, or
    -1 - s when every slot is taken by other keys."""
    cap = tkeys.shape[0]
    for _ in range(cap):
        here = tkeys[s]
        if here == key:
            return trows[s]
        if here == uint64(_EMPTY):
            return -1 - s
        s += 1
        if s == cap:
            s = 0
    return -1 - s


@njit(cache=True, inline="always")
def _find_one(tkeys, trows, key):
    row = _probe_from(tkeys, trows, key, _home_slot(key, tkeys.shape[0]))
    return row if row >= 0 else np.int64(-1)


@njit(cache=True, inline="always")
def _claim_from(tkeys, trows, key, s, next_row, max_rows):
    """Probe for key from slot s on, claiming the first free slot for it with row next_row when it is new:
    (its row, the slot claimed or -1 when it was known). Row -1 when it is new and next_row >= max_rows,
    or when every slot is taken by other keys."""
    cap = tkeys.shape[0]
    for _ in range(cap):
        here = tkeys[s]
        if here == key:
            return trows[s], np.int64(-1)
        if here == uint64(_EMPTY):
            if next_row >= max_rows:
                return np.int64(-1), np.int64(-1)
            tkeys[s] = key
            trows[s] = next_row
            return next_row, s
        s += 1
        if s == cap:
            s = 0
    return np.int64(-1), np.int64(-1)


@njit(cache=True)
def _roll_back(tkeys, trows, claimed, n_new):
    for c in range(n_new):
        tkeys[claimed[c]] = uint64(_EMPTY)
        trows[claimed[c]] = -1


@njit(cache=True, inline="always")
def _claim_into(tkeys, trows, keys, i, s, base, n_new, max_rows, claimed, rows_out):
    """Key i from slot s on (_claim_from, with row base + n_new if it is new): its row into rows_out[i] and
    a claimed slot into claimed[n_new]. Returns the new n_new, or -1 after undoing the batch's claims when
    the rows or the slots ran out."""
    row, slot = _claim_from(tkeys, trows, keys[i], s, base + n_new, max_rows)
    if row < 0:
        _roll_back(tkeys, trows, claimed, n_new)
        return np.int64(-1)
    if slot >= 0:
        claimed[n_new] = slot
        n_new += 1
    rows_out[i] = row
    return n_new


@pjit(cache=True)
def hash_insert_cpu(tkeys, trows, keys, base, max_rows, rows_out, claimed, miss, serial_slots=SERIAL_SLOTS):
    """rows_out (N,) int64 <- rows of keys (N,) uint64, inserting new keys at rows base, base + 1, ...
    claimed and miss (N,) int64 are scratch. Returns the number of new keys, or -1 when the table could not
    take them all (max_rows reached or no free slot): the table is then rolled back to what it was.

    A table of up to serial_slots slots (it stays in cache) takes the batch in one serial pass. A larger
    one is probed in parallel first, as find does: the home slots first (miss holds them), then the probes,
    each prefetching the home slot _FIND_PF keys ahead. In the steady state of training nearly every key is
    known and this is the whole insert. A key not found leaves -1 - (the free slot that ended its probe) in
    rows_out. Then the misses, in batch order, claim slots one after another (serial, so rows come out in
    first-occurrence order): each resumes its probe at that free slot (the slots before it held other keys
    and still do; slots claimed since then are probed on), prefetching the miss _FIND_PF ahead. A later
    repeat of a new key finds the slot its first occurrence claimed."""
    n = keys.shape[0]
    cap = tkeys.shape[0]
    n_new = 0
    if cap <= serial_slots:
        for i in range(n):
            n_new = _claim_into(tkeys, trows, keys, i, _home_slot(keys[i], cap), base, n_new, max_rows, claimed,
                                rows_out)
            if n_new < 0:
                return -1
        return n_new
    for i in prange(n):
        miss[i] = _home_slot(keys[i], cap)
    for i in prange(n):
        if i + _FIND_PF < n:
            prefetch(tkeys, miss[i + _FIND_PF])
            prefetch(trows, miss[i + _FIND_PF])
        rows_out[i] = _probe_from(tkeys, trows, keys[i], miss[i])
    m = 0
    for i in range(n):                                  # the misses' positions, in batch order
        if rows_out[i] < 0:
            miss[m] = i
            m += 1
    for j in range(m):
        if j + _FIND_PF < m:
            ahead = -1 - rows_out[miss[j + _FIND_PF]]
            prefetch(tkeys, ahead)
            prefetch(trows, ahead)
        i = miss[j]
        n_new = _claim_into(tkeys, trows, keys, i, -1 - rows_out[i], base, n_new, max_rows, claimed, rows_out)
        if n_new < 0:
            return -1
    return n_new


@njit(cache=True)
def direct_rows(direct, keys, rows_out):
    """rows_out[i] = direct[keys[i]] for the keys of the batch in order, up to the first that is not below
    D = len(direct) or not known (direct -1). Returns how many were served: the batch's length when all."""
    d = uint64(direct.shape[0])
    for i in range(keys.shape[0]):
        k = keys[i]
        if k >= d:
            return i
        r = direct[k]
        if r < 0:
            return i
        rows_out[i] = r
    return keys.shape[0]


@njit(cache=True)
def direct_note(direct, keys, rows):
    """direct[k] = its row for each key k below D of a batch the table has just taken (rows -1: not taken)."""
    d = uint64(direct.shape[0])
    for i in range(keys.shape[0]):
        if keys[i] < d and rows[i] >= 0:
            direct[keys[i]] = rows[i]


@pjit(cache=True)
def direct_find_cpu(direct, tkeys, trows, keys, rows_out):
    """hash_find_cpu with the direct index: a key below D = len(direct) is read from it (-1: absent), a
    larger one probed in the table."""
    n = keys.shape[0]
    d = uint64(direct.shape[0])
    for i in prange(n):
        k = keys[i]
        rows_out[i] = direct[k] if k < d else _find_one(tkeys, trows, k)


@pjit(cache=True)
def hash_find_cpu(tkeys, trows, keys, rows_out):
    """rows_out (N,) int64 <- row of each key (N,) uint64, -1 when absent; in parallel. The home slot of
    the key _FIND_PF ahead is prefetched (its key and row), so the random probes overlap."""
    n = keys.shape[0]
    cap = tkeys.shape[0]
    for i in prange(n):
        if i + _FIND_PF < n:
            s = _home_slot(keys[i + _FIND_PF], cap)
            prefetch(tkeys, s)
            prefetch(trows, s)
        rows_out[i] = _find_one(tkeys, trows, keys[i])


#: CPU code only; the numba.cuda kernels of the hash table are in kernels/hash_table.py
PTX_CHECKS = []


@njit(cache=True)
def first_occurrences(rows, mark, uniq, first, occ):
    """Distinct rows of rows (N,) int64 (-1: none) in order of first occurrence, in one pass and without a
    sort: uniq[:U] the distinct rows >= 0, first[:U] the position of each one's first occurrence,
    occ (N,) <- the index into uniq of each occurrence (-1 for rows -1). mark (R,) int64 is scratch that
    must hold -1 everywhere on entry and does again on return. Returns U."""
    u = 0
    for k in range(rows.shape[0]):
        r = rows[k]
        if r < 0:
            occ[k] = -1
            continue
        p = mark[r]
        if p < 0:
            p = u
            mark[r] = u
            uniq[u] = r
            first[u] = k
            u += 1
        occ[k] = p
    for i in range(u):
        mark[uniq[i]] = -1
    return u


@njit(cache=True)
def serve_cached_cpu(tkeys, trows, keys, offsets, row_slot, row_off, slot_off, buf, stride, dim, mean, slot_of,
                     stamp, freq, clock, acc, out):
    """Inference's warm-cache request in one call (numbactr.inference.hps.ModelCache.serve_pooled): the keys
    (N,) uint64 of bags offsets (J + 1,) are found in the key -> row table (tkeys, trows), their rows'
    cache slots read from row_slot[row + row_off], each distinct slot stamped used at `clock` (a new tick:
    no slot holds it yet, so the stamp itself tells a slot's first occurrence) with its frequency counted
    once, as EmbeddingCache.touch_cached does; then the bags are pooled straight from the cache's vectors
    buf (slots * stride,) float32 (local slot s - slot_off at (s - slot_off) * stride) into out (J * dim,)
    by the embedding engine's own compiled pooling (kernels/tbe_cpu.pool_dispatch; SUM, or MEAN when mean),
    so the result equals copying the rows to a block and pooling there. slot_of (N,) int64 and acc (dim,)
    float32 are scratch. Returns U, the number of distinct keys; or -1, with nothing changed (out
    undefined), when a key is not in the table or its row is not cached: the caller then takes the general
    path. Each pass prefetches _FIND_PF ahead (a fused loop whose next address depends on the last load
    stalls on every cache miss): find the rows, read their slots, stamp them, pool."""
    n = keys.shape[0]
    cap = tkeys.shape[0]
    for k in range(n):
        if k + _FIND_PF < n:
            s = _home_slot(keys[k + _FIND_PF], cap)
            prefetch(tkeys, s)
            prefetch(trows, s)
        row = _find_one(tkeys, trows, keys[k])
        if row < 0:
            return -1
        slot_of[k] = row + row_off
    for k in range(n):
        if k + _FIND_PF < n:
            prefetch(row_slot, slot_of[k + _FIND_PF])
        s = row_slot[slot_of[k]]
        if s < 0:
            return -1
        slot_of[k] = s
    u = 0
    for k in range(n):
        if k + _FIND_PF < n:
            prefetch(stamp, slot_of[k + _FIND_PF])
            prefetch(freq, slot_of[k + _FIND_PF])
        s = slot_of[k]
        if stamp[s] != clock:
            stamp[s] = clock
            freq[s] += 1
            u += 1
        slot_of[k] = s - slot_off                      # the vector's row in the table's buffer
    # the bags, pooled by the embedding engine's own compiled pooling (kernels/tbe_cpu.pool_dispatch:
    # float32 sums in occurrence order, MEAN scaled after, the common widths unrolled)
    pool_dispatch(buf, slot_of, acc, False, offsets, 0, offsets.shape[0] - 1, 0, 0, stride, dim, dim, uint64(0),
                  1 if mean else 0, acc, out)
    return u
