"""GRU (spec §6.2): cuDNN's single-layer unidirectional GRU with one input bias, written as per-step
kernels (numbactr.kernels.gru) plus matmuls, and a hand-written backward through time.

Parameters (DenseLayer): num_output = H (hidden), batchsize = B, SeqLength = T, vector_size = V.
Input: any tensor of B*T*V floats whose rows are samples: (B, T*V), (B, T, V) or (B*T, V) (what a
Reshape with leading_dim=V of (B, T, V) gives; HugeCTR's din_try feeds that). Output: the hidden
state of every step, T*H floats per sample: (B, T*H), (B, T, H) or (B*T, H) respectively (the
last matches HugeCTR's (rows, num_output) top).

Weights (HugeCTR: weight index 0 = cuDNN's weight space (1, W), index 1 = hx (1, B*H)):
    w (1, 3H*V + 3H*H + 3H) = [W_r, W_z, W_n (each (H, V) row-major), U_r, U_z, U_n (each (H, H)),
                               b_r, b_z, b_n (each (H,))]
    hx (1, B*H)  the initial hidden state, trainable
This is cuDNN's canonical order (input matrices by gate r, z, n, then the recurrent ones, then the
biases; CUDNN_RNN_SINGLE_INP_BIAS has no recurrent biases, so n = tanh(W_n x + b_n + r*(U_n h))).
It has not been checked byte for byte against a cuDNN weight space (no cuDNN here).
Init: zeros for w and hx whatever the Initializer_t (HugeCTR's base-class default).

Differences from HugeCTR (numbactr.hugectr_exact.hugectr_exact() restores the first two):
  * layout: the flat input is read batch-major, x[b, t, :] is sample b's step t. cuDNN (and so
    HugeCTR) reads the same buffer seq-major, [T][B][V], which mixes the samples of a batch-major
    (B*T, V) tensor into one sequence. Exact mode reads and writes seq-major.
  * hx: HugeCTR allocates hx as a trainable weight but passes NULL to cuDNN (h_0 = 0, its gradient
    never used). numbactr starts from hx and trains it; exact mode uses h_0 = 0 and gives hx a zero
    gradient.
  * gradients: HugeCTR's bprop feeds cuDNN separate wgrad buffers as dy/dx (the top's gradient never
    reaches cuDNN, dx never reaches the bottom). numbactr back-propagates through time properly,
    in both modes.
"""
from __future__ import annotations

import math

import numpy as np

from numbactr import hugectr_exact as compat
from numbactr.runtime import device
from numbactr.autograd import Context, Function
from numbactr.enums import Initializer_t, Layer_t
from numbactr.kernels import bias as bias_kernels
from numbactr.kernels import gru
from numbactr.layers import init
from numbactr.layers.base import Layer
from numbactr.runtime.device import xp as _xp, contig as _contig  # noqa: F401


def gru_weight_count(hidden: int, vec: int) -> int:
    return 3 * hidden * vec + 3 * hidden * hidden + 3 * hidden


def split_gru_weights(wflat, hidden: int, vec: int):
    """Views (W (3H, V), U (3H, H), b (3H,)) of the flat weight vector."""
    w = wflat.reshape(-1)
    a, c = 3 * hidden * vec, 3 * hidden * hidden
    return w[:a].reshape(3 * hidden, vec), w[a:a + c].reshape(3 * hidden, hidden), w[a + c:a + c + 3 * hidden]


class GRUFn(Function):
    """x (any shape, B*T*V floats), w (1, W), hx (1, B_cfg*H) -> y (out_shape)."""

    @staticmethod
    def forward(ctx: Context, x, wflat, hx, hidden=1, steps=1, vec=1, out_shape=(), exact=False):
        xp = _xp()
        bsz = x.size // (steps * vec)
        if exact:          # cuDNN's seq-major buffer [T][B][V]
            xb = _contig(x.reshape(steps, bsz, vec).transpose(1, 0, 2))
        else:
            xb = _contig(x).reshape(bsz, steps, vec)                             # (B, T, V)
        w, u, b = split_gru_weights(wflat, hidden, vec)
        if exact:
            h0 = xp.zeros((bsz, hidden), np.float32)
        else:
            h0 = hx.reshape(-1)[:bsz * hidden].reshape(bsz, hidden)
        if device.uses_kernels():
            gx = _contig(xb.reshape(bsz * steps, vec) @ w.T).reshape(bsz, steps, 3 * hidden)
            hs = xp.empty((bsz, steps + 1, hidden), np.float32)
            hs[:, 0] = h0
            gates = xp.empty((bsz, steps, 4 * hidden), np.float32)
            for t in range(steps):
                gh = _contig(hs[:, t] @ u.T)                                     # (B, 3H)
                gru.gru_step_forward(gx, b, gh, hs, gates, t)
            y = hs[:, 1:]
            cache = (hs, gates)
        else:
            y, cache = gru.gru_forward_ref(xb, w, u, b, h0)
            y = y.astype(np.float32, copy=False)
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
            dy3 = _contig(dy).reshape(bsz, steps, hidden)                       # (B, T, H)
        w, u, _ = split_gru_weights(ctx.wflat, hidden, vec)
        hs, gates = ctx.cache
        if device.uses_kernels():
            dgx = xp.empty((bsz, steps, 3 * hidden), np.float32)
            dgh = xp.empty_like(dgx)
            dh_mm = xp.zeros((bsz, hidden), np.float32)      # dgh_{t+1} U: the matmul part of the carry
            dh_dir = xp.zeros((bsz, hidden), np.float32)     # dh_{t+1} * z_{t+1}: the direct part
            for t in reversed(range(steps)):
                gru.gru_step_backward(dy3, dh_mm, dh_dir, gates, hs, t, dgx, dgh)
                dh_mm = _contig(dgh[:, t] @ u)
            dh0 = xp.empty((bsz, hidden), np.float32)
            gru.gru_add(dh_mm, dh_dir, dh0)
            dgx2 = dgx.reshape(-1, 3 * hidden)
            dw = dgx2.T @ ctx.xb.reshape(-1, vec)
            du = dgh.reshape(-1, 3 * hidden).T @ _contig(hs[:, :steps]).reshape(-1, hidden)
            db = xp.empty((3 * hidden,), np.float32)
            bias_kernels.bias_grad(dgx2, db)
            dx = dgx2 @ w
        else:
            dx, dw, du, db, dh0 = gru.gru_backward_ref(dy3, ctx.xb, w, u, ctx.cache)
        dx = dx.reshape(bsz, steps, vec)
        if ctx.exact:
            dx = dx.transpose(1, 0, 2)
        dx = _contig(dx).reshape(ctx.in_shape).astype(np.float32, copy=False)
        dwflat = xp.concatenate([dw.reshape(-1), du.reshape(-1), db.reshape(-1)]).astype(np.float32)
        dhx = xp.zeros(int(np.prod(ctx.hx_shape)), np.float32)
        if not ctx.exact:
            dhx[:bsz * hidden] = dh0.reshape(-1)
        return dx, dwflat.reshape(ctx.wflat.shape), dhx.reshape(ctx.hx_shape)


