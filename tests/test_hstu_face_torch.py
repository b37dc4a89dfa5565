"""numbactr.hstu.hstu_attn_varlen_func on torch tensors against an independent PyTorch implementation of the
same math written here (padded dense, after FBGEMM's test procedure in fbgemm_gpu/experimental/hstu/test/
hstu_test.py): forward and, through torch.autograd on both sides, dq, dk, dv and drab, on ragged batches
(lengths 0 and 1 among them) with contexts, targets in groups, causal / local / no windows, rab of one or of
every head. The face computes in float32 (the kernels' precision), the implementation here in float64."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from numbactr.hstu import hstu_attn_varlen_func  # noqa: E402


# ---- the independent implementation ---------------------------------------------------------------------
def dense_mask(n_pad, length, n_ctx, n_tgt, group, window, max_seqlen):
    """(M, M) bool: which key (column) each query (row) of one padded sequence sees. Built from FBGEMM's
    rules in words: the window; a target sees no target of an earlier group; a context row sees every
    non-target row; nothing beyond the sequence's length."""
    left, right = (max_seqlen if w < 0 or w > max_seqlen else w for w in window)
    row = torch.arange(n_pad).view(-1, 1)
    col = torch.arange(n_pad).view(1, -1)
    seen = (col - row <= right) & (row - col <= left)
    first_target = length - n_tgt
    row_group = torch.div(row - first_target, group, rounding_mode="floor")
    col_group = torch.div(col - first_target, group, rounding_mode="floor")
    both_targets = (row >= first_target) & (col >= first_target)
    seen = seen & ~(both_targets & (col_group < row_group))
    seen = seen | ((row < n_ctx) & (col < first_target))
    return seen & (row < length) & (col < length)


def hstu_padded_dense(q, k, v, cu, max_seqlen, scaling, n_ctx, n_tgt, group, window, alpha, rab):
    """out (T, H, Dv): pad to (B, M, H, D), silu(alpha (q k^T + rab)) * mask / scaling @ v, unpad."""
    lengths = (cu[1:] - cu[:-1]).tolist()
    batch, m = len(lengths), max_seqlen
    pad = [torch.zeros((batch, m) + t.shape[1:], dtype=t.dtype) for t in (q, k, v)]
    for b, n in enumerate(lengths):
        for p, t in zip(pad, (q, k, v)):
            p[b, :n] = t[cu[b] : cu[b] + n]
    qp, kp, vp = pad
    scores = torch.einsum("bihd,bjhd->bhij", qp, kp)  # (B, H, M, M)
    if rab is not None:
        scores = scores + rab[:, :, :m, :m]  # one rab head broadcasts over the heads
    masks = torch.stack(
        [dense_mask(m, n, int(n_ctx[b]), int(n_tgt[b]), group, window, max_seqlen) for b, n in enumerate(lengths)]
    )
    p = torch.nn.functional.silu(alpha * scores) * masks[:, None].to(scores.dtype) / scaling
    outp = torch.einsum("bhij,bjhd->bihd", p, vp)  # (B, M, H, Dv)
    return torch.cat([outp[b, :n] for b, n in enumerate(lengths)])


# ---- problems ---------------------------------------------------------------------------------------------
def problem(lengths, heads=2, d=8, dv=6, rab_heads=None, rab_pad=2, ctx=None, tgt=None, seed=0):
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = int(cu[-1])
    q, k = (rng.uniform(-1, 1, (t, heads, d)) for _ in range(2))
    v = rng.uniform(-1, 1, (t, heads, dv))
    m = max(max(lengths), 1)
    rab = None if rab_heads is None else rng.uniform(-1, 1, (len(lengths), rab_heads, m + rab_pad, m + rab_pad))
    dout = rng.uniform(-1, 1, (t, heads, dv))
    as32 = {n: torch.tensor(a, dtype=torch.float32) for n, a in dict(q=q, k=k, v=v, dout=dout).items()}
    if rab is not None:
        as32["rab"] = torch.tensor(rab, dtype=torch.float32)
    ints = {n: None if a is None else torch.tensor(a, dtype=torch.int32) for n, a in dict(ctx=ctx, tgt=tgt).items()}
    return as32, torch.tensor(cu), m, ints


