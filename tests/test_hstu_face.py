"""numbactr.hstu.hstu_attn_varlen_func and hstu_attn_varlen_backward on NumPy arrays (no torch needed):
FBGEMM's argument order, the results against the NumPy reference (kernels/hstu_attention_ref.py) on ragged
batches with contexts, targets and rab, the dtypes, and a clear error for every argument numbactr does not
support. The torch face against an independent PyTorch implementation: tests/test_hstu_face_torch.py."""

import inspect

import numpy as np
import pytest

from numbactr.hstu import hstu_attn_varlen_backward, hstu_attn_varlen_func
from numbactr.kernels import hstu_attention_ref as ref

#: FBGEMM's hstu_attn_varlen_func (fbgemm_gpu/experimental/hstu/hstu/cuda_hstu_attention.py), in order
FBGEMM_PARAMETERS = [
    ("q", None), ("k", None), ("v", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None), ("seqused_q", None),
    ("seqused_k", None), ("max_seqlen_q", None), ("max_seqlen_k", None), ("scaling_seqlen", None),
    ("num_contexts", None), ("num_targets", None), ("target_group_size", 1), ("window_size", (-1, -1)),
    ("alpha", 1.0), ("rab", None), ("has_drab", False), ("kv_cache", None), ("page_offsets", None),
    ("page_ids", None), ("last_page_lens", None), ("func", None), ("quant_mode", -1),
]  # fmt: skip


def test_signature_is_fbgemms():
    params = inspect.signature(hstu_attn_varlen_func).parameters.values()
    empty = inspect.Parameter.empty
    assert [(p.name, None if p.default is empty else p.default) for p in params] == FBGEMM_PARAMETERS
    assert [p.default for p in params][:12] == [empty] * 12  # the first twelve have no default, as in FBGEMM


def batch(lengths, heads=2, d=4, dv=3, rab_heads=1, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t, m = int(cu[-1]), max(max(lengths), 1)
    q, k = (rng.uniform(-1, 1, (t, heads, d)).astype(dtype) for _ in range(2))
    v, dout = (rng.uniform(-1, 1, (t, heads, dv)).astype(dtype) for _ in range(2))
    rab = None if rab_heads is None else rng.uniform(-1, 1, (len(lengths), rab_heads, m, m)).astype(dtype)
    return q, k, v, dout, cu, m, rab


def _f64(*arrays):
    return [None if a is None else a.astype(np.float64) for a in arrays]


@pytest.mark.parametrize("rab_heads", [None, 1, 2])
def test_arrays_match_the_reference_with_contexts_and_targets(rab_heads):
    lengths = [4, 0, 1, 6]
    q, k, v, dout, cu, m, rab = batch(lengths, rab_heads=rab_heads)
    ctx, tgt = np.array([1, 0, 0, 2]), np.array([2, 0, 1, 3])
    args = (cu, cu, None, None, m, m, -1, ctx, tgt)
    kw = dict(target_group_size=2, window_size=(-1, 0), alpha=0.9, rab=rab)
    out = hstu_attn_varlen_func(q, k, v, *args, **kw)
    assert out.dtype == np.float32 and out.shape == v.shape
    q64, k64, v64, d64, r64 = _f64(q, k, v, dout, rab)
    ref_kw = dict(num_contexts=ctx, num_targets=tgt, target_group_size=2, window=(-1, 0), alpha=0.9, rab=r64)
    np.testing.assert_allclose(out, ref.hstu_attn_forward_ref(q64, k64, v64, cu, m, **ref_kw), rtol=1e-5, atol=1e-6)
    grads = hstu_attn_varlen_backward(dout, q, k, v, *args, **kw, has_drab=rab is not None)
    want = ref.hstu_attn_backward_ref(q64, k64, v64, d64, cu, m, **ref_kw)
    for name, g, w in zip(("dq", "dk", "dv", "drab"), grads, want):
        if w is None:
            assert g is None
        else:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)


