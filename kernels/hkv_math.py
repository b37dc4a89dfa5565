"""The evicting hash table's names and its per-key step, written once as plain Python and compiled twice.

kernels/hkv.py compiles ``upsert_key`` as an inlined numba.cuda device function, kernels/hkv_cpu.py with
``numba.njit``: the GPU, the simulator and the compiled cpu path run one text for "one key meets its bucket".
kernels/hkv_ref.py says the same in NumPy (written apart from this, so that it can be the oracle); the
table's contract (layout, scores, ties, batch order, growth) is that module's docstring.

``upsert_key`` is a leaf (it calls no other function of this module), so each target binds its own copy; all
its key and score arithmetic is uint64 against uint64 constants (see /work/shared/notes/numba_cuda.md on
integer promotion: the simulator runs this on NumPy scalars) and no sum can wrap (saturating adds).
"""
from __future__ import annotations

import enum
from typing import NamedTuple

from numba import uint64

EMPTY_KEY = 0xFFFFFFFFFFFFFFFF    # reserved: marks a free slot (HierarchicalKV's EMPTY_KEY too)
MAX_SCORE = 0xFFFFFFFFFFFFFFFF
LO32 = 0xFFFFFFFF


class EvictStrategy(enum.IntEnum):
    """HierarchicalKV's EvictStrategy, with its values."""

    kLru = 0           # noqa: N815 (HierarchicalKV's names)
    kLfu = 1           # noqa: N815
    kEpochLru = 2      # noqa: N815
    kEpochLfu = 3      # noqa: N815
    kCustomized = 4    # noqa: N815


class Mode(enum.IntEnum):
    """What an upsert does with a key it finds, and whether it inserts one it does not."""

    FIND_OR_INSERT = 0     # found: read its row; absent: insert the given row
    INSERT_OR_ASSIGN = 1   # found: overwrite its row; absent: insert the given row (insert_and_evict too)
    ASSIGN = 2             # found: overwrite its row; absent: nothing


class Status(enum.IntEnum):
    """What happened to each key of a batch (status (N,) int32)."""

    ABSENT = 0      # assign: the key is not in the table, nothing done
    FOUND = 1       # the key was in the table (its score updated)
    INSERTED = 2    # a new key took a free slot of its bucket
    EVICTED = 3     # a new key took the slot of its full bucket's lowest score; that key is reported
    REFUSED = 4     # a new key scored below its full bucket's minimum: not stored; reported as evicted


class Pred(enum.IntEnum):
    """The predicates of erase_if / export_batch_if on an occupied slot's score."""

    SCORE_LT = 0    # score < threshold (a TTL: threshold = now - ttl)
    SCORE_GE = 1    # score >= threshold


class Arrays(NamedTuple):
    """The table state, C = num_buckets * bucket_size slots; bucket b owns slots b*B .. b*B + B - 1."""

    keys: object      # (C,) uint64, EMPTY_KEY where free
    values: object    # (C, D) the rows
    scores: object    # (C,) uint64, 0 where free
    sizes: object     # (num_buckets,) int64, occupied slots per bucket


def upsert_key(tkeys, tvals, tscores, sizes, b, i, keys, given, vin, vout, mode, strategy, clock, epoch,
               status, slots, ev_keys, ev_vals, ev_scores):
    """Key keys[i] of a batch meets its bucket b (see kernels/hkv_ref.py for the contract).

    One scan of the bucket finds the key, or else the first free slot and the lowest score (the first slot
    holding it: strict ``<`` keeps the lowest index among equal minima). Then the key's score, by strategy:
        kLru      clock                          kLfu        old + given (saturating; new key: given)
        kEpochLru epoch << 32 | clock & LO32     kEpochLfu   epoch << 32 | (old & LO32) + given, both
        kCustomized  given                                   saturating at LO32 (new key: given)
    and the write: found -> score, and (mode) read the row into vout[i] or write vin[i] to it; absent and
    mode != ASSIGN -> a free slot, or the minimum's slot when score >= that minimum (its key, row and score
    go to ev_*[i]), or refused (keys[i], vin[i] and its score go to ev_*[i]). status[i], slots[i] (-1 when
    not stored) say which."""
    B = tkeys.shape[0] // sizes.shape[0]
    key = keys[i]
    lo = b * B
    found = -1
    free = -1
    victim = -1
    for s in range(lo, lo + B):
        k = tkeys[s]
        if k == key:
            found = s
            break
        if k == uint64(0xFFFFFFFFFFFFFFFF):
            if free < 0:
                free = s
        elif victim < 0 or tscores[s] < tscores[victim]:
            victim = s
    g = given[i]
    lo32 = uint64(0xFFFFFFFF)
    score = uint64(0)
    if strategy == 0:
        score = clock
    elif strategy == 1:
        score = g
        if found >= 0:
            old = tscores[found]
            score = uint64(0xFFFFFFFFFFFFFFFF) if g > uint64(0xFFFFFFFFFFFFFFFF) - old else old + g
    elif strategy == 2:
        score = ((epoch & lo32) << uint64(32)) | (clock & lo32)
    elif strategy == 3:
        count = g if g < lo32 else lo32
        if found >= 0:
            count = count + (tscores[found] & lo32)        # < 2^33: no wrap
            if count > lo32:
                count = lo32
        score = ((epoch & lo32) << uint64(32)) | count
    else:
        score = g
    dim = tvals.shape[1]
    if found >= 0:
        tscores[found] = score
        if mode == 0:
            for d in range(dim):
                vout[i, d] = tvals[found, d]
        else:
            for d in range(dim):
                tvals[found, d] = vin[i, d]
        status[i] = 1
        slots[i] = found
        return
    if mode == 2:
        status[i] = 0
        slots[i] = -1
        return
    if mode == 0:
        for d in range(dim):
            vout[i, d] = vin[i, d]          # a refused key is used with its initial row, not stored
    target = free
    if free >= 0:
        sizes[b] += 1
        status[i] = 2
    elif score < tscores[victim]:
        ev_keys[i] = key
        ev_scores[i] = score
        for d in range(dim):
            ev_vals[i, d] = vin[i, d]
        status[i] = 4
        slots[i] = -1
        return
    else:
        target = victim
        ev_keys[i] = tkeys[victim]
        ev_scores[i] = tscores[victim]
        for d in range(dim):
            ev_vals[i, d] = tvals[victim, d]
        status[i] = 3
    tkeys[target] = key
    tscores[target] = score
    for d in range(dim):
        tvals[target, d] = vin[i, d]
    slots[i] = target


def move_slot(tkeys, tvals, tscores, nkeys, nvals, nscores, nsizes, moved, s, b, bsz):
    """Doubling: old slot s's key, row and score to the next free slot of new bucket b (buckets of bsz
    slots); moved[s] <- that slot."""
    d = b * bsz + nsizes[b]
    nsizes[b] += 1
    nkeys[d] = tkeys[s]
    nscores[d] = tscores[s]
    for k in range(tvals.shape[1]):
        nvals[d, k] = tvals[s, k]
    moved[s] = d


#: plain Python compiled by kernels/hkv.py (whose PTX_CHECKS compile it inside the kernels) and hkv_cpu.py
PTX_CHECKS = []
