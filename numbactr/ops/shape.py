"""Shape ops: Concat, Reshape, ReduceAxis, Slice, Select (Select, Gather, Reshape with selected slots),
FusedReshapeConcat(General), SequenceMask. None has parameters.

Contract: autograd Functions on raw arrays; numbactr.ops.dispatch.pick sends each direction to the
numba.cuda kernels of numbactr.kernels.{concat, reduce_axis, slice_select, fused_reshape_concat,
sequence_mask} on gpu/sim and their NumPy references on cpu. Reshape is a view on every device.

Formulas: Concat y = [x_1 | ... | x_K] on ``axis``; ReduceAxis y = Σ_axis x (or the mean), dX = dY
broadcast (/ n); Slice y_i = x[..., a_i:b_i], dX = Σ_i dY_i placed at [a_i, b_i); Select y = x[index]
along ``dim``, dX = scatter-add of dY (0 where not selected); SequenceMask m[b, 0, i, j] =
(i < len_from[b]) and (j < len_to[b]).

Why Select's backward adds and zero-fills (HugeCTR writes with '=', leaving unselected gradients stale and
racing on duplicate indices): the gradient of a gather is a scatter-add, and a repeated index is legal.
"""

from __future__ import annotations

import numpy as np

from numbactr.autograd import Context, Function
from numbactr.autograd.tape import native_dtype as _out
from numbactr.autograd.tape import native_inputs as _half
from numbactr.kernels import concat, reduce_axis, sequence_mask, slice_select
from numbactr.kernels import fused_reshape_concat
from numbactr.ops.buffers import grad_of, out_of
from numbactr.ops.dispatch import pick
from numbactr.runtime.device import contig as _contig
from numbactr.runtime.device import empty as _empty
from numbactr.runtime.device import xp as _xp


# ---- Concat: y = [x_1 | ... | x_K] on axis ----------------------------------------------------------
# (the planned step's buffers, numbactr.ops.buffers: the output's ``out_of(ctx)``, each input gradient's
# ``grad_of(ctx, i)``; copies into them are the same copies as into new arrays)
def _concat_forward_kernel(ctx, xs, dtype):
    shape = list(xs[0].shape)
    shape[ctx.axis] = sum(ctx.widths)
    out = out_of(ctx)
    out = _xp().empty(tuple(shape), dtype) if out is None else out
    concat.concat_forward([_contig(x) for x in xs], out, axis=ctx.axis)
    return out


def _concat_forward_ref(ctx, xs, dtype):
    out = out_of(ctx)
    if out is None:
        return concat.concat_forward_ref(xs, axis=ctx.axis)
    return np.concatenate(xs, axis=ctx.axis, out=out)


def _concat_backward_kernel(ctx, dy):
    dxs = []
    for i, w in enumerate(ctx.widths):
        shape = list(dy.shape)
        shape[ctx.axis] = w
        buf = grad_of(ctx, i)
        dxs.append(_xp().empty(tuple(shape), dy.dtype if ctx.native_half else np.float32) if buf is None else buf)
    concat.concat_backward(_contig(dy), dxs, axis=ctx.axis)
    return tuple(dxs)


def _concat_backward_ref(ctx, dy):
    if not ctx.grad_into:
        return tuple(concat.concat_backward_ref(dy, ctx.widths, axis=ctx.axis))
    cuts = np.cumsum(ctx.widths)[:-1]  # concat_backward_ref's pieces, each copied into its buffer (or anew)
    dxs = []
    for i, piece in enumerate(np.split(dy, cuts, axis=ctx.axis)):
        buf = grad_of(ctx, i)
        if buf is None:
            dxs.append(np.array(piece))
        else:
            buf[...] = piece
            dxs.append(buf)
    return tuple(dxs)


