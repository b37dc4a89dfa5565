"""Elementwise and small fixed-pattern layers: Add, Sub, ElementwiseMultiply, ELU, Sigmoid, ReLUHalf,
Cast, Scale, Dropout, WeightMultiply, FmOrder2.

Contract: each layer checks its config and bottoms and runs an op of numbactr.ops.elementwise (the
formulas are there: Add y = Σ x_i, ELU, Sigmoid, Scale, Dropout y = x·keep/(1 - r), ...), which reaches
its kernel, compiled CPU version or NumPy reference through numbactr.ops.dispatch.

Differences from HugeCTR (the corrected form is the default; ``numbactr.hugectr_exact.hugectr_exact()``
switches to HugeCTR's):

* ElementwiseMultiply backward: product rule dX_i = dY * prod_{j!=i} X_j. HugeCTR computes
  dY * (Y / X_i) and writes 0 to EVERY input's gradient wherever Y == 0 (exact mode does this).
* Scale backward: the gradient of all ``factor`` copies is summed. HugeCTR keeps only the first
  copy's gradient (exact mode does this).
* Dropout: the mask is a counter-based hash of (solver seed, training step, layer id, element index),
  reproducible and identical on gpu, sim and cpu; HugeCTR draws cuRAND uniforms from a
  /dev/urandom seed (not reproducible). The keep probability and the 1/(1-r) scaling are the same.
* ReLUHalf: HugeCTR only lists the enum; here it is the fp32 ReLU.
* Cast: HugeCTR's fp32 <-> fp16 for mixed precision. numbactr's tape already stores every activation
  in the run's precision (fp16 under use_mixed_precision, rounded between layers), so Cast passes its
  input on unchanged (no copy, gradient passes through).
"""

from __future__ import annotations

import math
import zlib

from numbactr import hugectr_exact
from numbactr.autograd import Context
from numbactr.enums import Initializer_t, Layer_t
from numbactr.layers import init
from numbactr.layers.base import Layer, op_fn
from numbactr.ops.elementwise import (
    AddFn,
    DropoutFn,
    ELUFn,
    FmOrder2Fn,
    Identity,
    MultiplyFn,
    ScaleFn,
    SigmoidFn,
    SubFn,
    WeightMultiplyFn,
    dropout_step,
)
from numbactr.ops.elementwise import ReLU as ReLUFn


# ---- layers ----------------------------------------------------------------------------------
class _SameShape(Layer):
    """Base of the layers whose bottoms all share one shape and whose top has that shape."""

    min_bottoms, max_bottoms = 1, 1

    def infer(self):
        names, shapes = self.cfg.bottom_names, self.in_shapes
        lo, hi = self.min_bottoms, self.max_bottoms
        if not lo <= len(names) <= hi:
            want = str(lo) if lo == hi else f">= {lo}"
            self.fail(f"expects {want} bottom tensor(s), got {len(names)}: {names}")
        if len(self.cfg.top_names) != 1:
            self.fail(f"expects 1 top tensor, got {len(self.cfg.top_names)}")
        for name, s in zip(names[1:], shapes[1:]):
            if s != shapes[0]:
                self.fail(
                    f"input {name!r} has shape {s}, but {names[0]!r} has {shapes[0]}: all inputs "
                    "must have the same shape"
                )
        self.check_params()
        return [shapes[0]]

    def check_params(self) -> None:
        pass


class Add(_SameShape):
    """Y = sum_i X_i over N >= 2 same-shape bottoms (any rank); dX_i = dY."""

    type_name = "Add"
    min_bottoms, max_bottoms = 2, 1 << 30

    def forward(self, tape, xs, run):
        return [AddFn.apply(tape, *xs, name=self.cfg.top_names[0])]

    def inference_fn(self):
        return op_fn(AddFn)


class Sub(_SameShape):
    """Y = X0 - X1 (two same-shape bottoms); dX0 = dY, dX1 = -dY."""

    type_name = "Sub"
    min_bottoms, max_bottoms = 2, 2

    def forward(self, tape, xs, run):
        return [SubFn.apply(tape, *xs, name=self.cfg.top_names[0])]


class ElementwiseMultiply(_SameShape):
    """Y = prod_i X_i over N >= 2 same-shape bottoms.

    Backward: product rule dX_i = dY * prod_{j!=i} X_j; under hugectr_exact.hugectr_exact(), HugeCTR's
    dX_i = dY * (Y / X_i) with dX_i = 0 for every i wherever Y == 0.
    """

    type_name = "ElementwiseMultiply"
    min_bottoms, max_bottoms = 2, 1 << 30

    def forward(self, tape, xs, run):
        return [MultiplyFn.apply(tape, *xs, exact=hugectr_exact.hugectr_exact(), name=self.cfg.top_names[0])]

    def inference_fn(self):
        return lambda xs: [MultiplyFn.forward(Context(), *xs, exact=hugectr_exact.hugectr_exact())]


