"""The layers of the sequential recommenders: HSTU's SequentialTransductionUnit and SASRec's block.

Both take and give jagged token rows x (T, D) (token t of sequence b at row cu[b] + t, numbactr.hstu.data)
and are chains of numbactr ops (numbactr.ops: Linear, LayerNormFn, SliceFn, MultiplyFn, DropoutFn, AddFn,
the attention ops, and numbactr.ops.hstu), so each trains on the cpu, sim and gpu devices with the ops'
hand-written backwards.

HSTU (Zhai et al., "Actions Speak Louder than Words", arXiv 2402.17152, eqs. 1-3; generative-recommenders'
research ``SequentialTransductionUnitJagged``, generative_recommenders/research/modeling/sequential/hstu.py,
linear_config "uvqk", normalization "rel_bias", concat_ua False)::

    u, v, q, k = split(silu(LayerNorm(x) W_uvqk))                  LayerNorm without affine, eps 1e-6
    A  = HSTU attention of q, k, v + rab, causal, divided by N     N the padded length (numbactr.ops.hstu)
    y  = W_o dropout(u * LayerNorm(A)) + b_o + x

    rab = RelativeBucketedTimeAndPositionBasedBias (128 log-time buckets; kernels/hstu_rab.py), one per layer.
    Init as the original: W_uvqk ~ N(0, 0.02), W_o Xavier-uniform, b_o ~ U(+-1/sqrt(H dv)) (torch.nn.Linear's
    default), the bias weights ~ N(0, 0.02).

SASRec (Kang and McAuley, ICDM 2018; generative-recommenders' ``SASRec._run_one_layer`` and
``StandardAttentionFF``, research/modeling/sequential/sasrec.py), over the padded (B, N, D) form::

    Q = LayerNorm(x)                                              eps 1e-8, no affine
    a = MultiHeadAttention(query Q, key x, value x, causal)       softmax(Qh Kh^T / sqrt(d)) Vh, in/out bias
    z = LayerNorm(Q + a)
    y = W_2 dropout(relu(W_1 z + b_1)) + b_2, dropout, + z         (the point-wise Conv1d FFN)

Padding rows are dropped on the way back to jagged rows (the original multiplies by the valid mask).
Dropout (rate r) uses numbactr's counter-based masks (numbactr.ops.elementwise.DropoutFn), so the backward
recomputes the mask instead of storing it.
"""

from __future__ import annotations

import math

import numpy as np

from numbactr.autograd import Tensor
from numbactr.hstu.data import JaggedBatch
from numbactr.ops.attention import MaskedSoftmaxFn, MatMulFn, MergeHeadsFn, ScaledQKFn, SplitHeadsFn
from numbactr.ops.dense import Linear
from numbactr.ops.elementwise import AddFn, DropoutFn, MultiplyFn, ReLU, dropout_step
from numbactr.ops.hstu import HstuAttentionFn, PadFn, RelativeBiasFn, SiluFn, UnpadFn, padded_index
from numbactr.ops.normalization import LayerNormFn
from numbactr.ops.shape import Reshape, SliceFn
from numbactr.runtime import device

NUM_TIME_BUCKETS = 128


def param(values, name: str) -> Tensor:
    """A trainable float32 Tensor on the current device."""
    return Tensor(device.xp().asarray(np.asarray(values, np.float32)), name, requires_grad=True)


def constant(values, name: str) -> Tensor:
    return Tensor(device.xp().asarray(np.asarray(values, np.float32)), name)


def xavier_uniform(rng, fan_in: int, fan_out: int) -> np.ndarray:
    a = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-a, a, (fan_in, fan_out))


class Steps:
    """What every layer of one forward shares: the batch, its padded length N (inputs + the predicted
    item), training or not, the dropout seed and step, and the tape."""

    def __init__(self, tape, batch: JaggedBatch, n_pad: int, training: bool, seed: int = 0, step: int = 0):
        self.tape, self.batch, self.n_pad, self.training = tape, batch, n_pad, training
        self.seed, self.step = seed, step
        self._pad = None

    @property
    def pad_index(self) -> np.ndarray:
        if self._pad is None:
            self._pad = padded_index(self.batch.cu, self.n_pad)
        return self._pad

    def dropout(self, owner, x: Tensor, rate: float, layer_id: int) -> Tensor:
        if not self.training or rate <= 0:
            return x
        return DropoutFn.apply(
            self.tape, x, rate=rate, seed=self.seed, step=dropout_step(owner, self.step), layer_id=layer_id
        )


