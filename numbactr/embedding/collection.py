"""HugeCTR's EmbeddingCollection (spec §5.5) on the table-batched engine, one rank or sharded.

The configuration objects keep HugeCTR's names and arguments (HugeCTR v23.08/v23.12
``embedding_collection_wrapper.hpp`` and ``embeddings/embedding_collection.hpp``):

    EmbeddingTableConfig(name, max_vocabulary_size, ev_size, opt_params_or_empty=None, init_param_or_empty=None)
    EmbeddingCollectionConfig(use_exclusive_keys=False, comm_strategy=CommunicationStrategy.Uniform)
        .embedding_lookup(table_config, bottom_name, top_name, combiner)          one lookup, one top
        .embedding_lookup([table_config], [bottom_name], top_name, [combiner])    HugeCTR's batch-major form
        .shard(shard_matrix, shard_strategy)
    model.add(ebc_config)

Lookups. A lookup reads one sparse input (slot_num 1, up to nnz_per_slot = H keys per sample) through one
table of width D. Its top is (B, 1, D) for "sum" and "average" (numbactr also takes "mean"), and
(B, 1, H*D) for "concat": the sample's vectors in key order, zero where it has fewer than H keys. The
batch-major form (a list of lookups, one top name) gives one (B, sum of the lookups' widths) top, the
lookups side by side. Several lookups may read one table; their gradients meet in ONE update per step.

Tables. Static (max_vocabulary_size = V > 0): row = key, keys must lie in [0, V) (a clear error names the
key, the lookup and the table otherwise); rows start U(-sqrt(1/V), sqrt(1/V)) as HugeCTR's static tables
(Initializer_t.Default), drawn from a hash of (seed, table name, row), so every device and every sharding
starts from the same rows. Dynamic (max_vocabulary_size = -1): a hash table (numbactr.embedding.hash_table)
that grows: training inserts new keys in order of first occurrence, each starting U(-0.05, 0.05) from a hash
of (seed, key) (numbactr's choice, as its hash SparseEmbedding; HugeCTR's dynamic table draws its own);
when the rows run out the table is rebuilt twice as large with every row and optimizer state kept.
Evaluation never inserts: an unseen key adds a zero vector (and counts in an average's length).
Each table trains with its own optimizer (opt_params_or_empty) or the model's.

On the engine. The tables share as few TableBatchedEmbeddings as they can (EmbeddingCollection._group_tables):
tables on the same rank(s) with the same strategy and optimizer settings are the physical tables of ONE
engine whose features are the lookups reading them (feature_table_map), in HugeCTR's sample-major CSR
(bag b*F + f), so one forward and one fused backward + optimizer serve them all, every row summing its
lookups' gradients in occurrence order (as when each table had its own engine: the results are the same,
tests/test_embedding_collection.py compares the two bit for bit). Static and dynamic tables get separate
engines (a hash table in an engine takes its index fast path from the static tables, and a growing table
rebuilds its engine). A group whose lookups are all sum/average ("pooled") has the engine pool them (SUM; an
average's columns are scaled by 1/length after the forward and its gradient before the backward, the
engine's own MEAN arithmetic). Otherwise (a concat lookup, or a table model parallel over ranks) the engine
looks every occurrence up with pooling NONE (the group's tables have one width) and each lookup pools its
occurrences (sum/average by a second engine with optimizer NONE holding the vectors as its rows, concat by
placing them), its backward turning dLoss/dtop back into one gradient per occurrence. Tables model parallel
over the same ranks share an engine too: each occurrence's table travels beside its key (ShardedTable's
payload) and the owner groups what it receives by table, stably, so every row still sums its gradients in
the global batch's order.
Optimizer_t.Ftrl (HugeCTR's EmbeddingCollection has it): the engine has no fused Ftrl, so an Ftrl group's
engine runs optimizer NONE, which returns each touched row's summed gradient, and the group applies
HugeCTR's Ftrl rule (kernels.optimizers.ftrl_update_ref: the dense formula on the touched rows, z and n
starting at 0, lambda2 + beta/lr) in NumPy; its z, n are not dumped (as no optimizer state is).

Ranks (mpiexec). ``shard(shard_matrix, shard_strategy)``: shard_matrix[r] names the tables rank r holds;
shard_strategy [("mp" | "dp", [table names]), ...] says how. "mp" (model parallel): the table's keys are
split over the ranks holding it, key % n -> the (key % n)-th of them (one rank: it holds every key), and the
lookups go through numbactr.embedding.sharded.ShardedTable (keys to their owners, vectors back, gradients to
the owners in the global batch's order). "dp" (data parallel): every rank holds the whole table (HugeCTR
requires it on every rank); the ranks' keys are gathered, each rank looks up and updates the global batch
(the effect of HugeCTR's allreduced gradients: every replica takes the same update). Either way R ranks give
one rank's outputs, losses and rows (tests/test_embedding_collection_mpi.py). On one rank shard() may be
left out (every table on rank 0).

Files. ``embedding_dump(path, table_names)`` writes HugeCTR's layout (v23.08's
embedding_storage/weight_io): per collection c (its place among the model's collections),
``path/embedding_collection_<c>/meta_data`` (int32 table count, key type 0 = uint32 / 1 = int64 (the solver's
i64_input_key), value type 0 = float32, two zeros; then the int32 table ids, uint64 key counts and int32
ev_sizes of the dumped tables) and per table id j (its place in the collection: the order of first lookup)
``key<j>`` and ``weight<j>``, each a 128-byte head (int32 1 or 2, the table id, zeros) before the keys
(ascending) or the float32 vectors: the files HugeCTR's embedding_dump writes and its embedding_load reads
(as its v23.08 source reads them; no HugeCTR ran here), so dumps move between the two. The files go
through numbactr.files.checkpoint's atomic commit (staged, fsync'd, manifest
``path/embedding_collection_0.manifest.json`` with each file's size and sha256, which HugeCTR ignores);
``embedding_load`` checks every file (against the manifest when there is one, and against meta_data) before it
changes any table, and still reads numbactr's earlier layout (``path/<table name>/key`` and ``emb_vector``).
Optimizer states are not dumped (nor are they by HugeCTR v23.08).
HugeCTR's save_params_to_files writes only the dense files of such a model; numbactr's also dumps the
tables into ``{prefix}_embedding_collection_{iter}`` (a second atomic commit after the dense snapshot), so a
fit() snapshot is complete; reload them with embedding_load. graph_to_json writes no entry for a collection,
as HugeCTR's writer (construct_from_json therefore cannot rebuild one).
"""
from __future__ import annotations

