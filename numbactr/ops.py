"""One autograd Function per kernel op. Each picks, per device, the numba.cuda kernel launch
(gpu, sim), the op's compiled CPU version (cpu, numbactr.device.compiled_cpu()) or its NumPy reference
(cpu under numbactr.device.reference_ops() / NUMBACTR_CPU_REFERENCE=1). Matrix products use the array
library (cuBLAS via cupy on gpu, BLAS on cpu/sim, on contiguous operands or their transposed views:
no copies); everything else goes through numbactr.kernels.

Shape glossary: B batch, S slots, N keys, D embedding width, K/N_out layer widths.
"""
from __future__ import annotations

import numpy as np

from .autograd import Context, Function
from .kernels import bce, bias, concat, embedding_bag, interaction, relu
from .device import compiled_cpu as _compiled, contig as _contig, uses_kernels as _kernels, xp as _xp  # noqa: F401


# ---- InnerProduct: y = x W + b ---------------------------------------------------------------
class Linear(Function):
    @staticmethod
    def forward(ctx: Context, x, w, b):
        x2 = x.reshape(-1, x.shape[-1])                          # (B*, K): applied to the last dim
        y = x2 @ w                                               # (B*, N)
        if _kernels():
            bias.bias_add(y, b)
        elif _compiled():
            bias.bias_add_cpu(y, b)
        else:
            y = bias.bias_add_ref(y, b)
        ctx.x2, ctx.w, ctx.in_shape = x2, w, x.shape
        return y.reshape(*x.shape[:-1], w.shape[1])

    @staticmethod
    def backward(ctx: Context, dy):
        dy2 = dy.reshape(-1, dy.shape[-1])                       # (B*, N)
        dw = ctx.x2.T @ dy2                                      # (K, N)
        if _kernels():
            db = _xp().empty((dy2.shape[1],), np.float32)
            bias.bias_grad(dy2, db)
        elif _compiled():
            db = np.empty((dy2.shape[1],), np.float32)
            bias.bias_grad_cpu(_contig(dy2), db)
        else:
            db = bias.bias_grad_ref(dy2)
        dx = (dy2 @ ctx.w.T).reshape(ctx.in_shape) if ctx.needs_input_grad[0] else None
        return dx, dw, db


class ReLU(Function):
    @staticmethod
    def forward(ctx: Context, x):
        if _kernels():
            y = _xp().empty_like(x)
            relu.relu_forward(x, y)
        elif _compiled():
            x = _contig(x)
            y = np.empty_like(x)
            relu.relu_forward_cpu(x, y)
        else:
            y = relu.relu_forward_ref(x)
        ctx.y = y
        return y

    @staticmethod
    def backward(ctx: Context, dy):
        if _kernels() or _compiled():
            dy = _contig(dy)
            dx = _xp().empty_like(dy)
            (relu.relu_backward if _kernels() else relu.relu_backward_cpu)(ctx.y, dy, dx)
            return dx
        return relu.relu_backward_ref(ctx.y, dy)


class Concat(Function):
    """Concatenate along ``axis`` (2-D: axis 1; 3-D: axis 1 or 2)."""

    @staticmethod
    def forward(ctx: Context, *xs, axis: int = 1):
        ctx.axis, ctx.widths = axis, [x.shape[axis] for x in xs]
        if _kernels():
            shape = list(xs[0].shape)
            shape[axis] = sum(ctx.widths)
            out = _xp().empty(tuple(shape), np.float32)
            concat.concat_forward([_contig(x) for x in xs], out, axis=axis)
            return out
        return concat.concat_forward_ref(xs, axis=axis)

    @staticmethod
    def backward(ctx: Context, dy):
        if _kernels():
            dxs = []
            for w in ctx.widths:
                shape = list(dy.shape)
                shape[ctx.axis] = w
                dxs.append(_xp().empty(tuple(shape), np.float32))
            concat.concat_backward(_contig(dy), dxs, axis=ctx.axis)
            return tuple(dxs)
        return tuple(concat.concat_backward_ref(dy, ctx.widths, axis=ctx.axis))


