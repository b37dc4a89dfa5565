"""Fully connected ops: Linear (InnerProduct), FcBiasAct (MLP, FusedInnerProduct), MultiCrossV1/V2 (DCN).

Contract: autograd Functions on raw arrays (numbactr.autograd.Function); each device reaches its
implementation through numbactr.ops.dispatch.pick: the numba.cuda kernels of numbactr.kernels.{bias,
fused_bias_act, multi_cross} on gpu/sim, their compiled CPU versions (where they exist) or NumPy references
on cpu. The matrix products use the array library (cuBLAS via cupy on gpu, BLAS on cpu/sim, on contiguous
operands or their transposed views: no copies).

Formulas: Linear y = x W + b (on the last dim); FcBiasAct y = act(x W + b), act ReLU or none;
DCNv1 x_{l+1} = x0 * (x_l · w_l) + x_l + b_l; DCNv2 x_{l+1} = x0 * (x_l U_l V_l + b_l) + x_l.

Why the bias add (and ReLU) after a GEMM is its own kernel: it is the one pass over the activations the
GEMM library does not do; FcBiasAct fuses bias and activation into one pass each way.
"""

from __future__ import annotations

import os

import numpy as np

from numbactr.autograd import Context, Function
from numbactr.kernels import bias, fused_bias_act, multi_cross
from numbactr.ops.buffers import grad_of, into, mm, out_of
from numbactr.ops.dispatch import kernels, pick
from numbactr.runtime.device import contig as _contig
from numbactr.runtime.device import xp as _xp


def _half_mm(a, b):
    """a @ b of float16 matrices with float32 accumulation and a float16 result (mixed precision on gpu and
    sim): cuBLAS's tensor-core GEMM through CuPy on a GPU (CuPy's default compute type for float16 inputs
    is float32); on the simulator NumPy in float32, rounded to float16 once (NumPy's own float16 product
    would round every partial sum)."""
    if _xp().__name__ != "cupy":  # (numpy, and the simulator's strict arrays: numbactr.runtime.sim_strict)
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    return a @ b


def fuse_bias_relu() -> bool:
    """Fuse an InnerProduct's bias add with the ReLU layer after it (one kernel each way) on the kernel devices
    (gpu, sim), where every pass over the activations costs a launch and a read and write of memory; the cpu
    device keeps the two layers (its results are the test oracle). NUMBACTR_FUSE_BIAS_RELU=0 turns it off."""
    flag = os.environ.get("NUMBACTR_FUSE_BIAS_RELU", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"NUMBACTR_FUSE_BIAS_RELU must be 0 or 1, got {flag!r}")
    return flag == "1" and kernels()


def _weight_grad(ctx: Context, a, b, index: int):
    """a @ b, the gradient of input ``index``: written straight into ``ctx.grad_into[index]`` when the planned
    step handed one (a weight's view of the flat gradient buffer, numbactr.train.plan: no copy after; or an
    activation gradient's buffer, numbactr.train.plan_buffers). Returns an array of that buffer's shape."""
    out = grad_of(ctx, index)
    if out is None:
        return mm(a, b)
    mm(a, b, out.reshape(a.shape[0], b.shape[1]))
    return out


def _shaped(a, shape):
    """``a`` itself when it has ``shape`` (a planned step's buffer keeps its identity), else a view."""
    return a if a.shape == shape else a.reshape(shape)


# ---- Linear: y = x W + b ---------------------------------------------------------------------
def _bias_add_kernel(y, b):
    bias.bias_add(y, b)
    return y


def _bias_add_cpu(y, b):
    bias.bias_add_cpu(y, b)
    return y


def _bias_grad_kernel(dy2, db=None):
    db = _xp().empty((dy2.shape[1],), np.float32) if db is None else db
    bias.bias_grad(dy2, db.reshape(-1))
    return db


def _bias_grad_cpu(dy2, db=None):
    db = np.empty((dy2.shape[1],), np.float32) if db is None else db
    bias.bias_grad_cpu(_contig(dy2), db)
    return db


def _bias_grad_ref(dy2, db=None):
    return into(db, bias.bias_grad_ref(dy2))


