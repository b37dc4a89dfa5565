"""HSTU's jagged attention: the NumPy reference (forward and hand-written backward) and its argument rules.

HSTU (Zhai et al., "Actions Speak Louder than Words", arXiv 2402.17152) replaces softmax attention by a
pointwise SiLU, so every (query, key) pair is independent of the others in its row. Over a batch of jagged
sequences (token ``t`` of sequence ``b`` is row ``cu_seqlens[b] + t`` of q, k, v), for one head:

    s[i, j] = q_i . k_j + rab[b, h, i, j]          (rab: a relative attention bias, optional)
    x[i, j] = alpha * s[i, j]
    p[i, j] = m[i, j] * silu(x[i, j]) / S          silu(x) = x * sigmoid(x);  m the mask below (0 or 1)
    out_i   = sum_j p[i, j] * v_j                  (B, H) pairs independent; i, j local positions in b

with ``S = scaling_seqlen`` (``-1``: ``max_seqlen``). The backward, derived by hand (dout = dL/dout):

    dv_j      = sum_i p[i, j] * dout_i
    dp[i, j]  = dout_i . v_j
    ds[i, j]  = dp[i, j] * m[i, j] / S * alpha * silu'(x[i, j])
                silu'(x) = sig(x) * (1 + x * (1 - sig(x)))          (sig = sigmoid)
    dq_i      = sum_j ds[i, j] * k_j
    dk_j      = sum_i ds[i, j] * q_i
    drab[b, h, i, j] = ds[i, j]       (summed over the heads when rab has one head for all)

The mask (FBGEMM's kernel predicate, ``apply_mask`` in fbgemm_gpu/experimental/hstu/src/hstu_ampere/
hstu_fwd.h and the argument rules of its hstu_ops_gpu.cpp ``set_params_fprop``). A sequence of length
``L`` is laid out as ``[contexts | history | targets]``; ``c = num_contexts[b]``,
``hist = L - num_targets[b]`` (where the targets start). Window sizes below 0 or above ``max_seqlen``
mean ``max_seqlen`` (unbounded); ``(-1, 0)`` is causal. Key ``j`` is visible to query ``i`` when

    i < c and j < hist                            a context row sees every non-target row, else
    i - wl <= j <= i + wr                         the window (causal: j <= i), and not
    i >= hist and hist <= j < hist + G * ((i - hist) // G)
                                                  a target sees no target of an earlier group
                                                  (G = target_group_size; within its group: causal)

Contexts and targets are defined only with the causal window (FBGEMM refuses them otherwise: "undefined
behavior"); ``window=(-1, -1)`` is full attention over the sequence. FBGEMM's own PyTorch reference
(``_hstu_attention_maybe_from_cache`` and ``construct_mask`` in fbgemm_gpu/experimental/hstu/test/
hstu_test.py) pads each sequence to ``max_seqlen``, multiplies silu(alpha (qk + rab)) / max_seqlen by the
dense mask and applies it to v, the formula above. rab is (B, Hr, M, M), Hr 1 or H, M >= the longest
sequence, indexed by local positions (FBGEMM pads it to its tile size).

Shapes: q, k (T, H, D), v (T, H, Dv), cu_seqlens (B + 1,), T = cu_seqlens[-1].
The numba.cuda kernels and the compiled cpu version are in kernels/hstu_attention.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HstuArgs:
    """The checked arguments: per-sequence starts and lengths, where targets start (hist) and how many
    contexts lead (ctx), the window as two non-negative ints, the divisor S and rab's head count."""

    starts: np.ndarray    # (B,) int64
    lengths: np.ndarray   # (B,) int64
    hist: np.ndarray      # (B,) int64, L - num_targets
    ctx: np.ndarray       # (B,) int64
    wl: int
    wr: int
    scale: float
    group: int
    rab_heads: int        # 0 without rab


def resolve_window(window, max_seqlen: int) -> tuple[int, int]:
    """(wl, wr) as FBGEMM sets them: a size below 0 or above max_seqlen becomes max_seqlen."""
    try:
        wl, wr = (int(w) for w in window)
    except (TypeError, ValueError):
        raise ValueError(f"hstu attention: window must be two ints (left, right), got {window!r}") from None
    return tuple(max_seqlen if w < 0 or w > max_seqlen else w for w in (wl, wr))


