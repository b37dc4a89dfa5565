"""The lookup side of TableBatchedEmbedding (core.py), as a mixin: bounds reporting (eager and deferred),
keyed rows (hash-table inserts and finds, new rows' initial values), the INT8 weights' decoding.

Apart from core.py so that the class's file holds its state and its op methods; the methods here keep their
names on the class (TableBatchedEmbedding inherits them; numbactr.embedding.tiered's engine uses them).
"""

from __future__ import annotations

import warnings

import numpy as np

from numbactr.runtime import device
from numbactr.kernels import embedding_init
from numbactr.kernels import tbe
from numbactr.embedding.hash_table import HashTable
from numbactr.embedding.engine.specs import (
    BoundsCheck,
    EmbeddingBoundsError,
    FloatRows,
    Layout,
    LookupContext,
    Pooling,
)

DECODE_CHUNK_ELEMS = 1 << 22  # values per chunk an INT8 lookup decodes at a time (its temporaries ~50 MB)


class _LookupRows:
    """TableBatchedEmbedding's lookup helpers (module docstring); uses the engine's attributes only."""

    def forward_bytes(self, indices, offsets, width: int):
        """Byte-row weights (INT8) without pooling: (N, width) uint8, each occurrence's stored row bytes
        (the first width of them, as stored: quantized values with their scale and bias, undecoded), in
        occurrence order; an index that reads nothing (pruned, or a bad index under IGNORE) gives zeros.
        FBGEMM's inference TBE returns this for output_dtype INT8 with PoolingMode.NONE."""
        if not self.int8:
            raise ValueError(
                f"forward_bytes reads byte-row (INT8) weights; these tables hold {self.weights_precision.name}"
            )
        ctx = self.lookup(indices, offsets, None, training=False, pooling=Pooling.NONE)
        xp = device.xp()
        width = int(width)
        short = [t for t, c in enumerate(self.codecs) if c.row_bytes < width]
        if short:
            raise ValueError(
                f"forward_bytes: width {width} is more than table {short[0]}'s "
                f"{self.codecs[short[0]].row_bytes} bytes per row"
            )
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
        bag = xp.searchsorted(ctx.offsets[1:], xp.arange(n, dtype=np.int64), side="right")  # (N,) bag of k
        feature = bag // ctx.batch if self.layout == Layout.FEATURE_MAJOR else bag % self.n_features
        table = xp.asarray(np.asarray(self.feature_table_map, np.int64))[feature]
        return [xp.flatnonzero(table == t) for t in range(len(self.tables))]

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
            block = w[elem_off[t] : elem_off[t + 1]].reshape(int(counts[t]), int(strides[t]))
            at, r = at[ok], r[ok]
            step = max(1, DECODE_CHUNK_ELEMS // int(self.dims[t]))  # bounds decode's temporaries
            for lo in range(0, int(at.shape[0]), step):
                block[at[lo : lo + step], : int(self.dims[t])] = self.codecs[t].decode(view[r[lo : lo + step]], xp)
        return FloatRows(w, elem_off, strides), local

    def check_deferred(self) -> None:
        """Raise (FATAL, a full or misused hash table) or warn (WARNING) about what the lookups since the last
        call recorded on the device (defer_checks); one host read per record that was written to."""
        rec = self._bounds_rec
        if rec is not None:
            h = device.to_host(rec).astype(np.int64)
            if h[0] or h[3]:
                rec[...] = tbe.new_bounds_record(device.xp())
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
                raise EmbeddingBoundsError(tbe.offsets_message(int(h[1]), int(h[2]), int(h[9]), int(h[10])) + since)
            if first is not None:
                raise EmbeddingBoundsError(tbe.bounds_message(first, bad, BoundsCheck.FATAL) + since)
            raise EmbeddingBoundsError(f"{bad} indices out of range and {bad_off} offsets repaired{since}")
        self.bounds_warnings += bad + bad_off
        what = [tbe.bounds_message(first, bad, BoundsCheck.WARNING)] if first is not None else []
        if bad_off:
            what.append(f"{bad_off} offsets repaired (clamped into [0, N], made non-decreasing, last set to N)")
        warnings.warn(
            f"TableBatchedEmbedding bounds check (lookups since the last check): {'; '.join(what)}",
            RuntimeWarning,
            stacklevel=3,
        )

    def _rows_of_keys_deferred(self, indices, rows, skip=None) -> dict:
        """_rows_of_keys of a training lookup with no host read (defer_checks on the kernels): each occurrence's
        keyed table comes from a kernel, each hash table inserts its own occurrences in place in rows, new rows
        take their initial values on the device. Returns {table: (rows, flags, keys)} of the inserts (flags: 1
        at each new key's first occurrence), for callers that record something per new row."""
        n = rows.shape[0]
        if n == 0:
            return {}
        occ = self._scratch("occ_table", n, np.int64)  # written by the bounds check (check_indices)
        if skip is not None:  # skipped occurrences belong to no table
            occ[...] = device.xp().where(skip, -1, occ)
        out = {}
        for t, table in self.hash_tables.items():
            _, flags, keys = table.insert_deferred(indices, occ, t, rows_out=rows)
            spec = self.tables[t]
            if self.weights.dtype == np.float32:
                embedding_init.init_flagged_rows(
                    self.weights,
                    int(self.elem_offsets[t]),
                    int(self.strides[t]),
                    spec.dim,
                    rows,
                    keys,
                    flags,
                    self.seed,
                    *spec.init_range,
                )
            else:  # float16 weights: the new rows' values through the host (reads)
                view = self._table_view(self.weights, t, False)
                new = device.to_host(flags).astype(bool)
                r = device.to_host(rows)[new]
                vals = embedding_init.row_values_ref(device.to_host(keys)[new], spec.dim, self.seed, *spec.init_range)
                view[device.xp().asarray(r[r >= 0])] = device.xp().asarray(vals[r >= 0].astype(view.dtype))
            out[t] = (rows, flags, keys)
        return out

    def _report(self, report, offsets, n: int) -> None:
        """Raise (FATAL) or warn (WARNING) about what the bounds check found."""
        bad_offsets, first_offset, bad, first = report
        if self.bounds_check == BoundsCheck.FATAL:
            if bad_offsets:
                value = int(device.to_host(offsets[first_offset : first_offset + 1])[0])
                raise EmbeddingBoundsError(tbe.offsets_message(first_offset, value, n, offsets.shape[0] - 1))
            if bad:
                raise EmbeddingBoundsError(tbe.bounds_message(first, bad, BoundsCheck.FATAL))
        elif bad or bad_offsets:
            self.bounds_warnings += bad + bad_offsets
            what = [tbe.bounds_message(first, bad, BoundsCheck.WARNING)] if bad else []
            if bad_offsets:
                what.append(
                    f"{bad_offsets} offsets repaired (clamped into [0, {n}], made non-decreasing, last set to N)"
                )
            warnings.warn(
                f"TableBatchedEmbedding bounds check: {'; '.join(what)}", RuntimeWarning, stacklevel=4
            )  # _report <- _lookup <- forward <- its caller

    def _feature_rows(self) -> np.ndarray:
        """(F,) the rows each feature's indices must stay below; -1 for keyed features (not checked)."""
        return np.array([-1 if self.tables[t].keyed else self.tables[t].rows for t in self.feature_table_map], np.int64)

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
            raise ValueError(
                "indices of unkeyed tables must fit int64; uint64 keys above 2**63 - 1 belong to keyed tables"
            )
        return indices.astype(np.int64)

    def _rows_of_keys(self, indices, rows, offsets, batch: int, training: bool, skip=None) -> None:
        """rows[k] <- the row of key indices[k] for every occurrence of a keyed feature (inserted in
        training, -1 when missing in evaluation); any integer keys (uint64 included). Host-side
        bookkeeping: a keyed step reads the hash table's new-key count back anyway."""
        xp = device.xp()
        ftables = set(self.feature_table_map)
        if skip is None and len(self.hash_tables) == 1 and ftables == set(self.hash_tables):
            # every feature reads the one keyed table and nothing is skipped (a HugeCTR sparse embedding):
            # when the first bag starts at 0 (offsets are repaired: non-decreasing, last N) every occurrence
            # is that table's, so the selection below would take all N in order; no per-occurrence work
            if indices.shape[0] == 0:
                return
            if int(device.to_host(offsets[:1])[0]) == 0:
                (t,) = ftables
                rows[...] = self._insert_or_find(t, self.hash_tables[t], indices, training)
                return
        _, feat, _ = tbe._occurrences(device.to_host(offsets), self.n_features, batch, self.layout)
        inside = feat >= 0
        # (N,) the table of each occurrence (-1 outside every bag): a compare per table, no isin
        occ_table = np.full(feat.shape[0], -1, np.int64)
        occ_table[inside] = np.asarray(self.feature_table_map, np.int64)[feat[inside]]
        keyed = np.zeros(feat.shape[0], bool)
        keyed[inside] = np.array([self.tables[t].keyed for t in self.feature_table_map])[feat[inside]]
        if indices.dtype == np.uint64 and not keyed.all():
            self._as_int64(indices[xp.asarray(np.flatnonzero(~keyed))])
        take = np.ones(feat.shape[0], bool) if skip is None else ~device.to_host(skip).astype(bool)
        for t, table in self.hash_tables.items():
            mine = xp.asarray(np.flatnonzero((occ_table == t) & take))
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
            vals = embedding_init.row_values_ref(k64, spec.dim, self.seed, *spec.init_range)
            view = self._table_view(self.weights, t, False)
            view[device.xp().asarray(device.to_host(rows)[new])] = device.xp().asarray(vals.astype(view.dtype))
        return rows
