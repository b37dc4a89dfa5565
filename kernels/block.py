"""Block-level building blocks shared by the reduction kernels.

Every thread of the block must call these (they contain barriers), with ``t = cuda.threadIdx.x`` and
``tpb`` the block size, a power of two. On return every thread may read the total in ``part[0]``;
a later write to ``part`` needs a ``cuda.syncthreads()`` first.

    block_sum(part, t, tpb)        part[0] = sum(part[0:tpb])           (tree, log2(tpb) barriers)
    block_sum2(a, b, t, tpb)       the same for two arrays in one tree (one set of barriers)
"""
from __future__ import annotations

import numpy as np
from numba import cuda


def block_sum_ref(part: np.ndarray) -> float:
    return float(np.sum(part, dtype=np.float64))


@cuda.jit(device=True, inline=True)
def block_sum(part, t, tpb):
    cuda.syncthreads()                      # every partial sum is written
    step = tpb // 2
    while step > 0:
        if t < step:
            part[t] += part[t + step]
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


PTX_CHECKS = []   # device functions: compiled inside every kernel that calls them
