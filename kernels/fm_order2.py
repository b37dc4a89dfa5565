"""FmOrder2: the factorization machine's second-order term, per embedding component.

    x (B, S*V) viewed as (B, S, V);  V = out_dim, S = width / V
    y[b, v]       = 0.5 * ((sum_s x[b, s, v])^2 - sum_s x[b, s, v]^2)          -> y (B, V)
    dx[b, s, v]   = dy[b, v] * (sum_s' x[b, s', v] - x[b, s, v])

One thread per (b, v) walks the S slots (stride V in memory, so neighbouring threads read
neighbouring addresses); no shared memory.

HugeCTR: HugeCTR/src/layers/fm_order2_layer.cu (one block per row, one thread per v).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from .launch import launch_1d


# ---- NumPy references ------------------------------------------------------------------------
def fm_order2_forward_ref(x: np.ndarray, out_dim: int) -> np.ndarray:
    b, sv = x.shape
    e = x.reshape(b, sv // out_dim, out_dim)               # (B, S, V)
    s = e.sum(axis=1)                                      # (B, V)
    return x.dtype.type(0.5) * (s * s - (e * e).sum(axis=1))


def fm_order2_backward_ref(x: np.ndarray, dy: np.ndarray, out_dim: int) -> np.ndarray:
    b, sv = x.shape
    e = x.reshape(b, sv // out_dim, out_dim)               # (B, S, V)
    s = e.sum(axis=1, keepdims=True)                       # (B, 1, V)
    return (dy[:, None, :] * (s - e)).reshape(x.shape)


# ---- kernels ---------------------------------------------------------------------------------
@cuda.jit
def fm_order2_forward_kernel(x, y):
    # x (B, S*V), y (B, V); one thread per (b, v)
    v_dim = y.shape[1]
    slots = x.shape[1] // v_dim
    for t in range(cuda.grid(1), y.shape[0] * v_dim, cuda.gridsize(1)):
        b = t // v_dim
        v = t % v_dim
        s1 = float32(0.0)
        s2 = float32(0.0)
        for s in range(slots):
            e = float32(x[b, s * v_dim + v])
            s1 += e
            s2 += e * e
        y[b, v] = float32(0.5) * (s1 * s1 - s2)


@cuda.jit
def fm_order2_backward_kernel(x, dy, dx):
    # x, dx (B, S*V), dy (B, V); one thread per (b, v): the column sum, then every slot's gradient
    v_dim = dy.shape[1]
    slots = x.shape[1] // v_dim
    for t in range(cuda.grid(1), dy.shape[0] * v_dim, cuda.gridsize(1)):
        b = t // v_dim
        v = t % v_dim
        s1 = float32(0.0)
        for s in range(slots):
            s1 += float32(x[b, s * v_dim + v])
        g = float32(dy[b, v])
        for s in range(slots):
            dx[b, s * v_dim + v] = g * (s1 - float32(x[b, s * v_dim + v]))


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def fm_order2_forward(x, y) -> None:
    """y (B, V) from x (B, S*V)."""
    if x.shape[0] != y.shape[0] or y.shape[1] == 0 or x.shape[1] % y.shape[1]:
        raise ValueError(f"fm_order2: input {tuple(x.shape)} does not split into output {tuple(y.shape)}")
    launch_1d(fm_order2_forward_kernel, y.size, x, y)


def fm_order2_backward(x, dy, dx) -> None:
    """dx (B, S*V) from x (B, S*V) and dy (B, V); overwrites dx."""
    if x.shape != dx.shape or x.shape[0] != dy.shape[0] or dy.shape[1] == 0 or x.shape[1] % dy.shape[1]:
        raise ValueError(f"fm_order2: shapes x {tuple(x.shape)}, dy {tuple(dy.shape)}, dx {tuple(dx.shape)}")
    launch_1d(fm_order2_backward_kernel, dy.size, x, dy, dx)


PTX_CHECKS = [
    (fm_order2_forward_kernel, "void(float32[:, ::1], float32[:, ::1])"),
    (fm_order2_backward_kernel, "void(float32[:, ::1], float32[:, ::1], float32[:, ::1])"),
    (fm_order2_forward_kernel, "void(float16[:, ::1], float16[:, ::1])"),                 # mixed precision
    (fm_order2_backward_kernel, "void(float16[:, ::1], float16[:, ::1], float16[:, ::1])"),
]
