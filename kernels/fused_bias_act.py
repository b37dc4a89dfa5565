"""Fused epilogue of a fully connected layer (the matmul itself is the caller's, with the array library).

    forward:  y[m, n] = act(y[m, n] + b[n])          # y (M, N) = X·W in place; b (N,); act: ReLU or identity
    backward: d[m, n] = dy[m, n] * (y[m, n] > 0)      # the ReLU mask read from the OUTPUT (y > 0 <=> pre > 0)
              db[n]   = sum_m d[m, n]                 # in the same kernel (overwritten)

has_bias = 0 skips the bias (MLP's use_bias=False); relu = 0 is the identity (Activation_t.Non).

HugeCTR: HugeCTR/src/layers/mlp_layer.cu and fused_relu_bias_fully_connected_layer.cu (cuBLASLt GEMM
with the bias+ReLU epilogue; the backward's dReLU + bias-gradient epilogue).

The backward reads and writes whole rows: a block is TILE_C consecutive columns (coalesced) by TILE_R threads
down CHUNK rows; it writes the masked gradient and one partial column sum per chunk, and a second kernel adds
the chunks' partials up in order (deterministic, no atomics; HugeCTR reduces the bias gradient by columns too).

Compiled CPU versions (numba.njit, the cpu device's path), over fixed chunks of rows (kernels/parallel_cpu.py):
the forward (a NaN stays NaN, as in the reference); the backward's mask and bias gradient in one pass, the
column sums as bias.py's (one partial row per chunk, added in chunk order: the same at any thread count).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, njit, prange

from .bias import masked_column_sums
from .launch import launch_1d
from .parallel_cpu import PARALLEL_MIN, ROW_CHUNK, pjit, sum_partials


# ---- NumPy reference -------------------------------------------------------------------------
def bias_act_forward_ref(y, b=None, relu=True):
    """act(y + b) for y (M, N), b (N,) or None."""
    out = y + b if b is not None else y
    return np.maximum(out, out.dtype.type(0)) if relu else out


def bias_act_backward_ref(y, dy, relu=True, has_bias=True):
    """Returns (d_pre (M, N), db (N,) or None) given the forward's OUTPUT y."""
    d = np.where(y > 0, dy, dy.dtype.type(0)) if relu else dy
    return d, (d.sum(axis=0) if has_bias else None)


# ---- kernels ---------------------------------------------------------------------------------
@cuda.jit
def bias_act_forward_kernel(y, b, has_bias, relu):
    # y: flat (M*N,) view, b: (N,) (may be empty when has_bias == 0)
    n = b.shape[0]
    for i in range(cuda.grid(1), y.shape[0], cuda.gridsize(1)):
        v = float32(y[i])                   # a float16 y (mixed precision): computed in float32
        if has_bias != 0:
            v += b[i % n]
        if relu != 0 and v < float32(0.0):
            v = float32(0.0)
        y[i] = v


# ---- launch wrappers (contiguous float32; allocate nothing) ----------------------------------
@functools.lru_cache(maxsize=None)
def _placeholder():
    """A 1-element device array standing in for an absent b/db (the kernels never touch it when
    has_bias == 0). Allocated once. Not an alias of y/d: the simulator copies every argument back
    after a launch, so passing one array twice would let the stale copy overwrite the results."""
    return cuda.device_array(1, np.float32)


def bias_act_forward(y, b, relu: bool) -> None:
    """In place: y (M, N) = act(y + b); b None for no bias."""
    if b is not None and y.shape[-1] != b.size:
        raise ValueError(f"bias_act_forward: y {y.shape} does not end in the bias width {b.size}")
    if b is None and not relu:
        return
    launch_1d(bias_act_forward_kernel, y.size, y.reshape(-1), b if b is not None else _placeholder(),
              np.int32(b is not None), np.int32(bool(relu)))


def bias_act_backward(y, dy, relu: bool, d, db=None, chunk: int | None = None, grid=None) -> None:
    """d (M, N) = dy masked by y > 0 (if relu); db (N,) = column sums of d (if db is given): the bias
    gradient's coalesced tiled pass with the mask and d added (kernels/bias.masked_column_sums)."""
    masked_column_sums(y, dy, relu, d, db, chunk, grid)


# ---- compiled CPU versions (numba.njit; the cpu device) -------------------------------------------
_NO_BIAS = np.zeros(0, np.float32)     # stands in for an absent b / db (never indexed: has_bias is False)


@njit(cache=True, inline="always")
def _forward_rows(y, b, has_bias, relu, c):
    for m in range(c * ROW_CHUNK, min(y.shape[0], (c + 1) * ROW_CHUNK)):
        row = y[m]
        for k in range(row.shape[0]):
            v = row[k]
            if has_bias:
                v += b[k]
            if relu and v < float32(0.0):
                v = float32(0.0)
            row[k] = v


@njit(cache=True, inline="always")
def _backward_rows(y, dy, relu, d, part, has_bias, c):
    for m in range(c * ROW_CHUNK, min(y.shape[0], (c + 1) * ROW_CHUNK)):
        yr, gr, dr = y[m], dy[m], d[m]
        for k in range(dr.shape[0]):
            g = gr[k]
            if relu and not yr[k] > float32(0.0):
                g = float32(0.0)
            dr[k] = g
        if has_bias:
            p = part[c]
            for k in range(dr.shape[0]):
                p[k] += dr[k]


@pjit(cache=True)
def _bias_act_forward_cpu(y, b, has_bias, relu):
    chunks = (y.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    if y.size < PARALLEL_MIN:
        for c in range(chunks):
            _forward_rows(y, b, has_bias, relu, c)
    else:
        for c in prange(chunks):
            _forward_rows(y, b, has_bias, relu, c)


@pjit(cache=True)
def _bias_act_backward_cpu(y, dy, relu, d, db, has_bias):
    chunks = (y.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    part = np.zeros((chunks if has_bias else 0, y.shape[1]), np.float32)        # (chunks, N)
    if y.size < PARALLEL_MIN:
        for c in range(chunks):
            _backward_rows(y, dy, relu, d, part, has_bias, c)
    else:
        for c in prange(chunks):
            _backward_rows(y, dy, relu, d, part, has_bias, c)
    if has_bias:
        sum_partials(part, db)


def bias_act_forward_cpu(y, b, relu: bool) -> None:
    """bias_act_forward compiled for the CPU: in place y (M, N) = act(y + b); b None for no bias."""
    if b is not None and y.shape[-1] != b.size:
        raise ValueError(f"bias_act_forward: y {y.shape} does not end in the bias width {b.size}")
    if (b is None and not relu) or y.size == 0:
        return
    _bias_act_forward_cpu(y, _NO_BIAS if b is None else b, b is not None, bool(relu))


def bias_act_backward_cpu(y, dy, relu: bool, d, db=None) -> None:
    """bias_act_backward compiled for the CPU: d (M, N) = dy masked by y > 0 (if relu); db (N,) = column
    sums of d (if db is given, overwritten). d may be dy (each element is read before it is written)."""
    _bias_act_backward_cpu(y, dy, bool(relu), d, _NO_BIAS if db is None else db, db is not None)


PTX_CHECKS = [
    (bias_act_forward_kernel, "void(float32[::1], float32[::1], int32, int32)"),
    # mixed precision on gpu/sim: float16 activations and gradients, float32 bias and its gradient
    (bias_act_forward_kernel, "void(float16[::1], float32[::1], int32, int32)"),
]
