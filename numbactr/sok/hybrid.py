"""SOK's ``DynamicVariable(var_type="hybrid")`` on this rank: a table that never fills (HierarchicalKV's).

SOK's default backend is HierarchicalKV: keys hash to buckets, the table doubles up to ``max_capacity`` and
then a new key takes the slot of its bucket's lowest-scored key (``evict_strategy``: kLru by default). Here
that index is numbactr.embedding.evicting.EvictingTable, and the rows live in the embedding engine as an
unkeyed table of one row per slot of the index, so lookups, pooling and the fused optimizers are the
engine's own (numbactr.sok.table.SokTable, whose rules this class keeps: ownership key % R, held
gradients, checkpoints, SOK's files).

What happens to a slot (the EvictingTable's hooks):
  a new key lands      (on_reset) its row gets the key's initial row and every optimizer state its initial
                       value: an evicted key's row and Adam / Adagrad state never reach the key that takes
                       its slot; its time (incremental_model_dump) restarts.
  the index doubles    (on_move) the engine is rebuilt with twice the rows and every row, state and time
                       follows its key (memory follows the keys held, as HierarchicalKV's does).
A gradient held by backward is applied to the key's slot at the optimizer step: when another lookup of
the same step moved or evicted slots meanwhile, the step finds each key again (a key evicted meanwhile
gets no update).

Refused keys read zeros. A new key is refused when its bucket is full and its score is below the bucket's
minimum (kLfu, kEpochLfu, kCustomized; never under kLru / kEpochLru), when a later key of the same lookup evicted it
(a lookup bringing more new keys to a bucket than it has slots), or when the low-frequency filter does
not admit it (``lookup_sparse(..., use_low_frequency_filter=True)``: a key not in the table is admitted with
probability ``filter_ratio``, the draw a hash of (table seed, lookup number, key): the same on every device
and rank count). A refused key adds zero to its bag (a 'mean' bag still counts it, as an evaluation miss
of the other tables does) and gets no update. HierarchicalKV's find_or_insert hands a refused key its
initial row instead; numbactr's choice keeps one rule for both kinds of refusal.

Initial rows (the same on every device and rank count: a hash of (seed, key, d), as numbactr's keyed
tables): ``"random"`` / ``"normal"`` / None N(0, 1) (SOK's hybrid default; Box-Muller over two hashed
uniforms), ``"uniform"`` U(-1, 1), ``"zeros"``, ``"ones"``, a number or numeric string, or (lo, hi).
"""

from __future__ import annotations

import time

import numpy as np

from numbactr.runtime import device
from numbactr.embedding.engine import (
    BoundsCheck,
    Layout,
    Pooling,
    TableBatchedEmbedding,
)
from numbactr.embedding.evicting import EvictingTable
from numbactr.kernels import embedding_init
from numbactr.kernels.hkv_math import EMPTY_KEY
from numbactr.sok.table import SokTable, init_range

#: SOK's hybrid kwargs and numbactr's defaults for them
HYBRID_DEFAULTS = {
    "init_capacity": None,  # default: min(max_capacity, 2**14)
    "max_capacity": 1 << 20,
    "max_load_factor": 0.5,
    "max_bucket_size": None,  # default: 128, or less for a max_capacity below 128
    "evict_strategy": "kLru",
    "filter_ratio": 1.0,
}


def hybrid_initializer(initializer, who: str) -> tuple:
    """("normal",) or ("range", lo, hi) of a hybrid table's initializer (module docstring)."""
    if initializer is None or initializer in ("", "random", "normal"):
        return ("normal",)
    if initializer == "uniform":
        return ("range", -1.0, 1.0)
    return ("range", *init_range(initializer, who))


def initial_rows(keys, dim: int, seed: int, init: tuple) -> np.ndarray:
    """(n, dim) float32 initial rows of keys (n,) uint64 on the host."""
    keys = np.asarray(keys, np.uint64)
    if init[0] == "range":
        return embedding_init.row_values_ref(keys, dim, seed, init[1], init[2])
    u = embedding_init.row_values_ref(keys, 2 * dim, seed, 0.0, 1.0).astype(np.float64)
    r = np.sqrt(-2.0 * np.log(1.0 - u[:, :dim]))  # 1 - u in (0, 1]
    return (r * np.cos(2.0 * np.pi * u[:, dim:])).astype(np.float32)


