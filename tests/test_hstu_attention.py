"""HSTU's jagged attention: the reference's mask against hand-worked cases and an independent construction
(FBGEMM's test procedure), its backward against float64 central differences, the argument errors, and the
compiled cpu version against the reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numbactr.kernels import hstu_attention as ha
from numbactr.kernels import hstu_attention_ref as ref
from tests.gradcheck import assert_grad_close


def _batch(lengths, heads=2, d=3, dv=2, seed=0, rab_heads=None, dtype=np.float64, scale=1.0):
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = int(cu[-1])
    q, k = (rng.uniform(-1, 1, (t, heads, d)).astype(dtype) * scale for _ in range(2))
    v = rng.uniform(-1, 1, (t, heads, dv)).astype(dtype)
    m = max(max(lengths, default=0), 1)
    rab = None if rab_heads is None else rng.uniform(-1, 1, (len(lengths), rab_heads, m + 1, m + 1)).astype(dtype)
    return q, k, v, cu, rab


# ---- the mask ---------------------------------------------------------------------------------------------
def test_mask_contexts_causal_targets_by_hand():
    # L 6: one context, three history rows, two targets; wl = max_seqlen (unbounded), wr = 0 (causal)
    m = ref.hstu_mask_ref(6, hist=4, ctx=1, wl=8, wr=0, group=1).astype(int)
    np.testing.assert_array_equal(
        m,
        [
            [1, 1, 1, 1, 0, 0],  # the context row sees every non-target
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 0],  # a target sees the history and itself
            [1, 1, 1, 1, 0, 1],
        ],
    )
    # target groups of 2: both targets form one group (causal inside it)
    m2 = ref.hstu_mask_ref(6, hist=4, ctx=1, wl=8, wr=0, group=2).astype(int)
    np.testing.assert_array_equal(m2[5], [1, 1, 1, 1, 1, 1])


def test_mask_windows_by_hand():
    full = ref.hstu_mask_ref(3, hist=3, ctx=0, wl=3, wr=3, group=1)
    assert full.all()
    local = ref.hstu_mask_ref(5, hist=5, ctx=0, wl=1, wr=2, group=1).astype(int)
    np.testing.assert_array_equal(
        local, [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]
    )
    assert ref.resolve_window((-1, 0), 7) == (7, 0) and ref.resolve_window((2, 99), 7) == (2, 7)
    np.testing.assert_array_equal(ref.hstu_mask_ref(3, 3, 0, 0, 0, 1), np.eye(3, dtype=bool))


def _fbgemm_test_mask(n, n_ctx, n_tgt, group):
    """The causal + context + target mask built the way FBGEMM's test builds it (construct_mask in
    fbgemm_gpu/experimental/hstu/test/hstu_test.py): causal rows, then the context rows widened to the
    start of the targets, then each target row's earlier groups cleared."""
    mask = np.tril(np.ones((n, n), bool))
    target_start = n - n_tgt
    mask[:n_ctx, :target_start] = True
    for g in range(-(-n_tgt // group)):
        for r in range(min(group, n - target_start - g * group)):
            mask[target_start + g * group + r, target_start : target_start + g * group] = False
    return mask


@pytest.mark.parametrize("n", [0, 1, 2, 5, 9])
@pytest.mark.parametrize("group", [1, 2, 3])
def test_mask_equals_fbgemm_test_construction(n, group):
    for n_ctx in range(n + 1):
        for n_tgt in range(n - n_ctx + 1):
            got = ref.hstu_mask_ref(n, n - n_tgt, n_ctx, 16, 0, group)
            np.testing.assert_array_equal(got, _fbgemm_test_mask(n, n_ctx, n_tgt, group), err_msg=f"{n_ctx} {n_tgt}")


# ---- the reference ----------------------------------------------------------------------------------------
def test_forward_matches_dense_padded_formula():
    """One sequence, no mask: silu(alpha (q k^T + rab)) / S @ v written out per pair."""
    q, k, v, cu, rab = _batch([3], heads=1, rab_heads=1, seed=3)
    out = ref.hstu_attn_forward_ref(q, k, v, cu, 4, -1, alpha=0.7, rab=rab)
    want = np.zeros((3, 2))
    for i in range(3):
        for j in range(3):
            x = 0.7 * (q[i, 0] @ k[j, 0] + rab[0, 0, i, j])
            want[i] += x / (1 + np.exp(-x)) / 4 * v[j, 0]
    np.testing.assert_allclose(out[:, 0], want, rtol=1e-12)


CASES = [  # lengths, kwargs
    ([0, 1, 4, 3], dict(window=(-1, -1))),
    ([0, 1, 4, 3], dict(window=(-1, 0))),
    ([5, 1, 0, 4], dict(window=(-1, 0), num_contexts=[2, 0, 0, 1], num_targets=[2, 1, 0, 1])),
    ([6, 4], dict(window=(-1, 0), num_contexts=[1, 0], num_targets=[3, 2], target_group_size=2)),
    ([5, 2, 3], dict(window=(1, 2))),
    ([5, 3], dict(window=(0, -1), scaling_seqlen=3)),
]


@pytest.mark.parametrize("lengths, kw", CASES)
@pytest.mark.parametrize("rab_heads", [None, 1, 2])
def test_reference_backward_matches_central_differences(lengths, kw, rab_heads):
    q, k, v, cu, rab = _batch(lengths, rab_heads=rab_heads, seed=len(lengths) + (rab_heads or 0))
    dout = np.random.default_rng(9).normal(size=v.shape)
    kw = dict(kw, alpha=0.8)
    ms = max(lengths) + 1

    def fwd(q_=q, k_=k, v_=v, rab_=rab):
        return ref.hstu_attn_forward_ref(q_, k_, v_, cu, ms, rab=rab_, **kw)

    dq, dk, dv, drab = ref.hstu_attn_backward_ref(q, k, v, dout, cu, ms, rab=rab, **kw)
    assert_grad_close(dq, lambda z: fwd(q_=z), q, dout)
    assert_grad_close(dk, lambda z: fwd(k_=z), k, dout)
    assert_grad_close(dv, lambda z: fwd(v_=z), v, dout)
    if rab is None:
        assert drab is None
    else:
        assert_grad_close(drab, lambda z: fwd(rab_=z), rab, dout)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(cu=[0, 2, 1, 7]), "never decrease"),
        (dict(cu=[0, 3, 6]), "token count"),
        (dict(max_seqlen=2), "max_seqlen 2"),
        (dict(window=(-1, 1), num_contexts=[0, 0, 0]), "causal window"),
        (dict(window=(-1, 0), num_targets=[0, 5, 0]), "sequence 1 has 0 contexts and 5 targets"),
        (dict(window=(-1, 0), num_contexts=[0, -1, 0]), r"num_contexts\[1\] is negative"),
        (dict(window=(-1, 0), num_contexts=[0, 1]), r"num_contexts must be \(3,\)"),
        (dict(target_group_size=0), "target_group_size"),
        (dict(scaling_seqlen=0), "scaling_seqlen"),
        (dict(window=(1,)), "two ints"),
        (dict(rab=np.zeros((3, 3, 4, 4))), "rab must be"),
        (dict(rab=np.zeros((3, 1, 2, 4))), "rab must be"),
    ],
)
def test_bad_arguments_are_named(bad, match):
    q, k, v, cu, _ = _batch([1, 3, 3])
    kw = dict(cu=cu, max_seqlen=3) | bad
    with pytest.raises(ValueError, match=match):
        ref.hstu_attn_forward_ref(q, k, v, kw.pop("cu"), kw.pop("max_seqlen"), **kw)


