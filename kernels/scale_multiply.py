"""A Scale (repeat each element f times) and the Multiply that reads it, in one pass: MMoE's gating.

    forward:  y[b, j]  = s * x[b, j]  (or x[b, j] * s: the Multiply's input order)   s = g[b, j // f]
    backward: dx[b, j] = dy[b, j] * s                                                  (the Multiply's dX)
              ds[b, j] = dy[b, j] * x[b, j]                                            (its d(scaled))
              dg       = the Scale's backward of ds (its sum over the f copies, on each device as there)

g (B, N), x, y, dy, dx, ds (B, N*f); float32. The unfused ops materialize the repeated ``s`` (B, N*f) in the
forward and read it again in the backward; here it is read from g where needed. Each element is the same
one float32 product as in the unfused ops, so the bits are the same (numbactr.train.plan_fuse rewrites the
pair into this op; tests/test_step_plan_buffers.py compares them on cpu and sim).

No compiled CPU version: the planned step fuses the pair on the kernel devices only. On the cpu a compiled
loop measured 3-4x slower than NumPy's repeat and multiply (which are vectorized; LLVM does not vectorize
the loop, not knowing that the arrays do not overlap), and NumPy broadcasting without the repeated array
no faster than with it (2026-12-07, MMoE's gates, (1024, 1) repeated 64 times): the repeat is small.

HugeCTR: no fused counterpart (its MMoE sample runs Scale and ElementwiseMultiply as two layers).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from .launch import launch_1d


# ---- NumPy references ------------------------------------------------------------------------
def scale_multiply_ref(g, x, factor: int, g_first: bool):
    """y (B, N*f) = repeat(g) * x, multiplied in the Multiply's input order."""
    s = np.repeat(g, factor, axis=1)
    return s * x if g_first else x * s


def scale_multiply_backward_ref(g, x, dy, factor: int):
    """(dx, ds): dy * repeat(g) and dy * x (the Multiply's two input gradients)."""
    return dy * np.repeat(g, factor, axis=1), dy * x


# ---- kernels (2-D, one thread per element of y, grid-stride) ---------------------------------
@cuda.jit
def scale_multiply_kernel(g, x, y, factor, g_first):
    width = y.shape[1]
    for i in range(cuda.grid(1), y.shape[0] * width, cuda.gridsize(1)):
        b, j = i // width, i % width
        s = g[b, j // factor]
        y[b, j] = s * x[b, j] if g_first != 0 else x[b, j] * s


@cuda.jit
def scale_multiply_backward_kernel(g, x, dy, factor, dx, ds):
    width = dy.shape[1]
    for i in range(cuda.grid(1), dy.shape[0] * width, cuda.gridsize(1)):
        b, j = i // width, i % width
        dx[b, j] = dy[b, j] * g[b, j // factor]
        ds[b, j] = dy[b, j] * x[b, j]


def scale_multiply(g, x, y, factor: int, g_first: bool) -> None:
    """Writes y (B, N*f) = repeat(g) * x (the kernel)."""
    _check(g, x, y, factor)
    launch_1d(scale_multiply_kernel, y.size, g, x, y, factor, np.int32(bool(g_first)))


def scale_multiply_backward(g, x, dy, factor: int, dx, ds) -> None:
    """Writes dx = dy * repeat(g) and ds = dy * x (the kernel)."""
    _check(g, x, dy, factor)
    launch_1d(scale_multiply_backward_kernel, dy.size, g, x, dy, factor, dx, ds)


def _check(g, x, y, factor: int) -> None:
    if g.ndim != 2 or x.shape != y.shape or x.shape != (g.shape[0], g.shape[1] * factor):
        raise ValueError(f"scale_multiply: g {g.shape} repeated {factor} times does not match x {x.shape}")


PTX_CHECKS = [
    (scale_multiply_kernel, "void(float32[:, ::1], float32[:, ::1], float32[:, ::1], int64, int32)"),
    (scale_multiply_backward_kernel,
     "void(float32[:, ::1], float32[:, ::1], float32[:, ::1], int64, float32[:, ::1], float32[:, ::1])"),
]
