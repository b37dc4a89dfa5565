"""Elementwise and small fixed-pattern ops: ReLU, Identity, Add, Sub, Multiply, ELU, Sigmoid, Scale, Dropout,
WeightMultiply, FmOrder2.

Contract: autograd Functions on raw arrays; each direction reaches its implementation through
numbactr.ops.dispatch.pick: the numba.cuda kernels of numbactr.kernels.{relu, elementwise, scale, dropout,
weight_multiply, fm_order2} on gpu/sim, ReLU's compiled CPU version or the NumPy references on cpu. The
implementations of one op take the same arguments, the op's Context first (where the kernels write float16
under mixed precision, numbactr.autograd.tape.native_dtype(ctx)).

Formulas: ReLU y = max(x, 0); Add y = Σ x_i; Sub y = a - b; Multiply y = Π x_i, dX_i = dY Π_{j≠i} x_j
(HugeCTR's dY·Y/X_i under ``exact``); ELU y = x if x >= 0 else α(eˣ - 1); Sigmoid y = 1/(1 + e⁻ˣ);
Scale repeats elements (axis 0) or rows (axis 1) f times; Dropout y = x·keep/(1 - r);
WeightMultiply y[b, s·V+v] = x[b, s]·W[s, v]; FmOrder2 y = ½((Σ_s x_s)² - Σ_s x_s²).

Why Dropout needs no stored mask: the mask is a counter-based hash of (seed, step, layer id, element index),
so the backward recomputes it, identically on gpu, sim and cpu.
"""

from __future__ import annotations

import numpy as np

from numbactr.autograd import Context, Function
from numbactr.autograd.tape import native_dtype as _out
from numbactr.autograd.tape import native_inputs as _half
from numbactr.kernels import dropout
from numbactr.kernels import elementwise
from numbactr.kernels import fm_order2
from numbactr.kernels import relu
from numbactr.kernels import scale
from numbactr.kernels import weight_multiply
from numbactr.ops.buffers import grad_of, into, out_of
from numbactr.ops.dispatch import pick
from numbactr.runtime import step_values
from numbactr.runtime.device import contig as _contig
from numbactr.runtime.device import xp as _xp


# ---- ReLU: y = max(x, 0) ---------------------------------------------------------------------
# (``out``: the planned step's buffer for the result, numbactr.ops.buffers; None: a new array)
def _relu_forward_kernel(x, out=None):
    y = _xp().empty_like(x) if out is None else out
    relu.relu_forward(x, y)
    return y


def _relu_forward_cpu(x, out=None):
    x = _contig(x)
    y = np.empty_like(x) if out is None else out
    relu.relu_forward_cpu(x, y)
    return y


def _relu_forward_ref(x, out=None):
    return into(out, relu.relu_forward_ref(x))


def _relu_backward_kernel(y, dy, out=None):
    dy = _contig(dy)
    dx = _xp().empty_like(dy) if out is None else out
    relu.relu_backward(y, dy, dx)
    return dx


def _relu_backward_cpu(y, dy, out=None):
    dy = _contig(dy)
    dx = _xp().empty_like(dy) if out is None else out
    relu.relu_backward_cpu(y, dy, dx)
    return dx


def _relu_backward_ref(y, dy, out=None):
    return into(out, relu.relu_backward_ref(y, dy))


class ReLU(Function):
    half_native = True  # gpu/sim kernels load float16, compare in float32, store float16
    #: writes into the planned step's buffers when given (ctx.out, ctx.grad_into: numbactr.ops.buffers)
    writes_into = True

    @staticmethod
    def forward(ctx: Context, x):
        ctx.y = pick(kernel=_relu_forward_kernel, cpu=_relu_forward_cpu, ref=_relu_forward_ref)(x, out_of(ctx))
        return ctx.y

    @staticmethod
    def backward(ctx: Context, dy):
        return pick(kernel=_relu_backward_kernel, cpu=_relu_backward_cpu, ref=_relu_backward_ref)(
            ctx.y, dy, grad_of(ctx, 0)
        )


class Identity(Function):
    """y = x (no copy); the gradient passes through. Cast in fp32 mode, Dropout in eval mode."""

    @staticmethod
    def forward(ctx: Context, x):
        return x

    @staticmethod
    def backward(ctx: Context, dy):
        return dy


# ---- Add: y = Σ x_i ---------------------------------------------------------------------------
def _stacked(xs):
    """(K, M) copy of K same-shape inputs, written by a kernel (one row per input)."""
    out = _xp().empty((len(xs), xs[0].size), np.float32)
    elementwise.stack([_contig(x) for x in xs], out)
    return out