class ELU(_SameShape):
    """Y = X if X >= 0 else elu_alpha * (e^X - 1); any shape."""

    type_name = "ELU"

    def check_params(self):
        a = self.cfg.elu_alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
            self.fail(f"elu_alpha must be a finite number, got {a!r}")
        self.alpha = float(a)

    def forward(self, tape, xs, run):
        return [ELUFn.apply(tape, xs[0], alpha=self.alpha, name=self.cfg.top_names[0])]

    def json_params(self):
        return {"elu_param": {"alpha": self.alpha}}


class Sigmoid(_SameShape):
    """Y = 1 / (1 + e^-X); any shape."""

    type_name = "Sigmoid"

    def forward(self, tape, xs, run):
        return [SigmoidFn.apply(tape, xs[0], name=self.cfg.top_names[0])]

    def inference_fn(self):
        return op_fn(SigmoidFn)


class ReLUHalf(_SameShape):
    """HugeCTR declares Layer_t.ReLUHalf but builds no layer for it; numbactr runs the fp32 ReLU."""

    type_name = "ReLUHalf"

    def forward(self, tape, xs, run):
        return [ReLUFn.apply(tape, xs[0], name=self.cfg.top_names[0])]

    def inference_fn(self):
        return op_fn(ReLUFn)


class Cast(_SameShape):
    """HugeCTR: fp32 <-> fp16 (direction by mixed-precision mode). numbactr's tape stores activations in
    the run's precision already (autocast: fp16 between layers under use_mixed_precision), so Cast passes
    its input on (no copy, gradient passes through)."""

    type_name = "Cast"

    def forward(self, tape, xs, run):
        return [Identity.apply(tape, xs[0], name=self.cfg.top_names[0])]

    def inference_fn(self):
        return op_fn(Identity)


class Scale(Layer):
    """(B, N) -> (B, N*f) (axis 0: each element repeated f times consecutively) or (B*f, N)
    (axis 1: each row repeated f times); f = int(factor).

    Backward: the sum over the f copies; under hugectr_exact.hugectr_exact(), only the first copy (HugeCTR).
    """

    type_name = "Scale"

    def infer(self):
        self.expect_counts(1)
        (shape,) = self.in_shapes
        if len(shape) != 2:
            self.fail(f"input {self.cfg.bottom_names[0]!r} must be 2-D (B, N), got shape {shape}")
        axis, factor = self.cfg.axis, self.cfg.factor
        if axis not in (0, 1) or isinstance(axis, bool):
            self.fail(f"axis must be 0 (repeat elements) or 1 (repeat rows), got {axis!r}")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
            self.fail(f"factor must be a number, got {factor!r}")
        f = int(factor)  # HugeCTR casts the float to int
        if f < 1:
            self.fail(f"factor must be >= 1 after the cast to int, got factor={factor!r} -> {f}")
        self.axis, self.f = axis, f
        b, n = shape
        return [(b, n * f) if axis == 0 else (b * f, n)]

    def forward(self, tape, xs, run):
        return [
            ScaleFn.apply(
                tape,
                xs[0],
                axis=self.axis,
                factor=self.f,
                first_only=hugectr_exact.hugectr_exact(),
                name=self.cfg.top_names[0],
            )
        ]

    def json_params(self):
        return {"scale_param": {"axis": self.axis, "factor": float(self.cfg.factor)}}


class Dropout(_SameShape):
    """Train: keep each element with probability 1 - dropout_rate, scale kept ones by 1/(1-rate);
    eval: identity. Any shape (HugeCTR drops elementwise over the whole tensor).

    The mask is a hash of (run.seed, run.step, layer_id, flat element index) computed in the kernel
    (kernels/dropout.py): gpu, sim and cpu draw the same mask, and every step draws a new one.
    ``layer_id`` defaults to the CRC32 of the top name (stable across runs and graph edits); the
    model may overwrite it, e.g. with the layer's index.
    """

    type_name = "Dropout"

    def check_params(self):
        r = self.cfg.dropout_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < r < 1.0:
            self.fail(f"dropout_rate must be in (0, 1), got {r!r}")
        self.rate = float(r)
        self.layer_id = zlib.crc32(self.cfg.top_names[0].encode("utf-8"))

    def forward(self, tape, xs, run):
        name = self.cfg.top_names[0]
        if not run.training:
            return [Identity.apply(tape, xs[0], name=name)]
        return [
            DropoutFn.apply(
                tape, xs[0], rate=self.rate, seed=int(run.seed), layer_id=int(self.layer_id), name=name,
                **self.step_params(run),
            )
        ]  # fmt: skip

    def step_params(self, run) -> dict:
        # on gpu/sim the step in device memory: the same launch every step
        return {"step": dropout_step(self, int(run.step))}

    def inference_fn(self):
        return op_fn(Identity)  # no mask without training, as forward()

    def json_params(self):
        return {"rate": self.rate}


