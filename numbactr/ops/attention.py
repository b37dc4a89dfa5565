"""Attention ops: Softmax (plain and masked), MatMul, the head split/merge and the scaled Q Kᵀ. No weights.

Contract: autograd Functions on raw arrays. Products go to the array library (xp.matmul: cuBLAS via cupy
on gpu, BLAS on cpu/sim; float16 GEMMs with float32 accumulation under mixed precision);
numbactr.ops.dispatch.pick sends softmax rows and the head split/merge to the numba.cuda kernels of
numbactr.kernels.{softmax, attention} on gpu/sim; on cpu softmax rows run their compiled CPU versions, the
heads are split by views and the products avoid numpy's slow transposed batched GEMMs
(kernels.attention's CPU versions), and NUMBACTR_CPU_REFERENCE=1 runs the NumPy references.

Formulas: softmax y = e^(x - max) / Σ e^(x - max) over the last dim (HugeCTR's e^x / Σ e^x when
``subtract_max`` is False), dX = y (dY - Σ dY·y); masked y = softmax(x·factor - (1 - mask)·10000),
dX = factor·y (dY - Σ dY·y); split (B, L, H·d) -> (B, H, L, d), merge its inverse;
ScaledQK S = (Q Kᵀ)·scale.

Why the scale is the GEMM's alpha (not a separate pass): one rounding of the float16 product, as
HugeCTR's cuBLAS call has.
"""

from __future__ import annotations

import numpy as np

from numbactr.autograd import Context, Function
from numbactr.autograd.tape import native_dtype as _out
from numbactr.autograd.tape import native_inputs as _half
from numbactr.kernels import attention
from numbactr.kernels import softmax
from numbactr.ops.dense import _half_mm
from numbactr.ops.dispatch import pick
from numbactr.runtime.device import contig as _contig
from numbactr.runtime.device import empty as _empty
from numbactr.runtime.device import xp as _xp


# ---- Softmax ------------------------------------------------------------------------------------
def _softmax_forward_kernel(ctx, x, subtract_max):
    y = _empty(x.shape, _out(ctx))
    softmax.softmax_forward(_contig(x), y, subtract_max)
    return y


# the compiled CPU versions take float32 (training's dtype); float64 (gradient checks) runs the reference
def _softmax_forward_cpu(ctx, x, subtract_max):
    if x.dtype != np.float32:
        return _softmax_forward_ref(ctx, x, subtract_max)
    y = np.empty(x.shape, np.float32)
    softmax.softmax_forward_cpu(_contig(x), y, subtract_max)
    return y


def _softmax_forward_ref(ctx, x, subtract_max):
    return softmax.softmax_forward_ref(x, subtract_max)


def _softmax_backward_kernel(ctx, dy, factor=1.0):
    dx = _empty(dy.shape, _out(ctx))
    softmax.softmax_backward(ctx.y, _contig(dy), dx, factor)
    return dx


def _softmax_backward_cpu(ctx, dy, factor=1.0):
    if dy.dtype != np.float32 or ctx.y.dtype != np.float32:
        return _softmax_backward_ref(ctx, dy, factor)
    dx = np.empty(dy.shape, np.float32)
    softmax.softmax_backward_cpu(ctx.y, _contig(dy), dx, factor)
    return dx


def _softmax_backward_ref(ctx, dy, factor=1.0):
    return softmax.softmax_backward_ref(ctx.y, dy, factor)


class SoftmaxFn(Function):
    """Softmax over the last dim; ``subtract_max`` False is HugeCTR's overflow-prone form."""

    half_native = True  # gpu/sim: float16 in and out, float32 exp and sums

    @staticmethod
    def forward(ctx: Context, x, subtract_max: bool = True):
        (x,) = _half(ctx, x)
        ctx.y = pick(kernel=_softmax_forward_kernel, cpu=_softmax_forward_cpu, ref=_softmax_forward_ref)(
            ctx, x, subtract_max
        )
        return ctx.y

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        return pick(kernel=_softmax_backward_kernel, cpu=_softmax_backward_cpu, ref=_softmax_backward_ref)(ctx, dy)


def _masked_forward_kernel(ctx, x, mask, factor):
    y = _empty(x.shape, _out(ctx))
    softmax.masked_softmax_forward(_contig(x), _contig(mask), y, factor)
    return y


def _masked_forward_cpu(ctx, x, mask, factor):
    if x.dtype != np.float32 or mask.dtype != np.float32:
        return _masked_forward_ref(ctx, x, mask, factor)
    y = np.empty(x.shape, np.float32)
    softmax.masked_softmax_forward_cpu(_contig(x), _contig(mask), y, factor)
    return y


def _masked_forward_ref(ctx, x, mask, factor):
    return softmax.masked_softmax_forward_ref(x, mask, factor)


class MaskedSoftmaxFn(Function):
    """x (B, H, Lf, Lt), mask (B, 1, Lf|1, Lt): softmax(x*factor - (1-mask)*10000); mask gets no grad."""

    half_native = True  # gpu/sim: float16 x and y, the logits and sums in float32

    @staticmethod
    def forward(ctx: Context, x, mask, factor: float = 1.0):
        (x,) = _half(ctx, x)
        y = pick(kernel=_masked_forward_kernel, cpu=_masked_forward_cpu, ref=_masked_forward_ref)(ctx, x, mask, factor)
        ctx.y, ctx.factor = y, factor
        return y

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        return pick(kernel=_softmax_backward_kernel, cpu=_softmax_backward_cpu, ref=_softmax_backward_ref)(
            ctx, dy, ctx.factor
        ), None


