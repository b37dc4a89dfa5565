"""HugeCTR's SparseEmbedding hash table that never fills: ``SparseEmbedding(..., max_capacity=C)``.

HugeCTR's hash embeddings hold what ``workspace_size_per_gpu_in_mb`` gives and stop with an error when a
batch needs more rows; they never evict, and numbactr keeps that as the default. With numbactr's
``max_capacity`` the table is HierarchicalKV's evicting table instead (numbactr.embedding.evicting,
``evict_strategy``, ``max_bucket_size``): it doubles up to C keys, then a new key takes the slot of its
bucket's lowest-scored key, so a stream of ids that never ends trains in bounded memory.

How (as numbactr.embedding.collection_evicting does for EmbeddingCollection): the EvictingTable maps each key
to a slot and the engine holds one unkeyed row per slot, so the lookup, pooling and HugeCTR's fused sparse
optimizer are the engine's own. A new key's row starts U(-0.05, 0.05) from a hash of (seed, key), as in the
fixed table (below its capacity the two train bit for bit alike), and every optimizer state from its
initial value: an evicted key's row and state never reach the key that takes its slot. When the index
doubles the engine is rebuilt with it, every row and state following its key. A key refused (its full
bucket's scores all above its own: kLfu, kEpochLfu), or evicted by a later key of the same batch, reads
zeros and gets no update; evaluation finds keys without inserting (a missing key reads zeros).

A lower tier (``evict_to``, HierarchicalKV's hybrid mode keeping values beyond device memory): the rows of
evicted keys are inserted there (tag = the embedding's name) instead of dropped; a key that comes back takes
its row from there (its optimizer state starts again) and leaves the tier, so a key is in one place only.

Incremental dumps (``incremental_dump()``) feed a parameter server (numbactr.inference.hps's
ParameterServer.update): the keys inserted or trained since the last dump with their rows, and the keys
evicted since then. Keys that went to the lower tier are still part of the model: they come with the rows
they left with rather than as evicted.

One rank only (the sharded exchange of numbactr.embedding.sharded is not wired to the index).
"""

from __future__ import annotations

import numpy as np

from numbactr.runtime import device
from numbactr.enums import Embedding_t
from numbactr.embedding.engine import TableSpec
from numbactr.embedding.evicting import EvictingTable
from numbactr.embedding.sparse_embedding import INIT_RANGE, HashEmbedding, key_slots
from numbactr.kernels import embedding_init
from numbactr.kernels.hkv_math import EMPTY_KEY

__all__ = ["EvictingHashEmbedding"]

START_CAPACITY = 1024  # the index's first capacity (at most max_capacity)


class _HeldKeys:
    """What numbactr.files.checkpoint reads of a hash embedding's table: its size (keys held)."""

    def __init__(self, index: EvictingTable):
        self.index = index

    @property
    def size(self) -> int:
        return self.index.size()


