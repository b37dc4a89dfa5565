"""Normalization ops: BatchNorm, LayerNorm, PReLU_Dice (spec §6.2).

Contract: autograd Functions on raw arrays; numbactr.ops.dispatch.pick sends each direction to the
numba.cuda kernels of numbactr.kernels.{batch_norm, layer_norm, prelu_dice} on gpu/sim and, on cpu, their
compiled CPU versions where they exist (LayerNorm, PReLU_Dice) or NumPy references. Parameters and statistics
are float32 (float16 x and y under mixed precision).

Formulas: BatchNorm y = γ (x - μ_B) / sqrt(σ²_B + eps) + β per feature over the batch (training; the
running statistics move by ``factor``), with the running μ, σ² in eval; LayerNorm the same per row over the
last dim; Dice y = x·p + α·x·(1 - p), p = sigmoid((x - μ_B) / sqrt(σ²_B + eps)).

Why BatchNormFn takes its layer: the running statistics are layer state (not weights, not on the tape),
updated in place by every training forward and saved by the layer (HugeCTR's ntp.json).
"""

from __future__ import annotations

import numpy as np

from numbactr import hugectr_exact
from numbactr.autograd import Context, Function
from numbactr.autograd.tape import native_inputs as _half
from numbactr.kernels import batch_norm, layer_norm, prelu_dice
from numbactr.ops.dispatch import pick
from numbactr.runtime.device import contig as _contig
from numbactr.runtime.device import xp as _xp


# ---- BatchNorm ------------------------------------------------------------------------------------
def _bn_forward_kernel(ctx, x, gamma, beta, layer, training):
    xp = _xp()
    nf = x.shape[1]
    y = xp.empty_like(x)
    inv = xp.empty((nf,), np.float32)
    if training:
        mean = xp.empty((nf,), np.float32)
        batch_norm.batch_norm_forward_train(
            x, gamma, beta, layer.eps, layer.factor, y, mean, inv, layer.running_mean, layer.running_var
        )
    else:
        mean = layer.running_mean.copy()  # a snapshot: later training steps move it
        batch_norm.batch_norm_forward_eval(x, gamma, beta, layer.running_mean, layer.running_var, layer.eps, y, inv)
    ctx.mean, ctx.inv = mean, inv
    return y


def _bn_forward_ref(ctx, x, gamma, beta, layer, training):
    y, mean, inv, rm, rv = batch_norm.batch_norm_forward_ref(
        x, gamma, beta, np.float32(layer.eps), training, layer.running_mean, layer.running_var, np.float32(layer.factor)
    )
    if training:
        layer.running_mean[...] = rm
        layer.running_var[...] = rv
    ctx.mean, ctx.inv = np.array(mean, np.float32), np.asarray(inv, np.float32)
    return np.asarray(y, np.float32)


def _bn_backward_kernel(x, dy, gamma, mean, inv, training):
    xp = _xp()
    dx = xp.empty_like(dy)
    dgamma = xp.empty_like(gamma)
    dbeta = xp.empty_like(gamma)
    batch_norm.batch_norm_backward(x, dy, gamma, mean, inv, training, dx, dgamma, dbeta)
    return dx, dgamma, dbeta


class BatchNormFn(Function):
    """x (B, F), gamma, beta (F,) -> y (B, F). ``layer`` holds running_mean/running_var."""

    half_native = True  # gpu/sim: float16 x, y and gradients; float32 parameters and statistics

    @staticmethod
    def forward(ctx: Context, x, gamma, beta, layer=None, training: bool = True):
        x = _contig(_half(ctx, x)[0])
        ctx.x, ctx.gamma, ctx.training = x, gamma, training
        return pick(kernel=_bn_forward_kernel, ref=_bn_forward_ref)(ctx, x, gamma, beta, layer, training)

    @staticmethod
    def backward(ctx: Context, dy):
        dy = _contig(_half(ctx, dy)[0])
        return pick(kernel=_bn_backward_kernel, ref=batch_norm.batch_norm_backward_ref)(
            ctx.x, dy, ctx.gamma, ctx.mean, ctx.inv, ctx.training
        )


# ---- LayerNorm ------------------------------------------------------------------------------------
def _ln_forward_kernel(x2, gamma, beta, eps):
    xp = _xp()
    y = xp.empty_like(x2)
    mean = xp.empty((x2.shape[0],), np.float32)
    inv = xp.empty((x2.shape[0],), np.float32)
    layer_norm.layer_norm_forward(x2, gamma, beta, eps, y, mean, inv)
    return y, mean, inv


def _ln_forward_cpu(x2, gamma, beta, eps):
    if x2.dtype != np.float32:  # the compiled version takes float32; float64 (gradient checks): the reference
        return _ln_forward_ref(x2, gamma, beta, eps)
    y = np.empty_like(x2)
    mean, inv = np.empty((x2.shape[0],), np.float32), np.empty((x2.shape[0],), np.float32)
    layer_norm.layer_norm_forward_cpu(x2, gamma, beta, eps, y, mean, inv)
    return y, mean, inv


def _ln_forward_ref(x2, gamma, beta, eps):
    return layer_norm.layer_norm_forward_ref(x2, gamma, beta, np.float32(eps))


