"""The engine's numba.cuda implementation (impl "kernels": the gpu and sim devices): numbactr.kernels.tbe.

One launch per op for all tables, sizes known before each launch, and no host read in a step (bounds check
IGNORE / NONE, unkeyed tables, optimizer other than NONE); a step's scalars travel in small device arrays
written once per step (numbactr.runtime.step_values), so a captured step replays with the same arguments.
"""

from __future__ import annotations

import weakref

import numpy as np

from numbactr.runtime import device
from numbactr.kernels import tbe
from numbactr.kernels import tbe_row_ops
from numbactr.embedding.engine.specs import (
    BoundsCheck,
    FloatRows,
    LookupContext,
    Optim,
    Pooling,
    Precision,
    SparseRowGrad,
)


class _KernelImpl:
    """The numba.cuda kernels of kernels/tbe.py (gpu, sim): one launch per op for all tables, sizes known
    before each launch, no host read in a step (bounds check IGNORE/NONE, unkeyed tables, optimizer other
    than NONE); scratch buffers from the engine's pool, the rest from the array library's pool."""

    def __init__(self, eng):
        self.e = weakref.proxy(eng)  # no engine <-> impl cycle: the tables free with the engine
        xp = device.xp()
        self.elem_off, self.strides, self.dims, self.row_off, self.fcols = (
            xp.asarray(a) for a in (eng.elem_offsets, eng.strides, eng.dims, eng.row_offsets, eng.feature_cols)
        )
        self.ftable = xp.asarray(np.asarray(eng.feature_table_map, np.int64))
        self.tables = tbe.Tables(self.elem_off, self.strides, self.dims, self.row_off, self.ftable, self.fcols)
        self.feature_rows = xp.asarray(eng._feature_rows())
        self.keyed_table = xp.asarray(
            np.array([t if eng.tables[t].keyed else -1 for t in eng.feature_table_map], np.int64)
        )
        self.max_dim = int(eng.dims.max())
        self.w_half = eng.weights_precision == Precision.FP16
        self.no_f32 = xp.zeros(1, np.float32)  # stands in for an absent float array
        self.no_i64 = xp.zeros(1, np.int64)
        self.no_f2 = xp.zeros((1, 1), np.float32)
        self.all_features = xp.ones(eng.n_features, np.bool_)
        self._live_host = self._live_dev = None
        self._step_values: dict = {}  # name -> StepValues: the per-step scalars of a launch

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
        tbe.repair_offsets(offsets, n, fixed, status, e._scratch("scan", scan_partials_size(fixed.shape[0]), np.int64))
        return fixed, status

    def check_indices(self, indices, offsets, fixed, status, batch: int, mode=None):
        e = self.e
        rows = device.xp().empty(indices.shape[0], np.int64)
        if mode is None:
            mode = BoundsCheck.IGNORE if e.bounds_check == BoundsCheck.FATAL else e.bounds_check
        want = bool(e.defer_checks and e.hash_tables)  # the deferred keyed lookup's occurrence tables
        occ = e._scratch("occ_table", indices.shape[0], np.int64) if want else self.no_i64
        tbe.check_indices(
            indices,
            offsets,
            fixed,
            self.feature_rows,
            batch,
            int(e.layout),
            int(mode),
            rows,
            status,
            self.keyed_table,
            occ,
            want,
        )
        return rows, status

    def report(self, status, indices, offsets, fixed, batch: int):
        """One host read of the status; the first offender's details only when there is one."""
        st = device.to_host(status)
        bad_off, bad = int(st[tbe.ST_BAD_OFFSETS]), int(st[tbe.ST_BAD_INDICES])
        first_off = int(st[tbe.ST_FIRST_OFFSET]) if bad_off else -1
        first = None
        if bad:
            k = int(st[tbe.ST_FIRST_INDEX])
            fx = device.to_host(fixed)
            j = int(np.searchsorted(fx, k, side="right")) - 1
            f, b = tbe.bag_feature_sample_ref(self.e.n_features, batch, self.e.layout)
            first = (
                k,
                int(f[j]),
                int(b[j]),
                int(device.to_host(indices[k : k + 1]).astype(np.int64)[0]),
                int(self.e._feature_rows()[f[j]]),
            )
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
        w, eo, st, half = (
            (self._w(), self.elem_off, self.strides, self.w_half)
            if block is None
            else (block.weights, xp.asarray(block.elem_offsets), xp.asarray(block.strides), False)
        )
        tbe.forward(
            w,
            eo,
            st,
            self.ftable,
            self.fcols,
            ctx.rows,
            ctx.offsets,
            self.no_f32 if psw is None else psw,
            psw is not None,
            ctx.batch,
            int(e.layout),
            int(ctx.pooling),
            flat,
            half,
            fp16,
            self.max_dim,
        )
        return out

    def _segment(self, ctx: LookupContext) -> tbe.Segments:
        """Linear rows, bags and the sorted segments of the lookup (once per backward)."""
        from numbactr.kernels.scan import scan_partials_size

        e = self.e
        n = ctx.rows.shape[0]
        if "segments" not in ctx.extra:
            lin, bag_of = e._scratch("lin", n, np.int64), e._scratch("bag_of", n, np.int64)
            perm, flags = e._scratch("perm", n, np.int64), e._scratch("flags", n, np.int64)
            pos, seg = e._scratch("pos", n + 1, np.int64), e._scratch("seg", n + 1, np.int64)
            tbe.segment_rows(
                ctx.rows,
                ctx.offsets,
                self.ftable,
                self.row_off,
                int(e.row_offsets[-1]),
                ctx.batch,
                int(e.layout),
                lin,
                bag_of,
                perm,
                flags,
                pos,
                seg,
                e._scratch("scan", scan_partials_size(n), np.int64),
                device.xp(),
            )
            ctx.extra["segments"] = tbe.Segments(lin, bag_of, perm, pos, seg)
        return ctx.extra["segments"]

    def psw_grad(self, ctx: LookupContext, dy):
        e = self.e
        xp = device.xp()
        _, bag_of, _, _, _ = self._segment(ctx)
        want = self.all_features if ctx.feature_requires_grad is None else xp.asarray(ctx.feature_requires_grad)
        out = xp.empty(ctx.rows.shape[0], np.float32)
        tbe.psw_grad(
            self._w(),
            self.elem_off,
            self.strides,
            self.ftable,
            self.fcols,
            ctx.rows,
            ctx.offsets,
            bag_of,
            dy.reshape(-1),
            want,
            ctx.batch,
            int(e.layout),
            int(ctx.pooling),
            out,
            self.w_half,
            self.max_dim,
        )
        return out

    def put_hot(self, t: int, pooling, batch: int) -> tbe.StepScalars:
        """Step t's scalars of the fused update, in their device arrays (numbactr.runtime.step_values)."""
        e = self.e
        ks, ki = e._ks_ki(None, t, pooling, batch)
        return tbe.StepScalars(
            self._put("hot_ks", ks, np.float32),
            self._put("hot_ki", ki, np.int64),
            self._put("hot_kb", tbe.rounding_base(e.seed, t, tbe.SR_PASS_HOT), np.uint64),
        )

    def put_global(self, t: int) -> tbe.StepScalars:
        """Step t's scalars of the all-rows pass, in their device arrays."""
        e = self.e
        _, ki = e._ks_ki(None, t)
        ks = tbe.kernel_scalars(e.optimizer.hp(), t)
        return tbe.StepScalars(
            self._put("all_ks", ks, np.float32),
            self._put("all_ki", ki, np.int64),
            self._put("all_kb", tbe.rounding_base(e.seed, t, tbe.SR_PASS_ALL), np.uint64),
        )

    def backward(self, ctx: LookupContext, dy, t: int):
        e = self.e
        xp = device.xp()
        seg = self._segment(ctx)
        step = self.put_hot(t, ctx.pooling, ctx.batch)
        self._gate(step.ks, step.ki, t, "hot")
        none = e.optimizer.kind == Optim.NONE
        n = ctx.rows.shape[0]
        grad_rows = xp.empty(n if none else 1, np.int64)
        grad_vals = xp.empty((n, self.max_dim), np.float32) if none else self.no_f2
        states = self._row_states()
        if e.optimizer.counter is not None:
            self._max_counter(step.ks, states.scnt)
        psw = ctx.per_sample_weights
        tbe.update_rows(
            self._w(),
            states,
            self.tables,
            seg,
            ctx.offsets,
            self.no_f32 if psw is None else psw,
            psw is not None,
            dy.reshape(-1),
            step,
            grad_rows,
            grad_vals,
            self.w_half,
            self.max_dim,
            e.sr_rows,
            int(e.optimizer.kind),
            int(e.optimizer.weight_decay_mode),
        )  # compiled for them
        if not none:
            return None
        u = ctx.extra.get("touched_rows")  # a caller that knows U (numbactr.embedding.sharded)
        if u is None:
            u = int(device.to_host(seg.pos[n : n + 1])[0])  # NONE hands back U rows: the one host read
        return SparseRowGrad(grad_rows[:u], grad_vals[:u], e.row_offsets.copy())

    def _row_states(self) -> tbe.RowStates:
        """The engine's optimizer states as the update kernels take them (a stand-in where there is none)."""
        f, i = self.no_f32, self.no_i64
        a, b, r, p, pit, cnt = self.e._state_buffers()
        return tbe.RowStates(
            f if a is None else a,
            f if b is None else b,
            f if r is None else r,
            i if p is None else p,
            f if pit is None else pit,
            f if cnt is None else cnt,
        )

    def _max_counter(self, ks_d, cnt) -> None:
        """COUNTER / COWCLIP's max_counter on the device, in stream order (part of a captured step): renewed
        to 1 + the largest row counter when the step's KS_REFRESH says so, then copied into the step's
        scalars (KS_MAXC). Decided on the device, so a replayed step renews it at the right steps."""
        e = self.e
        xp = device.xp()
        if e.optimizer.counter.max_counter_update_freq > 0:
            top = cnt.max() + np.float32(1.0) if cnt.size else xp.ones((), np.float32)
            e.max_counter[...] = xp.where(ks_d[tbe.M.KS_REFRESH] > 0, top, e.max_counter[0])
        ks_d[tbe.M.KS_MAXC : tbe.M.KS_MAXC + 1] = e.max_counter

    def _live(self):
        """The rows in use per table on the device, uploaded again only when a keyed table grew (an
        upload is a host synchronization; a keyed step has one anyway)."""
        e = self.e
        if e.defer_checks:  # keyed tables' counts copied on the device (device to device: no read)
            if self._live_dev is None or self._live_host is not None:
                self._live_host, self._live_dev = None, device.xp().array(np.array(e.rows, np.int64))
            for tb, table in e.hash_tables.items():
                self._live_dev[tb : tb + 1] = table.device_size
            return self._live_dev
        live = tuple(e.live_rows(tb) for tb in range(len(e.tables)))
        if self._live_host != live:
            self._live_host, self._live_dev = live, device.xp().asarray(np.array(live, np.int64))
        return self._live_dev

    def global_pass(self, t: int) -> None:
        e = self.e
        step = self.put_global(t)
        self._gate(step.ks, step.ki, t, "all")
        tbe.global_pass(
            self._w(),
            self._row_states(),
            self.tables,
            int(e.row_offsets[-1]),
            self._live(),
            step,
            self.w_half,
            self.max_dim,
            e.sr_rows,
        )

    def _gate(self, ks_d, ki_d, t: int, which: str) -> None:
        """The caller's gate (TableBatchedEmbedding.gate) into the step's KI_GO and, for the steps that
        update, t's scalars computed on the device (after the upload, in stream order: part of a captured
        step)."""
        g = self.e.gate
        if g is not None:
            tbe.gate_scalars(ks_d, ki_d, g.go, g.skips, *self.gate_values(t, which, g))

    def gate_values(self, t: int, which: str, gate) -> tuple:
        """The host values gate_scalars reads: (the host's t, the skips it has seen), (lr, beta1, beta2)."""
        hp = self.e.optimizer.hp()
        return (
            self._put(which + "_tv", np.array([t, gate.seen], np.int64), np.int64),
            self._put(which + "_fv", np.array([hp["learning_rate"], hp["beta1"], hp["beta2"]], np.float64), np.float64),
        )

    def scale_rows(self, rows, factors) -> None:
        tbe_row_ops.scale_rows(
            self._w(), self.elem_off, self.strides, self.dims, self.row_off, rows, factors, self.w_half, self.max_dim
        )

    def lerp_halves(self, coef: float) -> None:
        tbe_row_ops.lerp_halves(
            self._w(),
            self.elem_off,
            self.strides,
            self.dims,
            self.row_off,
            int(self.e.row_offsets[-1]),
            coef,
            self.w_half,
            self.max_dim,
        )
