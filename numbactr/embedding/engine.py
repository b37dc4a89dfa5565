"""The table-batched embedding engine: every embedding-shaped op of numbactr runs here.

Contract (the math is in numbactr/kernels/tbe.py's docstring; this is the interface):

    eng = TableBatchedEmbedding(
        tables=[(rows, dim), ...] or [TableSpec(rows, dim, keyed=False, init_range=(-0.05, 0.05)), ...],
        feature_table_map=None,             # feature f reads table feature_table_map[f]; None: f -> f
        pooling=Pooling.SUM,                # SUM | MEAN | NONE (sequence embeddings, one row per index)
        optimizer=OptimizerSpec(Optim.EXACT_SGD, learning_rate=0.01, ...),
        weights_precision=Precision.FP32,   # FP32 | FP16 (updates stochastically rounded by default) | INT8
                                            # (FBGEMM's fused 8-bit rows, kernels/fused8bit.py: forward only)
        output_dtype=Precision.FP32,        # FP32 | FP16
        bounds_check=BoundsCheck.WARNING,   # FATAL | WARNING | IGNORE | NONE (FBGEMM's modes)
        stochastic_rounding=True,
        layout=Layout.FEATURE_MAJOR,        # CSR bag order: f*B + b (FBGEMM) or b*F + f (HugeCTR)
        seed=0,                             # stochastic rounding and keyed-row initialization
        impl=None)                          # "ref" | "cpu" | "kernels"; None: the device's (see below)
    out, ctx = eng.forward(indices, offsets, per_sample_weights=None, training=True,
                           pooling=None, feature_requires_grad=None)
        indices (N,) int32/int64 (keys of keyed tables may also be uint64), offsets (F*B + 1,) int32/int64,
        per_sample_weights (N,) float. out: (B, sum_f D_f) pooled ((B, F, D) when all D are equal and
        reshaped), or (N, D) for NONE; float32 or float16. ctx: what backward needs (a LookupContext).
    grads = eng.backward(ctx, grad_output)
        applies the fused update (sort/segment by row, deterministic per-row sum, optimizer, in one pass)
        and returns Grads(per_sample_weights=(N,) or None, sparse=SparseRowGrad or None (optimizer NONE)).
    eng.split_weights() -> [(V_t, D_t) views]    eng.split_optimizer_states() -> [[state views] per table]
    eng.learning_rate (settable), eng.step (updates done; settable), eng.set_hyper_parameters(**values),
    eng.init_uniform(lo, hi, seed), eng.bounds_warnings (bad indices/offsets seen under WARNING)

Storage: one weights buffer for all tables, row r of table t at elem_offset[t] + r * stride[t], the stride
the width padded to 16 bytes (4 float32 or 8 float16) so every row starts aligned on the kernel path;
per-element optimizer states (float32) share those offsets, per-row states use row_offset[t] + r. The
linear row id of (t, r) is row_offset[t] + r (FBGEMM's hash_size_cumsum indexing). INT8 weights: rows of
D_t + 8 bytes (D_t uint8, float32 scale, float32 bias; D_t a multiple of 4), unpadded as FBGEMM's; a lookup
dequantizes the rows it touches into a float32 block of the same layout and pools that (every impl), and a
backward raises NotImplementedError (as FBGEMM's CPU TBE does for INT8).

Keyed tables (HugeCTR's hash embeddings): the feature's indices are keys; the engine maps them to rows with
numbactr.embedding.hash_table.HashTable (training inserts: new keys take the next rows in order of first
occurrence, initialized U(init_range) from a hash of (seed, key); evaluation finds: a missing key is row
-1, which contributes zero but still counts in a MEAN bag's length, HugeCTR's rule, while an unkeyed
table's MEAN divides by the bag length as FBGEMM does; the two agree because -1 rows count). The forward's
insert gives each occurrence its row, so the backward needs no second table.

Steps: `step` counts updates; an update uses t = step + 1 (Adam's bias correction, stochastic rounding's
random stream). FBGEMM increments its `iter` in forward instead: a face that wants FBGEMM's count after
several forwards per backward sets `step`.

Devices: impl "kernels" (the default on gpu and sim) launches the numba.cuda kernels of
numbactr.kernels.tbe, "cpu" (the default on the cpu device) runs the numba-compiled CPU code of
numbactr.kernels.tbe_cpu, "ref" the NumPy reference (the test oracle). All three give the same result to
float32 rounding (float16 weights: to one float16 step per update); every row's gradient is summed in
occurrence order in all of them, so a step is deterministic. A kernels step launches one kernel per op for
all tables (counted in numbactr.kernels.launch.COUNTS on the sim device) and reads nothing back to the host,
except: bounds_check FATAL / WARNING read one status array per forward (to raise or warn at once), optimizer
NONE reads the number of touched rows to size its result, and keyed tables read the hash table's new-key
count (and do their key bookkeeping on the host).

Bounds check order: offsets are repaired and every unkeyed index checked before a keyed table is touched,
so a FATAL batch raises with the hash tables unchanged.
"""
from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass, field, fields, replace

import numba
import numpy as np

from numbactr.runtime import device
from numbactr.runtime.hostmem import HUGE_MIN_BYTES, check_fits, host_zeros, huge_pages_wanted
from numbactr.kernels import embedding_init as EI
from numbactr.kernels import fused8bit as Q8
from numbactr.kernels import nbit_rows as NB
from numbactr.kernels import tbe as K
from numbactr.kernels import tbe_cpu as C
from numbactr.kernels.tbe import (BoundsCheck, CounterRegularization, CounterWeightDecay, EmbeddingBoundsError, Layout,
                           Optim, Pooling, Precision, UpdateType, WeightDecay)
from numbactr.embedding.hash_table import HashTable

__all__ = ["TableBatchedEmbedding", "TableSpec", "OptimizerSpec", "LookupContext", "Grads", "SparseRowGrad",
           "Pooling", "Layout", "BoundsCheck", "Precision", "Optim", "UpdateType", "WeightDecay",
           "CounterRegularization", "CounterWeightDecay", "EmbeddingBoundsError", "IMPLS"]

IMPLS = ("ref", "cpu", "kernels")
MAX_DIM = 65535            # stochastic rounding hashes (linear row << 16 | d)


@dataclass(frozen=True)
class TableSpec:
    """One physical table: rows x dim. keyed: indices are keys mapped to rows by a hash table holding at
    most `rows` keys; new rows start U(init_range) from a hash of (seed, key)."""
    rows: int
    dim: int
    keyed: bool = False
    init_range: tuple = (-0.05, 0.05)


@dataclass
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
    there the iteration each row was last decayed at (numbactr/fbgemm_gpu/array_tbe.py applies the decay).
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

    def hp(self) -> dict:
        """The float hyper-parameters by name (kernels.tbe.HP_FIELDS)."""
        return {name: float(getattr(self, name)) for name in K.HP_FIELDS}


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


def _zeros(n: int, dtype, huge: bool = True):
    """A zeroed buffer for the tables, their states and the step's scratch: device memory on a GPU; on the
    host numbactr.runtime.hostmem.host_zeros (2 MiB-aligned transparent huge pages for big buffers: random row
    access 1.3-1.5x faster than 4 KiB pages on the measured VM; NUMBACTR_HUGE_PAGES=0 declines them)."""
    xp = device.xp()
    if xp is not np or n == 0:
        return xp.zeros(n, dtype)
    return host_zeros(n, dtype, huge)


DECODE_CHUNK_ELEMS = 1 << 22      # values per chunk an INT8 lookup decodes at a time (its temporaries ~50 MB)
FILL_CHUNK_ELEMS = 1 << 22         # values per chunk of fill_uniform_rows: its temporaries stay near 200 MB


