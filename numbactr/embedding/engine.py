"""The table-batched embedding engine: every embedding-shaped op of numbactr runs here.

Contract (the math is in numbactr/kernels/tbe.py's docstring; this is the interface):

    eng = TableBatchedEmbedding(
        tables=[(rows, dim), ...] or [TableSpec(rows, dim, keyed=False, init_range=(-0.05, 0.05)), ...],
        feature_table_map=None,             # feature f reads table feature_table_map[f]; None: f -> f
        pooling=Pooling.SUM,                # SUM | MEAN | NONE (sequence embeddings, one row per index)
        optimizer=OptimizerSpec(Optim.EXACT_SGD, learning_rate=0.01, ...),
        weights_precision=Precision.FP32,   # FP32 | FP16 (updates stochastically rounded by default)
        output_dtype=Precision.FP32,        # FP32 | FP16
        bounds_check=BoundsCheck.WARNING,   # FATAL | WARNING | IGNORE | NONE (FBGEMM's modes)
        stochastic_rounding=True,
        layout=Layout.FEATURE_MAJOR,        # CSR bag order: f*B + b (FBGEMM) or b*F + f (HugeCTR)
        seed=0,                             # stochastic rounding and keyed-row initialization
        impl=None)                          # "ref" | "cpu" | "kernels"; None: by numbactr.device
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
linear row id of (t, r) is row_offset[t] + r (FBGEMM's hash_size_cumsum indexing).

Keyed tables (HugeCTR's hash embeddings): the feature's indices are keys; the engine maps them to rows with
numbactr.embedding.hash_table.HashTable (training inserts: new keys take the next rows in order of first
occurrence, initialized U(init_range) from a hash of (seed, key); evaluation finds: a missing key is row
-1, which contributes zero but still counts in a MEAN bag's length, HugeCTR's rule, while an unkeyed
table's MEAN divides by the bag length as FBGEMM does; the two agree because -1 rows count). The forward's
insert gives each occurrence its row, so the backward needs no second table.

Steps: `step` counts updates; an update uses t = step + 1 (Adam's bias correction, stochastic rounding's
random stream). FBGEMM increments its `iter` in forward instead: a face that wants FBGEMM's count after
several forwards per backward sets `step`.

Devices: impl "kernels" launches the numba.cuda kernels (gpu, sim), "cpu" runs the numba-compiled CPU
code, "ref" the NumPy reference (the test oracle, numbactr.kernels.tbe). All three give the same result
to float32 rounding; the row gradient sum order is the occurrence order in every one of them.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields, replace

import numpy as np

from .. import device
from ..kernels import embedding_init as EI
from ..kernels import tbe as K
from ..kernels.tbe import (BoundsCheck, EmbeddingBoundsError, Layout, Optim, Pooling, Precision,
                           UpdateType, WeightDecay)
from .hash_table import HashTable

__all__ = ["TableBatchedEmbedding", "TableSpec", "OptimizerSpec", "LookupContext", "Grads", "SparseRowGrad",
           "Pooling", "Layout", "BoundsCheck", "Precision", "Optim", "UpdateType", "WeightDecay",
           "EmbeddingBoundsError", "IMPLS"]

IMPLS = ("ref", "cpu", "kernels")


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

    momentum: HugeCTR's momentum_factor (MomentumSGD, Nesterov). initial_accumulator: HugeCTR AdaGrad's
    initial_accu_value. scaler: HugeCTR's loss scaler (HugeCTR kinds divide the gradient by it).
    update_type: HugeCTR's Update_t (LOCAL, GLOBAL, LAZY_GLOBAL (Adam only)); FBGEMM's kinds are LOCAL.
    gradient_clipping: clamp each summed row gradient to [-max_gradient, max_gradient].
    max_norm > 0: rescale every updated row whose L2 norm exceeds it (FBGEMM applies it for
    EXACT_ROWWISE_ADAGRAD only; the engine for every kind, the face passes 0 where FBGEMM ignores it).
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

    def hp(self) -> dict:
        """The float hyper-parameters by name (kernels.tbe.HP_FIELDS)."""
        return {name: float(getattr(self, name)) for name in K.HP_FIELDS}


@dataclass
class SparseRowGrad:
    """Row gradients of optimizer NONE: rows (U,) linear row ids ascending, values (U, max D) float32
    (zero beyond a row's own width), tables (U,) the table of each row."""
    rows: object
    values: object
    tables: object
    row_offsets: np.ndarray

    def per_table(self) -> list:
        """[(rows (U_t,) local to table t, values (U_t, D)) for every table t]."""
        rows, vals, tabs = (device.to_host(a) for a in (self.rows, self.values, self.tables))
        return [(rows[tabs == t] - self.row_offsets[t], vals[tabs == t]) for t in range(len(self.row_offsets))]


@dataclass
class Grads:
    per_sample_weights: object = None
    sparse: SparseRowGrad | None = None


@dataclass
class LookupContext:
    """What a forward leaves for its backward: the bounds-checked rows (N,) int64 (local rows, -1 = none),
    repaired offsets (F*B + 1,) int64, per-sample weights (N,) float32 or None, batch B, pooling."""
    rows: object
    offsets: object
    per_sample_weights: object
    batch: int
    pooling: Pooling
    feature_requires_grad: object = None
    extra: dict = field(default_factory=dict)


def _as_table(t) -> TableSpec:
    spec = t if isinstance(t, TableSpec) else TableSpec(*t)
    if int(spec.rows) < 0 or int(spec.dim) < 1:
        raise ValueError(f"table {spec}: rows must be >= 0 and dim >= 1")
    lo, hi = spec.init_range
    if not lo <= hi:
        raise ValueError(f"table {spec}: init_range must be (lo, hi) with lo <= hi")
    return replace(spec, rows=int(spec.rows), dim=int(spec.dim))


def _check_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    spec = replace(spec, kind=Optim(spec.kind), update_type=UpdateType(spec.update_type),
                   weight_decay_mode=WeightDecay(spec.weight_decay_mode))
    k, u = spec.kind, spec.update_type
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
    return spec


class TableBatchedEmbedding:
    """Many tables, many features, one lookup and one fused update per step. See the module docstring."""

    def __init__(self, tables, feature_table_map=None, *, pooling=Pooling.SUM,
                 optimizer: OptimizerSpec | None = None, weights_precision=Precision.FP32,
                 output_dtype=Precision.FP32, bounds_check=BoundsCheck.WARNING,
                 stochastic_rounding: bool = True, layout=Layout.FEATURE_MAJOR, seed: int = 0,
                 impl: str | None = None):
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
        self.bounds_check = BoundsCheck(bounds_check)
        self.layout = Layout(layout)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = int(seed)
        self.optimizer = _check_optimizer(optimizer or OptimizerSpec())
        self.impl = self._pick_impl(impl)
        self.step = 0
        self.bounds_warnings = 0
        if self.pooling == Pooling.NONE:
            self._check_equal_dims("pooling NONE")

        # layout of the buffers (host numpy metadata; kernels get device copies)
        dims = np.array([t.dim for t in self.tables], np.int64)
        rows = np.array([t.rows for t in self.tables], np.int64)
        lane = 8 if self.weights_precision == Precision.FP16 else 4          # 16 bytes of weights
        self.strides = -(-dims // lane) * lane                               # (T,) padded widths
        self.elem_offsets = np.concatenate([[0], np.cumsum(rows * self.strides)]).astype(np.int64)
        self.row_offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self.dims, self.rows = dims, rows
        self.feature_dims = dims[ftable]
        self.feature_cols = np.concatenate([[0], np.cumsum(self.feature_dims)]).astype(np.int64)

        xp = device.xp()
        wdtype = np.float16 if self.weights_precision == Precision.FP16 else np.float32
        self.weights = xp.zeros(int(self.elem_offsets[-1]), wdtype)          # (sum V_t * stride_t,)
        self.states = [self._new_state(per_row, dtype, name) for name, per_row, dtype in self._state_specs()]
        self.hash_tables = {t: HashTable(spec.rows, use_kernels=self.impl == "kernels", xp=xp)
                            for t, spec in enumerate(self.tables) if spec.keyed}

    # ---- configuration ------------------------------------------------------------------------------
    def _pick_impl(self, impl):
        if impl is None:
            return "ref"
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if impl == "kernels" and not device.uses_kernels():
            raise ValueError("impl 'kernels' needs the gpu or sim device (numbactr.device)")
        if impl != "kernels" and device.kind() == "gpu":
            raise ValueError(f"impl {impl!r} runs on host arrays; the gpu device uses impl 'kernels'")
        if impl != "ref":
            raise NotImplementedError(f"impl {impl!r} is not built yet; use impl='ref'")
        return impl

    def _check_equal_dims(self, why: str) -> None:
        dims = {self.tables[t].dim for t in self.feature_table_map}
        if len(dims) > 1:
            raise ValueError(f"{why} needs every feature's table to have the same dim, got {sorted(dims)}")

    def _state_specs(self) -> list:
        specs = list(K.STATES[self.optimizer.kind])
        if self.optimizer.update_type == UpdateType.LAZY_GLOBAL:
            specs.append(K.LAZY_PREV_STEP)
        return specs

    def _new_state(self, per_row: bool, dtype, name: str):
        xp = device.xp()
        size = int(self.row_offsets[-1] if per_row else self.elem_offsets[-1])
        if name == "prev_step":
            return xp.ones(size, dtype)                      # HugeCTR's prev_time starts at 1
        if self.optimizer.kind == Optim.HUGECTR_ADAGRAD:
            return xp.full(size, self.optimizer.initial_accumulator, dtype)
        return xp.zeros(size, dtype)

    @property
    def learning_rate(self) -> float:
        return self.optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, lr: float) -> None:
        self.optimizer = replace(self.optimizer, learning_rate=float(lr))

    def set_hyper_parameters(self, **values) -> None:
        """Change optimizer hyper-parameters by OptimizerSpec field name (kind excepted)."""
        names = {f.name for f in fields(OptimizerSpec)} - {"kind"}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown hyper-parameter(s) {unknown}; known: {sorted(names)}")
        self.optimizer = _check_optimizer(replace(self.optimizer, **values))

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
        """One (V_t, D_t) view per table into the weights buffer (writes go to the engine)."""
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

    def init_uniform(self, lo: float, hi: float, seed: int | None = None) -> None:
        """Every weight U(lo, hi), drawn from a hash of (seed, linear row, d): the same on every device."""
        seed = self.seed if seed is None else int(seed)
        xp = device.xp()
        for t, view in enumerate(self.split_weights()):
            lin = np.arange(self.row_offsets[t], self.row_offsets[t + 1], dtype=np.uint64)
            view[...] = xp.asarray(EI.row_values_ref(lin, int(self.dims[t]), seed, lo, hi).astype(view.dtype))

    # ---- forward ------------------------------------------------------------------------------------
    def forward(self, indices, offsets, per_sample_weights=None, *, training: bool = True, pooling=None,
                feature_requires_grad=None):
        """(out, ctx): pooled (B, sum D_f) or, for NONE, (N, D) embeddings; see the module docstring."""
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
        if feature_requires_grad is not None:
            feature_requires_grad = np.asarray(device.to_host(xp.asarray(feature_requires_grad))).astype(bool)
            if feature_requires_grad.shape != (self.n_features,):
                raise ValueError(f"feature_requires_grad must have one entry per feature ({self.n_features})")

        offs, bad_offsets = self._check_offsets(offsets, n)
        keys_done = self._rows_of_keys(indices, offs, batch, training)
        rows, bad, first = self._check_indices(keys_done, offs, batch)
        if self.bounds_check == BoundsCheck.WARNING and (bad or bad_offsets):
            self.bounds_warnings += bad + bad_offsets
            what = K.bounds_message(first, bad, BoundsCheck.WARNING) if bad else ""
            if bad_offsets:
                what = (what + "; " if what else "") + f"{bad_offsets} offsets repaired (clamped into [0, {n}], " \
                                                       "made non-decreasing, last set to N)"
            warnings.warn(f"TableBatchedEmbedding bounds check: {what}", RuntimeWarning, stacklevel=2)
        ctx = LookupContext(rows, offs, psw, batch, pooling, feature_requires_grad)
        return self._forward(ctx), ctx

    def _check_offsets(self, offsets, n: int):
        fixed, bad = K.check_offsets_ref(device.to_host(offsets), n, self.bounds_check)
        return device.xp().asarray(fixed), bad

    def _feature_rows(self) -> np.ndarray:
        return self.rows[self.feature_table_map]

    def _check_indices(self, indices, offsets, batch: int):
        rows, bad, first = K.check_indices_ref(device.to_host(indices), device.to_host(offsets),
                                               self._feature_rows(), batch, self.layout, self.bounds_check)
        return device.xp().asarray(rows), bad, first

    def _rows_of_keys(self, indices, offsets, batch: int, training: bool):
        """indices as int64, every keyed feature's keys replaced by their rows (-1: missing in evaluation).
        Keys may be any integer type (uint64 included); unkeyed indices must fit int64."""
        xp = device.xp()
        if not self.hash_tables and indices.dtype != np.uint64:
            return indices
        _, feat, _ = K._occurrences(device.to_host(offsets), self.n_features, batch, self.layout)
        keyed_feature = np.array([self.tables[t].keyed for t in self.feature_table_map])
        keyed = np.zeros(feat.shape[0], bool)
        keyed[feat >= 0] = keyed_feature[feat[feat >= 0]]
        out = xp.empty(indices.shape[0], np.int64)
        plain = xp.asarray(np.flatnonzero(~keyed))
        vals = indices[plain]
        if vals.dtype == np.uint64 and bool((vals > np.uint64(np.iinfo(np.int64).max)).any()):
            raise ValueError("indices of unkeyed tables must fit int64; uint64 keys above 2**63 - 1 belong "
                             "to keyed tables")
        out[plain] = vals.astype(np.int64)
        for t, table in self.hash_tables.items():
            feats = [f for f, ft in enumerate(self.feature_table_map) if ft == t]
            mine = xp.asarray(np.flatnonzero(np.isin(feat, feats)))
            if mine.shape[0]:
                out[mine] = self._insert_or_find(t, table, indices[mine], training)
        return out

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

    def _forward(self, ctx: LookupContext):
        out = K.tbe_forward_ref([device.to_host(w) for w in self.split_weights()], self.feature_table_map,
                                device.to_host(ctx.rows), device.to_host(ctx.offsets), ctx.batch, ctx.pooling,
                                self.layout, None if ctx.per_sample_weights is None
                                else device.to_host(ctx.per_sample_weights))
        dtype = np.float16 if self.output_dtype == Precision.FP16 else np.float32
        with np.errstate(over="ignore"):
            return device.xp().asarray(out.astype(np.float32).astype(dtype))

    # ---- backward -----------------------------------------------------------------------------------
    def backward(self, ctx: LookupContext, grad_output) -> Grads:
        """Apply the fused update for the lookup `ctx` with dLoss/dout; see the module docstring."""
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
        grads = Grads()
        if ctx.per_sample_weights is not None:
            grads.per_sample_weights = self._psw_grad(ctx, dy)
        t = self.step + 1
        opt = self.optimizer
        if opt.kind == Optim.NONE:
            grads.sparse = self._sparse_grad(ctx, dy)
        else:
            glob = K.has_global_pass(opt.kind, opt.update_type)
            if glob and K.global_pass_first(opt.kind, opt.hp()):
                self._global_pass(t)
            self._update(ctx, dy, t)
            if glob and not K.global_pass_first(opt.kind, opt.hp()):
                self._global_pass(t)
        self.step = t
        return grads

    def _host_ctx(self, ctx):
        h = device.to_host
        psw = None if ctx.per_sample_weights is None else h(ctx.per_sample_weights)
        return h(ctx.rows), h(ctx.offsets), psw

    def _psw_grad(self, ctx, dy):
        rows, offs, _ = self._host_ctx(ctx)
        g = K.per_sample_weights_grad_ref([device.to_host(w) for w in self.split_weights()],
                                          self.feature_table_map, rows, offs, ctx.batch, ctx.pooling,
                                          self.layout, device.to_host(dy), ctx.feature_requires_grad)
        return device.xp().asarray(g.astype(np.float32))

    def _row_grads(self, ctx, dy) -> list:
        rows, offs, psw = self._host_ctx(ctx)
        return K.tbe_backward_ref(self.dims, self.feature_table_map, rows, offs, ctx.batch, ctx.pooling,
                                  self.layout, device.to_host(dy), psw)

    def _sparse_grad(self, ctx, dy) -> SparseRowGrad:
        per_table = self._row_grads(ctx, dy)
        width = int(self.dims.max())
        lin = np.concatenate([r + self.row_offsets[t] for t, (r, _) in enumerate(per_table)]).astype(np.int64)
        tabs = np.concatenate([np.full(r.size, t, np.int32) for t, (r, _) in enumerate(per_table)])
        vals = np.zeros((lin.size, width), np.float32)
        at = 0
        for r, g in per_table:
            vals[at:at + r.size, :g.shape[1]] = g
            at += r.size
        xp = device.xp()
        return SparseRowGrad(xp.asarray(lin), xp.asarray(vals), xp.asarray(tabs), self.row_offsets.copy())

    def _store_weights(self, view, idx, new64, lin_rows, t: int, pass_id: int) -> None:
        """view[idx] = new64 in the weights' precision (stochastic rounding for FP16 when enabled)."""
        new32 = new64.astype(np.float32)
        if self.weights_precision == Precision.FP16:
            bits = (K.rounding_bits_ref(self.seed, t, lin_rows, new32.shape[1], pass_id)
                    if self.stochastic_rounding else None)
            new32 = K.to_half_ref(new32, bits)
        view[idx] = device.xp().asarray(new32)

    def _update(self, ctx, dy, t: int) -> None:
        opt = self.optimizer
        specs = self._state_specs()
        weights = self.split_weights()
        states = self.split_optimizer_states()
        for tb, (rows, g) in enumerate(self._row_grads(ctx, dy)):
            if rows.size == 0:
                continue
            idx = device.xp().asarray(rows)
            w = device.to_host(weights[tb][idx])
            s = [device.to_host(st[idx]) for st in states[tb]]
            new_w, new_s = K.optimizer_update_ref(opt.kind, opt.hp(), w, g, s, t, opt.update_type,
                                                  opt.weight_decay_mode, opt.gradient_clipping)
            self._store_weights(weights[tb], idx, new_w, rows + self.row_offsets[tb], t, K._SR_PASS_HOT)
            for view, val, (_, _, dtype) in zip(states[tb], new_s, specs):
                view[idx] = device.xp().asarray(val.astype(dtype))

    def _global_pass(self, t: int) -> None:
        opt = self.optimizer
        states = self.split_optimizer_states()
        for tb, view in enumerate(self.split_weights()):
            n = self.live_rows(tb)
            if n == 0:
                continue
            w = device.to_host(view[:n])
            s = [device.to_host(st[:n]) for st in states[tb]]
            new_w, new_s = K.global_pass_ref(opt.kind, opt.hp(), w, s, t)
            lin = np.arange(n, dtype=np.int64) + self.row_offsets[tb]
            self._store_weights(view, slice(0, n), new_w, lin, t, K._SR_PASS_ALL)
            for st, val in zip(states[tb], new_s):
                st[:n] = device.xp().asarray(val.astype(np.float32))
