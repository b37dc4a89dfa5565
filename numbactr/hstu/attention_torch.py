"""The torch face of ``hstu_attn_varlen_func``: a torch.autograd.Function over numbactr's kernels (imports torch).

Forward and backward hand the tensors' memory to the kernels without a copy (float32 contiguous tensors;
others are converted first): a cpu tensor as the NumPy array sharing its buffer (numbactr.runtime.
torch_bridge), a CUDA tensor as itself, which numba.cuda reads through ``__cuda_array_interface__``. The
backward is the hand-written one (kernels/hstu_attention.py): dq, dk, dv, and drab when ``has_drab``
(FBGEMM returns no rab gradient otherwise, and neither does this). The plan (offsets, counts, window...)
was checked once by numbactr.hstu.attention_plan.make_plan.
"""

from __future__ import annotations

import torch

from numbactr.hstu.attention_plan import AttnPlan, backward_into, forward_into
from numbactr.runtime.torch_bridge import as_array

__all__ = ["attention"]


def _f32(t):
    """A float32 contiguous tensor without autograd history (t itself when it already is one)."""
    return None if t is None else t.detach().to(torch.float32).contiguous()


def _kernel_view(t):
    """What the kernels read: a cpu tensor's NumPy view, a CUDA tensor as it is (no copy either way)."""
    return None if t is None else (t if t.is_cuda else as_array(t))


class _HstuAttention(torch.autograd.Function):
    """out = the attention of q, k, v (and rab); backward: dq, dk, dv, drab (when has_drab)."""

    @staticmethod
    def forward(ctx, q, k, v, rab, plan: AttnPlan, has_drab: bool):
        q32, k32, v32, rab32 = _f32(q), _f32(k), _f32(v), _f32(rab)
        out = torch.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float32, device=q.device)
        forward_into(plan, *(_kernel_view(t) for t in (q32, k32, v32, rab32, out)))
        ctx.save_for_backward(q32, k32, v32, rab32)
        ctx.plan, ctx.has_drab = plan, has_drab
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (q, k, v, rab))
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q32, k32, v32, rab32 = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q32), torch.empty_like(k32), torch.empty_like(v32)
        drab = torch.zeros_like(rab32) if ctx.has_drab else None  # the GPU kernels add to it
        views = (_kernel_view(t) for t in (q32, k32, v32, _f32(dout), rab32, dq, dk, dv, drab))
        backward_into(ctx.plan, *views)
        grads = [None if g is None else g.to(dt) for g, dt in zip((dq, dk, dv, drab), ctx.dtypes)]
        return (*grads, None, None)


def attention(plan: AttnPlan, q, k, v, rab, has_drab: bool):
    """out (T, H, Dv) as a tensor with autograd (numbactr.hstu.attention.hstu_attn_varlen_func's torch path)."""
    return _HstuAttention.apply(q, k, v, rab, plan, has_drab)
