"""Elementwise and small fixed-pattern layers: Add, Sub, ElementwiseMultiply, ELU, Sigmoid, ReLUHalf,
Cast, Scale, Dropout, WeightMultiply, FmOrder2.

Each layer has an autograd Function on raw arrays: numba.cuda kernels on gpu/sim
(``device.uses_kernels()``), the NumPy references of the same kernel modules on cpu.

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

import numpy as np

from numbactr import hugectr_exact as compat, ops
from numbactr.autograd import Context, Function
from numbactr.autograd.tape import native_dtype as _out, native_inputs as _half
from numbactr.enums import Initializer_t, Layer_t
from numbactr.kernels import dropout as dropout_k
from numbactr.kernels import elementwise as ew
from numbactr.kernels import fm_order2 as fm_k
from numbactr.kernels import scale as scale_k
from numbactr.kernels import weight_multiply as wm_k
from numbactr.layers import init
from numbactr.layers.base import Layer, op_fn
from numbactr.runtime.device import uses_kernels as _kernels, xp as _xp, contig as _contig  # noqa: F401


# ---- autograd Functions ----------------------------------------------------------------------
class Identity(Function):
    """y = x (no copy); the gradient passes through. Cast in fp32 mode, Dropout in eval mode."""

    @staticmethod
    def forward(ctx: Context, x):
        return x

    @staticmethod
    def backward(ctx: Context, dy):
        return dy


def _stacked(xs):
    """(K, M) copy of K same-shape inputs, written by a kernel (one row per input)."""
    out = _xp().empty((len(xs), xs[0].size), np.float32)
    ew.stack([_contig(x) for x in xs], out)
    return out


class AddFn(Function):
    """y = sum of K >= 2 same-shape inputs; every input's gradient is dY (shared, never written)."""

    half_native = True

    @staticmethod
    def forward(ctx: Context, *xs):
        xs = _half(ctx, *xs)
        if _kernels():
            y = _xp().empty(xs[0].shape, _out(ctx))
            ew.add_forward(_stacked(xs), y)
            return y
        return ew.add_forward_ref(xs)

    @staticmethod
    def backward(ctx: Context, dy):
        return tuple(dy if need else None for need in ctx.needs_input_grad)


class SubFn(Function):
    half_native = True

    @staticmethod
    def forward(ctx: Context, a, b):
        a, b = _half(ctx, a, b)
        if _kernels():
            y = _xp().empty(a.shape, _out(ctx))
            ew.sub_forward(_contig(a), _contig(b), y)
            return y
        return ew.sub_forward_ref(a, b)

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        if _kernels():
            da, db = _xp().empty_like(dy), _xp().empty_like(dy)
            ew.sub_backward(_contig(dy), da, db)
            return da, db
        return ew.sub_backward_ref(dy)


class MultiplyFn(Function):
    """y = product of K >= 2 same-shape inputs; ``exact`` picks HugeCTR's quotient gradient."""

    half_native = True                 # gpu/sim: float16 in and out, the (K, M) stacks float32

    @staticmethod
    def forward(ctx: Context, *xs, exact: bool = False):
        xs = _half(ctx, *xs)
        ctx.exact, ctx.shape = exact, xs[0].shape
        if _kernels():
            stacked = _stacked(xs)                             # (K, M)
            y = _xp().empty(xs[0].shape, _out(ctx))
            ew.multiply_forward(stacked, y)
            ctx.stacked = stacked
        else:
            y = ew.multiply_forward_ref(xs)
            ctx.xs = xs
        ctx.y = y
        return y

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        if _kernels():
            dxs = _xp().empty(ctx.stacked.shape, np.float32)  # (K, M)
            ew.multiply_backward(ctx.stacked, _contig(dy), dxs, exact=ctx.exact, y=ctx.y)
            return tuple(dxs[k].reshape(ctx.shape) for k in range(dxs.shape[0]))
        return tuple(ew.multiply_backward_ref(ctx.xs, dy, exact=ctx.exact, y=ctx.y))