class Concat(Function):
    """Concatenate along ``axis`` (2-D: axis 1; 3-D: axis 1 or 2)."""

    half_native = True  # gpu/sim: float16 copied as float16
    #: writes into the planned step's buffers when given (ctx.out, ctx.grad_into: numbactr.ops.buffers)
    writes_into = True

    @staticmethod
    def forward(ctx: Context, *xs, axis: int = 1):
        ctx.axis, ctx.widths = axis, [x.shape[axis] for x in xs]
        dtype = np.float16 if ctx.native_half else np.float32
        if ctx.native_half:
            xs = tuple(x.astype(np.float16, copy=False) for x in xs)
        return pick(kernel=_concat_forward_kernel, ref=_concat_forward_ref)(ctx, xs, dtype)

    @staticmethod
    def backward(ctx: Context, dy):
        if ctx.native_half:
            dy = dy.astype(np.float16, copy=False)
        return pick(kernel=_concat_backward_kernel, ref=_concat_backward_ref)(ctx, dy)


class Reshape(Function):
    half_native = True  # a view: any dtype

    @staticmethod
    def forward(ctx: Context, x, shape: tuple = ()):
        ctx.in_shape = x.shape
        return x.reshape(shape)

    @staticmethod
    def backward(ctx: Context, dy):
        return dy.reshape(ctx.in_shape)


# ---- ReduceAxis: y = Σ_axis x (or the mean), axis kept as size 1 ----------------------------------
def _reduce_forward_kernel(ctx, x):
    out = list(x.shape)
    out[ctx.axis] = 1
    y = _empty(out, _out(ctx))
    reduce_axis.reduce_axis_forward(_contig(x), y, ctx.axis, ctx.mean)
    return y


def _reduce_forward_ref(ctx, x):
    return reduce_axis.reduce_axis_forward_ref(x, ctx.axis, ctx.mean)


def _reduce_backward_kernel(ctx, dy):
    dx = _empty(ctx.in_shape, _out(ctx))
    reduce_axis.reduce_axis_backward(_contig(dy), dx, ctx.axis, ctx.mean)
    return dx


def _reduce_backward_ref(ctx, dy):
    return reduce_axis.reduce_axis_backward_ref(dy, ctx.in_shape, ctx.axis, ctx.mean)


class ReduceAxis(Function):
    """Sum (mean=False) or mean over ``axis``, keeping it as size 1."""

    half_native = True  # gpu/sim: float16 in and out, summed in float32

    @staticmethod
    def forward(ctx: Context, x, axis: int = 1, mean: bool = False):
        (x,) = _half(ctx, x)
        ctx.in_shape, ctx.axis, ctx.mean = x.shape, axis, mean
        return pick(kernel=_reduce_forward_kernel, ref=_reduce_forward_ref)(ctx, x)

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        return pick(kernel=_reduce_backward_kernel, ref=_reduce_backward_ref)(ctx, dy)


# ---- Slice: y_i = x[..., a_i:b_i] -------------------------------------------------------------------
def _slice_forward_kernel(ctx, x):
    if ctx.out:
        ys = list(ctx.out)
    else:
        ys = [_empty(x.shape[:-1] + (b - a,), _out(ctx)) for a, b in ctx.ranges]
    slice_select.slice_forward(_contig(x), ys, [a for a, _ in ctx.ranges])
    return tuple(ys)


def _slice_forward_ref(ctx, x):
    if not ctx.out:
        return tuple(slice_select.slice_forward_ref(x, ctx.ranges))
    for y, (a, b) in zip(ctx.out, ctx.ranges):  # slice_forward_ref's copies, into the buffers
        y[...] = x[..., a:b]
    return ctx.out


def _slice_backward_kernel(ctx, dys):
    dx = grad_of(ctx, 0)
    dx = _empty(ctx.in_shape, _out(ctx)) if dx is None else dx
    dys = [None if d is None else _contig(_half(ctx, d)[0]) for d in dys]
    slice_select.slice_backward(dys, dx, [a for a, _ in ctx.ranges])
    return dx