class Linear(Function):
    # mixed precision on gpu/sim: float16 x and y, the GEMMs in float16 with float32 accumulation on a
    # float16 copy of the float32 master weights (HugeCTR's layers keep one too), the bias added in float32
    half_native = True
    #: writes into the planned step's buffers when given (ctx.out, ctx.grad_into: numbactr.ops.buffers)
    writes_into = True

    @staticmethod
    def forward(ctx: Context, x, w, b):
        x2 = x.reshape(-1, x.shape[-1])  # (B*, K): applied to the last dim
        if ctx.native_half:
            x2, w16 = _contig(x2.astype(np.float16, copy=False)), w.astype(np.float16)
            y = _half_mm(x2, w16)  # (B*, N) float16
            bias.bias_add(y, b)
            ctx.x2, ctx.w, ctx.in_shape = x2, w16, x.shape
            return y.reshape(*x.shape[:-1], w.shape[1])
        out = out_of(ctx)  # the planned step's buffer, shaped as the output, or None
        y2 = None if out is None else out.reshape(-1, w.shape[1])
        y = pick(kernel=_bias_add_kernel, cpu=_bias_add_cpu, ref=bias.bias_add_ref)(mm(x2, w, y2), b)  # (B*, N)
        ctx.x2, ctx.w, ctx.in_shape = x2, w, x.shape
        if out is None:
            return y.reshape(*x.shape[:-1], w.shape[1])
        if y is not y2:  # (the NumPy reference's y + b: a new array)
            y2[...] = y
        return out

    @staticmethod
    def backward(ctx: Context, dy):
        dy2 = dy.reshape(-1, dy.shape[-1])  # (B*, N)
        if ctx.native_half:
            dy2 = _contig(dy2.astype(np.float16, copy=False))
            dw = _half_mm(ctx.x2.T, dy2).astype(np.float32)  # (K, N): float16 GEMM, float32 for the update
            db = _xp().empty((dy2.shape[1],), np.float32)
            bias.bias_grad(dy2, db)
            dx = _half_mm(dy2, ctx.w.T).reshape(ctx.in_shape) if ctx.needs_input_grad[0] else None
            return dx, dw, db
        dw = _weight_grad(ctx, ctx.x2.T, dy2, 1)  # (K, N)
        db = pick(kernel=_bias_grad_kernel, cpu=_bias_grad_cpu, ref=_bias_grad_ref)(dy2, grad_of(ctx, 2))
        dx = _weight_grad(ctx, dy2, ctx.w.T, 0) if ctx.needs_input_grad[0] else None
        return (None if dx is None else _shaped(dx, ctx.in_shape)), dw, db


# ---- FcBiasAct: y = act(x W + b) -------------------------------------------------------------
def _bias_act_forward_kernel(y, bvec, relu):
    fused_bias_act.bias_act_forward(y, bvec, relu)
    return y


def _bias_act_forward_cpu(y, bvec, relu):
    fused_bias_act.bias_act_forward_cpu(y, bvec, relu)
    return y


def _bias_act_backward_launch(launch, y, dy, relu, has_bias, db=None):
    """(d, db) of the kernel or compiled CPU entry point ``launch``: both write into arrays given (``db``: the
    planned step's buffer, any shape of N elements, or None)."""
    if not (relu or has_bias):
        return dy, None
    xp = _xp()
    d = xp.empty_like(dy)
    if has_bias and db is None:
        db = xp.empty((dy.shape[1],), np.float32)
    launch(y, dy, relu, d, db.reshape(-1) if has_bias else None)
    return d, db


def _bias_act_backward_kernel(y, dy, relu, has_bias, db=None):
    return _bias_act_backward_launch(fused_bias_act.bias_act_backward, y, dy, relu, has_bias, db)


def _bias_act_backward_cpu(y, dy, relu, has_bias, db=None):
    return _bias_act_backward_launch(fused_bias_act.bias_act_backward_cpu, y, dy, relu, has_bias, db)


def _bias_act_backward_ref(y, dy, relu, has_bias, db=None):
    d, db_ = fused_bias_act.bias_act_backward_ref(y, dy, relu, has_bias)
    return d, (into(db, db_) if has_bias else None)