# ---- random problems (shared with tests/test_hstu_attention_kernels.py) ------------------------------------
@st.composite
def problems(draw, max_seqs=3, max_len=6, max_heads=2, max_dim=4):
    """A ragged batch (lengths 0..max_len) with one of the masks, alpha, S, rab: a dict of the reference's
    arguments ("ref") and of the kernels' ("dev": zeros for absent contexts / targets)."""
    lengths = draw(st.lists(st.integers(0, max_len), min_size=1, max_size=max_seqs))
    heads, d, dv = draw(st.integers(1, max_heads)), draw(st.integers(1, max_dim)), draw(st.integers(1, max_dim))
    mode = draw(st.sampled_from(["full", "causal", "local", "targets"]))
    window = {"full": (-1, -1), "causal": (-1, 0), "targets": (-1, 0)}.get(mode)
    if mode == "local":
        window = (draw(st.integers(0, 3)), draw(st.integers(-1, 3)))
    ctx = np.zeros(len(lengths), np.int32)
    tgt = np.zeros(len(lengths), np.int32)
    kw = dict(window=window, alpha=draw(st.sampled_from([1.0, 0.6])), scaling_seqlen=draw(st.sampled_from([-1, 3])))
    if mode == "targets":
        for b, n in enumerate(lengths):
            ctx[b] = draw(st.integers(0, n))
            tgt[b] = draw(st.integers(0, n - ctx[b]))
        kw["target_group_size"] = draw(st.integers(1, 3))
    max_seqlen = max(max(lengths), 1) + draw(st.integers(0, 1))
    rab_heads = draw(st.sampled_from([None, 1, heads]))
    q, k, v, cu, rab = _batch(lengths, heads, d, dv, draw(st.integers(0, 2**16)), rab_heads, np.float32, scale=1.5)
    dout = np.random.default_rng(len(lengths)).uniform(-1, 1, v.shape).astype(np.float32)
    both = dict(q=q, k=k, v=v, cu=cu, max_seqlen=max_seqlen, rab=rab, dout=dout, **kw)
    ref_kw = dict(num_contexts=ctx, num_targets=tgt) if mode == "targets" else {}
    return dict(both, ref=ref_kw, dev=dict(num_contexts=ctx, num_targets=tgt))


