"""HugeCTR's EmbeddingCollection (spec §5.5) on the table-batched engine, one rank or sharded.

    model.add(ebc_config)       an EmbeddingCollectionConfig (collection_config.py) becomes an EmbeddingCollection

Lookups. A lookup reads one sparse input (slot_num 1, up to nnz_per_slot = H keys per sample) through one
table of width D. Its top is (B, 1, D) for "sum" and "average" (numbactr also takes "mean"), and
(B, 1, H*D) for "concat": the sample's vectors in key order, zero where it has fewer than H keys. The
batch-major form (a list of lookups, one top name) gives one (B, sum of the lookups' widths) top, the
lookups side by side. Several lookups may read one table; their gradients meet in ONE update per step.

Tables. Static (max_vocabulary_size = V > 0): row = key, keys must lie in [0, V) (a clear error names the
key, the lookup and the table otherwise). Dynamic (max_vocabulary_size = -1): a hash table that grows:
training inserts new keys in order of first occurrence; evaluation never inserts (an unseen key adds a zero
vector and counts in an average's length). Each table trains with its own optimizer (opt_params_or_empty)
or the model's. Rows, engines and Ftrl: collection_tables.py.

Ranks (mpiexec): shard() places each table model parallel ("mp") or data parallel ("dp") (collection_plan.py);
either way R ranks give one rank's outputs, losses and rows (tests/test_embedding_collection_mpi.py).

Files: embedding_dump / embedding_load write and read HugeCTR's layout (collection_files.py). HugeCTR's
save_params_to_files writes only the dense files of such a model; numbactr's also dumps the tables into
``{prefix}_embedding_collection_{iter}`` (a second atomic commit after the dense snapshot), so a fit()
snapshot is complete. graph_to_json writes no entry for a collection, as HugeCTR's writer.
Why one module per concept: the configuration, the plan, the engines and the files change for different
reasons; this module only runs a step over them.
"""

from __future__ import annotations

import numpy as np

from numbactr.runtime import device
from numbactr.autograd import Tensor
from numbactr.ops.embedding_bag import CollectionLookupFn
from numbactr.embedding.collection_config import COMBINERS, CollectionError, EmbeddingCollectionConfig
from numbactr.embedding.collection_evicting import EvictingGroup
from numbactr.embedding.collection_plan import group_plan, placement
from numbactr.embedding.collection_tables import _Group, _Pooler, _Table

# names importable from here before the module was split
from numbactr.embedding.collection_config import MAX_EV, EmbeddingTableConfig  # noqa: F401
from numbactr.embedding.collection_files import (
    DUMP_BASE as DUMP_BASE,
    FILE_HEAD_BYTES as FILE_HEAD_BYTES,
    FILE_KEY as FILE_KEY,
    FILE_WEIGHT,  # noqa: F401
    KEY_TYPES as KEY_TYPES,
    META_HEAD_INTS as META_HEAD_INTS,
    dump as dump,
    load as load,
    meta_data_bytes as meta_data_bytes,
    parse_meta_data as parse_meta_data,
)
from numbactr.embedding.collection_tables import DYNAMIC_INIT  # noqa: F401

__all__ = ["EmbeddingTableConfig", "EmbeddingCollectionConfig", "EmbeddingCollection", "CollectionError"]

GROUP_TABLES = True  # False: one engine per table (tests compare the two bit for bit)