# ---- MatMul -------------------------------------------------------------------------------------
def _mm_plain(a, b, scale: float = 1.0, like=None):
    y = a @ b
    return y * y.dtype.type(scale) if scale != 1.0 else y


def _mm(ctx, a, b, scale: float = 1.0, like=None):
    """a @ b (batched over leading dims), times ``scale``: under the float16 kernels a float16 GEMM with
    float32 accumulation (ops.dense._half_mm; on the simulator the scale is applied before its one rounding,
    on a GPU to the GEMM's float16 result), else the array library's product in the operands' dtype (on
    cpu kernels.attention.matmul_cpu: row-major operands, the product in ``like``'s layout)."""
    if not ctx.native_half:
        return pick(kernel=_mm_plain, cpu=attention.matmul_cpu, ref=_mm_plain)(a, b, scale, like)
    if scale != 1.0 and _xp().__name__ == "numpy":
        return ((a.astype(np.float32) @ b.astype(np.float32)) * np.float32(scale)).astype(np.float16)
    y = _half_mm(a, b)
    return y * np.float16(scale) if scale != 1.0 else y


class MatMulFn(Function):
    """Y = A @ B for same-rank operands (batched over leading dims), or (m, n) x (n, g, h) -> (m, g, h)."""

    half_native = True  # gpu/sim: float16 GEMMs with float32 accumulation

    @staticmethod
    def forward(ctx: Context, a, b):
        a, b = _half(ctx, a, b)
        ctx.b_shape = b.shape
        flat_rhs = a.ndim == 2 and b.ndim == 3
        if flat_rhs:
            b = b.reshape(b.shape[0], -1)  # (n, g*h)
        ctx.a, ctx.b = a, b
        # on cpu the product takes b's layout when it has b's shape: attention's P V, V a head-split view
        # (Lf = Lt), comes out head-split, and the merge after it is a view (kernels.attention.matmul_cpu)
        y = _mm(ctx, a, b, like=b)
        return y.reshape((a.shape[0],) + ctx.b_shape[1:]) if flat_rhs else y

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        dy = dy.reshape(ctx.a.shape[:-1] + ctx.b.shape[-1:])
        da = _mm(ctx, dy, ctx.b.swapaxes(-1, -2), like=ctx.a)
        db = _mm(ctx, ctx.a.swapaxes(-1, -2), dy, like=ctx.b)
        return da, db.reshape(ctx.b_shape)


# ---- heads: (B, L, H*d) <-> (B, H, L, d) -----------------------------------------------------------
def _split_kernel(x, heads):
    b, l, hd = x.shape
    y = _empty((b, heads, l, hd // heads), x.dtype)
    attention.split_heads(_contig(x), y)
    return y


def _merge_kernel(x):
    b, h, l, d = x.shape
    y = _empty((b, l, h * d), x.dtype)
    attention.merge_heads(_contig(x), y)
    return y


def _split(x, heads):
    return pick(kernel=_split_kernel, cpu=attention.split_heads_cpu, ref=attention.split_heads_ref)(x, heads)


def _merge(x):
    return pick(kernel=_merge_kernel, cpu=attention.merge_heads_cpu, ref=attention.merge_heads_ref)(x)


class SplitHeadsFn(Function):
    """(B, L, H*d) -> (B, H, L, d)."""

    half_native = True  # gpu/sim: a copy, float16 as float16

    @staticmethod
    def forward(ctx: Context, x, heads: int = 1):
        return _split(x, heads)

    @staticmethod
    def backward(ctx: Context, dy):
        return _merge(dy)


class MergeHeadsFn(Function):
    """(B, H, L, d) -> (B, L, H*d)."""

    half_native = True  # gpu/sim: a copy, float16 as float16

    @staticmethod
    def forward(ctx: Context, x):
        ctx.heads = x.shape[1]
        return _merge(x)

    @staticmethod
    def backward(ctx: Context, dy):
        return _split(dy, ctx.heads)


class ScaledQKFn(Function):
    """Q (.., Lf, d), K (.., Lt, d) -> (Q @ Kᵀ) * scale (.., Lf, Lt); the scale is the GEMM's alpha."""

    half_native = True  # gpu/sim: float16 GEMMs with float32 accumulation

    @staticmethod
    def forward(ctx: Context, q, k, scale: float = 1.0):
        q, k = _half(ctx, q, k)
        ctx.q, ctx.k, ctx.scale = q, k, scale
        if ctx.native_half:
            return _mm(ctx, q, k.swapaxes(-1, -2), scale)
        ref = attention.scaled_qk_forward_ref
        return pick(kernel=ref, cpu=attention.scaled_qk_forward_cpu, ref=ref)(q, k, scale)

    @staticmethod
    def backward(ctx: Context, ds):
        if ctx.native_half:
            (ds,) = _half(ctx, ds)
            return _mm(ctx, ds, ctx.k, ctx.scale), _mm(ctx, ds.swapaxes(-1, -2), ctx.q, ctx.scale)
        ref = attention.scaled_qk_backward_ref
        return pick(kernel=ref, cpu=attention.scaled_qk_backward_cpu, ref=ref)(ctx.q, ctx.k, ds, ctx.scale)