def _add_kernel(ctx, xs):
    y = out_of(ctx)
    y = _xp().empty(xs[0].shape, _out(ctx)) if y is None else y
    elementwise.add_forward(_stacked(xs), y)
    return y


def _add_ref(ctx, xs):
    y = out_of(ctx)
    if y is None:
        return elementwise.add_forward_ref(xs)
    return _fold(np.add, xs, y)


def _fold(ufunc, xs, y):
    """y = ((x0 op x1) op x2) ... in input order, written into ``y`` (the references' order and rounding:
    each step is the same float32 operation, stored in place of a new array)."""
    ufunc(xs[0], xs[1], out=y)
    for x in xs[2:]:
        ufunc(y, x, out=y)
    return y


class AddFn(Function):
    """y = sum of K >= 2 same-shape inputs; every input's gradient is dY (shared, never written)."""

    half_native = True
    #: writes into the planned step's buffers when given (ctx.out, ctx.grad_into: numbactr.ops.buffers)
    writes_into = True

    @staticmethod
    def forward(ctx: Context, *xs):
        return pick(kernel=_add_kernel, ref=_add_ref)(ctx, _half(ctx, *xs))

    @staticmethod
    def backward(ctx: Context, dy):
        return tuple(dy if need else None for need in ctx.needs_input_grad)


# ---- Sub: y = a - b -----------------------------------------------------------------------------
def _sub_forward_kernel(ctx, a, b):
    y = _xp().empty(a.shape, _out(ctx))
    elementwise.sub_forward(_contig(a), _contig(b), y)
    return y


def _sub_forward_ref(ctx, a, b):
    return elementwise.sub_forward_ref(a, b)


def _sub_backward_kernel(dy):
    da, db = _xp().empty_like(dy), _xp().empty_like(dy)
    elementwise.sub_backward(_contig(dy), da, db)
    return da, db


class SubFn(Function):
    half_native = True

    @staticmethod
    def forward(ctx: Context, a, b):
        a, b = _half(ctx, a, b)
        return pick(kernel=_sub_forward_kernel, ref=_sub_forward_ref)(ctx, a, b)

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        return pick(kernel=_sub_backward_kernel, ref=elementwise.sub_backward_ref)(dy)


# ---- Multiply: y = Π x_i ------------------------------------------------------------------------
def _multiply_forward_kernel(ctx, xs):
    stacked = _stacked(xs)  # (K, M)
    y = out_of(ctx)
    y = _xp().empty(xs[0].shape, _out(ctx)) if y is None else y
    elementwise.multiply_forward(stacked, y)
    ctx.stacked = stacked
    return y


def _multiply_forward_ref(ctx, xs):
    ctx.xs = xs
    y = out_of(ctx)
    if y is None:
        return elementwise.multiply_forward_ref(xs)
    return _fold(np.multiply, xs, y)


def _multiply_backward_kernel(ctx, dy):
    dxs = _xp().empty(ctx.stacked.shape, np.float32)  # (K, M)
    elementwise.multiply_backward(ctx.stacked, _contig(dy), dxs, exact=ctx.exact, y=ctx.y)
    return tuple(dxs[k].reshape(ctx.shape) for k in range(dxs.shape[0]))


def _multiply_backward_ref(ctx, dy):
    if ctx.exact or not ctx.grad_into:
        return tuple(elementwise.multiply_backward_ref(ctx.xs, dy, exact=ctx.exact, y=ctx.y))
    dxs = []  # dX_k = dY · x_0 · ... (k left out), in the reference's order, each into its buffer (or anew)
    for k in range(len(ctx.xs)):
        others = [x for j, x in enumerate(ctx.xs) if j != k]
        buf = grad_of(ctx, k)
        dxs.append(
            elementwise.multiply_forward_ref([dy, *others]) if buf is None else _fold(np.multiply, [dy, *others], buf)
        )
    return tuple(dxs)


class MultiplyFn(Function):
    """y = product of K >= 2 same-shape inputs; ``exact`` picks HugeCTR's quotient gradient."""

    half_native = True  # gpu/sim: float16 in and out, the (K, M) stacks float32
    #: writes into the planned step's buffers when given (ctx.out, ctx.grad_into: numbactr.ops.buffers)
    writes_into = True

    @staticmethod
    def forward(ctx: Context, *xs, exact: bool = False):
        xs = _half(ctx, *xs)
        ctx.exact, ctx.shape = exact, xs[0].shape
        ctx.y = pick(kernel=_multiply_forward_kernel, ref=_multiply_forward_ref)(ctx, xs)
        return ctx.y

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        return pick(kernel=_multiply_backward_kernel, ref=_multiply_backward_ref)(ctx, dy)