import math
import os
import zlib
from dataclasses import fields

import numpy as np

from numbactr.runtime import device
from numbactr.autograd import Context, Function, Tensor
from numbactr.data.errors import DataFormatError
from numbactr.enums import CommunicationStrategy
from numbactr.kernels import embedding_init as EI
from numbactr.kernels import optimizers as OK
from numbactr.embedding.hugectr_optimizers import sparse_optimizer_spec
from numbactr.embedding.engine import (BoundsCheck, Layout, Optim, OptimizerSpec, Pooling, TableBatchedEmbedding, TableSpec,
                     fill_uniform_rows)
from numbactr.embedding.hash_table import HashTableFullError
from numbactr.embedding.sharded import ShardedTable

__all__ = ["EmbeddingTableConfig", "EmbeddingCollectionConfig", "EmbeddingCollection", "CollectionError"]

COMBINERS = {"sum": Pooling.SUM, "average": Pooling.MEAN, "mean": Pooling.MEAN, "concat": Pooling.NONE}
DYNAMIC_INIT = (-0.05, 0.05)
DYNAMIC_START_ROWS = 1024          # first size of a dynamic table (doubled whenever it fills)
MAX_EV = 1024                      # HugeCTR's largest embedding vector
GROUP_TABLES = True                # False: one engine per table (the layout before grouping; tests compare)


class CollectionError(ValueError):
    """A wrong EmbeddingCollection configuration or input; the message names the table/lookup."""