class EvictingHashEmbedding(HashEmbedding):
    """A Distributed / Localized hash SparseEmbedding with numbactr's max_capacity (module docstring)."""

    def __init__(self, cfg, sparse_param, opt, seed: int, comm=None):
        if cfg.embedding_type not in (
            Embedding_t.DistributedSlotSparseEmbeddingHash,
            Embedding_t.LocalizedSlotSparseEmbeddingHash,
        ) or not getattr(cfg, "evicting", False):
            raise ValueError(
                f"SparseEmbedding {cfg.sparse_embedding_name!r}: EvictingHashEmbedding is for a hash embedding "
                "with max_capacity (embedding.factory.make_embedding picks the class)"
            )
        self._configure(cfg, sparse_param, opt, seed, comm)
        if self.comm.size > 1:
            raise NotImplementedError(
                f"SparseEmbedding {self.name!r}: max_capacity (an evicting table) runs on one rank; sharded "
                "evicting SparseEmbeddings are not implemented"
            )
        self.by_slot = cfg.embedding_type == Embedding_t.LocalizedSlotSparseEmbeddingHash
        cap = cfg.max_capacity
        bsz = cfg.max_bucket_size or min(128, 1 << (cap.bit_length() - 1))
        try:
            self.index = EvictingTable(1, min(START_CAPACITY, cap), cap, 0.5, bsz, cfg.evict_strategy)
        except ValueError as e:
            raise ValueError(f"SparseEmbedding {self.name!r}: {e}") from None
        self.max_rows = self.index.max_capacity()
        self.tier = cfg.evict_to
        self.index.on_reset(self._reset_slots)
        self.index.on_move(self._move_slots)
        # per slot: the key's slot (Localized, HugeCTR's slot_id; -1 unknown) and whether it changed since
        # the last incremental dump (a new key has)
        self.index.slot_state("slot_id", 1, -1, np.int64)
        self.index.slot_state("dirty", 1, 1, np.int8)
        self._gone: dict = {}  # key -> None (dropped) or its row (in the lower tier), since the last dump
        self._reset_seen = None  # during a training lookup: [(slots, their rows before the reset)]
        self._make_engine(self._spec())
        self.table = _HeldKeys(self.index)
        self.row_slot = None

    def _spec(self) -> TableSpec:
        return TableSpec(self.index.capacity(), self.vec, keyed=False, init_range=INIT_RANGE)

    # ---- the index's hooks -------------------------------------------------------------------------
    def _reset_slots(self, slots) -> None:
        """on_reset: new keys took these slots: their rows start from the key's initial row, every optimizer
        state from its initial value (during a training lookup the old rows are kept for the lower tier)."""
        eng, xp = self.engine, device.xp()
        w = eng.split_weights()[0]
        if self._reset_seen is not None:
            self._reset_seen.append((device.to_host(slots).copy(), np.array(device.to_host(w[slots]))))
        keys = device.to_host(self.index.arrays.keys[slots])
        eng.restart_rows(0, slots, xp.asarray(embedding_init.row_values_ref(keys, self.vec, self.seed, *INIT_RANGE)))

    def _move_slots(self, moved) -> None:
        """on_move: the index doubled; a new engine of its capacity, every row and state following its key.
        The weight Tensor stays the same object (the tape and the step plans know it)."""
        old, weight = self.engine, self.weight
        self._make_engine(self._spec())
        new = self.engine
        used = device.xp().flatnonzero(moved >= 0)
        new.take_rows(0, old, used, moved[used])
        new.step = old.step
        new.set_hyper_parameters(learning_rate=old.learning_rate, scaler=old.optimizer.scaler)
        weight.data, self.weight = self.weight.data, weight

    # ---- a lookup ----------------------------------------------------------------------------------
    def _engine_lookup(self, keys, offsets, training: bool, pooling, slots=None, skip=None):
        xp = device.xp()
        k = xp.asarray(keys).astype(np.uint64)
        if training:
            at = self._insert(k)
            held = self.index.arrays.keys[xp.maximum(at, 0)] == k  # not evicted by a later key of the batch
            at = xp.where(held, at, -1)
            self.index.slot_state("dirty", 1, 1, np.int8)[at[at >= 0]] = 1
            if self.by_slot:
                self._record_slot_ids(at, offsets)
        else:
            at = self.index.find_slots(k)
        miss = at < 0
        return self.engine.forward(xp.where(miss, 0, at), offsets, training=training, pooling=pooling, skip=miss)

    def _insert(self, k):
        """find_or_insert of the batch's keys k (N,) uint64: (N,) slots; the evicted keys go to the lower tier
        (or are recorded as dropped) and keys coming back take their rows from it."""
        xp = device.xp()
        new_before = device.to_host(self.index.find_slots(k)) < 0  # the batch's keys not held before
        self._reset_seen = []
        try:
            _, at, (ev_keys, pos) = self.index.find_or_insert(k, return_slots=True, return_evicted=True)
            seen = self._reset_seen
        finally:
            self._reset_seen = None
        ev_keys, pos = device.to_host(ev_keys), device.to_host(pos)
        # keys that came and left within this call were never part of the model: not reported
        held_before = ~np.isin(ev_keys, device.to_host(k)[new_before])
        ev_keys, ev_slots = ev_keys[held_before], device.to_host(at)[pos[held_before]]
        rows = self._rows_before(seen, ev_slots)
        if self.tier is not None and ev_keys.size:
            self.tier.insert(self.name, ev_keys, rows)
        for i, key in enumerate(ev_keys.tolist()):
            self._gone[key] = rows[i] if self.tier is not None else None
        if seen:
            reset = np.unique(np.concatenate([s for s, _ in seen]))
            reset_keys = device.to_host(self.index.arrays.keys[reset])
            live = reset_keys != np.uint64(EMPTY_KEY)
            reset, reset_keys = reset[live], reset_keys[live]
            for key in reset_keys.tolist():
                self._gone.pop(key, None)
            if self.tier is not None and reset.size:
                values, found = self.tier.fetch(self.name, reset_keys, self.vec)
                if found.any():
                    self.engine.split_weights()[0][xp.asarray(reset[found])] = xp.asarray(values[found])
                    self.tier.erase(self.name, reset_keys[found])
        return at

    @staticmethod
    def _rows_before(seen: list, slots: np.ndarray) -> np.ndarray:
        """(E, D) the rows slots held before this call's resets (the first reset of each slot kept them)."""
        if not slots.size:
            return np.zeros((0, seen[0][1].shape[1] if seen else 0), np.float32)
        all_slots = np.concatenate([s for s, _ in seen])
        all_rows = np.concatenate([r for _, r in seen])
        _, first = np.unique(all_slots, return_index=True)
        order = all_slots[first]
        return all_rows[first][np.searchsorted(order, slots)]

    def _record_slot_ids(self, at, offsets) -> None:
        """A Localized table: the slot of each new key's first occurrence (HugeCTR's slot_id)."""
        xp = device.xp()
        ids = self.index.slot_state("slot_id", 1, -1, np.int64)
        ks = xp.asarray(key_slots(xp.asarray(offsets), int(at.shape[0]), self.slots))
        unset = (at >= 0) & (ids[xp.maximum(at, 0), 0] < 0)
        pos = xp.flatnonzero(unset)[::-1]  # reversed: the first occurrence is written last and wins
        ids[at[pos], 0] = ks[pos]

    # ---- what the model and checkpoints read ---------------------------------------------------------
    def _used(self):
        return device.xp().flatnonzero(self.index.arrays.keys != np.uint64(EMPTY_KEY))

    def size(self) -> int:
        """Keys held."""
        return self.index.size()

    def dump(self):
        """(keys (n,) uint64 in slot order, vectors (n, D)): host copies of the keys held."""
        used = self._used()
        return (
            np.array(device.to_host(self.index.arrays.keys[used])),
            np.array(device.to_host(self.weight.data[used])),
        )

    def dump_slots(self):
        if not self.by_slot:
            return None
        ids = device.to_host(self.index.slot_state("slot_id", 1, -1, np.int64)[self._used(), 0])
        return np.array(ids).astype(np.uint64)  # -1 -> 2**64-1: unknown

    def dump_states(self) -> list:
        used = self._used()
        return [np.array(device.to_host(s[used])) for s in self.states]

    def rows_of(self, keys: np.ndarray) -> np.ndarray:
        return device.to_host(self.index.find_slots(device.xp().asarray(np.asarray(keys, np.uint64)))).astype(np.int64)

    def load(self, keys: np.ndarray, vectors: np.ndarray, slots: np.ndarray | None = None) -> None:
        """Replace the table by keys (n,) uint64 with vectors (n, D) (and Localized slot ids); optimizer
        states follow their keys, keys new to the table start from the initial state. A key its bucket
        cannot take is a ValueError (raise max_capacity)."""
        xp = device.xp()
        k = xp.asarray(np.asarray(keys, np.uint64))
        old = self.index.find_slots(k)
        kept = [view[old[old >= 0]].copy() for view in self.engine.split_optimizer_states()[0]]
        self.index.clear()
        at = self.index.insert_or_assign(k, xp.zeros((k.shape[0], 1), np.float32), return_slots=True)
        if self.index.size() != k.shape[0]:
            raise ValueError(
                f"SparseEmbedding {self.name!r}: {k.shape[0] - self.index.size()} of the {k.shape[0]} keys "
                f"loaded did not fit their buckets of the evicting table (raise max_capacity={self.max_rows})"
            )
        self.weight.data[at] = xp.asarray(np.asarray(vectors, np.float32))
        for view, rows in zip(self.engine.split_optimizer_states()[0], kept):
            view[at[old >= 0]] = rows
        if self.by_slot:
            given = np.full(k.shape[0], -1, np.int64) if slots is None else np.asarray(slots, np.int64)
            self.index.slot_state("slot_id", 1, -1, np.int64)[at, 0] = xp.asarray(given)
        self._gone.clear()

    # ---- incremental dumps ---------------------------------------------------------------------------
    def incremental_dump(self):
        """(keys (m,) uint64, vectors (m, D), evicted (e,) uint64) since the last call: the keys held that
        were inserted or trained and those that went to the lower tier, with their rows; the keys evicted
        and dropped. A parameter server applies them (numbactr.inference.hps.ParameterServer.update)."""
        dirty = self.index.slot_state("dirty", 1, 1, np.int8)
        used = self._used()
        mine = used[dirty[used, 0] != 0]
        keys = np.array(device.to_host(self.index.arrays.keys[mine]))
        rows = np.array(device.to_host(self.weight.data[mine]))
        moved = [(k, r) for k, r in self._gone.items() if r is not None]
        evicted = np.array([k for k, r in self._gone.items() if r is None], np.uint64)
        if moved:
            keys = np.concatenate([keys, np.array([k for k, _ in moved], np.uint64)])
            rows = np.concatenate([rows, np.stack([r for _, r in moved])])
        dirty[...] = 0
        self._gone.clear()
        return keys, rows, evicted