# ---- ELU: y = x if x >= 0 else α(eˣ - 1) ------------------------------------------------------------
def _elu_forward_kernel(x, alpha):
    y = _xp().empty_like(x)
    elementwise.elu_forward(x, y, alpha)
    return y


def _elu_backward_kernel(x, dy, alpha):
    dx = _xp().empty_like(x)
    elementwise.elu_backward(x, _contig(dy), dx, alpha)
    return dx


class ELUFn(Function):
    half_native = True

    @staticmethod
    def forward(ctx: Context, x, alpha: float = 1.0):
        (x,) = _half(ctx, x)
        ctx.x, ctx.alpha = _contig(x), alpha
        return pick(kernel=_elu_forward_kernel, ref=elementwise.elu_forward_ref)(ctx.x, alpha)

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        return pick(kernel=_elu_backward_kernel, ref=elementwise.elu_backward_ref)(ctx.x, dy, ctx.alpha)


# ---- Sigmoid: y = 1 / (1 + e⁻ˣ) -----------------------------------------------------------------------
def _sigmoid_forward_kernel(ctx, x):
    y = _xp().empty(x.shape, _out(ctx))
    elementwise.sigmoid_forward(_contig(x), y)
    return y


def _sigmoid_forward_ref(ctx, x):
    return elementwise.sigmoid_forward_ref(x)


def _sigmoid_backward_kernel(y, dy):
    dx = _xp().empty_like(y)
    elementwise.sigmoid_backward(y, _contig(dy), dx)
    return dx


class SigmoidFn(Function):
    half_native = True

    @staticmethod
    def forward(ctx: Context, x):
        (x,) = _half(ctx, x)
        ctx.y = pick(kernel=_sigmoid_forward_kernel, ref=_sigmoid_forward_ref)(ctx, x)
        return ctx.y

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        return pick(kernel=_sigmoid_backward_kernel, ref=elementwise.sigmoid_backward_ref)(ctx.y, dy)


# ---- Scale: repeat elements (axis 0) or rows (axis 1) f times -------------------------------------
def _scale_forward_kernel(ctx, x):
    b, n = x.shape
    y = out_of(ctx)
    y = _xp().empty((b, n * ctx.factor) if ctx.axis == 0 else (b * ctx.factor, n), _out(ctx)) if y is None else y
    scale.scale_forward(_contig(x), y, ctx.axis, ctx.factor)
    return y


def _scale_forward_ref(ctx, x):
    y = out_of(ctx)
    if y is None:
        return scale.scale_forward_ref(x, ctx.axis, ctx.factor)
    b, n = x.shape  # np.repeat's copies, written into the buffer: (B, N, f) or (B, f, N)
    if ctx.axis == 0:
        y.reshape(b, n, ctx.factor)[...] = x[:, :, None]
    else:
        y.reshape(b, ctx.factor, n)[...] = x[:, None, :]
    return y


def _scale_backward_kernel(ctx, dy):
    dx = grad_of(ctx, 0)
    dx = _xp().empty(ctx.in_shape, _out(ctx)) if dx is None else dx
    scale.scale_backward(_contig(dy), dx, ctx.axis, ctx.factor, ctx.first_only)
    return dx


def _scale_backward_ref(ctx, dy):
    return into(grad_of(ctx, 0), scale.scale_backward_ref(dy, ctx.axis, ctx.factor, ctx.first_only))


class ScaleFn(Function):
    """Repeat elements (axis 0) or rows (axis 1) ``factor`` times; see kernels/scale.py."""

    half_native = True
    #: writes into the planned step's buffers when given (ctx.out, ctx.grad_into: numbactr.ops.buffers)
    writes_into = True

    @staticmethod
    def forward(ctx: Context, x, axis: int = 0, factor: int = 1, first_only: bool = False):
        (x,) = _half(ctx, x)
        ctx.axis, ctx.factor, ctx.first_only, ctx.in_shape = axis, factor, first_only, x.shape
        return pick(kernel=_scale_forward_kernel, ref=_scale_forward_ref)(ctx, x)

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        return pick(kernel=_scale_backward_kernel, ref=_scale_backward_ref)(ctx, dy)


# ---- Dropout: y = x·keep/(1 - r), keep a hash of (seed, step, layer id, index) --------------------------
def _dropout_kernel(ctx, x):
    """Forward and backward alike: the same mask and scale applied to x or dY."""
    y = _xp().empty(x.shape, _out(ctx))
    dropout.dropout_apply(_contig(x), y, *ctx.args)
    return y


