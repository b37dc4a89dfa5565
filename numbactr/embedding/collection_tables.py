"""EmbeddingCollection's tables at run time: each table (_Table) and the engines its group shares (_Group).

The tables share as few TableBatchedEmbeddings as they can (collection_plan.group_plan): tables on the same
rank(s) with the same strategy and optimizer settings are the physical tables of ONE engine whose features are
the lookups reading them (feature_table_map), in HugeCTR's sample-major CSR (bag b*F + f), so one forward and
one fused backward + optimizer serve them all, every row summing its lookups' gradients in occurrence order
(as when each table had its own engine: tests/test_embedding_collection_groups.py compares the two bit for
bit). A pooled group (sum/average lookups only) has the engine pool them (SUM; an average's columns are
scaled by 1/length after the forward and its gradient before the backward, the engine's own MEAN
arithmetic). Otherwise (a concat lookup, or a table model parallel over ranks) the engine looks every
occurrence up with pooling NONE and each lookup pools its occurrences (_Pooler: an engine with optimizer NONE
holding the vectors as its rows). Model parallel over ranks, each occurrence's table travels beside its key
(ShardedTable's payload) and the owner groups what it receives by table, stably.

Rows. Static: U(-sqrt(1/V), sqrt(1/V)) from a hash of (table seed, row), as HugeCTR's Initializer_t.Default.
Dynamic: a hash table whose new keys start U(-0.05, 0.05) from a hash of (table seed, key); when its rows run
out the engine is rebuilt with the table twice as large (_Group.grow), every row and state kept.
Optimizer_t.Ftrl: the engine's fused HUGECTR_FTRL (HugeCTR's rule on each touched row's summed gradient, z and n
starting at 0, per-element states of the engine: _Group.ftrl_states).
Why the table seed in every hash: equal-sized tables must not start equal, and every device and sharding
then starts from the same rows.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import fields

import numpy as np

from numbactr.runtime import device
from numbactr.kernels import embedding_init
from numbactr.embedding.hugectr_optimizers import sparse_optimizer_spec
from numbactr.embedding.collection_config import EmbeddingTableConfig
from numbactr.embedding.engine import (
    BoundsCheck,
    Layout,
    Optim,
    OptimizerSpec,
    Pooling,
    TableBatchedEmbedding,
    TableSpec,
    fill_uniform_rows,
)
from numbactr.embedding.hash_table import HashTableFullError
from numbactr.embedding.sharded import ShardedTable

DYNAMIC_INIT = (-0.05, 0.05)
DYNAMIC_START_ROWS = 1024  # first size of a dynamic table (doubled whenever it fills)


class _Pooler:
    """Sum/average of occurrence vectors (n, D) in CSR bags (B + 1,), by an engine holding them as its rows
    (optimizer NONE: its backward returns one gradient per occurrence): the engine's pooling arithmetic."""

    def __init__(self, dim: int, pooling: Pooling):
        self.dim, self.pooling, self.engine = dim, pooling, None

    def forward(self, vectors, offsets):
        n = vectors.shape[0]
        if self.engine is None or self.engine.rows[0] < n:
            self.engine = TableBatchedEmbedding(
                [(max(n, 1) * 3 // 2 + 1, self.dim)],
                [0],
                pooling=self.pooling,
                optimizer=OptimizerSpec(Optim.NONE),
                bounds_check=BoundsCheck.FATAL,
            )
        self.engine.split_weights()[0][:n] = vectors
        out, ctx = self.engine.forward(device.xp().arange(n, dtype=np.int64), offsets, training=False)
        return out, (self.engine, ctx)

    def backward(self, saved, dy):
        """(n, D) gradient of each occurrence of the forward that returned ``saved``."""
        engine, ctx = saved
        if ctx.rows.shape[0] == 0:
            return device.xp().zeros((0, self.dim), np.float32)
        return engine.backward(ctx, dy).sparse.values[:, : self.dim]


def _seed(seed: int, name: str) -> int:
    """A per-table seed: equal-sized tables must not start equal."""
    return zlib.crc32(f"{int(seed)}:{name}".encode())


class _Engine(TableBatchedEmbedding):
    """A group's engine: a keyed table's new rows start from a hash of (that table's seed, key), as when
    every table had an engine of its own (seeded with the table's seed), not of one seed for the group."""

    key_seeds: dict = {}

    def _insert_or_find(self, t: int, table, keys, training: bool):
        if not training:
            return table.find(keys)
        before = table.size
        rows = table.insert(keys)
        if table.size > before:
            spec, xp = self.tables[t], device.xp()
            new = device.to_host(rows) >= before
            k64 = device.to_host(keys).astype(np.uint64)[new]
            vals = embedding_init.row_values_ref(k64, spec.dim, self.key_seeds.get(t, self.seed), *spec.init_range)
            view = self._table_view(self.weights, t, False)
            view[xp.asarray(device.to_host(rows)[new])] = xp.asarray(vals.astype(view.dtype))
        return rows


def _opt_key(opt, where: str):
    """(what groups tables by optimizer, the engine's OptimizerSpec, Ftrl's (beta, lambda1, lambda2) or None).
    Ftrl: the engine's HUGECTR_FTRL (HugeCTR's EmbeddingCollection Ftrl: the dense rule on the touched rows,
    whatever the update_type); the learning rate and the loss scaler are set per step (_Group.apply)."""
    if opt.optimizer_type.name == "Ftrl":
        ftrl = (float(opt.beta), float(opt.lambda1), float(opt.lambda2))
        spec = OptimizerSpec(Optim.HUGECTR_FTRL, learning_rate=0.0, beta=ftrl[0], lambda1=ftrl[1], lambda2=ftrl[2])
        return ("Ftrl",) + ftrl, spec, ftrl
    spec = sparse_optimizer_spec(opt, where)
    return ("engine", tuple(sorted((f.name, str(getattr(spec, f.name))) for f in fields(spec)))), spec, None


class _Group:
    """Tables sharing one TableBatchedEmbedding: the same ranks and strategy, the same optimizer settings,
    static or dynamic alike, and one mode. pooled: one rank's (or data-parallel) tables read only by sum/average
    lookups; the engine pools every lookup (SUM; an average's columns scaled by 1/length after, its gradient
    before). Otherwise (a concat lookup, or model parallel over ranks) the engine looks every occurrence up
    (pooling NONE: one width) and the collection pools; model parallel over ranks, the keys travel to their
    owners through ShardedTable with their table beside them (_owner_lookup)."""

    def __init__(self, tables: list, comm, pooled: bool):
        self.tables, self.comm, self.pooled = tables, comm, pooled
        first = tables[0]
        self.strategy, self.ranks = first.strategy, first.ranks
        self.opt_spec, self.ftrl = first.opt_spec, first.ftrl
        self.lookups = [i for t in tables for i in t.lookups]  # the engine's features, in this order
        self.feature_table = [j for j, t in enumerate(tables) for _ in t.lookups]
        self.seed = first.seed
        for j, t in enumerate(tables):
            t.group, t.index = self, j
        self.engine = self._new_engine(
            [DYNAMIC_START_ROWS if t.cfg.dynamic else t.cfg.max_vocabulary_size for t in tables]
        )
        for j, t in enumerate(tables):
            if not t.cfg.dynamic:  # U(-sqrt(1/V), sqrt(1/V)) from (table seed, row): its own rows
                a = math.sqrt(1.0 / t.cfg.max_vocabulary_size)
                fill_uniform_rows(
                    self.engine.split_weights()[j], 0, t.seed, -a, a, what=f"EmbeddingTableConfig {t.cfg.name!r}"
                )
        # the first feature of each table: an owner puts the occurrences it receives of table j in its bag
        self.first_feature = np.array([self.feature_table.index(j) for j in range(len(tables))], np.int64)
        sharded = comm.size > 1 and self.strategy == "mp"
        self.wires = (
            ShardedTable(
                comm,
                first.dim,
                len(self.lookups),
                Pooling.NONE,
                self._owner_lookup,
                key_dtype=np.uint64 if first.cfg.dynamic else np.int64,
                layout=Layout.SAMPLE_MAJOR,
            )
            if sharded
            else None
        )

    def _new_engine(self, rows: list) -> TableBatchedEmbedding:
        specs = [
            TableSpec(int(r), t.dim, keyed=t.cfg.dynamic, init_range=DYNAMIC_INIT) for r, t in zip(rows, self.tables)
        ]
        eng = _Engine(
            specs,
            self.feature_table,
            pooling=Pooling.SUM if self.pooled else Pooling.NONE,
            layout=Layout.SAMPLE_MAJOR,
            optimizer=self.opt_spec,
            bounds_check=BoundsCheck.FATAL,
            seed=self.seed,
        )
        eng.key_seeds = {j: t.seed for j, t in enumerate(self.tables)}
        return eng

    @property
    def holds(self) -> bool:
        return self.comm.rank in self.ranks

    @property
    def ftrl_states(self) -> list | None:
        """Ftrl groups: per table, [z, n] (V, D) views of the engine's states (None for other optimizers)."""
        return self.engine.split_optimizer_states() if self.ftrl is not None else None

    # ---- lookups ---------------------------------------------------------------------------------
    def lookup(self, keys, offsets, training: bool):
        """pooled: ((B, sum of widths) SUM of each lookup's bags, ctx); else ((N, D) one vector per
        occurrence, ctx); keys (N,) in the group's sample-major bags ``offsets`` (B*F + 1,)."""
        if self.wires is None:
            return self._engine_lookup(keys, offsets, training)
        owner, table = self._owners(keys), None
        if len(self.tables) > 1:  # each occurrence's table travels beside its key
            off = np.asarray(device.to_host(offsets)).astype(np.int64)
            bag = np.repeat(np.arange(off.shape[0] - 1, dtype=np.int64), np.diff(off))
            table = np.asarray(self.feature_table, np.int64)[bag % len(self.lookups)]
        return self.wires.lookup(keys, offsets, owner, training, payload=table, pooling=Pooling.NONE)

    def _owners(self, keys) -> np.ndarray:
        """(N,) int64 owning rank of each key; keys (N,) on the host or the device (a lookup's are device arrays)."""
        k = np.asarray(keys if device.is_host_array(keys) else device.to_host(keys)).astype(np.uint64)
        return np.asarray(self.ranks, np.int64)[(k % np.uint64(len(self.ranks))).astype(np.int64)]

    def _owner_lookup(self, keys, offsets, training: bool, payload):
        """The owner's lookup of the occurrences it received, in their order (rank 0's, then rank 1's, ...,
        each in batch order): with several tables (payload: each occurrence's table) they are grouped by
        table, stably, into the bag of the table's first feature, looked up, and put back in received order;
        each row thus sums its gradients in the one-rank order."""
        if payload is None:
            return self._engine_lookup(keys, offsets, training)
        xp = device.xp()
        table = np.asarray(device.to_host(payload)).astype(np.int64)
        order = np.argsort(table, kind="stable")
        lens = np.zeros(len(self.lookups), np.int64)
        lens[self.first_feature] = np.bincount(table, minlength=len(self.tables))
        bags = xp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
        order_d = xp.asarray(order)
        vecs, ctx = self._engine_lookup(xp.asarray(keys)[order_d], bags, training)
        out = xp.empty_like(vecs)
        out[order_d] = vecs
        return out, (ctx, order_d)

    def _engine_lookup(self, keys, offsets, training: bool):
        """The engine's lookup; a dynamic table that runs out of rows grows and the lookup runs again (the
        keys already inserted keep their rows, so the result is that of a table that never filled)."""
        while True:
            try:
                return self.engine.forward(keys, offsets, training=training)
            except HashTableFullError as e:
                full = [
                    j
                    for j, h in self.engine.hash_tables.items()
                    if h.size == e.used and int(self.engine.rows[j]) == e.max_rows
                ]
                if not full:
                    raise
                for j in full:
                    self.grow(j, e.used + e.needed)

    def grow(self, j: int, need: int) -> None:
        """Rebuild the engine with table j's rows doubled until they hold ``need``: every table's rows, keys
        and optimizer states and the step counter kept, table j's new rows at their initial state."""
        old = self.engine
        rows = [int(r) for r in old.rows]
        while rows[j] < need:
            rows[j] *= 2
        new = self._new_engine(rows)
        w_old, w_new = old.split_weights(), new.split_weights()
        s_old, s_new = old.split_optimizer_states(), new.split_optimizer_states()
        for i in range(len(self.tables)):
            n = old.live_rows(i)
            if i in old.hash_tables:
                new.hash_tables[i].insert(old.hash_tables[i].keys_by_row())  # unique keys: rows 0..n-1
            w_new[i][:n] = w_old[i][:n]
            for dst, src in zip(s_new[i], s_old[i]):
                dst[:n] = src[:n]
        new.step = old.step
        new.set_hyper_parameters(learning_rate=old.learning_rate, scaler=old.optimizer.scaler)
        self.engine = new

    def apply(self, ctx, grads, lr: float, scaler: float) -> None:
        """The fused backward + optimizer with this rank's gradients: (B, sum of widths) of the pooled
        lookup, or (N, D) of its occurrences."""
        eng = self.engine
        lr = float(lr)
        if self.wires is not None:
            ctx, grads = self.wires.gradients(ctx, grads)  # every rank takes part
            if isinstance(ctx, tuple):  # several tables: the owner's grouped order
                ctx, order = ctx
                grads = device.xp().asarray(grads)[order]
        if eng.learning_rate != lr or eng.optimizer.scaler != scaler:
            eng.set_hyper_parameters(learning_rate=lr, scaler=float(scaler))
        eng.backward(ctx, grads)  # also with no occurrence: the step counts, Global updates run


class _Table:
    """One table at run time: its lookups, placement, optimizer, and its place in a group's engine."""

    def __init__(self, cfg: EmbeddingTableConfig, lookups: list, opt, seed: int, comm, strategy: str, ranks: list[int]):
        self.cfg, self.name, self.dim = cfg, cfg.name, cfg.ev_size
        self.lookups = lookups  # indices into the collection's lookups
        self.comm, self.strategy, self.ranks = comm, strategy, ranks
        self.seed = _seed(seed, cfg.name)
        self.opt_key, self.opt_spec, self.ftrl = _opt_key(opt, f"EmbeddingTableConfig {cfg.name!r}")
        self.group: _Group | None = None  # set by the group
        self.index = 0  # this table's number in the group's engine

    @property
    def engine(self) -> TableBatchedEmbedding:
        """The engine holding this table (shared with the other tables of its group)."""
        return self.group.engine

    @property
    def holds(self) -> bool:
        return self.comm.rank in self.ranks

    @property
    def weight(self):
        """(V, D) this rank's rows (a view into the engine)."""
        return self.engine.split_weights()[self.index]

    def _owners(self, keys) -> np.ndarray:
        k = np.asarray(keys).astype(np.uint64)
        return np.asarray(self.ranks, np.int64)[(k % np.uint64(len(self.ranks))).astype(np.int64)]

    # ---- files -----------------------------------------------------------------------------------
    def local_rows(self):
        """(keys (n,) int64, vectors (n, D)) this rank contributes to a dump (host copies): the keys it owns."""
        if not self.holds or (self.strategy == "dp" and self.comm.rank != self.ranks[0]):
            return np.zeros(0, np.int64), np.zeros((0, self.dim), np.float32)
        if self.cfg.evicting:  # numbactr.embedding.collection_evicting
            return self.group.held_rows()
        if self.cfg.dynamic:
            table = self.engine.hash_tables[self.index]
            keys = device.to_host(table.keys_by_row()).astype(np.uint64).view(np.int64)
            return keys, np.array(device.to_host(self.weight[: table.size]))
        keys = np.arange(self.cfg.max_vocabulary_size, dtype=np.int64)
        if self.strategy == "mp" and len(self.ranks) > 1:
            keys = keys[self._owners(keys) == self.comm.rank]
        return keys, np.array(device.to_host(self.weight))[keys]

    def load_rows(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Write checked (keys (n,) int64, vectors (n, D)) into this rank's rows: the keys this rank holds;
        other rows keep their values, a dynamic table inserts the keys it lacks (new rows: initial state)."""
        if not self.holds:
            return
        if self.strategy == "mp" and len(self.ranks) > 1:
            mine = self._owners(keys) == self.comm.rank
            keys, vectors = keys[mine], vectors[mine]
        xp = device.xp()
        if self.cfg.evicting:
            return self.group.put_rows(keys, vectors)
        if self.cfg.dynamic:
            table = self.engine.hash_tables[self.index]
            k = keys.view(np.uint64)
            missing = int(np.count_nonzero(device.to_host(table.find(xp.asarray(k))) < 0))
            if table.size + missing > int(self.engine.rows[self.index]):
                self.group.grow(self.index, table.size + missing)
                table = self.engine.hash_tables[self.index]
            rows = table.insert(xp.asarray(k))
        else:
            rows = xp.asarray(keys)
        self.weight[rows] = xp.asarray(vectors.astype(np.float32))
