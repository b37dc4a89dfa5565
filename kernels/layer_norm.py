"""LayerNorm over the last dim; leading dims flattened to M rows.

    mu[m]   = mean_h x[m, h]                        # x (M, H) -> mu, inv (M,)
    var[m]  = mean_h (x[m, h] - mu[m])^2            (biased)
    inv[m]  = 1 / sqrt(var[m] + eps)
    xhat    = (x - mu) * inv
    y[m, h] = gamma[h] * xhat[m, h] + beta[h]       # gamma, beta (H,)
    backward, g = dy * gamma:
    dx[m, h]  = inv[m] / H * (H * g[m, h] - sum_h g[m, :] - xhat[m, h] * sum_h (g * xhat)[m, :])
    dgamma[h] = sum_m dy[m, h] * xhat[m, h]         dbeta[h] = sum_m dy[m, h]   (overwritten)

HugeCTR: HugeCTR/src/layers/layer_norm_layer.cu (biased variance, standard LN backward).

Kernels: forward and dx use one block per row (threads stride over H and reduce in shared memory);
dgamma/dbeta use one block per column (threads stride over the M rows). tpb: power of two <= 1024.

Compiled CPU versions (numba.njit, the cpu device's path), over fixed chunks of rows (kernels/parallel_cpu.py):
the forward row by row (mean, then the centred variance, as the reference: no E[x^2] - mu^2 cancellation);
the backward's dx row by row, with dgamma and dbeta as one partial row per chunk added in chunk order, so
1 or N threads give the same bits. Row sums may be reassociated (fastmath reassoc: LLVM vectorizes them).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, njit, prange

from .launch import check_block_size, launch_rows, REDUCE_THREADS
from .block_reduce import block_sum2, row_mean_var
from .parallel_cpu import PARALLEL_MIN, ROW_CHUNK, pjit, sum_partials


# ---- NumPy reference -------------------------------------------------------------------------
def layer_norm_forward_ref(x, gamma, beta, eps):
    """Returns (y, mean (M,), inv (M,)) for x (..., H)."""
    x2 = x.reshape(-1, x.shape[-1])
    mean = x2.mean(axis=1)
    var = ((x2 - mean[:, None]) ** 2).mean(axis=1)
    inv = 1.0 / np.sqrt(var + eps)
    y = gamma * (x2 - mean[:, None]) * inv[:, None] + beta
    return y.reshape(x.shape), mean, inv


def layer_norm_backward_ref(x, dy, gamma, mean, inv):
    """Returns (dx, dgamma, dbeta)."""
    h = x.shape[-1]
    x2, dy2 = x.reshape(-1, h), dy.reshape(-1, h)
    xhat = (x2 - mean[:, None]) * inv[:, None]
    g = dy2 * gamma
    dx = inv[:, None] / h * (h * g - g.sum(axis=1, keepdims=True)
                             - xhat * (g * xhat).sum(axis=1, keepdims=True))
    return dx.reshape(x.shape), (dy2 * xhat).sum(axis=0), dy2.sum(axis=0)


# ---- kernels ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_ln_forward_kernel(tpb: int):
    check_block_size(tpb)

    @cuda.jit
    def ln_forward_kernel(x, gamma, beta, eps, y, mean_out, inv_out):
        # x, y: (M, H); gamma, beta: (H,); mean_out, inv_out: (M,)
        part = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        width = x.shape[1]
        for r in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):   # uniform per block
            mu, var = row_mean_var(x, r, part, t, tpb)
            inv = float32(1.0) / math.sqrt(var + eps)
            for j in range(t, width, tpb):
                y[r, j] = gamma[j] * (float32(x[r, j]) - mu) * inv + beta[j]
            if t == 0:
                mean_out[r] = mu
                inv_out[r] = inv

    return ln_forward_kernel


@functools.lru_cache(maxsize=None)
def make_ln_backward_dx_kernel(tpb: int):
    check_block_size(tpb)

    @cuda.jit
    def ln_backward_dx_kernel(x, dy, gamma, mean, inv, dx):
        # x, dy, dx: (M, H); gamma (H,); mean, inv (M,)
        s_g = cuda.shared.array(tpb, float32)
        s_gx = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        width = x.shape[1]
        nh = float32(width)
        for r in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
            mu = mean[r]
            iv = inv[r]
            a1 = float32(0.0)
            a2 = float32(0.0)
            for j in range(t, width, tpb):
                g = float32(dy[r, j]) * gamma[j]
                a1 += g
                a2 += g * (float32(x[r, j]) - mu) * iv
            s_g[t] = a1
            s_gx[t] = a2
            block_sum2(s_g, s_gx, t, tpb)
            sg = s_g[0]
            sgx = s_gx[0]
            cuda.syncthreads()
            for j in range(t, width, tpb):
                xhat = (float32(x[r, j]) - mu) * iv
                dx[r, j] = iv / nh * (nh * float32(dy[r, j]) * gamma[j] - sg - xhat * sgx)

    return ln_backward_dx_kernel


@functools.lru_cache(maxsize=None)
def make_ln_param_grad_kernel(tpb: int):
    check_block_size(tpb)

    @cuda.jit
    def ln_param_grad_kernel(x, dy, mean, inv, dgamma, dbeta):
        # column sums over the M rows: dgamma[h] = sum dy * xhat, dbeta[h] = sum dy
        s_b = cuda.shared.array(tpb, float32)
        s_g = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        rows = x.shape[0]
        for c in range(cuda.blockIdx.x, x.shape[1], cuda.gridDim.x):
            a1 = float32(0.0)
            a2 = float32(0.0)
            for m in range(t, rows, tpb):
                g = float32(dy[m, c])
                a1 += g
                a2 += g * (float32(x[m, c]) - mean[m]) * inv[m]
            s_b[t] = a1
            s_g[t] = a2
            block_sum2(s_b, s_g, t, tpb)
            if t == 0:
                dbeta[c] = s_b[0]
                dgamma[c] = s_g[0]
            cuda.syncthreads()          # thread 0 reads before the next column overwrites

    return ln_param_grad_kernel


# ---- launch wrappers (x, dy, y, dx are (M, H) contiguous float32; allocate nothing) -----------
def layer_norm_forward(x, gamma, beta, eps, y, mean_out, inv_out, threads: int | None = None) -> None:
    if x.shape[0] == 0 or x.shape[1] == 0:
        return
    tpb = threads or REDUCE_THREADS
    launch_rows(make_ln_forward_kernel(tpb), x.shape[0], x, gamma, beta, np.float32(eps), y, mean_out,
                inv_out, threads=tpb)


def layer_norm_backward(x, dy, gamma, mean, inv, dx, dgamma, dbeta, threads: int | None = None) -> None:
    if x.shape[1] == 0:
        return
    tpb = threads or REDUCE_THREADS
    if x.shape[0] > 0:
        launch_rows(make_ln_backward_dx_kernel(tpb), x.shape[0], x, dy, gamma, mean, inv, dx, threads=tpb)
    launch_rows(make_ln_param_grad_kernel(tpb), x.shape[1], x, dy, mean, inv, dgamma, dbeta, threads=tpb)


# ---- compiled CPU versions (numba.njit; the cpu device; rows split by parallel_cpu) ---------------
@njit(cache=True, inline="always")
def _forward_rows(x, gamma, beta, eps, y, mean_out, inv_out, c):
    nh = float32(x.shape[1])
    for m in range(c * ROW_CHUNK, min(x.shape[0], (c + 1) * ROW_CHUNK)):
        xr, yr = x[m], y[m]
        s = float32(0.0)
        for k in range(xr.shape[0]):
            s += xr[k]
        mu = s / nh
        v = float32(0.0)
        for k in range(xr.shape[0]):
            t = xr[k] - mu
            v += t * t
        inv = float32(1.0) / math.sqrt(v / nh + eps)
        for k in range(xr.shape[0]):
            yr[k] = gamma[k] * (xr[k] - mu) * inv + beta[k]
        mean_out[m] = mu
        inv_out[m] = inv


@njit(cache=True, inline="always")
def _backward_rows(x, dy, gamma, mean, inv, dx, pg, pb, c):
    # dx of the chunk's rows; pg, pb: the chunk's partial dgamma, dbeta (zeroed by the caller)
    nh = float32(x.shape[1])
    for m in range(c * ROW_CHUNK, min(x.shape[0], (c + 1) * ROW_CHUNK)):
        xr, gr, dr = x[m], dy[m], dx[m]
        mu, iv = mean[m], inv[m]
        sg = float32(0.0)
        sgx = float32(0.0)
        for k in range(xr.shape[0]):
            xhat = (xr[k] - mu) * iv
            g = gr[k] * gamma[k]
            sg += g
            sgx += g * xhat
            pg[k] += gr[k] * xhat
            pb[k] += gr[k]
        for k in range(xr.shape[0]):
            xhat = (xr[k] - mu) * iv
            dr[k] = iv / nh * (nh * (gr[k] * gamma[k]) - sg - xhat * sgx)


@pjit(cache=True, fastmath={"reassoc"})
def _layer_norm_forward_cpu(x, gamma, beta, eps, y, mean_out, inv_out):
    chunks = (x.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    if x.size < PARALLEL_MIN:
        for c in range(chunks):
            _forward_rows(x, gamma, beta, eps, y, mean_out, inv_out, c)
    else:
        for c in prange(chunks):
            _forward_rows(x, gamma, beta, eps, y, mean_out, inv_out, c)


@pjit(cache=True, fastmath={"reassoc"})
def _layer_norm_backward_cpu(x, dy, gamma, mean, inv, dx, dgamma, dbeta):
    chunks = (x.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    pg = np.zeros((chunks, x.shape[1]), np.float32)      # one partial dgamma, dbeta row per chunk
    pb = np.zeros((chunks, x.shape[1]), np.float32)
    if x.size < PARALLEL_MIN:
        for c in range(chunks):
            _backward_rows(x, dy, gamma, mean, inv, dx, pg[c], pb[c], c)
    else:
        for c in prange(chunks):
            _backward_rows(x, dy, gamma, mean, inv, dx, pg[c], pb[c], c)
    sum_partials(pg, dgamma)
    sum_partials(pb, dbeta)


def _check_cpu_shapes(x, gamma, *rows) -> None:
    if x.ndim != 2 or gamma.shape != (x.shape[1],) or any(a.shape != x.shape for a in rows):
        raise ValueError(f"layer_norm: x {x.shape} must be (M, H), gamma (H,) and the other (M, H) arrays its "
                         f"shape; got gamma {gamma.shape}, {[a.shape for a in rows]}")


def layer_norm_forward_cpu(x, gamma, beta, eps, y, mean_out, inv_out) -> None:
    """layer_norm_forward compiled for the CPU: y (M, H), mean_out, inv_out (M,) from x (M, H); contiguous
    float32, overwritten."""
    _check_cpu_shapes(x, gamma, y)
    if x.size:
        _layer_norm_forward_cpu(x, gamma, beta, np.float32(eps), y, mean_out, inv_out)


def layer_norm_backward_cpu(x, dy, gamma, mean, inv, dx, dgamma, dbeta) -> None:
    """layer_norm_backward compiled for the CPU: dx (M, H), dgamma, dbeta (H,) overwritten (dgamma, dbeta
    are zero when M is 0)."""
    _check_cpu_shapes(x, gamma, dy, dx)
    _layer_norm_backward_cpu(x, dy, gamma, mean, inv, dx, dgamma, dbeta)


_M, _V, _H = "float32[:, ::1]", "float32[::1]", "float16[:, ::1]"
PTX_CHECKS = [
    (make_ln_forward_kernel(256), f"void({_M}, {_V}, {_V}, float32, {_M}, {_V}, {_V})"),
    (make_ln_backward_dx_kernel(256), f"void({_M}, {_M}, {_V}, {_V}, {_V}, {_M})"),
    (make_ln_param_grad_kernel(256), f"void({_M}, {_M}, {_V}, {_V}, {_V}, {_V})"),
    # mixed precision on gpu/sim: float16 x, y, dy, dx; float32 gamma, beta, statistics and their gradients
    (make_ln_forward_kernel(256), f"void({_H}, {_V}, {_V}, float32, {_H}, {_V}, {_V})"),
    (make_ln_backward_dx_kernel(256), f"void({_H}, {_H}, {_V}, {_V}, {_V}, {_H})"),
    (make_ln_param_grad_kernel(256), f"void({_H}, {_H}, {_V}, {_V}, {_V}, {_V})"),
]