def is_causal(wl: int, wr: int, max_seqlen: int) -> bool:
    return wl == max_seqlen and wr == 0


def _per_sequence(name, a, batch: int) -> np.ndarray:
    a = np.asarray(a)
    if a.shape != (batch,) or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"hstu attention: {name} must be ({batch},) integers (one per sequence), "
                         f"got {a.dtype} {a.shape}")
    if (a < 0).any():
        raise ValueError(f"hstu attention: {name}[{int(np.argmax(a < 0))}] is negative")
    return a.astype(np.int64)


def check_args(q, k, v, cu_seqlens, max_seqlen, scaling_seqlen=-1, num_contexts=None, num_targets=None,
               target_group_size=1, window=(-1, -1), rab=None) -> HstuArgs:
    """Check shapes and values of the attention's arguments (host arrays); raise ValueError naming the
    argument. Returns the HstuArgs every implementation uses."""
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"hstu attention: q, k must be (T, H, D) and v (T, H, Dv) alike, got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 1 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"hstu attention: cu_seqlens must be (B + 1,) integers, got {cu.dtype} {cu.shape}")
    if cu[0] != 0 or (np.diff(cu) < 0).any() or cu[-1] != q.shape[0]:
        raise ValueError(f"hstu attention: cu_seqlens must start at 0, never decrease and end at the token "
                         f"count {q.shape[0]}, got {cu.tolist()[:8]}{'...' if cu.size > 8 else ''}")
    cu = cu.astype(np.int64)
    batch, lengths = cu.size - 1, np.diff(cu)
    longest = int(lengths.max(initial=0))
    if int(max_seqlen) < max(longest, 1):
        raise ValueError(f"hstu attention: max_seqlen {max_seqlen} is below the longest sequence ({longest}) "
                         f"or below 1")
    max_seqlen = int(max_seqlen)
    scale = max_seqlen if scaling_seqlen == -1 else scaling_seqlen
    if not scale >= 1:
        raise ValueError(f"hstu attention: scaling_seqlen must be -1 (max_seqlen) or >= 1, got {scaling_seqlen}")
    wl, wr = resolve_window(window, max_seqlen)
    if int(target_group_size) < 1:
        raise ValueError(f"hstu attention: target_group_size must be >= 1, got {target_group_size}")
    if (num_contexts is not None or num_targets is not None) and not is_causal(wl, wr, max_seqlen):
        raise ValueError(f"hstu attention: num_contexts and num_targets need the causal window (-1, 0), got "
                         f"{tuple(window)} (FBGEMM: undefined behavior)")
    ctx = np.zeros(batch, np.int64) if num_contexts is None else _per_sequence("num_contexts", num_contexts, batch)
    tgt = np.zeros(batch, np.int64) if num_targets is None else _per_sequence("num_targets", num_targets, batch)
    over = ctx + tgt > lengths
    if over.any():
        b = int(np.argmax(over))
        raise ValueError(f"hstu attention: sequence {b} has {ctx[b]} contexts and {tgt[b]} targets but "
                         f"length {lengths[b]}")
    rab_heads = 0
    if rab is not None:
        if (rab.ndim != 4 or rab.shape[0] != batch or rab.shape[1] not in (1, q.shape[1])
                or min(rab.shape[2:]) < longest):
            raise ValueError(f"hstu attention: rab must be (B, 1 or H, M, M) with B = {batch}, H = {q.shape[1]}, "
                             f"M >= the longest sequence ({longest}), got {rab.shape}")
        rab_heads = rab.shape[1]
    return HstuArgs(cu[:-1], lengths, lengths - tgt, ctx, wl, wr, float(scale), int(target_group_size), rab_heads)


def sigmoid_ref(x):
    """sigmoid(x) = (1 + tanh(x / 2)) / 2: the same value as 1 / (1 + exp(-x)), with no overflow."""
    return 0.5 + 0.5 * np.tanh(0.5 * x)


def silu_ref(x):
    return x * sigmoid_ref(x)


