"""Core DLRM layers: InnerProduct, ReLU, Concat, Reshape, Interaction, BinaryCrossEntropyLoss.

Contract: each layer checks its config and bottom shapes, declares its tops and weights, and runs one op of
numbactr.ops per forward (ops.Linear y = x W + b, ops.ReLU, ops.Concat, ops.Reshape, ops.Interaction,
ops.BinaryCrossEntropy); ``inference_fn`` runs the same op forward without a tape.

Why an InnerProduct may run ops.FcBiasAct: followed by a ReLU layer on the kernel devices, its bias add and
the ReLU are one fused kernel each way (numbactr.train.graph.fuse_bias_relu, ops.fuse_bias_relu).
"""

from __future__ import annotations

import math

import numpy as np

from numbactr import ops
from numbactr.enums import Layer_t
from numbactr.layers import init
from numbactr.layers.base import Layer, op_fn
from numbactr.layers.losses import RegularizedLoss


class InnerProduct(Layer):
    """Y = X·W + b on the last dim: (B, K) -> (B, N) or (B, S, K) -> (B, S, N). W (K, N), b (N,)."""

    type_name = "InnerProduct"

    def infer(self):
        self.expect_counts(1)
        (shape,) = self.in_shapes
        if len(shape) not in (2, 3):
            self.fail(f"input {self.cfg.bottom_names[0]!r} must be 2-D or 3-D, got shape {shape}")
        n = self.cfg.num_output
        if not isinstance(n, int) or n <= 0:
            self.fail(f"num_output must be a positive int, got {n!r}")
        self.k, self.n = shape[-1], n
        return [shape[:-1] + (n,)]

    def param_shapes(self):
        return [(self.k, self.n), (self.n,)]

    def init_params(self, rng):
        return [
            init.inner_product_weight(rng, self.k, self.n, self.cfg.weight_init_type),
            init.inner_product_bias(rng, self.n, self.cfg.bias_init_type),
        ]

    #: the ReLU layer this layer's bias add is fused with (numbactr.train.graph.fuse_bias_relu), or None
    relu_after = None

    def forward(self, tape, xs, run):
        if self.relu_after is not None and ops.fuse_bias_relu():
            # one epilogue kernel for bias + ReLU each way (FusedInnerProduct's); the ReLU layer passes it on
            return [ops.FcBiasAct.apply(tape, xs[0], *self.params, relu=True, name=self.relu_after.cfg.top_names[0])]
        return [ops.Linear.apply(tape, xs[0], *self.params, name=self.cfg.top_names[0])]

    def inference_fn(self):
        if self.relu_after is not None and ops.fuse_bias_relu():
            return op_fn(ops.FcBiasAct, *self.params, relu=True)
        return op_fn(ops.Linear, *self.params)

    def json_params(self):
        p = {"num_output": self.n}
        for key, attr in (("weight_init", "weight_init_type"), ("bias_init", "bias_init_type")):
            if attr in self.cfg.given:
                p[key] = getattr(self.cfg, attr).name
        return {"fc_param": p}


class ReLU(Layer):
    type_name = "ReLU"

    def infer(self):
        self.expect_counts(1)
        return [self.in_shapes[0]]

    #: the InnerProduct whose fused epilogue applies this ReLU (numbactr.train.graph.fuse_bias_relu), or None
    fused_into = None

    def forward(self, tape, xs, run):
        if self.fused_into is not None and ops.fuse_bias_relu():
            return [xs[0]]  # applied by the InnerProduct before it
        return [ops.ReLU.apply(tape, xs[0], name=self.cfg.top_names[0])]

    def inference_fn(self):
        if self.fused_into is not None and ops.fuse_bias_relu():
            return lambda xs: [xs[0]]
        return op_fn(ops.ReLU)


class Concat(Layer):
    """2-D inputs (B, K_i) -> (B, ΣK_i); 3-D (B, S_i, V) on axis 1 or (B, S, V_i) on axis 2."""

    type_name = "Concat"

    def infer(self):
        if len(self.cfg.bottom_names) < 2 or len(self.cfg.top_names) != 1:
            self.fail("expects >= 2 bottom tensors and 1 top tensor")
        shapes, axis = self.in_shapes, self.cfg.axis
        rank = len(shapes[0])
        if rank not in (2, 3) or any(len(s) != rank for s in shapes):
            self.fail(f"inputs must all be 2-D or all 3-D, got shapes {shapes}")
        if rank == 2:
            axis = 1
        if axis not in (1, 2) or axis >= rank:
            self.fail(f"axis must be 1 (2-D) or 1/2 (3-D), got {self.cfg.axis}")
        for name, s in zip(self.cfg.bottom_names, shapes):
            other = [d for i, d in enumerate(s) if i != axis]
            ref = [d for i, d in enumerate(shapes[0]) if i != axis]
            if other != ref:
                self.fail(
                    f"input {name!r} has shape {s}, which does not match "
                    f"{self.cfg.bottom_names[0]!r} {shapes[0]} off axis {axis}"
                )
        self.axis = axis
        out = list(shapes[0])
        out[axis] = sum(s[axis] for s in shapes)
        return [tuple(out)]

    def forward(self, tape, xs, run):
        return [ops.Concat.apply(tape, *xs, axis=self.axis, name=self.cfg.top_names[0])]

    def inference_fn(self):
        return op_fn(ops.Concat, axis=self.axis)

    def json_params(self):
        return {"axis": self.axis} if self.axis != 1 or "axis" in self.cfg.given else {}


