"""Bias of InnerProduct (the matmul itself is done by the caller with the array library).

    forward:  y[m, n] += b[n]                 # y (M, N) in place, b (N,)
    backward: db[n] = sum_m dy[m, n]          # dy (M, N) -> db (N,), overwritten

A 3-D InnerProduct (B, S, N) is the same on the flattened (B*S, N) view. M may be 0 (db = 0).

HugeCTR: HugeCTR/src/layers/fully_connected_layer.cu (bias added after the cuBLAS GEMM). HugeCTR adds
db onto the regularizer's initial wgrad; here db is overwritten and the caller adds any other term.

Compiled CPU versions (numba.njit, the cpu device's path), over fixed chunks of rows (kernels/parallel_cpu.py):
the add; the column sums as one partial row per chunk (a (chunks, N) scratch), added in chunk order, so
the thread count never changes a result.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, njit, prange

from .launch import check_block_size, launch_1d, launch_rows, REDUCE_THREADS
from .parallel_cpu import PARALLEL_MIN, ROW_CHUNK, sum_partials
from .block import block_sum


# ---- NumPy reference -------------------------------------------------------------------------
def bias_add_ref(y: np.ndarray, b: np.ndarray) -> np.ndarray:
    """y + b broadcast over rows: (M, N) + (N,) -> (M, N)."""
    return y + b.reshape(-1)


def bias_grad_ref(dy: np.ndarray) -> np.ndarray:
    """Column sums of dY: (M, N) -> (N,)."""
    return dy.reshape(-1, dy.shape[-1]).sum(axis=0)


# ---- kernels ---------------------------------------------------------------------------------
@cuda.jit
def bias_add_kernel(y, b):
    # y: flat (M*N,) view, b: (N,); element i sits in column i % N (row-major).
    n = b.shape[0]
    for i in range(cuda.grid(1), y.shape[0], cuda.gridsize(1)):
        y[i] = float32(y[i]) + b[i % n]          # a float16 y (mixed precision): added in float32


@functools.lru_cache(maxsize=None)
def make_bias_grad_kernel(tpb: int):
    """Column-sum kernel for blocks of exactly ``tpb`` threads (a power of two, <= 1024).

    Blocks grid-stride over columns; the threads of a block stride over the rows of that column and
    then reduce their partial sums in shared memory. Any grid size and any M (including 0) work.
    """
    check_block_size(tpb)

    @cuda.jit
    def bias_grad_kernel(dy, db):
        # dy: (M, N), db: (N,)
        partial = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        rows = dy.shape[0]
        # The column loop depends only on blockIdx, so every thread of a block runs the same number
        # of iterations and reaches every syncthreads below.
        for col in range(cuda.blockIdx.x, dy.shape[1], cuda.gridDim.x):
            acc = float32(0.0)
            for m in range(t, rows, tpb):
                acc += float32(dy[m, col])
            partial[t] = acc
            block_sum(partial, t, tpb)
            if t == 0:
                db[col] = partial[0]
            # thread 0 must read partial[0] before anyone overwrites it for the next column
            cuda.syncthreads()

    return bias_grad_kernel


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def bias_add(y, b, threads: int | None = None) -> None:
    """In place: y (M, N) += b (N,). y may have any leading shape whose last dim is N."""
    if y.shape[-1] != b.size:
        raise ValueError(f"bias_add: y {y.shape} does not end in the bias width {b.size}")
    if b.size == 0:
        return
    launch_1d(bias_add_kernel, y.size, y.reshape(-1), b.reshape(-1), threads=threads)


def bias_grad(dy, db, threads: int | None = None) -> None:
    """db (N,) = column sums of dy (M, N) (any leading shape, last dim N); overwrites db."""
    n = db.size
    if dy.shape[-1] != n:
        raise ValueError(f"bias_grad: dy {dy.shape} does not end in the bias width {n}")
    if n == 0:
        return
    tpb = threads or REDUCE_THREADS
    launch_rows(make_bias_grad_kernel(tpb), n, dy.reshape(-1, n), db.reshape(-1), threads=tpb)


# ---- compiled CPU versions (numba.njit; the cpu device; work split by parallel_cpu) ----------------
@njit(cache=True, inline="always")
def _add_rows(y, b, c):
    for m in range(c * ROW_CHUNK, min(y.shape[0], (c + 1) * ROW_CHUNK)):
        row = y[m]
        for k in range(row.shape[0]):
            row[k] += b[k]


@njit(cache=True, inline="always")
def _sum_rows(dy, p, c):
    for m in range(c * ROW_CHUNK, min(dy.shape[0], (c + 1) * ROW_CHUNK)):
        row = dy[m]
        for k in range(row.shape[0]):
            p[k] += row[k]


@njit(cache=True, parallel=True)
def _bias_add_cpu(y, b):
    chunks = (y.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    if y.size < PARALLEL_MIN:
        for c in range(chunks):
            _add_rows(y, b, c)
    else:
        for c in prange(chunks):
            _add_rows(y, b, c)


@njit(cache=True, parallel=True)
def _bias_grad_cpu(dy, db):
    part = np.zeros(((dy.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK, dy.shape[1]), np.float32)     # (chunks, N)
    if dy.size < PARALLEL_MIN:
        for c in range(part.shape[0]):
            _sum_rows(dy, part[c], c)
    else:
        for c in prange(part.shape[0]):
            _sum_rows(dy, part[c], c)
    sum_partials(part, db)


def bias_add_cpu(y, b) -> None:
    """bias_add compiled for the CPU: in place y (..., N) += b (N,); contiguous float32."""
    if y.shape[-1] != b.size:
        raise ValueError(f"bias_add: y {y.shape} does not end in the bias width {b.size}")
    if b.size == 0:
        return
    _bias_add_cpu(y.reshape(-1, b.size), b.reshape(-1))


def bias_grad_cpu(dy, db) -> None:
    """bias_grad compiled for the CPU: db (N,) = column sums of dy (..., N); overwrites db."""
    n = db.size
    if dy.shape[-1] != n:
        raise ValueError(f"bias_grad: dy {dy.shape} does not end in the bias width {n}")
    if n == 0:
        return
    _bias_grad_cpu(dy.reshape(-1, n), db.reshape(-1))


PTX_CHECKS = [
    (bias_add_kernel, "void(float32[::1], float32[::1])"),
    (make_bias_grad_kernel(256), "void(float32[:, ::1], float32[::1])"),
    (bias_add_kernel, "void(float16[::1], float32[::1])"),                 # mixed precision on gpu/sim
    (make_bias_grad_kernel(256), "void(float16[:, ::1], float32[::1])"),
]
