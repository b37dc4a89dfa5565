"""DLRM dot interaction, HugeCTR's layout: dense (B, D), emb (B, S, D) -> (B, D + (S+1)S/2 + 1).

Contract: an autograd Function on raw arrays; numbactr.ops.dispatch.pick sends it to the numba.cuda kernels
of numbactr.kernels.interaction on gpu/sim, their compiled CPU versions or the NumPy references on cpu.

Formula: Z = [dense; emb] (B, n = S+1, D); y = [dense | Z_i·Z_j for j < i (row-major) | 0];
dZ_i = Σ_{j≠i} dy[pair(i, j)] Z_j, d_dense = dy[:, :D] + dZ_0, d_emb = dZ_1..n-1.

Why the last column: HugeCTR's output has it (a pad); numbactr writes 0.0 there, as HugeCTR's fp16 path
does, and it gets no gradient.
"""

from __future__ import annotations

import numpy as np

from numbactr.autograd import Context, Function
from numbactr.kernels import interaction
from numbactr.ops.buffers import grad_of, into, out_of
from numbactr.ops.dispatch import pick
from numbactr.runtime.device import contig as _contig
from numbactr.runtime.device import xp as _xp


def _forward_launch(launch, ctx, dense, emb):
    """The kernel or compiled CPU entry point ``launch``: both write into the output given."""
    out = out_of(ctx)  # the planned step's buffer (numbactr.ops.buffers), or a new array
    if out is None:
        out = _xp().empty(
            (dense.shape[0], interaction.interaction_out_width(emb.shape[1], dense.shape[1])),
            np.float16 if ctx.native_half else np.float32,
        )
    launch(dense, emb, out)
    return out


def _forward_kernel(ctx, dense, emb):
    return _forward_launch(interaction.interaction_forward, ctx, dense, emb)


def _forward_cpu(ctx, dense, emb):
    return _forward_launch(interaction.interaction_forward_cpu, ctx, dense, emb)


def _forward_ref(ctx, dense, emb):
    return into(out_of(ctx), interaction.interaction_forward_ref(dense, emb))


def _backward_launch(launch, ctx, dense, emb, dy):
    d_dense, d_emb = grad_of(ctx, 0), grad_of(ctx, 1)  # (every element is written)
    d_dense = _xp().empty_like(dense) if d_dense is None else d_dense
    d_emb = _xp().empty_like(emb) if d_emb is None else d_emb
    launch(dense, emb, _contig(dy), d_dense, d_emb)
    return d_dense, d_emb


def _backward_kernel(ctx, dense, emb, dy):
    return _backward_launch(interaction.interaction_backward, ctx, dense, emb, dy)


def _backward_cpu(ctx, dense, emb, dy):
    return _backward_launch(interaction.interaction_backward_cpu, ctx, dense, emb, dy)


def _backward_ref(ctx, dense, emb, dy):
    d_dense, d_emb = interaction.interaction_backward_ref(dense, emb, dy)
    return into(grad_of(ctx, 0), d_dense), into(grad_of(ctx, 1), d_emb)


class Interaction(Function):
    """DLRM dot interaction, HugeCTR layout: [dense, strict lower triangle of Z Zᵀ, 0 pad]."""

    half_native = True  # gpu/sim kernels: float16 in and out, float32 dot products
    #: writes into the planned step's buffers when given (ctx.out, ctx.grad_into: numbactr.ops.buffers)
    writes_into = True

    @staticmethod
    def forward(ctx: Context, dense, emb):
        if ctx.native_half:
            dense, emb = dense.astype(np.float16, copy=False), emb.astype(np.float16, copy=False)
        dense, emb = _contig(dense), _contig(emb)
        ctx.dense, ctx.emb = dense, emb
        return pick(kernel=_forward_kernel, cpu=_forward_cpu, ref=_forward_ref)(ctx, dense, emb)

    @staticmethod
    def backward(ctx: Context, dy):
        if ctx.native_half:
            dy = dy.astype(np.float16, copy=False)
        return pick(kernel=_backward_kernel, cpu=_backward_cpu, ref=_backward_ref)(ctx, ctx.dense, ctx.emb, dy)
