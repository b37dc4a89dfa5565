"""Ops that do the work of several in one, for the planned step's fusions (numbactr.train.plan_fuse).

ScaleMultiplyFn: a Scale that repeats each element of g ``factor`` times (axis 0) and the Multiply that reads
the repeat, y = repeat(g) * x, without the repeated array: MMoE's gate probabilities times an expert's output.
Its inputs are (g, x); ``g_first`` keeps the Multiply's input order. Each direction reaches the kernels of
numbactr.kernels.scale_multiply through numbactr.ops.dispatch.pick (kernel on gpu/sim, NumPy reference on
cpu, where the planned step does not fuse the pair: kernels/scale_multiply.py says why);
dg is the Scale's own backward (its kernel or its reference) of dy * x, so the bits are the two ops' bits.
(The Linear + ReLU fusion needs no op of its own: it is FcBiasAct, numbactr.ops.dense.)

ActivationUnitInputFn: DIN's Scale (repeat the target over the history), Sub, ElementwiseMultiply and Concat,
y = [x | h | x - h | x * h] per history row, without the three intermediate arrays (kernels/activation_unit.py;
cpu only). Its backward must add its terms to the history's gradient in the four layers' order, after the
terms of the history's later readers: it ``accumulates`` input 1, receiving that gradient so far in
``ctx.grad_so_far`` and returning the whole (numbactr.train.plan).

WholeSliceFn: a Slice into column ranges that tile the last dim in order, read only by the Concat of all its
pieces in that order (HugeCTR's NCF sample slices the user and item vectors and concatenates them again):
the Concat's output is the Slice's input. Forward hands the input on (no copy: the values are the same);
backward is the Slice's backward of the Concat's pieces in one pass, dx = 0 + dy (a -0.0 becomes 0.0, as
the Slice's zeros and additions make it), so the bits are the two ops' bits.
"""

from __future__ import annotations

import numpy as np

from numbactr.autograd import Context, Function
from numbactr.kernels import activation_unit, scale, scale_multiply
from numbactr.ops.buffers import grad_of, into, out_of
from numbactr.ops.dispatch import pick
from numbactr.runtime.device import contig as _contig
from numbactr.runtime.device import xp as _xp


def _forward_with(launch, ctx, g, x):
    y = out_of(ctx)
    y = _xp().empty(x.shape, np.float32) if y is None else y
    launch(g, x, y, ctx.factor, ctx.g_first)
    return y


def _forward_kernel(ctx, g, x):
    return _forward_with(scale_multiply.scale_multiply, ctx, g, x)


def _forward_ref(ctx, g, x):
    return into(out_of(ctx), scale_multiply.scale_multiply_ref(g, x, ctx.factor, ctx.g_first))


def _backward_kernel(ctx, dy):
    xp = _xp()
    dx, dg = grad_of(ctx, 1), grad_of(ctx, 0)
    dx = xp.empty(dy.shape, np.float32) if dx is None else dx
    dg = xp.empty(ctx.g.shape, np.float32) if dg is None else dg
    ds = xp.empty(dy.shape, np.float32)
    scale_multiply.scale_multiply_backward(ctx.g, ctx.x, dy, ctx.factor, dx, ds)
    scale.scale_backward(ds, dg, 0, ctx.factor)  # (the Scale's backward kernel)
    return dg, dx


def _backward_ref(ctx, dy):
    dx, ds = scale_multiply.scale_multiply_backward_ref(ctx.g, ctx.x, dy, ctx.factor)
    return into(grad_of(ctx, 0), scale.scale_backward_ref(ds, 0, ctx.factor)), into(grad_of(ctx, 1), dx)


class ScaleMultiplyFn(Function):
    """y (B, N*f) = repeat(g (B, N), f) * x (B, N*f): ScaleFn(axis=0) then MultiplyFn in one pass (module
    docstring). float32 only (the planned step, which makes it, does not run mixed precision)."""

    #: writes into the planned step's buffers when given (ctx.out, ctx.grad_into: numbactr.ops.buffers)
    writes_into = True

    @staticmethod
    def forward(ctx: Context, g, x, factor: int = 1, g_first: bool = True):
        g, x = _contig(g), _contig(x)
        ctx.g, ctx.x, ctx.factor, ctx.g_first = g, x, factor, g_first
        return pick(kernel=_forward_kernel, ref=_forward_ref)(ctx, g, x)

    @staticmethod
    def backward(ctx: Context, dy):
        return pick(kernel=_backward_kernel, ref=_backward_ref)(ctx, _contig(dy))


class ActivationUnitInputFn(Function):
    """y (B*f, 4N) = [repeat(x) | h | repeat(x) - h | repeat(x) * h] for x (B, N), h (B*f, N) (module
    docstring). float32, cpu (the compiled passes of kernels/activation_unit.py)."""

    #: writes into the planned step's buffers when given (ctx.out, ctx.grad_into: numbactr.ops.buffers)
    writes_into = True
    #: input 1's gradient is handed in (ctx.grad_so_far) and returned whole, this op's terms added in order
    accumulates = (1,)

    @staticmethod
    def forward(ctx: Context, x, h, factor: int = 1):
        x, h = _contig(x), _contig(h)
        ctx.x, ctx.h, ctx.factor = x, h, factor
        return activation_unit.activation_input(x, h, factor, out_of(ctx))

    @staticmethod
    def backward(ctx: Context, dy):
        dh0 = ctx.grad_so_far.get(1)
        return activation_unit.activation_input_backward(
            ctx.x, ctx.h, ctx.factor, _contig(dy), dh0, grad_of(ctx, 0), grad_of(ctx, 1)
        )


class WholeSliceFn(Function):
    """y = x: the Concat of a Slice's pieces that tile x's last dim in order (module docstring)."""

    @staticmethod
    def forward(ctx: Context, x):
        return x  # (no buffer of its own: not ``writes_into``)

    @staticmethod
    def backward(ctx: Context, dy):
        return _xp().add(dy, dy.dtype.type(0))
