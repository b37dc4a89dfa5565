"""Tiered tables: the engine on a fast cache of slots, every row in a larger backing tier.

    tier = TieredEmbedding(tables, feature_table_map, cache=CacheConfig(policy="lru", load_factor=0.2),
                           backing="memmap", path="/data/tables", optimizer=..., ...)   # engine arguments
    out, ctx = tier.forward(indices, offsets)      # the engine's forward (same arguments and results)
    tier.prefetch(next_indices, next_offsets)      # optional: stage the next batch (on a thread if asked)
    tier.backward(ctx, grad_output)                # the engine's fused backward + optimizer, on the slots
    tier.flush(); tier.split_weights()             # every row, from the backing tier

What happens (shapes: T tables, V_t rows, C_t cache slots, N occurrences):
  * the fast tier is an ordinary TableBatchedEmbedding whose table t has C_t rows, the slots, holding
    weights and optimizer states; on a GPU it is device memory, on the cpu device RAM.
  * the backing tier (numbactr.embedding.tiers) holds every row of every table with its optimizer states
    and LFU count: host memory ("host"; pinned on a GPU) or files (numpy.memmap, "memmap").
  * before a batch's lookup its rows are placed (numbactr.embedding.cache.EmbeddingCache): hits keep their
    slot; misses take LRU / LFU victims among slots that neither this batch nor a pending training lookup
    uses; a victim's row is written back (weights AND optimizer states) when it was updated, then the
    missing rows are loaded; the engine then runs on slot numbers. A training lookup pins its slots until
    its backward has run, so a prefetch of the next batch can never move a row that an update is about to
    write (FBGEMM's prefetch-pipeline cache locking).
  * the engine's per-row math reads only that row's weights and states (and the step, learning rate and
    batch), and each row's gradient is summed in occurrence order whatever its slot, so training through
    the cache gives exactly the weights and states of training with every table in the fast tier, for
    every optimizer (tests/test_tiered.py). HugeCTR's GLOBAL update kinds move every row in use each step:
    the slots through the engine, the rows of the backing tier through the same pass of the same
    implementation (ref: NumPy, cpu: compiled; on a GPU the CPU's compiled pass runs on the host tier, the
    same float32 formula), which costs a pass over the whole backing tier per step.
  * a batch with more distinct rows of a table than that table's free slots is an error
    (CacheCapacityError) before anything moves: never a silent fallback.
  * keyed tables (HugeCTR's hash embeddings, TableSpec(keyed=True)): the tier maps keys to rows itself
    before the engine runs, with the engine's HashTable (in memory: the hot key -> row path is a compiled
    or kernel hash lookup, never the store), rows in order of first occurrence and new rows U(init_range)
    from a hash of (seed, key), exactly as the engine's keyed tables; each new row is written to the
    backing tier when its key arrives. rows = the most keys the table takes (host, memmap), or rows=0 on
    backing="lmdb": a dynamic vocabulary whose key table doubles as it fills and whose rows and keys
    live in an LMDB environment (numbactr.embedding.tiers.LmdbStore), which reopens with its vocabulary.
  * FP16 weights with stochastic rounding: the rounding's random bits hash the row's number, so the slot
    engine hashes the row each slot holds (engine.sr_rows), and rounds exactly as the whole table would.
Not supported through the cache (an error says so): HugeCTR's GLOBAL kinds on an LMDB tier (their pass
needs the rows as arrays).
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np

from numbactr.runtime import device
from numbactr.kernels import cache as KC
from numbactr.kernels import embedding_init
from numbactr.kernels import tbe
from numbactr.kernels import tbe_cpu
from numbactr.config import CacheConfig, TierSpec  # noqa: F401 (their documented home: numbactr.embedding.tiered)
from numbactr.embedding.cache import CacheCapacityError, CacheStats, EmbeddingCache
from numbactr.embedding.engine import (
    Grads,
    LookupContext,
    Optim,
    OptimizerSpec,
    Precision,
    SparseRowGrad,
    TableBatchedEmbedding,
    TableSpec,
    _as_table,
    _check_optimizer,
    state_specs,
)
from numbactr.embedding.hash_table import HashTable, HashTableFullError
from numbactr.embedding.tiers import BufferSpec, make_store

__all__ = ["TieredEmbedding", "CacheConfig", "TierSpec", "CacheCapacityError", "CacheStats", "cache_rows", "slot_bytes"]

SLOT_BOOKKEEPING_BYTES = 8 + 8 + 8 + 4 + 1  # slot_row, stamp, freq, pin, dirty per slot
_FIRST_KEYS = 1024  # rows a growing keyed table starts with (then doubles)
ROW_MAP_BYTES = 8  # row_slot per row of the table


def slot_bytes(dim: int, precision: Precision, state_specs) -> int:
    """Fast-tier bytes of one slot of width dim: the padded weights row, its states and the bookkeeping."""
    lane = 8 if precision == Precision.FP16 else 4
    stride = -(-dim // lane) * lane
    total = stride * (2 if precision == Precision.FP16 else 4) + SLOT_BOOKKEEPING_BYTES
    for _, per_row, dtype in state_specs:
        total += np.dtype(dtype).itemsize * (1 if per_row else stride)
    return total


def cache_rows(tables, config: CacheConfig, precision=Precision.FP32, state_specs=()) -> list:
    """Slots per table (C_t): load_factor * V_t, or the byte budget split in proportion to V_t; at least
    config.min_slots and at most V_t."""
    specs = [_as_table(t) for t in tables]
    rows = np.array([t.rows for t in specs], np.int64)
    if config.capacities is not None:
        caps = [int(c) for c in config.capacities]
        if len(caps) != rows.size or any(c < 1 or (r and c > r) for c, r in zip(caps, rows)):
            raise ValueError(
                f"cache capacities {caps} must give each of the {rows.size} tables 1..rows slots "
                f"(rows {rows.tolist()}; a growing table, rows=0, any number >= 1)"
            )
        return caps
    if config.budget_bytes is not None:
        per_row = np.array([slot_bytes(t.dim, Precision(precision), state_specs) for t in specs], np.int64)
        if config.budget_bytes <= 0:
            raise ValueError(f"cache budget_bytes must be > 0, got {config.budget_bytes}")
        frac = config.budget_bytes / max(int((rows * per_row).sum()), 1)
    else:
        frac = config.load_factor
        if frac is None or not 0 < frac <= 1:
            raise ValueError(f"cache load_factor must be in (0, 1], got {frac!r}")
    return [int(min(r, max(config.min_slots, math.floor(frac * r)))) if r else 0 for r in rows]


class _SlotEngine(TableBatchedEmbedding):
    """The engine over the cache's slots: bounds-checks indices against the full tables and places the
    rows in slots (the forward's _storage_rows hook)."""

    def __init__(self, tier: "TieredEmbedding", full_rows, slot_tables, ftm, **kwargs):
        self._full_rows = np.asarray(full_rows, np.int64)
        self._tier = weakref.proxy(tier)
        super().__init__(slot_tables, ftm, **kwargs)

    def _feature_rows(self) -> np.ndarray:
        return self._full_rows[self.feature_table_map]

    def _storage_rows(self, indices, rows, offsets, batch: int, training: bool):
        return self._tier._place_lookup(rows, offsets, batch, training)

    def _max_counter_refresh(self, t: int) -> bool:
        # the slots hold some rows' counters only: TieredEmbedding.backward renews max_counter over every row
        # (the cache's and the backing tier's) before the engine's update, which then keeps that value
        return False


class TieredEmbedding:
    """A TableBatchedEmbedding whose tables live in a backing tier behind a cache (module docstring).

    Args:
        tables, feature_table_map: as the engine's; a keyed table may have rows=0 (grows) on "lmdb".
        cache: CacheConfig (default: LRU, load factor 0.2).
        backing: "host", "memmap", "lmdb" or a store object (numbactr.embedding.tiers).
        path: the memmap / lmdb tier's directory (default: a temporary one, removed by close()).
        **engine_kwargs: the engine's keyword arguments (pooling, optimizer, weights_precision, ...).
    """

    def __init__(
        self,
        tables,
        feature_table_map=None,
        *,
        cache: CacheConfig | None = None,
        backing="host",
        path=None,
        **engine_kwargs,
    ):
        self.tables = [_as_table(t) for t in tables]
        if not self.tables:
            raise ValueError("TieredEmbedding needs at least one table")
        self.config = cache or CacheConfig()
        if Precision(engine_kwargs.get("weights_precision", Precision.FP32)) == Precision.INT8:
            raise NotImplementedError(
                "TieredEmbedding: INT8 weights are forward only and are not cached; use "
                "FP32 or FP16 weights, or an untiered engine for INT8"
            )
        rows = np.array([t.rows for t in self.tables], np.int64)
        growable = backing == "lmdb" or getattr(backing, "grow", None) is not None
        unbounded = [t for t, spec in enumerate(self.tables) if spec.rows == 0]
        if unbounded and not (growable and all(self.tables[t].keyed for t in unbounded)):
            raise ValueError(
                f"tables {unbounded} have rows=0: only keyed tables on a growable backing tier "
                "(backing='lmdb') may start empty and grow; give the others rows >= 1"
            )
        if unbounded and self.config.capacities is None:
            raise ValueError(
                f"tables {unbounded} grow without a bound: give their cache sizes as "
                "CacheConfig(capacities=[...]) (a load factor of an unknown size means nothing)"
            )
        self._lock = threading.Lock()
        self._prefetched = []  # FIFO of the unique slots prefetch() staged (and pinned) for a forward
        self._worker = None
        self._worker_error = None
        # linear rows of the tables as declared: init_uniform's hash (the untiered engine's numbering)
        self.spec_row_offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        slots = self._sizes(engine_kwargs, feature_table_map)
        slot_tables = [TableSpec(c, t.dim, False, t.init_range) for c, t in zip(slots, self.tables)]
        # keyed features are bounds-checked after their keys became rows: below the table's size (a growing
        # table's bound is the largest row number there can be)
        bounds = np.where(rows > 0, rows, np.iinfo(np.int64).max // 2)
        self.engine = _SlotEngine(self, bounds, slot_tables, feature_table_map, **engine_kwargs)
        e = self.engine
        kernels = e.impl == "kernels"
        self.key_index = {
            t: self._new_index(spec.rows or _FIRST_KEYS, kernels) for t, spec in enumerate(self.tables) if spec.keyed
        }
        self._growing = set(unbounded)
        space = [self.key_index[t].max_rows if t in self._growing else int(r) for t, r in enumerate(rows)]
        self.cache = EmbeddingCache(slots, space, self.config.policy, use_kernels=kernels)
        if e.weights_precision == Precision.FP16 and e.stochastic_rounding:
            e.sr_rows = self.cache.xp.arange(self.cache.n_slots, dtype=np.int64)  # slot -> the row it holds
        self._specs = e._state_specs()
        buffers = [BufferSpec("weights", False, e.weights.dtype)]
        buffers += [
            BufferSpec(name, per_row, dtype, e.initial_state_value(name)) for name, per_row, dtype in self._specs
        ]
        buffers.append(BufferSpec("freq", True, np.int64))
        self.store = make_store(
            backing, buffers, rows, [t.dim for t in self.tables], path=path, pinned=device.kind() == "gpu"
        )
        if hasattr(self.store, "keys"):
            self._reopen_keys()
        if tbe.has_global_pass(e.optimizer.kind, e.optimizer.update_type) and not hasattr(self.store, "flat"):
            raise NotImplementedError(
                "HugeCTR's GLOBAL update passes over every row each step: it needs a backing "
                "tier of arrays (backing='host' or 'memmap'), not an LMDB store"
            )
        # per table, its cache buffers: (C_t, D_t) views (host path) and the padded (C_t, stride_t) / (C_t, 1)
        # contiguous blocks they live in (the row kernels' arguments)
        self._cache_views = [[w] + list(s) for w, s in zip(e.split_weights(), e.split_optimizer_states())]
        self._cache_blocks = [
            [_block(e, e.weights, t, False)]
            + [_block(e, buf, t, per_row) for buf, (_, per_row, _) in zip(e.states, self._specs)]
            for t in range(len(self.tables))
        ]
        self.weights_precision = e.weights_precision

    def _new_index(self, max_rows: int, kernels: bool) -> HashTable:
        """A key -> row hash table as the engine's keyed tables have (rows in order of first occurrence)."""
        return HashTable(
            max_rows, use_kernels=kernels, xp=device.xp() if kernels else np, compiled=self.engine.impl == "cpu"
        )

    def _reopen_keys(self) -> None:
        """An LMDB store that already holds keys: the key -> row tables take them back, rows as recorded."""
        for t in self.key_index:
            keys = self.store.keys(t)
            if keys.size:
                self._grow_keys(t, keys.size)
                rows = device.to_host(self.key_index[t].insert(self.cache.xp.asarray(keys)))
                if not np.array_equal(rows, np.arange(keys.size)):
                    raise ValueError(
                        f"{self.store.path}: table {t}'s recorded keys are not a row-ordered "
                        "vocabulary (duplicate keys?)"
                    )
                self.store.grow(t, keys.size)

    def _grow_keys(self, t: int, need: int) -> None:
        """Make growing table t's key -> row table (and the cache's row space) hold `need` rows, doubling."""
        index = self.key_index[t]
        if need <= index.max_rows:
            return
        cap = index.max_rows
        while cap < need:
            cap *= 2
        bigger = self._new_index(cap, self.engine.impl == "kernels")
        keys = index.keys_by_row()
        if keys.shape[0]:
            bigger.insert(keys)  # row order in, row order out: every key keeps its row
        self.key_index[t] = bigger
        self.cache.grow_rows(t, cap)

    def _sizes(self, engine_kwargs, feature_table_map) -> list:
        opt = _check_optimizer(engine_kwargs.get("optimizer") or OptimizerSpec())
        specs = state_specs(opt)
        return cache_rows(self.tables, self.config, engine_kwargs.get("weights_precision", Precision.FP32), specs)

    # ---- the engine's interface ----------------------------------------------------------------------
    @property
    def row_offsets(self) -> np.ndarray:
        """(T + 1,) offsets of the tables in the cache's linear row space (a growing keyed table moves the
        tables after it)."""
        return self.cache.row_offsets

    def live_rows(self, t: int) -> int:
        """Rows of table t in use: every row, or the keys inserted so far for a keyed table."""
        index = self.key_index.get(t)
        return index.size if index is not None else int(self.tables[t].rows)

    def keys(self, t: int):
        """(n,) uint64 the keys of keyed table t in row order (row r holds key keys[r])."""
        return self.key_index[t].keys_by_row()

    @property
    def hash_tables(self) -> dict:
        """{table: its key -> row HashTable} of the keyed tables (the engine's attribute of that name)."""
        return self.key_index

    @property
    def pooling(self):
        return self.engine.pooling

    def take_state_rows(self, t: int, src) -> None:
        """The engine's take_state_rows on the backing tier (a checkpoint load rebuilt table t's rows): row i
        takes the optimizer states of old row src[i] (-1: initial states), every other row starts anew."""
        self.invalidate()
        src = np.asarray(device.to_host(src), np.int64)
        hit = src >= 0
        for view, (name, _, _) in zip(self.store.views(t)[1 : 1 + len(self._specs)], self._specs):
            kept = view[src[hit]]
            view[...] = self.engine.initial_state_value(name)
            view[: src.shape[0]][hit] = kept

    @property
    def feature_table_map(self) -> list:
        return self.engine.feature_table_map

    @property
    def n_features(self) -> int:
        return self.engine.n_features

    @property
    def total_dim(self) -> int:
        return self.engine.total_dim

    @property
    def optimizer(self):
        return self.engine.optimizer

    @property
    def step(self) -> int:
        return self.engine.step

    @step.setter
    def step(self, value: int) -> None:
        self.engine.step = int(value)

    @property
    def learning_rate(self) -> float:
        return self.engine.learning_rate

    @learning_rate.setter
    def learning_rate(self, lr: float) -> None:
        self.engine.learning_rate = lr

    def set_hyper_parameters(self, **values) -> None:
        self.engine.set_hyper_parameters(**values)

    @property
    def bounds_warnings(self) -> int:
        return self.engine.bounds_warnings

    @property
    def stats(self) -> CacheStats:
        """Hit, miss, eviction and write-back counters (numbactr.embedding.cache.CacheStats)."""
        return self.cache.stats

    @property
    def capacities(self) -> list:
        """Cache slots per table (C_t)."""
        return [int(c) for c in self.cache.capacities]

    def forward(
        self,
        indices,
        offsets,
        per_sample_weights=None,
        *,
        training: bool = True,
        pooling=None,
        feature_requires_grad=None,
    ):
        """The engine's forward through the cache: (out, ctx) as TableBatchedEmbedding.forward."""
        self._wait()
        self._held = None
        if self.key_index:
            indices = self._keyed_rows(indices, offsets, training)
        try:
            out, ctx = self.engine.forward(
                indices,
                offsets,
                per_sample_weights,
                training=training,
                pooling=pooling,
                feature_requires_grad=feature_requires_grad,
            )
        except BaseException:
            if self._held is not None:  # placed and pinned, but no lookup came of it
                self.cache.unpin(self._held, dirty=False)
            raise
        # the table rows of the occurrences (ctx.rows are cache slots): what HugeCTR's Localized tables record
        ctx.extra["table_rows"] = self.cache.xp.asarray(indices).astype(np.int64, copy=False)
        if self._held is not None:
            # the slots stay pinned until this lookup's backward, or until the lookup is dropped
            ctx.extra["tier_slots"] = self._held
            ctx.extra["tier_release"] = weakref.finalize(ctx, self.cache.unpin, self._held, False)
        return out, ctx

    def backward(self, ctx: LookupContext, grad_output) -> Grads:
        """The engine's fused backward + optimizer on the lookup's slots; optimizer NONE returns the row
        gradients with the tables' linear rows (ascending), as the untiered engine does."""
        release = ctx.extra.get("tier_release")
        if release is None or not release.alive:
            raise RuntimeError(
                "this lookup has no cache slots held for a backward: it was an evaluation "
                "lookup (training=False) or its backward already ran"
            )
        self._wait()
        e = self.engine
        glob = tbe.has_global_pass(e.optimizer.kind, e.optimizer.update_type)
        if TableBatchedEmbedding._max_counter_refresh(e, e.step + 1):
            self._renew_max_counter()
        grads = e.backward(ctx, grad_output)  # a bad grad_output raises here: the slots stay held
        del ctx.extra["tier_release"]
        release.detach()
        self.cache.unpin(ctx.extra["tier_slots"], dirty=e.optimizer.kind != Optim.NONE)
        if glob:
            self._backing_global_pass(e.step)
            self.cache.mark_all_dirty()
        if grads.sparse is not None:
            grads.sparse = self._row_grads(grads.sparse)
        return grads

    def _row_grads(self, g: SparseRowGrad) -> SparseRowGrad:
        """Slot gradients -> row gradients: linear rows of the full tables, ascending."""
        xp = self.cache.xp
        rows = self.cache.slot_row[g.rows]
        order = xp.argsort(rows, kind="stable")
        return SparseRowGrad(rows[order], g.values[order], self.row_offsets.copy())

    # ---- keys -> rows ------------------------------------------------------------------------------------
    def _keyed_rows(self, indices, offsets, training: bool, insert: bool = True):
        """indices (N,) with the keys of keyed features replaced by their rows (int64): training inserts new
        keys (rows in order of first occurrence, the engine's rule; each new row is written to the backing
        tier U(init_range) from a hash of (seed, key) with initial optimizer states), evaluation (or
        insert=False) finds them (-1 when missing). A batch the engine's FATAL check will refuse (bad offsets,
        an unkeyed index outside its table) inserts nothing, as in the engine, which checks before it
        inserts."""
        xp = self.cache.xp
        e = self.engine
        indices, offsets = xp.asarray(indices), xp.asarray(offsets)
        if indices.ndim != 1 or offsets.ndim != 1 or indices.dtype.kind not in "iu":
            return indices  # the engine's checks say what is wrong
        n_bags = offsets.shape[0] - 1
        if n_bags < 0 or n_bags % e.n_features:
            return indices
        host_off = device.to_host(offsets).astype(np.int64)
        fixed, bad = tbe.check_offsets_ref(host_off, int(indices.shape[0]), tbe.BoundsCheck.IGNORE)
        if bad and e.bounds_check == tbe.BoundsCheck.FATAL:
            insert = False
        _, feat, _ = tbe._occurrences(fixed, e.n_features, n_bags // e.n_features, e.layout)
        keyed = np.array([t in self.key_index for t in e.feature_table_map])
        is_key = np.zeros(feat.shape[0], bool)
        is_key[feat >= 0] = keyed[feat[feat >= 0]]
        if indices.dtype == np.uint64 and (~is_key).any():
            e._as_int64(indices[xp.asarray(np.flatnonzero(~is_key))])  # unkeyed values must fit int64
        out = indices.astype(np.int64)
        if e.bounds_check == tbe.BoundsCheck.FATAL and insert:
            plain = np.flatnonzero(~is_key & (feat >= 0))
            limit = e._feature_rows()[feat[plain]]
            vals = device.to_host(out[xp.asarray(plain)]) if plain.size else np.zeros(0, np.int64)
            insert = not bool(((vals < -1) | (vals >= limit)).any())
        for t in self.key_index:
            feats = [f for f, ft in enumerate(e.feature_table_map) if ft == t]
            mine = xp.asarray(np.flatnonzero(np.isin(feat, feats)))
            if mine.shape[0]:
                out[mine] = self._rows_of_keys(t, indices[mine], training and insert)
        return out

    def _rows_of_keys(self, t: int, keys, insert: bool):
        index = self.key_index[t]
        if not insert:
            return index.find(keys)
        before = index.size
        if t in self._growing:  # room for the batch's distinct new keys first
            new = keys[index.find(keys) < 0]
            self._grow_keys(t, before + int(self.cache.xp.unique(new).shape[0]))
            index = self.key_index[t]
        try:
            rows = index.insert(keys)
        except HashTableFullError as err:
            raise HashTableFullError(
                err.needed, err.used, err.max_rows, hint=f"tiered table {t} holds at most rows={err.max_rows} keys"
            ) from None
        if index.size > before:
            rows_h, keys_h = device.to_host(rows), device.to_host(keys).astype(np.uint64)
            new_rows, first = np.unique(rows_h[rows_h >= before], return_index=True)
            new_keys = keys_h[rows_h >= before][first]
            spec = self.tables[t]
            w = embedding_init.row_values_ref(new_keys, spec.dim, self.engine.seed, *spec.init_range)
            with self._lock:
                if t in self._growing:
                    self.store.grow(t, index.size)
                values = [w.astype(self.engine.weights.dtype)] + [None] * (len(self._specs) + 1)
                self._reset_rows(t, new_rows, values)
                if hasattr(self.store, "put_keys"):
                    self.store.put_keys(t, new_rows, new_keys)
        return rows

    def _reset_rows(self, t: int, rows: np.ndarray, values: list) -> None:
        """Rows new to keyed table t: the given weights, every optimizer state and LFU count at its start."""
        full = list(values)
        for i, b in enumerate(self.store.buffers):
            if full[i] is None:
                shape = b.shape(rows.size, self.tables[t].dim)
                full[i] = np.full(shape, b.initial, b.dtype)
        self.store.write(t, rows, full)

    # ---- placement ---------------------------------------------------------------------------------------
    def _linear_rows(self, rows, offsets, batch: int):
        """(N,) linear rows of local rows (N,): -1 for -1 and for rows outside their table (bounds check
        NONE lets them through: they read and update nothing)."""
        xp = self.cache.xp
        e = self.engine
        _, feat, _ = tbe._occurrences(device.to_host(offsets).astype(np.int64), e.n_features, batch, e.layout)
        tab = np.asarray(e.feature_table_map)[np.maximum(feat, 0)]
        base = xp.asarray(np.where(feat >= 0, self.row_offsets[tab], 0))
        limit = xp.asarray(np.where(feat >= 0, self.row_offsets[tab + 1] - self.row_offsets[tab], 0))
        rows = xp.asarray(rows).astype(np.int64, copy=False)
        return xp.where((rows >= 0) & (rows < limit), rows + base, -1)

    def _place_lookup(self, rows, offsets, batch: int, training: bool):
        """The forward's hook: place the lookup's rows, pin them for a training lookup's backward, release
        the prefetch this forward consumes; returns the local slots (N,)."""
        plan = self._place(self._linear_rows(rows, offsets, batch), count=not self._prefetched)
        if self._prefetched:
            self.cache.unpin(self._prefetched.pop(0), dirty=False)
        if training:
            self.cache.pin(plan.unique_slots)
        self._held = plan.unique_slots if training else None
        xp = self.cache.xp
        return xp.where(plan.slots >= 0, plan.slots - self._slot_base(plan.slots), -1)

    def _slot_base(self, slots):
        """slot_offsets of each linear slot's table."""
        xp = self.cache.xp
        off = xp.asarray(self.cache.slot_offsets)
        return off[xp.searchsorted(off, xp.maximum(slots, 0), side="right") - 1]

    def _place(self, lin, count: bool = True):
        """Place linear rows (N,) and move the rows that enter or leave the cache."""
        with self._lock:
            plan = self.cache.place(lin, count)
            loaded_freq = self._move(plan)
            self.cache.finish(plan, loaded_freq)
            return plan

    def _move(self, plan) -> np.ndarray:
        """Write the evicted dirty rows back, load the misses into their victims; returns the misses' LFU
        counts from the backing tier."""
        cache = self.cache
        loaded_freq = np.zeros(plan.misses.shape[0], np.int64)
        for t in range(len(self.tables)):
            m0, m1 = int(plan.miss_start[t]), int(plan.miss_start[t + 1])
            if m0 == m1:
                continue
            victims = plan.victims[m0:m1] - cache.slot_offsets[t]
            evicted = plan.evicted[m0:m1]
            held = evicted >= 0
            dirty = held & (plan.evicted_dirty[m0:m1] != 0)
            if dirty.any():  # weights and optimizer states of the updated rows
                self._write(t, evicted[dirty] - self.row_offsets[t], self._gather(t, victims[dirty]) + [None])
                cache.stats.writebacks += int(dirty.sum())
            if held.any():  # every evicted row's LFU count
                self._write(
                    t,
                    evicted[held] - self.row_offsets[t],
                    [None] * len(self._cache_views[t]) + [plan.evicted_freq[m0:m1][held]],
                )
            misses = plan.misses[m0:m1] - self.row_offsets[t]
            if self.engine.sr_rows is not None:  # stochastic rounding hashes the row the slot now holds
                xp = self.cache.xp
                self.engine.sr_rows[xp.asarray(plan.victims[m0:m1])] = xp.asarray(self.spec_row_offsets[t] + misses)
            loaded = self.store.read(t, misses)
            self._scatter(t, victims, loaded[:-1])
            loaded_freq[m0:m1] = loaded[-1]
        return loaded_freq

    def _write(self, t: int, rows: np.ndarray, values: list) -> None:
        """Store rows of table t for the buffers whose value is given (None: keep)."""
        self.store.write(t, rows, values)

    def _gather(self, t: int, slots: np.ndarray) -> list:
        """Host copies of the cache rows of table t at local slots (n,): weights and states."""
        if self.cache.use_kernels:
            xp = self.cache.xp
            idx = xp.asarray(slots)
            out = []
            for view, block in zip(self._cache_views[t], self._cache_blocks[t]):
                width = 1 if view.ndim == 1 else view.shape[1]
                buf = xp.empty((idx.shape[0], width), block.dtype)
                KC.gather_rows(block, idx, buf)
                out.append(device.to_host(buf).view(view.dtype).reshape((idx.shape[0],) + view.shape[1:]))
            return out
        return [view[slots] for view in self._cache_views[t]]

    def _scatter(self, t: int, slots: np.ndarray, values: list) -> None:
        if self.cache.use_kernels:
            xp = self.cache.xp
            idx = xp.asarray(slots)
            for block, v in zip(self._cache_blocks[t], values):
                src = xp.asarray(np.ascontiguousarray(v).reshape(idx.shape[0], -1)).view(block.dtype)
                KC.scatter_rows(block, idx, src)
            return
        for view, v in zip(self._cache_views[t], values):
            view[slots] = v

    # ---- prefetch ----------------------------------------------------------------------------------------
    def prefetch(self, indices, offsets) -> None:
        """Stage the rows of a coming forward (FBGEMM's prefetch): they are placed now (on a worker thread
        with CacheConfig.prefetch_thread) and held until the next forward, which finds them cached. Indices
        outside their table are skipped here (the forward's bounds check reports them)."""
        self._wait()
        xp = self.cache.xp
        e = self.engine
        indices, offsets = xp.asarray(indices), xp.asarray(offsets)
        n_bags = offsets.shape[0] - 1
        if indices.ndim != 1 or offsets.ndim != 1 or n_bags < 0 or n_bags % e.n_features:
            raise ValueError(
                f"prefetch: indices (N,) and offsets (F*B + 1,) with F = {e.n_features} features, "
                f"got shapes {indices.shape} and {offsets.shape}"
            )
        fixed, _ = tbe.check_offsets_ref(
            device.to_host(offsets).astype(np.int64), int(indices.shape[0]), tbe.BoundsCheck.IGNORE
        )
        if self.key_index:
            indices = self._keyed_rows(indices, offsets, training=False)
        lin = self._linear_rows(indices, fixed, n_bags // e.n_features)

        def run():
            plan = self._place(lin)
            self.cache.pin(plan.unique_slots)
            self._prefetched.append(plan.unique_slots)

        glob = tbe.has_global_pass(e.optimizer.kind, e.optimizer.update_type)
        if self.config.prefetch_thread and not glob:
            self._worker = threading.Thread(target=self._guard(run), name="numbactr-prefetch", daemon=True)
            self._worker.start()
        else:
            run()

    def _guard(self, fn):
        def wrapped():
            try:
                device.bind_thread()  # the rank's GPU, not GPU 0 (a new thread's device)
                fn()
            except BaseException as exc:  # handed to the caller's thread by _wait()
                self._worker_error = exc

        return wrapped

    def _wait(self) -> None:
        """Join a running prefetch; re-raise its error in the caller's thread."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        if self._worker_error is not None:
            exc, self._worker_error = self._worker_error, None
            raise exc

    # ---- the whole table ---------------------------------------------------------------------------------
    def _renew_max_counter(self) -> None:
        """COUNTER / COWCLIP's max_counter at a renewing step, before its update: 1 + the largest row counter
        of every row of every table (1 without rows), as the untiered engine computes it over its buffer. The
        cache is flushed first, so the backing tier holds every row's current counter."""
        self.flush()
        at = 1 + [name for name, _, _ in self._specs].index("row_counter")
        top = 0.0
        for t in range(len(self.tables)):
            cnt = np.asarray(self.store.views(t)[at])
            if cnt.size:
                top = max(top, float(cnt.max()))
        self.engine.max_counter[...] = top + 1.0 if any(t.rows for t in self.tables) else 1.0

    def flush(self) -> None:
        """Write every updated cached row (weights and states) back to the backing tier."""
        self._wait()
        with self._lock:
            slots, rows, dirty = self.cache.held()
            for t in range(len(self.tables)):
                lo, hi = self.cache.slot_offsets[t], self.cache.slot_offsets[t + 1]
                mine = (slots >= lo) & (slots < hi)
                sel = mine & dirty
                if sel.any():
                    self._write(t, rows[sel] - self.row_offsets[t], self._gather(t, slots[sel] - lo) + [None])
                    self.cache.stats.writebacks += int(sel.sum())
                if mine.any():
                    freq = self.cache.freq[self.cache.xp.asarray(slots[mine])]
                    self._write(
                        t, rows[mine] - self.row_offsets[t], [None] * len(self._cache_views[t]) + [device.to_host(freq)]
                    )
            self.cache.clean()
            self.store.flush()

    def invalidate(self, write_back: bool = True) -> None:
        """Flush (unless write_back=False: the backing tier was overwritten, by a checkpoint load say), then
        empty the cache: the backing tier alone holds the rows."""
        if write_back:
            self.flush()
        else:
            self._wait()
        self.cache.invalidate()
        self._prefetched.clear()

    def split_weights(self) -> list:
        """One (V_t, D_t) array per table: the backing tier's rows after a flush and an emptied cache, so
        that reads see every update and writes reach training."""
        self.invalidate()
        return [views[0] for views in (self.store.views(t) for t in range(len(self.tables)))]

    def split_optimizer_states(self) -> list:
        """Per table, its optimizer state arrays in kernels.tbe.STATES order, from the backing tier."""
        self.invalidate()
        n = len(self._specs)
        return [self.store.views(t)[1 : 1 + n] for t in range(len(self.tables))]

    def init_uniform(self, lo: float, hi: float, seed: int | None = None) -> None:
        """Every weight U(lo, hi) from the hash of (seed, linear row, d): the engine's init_uniform."""
        seed = self.engine.seed if seed is None else int(seed)
        self.invalidate()
        keep = [None] * len(self.store.buffers[1:])
        for t, spec in enumerate(self.tables):
            for a in range(0, spec.rows, 1 << 16):
                b = min(spec.rows, a + (1 << 16))
                lin = np.arange(self.spec_row_offsets[t] + a, self.spec_row_offsets[t] + b, dtype=np.uint64)
                w = embedding_init.row_values_ref(lin, spec.dim, seed, lo, hi).astype(self.engine.weights.dtype)
                self.store.write(t, np.arange(a, b, dtype=np.int64), [w] + keep)

    def close(self) -> None:
        """Release the backing tier (a temporary memmap directory is removed)."""
        self._wait()
        self.store.close()

    # ---- HugeCTR's GLOBAL update on the backing tier ------------------------------------------------------
    def _backing_global_pass(self, t: int) -> None:
        """The all-rows pass of step t over every row of the backing tier (stale copies of cached rows
        included: they are overwritten when those rows are written back)."""
        e = self.engine
        opt = e.optimizer
        sr = e.weights_precision == Precision.FP16 and e.stochastic_rounding
        for tb in range(len(self.tables)):
            views = self.store.views(tb)
            w, states = views[0], views[1 : 1 + len(self._specs)]
            live = self.live_rows(tb)
            for a in range(0, live, 1 << 16):
                b = min(live, a + (1 << 16))
                if e.impl == "ref":
                    new_w, new_s = tbe.global_pass_ref(opt.kind, opt.hp(), w[a:b], [s[a:b] for s in states], t)
                    lin = np.arange(a, b, dtype=np.int64) + self.spec_row_offsets[tb]
                    bits = tbe.rounding_bits_ref(e.seed, t, lin, w.shape[1], tbe.SR_PASS_ALL) if sr else None
                    w[a:b] = (
                        tbe.to_half_ref(new_w.astype(np.float32), bits)
                        if w.dtype == np.float16
                        else new_w.astype(np.float32)
                    )
                    for s, v in zip(states, new_s):
                        s[a:b] = v.astype(np.float32)
                else:
                    self._compiled_global_pass(w[a:b], states, a, b, t, self.spec_row_offsets[tb])

    def _compiled_global_pass(self, w, states, a: int, b: int, t: int, first_row: int) -> None:
        """The cpu engine's compiled all-rows pass on rows a:b of one table's backing arrays (first_row: the
        table's first linear row, which stochastic rounding hashes with)."""
        e = self.engine
        n, dim = b - a, w.shape[1]
        wf = np.ascontiguousarray(w).reshape(-1)
        sa = np.ascontiguousarray(states[0][a:b]).reshape(-1)
        sb = (
            np.ascontiguousarray(states[1][a:b]).reshape(-1)
            if len(states) > 1 and states[1].ndim == 2
            else np.zeros(1, np.float32)
        )
        _, ki = e._ks_ki(None, t)
        ks = tbe.kernel_scalars(e.optimizer.hp(), t)
        wk = wf.view(np.uint16) if wf.dtype == np.float16 else wf
        tbe_cpu.global_pass(
            wk,
            sa,
            sb,
            np.array([0, n * dim], np.int64),
            np.array([dim], np.int64),
            np.array([dim], np.int64),
            np.array([0, n], np.int64),
            np.array([n], np.int64),
            ks,
            ki,
            tbe.rounding_base(e.seed, t, tbe.SR_PASS_ALL),
            np.arange(a, b, dtype=np.int64) + first_row,
            True,
        )
        w[...] = wf.reshape(n, dim)
        states[0][a:b] = sa.reshape(n, dim)
        if len(states) > 1 and states[1].ndim == 2:
            states[1][a:b] = sb.reshape(n, dim)


def _block(e: TableBatchedEmbedding, buf, t: int, per_row: bool):
    """Table t's contiguous block of an engine buffer: (C_t, stride_t), or (C_t, 1) for a per-row state;
    float16 as uint16 (the row kernels copy bits)."""
    if per_row:
        block = buf[e.row_offsets[t] : e.row_offsets[t + 1]].reshape(-1, 1)
    else:
        block = buf[e.elem_offsets[t] : e.elem_offsets[t + 1]].reshape(int(e.rows[t]), int(e.strides[t]))
    return block.view(np.uint16) if block.dtype == np.float16 else block