class FcBiasAct(Function):
    """y = act(x @ w + b): x (B, K), w (K, N), b (N,) (absent when has_bias is False).

    Mixed precision on gpu/sim (half_native): float16 x, y and gradients, the GEMMs in float16 with
    float32 accumulation on a float16 copy of the float32 master weights, bias and activation in float32
    inside the fused kernels; the weight gradient comes out of a float16 GEMM, as in HugeCTR's fp16 layers."""

    half_native = True
    #: writes into the planned step's buffers when given (ctx.out, ctx.grad_into: numbactr.ops.buffers)
    writes_into = True

    @staticmethod
    def forward(ctx: Context, x, w, *b, relu: bool = True):
        if ctx.native_half:
            x, w = x.astype(np.float16, copy=False), w.astype(np.float16)
        x = _contig(x)
        y = _half_mm(x, w) if ctx.native_half else mm(x, w, out_of(ctx))  # (B, N)
        bvec = b[0].reshape(-1) if b else None
        y = into(
            out_of(ctx),
            pick(kernel=_bias_act_forward_kernel, cpu=_bias_act_forward_cpu, ref=fused_bias_act.bias_act_forward_ref)(
                y, bvec, relu
            ),
        )
        ctx.x, ctx.w, ctx.y, ctx.relu, ctx.has_bias = x, w, y, relu, bool(b)
        ctx.b_shape = b[0].shape if b else None
        return y

    @staticmethod
    def backward(ctx: Context, dy):
        dy = _contig(dy.astype(np.float16, copy=False) if ctx.native_half else dy)
        d, db = pick(kernel=_bias_act_backward_kernel, cpu=_bias_act_backward_cpu, ref=_bias_act_backward_ref)(
            ctx.y, dy, ctx.relu, ctx.has_bias, grad_of(ctx, 2) if ctx.has_bias and not ctx.native_half else None
        )
        if ctx.native_half:
            d = d.astype(np.float16, copy=False)
            dw = _half_mm(ctx.x.T, d).astype(np.float32)  # (K, N), for the float32 update
            dx = _half_mm(d, ctx.w.T) if ctx.needs_input_grad[0] else None
        else:
            dw = _weight_grad(ctx, ctx.x.T, d, 1)  # (K, N)
            dx = _weight_grad(ctx, d, ctx.w.T, 0) if ctx.needs_input_grad[0] else None  # (B, K)
        if ctx.has_bias:
            return dx, dw, _shaped(db, ctx.b_shape)
        return dx, dw


# ---- MultiCross, DCNv1: x_{l+1} = x0 * (x_l · w_l) + x_l + b_l --------------------------------
# The kernels and the compiled CPU versions take the same arguments: one stack loop, given its entry points.
def _v1_forward_with(layer_forward, x0, ws, bs):
    xp = _xp()
    xs, hs = [x0], []
    for w, b in zip(ws, bs):
        out = xp.empty_like(x0)
        h = xp.empty((x0.shape[0],), np.float32)
        layer_forward(x0, xs[-1], w, b, out, h)
        xs.append(out)
        hs.append(h)
    return xs[-1], xs, hs


def _v1_backward_with(layer_backward, add, g, x0, ws, xs, hs):
    xp = _xp()
    n = len(ws)
    dws, dbs = [None] * n, [None] * n
    dx0 = xp.empty_like(x0)
    dh = xp.empty((x0.shape[0],), np.float32)
    for layer in reversed(range(n)):
        dxl = xp.empty_like(x0)
        dws[layer] = xp.empty_like(ws[layer])
        dbs[layer] = xp.empty_like(ws[layer])
        layer_backward(g, x0, xs[layer], ws[layer], hs[layer], layer == n - 1, dx0, dxl, dh, dws[layer], dbs[layer])
        g = dxl
    dx = xp.empty_like(x0)
    add(dx0, g, dx)
    return dx, dws, dbs


def _v1_forward_kernel(x0, ws, bs):
    return _v1_forward_with(multi_cross.v1_forward, x0, ws, bs)


