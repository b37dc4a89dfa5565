"""The evicting hash table's numba.cuda kernels (gpu, sim): kernels/hkv_ref.py's results, bit for bit.

The contract (layout, scores, ties, batch order, growth) is kernels/hkv_ref.py's docstring. The reference
processes a batch's keys one after another; keys of different buckets never meet, so the only order that
matters is the order of the keys of one bucket. The design keeps exactly that order and nothing more:

    upsert   1. bucket_kernel     one thread per key: its bucket fmix64(key) % num_buckets, and
                                  count[bucket] += 1 (atomic add: a count does not depend on the order)
             2. exclusive scan    start (num_buckets + 1,) = where each bucket's keys begin (kernels/scan.py)
             3. place_kernel      one thread per key: order[start[b] + atomic ticket] = i; the positions of a
                                  bucket's keys are now together, in an order the atomics chose
             4. upsert_kernel     one thread per bucket: sorts its positions (insertion sort: a bucket gets
                                  about N / num_buckets keys of a batch) and then runs kernels/hkv_math.upsert_key
                                  for each in input order, the very code of the cpu path. The thread owns its
                                  bucket's B slots and its keys' output entries: no other thread writes them,
                                  so there is no lock, no CAS and no race to make results differ.
    find     one thread per key scans its bucket (reads only).
    match    flag each slot (occupied and the predicate), exclusive scan, compact: slots in ascending order.
    erase    one thread per slot to free; the bucket sizes drop by atomic adds (integers: any order).
    double   one thread per old bucket b: its keys go, in slot order, to new buckets b and b + num_buckets,
             which no other old bucket feeds (fmix64(k) % 2nb is k's old bucket or that + nb).

Cost: a bucket's keys are handled by one thread, so a batch is as slow as its busiest bucket, and each key
scans up to B slots serially. HierarchicalKV gives a bucket to a tile of threads that scan the slots together
(digests, then locks); a warp per bucket is the next step here, with the same order and the same results.
Only the upsert's scan and the match's count need host reads (the total of the scan: the match size).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, int64, uint64

from . import hkv_math as M
from .hash64 import fmix64
from .launch import count_host_read, launch_1d
from .scan import exclusive_scan, scan_partials_size

_device = functools.partial(cuda.jit, device=True, inline=True)    # inline: compiles without a GPU
upsert_key = _device(M.upsert_key)
move_slot = _device(M.move_slot)


@cuda.jit
def bucket_kernel(keys, nb, buckets, counts):
    """buckets[i] <- fmix64(keys[i]) % nb; counts[bucket] += 1."""
    for i in range(cuda.grid(1), keys.shape[0], cuda.gridsize(1)):
        b = int64(fmix64(keys[i]) % uint64(nb))
        buckets[i] = b
        cuda.atomic.add(counts, b, int64(1))


@cuda.jit
def place_kernel(buckets, start, fill, order):
    """order[start[b] + ticket] <- i for each key i of bucket b (fill (nb,) zeros: the tickets)."""
    for i in range(cuda.grid(1), buckets.shape[0], cuda.gridsize(1)):
        b = buckets[i]
        order[start[b] + cuda.atomic.add(fill, b, int64(1))] = i


@cuda.jit
def upsert_kernel(tkeys, tvals, tscores, sizes, order, start, keys, given, vin, vout, mode, strategy, clock,
                  epoch, status, slots, ev_keys, ev_vals, ev_scores):
    """One thread per bucket: its keys' positions order[start[b]:start[b + 1]] sorted, then each key
    upserted in input order (hkv_math.upsert_key)."""
    for b in range(cuda.grid(1), sizes.shape[0], cuda.gridsize(1)):
        lo = start[b]
        hi = start[b + 1]
        for j in range(lo + 1, hi):                     # insertion sort of the positions
            v = order[j]
            k = j - 1
            while k >= lo and order[k] > v:
                order[k + 1] = order[k]
                k -= 1
            order[k + 1] = v
        for j in range(lo, hi):
            upsert_key(tkeys, tvals, tscores, sizes, b, order[j], keys, given, vin, vout, mode, strategy, clock,
                       epoch, status, slots, ev_keys, ev_vals, ev_scores)


@cuda.jit
def find_kernel(tkeys, tvals, tscores, nb, keys, rows, found, scores):
    """rows[i], found[i], scores[i] <- keys[i]'s row and score (left as given when absent)."""
    bsz = tkeys.shape[0] // nb
    for i in range(cuda.grid(1), keys.shape[0], cuda.gridsize(1)):
        key = keys[i]
        lo = int64(fmix64(key) % uint64(nb)) * bsz
        for s in range(lo, lo + bsz):
            if tkeys[s] == key:
                for d in range(tvals.shape[1]):
                    rows[i, d] = tvals[s, d]
                found[i] = True
                scores[i] = tscores[s]
                break


