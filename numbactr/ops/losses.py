"""Loss ops: BinaryCrossEntropy (sigmoid fused), CrossEntropy (2-class softmax fused), MultiCrossEntropy,
and the eval activations sigmoid and softmax2 (spec §6.3).

Contract: each loss Function returns the mean loss (1,) over the valid rows and saves dX, computed in the
same pass (one kernel); ``backward`` hands on dX times the loss's incoming gradient (scale_by_seed).
numbactr.ops.dispatch.pick sends each to the numba.cuda kernels of numbactr.kernels.{bce, cross_entropy,
multi_cross_entropy} on gpu/sim, BCE's compiled CPU version or the NumPy references on cpu.

Formulas: BCE dX = (sigmoid(x) - y)·grad_scale; CrossEntropy dX = (softmax(x) - onehot)·grad_scale
(0 for rows >= valid); MultiCrossEntropy dX = tw·(sigmoid(x) - y)·grad_scale, labels < -0.5 ignored,
the loss summed over the used elements / (valid·T). HugeCTR's grad_scale is scaler / (b·ranks).

Why the gradient is computed in the forward: the loss kernel has sigmoid(x) or softmax(x) at hand; a
weighted loss (the model seeds each loss with its weight) scales the saved dX instead of recomputing it.
"""

from __future__ import annotations

import numpy as np

from numbactr.autograd import Context, Function
from numbactr.kernels import bce, cross_entropy, multi_cross_entropy
from numbactr.ops.dispatch import pick
from numbactr.runtime.device import contig as _contig
from numbactr.runtime.device import xp as _xp


def scale_by_seed(dx, dloss):
    """dX scaled by the loss's incoming gradient dloss (1,): the chain rule through the loss value.
    A seed of exactly 1 (the common case) returns dX itself, bit for bit."""
    return dx * dloss.astype(dx.dtype, copy=False)


# ---- BinaryCrossEntropy ---------------------------------------------------------------------------
def _bce_kernel(ctx, x, y, b, grad_scale):
    xp = _xp()
    dx = xp.empty_like(x)
    loss = xp.zeros((1,), np.float32)
    bce.bce_forward_backward(_contig(x), _contig(y), dx, loss, b, grad_scale)
    ctx.dx = dx
    return loss / np.float32(b)


def _bce_cpu(ctx, x, y, b, grad_scale):
    x = _contig(x)
    ctx.dx = np.empty_like(x)
    return np.asarray([bce.bce_forward_backward_cpu(x, _contig(y), ctx.dx, b, grad_scale)], np.float32)


def _bce_ref(ctx, x, y, b, grad_scale):
    loss, dx = bce.bce_forward_backward_ref(x, y, b, grad_scale)
    ctx.dx = dx.reshape(x.shape).astype(np.float32)
    return np.asarray([loss], np.float32)


class BinaryCrossEntropy(Function):
    """Sigmoid + BCE in one kernel: returns the mean loss over the valid rows, saves dX.

    HugeCTR semantics (spec §6.3): dX = (sigmoid(x) - y) * scaler / (b * ranks). ``backward`` scales dX
    by the incoming (1,) gradient of the loss value, so a loss weight w seeded by the model (the
    gradient of the reported loss Σ w_i·loss_i) gives w·dX; HugeCTR seeds 1 (weights scale only the
    reported loss), which the model does under numbactr.hugectr_exact.hugectr_exact().
    """

    @staticmethod
    def forward(ctx: Context, x, y, valid: int = 0, grad_scale: float = 1.0):
        b = valid or x.shape[0]
        return pick(kernel=_bce_kernel, cpu=_bce_cpu, ref=_bce_ref)(ctx, x, y, b, grad_scale)

    @staticmethod
    def backward(ctx: Context, dloss):
        return scale_by_seed(ctx.dx, dloss), None


def _sigmoid_kernel(x):
    y = _xp().empty_like(x)
    bce.sigmoid_forward(_contig(x), y)
    return y


def sigmoid(x):
    """Predictions from logits, elementwise (eval path; no autograd)."""
    return pick(kernel=_sigmoid_kernel, ref=bce.sigmoid_ref)(x)


# ---- CrossEntropy (2 classes) ----------------------------------------------------------------------
def _ce_kernel(ctx, x, label, b, grad_scale, hugectr_label):
    xp = _xp()
    dx = xp.empty_like(x)
    loss = xp.zeros((1,), np.float32)
    cross_entropy.cross_entropy_forward_backward(
        _contig(x), _contig(label), dx, loss, b, grad_scale, hugectr_label=hugectr_label
    )
    ctx.dx = dx
    return loss / np.float32(b)


def _ce_ref(ctx, x, label, b, grad_scale, hugectr_label):
    loss, dx = cross_entropy.cross_entropy_forward_backward_ref(x, label, b, grad_scale, hugectr_label)
    ctx.dx = dx.astype(np.float32)
    return np.asarray([loss], np.float32)


class CrossEntropy(Function):
    """Softmax over 2 logits + CE in one kernel: returns the mean loss over the valid rows, saves dX
    = (softmax(x) - onehot) · grad_scale (0 for rows >= valid)."""

    @staticmethod
    def forward(ctx: Context, x, label, valid: int = 0, grad_scale: float = 1.0, hugectr_label: bool = False):
        b = valid or x.shape[0]
        return pick(kernel=_ce_kernel, ref=_ce_ref)(ctx, x, label, b, grad_scale, hugectr_label)

    @staticmethod
    def backward(ctx: Context, dloss):
        return scale_by_seed(ctx.dx, dloss), None


def _softmax2_kernel(x):
    y = _xp().empty_like(x)
    cross_entropy.softmax2_forward(_contig(x), y)
    return y


def softmax2(x):
    """Row-wise softmax of (B, 2) logits (eval predictions; no autograd)."""
    return pick(kernel=_softmax2_kernel, ref=cross_entropy.softmax2_ref)(x)


# ---- MultiCrossEntropy -----------------------------------------------------------------------------
def _mce_kernel(ctx, x, y, tw, b, grad_scale):
    xp = _xp()
    dx = xp.empty_like(x)
    loss = xp.zeros((1,), np.float32)
    multi_cross_entropy.multi_cross_entropy_forward_backward(_contig(x), _contig(y), tw, dx, loss, b, grad_scale)
    ctx.dx = dx
    return loss / np.float32(b * x.shape[1])


def _mce_ref(ctx, x, y, tw, b, grad_scale):
    loss, dx = multi_cross_entropy.multi_cross_entropy_forward_backward_ref(x, y, tw, b, grad_scale)
    ctx.dx = dx.astype(np.float32)
    return np.asarray([loss], np.float32)


class MultiCrossEntropy(Function):
    """Per-target weighted BCE with ignorable labels (< -0.5) in one kernel: returns the loss summed
    over the used elements / (valid·T), saves dX = tw·(sigmoid(x) - y)·grad_scale."""

    @staticmethod
    def forward(ctx: Context, x, y, tw=None, valid: int = 0, grad_scale: float = 1.0):
        b = valid or x.shape[0]
        return pick(kernel=_mce_kernel, ref=_mce_ref)(ctx, x, y, tw, b, grad_scale)

    @staticmethod
    def backward(ctx: Context, dloss):
        return scale_by_seed(ctx.dx, dloss), None
