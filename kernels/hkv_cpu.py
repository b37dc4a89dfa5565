"""The evicting hash table compiled for the CPU (numba.njit): the cpu device's fast path.

The contract is kernels/hkv_ref.py's (layout, scores, ties, batch order, growth); the per-key step is
kernels/hkv_math.upsert_key, the same text the numba.cuda kernels compile. Here the keys of a batch simply
run one after another in input order, which is the reference's order by definition. Every loop is serial
(a batch's keys must be) but find's: it changes no state, so its keys are looked up in parallel (a
parallel_cpu.pjit twin: prange over the keys, each writing only its own outputs; the same bits at any
thread count, and the serial twin when numba runs one thread).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, uint64

from . import hkv_math as M
from .parallel_cpu import pjit

_JIT = dict(cache=True)
upsert_key = njit(inline="always", **_JIT)(M.upsert_key)
move_slot = njit(inline="always", **_JIT)(M.move_slot)


@njit(inline="always", **_JIT)
def _bucket(key, nb):
    """murmur3's fmix64 of the key modulo nb (compiled code wraps uint64 products natively)."""
    h = key ^ (key >> uint64(33))
    h = h * uint64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> uint64(33))
    h = h * uint64(0xC4CEB9FE1A85EC53)
    h = h ^ (h >> uint64(33))
    return np.int64(h % uint64(nb))


@njit(**_JIT)
def upsert_batch(tkeys, tvals, tscores, sizes, keys, given, vin, vout, mode, strategy, clock, epoch, status,
               slots, ev_keys, ev_vals, ev_scores):
    """kernels/hkv_ref.upsert_ref in place, outputs into the given (N,) / (N, D) arrays (status, slots,
    ev_*: zero- and -1-filled by the caller where not written)."""
    nb = sizes.shape[0]
    for i in range(keys.shape[0]):
        upsert_key(tkeys, tvals, tscores, sizes, _bucket(keys[i], nb), i, keys, given, vin, vout, mode,
                   strategy, clock, epoch, status, slots, ev_keys, ev_vals, ev_scores)


@pjit(**_JIT)
def find_keys(tkeys, tvals, tscores, sizes, keys, rows, found, scores):
    """rows (N, D), found (N,) bool, scores (N,) uint64 <- the keys' rows and scores (left as given when
    absent); the keys in parallel (reads of the table only, writes of key i's outputs only)."""
    nb = sizes.shape[0]
    bsz = tkeys.shape[0] // nb
    for i in prange(keys.shape[0]):
        lo = _bucket(keys[i], nb) * bsz
        for s in range(lo, lo + bsz):
            if tkeys[s] == keys[i]:
                for d in range(tvals.shape[1]):
                    rows[i, d] = tvals[s, d]
                found[i] = True
                scores[i] = tscores[s]
                break


@njit(**_JIT)
def match_slots(tkeys, tscores, pred, threshold, out):
    """out[:M] <- the occupied slots whose score is < threshold (pred SCORE_LT = 0) or >= threshold
    (SCORE_GE = 1), ascending; returns M. out (C,) int64."""
    m = 0
    for s in range(tkeys.shape[0]):
        if tkeys[s] != uint64(M.EMPTY_KEY):
            sc = tscores[s]
            if (sc < threshold) if pred == 0 else (sc >= threshold):
                out[m] = s
                m += 1
    return m


@njit(**_JIT)
def erase_slots(tkeys, tscores, sizes, slots):
    """Free the given occupied slots (M,) int64 (key EMPTY, score 0, their bucket's size - 1)."""
    bsz = tkeys.shape[0] // sizes.shape[0]
    for j in range(slots.shape[0]):
        s = slots[j]
        tkeys[s] = uint64(M.EMPTY_KEY)
        tscores[s] = uint64(0)
        sizes[s // bsz] -= 1


@njit(**_JIT)
def double_into(tkeys, tvals, tscores, nkeys, nvals, nscores, nsizes, moved):
    """Place every key of the old table (tkeys, tvals, tscores) into the empty new one of twice the buckets
    (nkeys, nvals, nscores, nsizes), in old slot order, each in the next slot of its new bucket;
    moved (C,) int64 <- the new slot of each old slot, -1 if free."""
    nb = nsizes.shape[0]
    bsz = nkeys.shape[0] // nb
    for s in range(tkeys.shape[0]):
        key = tkeys[s]
        if key == uint64(M.EMPTY_KEY):
            moved[s] = -1
            continue
        move_slot(tkeys, tvals, tscores, nkeys, nvals, nscores, nsizes, moved, s, _bucket(key, nb), bsz)


# ---- the ops over an Arrays table (the signatures of kernels/hkv_ref.py's) ---------------------------
def upsert_cpu(t: M.Arrays, keys, given, vin, vout, mode: int, strategy: int, clock: int, epoch: int):
    """kernels/hkv_ref.upsert_ref, compiled."""
    n = keys.shape[0]
    out = (np.zeros(n, np.int32), np.full(n, -1, np.int64), np.zeros(n, np.uint64),
           np.zeros((n, t.values.shape[1]), t.values.dtype), np.zeros(n, np.uint64))
    if n:
        upsert_batch(*t, keys, given, vin, vout, int(mode), int(strategy), np.uint64(clock), np.uint64(epoch), *out)
    return out


def find_cpu(t: M.Arrays, keys):
    """kernels/hkv_ref.find_ref, compiled."""
    n = keys.shape[0]
    out = (np.zeros((n, t.values.shape[1]), t.values.dtype), np.zeros(n, bool), np.zeros(n, np.uint64))
    if n:
        find_keys(*t, keys, *out)
    return out


def match_cpu(t: M.Arrays, pred: int, threshold: int):
    """kernels/hkv_ref.match_ref, compiled."""
    out = np.empty(t.keys.shape[0], np.int64)
    return out[:match_slots(t.keys, t.scores, int(pred), np.uint64(threshold), out)].copy()


def erase_cpu(t: M.Arrays, slots) -> None:
    """kernels/hkv_ref.erase_ref, compiled."""
    erase_slots(t.keys, t.scores, t.sizes, np.ascontiguousarray(slots, dtype=np.int64))


def double_cpu(t: M.Arrays):
    """kernels/hkv_ref.double_ref, compiled."""
    nb, bsz = t.sizes.shape[0], t.keys.shape[0] // t.sizes.shape[0]
    c = 2 * nb * bsz
    new = M.Arrays(np.full(c, np.uint64(M.EMPTY_KEY)), np.zeros((c, t.values.shape[1]), t.values.dtype),
                   np.zeros(c, np.uint64), np.zeros(2 * nb, np.int64))
    moved = np.empty(t.keys.shape[0], np.int64)
    double_into(t.keys, t.values, t.scores, *new, moved)
    return new, moved


#: CPU code only; the numba.cuda kernels of the table are in kernels/hkv.py
PTX_CHECKS = []
