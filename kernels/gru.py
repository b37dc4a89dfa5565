"""GRU (one layer, unidirectional), cuDNN's cell with one input bias (CUDNN_RNN_SINGLE_INP_BIAS).

Shapes: x (B, T, V) batch-major, H hidden; W = [W_r; W_z; W_n] (3H, V), U = [U_r; U_z; U_n] (3H, H),
b = [b_r, b_z, b_n] (3H,), h_0 (B, H). Gate order r, z, n as cuDNN. Per step t = 0..T-1:
    gx_t = x_t W^T            (one matmul for all t, by the caller)     # (B, 3H)
    gh_t = h_t U^T            (one matmul per step, by the caller)      # (B, 3H)
    r    = sigmoid(gx_r + b_r + gh_r)
    z    = sigmoid(gx_z + b_z + gh_z)
    n    = tanh(gx_n + b_n + r * gh_n)          # single input bias: no recurrent bias b_Un
    h_{t+1} = (1 - z) * n + z * h_t             # y[:, t] = h_{t+1}
Backward through time (t = T-1..0), dh = dy_t + dh carried from step t+1:
    dn = dh (1 - z); dz = dh (h_t - n); a_n = dn (1 - n^2); a_z = dz z (1 - z); a_r = a_n gh_n r (1 - r)
    dgx_t = [a_r, a_z, a_n]          dgh_t = [a_r, a_z, a_n * r]
    dh_t  = dh * z + dgh_t U         (the matmul by the caller; the step kernel adds its two parts)
    then dW = dgx^T x, dU = dgh^T h_{0..T-1}, db = sum dgx, dx = dgx W, dh_0 = the last carry.

HugeCTR: HugeCTR/src/layers/gru_layer.cu (cudnnRNNForward / cudnnRNNBackwardData_v8 /
BackwardWeights_v8). The step kernels are elementwise over (B, H); the recurrence is the host loop.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from .launch import launch_1d


# ---- NumPy reference -------------------------------------------------------------------------
def _sigmoid(a):
    e = np.exp(-np.abs(a))
    return np.where(a >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def gru_forward_ref(x, w, u, b, h0):
    """x (B, T, V), w (3H, V), u (3H, H), b (3H,), h0 (B, H) -> (y (B, T, H), cache)."""
    bsz, steps, _ = x.shape
    hid = u.shape[1]
    hs = np.zeros((bsz, steps + 1, hid), dtype=np.result_type(x, w))
    hs[:, 0] = h0
    gates = np.zeros((bsz, steps, 4 * hid), dtype=hs.dtype)
    gx = x @ w.T + b                                                      # (B, T, 3H)
    for t in range(steps):
        gh = hs[:, t] @ u.T                                               # (B, 3H)
        r = _sigmoid(gx[:, t, :hid] + gh[:, :hid])
        z = _sigmoid(gx[:, t, hid:2 * hid] + gh[:, hid:2 * hid])
        hn = gh[:, 2 * hid:]
        n = np.tanh(gx[:, t, 2 * hid:] + r * hn)
        hs[:, t + 1] = (1 - z) * n + z * hs[:, t]
        gates[:, t] = np.concatenate([r, z, n, hn], axis=1)
    return hs[:, 1:].copy(), (hs, gates)


def gru_backward_ref(dy, x, w, u, cache):
    """Returns (dx (B, T, V), dw (3H, V), du (3H, H), db (3H,), dh0 (B, H))."""
    hs, gates = cache
    bsz, steps, _ = x.shape
    hid = u.shape[1]
    dgx = np.zeros((bsz, steps, 3 * hid), dtype=hs.dtype)
    dgh = np.zeros_like(dgx)
    dh_next = np.zeros((bsz, hid), dtype=hs.dtype)
    for t in reversed(range(steps)):
        r, z, n, hn = (gates[:, t, k * hid:(k + 1) * hid] for k in range(4))
        dh = dy[:, t] + dh_next
        dn = dh * (1 - z)
        dz = dh * (hs[:, t] - n)
        a_n = dn * (1 - n * n)
        a_z = dz * z * (1 - z)
        a_r = a_n * hn * r * (1 - r)
        dgx[:, t] = np.concatenate([a_r, a_z, a_n], axis=1)
        dgh[:, t] = np.concatenate([a_r, a_z, a_n * r], axis=1)
        dh_next = dh * z + dgh[:, t] @ u
    dgx2 = dgx.reshape(-1, 3 * hid)
    dw = dgx2.T @ x.reshape(-1, x.shape[2])
    du = dgh.reshape(-1, 3 * hid).T @ hs[:, :steps].reshape(-1, hid)
    return (dgx2 @ w).reshape(x.shape), dw, du, dgx2.sum(axis=0), dh_next


# ---- kernels (elementwise over the B*H hidden units of one step) -----------------------------
@cuda.jit
def gru_step_forward_kernel(gx, b, gh, hs, gates, t):
    # gx (B, T, 3H) = x W^T; b (3H,); gh (B, 3H) = h_t U^T; hs (B, T+1, H); gates (B, T, 4H) out
    hid = hs.shape[2]
    one = float32(1.0)
    for i in range(cuda.grid(1), hs.shape[0] * hid, cuda.gridsize(1)):
        bi = i // hid
        j = i % hid
        a = gx[bi, t, j] + b[j] + gh[bi, j]
        e = math.exp(-abs(a))
        r = one / (one + e) if a >= float32(0.0) else e / (one + e)
        a = gx[bi, t, hid + j] + b[hid + j] + gh[bi, hid + j]
        e = math.exp(-abs(a))
        z = one / (one + e) if a >= float32(0.0) else e / (one + e)
        hn = gh[bi, 2 * hid + j]
        n = math.tanh(gx[bi, t, 2 * hid + j] + b[2 * hid + j] + r * hn)
        hs[bi, t + 1, j] = (one - z) * n + z * hs[bi, t, j]
        gates[bi, t, j] = r
        gates[bi, t, hid + j] = z
        gates[bi, t, 2 * hid + j] = n
        gates[bi, t, 3 * hid + j] = hn


@cuda.jit
def gru_step_backward_kernel(dy, dh_mm, dh_dir, gates, hs, t, dgx, dgh):
    # dy (B, T, H); dh_mm = dgh_{t+1} U and dh_dir = dh_{t+1} * z_{t+1} (B, H): the carry from step
    # t+1, whose sum is dL/dh_{t+1} besides dy. dh_dir is overwritten with this step's dh * z.
    # gates (B, T, 4H) [r|z|n|hn]; hs (B, T+1, H); dgx, dgh (B, T, 3H) out at step t.
    hid = hs.shape[2]
    one = float32(1.0)
    for i in range(cuda.grid(1), hs.shape[0] * hid, cuda.gridsize(1)):
        bi = i // hid
        j = i % hid
        dh = dy[bi, t, j] + dh_mm[bi, j] + dh_dir[bi, j]
        r = gates[bi, t, j]
        z = gates[bi, t, hid + j]
        n = gates[bi, t, 2 * hid + j]
        hn = gates[bi, t, 3 * hid + j]
        a_n = dh * (one - z) * (one - n * n)
        a_z = dh * (hs[bi, t, j] - n) * z * (one - z)
        a_r = a_n * hn * r * (one - r)
        dgx[bi, t, j] = a_r
        dgx[bi, t, hid + j] = a_z
        dgx[bi, t, 2 * hid + j] = a_n
        dgh[bi, t, j] = a_r
        dgh[bi, t, hid + j] = a_z
        dgh[bi, t, 2 * hid + j] = a_n * r
        dh_dir[bi, j] = dh * z


@cuda.jit
def gru_add_kernel(a, b, out):
    # flat views: out = a + b (dh_0 = the last step's two carry parts)
    for i in range(cuda.grid(1), a.shape[0], cuda.gridsize(1)):
        out[i] = a[i] + b[i]


# ---- launch wrappers (contiguous float32; allocate nothing) ----------------------------------
def gru_step_forward(gx, b, gh, hs, gates, t: int) -> None:
    launch_1d(gru_step_forward_kernel, hs.shape[0] * hs.shape[2], gx, b, gh, hs, gates, np.int64(t))


def gru_step_backward(dy, dh_mm, dh_dir, gates, hs, t: int, dgx, dgh) -> None:
    launch_1d(gru_step_backward_kernel, hs.shape[0] * hs.shape[2], dy, dh_mm, dh_dir, gates, hs,
              np.int64(t), dgx, dgh)


def gru_add(a, b, out) -> None:
    launch_1d(gru_add_kernel, a.size, a.reshape(-1), b.reshape(-1), out.reshape(-1))


_T3, _M, _V = "float32[:, :, ::1]", "float32[:, ::1]", "float32[::1]"
PTX_CHECKS = [
    (gru_step_forward_kernel, f"void({_T3}, {_V}, {_M}, {_T3}, {_T3}, int64)"),
    (gru_step_backward_kernel, f"void({_T3}, {_M}, {_M}, {_T3}, {_T3}, int64, {_T3}, {_T3})"),
    (gru_add_kernel, f"void({_V}, {_V}, {_V})"),
]