class Reshape(Layer):
    """(a) leading_dim: (N/L, L); (b) leading_dim + time_step: (N/(L·T), T, L);
    (c) selected slots: layers.shape.ReshapeSelected (a gather, dispatched by layers.build); (d) shape=[..., -1]."""

    type_name = "Reshape"

    def infer(self):
        self.expect_counts(1)
        (shape,) = self.in_shapes
        total = math.prod(shape)
        c = self.cfg
        if c.selected:
            self.fail("selected=True is handled by layers.shape.ReshapeSelected (build() dispatches to it)")
        if c.leading_dim > 0:
            per = c.leading_dim * max(c.time_step, 1)
            if total % per:
                self.fail(
                    f"input {c.bottom_names[0]!r} {shape} has {total} elements, not divisible by "
                    f"leading_dim*time_step = {per}"
                )
            out = (total // per, c.time_step, c.leading_dim) if c.time_step > 0 else (total // per, c.leading_dim)
        elif c.shape:
            shp = list(c.shape)
            if shp.count(-1) != 1:
                self.fail(f"shape {shp} must hold exactly one -1")
            known = math.prod(d for d in shp if d != -1)
            if known <= 0 or total % known:
                self.fail(f"shape {shp} does not fit input {shape}")
            out = tuple(total // known if d == -1 else d for d in shp)
        else:
            self.fail("needs leading_dim > 0 (optionally time_step), selected slots, or shape")
        # the batch dim scales: keep B symbolic by storing the per-sample factor
        self._tail = out[1:]
        return [out]

    def forward(self, tape, xs, run):
        return [ops.Reshape.apply(tape, xs[0], shape=(-1,) + self._tail, name=self.cfg.top_names[0])]

    def inference_fn(self):
        return op_fn(ops.Reshape, shape=(-1,) + self._tail)

    def json_params(self):
        return {"leading_dim": self.cfg.leading_dim, "time_step": self.cfg.time_step}


class Interaction(Layer):
    """DLRM dot interaction: bottoms dense (B, V) and emb (B, S, V) -> (B, V + (S+1)S/2 + 1).

    HugeCTR's fp16 Interaction may have a second top (``["interaction1", "interaction_grad"]`` in the
    DLRM fp16 samples): a buffer of the same shape through which its backward receives dY from the
    fused MLP / FusedInnerProduct Head that takes it as second bottom. numbactr's tape carries that
    gradient on the first top, so the second top is the SAME tensor as the first (its consumers read
    the output; a gradient sent to it adds to the first's). Accepted in fp32 too, as FusedInnerProduct."""

    type_name = "Interaction"

    def infer(self):
        self.expect_counts(2, tops=len(self.cfg.top_names) if len(self.cfg.top_names) in (1, 2) else 1)
        if self.cfg.compute_config.async_wgrad and len(self.cfg.top_names) == 1:
            # HugeCTR's check (the one-top form has no dgrad split)
            self.fail(
                "compute_config async_wgrad=True needs the two-top (fp16) Interaction; the one-top "
                "form has no separate gradient output to overlap"
            )
        d, e = self.in_shapes
        names = self.cfg.bottom_names
        if len(d) != 2 or len(e) != 3:
            self.fail(
                f"bottoms must be dense (B, V) and embedding (B, S, V); got {names[0]!r} {d} and {names[1]!r} {e}"
            )
        if d[0] != e[0] or d[1] != e[2]:
            self.fail(f"{names[0]!r} {d} and {names[1]!r} {e} disagree: need dense (B, V) with V == embedding width")
        n = e[1] + 1
        out = (d[0], d[1] + n * (n - 1) // 2 + 1)
        return [out] * len(self.cfg.top_names)

    def forward(self, tape, xs, run):
        y = ops.Interaction.apply(tape, xs[0], xs[1], name=self.cfg.top_names[0])
        return [y] * len(self.cfg.top_names)

    def inference_fn(self):
        return op_fn(ops.Interaction, tops=len(self.cfg.top_names))


class BinaryCrossEntropyLoss(RegularizedLoss, Layer):
    """bottoms [logit (B, 1), label (B, 1)] -> scalar loss; sigmoid fused; see ops.BinaryCrossEntropy."""

    type_name = "BinaryCrossEntropyLoss"
    is_loss = True
    label_kind = "unit"  # labels in [0, 1], checked by the reader (numbactr.data.validation)

    def infer(self):
        self.expect_counts(2)
        x, y = self.in_shapes
        if x != y or len(x) != 2 or x[1] != 1:
            self.fail(
                f"logit {self.cfg.bottom_names[0]!r} {x} and label {self.cfg.bottom_names[1]!r} {y} must both be (B, 1)"
            )
        self.setup_regularizer()
        return [(1,)]

    def forward(self, tape, xs, run):
        # a rank whose share of a partial last batch is empty has no rows to scale (as CrossEntropyLoss)
        grad_scale = run.scaler / (run.valid * run.ranks) if run.valid else 0.0
        loss = ops.BinaryCrossEntropy.apply(
            tape, xs[0], xs[1], valid=run.valid, grad_scale=grad_scale, name=self.cfg.top_names[0]
        )
        self.logits = xs[0]
        return [loss]

    def json_params(self):
        return self.regularizer_json()

    def predictions(self):
        """sigmoid of the last forward's logits, (B, 1) (float32 also from mixed precision's fp16 logits)."""
        z = self.logits.data
        return ops.sigmoid(z if z.dtype == np.float32 else z.astype(np.float32))


LAYERS = {
    Layer_t.InnerProduct: InnerProduct,
    Layer_t.ReLU: ReLU,
    Layer_t.Concat: Concat,
    Layer_t.Reshape: Reshape,
    Layer_t.Interaction: Interaction,
    Layer_t.BinaryCrossEntropyLoss: BinaryCrossEntropyLoss,
}