def reference(pr):
    """(out, dq, dk, dv, drab) of problem pr, in float64."""
    f64 = {n: (None if pr[n] is None else pr[n].astype(np.float64)) for n in ("q", "k", "v", "rab", "dout")}
    kw = dict(
        scaling_seqlen=pr["scaling_seqlen"],
        target_group_size=pr.get("target_group_size", 1),
        window=pr["window"],
        alpha=pr["alpha"],
        rab=f64["rab"],
        **pr["ref"],
    )
    out = ref.hstu_attn_forward_ref(f64["q"], f64["k"], f64["v"], pr["cu"], pr["max_seqlen"], **kw)
    grads = ref.hstu_attn_backward_ref(f64["q"], f64["k"], f64["v"], f64["dout"], pr["cu"], pr["max_seqlen"], **kw)
    return (out,) + grads


def device_kwargs(pr):
    return dict(
        scaling_seqlen=pr["scaling_seqlen"],
        target_group_size=pr.get("target_group_size", 1),
        window=pr["window"],
        alpha=pr["alpha"],
        rab=pr["rab"],
    )


def assert_matches_reference(got, want):
    for name, g, w in zip(("out", "dq", "dk", "dv", "drab"), got, want):
        if w is None:
            assert g is None, name
        else:
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6, err_msg=name)


def run_cpu(pr, tile=None):
    """(out, dq, dk, dv, drab) of the cpu version; tile: its query rows per tile (None: ha.CPU_TILE)."""
    q, k, v, dout, cu, rab = pr["q"], pr["k"], pr["v"], pr["dout"], pr["cu"], pr["rab"]
    ctx, tgt = pr["dev"]["num_contexts"], pr["dev"]["num_targets"]
    kw = dict(device_kwargs(pr), tile=tile)
    out = np.full(v.shape, np.nan, np.float32)
    ha.hstu_attn_forward_cpu(q, k, v, cu, ctx, tgt, out, pr["max_seqlen"], **kw)
    dq, dk, dv = (np.full(x.shape, np.nan, np.float32) for x in (q, k, v))
    drab = None if rab is None else np.full(rab.shape, np.nan, np.float32)
    ha.hstu_attn_backward_cpu(q, k, v, dout, cu, ctx, tgt, dq, dk, dv, pr["max_seqlen"], drab=drab, **kw)
    return out, dq, dk, dv, drab


@settings(max_examples=60)
@given(pr=problems(max_len=9, max_heads=3, max_dim=5), tile=st.sampled_from([None, 1, 2, 3]))
def test_compiled_cpu_matches_reference(pr, tile):
    """Any tile: a sequence longer than the tile spans several tiles, each with its own key range (window,
    contexts and targets move it); None: one tile per sequence at these lengths."""
    assert_matches_reference(run_cpu(pr, tile), reference(pr))


def _long_case(lengths, heads, d, dv, window, ctx, tgt, rab_heads, seed=5):
    q, k, v, cu, rab = _batch(lengths, heads, d, dv, seed, rab_heads, np.float32, scale=1.5)
    return dict(
        q=q,
        k=k,
        v=v,
        cu=cu,
        rab=rab,
        max_seqlen=max(lengths),
        window=window,
        alpha=0.5,
        scaling_seqlen=-1,
        target_group_size=2,
        dout=np.random.default_rng(seed).uniform(-1, 1, v.shape).astype(np.float32),
        ref=dict(num_contexts=np.array(ctx, np.int32), num_targets=np.array(tgt, np.int32)) if ctx else {},
        dev=dict(num_contexts=np.array(ctx or [0] * len(lengths), np.int32),
                 num_targets=np.array(tgt or [0] * len(lengths), np.int32)),
    )  # fmt: skip