class WeightMultiply(Layer):
    """X (B, S) -> Y (B, S*V), Y[b, s*V+v] = X[b, s] * W[s, v]; weight_dims = [S, V], weight W (S, V).

    Init (weight_init_type): Default / XavierUniform U(+-sqrt(6/(S+S*V))), XavierNorm
    N(0, sqrt(2/(S+S*V))/0.8796), Uniform U(+-1/(S+S*V)), Zero.
    """

    type_name = "WeightMultiply"

    def infer(self):
        self.expect_counts(1)
        (shape,) = self.in_shapes
        name = self.cfg.bottom_names[0]
        if len(shape) != 2:
            self.fail(f"input {name!r} must be 2-D (B, S), got shape {shape}")
        dims = list(self.cfg.weight_dims)
        if len(dims) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
            self.fail(f"weight_dims must be two positive ints [S, V], got {self.cfg.weight_dims!r}")
        if dims[0] != shape[1]:
            self.fail(f"weight_dims[0] = {dims[0]} must equal the width S = {shape[1]} of input {name!r} {shape}")
        if self.cfg.weight_init_type not in (
            Initializer_t.Default,
            Initializer_t.XavierUniform,
            Initializer_t.XavierNorm,
            Initializer_t.Uniform,
            Initializer_t.Zero,
        ):
            self.fail(f"weight_init_type {self.cfg.weight_init_type!r} is not a weight initializer")
        self.s, self.v = dims
        return [(shape[0], self.s * self.v)]

    def param_shapes(self):
        return [(self.s, self.v)]

    def init_params(self, rng):
        return [init.weight_multiply_weight(rng, self.s, self.v, self.cfg.weight_init_type)]

    def forward(self, tape, xs, run):
        return [WeightMultiplyFn.apply(tape, xs[0], self.params[0], name=self.cfg.top_names[0])]

    def inference_fn(self):
        return op_fn(WeightMultiplyFn, self.params[0])

    def json_params(self):
        p = {"weight_dims": [self.s, self.v]}
        if "weight_init_type" in self.cfg.given and self.cfg.weight_init_type != Initializer_t.Default:
            p["weight_init"] = self.cfg.weight_init_type.name
        return p


class FmOrder2(Layer):
    """X (B, S*V) -> Y (B, V) with V = out_dim: Y = 0.5 * ((sum_s x_s)^2 - sum_s x_s^2) per component."""

    type_name = "FmOrder2"

    def infer(self):
        self.expect_counts(1)
        (shape,) = self.in_shapes
        name = self.cfg.bottom_names[0]
        if len(shape) != 2:
            self.fail(f"input {name!r} must be 2-D (B, S*V), got shape {shape}")
        v = self.cfg.out_dim
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            self.fail(f"out_dim must be a positive int (the embedding width V), got {v!r}")
        if shape[1] % v:
            self.fail(f"width {shape[1]} of input {name!r} {shape} is not a multiple of out_dim = {v}")
        self.v = v
        return [(shape[0], v)]

    def forward(self, tape, xs, run):
        return [FmOrder2Fn.apply(tape, xs[0], out_dim=self.v, name=self.cfg.top_names[0])]

    def inference_fn(self):
        return op_fn(FmOrder2Fn, out_dim=self.v)

    def json_params(self):
        return {"out_dim": self.v}


LAYERS = {
    Layer_t.Add: Add,
    Layer_t.Sub: Sub,
    Layer_t.ElementwiseMultiply: ElementwiseMultiply,
    Layer_t.ELU: ELU,
    Layer_t.Sigmoid: Sigmoid,
    Layer_t.ReLUHalf: ReLUHalf,
    Layer_t.Cast: Cast,
    Layer_t.Scale: Scale,
    Layer_t.Dropout: Dropout,
    Layer_t.WeightMultiply: WeightMultiply,
    Layer_t.FmOrder2: FmOrder2,
}