class GRU(Layer):
    """(B*T*V floats, rows = samples) -> every step's hidden state; see the module docstring."""
    type_name = "GRU"

    def infer(self):
        self.expect_counts(1)
        c = self.cfg
        (shape,) = self.in_shapes
        for key in ("num_output", "batchsize", "SeqLength", "vector_size"):
            v = getattr(c, key)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                self.fail(f"{key} must be a positive int, got {v!r}")
        h, bsz, steps, vec = int(c.num_output), int(c.batchsize), int(c.SeqLength), int(c.vector_size)
        total = math.prod(shape)
        if len(shape) not in (2, 3) or total != bsz * steps * vec:
            self.fail(f"input {c.bottom_names[0]!r} {shape} must be 2-D or 3-D holding batchsize*SeqLength*"
                      f"vector_size = {bsz}*{steps}*{vec} = {bsz * steps * vec} floats, got {total}")
        rows = shape[0]
        if len(shape) == 3:
            if shape[1:] != (steps, vec):
                self.fail(f"3-D input {c.bottom_names[0]!r} must be (B, SeqLength, vector_size) = "
                          f"({bsz}, {steps}, {vec}), got {shape}")
            out = (rows, steps, h)
        elif rows == bsz:
            out = (rows, steps * h)
        elif rows == bsz * steps:
            out = (rows, h)
        else:
            self.fail(f"input {c.bottom_names[0]!r} {shape}: rows must be batchsize ({bsz}) or "
                      f"batchsize*SeqLength ({bsz * steps})")
        self.h, self.bsz, self.steps, self.vec = h, bsz, steps, vec
        self._tail = out[1:]
        return [out]

    def param_shapes(self):
        return [(1, gru_weight_count(self.h, self.vec)), (1, self.bsz * self.h)]

    def init_params(self, rng):
        # zeros for every Initializer_t: HugeCTR's GRU overrides no getter (numbactr.layers.init.gru_param)
        w_shape, hx_shape = self.param_shapes()
        return [init.gru_param(rng, w_shape, self.cfg.weight_init_type),
                init.gru_param(rng, hx_shape, self.cfg.bias_init_type)]

    def forward(self, tape, xs, run):
        x = xs[0]
        per_sample = self.steps * self.vec
        if x.data.size % per_sample:
            self.fail(f"input {self.cfg.bottom_names[0]!r} {x.shape} does not hold whole sequences of "
                      f"SeqLength*vector_size = {per_sample} floats")
        bsz = x.data.size // per_sample
        if bsz > self.bsz:
            self.fail(f"a batch of {bsz} sequences exceeds batchsize={self.bsz} (hx holds {self.bsz} states)")
        rows = x.shape[0]
        out_shape = (rows,) + tuple(int(d) for d in self._tail)
        if bsz != self.bsz:                          # another batch size (eval): keep the row layout
            out_shape = (rows, bsz * self.steps * self.h // rows) if len(self._tail) == 1 else \
                (rows, self.steps, self.h)
        return [GRUFn.apply(tape, x, *self.params, hidden=self.h, steps=self.steps, vec=self.vec,
                            out_shape=out_shape, exact=compat.hugectr_exact(), name=self.cfg.top_names[0])]

    def json_params(self):
        c = self.cfg
        p = {"num_output": c.num_output, "batchsize": c.batchsize, "SeqLength": c.SeqLength,
             "vector_size": c.vector_size}
        if c.weight_init_type != Initializer_t.Default:
            p["weight_init"] = c.weight_init_type.name
        if c.bias_init_type != Initializer_t.Default:
            p["bias_init"] = c.bias_init_type.name
        return {"gru_param": p}


LAYERS = {Layer_t.GRU: GRU}