class ELUFn(Function):
    half_native = True

    @staticmethod
    def forward(ctx: Context, x, alpha: float = 1.0):
        (x,) = _half(ctx, x)
        ctx.x, ctx.alpha = _contig(x), alpha
        if _kernels():
            y = _xp().empty_like(ctx.x)
            ew.elu_forward(ctx.x, y, alpha)
            return y
        return ew.elu_forward_ref(x, alpha)

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        if _kernels():
            dx = _xp().empty_like(ctx.x)
            ew.elu_backward(ctx.x, _contig(dy), dx, ctx.alpha)
            return dx
        return ew.elu_backward_ref(ctx.x, dy, ctx.alpha)


class SigmoidFn(Function):
    half_native = True

    @staticmethod
    def forward(ctx: Context, x):
        (x,) = _half(ctx, x)
        if _kernels():
            y = _xp().empty(x.shape, _out(ctx))
            ew.sigmoid_forward(_contig(x), y)
        else:
            y = ew.sigmoid_forward_ref(x)
        ctx.y = y
        return y

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        if _kernels():
            dx = _xp().empty_like(ctx.y)
            ew.sigmoid_backward(ctx.y, _contig(dy), dx)
            return dx
        return ew.sigmoid_backward_ref(ctx.y, dy)


class ScaleFn(Function):
    """Repeat elements (axis 0) or rows (axis 1) ``factor`` times; see kernels/scale.py."""

    half_native = True

    @staticmethod
    def forward(ctx: Context, x, axis: int = 0, factor: int = 1, first_only: bool = False):
        (x,) = _half(ctx, x)
        ctx.axis, ctx.factor, ctx.first_only, ctx.in_shape = axis, factor, first_only, x.shape
        if _kernels():
            b, n = x.shape
            y = _xp().empty((b, n * factor) if axis == 0 else (b * factor, n), _out(ctx))
            scale_k.scale_forward(_contig(x), y, axis, factor)
            return y
        return scale_k.scale_forward_ref(x, axis, factor)

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        if _kernels():
            dx = _xp().empty(ctx.in_shape, _out(ctx))
            scale_k.scale_backward(_contig(dy), dx, ctx.axis, ctx.factor, ctx.first_only)
            return dx
        return scale_k.scale_backward_ref(dy, ctx.axis, ctx.factor, ctx.first_only)


class DropoutFn(Function):
    """Training-mode dropout; the backward recomputes the same hash mask (nothing is stored)."""

    half_native = True

    @staticmethod
    def forward(ctx: Context, x, rate: float = 0.5, seed: int = 0, step: int = 0, layer_id: int = 0):
        (x,) = _half(ctx, x)
        ctx.args = (rate, seed, step, layer_id)
        if _kernels():
            y = _xp().empty(x.shape, _out(ctx))
            dropout_k.dropout_apply(_contig(x), y, *ctx.args)
            return y
        return dropout_k.dropout_forward_ref(x, *ctx.args)

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        if _kernels():
            dx = _xp().empty(dy.shape, _out(ctx))
            dropout_k.dropout_apply(_contig(dy), dx, *ctx.args)
            return dx
        return dropout_k.dropout_backward_ref(dy, *ctx.args)


class WeightMultiplyFn(Function):
    """x (B, S), W (S, V) -> (B, S*V)."""

    half_native = True                 # gpu/sim: float16 x and y, float32 W and dW

    @staticmethod
    def forward(ctx: Context, x, w):
        (x,) = _half(ctx, x)
        ctx.x, ctx.w = _contig(x), _contig(w)
        if _kernels():
            y = _xp().empty((x.shape[0], w.size), _out(ctx))
            wm_k.weight_multiply_forward(ctx.x, ctx.w, y)
            return y
        return wm_k.weight_multiply_forward_ref(ctx.x, ctx.w)

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        if _kernels():
            xp = _xp()
            dx = xp.empty_like(ctx.x) if ctx.needs_input_grad[0] else None
            dw = xp.empty_like(ctx.w)
            wm_k.weight_multiply_backward(ctx.x, ctx.w, _contig(dy), dx, dw)
            return dx, dw
        dx, dw = wm_k.weight_multiply_backward_ref(ctx.x, ctx.w, dy)
        return (dx if ctx.needs_input_grad[0] else None), dw