def _slice_backward_ref(ctx, dys):
    used = [(d, r) for d, r in zip(dys, ctx.ranges) if d is not None]  # an unused top adds 0
    dx = grad_of(ctx, 0)
    if dx is None:
        return slice_select.slice_backward_ref([d for d, _ in used], [r for _, r in used], ctx.in_shape)
    spans = sorted(r for _, r in used)
    if all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:])):
        # disjoint ranges: each column is 0 + d once, written in one pass (0 + d is d, and -0.0 becomes 0.0
        # as in the reference), the columns no range covers zeroed
        for d, (a, b) in used:
            np.add(d, np.float32(0), out=dx[..., a:b])
        edges = [0] + [e for r in spans for e in r] + [dx.shape[-1]]
        for a, b in zip(edges[::2], edges[1::2]):
            if a < b:
                dx[..., a:b] = 0
        return dx
    dx[...] = 0  # overlapping ranges: slice_backward_ref's zeros and additions, in its order, into the buffer
    for d, (a, b) in used:
        dx[..., a:b] += d
    return dx


class SliceFn(Function):
    """Column ranges [a, b) of the last dim, one output each (a tuple, even for one range)."""

    half_native = True  # gpu/sim: float16 copied as float16 (overlaps add in float32)
    #: writes into the planned step's buffers when given (ctx.out, ctx.grad_into: numbactr.ops.buffers)
    writes_into = True

    @staticmethod
    def forward(ctx: Context, x, ranges: tuple = ()):
        (x,) = _half(ctx, x)
        ctx.in_shape, ctx.ranges = x.shape, ranges
        return pick(kernel=_slice_forward_kernel, ref=_slice_forward_ref)(ctx, x)

    @staticmethod
    def backward(ctx: Context, *dys):
        return pick(kernel=_slice_backward_kernel, ref=_slice_backward_ref)(ctx, dys)


# ---- Select: y = x[index] along dim; dX = scatter-add of dY -----------------------------------------
class Index:
    """An index list on the host (references) and, once a kernel needs it, on the device."""

    def __init__(self, values):
        self.host = np.asarray(list(values), dtype=np.int64)
        self._dev = {}

    def on_device(self):
        xp = _xp()
        if xp.__name__ not in self._dev:
            self._dev[xp.__name__] = xp.ascontiguousarray(xp.asarray(self.host))
        return self._dev[xp.__name__]


def _select_forward_kernel(ctx, x):
    y = _empty(ctx.sel_shape)
    slice_select.select_forward(_contig(x), ctx.index.on_device(), y, ctx.dim)
    return y


def _select_forward_ref(ctx, x):
    return slice_select.select_forward_ref(x, ctx.dim, ctx.index.host)


def _select_backward_kernel(ctx, dy):
    dx = _empty(ctx.in_shape)
    slice_select.select_backward(_contig(dy), ctx.index.on_device(), dx, ctx.dim)
    return dx


def _select_backward_ref(ctx, dy):
    return slice_select.select_backward_ref(dy, ctx.in_shape, ctx.dim, ctx.index.host)


class SelectFn(Function):
    """Entries ``index`` along ``dim`` (Select, Gather, Reshape with selected slots).

    ``out_shape`` (optional) reshapes the (P, K, Q)-ordered result, e.g. (B, K, V) -> (B, K*V).
    """

    @staticmethod
    def forward(ctx: Context, x, dim: int = 1, index: Index = None, out_shape: tuple = ()):
        sel_shape = x.shape[:dim] + (index.host.size,) + x.shape[dim + 1 :]
        ctx.in_shape, ctx.dim, ctx.index, ctx.sel_shape = x.shape, dim, index, sel_shape
        y = pick(kernel=_select_forward_kernel, ref=_select_forward_ref)(ctx, x)
        return y.reshape(out_shape) if out_shape else y

    @staticmethod
    def backward(ctx: Context, dy):
        dy = dy.reshape(ctx.sel_shape)
        return pick(kernel=_select_backward_kernel, ref=_select_backward_ref)(ctx, dy)


# ---- FusedReshapeConcat: (B, S, w_i) -> item (B*(S-1), W), ad (B, W) ---------------------------------
def _frc_forward_kernel(ctx, xs):
    b, s = xs[0].shape[:2]
    w = sum(ctx.widths)
    item, ad = _empty((b * (s - 1), w)), _empty((b, w))
    fused_reshape_concat.fused_reshape_concat_forward([_contig(x) for x in xs], item, ad)
    return item, ad


def _frc_forward_ref(ctx, xs):
    return fused_reshape_concat.fused_reshape_concat_forward_ref(xs)


