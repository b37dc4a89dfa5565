"""The engine's compiled CPU implementation (impl "cpu", the cpu device's default): numbactr.kernels.tbe_cpu.

The numba-compiled code runs on the engine's host arrays in place: a backward linearizes the occurrences,
radix-sorts them by row and runs one fused reduce + update over the sorted runs, in parallel over rows.

Small tables (at most ``_CpuImpl.small_rows`` linear rows in all, e.g. MovieLens' 2,625 users and items,
each row touched several times a step) take a cheaper pipeline with the same bits: a lookup whose bags
hold at most one occurrence is a gather (tbe_cpu.forward_onehot), and a backward adds each occurrence's
gradient straight into its row's accumulator, in occurrence order, and updates the touched rows in row
order (tbe_cpu.small_update): no linearize, sort or segments, which cost more than the update itself
when the batch has several times more occurrences than the tables have rows. The same role as torch's
dense nn.Embedding gradient (a buffer of every row), but only the touched rows' accumulators are
zeroed and read.
"""

from __future__ import annotations

import weakref

import numba
import numpy as np

from numbactr.runtime.hostmem import HUGE_MIN_BYTES
from numbactr.kernels import tbe
from numbactr.kernels import tbe_cpu
from numbactr.kernels import tbe_row_ops
from numbactr.embedding.engine.specs import (
    BoundsCheck,
    FloatRows,
    Layout,
    LookupContext,
    Optim,
    Pooling,
    Precision,
    SparseRowGrad,
)


def _wants_huge_copy(a, reads: int, huge: bool) -> bool:
    """Whether a host array read at `reads` random rows is worth copying into the scratch pool's huge pages
    first: when it is big, and read at least once per 64 bytes (each random read costs a page walk in 4 KiB
    pages; the copy costs its bytes: sparser reads did not repay it)."""
    return huge and a.dtype == np.float32 and a.nbytes >= HUGE_MIN_BYTES and reads * 64 >= a.nbytes


def _copy_to(dst, src):
    np.copyto(dst, src)
    return dst


