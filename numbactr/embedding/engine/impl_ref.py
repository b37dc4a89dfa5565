"""The engine's NumPy reference implementation (impl "ref"): the oracle of the other two.

It hands each op to the float64 references of numbactr.kernels.tbe_ref on host copies, table by table, and
writes the results back in the weights' precision; simple, vectorized per feature, not fast.
"""

from __future__ import annotations

import weakref

import numpy as np

from numbactr.runtime import device
from numbactr.kernels import tbe
from numbactr.kernels import tbe_row_ops
from numbactr.embedding.engine.specs import BoundsCheck, FloatRows, LookupContext, Optim, Precision, SparseRowGrad


class _RefImpl:
    """The NumPy reference (kernels/tbe_ref.py): the oracle; simple, vectorized per feature, not fast."""

    def __init__(self, eng):
        self.e = weakref.proxy(eng)  # no engine <-> impl cycle: the tables free with the engine

    def repair_offsets(self, offsets, n: int):
        """(repaired offsets, (number repaired, first repaired position))."""
        host = device.to_host(offsets).astype(np.int64)
        fixed, bad = tbe.check_offsets_ref(host, n, BoundsCheck.IGNORE)
        first = int(np.flatnonzero(fixed != host)[0]) if bad else -1
        return device.xp().asarray(fixed), (bad, first)

    def check_indices(self, indices, offsets, fixed, pre, batch: int, mode=None):
        """(rows, status): FATAL's rows are IGNORE's (the engine raises before anyone reads them)."""
        e = self.e
        mode = BoundsCheck.IGNORE if e.bounds_check == BoundsCheck.FATAL else e.bounds_check
        rows, bad, first = tbe.check_indices_ref(
            device.to_host(indices), device.to_host(fixed), e._feature_rows(), batch, e.layout, mode
        )
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
        tables = (
            self._tables()
            if block is None
            else [
                device.to_host(block.weights)[block.elem_offsets[t] : block.elem_offsets[t + 1]].reshape(
                    -1, int(block.strides[t])
                )[:, : int(e.dims[t])]
                for t in range(len(e.tables))
            ]
        )
        out = tbe.tbe_forward_ref(tables, e.feature_table_map, rows, offs, ctx.batch, ctx.pooling, e.layout, psw)
        dtype = np.float16 if e.output_dtype == Precision.FP16 else np.float32
        with np.errstate(over="ignore"):
            return device.xp().asarray(out.astype(np.float32).astype(dtype))

    def psw_grad(self, ctx: LookupContext, dy):
        e = self.e
        rows, offs, _ = self._host(ctx)
        g = tbe.per_sample_weights_grad_ref(
            self._tables(),
            e.feature_table_map,
            rows,
            offs,
            ctx.batch,
            ctx.pooling,
            e.layout,
            device.to_host(dy),
            ctx.feature_requires_grad,
        )
        return device.xp().asarray(g.astype(np.float32))

    def backward(self, ctx: LookupContext, dy, t: int):
        """The update of every touched row (or, for optimizer NONE, their gradients as a SparseRowGrad)."""
        e = self.e
        rows_h, offs, psw = self._host(ctx)
        per_table = tbe.tbe_backward_ref(
            e.dims, e.feature_table_map, rows_h, offs, ctx.batch, ctx.pooling, e.layout, device.to_host(dy), psw
        )
        xp = device.xp()
        if e.optimizer.kind == Optim.NONE:
            lin = np.concatenate([r + e.row_offsets[tb] for tb, (r, _) in enumerate(per_table)]).astype(np.int64)
            vals = np.zeros((lin.size, int(e.dims.max())), np.float32)
            at = 0
            for r, g in per_table:
                vals[at : at + r.size, : g.shape[1]] = g
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
            new_w, new_s = tbe.optimizer_update_ref(
                opt.kind,
                opt.hp(),
                w,
                g,
                s,
                t,
                opt.update_type,
                opt.weight_decay_mode,
                opt.counter,
                float(e.max_counter[0]),
                opt.rowwise_bias_correction,
            )
            self._store(weights[tb], idx, new_w, rows + e.row_offsets[tb], t, tbe.SR_PASS_HOT)
            for view, val, (_, _, dtype) in zip(states[tb], new_s, specs):
                view[idx] = xp.asarray(val.astype(dtype))
        return None

    def _store(self, view, idx, new64, lin_rows, t: int, pass_id: int) -> None:
        """view[idx] = new64 in the weights' precision (stochastic rounding for FP16 when enabled)."""
        e = self.e
        new32 = new64.astype(np.float32)
        if e.weights_precision == Precision.FP16:
            hashed = lin_rows if e.sr_rows is None else device.to_host(e.sr_rows)[lin_rows]
            bits = tbe.rounding_bits_ref(e.seed, t, hashed, new32.shape[1], pass_id) if e.stochastic_rounding else None
            new32 = tbe.to_half_ref(new32, bits)
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
            new_w, new_s = tbe.global_pass_ref(opt.kind, opt.hp(), w, s, t)
            self._store(view, slice(0, n), new_w, np.arange(n, dtype=np.int64) + e.row_offsets[tb], t, tbe.SR_PASS_ALL)
            for st, val in zip(states[tb], new_s):
                st[:n] = device.xp().asarray(val.astype(np.float32))

    def scale_rows(self, rows, factors) -> None:
        e = self.e
        tbe_row_ops.scale_rows_ref(
            e.weights, e.elem_offsets, e.strides, e.dims, e.row_offsets, device.to_host(rows), device.to_host(factors)
        )

    def lerp_halves(self, coef: float) -> None:
        e = self.e
        tbe_row_ops.lerp_halves_ref(e.weights, e.elem_offsets, e.strides, e.dims, coef)
