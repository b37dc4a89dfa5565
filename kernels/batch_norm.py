"""BatchNorm over the batch, per feature (cuDNN's PER_ACTIVATION mode on a 2-D (B, F) input).

    train:  mu[f]  = mean_b x[b, f]                                  # (F,)
            var[f] = mean_b (x[b, f] - mu[f])^2   (biased)           # (F,)
            inv[f] = 1 / sqrt(var[f] + eps)
            y[b, f] = gamma[f] * (x[b, f] - mu[f]) * inv[f] + beta[f]  # (B, F)
            running_mean = (1 - factor) * running_mean + factor * mu
            running_var  = (1 - factor) * running_var  + factor * var * B / (B - 1)   # UNBIASED
    eval:   the same y with mu = running_mean, inv = 1 / sqrt(running_var + eps)
    backward (xhat = (x - mu) * inv, sums over the batch b):
            dbeta[f]  = sum_b dy[b, f]
            dgamma[f] = sum_b dy[b, f] * xhat[b, f]
            train: dx = gamma * inv / B * (B * dy - dbeta - xhat * dgamma)
            eval:  dx = gamma * inv * dy        (the statistics are constants)

With B == 1 the unbiased variance is undefined; the biased one (0) is used for the running variance.

HugeCTR: HugeCTR/src/layers/batch_norm_layer.cu (cudnnBatchNormalizationForwardTraining /
ForwardInference / Backward, CUDNN_BATCHNORM_PER_ACTIVATION; the running variance is cuDNN's unbiased
one). HugeCTR overwrites dgamma/dbeta (no regularizer term); so do these kernels.

Kernels: one block per feature (blocks grid-stride over features); the block's threads stride over the
batch and reduce their partial sums in shared memory with a tree (tpb a power of two <= 1024).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from .launch import check_block_size, launch_1d, launch_rows, REDUCE_THREADS
from .block_reduce import block_sum2, column_mean_var

MIN_EPS = 1e-5      # cuDNN's CUDNN_BN_MIN_EPSILON


# ---- NumPy reference -------------------------------------------------------------------------
def batch_norm_forward_ref(x, gamma, beta, eps, training=True, running_mean=None, running_var=None,
                           factor=1.0):
    """Returns (y, mean, inv, new_running_mean, new_running_var); x (B, F), gamma/beta (F,).

    In eval mode mean/inv come from the running stats, which are returned unchanged."""
    x = np.asarray(x)
    b = x.shape[0]
    if training:
        mean = x.mean(axis=0)
        var = ((x - mean) ** 2).mean(axis=0)
        unbiased = var * b / (b - 1) if b > 1 else var
        rm = running_mean if running_mean is not None else np.zeros_like(mean)
        rv = running_var if running_var is not None else np.ones_like(var)
        new_rm = (1 - factor) * rm + factor * mean
        new_rv = (1 - factor) * rv + factor * unbiased
    else:
        mean, var = running_mean, running_var
        new_rm, new_rv = running_mean, running_var
    inv = 1.0 / np.sqrt(var + eps)
    y = gamma * (x - mean) * inv + beta
    return y, mean, inv, new_rm, new_rv


def batch_norm_backward_ref(x, dy, gamma, mean, inv, training=True):
    """Returns (dx, dgamma, dbeta) given the mean/inv the forward used."""
    b = x.shape[0]
    xhat = (x - mean) * inv
    dbeta = dy.sum(axis=0)
    dgamma = (dy * xhat).sum(axis=0)
    if training:
        dx = gamma * inv / b * (b * dy - dbeta - xhat * dgamma)
    else:
        dx = gamma * inv * dy
    return dx, dgamma, dbeta


# ---- kernels ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_bn_forward_train_kernel(tpb: int):
    """Block-per-feature forward in training mode; also updates the running stats in place."""
    check_block_size(tpb)

    @cuda.jit
    def bn_forward_train_kernel(x, gamma, beta, eps, factor, y, mean_out, inv_out, rmean, rvar):
        # x, y: (B, F); gamma, beta, mean_out, inv_out, rmean, rvar: (F,)
        part = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        rows = x.shape[0]
        nb = float32(rows)
        # The feature loop depends only on blockIdx: all threads of a block run the same iterations
        # and so meet every syncthreads.
        for f in range(cuda.blockIdx.x, x.shape[1], cuda.gridDim.x):
            mu, var = column_mean_var(x, f, part, t, tpb)      # biased batch statistics
            inv = float32(1.0) / math.sqrt(var + eps)
            g = gamma[f]
            bt = beta[f]
            for m in range(t, rows, tpb):
                y[m, f] = g * (float32(x[m, f]) - mu) * inv + bt
            if t == 0:
                mean_out[f] = mu
                inv_out[f] = inv
                unbiased = var * nb / (nb - float32(1.0)) if rows > 1 else var
                rmean[f] = (float32(1.0) - factor) * rmean[f] + factor * mu
                rvar[f] = (float32(1.0) - factor) * rvar[f] + factor * unbiased

    return bn_forward_train_kernel


@cuda.jit
def bn_forward_eval_kernel(x, gamma, beta, rmean, rvar, eps, y, inv_out):
    # x, y: flat (B*F,) views; element i is feature i % F. inv_out (F,) for the backward.
    nf = gamma.shape[0]
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        f = i % nf
        inv = float32(1.0) / math.sqrt(rvar[f] + eps)
        y[i] = gamma[f] * (float32(x[i]) - rmean[f]) * inv + beta[f]
        if i < nf:                      # row 0 writes the per-feature value once
            inv_out[f] = inv


@functools.lru_cache(maxsize=None)
def make_bn_backward_kernel(tpb: int):
    """Block-per-feature backward: dgamma, dbeta (overwritten) and dx."""
    check_block_size(tpb)

    @cuda.jit
    def bn_backward_kernel(x, dy, gamma, mean, inv, batch_stats, dx, dgamma, dbeta):
        # x, dy, dx: (B, F); gamma, mean, inv, dgamma, dbeta: (F,); batch_stats: 1 train, 0 eval
        s_dy = cuda.shared.array(tpb, float32)
        s_dyx = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        rows = x.shape[0]
        nb = float32(rows)
        for f in range(cuda.blockIdx.x, x.shape[1], cuda.gridDim.x):
            mu = mean[f]
            iv = inv[f]
            a1 = float32(0.0)
            a2 = float32(0.0)
            for m in range(t, rows, tpb):
                g = float32(dy[m, f])             # (float16 tensors are read in float32)
                a1 += g
                a2 += g * (float32(x[m, f]) - mu) * iv
            s_dy[t] = a1
            s_dyx[t] = a2
            block_sum2(s_dy, s_dyx, t, tpb)
            sdy = s_dy[0]
            sdyx = s_dyx[0]
            cuda.syncthreads()
            if t == 0:
                dgamma[f] = sdyx
                dbeta[f] = sdy
            scale = gamma[f] * iv
            for m in range(t, rows, tpb):
                if batch_stats != 0:
                    xhat = (float32(x[m, f]) - mu) * iv
                    dx[m, f] = scale / nb * (nb * float32(dy[m, f]) - sdy - xhat * sdyx)
                else:
                    dx[m, f] = scale * float32(dy[m, f])

    return bn_backward_kernel


# ---- launch wrappers (allocate nothing; contiguous float32 arrays) -----------------------------
def batch_norm_forward_train(x, gamma, beta, eps, factor, y, mean_out, inv_out, running_mean,
                             running_var, threads: int | None = None) -> None:
    """x (B, F) -> y (B, F); writes mean_out/inv_out (F,), updates running_mean/var (F,) in place."""
    if x.shape[0] == 0 or x.shape[1] == 0:
        return
    tpb = threads or REDUCE_THREADS
    launch_rows(make_bn_forward_train_kernel(tpb), x.shape[1], x, gamma, beta, np.float32(eps),
                np.float32(factor), y, mean_out, inv_out, running_mean, running_var, threads=tpb)


def batch_norm_forward_eval(x, gamma, beta, running_mean, running_var, eps, y, inv_out) -> None:
    """Inference with the running stats; inv_out (F,) receives 1/sqrt(running_var + eps)."""
    launch_1d(bn_forward_eval_kernel, x.size, x.reshape(-1), gamma, beta, running_mean, running_var,
              np.float32(eps), y.reshape(-1), inv_out)


def batch_norm_backward(x, dy, gamma, mean, inv, training, dx, dgamma, dbeta,
                        threads: int | None = None) -> None:
    if x.shape[1] == 0:
        return
    if x.shape[0] == 0:
        dgamma[...] = 0
        dbeta[...] = 0
        return
    tpb = threads or REDUCE_THREADS
    launch_rows(make_bn_backward_kernel(tpb), x.shape[1], x, dy, gamma, mean, inv,
                np.int32(1 if training else 0), dx, dgamma, dbeta, threads=tpb)


_M, _V, _H, _HV = "float32[:, ::1]", "float32[::1]", "float16[:, ::1]", "float16[::1]"
PTX_CHECKS = [
    (make_bn_forward_train_kernel(256),
     f"void({_M}, {_V}, {_V}, float32, float32, {_M}, {_V}, {_V}, {_V}, {_V})"),
    (bn_forward_eval_kernel, f"void({_V}, {_V}, {_V}, {_V}, {_V}, float32, {_V}, {_V})"),
    (make_bn_backward_kernel(256), f"void({_M}, {_M}, {_V}, {_V}, {_V}, int32, {_M}, {_V}, {_V})"),
    # mixed precision on gpu/sim: float16 x, y, dy, dx; float32 parameters, statistics and their gradients
    (make_bn_forward_train_kernel(256),
     f"void({_H}, {_V}, {_V}, float32, float32, {_H}, {_V}, {_V}, {_V}, {_V})"),
    (bn_forward_eval_kernel, f"void({_HV}, {_V}, {_V}, {_V}, {_V}, float32, {_HV}, {_V})"),
    (make_bn_backward_kernel(256), f"void({_H}, {_H}, {_V}, {_V}, {_V}, int32, {_H}, {_V}, {_V})"),
]