def _layer_norm(steps: Steps, x: Tensor, width: int, eps: float) -> Tensor:
    """LayerNorm without affine: gamma 1 and beta 0, not trained."""
    ones, zeros = constant(np.ones(width), "ones"), constant(np.zeros(width), "zeros")
    return LayerNormFn.apply(steps.tape, x, ones, zeros, eps=eps)


class HstuLayer:
    """One HSTU layer (module docstring): ``dim`` D, ``heads`` H, head dims ``dqk`` and ``dv``, padded
    length ``n_pad`` (the relative bias has 2 n_pad - 1 position weights), dropout rate, ``layer_id``
    (its dropout masks' stream)."""

    def __init__(self, dim: int, heads: int, dqk: int, dv: int, n_pad: int, dropout: float, rng, layer_id: int):
        self.dim, self.heads, self.dqk, self.dv, self.rate, self.layer_id = dim, heads, dqk, dv, dropout, layer_id
        width = 2 * heads * (dv + dqk)
        self.w_uvqk = param(rng.normal(0, 0.02, (dim, width)), f"hstu{layer_id}.uvqk")
        self.no_bias = constant(np.zeros(width), "no bias")
        self.w_o = param(xavier_uniform(rng, heads * dv, dim), f"hstu{layer_id}.o.w")
        bound = 1 / math.sqrt(heads * dv)
        self.b_o = param(rng.uniform(-bound, bound, dim), f"hstu{layer_id}.o.b")
        self.pos_w = param(rng.normal(0, 0.02, 2 * n_pad - 1), f"hstu{layer_id}.rab.pos_w")
        self.ts_w = param(rng.normal(0, 0.02, NUM_TIME_BUCKETS + 1), f"hstu{layer_id}.rab.ts_w")
        self.n_pad = n_pad

    @property
    def params(self) -> list:
        return [self.w_uvqk, self.w_o, self.b_o, self.pos_w, self.ts_w]

    def __call__(self, steps: Steps, x: Tensor) -> Tensor:
        tape, t = steps.tape, x.shape[0]
        hv, hq = self.heads * self.dv, self.heads * self.dqk
        h = SiluFn.apply(tape, Linear.apply(tape, _layer_norm(steps, x, self.dim, 1e-6), self.w_uvqk, self.no_bias))
        u, v, q, k = SliceFn.apply(
            tape, h, ranges=((0, hv), (hv, 2 * hv), (2 * hv, 2 * hv + hq), (2 * hv + hq, 2 * hv + 2 * hq))
        )
        q, k = (Reshape.apply(tape, a, shape=(t, self.heads, self.dqk)) for a in (q, k))
        v = Reshape.apply(tape, v, shape=(t, self.heads, self.dv))
        rab = RelativeBiasFn.apply(tape, self.pos_w, self.ts_w, timestamps=steps.batch.timestamps)
        a = HstuAttentionFn.apply(
            tape, q, k, v, rab, cu_seqlens=steps.batch.cu, max_seqlen=steps.n_pad, scaling_seqlen=steps.n_pad
        )
        a = _layer_norm(steps, Reshape.apply(tape, a, shape=(t, hv)), hv, 1e-6)
        o = steps.dropout(self, MultiplyFn.apply(tape, u, a), self.rate, self.layer_id)
        return AddFn.apply(tape, Linear.apply(tape, o, self.w_o, self.b_o), x)


def causal_mask(n: int):
    """(1, 1, n, n) float32: 1 where key j <= query i."""
    return device.xp().asarray(np.tril(np.ones((n, n), np.float32))[None, None])


