"""Attention layers: Softmax (plain and masked), MatrixMultiply, MultiHeadAttention. No weights.

Contract: each layer checks its config and bottoms and chains ops of numbactr.ops.attention (products
through the array library; softmax rows and the head split/merge through numbactr.ops.dispatch: numba.cuda
kernels on gpu/sim, NumPy references on cpu). Formula of the whole attention (mode iv below):
Y = merge_heads(softmax(Qh Khᵀ/sqrt(d) - (1 - mask)·10000) Vh).

Differences from HugeCTR (spec §6.2, §10.5):
* Softmax (1 input) subtracts the row max before exp (same result, no overflow to inf/NaN for
  logits > ~88); HugeCTR computes exp(x)/sum(exp(x)) as is. numbactr.hugectr_exact.hugectr_exact() restores
  HugeCTR's version.
* Masked Softmax reads mask[b, 0, i, j] for every row i, as HugeCTR v23.08/v23.12's kernel does
  (offset b*Lf*Lt + i*Lt + j); numbactr also takes a (B, 1, 1, Lt) mask, broadcast over the rows,
  which HugeCTR would read past. The four-input MultiHeadAttention uses the same masked softmax.
"""

from __future__ import annotations

import math
import numbers

from numbactr import hugectr_exact
from numbactr.enums import Layer_t
from numbactr.layers.base import Layer
from numbactr.ops.attention import (
    MaskedSoftmaxFn,
    MatMulFn,
    MergeHeadsFn,
    ScaledQKFn,
    SoftmaxFn,
    SplitHeadsFn,
)


# ---- layers ----------------------------------------------------------------------------------
class Softmax(Layer):
    """1 bottom: softmax over the last dim (any rank >= 2).
    2 bottoms: masked softmax of scores (B, H, Lf, Lt) with mask (B, 1, Lf, Lt) (or (B, 1, 1, Lt)):
    y = softmax(x*factor - (1-mask)*10000) (max subtracted, +1e-6 in the denominator);
    dX = factor * y * (dY - sum dY*y). The mask receives no gradient."""

    type_name = "Softmax"

    def infer(self):
        self.expect_counts((1, 2))
        names, shapes = self.cfg.bottom_names, self.in_shapes
        x = shapes[0]
        self.masked = len(shapes) == 2
        if not self.masked:
            if len(x) < 2:
                self.fail(f"input {names[0]!r} must have rank >= 2, got shape {x}")
            return [x]
        m = shapes[1]
        if len(x) != 4:
            self.fail(f"masked softmax needs scores {names[0]!r} of shape (B, H, Lf, Lt), got {x}")
        b, _, lf, lt = x
        if m not in ((b, 1, lf, lt), (b, 1, 1, lt)):
            self.fail(
                f"mask {names[1]!r} {m} does not fit scores {names[0]!r} {x}: "
                f"need ({b}, 1, {lf}, {lt}) or ({b}, 1, 1, {lt})"
            )
        f = self.cfg.factor
        if not isinstance(f, numbers.Real) or isinstance(f, bool) or not math.isfinite(f):
            self.fail(f"factor must be a finite number, got {f!r}")
        self.factor = float(f)
        return [x]

    def forward(self, tape, xs, run):
        name = self.cfg.top_names[0]
        if self.masked:
            return [MaskedSoftmaxFn.apply(tape, xs[0], xs[1], factor=self.factor, name=name)]
        # read at run time so that hugectr_exact.set_hugectr_exact() applies to a built model
        return [SoftmaxFn.apply(tape, xs[0], subtract_max=not hugectr_exact.hugectr_exact(), name=name)]

    def json_params(self):
        return {"factor": self.cfg.factor}


