"""Attention layers: Softmax (plain and masked), MatrixMultiply, MultiHeadAttention. No weights.

Products go to the array library (xp.matmul: cuBLAS via cupy on gpu, BLAS on cpu/sim); softmax rows
and the head split/merge run as numba.cuda kernels on gpu/sim and as NumPy references on cpu.

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

import numpy as np

from numbactr import hugectr_exact as compat
from numbactr.autograd import Context, Function
from numbactr.enums import Layer_t
from numbactr.kernels import attention as att
from numbactr.kernels import softmax as sm
from numbactr.layers.base import Layer
from numbactr.autograd.tape import native_dtype as _out, native_inputs as _half
from numbactr.runtime.device import contig as _contig, empty as _empty, uses_kernels as _kernels, xp as _xp
from numbactr.ops import _half_mm


# ---- autograd Functions ----------------------------------------------------------------------
class SoftmaxFn(Function):
    """Softmax over the last dim; ``subtract_max`` False is HugeCTR's overflow-prone form."""

    half_native = True                 # gpu/sim: float16 in and out, float32 exp and sums

    @staticmethod
    def forward(ctx: Context, x, subtract_max: bool = True):
        (x,) = _half(ctx, x)
        if _kernels():
            y = _empty(x.shape, _out(ctx))
            sm.softmax_forward(_contig(x), y, subtract_max)
        else:
            y = sm.softmax_forward_ref(x, subtract_max)
        ctx.y = y
        return y

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        if _kernels():
            dx = _empty(dy.shape, _out(ctx))
            sm.softmax_backward(ctx.y, _contig(dy), dx)
            return dx
        return sm.softmax_backward_ref(ctx.y, dy)


class MaskedSoftmaxFn(Function):
    """x (B, H, Lf, Lt), mask (B, 1, Lf|1, Lt): softmax(x*factor - (1-mask)*10000); mask gets no grad."""

    half_native = True                 # gpu/sim: float16 x and y, the logits and sums in float32

    @staticmethod
    def forward(ctx: Context, x, mask, factor: float = 1.0):
        (x,) = _half(ctx, x)
        if _kernels():
            y = _empty(x.shape, _out(ctx))
            sm.masked_softmax_forward(_contig(x), _contig(mask), y, factor)
        else:
            y = sm.masked_softmax_forward_ref(x, mask, factor)
        ctx.y, ctx.factor = y, factor
        return y

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        if _kernels():
            dx = _empty(dy.shape, _out(ctx))
            sm.softmax_backward(ctx.y, _contig(dy), dx, ctx.factor)
            return dx, None
        return sm.softmax_backward_ref(ctx.y, dy, ctx.factor), None


def _mm(ctx, a, b, scale: float = 1.0):
    """a @ b (batched over leading dims), times ``scale``: under the float16 kernels a float16 GEMM with
    float32 accumulation (ops._half_mm; on the simulator the scale is applied before its one rounding, on a
    GPU to the GEMM's float16 result), else the array library's product in the operands' dtype."""
    if not ctx.native_half:
        y = a @ b
        return y * y.dtype.type(scale) if scale != 1.0 else y
    if scale != 1.0 and _xp().__name__ == "numpy":
        return ((a.astype(np.float32) @ b.astype(np.float32)) * np.float32(scale)).astype(np.float16)
    y = _half_mm(a, b)
    return y * np.float16(scale) if scale != 1.0 else y


class MatMulFn(Function):
    """Y = A @ B for same-rank operands (batched over leading dims), or (m, n) x (n, g, h) -> (m, g, h)."""

    half_native = True                 # gpu/sim: float16 GEMMs with float32 accumulation

    @staticmethod
    def forward(ctx: Context, a, b):
        a, b = _half(ctx, a, b)
        ctx.b_shape = b.shape
        flat_rhs = a.ndim == 2 and b.ndim == 3
        if flat_rhs:
            b = b.reshape(b.shape[0], -1)                        # (n, g*h)
        ctx.a, ctx.b = a, b
        y = _mm(ctx, a, b)
        return y.reshape((a.shape[0],) + ctx.b_shape[1:]) if flat_rhs else y

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        dy = dy.reshape(ctx.a.shape[:-1] + ctx.b.shape[-1:])
        da, db = _mm(ctx, dy, ctx.b.swapaxes(-1, -2)), _mm(ctx, ctx.a.swapaxes(-1, -2), dy)
        return da, db.reshape(ctx.b_shape)