def _v1_forward_cpu(x0, ws, bs):
    return _v1_forward_with(multi_cross.v1_forward_cpu, x0, ws, bs)


def _v1_backward_kernel(g, x0, ws, xs, hs):
    return _v1_backward_with(multi_cross.v1_backward, multi_cross.add, g, x0, ws, xs, hs)


def _v1_backward_cpu(g, x0, ws, xs, hs):
    return _v1_backward_with(multi_cross.v1_backward_cpu, np.add, g, x0, ws, xs, hs)


class MultiCrossV1(Function):
    """DCNv1 stack: x0 (B, D), params [w0, b0, w1, b1, ...] each (1, D) -> x_L (B, D). Mixed precision on
    gpu/sim: float16 x_l and gradients, float32 arithmetic inside the kernels, float32 parameters."""

    half_native = True

    @staticmethod
    def forward(ctx: Context, x0, *params):
        x0 = _contig(x0.astype(np.float16, copy=False) if ctx.native_half else x0)
        ws = [p.reshape(-1) for p in params[0::2]]
        bs = [p.reshape(-1) for p in params[1::2]]
        ctx.x0, ctx.ws, ctx.pshape = x0, ws, params[0].shape
        y, ctx.xs, ctx.hs = pick(
            kernel=_v1_forward_kernel, cpu=_v1_forward_cpu, ref=multi_cross.multi_cross_v1_forward_ref
        )(x0, ws, bs)
        return y

    @staticmethod
    def backward(ctx: Context, dy):
        g = _contig(dy.astype(np.float16, copy=False) if ctx.native_half else dy)
        dx, dws, dbs = pick(
            kernel=_v1_backward_kernel, cpu=_v1_backward_cpu, ref=multi_cross.multi_cross_v1_backward_ref
        )(g, ctx.x0, ctx.ws, ctx.xs, ctx.hs)
        grads = []
        for dw, db in zip(dws, dbs):
            grads += [dw.reshape(ctx.pshape), db.reshape(ctx.pshape)]
        return (dx, *grads)


# ---- MultiCross, DCNv2: x_{l+1} = x0 * (x_l U_l V_l + b_l) + x_l ------------------------------
def _mm_of(half: bool):
    return _half_mm if half else (lambda a, b: a @ b)


def _v2_forward_kernel(x0, us, vs, bs, half):
    """(y, xs, zs, ts): ts[l] = x_l U_l (B, P), kept for the backward's dV (one matmul fewer there)."""
    xp, mm = _xp(), _mm_of(half)
    xs, zs, ts = [x0], [], []
    for u, v, b in zip(us, vs, bs):
        t = mm(xs[-1], u)  # (B, P)
        z = _contig(mm(t, v))  # (B, D)
        out = xp.empty_like(x0)
        multi_cross.v2_forward(x0, xs[-1], z, b, out)
        xs.append(out)
        zs.append(z)
        ts.append(t)
    return xs[-1], xs, zs, ts


def _v2_forward_cpu(x0, us, vs, bs, half):
    """As _v2_forward_kernel, with the compiled CPU pass."""
    xs, zs, ts = [x0], [], []
    for u, v, b in zip(us, vs, bs):
        t = xs[-1] @ u  # (B, P)
        z = t @ v  # (B, D)
        out = np.empty_like(x0)
        multi_cross.v2_forward_cpu(x0, xs[-1], z, b, out)
        xs.append(out)
        zs.append(z)
        ts.append(t)
    return xs[-1], xs, zs, ts


def _v2_forward_ref(x0, us, vs, bs, half):
    return (*multi_cross.multi_cross_v2_forward_ref(x0, us, vs, bs), None)


