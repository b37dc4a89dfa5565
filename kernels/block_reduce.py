"""Block-level building blocks shared by the reduction kernels.

Every thread of the block must call these (they contain barriers), with ``t = cuda.threadIdx.x`` and
``tpb`` the block size (block_sum and block_max take any size; block_sum2 a power of two). On return every thread may read the total in ``part[0]``;
a later write to ``part`` needs a ``cuda.syncthreads()`` first.

    block_sum(part, t, tpb)        part[0] = sum(part[0:tpb])           (tree, log2(tpb) barriers)
    block_max(part, t, tpb)        part[0] = max(part[0:tpb])
    block_sum2(a, b, t, tpb)       the same for two arrays in one tree (one set of barriers)
    column_mean_var(x, f, part, t, tpb) -> (mean, biased variance) of column f of x (B, F)
    row_mean_var(x, r, part, t, tpb)    -> the same for row r of x (M, H)
The mean/variance helpers take two passes over the data (no E[x^2] - E[x]^2 cancellation), use
``part`` (tpb floats of shared memory) as scratch and leave it free for reuse.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32


def block_sum_ref(part: np.ndarray) -> float:
    return float(np.sum(part, dtype=np.float64))


@cuda.jit(device=True, inline=True)
def _first_stride(tpb):
    """Largest power of two below tpb (0 for tpb = 1): the tree's first stride, for any tpb."""
    step = 0
    if tpb > 1:
        step = 1
        while step * 2 < tpb:
            step *= 2
    return step


@cuda.jit(device=True, inline=True)
def block_sum(part, t, tpb):
    cuda.syncthreads()                      # every partial sum is written
    step = _first_stride(tpb)
    while step > 0:
        if t < step and t + step < tpb:     # the guard makes any tpb work, not only powers of two
            part[t] += part[t + step]
        cuda.syncthreads()
        step //= 2


@cuda.jit(device=True, inline=True)
def lane_sum(sh, ty, tx, v, lanes):
    """Sum of v over the `lanes` threads tx = 0..lanes-1 of block row ty (lanes a power of two), through row ty
    of the shared (rows, lanes) array sh; every lane of the row gets the sum (the row-wise block_sum)."""
    cuda.syncthreads()                      # the row's shared cells are free (an earlier sum was read)
    sh[ty, tx] = v
    cuda.syncthreads()
    step = lanes // 2
    while step > 0:
        if tx < step:
            sh[ty, tx] += sh[ty, tx + step]
        cuda.syncthreads()
        step //= 2
    return sh[ty, 0]


@cuda.jit(device=True, inline=True)
def block_max(part, t, tpb):
    cuda.syncthreads()
    step = _first_stride(tpb)
    while step > 0:
        if t < step and t + step < tpb:
            part[t] = max(part[t], part[t + step])
        cuda.syncthreads()
        step //= 2


@cuda.jit(device=True, inline=True)
def block_sum2(a, b, t, tpb):
    cuda.syncthreads()
    step = tpb // 2
    while step > 0:
        if t < step:
            a[t] += a[t + step]
            b[t] += b[t + step]
        cuda.syncthreads()
        step //= 2


def mean_var_ref(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=np.float64)
    mu = x.mean(axis=axis)
    return mu, ((x - np.expand_dims(mu, axis)) ** 2).mean(axis=axis)


@cuda.jit(device=True, inline=True)
def column_mean_var(x, f, part, t, tpb):
    rows = x.shape[0]
    n = float32(rows)
    acc = float32(0.0)
    for m in range(t, rows, tpb):          # thread t sums rows t, t + tpb, ...
        acc += float32(x[m, f])            # (float16 tensors are read in float32)
    part[t] = acc
    block_sum(part, t, tpb)
    mu = part[0] / n
    cuda.syncthreads()                     # everyone has read part[0] before it is overwritten
    acc = float32(0.0)
    for m in range(t, rows, tpb):
        d = float32(x[m, f]) - mu
        acc += d * d
    part[t] = acc
    block_sum(part, t, tpb)
    var = part[0] / n
    cuda.syncthreads()
    return mu, var


@cuda.jit(device=True, inline=True)
def row_mean_var(x, r, part, t, tpb):
    width = x.shape[1]
    n = float32(width)
    acc = float32(0.0)
    for j in range(t, width, tpb):
        acc += float32(x[r, j])
    part[t] = acc
    block_sum(part, t, tpb)
    mu = part[0] / n
    cuda.syncthreads()
    acc = float32(0.0)
    for j in range(t, width, tpb):
        d = float32(x[r, j]) - mu
        acc += d * d
    part[t] = acc
    block_sum(part, t, tpb)
    var = part[0] / n
    cuda.syncthreads()
    return mu, var


PTX_CHECKS = []   # device functions: compiled inside every kernel that calls them