class MatrixMultiply(Layer):
    """(m, n) x (n, k) -> (m, k); (B, m, n) x (B, n, k) -> (B, m, k); 4-D batched over the first two
    dims; (m, n) x (n, g, h) -> (m, g, h) (rhs viewed as (n, g*h)). dA = dY Bᵀ, dB = Aᵀ dY."""

    type_name = "MatrixMultiply"

    def infer(self):
        self.expect_counts(2)
        (na, nb), (a, b) = self.cfg.bottom_names, self.in_shapes
        ranks = (len(a), len(b))
        if ranks not in ((2, 2), (3, 3), (4, 4), (2, 3)):
            self.fail(f"unsupported ranks: {na!r} {a} x {nb!r} {b}; need 2-D x 2-D, 3-D x 3-D, 4-D x 4-D or 2-D x 3-D")
        inner = b[0] if ranks == (2, 3) else b[-2]
        if a[-1] != inner:
            self.fail(
                f"{na!r} {a} x {nb!r} {b}: the last dim of the first ({a[-1]}) must equal "
                f"the contracted dim of the second ({inner})"
            )
        if ranks == (2, 3):
            return [(a[0], b[1], b[2])]
        if a[:-2] != b[:-2]:
            self.fail(f"{na!r} {a} and {nb!r} {b} must share their batch dims {a[:-2]}")
        return [a[:-1] + b[-1:]]

    def forward(self, tape, xs, run):
        return [MatMulFn.apply(tape, xs[0], xs[1], name=self.cfg.top_names[0])]