@cuda.jit
def flag_kernel(tkeys, tscores, pred, threshold, flags):
    """flags[s] <- 1 for an occupied slot whose score is < threshold (pred 0) or >= threshold (pred 1)."""
    for s in range(cuda.grid(1), tkeys.shape[0], cuda.gridsize(1)):
        ok = int64(0)
        if tkeys[s] != uint64(0xFFFFFFFFFFFFFFFF):
            sc = tscores[s]
            if pred == 0:
                ok = int64(1) if sc < threshold else int64(0)
            else:
                ok = int64(1) if sc >= threshold else int64(0)
        flags[s] = ok


@cuda.jit
def compact_kernel(flags, pos, out):
    """out[pos[s]] <- s where flags[s] (pos: the exclusive scan of flags)."""
    for s in range(cuda.grid(1), flags.shape[0], cuda.gridsize(1)):
        if flags[s] != 0:
            out[pos[s]] = s


@cuda.jit
def erase_kernel(tkeys, tscores, sizes, slots):
    """Free slots[j]: key EMPTY, score 0, its bucket's size - 1."""
    bsz = tkeys.shape[0] // sizes.shape[0]
    for j in range(cuda.grid(1), slots.shape[0], cuda.gridsize(1)):
        s = slots[j]
        tkeys[s] = uint64(0xFFFFFFFFFFFFFFFF)
        tscores[s] = uint64(0)
        cuda.atomic.add(sizes, s // bsz, int64(-1))


@cuda.jit
def double_kernel(tkeys, tvals, tscores, nkeys, nvals, nscores, nsizes, moved):
    """One thread per old bucket: its keys, in slot order, to the next slot of their new bucket (of twice the
    buckets: the old one or that + old count); moved[s] <- the new slot (-1 for a free slot)."""
    nb = nsizes.shape[0]
    old_nb = nb // 2
    bsz = tkeys.shape[0] // old_nb
    for ob in range(cuda.grid(1), old_nb, cuda.gridsize(1)):
        for s in range(ob * bsz, (ob + 1) * bsz):
            key = tkeys[s]
            if key == uint64(0xFFFFFFFFFFFFFFFF):
                moved[s] = -1
                continue
            move_slot(tkeys, tvals, tscores, nkeys, nvals, nscores, nsizes, moved, s, int64(fmix64(key) % uint64(nb)),
                      bsz)


# ---- the ops over an Arrays table on xp (the signatures of kernels/hkv_ref.py's) ------------------------
def _xp(a):
    if hasattr(a, "__cuda_array_interface__") and not isinstance(a, np.ndarray):
        import cupy

        return cupy
    return np


def _scan(flags, xp):
    """The exclusive scan (n + 1,) int64 of flags (n,) int64 and its total (one host read)."""
    n = flags.shape[0]
    pos = xp.empty(n + 1, dtype=np.int64)
    exclusive_scan(flags, pos, partials=xp.empty(scan_partials_size(n), dtype=np.int64))
    count_host_read()
    return pos, int(pos[n])


def upsert(t: M.Arrays, keys, given, vin, vout, mode: int, strategy: int, clock: int, epoch: int):
    """kernels/hkv_ref.upsert_ref on the device (see the module docstring for the kernels)."""
    xp, n, nb = _xp(t.keys), keys.shape[0], t.sizes.shape[0]
    out = (xp.zeros(n, np.int32), xp.full(n, -1, np.int64), xp.zeros(n, np.uint64),
           xp.zeros((n, t.values.shape[1]), t.values.dtype), xp.zeros(n, np.uint64))
    if n == 0:
        return out
    buckets, counts = xp.empty(n, np.int64), xp.zeros(nb, np.int64)
    launch_1d(bucket_kernel, n, keys, nb, buckets, counts)
    start = xp.empty(nb + 1, np.int64)
    exclusive_scan(counts, start, partials=xp.empty(scan_partials_size(nb), dtype=np.int64))
    order = xp.empty(n, np.int64)
    launch_1d(place_kernel, n, buckets, start, xp.zeros(nb, np.int64), order)
    launch_1d(upsert_kernel, nb, *t, order, start, keys, given, vin, vout, int(mode), int(strategy),
              np.uint64(clock), np.uint64(epoch), *out)
    return out


def find(t: M.Arrays, keys):
    """kernels/hkv_ref.find_ref on the device."""
    xp, n = _xp(t.keys), keys.shape[0]
    out = (xp.zeros((n, t.values.shape[1]), t.values.dtype), xp.zeros(n, bool), xp.zeros(n, np.uint64))
    launch_1d(find_kernel, n, t.keys, t.values, t.scores, t.sizes.shape[0], keys, *out)
    return out


def match(t: M.Arrays, pred: int, threshold: int):
    """kernels/hkv_ref.match_ref on the device: (M,) int64 slots, ascending."""
    xp, c = _xp(t.keys), t.keys.shape[0]
    flags = xp.empty(c, np.int64)
    launch_1d(flag_kernel, c, t.keys, t.scores, int(pred), np.uint64(threshold), flags)
    pos, m = _scan(flags, xp)
    out = xp.empty(m, np.int64)
    if m:
        launch_1d(compact_kernel, c, flags, pos, out)
    return out


def erase(t: M.Arrays, slots) -> None:
    """kernels/hkv_ref.erase_ref on the device."""
    launch_1d(erase_kernel, slots.shape[0], t.keys, t.scores, t.sizes, slots)


def double(t: M.Arrays):
    """kernels/hkv_ref.double_ref on the device: (the new table, moved (C,) int64)."""
    xp, nb, c = _xp(t.keys), t.sizes.shape[0], t.keys.shape[0]
    new = M.Arrays(xp.full(2 * c, np.uint64(M.EMPTY_KEY), dtype=np.uint64),
                   xp.zeros((2 * c, t.values.shape[1]), t.values.dtype), xp.zeros(2 * c, np.uint64),
                   xp.zeros(2 * nb, np.int64))
    moved = xp.empty(c, np.int64)
    launch_1d(double_kernel, nb, *t[:3], *new, moved)
    return new, moved


_T = "uint64[::1], float32[:, ::1], uint64[::1], int64[::1]"        # a float32 table's Arrays
PTX_CHECKS = [
    (bucket_kernel, "void(uint64[::1], int64, int64[::1], int64[::1])"),
    (place_kernel, "void(int64[::1], int64[::1], int64[::1], int64[::1])"),
    (upsert_kernel, f"void({_T}, int64[::1], int64[::1], uint64[::1], uint64[::1], float32[:, ::1], "
                    "float32[:, ::1], int64, int64, uint64, uint64, int32[::1], int64[::1], uint64[::1], "
                    "float32[:, ::1], uint64[::1])"),
    (find_kernel, "void(uint64[::1], float32[:, ::1], uint64[::1], int64, uint64[::1], float32[:, ::1], "
                  "boolean[::1], uint64[::1])"),
    (flag_kernel, "void(uint64[::1], uint64[::1], int64, uint64, int64[::1])"),
    (compact_kernel, "void(int64[::1], int64[::1], int64[::1])"),
    (erase_kernel, "void(uint64[::1], uint64[::1], int64[::1], int64[::1])"),
    (double_kernel, f"void(uint64[::1], float32[:, ::1], uint64[::1], {_T}, int64[::1])"),
]
