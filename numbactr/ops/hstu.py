"""Ops of the sequential recommenders (numbactr.hstu): HSTU's jagged attention and its relative bias, SiLU,
row-wise L2 normalisation, the jagged <-> padded copies, a row gather, and the sampled softmax loss.

Contract: autograd Functions on raw arrays of the current device, each with a hand-written backward.
``HstuAttentionFn`` and ``RelativeBiasFn`` reach their implementations through numbactr.ops.dispatch.pick:
the numba.cuda kernels of kernels/hstu_attention.py and kernels/hstu_rab.py on gpu/sim, the compiled CPU
attention (``kernels.hstu_attention.hstu_attn_*_cpu``) on cpu, and the NumPy references (the oracle;
kernels/hstu_attention_ref.py, ``kernels.hstu_rab.rab_*_ref``) under NUMBACTR_CPU_REFERENCE=1 or for float64
(gradient checks). The other ops here are a few array expressions each, written once with the array
library (``xp``: NumPy on cpu/sim, CuPy's elementwise kernels and cuBLAS on gpu): they have no numba
kernel of their own.

Formulas (T tokens of B jagged sequences, token t of sequence b at row cu[b] + t; N the padded length)::

    HSTU attention   out_i = sum_j m[i, j] silu(alpha (q_i . k_j + rab[b, i, j])) v_j / S   (causal m)
    relative bias    rab[b, i, j] = pos_w[N - 1 + j - i] + ts_w[bucket(ts[b, i + 1] - ts[b, j])]
    SiLU             y = x sig(x),  dx = dy sig(x) (1 + x (1 - sig(x)))
    L2 norm          y = x / max(|x|, eps),  dx = (dy - y (y . dy)) / |x|   (dy / eps below eps)
    sampled softmax  l_0 = q . p / tau,  l_r = q . n_r / tau (-5e4 where n_r is the positive's own id),
                     loss = sum_m w_m (logsumexp_r l - l_0) / sum_m w_m   (p, n_r rows of a candidate table)

Sources: Zhai et al., "Actions Speak Louder than Words" (arXiv 2402.17152); generative-recommenders'
research code (meta-recsys/generative-recommenders, generative_recommenders/research/modeling/sequential/
hstu.py ``_hstu_attention_maybe_from_cache`` and ``RelativeBucketedTimeAndPositionBasedBias``;
losses/sampled_softmax.py ``SampledSoftmaxLoss``; output_postprocessors.py ``L2NormEmbeddingPostprocessor``).
"""

from __future__ import annotations

import numpy as np

from numbactr.autograd import Context, Function
from numbactr.kernels import hstu_attention as ha
from numbactr.kernels import hstu_attention_ref as har
from numbactr.kernels import hstu_rab
from numbactr.ops.dispatch import pick
from numbactr.runtime.device import contig as _contig
from numbactr.runtime.device import xp as _xp

CAUSAL = (-1, 0)
#: the logit a sampled negative gets when it is the positive itself (generative-recommenders' value)
COLLISION_LOGIT = -5.0e4


# ---- HSTU attention ---------------------------------------------------------------------------------------
def _ints(xp, a):
    return xp.asarray(np.ascontiguousarray(a, np.int32))


def _attn_forward_kernel(ctx, q, k, v, rab):
    xp = _xp()
    out = xp.empty(v.shape, np.float32)
    zeros = _ints(xp, np.zeros(ctx.batch))
    ha.hstu_attn_forward(
        q, k, v, _ints(xp, ctx.cu), zeros, zeros, out, ctx.max_seqlen, ctx.scaling, 1, ctx.window, ctx.alpha, rab
    )
    return out


def _attn_forward_cpu(ctx, q, k, v, rab):
    if q.dtype != np.float32:  # float64 (gradient checks): the reference
        return _attn_forward_ref(ctx, q, k, v, rab)
    out = np.empty(v.shape, np.float32)
    zeros = np.zeros(ctx.batch, np.int64)
    ha.hstu_attn_forward_cpu(
        q, k, v, ctx.cu, zeros, zeros, out, ctx.max_seqlen, ctx.scaling, 1, ctx.window, ctx.alpha, rab
    )
    return out


def _attn_forward_ref(ctx, q, k, v, rab):
    return har.hstu_attn_forward_ref(
        q, k, v, ctx.cu, ctx.max_seqlen, ctx.scaling, window=ctx.window, alpha=ctx.alpha, rab=rab
    )


