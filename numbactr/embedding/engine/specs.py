"""The engine's specs: what a caller describes (tables, optimizer) and what a lookup and a backward hand back.

TableSpec and OptimizerSpec are checked here (_as_table, _check_optimizer) so that every face and the tiered
engine refuse the same bad settings with the same words; state_specs(opt) is the one place that says which
optimizer state buffers an engine keeps, in split_optimizer_states order. The enums (Pooling, Layout,
BoundsCheck, Precision, Optim, UpdateType, WeightDecay, CounterWeightDecay) live in the lowest layer,
numbactr.kernels.tbe_math, CounterRegularization and EmbeddingBoundsError in numbactr.kernels.tbe_ref; all
are re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import numpy as np

from numbactr.runtime import device
from numbactr.kernels import tbe
from numbactr.kernels.tbe import (
    BoundsCheck as BoundsCheck,
    CounterRegularization,
    CounterWeightDecay,  # noqa: F401
    EmbeddingBoundsError as EmbeddingBoundsError,
    Layout as Layout,
    Optim,
    Pooling,
    Precision as Precision,
    UpdateType,
    WeightDecay,
)

IMPLS = ("ref", "cpu", "kernels")
MAX_DIM = 65535  # stochastic rounding hashes (linear row << 16 | d)


@dataclass(frozen=True)
class TableSpec:
    """One physical table: rows x dim. keyed: indices are keys mapped to rows by a hash table holding at
    most `rows` keys; new rows start U(init_range) from a hash of (seed, key)."""

    rows: int
    dim: int
    keyed: bool = False
    init_range: tuple = (-0.05, 0.05)


@dataclass(frozen=True)
class OptimizerSpec:
    """The fused optimizer and its hyper-parameters (FBGEMM's names; HugeCTR's where FBGEMM has none).

    momentum: HugeCTR's momentum_factor (MomentumSGD, Nesterov); LARS_SGD's momentum. eta: LARS_SGD's
    trust coefficient (its row rate is learning_rate eta |w| / (|g| + weight_decay |w|)).
    initial_accumulator: HugeCTR AdaGrad's initial_accu_value. scaler: HugeCTR's loss scaler (HugeCTR kinds
    divide the gradient by it).
    update_type: HugeCTR's Update_t (LOCAL, GLOBAL, LAZY_GLOBAL (Adam only)); FBGEMM's kinds are LOCAL.
    gradient_clipping: clamp dLoss/dout elementwise to [-max_gradient, max_gradient] before the backward
    (FBGEMM's rule: the bags' gradients are clipped, not the rows' sums).
    max_norm > 0: rescale every updated row whose L2 norm exceeds it (FBGEMM applies it for
    EXACT_ROWWISE_ADAGRAD only; the engine for every kind, the face passes 0 where FBGEMM ignores it).
    counter: the settings of weight_decay_mode COUNTER / COWCLIP (EXACT_ROWWISE_ADAGRAD with two more
    per-row states, prev_iter and row_counter; FBGEMM's rowwise_adagrad_with_counter).
    rowwise_bias_correction (ADAM): Adam's bias corrections use each row's own update count, kept in a
    per-row row_counter, instead of the step t (FBGEMM's UserEnabledConfigDefinition).
    prev_iter_state: keep a per-row float32 prev_iter after the kind's states, which the update kernels do
    not read: FBGEMM's global weight decay (WeightDecayMode.DECOUPLE_GLOBAL, EXACT_ROWWISE_ADAGRAD) records
    there the iteration each row was last decayed at (numbactr/fbgemm_gpu/tbe_optimizer.py applies the decay
    with TableBatchedEmbedding.scale_rows).
    beta, lambda1, lambda2: HUGECTR_FTRL's (HugeCTR's names; LOCAL only, per-element states z and n).

    Frozen: a change is a new spec (``dataclasses.replace``; the engine's setters do so), for the engine
    keeps what it derives from a spec while the spec is the same object (TableBatchedEmbedding._step_constants).
    """

    kind: Optim = Optim.EXACT_SGD
    learning_rate: float = 0.01
    eps: float = 1.0e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    weight_decay_mode: WeightDecay = WeightDecay.NONE
    momentum: float = 0.0
    initial_accumulator: float = 0.0
    update_type: UpdateType = UpdateType.LOCAL
    scaler: float = 1.0
    gradient_clipping: bool = False
    max_gradient: float = 1.0
    max_norm: float = 0.0
    counter: CounterRegularization | None = None
    rowwise_bias_correction: bool = False
    prev_iter_state: bool = False
    eta: float = 0.001
    beta: float = 0.0
    lambda1: float = 0.0
    lambda2: float = 0.0

    def hp(self) -> dict:
        """The float hyper-parameters by name (kernels.tbe.HP_FIELDS)."""
        return {name: float(getattr(self, name)) for name in tbe.HP_FIELDS}


@dataclass
class SparseRowGrad:
    """Row gradients of optimizer NONE: rows (U,) linear row ids ascending (row_offsets[t] + local row),
    values (U, max D) float32, zero beyond a row's own width."""

    rows: object
    values: object
    row_offsets: np.ndarray

    def per_table(self) -> list:
        """[(rows (U_t,) local to table t, values (U_t, D_max)) for every table t]."""
        rows, vals = device.to_host(self.rows), device.to_host(self.values)
        tab = np.searchsorted(self.row_offsets, rows, side="right") - 1
        return [(rows[tab == t] - self.row_offsets[t], vals[tab == t]) for t in range(len(self.row_offsets) - 1)]


@dataclass
class Grads:
    per_sample_weights: object = None
    sparse: SparseRowGrad | None = None


@dataclass
class FloatRows:
    """Float32 rows standing in for the engine's weights in one forward (INT8 weights, dequantized): the
    flat buffer, (T + 1,) element offsets and (T,) row strides, in the engine's layout (host arrays for
    the offsets and strides; the impl moves them where its kernels need them)."""

    weights: object
    elem_offsets: np.ndarray
    strides: np.ndarray


@dataclass
class LookupContext:
    """What a forward leaves for its backward: the bounds-checked rows (N,) int64 (local rows, -1 = none),
    repaired offsets (F*B + 1,) int64, per-sample weights (N,) float32 or None, batch B, pooling. extra: what
    the engine keeps beside (new rows, segments) and what a caller knows: "touched_rows", the number of
    distinct rows the lookup touched, spares optimizer NONE's backward its one host read."""

    rows: object
    offsets: object
    per_sample_weights: object
    batch: int
    pooling: Pooling
    feature_requires_grad: object = None
    extra: dict = field(default_factory=dict)


def _as_table(t) -> TableSpec:
    spec = t if isinstance(t, TableSpec) else TableSpec(*t)
    if int(spec.rows) < 0 or not 1 <= int(spec.dim) <= MAX_DIM:
        raise ValueError(f"table {spec}: rows must be >= 0 and dim in 1..{MAX_DIM}")
    lo, hi = spec.init_range
    if not lo <= hi:
        raise ValueError(f"table {spec}: init_range must be (lo, hi) with lo <= hi")
    return replace(spec, rows=int(spec.rows), dim=int(spec.dim))


def _check_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    spec = replace(
        spec,
        kind=Optim(spec.kind),
        update_type=UpdateType(spec.update_type),
        weight_decay_mode=WeightDecay(spec.weight_decay_mode),
    )
    k, u = spec.kind, spec.update_type
    bad = {
        f.name: getattr(spec, f.name)
        for f in fields(spec)
        if f.type in ("float", float) and not math.isfinite(float(getattr(spec, f.name)))
    }
    if bad:
        raise ValueError(f"optimizer {k.name}: hyper-parameter(s) {bad} must be finite numbers")
    if u != UpdateType.LOCAL and k not in tbe.HUGECTR_KINDS:
        raise ValueError(
            f"optimizer {k.name}: update_type {u.name} is HugeCTR's SparseEmbedding's; {k.name} is LOCAL only"
        )
    if u == UpdateType.LAZY_GLOBAL and k != Optim.HUGECTR_ADAM:
        raise ValueError(f"optimizer {k.name}: LAZY_GLOBAL is only defined for HUGECTR_ADAM (as in HugeCTR)")
    if k == Optim.HUGECTR_ADAM and u == UpdateType.GLOBAL and (spec.beta1 == 0 or spec.beta2 == 0):
        raise ValueError(
            "optimizer HUGECTR_ADAM with GLOBAL update needs beta1 > 0 and beta2 > 0 (HugeCTR "
            "divides the touched rows' moment increments by them)"
        )
    if spec.weight_decay_mode != WeightDecay.NONE and k != Optim.EXACT_ROWWISE_ADAGRAD:
        raise ValueError(
            f"optimizer {k.name}: weight_decay_mode {spec.weight_decay_mode.name} is only "
            "defined for EXACT_ROWWISE_ADAGRAD (ADAM/LAMB kinds take weight_decay as decoupled)"
        )
    if spec.scaler == 0:
        raise ValueError("optimizer scaler must be non-zero (the gradient is divided by it)")
    counted = spec.weight_decay_mode in (WeightDecay.COUNTER, WeightDecay.COWCLIP)
    if counted != (spec.counter is not None):
        raise ValueError(
            f"weight_decay_mode {spec.weight_decay_mode.name}: the counter settings "
            "(OptimizerSpec.counter) go with COUNTER / COWCLIP and only with them"
        )
    if counted:
        c = spec.counter
        if not isinstance(c, CounterRegularization):
            raise TypeError(f"OptimizerSpec.counter must be a CounterRegularization, got {type(c).__name__}")
        spec = replace(spec, counter=replace(c, weight_decay_mode=CounterWeightDecay(c.weight_decay_mode)))
        if c.learning_rate_mode not in (-1, 0, 1, 2):
            raise ValueError(
                f"counter learning_rate_mode must be -1, 0, 1 or 2 (FBGEMM's LearningRateMode), "
                f"got {c.learning_rate_mode}"
            )
    if spec.rowwise_bias_correction and k != Optim.ADAM:
        raise ValueError(f"optimizer {k.name}: rowwise_bias_correction is only defined for ADAM (as in FBGEMM)")
    return spec


#: OptimizerSpec fields that shape the optimizer states: fixed once an engine is built
FIXED_HYPER_PARAMETERS = ("kind", "update_type", "initial_accumulator", "rowwise_bias_correction", "prev_iter_state")


def state_specs(opt: OptimizerSpec) -> list:
    """The optimizer's state buffers, [(name, per_row, dtype)] in split_optimizer_states order: the kind's
    (kernels.tbe.STATES), then HugeCTR LAZY_GLOBAL's prev_step, COUNTER / COWCLIP's prev_iter and row_counter,
    or rowwise-bias-corrected ADAM's row_counter; a prev_iter_state's prev_iter."""
    specs = list(tbe.STATES[opt.kind])
    if opt.update_type == UpdateType.LAZY_GLOBAL:
        specs.append(tbe.LAZY_PREV_STEP)
    if opt.counter is not None:
        specs += [tbe.PREV_ITER, tbe.ROW_COUNTER]
    if opt.rowwise_bias_correction:
        specs.append(tbe.ROW_COUNTER)
    if opt.prev_iter_state and opt.counter is None:
        specs.append(tbe.PREV_ITER)
    return specs
