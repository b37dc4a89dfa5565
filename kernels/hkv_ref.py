"""An evicting key -> row table after NVIDIA's HierarchicalKV, the NumPy reference: the contract and the oracle.

What it is for: tables over IDs that keep arriving (online training) never fill. When a key's bucket is full
the key with the lowest score leaves to make room, and a new key scoring below every key of its full bucket
is refused. kernels/hkv_cpu.py (numba.njit) and kernels/hkv.py (numba.cuda) compute exactly what this module
computes, bit for bit; the tests hold them to it.

Layout (C = num_buckets * B slots, D the row width; num_buckets a power of two)
    keys (C,) uint64      EMPTY_KEY = 2**64 - 1 where free (a reserved key: inputs may not use it)
    values (C, D)         the rows;  scores (C,) uint64 (0 where free);  sizes (num_buckets,) int64
    bucket of a key       fmix64(key) % num_buckets  (murmur3's finalizer, kernels/hash64.py, as HKV's
                          Murmur3HashDevice); the key may sit in any slot b*B .. b*B + B - 1 of bucket b
    a new key             takes the lowest free slot of its bucket; a full bucket evicts the slot with the
                          lowest score, the lowest slot index among equal minima (np.argmin's first)

Batch order: the keys of a batch are processed one after another in input order. A repeated key therefore
finds what its earlier occurrence did (a hit: its score is updated again, insert_or_assign's last row wins),
and a key inserted early in a batch may be evicted by a later key of the same batch (then reported by that
later key). Keys of different buckets never meet, so the GPU processes buckets in parallel, each bucket's
keys in input order, and gets the same result.

Scores (S = the stored score, g = the given score of the key, 1 when none is given for kLfu/kEpochLfu)
    kLru        clock: a logical clock of the table, + 1 before every batch that writes scores
                (find_or_insert, insert_or_assign, insert_and_evict, assign); all keys of a batch share it.
                HierarchicalKV reads the GPU's nanosecond timer instead: a clock per batch is reproducible.
    kLfu        S + g (saturating at 2**64 - 1); a new key g
    kEpochLru   epoch << 32 | (clock & 0xFFFFFFFF)      (epoch: set_global_epoch, below 2**32)
    kEpochLfu   epoch << 32 | min((S & 0xFFFFFFFF) + g, 0xFFFFFFFF): the count goes on across epochs,
                saturating at 32 bits; a new key epoch << 32 | min(g, 0xFFFFFFFF)
    kCustomized g
find and export_batch_if change no score. A new key whose score is below its full bucket's minimum is
refused (strictly below: an equal score evicts); under kLru and kEpochLru that never happens (the clock only
grows). A refused key is reported as evicted (with its own row and score) and find_or_insert hands back its
initial row, used for the batch but not stored.

Operations (Mode, Status in kernels/hkv_math.py)
    upsert_ref   FIND_OR_INSERT, INSERT_OR_ASSIGN (insert_and_evict is this plus the report), ASSIGN
    find_ref     rows, found flags, scores; nothing written
    match_ref    the occupied slots whose score satisfies a predicate (SCORE_LT / SCORE_GE a threshold; a TTL
                 is SCORE_LT now - ttl), in slot order: export_batch_if reads them, erase_if frees them
    erase_ref    frees slots (key EMPTY, score 0, bucket size - 1; the row is left for the next key)
    double_ref   growth: a table of twice the buckets, every key placed anew in slot order (a key of old
                 bucket b lands in b or b + num_buckets: the buckets never overflow)
Growth policy (numbactr.embedding.evicting): before a batch of n keys that may insert, the table doubles
while (size + n) > max_load_factor * capacity and capacity < max_capacity, as HierarchicalKV's
insert_or_assign does (it checks its load factor with the batch counted in). As there, a bucket that fills
before the table reaches max_capacity evicts too; at load factor 0.5 and B = 128 that is rare.

HierarchicalKV: include/merlin_hashtable.cuh (find_or_insert, insert_or_assign, insert_and_evict, assign,
find, erase_if, export_batch_if, EvictStrategy); it searches a bucket from a hashed start with digests and
locks, numbactr from the bucket's first slot; its scores for kLru come from a timer.
"""
from __future__ import annotations

import numpy as np

from .hash64 import fmix64_ref
from .hkv_math import EMPTY_KEY, LO32, MAX_SCORE, Arrays, EvictStrategy, Mode, Pred, Status

EMPTY = np.uint64(EMPTY_KEY)


def new_arrays(num_buckets: int, bucket_size: int, dim: int, dtype=np.float32, xp=np) -> Arrays:
    """An empty table of num_buckets * bucket_size slots on xp (numpy, or cupy for the kernels)."""
    c = num_buckets * bucket_size
    return Arrays(xp.full(c, EMPTY, dtype=np.uint64), xp.zeros((c, dim), dtype=dtype),
                  xp.zeros(c, dtype=np.uint64), xp.zeros(num_buckets, dtype=np.int64))


def bucket_of_ref(keys: np.ndarray, num_buckets: int) -> np.ndarray:
    """(N,) int64: fmix64(key) % num_buckets."""
    return (fmix64_ref(keys) % np.uint64(num_buckets)).astype(np.int64)


def score_ref(strategy: int, old: int | None, g: int, clock: int, epoch: int) -> int:
    """The score a key gets (old: its stored score, None for a new key), as Python ints."""
    if strategy == EvictStrategy.kLru:
        return clock
    if strategy == EvictStrategy.kLfu:
        return g if old is None else min(old + g, MAX_SCORE)
    if strategy == EvictStrategy.kEpochLru:
        return (epoch & LO32) << 32 | (clock & LO32)
    if strategy == EvictStrategy.kEpochLfu:
        count = min(g, LO32) + (0 if old is None else old & LO32)
        return (epoch & LO32) << 32 | min(count, LO32)
    return g