def run_both(lengths, window, *, rab_heads=None, has_drab=False, ctx=None, tgt=None, group=1, alpha=1.0,
             scaling=-1, heads=2, seed=0):  # fmt: skip
    """(face's (out, grads), reference's (out, grads)): grads of q, k, v (and rab when has_drab)."""
    t, cu, m, ints = problem(lengths, heads=heads, rab_heads=rab_heads, ctx=ctx, tgt=tgt, seed=seed)
    names = ["q", "k", "v"] + (["rab"] if has_drab else [])
    face_in = {n: t[n].clone().requires_grad_(n in names) for n in ("q", "k", "v", "rab") if n in t}
    out = hstu_attn_varlen_func(
        face_in["q"], face_in["k"], face_in["v"], cu, cu, None, None, m, m, scaling, ints["ctx"], ints["tgt"],
        target_group_size=group, window_size=window, alpha=alpha, rab=face_in.get("rab"), has_drab=has_drab,
    )  # fmt: skip
    face_grads = torch.autograd.grad(out, [face_in[n] for n in names], t["dout"])
    ref_in = {n: t[n].double().requires_grad_(n in names) for n in ("q", "k", "v", "rab") if n in t}
    zeros = torch.zeros(len(lengths), dtype=torch.int64)
    n_ctx = zeros if ints["ctx"] is None else ints["ctx"]
    n_tgt = zeros if ints["tgt"] is None else ints["tgt"]
    ref = hstu_padded_dense(
        ref_in["q"], ref_in["k"], ref_in["v"], cu, m, m if scaling == -1 else scaling, n_ctx, n_tgt, group, window,
        alpha, ref_in.get("rab"),
    )  # fmt: skip
    ref_grads = torch.autograd.grad(ref, [ref_in[n] for n in names], t["dout"].double())
    return (out, face_grads), (ref, ref_grads), names


def assert_agree(face, ref, names):
    (out, grads), (rout, rgrads) = face, ref
    assert out.dtype == torch.float32 and out.shape == rout.shape
    torch.testing.assert_close(out.double(), rout, rtol=1e-4, atol=2e-6)
    for name, g, rg in zip(names, grads, rgrads):
        assert g.shape == rg.shape, name
        torch.testing.assert_close(g.double(), rg, rtol=1e-4, atol=2e-6, msg=lambda m, n=name: f"d{n}: {m}")


# ---- agreement ----------------------------------------------------------------------------------------------
RAGGED = [5, 0, 1, 7, 3]


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (2, 0), (1, 2), (0, 0)], ids=str)
def test_windows_agree_forward_and_gradients(window):
    assert_agree(*run_both(RAGGED, window, alpha=0.8)[:2], ["q", "k", "v"])


@pytest.mark.parametrize("rab_heads", [1, 2])
@pytest.mark.parametrize("has_drab", [False, True])
def test_rab_agrees_with_and_without_its_gradient(rab_heads, has_drab):
    face, ref, names = run_both(RAGGED, (-1, 0), rab_heads=rab_heads, has_drab=has_drab, alpha=1.3, seed=1)
    assert_agree(face, ref, names)
    if has_drab:  # rab's shape, zero beyond each sequence (no query there)
        drab = face[1][3]
        assert drab.shape == (len(RAGGED), rab_heads, 9, 9) and not drab[:, :, 7:, :].any()


@pytest.mark.parametrize("group", [1, 2, 3])
def test_contexts_and_targets_in_groups_agree(group):
    lengths = [6, 0, 1, 9, 4]
    ctx = np.array([1, 0, 0, 2, 0])
    tgt = np.array([3, 0, 1, 4, 4])
    face, ref, names = run_both(lengths, (-1, 0), rab_heads=1, has_drab=True, ctx=ctx, tgt=tgt, group=group, seed=2)
    assert_agree(face, ref, names)


def test_scaling_seqlen_and_one_token():
    assert_agree(*run_both([1], (-1, 0), scaling=3, heads=1)[:2], ["q", "k", "v"])
    assert_agree(*run_both([4, 2], (-1, -1), scaling=11, seed=3)[:2], ["q", "k", "v"])


