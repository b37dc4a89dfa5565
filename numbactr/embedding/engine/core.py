"""TableBatchedEmbedding: the engine's state (buffers, layout, hash tables) and its public methods.

The contract is the package's docstring (numbactr/embedding/engine/__init__.py); the work of each op is done
by one implementation per device, picked at construction: impl_ref.py (NumPy), impl_cpu.py (compiled CPU),
impl_kernels.py (numba.cuda, the gpu and sim devices). Everything they share lives here, the lookup side's
helpers (bounds reports, keyed rows, INT8 decoding) in lookup_rows.py, a mixin the class inherits.
"""

from __future__ import annotations

import math
import operator
from dataclasses import fields, replace

import numpy as np

from numbactr.runtime import device
from numbactr.runtime.hostmem import huge_pages_wanted
from numbactr.kernels import fused8bit
from numbactr.kernels import nbit_rows
from numbactr.kernels import tbe
from numbactr.embedding.hash_table import HashTable
from numbactr.embedding.engine.buffers import _zeros, fill_uniform_rows
from numbactr.embedding.engine.impl_cpu import _CpuImpl
from numbactr.embedding.engine.impl_kernels import _KernelImpl
from numbactr.embedding.engine.impl_ref import _RefImpl
from numbactr.embedding.engine.lookup_rows import _LookupRows
from numbactr.embedding.engine.specs import (
    FIXED_HYPER_PARAMETERS,
    IMPLS,
    BoundsCheck,
    Grads,
    Layout,
    LookupContext,
    Optim,
    OptimizerSpec,
    Pooling,
    Precision,
    _as_table,
    _check_optimizer,
    state_specs,
)

_IMPLS = {"ref": _RefImpl, "cpu": _CpuImpl, "kernels": _KernelImpl}