class MultiHeadAttention(Layer):
    """Four modes (no weights; H = num_attention_heads, d = size per head):
    (i)   Q, K, V (B, L, H*d) -> 2 tops: scores Qh Khᵀ/sqrt(d) (B, H, L, L) and V split into heads
          (B, H, L, d) (HugeCTR v23.08);
    (ii)  transpose_b=True:  Q (B, H, Lf, d), K (B, H, Lt, d) -> Q Kᵀ/sqrt(d) (B, H, Lf, Lt);
    (iii) transpose_b=False: scores (B, H, Lf, Lt), V (B, H, Lt, d) -> merged heads (B, Lf, H*d);
    (iv)  HugeCTR v23.12's whole attention, 4 bottoms [Q (B, Lf, H*d), K (B, Lt, H*d), V (B, Lt, H*d),
          mask (B, 1, Lf, Lt)] -> 1 top (B, Lf, H*d):
              P = softmax(Qh Khᵀ/sqrt(d) - (1 - mask)*10000)    per head, over Lt (+1e-6 in the sum)
              Y = merge_heads(P Vh)
          mask 1 keeps a key, 0 drops it (HugeCTR's MaskedSoftmaxLayer, factor 1: SequenceMask's output
          fits); it gets no gradient, and transpose_b is not read (HugeCTR ignores it too). numbactr also
          takes a (B, 1, 1, Lt) mask, broadcast over the query rows. The backward is the chain of the
          pieces' hand-written backwards: merge -> dP, dVh = dO Vhᵀ, Pᵀ dO -> masked-softmax backward ->
          dQh, dKh = dS Kh/sqrt(d), dSᵀ Qh/sqrt(d) -> split back to (B, L, H*d).
          With 3 bottoms [Q, K, V] and 1 top, v23.12 computes the same without a mask:
          P = softmax(Qh Khᵀ/sqrt(d)) (HugeCTR's plain SoftmaxLayer; Softmax's row max and
          hugectr_exact apply)."""

    type_name = "MultiHeadAttention"

    def _set_heads(self, hidden: int, who: str) -> None:
        heads = self.cfg.num_attention_heads
        if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0:
            self.fail(f"num_attention_heads must be a positive int, got {heads!r}")
        if hidden % heads:
            self.fail(f"hidden width {hidden} of {who} is not divisible by num_attention_heads={heads}")
        self.heads, self.d = heads, hidden // heads

    def infer(self):
        names, shapes = self.cfg.bottom_names, self.in_shapes
        tb = self.cfg.transpose_b
        if len(shapes) == 4 or (len(shapes) == 3 and len(self.cfg.top_names) == 1):
            return self._infer_attention()
        if len(shapes) == 3:
            self.mode = "qkv"
            if len(self.cfg.top_names) != 2:
                self.fail(
                    f"3 bottoms give 1 top (v23.12's attention) or 2 (v23.08's scores and value heads), "
                    f"got {len(self.cfg.top_names)}"
                )
            q = shapes[0]
            if any(len(s) != 3 for s in shapes) or any(s != q for s in shapes):
                self.fail(
                    "Q, K, V must all be 3-D (B, L, H*d) of one shape; got "
                    + ", ".join(f"{n!r} {s}" for n, s in zip(names, shapes))
                )
            b, l, hd = q
            self._set_heads(hd, f"{names[0]!r} {q}")
            return [(b, self.heads, l, l), (b, self.heads, l, self.d)]
        self.expect_counts((2, 3, 4), 1)  # 3 and 4 bottoms were handled above: here there are 2
        a, v = shapes
        if len(a) != 4 or len(v) != 4 or a[:2] != v[:2]:
            self.fail(f"2 bottoms must be 4-D (B, H, ., .) sharing B and H; got {names[0]!r} {a} and {names[1]!r} {v}")
        if tb:
            self.mode = "qk"
            if a[3] != v[3]:
                self.fail(
                    f"transpose_b=True needs Q (B, H, Lf, d) and K (B, H, Lt, d) with one d; "
                    f"got {names[0]!r} {a} and {names[1]!r} {v}"
                )
            self.heads, self.d = a[1], a[3]
            return [(a[0], a[1], a[2], v[2])]
        self.mode = "sv"
        if a[3] != v[2]:
            self.fail(
                f"transpose_b=False needs scores (B, H, Lf, Lt) and V (B, H, Lt, d); got "
                f"{names[0]!r} {a} and {names[1]!r} {v}"
            )
        self.heads, self.d = a[1], v[3]
        return [(a[0], a[2], a[1] * v[3])]

    def _infer_attention(self):
        names, shapes = self.cfg.bottom_names, self.in_shapes
        self.mode = "attention"
        self.expect_counts((3, 4), 1)
        self.masked = len(shapes) == 4
        q, k, v = shapes[:3]
        listed = ", ".join(f"{n!r} {s}" for n, s in zip(names[:3], shapes[:3]))
        if any(len(s) != 3 for s in (q, k, v)):
            self.fail(
                f"the bottoms are Q (B, Lf, H*d), K and V (B, Lt, H*d) (and a mask); Q, K, V must be 3-D, got {listed}"
            )
        if not q[0] == k[0] == v[0] or not q[2] == k[2] == v[2] or k[1] != v[1]:
            self.fail(f"Q (B, Lf, H*d), K and V (B, Lt, H*d) must share B and H*d, and K and V Lt; got {listed}")
        b, lf, hd = q
        lt = k[1]
        self._set_heads(hd, f"{names[0]!r} {q}")
        m = shapes[3] if self.masked else None
        if self.masked and m not in ((b, 1, lf, lt), (b, 1, 1, lt)):
            self.fail(
                f"mask {names[3]!r} {m} does not fit Q {q} and K {k}: need ({b}, 1, {lf}, {lt}) or ({b}, 1, 1, {lt})"
            )
        return [(b, lf, hd)]

    def forward(self, tape, xs, run):
        tops = self.cfg.top_names
        scale = 1.0 / math.sqrt(self.d)
        if self.mode == "qkv":
            names = (f"{tops[0]}:q_heads", f"{tops[0]}:k_heads", tops[1])
            q, k, v = (SplitHeadsFn.apply(tape, x, heads=self.heads, name=n) for x, n in zip(xs, names))
            return [ScaledQKFn.apply(tape, q, k, scale=scale, name=tops[0]), v]  # v: (B, H, L, d)
        if self.mode == "attention":
            q, k, v = (
                SplitHeadsFn.apply(tape, x, heads=self.heads, name=f"{tops[0]}:{n}_heads")
                for x, n in zip(xs[:3], "qkv")
            )  # (B, H, L, d)
            s = ScaledQKFn.apply(tape, q, k, scale=scale, name=f"{tops[0]}:scores")  # (B, H, Lf, Lt)
            if self.masked:
                p = MaskedSoftmaxFn.apply(tape, s, xs[3], factor=1.0, name=f"{tops[0]}:softmax")
            else:
                p = SoftmaxFn.apply(tape, s, subtract_max=not hugectr_exact.hugectr_exact(), name=f"{tops[0]}:softmax")
            o = MatMulFn.apply(tape, p, v, name=f"{tops[0]}:heads")  # (B, H, Lf, d)
            return [MergeHeadsFn.apply(tape, o, name=tops[0])]
        if self.mode == "qk":
            return [ScaledQKFn.apply(tape, xs[0], xs[1], scale=scale, name=tops[0])]
        o = MatMulFn.apply(tape, xs[0], xs[1], name=f"{tops[0]}:heads")  # (B, H, Lf, d)
        return [MergeHeadsFn.apply(tape, o, name=tops[0])]

    def json_params(self):
        return {"num_attention_heads": self.cfg.num_attention_heads, "transpose_b": bool(self.cfg.transpose_b)}


LAYERS = {
    Layer_t.Softmax: Softmax,
    Layer_t.MatrixMultiply: MatrixMultiply,
    Layer_t.MultiHeadAttention: MultiHeadAttention,
}
