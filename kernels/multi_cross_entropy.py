"""Multi-target binary cross-entropy on logits, per-target weights, ignorable labels (one fused kernel).

    x (B, T) logits, y (B, T) labels, tw (T,) target weights; element (i, t) is used when i < b
    (b = valid rows) and y_it >= -0.5 (a label < -0.5 means "no label": loss 0, gradient 0)
    loss_it = tw_t * (max(x, 0) - x*y + log(1 + exp(-|x|)))
    loss    = (1/(b*T)) * sum_{used} loss_it            # ignored elements still count in b*T
    dx_it   = tw_t * (sigmoid(x_it) - y_it) * grad_scale   if used, else 0             # (B, T)

The caller passes grad_scale = scaler / (b * T * G) (G ranks), as HugeCTR does. Labels may be
fractional. Overflow-free forms throughout: logits of +-1e4 give finite results.

Eval: predictions are sigmoid(x) (numbactr.kernels.bce.sigmoid_forward).

HugeCTR: HugeCTR/src/loss.cu (MultiCrossEntropyLoss::do_compute, MultiCrossEntropy_Kernel, fp32).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from .launch import check_block_size, launch_1d, REDUCE_THREADS
from .block_reduce import block_sum

IGNORE_BELOW = -0.5     # labels below this are "missing"


# ---- NumPy reference -------------------------------------------------------------------------
def multi_cross_entropy_forward_backward_ref(x: np.ndarray, y: np.ndarray, tw: np.ndarray, b: int,
                                             grad_scale: float):
    """-> (loss_mean = sum / (b*T) (0.0 when b == 0), dx (B, T))."""
    rows, targets = x.shape
    tw = np.asarray(tw, x.dtype).reshape(1, targets)
    used = (y >= IGNORE_BELOW) & (np.arange(rows)[:, None] < b)       # (B, T)
    loss = tw * (np.maximum(x, 0) - x * y + np.log1p(np.exp(-np.abs(x))))
    loss_mean = float(np.where(used, loss, 0).sum() / (b * targets)) if b > 0 else 0.0
    e = np.exp(-np.abs(x))
    sig = np.where(x >= 0, 1 / (1 + e), e / (1 + e))
    dx = np.where(used, tw * (sig - y) * x.dtype.type(grad_scale), 0).astype(x.dtype)
    return loss_mean, dx


# ---- kernels ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def make_mce_kernel(tpb: int):
    """Fused multi-target CE kernel for blocks of exactly ``tpb`` threads (a power of two, <= 1024).

    Threads grid-stride over the B*T elements writing dx and summing the used elements' losses; each
    block then reduces in shared memory and thread 0 adds the block total to loss_out[0].
    """
    check_block_size(tpb)

    @cuda.jit
    def mce_kernel(x, y, tw, dx, loss_out, n_valid, grad_scale):
        # x, y, dx flat (B*T,); tw (T,); n_valid = b*T; loss_out (1,)
        partial = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        targets = tw.shape[0]
        acc = float32(0.0)
        for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
            label = y[i]
            if i < n_valid and label >= float32(-0.5):
                w = tw[i % targets]
                v = x[i]                                    # read before dx (may alias x)
                e = math.exp(-abs(v))                       # in (0, 1]
                if v >= float32(0.0):
                    sig = float32(1.0) / (float32(1.0) + e)
                    acc += w * (v - v * label + math.log1p(e))
                else:
                    sig = e / (float32(1.0) + e)
                    acc += w * (-v * label + math.log1p(e))
                dx[i] = w * (sig - label) * grad_scale
            else:
                dx[i] = float32(0.0)
        partial[t] = acc
        block_sum(partial, t, tpb)
        if t == 0:
            cuda.atomic.add(loss_out, 0, partial[0])

    return mce_kernel


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def multi_cross_entropy_forward_backward(x, y, tw, dx, loss_out, b: int, grad_scale: float,
                                         threads: int | None = None) -> None:
    """Write dx (B, T) and ADD the used elements' summed loss to loss_out[0]; returns nothing.

    x, y, dx: (B, T); tw: (T,) float32; loss_out: (1,) float32 the caller zeroes beforehand. The
    reported loss is loss_out[0] / (b*T). dx may alias x.
    """
    if x.ndim != 2 or tuple(y.shape) != tuple(x.shape) or tw.size != x.shape[1]:
        raise ValueError(f"multi_cross_entropy: need x, y (B, T) and tw (T,); got {tuple(x.shape)}, "
                         f"{tuple(y.shape)}, {tuple(tw.shape)}")
    rows, targets = x.shape
    if not 0 <= b <= rows:
        raise ValueError(f"multi_cross_entropy: valid rows b={b} outside 0..{rows}")
    tpb = threads or REDUCE_THREADS
    launch_1d(make_mce_kernel(tpb), x.size, x.reshape(-1), y.reshape(-1), tw.reshape(-1),
              dx.reshape(-1), loss_out, np.int64(b * targets), np.float32(grad_scale), threads=tpb)


PTX_CHECKS = [
    (make_mce_kernel(256),
     "void(float32[::1], float32[::1], float32[::1], float32[::1], float32[::1], int64, float32)"),
]
