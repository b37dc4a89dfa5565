"""ReduceSum / ReduceMean along one axis of a rank <= 3 tensor; the axis stays, with size 1.

Any axis of any shape is the middle axis of the row-major view (O, N, I) with
O = prod(shape[:axis]), N = shape[axis], I = prod(shape[axis+1:]):

    forward:  y[o, i] = scale * sum_n x[o, n, i]          # x (O, N, I) -> y (O, I)
    backward: dx[o, n, i] = scale * dy[o, i]              # dy (O, I) -> dx (O, N, I)

scale = 1 for ReduceSum, 1/N for ReduceMean. E.g. (B, S, D) on axis 1: O = B, N = S, I = D.

HugeCTR: HugeCTR/src/layers/reduce_sum_layer.cu and reduce_mean_layer.cu (one block per output
element reducing in shared memory; dgrad broadcasts dY).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from .block_reduce import block_sum
from .launch import MAX_THREADS_PER_BLOCK, REDUCE_THREADS, launch_1d, launch_rows


def axis_view(shape, axis: int) -> tuple[int, int, int]:
    """(O, N, I): the sizes before, on and after ``axis`` of a row-major ``shape``."""
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


# ---- NumPy reference -------------------------------------------------------------------------
def reduce_axis_forward_ref(x: np.ndarray, axis: int, mean: bool = False) -> np.ndarray:
    """Sum (or mean) over ``axis``, keeping it as size 1."""
    return x.mean(axis=axis, keepdims=True) if mean else x.sum(axis=axis, keepdims=True)


def reduce_axis_backward_ref(dy: np.ndarray, in_shape, axis: int, mean: bool = False) -> np.ndarray:
    """dY (shape with ``axis`` = 1) broadcast back to ``in_shape`` (divided by N for the mean)."""
    dx = np.broadcast_to(dy, tuple(in_shape)).copy()
    return dx / dx.dtype.type(in_shape[axis]) if mean else dx


# ---- kernels ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_reduce_axis_kernel(tpb: int):
    """Kernel for blocks of exactly ``tpb`` threads (any size in 1..1024).

    Blocks grid-stride over the O*I outputs; a block's threads stride over the N reduced values and
    then fold their partial sums in shared memory. The output loop depends only on blockIdx, so every
    thread of a block reaches every syncthreads.
    """
    if not 1 <= tpb <= MAX_THREADS_PER_BLOCK:
        raise ValueError(f"tpb must be in 1..{MAX_THREADS_PER_BLOCK}, got {tpb}")

    @cuda.jit
    def reduce_axis_kernel(x, y, scale):
        # x (O, N, I), y (O, I)
        part = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        n, inner = x.shape[1], x.shape[2]
        for e in range(cuda.blockIdx.x, y.shape[0] * inner, cuda.gridDim.x):
            o = e // inner
            i = e - o * inner
            acc = float32(0.0)
            for j in range(t, n, tpb):
                acc += float32(x[o, j, i])        # float16 tensors (mixed precision): summed in float32
            part[t] = acc
            block_sum(part, t, tpb)
            if t == 0:
                y[o, i] = part[0] * scale
            # thread 0 reads part[0] before anyone overwrites it for the next output
            cuda.syncthreads()

    return reduce_axis_kernel


@cuda.jit
def reduce_axis_backward_kernel(dy, dx, scale):
    # dy (O, I), dx (O, N, I): one thread per element of dx
    n, inner = dx.shape[1], dx.shape[2]
    for k in range(cuda.grid(1), dx.shape[0] * n * inner, cuda.gridsize(1)):
        o = k // (n * inner)
        i = k - (k // inner) * inner
        dx[o, (k // inner) - o * n, i] = float32(dy[o, i]) * scale


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def reduce_axis_forward(x, y, axis: int, mean: bool = False, threads: int | None = None) -> None:
    """y (x's shape with ``axis`` = 1) = sum or mean of x over ``axis``; overwrites y."""
    o, n, i = axis_view(x.shape, axis)
    if y.size != o * i:
        raise ValueError(f"reduce_axis: y {y.shape} does not fit x {x.shape} reduced on axis {axis}")
    if y.size == 0:
        return
    scale = np.float32(1.0 / n if mean and n else 1.0)
    tpb = threads or REDUCE_THREADS
    launch_rows(make_reduce_axis_kernel(tpb), o * i, x.reshape(o, n, i), y.reshape(o, i), scale, threads=tpb)


def reduce_axis_backward(dy, dx, axis: int, mean: bool = False, threads: int | None = None) -> None:
    """dx = dY broadcast over ``axis`` (divided by its size for the mean); overwrites dx."""
    o, n, i = axis_view(dx.shape, axis)
    if dy.size != o * i:
        raise ValueError(f"reduce_axis: dy {dy.shape} does not fit dx {dx.shape} on axis {axis}")
    scale = np.float32(1.0 / n if mean and n else 1.0)
    launch_1d(reduce_axis_backward_kernel, dx.size, dy.reshape(o, i), dx.reshape(o, n, i), scale,
              threads=threads)


PTX_CHECKS = [
    (make_reduce_axis_kernel(256), "void(float32[:, :, ::1], float32[:, ::1], float32)"),
    (reduce_axis_backward_kernel, "void(float32[:, ::1], float32[:, :, ::1], float32)"),
    (make_reduce_axis_kernel(256), "void(float16[:, :, ::1], float16[:, ::1], float32)"),   # mixed precision
    (reduce_axis_backward_kernel, "void(float16[:, ::1], float16[:, :, ::1], float32)"),
]