def _name_ok(name) -> bool:
    """Table names become folder names in embedding_dump."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


class EmbeddingTableConfig:
    """``hugectr.EmbeddingTableConfig``: one table of ``ev_size``-wide rows; max_vocabulary_size -1 is a
    dynamic (growing hash) table, V > 0 a static one of V rows indexed by key."""

    def __init__(self, name, max_vocabulary_size, ev_size, opt_params_or_empty=None, init_param_or_empty=None):
        from numbactr.config import OptParamsPy
        if not _name_ok(name):
            raise CollectionError(f"EmbeddingTableConfig: name must be a non-empty string without '/' or '\\' "
                                  f"(it names the table's folder in embedding_dump), got {name!r}")
        who = f"EmbeddingTableConfig {name!r}"
        if isinstance(max_vocabulary_size, bool) or not isinstance(max_vocabulary_size, (int, np.integer)) \
                or not (max_vocabulary_size == -1 or max_vocabulary_size > 0):
            raise CollectionError(f"{who}: max_vocabulary_size must be -1 (dynamic table) or a positive row "
                                  f"count, got {max_vocabulary_size!r}")
        if isinstance(ev_size, bool) or not isinstance(ev_size, (int, np.integer)) or not 1 <= ev_size <= MAX_EV:
            raise CollectionError(f"{who}: ev_size must be an integer in 1..{MAX_EV}, got {ev_size!r}")
        if opt_params_or_empty is not None and (not isinstance(opt_params_or_empty, OptParamsPy)
                                                or not opt_params_or_empty.initialized):
            raise CollectionError(f"{who}: opt_params_or_empty must come from CreateOptimizer() or be None (the "
                                  f"model's optimizer), got {opt_params_or_empty!r}")
        if init_param_or_empty is not None:
            raise NotImplementedError(f"{who}: init_param_or_empty is not supported by numbactr (HugeCTR's "
                                      "Python API has no way to build one either); leave it None")
        self.name = name
        self.max_vocabulary_size = int(max_vocabulary_size)
        self.ev_size = int(ev_size)
        self.opt_params_or_empty = opt_params_or_empty
        self.init_param_or_empty = None

    @property
    def dynamic(self) -> bool:
        return self.max_vocabulary_size == -1

    def _same(self, other: "EmbeddingTableConfig") -> bool:
        return (self.max_vocabulary_size, self.ev_size, self.opt_params_or_empty) == \
            (other.max_vocabulary_size, other.ev_size, other.opt_params_or_empty)

    def __repr__(self):
        return (f"EmbeddingTableConfig(name={self.name!r}, max_vocabulary_size={self.max_vocabulary_size}, "
                f"ev_size={self.ev_size})")


class EmbeddingCollectionConfig:
    """``hugectr.EmbeddingCollectionConfig``: lookups, tables (in order of first use) and the sharding.
    use_exclusive_keys and comm_strategy choose HugeCTR's GPU sort and communication algorithms; they do
    not change the math, and numbactr accepts them without acting on them."""

    def __init__(self, use_exclusive_keys: bool = False, comm_strategy=CommunicationStrategy.Uniform):
        if not isinstance(comm_strategy, CommunicationStrategy):
            raise CollectionError(f"EmbeddingCollectionConfig: comm_strategy must be a CommunicationStrategy "
                                  f"(Uniform or Hierarchical), got {comm_strategy!r}")
        self.use_exclusive_keys = bool(use_exclusive_keys)
        self.comm_strategy = comm_strategy
        self.tables: list[EmbeddingTableConfig] = []
        self.lookups: list[tuple[str, str, str, str]] = []     # (table name, bottom, top, combiner)
        self.batch_major_top: str | None = None
        self.shard_matrix: list[list[str]] | None = None
        self.shard_strategy: list[tuple[str, list[str]]] | None = None

    def embedding_lookup(self, table_config, bottom_name, top_name, combiner) -> None:
        if isinstance(table_config, (list, tuple)):
            return self._batch_major(table_config, bottom_name, top_name, combiner)
        if not isinstance(table_config, EmbeddingTableConfig):
            raise CollectionError(f"embedding_lookup: table_config must be an EmbeddingTableConfig (or a list of "
                                  f"them), got {type(table_config).__name__}")
        for what, v in (("bottom_name", bottom_name), ("top_name", top_name)):
            if not isinstance(v, str) or not v:
                raise CollectionError(f"embedding_lookup (table {table_config.name!r}): {what} must be a "
                                      f"non-empty string, got {v!r}")
        if combiner not in COMBINERS:
            raise CollectionError(f"embedding_lookup {top_name!r} (table {table_config.name!r}): combiner "
                                  f"{combiner!r} is not supported; use 'sum', 'average' (or 'mean') or 'concat'")
        if any(top_name == t for _, _, t, _ in self.lookups):
            raise CollectionError(f"embedding_lookup: top_name {top_name!r} is already a lookup's top")
        known = [t for t in self.tables if t.name == table_config.name]
        if known and not known[0]._same(table_config):
            raise CollectionError(f"embedding_lookup {top_name!r}: two different tables are named "
                                  f"{table_config.name!r} ({known[0]} and {table_config})")
        if not known:
            self.tables.append(table_config)
        self.lookups.append((table_config.name, bottom_name, top_name, combiner))

    def _batch_major(self, tables, bottoms, top_name, combiners) -> None:
        """HugeCTR's list form: lookup i is named top_name + str(i) inside; only top_name is a tensor."""
        if self.lookups:
            raise CollectionError("embedding_lookup with lists (one batch-major top) must be the collection's "
                                  "only embedding_lookup call (HugeCTR: 'empty lookup params required')")
        if not isinstance(bottoms, (list, tuple)) or not isinstance(combiners, (list, tuple)) \
                or not len(tables) == len(bottoms) == len(combiners) or not tables:
            raise CollectionError(f"embedding_lookup {top_name!r}: the list form needs equally long non-empty "
                                  f"lists of tables, bottom names and combiners, got {len(tables)}, "
                                  f"{len(bottoms) if isinstance(bottoms, (list, tuple)) else bottoms!r} and "
                                  f"{len(combiners) if isinstance(combiners, (list, tuple)) else combiners!r}")
        if not isinstance(top_name, str) or not top_name:
            raise CollectionError(f"embedding_lookup: top_name must be a non-empty string, got {top_name!r}")
        for i, (t, b, c) in enumerate(zip(tables, bottoms, combiners)):
            self.embedding_lookup(t, b, f"{top_name}{i}", c)
        self.batch_major_top = top_name

    def shard(self, shard_matrix, shard_strategy) -> None:
        """shard_matrix: one list of table names per rank (GPU); shard_strategy: [("mp"|"dp", [names])]."""
        try:
            matrix = [[str(n) for n in row] for row in shard_matrix]
            strategy = [(str(s), [str(n) for n in names]) for s, names in shard_strategy]
        except (TypeError, ValueError):
            raise CollectionError(f"shard: shard_matrix must be a list of lists of table names and shard_strategy "
                                  f"a list of (\"mp\"|\"dp\", [table names]) pairs, got {shard_matrix!r} and "
                                  f"{shard_strategy!r}") from None
        self.shard_matrix, self.shard_strategy = matrix, strategy


# ---- the runtime -------------------------------------------------------------------------------
class _CollectionFn(Function):
    """The collection's lookups on the tape: forward returns every top; backward hands their dLoss/dtop to
    the collection, whose update() applies them (no dense gradient)."""

    @staticmethod
    def forward(ctx: Context, anchor, coll=None, inputs=None, training=True):
        ctx.coll = coll
        return tuple(coll.lookup(inputs, training))

    @staticmethod
    def backward(ctx: Context, *dys):
        ctx.coll.hold_gradients(dys)
        return None