def _attn_backward_kernel(ctx, dout):
    xp = _xp()
    q, k, v, rab = ctx.saved
    dq, dk, dv = xp.empty(q.shape, np.float32), xp.empty(k.shape, np.float32), xp.empty(v.shape, np.float32)
    drab = None if rab is None else xp.zeros(rab.shape, np.float32)  # the kernel adds into it
    zeros = _ints(xp, np.zeros(ctx.batch))
    ha.hstu_attn_backward(
        q,
        k,
        v,
        dout,
        _ints(xp, ctx.cu),
        zeros,
        zeros,
        dq,
        dk,
        dv,
        ctx.max_seqlen,
        ctx.scaling,
        1,
        ctx.window,
        ctx.alpha,
        rab,
        drab,
    )
    return dq, dk, dv, drab


def _attn_backward_cpu(ctx, dout):
    q, k, v, rab = ctx.saved
    if q.dtype != np.float32 or dout.dtype != np.float32:
        return _attn_backward_ref(ctx, dout)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    drab = None if rab is None else np.empty_like(rab)
    zeros = np.zeros(ctx.batch, np.int64)
    ha.hstu_attn_backward_cpu(
        q,
        k,
        v,
        dout,
        ctx.cu,
        zeros,
        zeros,
        dq,
        dk,
        dv,
        ctx.max_seqlen,
        ctx.scaling,
        1,
        ctx.window,
        ctx.alpha,
        rab,
        drab,
    )
    return dq, dk, dv, drab


def _attn_backward_ref(ctx, dout):
    q, k, v, rab = ctx.saved
    return har.hstu_attn_backward_ref(
        q, k, v, dout, ctx.cu, ctx.max_seqlen, ctx.scaling, window=ctx.window, alpha=ctx.alpha, rab=rab
    )


class HstuAttentionFn(Function):
    """q, k (T, H, D), v (T, H, Dv) [, rab (B, 1 or H, N, N)] -> out (T, H, Dv): HSTU's pointwise attention
    over the jagged sequences of ``cu_seqlens`` (host (B + 1,) ints), divided by ``scaling_seqlen`` (-1:
    ``max_seqlen``), causal by default (``window=(-1, 0)``). The arguments are checked on the host first
    (kernels.hstu_attention_ref.check_args: a bad shape or offset is a ValueError naming it)."""

    @staticmethod
    def forward(
        ctx: Context,
        q,
        k,
        v,
        rab=None,
        cu_seqlens=None,
        max_seqlen: int = 0,
        scaling_seqlen=-1,
        window=CAUSAL,
        alpha: float = 1.0,
    ):
        cu = np.asarray(cu_seqlens, np.int64)
        har.check_args(q, k, v, cu, max_seqlen, scaling_seqlen, window=window, rab=rab)
        ctx.cu, ctx.batch, ctx.max_seqlen, ctx.scaling = cu, cu.size - 1, int(max_seqlen), scaling_seqlen
        ctx.window, ctx.alpha = tuple(window), float(alpha)
        q, k, v = _contig(q), _contig(k), _contig(v)
        rab = None if rab is None else _contig(rab)
        ctx.saved = (q, k, v, rab)
        return pick(kernel=_attn_forward_kernel, cpu=_attn_forward_cpu, ref=_attn_forward_ref)(ctx, q, k, v, rab)

    @staticmethod
    def backward(ctx: Context, dout):
        dq, dk, dv, drab = pick(kernel=_attn_backward_kernel, cpu=_attn_backward_cpu, ref=_attn_backward_ref)(
            ctx, _contig(dout)
        )
        return (dq, dk, dv) if ctx.saved[3] is None else (dq, dk, dv, drab)


# ---- relative attention bias (positions and log-time buckets) ------------------------------------------------
def _rab_forward_kernel(ts, pos_w, ts_w):
    xp = _xp()
    rab = xp.empty((ts.shape[0], ts.shape[1], ts.shape[1]), np.float32)
    hstu_rab.rab_forward(xp.asarray(ts), _contig(pos_w), _contig(ts_w), rab)
    return rab


def _rab_backward_kernel(ts, drab, pos_w, ts_w):
    xp = _xp()
    dpos, dts = xp.zeros(pos_w.shape, np.float32), xp.zeros(ts_w.shape, np.float32)
    hstu_rab.rab_backward(xp.asarray(ts), _contig(drab).astype(np.float32, copy=False), dpos, dts)
    return dpos, dts


