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

Compiled CPU versions (numba.njit, the cpu device's path): row-major passes over fixed chunks of rows
(kernels/parallel_cpu.py), the per-feature sums as one partial row per chunk added in chunk order (the
same bits at any thread count); the forward in three passes (sum, squared deviations, y), the default
backward in two (the sums of a and a * s, then dx), HugeCTR's formula in one. The sigmoid's ``exp(-|s|)``
is ``_exp_neg``, a polynomial that LLVM vectorizes: a libm ``expf`` call per element kept the loops scalar
and cost more than NumPy's reference (0.5 ms for 256 x 280 elements; 0.03 ms vectorized).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, njit, prange
from numba import types as nt
from numba.extending import intrinsic

from .launch import check_block_size, launch_rows, REDUCE_THREADS
from .block_reduce import block_sum2, column_mean_var
from .parallel_cpu import PARALLEL_MIN, ROW_CHUNK, pjit, sum_partials

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


# ---- compiled CPU versions (numba.njit; the cpu device; work split by parallel_cpu) ----------------
# error_model="numpy": a float division is a plain division (Python's model tests every divisor for 0 and
# raises, a branch that keeps LLVM from vectorizing the loop)
_JIT = dict(cache=True, error_model="numpy")


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the low 32 bits of the integer bits (a bitcast, vectorizable)."""
    if not isinstance(bits, nt.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], context.get_value_type(nt.int32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, context.get_value_type(nt.float32))
    return nt.float32(bits), codegen


@njit(inline="always", **_JIT)
def _exp_neg(x):
    """e^x for float32 x <= 0 within 1 ulp (Cephes' expf: x = k ln2 + r, ``|r| <= ln2 / 2``, a degree-7
    polynomial for e^r, times 2^k built from its exponent bits); 0 at and below -87.3, where e^x would not
    be a normal float32; NaN stays NaN."""
    k = np.floor(x * float32(1.44269504) + float32(0.5))            # round(x / ln 2)
    r = x - k * float32(0.693359375) - k * float32(-2.12194440e-4)   # ln 2 in two parts: r exact
    p = float32(1.9875691500e-4)
    p = p * r + float32(1.3981999507e-3)
    p = p * r + float32(8.3334519073e-3)
    p = p * r + float32(4.1665795894e-2)
    p = p * r + float32(1.6666665459e-1)
    p = p * r + float32(5.0000001201e-1)
    er = p * r * r + r + float32(1.0)
    two_k = _f32_from_bits((np.int32(k) + np.int32(127)) << np.int32(23))
    return float32(0.0) if x <= float32(-87.3) else er * two_k


@njit(inline="always", **_JIT)
def _sigmoid_cpu(s):
    # the reference's formula: 1 / (1 + e) for s >= 0, e / (1 + e) below, e = e^-|s| in (0, 1]
    e = _exp_neg(-abs(s))
    num = float32(1.0) if s >= float32(0.0) else e
    return num / (float32(1.0) + e)


@njit(inline="always", **_JIT)
def _col_sums_chunk(x, centre, squares, part, c):
    """part[c] = column sums of x's rows in chunk c: of x (squares False) or of (x - centre)^2."""
    p = part[c]
    for f in range(p.shape[0]):
        p[f] = float32(0.0)
    for m in range(c * ROW_CHUNK, min(x.shape[0], (c + 1) * ROW_CHUNK)):
        row = x[m]
        if squares:
            for f in range(p.shape[0]):
                d = row[f] - centre[f]
                p[f] += d * d
        else:
            for f in range(p.shape[0]):
                p[f] += row[f]


@njit(inline="always", **_JIT)
def _forward_chunk(x, alpha, mean, inv, y, c):
    one_a = float32(1.0) - alpha
    for m in range(c * ROW_CHUNK, min(x.shape[0], (c + 1) * ROW_CHUNK)):
        xr, yr = x[m], y[m]
        for f in range(xr.shape[0]):
            p = _sigmoid_cpu((xr[f] - mean[f]) * inv[f])
            yr[f] = xr[f] * (alpha + one_a * p)


@pjit(**_JIT)
def _dice_forward_cpu(x, alpha, eps, y, mean, inv, part):
    # part (chunks, F): scratch for the column sums
    rows, chunks, big = x.shape[0], part.shape[0], x.size >= PARALLEL_MIN
    for squares in (False, True):           # the sums of x, then of (x - mean)^2 (two passes, as the reference)
        if big:
            for c in prange(chunks):
                _col_sums_chunk(x, mean, squares, part, c)
        else:
            for c in range(chunks):
                _col_sums_chunk(x, mean, squares, part, c)
        if not squares:
            sum_partials(part, mean)
            for f in range(mean.shape[0]):
                mean[f] = mean[f] / float32(rows)
        else:
            sum_partials(part, inv)
            for f in range(inv.shape[0]):
                ve = inv[f] / float32(rows) + eps   # the variance + eps
                inv[f] = float32(0.0) if ve < float32(TINY) else float32(1.0) / np.sqrt(ve)
    if big:
        for c in prange(chunks):
            _forward_chunk(x, alpha, mean, inv, y, c)
    else:
        for c in range(chunks):
            _forward_chunk(x, alpha, mean, inv, y, c)


@njit(inline="always", **_JIT)
def _backward_sums_chunk(x, dy, alpha, mean, inv, part, c):
    """part[c, 0] = sums of a = dy (1 - alpha) x p (1 - p) over chunk c's rows, part[c, 1] of a * s."""
    one = float32(1.0)
    pa, pas = part[c, 0], part[c, 1]
    for f in range(pa.shape[0]):
        pa[f] = float32(0.0)
        pas[f] = float32(0.0)
    for m in range(c * ROW_CHUNK, min(x.shape[0], (c + 1) * ROW_CHUNK)):
        xr, gr = x[m], dy[m]
        for f in range(xr.shape[0]):
            s = (xr[f] - mean[f]) * inv[f]
            p = _sigmoid_cpu(s)
            a = gr[f] * (one - alpha) * xr[f] * p * (one - p)
            pa[f] += a
            pas[f] += a * s


@njit(inline="always", **_JIT)
def _backward_chunk(x, dy, alpha, mean, inv, exact, mean_a, mean_as, dx, c):
    one = float32(1.0)
    nb = float32(x.shape[0])
    for m in range(c * ROW_CHUNK, min(x.shape[0], (c + 1) * ROW_CHUNK)):
        xr, gr, dr = x[m], dy[m], dx[m]
        if exact:
            for f in range(xr.shape[0]):
                v, iv = xr[f], inv[f]
                p = _sigmoid_cpu((v - mean[f]) * iv)
                ys_s = (one / nb - one) * iv - (one / nb) * (mean[f] - v) * (v - mean[f]) * (iv * iv * iv)
                ps_s = -p * (one - p) * ys_s
                dr[f] = ((ps_s * v + p) * (one - alpha) + alpha) * gr[f]
        else:
            for f in range(xr.shape[0]):
                s = (xr[f] - mean[f]) * inv[f]
                p = _sigmoid_cpu(s)
                a = gr[f] * (one - alpha) * xr[f] * p * (one - p)
                dr[f] = gr[f] * (alpha + (one - alpha) * p) + inv[f] * (a - mean_a[f] - s * mean_as[f])


@pjit(**_JIT)
def _dice_backward_cpu(x, dy, alpha, mean, inv, exact, dx, part, means):
    # part (chunks, 2, F) and means (2, F): scratch for the sums of a and a * s (the default formula only)
    chunks = (x.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    big = x.size >= PARALLEL_MIN
    if not exact:
        if big:
            for c in prange(chunks):
                _backward_sums_chunk(x, dy, alpha, mean, inv, part, c)
        else:
            for c in range(chunks):
                _backward_sums_chunk(x, dy, alpha, mean, inv, part, c)
        sum_partials(part.reshape(chunks, -1), means.reshape(-1))
        for k in range(means.shape[1]):
            means[0, k] = means[0, k] / float32(x.shape[0])
            means[1, k] = means[1, k] / float32(x.shape[0])
    if big:
        for c in prange(chunks):
            _backward_chunk(x, dy, alpha, mean, inv, exact, means[0], means[1], dx, c)
    else:
        for c in range(chunks):
            _backward_chunk(x, dy, alpha, mean, inv, exact, means[0], means[1], dx, c)


def _check_dice_cpu(name, x, *others):
    if x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise ValueError(f"{name}: x must be a C-contiguous float32 (B, F) array, got {x.dtype} {x.shape}")
    for label, a, shape in others:
        if a.shape != shape or a.dtype != np.float32:
            raise ValueError(f"{name}: {label} must be float32 {shape} (x {x.shape}), got {a.dtype} {a.shape}")


def prelu_dice_forward_cpu(x, alpha, eps, y, mean_out, inv_out) -> None:
    """prelu_dice_forward compiled for the CPU: y (B, F), mean_out and inv_out (F,) written (float32)."""
    b, f = x.shape
    _check_dice_cpu("prelu_dice_forward_cpu", x, ("y", y, (b, f)), ("mean_out", mean_out, (f,)),
                    ("inv_out", inv_out, (f,)))
    if b == 0 or f == 0:
        return
    part = np.empty(((b + ROW_CHUNK - 1) // ROW_CHUNK, f), np.float32)
    _dice_forward_cpu(x, np.float32(alpha), np.float32(eps), y, mean_out, inv_out, part)


def prelu_dice_backward_cpu(x, dy, alpha, mean, inv, hugectr_exact, dx) -> None:
    """prelu_dice_backward compiled for the CPU: dx (B, F) written (float32); hugectr_exact picks HugeCTR's
    diagonal formula."""
    b, f = x.shape
    _check_dice_cpu("prelu_dice_backward_cpu", x, ("dy", dy, (b, f)), ("dx", dx, (b, f)), ("mean", mean, (f,)),
                    ("inv", inv, (f,)))
    if b == 0 or f == 0:
        return
    exact = bool(hugectr_exact)
    part = np.empty((0 if exact else (b + ROW_CHUNK - 1) // ROW_CHUNK, 2, f), np.float32)
    _dice_backward_cpu(x, dy, np.float32(alpha), mean, inv, exact, dx, part, np.empty((2, f), np.float32))


_M, _V, _H = "float32[:, ::1]", "float32[::1]", "float16[:, ::1]"
PTX_CHECKS = [
    (make_dice_forward_kernel(256), f"void({_M}, float32, float32, {_M}, {_V}, {_V})"),
    (make_dice_backward_kernel(256), f"void({_M}, {_M}, float32, {_V}, {_V}, int32, {_M})"),
    (make_dice_forward_kernel(256), f"void({_H}, float32, float32, {_H}, {_V}, {_V})"),     # mixed precision
    (make_dice_backward_kernel(256), f"void({_H}, {_H}, float32, {_V}, {_V}, int32, {_H})"),
]
