"""PReLU_Dice (DIN's Dice activation): per-feature batch statistics, in training AND inference.

    x (B, F); m = B; per feature f (sums over the batch b):
    E[f]   = mean_b x                    Var[f] = mean_b (x - E)^2   (biased)
    inv[f] = 1 / sqrt(Var + eps)         (0 when Var + eps < 1e-8, as HugeCTR)
    s      = (x - E) * inv               p = sigmoid(s)
    y      = p * x + (1 - p) * alpha * x = x * (alpha + (1 - alpha) * p)

Backward, default (the full derivative, through E and Var):
    a      = dy * (1 - alpha) * x * p * (1 - p)
    dx     = dy * (alpha + (1 - alpha) * p) + inv * (a - mean_b(a) - s * mean_b(a * s))
Backward under numbactr.hugectr_exact.hugectr_exact() (HugeCTR's formula, spec §6.2):
    ys = (E - x) * inv;  ys_s = (1/m - 1) * inv - (1/m) * (E - x) * (x - E) * inv^3
    ps = 1 / (1 + e^ys) (= p);  ps_s = -e^ys * ys_s / (1 + e^ys)^2 (= -p (1-p) ys_s)
    dx = ((ps_s * x + ps) * (1 - alpha) + alpha) * dy
HugeCTR's dx is only the DIAGONAL of the Jacobian (dy_i/dx_i including the x_i-dependence of E and
Var): it drops every cross term dy_j/dx_i, j != i, so it is not the gradient (the float64
central-difference check fails for it and passes for the default; tests/test_layers_norm.py).

HugeCTR: HugeCTR/src/layers/prelu_dice_layer.cu (HugeCTR computes Var = E[x^2] - E^2; the two-pass
form here is the same number without the cancellation).

Kernels: one block per feature, threads stride over the batch, shared-memory tree reductions
(tpb a power of two <= 1024).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from .launch import check_block_size, launch_rows, REDUCE_THREADS
from .block_reduce import block_sum2, column_mean_var

TINY = 1e-8


# ---- NumPy reference -------------------------------------------------------------------------
def _sigmoid(s):
    e = np.exp(-np.abs(s))
    return np.where(s >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def prelu_dice_forward_ref(x, alpha, eps):
    """Returns (y, E (F,), inv (F,)) for x (B, F)."""
    mean = x.mean(axis=0)
    var = ((x - mean) ** 2).mean(axis=0)
    ve = var + eps
    inv = np.where(ve < TINY, 0.0, 1.0 / np.sqrt(np.maximum(ve, TINY)))
    p = _sigmoid((x - mean) * inv)
    return x * (alpha + (1 - alpha) * p), mean, inv


def prelu_dice_backward_ref(x, dy, alpha, mean, inv, hugectr_exact=False):
    m = x.shape[0]
    s = (x - mean) * inv
    p = _sigmoid(s)
    if hugectr_exact:
        ys_s = (1.0 / m - 1.0) * inv - (1.0 / m) * (mean - x) * (x - mean) * inv ** 3
        ps_s = -p * (1 - p) * ys_s
        return ((ps_s * x + p) * (1 - alpha) + alpha) * dy
    a = dy * (1 - alpha) * x * p * (1 - p)
    return dy * (alpha + (1 - alpha) * p) + inv * (a - a.mean(axis=0) - s * (a * s).mean(axis=0))


# ---- kernels ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_dice_forward_kernel(tpb: int):
    check_block_size(tpb)

    @cuda.jit
    def dice_forward_kernel(x, alpha, eps, y, mean_out, inv_out):
        # x, y: (B, F); mean_out, inv_out: (F,)
        part = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        rows = x.shape[0]
        for f in range(cuda.blockIdx.x, x.shape[1], cuda.gridDim.x):   # uniform per block
            mu, var = column_mean_var(x, f, part, t, tpb)
            ve = var + eps
            inv = float32(0.0) if ve < float32(TINY) else float32(1.0) / math.sqrt(ve)
            for m in range(t, rows, tpb):
                v = float32(x[m, f])            # (float16 tensors are read in float32)
                s = (v - mu) * inv
                e = math.exp(-abs(s))
                p = float32(1.0) / (float32(1.0) + e) if s >= float32(0.0) else e / (float32(1.0) + e)
                y[m, f] = v * (alpha + (float32(1.0) - alpha) * p)
            if t == 0:
                mean_out[f] = mu
                inv_out[f] = inv

    return dice_forward_kernel


@functools.lru_cache(maxsize=None)
def make_dice_backward_kernel(tpb: int):
    check_block_size(tpb)

    @cuda.jit
    def dice_backward_kernel(x, dy, alpha, mean, inv, exact, dx):
        # x, dy, dx: (B, F); mean, inv: (F,); exact: 1 = HugeCTR's diagonal formula, 0 = full grad
        s_a = cuda.shared.array(tpb, float32)
        s_as = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        rows = x.shape[0]
        nb = float32(rows)
        one = float32(1.0)
        for f in range(cuda.blockIdx.x, x.shape[1], cuda.gridDim.x):
            mu = mean[f]
            iv = inv[f]
            a1 = float32(0.0)
            a2 = float32(0.0)
            for m in range(t, rows, tpb):
                v = float32(x[m, f])
                s = (v - mu) * iv
                e = math.exp(-abs(s))
                p = one / (one + e) if s >= float32(0.0) else e / (one + e)
                a = float32(dy[m, f]) * (one - alpha) * v * p * (one - p)
                a1 += a
                a2 += a * s
            s_a[t] = a1
            s_as[t] = a2
            block_sum2(s_a, s_as, t, tpb)
            mean_a = s_a[0] / nb
            mean_as = s_as[0] / nb
            cuda.syncthreads()
            for m in range(t, rows, tpb):
                v = float32(x[m, f])
                g = float32(dy[m, f])
                s = (v - mu) * iv
                e = math.exp(-abs(s))
                p = one / (one + e) if s >= float32(0.0) else e / (one + e)
                if exact != 0:
                    ys_s = (one / nb - one) * iv + (one / nb) * s * s * iv
                    ps_s = -p * (one - p) * ys_s
                    dx[m, f] = ((ps_s * v + p) * (one - alpha) + alpha) * g
                else:
                    a = g * (one - alpha) * v * p * (one - p)
                    dx[m, f] = g * (alpha + (one - alpha) * p) + iv * (a - mean_a - s * mean_as)

    return dice_backward_kernel


# ---- launch wrappers (x, y, dy, dx contiguous (B, F) float32; allocate nothing) ----------------
def prelu_dice_forward(x, alpha, eps, y, mean_out, inv_out, threads: int | None = None) -> None:
    if x.shape[0] == 0 or x.shape[1] == 0:
        return
    tpb = threads or REDUCE_THREADS
    launch_rows(make_dice_forward_kernel(tpb), x.shape[1], x, np.float32(alpha), np.float32(eps), y,
                mean_out, inv_out, threads=tpb)


def prelu_dice_backward(x, dy, alpha, mean, inv, hugectr_exact, dx, threads: int | None = None) -> None:
    if x.shape[0] == 0 or x.shape[1] == 0:
        return
    tpb = threads or REDUCE_THREADS
    launch_rows(make_dice_backward_kernel(tpb), x.shape[1], x, dy, np.float32(alpha), mean, inv,
                np.int32(1 if hugectr_exact else 0), dx, threads=tpb)


_M, _V, _H = "float32[:, ::1]", "float32[::1]", "float16[:, ::1]"
PTX_CHECKS = [
    (make_dice_forward_kernel(256), f"void({_M}, float32, float32, {_M}, {_V}, {_V})"),
    (make_dice_backward_kernel(256), f"void({_M}, {_M}, float32, {_V}, {_V}, int32, {_M})"),
    (make_dice_forward_kernel(256), f"void({_H}, float32, float32, {_H}, {_V}, {_V})"),     # mixed precision
    (make_dice_backward_kernel(256), f"void({_H}, {_H}, float32, {_V}, {_V}, int32, {_H})"),
]
