"""HSTU's jagged attention with FBGEMM's signature: ``hstu_attn_varlen_func`` on numbactr's kernels.

A PyTorch script written for FBGEMM's HSTU (fbgemm_gpu/experimental/hstu, ``hstu_attn_varlen_func``)
changes its import line only::

    from fbgemm_gpu.experimental.hstu import hstu_attn_varlen_func
 -> from numbactr.hstu import hstu_attn_varlen_func

The math (kernels/hstu_attention_ref.py's docstring, after FBGEMM's kernels and its test's PyTorch
reference): over jagged sequences (token ``t`` of sequence ``b`` is row ``cu_seqlens[b] + t``), per head,

    out_i = sum_j  m[i, j] * silu(alpha * (q_i . k_j + rab[b, h, i, j])) * v_j / scaling_seqlen

with ``m`` the mask of the window (``(-1, 0)`` causal, ``(-1, -1)`` none, ``(w, 0)`` local), the
contexts (``num_contexts[b]`` leading rows that see every non-target row) and the targets
(``num_targets[b]`` trailing rows that see the history and their own group of ``target_group_size``
only). ``scaling_seqlen=-1`` means ``max_seqlen_q``.

Shapes: q, k (T, H, D), v (T, H, Dv), cu_seqlens_q = cu_seqlens_k (B + 1,), num_contexts, num_targets
(B,) or None, rab (B, 1 or H, M, M) with M >= the longest sequence (FBGEMM: M = max_seqlen_k),
indexed by local positions; out (T, H, Dv).

Where each call runs: host arrays (NumPy, cpu torch tensors) go to the cpu version
(``hstu_attn_forward_cpu`` / ``hstu_attn_backward_cpu``: BLAS products over tiles of query rows and a
compiled elementwise step, sequences spread over the compute threads); device arrays (CuPy, CUDA torch tensors: anything with ``__cuda_array_interface__``) go to the
numba.cuda kernels (``hstu_attn_forward`` / ``hstu_attn_backward``), which read the tensors' memory in
place. Both compute in float32; inputs of another floating dtype are converted, and the results come back
in the inputs' dtypes (FBGEMM computes fp16 / bf16 inputs in float32 too).

Torch tensors in: the result is a tensor with autograd (numbactr/hstu/attention_torch.py: dq, dk, dv, and
drab when ``has_drab``, from the hand-written backward). Arrays in: the forward only, and
``hstu_attn_varlen_backward`` for the gradients.

Not supported (each a clear error): the paged KV cache (``kv_cache``, ``page_offsets``, ``page_ids``,
``last_page_lens``), FP8 (``quant_mode`` other than -1), the arbitrary mask ``func``, ``seqused_q`` /
``seqused_k``, and queries that are a suffix of the keys (``cu_seqlens_q`` different from
``cu_seqlens_k``, FBGEMM's delta-q). A rab with Hr heads, 1 < Hr < H, is refused too (FBGEMM allows any Hr
dividing H).
"""

from __future__ import annotations

import numpy as np

from numbactr.hstu.attention_plan import WHO, backward_into, forward_into, is_torch, make_plan, on_gpu

__all__ = ["hstu_attn_varlen_func", "hstu_attn_varlen_backward"]


def _xp(a):
    """The array module of a: CuPy for device arrays, NumPy for host arrays."""
    if on_gpu(a):
        import cupy

        return cupy
    return np


def _f32(a):
    """a as a contiguous float32 array where it lives (a itself when it already is one)."""
    return None if a is None else _xp(a).ascontiguousarray(a, dtype=np.float32)


def hstu_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    seqused_q,
    seqused_k,
    max_seqlen_q,
    max_seqlen_k,
    scaling_seqlen,
    num_contexts,
    num_targets,
    target_group_size=1,
    window_size=(-1, -1),
    alpha=1.0,
    rab=None,
    has_drab=False,
    kv_cache=None,
    page_offsets=None,
    page_ids=None,
    last_page_lens=None,
    func=None,
    quant_mode=-1,
):
    """out (T, H, Dv): HSTU's jagged attention, FBGEMM's arguments in FBGEMM's order (module docstring).

    Torch tensors in: a tensor out, differentiable in q, k, v (and rab when has_drab). NumPy / CuPy
    arrays in: an array out in q's dtype; gradients by ``hstu_attn_varlen_backward``."""
    plan = make_plan(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, scaling_seqlen,
        num_contexts, num_targets, target_group_size, window_size, alpha, rab, has_drab, kv_cache, page_offsets,
        page_ids, last_page_lens, func, quant_mode,
    )  # fmt: skip
    if is_torch(q):
        from numbactr.hstu.attention_torch import attention

        return attention(plan, q, k, v, rab, bool(has_drab))
    q32, k32, v32 = _f32(q), _f32(k), _f32(v)
    out = _xp(q).empty((q.shape[0], q.shape[1], v.shape[2]), np.float32)
    forward_into(plan, q32, k32, v32, _f32(rab), out)
    return out.astype(q.dtype, copy=False)


def hstu_attn_varlen_backward(
    dout,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    seqused_q,
    seqused_k,
    max_seqlen_q,
    max_seqlen_k,
    scaling_seqlen,
    num_contexts,
    num_targets,
    target_group_size=1,
    window_size=(-1, -1),
    alpha=1.0,
    rab=None,
    has_drab=False,
):
    """(dq, dk, dv, drab) of ``hstu_attn_varlen_func`` on arrays, for dout = dL/dout (T, H, Dv): the
    forward's arguments after dout; drab (rab's shape, zero where no query sees a key) when has_drab, else
    None. Each gradient in its input's dtype."""
    plan = make_plan(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, scaling_seqlen,
        num_contexts, num_targets, target_group_size, window_size, alpha, rab, has_drab,
    )  # fmt: skip
    if is_torch(q):
        raise TypeError(f"{WHO}: torch tensors get their gradients from autograd (out.backward()), not here")
    if dout.shape != (q.shape[0], q.shape[1], v.shape[2]):
        raise ValueError(f"{WHO}: dout must be out's shape {(q.shape[0], q.shape[1], v.shape[2])}, got {dout.shape}")
    xp = _xp(q)
    q32, k32, v32 = _f32(q), _f32(k), _f32(v)
    dq, dk, dv = xp.empty_like(q32), xp.empty_like(k32), xp.empty_like(v32)
    drab = xp.zeros(rab.shape, np.float32) if has_drab else None
    backward_into(plan, q32, k32, v32, _f32(dout), _f32(rab), dq, dk, dv, drab)
    grads = (dq.astype(q.dtype, copy=False), dk.astype(k.dtype, copy=False), dv.astype(v.dtype, copy=False))
    return (*grads, None if drab is None else drab.astype(rab.dtype, copy=False))