class Reshape(Function):
    @staticmethod
    def forward(ctx: Context, x, shape: tuple = ()):
        ctx.in_shape = x.shape
        return x.reshape(shape)

    @staticmethod
    def backward(ctx: Context, dy):
        return dy.reshape(ctx.in_shape)


class Interaction(Function):
    """DLRM dot interaction, HugeCTR layout: [dense, strict lower triangle of Z Zᵀ, 0 pad]."""

    @staticmethod
    def forward(ctx: Context, dense, emb):
        dense, emb = _contig(dense), _contig(emb)
        ctx.dense, ctx.emb = dense, emb
        if _kernels() or _compiled():
            out = _xp().empty((dense.shape[0], interaction.interaction_out_width(emb.shape[1], dense.shape[1])),
                              np.float32)
            (interaction.interaction_forward if _kernels() else interaction.interaction_forward_cpu)(dense, emb, out)
            return out
        return interaction.interaction_forward_ref(dense, emb)

    @staticmethod
    def backward(ctx: Context, dy):
        if _kernels() or _compiled():
            d_dense, d_emb = _xp().empty_like(ctx.dense), _xp().empty_like(ctx.emb)
            (interaction.interaction_backward if _kernels() else interaction.interaction_backward_cpu)(
                ctx.dense, ctx.emb, _contig(dy), d_dense, d_emb)
            return d_dense, d_emb
        return tuple(interaction.interaction_backward_ref(ctx.dense, ctx.emb, dy))


class BinaryCrossEntropy(Function):
    """Sigmoid + BCE in one kernel: returns the mean loss over the valid rows, saves dX.

    HugeCTR semantics (spec §6.3): dX = (sigmoid(x) - y) * scaler / (b * ranks). ``backward`` scales dX
    by the incoming (1,) gradient of the loss value, so a loss weight w seeded by the model (the
    gradient of the reported loss Σ w_i·loss_i) gives w·dX; HugeCTR seeds 1 (weights scale only the
    reported loss), which the model does under numbactr.compat.hugectr_exact().
    """

    @staticmethod
    def forward(ctx: Context, x, y, valid: int = 0, grad_scale: float = 1.0):
        b = valid or x.shape[0]
        if _kernels():
            xp = _xp()
            dx = xp.empty_like(x)
            loss = xp.zeros((1,), np.float32)
            bce.bce_forward_backward(_contig(x), _contig(y), dx, loss, b, grad_scale)
            ctx.dx = dx
            return loss / np.float32(b)
        if _compiled():
            x = _contig(x)
            ctx.dx = np.empty_like(x)
            return np.asarray([bce.bce_forward_backward_cpu(x, _contig(y), ctx.dx, b, grad_scale)], np.float32)
        loss, dx = bce.bce_forward_backward_ref(x, y, b, grad_scale)
        ctx.dx = dx.reshape(x.shape).astype(np.float32)
        return np.asarray([loss], np.float32)

    @staticmethod
    def backward(ctx: Context, dloss):
        return scale_by_seed(ctx.dx, dloss), None


def scale_by_seed(dx, dloss):
    """dX scaled by the loss's incoming gradient dloss (1,): the chain rule through the loss value.
    A seed of exactly 1 (the common case) returns dX itself, bit for bit."""
    return dx * dloss.astype(dx.dtype, copy=False)


def sigmoid(x):
    """Predictions from logits (eval path; no autograd)."""
    if _kernels():
        y = _xp().empty_like(x)
        bce.sigmoid_forward(_contig(x), y)
        return y
    return bce.sigmoid_ref(x)


# ---- embedding bag ---------------------------------------------------------------------------
def embedding_bag_forward(table, rows, offsets, combiner: int):
    """(nbags, D) pooled rows; rows == -1 (missing in eval) add nothing but count for the mean."""
    if _kernels():
        out = _xp().empty((offsets.shape[0] - 1, table.shape[1]), np.float32)
        embedding_bag.embedding_bag_forward(table, rows, offsets, combiner, out)
        return out
    return embedding_bag.embedding_bag_forward_ref(table, rows, offsets, combiner)
