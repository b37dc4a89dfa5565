"""Row operations on the table-batched embedding's weights, outside the fused update: scale listed rows, and
move each row's second half towards its first (FBGEMM's global weight decay and EMA in place).

The weights are the engine's flat buffer (kernels/tbe.py's layout): table t's row r starts at element
elem_off[t] + r * strides[t] and holds dims[t] values; its linear row is row_off[t] + r.

    scale_rows   w[row, d] = f_i w[row, d] for every listed linear row rows[i] (distinct; -1: skipped) and
                 d < D_t, in float32, rounded once to the weights' precision (float16: to nearest even)
    lerp_halves  every row of every table (D_t even, h = D_t / 2), slow = w[row, h:], fast = w[row, :h]:
                 slow = slow + c (fast - slow)      where |c| < 1/2
                 slow = fast - (fast - slow)(1 - c) otherwise
                 in float32 and rounded once (float16: to nearest even): torch.lerp_'s formula and rounding
Why here and not in the fused update: they are FBGEMM's rules around its optimizer (the decay of the rows a
lookup reads before it reads them, the EMA every step_ema iterations), each one pass over rows, so every
device runs the same op without a host round trip.

Three versions of each, one result: the NumPy reference (*_ref, in place on NumPy arrays; float16 weights as
float16), the compiled CPU code (*_cpu, numba.njit; float16 weights as their uint16 bits) and the numba.cuda
kernels (make_*_kernel, launched by scale_rows / lerp_halves; grid-stride over (row, column) pairs; the
launch wrappers allocate nothing).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, njit, uint64

from .launch import launch_1d
from .tbe import _load16, _load32, _sig, _store16, _store32, _table_of, make_update_kernel
from .tbe_cpu import load, store, table_of
from .tbe_math import Optim

_JIT = dict(cache=True, error_model="numpy")
_device = functools.partial(cuda.jit, device=True, inline=True)


# ---- NumPy reference --------------------------------------------------------------------------------
def _row_view(w, elem_off, strides, dims, t: int):
    """(V_t, D_t) view of table t in the flat buffer w."""
    lo, hi = int(elem_off[t]), int(elem_off[t + 1])
    stride = int(strides[t])
    rows = (hi - lo) // stride if stride else 0
    return w[lo:lo + rows * stride].reshape(rows, stride)[:, :int(dims[t])]


def scale_rows_ref(w, elem_off, strides, dims, row_off, rows, factors) -> None:
    """In place: each listed linear row (rows (U,) int64, -1 skipped) times factors (U,) float32."""
    rows = np.asarray(rows, np.int64)
    factors = np.asarray(factors, np.float32)
    table = np.searchsorted(np.asarray(row_off), rows, side="right") - 1
    for t in range(len(dims)):
        pick = (rows >= 0) & (table == t)
        if not pick.any():
            continue
        view = _row_view(w, elem_off, strides, dims, t)
        r = rows[pick] - int(row_off[t])
        with np.errstate(over="ignore"):
            view[r] = (view[r].astype(np.float32) * factors[pick][:, None]).astype(w.dtype)


def lerp_rows_ref(view, coef: float) -> None:
    """In place on one (V, D) NumPy array (D even): each row's second half lerped towards its first by coef."""
    c = np.float32(coef)
    h = view.shape[1] // 2
    a, b = view[:, h:2 * h].astype(np.float32), view[:, :h].astype(np.float32)
    diff = b - a
    with np.errstate(over="ignore", invalid="ignore"):
        out = a + c * diff if abs(c) < 0.5 else b - diff * (np.float32(1.0) - c)
        view[:, h:2 * h] = out.astype(view.dtype)


def lerp_halves_ref(w, elem_off, strides, dims, coef: float) -> None:
    """In place: every row's second half lerped towards its first half by coef (torch.lerp_'s formula)."""
    for t in range(len(dims)):
        lerp_rows_ref(_row_view(w, elem_off, strides, dims, t), coef)


# ---- compiled CPU (numba.njit; float16 weights as uint16 bits) ---------------------------------------
@njit(**_JIT)
def scale_rows_cpu(w, elem_off, strides, dims, row_off, rows, factors):
    for i in range(rows.shape[0]):
        lin = rows[i]
        if lin < 0:
            continue
        t = table_of(lin, row_off)
        e0 = elem_off[t] + (lin - row_off[t]) * strides[t]
        f = factors[i]
        for d in range(dims[t]):
            store(w, e0 + d, load(w, e0 + d) * f, uint64(0), False)


