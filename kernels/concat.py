"""Concat.

    forward:  y = [x_0 | x_1 | ... ]          # x_i (B, K_i) -> y (B, sum K_i), in bottom order
    backward: dx_i = dy[:, c_i : c_i + K_i]   # c_i = K_0 + ... + K_{i-1}

Concat along any axis a of row-major arrays is this 2-D concat on the views
(prod(shape[:a]), prod(shape[a:])): 3-D (B, S_i, V) on axis 1 uses (B, S_i*V) blocks, 3-D
(B, S, V_i) on axis 2 uses (B*S, V_i) blocks. So the two kernels only copy one (R, K) block into /
out of columns [c0, c0+K) of an (R, W) array; the wrappers launch once per input.

HugeCTR: HugeCTR/src/layers/concat_layer.cu (2-D) and concat_3d_layer.cu (3-D, axis 1 or 2).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .launch import launch_1d


# ---- NumPy reference -------------------------------------------------------------------------
def concat_forward_ref(xs, axis: int = 1) -> np.ndarray:
    return np.concatenate(xs, axis=axis)


def concat_backward_ref(dy: np.ndarray, widths, axis: int = 1) -> list:
    """Split dy along ``axis`` into pieces of sizes ``widths`` (the inputs' sizes on that axis)."""
    cuts = np.cumsum(widths)[:-1]
    return [np.array(p) for p in np.split(dy, cuts, axis=axis)]


# ---- kernels (2-D views; one thread per element of the (R, K) block, grid-stride) -------------
@cuda.jit
def concat_copy_in_kernel(x, out, c0):
    # x (R, K) -> out[:, c0:c0+K] of out (R, W)
    k = x.shape[1]
    for i in range(cuda.grid(1), x.shape[0] * k, cuda.gridsize(1)):
        r = i // k
        c = i - r * k
        out[r, c0 + c] = x[r, c]


@cuda.jit
def concat_copy_out_kernel(dy, dx, c0):
    # dy[:, c0:c0+K] of dy (R, W) -> dx (R, K)
    k = dx.shape[1]
    for i in range(cuda.grid(1), dx.shape[0] * k, cuda.gridsize(1)):
        r = i // k
        c = i - r * k
        dx[r, c] = dy[r, c0 + c]


# ---- launch wrappers (allocate nothing; arrays are contiguous) --------------------------------
def _block_views(pieces, whole, axis: int):
    """(R, K_i) views of the pieces, (R, W) view of the whole, and the column offsets c_i."""
    if not 0 < axis < whole.ndim:
        raise ValueError(f"concat axis must be in 1..{whole.ndim - 1}, got {axis}")
    rows = math.prod(whole.shape[:axis])
    views, offsets, c0 = [], [], 0
    for p in pieces:
        if p.shape[:axis] != whole.shape[:axis] or p.shape[axis + 1:] != whole.shape[axis + 1:]:
            raise ValueError(f"concat: piece shape {p.shape} does not fit {whole.shape} on axis {axis}")
        k = math.prod(p.shape[axis:])
        views.append(p.reshape(rows, k))
        offsets.append(c0)
        c0 += k
    width = math.prod(whole.shape[axis:])
    if c0 != width:
        raise ValueError(f"concat: pieces are {c0} wide on axis {axis}, output is {width}")
    return views, whole.reshape(rows, width), offsets


def concat_forward(xs, out, axis: int = 1, threads: int | None = None) -> None:
    """out = concatenate(xs, axis): xs (B, K_i) or (B, S_i, V) (axis 1) or (B, S, V_i) (axis 2)."""
    views, out2, offsets = _block_views(xs, out, axis)
    for x2, c0 in zip(views, offsets):
        launch_1d(concat_copy_in_kernel, x2.size, x2, out2, c0, threads=threads)


def concat_backward(dy, dxs, axis: int = 1, threads: int | None = None) -> None:
    """dxs[i] = the slice of dy that input i was copied into (overwrites every dxs[i])."""
    views, dy2, offsets = _block_views(dxs, dy, axis)
    for dx2, c0 in zip(views, offsets):
        launch_1d(concat_copy_out_kernel, dx2.size, dy2, dx2, c0, threads=threads)


PTX_CHECKS = [
    (concat_copy_in_kernel, "void(float32[:, ::1], float32[:, ::1], int64)"),
    (concat_copy_out_kernel, "void(float32[:, ::1], float32[:, ::1], int64)"),
    (concat_copy_in_kernel, "void(float16[:, ::1], float16[:, ::1], int64)"),     # mixed precision on gpu/sim
    (concat_copy_out_kernel, "void(float16[:, ::1], float16[:, ::1], int64)"),
]