def test_scaling_window_and_alpha_reach_the_kernels():
    q, k, v, _, cu, m, _ = batch([5, 3], rab_heads=None)
    out = hstu_attn_varlen_func(q, k, v, cu, cu, None, None, m, m + 2, 7, None, None, window_size=(1, 1), alpha=0.5)
    q64, k64, v64 = _f64(q, k, v)
    want = ref.hstu_attn_forward_ref(q64, k64, v64, cu, m + 2, 7, window=(1, 1), alpha=0.5)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    default = hstu_attn_varlen_func(q, k, v, cu, cu, None, None, m, m + 2, -1, None, None)
    np.testing.assert_allclose(default * m, ref.hstu_attn_forward_ref(q64, k64, v64, cu, m, 1), rtol=1e-5, atol=1e-6)


def test_float64_arrays_come_back_float64():
    q, k, v, dout, cu, m, rab = batch([3, 2], dtype=np.float64)
    out = hstu_attn_varlen_func(q, k, v, cu, cu, None, None, m, m, -1, None, None, rab=rab)
    assert out.dtype == np.float64
    grads = hstu_attn_varlen_backward(dout, q, k, v, cu, cu, None, None, m, m, -1, None, None, rab=rab, has_drab=True)
    assert all(g.dtype == np.float64 for g in grads)


CALL = dict(seqused_q=None, seqused_k=None, scaling_seqlen=-1, num_contexts=None, num_targets=None)


@pytest.mark.parametrize(
    "extra, error, match",
    [
        (dict(kv_cache=np.zeros((1, 2, 4, 2, 4))), NotImplementedError, "paged KV cache .kv_cache."),
        (dict(page_ids=np.zeros(1), page_offsets=np.zeros(3)), NotImplementedError, "page_offsets, page_ids"),
        (dict(quant_mode=0), NotImplementedError, "quant_mode=0 .FP8."),
        (dict(func=np.zeros((2, 16))), NotImplementedError, "arbitrary mask"),
        (dict(seqused_q=np.array([3, 2])), NotImplementedError, "seqused_q is not supported"),
        (dict(has_drab=True), ValueError, "has_drab=True needs rab"),
        (dict(max_seqlen_q=9), ValueError, "max_seqlen_q 9 > max_seqlen_k 3"),
        (dict(num_contexts=np.array([1, 0])), ValueError, "need the causal window"),
        (dict(num_targets=np.array([1, 3]), window_size=(-1, 0)), ValueError, "sequence 1 has 0 contexts and 3"),
        (dict(rab=np.zeros((2, 1, 2, 2), np.float32)), ValueError, "M >= the longest sequence"),
        (dict(window_size=3), ValueError, "window must be two ints"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_unsupported_and_bad_arguments_are_clear_errors(extra, error, match):
    q, k, v, _, cu, m, _ = batch([3, 2], rab_heads=None)
    kw = {**CALL, "max_seqlen_q": m, "max_seqlen_k": m, **extra}
    with pytest.raises(error, match=match):
        hstu_attn_varlen_func(q, k, v, cu, cu, **kw)


def test_delta_q_integer_inputs_and_dout_shape_are_refused():
    q, k, v, dout, cu, m, _ = batch([3, 2], rab_heads=None)
    with pytest.raises(NotImplementedError, match="cu_seqlens_q must equal cu_seqlens_k"):
        hstu_attn_varlen_func(q[:3], k, v, np.array([0, 1, 3]), cu, **CALL, max_seqlen_q=2, max_seqlen_k=m)
    with pytest.raises(ValueError, match="q must hold floating-point values"):
        hstu_attn_varlen_func(q.astype(np.int32), k, v, cu, cu, **CALL, max_seqlen_q=m, max_seqlen_k=m)
    with pytest.raises(ValueError, match="dout must be out's shape"):
        hstu_attn_varlen_backward(dout[:2], q, k, v, cu, cu, **CALL, max_seqlen_q=m, max_seqlen_k=m)