def dsilu_ref(x):
    """silu'(x) = sig(x) (1 + x (1 - sig(x)))."""
    s = sigmoid_ref(x)
    return s * (1 + x * (1 - s))


def hstu_mask_ref(length: int, hist: int, ctx: int, wl: int, wr: int, group: int) -> np.ndarray:
    """(L, L) bool: m[i, j], key j visible to query i (the rules of the module docstring)."""
    i = np.arange(length)[:, None]
    j = np.arange(length)[None, :]
    m = (j >= i - wl) & (j <= i + wr)
    m &= ~((i >= hist) & (j >= hist) & (j < hist + group * ((i - hist) // group)))
    return m | ((i < ctx) & (j < hist))


def _pairs(a: HstuArgs, heads: int):
    """(b, h, rows slice, mask, rab head) of every (sequence, head) pair."""
    for b in range(a.lengths.size):
        n = int(a.lengths[b])
        m = hstu_mask_ref(n, int(a.hist[b]), int(a.ctx[b]), a.wl, a.wr, a.group)
        rows = slice(int(a.starts[b]), int(a.starts[b]) + n)
        for h in range(heads):
            yield b, h, rows, m, (h if a.rab_heads > 1 else 0)


def _scores(q, k, rab, b, h, rows, hr, n, alpha):
    s = q[rows, h] @ k[rows, h].T                                   # (L, L)
    if rab is not None:
        s = s + rab[b, hr, :n, :n]
    return alpha * s


def hstu_attn_forward_ref(q, k, v, cu_seqlens, max_seqlen, scaling_seqlen=-1, num_contexts=None,
                          num_targets=None, target_group_size=1, window=(-1, -1), alpha=1.0, rab=None):
    """out (T, H, Dv) of the module docstring's formula, in q's dtype (float64 for the gradient checks)."""
    a = check_args(q, k, v, cu_seqlens, max_seqlen, scaling_seqlen, num_contexts, num_targets,
                   target_group_size, window, rab)
    out = np.zeros(v.shape, dtype=np.result_type(q, k, v))
    for b, h, rows, m, hr in _pairs(a, q.shape[1]):
        x = _scores(q, k, rab, b, h, rows, hr, m.shape[0], alpha)
        p = np.where(m, silu_ref(x), 0) / a.scale                   # (L, L)
        out[rows, h] = p @ v[rows, h]
    return out


def hstu_attn_backward_ref(q, k, v, dout, cu_seqlens, max_seqlen, scaling_seqlen=-1, num_contexts=None,
                           num_targets=None, target_group_size=1, window=(-1, -1), alpha=1.0, rab=None):
    """(dq, dk, dv, drab) of the module docstring's backward; drab is None without rab, else rab's shape
    (zero where no query sees a key, and beyond each sequence's length)."""
    a = check_args(q, k, v, cu_seqlens, max_seqlen, scaling_seqlen, num_contexts, num_targets,
                   target_group_size, window, rab)
    if dout.shape != v.shape:
        raise ValueError(f"hstu attention backward: dout {dout.shape} must be v's shape {v.shape}")
    dt = np.result_type(q, k, v, dout)
    dq, dk, dv = np.zeros(q.shape, dt), np.zeros(k.shape, dt), np.zeros(v.shape, dt)
    drab = None if rab is None else np.zeros(rab.shape, dt)
    for b, h, rows, m, hr in _pairs(a, q.shape[1]):
        n = m.shape[0]
        x = _scores(q, k, rab, b, h, rows, hr, n, alpha)
        p = np.where(m, silu_ref(x), 0) / a.scale
        dp = dout[rows, h] @ v[rows, h].T                           # (L, L)
        ds = np.where(m, dp * dsilu_ref(x), 0) * (alpha / a.scale)
        dv[rows, h] = p.T @ dout[rows, h]
        dq[rows, h] = ds @ k[rows, h]
        dk[rows, h] = ds.T @ q[rows, h]
        if drab is not None:
            drab[b, hr, :n, :n] += ds
    return dq, dk, dv, drab


#: no kernels here (NumPy reference only)
PTX_CHECKS = []