@pytest.mark.parametrize(
    "window, ctx, tgt",
    [((-1, 0), [3, 0, 70], [9, 0, 5]), ((-1, -1), None, None), ((30, 7), None, None)],
)
def test_compiled_cpu_matches_reference_on_long_sequences(window, ctx, tgt):
    """Sequences of several default tiles (CPU_TILE rows), sums over 150 keys: the BLAS products' order."""
    assert ha.CPU_TILE < 150
    pr = _long_case([150, 0, 97], 2, 16, 8, window, ctx, tgt, rab_heads=1)
    assert_matches_reference(run_cpu(pr), reference(pr))


def test_compiled_cpu_refuses_an_empty_tile():
    pr = case_problem([3, 2], dict(window=(-1, 0)), rab_heads=None)
    with pytest.raises(ValueError, match="tile must be >= 1"):
        run_cpu(pr, tile=0)


def test_compiled_cpu_is_the_same_for_any_thread_count():
    """One thread, and as many as numba has (a pool over the sequences when there are 2 or more): the same
    bits, small problems (run in the calling thread) and large ones (enough work for the pool)."""
    import numba

    q, k, v, cu, rab = _batch([7, 0, 5, 9], heads=3, d=4, dv=5, rab_heads=1, dtype=np.float32, seed=4)
    small = dict(
        q=q,
        k=k,
        v=v,
        cu=cu,
        rab=rab,
        max_seqlen=9,
        window=(-1, 0),
        alpha=1.0,
        scaling_seqlen=-1,
        dout=np.ones(v.shape, np.float32),
        ref={},
        dev=dict(num_contexts=np.array([2, 0, 1, 0], np.int32), num_targets=np.array([3, 0, 1, 2], np.int32)),
    )
    large = _long_case([300, 250, 0, 120], 2, 32, 32, (-1, 0), [4, 0, 0, 9], [20, 3, 0, 1], rab_heads=1)
    before = numba.get_num_threads()
    try:
        for case in (small, large):
            numba.set_num_threads(1)
            one = run_cpu(case)
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
            if case is large and numba.config.NUMBA_NUM_THREADS > 1:  # the pool runs it
                call = ha._CpuCall(case["q"], case["cu"], *case["dev"].values(), 300, -1, (-1, 0), 2, 0.5, None, None)
                assert call.threads(64) > 1
            many = run_cpu(case)
            for a, b in zip(one, many):
                np.testing.assert_array_equal(a, b)
    finally:
        numba.set_num_threads(before)


def case_problem(lengths, kw, rab_heads, heads=2, d=3, dv=2, seed=0):
    """One of CASES as a problem dict (float32 arrays) for the cpu and kernel tests."""
    q, k, v, cu, rab = _batch(lengths, heads, d, dv, seed, rab_heads, np.float32, scale=1.5)
    batch = len(lengths)
    ctx = np.asarray(kw.get("num_contexts", [0] * batch), np.int32)
    tgt = np.asarray(kw.get("num_targets", [0] * batch), np.int32)
    ref_kw = {n: np.asarray(kw[n], np.int32) for n in ("num_contexts", "num_targets") if n in kw}
    return dict(
        q=q,
        k=k,
        v=v,
        cu=cu,
        rab=rab,
        max_seqlen=max(lengths) + 1,
        window=kw["window"],
        alpha=0.8,
        scaling_seqlen=kw.get("scaling_seqlen", -1),
        target_group_size=kw.get("target_group_size", 1),
        dout=np.random.default_rng(seed).uniform(-1, 1, v.shape).astype(np.float32),
        ref=ref_kw,
        dev=dict(num_contexts=ctx, num_targets=tgt),
    )


@pytest.mark.parametrize("lengths, kw", CASES)
@pytest.mark.parametrize("rab_heads", [None, 1, 2])
def test_compiled_cpu_matches_reference_on_the_gradient_cases(lengths, kw, rab_heads):
    pr = case_problem(lengths, kw, rab_heads)
    assert_matches_reference(run_cpu(pr), reference(pr))
