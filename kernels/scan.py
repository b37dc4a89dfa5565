"""Exclusive prefix sum (scan) of int64 counts.

    out[0] = 0,  out[i + 1] = out[i] + x[i]           # x (N,) int64 -> out (N + 1,) int64
    so out[N] = sum(x); turns per-bag nnz counts into CSR offsets, or 0/1 flags into output positions.

One block of tpb threads walks the array in tiles of 2*tpb elements: each thread adds its pair of
neighbouring elements, the block scans the tpb pair sums in shared memory (Hillis-Steele, ping-pong
between the two halves of one shared buffer so each step needs a single barrier), and a running total
carries from tile to tile. The carry lives in a register of every thread: all threads read the tile
total from shared memory, so they all agree on it without another shared slot.

HugeCTR: stands in for the cub::DeviceScan::ExclusiveSum calls in HugeCTR/src/embeddings/ (CSR row
offsets of the sparse input, positions of newly inserted keys); a single-block numba.cuda scan.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, int64

from .launch import check_block_size, REDUCE_THREADS


# ---- NumPy reference -------------------------------------------------------------------------
def exclusive_scan_ref(x: np.ndarray) -> np.ndarray:
    """(N,) int -> (N + 1,) int64 with out[0] = 0 and out[N] = sum(x)."""
    x = np.asarray(x, dtype=np.int64).reshape(-1)
    out = np.zeros(x.shape[0] + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


# ---- kernel factory (closes over tpb, a power of two <= 1024) --------------------------------
@functools.lru_cache(maxsize=None)
def make_exclusive_scan_kernel(tpb: int):
    """A kernel ``k[blocks, tpb](x, out)`` scanning x (N,) into out (N + 1,). Only block 0 works,
    so any grid is correct; the block must have exactly tpb threads."""
    check_block_size(tpb)
    tile = 2 * tpb

    @cuda.jit
    def exclusive_scan_kernel(x, out):
        # buf[0:tpb] and buf[tpb:2*tpb] are the ping-pong halves of the Hillis-Steele scan
        buf = cuda.shared.array(tile, int64)
        if cuda.blockIdx.x != 0:          # the whole of any extra block leaves: no barrier is split
            return
        t = cuda.threadIdx.x
        n = x.shape[0]
        if t == 0:
            out[0] = int64(0)
        carry = int64(0)                  # sum of all earlier tiles, identical in every thread
        base = 0
        while base < n:
            i0 = base + 2 * t             # this thread owns elements i0 and i0 + 1 of the tile
            a = int64(0)
            b = int64(0)
            if i0 < n:
                a = x[i0]
            if i0 + 1 < n:
                b = x[i0 + 1]
            pair = a + b
            buf[t] = pair
            cuda.syncthreads()
            src = 0                       # half holding the current partial sums
            step = 1
            while step < tpb:
                v = buf[src + t]
                if t >= step:
                    v += buf[src + t - step]
                buf[tpb - src + t] = v    # write the other half: no read/write race in a step
                src = tpb - src
                step *= 2
                cuda.syncthreads()
            incl = buf[src + t]           # inclusive scan of the pair sums up to this thread
            total = buf[src + tpb - 1]
            before = carry + incl - pair  # exclusive prefix at element i0
            if i0 < n:
                out[i0 + 1] = before + a
            if i0 + 1 < n:
                out[i0 + 2] = before + a + b
            carry += total
            base += tile
            cuda.syncthreads()            # everyone has read buf before the next tile overwrites it

    return exclusive_scan_kernel


# ---- launch wrapper (allocates nothing) -------------------------------------------------------
def exclusive_scan(x, out, *, threads: int | None = None) -> None:
    """out (N + 1,) int64 <- exclusive scan of x (N,) int64; N == 0 just sets out[0] = 0."""
    n = x.shape[0]
    if out.shape[0] != n + 1:
        raise ValueError(f"exclusive_scan: out must have n + 1 = {n + 1} elements, got {out.shape[0]}")
    if x.dtype != np.int64 or out.dtype != np.int64:
        raise TypeError(f"exclusive_scan: expected int64 arrays, got {x.dtype} and {out.dtype}")
    if n == 0:
        out[0] = 0
        return
    tpb = threads or REDUCE_THREADS
    make_exclusive_scan_kernel(tpb)[1, tpb](x, out)


PTX_CHECKS = [
    (make_exclusive_scan_kernel(256), "void(int64[::1], int64[::1])"),
]
