"""Softmax over the last dim, plain or masked (attention scores).

Plain, x viewed as rows (R, N):

    m = max_j x[r, j]  (or 0 when subtract_max is off)
    y[r, j] = exp(x[r, j] - m) / (sum_j' exp(x[r, j'] - m) + eps)
    dx[r, j] = factor * y[r, j] * (dy[r, j] - sum_j' dy[r, j'] * y[r, j'])

Subtracting the row max gives the same y and keeps exp from overflowing; HugeCTR's plain Softmax
skips it (exp(x) overflows to inf for x > ~88, giving NaN). eps = 0, factor = 1 for plain softmax.

Masked (x (B, H, Lf, Lt), mask (B, 1, Lf, Lt) or (B, 1, 1, Lt) broadcast over the rows):

    z = x * factor - (1 - mask) * 10000          # masked_logits (one kernel computes z where it reads it)
    y = softmax of z with the max subtracted and eps = 1e-6
    dx = factor * y * (dy - sum dy*y)            # exact for the eps'd softmax too: y_j = e_j/(S+eps)

The row kernels run one block per row (grid-stride over rows) and reduce max and sums in shared
memory; every thread of a block walks the same rows, so all reach every syncthreads. They are
correct for any row length and any block size 1..1024. ``y`` may be ``x`` (in place): each thread
overwrites only elements it alone read. (The simulator copies aliased arguments separately and writes
them back in argument order, so ``y`` must stay after ``x`` in the kernel signature.)

Compiled CPU versions (numba.njit, the cpu device's path), over fixed chunks of rows (kernels/parallel_cpu.py).
The forward is three passes: a compiled one writes z - max(z) per row into y (z the logits, masked or not),
numpy's exp runs in place on y, a compiled one divides each row by its sum (+ eps). Why not exp in the
compiled loop: numba's exp is libm's scalar expf, 4x slower than numpy's SIMD exp (102,400 elements, one
thread: 0.38 ms against 0.09 ms); the row max and sums are where numpy is slow (a reduction over rows of
10 costs it ~10x the compiled loop). The backward is one compiled pass. Row sums may be reassociated
(fastmath reassoc: LLVM vectorizes them); every row is one chunk's, so 1 or N threads give the same bits.

HugeCTR: HugeCTR/src/layers/softmax_layer.cu and masked_softmax_layer.cu.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, njit, prange

from .block_reduce import block_max, block_sum
from .launch import MAX_THREADS_PER_BLOCK, REDUCE_THREADS, launch_rows
from .parallel_cpu import PARALLEL_MIN, ROW_CHUNK, pjit

MASK_PENALTY = 10000.0      # subtracted from masked-out logits
MASKED_EPS = 1e-6           # added to the masked softmax's denominator


# ---- NumPy reference -------------------------------------------------------------------------
def softmax_forward_ref(x: np.ndarray, subtract_max: bool = True, eps: float = 0.0) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True) if subtract_max else np.zeros_like(x[..., :1])
    e = np.exp(x - m)
    return e / (e.sum(axis=-1, keepdims=True) + x.dtype.type(eps))


def softmax_backward_ref(y: np.ndarray, dy: np.ndarray, factor: float = 1.0) -> np.ndarray:
    return y.dtype.type(factor) * y * (dy - (dy * y).sum(axis=-1, keepdims=True))


def masked_logits_ref(x: np.ndarray, mask: np.ndarray, factor: float) -> np.ndarray:
    """z = x*factor - (1-mask)*10000; mask (B, 1, Lf|1, Lt) broadcasts over heads (and rows)."""
    t = x.dtype.type
    return x * t(factor) - (t(1) - mask) * t(MASK_PENALTY)


def masked_softmax_forward_ref(x: np.ndarray, mask: np.ndarray, factor: float) -> np.ndarray:
    return softmax_forward_ref(masked_logits_ref(x, mask, factor), True, MASKED_EPS)


# ---- kernels ---------------------------------------------------------------------------------

def _check_tpb(tpb: int) -> None:
    if not 1 <= tpb <= MAX_THREADS_PER_BLOCK:
        raise ValueError(f"tpb must be in 1..{MAX_THREADS_PER_BLOCK}, got {tpb}")


@functools.lru_cache(maxsize=None)
def make_softmax_forward_kernel(tpb: int):
    """Row softmax for blocks of exactly ``tpb`` threads; x, y (R, N) with N >= 1."""
    _check_tpb(tpb)

    @cuda.jit
    def softmax_forward_kernel(x, y, subtract_max, eps):
        buf = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        n = x.shape[1]
        for r in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
            shift = float32(0.0)
            if subtract_max != 0:                       # uniform across the block
                m = float32(-math.inf)
                for j in range(t, n, tpb):
                    m = max(m, float32(x[r, j]))        # (float16 tensors are read in float32)
                buf[t] = m
                block_max(buf, t, tpb)
                shift = buf[0]
                cuda.syncthreads()                      # all read buf[0] before it is reused
            acc = float32(0.0)
            for j in range(t, n, tpb):
                acc += math.exp(float32(x[r, j]) - shift)
            buf[t] = acc
            block_sum(buf, t, tpb)
            inv = float32(1.0) / (buf[0] + eps)
            cuda.syncthreads()                          # all read buf[0] before the next row
            for j in range(t, n, tpb):
                y[r, j] = math.exp(float32(x[r, j]) - shift) * inv

    return softmax_forward_kernel


@functools.lru_cache(maxsize=None)
def make_softmax_backward_kernel(tpb: int):
    """dx = factor * y * (dy - rowsum(dy*y)) for blocks of exactly ``tpb`` threads; (R, N) arrays."""
    _check_tpb(tpb)

    @cuda.jit
    def softmax_backward_kernel(y, dy, dx, factor):
        buf = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        n = y.shape[1]
        for r in range(cuda.blockIdx.x, y.shape[0], cuda.gridDim.x):
            acc = float32(0.0)
            for j in range(t, n, tpb):
                acc += float32(dy[r, j]) * float32(y[r, j])
            buf[t] = acc
            block_sum(buf, t, tpb)
            dot = buf[0]
            cuda.syncthreads()                          # all read buf[0] before the next row
            for j in range(t, n, tpb):
                dx[r, j] = factor * float32(y[r, j]) * (float32(dy[r, j]) - dot)

    return softmax_backward_kernel


@functools.lru_cache(maxsize=None)
def make_masked_softmax_kernel(tpb: int):
    """The masked softmax in one pass over each row, for blocks of exactly ``tpb`` threads: the logits
    z = x*factor - (1-mask)*10000 are computed in float32 where each of the three row walks (max, sum,
    write) reads them, never stored (a float16 x is rounded only in y)."""
    _check_tpb(tpb)

    @cuda.jit
    def masked_softmax_kernel(x, mask, y, factor, lf, rows_per_batch):
        # x, y (R, Lt) with R = B*H*Lf, row r = (b*H + h)*Lf + i; mask (B*M, Lt) with M = Lf or 1
        buf = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        n = x.shape[1]
        m_rows = mask.shape[0] // (x.shape[0] // rows_per_batch)      # M
        penalty = float32(MASK_PENALTY)
        one = float32(1.0)
        for r in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):  # uniform per block
            mr = (r // rows_per_batch) * m_rows + (r % lf) % m_rows
            m = float32(-math.inf)
            for j in range(t, n, tpb):
                m = max(m, float32(x[r, j]) * factor - (one - float32(mask[mr, j])) * penalty)
            buf[t] = m
            block_max(buf, t, tpb)
            shift = buf[0]
            cuda.syncthreads()                          # all read buf[0] before it is reused
            acc = float32(0.0)
            for j in range(t, n, tpb):
                acc += math.exp(float32(x[r, j]) * factor - (one - float32(mask[mr, j])) * penalty - shift)
            buf[t] = acc
            block_sum(buf, t, tpb)
            inv = one / (buf[0] + float32(MASKED_EPS))
            cuda.syncthreads()                          # all read buf[0] before the next row
            for j in range(t, n, tpb):
                y[r, j] = math.exp(float32(x[r, j]) * factor - (one - float32(mask[mr, j])) * penalty - shift) * inv

    return masked_softmax_kernel


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def _rows(a):
    return a.reshape(-1, a.shape[-1])


def softmax_forward(x, y, subtract_max: bool = True, eps: float = 0.0, threads: int | None = None) -> None:
    """y = softmax of x over the last dim (y may be x); overwrites y."""
    if x.size == 0:
        return
    tpb = threads or REDUCE_THREADS
    x2 = _rows(x)
    launch_rows(make_softmax_forward_kernel(tpb), x2.shape[0], x2, _rows(y), int(subtract_max),
                np.float32(eps), threads=tpb)


def softmax_backward(y, dy, dx, factor: float = 1.0, threads: int | None = None) -> None:
    """dx = factor * y * (dy - sum(dy*y)) over the last dim; overwrites dx."""
    if y.size == 0:
        return
    tpb = threads or REDUCE_THREADS
    y2 = _rows(y)
    launch_rows(make_softmax_backward_kernel(tpb), y2.shape[0], y2, _rows(dy), _rows(dx),
                np.float32(factor), threads=tpb)


def masked_softmax_forward(x, mask, y, factor: float, threads: int | None = None) -> None:
    """y = softmax(x*factor - (1-mask)*10000) with eps 1e-6: x, y (B, H, Lf, Lt), mask (B, 1, Lf|1, Lt).
    One launch (make_masked_softmax_kernel); y may be x."""
    b, h, lf, lt = x.shape
    if mask.shape not in ((b, 1, lf, lt), (b, 1, 1, lt)):
        raise ValueError(f"masked_softmax: mask {mask.shape} does not fit x {x.shape}")
    if x.size == 0:
        return
    tpb = threads or REDUCE_THREADS
    x2 = _rows(x)
    launch_rows(make_masked_softmax_kernel(tpb), x2.shape[0], x2, _rows(mask), _rows(y), np.float32(factor),
                lf, h * lf, threads=tpb)


# ---- compiled CPU versions (numba.njit; the cpu device; rows split by parallel_cpu) ---------------
@njit(cache=True, inline="always")
def _subtract_row_max(yr):
    m = yr[0]
    for j in range(1, yr.shape[0]):
        m = max(m, yr[j])
    for j in range(yr.shape[0]):
        yr[j] -= m


@njit(cache=True, inline="always")
def _shift_rows(x, y, subtract_max, c):
    for r in range(c * ROW_CHUNK, min(x.shape[0], (c + 1) * ROW_CHUNK)):
        xr, yr = x[r], y[r]
        for j in range(xr.shape[0]):
            yr[j] = xr[j]
        if subtract_max:
            _subtract_row_max(yr)


@njit(cache=True, inline="always")
def _masked_shift_rows(x, mask, y, factor, lf, rows_per_batch, c):
    # x, y (R, Lt) with R = B*H*Lf, row r = (b*H + h)*Lf + i; mask (B*M, Lt) with M = Lf or 1
    m_rows = mask.shape[0] // (x.shape[0] // rows_per_batch)
    penalty = float32(MASK_PENALTY)
    one = float32(1.0)
    for r in range(c * ROW_CHUNK, min(x.shape[0], (c + 1) * ROW_CHUNK)):
        xr, mk, yr = x[r], mask[(r // rows_per_batch) * m_rows + (r % lf) % m_rows], y[r]
        for j in range(xr.shape[0]):
            yr[j] = xr[j] * factor - (one - mk[j]) * penalty
        _subtract_row_max(yr)


@njit(cache=True, inline="always")
def _normalize_rows(y, eps, c):
    for r in range(c * ROW_CHUNK, min(y.shape[0], (c + 1) * ROW_CHUNK)):
        yr = y[r]
        s = float32(0.0)
        for j in range(yr.shape[0]):
            s += yr[j]
        d = s + eps
        for j in range(yr.shape[0]):
            yr[j] = yr[j] / d


@njit(cache=True, inline="always")
def _backward_rows(y, dy, dx, factor, c):
    for r in range(c * ROW_CHUNK, min(y.shape[0], (c + 1) * ROW_CHUNK)):
        yr, gr, dr = y[r], dy[r], dx[r]
        s = float32(0.0)
        for j in range(yr.shape[0]):
            s += gr[j] * yr[j]
        for j in range(yr.shape[0]):
            dr[j] = factor * yr[j] * (gr[j] - s)


@pjit(cache=True)
def _shift_cpu(x, y, subtract_max):
    chunks = (x.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    if x.size < PARALLEL_MIN:
        for c in range(chunks):
            _shift_rows(x, y, subtract_max, c)
    else:
        for c in prange(chunks):
            _shift_rows(x, y, subtract_max, c)


@pjit(cache=True)
def _masked_shift_cpu(x, mask, y, factor, lf, rows_per_batch):
    chunks = (x.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    if x.size < PARALLEL_MIN:
        for c in range(chunks):
            _masked_shift_rows(x, mask, y, factor, lf, rows_per_batch, c)
    else:
        for c in prange(chunks):
            _masked_shift_rows(x, mask, y, factor, lf, rows_per_batch, c)


@pjit(cache=True, fastmath={"reassoc"})
def _normalize_cpu(y, eps):
    chunks = (y.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    if y.size < PARALLEL_MIN:
        for c in range(chunks):
            _normalize_rows(y, eps, c)
    else:
        for c in prange(chunks):
            _normalize_rows(y, eps, c)


@pjit(cache=True, fastmath={"reassoc"})
def _backward_cpu(y, dy, dx, factor):
    chunks = (y.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    if y.size < PARALLEL_MIN:
        for c in range(chunks):
            _backward_rows(y, dy, dx, factor, c)
    else:
        for c in prange(chunks):
            _backward_rows(y, dy, dx, factor, c)


def softmax_forward_cpu(x, y, subtract_max: bool = True, eps: float = 0.0) -> None:
    """softmax_forward compiled for the CPU: y = softmax of x over the last dim (y may be x); contiguous
    float32, overwrites y."""
    if x.shape != y.shape:
        raise ValueError(f"softmax: y {y.shape} is not x's shape {x.shape}")
    if x.size == 0:
        return
    y2 = _rows(y)
    _shift_cpu(_rows(x), y2, bool(subtract_max))
    np.exp(y2, out=y2)
    _normalize_cpu(y2, np.float32(eps))


def softmax_backward_cpu(y, dy, dx, factor: float = 1.0) -> None:
    """softmax_backward compiled for the CPU: dx = factor * y * (dy - sum(dy*y)) over the last dim
    (dx may be dy); contiguous float32, overwrites dx."""
    if not y.shape == dy.shape == dx.shape:
        raise ValueError(f"softmax backward: y {y.shape}, dy {dy.shape} and dx {dx.shape} must be one shape")
    if y.size == 0:
        return
    _backward_cpu(_rows(y), _rows(dy), _rows(dx), np.float32(factor))


def masked_softmax_forward_cpu(x, mask, y, factor: float) -> None:
    """masked_softmax_forward compiled for the CPU: y = softmax(x*factor - (1-mask)*10000) with eps 1e-6;
    x, y (B, H, Lf, Lt), mask (B, 1, Lf|1, Lt), contiguous float32; y may be x."""
    b, h, lf, lt = x.shape
    if mask.shape not in ((b, 1, lf, lt), (b, 1, 1, lt)) or y.shape != x.shape:
        raise ValueError(f"masked_softmax: mask {mask.shape} or y {y.shape} does not fit x {x.shape}")
    if x.size == 0:
        return
    y2 = _rows(y)
    _masked_shift_cpu(_rows(x), _rows(mask), y2, np.float32(factor), lf, h * lf)
    np.exp(y2, out=y2)
    _normalize_cpu(y2, np.float32(MASKED_EPS))


PTX_CHECKS = [
    (make_softmax_forward_kernel(256), "void(float32[:, ::1], float32[:, ::1], int64, float32)"),
    (make_softmax_backward_kernel(256), "void(float32[:, ::1], float32[:, ::1], float32[:, ::1], float32)"),
    # mixed precision on gpu/sim: the plain Softmax takes float16 tensors
    (make_softmax_forward_kernel(256), "void(float16[:, ::1], float16[:, ::1], int64, float32)"),
    (make_softmax_backward_kernel(256), "void(float16[:, ::1], float16[:, ::1], float16[:, ::1], float32)"),
    (make_masked_softmax_kernel(256),
     "void(float32[:, ::1], float32[:, ::1], float32[:, ::1], float32, int64, int64)"),
    (make_masked_softmax_kernel(256),                   # mixed precision: float16 x and y (and mask)
     "void(float16[:, ::1], float16[:, ::1], float16[:, ::1], float32, int64, int64)"),
    (make_masked_softmax_kernel(256),
     "void(float16[:, ::1], float32[:, ::1], float16[:, ::1], float32, int64, int64)"),
]
