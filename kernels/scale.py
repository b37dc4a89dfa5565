"""Scale: repeat every element (axis 0) or every row (axis 1) ``f`` times.

    axis 0: x (B, N) -> y (B, N*f),  y[b, n*f + j] = x[b, n]     (flat: y[o] = x[o // f])
    axis 1: x (B, N) -> y (B*f, N),  y[b*f + j, n] = x[b, n]     (row b repeated f times)
    backward, correct:      dx[b, n] = sum_{j < f} dy[b, n*f + j]   (axis 0)
                            dx[b, n] = sum_{j < f} dy[b*f + j, n]   (axis 1)
    backward, HugeCTR exact: only the first copy, j = 0 (the other f - 1 gradients are dropped).

The backward kernel takes the number of copies it sums (``f`` for the correct gradient, 1 for
HugeCTR's), so one kernel serves both.

HugeCTR: HugeCTR/src/layers/scale_layer.cu (upscale_kernel / downscale_kernel).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from .launch import launch_1d


# ---- NumPy references ------------------------------------------------------------------------
def scale_forward_ref(x: np.ndarray, axis: int, factor: int) -> np.ndarray:
    """(B, N) -> (B, N*f) for axis 0, (B*f, N) for axis 1."""
    return np.repeat(x, factor, axis=1 if axis == 0 else 0)


def scale_backward_ref(dy: np.ndarray, axis: int, factor: int, first_only: bool = False) -> np.ndarray:
    """dy (B, N*f) or (B*f, N) -> dx (B, N). first_only=True is HugeCTR's gradient."""
    if axis == 0:
        b, nf = dy.shape
        g = dy.reshape(b, nf // factor, factor)             # (B, N, f)
        return g[:, :, 0].copy() if first_only else g.sum(axis=2)
    bf, n = dy.shape
    g = dy.reshape(bf // factor, factor, n)                 # (B, f, N)
    return g[:, 0, :].copy() if first_only else g.sum(axis=1)


# ---- kernels (flat views, grid-stride) -------------------------------------------------------
@cuda.jit
def scale_forward_kernel(x, y, n, factor, axis):
    # x flat (B*N,), y flat (B*N*f,); one thread per OUTPUT element.
    for o in range(cuda.grid(1), y.shape[0], cuda.gridsize(1)):
        if axis == 0:
            y[o] = x[o // factor]
        else:
            # o = (b*f + j)*n + c  ->  x[b*n + c]
            y[o] = x[(o // (factor * n)) * n + o % n]


@cuda.jit
def scale_backward_kernel(dy, dx, n, factor, axis, copies):
    # dx flat (B*N,); sums the first `copies` of the f copies of each input element.
    for i in range(cuda.grid(1), dx.shape[0], cuda.gridsize(1)):
        if axis == 0:
            base = i * factor
            acc = float32(dy[base])
            for j in range(1, copies):
                acc += float32(dy[base + j])
        else:
            base = (i // n) * factor * n + i % n           # (b*f)*n + c
            acc = float32(dy[base])
            for j in range(1, copies):
                acc += float32(dy[base + j * n])
        dx[i] = acc


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def _check(x_shape, y_shape, axis, factor):
    if axis not in (0, 1) or factor < 1:
        raise ValueError(f"scale: need axis 0/1 and factor >= 1, got axis={axis}, factor={factor}")
    b, n = x_shape
    want = (b, n * factor) if axis == 0 else (b * factor, n)
    if tuple(y_shape) != want:
        raise ValueError(f"scale: output {tuple(y_shape)} should be {want} for input {tuple(x_shape)}")


def scale_forward(x, y, axis: int, factor: int) -> None:
    """y = x repeated; x (B, N), y (B, N*f) for axis 0 or (B*f, N) for axis 1."""
    _check(x.shape, y.shape, axis, factor)
    launch_1d(scale_forward_kernel, y.size, x.reshape(-1), y.reshape(-1), x.shape[1], factor, axis)


def scale_backward(dy, dx, axis: int, factor: int, first_only: bool = False) -> None:
    """dx (B, N) from dy; first_only=True keeps only the first copy (HugeCTR)."""
    _check(dx.shape, dy.shape, axis, factor)
    launch_1d(scale_backward_kernel, dx.size, dy.reshape(-1), dx.reshape(-1), dx.shape[1], factor, axis,
              1 if first_only else factor)


PTX_CHECKS = [
    (scale_forward_kernel, "void(float32[::1], float32[::1], int64, int64, int64)"),
    (scale_backward_kernel, "void(float32[::1], float32[::1], int64, int64, int64, int64)"),
    (scale_forward_kernel, "void(float16[::1], float16[::1], int64, int64, int64)"),    # mixed precision
    (scale_backward_kernel, "void(float16[::1], float16[::1], int64, int64, int64, int64)"),
]