def _v2_backward_kernel(g, x0, us, vs, bs, xs, zs, ts, half):
    xp, mm = _xp(), _mm_of(half)
    f32 = (lambda a: a.astype(np.float32)) if half else (lambda a: a)
    n = len(us)
    dus, dvs, dbs = [None] * n, [None] * n, [None] * n
    dx0 = xp.empty_like(x0)
    for layer in reversed(range(n)):
        u, v, x = us[layer], vs[layer], xs[layer]
        dz = xp.empty_like(x0)
        multi_cross.v2_backward(g, x0, zs[layer], bs[layer], layer == n - 1, dz, dx0)
        dbs[layer] = xp.empty((x0.shape[1],), np.float32)
        bias.bias_grad(dz, dbs[layer])
        t = ts[layer] if ts is not None else mm(x, u)  # (none saved when the reference ran the forward)
        dvs[layer] = f32(mm(t.T, dz))  # (P, D)
        dt = mm(dz, v.T)  # (B, P)
        dus[layer] = f32(mm(x.T, dt))  # (D, P)
        gl = mm(dt, u.T)  # (B, D): the x_l path's matmul part
        nxt = xp.empty_like(x0)
        multi_cross.add(g, _contig(gl), nxt)  # dx_l = g + dz V^T U^T
        g = nxt
    dx = xp.empty_like(x0)
    multi_cross.add(dx0, g, dx)
    return dx, dus, dvs, dbs


def _v2_backward_cpu(g, x0, us, vs, bs, xs, zs, ts, half):
    n = len(us)
    dus, dvs, dbs = [None] * n, [None] * n, [None] * n
    dx0 = np.empty_like(x0)
    gm = None  # the x_l path's matmul part from the layer above, dz V^T U^T (B, D): its gradient is g + gm
    for layer in reversed(range(n)):
        u, v, x = us[layer], vs[layer], xs[layer]
        dz = np.empty_like(x0)
        dbs[layer] = np.empty((x0.shape[1],), np.float32)
        multi_cross.v2_backward_cpu(g, gm, x0, zs[layer], bs[layer], layer == n - 1, dz, dx0, dbs[layer])
        g = g if gm is None else gm  # (gm now holds g + gm)
        t = ts[layer] if ts is not None else x @ u
        dvs[layer] = t.T @ dz  # (P, D)
        dt = dz @ v.T  # (B, P)
        dus[layer] = x.T @ dt  # (D, P)
        gm = dt @ u.T  # (B, D)
    gm += g  # dx_0 = g + dz V^T U^T, then dx = dx0 + dx_0 (the reference's order)
    dx0 += gm
    return dx0, dus, dvs, dbs


def _v2_backward_ref(g, x0, us, vs, bs, xs, zs, ts, half):
    return multi_cross.multi_cross_v2_backward_ref(g, x0, us, vs, bs, xs, zs)


class MultiCrossV2(Function):
    """DCNv2 stack: x0 (B, D), params [U0 (D, P), V0 (P, D), b0 (1, D), ...] -> x_L (B, D). Mixed precision
    on gpu/sim: float16 x_l, z and gradients, float16 GEMMs (float32 accumulation) on float16 copies of U
    and V, float32 arithmetic inside the kernels, float32 parameter gradients."""

    half_native = True

    @staticmethod
    def forward(ctx: Context, x0, *params):
        half = ctx.native_half
        x0 = _contig(x0.astype(np.float16, copy=False) if half else x0)
        us, vs = list(params[0::3]), list(params[1::3])
        if half:
            us, vs = [u.astype(np.float16) for u in us], [v.astype(np.float16) for v in vs]
        bs = [p.reshape(-1) for p in params[2::3]]
        ctx.x0, ctx.us, ctx.vs, ctx.bs, ctx.bshape = x0, us, vs, bs, params[2].shape
        y, ctx.xs, ctx.zs, ctx.ts = pick(kernel=_v2_forward_kernel, cpu=_v2_forward_cpu, ref=_v2_forward_ref)(
            x0, us, vs, bs, half
        )
        return y

    @staticmethod
    def backward(ctx: Context, dy):
        half = ctx.native_half
        g = _contig(dy.astype(np.float16, copy=False) if half else dy)
        dx, dus, dvs, dbs = pick(kernel=_v2_backward_kernel, cpu=_v2_backward_cpu, ref=_v2_backward_ref)(
            g, ctx.x0, ctx.us, ctx.vs, ctx.bs, ctx.xs, ctx.zs, ctx.ts, half
        )
        grads = []
        for du, dv, db in zip(dus, dvs, dbs):
            grads += [du, dv, db.reshape(ctx.bshape)]
        return (dx, *grads)
