"""The checked arguments of ``hstu_attn_varlen_func`` (numbactr/hstu/attention.py) and the calls of the kernels.

``make_plan`` applies FBGEMM's argument rules and numbactr's (kernels/hstu_attention_ref.check_args), and
refuses what numbactr does not do; the result, an ``AttnPlan``, is everything of a call but the tensors.
``forward_into`` / ``backward_into`` run the compiled cpu version on host arrays and the numba.cuda kernels
on device arrays. Both faces (arrays: attention.py, torch: attention_torch.py) call these.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numbactr.kernels import hstu_attention as kernels
from numbactr.kernels.hstu_attention_ref import check_args

__all__ = ["AttnPlan", "make_plan", "forward_into", "backward_into", "on_gpu", "is_torch"]

WHO = "hstu_attn_varlen_func"


@dataclass(frozen=True)
class AttnPlan:
    """Everything of a call but the tensors, resolved and checked on the host once: the offsets and the
    per-sequence counts (int32; zeros for none), the max length the window is resolved against, the
    divisor S, the window, the target group size and alpha."""

    cu: np.ndarray  # (B + 1,)
    num_contexts: np.ndarray  # (B,)
    num_targets: np.ndarray  # (B,)
    max_seqlen: int
    scaling_seqlen: int
    window: tuple
    group: int
    alpha: float

    def ints(self, on_gpu: bool):
        """(cu, num_contexts, num_targets) where the kernels read them: device copies for the GPU."""
        host = (self.cu, self.num_contexts, self.num_targets)
        if not on_gpu:
            return host
        from numba import cuda

        return tuple(cuda.to_device(a) for a in host)

    def scalars(self) -> dict:
        """The keyword arguments every kernel wrapper takes."""
        return dict(
            scaling_seqlen=self.scaling_seqlen,
            target_group_size=self.group,
            window=self.window,
            alpha=self.alpha,
        )


# ---- arguments --------------------------------------------------------------------------------------------
def is_torch(a) -> bool:
    return type(a).__module__.split(".")[0] == "torch"


def on_gpu(a) -> bool:
    """Device memory (CuPy, a CUDA torch tensor, a numba device array)?"""
    if is_torch(a):  # (a tensor that requires grad refuses __cuda_array_interface__)
        return a.is_cuda
    return hasattr(a, "__cuda_array_interface__")


def to_host(a):
    """A (small) integer argument as a NumPy array: torch tensors and device arrays copied to the host."""
    if a is None or isinstance(a, np.ndarray):
        return a
    if is_torch(a):
        return a.detach().cpu().numpy()
    if on_gpu(a):
        if hasattr(a, "get"):  # CuPy
            return a.get()
        from numba import cuda

        return cuda.as_cuda_array(a).copy_to_host()
    return np.asarray(a)


def _refuse_unsupported(seqused_q, seqused_k, kv_cache, page_offsets, page_ids, last_page_lens, func, quant_mode):
    paged = {"kv_cache": kv_cache, "page_offsets": page_offsets, "page_ids": page_ids, "last_page_lens": last_page_lens}
    given = [name for name, a in paged.items() if a is not None]
    if given:
        raise NotImplementedError(
            f"{WHO}: the paged KV cache ({', '.join(given)}) is not supported by numbactr: pass every sequence's "
            "keys and values whole in k and v"
        )
    if quant_mode not in (-1, None):
        raise NotImplementedError(
            f"{WHO}: quant_mode={quant_mode} (FP8) is not supported by numbactr: only -1 (no quantization; "
            "numbactr computes in float32)"
        )
    if func is not None:
        raise NotImplementedError(f"{WHO}: func (an arbitrary mask) is not supported by numbactr")
    for name, a in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if a is not None:
            raise NotImplementedError(
                f"{WHO}: {name} is not supported by numbactr (pass None: every token of a sequence is valid); "
                "give shorter sequences in cu_seqlens instead"
            )


def make_plan(
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
) -> AttnPlan:
    """Check every argument of ``hstu_attn_varlen_func`` (FBGEMM's rules, then numbactr's: shapes, counts,
    what is unsupported) and resolve them into an AttnPlan. Raises ValueError naming the argument, or
    NotImplementedError for what numbactr does not do."""
    _refuse_unsupported(seqused_q, seqused_k, kv_cache, page_offsets, page_ids, last_page_lens, func, quant_mode)
    if has_drab and rab is None:
        raise ValueError(f"{WHO}: has_drab=True needs rab (there is no bias to differentiate)")
    if int(max_seqlen_q) > int(max_seqlen_k):
        raise ValueError(f"{WHO}: max_seqlen_q {max_seqlen_q} > max_seqlen_k {max_seqlen_k} (FBGEMM: undefined)")
    cu_q, cu_k = to_host(cu_seqlens_q), to_host(cu_seqlens_k)
    if cu_q.shape != cu_k.shape or not np.array_equal(cu_q, cu_k):
        raise NotImplementedError(
            f"{WHO}: cu_seqlens_q must equal cu_seqlens_k in numbactr (queries that are a suffix of the keys, "
            f"FBGEMM's delta-q, are not supported), got {cu_q.tolist()[:8]} and {cu_k.tolist()[:8]}"
        )
    given = [(name, a) for name, a in (("q", q), ("k", k), ("v", v), ("rab", rab)) if a is not None]
    for name, a in given:
        floating = a.is_floating_point() if is_torch(a) else np.dtype(a.dtype).kind == "f"
        if not floating:
            raise ValueError(f"{WHO}: {name} must hold floating-point values, got {a.dtype}")
    if len({on_gpu(a) for _, a in given}) > 1:
        where = ", ".join(f"{name} on the {'GPU' if on_gpu(a) else 'host'}" for name, a in given)
        raise ValueError(f"{WHO}: q, k, v and rab must all be on the host or all on the GPU, got {where}")
    scale = int(max_seqlen_q) if scaling_seqlen in (-1, None) else scaling_seqlen
    ctx, tgt = to_host(num_contexts), to_host(num_targets)
    a = check_args(q, k, v, cu_q, int(max_seqlen_k), scale, ctx, tgt, target_group_size, window_size, rab)
    return AttnPlan(
        cu=cu_q.astype(np.int32),
        num_contexts=a.ctx.astype(np.int32),
        num_targets=(a.lengths - a.hist).astype(np.int32),
        max_seqlen=int(max_seqlen_k),
        scaling_seqlen=scale,
        window=tuple(int(w) for w in window_size),
        group=int(target_group_size),
        alpha=float(alpha),
    )


# ---- running the kernels on float32 arrays (NumPy, or device arrays) --------------------------------------
def forward_into(plan: AttnPlan, q, k, v, rab, out) -> None:
    """out (T, H, Dv) <- the attention of contiguous float32 arrays, all on the host or all on the GPU."""
    gpu = on_gpu(q)
    run = kernels.hstu_attn_forward if gpu else kernels.hstu_attn_forward_cpu
    run(q, k, v, *plan.ints(gpu), out, plan.max_seqlen, rab=rab, **plan.scalars())


def backward_into(plan: AttnPlan, q, k, v, dout, rab, dq, dk, dv, drab) -> None:
    """dq, dk, dv (and drab when given: rab's shape, zeroed by the caller) of the attention."""
    gpu = on_gpu(q)
    run = kernels.hstu_attn_backward if gpu else kernels.hstu_attn_backward_cpu
    run(q, k, v, dout, *plan.ints(gpu), dq, dk, dv, plan.max_seqlen, rab=rab, drab=drab, **plan.scalars())