class TableBatchedEmbedding(_LookupRows):
    """Many tables, many features, one lookup and one fused update per step. See the package docstring."""

    #: see __init__ (class defaults too: engines built another way, e.g. TieredEmbedding, never defer)
    defer_checks = False
    _bounds_rec = None
    _step_free = None  # _step_constants' cache
    _state_bufs = None  # _state_buffers' cache

    def __init__(
        self,
        tables,
        feature_table_map=None,
        *,
        pooling=Pooling.SUM,
        optimizer: OptimizerSpec | None = None,
        weights_precision=Precision.FP32,
        output_dtype=Precision.FP32,
        bounds_check=BoundsCheck.WARNING,
        stochastic_rounding: bool = True,
        layout=Layout.FEATURE_MAJOR,
        seed: int = 0,
        impl: str | None = None,
        pad_rows: bool = True,
        row_codecs=None,
        table_align: int = 1,
    ):
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
            self.strides = -(-dims // lane) * lane  # (T,) padded widths
        # table_align > 1 rounds each table's size up (FBGEMM's inference TBE: 128-byte cache lines)
        sizes = -(-(rows * self.strides) // int(table_align)) * int(table_align)
        self.elem_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.row_offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self.dims, self.rows = dims, rows
        self.feature_dims = dims[ftable]
        self.feature_cols = np.concatenate([[0], np.cumsum(self.feature_dims)]).astype(np.int64)

        xp = device.xp()
        wdtype = {Precision.FP16: np.float16, Precision.INT8: np.uint8}.get(self.weights_precision, np.float32)
        self.huge_pages = huge_pages_wanted()  # host buffers in huge pages (numbactr.runtime.hostmem), read once
        try:
            self.weights = _zeros(int(self.elem_offsets[-1]), wdtype, self.huge_pages)  # (sum V_t * stride_t,)
            self.states = [self._new_state(per_row, dtype, name) for name, per_row, dtype in self._state_specs()]
        except MemoryError as e:
            raise MemoryError(
                f"embedding tables of {int(rows.sum())} rows in all (widths {sorted(set(dims.tolist()))}, "
                f"{self.optimizer.kind.name} with {len(self._state_specs())} state buffer(s)): {e}"
            ) from None
        # counter-based regularization's max_counter (1 + the largest row counter, renewed every
        # max_counter_update_freq steps), on the engine's device: a kernels step never reads it back
        self.max_counter = xp.ones(1, np.float32)
        self.hash_tables = {
            t: HashTable(spec.rows, use_kernels=self.impl == "kernels", xp=xp, compiled=self.impl == "cpu")
            for t, spec in enumerate(self.tables)
            if spec.keyed
        }
        self._ws = {}  # scratch pool (_scratch)
        self._impl = _IMPLS[self.impl](self)

    # ---- configuration ------------------------------------------------------------------------------
    def _pick_impl(self, impl):
        if impl is None:  # the cpu device's references only: numbactr.runtime.device.reference_ops
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
            raise NotImplementedError(
                "INT8 weights are not supported for keyed (hash) tables: a new key's row "
                "would be written during a lookup; use FP32 or FP16 weights"
            )
        if row_codecs is None:
            bad = [int(d) for d in dims if d % 4]
            if bad:
                raise ValueError(
                    f"INT8 weights need every table's dim to be a multiple of 4 (FBGEMM's rule), got {bad}"
                )
            return [nbit_rows.fused8bit_codec(int(d)) for d in dims]
        codecs = list(row_codecs)
        if len(codecs) != len(dims) or any(c.dim != d for c, d in zip(codecs, dims)):
            raise ValueError(
                f"row_codecs must give one codec per table with the table's dim {list(map(int, dims))}, "
                f"got dims {[c.dim for c in codecs]}"
            )
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
            return 1  # HugeCTR's prev_time starts at 1
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
            raise ValueError(
                f"hyper-parameter(s) {sorted(values)}: the change would need other optimizer states "
                "({}, not {})".format(*names)
            )
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
            return buf[self.row_offsets[t] : self.row_offsets[t + 1]]
        lo, hi = self.elem_offsets[t], self.elem_offsets[t + 1]
        return buf[lo:hi].reshape(int(self.rows[t]), int(self.strides[t]))[:, : int(self.dims[t])]

    def split_weights(self) -> list:
        """One (V_t, D_t) view per table into the weights buffer (writes go to the engine); INT8 weights:
        (V_t, D_t + 8) uint8 views, each row its D bytes, scale and bias (kernels/fused8bit.py, FBGEMM's)."""
        if self.int8:
            return [
                self.weights[self.elem_offsets[t] : self.elem_offsets[t] + self.rows[t] * self.strides[t]].reshape(
                    int(self.rows[t]), int(self.strides[t])
                )
                for t in range(len(self.tables))
            ]
        return [self._table_view(self.weights, t, False) for t in range(len(self.tables))]

    def split_optimizer_states(self) -> list:
        """Per table, the list of its optimizer state views in kernels.tbe.STATES order:
        (V_t, D_t) per-element, (V_t,) per-row."""
        specs = self._state_specs()
        return [
            [self._table_view(buf, t, per_row) for buf, (_, per_row, _) in zip(self.states, specs)]
            for t in range(len(self.tables))
        ]

    def restart_rows(self, t: int, rows, values) -> None:
        """Rows `rows` of table t take `values` and every optimizer state its initial value: a slot an
        evicting table (numbactr.embedding.evicting) gave to a new key starts afresh."""
        self.split_weights()[t][rows] = values
        for view, (name, _, _) in zip(self.split_optimizer_states()[t], self._state_specs()):
            view[rows] = self.initial_state_value(name)

    def take_rows(self, t: int, old: TableBatchedEmbedding, src, dst) -> None:
        """Rows src of `old`'s table t, with their optimizer states, into rows dst of this engine's table t
        (an evicting table's index grew: every row follows its key into the larger engine)."""
        self.split_weights()[t][dst] = old.split_weights()[t][src]
        for nv, ov in zip(self.split_optimizer_states()[t], old.split_optimizer_states()[t]):
            nv[dst] = ov[src]

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
                raise ValueError(
                    f"adopt_host_buffers: {what} must be ({own.shape[0]},) {own.dtype}, got {buf.shape} {buf.dtype}"
                )
        if weights is not None:
            self.weights = weights
        for i, buf in (states or {}).items():
            self.states[i] = buf
        self._state_bufs = None  # (_state_buffers would see the swap; this lets the old buffers go now)

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
            view[: src.shape[0]][hit] = kept

    def init_uniform(self, lo: float, hi: float, seed: int | None = None) -> None:
        """Every weight U(lo, hi), drawn from a hash of (seed, linear row, d): the same on every device."""
        seed = self.seed if seed is None else int(seed)
        for t, view in enumerate(self.split_weights()):
            if self.int8:  # the same values, each row quantized (FBGEMM's way for INT8)
                vals = np.empty((int(self.rows[t]), int(self.dims[t])), np.float32)
                fill_uniform_rows(vals, int(self.row_offsets[t]), seed, lo, hi, what=f"table {t}")
                c = self.codecs[t]
                q = (
                    fused8bit.quantize_rows_ref(vals)
                    if c.ty == "fused8bit"
                    else nbit_rows.encode_rows_ref(
                        vals, c.ty, reverse_qparam=c.reverse_qparam, scale_bias_bytes=c.scale_bias_bytes
                    )
                )
                view[...] = 0
                view[:, : q.shape[1]] = device.xp().asarray(q)
                continue
            fill_uniform_rows(view, int(self.row_offsets[t]), seed, lo, hi, what=f"table {t}")

    # ---- forward ------------------------------------------------------------------------------------
    def forward(
        self,
        indices,
        offsets,
        per_sample_weights=None,
        *,
        training: bool = True,
        pooling=None,
        feature_requires_grad=None,
        skip=None,
    ):
        """(out, ctx): pooled (B, sum D_f) or, for NONE, (N, D) embeddings; see the module docstring.
        skip (N,) bool, optional: occurrences that read nothing (zeros), are not inserted into a hash table
        and are not updated (row -1), e.g. the keys another rank owns in a gathered sharded lookup
        (numbactr.embedding.sharded); computed on the device, no host read."""
        ctx = self.lookup(
            indices,
            offsets,
            per_sample_weights,
            training=training,
            pooling=pooling,
            feature_requires_grad=feature_requires_grad,
            skip=skip,
        )
        return self._forward(ctx), ctx

    def pool(self, ctx: LookupContext):
        """forward's output of a lookup(): the rows ctx reads, pooled as they are now."""
        return self._forward(ctx)

    def touched_rows(self, ctx: LookupContext):
        """(U,) int64 the distinct linear rows (row_offsets[t] + r) that the lookup ctx reads, ascending, on
        the engine's device."""
        xp = device.xp()
        n = ctx.rows.shape[0]
        k = xp.arange(n, dtype=np.int64)
        bag = xp.searchsorted(ctx.offsets[1:], k, side="right")
        inside = (k >= ctx.offsets[0]) & (bag < ctx.offsets.shape[0] - 1) & (ctx.rows >= 0)
        bag = xp.minimum(bag, max(ctx.offsets.shape[0] - 2, 0))
        feature = bag // max(ctx.batch, 1) if self.layout == Layout.FEATURE_MAJOR else bag % self.n_features
        first = xp.asarray(self.row_offsets[:-1][np.asarray(self.feature_table_map, np.int64)])[feature]
        return xp.unique((first + ctx.rows)[inside])

    def row_state(self, name: str):
        """The per-row optimizer state `name` (state_specs' names, e.g. "prev_iter") as the engine's flat
        (sum V_t,) buffer, indexed by linear row; writes reach the engine."""
        for buf, (n, per_row, _) in zip(self.states, self._state_specs()):
            if n == name and per_row:
                return buf
        raise KeyError(
            f"the engine keeps no per-row optimizer state {name!r} ({[n for n, _, _ in self._state_specs()]})"
        )

    def _row_elements(self, rows):
        """(U, max D) int64 flat weight positions of linear rows `rows` (columns past a row's D_t repeat its
        last element, so a gather and the scatter of what it gathered agree)."""
        xp = device.xp()
        t = xp.searchsorted(xp.asarray(self.row_offsets), rows, side="right") - 1
        base = xp.asarray(self.elem_offsets)[t] + (rows - xp.asarray(self.row_offsets)[t]) * xp.asarray(self.strides)[t]
        d = xp.arange(int(self.dims.max()), dtype=np.int64)[None, :]
        return base[:, None] + xp.minimum(d, xp.asarray(self.dims)[t][:, None] - 1)

    def copy_rows(self, rows):
        """(U, max D) copy of the weights of linear rows `rows` (U,) int64, for restore_rows."""
        return self.weights[self._row_elements(rows)]

    def restore_rows(self, rows, saved) -> None:
        """Put back what copy_rows(rows) copied."""
        self.weights[self._row_elements(rows)] = saved

    def scale_rows(self, rows, factors) -> None:
        """Every value of linear row rows[i] times factors[i] (rows (U,) int64 distinct, factors (U,) float32,
        arrays of the engine's device), rounded once to the weights' precision (kernels/tbe_row_ops.py):
        FBGEMM's global weight decay. One op on the device, no host read."""
        xp = device.xp()
        rows = xp.ascontiguousarray(xp.asarray(rows).astype(np.int64, copy=False))
        factors = xp.ascontiguousarray(xp.asarray(factors).astype(np.float32, copy=False))
        if rows.ndim != 1 or factors.shape != rows.shape:
            raise ValueError(f"scale_rows needs rows (U,) and factors (U,), got {rows.shape} and {factors.shape}")
        if self.int8:
            raise NotImplementedError("scale_rows: INT8 weights are forward only")
        if rows.shape[0]:
            self._impl.scale_rows(rows, factors)

    def lerp_halves(self, coef: float) -> None:
        """Every row of every table (each D_t even): its second half moves coef of the way to its first,
        torch.lerp_'s formula in float32, rounded once (kernels/tbe_row_ops.py): FBGEMM's EMA in place."""
        odd = [t for t, d in enumerate(self.dims) if d % 2]
        if odd:
            raise ValueError(
                f"lerp_halves needs every table's dim to be even; table {odd[0]} has {int(self.dims[odd[0]])}"
            )
        if self.int8:
            raise NotImplementedError("lerp_halves: INT8 weights are forward only")
        self._impl.lerp_halves(float(coef))

    def lookup(
        self,
        indices,
        offsets,
        per_sample_weights=None,
        *,
        training: bool = True,
        pooling=None,
        feature_requires_grad=None,
        skip=None,
    ) -> LookupContext:
        """forward's first half: its checks and row resolution (bounds, hash tables, tiers; FATAL raises here),
        as the LookupContext. pool(ctx) then gives forward's output; a caller may change rows in between
        (FBGEMM's global weight decay scales the rows a lookup reads before it reads them: touched_rows,
        scale_rows)."""
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
            raise ValueError(
                f"offsets has {offsets.shape[0]} entries; it needs F*B + 1 with F = "
                f"{self.n_features} features (B samples)"
            )
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
            indices = self._as_int64(
                indices,
                on_device=self.defer_checks
                and self.impl == "kernels"
                and self.bounds_check in (BoundsCheck.FATAL, BoundsCheck.WARNING),
            )
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
                self._bounds_rec = tbe.new_bounds_record(xp)
            tbe.record_bounds(
                status, indices, offsets, fixed, self._impl.feature_rows, batch, int(self.layout), self._bounds_rec
            )
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
            rows[...] = xp.where(skip, -1, rows)  # an element-wise select: no host read
        rows = self._storage_rows(indices, rows, fixed, batch, training)
        ctx = LookupContext(rows, fixed, psw, batch, pooling, feature_requires_grad)
        if new_rows:
            ctx.extra["new_rows"] = new_rows
        return ctx

    def _forward(self, ctx: LookupContext):
        if not self.int8:
            return self._impl.forward(ctx)
        block, local = self._int8_rows(ctx)
        return self._impl.forward(replace(ctx, rows=local, extra={}), block)

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

    # ---- backward -----------------------------------------------------------------------------------
    def backward(self, ctx: LookupContext, grad_output) -> Grads:
        """Apply the fused update for the lookup `ctx` with dLoss/dout; see the module docstring."""
        if self.int8:
            raise NotImplementedError(
                "INT8 weights are forward only (FBGEMM's CPU TBE has no INT8 backward "
                "either): train with FP32 or FP16 weights and quantize for serving"
            )
        xp = device.xp()
        dy = xp.asarray(grad_output)
        want = (
            (ctx.rows.shape[0], int(self.feature_dims[0]))
            if ctx.pooling == Pooling.NONE
            else (ctx.batch, self.total_dim)
        )
        if dy.ndim == 3 and ctx.pooling != Pooling.NONE:
            dy = dy.reshape(dy.shape[0], -1)
        if tuple(dy.shape) != want:
            raise ValueError(f"grad_output must have shape {want} for this lookup, got {tuple(dy.shape)}")
        if dy.dtype.kind != "f":
            raise TypeError(f"grad_output must be float, got {dy.dtype}")
        dy = xp.ascontiguousarray(dy.astype(np.float32, copy=False))
        if self.optimizer.gradient_clipping:  # FBGEMM clips dLoss/dout, not the row sums
            m = np.float32(self.optimizer.max_gradient)
            dy = xp.clip(dy, -m, m)
        grads = Grads()
        if ctx.per_sample_weights is not None:  # before the update: it reads the old weights
            grads.per_sample_weights = self._impl.psw_grad(ctx, dy)
        t = self.step + 1
        opt = self.optimizer
        glob = tbe.has_global_pass(opt.kind, opt.update_type)
        first = glob and tbe.global_pass_first(opt.kind, self._step_constants()[0])
        if first:
            self._impl.global_pass(t)
        grads.sparse = self._impl.backward(ctx, dy, t)
        if glob and not first:
            self._impl.global_pass(t)
        self.step = t
        if isinstance(self._impl, _KernelImpl):  # what a replayed step (numbactr.train.cuda_graphs) redoes
            from numbactr.runtime import step_values

            step_values.on_replay(
                ("engine", id(self)),
                lambda run, p=ctx.pooling, b=ctx.batch, g=self.gate: self._replay_backward(p, b, g),
            )
        return grads

    def _replay_backward(self, pooling, batch: int, gate=None) -> None:
        """The host half of backward's kernel step, for a replayed step: the step's device scalars and the
        step counter (the kernels' work is in the graph)."""
        t = self.step + 1
        self._impl.put_hot(t, pooling, batch)
        if gate is not None:
            self._impl.gate_values(t, "hot", gate)
        if tbe.has_global_pass(self.optimizer.kind, self.optimizer.update_type):
            self._impl.put_global(t)
            if gate is not None:
                self._impl.gate_values(t, "all", gate)
        self.step = t

    # ---- what the implementations share --------------------------------------------------------------
    def _state_buffers(self) -> tuple:
        """(a, b, row, prev, prev_iter, row_counter): elem_update's per-element states a, b, the rowwise
        kinds' per-row float state, HugeCTR's per-row step state and the counter states, as the engine's
        flat buffers; None where the optimizer keeps none. Kept while the same buffers are the states (the
        specs cannot change: set_hyper_parameters refuses; adopt_host_buffers swaps buffers): every step
        asks."""
        cached = self._state_bufs
        if cached is not None and len(cached[0]) == len(self.states) and all(map(operator.is_, cached[0], self.states)):
            return cached[1]
        elem, rowf, named = [], [], {}
        for buf, (name, per_row, dtype) in zip(self.states, self._state_specs()):
            if name in ("prev_step", "prev_iter", "row_counter"):
                named[name] = buf
            elif per_row:
                rowf.append(buf)
            else:
                elem.append(buf)
        out = (
            tuple(elem + [None] * (2 - len(elem)))
            + ((rowf or [None])[0],)
            + tuple(named.get(n) for n in ("prev_step", "prev_iter", "row_counter"))
        )
        self._state_bufs = (tuple(self.states), out)
        return out

    def _max_counter_refresh(self, t: int) -> bool:
        """Whether step t renews max_counter (COUNTER / COWCLIP: every max_counter_update_freq steps)."""
        c = self.optimizer.counter
        return c is not None and c.max_counter_update_freq > 0 and t % c.max_counter_update_freq == 0

    def _renew_max_counter(self, t: int) -> None:
        """Host impls: max_counter = 1 + the largest row counter (1 without rows) at a renewing step t."""
        if self._max_counter_refresh(t):
            cnt = self._state_buffers()[5]
            self.max_counter[0] = float(cnt.max()) + 1.0 if cnt.size else 1.0

    def _step_constants(self) -> tuple:
        """(hp, step-free kernel scalars with the counter settings, the same without (the all-rows pass),
        step-free kernel ints) of the current optimizer spec (kernels.tbe.step_free_scalars / _ints): they
        change only with the spec, which is frozen, so a change of learning rate or any hyper-parameter
        replaces it and the identity check below rebuilds them (the rebuild costs what every step cost)."""
        opt = self.optimizer
        cached = self._step_free
        if cached is None or cached[0] is not opt:
            hp = opt.hp()
            ints = tbe.step_free_ints(
                opt.kind, opt.update_type, opt.weight_decay_mode, opt.counter, opt.rowwise_bias_correction
            )
            cached = (opt, hp, tbe.step_free_scalars(hp, opt.counter), tbe.step_free_scalars(hp), ints)
            self._step_free = cached
        return cached[1:]

    def _stochastic(self) -> bool:
        """Whether updates round to FP16 stochastically (kernels.tbe_math.KI_SR)."""
        return self.weights_precision == Precision.FP16 and self.stochastic_rounding

    def _ks_ki(self, ctx, t: int, pooling=None, batch: int = 0):
        """The packed kernel scalars / integers (kernels.tbe.kernel_scalars / kernel_ints) for step t (of a
        lookup ctx, or of `pooling` and `batch`): copies of _step_constants' arrays with the step's entries."""
        if ctx is not None:
            pooling, batch = ctx.pooling, ctx.batch
        hp, ks0, _, _ = self._step_constants()
        # the kernels read max_counter from the device (_KernelImpl.backward copies it in): no host read
        maxc = 1.0 if self.impl == "kernels" else float(self.max_counter[0])
        ks = ks0.copy()
        tbe.set_step_scalars(ks, hp, t, maxc, self._max_counter_refresh(t))
        return ks, self._ki(t, pooling, batch)

    def _ki(self, t: int, pooling=None, batch: int = 0):
        """_ks_ki's integers alone (the all-rows pass takes its own scalars, _global_ks)."""
        ki = self._step_constants()[3].copy()
        tbe.set_step_ints(ki, t, self._stochastic(), self.pooling if pooling is None else pooling, self.layout, batch)
        return ki

    def _global_ks(self, t: int):
        """The packed kernel scalars of step t's all-rows pass: kernels.tbe.kernel_scalars(hp, t), no counter."""
        hp, _, ks0, _ = self._step_constants()
        ks = ks0.copy()
        tbe.set_step_scalars(ks, hp, t)
        return ks

    def _rounding_base(self, t: int, pass_id: int):
        """kernels.tbe.rounding_base of step t's pass, or 0 where no update rounds stochastically: the
        kernels read it only under KI_SR, and its splitmix64 reference costs more than a small step's update."""
        return tbe.rounding_base(self.seed, t, pass_id) if self._stochastic() else np.uint64(0)

    def _scratch(self, name: str, n: int, dtype):
        """A reused device buffer of n elements (grown by half when too small): the per-step scratch pool."""
        buf = self._ws.get(name)
        if buf is None or buf.shape[0] < n or buf.dtype != np.dtype(dtype):
            size = n if buf is None else max(n, int(buf.shape[0] * 1.5))
            buf = _zeros(max(size, 1), dtype, self.huge_pages)
            self._ws[name] = buf
        return buf[:n]
