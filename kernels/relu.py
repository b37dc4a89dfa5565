"""ReLU.

    y = max(x, 0)                         # any shape, applied elementwise
    dx = dy if x > 0 else 0

HugeCTR: HugeCTR/src/layers/relu_layer.cu (backward reads the *output*: y > 0 <=> x > 0).

Compiled CPU versions (numba.njit, the cpu device's path) follow the reference where the kernel does not:
a NaN input stays NaN (np.maximum), it is not clamped to 0.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, njit, prange

from .launch import launch_1d
from .parallel_cpu import FLAT_CHUNK, PARALLEL_MIN, pjit


# ---- NumPy reference -------------------------------------------------------------------------
def relu_forward_ref(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, x.dtype.type(0))


def relu_backward_ref(y: np.ndarray, dy: np.ndarray) -> np.ndarray:
    return np.where(y > 0, dy, dy.dtype.type(0))


# ---- kernels (flat 1-D views; one thread per element, grid-stride) ---------------------------
@cuda.jit
def relu_forward_kernel(x, y):
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        v = float32(x[i])                   # float16 tensors (mixed precision): compared in float32
        y[i] = v if v > float32(0.0) else float32(0.0)


@cuda.jit
def relu_backward_kernel(y, dy, dx):
    for i in range(cuda.grid(1), y.shape[0], cuda.gridsize(1)):
        dx[i] = float32(dy[i]) if float32(y[i]) > float32(0.0) else float32(0.0)


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def relu_forward(x, y) -> None:
    launch_1d(relu_forward_kernel, x.size, x.reshape(-1), y.reshape(-1))


def relu_backward(y, dy, dx) -> None:
    launch_1d(relu_backward_kernel, y.size, y.reshape(-1), dy.reshape(-1), dx.reshape(-1))


# ---- compiled CPU versions (numba.njit; the cpu device; flat views; work split by parallel_cpu) -----
@njit(cache=True, inline="always")
def _forward_span(x, y):
    for i in range(x.shape[0]):
        v = x[i]
        y[i] = float32(0.0) if v < float32(0.0) else v


@njit(cache=True, inline="always")
def _backward_span(y, dy, dx):
    for i in range(y.shape[0]):
        dx[i] = dy[i] if y[i] > float32(0.0) else float32(0.0)


@pjit(cache=True)
def _relu_forward_cpu(x, y):
    n = x.shape[0]
    if n < PARALLEL_MIN:
        _forward_span(x, y)
    else:
        for c in prange((n + FLAT_CHUNK - 1) // FLAT_CHUNK):
            lo, hi = c * FLAT_CHUNK, (c + 1) * FLAT_CHUNK
            _forward_span(x[lo:hi], y[lo:hi])


@pjit(cache=True)
def _relu_backward_cpu(y, dy, dx):
    n = y.shape[0]
    if n < PARALLEL_MIN:
        _backward_span(y, dy, dx)
    else:
        for c in prange((n + FLAT_CHUNK - 1) // FLAT_CHUNK):
            lo, hi = c * FLAT_CHUNK, (c + 1) * FLAT_CHUNK
            _backward_span(y[lo:hi], dy[lo:hi], dx[lo:hi])


def relu_forward_cpu(x, y) -> None:
    """y = max(x, 0) compiled for the CPU; x, y contiguous float32 of one shape (y may be x)."""
    _relu_forward_cpu(x.reshape(-1), y.reshape(-1))


def relu_backward_cpu(y, dy, dx) -> None:
    """dx = dy where y > 0, else 0, compiled for the CPU; contiguous float32 of one shape."""
    _relu_backward_cpu(y.reshape(-1), dy.reshape(-1), dx.reshape(-1))


PTX_CHECKS = [
    (relu_forward_kernel, "void(float32[::1], float32[::1])"),
    (relu_backward_kernel, "void(float32[::1], float32[::1], float32[::1])"),
    (relu_forward_kernel, "void(float16[::1], float16[::1])"),             # mixed precision on gpu/sim
    (relu_backward_kernel, "void(float16[::1], float16[::1], float16[::1])"),
]