def _dropout_forward_ref(ctx, x):
    return dropout.dropout_forward_ref(x, *ctx.args)


def _dropout_backward_ref(ctx, dy):
    return dropout.dropout_backward_ref(dy, *ctx.args)


class DropoutFn(Function):
    """Training-mode dropout; the backward recomputes the same hash mask (nothing is stored)."""

    half_native = True

    @staticmethod
    def forward(ctx: Context, x, rate: float = 0.5, seed: int = 0, step: int = 0, layer_id: int = 0):
        (x,) = _half(ctx, x)
        ctx.args = (rate, seed, step, layer_id)
        return pick(kernel=_dropout_kernel, ref=_dropout_forward_ref)(ctx, x)

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        return pick(kernel=_dropout_kernel, ref=_dropout_backward_ref)(ctx, dy)


def _dropout_step_kernel(owner, step: int):
    sv = step_values.held(owner, "_step_values", 1, np.uint64)
    step = sv.put(step & dropout.MASK64)
    step_values.on_replay(("dropout", id(owner)), lambda r: sv.put(int(r["step"]) & dropout.MASK64))
    return step


def _dropout_step_host(owner, step: int):
    return step


def dropout_step(owner, step: int):
    """DropoutFn's ``step`` argument for the training step ``step`` of the layer ``owner``: on gpu/sim the step
    in device memory (numbactr.runtime.step_values, held by owner), so each step repeats the same launch
    (a captured step replays with the new value); on cpu the int itself."""
    return pick(kernel=_dropout_step_kernel, ref=_dropout_step_host)(owner, step)


# ---- WeightMultiply: y[b, s·V+v] = x[b, s]·W[s, v] ------------------------------------------------------
def _wm_forward_kernel(ctx):
    y = _xp().empty((ctx.x.shape[0], ctx.w.size), _out(ctx))
    weight_multiply.weight_multiply_forward(ctx.x, ctx.w, y)
    return y


def _wm_forward_ref(ctx):
    return weight_multiply.weight_multiply_forward_ref(ctx.x, ctx.w)


def _wm_backward_kernel(ctx, dy):
    xp = _xp()
    dx = xp.empty_like(ctx.x) if ctx.needs_input_grad[0] else None
    dw = xp.empty_like(ctx.w)
    weight_multiply.weight_multiply_backward(ctx.x, ctx.w, _contig(dy), dx, dw)
    return dx, dw


def _wm_backward_ref(ctx, dy):
    dx, dw = weight_multiply.weight_multiply_backward_ref(ctx.x, ctx.w, dy)
    return (dx if ctx.needs_input_grad[0] else None), dw


class WeightMultiplyFn(Function):
    """x (B, S), W (S, V) -> (B, S*V)."""

    half_native = True  # gpu/sim: float16 x and y, float32 W and dW

    @staticmethod
    def forward(ctx: Context, x, w):
        (x,) = _half(ctx, x)
        ctx.x, ctx.w = _contig(x), _contig(w)
        return pick(kernel=_wm_forward_kernel, ref=_wm_forward_ref)(ctx)

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        return pick(kernel=_wm_backward_kernel, ref=_wm_backward_ref)(ctx, dy)


# ---- FmOrder2: y = ½((Σ_s x_s)² - Σ_s x_s²) per component --------------------------------------------
def _fm_forward_kernel(ctx):
    y = _xp().empty((ctx.x.shape[0], ctx.out_dim), _out(ctx))
    fm_order2.fm_order2_forward(ctx.x, y)
    return y


def _fm_forward_ref(ctx):
    return fm_order2.fm_order2_forward_ref(ctx.x, ctx.out_dim)


def _fm_backward_kernel(ctx, dy):
    dx = _xp().empty_like(ctx.x)
    fm_order2.fm_order2_backward(ctx.x, _contig(dy), dx)
    return dx


def _fm_backward_ref(ctx, dy):
    return fm_order2.fm_order2_backward_ref(ctx.x, dy, ctx.out_dim)


class FmOrder2Fn(Function):
    """x (B, S*V) -> (B, V)."""

    half_native = True

    @staticmethod
    def forward(ctx: Context, x, out_dim: int = 1):
        (x,) = _half(ctx, x)
        ctx.x, ctx.out_dim = _contig(x), out_dim
        return pick(kernel=_fm_forward_kernel, ref=_fm_forward_ref)(ctx)

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        return pick(kernel=_fm_backward_kernel, ref=_fm_backward_ref)(ctx, dy)