class RelativeBiasFn(Function):
    """pos_w (2N - 1,), ts_w (num_buckets + 1,) -> rab (B, 1, N, N) for ``timestamps`` (B, N) int64 (host):
    generative-recommenders' RelativeBucketedTimeAndPositionBasedBias (formula: kernels/hstu_rab.py), one
    bias for all heads."""

    @staticmethod
    def forward(ctx: Context, pos_w, ts_w, timestamps=None):
        ts = np.ascontiguousarray(timestamps, np.int64)
        ctx.ts, ctx.pos_w, ctx.ts_w = ts, pos_w, ts_w
        rab = pick(kernel=_rab_forward_kernel, ref=hstu_rab.rab_forward_ref)(ts, pos_w, ts_w)
        return rab[:, None]

    @staticmethod
    def backward(ctx: Context, drab):
        return pick(kernel=_rab_backward_kernel, ref=hstu_rab.rab_backward_ref)(ctx.ts, drab[:, 0], ctx.pos_w, ctx.ts_w)


# ---- SiLU, L2 norm -------------------------------------------------------------------------------------------
class SiluFn(Function):
    """y = x sig(x), sig(x) = (1 + tanh(x / 2)) / 2 (no overflow)."""

    @staticmethod
    def forward(ctx: Context, x):
        xp = _xp()
        s = 0.5 + 0.5 * xp.tanh(0.5 * x)
        ctx.x, ctx.s = x, s.astype(x.dtype, copy=False)
        return x * ctx.s

    @staticmethod
    def backward(ctx: Context, dy):
        s = ctx.s
        return dy * (s * (1 + ctx.x * (1 - s)))


class L2NormFn(Function):
    """Rows of x (..., D) divided by their L2 norm, at least ``eps`` (generative-recommenders'
    L2NormEmbeddingPostprocessor and item_l2_norm, eps 1e-6)."""

    @staticmethod
    def forward(ctx: Context, x, eps: float = 1e-6):
        xp = _xp()
        norm = xp.sqrt((x * x).sum(-1, keepdims=True))  # (..., 1)
        ctx.n, ctx.small = xp.maximum(norm, x.dtype.type(eps)), norm < eps
        ctx.y = x / ctx.n
        return ctx.y

    @staticmethod
    def backward(ctx: Context, dy):
        y = ctx.y
        dx = (dy - y * (y * dy).sum(-1, keepdims=True)) / ctx.n
        return _xp().where(ctx.small, dy / ctx.n, dx)


# ---- jagged <-> padded, gathered rows --------------------------------------------------------------------------
def padded_index(cu_seqlens, n: int) -> np.ndarray:
    """(T,) int64: where token t of the jagged layout lands in the flattened padded (B * n) layout (each
    sequence left-aligned in its row of n; lengths above n are an error)."""
    cu = np.asarray(cu_seqlens, np.int64)
    lengths = np.diff(cu)
    if (lengths > n).any():
        b = int(np.argmax(lengths > n))
        raise ValueError(f"padded_index: sequence {b} has {lengths[b]} tokens, more than the padded length {n}")
    seq = np.repeat(np.arange(lengths.size), lengths)
    return seq * n + (np.arange(int(cu[-1])) - cu[:-1][seq])


class PadFn(Function):
    """x (T, E) jagged -> (B, n, E) padded with zeros; ``index`` = padded_index(cu_seqlens, n)."""

    @staticmethod
    def forward(ctx: Context, x, index=None, batch: int = 0, n: int = 0):
        xp = _xp()
        ctx.index = xp.asarray(index)
        out = xp.zeros((batch * n,) + x.shape[1:], x.dtype)
        out[ctx.index] = x
        return out.reshape((batch, n) + x.shape[1:])

    @staticmethod
    def backward(ctx: Context, dy):
        return dy.reshape((-1,) + dy.shape[2:])[ctx.index]


class UnpadFn(Function):
    """(B, n, E) padded -> (T, E) jagged rows at ``index`` (the inverse of PadFn; padding gets no gradient)."""

    @staticmethod
    def forward(ctx: Context, x, index=None):
        xp = _xp()
        ctx.index, ctx.shape = xp.asarray(index), x.shape
        return x.reshape((-1,) + x.shape[2:])[ctx.index]

    @staticmethod
    def backward(ctx: Context, dy):
        xp = _xp()
        dx = xp.zeros((ctx.shape[0] * ctx.shape[1],) + dy.shape[1:], dy.dtype)
        dx[ctx.index] = dy
        return dx.reshape(ctx.shape)


def _scatter_add(dst, index, src):
    xp = _xp()
    if xp.__name__ == "numpy":
        np.add.at(dst, index, src)
    else:  # CuPy: an atomic scatter-add kernel
        import cupyx

        cupyx.scatter_add(dst, index, src)


