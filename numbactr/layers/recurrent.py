"""GRU (spec §6.2): cuDNN's single-layer unidirectional GRU with one input bias, written as per-step
kernels (numbactr.kernels.gru) plus matmuls, and a hand-written backward through time: the op
numbactr.ops.recurrent.GRUFn (its formula is there); this module keeps the layer's shapes and weights.

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

from numbactr import hugectr_exact
from numbactr.enums import Initializer_t, Layer_t
from numbactr.layers import init
from numbactr.layers.base import Layer
from numbactr.ops.recurrent import GRUFn, gru_weight_count, split_gru_weights  # noqa: F401 (split_gru_weights: the ONNX converter's)


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
            self.fail(
                f"input {c.bottom_names[0]!r} {shape} must be 2-D or 3-D holding batchsize*SeqLength*"
                f"vector_size = {bsz}*{steps}*{vec} = {bsz * steps * vec} floats, got {total}"
            )
        rows = shape[0]
        if len(shape) == 3:
            if shape[1:] != (steps, vec):
                self.fail(
                    f"3-D input {c.bottom_names[0]!r} must be (B, SeqLength, vector_size) = "
                    f"({bsz}, {steps}, {vec}), got {shape}"
                )
            out = (rows, steps, h)
        elif rows == bsz:
            out = (rows, steps * h)
        elif rows == bsz * steps:
            out = (rows, h)
        else:
            self.fail(
                f"input {c.bottom_names[0]!r} {shape}: rows must be batchsize ({bsz}) or "
                f"batchsize*SeqLength ({bsz * steps})"
            )
        self.h, self.bsz, self.steps, self.vec = h, bsz, steps, vec
        self._tail = out[1:]
        return [out]

    def param_shapes(self):
        return [(1, gru_weight_count(self.h, self.vec)), (1, self.bsz * self.h)]

    def init_params(self, rng):
        # zeros for every Initializer_t: HugeCTR's GRU overrides no getter (numbactr.layers.init.gru_param)
        w_shape, hx_shape = self.param_shapes()
        return [
            init.gru_param(rng, w_shape, self.cfg.weight_init_type),
            init.gru_param(rng, hx_shape, self.cfg.bias_init_type),
        ]

    def forward(self, tape, xs, run):
        x = xs[0]
        per_sample = self.steps * self.vec
        if x.data.size % per_sample:
            self.fail(
                f"input {self.cfg.bottom_names[0]!r} {x.shape} does not hold whole sequences of "
                f"SeqLength*vector_size = {per_sample} floats"
            )
        bsz = x.data.size // per_sample
        if bsz > self.bsz:
            self.fail(f"a batch of {bsz} sequences exceeds batchsize={self.bsz} (hx holds {self.bsz} states)")
        rows = x.shape[0]
        out_shape = (rows,) + tuple(int(d) for d in self._tail)
        if bsz != self.bsz:  # another batch size (eval): keep the row layout
            out_shape = (
                (rows, bsz * self.steps * self.h // rows) if len(self._tail) == 1 else (rows, self.steps, self.h)
            )
        return [
            GRUFn.apply(
                tape,
                x,
                *self.params,
                hidden=self.h,
                steps=self.steps,
                vec=self.vec,
                out_shape=out_shape,
                exact=hugectr_exact.hugectr_exact(),
                name=self.cfg.top_names[0],
            )
        ]

    def json_params(self):
        c = self.cfg
        p = {
            "num_output": c.num_output,
            "batchsize": c.batchsize,
            "SeqLength": c.SeqLength,
            "vector_size": c.vector_size,
        }
        if c.weight_init_type != Initializer_t.Default:
            p["weight_init"] = c.weight_init_type.name
        if c.bias_init_type != Initializer_t.Default:
            p["bias_init"] = c.bias_init_type.name
        return {"gru_param": p}


LAYERS = {Layer_t.GRU: GRU}