@njit(**_JIT)
def lerp_halves_cpu(w, elem_off, strides, dims, row_off, coef):
    c = float32(coef)
    near = abs(c) < float32(0.5)
    for t in range(dims.shape[0]):
        h = dims[t] // 2
        for r in range(row_off[t + 1] - row_off[t]):
            e0 = elem_off[t] + r * strides[t]
            for d in range(h):
                a = load(w, e0 + h + d)
                b = load(w, e0 + d)
                diff = b - a
                v = a + c * diff if near else b - diff * (float32(1.0) - c)
                store(w, e0 + h + d, v, uint64(0), False)


# ---- numba.cuda kernels ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def make_scale_rows_kernel(w_half: bool):
    """scale_rows: item i is (listed row i // max_dim, column i % max_dim); columns past D_t do nothing."""
    load_, store_ = (_load16, _store16) if w_half else (_load32, _store32)

    @cuda.jit
    def scale_rows_kernel(w, elem_off, strides, dims, row_off, rows, factors, max_dim):
        n = rows.shape[0] * max_dim
        for i in range(cuda.grid(1), n, cuda.gridsize(1)):
            u = i // max_dim
            d = i - u * max_dim
            lin = rows[u]
            if lin >= 0:
                t = _table_of(lin, row_off)
                if d < dims[t]:
                    e = elem_off[t] + (lin - row_off[t]) * strides[t] + d
                    store_(w, e, load_(w, e) * factors[u], uint64(0), False)

    return scale_rows_kernel


@functools.lru_cache(maxsize=None)
def make_lerp_halves_kernel(w_half: bool):
    """lerp_halves: item i is (linear row i // half_max, column i % half_max of its second half)."""
    load_, store_ = (_load16, _store16) if w_half else (_load32, _store32)

    @cuda.jit
    def lerp_halves_kernel(w, elem_off, strides, dims, row_off, coef, half_max):
        n = row_off[row_off.shape[0] - 1] * half_max
        near = abs(coef) < float32(0.5)
        for i in range(cuda.grid(1), n, cuda.gridsize(1)):
            lin = i // half_max
            d = i - lin * half_max
            t = _table_of(lin, row_off)
            h = dims[t] // 2
            if d < h:
                e0 = elem_off[t] + (lin - row_off[t]) * strides[t]
                a = load_(w, e0 + h + d)
                b = load_(w, e0 + d)
                diff = b - a
                v = a + coef * diff if near else b - diff * (float32(1.0) - coef)
                store_(w, e0 + h + d, v, uint64(0), False)

    return lerp_halves_kernel


def scale_rows(w, elem_off, strides, dims, row_off, rows, factors, w_half: bool, max_dim: int) -> None:
    """scale_rows on the device: w the weights (float32, or float16 as uint16 bits), rows (U,) int64,
    factors (U,) float32, max_dim the widest table's D (the host knows it)."""
    launch_1d(make_scale_rows_kernel(bool(w_half)), int(rows.shape[0]) * int(max_dim), w, elem_off, strides, dims,
              row_off, rows, factors, np.int64(max_dim))


def lerp_halves(w, elem_off, strides, dims, row_off, total_rows: int, coef: float, w_half: bool,
                max_dim: int) -> None:
    """lerp_halves on the device; total_rows = row_off[-1] and max_dim from the caller's host copies."""
    half = max(int(max_dim) // 2, 1)
    launch_1d(make_lerp_halves_kernel(bool(w_half)), int(total_rows) * half, w, elem_off, strides, dims, row_off,
              np.float32(coef), np.int64(half))


_F1, _U16, _I1 = "float32[::1]", "uint16[::1]", "int64[::1]"
PTX_CHECKS = [
    (make_scale_rows_kernel(wh), _sig(_U16 if wh else _F1, _I1, _I1, _I1, _I1, _I1, _F1, "int64"))
    for wh in (False, True)
] + [
    (make_lerp_halves_kernel(wh), _sig(_U16 if wh else _F1, _I1, _I1, _I1, _I1, "float32", "int64"))
    for wh in (False, True)
] + [
    # kernels/tbe.py's update kernel compiled for HUGECTR_FTRL (the variant the engine launches for it)
    (make_update_kernel(False, 32, 8, 4, int(Optim.HUGECTR_FTRL), 0),
     _sig(_F1, _F1, _F1, _F1, _I1, _F1, _F1, *[_I1] * 11, _F1, "boolean", _F1, _F1, _I1, "uint64[::1]", _I1,
          "float32[:, ::1]", _I1, "boolean")),
]