class GatherRowsFn(Function):
    """table (V, E), ``index`` (M,) ints -> table[index] (M, E); the backward scatter-adds dY into the
    rows read (learned positions: row t of the table for token t of every sequence)."""

    @staticmethod
    def forward(ctx: Context, table, index=None):
        ctx.index, ctx.shape = _xp().asarray(index), table.shape
        return table[ctx.index]

    @staticmethod
    def backward(ctx: Context, dy):
        dt = _xp().zeros(ctx.shape, dy.dtype)
        _scatter_add(dt, ctx.index, dy)
        return dt


class ScaleByFn(Function):
    """y = c x for a constant c (the item embeddings' sqrt(D))."""

    @staticmethod
    def forward(ctx: Context, x, factor: float = 1.0):
        ctx.c = x.dtype.type(factor)
        return x * ctx.c

    @staticmethod
    def backward(ctx: Context, dy):
        return dy * ctx.c


# ---- sampled softmax -------------------------------------------------------------------------------------------
#: (rows x candidates) scores one block of the sampled softmax holds at a time (16 MB of float32)
BLOCK_SCORES = 1 << 22


def _blocks(m: int, u: int):
    """Row ranges [a, b) of at most BLOCK_SCORES / u rows (at least one)."""
    step = max(1, BLOCK_SCORES // max(u, 1))
    return [(a, min(a + step, m)) for a in range(0, m, step)]


class SampledSoftmaxFn(Function):
    """query (M, D) and the candidate rows items (U, D) -> the mean weighted loss (0-d).

    Row m's positive is items[pos[m]] and its R negatives items[neg[m, r]] (``pos`` (M,), ``neg`` (M, R)
    ints: a batch's distinct items are looked up once and the samples index them). A negative that is the
    positive itself gets the logit -5e4 (generative-recommenders' SampledSoftmaxLoss); ``weights`` (M,) are 1
    for a supervised position, 0 for padding; ``temperature`` tau::

        l_m0 = q_m . items[pos[m]] / tau,   l_mr = q_m . items[neg[m, r]] / tau
        loss = sum_m w_m (logsumexp(l_m) - l_m0) / sum_m w_m,   dL/dl_m = w_m (softmax(l_m) - e_0) / sum w

    The scores of a block of rows against every candidate come from one product S = q items^T; the backward
    adds the block's logit gradients into a matrix G of the same shape (a bincount) and returns G items and
    G^T q. Blocks of at most BLOCK_SCORES scores bound the memory (ML-1M: 25,600 rows x 3,706 items)."""

    @staticmethod
    def forward(ctx: Context, query, items, pos=None, neg=None, weights=None, temperature: float = 0.05):
        xp = _xp()
        m, u = query.shape[0], items.shape[0]
        pos, neg = xp.asarray(pos).reshape(m, 1), xp.asarray(neg).reshape(m, -1)
        inv = query.dtype.type(1.0 / temperature)
        cand = xp.concatenate([pos, neg], axis=1)  # (M, 1 + R) candidate of each logit
        logits = xp.empty(cand.shape, query.dtype)
        for a, b in _blocks(m, u):
            s = (query[a:b] @ items.T).reshape(-1)  # ((b - a) * U,) scores
            logits[a:b] = s[xp.arange(b - a)[:, None] * u + cand[a:b]] * inv
        collide = xp.concatenate([xp.zeros((m, 1), bool), neg == pos], axis=1)
        logits = xp.where(collide, query.dtype.type(COLLISION_LOGIT), logits)
        top = logits.max(axis=1, keepdims=True)
        e = xp.exp(logits - top)
        z = e.sum(axis=1, keepdims=True)
        w = xp.asarray(weights).astype(query.dtype, copy=False)
        total = query.dtype.type(max(float(w.sum()), 1e-12))
        per_row = (xp.log(z) + top)[:, 0] - logits[:, 0]
        ctx.saved = (query, items, cand, collide, e / z, w / total, inv)
        return (per_row * w).sum() / total

    @staticmethod
    def backward(ctx: Context, dloss):
        xp = _xp()
        query, items, cand, collide, prob, w, inv = ctx.saved
        g = prob * (w * inv * dloss)[:, None]  # (M, 1 + R): dL/d(q . x)
        g[:, 0] -= w * inv * dloss
        g = xp.where(collide, 0, g)  # collisions: constant logits
        m, u = query.shape[0], items.shape[0]
        dq, ditems = xp.empty_like(query), xp.zeros_like(items)
        for a, b in _blocks(m, u):
            flat = (xp.arange(b - a)[:, None] * u + cand[a:b]).reshape(-1)
            big = xp.bincount(flat, weights=g[a:b].reshape(-1), minlength=(b - a) * u).reshape(b - a, u)
            big = big.astype(query.dtype, copy=False)  # (rows, U): the block's G
            dq[a:b] = big @ items
            ditems += big.T @ query[a:b]
        return dq, ditems