class _CpuImpl:
    """The numba-compiled CPU code (kernels/tbe_cpu.py) on host arrays: the cpu device's fast path."""

    def __init__(self, eng):
        self.e = weakref.proxy(eng)  # no engine <-> impl cycle: the tables free with the engine
        self.ftable = np.asarray(eng.feature_table_map, np.int64)
        self.no_f32 = np.zeros(1, np.float32)  # stands in for an absent float array
        self.no_i64 = np.zeros(1, np.int64)
        self.no_vals = np.zeros((1, 1), np.float32)
        self.max_dim = int(eng.dims.max(initial=1))  # the widest table (dims are fixed): scratch widths
        self.touched = None  # small_update's per-linear-row flags, 0 between calls (made on first use)

    #: the most linear rows (all tables) for which the small-table pipeline runs (module docstring): its
    #: update walks every row's flag, and its accumulators are a row per row (a walk of at most 128 KiB of
    #: flags, and 2^17 x 4 x D bytes of accumulators of which only the touched rows are written). Tests set
    #: -1 to force the general path.
    small_rows = 1 << 17

    def _small(self) -> bool:
        return int(self.e.row_offsets[-1]) <= self.small_rows

    def _w(self):
        w = self.e.weights
        return w.view(np.uint16) if w.dtype == np.float16 else w

    def repair_offsets(self, offsets, n: int):
        if offsets.dtype == np.int64 and offsets.flags.c_contiguous and tbe_cpu.offsets_valid(offsets, n):
            return offsets, (0, -1)  # nothing to repair: the caller's array, read only
        fixed = np.empty(offsets.shape[0], np.int64)
        bad, first = tbe_cpu.check_offsets(offsets, n, fixed)
        return fixed, (bad, first)

    def check_indices(self, indices, offsets, fixed, pre, batch: int, mode=None):
        e = self.e
        frows = e._feature_rows()
        # a clean int64 batch of an engine without keyed tables is its own rows: read, never written
        # (the backward reads them too, as FBGEMM's autograd keeps the indices tensor)
        if (
            indices.dtype == np.int64
            and indices.flags.c_contiguous
            and not e.hash_tables
            and not tbe_cpu.count_bad_indices(indices, fixed, frows, batch, int(e.layout))
        ):
            return indices, (*pre, 0, None)
        rows = np.empty(indices.shape[0], np.int64)
        mode = BoundsCheck.IGNORE if e.bounds_check == BoundsCheck.FATAL else e.bounds_check
        bad = tbe_cpu.check_indices(indices, fixed, frows, batch, int(e.layout), int(mode), rows)
        first = (
            tuple(int(v) for v in tbe_cpu.first_bad_index(indices, fixed, frows, batch, int(e.layout))) if bad else None
        )
        return rows, (*pre, bad, first)

    def report(self, status, indices, offsets, fixed, batch: int):
        """(offsets repaired, first, indices out of range, first (position, feature, sample, index, rows))."""
        return status

    def forward(self, ctx: LookupContext, block: FloatRows | None = None):
        e = self.e
        none = ctx.pooling == Pooling.NONE
        shape = (ctx.rows.shape[0], int(e.feature_dims[0])) if none else (ctx.batch, e.total_dim)
        out = np.empty(shape, np.float32)
        psw = ctx.per_sample_weights
        scratch = np.empty((numba.get_num_threads(), self.max_dim), np.float32)
        w, eo, st = (
            (self._w(), e.elem_offsets, e.strides)
            if block is None
            else (block.weights, block.elem_offsets, block.strides)
        )
        if not none and psw is None and self._small() and tbe_cpu.longest_bag(ctx.offsets) <= 1:
            tbe_cpu.forward_onehot(w, eo, st, self.ftable, e.feature_cols, ctx.rows, ctx.offsets, ctx.batch,
                                   int(e.layout), out.reshape(-1))  # fmt: skip
        elif not none and psw is None and e.layout == Layout.FEATURE_MAJOR:  # FBGEMM's common case
            tbe_cpu.forward_pooled(
                w,
                eo,
                st,
                self.ftable,
                e.feature_cols,
                ctx.rows,
                ctx.offsets,
                ctx.batch,
                int(ctx.pooling),
                out.reshape(-1),
                scratch,
            )
        else:
            tbe_cpu.forward(
                w,
                eo,
                st,
                self.ftable,
                e.feature_cols,
                ctx.rows,
                ctx.offsets,
                self.no_f32 if psw is None else psw,
                psw is not None,
                ctx.batch,
                int(e.layout),
                int(ctx.pooling),
                out.reshape(-1),
                scratch,
            )
        # FP16 output: rounded (to nearest even) after the float32 pooling, so the compiled forward has one
        # output type (each of its signatures costs a long compile)
        return out.astype(np.float16) if e.output_dtype == Precision.FP16 else out

    def psw_grad(self, ctx: LookupContext, dy):
        e = self.e
        want = np.ones(e.n_features, np.bool_) if ctx.feature_requires_grad is None else ctx.feature_requires_grad
        out = np.empty(ctx.rows.shape[0], np.float32)
        tbe_cpu.psw_grad(
            self._w(),
            e.elem_offsets,
            e.strides,
            self.ftable,
            e.feature_cols,
            ctx.rows,
            ctx.offsets,
            dy,
            want,
            ctx.batch,
            int(e.layout),
            int(ctx.pooling),
            out,
        )
        return out

    def backward(self, ctx: LookupContext, dy, t: int):
        e = self.e
        if e.optimizer.kind != Optim.NONE and self._small():
            return self._small_backward(ctx, dy, t)
        n = ctx.rows.shape[0]
        sentinel = int(e.row_offsets[-1])
        psw = ctx.per_sample_weights
        pooled = ctx.pooling != Pooling.NONE
        by_bag = pooled and psw is None
        n_bags = ctx.offsets.shape[0] - 1
        # 32-bit sort keys and payloads when they fit: the sort moves half the bytes
        kt = np.int32 if sentinel < 2**31 - 1 else np.int64
        # payloads: dy offsets (by_bag) or occurrence numbers
        pt = np.int32 if max(n, n_bags, dy.size) < 2**31 - 1 else np.int64
        lin, pay = e._scratch("lin", n, kt), e._scratch("pay", n, pt)
        flat = dy.reshape(-1)
        pooling = ctx.pooling
        if by_bag and pooling == Pooling.MEAN and tbe_cpu.longest_bag(ctx.offsets) <= 1:
            pooling = Pooling.SUM  # every bag's mean is its sum: no pre-scaled copy of dy to write
        scaled = by_bag and pooling == Pooling.MEAN
        if not scaled and _wants_huge_copy(flat, n, e.huge_pages):
            # the update reads a random dy row per occurrence: from huge pages, not the caller's 4 KiB pages
            # (the MEAN lookup's pre-scaled copy is in the scratch pool's huge pages already)
            flat = _copy_to(e._scratch("dy_huge", flat.shape[0], np.float32), flat)
        if by_bag:  # the sorted payload is the bag's dy row itself; MEAN reads a pre-scaled copy
            bag_of, bag_src, bag_scale = self.no_i64, self.no_i64, self.no_f32
            dys = e._scratch("dy_scaled", flat.shape[0], np.float32) if scaled else self.no_f32
        else:
            bag_of = e._scratch("bag_of", n, np.int64)
            bag_src = e._scratch("bag_src", n_bags, np.int64)
            bag_scale = e._scratch("bag_scale", n_bags, np.float32)
            dys = self.no_f32
        tbe_cpu.linearize(
            ctx.rows,
            ctx.offsets,
            self.ftable,
            e.row_offsets,
            e.feature_cols,
            ctx.batch,
            int(e.layout),
            int(pooling),
            by_bag,
            sentinel,
            flat,
            dys,
            lin,
            pay,
            bag_of,
            bag_src,
            bag_scale,
        )
        # the gradient rows the update reads, always flat (one signature of the compiled update, not two)
        dy = dys if scaled else flat
        keys, vals = e._scratch("keys", n, kt), e._scratch("vals", n, pt)
        tbe_cpu.radix_sort(
            lin,
            pay,
            tbe_cpu.radix_bits(sentinel),
            keys,
            vals,
            e._scratch("keys_tmp", n, kt),
            e._scratch("vals_tmp", n, pt),
        )
        seg = e._scratch("seg", n + 1, np.int64)
        n_seg = tbe_cpu.segments(keys, sentinel, seg)
        e._renew_max_counter(t)
        ks, ki = e._ks_ki(ctx, t)
        none = e.optimizer.kind == Optim.NONE
        grad_rows = np.empty(n_seg if none else 1, np.int64)
        grad_vals = np.empty((n_seg if none else 1, self.max_dim), np.float32)
        a, b, r, p, pit, cnt = e._state_buffers()
        rows = tuple(self.no_f32 if x is None else x for x in (r, pit, cnt))
        tbe_cpu.fused_update(
            self._w(),
            self.no_f32 if a is None else a,
            self.no_f32 if b is None else b,
            rows,
            self.no_i64 if p is None else p,
            e.elem_offsets,
            e.strides,
            e.dims,
            e.row_offsets,
            keys,
            vals,
            by_bag,
            seg,
            n_seg,
            bag_of,
            bag_src,
            bag_scale,
            self.no_f32 if psw is None else psw,
            psw is not None,
            dy,
            ks,
            ki,
            e._rounding_base(t, tbe.SR_PASS_HOT),
            grad_rows,
            grad_vals,
            self.no_i64 if e.sr_rows is None else e.sr_rows,
            e.sr_rows is not None,
        )
        return SparseRowGrad(grad_rows, grad_vals, e.row_offsets.copy()) if none else None

    def _small_backward(self, ctx: LookupContext, dy, t: int) -> None:
        """backward for small tables (module docstring): tbe_cpu.small_update, the same bits as the sort path."""
        e = self.e
        rows_total = int(e.row_offsets[-1])
        if self.touched is None:
            self.touched = np.zeros(rows_total, np.int8)
        psw = ctx.per_sample_weights
        e._renew_max_counter(t)
        ks, ki = e._ks_ki(ctx, t)
        a, b, r, p, pit, cnt = e._state_buffers()
        tbe_cpu.small_update(
            self._w(),
            self.no_f32 if a is None else a,
            self.no_f32 if b is None else b,
            tuple(self.no_f32 if x is None else x for x in (r, pit, cnt)),
            self.no_i64 if p is None else p,
            e.elem_offsets,
            e.strides,
            e.dims,
            e.row_offsets,
            ctx.rows,
            ctx.offsets,
            self.ftable,
            e.feature_cols,
            ctx.batch,
            int(e.layout),
            int(ctx.pooling),
            self.no_f32 if psw is None else psw,
            psw is not None,
            dy.reshape(-1),
            self.touched,
            e._scratch("acc", max(rows_total, 1) * self.max_dim, np.float32),  # flat: a row of max_dim per row
            ks,
            ki,
            e._rounding_base(t, tbe.SR_PASS_HOT),
            self.no_i64 if e.sr_rows is None else e.sr_rows,
            e.sr_rows is not None,
            e._scratch("small_rows", 3 * self.max_dim * numba.get_num_threads(), np.float32).reshape(
                -1, 3 * self.max_dim
            ),
            self.no_i64,
            self.no_vals,
        )
        return None

    def global_pass(self, t: int) -> None:
        e = self.e
        ki, ks = e._ki(t), e._global_ks(t)
        live = np.array([e.live_rows(tb) for tb in range(len(e.tables))], np.int64)
        a, b = e._state_buffers()[:2]
        tbe_cpu.global_pass(
            self._w(),
            a,
            self.no_f32 if b is None else b,
            e.elem_offsets,
            e.strides,
            e.dims,
            e.row_offsets,
            live,
            ks,
            ki,
            e._rounding_base(t, tbe.SR_PASS_ALL),
            self.no_i64 if e.sr_rows is None else e.sr_rows,
            e.sr_rows is not None,
        )

    def scale_rows(self, rows, factors) -> None:
        e = self.e
        tbe_row_ops.scale_rows_cpu(self._w(), e.elem_offsets, e.strides, e.dims, e.row_offsets, rows, factors)

    def lerp_halves(self, coef: float) -> None:
        e = self.e
        tbe_row_ops.lerp_halves_cpu(self._w(), e.elem_offsets, e.strides, e.dims, e.row_offsets, np.float32(coef))
