"""Prefix scans of int64 arrays over many blocks: exclusive sum, inclusive maximum.

    exclusive sum:  out[0] = 0,  out[i + 1] = out[i] + x[i]          # x (N,) -> out (N + 1,), out[N] = sum(x)
    inclusive max:  out[i] = max(x[0], ..., x[i])                      # x (N,) -> out (N,), in place allowed
The sum turns per-bag counts into CSR offsets and 0/1 flags into output positions (the hash table's new
keys, the embedding engine's row segments); the maximum repairs CSR offsets (FBGEMM's bounds check).

Three launches, G blocks each working on its own contiguous chunk of x (reduce, then scan, then scan):
    1. block b reduces its chunk:                        totals[b] = op(x[chunk b])
    2. one block scans the G totals:                     pre[b] = op(totals[0..b-1]) (pre[0] = identity)
    3. block b scans its chunk again, starting from pre[b], and writes out.
Inside a block, tpb threads walk the chunk in tiles of 2*tpb elements: each thread combines its pair of
neighbouring elements, the block scans the tpb pair values in shared memory (Hillis-Steele, ping-pong
between the two halves of one shared buffer so each step needs a single barrier) and a running carry
moves from tile to tile (every thread reads the tile total from shared memory, so all agree on it). With
no scratch for the G totals (``partials=None``) the wrappers run phase 3 alone in one block.

HugeCTR: stands in for the cub::DeviceScan calls in HugeCTR/src/embeddings/ (CSR row offsets, positions
of newly inserted keys); CUB's single-pass decoupled look-back needs inter-block spinning that Numba's
simulator (blocks run one after another) cannot exercise, so this is the reduce-then-scan variant.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, int64

from .launch import REDUCE_THREADS, SIMULATED, _sm_count, check_block_size, launch

SUM = 0
MAX = 1
_INT64_MIN = -(2 ** 63)
_IDENTITY = {SUM: 0, MAX: _INT64_MIN}


# ---- NumPy references ------------------------------------------------------------------------
def exclusive_scan_ref(x: np.ndarray) -> np.ndarray:
    """(N,) int -> (N + 1,) int64 with out[0] = 0 and out[N] = sum(x)."""
    x = np.asarray(x, dtype=np.int64).reshape(-1)
    out = np.zeros(x.shape[0] + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def inclusive_max_ref(x: np.ndarray) -> np.ndarray:
    """(N,) int -> (N,) int64 running maximum."""
    return np.maximum.accumulate(np.asarray(x, dtype=np.int64).reshape(-1))


# ---- kernels (factories close over tpb, the operator and the phase) ---------------------------
@cuda.jit(device=True, inline=True)
def _add(a, b):
    return a + b


@cuda.jit(device=True, inline=True)
def _max(a, b):
    return a if a > b else b


@functools.lru_cache(maxsize=None)
def make_scan_kernel(tpb: int, op: int, reduce_only: bool):
    """A kernel ``k[G, tpb](x, out, carries, chunk, shift)`` over chunks of `chunk` elements, block b on
    x[b*chunk : (b+1)*chunk]. reduce_only: out[b] <- op of the chunk. Otherwise out[i + shift] <- the
    inclusive scan of x up to i, started from carries[b] (the identity when carries is empty), and for
    shift = 1 block 0 also writes out[0] = identity (an exclusive scan)."""
    check_block_size(tpb)
    if op not in _IDENTITY:
        raise ValueError(f"scan op must be SUM or MAX, got {op!r}")
    tile = 2 * tpb
    combine = _add if op == SUM else _max
    identity = _IDENTITY[op]

    @cuda.jit
    def scan_kernel(x, out, carries, chunk, shift):
        # buf[0:tpb] and buf[tpb:2*tpb] are the ping-pong halves of the Hillis-Steele scan
        buf = cuda.shared.array(tile, int64)
        b = cuda.blockIdx.x
        t = cuda.threadIdx.x
        n = x.shape[0]
        lo = b * chunk
        hi = min(n, lo + chunk)
        carry = int64(identity)
        if not reduce_only:
            if carries.shape[0] > 0:
                carry = carries[b]
            if shift == 1 and b == 0 and t == 0:
                out[0] = int64(identity)
        base = lo
        while base < hi:                              # the same trip count in every thread of the block
            i0 = base + 2 * t                         # this thread owns elements i0 and i0 + 1
            a = int64(identity)
            c = int64(identity)
            if i0 < hi:
                a = x[i0]
            if i0 + 1 < hi:
                c = x[i0 + 1]
            buf[t] = combine(a, c)
            cuda.syncthreads()
            src = 0
            step = 1
            while step < tpb:
                v = buf[src + t]
                if t >= step:
                    v = combine(buf[src + t - step], v)
                buf[tpb - src + t] = v                # write the other half: no read/write race in a step
                src = tpb - src
                step *= 2
                cuda.syncthreads()
            before = carry                            # the scan of everything before element i0
            if t > 0:
                before = combine(carry, buf[src + t - 1])
            if not reduce_only:
                if i0 < hi:
                    out[i0 + shift] = combine(before, a)
                if i0 + 1 < hi:
                    out[i0 + 1 + shift] = combine(combine(before, a), c)
            carry = combine(carry, buf[src + tpb - 1])
            base += tile
            cuda.syncthreads()                        # everyone has read buf before the next tile
        if reduce_only and t == 0:
            out[b] = carry

    return scan_kernel


# ---- launch wrappers (allocate nothing) -------------------------------------------------------
def scan_partials_size(n: int, threads: int | None = None) -> int:
    """Length of the int64 `partials` scratch a multi-block scan of n elements uses (2 G + 1)."""
    return 2 * _blocks(n, threads or REDUCE_THREADS)[0] + 1


def _blocks(n: int, tpb: int) -> tuple[int, int]:
    """(G blocks, chunk) for n elements: chunks a whole number of tiles, at most a few blocks per SM."""
    tile = 2 * tpb
    if n == 0:
        return 1, tile
    cap = 2 if SIMULATED else 4 * _sm_count()
    g = max(1, min(cap, math.ceil(n / tile)))
    chunk = math.ceil(math.ceil(n / g) / tile) * tile
    return math.ceil(n / chunk), chunk


def _scan(x, out, partials, op: int, shift: int, threads: int | None) -> None:
    n = x.shape[0]
    tpb = threads or REDUCE_THREADS
    empty = x[:0]
    if partials is None:                              # one block: phase 3 only
        launch(make_scan_kernel(tpb, op, False), 1, tpb, x, out, empty, max(n, 1), shift)
        return
    g, chunk = _blocks(n, tpb)
    if partials.shape[0] < 2 * g + 1 or partials.dtype != np.int64:
        raise ValueError(f"scan: partials must be int64 with at least {2 * g + 1} entries "
                         f"(scan_partials_size), got {partials.dtype} {partials.shape}")
    totals, pre = partials[:g], partials[g:2 * g + 1]
    launch(make_scan_kernel(tpb, op, True), g, tpb, x, totals, empty, chunk, 0)
    launch(make_scan_kernel(tpb, op, False), 1, tpb, totals, pre, empty, g, 1)       # pre[b]: the blocks before b
    launch(make_scan_kernel(tpb, op, False), g, tpb, x, out, pre, chunk, shift)


def _check(x, out, want: int, what: str) -> None:
    if out.shape[0] != want:
        raise ValueError(f"scan: out must have {what} = {want} elements, got {out.shape[0]}")
    if x.dtype != np.int64 or out.dtype != np.int64:
        raise TypeError(f"scan: expected int64 arrays, got {x.dtype} and {out.dtype}")


def exclusive_scan(x, out, *, threads: int | None = None, partials=None) -> None:
    """out (N + 1,) int64 <- exclusive sum of x (N,) int64. With `partials` (scan_partials_size(N) int64
    scratch) over many blocks, else in one block. N == 0 just sets out[0] = 0."""
    _check(x, out, x.shape[0] + 1, "n + 1")
    _scan(x, out, partials, SUM, 1, threads)


def inclusive_max_scan(x, out, partials, *, threads: int | None = None) -> None:
    """out (N,) int64 <- running maximum of x (N,) int64 (out may be x), over many blocks."""
    _check(x, out, x.shape[0], "n")
    if x.shape[0]:
        _scan(x, out, partials, MAX, 0, threads)


_SCAN_SIG = "void(int64[::1], int64[::1], int64[::1], int64, int64)"
PTX_CHECKS = [(make_scan_kernel(256, op, reduce_only), _SCAN_SIG) for op in (SUM, MAX) for reduce_only in (True, False)]