def fill_uniform_rows(view, first_lin: int, seed: int, lo: float, hi: float, row_scale=None,
                      what: str = "an embedding table") -> None:
    """view (V, D) = U(lo, hi) from the hash of (seed, first_lin + row, d) (kernels.embedding_init), times
    row_scale[row] ((V,) float32) where given: the same values on every device. It runs in chunks of rows,
    because the hash's NumPy reference holds several 8-byte temporaries per value (a whole table at once
    needed 6x the table's size), and first checks that the host memory it will touch is there (a table
    initialized past the machine's memory is otherwise killed by the kernel without a word)."""
    V, D = view.shape
    xp = np if device.is_host_array(view) else device.xp()     # (a tiered table's rows are host memory)
    if xp is np:
        check_fits(V * D * view.dtype.itemsize, f"initializing {what} ({V} rows x {D})",
                   "shrink the table (slot_size_array, max_vocabulary_size) or keep it in a tiered store "
                   "(numbactr.embedding.tiered)")
    step = max(1, FILL_CHUNK_ELEMS // max(D, 1))
    for a in range(0, V, step):
        b = min(V, a + step)
        vals = EI.row_values_ref(np.arange(first_lin + a, first_lin + b, dtype=np.uint64), D, seed, lo, hi)
        if row_scale is not None:
            vals *= row_scale[a:b, None]
        view[a:b] = xp.asarray(vals.astype(view.dtype, copy=False))


def _wants_huge_copy(a, reads: int, huge: bool) -> bool:
    """Whether a host array read at `reads` random rows is worth copying into the scratch pool's huge pages
    first: when it is big, and read at least once per 64 bytes (each random read costs a page walk in 4 KiB
    pages; the copy costs its bytes. One-hot bags at D = 64 read a quarter of that: there the 54 MB copy
    made the backward 29 -> 34 ms, where at D = 16 it made it 24 -> 14 ms)."""
    return huge and a.dtype == np.float32 and a.nbytes >= HUGE_MIN_BYTES and reads * 64 >= a.nbytes


def _copy_to(dst, src):
    np.copyto(dst, src)
    return dst


def _as_table(t) -> TableSpec:
    spec = t if isinstance(t, TableSpec) else TableSpec(*t)
    if int(spec.rows) < 0 or not 1 <= int(spec.dim) <= MAX_DIM:
        raise ValueError(f"table {spec}: rows must be >= 0 and dim in 1..{MAX_DIM}")
    lo, hi = spec.init_range
    if not lo <= hi:
        raise ValueError(f"table {spec}: init_range must be (lo, hi) with lo <= hi")
    return replace(spec, rows=int(spec.rows), dim=int(spec.dim))


def _check_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    spec = replace(spec, kind=Optim(spec.kind), update_type=UpdateType(spec.update_type),
                   weight_decay_mode=WeightDecay(spec.weight_decay_mode))
    k, u = spec.kind, spec.update_type
    bad = {f.name: getattr(spec, f.name) for f in fields(spec) if f.type in ("float", float)
           and not math.isfinite(float(getattr(spec, f.name)))}
    if bad:
        raise ValueError(f"optimizer {k.name}: hyper-parameter(s) {bad} must be finite numbers")
    if u != UpdateType.LOCAL and k not in K.HUGECTR_KINDS:
        raise ValueError(f"optimizer {k.name}: update_type {u.name} is HugeCTR's; FBGEMM's optimizers are LOCAL")
    if u == UpdateType.LAZY_GLOBAL and k != Optim.HUGECTR_ADAM:
        raise ValueError(f"optimizer {k.name}: LAZY_GLOBAL is only defined for HUGECTR_ADAM (as in HugeCTR)")
    if k == Optim.HUGECTR_ADAM and u == UpdateType.GLOBAL and (spec.beta1 == 0 or spec.beta2 == 0):
        raise ValueError("optimizer HUGECTR_ADAM with GLOBAL update needs beta1 > 0 and beta2 > 0 (HugeCTR "
                         "divides the touched rows' moment increments by them)")
    if spec.weight_decay_mode != WeightDecay.NONE and k != Optim.EXACT_ROWWISE_ADAGRAD:
        raise ValueError(f"optimizer {k.name}: weight_decay_mode {spec.weight_decay_mode.name} is only "
                         "defined for EXACT_ROWWISE_ADAGRAD (ADAM/LAMB kinds take weight_decay as decoupled)")
    if spec.scaler == 0:
        raise ValueError("optimizer scaler must be non-zero (the gradient is divided by it)")
    counted = spec.weight_decay_mode in (WeightDecay.COUNTER, WeightDecay.COWCLIP)
    if counted != (spec.counter is not None):
        raise ValueError(f"weight_decay_mode {spec.weight_decay_mode.name}: the counter settings "
                         "(OptimizerSpec.counter) go with COUNTER / COWCLIP and only with them")
    if counted:
        c = spec.counter
        if not isinstance(c, CounterRegularization):
            raise TypeError(f"OptimizerSpec.counter must be a CounterRegularization, got {type(c).__name__}")
        spec = replace(spec, counter=replace(c, weight_decay_mode=CounterWeightDecay(c.weight_decay_mode)))
        if c.learning_rate_mode not in (-1, 0, 1, 2):
            raise ValueError(f"counter learning_rate_mode must be -1, 0, 1 or 2 (FBGEMM's LearningRateMode), "
                             f"got {c.learning_rate_mode}")
    if spec.rowwise_bias_correction and k != Optim.ADAM:
        raise ValueError(f"optimizer {k.name}: rowwise_bias_correction is only defined for ADAM (as in FBGEMM)")
    return spec


#: OptimizerSpec fields that shape the optimizer states: fixed once an engine is built
FIXED_HYPER_PARAMETERS = ("kind", "update_type", "initial_accumulator", "rowwise_bias_correction", "prev_iter_state")


def state_specs(opt: OptimizerSpec) -> list:
    """The optimizer's state buffers, [(name, per_row, dtype)] in split_optimizer_states order: the kind's
    (kernels.tbe.STATES), then HugeCTR LAZY_GLOBAL's prev_step, COUNTER / COWCLIP's prev_iter and row_counter,
    or rowwise-bias-corrected ADAM's row_counter; a prev_iter_state's prev_iter."""
    specs = list(K.STATES[opt.kind])
    if opt.update_type == UpdateType.LAZY_GLOBAL:
        specs.append(K.LAZY_PREV_STEP)
    if opt.counter is not None:
        specs += [K.PREV_ITER, K.ROW_COUNTER]
    if opt.rowwise_bias_correction:
        specs.append(K.ROW_COUNTER)
    if opt.prev_iter_state and opt.counter is None:
        specs.append(K.PREV_ITER)
    return specs


class TableBatchedEmbedding:
    """Many tables, many features, one lookup and one fused update per step. See the module docstring."""

    #: see __init__ (class defaults too: engines built another way, e.g. TieredEmbedding, never defer)
    defer_checks = False
    _bounds_rec = None

    def __init__(self, tables, feature_table_map=None, *, pooling=Pooling.SUM,
                 optimizer: OptimizerSpec | None = None, weights_precision=Precision.FP32,
                 output_dtype=Precision.FP32, bounds_check=BoundsCheck.WARNING,
                 stochastic_rounding: bool = True, layout=Layout.FEATURE_MAJOR, seed: int = 0,
                 impl: str | None = None, pad_rows: bool = True, row_codecs=None, table_align: int = 1):
        self.tables = [_as_table(t) for t in tables]
        if not self.tables:
            raise ValueError("TableBatchedEmbedding needs at least one table")
        n_tables = len(self.tables)
        ftable = list(range(n_tables)) if feature_table_map is None else [int(t) for t in feature_table_map]
        if not ftable:
            raise ValueError("feature_table_map is empty: at least one feature must read a table")
        bad = [t for t in ftable if not 0 <= t < n_tables]
        if bad:
            raise ValueError(f"feature_table_map names table(s) {bad}; there are {n_tables} tables")
        self.feature_table_map = ftable
        self.pooling = Pooling(pooling)
        self.weights_precision = Precision(weights_precision)
        self.output_dtype = Precision(output_dtype)
        if self.output_dtype == Precision.INT8:
            raise ValueError("output_dtype INT8 is not supported: the pooled output is FP32 or FP16")
        self.bounds_check = BoundsCheck(bounds_check)
        self.layout = Layout(layout)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = int(seed)
        self.optimizer = _check_optimizer(optimizer or OptimizerSpec())
        self.impl = self._pick_impl(impl)
        self.step = 0
        self.bounds_warnings = 0
        # gate: None, or a numbactr.runtime.precision.Gate set by a caller for one update (kernels only): its go = 0
        # makes the step's update kernels change nothing (kernels.tbe_math.KI_GO), and the step-dependent
        # scalars (bias corrections, KI_STEP) are computed on the device for the steps that did update
        # (kernels.tbe.gate_scalars; stochastic rounding's salts still count every step). Mixed precision
        # skips a step whose gradients overflowed that way, decided on the device (numbactr.model, _gate)
        self.gate = None
        # defer_checks (kernels only, set by a caller that reads them at its own check points, e.g. HugeCTR's
        # SparseEmbedding in a training step): the bounds check's status and the hash tables' errors and sizes
        # stay on the device and check_deferred() raises what they recorded, so a lookup reads nothing back
        self.defer_checks = False
        self._bounds_rec = None
        # (R,) int64 device array or None: the row number stochastic rounding hashes for each linear row (None:
        # the row itself); a tiered table's engine sets it to the row each cache slot holds, so that FP16
        # training through the cache rounds as training on the whole table does
        self.sr_rows = None
        if self.pooling == Pooling.NONE:
            self._check_equal_dims("pooling NONE")

        # layout of the buffers (host numpy metadata; kernels get device copies)
        dims = np.array([t.dim for t in self.tables], np.int64)
        rows = np.array([t.rows for t in self.tables], np.int64)
        self.int8 = self.weights_precision == Precision.INT8
        self.codecs = None
        if row_codecs is not None and not self.int8:
            raise ValueError("row_codecs describe byte rows: they go with weights_precision INT8")
        if self.int8:
            self.codecs = self._check_int8(dims, row_codecs)
            # byte rows, read forward only: FBGEMM's fused 8-bit rows by default (D bytes, then float32 scale
            # and bias, kernels/fused8bit.py; D is a multiple of 4, so every row starts 4-byte aligned), or the
            # caller's row codecs (kernels/nbit_rows.py: the inference TBE's per-table types)
            self.strides = np.array([c.row_bytes for c in self.codecs], np.int64)
        else:
            # rows padded to 16 bytes of weights (aligned reads); pad_rows=False keeps rows of D_t values, for a
            # caller whose buffers must have FBGEMM's unpadded layout (the dense TBE's flat parameter)
            lane = (8 if self.weights_precision == Precision.FP16 else 4) if pad_rows else 1
            self.strides = -(-dims // lane) * lane                           # (T,) padded widths
        # table_align > 1 rounds each table's size up (FBGEMM's inference TBE: 128-byte cache lines)
        sizes = -(-(rows * self.strides) // int(table_align)) * int(table_align)
        self.elem_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.row_offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self.dims, self.rows = dims, rows
        self.feature_dims = dims[ftable]
        self.feature_cols = np.concatenate([[0], np.cumsum(self.feature_dims)]).astype(np.int64)

        xp = device.xp()
        wdtype = {Precision.FP16: np.float16, Precision.INT8: np.uint8}.get(self.weights_precision, np.float32)
        self.huge_pages = huge_pages_wanted()       # host buffers in huge pages (numbactr.runtime.hostmem), read once
        try:
            self.weights = _zeros(int(self.elem_offsets[-1]), wdtype, self.huge_pages)       # (sum V_t * stride_t,)
            self.states = [self._new_state(per_row, dtype, name) for name, per_row, dtype in self._state_specs()]
        except MemoryError as e:
            raise MemoryError(f"embedding tables of {int(rows.sum())} rows in all (widths {sorted(set(dims.tolist()))}, "
                              f"{self.optimizer.kind.name} with {len(self._state_specs())} state buffer(s)): {e}") from None
        # counter-based regularization's max_counter (1 + the largest row counter, renewed every
        # max_counter_update_freq steps), on the engine's device: a kernels step never reads it back
        self.max_counter = xp.ones(1, np.float32)
        self.hash_tables = {t: HashTable(spec.rows, use_kernels=self.impl == "kernels", xp=xp,
                                         compiled=self.impl == "cpu")
                            for t, spec in enumerate(self.tables) if spec.keyed}
        self._ws = {}                                                        # scratch pool (_scratch)
        self._impl = _IMPLS[self.impl](self)

    # ---- configuration ------------------------------------------------------------------------------
    def _pick_impl(self, impl):
        if impl is None:                 # the cpu device's references only: numbactr.runtime.device.reference_ops
            return ("cpu" if device.compiled_cpu() else "ref") if device.kind() == "cpu" else "kernels"
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if impl == "kernels" and not device.uses_kernels():
            raise ValueError("impl 'kernels' needs the gpu or sim device (numbactr.runtime.device)")
        if impl != "kernels" and device.kind() == "gpu":
            raise ValueError(f"impl {impl!r} runs on host arrays; the gpu device uses impl 'kernels'")
        if impl not in _IMPLS:
            raise NotImplementedError(f"impl {impl!r} is not built yet")
        return impl

    def _check_int8(self, dims, row_codecs) -> list:
        """INT8 weights (byte rows) are read forward only, by index: the tables' row codecs, checked."""
        if any(t.keyed for t in self.tables):
            raise NotImplementedError("INT8 weights are not supported for keyed (hash) tables: a new key's row "
                                      "would be written during a lookup; use FP32 or FP16 weights")
        if row_codecs is None:
            bad = [int(d) for d in dims if d % 4]
            if bad:
                raise ValueError(f"INT8 weights need every table's dim to be a multiple of 4 (FBGEMM's rule), got {bad}")
            return [NB.fused8bit_codec(int(d)) for d in dims]
        codecs = list(row_codecs)
        if len(codecs) != len(dims) or any(c.dim != d for c, d in zip(codecs, dims)):
            raise ValueError(f"row_codecs must give one codec per table with the table's dim {list(map(int, dims))}, "
                             f"got dims {[c.dim for c in codecs]}")
        return codecs

    def _check_equal_dims(self, why: str) -> None:
        dims = {self.tables[t].dim for t in self.feature_table_map}
        if len(dims) > 1:
            raise ValueError(f"{why} needs every feature's table to have the same dim, got {sorted(dims)}")

    def _state_specs(self) -> list:
        return state_specs(self.optimizer)

    def _new_state(self, per_row: bool, dtype, name: str):
        size = int(self.row_offsets[-1] if per_row else self.elem_offsets[-1])
        buf = _zeros(size, dtype, self.huge_pages)
        start = self.initial_state_value(name)
        if start:
            buf.fill(start)
        return buf

    def initial_state_value(self, name: str) -> float:
        """The value every row of optimizer state `name` starts from (a tiered table's backing tier too)."""
        if name == "prev_step":
            return 1                                         # HugeCTR's prev_time starts at 1
        if self.optimizer.kind == Optim.HUGECTR_ADAGRAD:
            return self.optimizer.initial_accumulator
        return 0

    @property
    def learning_rate(self) -> float:
        return self.optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, lr: float) -> None:
        lr = float(lr)
        if not math.isfinite(lr):
            raise ValueError(f"learning_rate must be a finite number, got {lr}")
        self.optimizer = replace(self.optimizer, learning_rate=lr)

    def set_hyper_parameters(self, **values) -> None:
        """Change optimizer hyper-parameters by OptimizerSpec field name. FIXED_HYPER_PARAMETERS shape the
        optimizer states, which exist already: they are fixed, and so is any change that would add or drop
        a state (weight_decay_mode to or from COUNTER / COWCLIP)."""
        fixed = set(FIXED_HYPER_PARAMETERS)
        names = {f.name for f in fields(OptimizerSpec)} - fixed
        unknown = sorted(set(values) - names)
        if unknown:
            why = "fixed when the engine is built" if set(unknown) <= fixed else "unknown"
            raise ValueError(f"hyper-parameter(s) {unknown}: {why}; settable: {sorted(names)}")
        new = _check_optimizer(replace(self.optimizer, **values))
        if state_specs(new) != state_specs(self.optimizer):
            names = ([n for n, _, _ in state_specs(o)] for o in (new, self.optimizer))
            raise ValueError(f"hyper-parameter(s) {sorted(values)}: the change would need other optimizer states "
                             "({}, not {})".format(*names))
        self.optimizer = new

    @property
    def n_features(self) -> int:
        return len(self.feature_table_map)

    @property
    def total_dim(self) -> int:
        return int(self.feature_cols[-1])

    # ---- views --------------------------------------------------------------------------------------
    def _table_view(self, buf, t: int, per_row: bool):
        if per_row:
            return buf[self.row_offsets[t]:self.row_offsets[t + 1]]
        lo, hi = self.elem_offsets[t], self.elem_offsets[t + 1]
        return buf[lo:hi].reshape(int(self.rows[t]), int(self.strides[t]))[:, :int(self.dims[t])]

    def split_weights(self) -> list:
        """One (V_t, D_t) view per table into the weights buffer (writes go to the engine); INT8 weights:
        (V_t, D_t + 8) uint8 views, each row its D bytes, scale and bias (kernels/fused8bit.py, FBGEMM's)."""
        if self.int8:
            return [self.weights[self.elem_offsets[t]:self.elem_offsets[t] + self.rows[t] * self.strides[t]]
                    .reshape(int(self.rows[t]), int(self.strides[t])) for t in range(len(self.tables))]
        return [self._table_view(self.weights, t, False) for t in range(len(self.tables))]

    def split_optimizer_states(self) -> list:
        """Per table, the list of its optimizer state views in kernels.tbe.STATES order:
        (V_t, D_t) per-element, (V_t,) per-row."""
        specs = self._state_specs()
        return [[self._table_view(buf, t, per_row) for buf, (_, per_row, _) in zip(self.states, specs)]
                for t in range(len(self.tables))]

    def live_rows(self, t: int) -> int:
        """Rows of table t in use: every row, or the keys inserted so far for a keyed table."""
        table = self.hash_tables.get(t)
        return table.size if table is not None else int(self.rows[t])

    def adopt_host_buffers(self, weights=None, states=None) -> None:
        """Use caller-owned host arrays as storage, as they are (FBGEMM's preallocated_host_buffers): weights
        (sum V_t * stride_t,) and states {i: array} (self.states[i]'s size), each 1-D, C-contiguous, of the
        buffer's dtype. Their contents are kept: nothing is zeroed. Host impls only ("cpu", "ref")."""
        if self.impl == "kernels":
            raise NotImplementedError("adopt_host_buffers: the engine's buffers live on the GPU (impl 'kernels')")
        pairs = [("weights", self.weights, weights)]
        pairs += [(f"state {i}", self.states[i], buf) for i, buf in sorted((states or {}).items())]
        for what, own, buf in pairs:
            if buf is None:
                continue
            if not isinstance(buf, np.ndarray) or buf.ndim != 1 or not buf.flags.c_contiguous:
                raise ValueError(f"adopt_host_buffers: {what} must be a 1-D C-contiguous NumPy array")
            if buf.dtype != own.dtype or buf.shape != own.shape:
                raise ValueError(f"adopt_host_buffers: {what} must be ({own.shape[0]},) {own.dtype}, got "
                                 f"{buf.shape} {buf.dtype}")
        if weights is not None:
            self.weights = weights
        for i, buf in (states or {}).items():
            self.states[i] = buf

    def take_state_rows(self, t: int, src) -> None:
        """Renumber table t's optimizer states after its rows were rebuilt (a checkpoint load): row i takes
        old row src[i] (src (n,) int64; -1: a row new to the table), every other row starts from the
        initial state. (Added for HugeCTR's SparseEmbedding, whose states follow their keys on reload.)"""
        src = device.xp().asarray(src)
        hit = src >= 0
        for buf, (name, per_row, dtype) in zip(self.states, self._state_specs()):
            view = self._table_view(buf, t, per_row)
            kept = view[src[hit]]
            view[...] = self._table_view(self._new_state(per_row, dtype, name), t, per_row)
            view[:src.shape[0]][hit] = kept

    def init_uniform(self, lo: float, hi: float, seed: int | None = None) -> None:
        """Every weight U(lo, hi), drawn from a hash of (seed, linear row, d): the same on every device."""
        seed = self.seed if seed is None else int(seed)
        for t, view in enumerate(self.split_weights()):
            if self.int8:                   # the same values, each row quantized (FBGEMM's way for INT8)
                vals = np.empty((int(self.rows[t]), int(self.dims[t])), np.float32)
                fill_uniform_rows(vals, int(self.row_offsets[t]), seed, lo, hi, what=f"table {t}")
                c = self.codecs[t]
                q = Q8.quantize_rows_ref(vals) if c.ty == "fused8bit" else \
                    NB.encode_rows_ref(vals, c.ty, reverse_qparam=c.reverse_qparam, scale_bias_bytes=c.scale_bias_bytes)
                view[...] = 0
                view[:, :q.shape[1]] = device.xp().asarray(q)
                continue
            fill_uniform_rows(view, int(self.row_offsets[t]), seed, lo, hi, what=f"table {t}")

    # ---- forward ------------------------------------------------------------------------------------
    def forward(self, indices, offsets, per_sample_weights=None, *, training: bool = True, pooling=None,
                feature_requires_grad=None, skip=None):
        """(out, ctx): pooled (B, sum D_f) or, for NONE, (N, D) embeddings; see the module docstring.
        skip (N,) bool, optional: occurrences that read nothing (zeros), are not inserted into a hash table
        and are not updated (row -1), e.g. the keys another rank owns in a gathered sharded lookup
        (numbactr.embedding.sharded); computed on the device, no host read."""
        ctx = self._lookup(indices, offsets, per_sample_weights, training=training, pooling=pooling,
                           feature_requires_grad=feature_requires_grad, skip=skip)
        return self._forward(ctx), ctx

    def _lookup(self, indices, offsets, per_sample_weights=None, *, training: bool = True, pooling=None,
                feature_requires_grad=None, skip=None) -> LookupContext:
        """forward's checks and row resolution (bounds, hash tables, tiers): the LookupContext of a lookup."""
        xp = device.xp()
        pooling = self.pooling if pooling is None else Pooling(pooling)
        if pooling == Pooling.NONE:
            self._check_equal_dims("pooling NONE")
        indices, offsets = xp.asarray(indices), xp.asarray(offsets)
        if indices.ndim != 1 or offsets.ndim != 1:
            raise ValueError(f"indices and offsets must be 1-D, got shapes {indices.shape} and {offsets.shape}")
        if indices.dtype.kind not in "iu" or offsets.dtype.kind not in "iu":
            raise TypeError(f"indices and offsets must be integer arrays, got {indices.dtype} and {offsets.dtype}")
        n_bags = offsets.shape[0] - 1
        if n_bags < 0 or n_bags % self.n_features:
            raise ValueError(f"offsets has {offsets.shape[0]} entries; it needs F*B + 1 with F = "
                             f"{self.n_features} features (B samples)")
        batch = n_bags // self.n_features
        n = indices.shape[0]
        psw = None
        if per_sample_weights is not None:
            psw = xp.asarray(per_sample_weights)
            if psw.shape != (n,) or psw.dtype.kind != "f":
                raise ValueError(f"per_sample_weights must be float of shape ({n},), got {psw.dtype} {psw.shape}")
            psw = xp.ascontiguousarray(psw.astype(np.float32, copy=False))
        if skip is not None:
            skip = xp.asarray(skip)
            if skip.shape != (n,) or skip.dtype != np.bool_:
                raise ValueError(f"skip must be bool of shape ({n},), got {skip.dtype} {skip.shape}")
        if feature_requires_grad is not None:
            feature_requires_grad = np.asarray(device.to_host(xp.asarray(feature_requires_grad))).astype(bool)
            if feature_requires_grad.shape != (self.n_features,):
                raise ValueError(f"feature_requires_grad must have one entry per feature ({self.n_features})")

        if indices.dtype == np.uint64 and not self.hash_tables:
            indices = self._as_int64(indices, on_device=self.defer_checks and self.impl == "kernels" and
                                     self.bounds_check in (BoundsCheck.FATAL, BoundsCheck.WARNING))
        # bounds check first (keyed features are not checked: their keys become rows below), so that a
        # FATAL batch raises before a hash table changes
        fixed, pre = self._impl.repair_offsets(offsets, n)
        defer = self.defer_checks and self.impl == "kernels"
        checked = self.bounds_check in (BoundsCheck.FATAL, BoundsCheck.WARNING)
        # deferred FATAL: a bad index reads and updates nothing (NONE's -1) until check_deferred raises
        mode = BoundsCheck.NONE if defer and self.bounds_check == BoundsCheck.FATAL else None
        rows, status = self._impl.check_indices(indices, offsets, fixed, pre, batch, mode)
        if checked and defer:
            if self._bounds_rec is None:
                self._bounds_rec = K.new_bounds_record(xp)
            K.record_bounds(status, indices, offsets, fixed, self._impl.feature_rows, batch, int(self.layout),
                            self._bounds_rec)
        elif checked:
            self._report(self._impl.report(status, indices, offsets, fixed, batch), offsets, n)
        new_rows = {}
        # (an evaluation lookup, and uint64 keys beside unkeyed tables, whose indices are checked on the
        # host, take the eager path)
        mixed_u64 = indices.dtype == np.uint64 and len(self.hash_tables) < len(self.tables)
        if self.hash_tables and defer and training and not mixed_u64:
            new_rows = self._rows_of_keys_deferred(indices, rows, skip)
        elif self.hash_tables:
            self._rows_of_keys(indices, rows, fixed, batch, training, skip)
        if skip is not None:
            rows[...] = xp.where(skip, -1, rows)          # an element-wise select: no host read
        rows = self._storage_rows(indices, rows, fixed, batch, training)
        ctx = LookupContext(rows, fixed, psw, batch, pooling, feature_requires_grad)
        if new_rows:
            ctx.extra["new_rows"] = new_rows
        return ctx

    def forward_bytes(self, indices, offsets, width: int):
        """Byte-row weights (INT8) without pooling: (N, width) uint8, each occurrence's stored row bytes
        (the first width of them, as stored: quantized values with their scale and bias, undecoded), in
        occurrence order; an index that reads nothing (pruned, or a bad index under IGNORE) gives zeros.
        FBGEMM's inference TBE returns this for output_dtype INT8 with PoolingMode.NONE."""
        if not self.int8:
            raise ValueError("forward_bytes reads byte-row (INT8) weights; these tables hold "
                             f"{self.weights_precision.name}")
        ctx = self._lookup(indices, offsets, None, training=False, pooling=Pooling.NONE)
        xp = device.xp()
        width = int(width)
        short = [t for t, c in enumerate(self.codecs) if c.row_bytes < width]
        if short:
            raise ValueError(f"forward_bytes: width {width} is more than table {short[0]}'s "
                             f"{self.codecs[short[0]].row_bytes} bytes per row")
        out = xp.zeros((ctx.rows.shape[0], width), np.uint8)
        for occ, view in zip(self._occurrences_by_table(ctx), self.split_weights()):
            r = ctx.rows[occ]
            ok = r >= 0
            out[occ[ok]] = view[r[ok], :width]
        return out

    def _occurrences_by_table(self, ctx: LookupContext) -> list:
        """Per table, the occurrences (positions in ctx.rows) that read it, in occurrence order."""
        xp = device.xp()
        n = ctx.rows.shape[0]
        bag = xp.searchsorted(ctx.offsets[1:], xp.arange(n, dtype=np.int64), side="right")    # (N,) bag of k
        feature = bag // ctx.batch if self.layout == Layout.FEATURE_MAJOR else bag % self.n_features
        table = xp.asarray(np.asarray(self.feature_table_map, np.int64))[feature]
        return [xp.flatnonzero(table == t) for t in range(len(self.tables))]

    def _forward(self, ctx: LookupContext):
        if not self.int8:
            return self._impl.forward(ctx)
        block, local = self._int8_rows(ctx)
        return self._impl.forward(replace(ctx, rows=local, extra={}), block)

    def _int8_rows(self, ctx: LookupContext) -> tuple:
        """INT8 weights' forward: (FloatRows, rows (N,)): the rows ctx touches, dequantized into a float32
        block laid out as the engine's own tables are (table t's region holds its occurrences in occurrence
        order, rows padded to 4 floats), and each occurrence's row in that block (-1 stays -1); the device's
        forward then pools the block as it pools FP32 weights. One row per occurrence (no dedup): the block
        is as large as a no-pooling output."""
        xp = device.xp()
        rows = ctx.rows
        n = rows.shape[0]
        local = xp.full(n, -1, np.int64)
        strides = -(-self.dims // 4) * 4
        picks = self._occurrences_by_table(ctx)
        counts = np.array([occ.shape[0] for occ in picks], np.int64)
        elem_off = np.concatenate([[0], np.cumsum(counts * strides)]).astype(np.int64)
        w = xp.zeros(max(int(elem_off[-1]), 1), np.float32)
        for t, (occ, view) in enumerate(zip(picks, self.split_weights())):
            if not occ.shape[0]:
                continue
            r = rows[occ]
            ok = r >= 0
            at = xp.arange(occ.shape[0], dtype=np.int64)
            local[occ] = xp.where(ok, at, -1)
            block = w[elem_off[t]:elem_off[t + 1]].reshape(int(counts[t]), int(strides[t]))
            at, r = at[ok], r[ok]
            step = max(1, DECODE_CHUNK_ELEMS // int(self.dims[t]))     # bounds decode's temporaries
            for lo in range(0, int(at.shape[0]), step):
                block[at[lo:lo + step], :int(self.dims[t])] = self.codecs[t].decode(view[r[lo:lo + step]], xp)
        return FloatRows(w, elem_off, strides), local

    def check_deferred(self) -> None:
        """Raise (FATAL, a full or misused hash table) or warn (WARNING) about what the lookups since the last
        call recorded on the device (defer_checks); one host read per record that was written to."""
        rec = self._bounds_rec
        if rec is not None:
            h = device.to_host(rec).astype(np.int64)
            if h[0] or h[3]:
                rec[...] = K.new_bounds_record(device.xp())
                self._report_record(h)
        for table in self.hash_tables.values():
            table.check()

    def _report_record(self, h) -> None:
        """_report for a bounds record (kernels.tbe.REC_SIZE): the first offender of the lookups since the
        last check, and the counts summed over them."""
        bad_off, bad = int(h[0]), int(h[3])
        first = (int(h[4]), int(h[5]), int(h[6]), int(h[7]), int(h[8])) if h[4] >= 0 else None
        since = " (in the lookups since the last check; those occurrences were looked up as nothing)"
        if self.bounds_check == BoundsCheck.FATAL:
            if h[1] >= 0:
                raise EmbeddingBoundsError(K.offsets_message(int(h[1]), int(h[2]), int(h[9]), int(h[10])) + since)
            if first is not None:
                raise EmbeddingBoundsError(K.bounds_message(first, bad, BoundsCheck.FATAL) + since)
            raise EmbeddingBoundsError(f"{bad} indices out of range and {bad_off} offsets repaired{since}")
        self.bounds_warnings += bad + bad_off
        what = [K.bounds_message(first, bad, BoundsCheck.WARNING)] if first is not None else []
        if bad_off:
            what.append(f"{bad_off} offsets repaired (clamped into [0, N], made non-decreasing, last set to N)")
        warnings.warn(f"TableBatchedEmbedding bounds check (lookups since the last check): {'; '.join(what)}",
                      RuntimeWarning, stacklevel=3)

    def _rows_of_keys_deferred(self, indices, rows, skip=None) -> dict:
        """_rows_of_keys of a training lookup with no host read (defer_checks on the kernels): each occurrence's
        keyed table comes from a kernel, each hash table inserts its own occurrences in place in rows, new rows
        take their initial values on the device. Returns {table: (rows, flags, keys)} of the inserts (flags: 1
        at each new key's first occurrence), for callers that record something per new row."""
        n = rows.shape[0]
        if n == 0:
            return {}
        occ = self._scratch("occ_table", n, np.int64)       # written by the bounds check (check_indices)
        if skip is not None:                                  # skipped occurrences belong to no table
            occ[...] = device.xp().where(skip, -1, occ)
        out = {}
        for t, table in self.hash_tables.items():
            _, flags, keys = table.insert_deferred(indices, occ, t, rows_out=rows)
            spec = self.tables[t]
            if self.weights.dtype == np.float32:
                EI.init_flagged_rows(self.weights, int(self.elem_offsets[t]), int(self.strides[t]), spec.dim, rows,
                                     keys, flags, self.seed, *spec.init_range)
            else:                   # float16 weights: the new rows' values through the host (reads)
                view = self._table_view(self.weights, t, False)
                new = device.to_host(flags).astype(bool)
                r = device.to_host(rows)[new]
                vals = EI.row_values_ref(device.to_host(keys)[new], spec.dim, self.seed, *spec.init_range)
                view[device.xp().asarray(r[r >= 0])] = device.xp().asarray(vals[r >= 0].astype(view.dtype))
            out[t] = (rows, flags, keys)
        return out

    def forward_rows(self, rows, offsets, batch: int):
        """Pooled (B, sum D_f) embeddings of rows the caller made itself: rows (N,) int64 storage rows of
        the engine's tables (-1: nothing), offsets (F*B + 1,) int64 valid CSR offsets, both on the device.
        No bounds check and no hash table: inference's pooler reads the block rows its cache lookup just
        wrote (numbactr.inference.session), where checking N indices again costs as much as the lookup."""
        return self._forward(LookupContext(rows, offsets, None, batch, self.pooling, None))

    def _storage_rows(self, indices, rows, offsets, batch: int, training: bool):
        """(N,) where each occurrence's row is stored: the row itself. A tiered table's engine
        (numbactr.embedding.tiered) overrides this to place the rows in its cache slots."""
        return rows

    def _report(self, report, offsets, n: int) -> None:
        """Raise (FATAL) or warn (WARNING) about what the bounds check found."""
        bad_offsets, first_offset, bad, first = report
        if self.bounds_check == BoundsCheck.FATAL:
            if bad_offsets:
                value = int(device.to_host(offsets[first_offset:first_offset + 1])[0])
                raise EmbeddingBoundsError(K.offsets_message(first_offset, value, n, offsets.shape[0] - 1))
            if bad:
                raise EmbeddingBoundsError(K.bounds_message(first, bad, BoundsCheck.FATAL))
        elif bad or bad_offsets:
            self.bounds_warnings += bad + bad_offsets
            what = [K.bounds_message(first, bad, BoundsCheck.WARNING)] if bad else []
            if bad_offsets:
                what.append(f"{bad_offsets} offsets repaired (clamped into [0, {n}], made non-decreasing, "
                            "last set to N)")
            warnings.warn(f"TableBatchedEmbedding bounds check: {'; '.join(what)}", RuntimeWarning,
                          stacklevel=4)                    # _report <- _lookup <- forward <- its caller

    def _feature_rows(self) -> np.ndarray:
        """(F,) the rows each feature's indices must stay below; -1 for keyed features (not checked)."""
        return np.array([-1 if self.tables[t].keyed else self.tables[t].rows for t in self.feature_table_map],
                        np.int64)

    @staticmethod
    def _as_int64(indices, on_device: bool = False):
        """uint64 indices of unkeyed tables as int64. on_device (a deferred bounds check will see them): no
        host read in the step; an index above 2**63 - 1 becomes 2**63 - 1, beyond every table, which the
        deferred check records (FATAL raises it at the check point, WARNING reads row 0). Otherwise such an
        index is an error here."""
        top = np.uint64(np.iinfo(np.int64).max)
        if on_device:
            return device.xp().minimum(indices, top).astype(np.int64)
        if bool((indices > top).any()):
            raise ValueError("indices of unkeyed tables must fit int64; uint64 keys above 2**63 - 1 belong "
                             "to keyed tables")
        return indices.astype(np.int64)

    def _rows_of_keys(self, indices, rows, offsets, batch: int, training: bool, skip=None) -> None:
        """rows[k] <- the row of key indices[k] for every occurrence of a keyed feature (inserted in
        training, -1 when missing in evaluation); any integer keys (uint64 included). Host-side
        bookkeeping: a keyed step reads the hash table's new-key count back anyway."""
        xp = device.xp()
        _, feat, _ = K._occurrences(device.to_host(offsets), self.n_features, batch, self.layout)
        keyed = np.zeros(feat.shape[0], bool)
        inside = feat >= 0
        keyed[inside] = np.array([self.tables[t].keyed for t in self.feature_table_map])[feat[inside]]
        if indices.dtype == np.uint64 and not keyed.all():
            self._as_int64(indices[xp.asarray(np.flatnonzero(~keyed))])
        take = np.ones(feat.shape[0], bool) if skip is None else ~device.to_host(skip).astype(bool)
        for t, table in self.hash_tables.items():
            feats = [f for f, ft in enumerate(self.feature_table_map) if ft == t]
            mine = xp.asarray(np.flatnonzero(np.isin(feat, feats) & take))
            if mine.shape[0]:
                rows[mine] = self._insert_or_find(t, table, indices[mine], training)

    def _insert_or_find(self, t: int, table: HashTable, keys, training: bool):
        if not training:
            return table.find(keys)
        before = table.size
        rows = table.insert(keys)
        if table.size > before:
            spec = self.tables[t]
            new = device.to_host(rows) >= before
            k64 = device.to_host(keys).astype(np.uint64)[new]
            vals = EI.row_values_ref(k64, spec.dim, self.seed, *spec.init_range)
            view = self._table_view(self.weights, t, False)
            view[device.xp().asarray(device.to_host(rows)[new])] = device.xp().asarray(vals.astype(view.dtype))
        return rows


    # ---- backward -----------------------------------------------------------------------------------
    def backward(self, ctx: LookupContext, grad_output) -> Grads:
        """Apply the fused update for the lookup `ctx` with dLoss/dout; see the module docstring."""
        if self.int8:
            raise NotImplementedError("INT8 weights are forward only (FBGEMM's CPU TBE has no INT8 backward "
                                      "either): train with FP32 or FP16 weights and quantize for serving")
        xp = device.xp()
        dy = xp.asarray(grad_output)
        want = (ctx.rows.shape[0], int(self.feature_dims[0])) if ctx.pooling == Pooling.NONE \
            else (ctx.batch, self.total_dim)
        if dy.ndim == 3 and ctx.pooling != Pooling.NONE:
            dy = dy.reshape(dy.shape[0], -1)
        if tuple(dy.shape) != want:
            raise ValueError(f"grad_output must have shape {want} for this lookup, got {tuple(dy.shape)}")
        if dy.dtype.kind != "f":
            raise TypeError(f"grad_output must be float, got {dy.dtype}")
        dy = xp.ascontiguousarray(dy.astype(np.float32, copy=False))
        if self.optimizer.gradient_clipping:            # FBGEMM clips dLoss/dout, not the row sums
            m = np.float32(self.optimizer.max_gradient)
            dy = xp.clip(dy, -m, m)
        grads = Grads()
        if ctx.per_sample_weights is not None:      # before the update: it reads the old weights
            grads.per_sample_weights = self._impl.psw_grad(ctx, dy)
        t = self.step + 1
        opt = self.optimizer
        glob = K.has_global_pass(opt.kind, opt.update_type)
        first = glob and K.global_pass_first(opt.kind, opt.hp())
        if first:
            self._impl.global_pass(t)
        grads.sparse = self._impl.backward(ctx, dy, t)
        if glob and not first:
            self._impl.global_pass(t)
        self.step = t
        if isinstance(self._impl, _KernelImpl):     # what a replayed step (numbactr.train.cuda_graphs) redoes
            from numbactr.runtime import step_values
            step_values.on_replay(("engine", id(self)), lambda run, p=ctx.pooling, b=ctx.batch, g=self.gate:
                                  self._replay_backward(p, b, g))
        return grads

    def _replay_backward(self, pooling, batch: int, gate=None) -> None:
        """The host half of backward's kernel step, for a replayed step: the step's device scalars and the
        step counter (the kernels' work is in the graph)."""
        t = self.step + 1
        self._impl.put_hot(t, pooling, batch)
        if gate is not None:
            self._impl.gate_values(t, "hot", gate)
        if K.has_global_pass(self.optimizer.kind, self.optimizer.update_type):
            self._impl.put_global(t)
            if gate is not None:
                self._impl.gate_values(t, "all", gate)
        self.step = t

    # ---- what the implementations share --------------------------------------------------------------
    def _state_buffers(self) -> tuple:
        """(a, b, row, prev, prev_iter, row_counter): elem_update's per-element states a, b, the rowwise
        kinds' per-row float state, HugeCTR's per-row step state and the counter states, as the engine's
        flat buffers; None where the optimizer keeps none."""
        elem, rowf, named = [], [], {}
        for buf, (name, per_row, dtype) in zip(self.states, self._state_specs()):
            if name in ("prev_step", "prev_iter", "row_counter"):
                named[name] = buf
            elif per_row:
                rowf.append(buf)
            else:
                elem.append(buf)
        return (tuple(elem + [None] * (2 - len(elem))) + ((rowf or [None])[0],)
                + tuple(named.get(n) for n in ("prev_step", "prev_iter", "row_counter")))

    def _max_counter_refresh(self, t: int) -> bool:
        """Whether step t renews max_counter (COUNTER / COWCLIP: every max_counter_update_freq steps)."""
        c = self.optimizer.counter
        return c is not None and c.max_counter_update_freq > 0 and t % c.max_counter_update_freq == 0

    def _renew_max_counter(self, t: int) -> None:
        """Host impls: max_counter = 1 + the largest row counter (1 without rows) at a renewing step t."""
        if self._max_counter_refresh(t):
            cnt = self._state_buffers()[5]
            self.max_counter[0] = float(cnt.max()) + 1.0 if cnt.size else 1.0

    def _ks_ki(self, ctx, t: int, pooling=None, batch: int = 0):
        """The packed kernel scalars / integers (kernels.tbe.kernel_scalars / kernel_ints) for step t (of a
        lookup ctx, or of `pooling` and `batch`)."""
        opt = self.optimizer
        sr = self.weights_precision == Precision.FP16 and self.stochastic_rounding
        if ctx is not None:
            pooling, batch = ctx.pooling, ctx.batch
        elif pooling is None:
            pooling = self.pooling
        # the kernels read max_counter from the device (_KernelImpl.backward copies it in): no host read
        maxc = 1.0 if self.impl == "kernels" else float(self.max_counter[0])
        return (K.kernel_scalars(opt.hp(), t, opt.counter, maxc, self._max_counter_refresh(t)),
                K.kernel_ints(opt.kind, opt.update_type, opt.weight_decay_mode, t, sr, pooling, self.layout,
                              batch, opt.counter, opt.rowwise_bias_correction))

    def _scratch(self, name: str, n: int, dtype):
        """A reused device buffer of n elements (grown by half when too small): the per-step scratch pool."""
        buf = self._ws.get(name)
        if buf is None or buf.shape[0] < n or buf.dtype != np.dtype(dtype):
            size = n if buf is None else max(n, int(buf.shape[0] * 1.5))
            buf = _zeros(max(size, 1), dtype, self.huge_pages)
            self._ws[name] = buf
        return buf[:n]


class _RefImpl:
    """The NumPy reference (kernels/tbe.py): the oracle; simple, vectorized per feature, not fast."""

    def __init__(self, eng: TableBatchedEmbedding):
        self.e = weakref.proxy(eng)        # no engine <-> impl cycle: the tables free with the engine

    def repair_offsets(self, offsets, n: int):
        """(repaired offsets, (number repaired, first repaired position))."""
        host = device.to_host(offsets).astype(np.int64)
        fixed, bad = K.check_offsets_ref(host, n, BoundsCheck.IGNORE)
        first = int(np.flatnonzero(fixed != host)[0]) if bad else -1
        return device.xp().asarray(fixed), (bad, first)

    def check_indices(self, indices, offsets, fixed, pre, batch: int, mode=None):
        """(rows, status): FATAL's rows are IGNORE's (the engine raises before anyone reads them)."""
        e = self.e
        mode = BoundsCheck.IGNORE if e.bounds_check == BoundsCheck.FATAL else e.bounds_check
        rows, bad, first = K.check_indices_ref(device.to_host(indices), device.to_host(fixed),
                                               e._feature_rows(), batch, e.layout, mode)
        return device.xp().asarray(rows), (*pre, bad, first)

    def report(self, status, indices, offsets, fixed, batch: int):
        """(offsets repaired, first, indices out of range, first (position, feature, sample, index, rows))."""
        return status

    def _host(self, ctx):
        h = device.to_host
        psw = None if ctx.per_sample_weights is None else h(ctx.per_sample_weights)
        return h(ctx.rows), h(ctx.offsets), psw

    def _tables(self) -> list:
        return [device.to_host(w) for w in self.e.split_weights()]

    def forward(self, ctx: LookupContext, block: FloatRows | None = None):
        """Pooled output of ctx; block: float32 rows read instead of the weights (INT8, dequantized)."""
        e = self.e
        rows, offs, psw = self._host(ctx)
        tables = self._tables() if block is None else [
            device.to_host(block.weights)[block.elem_offsets[t]:block.elem_offsets[t + 1]]
            .reshape(-1, int(block.strides[t]))[:, :int(e.dims[t])] for t in range(len(e.tables))]
        out = K.tbe_forward_ref(tables, e.feature_table_map, rows, offs, ctx.batch, ctx.pooling, e.layout, psw)
        dtype = np.float16 if e.output_dtype == Precision.FP16 else np.float32
        with np.errstate(over="ignore"):
            return device.xp().asarray(out.astype(np.float32).astype(dtype))

    def psw_grad(self, ctx: LookupContext, dy):
        e = self.e
        rows, offs, _ = self._host(ctx)
        g = K.per_sample_weights_grad_ref(self._tables(), e.feature_table_map, rows, offs, ctx.batch,
                                          ctx.pooling, e.layout, device.to_host(dy), ctx.feature_requires_grad)
        return device.xp().asarray(g.astype(np.float32))

    def backward(self, ctx: LookupContext, dy, t: int):
        """The update of every touched row (or, for optimizer NONE, their gradients as a SparseRowGrad)."""
        e = self.e
        rows_h, offs, psw = self._host(ctx)
        per_table = K.tbe_backward_ref(e.dims, e.feature_table_map, rows_h, offs, ctx.batch, ctx.pooling,
                                       e.layout, device.to_host(dy), psw)
        xp = device.xp()
        if e.optimizer.kind == Optim.NONE:
            lin = np.concatenate([r + e.row_offsets[tb] for tb, (r, _) in enumerate(per_table)]).astype(np.int64)
            vals = np.zeros((lin.size, int(e.dims.max())), np.float32)
            at = 0
            for r, g in per_table:
                vals[at:at + r.size, :g.shape[1]] = g
                at += r.size
            return SparseRowGrad(xp.asarray(lin), xp.asarray(vals), e.row_offsets.copy())
        opt, specs = e.optimizer, e._state_specs()
        e._renew_max_counter(t)
        weights, states = e.split_weights(), e.split_optimizer_states()
        for tb, (rows, g) in enumerate(per_table):
            if rows.size == 0:
                continue
            idx = xp.asarray(rows)
            w = device.to_host(weights[tb][idx])
            s = [device.to_host(st[idx]) for st in states[tb]]
            new_w, new_s = K.optimizer_update_ref(opt.kind, opt.hp(), w, g, s, t, opt.update_type,
                                                  opt.weight_decay_mode, opt.counter, float(e.max_counter[0]),
                                                  opt.rowwise_bias_correction)
            self._store(weights[tb], idx, new_w, rows + e.row_offsets[tb], t, K.SR_PASS_HOT)
            for view, val, (_, _, dtype) in zip(states[tb], new_s, specs):
                view[idx] = xp.asarray(val.astype(dtype))
        return None

    def _store(self, view, idx, new64, lin_rows, t: int, pass_id: int) -> None:
        """view[idx] = new64 in the weights' precision (stochastic rounding for FP16 when enabled)."""
        e = self.e
        new32 = new64.astype(np.float32)
        if e.weights_precision == Precision.FP16:
            hashed = lin_rows if e.sr_rows is None else device.to_host(e.sr_rows)[lin_rows]
            bits = (K.rounding_bits_ref(e.seed, t, hashed, new32.shape[1], pass_id)
                    if e.stochastic_rounding else None)
            new32 = K.to_half_ref(new32, bits)
        view[idx] = device.xp().asarray(new32)

    def global_pass(self, t: int) -> None:
        e, opt = self.e, self.e.optimizer
        states = e.split_optimizer_states()
        for tb, view in enumerate(e.split_weights()):
            n = e.live_rows(tb)
            if n == 0:
                continue
            w = device.to_host(view[:n])
            s = [device.to_host(st[:n]) for st in states[tb]]
            new_w, new_s = K.global_pass_ref(opt.kind, opt.hp(), w, s, t)
            self._store(view, slice(0, n), new_w, np.arange(n, dtype=np.int64) + e.row_offsets[tb], t,
                        K.SR_PASS_ALL)
            for st, val in zip(states[tb], new_s):
                st[:n] = device.xp().asarray(val.astype(np.float32))


class _CpuImpl:
    """The numba-compiled CPU code (kernels/tbe_cpu.py) on host arrays: the cpu device's fast path."""

    def __init__(self, eng: TableBatchedEmbedding):
        self.e = weakref.proxy(eng)        # no engine <-> impl cycle: the tables free with the engine
        self.ftable = np.asarray(eng.feature_table_map, np.int64)
        self.no_f32 = np.zeros(1, np.float32)                 # stands in for an absent float array
        self.no_i64 = np.zeros(1, np.int64)

    def _w(self):
        w = self.e.weights
        return w.view(np.uint16) if w.dtype == np.float16 else w

    def repair_offsets(self, offsets, n: int):
        if offsets.dtype == np.int64 and offsets.flags.c_contiguous and C.offsets_valid(offsets, n):
            return offsets, (0, -1)                 # nothing to repair: the caller's array, read only
        fixed = np.empty(offsets.shape[0], np.int64)
        bad, first = C.check_offsets(offsets, n, fixed)
        return fixed, (bad, first)

    def check_indices(self, indices, offsets, fixed, pre, batch: int, mode=None):
        e = self.e
        frows = e._feature_rows()
        # a clean int64 batch of an engine without keyed tables is its own rows: read, never written
        # (the backward reads them too, as FBGEMM's autograd keeps the indices tensor)
        if (indices.dtype == np.int64 and indices.flags.c_contiguous and not e.hash_tables
                and not C.count_bad_indices(indices, fixed, frows, batch, int(e.layout))):
            return indices, (*pre, 0, None)
        rows = np.empty(indices.shape[0], np.int64)
        mode = BoundsCheck.IGNORE if e.bounds_check == BoundsCheck.FATAL else e.bounds_check
        bad = C.check_indices(indices, fixed, frows, batch, int(e.layout), int(mode), rows)
        first = tuple(int(v) for v in C.first_bad_index(indices, fixed, frows, batch, int(e.layout))) if bad \
            else None
        return rows, (*pre, bad, first)

    report = _RefImpl.report

    def forward(self, ctx: LookupContext, block: FloatRows | None = None):
        e = self.e
        none = ctx.pooling == Pooling.NONE
        shape = (ctx.rows.shape[0], int(e.feature_dims[0])) if none else (ctx.batch, e.total_dim)
        out = np.empty(shape, np.float32)
        psw = ctx.per_sample_weights
        scratch = np.empty((numba.get_num_threads(), int(e.dims.max(initial=1))), np.float32)
        w, eo, st = (self._w(), e.elem_offsets, e.strides) if block is None else \
            (block.weights, block.elem_offsets, block.strides)
        if not none and psw is None and e.layout == Layout.FEATURE_MAJOR:      # FBGEMM's common case
            C.forward_pooled(w, eo, st, self.ftable, e.feature_cols, ctx.rows,
                             ctx.offsets, ctx.batch, int(ctx.pooling), out.reshape(-1), scratch)
        else:
            C.forward(w, eo, st, self.ftable, e.feature_cols, ctx.rows, ctx.offsets,
                      self.no_f32 if psw is None else psw, psw is not None, ctx.batch, int(e.layout),
                      int(ctx.pooling), out.reshape(-1), scratch)
        # FP16 output: rounded (to nearest even) after the float32 pooling, so the compiled forward has one
        # output type (each of its signatures costs a long compile)
        return out.astype(np.float16) if e.output_dtype == Precision.FP16 else out

    def psw_grad(self, ctx: LookupContext, dy):
        e = self.e
        want = (np.ones(e.n_features, np.bool_) if ctx.feature_requires_grad is None
                else ctx.feature_requires_grad)
        out = np.empty(ctx.rows.shape[0], np.float32)
        C.psw_grad(self._w(), e.elem_offsets, e.strides, self.ftable, e.feature_cols, ctx.rows, ctx.offsets, dy,
                   want, ctx.batch, int(e.layout), int(ctx.pooling), out)
        return out

    def backward(self, ctx: LookupContext, dy, t: int):
        e = self.e
        n = ctx.rows.shape[0]
        sentinel = int(e.row_offsets[-1])
        psw = ctx.per_sample_weights
        pooled = ctx.pooling != Pooling.NONE
        by_bag = pooled and psw is None
        n_bags = ctx.offsets.shape[0] - 1
        # 32-bit sort keys and payloads when they fit: the sort moves half the bytes
        kt = np.int32 if sentinel < 2 ** 31 - 1 else np.int64
        # payloads: dy offsets (by_bag) or occurrence numbers
        pt = np.int32 if max(n, n_bags, dy.size) < 2 ** 31 - 1 else np.int64
        lin, pay = e._scratch("lin", n, kt), e._scratch("pay", n, pt)
        flat = dy.reshape(-1)
        pooling = ctx.pooling
        if by_bag and pooling == Pooling.MEAN and C.longest_bag(ctx.offsets) <= 1:
            pooling = Pooling.SUM           # every bag's mean is its sum: no pre-scaled copy of dy to write
        scaled = by_bag and pooling == Pooling.MEAN
        if not scaled and _wants_huge_copy(flat, n, e.huge_pages):
            # the update reads a random dy row per occurrence: from huge pages, not the caller's 4 KiB pages
            # (L = 20, D = 16, 26 x 8192 bags: the fused update 223 -> 73 ms for a 3 ms copy; the MEAN
            # lookup's pre-scaled copy is in the scratch pool's huge pages already)
            flat = _copy_to(e._scratch("dy_huge", flat.shape[0], np.float32), flat)
        if by_bag:          # the sorted payload is the bag's dy row itself; MEAN reads a pre-scaled copy
            bag_of, bag_src, bag_scale = self.no_i64, self.no_i64, self.no_f32
            dys = e._scratch("dy_scaled", flat.shape[0], np.float32) if scaled else self.no_f32
        else:
            bag_of = e._scratch("bag_of", n, np.int64)
            bag_src = e._scratch("bag_src", n_bags, np.int64)
            bag_scale = e._scratch("bag_scale", n_bags, np.float32)
            dys = self.no_f32
        C.linearize(ctx.rows, ctx.offsets, self.ftable, e.row_offsets, e.feature_cols, ctx.batch, int(e.layout),
                    int(pooling), by_bag, sentinel, flat, dys, lin, pay, bag_of, bag_src, bag_scale)
        # the gradient rows the update reads, always flat (one signature of the compiled update, not two)
        dy = dys if scaled else flat
        keys, vals = e._scratch("keys", n, kt), e._scratch("vals", n, pt)
        C.radix_sort(lin, pay, C.radix_bits(sentinel), keys, vals, e._scratch("keys_tmp", n, kt),
                     e._scratch("vals_tmp", n, pt))
        seg = e._scratch("seg", n + 1, np.int64)
        n_seg = C.segments(keys, sentinel, seg)
        e._renew_max_counter(t)
        ks, ki = e._ks_ki(ctx, t)
        none = e.optimizer.kind == Optim.NONE
        grad_rows = np.empty(n_seg if none else 1, np.int64)
        grad_vals = np.empty((n_seg if none else 1, int(e.dims.max())), np.float32)
        a, b, r, p, pit, cnt = e._state_buffers()
        rows = tuple(self.no_f32 if x is None else x for x in (r, pit, cnt))
        C.fused_update(self._w(), self.no_f32 if a is None else a, self.no_f32 if b is None else b,
                       rows, self.no_i64 if p is None else p, e.elem_offsets, e.strides,
                       e.dims, e.row_offsets, keys, vals, by_bag, seg, n_seg, bag_of, bag_src, bag_scale,
                       self.no_f32 if psw is None else psw, psw is not None, dy, ks, ki,
                       K.rounding_base(e.seed, t, K.SR_PASS_HOT), grad_rows, grad_vals,
                       self.no_i64 if e.sr_rows is None else e.sr_rows, e.sr_rows is not None)
        return SparseRowGrad(grad_rows, grad_vals, e.row_offsets.copy()) if none else None

    def global_pass(self, t: int) -> None:
        e = self.e
        _, ki = e._ks_ki(None, t)
        ks = K.kernel_scalars(e.optimizer.hp(), t)
        live = np.array([e.live_rows(tb) for tb in range(len(e.tables))], np.int64)
        a, b = e._state_buffers()[:2]
        C.global_pass(self._w(), a, self.no_f32 if b is None else b, e.elem_offsets, e.strides, e.dims,
                      e.row_offsets, live, ks, ki, K.rounding_base(e.seed, t, K.SR_PASS_ALL),
                      self.no_i64 if e.sr_rows is None else e.sr_rows, e.sr_rows is not None)


class _KernelImpl:
    """The numba.cuda kernels of kernels/tbe.py (gpu, sim): one launch per op for all tables, sizes known
    before each launch, no host read in a step (bounds check IGNORE/NONE, unkeyed tables, optimizer other
    than NONE); scratch buffers from the engine's pool, the rest from the array library's pool."""

    def __init__(self, eng: TableBatchedEmbedding):
        self.e = weakref.proxy(eng)        # no engine <-> impl cycle: the tables free with the engine
        xp = device.xp()
        self.elem_off, self.strides, self.dims, self.row_off, self.fcols = (
            xp.asarray(a) for a in (eng.elem_offsets, eng.strides, eng.dims, eng.row_offsets, eng.feature_cols))
        self.ftable = xp.asarray(np.asarray(eng.feature_table_map, np.int64))
        self.feature_rows = xp.asarray(eng._feature_rows())
        self.keyed_table = xp.asarray(np.array([t if eng.tables[t].keyed else -1 for t in eng.feature_table_map],
                                               np.int64))
        self.max_dim = int(eng.dims.max())
        self.w_half = eng.weights_precision == Precision.FP16
        self.no_f32 = xp.zeros(1, np.float32)           # stands in for an absent float array
        self.no_i64 = xp.zeros(1, np.int64)
        self.no_f2 = xp.zeros((1, 1), np.float32)
        self.all_features = xp.ones(eng.n_features, np.bool_)
        self._live_host = self._live_dev = None
        self._step_values: dict = {}           # name -> StepValues: the per-step scalars of a launch

    def _put(self, name: str, values, dtype):
        """The device array holding this step's ``values`` for one launch (numbactr.runtime.step_values): the same
        array every step, so the launch's arguments do not change from step to step."""
        sv = self._step_values.get(name)
        if sv is None:
            from numbactr.runtime.step_values import StepValues
            sv = self._step_values[name] = StepValues(np.size(values), dtype)
        return sv.put(values)

    def _w(self):
        w = self.e.weights
        return w.view(np.uint16) if self.w_half else w

    def repair_offsets(self, offsets, n: int):
        from numbactr.kernels.scan import scan_partials_size
        e = self.e
        fixed = device.xp().empty(offsets.shape[0], np.int64)
        status = e._scratch("status", 4, np.int64)
        K.repair_offsets(offsets, n, fixed, status, e._scratch("scan", scan_partials_size(fixed.shape[0]), np.int64))
        return fixed, status

    def check_indices(self, indices, offsets, fixed, status, batch: int, mode=None):
        e = self.e
        rows = device.xp().empty(indices.shape[0], np.int64)
        if mode is None:
            mode = BoundsCheck.IGNORE if e.bounds_check == BoundsCheck.FATAL else e.bounds_check
        want = bool(e.defer_checks and e.hash_tables)      # the deferred keyed lookup's occurrence tables
        occ = e._scratch("occ_table", indices.shape[0], np.int64) if want else self.no_i64
        K.check_indices(indices, offsets, fixed, self.feature_rows, batch, int(e.layout), int(mode), rows, status,
                        self.keyed_table, occ, want)
        return rows, status

    def report(self, status, indices, offsets, fixed, batch: int):
        """One host read of the status; the first offender's details only when there is one."""
        st = device.to_host(status)
        bad_off, bad = int(st[K.ST_BAD_OFFSETS]), int(st[K.ST_BAD_INDICES])
        first_off = int(st[K.ST_FIRST_OFFSET]) if bad_off else -1
        first = None
        if bad:
            k = int(st[K.ST_FIRST_INDEX])
            fx = device.to_host(fixed)
            j = int(np.searchsorted(fx, k, side="right")) - 1
            f, b = K.bag_feature_sample_ref(self.e.n_features, batch, self.e.layout)
            first = (k, int(f[j]), int(b[j]), int(device.to_host(indices[k:k + 1]).astype(np.int64)[0]),
                     int(self.e._feature_rows()[f[j]]))
        return bad_off, first_off, bad, first

    def forward(self, ctx: LookupContext, block: FloatRows | None = None):
        e = self.e
        xp = device.xp()
        none = ctx.pooling == Pooling.NONE
        shape = (ctx.rows.shape[0], int(e.feature_dims[0])) if none else (ctx.batch, e.total_dim)
        fp16 = e.output_dtype == Precision.FP16
        out = xp.empty(shape, np.float16 if fp16 else np.float32)
        flat = out.reshape(-1).view(np.uint16) if fp16 else out.reshape(-1)
        psw = ctx.per_sample_weights
        w, eo, st, half = (self._w(), self.elem_off, self.strides, self.w_half) if block is None else \
            (block.weights, xp.asarray(block.elem_offsets), xp.asarray(block.strides), False)
        K.forward(w, eo, st, self.ftable, self.fcols, ctx.rows, ctx.offsets,
                  self.no_f32 if psw is None else psw, psw is not None, ctx.batch, int(e.layout), int(ctx.pooling),
                  flat, half, fp16, self.max_dim)
        return out

    def _segment(self, ctx: LookupContext):
        """Linear rows, bags and the sorted segments of the lookup (once per backward)."""
        from numbactr.kernels.scan import scan_partials_size
        e = self.e
        n = ctx.rows.shape[0]
        if "segments" not in ctx.extra:
            lin, bag_of = e._scratch("lin", n, np.int64), e._scratch("bag_of", n, np.int64)
            perm, flags = e._scratch("perm", n, np.int64), e._scratch("flags", n, np.int64)
            pos, seg = e._scratch("pos", n + 1, np.int64), e._scratch("seg", n + 1, np.int64)
            K.segment_rows(ctx.rows, ctx.offsets, self.ftable, self.row_off, int(e.row_offsets[-1]), ctx.batch,
                           int(e.layout), lin, bag_of, perm, flags, pos, seg,
                           e._scratch("scan", scan_partials_size(n), np.int64), device.xp())
            ctx.extra["segments"] = (lin, bag_of, perm, pos, seg)
        return ctx.extra["segments"]

    def psw_grad(self, ctx: LookupContext, dy):
        e = self.e
        xp = device.xp()
        _, bag_of, _, _, _ = self._segment(ctx)
        want = self.all_features if ctx.feature_requires_grad is None else xp.asarray(ctx.feature_requires_grad)
        out = xp.empty(ctx.rows.shape[0], np.float32)
        K.psw_grad(self._w(), self.elem_off, self.strides, self.ftable, self.fcols, ctx.rows, ctx.offsets, bag_of,
                   dy.reshape(-1), want, ctx.batch, int(e.layout), int(ctx.pooling), out, self.w_half, self.max_dim)
        return out

    def put_hot(self, t: int, pooling, batch: int) -> tuple:
        """Step t's scalars of the fused update, in their device arrays (numbactr.runtime.step_values)."""
        e = self.e
        ks, ki = e._ks_ki(None, t, pooling, batch)
        return (self._put("hot_ks", ks, np.float32), self._put("hot_ki", ki, np.int64),
                self._put("hot_kb", K.rounding_base(e.seed, t, K.SR_PASS_HOT), np.uint64))

    def put_global(self, t: int) -> tuple:
        """Step t's scalars of the all-rows pass, in their device arrays."""
        e = self.e
        _, ki = e._ks_ki(None, t)
        ks = K.kernel_scalars(e.optimizer.hp(), t)
        return (self._put("all_ks", ks, np.float32), self._put("all_ki", ki, np.int64),
                self._put("all_kb", K.rounding_base(e.seed, t, K.SR_PASS_ALL), np.uint64))

    def backward(self, ctx: LookupContext, dy, t: int):
        e = self.e
        xp = device.xp()
        lin, bag_of, perm, pos, seg = self._segment(ctx)
        ks_d, ki_d, kb_d = self.put_hot(t, ctx.pooling, ctx.batch)
        self._gate(ks_d, ki_d, t, "hot")
        none = e.optimizer.kind == Optim.NONE
        n = ctx.rows.shape[0]
        grad_rows = xp.empty(n if none else 1, np.int64)
        grad_vals = xp.empty((n, self.max_dim), np.float32) if none else self.no_f2
        a, b, r, p, pit, cnt = e._state_buffers()
        if e.optimizer.counter is not None:
            self._max_counter(ks_d, cnt)
        psw = ctx.per_sample_weights
        K.fused_update(self._w(), self.no_f32 if a is None else a, self.no_f32 if b is None else b,
                       self.no_f32 if r is None else r, self.no_i64 if p is None else p,
                       self.no_f32 if pit is None else pit, self.no_f32 if cnt is None else cnt,
                       self.elem_off, self.strides,
                       self.dims, self.row_off, self.fcols, lin, perm, seg, pos, bag_of, ctx.offsets,
                       self.no_f32 if psw is None else psw, psw is not None, dy.reshape(-1), ks_d, ki_d, kb_d,
                       grad_rows, grad_vals, self.w_half, self.max_dim, e.sr_rows,
                       int(e.optimizer.kind), int(e.optimizer.weight_decay_mode))    # the kernel compiled for them
        if not none:
            return None
        u = ctx.extra.get("touched_rows")                   # a caller that knows U (numbactr.embedding.sharded)
        if u is None:
            u = int(device.to_host(pos[n:n + 1])[0])     # NONE hands back U rows: the one host read
        return SparseRowGrad(grad_rows[:u], grad_vals[:u], e.row_offsets.copy())

    def _max_counter(self, ks_d, cnt) -> None:
        """COUNTER / COWCLIP's max_counter on the device, in stream order (part of a captured step): renewed
        to 1 + the largest row counter when the step's KS_REFRESH says so, then copied into the step's
        scalars (KS_MAXC). Decided on the device, so a replayed step renews it at the right steps."""
        e = self.e
        xp = device.xp()
        if e.optimizer.counter.max_counter_update_freq > 0:
            top = cnt.max() + np.float32(1.0) if cnt.size else xp.ones((), np.float32)
            e.max_counter[...] = xp.where(ks_d[K.M.KS_REFRESH] > 0, top, e.max_counter[0])
        ks_d[K.M.KS_MAXC:K.M.KS_MAXC + 1] = e.max_counter

    def _live(self):
        """The rows in use per table on the device, uploaded again only when a keyed table grew (an
        upload is a host synchronization; a keyed step has one anyway)."""
        e = self.e
        if e.defer_checks:          # keyed tables' counts copied on the device (device to device: no read)
            if self._live_dev is None or self._live_host is not None:
                self._live_host, self._live_dev = None, device.xp().array(np.array(e.rows, np.int64))
            for tb, table in e.hash_tables.items():
                self._live_dev[tb:tb + 1] = table.device_size
            return self._live_dev
        live = tuple(e.live_rows(tb) for tb in range(len(e.tables)))
        if self._live_host != live:
            self._live_host, self._live_dev = live, device.xp().asarray(np.array(live, np.int64))
        return self._live_dev

    def global_pass(self, t: int) -> None:
        e = self.e
        a, b = e._state_buffers()[:2]
        ks_d, ki_d, kb_d = self.put_global(t)
        self._gate(ks_d, ki_d, t, "all")
        K.global_pass(self._w(), a, self.no_f32 if b is None else b, self.elem_off, self.strides, self.dims,
                      self.row_off, int(e.row_offsets[-1]), self._live(), ks_d, ki_d, kb_d,
                      self.w_half, self.max_dim, e.sr_rows)

    def _gate(self, ks_d, ki_d, t: int, which: str) -> None:
        """The caller's gate (TableBatchedEmbedding.gate) into the step's KI_GO and, for the steps that
        update, t's scalars computed on the device (after the upload, in stream order: part of a captured
        step)."""
        g = self.e.gate
        if g is not None:
            K.gate_scalars(ks_d, ki_d, g.go, g.skips, *self.gate_values(t, which, g))

    def gate_values(self, t: int, which: str, gate) -> tuple:
        """The host values gate_scalars reads: (the host's t, the skips it has seen), (lr, beta1, beta2)."""
        hp = self.e.optimizer.hp()
        return (self._put(which + "_tv", np.array([t, gate.seen], np.int64), np.int64),
                self._put(which + "_fv", np.array([hp["learning_rate"], hp["beta1"], hp["beta2"]], np.float64),
                          np.float64))


_IMPLS = {"ref": _RefImpl, "cpu": _CpuImpl, "kernels": _KernelImpl}