class HybridTable(SokTable):
    """One hybrid DynamicVariable's table on this rank (module docstring). Args: SokTable's who, dim, target,
    trainable, comm; SOK's hybrid kwargs (HYBRID_DEFAULTS); initializer (hybrid_initializer's)."""

    def __init__(
        self,
        who: str,
        dim: int,
        *,
        init_capacity=None,
        max_capacity=HYBRID_DEFAULTS["max_capacity"],
        max_load_factor=0.5,
        max_bucket_size=None,
        evict_strategy="kLru",
        filter_ratio=1.0,
        initializer=None,
        target: int = -1,
        trainable: bool = True,
        comm=None,
    ):
        max_capacity = int(max_capacity)
        if max_capacity < 1:
            raise ValueError(f"{who}: max_capacity must be >= 1, got {max_capacity}")
        if max_bucket_size is None:
            max_bucket_size = min(128, 1 << (max_capacity.bit_length() - 1))
        if init_capacity is None:
            init_capacity = min(max_capacity, 1 << 14)
        self.filter_ratio = float(filter_ratio)
        if not 0.0 <= self.filter_ratio <= 1.0:
            raise ValueError(f"{who}: filter_ratio must be in [0, 1], got {filter_ratio}")
        try:
            self.index = EvictingTable(1, init_capacity, max_capacity, max_load_factor, max_bucket_size, evict_strategy)
        except ValueError as e:
            raise ValueError(f"{who}: {e}") from None
        self.init = hybrid_initializer(initializer, who)
        self.index.on_reset(self._reset_slots)
        self.index.on_move(self._move_slots)
        self.index.slot_state("time", 1, 0, np.int64)  # each slot's last insertion / update time, ns
        self._gen = 0  # + 1 whenever slots are reset or moved: held gradients then find their keys again
        self.filter_now = False  # set by lookup_sparse(use_low_frequency_filter=True) for one lookup
        self._capture = None  # sparse_read_and_evict: {slot: the row it held} before a reset
        super().__init__(
            who,
            dim,
            keyed=True,
            capacity=self.index.max_capacity(),
            option="max_capacity (keys per rank)",
            pooling=Pooling.MEAN,
            target=target,
            trainable=trainable,
            comm=comm,
        )

    # ---- the engine: one row per slot of the index -------------------------------------------------
    def _new_engine(self, spec) -> TableBatchedEmbedding:
        return TableBatchedEmbedding(
            [(self.index.capacity(), self.dim)],
            [0] * self.features,
            pooling=self.pooling,
            layout=Layout.SAMPLE_MAJOR,
            optimizer=spec,
            bounds_check=BoundsCheck.FATAL,
            seed=self.seed,
        )

    def _carry_rows(self, old, new) -> None:
        new.split_weights()[0][...] = old.split_weights()[0]

    def _reset_slots(self, slots) -> None:
        """on_reset: new keys took these slots (their rows and optimizer states start again)."""
        eng, xp = self.engine, device.xp()
        w = eng.split_weights()[0]
        if self._capture is not None:
            for s, row in zip(device.to_host(slots).tolist(), device.to_host(w[slots])):
                self._capture.setdefault(s, row.copy())
        keys = device.to_host(self.index.arrays.keys[slots])
        eng.restart_rows(0, slots, xp.asarray(initial_rows(keys, self.dim, self.seed, self.init)))
        self._gen += 1

    def _move_slots(self, moved) -> None:
        """on_move: the index doubled; the engine grows with it, every row and state following its key."""
        old = self.engine
        new = self._new_engine(old.optimizer)
        new.step = old.step
        used = device.xp().flatnonzero(moved >= 0)
        new.take_rows(0, old, used, moved[used])
        self.engine = new
        self._gen += 1

    # ---- rows ----------------------------------------------------------------------------------------
    def _used(self):
        return device.xp().flatnonzero(self.index.arrays.keys != np.uint64(EMPTY_KEY))

    def weights(self):
        """(n, D) the rows of the keys this rank holds, in slot order: a copy (the slots are not contiguous)."""
        return self.engine.split_weights()[0][self._used()]

    def keys(self):
        return device.to_host(self.index.arrays.keys[self._used()]).view(np.int64)

    def size(self) -> int:
        return self.index.size()

    def stamp(self, rows) -> None:
        xp = device.xp()
        rows = xp.asarray(rows).astype(np.int64, copy=False).reshape(-1)
        rows = rows[rows >= 0]
        if rows.shape[0]:
            self.index.slot_state("time", 1, 0, np.int64)[rows] = time.time_ns()

    @property
    def keeps_times(self) -> bool:
        return True

    def updated_since(self, ns: int):
        used = self._used()
        mine = device.to_host(self.index.slot_state("time", 1, 0, np.int64)[used, 0]) >= ns
        keys, values = self.state()
        return keys[mine], values[mine]

    def put_rows(self, keys, values) -> None:
        xp = device.xp()
        slots = self.index.insert_or_assign(
            xp.asarray(keys), xp.zeros((keys.shape[0], 1), np.float32), return_slots=True
        )
        refused = np.flatnonzero(device.to_host(slots) < 0)
        if refused.size:
            raise ValueError(f"{self.who}{self._where()}: key {keys[refused[0]]} was refused (its bucket is full)")
        self.engine.split_weights()[0][slots] = xp.asarray(values)
        self.stamp(slots)

    # ---- checkpoints ---------------------------------------------------------------------------------
    def _state_rows(self, keys: np.ndarray, what: str, insert: bool) -> np.ndarray:
        self.check_state(keys, what)
        who = f"{self.who}{self._where()}: {what}"
        xp = device.xp()
        k = xp.asarray(keys.astype(np.uint64))
        old = self.index.find_slots(k)
        if not insert:
            missing = np.flatnonzero(device.to_host(old) < 0)
            if missing.size:
                raise ValueError(
                    f"{who}: key {keys[missing[0]]} is not in the table (load the model's state_dict "
                    "before the optimizer's)"
                )
            return device.to_host(old)
        eng = self.engine
        kept = [view[old[old >= 0]].copy() for view in eng.split_optimizer_states()[0]]
        self.index.clear()
        slots = self.index.insert_or_assign(k, xp.zeros((keys.size, 1), np.float32), return_slots=True)
        if self.index.size() != keys.size:
            raise ValueError(
                f"{who}: {keys.size - self.index.size()} of its {keys.size} keys did not fit their buckets "
                "(raise max_capacity)"
            )
        hit = old >= 0
        for view, rows in zip(self.engine.split_optimizer_states()[0], kept):
            view[slots[hit]] = rows
        self.stamp(slots)
        return device.to_host(slots)

    def optimizer_state(self) -> dict:
        st = super().optimizer_state()
        used = self._used()
        st["states"] = {
            name: np.array(device.to_host(v[used]))
            for (name, _, _), v in zip(self.engine._state_specs(), self.engine.split_optimizer_states()[0])
        }
        return st

    # ---- lookup and update ---------------------------------------------------------------------------
    def _slots(self, keys, training: bool):
        """(N,) int64 the slot of each key, -1 where refused (training: find-or-insert, under the filter
        when filter_now), or absent (not training: find)."""
        xp = device.xp()
        if not training:
            return self.index.find_slots(keys)
        if not self.filter_now or self.filter_ratio >= 1.0:
            return self.index.find_or_insert(keys, return_slots=True)[1]
        k = xp.asarray(keys).astype(np.uint64)
        held = device.to_host(self.index.find_slots(k)) >= 0
        draw = embedding_init.row_values_ref(device.to_host(k), 1, self.seed * 1_000_003 + self._lookups, 0.0, 1.0)
        admit = np.flatnonzero(held | (draw[:, 0] < self.filter_ratio))
        slots = xp.full(k.shape[0], -1, np.int64)
        if admit.size:
            at = xp.asarray(admit)
            slots[at] = self.index.find_or_insert(k[at], return_slots=True)[1]
        return slots

    def _forward(self, keys, offsets, training, pooling, per_sample_weights):
        xp = device.xp()
        slots = self._slots(keys, training)
        # a key that a later key of this lookup evicted (a bucket offered fewer slots than new keys) is refused
        held = self.index.arrays.keys[xp.maximum(slots, 0)] == xp.asarray(keys).astype(np.uint64)
        slots = xp.where(held, slots, -1)
        skip = slots < 0
        out, ctx = self.engine.forward(
            xp.where(skip, 0, slots), offsets, per_sample_weights, training=training, pooling=pooling, skip=skip
        )
        ctx.extra["keys"], ctx.extra["gen"] = xp.asarray(keys), self._gen
        if training:
            self.stamp(slots)
        return out, ctx

    def _current(self, ctx):
        """ctx with each held key's slot now (another lookup moved or evicted slots since)."""
        if ctx.extra.get("gen") == self._gen:
            return ctx
        now = self.index.find_slots(ctx.extra["keys"])
        ctx.rows = device.xp().where(ctx.rows >= 0, now, -1)
        ctx.extra["gen"] = self._gen
        return ctx

    def apply(self) -> None:
        self._pending = [(n, self._current(ctx), dy) for n, ctx, dy in self._pending]
        super().apply()

    def read_and_evict(self, keys):
        """sok.sparse_read_and_evict on the owner: (rows (N, D) of keys (N,) as a lookup reads them, inserting
        new keys; evicted_keys (E,) int64, evicted_values (E, D) float32 on the host: the keys this insertion
        pushed out, with their rows as they were)."""
        xp = device.xp()
        k = xp.asarray(keys).astype(np.uint64)
        self._capture = {}
        try:
            _, slots, (ev_keys, at) = self.index.find_or_insert(k, return_slots=True, return_evicted=True)
            captured = self._capture
        finally:
            self._capture = None
        self.stamp(slots)
        rows = xp.where((slots >= 0)[:, None], self.engine.split_weights()[0][xp.maximum(slots, 0)], 0)
        ev_keys, ev_slots = device.to_host(ev_keys), device.to_host(slots[at])
        values = np.empty((ev_keys.shape[0], self.dim), np.float32)
        first = {}
        for i, s in enumerate(ev_slots.tolist()):  # a slot's first eviction gives back its held row; a key
            if s not in first:  # that came and left within this call gives back its initial row
                first[s] = i
                values[i] = captured[s]
            else:
                values[i] = initial_rows(ev_keys[i : i + 1], self.dim, self.seed, self.init)[0]
        return rows, ev_keys.view(np.int64), values
