"""Binary cross-entropy on logits, with the sigmoid fused in (forward and backward in one kernel).

    loss_i = max(x_i, 0) - x_i*y_i + log(1 + exp(-|x_i|))      # x logits (B,), y labels (B,)
    loss   = (1/b) * sum_{i < b} loss_i                          # b = valid rows, b <= B
    dx_i   = (sigmoid(x_i) - y_i) * grad_scale   for i < b,  0 for i >= b

The caller passes grad_scale = scaler / (b * G) (G ranks), as HugeCTR does; loss weights and the
regularizer term are the caller's business. Labels may be fractional. The loss form and the sigmoid
are both the overflow-free ones, so logits of +-1e4 give finite results.

Eval: y = sigmoid(x) (the prediction used by metrics), `sigmoid_forward` (may run in place; the kernel is
elementwise.sigmoid_forward_kernel, the same overflow-free formula).

HugeCTR: HugeCTR/src/loss.cu (BinaryCrossEntropyLoss::do_compute, fp32).

Compiled CPU version (numba.njit, the cpu device's path): the kernel's float32 formulas row by row, the
loss summed in float64 in row order (B is one batch: no threads needed).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, float64, njit

from .launch import check_block_size, launch_1d, REDUCE_THREADS
from .block_reduce import block_sum
from .elementwise import sigmoid_forward_kernel as sigmoid_kernel   # the one sigmoid kernel (PTX-checked there)


# ---- NumPy reference -------------------------------------------------------------------------
def sigmoid_ref(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))                        # in (0, 1]: never overflows
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype)


def bce_forward_backward_ref(x: np.ndarray, y: np.ndarray, b: int, grad_scale: float):
    """-> (loss_mean over the first b rows (0.0 when b == 0), dx (B,))."""
    x = x.reshape(-1)
    y = y.reshape(-1)
    loss = np.maximum(x, 0) - x * y + np.log1p(np.exp(-np.abs(x)))   # (B,)
    loss_mean = float(loss[:b].sum() / b) if b > 0 else 0.0
    dx = (sigmoid_ref(x) - y) * x.dtype.type(grad_scale)
    dx[b:] = 0
    return loss_mean, dx


# ---- kernels ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def make_bce_kernel(tpb: int):
    """Fused BCE kernel for blocks of exactly ``tpb`` threads (a power of two, <= 1024).

    Threads grid-stride over rows writing dx and summing their valid rows' losses; each block then
    reduces its partial sums in shared memory and thread 0 adds the block total to loss_out[0].
    """
    check_block_size(tpb)

    @cuda.jit
    def bce_kernel(x, y, dx, loss_out, b, grad_scale):
        # x, y, dx (B,); loss_out (1,); b valid rows; grad_scale float32
        partial = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        acc = float32(0.0)
        for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
            if i < b:
                v = x[i]
                label = y[i]
                e = math.exp(-abs(v))                      # in (0, 1]
                if v >= float32(0.0):
                    sig = float32(1.0) / (float32(1.0) + e)
                    acc += v - v * label + math.log1p(e)
                else:
                    sig = e / (float32(1.0) + e)
                    acc += -v * label + math.log1p(e)
                dx[i] = (sig - label) * grad_scale
            else:
                dx[i] = float32(0.0)
        partial[t] = acc
        block_sum(partial, t, tpb)
        if t == 0:
            cuda.atomic.add(loss_out, 0, partial[0])

    return bce_kernel


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def bce_forward_backward(x, y, dx, loss_out, b: int, grad_scale: float,
                         threads: int | None = None) -> None:
    """Write dx (B,) and ADD sum_{i<b} loss_i to loss_out[0]; returns nothing.

    x, y, dx: (B,) or (B, 1); loss_out: (1,) float32 that the caller zeroes beforehand. The
    reported loss is loss_out[0] / b. dx may alias x (each thread reads x[i] before writing dx[i]).
    """
    n = x.size
    if not 0 <= b <= n:
        raise ValueError(f"bce: valid rows b={b} outside 0..{n}")
    tpb = threads or REDUCE_THREADS
    launch_1d(make_bce_kernel(tpb), n, x.reshape(-1), y.reshape(-1), dx.reshape(-1), loss_out,
              np.int64(b), np.float32(grad_scale), threads=tpb)


def sigmoid_forward(x, y, threads: int | None = None) -> None:
    """y = sigmoid(x) elementwise, any shape; y may be x (HugeCTR eval overwrites the logits)."""
    launch_1d(sigmoid_kernel, x.size, x.reshape(-1), y.reshape(-1), threads=threads)


# ---- compiled CPU version (numba.njit; the cpu device) ---------------------------------------------
@njit(cache=True)
def _bce_cpu(x, y, dx, b, grad_scale):
    total = float64(0.0)
    for i in range(x.shape[0]):
        if i < b:
            v = x[i]
            label = y[i]
            e = float32(math.exp(-abs(v)))                 # in (0, 1]
            if v >= float32(0.0):
                sig = float32(1.0) / (float32(1.0) + e)
                total += v - v * label + float32(math.log1p(e))
            else:
                sig = e / (float32(1.0) + e)
                total += -v * label + float32(math.log1p(e))
            dx[i] = (sig - label) * grad_scale
        else:
            dx[i] = float32(0.0)
    return total


def bce_forward_backward_cpu(x, y, dx, b: int, grad_scale: float) -> float:
    """bce_forward_backward compiled for the CPU: writes dx (B,) and returns the mean loss over the first
    b rows (0.0 when b == 0). x, y, dx: contiguous float32 (B,) or (B, 1); dx may alias x."""
    n = x.size
    if not 0 <= b <= n:
        raise ValueError(f"bce: valid rows b={b} outside 0..{n}")
    total = _bce_cpu(x.reshape(-1), y.reshape(-1), dx.reshape(-1), np.int64(b), np.float32(grad_scale))
    return total / b if b > 0 else 0.0


PTX_CHECKS = [                  # sigmoid_kernel is elementwise.sigmoid_forward_kernel, checked in its list
    (make_bce_kernel(256),
     "void(float32[::1], float32[::1], float32[::1], float32[::1], int64, float32)"),
]
