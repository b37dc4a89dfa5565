"""GRU op (spec §6.2): cuDNN's single-layer unidirectional GRU with one input bias, as per-step kernels
(numbactr.kernels.gru) plus matmuls, with a hand-written backward through time.

Contract: ``GRUFn`` x (B*T*V floats), w (1, W), hx (1, B_cfg*H) -> every step's hidden state (out_shape);
numbactr.ops.dispatch.pick sends the recurrence to the numba.cuda step kernels on gpu/sim and to the NumPy
reference on cpu. The flat weight vector is [W_r, W_z, W_n (H, V each), U_r, U_z, U_n (H, H each),
b_r, b_z, b_n (H,)] (cuDNN's canonical order; ``split_gru_weights``).

Formula, per step t:  r = σ(W_r x + b_r + U_r h),  z = σ(W_z x + b_z + U_z h),
                      n = tanh(W_n x + b_n + r·(U_n h)),  h' = (1 - z)·n + z·h.

Why the input projections are one GEMM before the loop: W x does not depend on h, so all T steps'
gates come from one (B·T, V) x (V, 3H) product; only U h is per step.
"""

from __future__ import annotations

import numpy as np

from numbactr.autograd import Context, Function
from numbactr.kernels import bias
from numbactr.kernels import gru
from numbactr.ops.dispatch import pick
from numbactr.runtime.device import contig as _contig
from numbactr.runtime.device import xp as _xp


def gru_weight_count(hidden: int, vec: int) -> int:
    return 3 * hidden * vec + 3 * hidden * hidden + 3 * hidden


def split_gru_weights(wflat, hidden: int, vec: int):
    """Views (W (3H, V), U (3H, H), b (3H,)) of the flat weight vector."""
    w = wflat.reshape(-1)
    a, c = 3 * hidden * vec, 3 * hidden * hidden
    return w[:a].reshape(3 * hidden, vec), w[a : a + c].reshape(3 * hidden, hidden), w[a + c : a + c + 3 * hidden]


def _forward_kernel(xb, w, u, b, h0):
    xp = _xp()
    bsz, steps, vec = xb.shape
    hidden = u.shape[1]
    gx = _contig(xb.reshape(bsz * steps, vec) @ w.T).reshape(bsz, steps, 3 * hidden)
    hs = xp.empty((bsz, steps + 1, hidden), np.float32)
    hs[:, 0] = h0
    gates = xp.empty((bsz, steps, 4 * hidden), np.float32)
    for t in range(steps):
        gh = _contig(hs[:, t] @ u.T)  # (B, 3H)
        gru.gru_step_forward(gx, b, gh, hs, gates, t)
    return hs[:, 1:], (hs, gates)


def _forward_ref(xb, w, u, b, h0):
    y, cache = gru.gru_forward_ref(xb, w, u, b, h0)
    return y.astype(np.float32, copy=False), cache


def _backward_kernel(dy3, xb, w, u, cache):
    xp = _xp()
    bsz, steps, hidden = dy3.shape
    vec = xb.shape[2]
    hs, gates = cache
    dgx = xp.empty((bsz, steps, 3 * hidden), np.float32)
    dgh = xp.empty_like(dgx)
    dh_mm = xp.zeros((bsz, hidden), np.float32)  # dgh_{t+1} U: the matmul part of the carry
    dh_dir = xp.zeros((bsz, hidden), np.float32)  # dh_{t+1} * z_{t+1}: the direct part
    for t in reversed(range(steps)):
        gru.gru_step_backward(dy3, dh_mm, dh_dir, gates, hs, t, dgx, dgh)
        dh_mm = _contig(dgh[:, t] @ u)
    dh0 = xp.empty((bsz, hidden), np.float32)
    gru.gru_add(dh_mm, dh_dir, dh0)
    dgx2 = dgx.reshape(-1, 3 * hidden)
    dw = dgx2.T @ xb.reshape(-1, vec)
    du = dgh.reshape(-1, 3 * hidden).T @ _contig(hs[:, :steps]).reshape(-1, hidden)
    db = xp.empty((3 * hidden,), np.float32)
    bias.bias_grad(dgx2, db)
    dx = dgx2 @ w
    return dx, dw, du, db, dh0


class GRUFn(Function):
    """x (any shape, B*T*V floats), w (1, W), hx (1, B_cfg*H) -> y (out_shape)."""

    @staticmethod
    def forward(ctx: Context, x, wflat, hx, hidden=1, steps=1, vec=1, out_shape=(), exact=False):
        xp = _xp()
        bsz = x.size // (steps * vec)
        if exact:  # cuDNN's seq-major buffer [T][B][V]
            xb = _contig(x.reshape(steps, bsz, vec).transpose(1, 0, 2))
        else:
            xb = _contig(x).reshape(bsz, steps, vec)  # (B, T, V)
        w, u, b = split_gru_weights(wflat, hidden, vec)
        if exact:
            h0 = xp.zeros((bsz, hidden), np.float32)
        else:
            h0 = hx.reshape(-1)[: bsz * hidden].reshape(bsz, hidden)
        y, cache = pick(kernel=_forward_kernel, ref=_forward_ref)(xb, w, u, b, h0)
        ctx.xb, ctx.wflat, ctx.cache = xb, wflat, cache
        ctx.dims, ctx.exact, ctx.in_shape, ctx.hx_shape = (bsz, hidden, steps, vec), exact, x.shape, hx.shape
        if exact:
            y = y.transpose(1, 0, 2)
        return _contig(y).reshape(out_shape)

    @staticmethod
    def backward(ctx: Context, dy):
        xp = _xp()
        bsz, hidden, steps, vec = ctx.dims
        if ctx.exact:
            dy3 = _contig(dy.reshape(steps, bsz, hidden).transpose(1, 0, 2))
        else:
            dy3 = _contig(dy).reshape(bsz, steps, hidden)  # (B, T, H)
        w, u, _ = split_gru_weights(ctx.wflat, hidden, vec)
        dx, dw, du, db, dh0 = pick(kernel=_backward_kernel, ref=gru.gru_backward_ref)(dy3, ctx.xb, w, u, ctx.cache)
        dx = dx.reshape(bsz, steps, vec)
        if ctx.exact:
            dx = dx.transpose(1, 0, 2)
        dx = _contig(dx).reshape(ctx.in_shape).astype(np.float32, copy=False)
        dwflat = xp.concatenate([dw.reshape(-1), du.reshape(-1), db.reshape(-1)]).astype(np.float32)
        dhx = xp.zeros(int(np.prod(ctx.hx_shape)), np.float32)
        if not ctx.exact:
            dhx[: bsz * hidden] = dh0.reshape(-1)
        return dx, dwflat.reshape(ctx.wflat.shape), dhx.reshape(ctx.hx_shape)
