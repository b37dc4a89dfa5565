"""WeightMultiply: scale each slot's scalar by a learned vector.

    x (B, S), W (S, V) -> y (B, S*V),   y[b, s*V + v] = x[b, s] * W[s, v]
    dx[b, s] = sum_v dy[b, s*V + v] * W[s, v]                       -> (B, S)
    dW[s, v] = sum_b dy[b, s*V + v] * x[b, s]                       -> (S, V), overwritten

Every kernel is one thread per output element with a short serial loop (V for dx, B for dW);
neighbouring threads touch neighbouring addresses, and nothing needs shared memory. HugeCTR
accumulates dW into the regularizer-initialised wgrad; here dW is overwritten and the caller adds.

HugeCTR: HugeCTR/src/layers/weight_multiply_layer.cu.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from .launch import launch_1d


# ---- NumPy references ------------------------------------------------------------------------
def weight_multiply_forward_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    b, s = x.shape
    return (x[:, :, None] * w[None, :, :]).reshape(b, s * w.shape[1])


def weight_multiply_backward_ref(x: np.ndarray, w: np.ndarray, dy: np.ndarray):
    """(dx (B, S), dW (S, V))."""
    b, s = x.shape
    g = dy.reshape(b, s, w.shape[1])                       # (B, S, V)
    dx = (g * w[None, :, :]).sum(axis=2)
    dw = (g * x[:, :, None]).sum(axis=0)
    return dx, dw


# ---- kernels ---------------------------------------------------------------------------------
@cuda.jit
def weight_multiply_forward_kernel(x, w, y):
    # x (B, S), w (S, V), y (B, S*V); one thread per output element
    s_dim = w.shape[0]
    v_dim = w.shape[1]
    sv = s_dim * v_dim
    for o in range(cuda.grid(1), x.shape[0] * sv, cuda.gridsize(1)):
        b = o // sv
        r = o % sv
        s = r // v_dim
        y[b, r] = float32(x[b, s]) * float32(w[s, r % v_dim])


@cuda.jit
def weight_multiply_dgrad_kernel(dy, w, dx):
    # dy (B, S*V), w (S, V), dx (B, S); one thread per (b, s)
    s_dim = w.shape[0]
    v_dim = w.shape[1]
    for t in range(cuda.grid(1), dx.shape[0] * s_dim, cuda.gridsize(1)):
        b = t // s_dim
        s = t % s_dim
        acc = float32(0.0)
        for v in range(v_dim):
            acc += float32(dy[b, s * v_dim + v]) * float32(w[s, v])
        dx[b, s] = acc


@cuda.jit
def weight_multiply_wgrad_kernel(dy, x, dw):
    # dy (B, S*V), x (B, S), dw (S, V); one thread per (s, v), summing over the batch
    v_dim = dw.shape[1]
    for r in range(cuda.grid(1), dw.shape[0] * v_dim, cuda.gridsize(1)):
        s = r // v_dim
        acc = float32(0.0)
        for b in range(x.shape[0]):
            acc += float32(dy[b, r]) * float32(x[b, s])
        dw[s, r % v_dim] = acc


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def _check(x_shape, w_shape, y_shape):
    b, s = x_shape
    if w_shape[0] != s or tuple(y_shape) != (b, s * w_shape[1]):
        raise ValueError(f"weight_multiply: x {tuple(x_shape)}, W {tuple(w_shape)}, y {tuple(y_shape)} "
                         "do not fit (B, S) x (S, V) -> (B, S*V)")


def weight_multiply_forward(x, w, y) -> None:
    _check(x.shape, w.shape, y.shape)
    launch_1d(weight_multiply_forward_kernel, y.size, x, w, y)


def weight_multiply_backward(x, w, dy, dx, dw) -> None:
    """dx (B, S) and dW (S, V), both overwritten (dW = 0 for B = 0). dx may be None."""
    _check(x.shape, w.shape, dy.shape)
    if dx is not None:
        launch_1d(weight_multiply_dgrad_kernel, dx.size, dy, w, dx)
    launch_1d(weight_multiply_wgrad_kernel, dw.size, dy, x, dw)


PTX_CHECKS = [
    (weight_multiply_forward_kernel, "void(float32[:, ::1], float32[:, ::1], float32[:, ::1])"),
    (weight_multiply_dgrad_kernel, "void(float32[:, ::1], float32[:, ::1], float32[:, ::1])"),
    (weight_multiply_wgrad_kernel, "void(float32[:, ::1], float32[:, ::1], float32[:, ::1])"),
    # mixed precision on gpu/sim: float16 x, y, dy, dx; float32 W and dW
    (weight_multiply_forward_kernel, "void(float16[:, ::1], float32[:, ::1], float16[:, ::1])"),
    (weight_multiply_dgrad_kernel, "void(float16[:, ::1], float32[:, ::1], float16[:, ::1])"),
    (weight_multiply_wgrad_kernel, "void(float16[:, ::1], float16[:, ::1], float32[:, ::1])"),
]