class SplitHeadsFn(Function):
    """(B, L, H*d) -> (B, H, L, d)."""

    half_native = True                 # gpu/sim: a copy, float16 as float16

    @staticmethod
    def forward(ctx: Context, x, heads: int = 1):
        if _kernels():
            b, l, hd = x.shape
            y = _empty((b, heads, l, hd // heads), x.dtype)
            att.split_heads(_contig(x), y)
            return y
        return att.split_heads_ref(x, heads)

    @staticmethod
    def backward(ctx: Context, dy):
        return _merge(dy)


class MergeHeadsFn(Function):
    """(B, H, L, d) -> (B, L, H*d)."""

    half_native = True                 # gpu/sim: a copy, float16 as float16

    @staticmethod
    def forward(ctx: Context, x):
        ctx.heads = x.shape[1]
        return _merge(x)

    @staticmethod
    def backward(ctx: Context, dy):
        if _kernels():
            b, l, hd = dy.shape
            dx = _empty((b, ctx.heads, l, hd // ctx.heads), dy.dtype)
            att.split_heads(_contig(dy), dx)
            return dx
        return att.split_heads_ref(dy, ctx.heads)


def _merge(x):
    if _kernels():
        b, h, l, d = x.shape
        y = _empty((b, l, h * d), x.dtype)
        att.merge_heads(_contig(x), y)
        return y
    return att.merge_heads_ref(x)


class ScaledQKFn(Function):
    """Q (.., Lf, d), K (.., Lt, d) -> (Q @ Kᵀ) * scale (.., Lf, Lt); the scale is the GEMM's alpha."""

    half_native = True                 # gpu/sim: float16 GEMMs with float32 accumulation

    @staticmethod
    def forward(ctx: Context, q, k, scale: float = 1.0):
        q, k = _half(ctx, q, k)
        ctx.q, ctx.k, ctx.scale = q, k, scale
        if ctx.native_half:
            return _mm(ctx, q, k.swapaxes(-1, -2), scale)
        return att.scaled_qk_forward_ref(q, k, scale)

    @staticmethod
    def backward(ctx: Context, ds):
        if ctx.native_half:
            (ds,) = _half(ctx, ds)
            return _mm(ctx, ds, ctx.k, ctx.scale), _mm(ctx, ds.swapaxes(-1, -2), ctx.q, ctx.scale)
        return att.scaled_qk_backward_ref(ctx.q, ctx.k, ds, ctx.scale)


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
            self.fail(f"mask {names[1]!r} {m} does not fit scores {names[0]!r} {x}: "
                      f"need ({b}, 1, {lf}, {lt}) or ({b}, 1, 1, {lt})")
        f = self.cfg.factor
        if not isinstance(f, numbers.Real) or isinstance(f, bool) or not math.isfinite(f):
            self.fail(f"factor must be a finite number, got {f!r}")
        self.factor = float(f)
        return [x]

    def forward(self, tape, xs, run):
        name = self.cfg.top_names[0]
        if self.masked:
            return [MaskedSoftmaxFn.apply(tape, xs[0], xs[1], factor=self.factor, name=name)]
        # read at run time so that compat.set_hugectr_exact() applies to a built model
        return [SoftmaxFn.apply(tape, xs[0], subtract_max=not compat.hugectr_exact(), name=name)]

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
            self.fail(f"unsupported ranks: {na!r} {a} x {nb!r} {b}; need 2-D x 2-D, 3-D x 3-D, "
                      f"4-D x 4-D or 2-D x 3-D")
        inner = b[0] if ranks == (2, 3) else b[-2]
        if a[-1] != inner:
            self.fail(f"{na!r} {a} x {nb!r} {b}: the last dim of the first ({a[-1]}) must equal "
                      f"the contracted dim of the second ({inner})")
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
                self.fail(f"3 bottoms give 1 top (v23.12's attention) or 2 (v23.08's scores and value heads), "
                          f"got {len(self.cfg.top_names)}")
            q = shapes[0]
            if any(len(s) != 3 for s in shapes) or any(s != q for s in shapes):
                self.fail("Q, K, V must all be 3-D (B, L, H*d) of one shape; got " +
                          ", ".join(f"{n!r} {s}" for n, s in zip(names, shapes)))
            b, l, hd = q
            self._set_heads(hd, f"{names[0]!r} {q}")
            return [(b, self.heads, l, l), (b, self.heads, l, self.d)]
        self.expect_counts((2, 3, 4), 1)      # 3 and 4 bottoms were handled above: here there are 2
        a, v = shapes
        if len(a) != 4 or len(v) != 4 or a[:2] != v[:2]:
            self.fail(f"2 bottoms must be 4-D (B, H, ., .) sharing B and H; got {names[0]!r} {a} "
                      f"and {names[1]!r} {v}")
        if tb:
            self.mode = "qk"
            if a[3] != v[3]:
                self.fail(f"transpose_b=True needs Q (B, H, Lf, d) and K (B, H, Lt, d) with one d; "
                          f"got {names[0]!r} {a} and {names[1]!r} {v}")
            self.heads, self.d = a[1], a[3]
            return [(a[0], a[1], a[2], v[2])]
        self.mode = "sv"
        if a[3] != v[2]:
            self.fail(f"transpose_b=False needs scores (B, H, Lf, Lt) and V (B, H, Lt, d); got "
                      f"{names[0]!r} {a} and {names[1]!r} {v}")
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
            self.fail(f"the bottoms are Q (B, Lf, H*d), K and V (B, Lt, H*d) (and a mask); Q, K, V must be 3-D, "
                      f"got {listed}")
        if not q[0] == k[0] == v[0] or not q[2] == k[2] == v[2] or k[1] != v[1]:
            self.fail(f"Q (B, Lf, H*d), K and V (B, Lt, H*d) must share B and H*d, and K and V Lt; got {listed}")
        b, lf, hd = q
        lt = k[1]
        self._set_heads(hd, f"{names[0]!r} {q}")
        m = shapes[3] if self.masked else None
        if self.masked and m not in ((b, 1, lf, lt), (b, 1, 1, lt)):
            self.fail(f"mask {names[3]!r} {m} does not fit Q {q} and K {k}: need ({b}, 1, {lf}, {lt}) "
                      f"or ({b}, 1, 1, {lt})")
        return [(b, lf, hd)]

    def forward(self, tape, xs, run):
        tops = self.cfg.top_names
        scale = 1.0 / math.sqrt(self.d)
        if self.mode == "qkv":
            names = (f"{tops[0]}:q_heads", f"{tops[0]}:k_heads", tops[1])
            q, k, v = (SplitHeadsFn.apply(tape, x, heads=self.heads, name=n) for x, n in zip(xs, names))
            return [ScaledQKFn.apply(tape, q, k, scale=scale, name=tops[0]), v]      # v: (B, H, L, d)
        if self.mode == "attention":
            q, k, v = (SplitHeadsFn.apply(tape, x, heads=self.heads, name=f"{tops[0]}:{n}_heads")
                       for x, n in zip(xs[:3], "qkv"))                          # (B, H, L, d)
            s = ScaledQKFn.apply(tape, q, k, scale=scale, name=f"{tops[0]}:scores")   # (B, H, Lf, Lt)
            if self.masked:
                p = MaskedSoftmaxFn.apply(tape, s, xs[3], factor=1.0, name=f"{tops[0]}:softmax")
            else:
                p = SoftmaxFn.apply(tape, s, subtract_max=not compat.hugectr_exact(), name=f"{tops[0]}:softmax")
            o = MatMulFn.apply(tape, p, v, name=f"{tops[0]}:heads")                  # (B, H, Lf, d)
            return [MergeHeadsFn.apply(tape, o, name=tops[0])]
        if self.mode == "qk":
            return [ScaledQKFn.apply(tape, xs[0], xs[1], scale=scale, name=tops[0])]
        o = MatMulFn.apply(tape, xs[0], xs[1], name=f"{tops[0]}:heads")          # (B, H, Lf, d)
        return [MergeHeadsFn.apply(tape, o, name=tops[0])]

    def json_params(self):
        return {"num_attention_heads": self.cfg.num_attention_heads, "transpose_b": bool(self.cfg.transpose_b)}


LAYERS = {
    Layer_t.Softmax: Softmax,
    Layer_t.MatrixMultiply: MatrixMultiply,
    Layer_t.MultiHeadAttention: MultiHeadAttention,
}
