"""Slice (column ranges of the last dim) and Select / Gather (index lists along one dim).

Slice, x viewed as (R, W) with R = prod of the leading dims, ranges [a_i, b_i) (overlaps allowed):

    forward:  y_i[r, c] = x[r, a_i + c]                      # y_i (R, b_i - a_i)
    backward: dx = 0;  dx[r, a_i + c] += dy_i[r, c]  for each i (overlapping pieces add)

Select along ``dim`` with index list idx (K entries, duplicates allowed), x viewed as (P, N, Q):
P = prod(shape[:dim]), N = shape[dim], Q = prod(shape[dim+1:]):

    forward:  y[p, k, q] = x[p, idx[k], q]                   # y (P, K, Q)
    backward: dx = 0;  dx[p, idx[k], q] += dy[p, k, q]       # unselected entries get 0

Gather (rows of a (B, K) input) is Select with dim 0; Reshape with selected slots is Select with
dim 1 on (B, S, V) followed by a free reshape to (B, K*V).

HugeCTR: HugeCTR/src/layers/slice_layer.cu, select_layer.cu, gather_layer.cu and reshape_layer.cu
(selected slots). HugeCTR's Select/Gather/Reshape backward writes (=) without zeroing the rest and
races on duplicate indices; here unselected entries are 0 and duplicates add (atomic add).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from .launch import launch_1d


# ---- NumPy reference -------------------------------------------------------------------------
def slice_forward_ref(x: np.ndarray, ranges) -> list:
    """One copy of x[..., a:b] per range (a, b)."""
    return [np.array(x[..., a:b]) for a, b in ranges]


def slice_backward_ref(dys, ranges, in_shape) -> np.ndarray:
    """dX (in_shape): zero, then add each dY_i into its columns [a_i, b_i)."""
    dx = np.zeros(tuple(in_shape), dtype=np.result_type(*dys))
    for dy, (a, b) in zip(dys, ranges):
        dx[..., a:b] += dy
    return dx


def select_view(shape, dim: int) -> tuple[int, int, int]:
    """(P, N, Q): the sizes before, on and after ``dim`` of a row-major ``shape``."""
    return math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:])


def select_forward_ref(x: np.ndarray, dim: int, index) -> np.ndarray:
    """x with ``dim`` replaced by len(index): entries index[k] of that dim, in order."""
    return np.take(x, np.asarray(index, dtype=np.int64), axis=dim)


def select_backward_ref(dy: np.ndarray, in_shape, dim: int, index) -> np.ndarray:
    """dX (in_shape): zero, dy's pieces added back at their indices (duplicates add)."""
    p, n, q = select_view(in_shape, dim)
    k = len(index)
    dx = np.zeros((p, n, q), dtype=dy.dtype)
    np.add.at(dx, (slice(None), np.asarray(index, dtype=np.int64)), dy.reshape(p, k, q))
    return dx.reshape(tuple(in_shape))


# ---- kernels ---------------------------------------------------------------------------------
@cuda.jit
def fill_zero_kernel(a):
    # a: flat (n,)
    for i in range(cuda.grid(1), a.shape[0], cuda.gridsize(1)):
        a[i] = float32(0.0)


@cuda.jit
def slice_copy_kernel(x, y, a):
    # x (R, W) columns [a, a + w) -> y (R, w)
    w = y.shape[1]
    for k in range(cuda.grid(1), y.shape[0] * w, cuda.gridsize(1)):
        r = k // w
        c = k - r * w
        y[r, c] = x[r, a + c]


@cuda.jit
def slice_add_kernel(dy, dx, a):
    # dx[:, a:a+w] += dy (R, w). Within one launch each dx element is touched once: no race.
    w = dy.shape[1]
    for k in range(cuda.grid(1), dy.shape[0] * w, cuda.gridsize(1)):
        r = k // w
        c = k - r * w
        dx[r, a + c] = float32(dx[r, a + c]) + float32(dy[r, c])     # float16 pieces: added in float32


@cuda.jit
def select_gather_kernel(x, idx, y):
    # x (P, N, Q), idx (K,) int64, y (P, K, Q)
    kk, q = y.shape[1], y.shape[2]
    for e in range(cuda.grid(1), y.shape[0] * kk * q, cuda.gridsize(1)):
        p = e // (kk * q)
        rest = e - p * kk * q
        k = rest // q
        j = rest - k * q
        y[p, k, j] = x[p, idx[k], j]


