"""Two-class cross-entropy on logits with the softmax fused in (forward and backward in one kernel).

    x (B, 2) logits; c_i in {0, 1} the class of row i (see "labels" below)
    a_i    = softmax(x_i)                       # (B, 2); with d = x_i1 - x_i0: a_i1 = sigmoid(d)
    loss_i = -log a_{i, c_i} = max(s, 0) + log(1 + exp(-|d|)),  s = d if c_i == 0 else -d
    loss   = (1/b) * sum_{i < b} loss_i                       # b = valid rows, b <= B
    dx_i   = (a_i - onehot(c_i)) * grad_scale   for i < b,   0 for i >= b        # (B, 2)

The caller passes grad_scale = scaler / (b * G) (G ranks), as HugeCTR does; loss weights and the
regularizer term are the caller's business. The two-class softmax is computed as a sigmoid of the
logit difference and the loss in its log1p form, so logits of +-1e30 give finite results (HugeCTR
computes exp(x) in double without max subtraction: NaN once |x| > ~709; same values elsewhere).

Labels: ``lab`` is the label tensor's flat float buffer and ``lab_stride`` how far apart rows' labels
lie in it: c_i = 0 if lab[i * lab_stride] < 0.5 else 1. lab_stride = label width reads column 0 of
each row (numbactr's default); lab_stride = 1 reads the first B floats of the buffer whatever its
width, which is what HugeCTR's kernel does (``label[i]`` on a (B, 2) label: a quirk).

Eval: y = softmax(x) row-wise (the prediction used by metrics), `softmax2_forward` (may run in place).

HugeCTR: HugeCTR/src/loss.cu (CrossEntropyLoss::do_compute, CrossEntropy_Kernel, fp32).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from .launch import check_block_size, launch_1d, REDUCE_THREADS
from .block_reduce import block_sum


# ---- NumPy reference -------------------------------------------------------------------------
def ce_classes_ref(label: np.ndarray, rows: int, hugectr_label: bool = False) -> np.ndarray:
    """(rows,) int class per row: column 0 of each row, or the first `rows` floats (HugeCTR)."""
    flat = np.asarray(label).reshape(-1)
    vals = flat[:rows] if hugectr_label else flat.reshape(rows, -1)[:, 0]
    return np.where(vals < 0.5, 0, 1)


def softmax2_ref(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax of (B, 2) logits, overflow-free."""
    d = x[:, 1] - x[:, 0]
    e = np.exp(-np.abs(d))                       # in (0, 1]
    big, small = 1 / (1 + e), e / (1 + e)        # probabilities of the larger / smaller logit
    a1 = np.where(d >= 0, big, small)
    a0 = np.where(d >= 0, small, big)
    return np.stack([a0, a1], axis=1).astype(x.dtype)


def cross_entropy_forward_backward_ref(x: np.ndarray, label: np.ndarray, b: int, grad_scale: float,
                                       hugectr_label: bool = False):
    """-> (loss_mean over the first b rows (0.0 when b == 0), dx (B, 2))."""
    rows = x.shape[0]
    c = ce_classes_ref(label, rows, hugectr_label)                   # (B,)
    d = x[:, 1] - x[:, 0]
    s = np.where(c == 0, d, -d)
    loss = np.logaddexp(0, s)                                         # -log a_c, (B,)
    loss_mean = float(loss[:b].sum() / b) if b > 0 else 0.0
    onehot = np.stack([c == 0, c == 1], axis=1).astype(x.dtype)
    dx = (softmax2_ref(x) - onehot) * x.dtype.type(grad_scale)
    dx[b:] = 0
    return loss_mean, dx