class SasRecBlock:
    """One SASRec block (module docstring): ``dim`` D = the FFN's hidden width as in the ML-1M config,
    ``heads`` H (D divisible by H), dropout rate for the attention probabilities and the FFN."""

    def __init__(self, dim: int, heads: int, dropout: float, rng, layer_id: int, ffn_dim: int | None = None):
        if dim % heads:
            raise ValueError(f"SasRecBlock: dim {dim} is not divisible by heads {heads}")
        self.dim, self.heads, self.rate, self.layer_id = dim, heads, dropout, layer_id
        f = ffn_dim or dim
        # torch.nn.MultiheadAttention: in_proj Xavier-uniform over (3D, D), biases 0; out_proj bias 0
        w_in = xavier_uniform(rng, dim, 3 * dim)
        bound = 1 / math.sqrt(dim)
        self.w_q, self.w_k, self.w_v = (
            param(w_in[:, i * dim : (i + 1) * dim], f"sas{layer_id}.{n}") for i, n in enumerate("qkv")
        )
        self.b_q, self.b_k, self.b_v = (param(np.zeros(dim), f"sas{layer_id}.b{n}") for n in "qkv")
        self.w_out = param(rng.uniform(-bound, bound, (dim, dim)), f"sas{layer_id}.out.w")
        self.b_out = param(np.zeros(dim), f"sas{layer_id}.out.b")
        # Conv1d(kernel 1) = a Linear; torch's default init U(+-1/sqrt(fan_in)) for weights and biases
        self.w_1 = param(rng.uniform(-bound, bound, (dim, f)), f"sas{layer_id}.ffn1.w")
        self.b_1 = param(rng.uniform(-bound, bound, f), f"sas{layer_id}.ffn1.b")
        b2 = 1 / math.sqrt(f)
        self.w_2 = param(rng.uniform(-b2, b2, (f, dim)), f"sas{layer_id}.ffn2.w")
        self.b_2 = param(rng.uniform(-b2, b2, dim), f"sas{layer_id}.ffn2.b")

    @property
    def params(self) -> list:
        return [
            self.w_q,
            self.w_k,
            self.w_v,
            self.b_q,
            self.b_k,
            self.b_v,
            self.w_out,
            self.b_out,
            self.w_1,
            self.b_1,
            self.w_2,
            self.b_2,
        ]

    def __call__(self, steps: Steps, x: Tensor) -> Tensor:
        tape, b, n, d, h = steps.tape, steps.batch.size, steps.n_pad, self.dim, self.heads
        xp = PadFn.apply(tape, x, index=steps.pad_index, batch=b, n=n)  # (B, N, D)
        q_in = _layer_norm(steps, xp, d, 1e-8)
        q = SplitHeadsFn.apply(tape, Linear.apply(tape, q_in, self.w_q, self.b_q), heads=h)  # (B, H, N, d)
        k = SplitHeadsFn.apply(tape, Linear.apply(tape, xp, self.w_k, self.b_k), heads=h)
        v = SplitHeadsFn.apply(tape, Linear.apply(tape, xp, self.w_v, self.b_v), heads=h)
        s = ScaledQKFn.apply(tape, q, k, scale=1.0 / math.sqrt(d // h))  # (B, H, N, N)
        mask = Tensor(device.xp().broadcast_to(causal_mask(n), (b, 1, n, n)).copy(), "causal")
        p = steps.dropout(self, MaskedSoftmaxFn.apply(tape, s, mask), self.rate, 2 * self.layer_id)
        a = Linear.apply(tape, MergeHeadsFn.apply(tape, MatMulFn.apply(tape, p, v)), self.w_out, self.b_out)
        z = _layer_norm(steps, AddFn.apply(tape, q_in, a), d, 1e-8)
        f = steps.dropout(
            self, ReLU.apply(tape, Linear.apply(tape, z, self.w_1, self.b_1)), self.rate, 2 * self.layer_id + 1
        )
        f = steps.dropout(self, Linear.apply(tape, f, self.w_2, self.b_2), self.rate, 2 * self.layer_id + 1001)
        return UnpadFn.apply(tape, AddFn.apply(tape, f, z), index=steps.pad_index)