def test_the_reference_here_is_not_trivially_the_same_code():
    """The mask built here against hand-worked rows (contexts 1, history 3, targets in groups of 2)."""
    m = dense_mask(7, 6, 1, 2, 2, (-1, 0), 6).int()
    assert m[0].tolist() == [1, 1, 1, 1, 0, 0, 0]  # the context row sees every non-target
    assert m[4].tolist() == [1, 1, 1, 1, 1, 0, 0]  # first target of the group
    assert m[5].tolist() == [1, 1, 1, 1, 1, 1, 0]  # sees its group's first target
    assert not m[6].any()  # padding


def test_float64_and_bfloat16_inputs_come_back_in_their_dtype():
    t, cu, m, _ = problem([3, 2])
    q, k, v = (t[n].double().requires_grad_() for n in "qkv")
    out = hstu_attn_varlen_func(q, k, v, cu, cu, None, None, m, m, -1, None, None, window_size=(-1, 0))
    assert out.dtype == torch.float64
    out.sum().backward()
    assert q.grad.dtype == torch.float64 and torch.isfinite(q.grad).all()
    qb = t["q"].bfloat16()
    ob = hstu_attn_varlen_func(qb, qb, qb, cu, cu, None, None, m, m, -1, None, None)
    assert ob.dtype == torch.bfloat16


def test_torch_errors():
    t, cu, m, _ = problem([3, 2])
    q, k, v = t["q"], t["k"], t["v"]
    call = dict(seqused_q=None, seqused_k=None, max_seqlen_q=m, max_seqlen_k=m, scaling_seqlen=-1, num_contexts=None,
                num_targets=None)  # fmt: skip
    with pytest.raises(NotImplementedError, match="paged KV cache"):
        hstu_attn_varlen_func(q, k, v, cu, cu, **call, kv_cache=torch.zeros(1, 2, 4, 2, 8))
    with pytest.raises(NotImplementedError, match="FP8"):
        hstu_attn_varlen_func(q, k, v, cu, cu, **call, quant_mode=1)
    with pytest.raises(NotImplementedError, match="delta-q"):
        hstu_attn_varlen_func(q[:4], k, v, torch.tensor([0, 2, 4]), cu, **call)
    with pytest.raises(ValueError, match="has_drab=True needs rab"):
        hstu_attn_varlen_func(q, k, v, cu, cu, **call, has_drab=True)
    with pytest.raises(ValueError, match="floating-point"):
        hstu_attn_varlen_func(q.int(), k, v, cu, cu, **call)
    bad = dict(call, num_targets=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="causal window"):
        hstu_attn_varlen_func(q, k, v, cu, cu, **bad, window_size=(-1, -1))


@st.composite
def torch_cases(draw):
    """A random ragged batch (lengths 0-8), window, and (with the causal window) contexts and targets."""
    lengths = draw(st.lists(st.integers(0, 8), min_size=1, max_size=4).filter(lambda ls: max(ls) > 0))
    window = draw(st.sampled_from([(-1, 0), (-1, -1), (2, 0), (1, 1)]))
    ctx = tgt = None
    if window == (-1, 0) and draw(st.booleans()):
        tgt = np.array([draw(st.integers(0, n)) for n in lengths])
        ctx = np.array([draw(st.integers(0, n - t)) for n, t in zip(lengths, tgt)])
    rab_heads = draw(st.sampled_from([None, 1, 2]))
    has_drab = rab_heads is not None and draw(st.booleans())
    return dict(lengths=lengths, window=window, ctx=ctx, tgt=tgt, group=draw(st.integers(1, 3)),
                rab_heads=rab_heads, has_drab=has_drab, alpha=draw(st.sampled_from([0.5, 1.0, 2.0])),
                seed=draw(st.integers(0, 99)))  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(case=torch_cases())
def test_random_batches_agree_with_the_torch_implementation(case):
    face, ref, names = run_both(case.pop("lengths"), case.pop("window"), **case)
    assert_agree(face, ref, names)
