"""One autograd Function per kernel op. Each picks, per device, the numba.cuda kernel launch
(gpu, sim), the op's compiled CPU version (cpu, numbactr.runtime.device.compiled_cpu()) or its NumPy reference
(cpu under numbactr.runtime.device.reference_ops() / NUMBACTR_CPU_REFERENCE=1). Matrix products use the array
library (cuBLAS via cupy on gpu, BLAS on cpu/sim, on contiguous operands or their transposed views:
no copies); everything else goes through numbactr.kernels.

Shape glossary: B batch, S slots, N keys, D embedding width, K/N_out layer widths.
"""
from __future__ import annotations

import os

import numpy as np

from numbactr.autograd import Context, Function
from numbactr.kernels import bce, bias, concat, embedding_bag, interaction, relu
from numbactr.runtime.device import compiled_cpu as _compiled, contig as _contig, uses_kernels as _kernels, xp as _xp  # noqa: F401


def _half_mm(a, b):
    """a @ b of float16 matrices with float32 accumulation and a float16 result (mixed precision on gpu and
    sim): cuBLAS's tensor-core GEMM through CuPy on a GPU (CuPy's default compute type for float16 inputs
    is float32); on the simulator NumPy in float32, rounded to float16 once (NumPy's own float16 product
    would round every partial sum)."""
    if _xp().__name__ != "cupy":          # (numpy, and the simulator's strict arrays: numbactr.runtime.sim_strict)
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    return a @ b


# ---- InnerProduct: y = x W + b ---------------------------------------------------------------

def fuse_bias_relu() -> bool:
    """Fuse an InnerProduct's bias add with the ReLU layer after it (one kernel each way) on the kernel devices
    (gpu, sim), where every pass over the activations costs a launch and a read and write of memory; the cpu
    device keeps the two layers (its results are the test oracle). NUMBACTR_FUSE_BIAS_RELU=0 turns it off."""
    flag = os.environ.get("NUMBACTR_FUSE_BIAS_RELU", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"NUMBACTR_FUSE_BIAS_RELU must be 0 or 1, got {flag!r}")
    return flag == "1" and _kernels()

class Linear(Function):
    # mixed precision on gpu/sim: float16 x and y, the GEMMs in float16 with float32 accumulation on a
    # float16 copy of the float32 master weights (HugeCTR's layers keep one too), the bias added in float32
    half_native = True

    @staticmethod
    def forward(ctx: Context, x, w, b):
        x2 = x.reshape(-1, x.shape[-1])                          # (B*, K): applied to the last dim
        if ctx.native_half:
            x2, w16 = _contig(x2.astype(np.float16, copy=False)), w.astype(np.float16)
            y = _half_mm(x2, w16)                                # (B*, N) float16
            bias.bias_add(y, b)
            ctx.x2, ctx.w, ctx.in_shape = x2, w16, x.shape
            return y.reshape(*x.shape[:-1], w.shape[1])
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
        if ctx.native_half:
            dy2 = _contig(dy2.astype(np.float16, copy=False))
            dw = _half_mm(ctx.x2.T, dy2).astype(np.float32)      # (K, N): float16 GEMM, float32 for the update
            db = _xp().empty((dy2.shape[1],), np.float32)
            bias.bias_grad(dy2, db)
            dx = _half_mm(dy2, ctx.w.T).reshape(ctx.in_shape) if ctx.needs_input_grad[0] else None
            return dx, dw, db
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
    half_native = True                 # gpu/sim kernels load float16, compare in float32, store float16

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

    half_native = True                 # gpu/sim: float16 copied as float16

    @staticmethod
    def forward(ctx: Context, *xs, axis: int = 1):
        ctx.axis, ctx.widths = axis, [x.shape[axis] for x in xs]
        dtype = np.float16 if ctx.native_half else np.float32
        if ctx.native_half:
            xs = tuple(x.astype(np.float16, copy=False) for x in xs)
        if _kernels():
            shape = list(xs[0].shape)
            shape[axis] = sum(ctx.widths)
            out = _xp().empty(tuple(shape), dtype)
            concat.concat_forward([_contig(x) for x in xs], out, axis=axis)
            return out
        return concat.concat_forward_ref(xs, axis=axis)

    @staticmethod
    def backward(ctx: Context, dy):
        if ctx.native_half:
            dy = dy.astype(np.float16, copy=False)
        if _kernels():
            dxs = []
            for w in ctx.widths:
                shape = list(dy.shape)
                shape[ctx.axis] = w
                dxs.append(_xp().empty(tuple(shape), dy.dtype if ctx.native_half else np.float32))
            concat.concat_backward(_contig(dy), dxs, axis=ctx.axis)
            return tuple(dxs)
        return tuple(concat.concat_backward_ref(dy, ctx.widths, axis=ctx.axis))


class Reshape(Function):
    half_native = True                 # a view: any dtype

    @staticmethod
    def forward(ctx: Context, x, shape: tuple = ()):
        ctx.in_shape = x.shape
        return x.reshape(shape)

    @staticmethod
    def backward(ctx: Context, dy):
        return dy.reshape(ctx.in_shape)


class Interaction(Function):
    """DLRM dot interaction, HugeCTR layout: [dense, strict lower triangle of Z Zᵀ, 0 pad]."""

    half_native = True                 # gpu/sim kernels: float16 in and out, float32 dot products

    @staticmethod
    def forward(ctx: Context, dense, emb):
        if ctx.native_half:
            dense, emb = dense.astype(np.float16, copy=False), emb.astype(np.float16, copy=False)
        dense, emb = _contig(dense), _contig(emb)
        ctx.dense, ctx.emb = dense, emb
        if _kernels() or _compiled():
            out = _xp().empty((dense.shape[0], interaction.interaction_out_width(emb.shape[1], dense.shape[1])),
                              np.float16 if ctx.native_half else np.float32)
            (interaction.interaction_forward if _kernels() else interaction.interaction_forward_cpu)(dense, emb, out)
            return out
        return interaction.interaction_forward_ref(dense, emb)

    @staticmethod
    def backward(ctx: Context, dy):
        if ctx.native_half:
            dy = dy.astype(np.float16, copy=False)
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
    reported loss), which the model does under numbactr.hugectr_exact.hugectr_exact().
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