# ---- kernels ---------------------------------------------------------------------------------
@cuda.jit
def softmax2_kernel(x, y):
    # x, y: flat (2B,), row i at [2i, 2i+1]
    for i in range(cuda.grid(1), x.shape[0] // 2, cuda.gridsize(1)):
        d = x[2 * i + 1] - x[2 * i]
        e = math.exp(-abs(d))
        big = float32(1.0) / (float32(1.0) + e)
        small = e * big
        if d >= float32(0.0):
            y[2 * i] = small
            y[2 * i + 1] = big
        else:
            y[2 * i] = big
            y[2 * i + 1] = small


@functools.lru_cache(maxsize=None)
def make_ce_kernel(tpb: int):
    """Fused CE kernel for blocks of exactly ``tpb`` threads (a power of two, <= 1024).

    Threads grid-stride over rows writing dx and summing their valid rows' losses; each block then
    reduces its partial sums in shared memory and thread 0 adds the block total to loss_out[0].
    """
    check_block_size(tpb)

    @cuda.jit
    def ce_kernel(x, lab, dx, loss_out, b, lab_stride, grad_scale):
        # x, dx flat (2B,); lab flat label buffer; loss_out (1,); b valid rows; grad_scale float32
        partial = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        acc = float32(0.0)
        for i in range(cuda.grid(1), x.shape[0] // 2, cuda.gridsize(1)):
            if i < b:
                d = x[2 * i + 1] - x[2 * i]                   # read both before dx (may alias x)
                e = math.exp(-abs(d))                         # in (0, 1]
                big = float32(1.0) / (float32(1.0) + e)
                small = e * big
                if d >= float32(0.0):
                    a0 = small
                    a1 = big
                else:
                    a0 = big
                    a1 = small
                no_click = lab[i * lab_stride] < float32(0.5)   # HugeCTR's test (NaN -> class 1)
                if no_click:
                    s = d
                    dx[2 * i] = (a0 - float32(1.0)) * grad_scale
                    dx[2 * i + 1] = a1 * grad_scale
                else:
                    s = -d
                    dx[2 * i] = a0 * grad_scale
                    dx[2 * i + 1] = (a1 - float32(1.0)) * grad_scale
                acc += max(s, float32(0.0)) + math.log1p(e)
            else:
                dx[2 * i] = float32(0.0)
                dx[2 * i + 1] = float32(0.0)
        partial[t] = acc
        block_sum(partial, t, tpb)
        if t == 0:
            cuda.atomic.add(loss_out, 0, partial[0])

    return ce_kernel


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def cross_entropy_forward_backward(x, label, dx, loss_out, b: int, grad_scale: float,
                                   hugectr_label: bool = False, threads: int | None = None) -> None:
    """Write dx (B, 2) and ADD sum_{i<b} loss_i to loss_out[0]; returns nothing.

    x, dx: (B, 2); label: (B, k) for any k >= 1 (class from column 0, or from the first B floats of
    its buffer when hugectr_label); loss_out: (1,) float32 the caller zeroes beforehand. The
    reported loss is loss_out[0] / b. dx may alias x.
    """
    rows = x.shape[0]
    if x.ndim != 2 or x.shape[1] != 2:
        raise ValueError(f"cross_entropy: logits must be (B, 2), got {tuple(x.shape)}")
    if label.shape[0] != rows or label.size < rows:
        raise ValueError(f"cross_entropy: label {tuple(label.shape)} does not have {rows} rows")
    if not 0 <= b <= rows:
        raise ValueError(f"cross_entropy: valid rows b={b} outside 0..{rows}")
    stride = 1 if hugectr_label else label.size // max(rows, 1)
    tpb = threads or REDUCE_THREADS
    launch_1d(make_ce_kernel(tpb), rows, x.reshape(-1), label.reshape(-1), dx.reshape(-1), loss_out,
              np.int64(b), np.int64(stride), np.float32(grad_scale), threads=tpb)


def softmax2_forward(x, y, threads: int | None = None) -> None:
    """y = softmax(x) over each row of (B, 2) logits; y may be x."""
    launch_1d(softmax2_kernel, x.shape[0], x.reshape(-1), y.reshape(-1), threads=threads)


PTX_CHECKS = [
    (softmax2_kernel, "void(float32[::1], float32[::1])"),
    (make_ce_kernel(256),
     "void(float32[::1], float32[::1], float32[::1], float32[::1], int64, int64, float32)"),
]