class FmOrder2Fn(Function):
    """x (B, S*V) -> (B, V)."""

    half_native = True

    @staticmethod
    def forward(ctx: Context, x, out_dim: int = 1):
        (x,) = _half(ctx, x)
        ctx.x, ctx.out_dim = _contig(x), out_dim
        if _kernels():
            y = _xp().empty((x.shape[0], out_dim), _out(ctx))
            fm_k.fm_order2_forward(ctx.x, y)
            return y
        return fm_k.fm_order2_forward_ref(ctx.x, out_dim)

    @staticmethod
    def backward(ctx: Context, dy):
        (dy,) = _half(ctx, dy)
        if _kernels():
            dx = _xp().empty_like(ctx.x)
            fm_k.fm_order2_backward(ctx.x, _contig(dy), dx)
            return dx
        return fm_k.fm_order2_backward_ref(ctx.x, dy, ctx.out_dim)


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
                self.fail(f"input {name!r} has shape {s}, but {names[0]!r} has {shapes[0]}: all inputs "
                          "must have the same shape")
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

    Backward: product rule dX_i = dY * prod_{j!=i} X_j; under compat.hugectr_exact(), HugeCTR's
    dX_i = dY * (Y / X_i) with dX_i = 0 for every i wherever Y == 0.
    """
    type_name = "ElementwiseMultiply"
    min_bottoms, max_bottoms = 2, 1 << 30

    def forward(self, tape, xs, run):
        return [MultiplyFn.apply(tape, *xs, exact=compat.hugectr_exact(), name=self.cfg.top_names[0])]

    def inference_fn(self):
        return lambda xs: [MultiplyFn.forward(Context(), *xs, exact=compat.hugectr_exact())]


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
        return [ops.ReLU.apply(tape, xs[0], name=self.cfg.top_names[0])]

    def inference_fn(self):
        return op_fn(ops.ReLU)


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

    Backward: the sum over the f copies; under compat.hugectr_exact(), only the first copy (HugeCTR).
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
        f = int(factor)                                        # HugeCTR casts the float to int
        if f < 1:
            self.fail(f"factor must be >= 1 after the cast to int, got factor={factor!r} -> {f}")
        self.axis, self.f = axis, f
        b, n = shape
        return [(b, n * f) if axis == 0 else (b * f, n)]

    def forward(self, tape, xs, run):
        return [ScaleFn.apply(tape, xs[0], axis=self.axis, factor=self.f, first_only=compat.hugectr_exact(),
                              name=self.cfg.top_names[0])]

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
        step = int(run.step)
        if _kernels():                    # the step in device memory: the same launch every step
            from numbactr.runtime import step_values
            sv = step_values.held(self, "_step_values", 1, np.uint64)
            step = sv.put(step & dropout_k.MASK64)
            step_values.on_replay(("dropout", id(self)), lambda r: sv.put(int(r["step"]) & dropout_k.MASK64))
        return [DropoutFn.apply(tape, xs[0], rate=self.rate, seed=int(run.seed), step=step,
                                layer_id=int(self.layer_id), name=name)]


    def inference_fn(self):
        return op_fn(Identity)                          # no mask without training, as forward()
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
            self.fail(f"weight_dims[0] = {dims[0]} must equal the width S = {shape[1]} of input "
                      f"{name!r} {shape}")
        if self.cfg.weight_init_type not in (Initializer_t.Default, Initializer_t.XavierUniform,
                                             Initializer_t.XavierNorm, Initializer_t.Uniform,
                                             Initializer_t.Zero):
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