def _frc_backward_kernel(ctx, d_item, d_ad):
    dxs = [_empty((d_ad.shape[0], ctx.slots, wi)) for wi in ctx.widths]
    fused_reshape_concat.fused_reshape_concat_backward(_contig(d_item), _contig(d_ad), dxs)
    return tuple(dxs)


def _frc_backward_ref(ctx, d_item, d_ad):
    return tuple(fused_reshape_concat.fused_reshape_concat_backward_ref(d_item, d_ad, ctx.widths, ctx.slots))


class FusedReshapeConcatFn(Function):
    """Inputs (B, S, w_i) -> item (B*(S-1), W), ad (B, W)."""

    @staticmethod
    def forward(ctx: Context, *xs):
        ctx.widths, ctx.slots = [x.shape[2] for x in xs], xs[0].shape[1]
        return pick(kernel=_frc_forward_kernel, ref=_frc_forward_ref)(ctx, xs)

    @staticmethod
    def backward(ctx: Context, d_item, d_ad):
        w = sum(ctx.widths)
        # an unused top contributes a zero gradient
        if d_item is None:
            d_item = _xp().zeros((d_ad.shape[0] * (ctx.slots - 1), w), np.float32)
        if d_ad is None:
            d_ad = _xp().zeros((d_item.shape[0] // (ctx.slots - 1), w), np.float32)
        return pick(kernel=_frc_backward_kernel, ref=_frc_backward_ref)(ctx, d_item, d_ad)


# ---- FusedReshapeConcatGeneral: (B, S, w_i) -> (B*S, W) ---------------------------------------------
def _frcg_forward_kernel(ctx, xs):
    b, s = xs[0].shape[:2]
    out = _empty((b * s, sum(ctx.widths)))
    fused_reshape_concat.fused_reshape_concat_general_forward([_contig(x) for x in xs], out)
    return out


def _frcg_forward_ref(ctx, xs):
    return fused_reshape_concat.fused_reshape_concat_general_forward_ref(xs)


def _frcg_backward_kernel(ctx, d_out):
    b = d_out.shape[0] // ctx.slots
    dxs = [_empty((b, ctx.slots, wi)) for wi in ctx.widths]
    fused_reshape_concat.fused_reshape_concat_general_backward(_contig(d_out), dxs)
    return tuple(dxs)


def _frcg_backward_ref(ctx, d_out):
    return tuple(fused_reshape_concat.fused_reshape_concat_general_backward_ref(d_out, ctx.widths, ctx.slots))


class FusedReshapeConcatGeneralFn(Function):
    """Inputs (B, S, w_i) -> (B*S, W)."""

    @staticmethod
    def forward(ctx: Context, *xs):
        ctx.widths, ctx.slots = [x.shape[2] for x in xs], xs[0].shape[1]
        return pick(kernel=_frcg_forward_kernel, ref=_frcg_forward_ref)(ctx, xs)

    @staticmethod
    def backward(ctx: Context, d_out):
        return pick(kernel=_frcg_backward_kernel, ref=_frcg_backward_ref)(ctx, d_out)


# ---- SequenceMask: m[b, 0, i, j] = (i < len_from[b]) and (j < len_to[b]) -----------------------------
def _mask_kernel(len_from, len_to, lf, lt):
    y = _empty((len_from.shape[0], 1, lf, lt))
    sequence_mask.sequence_mask(_contig(len_from), _contig(len_to), y)
    return y


class SequenceMaskFn(Function):
    """Lengths (B, 1), (B, 1) -> mask (B, 1, Lf, Lt); no gradient flows back. ``one_from``: every from-length
    is 1 (the one-bottom SequenceMask; ``len_from`` is then only read for its shape)."""

    @staticmethod
    def forward(ctx: Context, len_from, len_to, lf: int = 1, lt: int = 1, one_from: bool = False):
        if one_from:
            len_from = _xp().ones(len_to.shape, len_to.dtype)
        return pick(kernel=_mask_kernel, ref=sequence_mask.sequence_mask_ref)(len_from, len_to, lf, lt)

    @staticmethod
    def backward(ctx: Context, dy):
        return None, None