# ---- the runtime -------------------------------------------------------------------------------
class EmbeddingCollection:
    """An added EmbeddingCollectionConfig: its lookups' tops, tables and step (module docstring).

    Args:
        cfg: the EmbeddingCollectionConfig.
        index: this collection's position among the model's collections.
        sparse_params: {sparse input name: DataReaderSparseParam} of the model's Input.
        opt: the model's optimizer (for tables without their own).
        seed: the Solver's seed.
        comm: the job's Comm.
    """

    def __init__(self, cfg: EmbeddingCollectionConfig, index: int, sparse_params: dict, opt, seed: int, comm):
        self.cfg, self.index, self.comm = cfg, index, comm
        self.name = f"EmbeddingCollection{index}"
        if not cfg.lookups:
            raise CollectionError(f"{self.name}: the EmbeddingCollectionConfig has no embedding_lookup")
        self.lookups = []  # per lookup: dict(table, bottom, top, combiner, hot, width)
        by_name = {t.name: t for t in cfg.tables}
        for table, bottom, top, combiner in cfg.lookups:
            p = sparse_params.get(bottom)
            if p is None:
                raise CollectionError(
                    f"{self.name}: lookup {top!r} reads bottom_name {bottom!r}, which is not a "
                    f"sparse input; sparse inputs: {sorted(sparse_params)}"
                )
            if p.slot_num != 1:
                raise CollectionError(
                    f"{self.name}: lookup {top!r} reads {bottom!r} with slot_num={p.slot_num}; "
                    "an EmbeddingCollection lookup reads a sparse input of slot_num=1 (one "
                    "DataReaderSparseParam per feature, as HugeCTR requires)"
                )
            hot = int(p.max_feature_num)
            dim = by_name[table].ev_size
            self.lookups.append(
                dict(
                    table=table,
                    bottom=bottom,
                    top=top,
                    combiner=combiner,
                    hot=hot,
                    width=hot * dim if combiner == "concat" else dim,
                    dim=dim,
                )
            )
        placement_ = placement(cfg, comm, self.name, by_name)
        self.tables = []
        for t in cfg.tables:
            mine = [i for i, lk in enumerate(self.lookups) if lk["table"] == t.name]
            strategy, ranks = placement_[t.name]
            table_opt = t.opt_params_or_empty if t.opt_params_or_empty is not None else opt
            self.tables.append(_Table(t, mine, table_opt, seed, comm, strategy, ranks))
        self._table_of = {i: t for t in self.tables for i in t.lookups}
        self.groups = self._group_tables()
        self._poolers = {}  # (dim, pooling) -> _Pooler
        self._anchor = Tensor(device.xp().zeros(1, np.float32), name=self.name, requires_grad=True)
        self._saved = None  # this step's per-table lookups, for update()
        self._pending = None  # this step's dLoss/dtop, from the tape's backward

    # ---- configuration ---------------------------------------------------------------------------
    def _group_tables(self) -> list:
        """The tables in as few engines (_Group) as one forward and one fused backward can serve
        (collection_plan.group_plan); GROUP_TABLES False: one engine per table."""
        plan = group_plan(self.tables, self.lookups, self.comm)
        if not GROUP_TABLES:
            plan = [(pooled, [t]) for pooled, members in plan for t in members]
        return [
            (EvictingGroup if members[0].cfg.evicting else _Group)(members, self.comm, pooled)
            for pooled, members in plan
        ]

    def tops(self, batch: int) -> list[tuple[str, tuple]]:
        """[(top name, shape)] this collection adds to the model, with per-rank batch B."""
        if self.cfg.batch_major_top is not None:
            return [(self.cfg.batch_major_top, (batch, sum(lk["width"] for lk in self.lookups)))]
        return [(lk["top"], (batch, 1, lk["width"])) for lk in self.lookups]

    @property
    def bottoms(self) -> list[str]:
        return [lk["bottom"] for lk in self.lookups]

    def table(self, name: str) -> _Table:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    # ---- a step ----------------------------------------------------------------------------------
    def forward(self, tape, inputs: dict, training: bool) -> dict:
        """{top name: Tensor} of this rank's batch; inputs: {sparse input name: (keys (N,), offsets (B+1,))}."""
        if training:
            self._pending = None
        outs = CollectionLookupFn.apply(
            tape if training else None, self._anchor, coll=self, inputs=inputs, training=training, name=self.name
        )
        outs = outs if isinstance(outs, tuple) else (outs,)
        return {name: o for (name, _), o in zip(self.tops(0), outs)}

    def lookup(self, inputs: dict, training: bool) -> list:
        """The tops' arrays (see tops()) of this rank's batch."""
        xp = device.xp()
        host = {b: (device.to_host(k), device.to_host(o).astype(np.int64)) for b, (k, o) in inputs.items()}
        batch = next(iter(host.values()))[1].shape[0] - 1
        rows = (0, batch)
        if any(t.strategy == "dp" for t in self.tables) and self.comm.size > 1:
            counts = self.comm.allgather_rows(np.array([batch], np.int64))
            rows = (int(counts[: self.comm.rank].sum()), int(counts[: self.comm.rank + 1].sum()))
        per_lookup = [None] * len(self.lookups)
        saved = []
        for g in self.groups:
            gather = g.strategy == "dp" and self.comm.size > 1
            csrs = [self._csr(host[self.lookups[i]["bottom"]], gather) for i in g.lookups]
            for i, (keys, _) in zip(g.lookups, csrs):
                self._check_keys(self._table_of[i], i, keys)
            keys, offsets, pos = _interleave(csrs)
            out, ctx = g.lookup(xp.asarray(keys), xp.asarray(offsets), training)
            if g.pooled:  # out: (B, sum of widths), every lookup's SUM side by side
                scales, col = [], 0
                for i, (_, o) in zip(g.lookups, csrs):
                    dim = self.lookups[i]["dim"]
                    part = out[:, col : col + dim]
                    scale = None
                    if self.lookups[i]["combiner"] != "sum":  # average: times 1/length (float32)
                        scale = xp.asarray(np.float32(1.0) / np.maximum(np.diff(o), 1).astype(np.float32))
                        part = part * scale[:, None]
                    per_lookup[i] = xp.ascontiguousarray(part[rows[0] : rows[1]] if gather else part)
                    scales.append(scale)
                    col += dim
                saved.append((ctx, scales, gather))
                continue
            pooled = []
            for i, (k, o), p in zip(g.lookups, csrs, pos):
                res, pctx = self._pool(i, out[xp.asarray(p)], o)
                per_lookup[i] = res[rows[0] : rows[1]] if gather else res
                pooled.append(pctx)
            saved.append((ctx, pos, pooled, csrs, gather, keys.shape[0]))
        if training:
            self._saved = (saved, rows)
        flat = [o.reshape(o.shape[0], -1) for o in per_lookup]
        if self.cfg.batch_major_top is not None:
            return [xp.concatenate(flat, axis=1) if len(flat) > 1 else flat[0]]
        return [o.reshape(o.shape[0], 1, -1) for o in flat]

    def _csr(self, csr, gather: bool):
        """(keys (N,) int64-or-uint64, offsets (B+1,) int64) of this rank, or of the global batch."""
        keys, offsets = csr
        # int64 keys throughout (uint64 ones by their bits: a dynamic table's hash reads them back as uint64)
        keys = keys.view(np.int64) if keys.dtype == np.uint64 else keys.astype(np.int64, copy=False)
        if not gather:
            return keys, offsets
        comm = self.comm
        all_keys = comm.allgather_rows(np.ascontiguousarray(keys))
        lens = comm.allgather_rows(np.diff(offsets))
        return all_keys, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)

    def _check_keys(self, t: _Table, i: int, keys) -> None:
        """Static tables: every key in [0, V) (else a clear error); dynamic tables take any key but -1."""
        if t.cfg.dynamic or keys.shape[0] == 0:
            return
        bad = np.flatnonzero((keys < 0) | (keys >= t.cfg.max_vocabulary_size))
        if bad.size:
            lk = self.lookups[i]
            raise CollectionError(
                f"{self.name}: lookup {lk['top']!r} (bottom {lk['bottom']!r}) has key "
                f"{int(keys[bad[0]])} at position {int(bad[0])}, outside static table "
                f"{t.name!r}'s rows [0, {t.cfg.max_vocabulary_size}) (max_vocabulary_size); "
                f"{bad.size} such key(s) in this batch. Use max_vocabulary_size=-1 (dynamic "
                "table) for arbitrary keys"
            )

    def _pool(self, i: int, vecs, offsets):
        """(out (B, width), ctx) of lookup i's occurrence vectors (n, D) in bags offsets (B+1,)."""
        lk = self.lookups[i]
        xp = device.xp()
        batch, dim = offsets.shape[0] - 1, lk["dim"]
        if lk["combiner"] != "concat":
            key = (dim, COMBINERS[lk["combiner"]])
            pooler = self._poolers.setdefault(key, _Pooler(*key))
            out, ctx = pooler.forward(vecs, xp.asarray(offsets))
            return out, (pooler, ctx)
        lens = np.diff(offsets)
        if lens.size and int(lens.max()) > lk["hot"]:
            b = int(np.argmax(lens))
            raise CollectionError(
                f"{self.name}: concat lookup {lk['top']!r}: sample {b} of {lk['bottom']!r} has "
                f"{int(lens[b])} keys, more than its nnz_per_slot {lk['hot']}"
            )
        place = np.repeat(np.arange(batch, dtype=np.int64) * lk["hot"] - offsets[:-1], lens) + np.arange(
            offsets[-1], dtype=np.int64
        )  # (n,) slot in (B*H) of each occurrence
        out = xp.zeros((batch * lk["hot"], dim), np.float32)
        out[xp.asarray(place)] = vecs
        return out.reshape(batch, lk["hot"] * dim), (None, xp.asarray(place))

    def hold_gradients(self, dys) -> None:
        self._pending = dys

    def update(self, lr: float, scaler: float) -> None:
        """Each table's fused backward + optimizer over every lookup's gradient of this step (nothing if the
        step ran no backward); every rank calls it (sharded tables exchange gradients)."""
        pending, self._pending = self._pending, None
        saved, self._saved = self._saved, None
        if pending is None or saved is None:
            return
        saved, rows = saved
        xp = device.xp()
        batch = rows[1] - rows[0]
        dys = self._per_lookup_grads(pending, batch)
        for g, kept in zip(self.groups, saved):
            if g.pooled:
                ctx, scales, gather = kept
                dy = xp.concatenate([xp.asarray(dys[i], dtype=np.float32) for i in g.lookups], axis=1)  # a copy
                if gather:  # every rank's dLoss/dtop rows, rank order
                    dy = xp.asarray(self.comm.allgather_rows(np.ascontiguousarray(device.to_host(dy))))
                col = 0
                for i, scale in zip(g.lookups, scales):
                    dim = self.lookups[i]["dim"]
                    if scale is not None:
                        dy[:, col : col + dim] *= scale[:, None]
                    col += dim
                g.apply(ctx, dy, lr, scaler)
                continue
            ctx, pos, pooled, csrs, gather, n = kept
            grads = xp.zeros((n, g.tables[0].dim), np.float32)
            for i, p, (pooler, pctx), (_, offsets) in zip(g.lookups, pos, pooled, csrs):
                dy = dys[i]
                if gather:  # every rank's dLoss/dtop rows, rank order
                    dy = xp.asarray(self.comm.allgather_rows(np.ascontiguousarray(device.to_host(dy))))
                if pooler is not None:
                    res = pooler.backward(pctx, xp.ascontiguousarray(dy))
                else:
                    res = dy.reshape(-1, g.tables[0].dim)[pctx]
                grads[xp.asarray(p)] = res
            g.apply(ctx, grads, lr, scaler)

    def _per_lookup_grads(self, pending, batch: int) -> list:
        """[dLoss/dtop of lookup i as (B, width)] (zeros where a top got no gradient)."""
        xp = device.xp()
        if self.cfg.batch_major_top is not None:
            whole = pending[0]
            cols = np.concatenate([[0], np.cumsum([lk["width"] for lk in self.lookups])])
            return [
                xp.zeros((batch, lk["width"]), np.float32)
                if whole is None
                else whole.reshape(batch, -1)[:, cols[i] : cols[i + 1]]
                for i, lk in enumerate(self.lookups)
            ]
        return [
            xp.zeros((batch, lk["width"]), np.float32) if d is None else d.reshape(batch, -1)
            for d, lk in zip(pending, self.lookups)
        ]


def _interleave(csrs):
    """Sample-major CSR of F lookups' bags: (keys (N,), offsets (B*F + 1,), [positions (N_f,) of lookup f's
    occurrences in the result]); bag b*F + f holds lookup f's keys of sample b."""
    F = len(csrs)
    batch = csrs[0][1].shape[0] - 1
    lens = np.stack([np.diff(o) for _, o in csrs], axis=1) if batch else np.zeros((0, F), np.int64)  # (B, F)
    offsets = np.concatenate([[0], np.cumsum(lens.reshape(-1))]).astype(np.int64)
    starts = offsets[:-1].reshape(batch, F)
    keys = np.empty(int(offsets[-1]), np.int64)
    pos = []
    for f, (k, o) in enumerate(csrs):
        p = np.repeat(starts[:, f] - o[:-1], np.diff(o)) + np.arange(o[-1], dtype=np.int64)
        keys[p] = k
        pos.append(p)
    return keys, offsets, pos