class _Pooler:
    """Sum/average of occurrence vectors (n, D) in CSR bags (B + 1,), by an engine holding them as its rows
    (optimizer NONE: its backward returns one gradient per occurrence): the engine's pooling arithmetic."""

    def __init__(self, dim: int, pooling: Pooling):
        self.dim, self.pooling, self.engine = dim, pooling, None

    def forward(self, vectors, offsets):
        n = vectors.shape[0]
        if self.engine is None or self.engine.rows[0] < n:
            self.engine = TableBatchedEmbedding([(max(n, 1) * 3 // 2 + 1, self.dim)], [0], pooling=self.pooling,
                                                optimizer=OptimizerSpec(Optim.NONE), bounds_check=BoundsCheck.FATAL)
        self.engine.split_weights()[0][:n] = vectors
        out, ctx = self.engine.forward(device.xp().arange(n, dtype=np.int64), offsets, training=False)
        return out, (self.engine, ctx)

    def backward(self, saved, dy):
        """(n, D) gradient of each occurrence of the forward that returned ``saved``."""
        engine, ctx = saved
        if ctx.rows.shape[0] == 0:
            return device.xp().zeros((0, self.dim), np.float32)
        return engine.backward(ctx, dy).sparse.values[:, :self.dim]


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
            vals = EI.row_values_ref(k64, spec.dim, self.key_seeds.get(t, self.seed), *spec.init_range)
            view = self._table_view(self.weights, t, False)
            view[xp.asarray(device.to_host(rows)[new])] = xp.asarray(vals.astype(view.dtype))
        return rows


def _opt_key(opt, where: str):
    """(what groups tables by optimizer, the engine's OptimizerSpec, Ftrl's (beta, lambda1, lambda2) or None).
    Ftrl: the engine runs optimizer NONE (it has no fused Ftrl) and the group applies Ftrl to the rows'
    summed gradients it returns (HugeCTR's EmbeddingCollection Ftrl: the dense rule on the touched rows)."""
    if opt.optimizer_type.name == "Ftrl":
        ftrl = (float(opt.beta), float(opt.lambda1), float(opt.lambda2))
        return ("Ftrl",) + ftrl, OptimizerSpec(Optim.NONE), ftrl
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
        self.lookups = [i for t in tables for i in t.lookups]            # the engine's features, in this order
        self.feature_table = [j for j, t in enumerate(tables) for _ in t.lookups]
        self.seed = first.seed
        for j, t in enumerate(tables):
            t.group, t.index = self, j
        self.engine = self._new_engine([DYNAMIC_START_ROWS if t.cfg.dynamic else t.cfg.max_vocabulary_size
                                        for t in tables])
        for j, t in enumerate(tables):
            if not t.cfg.dynamic:                 # U(-sqrt(1/V), sqrt(1/V)) from (table seed, row): its own rows
                a = math.sqrt(1.0 / t.cfg.max_vocabulary_size)
                fill_uniform_rows(self.engine.split_weights()[j], 0, t.seed, -a, a,
                                  what=f"EmbeddingTableConfig {t.cfg.name!r}")
        xp = device.xp()
        self.ftrl_states = [[xp.zeros((int(r), t.dim), np.float32) for _ in range(2)]        # [z, n] per table
                            for t, r in zip(tables, self.engine.rows)] if self.ftrl else None
        # the first feature of each table: an owner puts the occurrences it receives of table j in its bag
        self.first_feature = np.array([self.feature_table.index(j) for j in range(len(tables))], np.int64)
        sharded = comm.size > 1 and self.strategy == "mp"
        self.wires = ShardedTable(comm, first.dim, len(self.lookups), Pooling.NONE, self._owner_lookup,
                                  key_dtype=np.uint64 if first.cfg.dynamic else np.int64,
                                  layout=Layout.SAMPLE_MAJOR) if sharded else None

    def _new_engine(self, rows: list) -> TableBatchedEmbedding:
        specs = [TableSpec(int(r), t.dim, keyed=t.cfg.dynamic, init_range=DYNAMIC_INIT)
                 for r, t in zip(rows, self.tables)]
        eng = _Engine(specs, self.feature_table, pooling=Pooling.SUM if self.pooled else Pooling.NONE,
                      layout=Layout.SAMPLE_MAJOR, optimizer=self.opt_spec, bounds_check=BoundsCheck.FATAL,
                      seed=self.seed)
        eng.key_seeds = {j: t.seed for j, t in enumerate(self.tables)}
        return eng

    @property
    def holds(self) -> bool:
        return self.comm.rank in self.ranks

    # ---- lookups ---------------------------------------------------------------------------------
    def lookup(self, keys, offsets, training: bool):
        """pooled: ((B, sum of widths) SUM of each lookup's bags, ctx); else ((N, D) one vector per
        occurrence, ctx); keys (N,) in the group's sample-major bags ``offsets`` (B*F + 1,)."""
        if self.wires is None:
            return self._engine_lookup(keys, offsets, training)
        owner, table = self._owners(keys), None
        if len(self.tables) > 1:                  # each occurrence's table travels beside its key
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
                full = [j for j, h in self.engine.hash_tables.items()
                        if h.size == e.used and int(self.engine.rows[j]) == e.max_rows]
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
                new.hash_tables[i].insert(old.hash_tables[i].keys_by_row())      # unique keys: rows 0..n-1
            w_new[i][:n] = w_old[i][:n]
            for dst, src in zip(s_new[i], s_old[i]):
                dst[:n] = src[:n]
            if self.ftrl_states is not None and rows[i] != int(old.rows[i]):
                grown = []
                for st in self.ftrl_states[i]:
                    bigger = device.xp().zeros((rows[i], st.shape[1]), np.float32)
                    bigger[:st.shape[0]] = st
                    grown.append(bigger)
                self.ftrl_states[i] = grown
        new.step = old.step
        new.set_hyper_parameters(learning_rate=old.learning_rate, scaler=old.optimizer.scaler)
        self.engine = new

    def apply(self, ctx, grads, lr: float, scaler: float) -> None:
        """The fused backward + optimizer with this rank's gradients: (B, sum of widths) of the pooled
        lookup, or (N, D) of its occurrences (Ftrl: the engine sums each row's gradient, then Ftrl)."""
        eng = self.engine
        lr = float(lr)
        if self.wires is not None:
            ctx, grads = self.wires.gradients(ctx, grads)           # every rank takes part
            if isinstance(ctx, tuple):                              # several tables: the owner's grouped order
                ctx, order = ctx
                grads = device.xp().asarray(grads)[order]
        if eng.learning_rate != lr or eng.optimizer.scaler != scaler:
            eng.set_hyper_parameters(learning_rate=lr, scaler=float(scaler))
        out = eng.backward(ctx, grads)   # also with no occurrence: the step counts, Global updates run
        if self.ftrl is not None:
            self._ftrl(out.sparse, lr, float(scaler))

    def _ftrl(self, sparse, lr: float, scaler: float) -> None:
        """HugeCTR's Ftrl (kernels.optimizers.ftrl_update_ref) on each table's touched rows, from their summed
        gradients, in float32 as HugeCTR's embedding optimizer."""
        xp = device.xp()
        beta, l1, l2 = self.ftrl
        weights = self.engine.split_weights()
        for j, (rows, vals) in enumerate(sparse.per_table()):
            if rows.size == 0:
                continue
            dim = self.tables[j].dim
            idx = xp.asarray(rows)
            z, n = self.ftrl_states[j]
            w, zz, nn = OK.ftrl_update_ref(device.to_host(weights[j][idx]), device.to_host(z[idx]),
                                           device.to_host(n[idx]), np.ascontiguousarray(vals[:, :dim]),
                                           lr, beta, l1, l2, scaler)
            weights[j][idx], z[idx], n[idx] = xp.asarray(w), xp.asarray(zz), xp.asarray(nn)


class _Table:
    """One table at run time: its lookups, placement, optimizer, and its place in a group's engine."""

    def __init__(self, cfg: EmbeddingTableConfig, lookups: list, opt, seed: int, comm, strategy: str,
                 ranks: list[int]):
        self.cfg, self.name, self.dim = cfg, cfg.name, cfg.ev_size
        self.lookups = lookups                              # indices into the collection's lookups
        self.comm, self.strategy, self.ranks = comm, strategy, ranks
        self.seed = _seed(seed, cfg.name)
        self.opt_key, self.opt_spec, self.ftrl = _opt_key(opt, f"EmbeddingTableConfig {cfg.name!r}")
        self.group: _Group | None = None                    # set by the group
        self.index = 0                                      # this table's number in the group's engine

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
        if self.cfg.dynamic:
            table = self.engine.hash_tables[self.index]
            keys = device.to_host(table.keys_by_row()).astype(np.uint64).view(np.int64)
            return keys, np.array(device.to_host(self.weight[:table.size]))
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
        self.lookups = []          # per lookup: dict(table, bottom, top, combiner, hot, width)
        by_name = {t.name: t for t in cfg.tables}
        for table, bottom, top, combiner in cfg.lookups:
            p = sparse_params.get(bottom)
            if p is None:
                raise CollectionError(f"{self.name}: lookup {top!r} reads bottom_name {bottom!r}, which is not a "
                                      f"sparse input; sparse inputs: {sorted(sparse_params)}")
            if p.slot_num != 1:
                raise CollectionError(f"{self.name}: lookup {top!r} reads {bottom!r} with slot_num={p.slot_num}; "
                                      "an EmbeddingCollection lookup reads a sparse input of slot_num=1 (one "
                                      "DataReaderSparseParam per feature, as HugeCTR requires)")
            hot = int(p.max_feature_num)
            dim = by_name[table].ev_size
            self.lookups.append(dict(table=table, bottom=bottom, top=top, combiner=combiner, hot=hot,
                                     width=hot * dim if combiner == "concat" else dim, dim=dim))
        placement = self._placement(by_name)
        self.tables = []
        for t in cfg.tables:
            mine = [i for i, lk in enumerate(self.lookups) if lk["table"] == t.name]
            strategy, ranks = placement[t.name]
            table_opt = t.opt_params_or_empty if t.opt_params_or_empty is not None else opt
            self.tables.append(_Table(t, mine, table_opt, seed, comm, strategy, ranks))
        self._table_of = {i: t for t in self.tables for i in t.lookups}
        self.groups = self._group_tables()
        self._poolers = {}                  # (dim, pooling) -> _Pooler
        self._anchor = Tensor(device.xp().zeros(1, np.float32), name=self.name, requires_grad=True)
        self._saved = None                  # this step's per-table lookups, for update()
        self._pending = None                # this step's dLoss/dtop, from the tape's backward

    # ---- configuration ---------------------------------------------------------------------------
    def _group_tables(self) -> list:
        """The tables in as few engines (_Group) as one forward and one fused backward can serve: tables on
        the same ranks with the same strategy and optimizer settings share one, static ones apart from dynamic
        ones (a hash table in an engine takes the engine's index fast path away from its static tables, and
        a growing table rebuilds its whole engine), pooled groups (sum/average lookups only) apart from
        occurrence groups (a concat lookup, or model parallel over ranks), the latter by width (pooling NONE
        returns one width)."""
        groups: dict = {}
        for t in self.tables:
            sharded = self.comm.size > 1 and t.strategy == "mp"
            pooled = not sharded and all(self.lookups[i]["combiner"] != "concat" for i in t.lookups)
            key = (t.strategy, tuple(t.ranks), t.opt_key, t.cfg.dynamic, pooled, None if pooled else t.dim)
            groups.setdefault(key, (pooled, []))[1].append(t)
        if not GROUP_TABLES:
            return [_Group([t], self.comm, pooled) for pooled, members in groups.values() for t in members]
        return [_Group(members, self.comm, pooled) for pooled, members in groups.values()]

    def _placement(self, by_name: dict) -> dict:
        """{table name: (strategy "mp"|"dp", sorted ranks holding it)} from shard(), checked."""
        R = self.comm.size
        cfg, who = self.cfg, f"{self.name} shard()"
        if cfg.shard_matrix is None:
            if R > 1:
                raise CollectionError(f"{self.name}: on {R} ranks the EmbeddingCollectionConfig needs "
                                      "shard(shard_matrix, shard_strategy) to place its tables")
            return {n: ("mp", [0]) for n in by_name}
        G = len(cfg.shard_matrix)
        if G != R:
            # a script written for G GPUs (HugeCTR drives several GPUs from one process) on R ranks, one GPU
            # each: GPU g's tables go to rank g * R // G (the GPUs of one node to one rank); where a table lives
            # changes no result (model-parallel tables equal one rank's, data-parallel ones are everywhere)
            if G < R or G % R:
                raise CollectionError(f"{who}: shard_matrix has {G} rows, one per GPU; this job has {R} rank(s), one "
                                      f"GPU each (give one row per rank, or a multiple of the rank count)")
            from numbactr.config import warn_ignored
            warn_ignored(who, "shard_matrix rows", G, f"numbactr runs one GPU per rank: this job has {R} rank(s), so "
                         f"the tables of GPUs {G // R} at a time are placed together on one rank", stacklevel=4)
        strategy = {}
        for kind, names in cfg.shard_strategy:
            if kind not in ("mp", "dp"):
                raise CollectionError(f"{who}: shard_strategy kind {kind!r} is not 'mp' or 'dp'")
            for n in names:
                if n not in by_name:
                    raise CollectionError(f"{who}: shard_strategy names table {n!r}, which no lookup uses; "
                                          f"tables: {sorted(by_name)}")
                if n in strategy:
                    raise CollectionError(f"{who}: table {n!r} appears twice in shard_strategy")
                strategy[n] = kind
        missing = sorted(set(by_name) - set(strategy))
        if missing:
            raise CollectionError(f"{who}: tables {missing} are in no shard_strategy group ('mp' or 'dp')")
        ranks = {n: [] for n in by_name}
        for g, row in enumerate(cfg.shard_matrix):
            r = g * R // G
            for n in row:
                if n not in by_name:
                    raise CollectionError(f"{who}: shard_matrix row {g} names table {n!r}, which no lookup uses; "
                                          f"tables: {sorted(by_name)}")
                if r not in ranks[n]:
                    ranks[n].append(r)
        out = {}
        for n in by_name:
            if not ranks[n]:
                raise CollectionError(f"{who}: table {n!r} is on no rank (no shard_matrix row names it)")
            if strategy[n] == "dp" and len(ranks[n]) != R:
                raise CollectionError(f"{who}: data-parallel table {n!r} must be on every rank; shard_matrix puts "
                                      f"it on ranks {ranks[n]} of {R}")
            out[n] = (strategy[n], ranks[n])
        return out

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
        outs = _CollectionFn.apply(tape if training else None, self._anchor, coll=self, inputs=inputs,
                                   training=training, name=self.name)
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
            rows = (int(counts[:self.comm.rank].sum()), int(counts[:self.comm.rank + 1].sum()))
        per_lookup = [None] * len(self.lookups)
        saved = []
        for g in self.groups:
            gather = g.strategy == "dp" and self.comm.size > 1
            csrs = [self._csr(host[self.lookups[i]["bottom"]], gather) for i in g.lookups]
            for i, (keys, _) in zip(g.lookups, csrs):
                self._check_keys(self._table_of[i], i, keys)
            keys, offsets, pos = _interleave(csrs)
            out, ctx = g.lookup(xp.asarray(keys), xp.asarray(offsets), training)
            if g.pooled:                            # out: (B, sum of widths), every lookup's SUM side by side
                scales, col = [], 0
                for i, (_, o) in zip(g.lookups, csrs):
                    dim = self.lookups[i]["dim"]
                    part = out[:, col:col + dim]
                    scale = None
                    if self.lookups[i]["combiner"] != "sum":           # average: times 1/length (float32)
                        scale = xp.asarray(np.float32(1.0) / np.maximum(np.diff(o), 1).astype(np.float32))
                        part = part * scale[:, None]
                    per_lookup[i] = xp.ascontiguousarray(part[rows[0]:rows[1]] if gather else part)
                    scales.append(scale)
                    col += dim
                saved.append((ctx, scales, gather))
                continue
            pooled = []
            for i, (k, o), p in zip(g.lookups, csrs, pos):
                res, pctx = self._pool(i, out[xp.asarray(p)], o)
                per_lookup[i] = res[rows[0]:rows[1]] if gather else res
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
            raise CollectionError(f"{self.name}: lookup {lk['top']!r} (bottom {lk['bottom']!r}) has key "
                                  f"{int(keys[bad[0]])} at position {int(bad[0])}, outside static table "
                                  f"{t.name!r}'s rows [0, {t.cfg.max_vocabulary_size}) (max_vocabulary_size); "
                                  f"{bad.size} such key(s) in this batch. Use max_vocabulary_size=-1 (dynamic "
                                  "table) for arbitrary keys")

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
            raise CollectionError(f"{self.name}: concat lookup {lk['top']!r}: sample {b} of {lk['bottom']!r} has "
                                  f"{int(lens[b])} keys, more than its nnz_per_slot {lk['hot']}")
        place = np.repeat(np.arange(batch, dtype=np.int64) * lk["hot"] - offsets[:-1], lens) + \
            np.arange(offsets[-1], dtype=np.int64)                     # (n,) slot in (B*H) of each occurrence
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
                dy = xp.concatenate([xp.asarray(dys[i], dtype=np.float32) for i in g.lookups], axis=1)   # a copy
                if gather:                                  # every rank's dLoss/dtop rows, rank order
                    dy = xp.asarray(self.comm.allgather_rows(np.ascontiguousarray(device.to_host(dy))))
                col = 0
                for i, scale in zip(g.lookups, scales):
                    dim = self.lookups[i]["dim"]
                    if scale is not None:
                        dy[:, col:col + dim] *= scale[:, None]
                    col += dim
                g.apply(ctx, dy, lr, scaler)
                continue
            ctx, pos, pooled, csrs, gather, n = kept
            grads = xp.zeros((n, g.tables[0].dim), np.float32)
            for i, p, (pooler, pctx), (_, offsets) in zip(g.lookups, pos, pooled, csrs):
                dy = dys[i]
                if gather:                                  # every rank's dLoss/dtop rows, rank order
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
            return [xp.zeros((batch, lk["width"]), np.float32) if whole is None
                    else whole.reshape(batch, -1)[:, cols[i]:cols[i + 1]] for i, lk in enumerate(self.lookups)]
        return [xp.zeros((batch, lk["width"]), np.float32) if d is None else d.reshape(batch, -1)
                for d, lk in zip(pending, self.lookups)]


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


# ---- embedding_dump / embedding_load --------------------------------------------------------------
DUMP_BASE = "embedding_collection"       # the manifest's name in a dump folder: {DUMP_BASE}_0.manifest.json
# HugeCTR's layout (v23.08, embedding_storage/weight_io/parameter_IO.cpp and data_info.hpp)
FILE_HEAD_BYTES = 128                    # FileHeadNbytes: int32 file type (1 key, 2 weight), int32 table id, 0s
META_HEAD_INTS = 5                       # MetaDataHeadLength / 4: n tables, key type, value type, 0, 0
KEY_TYPES = {0: "<u4", 1: "<i8"}         # meta_data's key type: uint32 (i64_input_key=False) or int64
FILE_KEY, FILE_WEIGHT = 1, 2


def _selected(collections, table_names, what: str) -> list:
    """[(collection index, table index, _Table)] named by table_names ([] = all), in the model's order. The
    indices are HugeCTR's: a collection's place among the model's collections, a table's place in its
    collection (the order of the tables' first embedding_lookup)."""
    everything = [(c, j, t) for c, coll in enumerate(collections) for j, t in enumerate(coll.tables)]
    if not everything:
        raise CollectionError(f"{what}: the model has no EmbeddingCollection")
    names = list(table_names or [])
    known = {t.name for _, _, t in everything}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise CollectionError(f"{what}: no table named {unknown} in the model; tables: {sorted(known)}")
    return [(c, j, t) for c, j, t in everything if not names or t.name in names]


def _file_head(kind: int, table_id: int) -> np.ndarray:
    head = np.zeros(FILE_HEAD_BYTES // 4, "<i4")
    head[0], head[1] = kind, table_id
    return head.view(np.uint8)


def meta_data_bytes(table_ids, key_counts, ev_sizes, key_type: int) -> np.ndarray:
    """HugeCTR's meta_data file: int32 [n, key type, value type 0 (float32), 0, 0], the n table ids (int32,
    ascending), their key counts (uint64) and embedding vector sizes (int32), little-endian, unpadded."""
    n = len(table_ids)
    head = np.array([n, key_type, 0, 0, 0], "<i4")
    return np.concatenate([head.view(np.uint8), np.asarray(table_ids, "<i4").view(np.uint8),
                           np.asarray(key_counts, "<u8").view(np.uint8), np.asarray(ev_sizes, "<i4").view(np.uint8)])


def parse_meta_data(data: bytes, path: str) -> dict:
    """{"key_type": 0|1, "tables": {table id: (key count, ev size)}} of a meta_data file, checked."""
    what = "embedding_dump meta_data"
    if len(data) < 4 * META_HEAD_INTS:
        raise DataFormatError(what, path, None, f"holds {len(data)} bytes; its head alone is {4 * META_HEAD_INTS}")
    head = np.frombuffer(data, "<i4", META_HEAD_INTS)
    n, key_type, value_type = (int(v) for v in head[:3])
    want = 4 * META_HEAD_INTS + n * (4 + 8 + 4)
    if n < 0 or len(data) != want:
        raise DataFormatError(what, path, 0, f"says {n} tables, which take {max(want, 0)} bytes; the file holds "
                                             f"{len(data)}")
    if key_type not in KEY_TYPES:
        raise DataFormatError(what, path, 4, f"key type {key_type} is neither 0 (uint32) nor 1 (int64)")
    if value_type != 0:
        raise DataFormatError(what, path, 8, f"value type {value_type}: only 0 (float32 vectors) is read; "
                                             "1 (float16) is not supported")
    at = 4 * META_HEAD_INTS
    ids = np.frombuffer(data, "<i4", n, at)
    counts = np.frombuffer(data, "<u8", n, at + 4 * n)
    sizes = np.frombuffer(data, "<i4", n, at + 12 * n)
    if np.unique(ids).size != n or (ids < 0).any() or (sizes <= 0).any():
        raise DataFormatError(what, path, at, f"table ids {ids.tolist()} must be distinct and >= 0 and ev sizes "
                                              f"{sizes.tolist()} positive")
    return {"key_type": key_type,
            "tables": {int(i): (int(k), int(d)) for i, k, d in zip(ids, counts, sizes)}}


def dump(collections, comm, path: str, table_names=(), i64_keys: bool = True) -> None:
    """``Model.embedding_dump``: every rank calls it; rank 0 writes (module docstring: layout, atomicity)."""
    from numbactr.files import checkpoint
    chosen = _selected(collections, table_names, "embedding_dump")
    parts = []
    for c, j, t in chosen:                                # collectives, every rank in the same order
        keys, vecs = t.local_rows()
        parts.append((c, j, t, comm.gather_rows(keys), comm.gather_rows(np.ascontiguousarray(vecs, np.float32))))

    def write():
        outs, tables = [], []
        for c in sorted({c for c, *_ in parts}):
            mine = [(j, t, keys, vecs) for cc, j, t, keys, vecs in parts if cc == c]
            # HugeCTR's key type is the solver's; keys that do not fit uint32 are written as int64 anyway
            wide = i64_keys or any(k.size and (k.min() < 0 or k.max() > 0xFFFFFFFF) for _, _, k, _ in mine)
            key_type = 1 if wide else 0
            folder = f"{DUMP_BASE}_{c}"
            outs.append((f"{folder}/meta_data", meta_data_bytes([j for j, *_ in mine], [k.size for _, _, k, _ in mine],
                                                                 [t.dim for _, t, _, _ in mine], key_type)))
            for j, t, keys, vecs in mine:
                order = np.argsort(keys, kind="stable")
                outs += [(f"{folder}/key{j}", np.concatenate([_file_head(FILE_KEY, j),
                                                              checkpoint._raw(keys[order], KEY_TYPES[key_type])])),
                         (f"{folder}/weight{j}", np.concatenate([_file_head(FILE_WEIGHT, j),
                                                                 checkpoint._raw(vecs[order], "<f4")]))]
                tables.append({"name": t.name, "collection": c, "table_id": j, "ev_size": t.dim,
                               "max_vocabulary_size": t.cfg.max_vocabulary_size, "keys": int(keys.shape[0])})
        os.makedirs(path, exist_ok=True)
        checkpoint._commit(path, DUMP_BASE, 0, outs, {"ranks": comm.size, "embeddings": [], "tables": tables})

    checkpoint.on_rank0(comm, write, f"embedding_dump({path!r}): rank 0 could not write the tables")


def _read_hugectr_table(snap, path: str, c: int, j: int, t, metas: dict):
    """(keys (n,) int64, vectors (n, D), the key file, its key size) of table j of collection c from HugeCTR's
    layout, checked against meta_data (table id, ev_size, key count) and the files' heads."""
    from numbactr.files import checkpoint
    folder = os.path.join(path, f"{DUMP_BASE}_{c}")
    mpath = os.path.join(folder, "meta_data")
    if c not in metas:
        metas[c] = parse_meta_data(snap.read(mpath, "embedding_load meta_data"), mpath)
    meta = metas[c]
    what = f"embedding_load table {t.name!r} (collection {c}, table id {j})"
    if j not in meta["tables"]:
        raise DataFormatError("embedding_dump meta_data", mpath, None,
                              f"lists table ids {sorted(meta['tables'])}; {what} is not in this dump")
    n, dim = meta["tables"][j]
    if dim != t.dim:
        raise DataFormatError("embedding_dump meta_data", mpath, None,
                              f"gives table id {j} ev_size {dim}; the model's table {t.name!r} has ev_size {t.dim}")
    kdt = KEY_TYPES[meta["key_type"]]
    arrays = []
    for kind, name, dtype, count in ((FILE_KEY, f"key{j}", kdt, n), (FILE_WEIGHT, f"weight{j}", "<f4", n * dim)):
        fpath = os.path.join(folder, name)
        data = snap.read(fpath, f"{what} {name}")
        if len(data) < FILE_HEAD_BYTES or int(np.frombuffer(data, "<i4", 1)[0]) != kind:
            raise DataFormatError(what, fpath, 0, f"is not a HugeCTR {('key', 'weight')[kind - 1]} file (its "
                                                  f"{FILE_HEAD_BYTES}-byte head must start with int32 {kind})")
        arrays.append(checkpoint._array(data[FILE_HEAD_BYTES:], dtype, fpath, f"{what} {name}", count,
                                        f": meta_data says {n} keys of ev_size {dim}"))
    keys, vecs = arrays
    return keys.astype(np.int64), vecs.reshape(n, dim), os.path.join(folder, f"key{j}"), np.dtype(kdt).itemsize


def load(collections, path: str, table_names=()) -> None:
    """``Model.embedding_load``: read and check every named table's files (verified against the dump's
    manifest when there is one), then write them into the tables; a failed load changes nothing. Reads
    HugeCTR's layout (embedding_collection_<c>/meta_data, key<id>, weight<id>: what HugeCTR and numbactr
    write) and numbactr's earlier one (<table name>/key and emb_vector)."""
    from numbactr.files import checkpoint
    chosen = _selected(collections, table_names, "embedding_load")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"embedding_load: folder {path!r} does not exist")
    mpath = os.path.join(path, f"{DUMP_BASE}_0.manifest.json")
    snap = checkpoint._Snapshot(path, mpath, checkpoint._read_manifest(mpath)) if os.path.exists(mpath) \
        else checkpoint._Snapshot(path)
    loaded, metas = [], {}
    for c, j, t in chosen:
        what = f"embedding_load table {t.name!r}"
        old = os.path.join(path, t.name, "key")
        hugectr = os.path.join(path, f"{DUMP_BASE}_{c}", "meta_data")
        if snap.has(hugectr) or not snap.has(old):
            if not snap.has(hugectr):
                raise FileNotFoundError(f"{what}: {path!r} holds no dump of it: neither HugeCTR's {hugectr!r} "
                                        f"nor numbactr's earlier {old!r}")
            keys, vecs, kpath, item = _read_hugectr_table(snap, path, c, j, t, metas)
            base = FILE_HEAD_BYTES
        else:
            kpath, vpath = old, os.path.join(path, t.name, "emb_vector")
            keys = checkpoint._array(snap.read(kpath, what + " keys"), "<i8", kpath, what + " keys")
            item, base = 8, 0
            n = keys.shape[0]
            vecs = checkpoint._array(snap.read(vpath, what + " vectors"), "<f4", vpath, what + " vectors", n * t.dim,
                                     f": {n} keys in {kpath!r} x ev_size {t.dim}").reshape(n, t.dim)
        n = keys.shape[0]
        uniq, first = np.unique(keys, return_index=True)
        if uniq.shape[0] != n:
            dup = np.setdiff1d(np.arange(n), first)[0]
            raise DataFormatError(what + " keys", kpath, base + item * int(dup), f"key {int(keys[dup])} appears twice")
        if t.cfg.dynamic:
            bad = np.flatnonzero(keys == -1)
            why = "-1 is reserved (it marks empty hash-table slots)"
        else:
            bad = np.flatnonzero((keys < 0) | (keys >= t.cfg.max_vocabulary_size))
            why = f"outside the static table's rows [0, {t.cfg.max_vocabulary_size})"
        if bad.size:
            i = int(bad[0])
            raise DataFormatError(what + " keys", kpath, base + item * i, f"key {int(keys[i])} at position {i} is {why}")
        loaded.append((t, keys.copy(), np.array(vecs, np.float32)))
    for t, keys, vecs in loaded:
        t.load_rows(keys, vecs)
