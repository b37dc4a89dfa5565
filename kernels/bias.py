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

from .launch import SIMULATED, _sm_count, launch, launch_1d
from .parallel_cpu import PARALLEL_MIN, ROW_CHUNK, pjit, sum_partials


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


#: the column sums' block: TILE_C consecutive columns (threadIdx.x: coalesced reads of each row) by TILE_R
#: threads down the rows; a block covers CHUNK rows and writes one partial sum per column, and
#: partials_sum_kernel adds the chunks up in order (deterministic at any grid, no atomics). The fused
#: bias+activation backward (kernels/fused_bias_act.py) is the same pass with the ReLU mask and d written.
TILE_C = 4 if SIMULATED else 32
TILE_R = 2 if SIMULATED else 8
CHUNK = 4 if SIMULATED else 256


@cuda.jit
def column_partials_kernel(y, dy, relu, d, write_d, partials, want_sums, chunk):
    """g = dy masked by y > 0 (relu; else dy itself); d = g (write_d); partials[k, c] = the sum of g[m, c]
    over chunk k's rows (want_sums): in row order per thread, then in thread order."""
    part = cuda.shared.array((TILE_R, TILE_C), float32)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    rows = dy.shape[0]
    cols = dy.shape[1]
    n_chunks = (rows + chunk - 1) // chunk
    for k in range(cuda.blockIdx.y, n_chunks, cuda.gridDim.y):                  # uniform per block
        lo = k * chunk
        hi = min(rows, lo + chunk)
        for c0 in range(cuda.blockIdx.x * TILE_C, cols, cuda.gridDim.x * TILE_C):
            c = c0 + tx
            acc = float32(0.0)
            if c < cols:
                for m in range(lo + ty, hi, TILE_R):
                    g = float32(dy[m, c])
                    if relu != 0 and not (float32(y[m, c]) > float32(0.0)):
                        g = float32(0.0)
                    if write_d != 0:
                        d[m, c] = g
                    acc += g
            part[ty, tx] = acc
            cuda.syncthreads()
            if ty == 0 and c < cols and want_sums != 0:
                total = float32(0.0)
                for r in range(TILE_R):
                    total += part[r, tx]
                partials[k, c] = total
            cuda.syncthreads()          # part is read before the next tile overwrites it


@cuda.jit
def partials_sum_kernel(partials, db):
    """db[c] = sum over chunks k (in order) of partials[k, c]; consecutive threads take consecutive columns."""
    for c in range(cuda.grid(1), db.shape[0], cuda.gridsize(1)):
        total = float32(0.0)
        for k in range(partials.shape[0]):
            total += partials[k, c]
        db[c] = total


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def bias_add(y, b, threads: int | None = None) -> None:
    """In place: y (M, N) += b (N,). y may have any leading shape whose last dim is N."""
    if y.shape[-1] != b.size:
        raise ValueError(f"bias_add: y {y.shape} does not end in the bias width {b.size}")
    if b.size == 0:
        return
    launch_1d(bias_add_kernel, y.size, y.reshape(-1), b.reshape(-1), threads=threads)


def masked_column_sums(y, dy, relu: bool, d, db, chunk: int | None = None, grid=None) -> None:
    """The tiled pass behind bias_grad and the fused bias+activation backward: g = dy (M, N) masked by
    y > 0 when relu; d <- g when d is given; db (N,) <- the column sums of g when db is given. One launch,
    plus one adding the chunks' partial sums when M > chunk; `chunk` and `grid` (blocks over column tiles,
    over row chunks) for tests: any grid gives the same bits."""
    rows, n = dy.shape
    if n == 0 or (d is None and db is None):
        return
    if rows == 0:
        if db is not None:
            db[...] = 0
        return
    chunk = chunk or CHUNK
    n_chunks = -(-rows // chunk)
    if db is None:
        partials = _placeholder2d(0)
    elif n_chunks == 1:                 # one chunk: its partial sums are the column sums (one launch)
        partials = db.reshape(1, n)
    else:
        partials = _scratch_like(dy, (n_chunks, n))
    launch(column_partials_kernel, grid or _tile_grid(rows, n, chunk), (TILE_C, TILE_R),
           y, dy, np.int32(bool(relu)), _placeholder2d(1) if d is None else d, np.int32(d is not None), partials,
        np.int32(db is not None), np.int64(chunk))
    if db is not None and n_chunks > 1:
        launch_1d(partials_sum_kernel, n, partials, db.reshape(-1))


def bias_grad(dy, db, chunk: int | None = None, grid=None) -> None:
    """db (N,) = column sums of dy (M, N) (any leading shape, last dim N); overwrites db (see
    masked_column_sums: coalesced tiles, the chunks' partial sums added in order)."""
    n = db.size
    if dy.shape[-1] != n:
        raise ValueError(f"bias_grad: dy {dy.shape} does not end in the bias width {n}")
    if n == 0:
        return
    dy2 = dy.reshape(-1, n)
    masked_column_sums(dy2, dy2, False, None, db, chunk, grid)


def _tile_grid(rows: int, cols: int, chunk: int) -> tuple[int, int]:
    """(blocks over column tiles, blocks over row chunks) for column_partials_kernel."""
    n_chunks = -(-rows // chunk)
    cap = 2 if SIMULATED else 32 * _sm_count()
    gx = max(1, min(-(-cols // TILE_C), cap))
    return gx, max(1, min(n_chunks, cap // gx))


def _scratch_like(a, shape):
    """A float32 scratch array of the array library of `a` (CuPy's pool on a GPU, NumPy in the simulator)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy.empty(shape, np.float32)
    return np.empty(shape, np.float32)


@functools.lru_cache(maxsize=None)
def _placeholder2d(which: int):
    """(1, 1) device arrays standing in for an absent d (1) or partials (0): never written; two distinct ones,
    since the simulator copies every argument back after a launch."""
    return cuda.device_array((1, 1), np.float32)


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


@pjit(cache=True)
def _bias_add_cpu(y, b):
    chunks = (y.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    if y.size < PARALLEL_MIN:
        for c in range(chunks):
            _add_rows(y, b, c)
    else:
        for c in prange(chunks):
            _add_rows(y, b, c)


@pjit(cache=True)
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
    (column_partials_kernel,
     "void(float32[:, ::1], float32[:, ::1], int32, float32[:, ::1], int32, float32[:, ::1], int32, int64)"),
    (partials_sum_kernel, "void(float32[:, ::1], float32[::1])"),
    (bias_add_kernel, "void(float16[::1], float32[::1])"),                 # mixed precision on gpu/sim
    (column_partials_kernel,                   # mixed precision: float16 activations and gradients
     "void(float16[:, ::1], float16[:, ::1], int32, float16[:, ::1], int32, float32[:, ::1], int32, int64)"),
]