def upsert_ref(t: Arrays, keys, given, vin, vout, mode: int, strategy: int, clock: int, epoch: int):
    """One batch (see the module docstring), in place on t. keys (N,) uint64, given (N,) uint64 scores,
    vin (N, D) the rows to insert or assign, vout (N, D) filled by FIND_OR_INSERT (the found rows, a new or
    refused key's vin row). Returns status (N,) int32, slots (N,) int64 (-1: not stored), and per position
    the evicted (or refused) key, row and score: ev_keys (N,), ev_vals (N, D), ev_scores (N,), zero where
    status is neither EVICTED nor REFUSED."""
    n, bsz = keys.shape[0], t.keys.shape[0] // t.sizes.shape[0]
    status = np.zeros(n, dtype=np.int32)
    slots = np.full(n, -1, dtype=np.int64)
    ev_keys, ev_scores = np.zeros(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64)
    ev_vals = np.zeros((n, t.values.shape[1]), dtype=t.values.dtype)
    buckets = bucket_of_ref(keys, t.sizes.shape[0])
    for i in range(n):                                  # input order: a repeat sees what came before it
        key, b = keys[i], buckets[i]
        lo = b * bsz
        bucket = slice(lo, lo + bsz)
        hit = np.flatnonzero(t.keys[bucket] == key)
        if hit.size:                                    # found: new score, then read or write the row
            s = lo + int(hit[0])
            t.scores[s] = score_ref(strategy, int(t.scores[s]), int(given[i]), clock, epoch)
            if mode == Mode.FIND_OR_INSERT:
                vout[i] = t.values[s]
            else:
                t.values[s] = vin[i]
            status[i], slots[i] = Status.FOUND, s
            continue
        if mode == Mode.ASSIGN:                         # assign never inserts
            status[i] = Status.ABSENT
            continue
        if mode == Mode.FIND_OR_INSERT:
            vout[i] = vin[i]                            # the initial row, stored or not
        score = score_ref(strategy, None, int(given[i]), clock, epoch)
        free = np.flatnonzero(t.keys[bucket] == EMPTY)
        if free.size:                                   # a free slot: the lowest one
            s = lo + int(free[0])
            t.sizes[b] += 1
            status[i] = Status.INSERTED
        else:                                           # full: the lowest score, lowest slot among equals
            s = lo + int(np.argmin(t.scores[bucket]))
            if score < int(t.scores[s]):                # below the minimum: refused, reported as evicted
                ev_keys[i], ev_vals[i], ev_scores[i] = key, vin[i], score
                status[i] = Status.REFUSED
                continue
            ev_keys[i], ev_vals[i], ev_scores[i] = t.keys[s], t.values[s], t.scores[s]
            status[i] = Status.EVICTED
        t.keys[s], t.values[s], t.scores[s] = key, vin[i], score
        slots[i] = s
    return status, slots, ev_keys, ev_vals, ev_scores


def find_ref(t: Arrays, keys):
    """(rows (N, D), found (N,) bool, scores (N,) uint64) of keys (N,) uint64; zeros for absent keys."""
    n, bsz = keys.shape[0], t.keys.shape[0] // t.sizes.shape[0]
    rows = np.zeros((n, t.values.shape[1]), dtype=t.values.dtype)
    found = np.zeros(n, dtype=bool)
    scores = np.zeros(n, dtype=np.uint64)
    for i, b in enumerate(bucket_of_ref(keys, t.sizes.shape[0])):
        hit = np.flatnonzero(t.keys[b * bsz:(b + 1) * bsz] == keys[i])
        if hit.size:
            s = b * bsz + int(hit[0])
            rows[i], found[i], scores[i] = t.values[s], True, t.scores[s]
    return rows, found, scores


def match_ref(t: Arrays, pred: int, threshold: int) -> np.ndarray:
    """(M,) int64: the occupied slots whose score is < threshold (SCORE_LT) or >= threshold (SCORE_GE),
    ascending."""
    thr = np.uint64(threshold)
    ok = t.scores < thr if pred == Pred.SCORE_LT else t.scores >= thr
    return np.flatnonzero(ok & (t.keys != EMPTY)).astype(np.int64)


def erase_ref(t: Arrays, slots) -> None:
    """Free the given occupied slots (M,) int64."""
    bsz = t.keys.shape[0] // t.sizes.shape[0]
    t.keys[slots] = EMPTY
    t.scores[slots] = 0
    np.subtract.at(t.sizes, np.asarray(slots) // bsz, 1)


def double_ref(t: Arrays) -> tuple[Arrays, np.ndarray]:
    """(the table with twice the buckets, moved (C,) int64: the new slot of each old slot, -1 if free).
    Keys are placed in old slot order, each in the lowest free slot of its new bucket."""
    nb, bsz = t.sizes.shape[0], t.keys.shape[0] // t.sizes.shape[0]
    new = new_arrays(2 * nb, bsz, t.values.shape[1], t.values.dtype)
    moved = np.full(t.keys.shape[0], -1, dtype=np.int64)
    used = np.flatnonzero(t.keys != EMPTY)
    for s, b in zip(used, bucket_of_ref(t.keys[used], 2 * nb)):
        d = b * bsz + new.sizes[b]                      # a new table has no holes: the next slot is free
        new.sizes[b] += 1
        new.keys[d], new.values[d], new.scores[d] = t.keys[s], t.values[s], t.scores[s]
        moved[s] = d
    return new, moved


#: NumPy only; the numba.cuda kernels of the table are in kernels/hkv.py
PTX_CHECKS = []