def _ln_backward_kernel(x2, dy2, gamma, mean, inv):
    xp = _xp()
    dx = xp.empty_like(dy2)
    dgamma, dbeta = xp.empty_like(gamma), xp.empty_like(gamma)
    layer_norm.layer_norm_backward(x2, dy2, gamma, mean, inv, dx, dgamma, dbeta)
    return dx, dgamma, dbeta


def _ln_backward_cpu(x2, dy2, gamma, mean, inv):
    if x2.dtype != np.float32 or dy2.dtype != np.float32:
        return layer_norm.layer_norm_backward_ref(x2, dy2, gamma, mean, inv)
    dx, dgamma, dbeta = np.empty_like(dy2), np.empty_like(gamma), np.empty_like(gamma)
    layer_norm.layer_norm_backward_cpu(x2, dy2, gamma, mean, inv, dx, dgamma, dbeta)
    return dx, dgamma, dbeta


class LayerNormFn(Function):
    """x (..., H), gamma, beta (H,) -> y (..., H)."""

    half_native = True  # gpu/sim: float16 x, y and gradients; float32 parameters and statistics

    @staticmethod
    def forward(ctx: Context, x, gamma, beta, eps: float = 1e-5):
        (x,) = _half(ctx, x)
        shape = x.shape
        x2 = _contig(x).reshape(-1, shape[-1])  # (M, H)
        ctx.x2, ctx.gamma, ctx.shape = x2, gamma, shape
        y, ctx.mean, ctx.inv = pick(kernel=_ln_forward_kernel, cpu=_ln_forward_cpu, ref=_ln_forward_ref)(
            x2, gamma, beta, eps
        )
        return y.reshape(shape)

    @staticmethod
    def backward(ctx: Context, dy):
        dy2 = _contig(_half(ctx, dy)[0]).reshape(ctx.x2.shape)
        dx, dgamma, dbeta = pick(
            kernel=_ln_backward_kernel, cpu=_ln_backward_cpu, ref=layer_norm.layer_norm_backward_ref
        )(ctx.x2, dy2, ctx.gamma, ctx.mean, ctx.inv)
        return dx.reshape(ctx.shape), dgamma, dbeta


# ---- PReLU_Dice ------------------------------------------------------------------------------------
def _dice_forward_kernel(x2, alpha, eps):
    xp = _xp()
    y = xp.empty_like(x2)
    mean = xp.empty((x2.shape[1],), np.float32)
    inv = xp.empty((x2.shape[1],), np.float32)
    prelu_dice.prelu_dice_forward(x2, alpha, eps, y, mean, inv)
    return y, mean, inv


def _dice_forward_cpu(x2, alpha, eps):
    y = np.empty_like(x2)
    mean = np.empty((x2.shape[1],), np.float32)
    inv = np.empty((x2.shape[1],), np.float32)
    prelu_dice.prelu_dice_forward_cpu(x2, alpha, eps, y, mean, inv)
    return y, mean, inv


def _dice_forward_ref(x2, alpha, eps):
    y, mean, inv = prelu_dice.prelu_dice_forward_ref(x2, np.float32(alpha), np.float32(eps))
    return y.astype(np.float32, copy=False), mean, inv


def _dice_backward_kernel(x2, dy2, alpha, mean, inv, exact):
    dx = _xp().empty_like(dy2)
    prelu_dice.prelu_dice_backward(x2, dy2, alpha, mean, inv, exact, dx)
    return dx


def _dice_backward_cpu(x2, dy2, alpha, mean, inv, exact):
    dx = np.empty_like(dy2)
    prelu_dice.prelu_dice_backward_cpu(x2, dy2, alpha, mean, inv, exact, dx)
    return dx


def _dice_backward_ref(x2, dy2, alpha, mean, inv, exact):
    return prelu_dice.prelu_dice_backward_ref(x2, dy2, np.float32(alpha), mean, inv, hugectr_exact=exact).astype(
        np.float32, copy=False
    )


class PReLUDiceFn(Function):
    """x (B, ...) viewed as (B, F) -> y of x's shape. Batch statistics in train and eval alike."""

    half_native = True  # gpu/sim: float16 x, y and gradients; float32 statistics

    @staticmethod
    def forward(ctx: Context, x, alpha: float = 1.0, eps: float = 1e-5):
        (x,) = _half(ctx, x)
        shape = x.shape
        x2 = _contig(x).reshape(shape[0], -1)  # (B, F)
        ctx.x2, ctx.shape, ctx.alpha = x2, shape, alpha
        y, ctx.mean, ctx.inv = pick(kernel=_dice_forward_kernel, cpu=_dice_forward_cpu, ref=_dice_forward_ref)(
            x2, alpha, eps
        )
        return y.reshape(shape)

    @staticmethod
    def backward(ctx: Context, dy):
        dy2 = _contig(_half(ctx, dy)[0]).reshape(ctx.x2.shape)
        exact = hugectr_exact.hugectr_exact()
        dx = pick(kernel=_dice_backward_kernel, cpu=_dice_backward_cpu, ref=_dice_backward_ref)(
            ctx.x2, dy2, ctx.alpha, ctx.mean, ctx.inv, exact
        )
        return dx.reshape(ctx.shape)