@cuda.jit
def select_scatter_add_kernel(dy, idx, dx):
    # dx (P, N, Q) must be zeroed first; dy (P, K, Q). Duplicate indices hit one dx entry from several
    # threads, hence the atomic add.
    kk, q = dy.shape[1], dy.shape[2]
    for e in range(cuda.grid(1), dy.shape[0] * kk * q, cuda.gridsize(1)):
        p = e // (kk * q)
        rest = e - p * kk * q
        k = rest // q
        j = rest - k * q
        cuda.atomic.add(dx, (p, idx[k], j), dy[p, k, j])


# ---- launch wrappers (allocate nothing; arrays are contiguous float32, idx int64) -------------
def _rows(a):
    """(R, W) view: the last dim against all leading dims."""
    return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])


def fill_zero(a, threads: int | None = None) -> None:
    launch_1d(fill_zero_kernel, a.size, a.reshape(-1), threads=threads)


def slice_forward(x, ys, starts, threads: int | None = None) -> None:
    """ys[i] = x[..., starts[i] : starts[i] + ys[i].shape[-1]] (overwrites every ys[i])."""
    x2 = _rows(x)
    for y, a in zip(ys, starts):
        y2 = _rows(y)
        if y2.shape[0] != x2.shape[0] or not 0 <= a <= a + y2.shape[1] <= x2.shape[1]:
            raise ValueError(f"slice: piece {y.shape} at column {a} does not fit x {x.shape}")
        launch_1d(slice_copy_kernel, y2.size, x2, y2, a, threads=threads)


def slice_backward(dys, dx, starts, threads: int | None = None) -> None:
    """dx = 0, then dx[..., a_i : a_i + w_i] += dys[i]; a dys[i] of None adds nothing."""
    fill_zero(dx, threads)
    dx2 = _rows(dx)
    for dy, a in zip(dys, starts):
        if dy is None:
            continue
        dy2 = _rows(dy)
        if dy2.shape[0] != dx2.shape[0] or not 0 <= a <= a + dy2.shape[1] <= dx2.shape[1]:
            raise ValueError(f"slice: piece {dy.shape} at column {a} does not fit dx {dx.shape}")
        launch_1d(slice_add_kernel, dy2.size, dy2, dx2, a, threads=threads)


def select_forward(x, idx, y, dim: int, threads: int | None = None) -> None:
    """y = x's entries idx[k] along ``dim`` (idx: int64 device array of K in-range indices)."""
    p, n, q = select_view(x.shape, dim)
    if y.size != p * idx.size * q:
        raise ValueError(f"select: y {y.shape} does not fit x {x.shape} with {idx.size} indices on dim {dim}")
    launch_1d(select_gather_kernel, y.size, x.reshape(p, n, q), idx, y.reshape(p, idx.size, q),
              threads=threads)


def select_backward(dy, idx, dx, dim: int, threads: int | None = None) -> None:
    """dx = 0 except at the selected entries, which receive the sum of their dy pieces."""
    p, n, q = select_view(dx.shape, dim)
    if dy.size != p * idx.size * q:
        raise ValueError(f"select: dy {dy.shape} does not fit dx {dx.shape} with {idx.size} indices")
    fill_zero(dx, threads)
    launch_1d(select_scatter_add_kernel, dy.size, dy.reshape(p, idx.size, q), idx, dx.reshape(p, n, q),
              threads=threads)


PTX_CHECKS = [
    (fill_zero_kernel, "void(float32[::1])"),
    (slice_copy_kernel, "void(float32[:, ::1], float32[:, ::1], int64)"),
    (slice_add_kernel, "void(float32[:, ::1], float32[:, ::1], int64)"),
    (select_gather_kernel, "void(float32[:, :, ::1], int64[::1], float32[:, :, ::1])"),
    (select_scatter_add_kernel, "void(float32[:, :, ::1], int64[::1], float32[:, :, ::1])"),
    # mixed precision on gpu/sim: Slice takes float16 tensors
    (fill_zero_kernel, "void(float16[::1])"),
    (slice_copy_kernel, "void(float16[:, ::1], float16[:, ::1], int64)"),
    (slice_add_kernel, "void(float16[:, ::1], float16[:, ::1], int64)"),
]
