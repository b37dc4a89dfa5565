"""An EmbeddingCollection dynamic table that never fills: ``EmbeddingTableConfig(name, -1, D, max_capacity=C)``.

HugeCTR's dynamic tables (max_vocabulary_size=-1) grow as long as memory lasts and never evict; numbactr
keeps that as the default (collection_tables._Group.grow). With numbactr's ``max_capacity`` the table is
HierarchicalKV's evicting table instead (numbactr.embedding.evicting.EvictingTable, ``evict_strategy``):
it doubles up to max_capacity keys per rank, then a new key takes the slot of its bucket's lowest-scored
key, so an unbounded stream of ids trains without error in bounded memory.

How: the table is a group of its own (collection_plan.group_plan); the EvictingTable maps each key to a
slot and the group's engine holds one unkeyed row per slot, so the engine's lookup, pooling and fused
optimizer are the same as for every other table. A new key's row starts U(-0.05, 0.05) from a hash of
(table seed, key), as in a growing table (so until the first eviction the two train bit for bit alike), and
its optimizer state from its initial value: an evicted key's row and state never reach the key taking its
slot. When the index doubles the engine is rebuilt with it, every row and state following its key. A key
refused (its full bucket's scores all above its own: kLfu, kEpochLfu), or evicted by a later key of the
same batch, reads zeros and gets no update. Evaluation finds keys without inserting (a missing key reads
zeros, as in a growing table).
"""

from __future__ import annotations

import numpy as np

from numbactr.runtime import device
from numbactr.embedding.collection_tables import DYNAMIC_INIT, _Engine, _Group
from numbactr.embedding.engine import BoundsCheck, Layout, Pooling, TableSpec
from numbactr.embedding.evicting import EvictingTable
from numbactr.kernels import embedding_init
from numbactr.kernels.hkv_math import EMPTY_KEY

__all__ = ["EvictingGroup"]

START_CAPACITY = 1024  # the index's first capacity (at most max_capacity), as a growing table's first rows


class EvictingGroup(_Group):
    """The one evicting table of a group (module docstring)."""

    def __init__(self, tables: list, comm, pooled: bool):
        (t,) = tables
        cfg = t.cfg
        bsz = cfg.max_bucket_size or min(128, 1 << (cfg.max_capacity.bit_length() - 1))
        try:
            self.index = EvictingTable(
                1, min(START_CAPACITY, cfg.max_capacity), cfg.max_capacity, 0.5, bsz, cfg.evict_strategy
            )
        except ValueError as e:
            raise ValueError(f"EmbeddingTableConfig {cfg.name!r}: {e}") from None
        self.index.on_reset(self._reset_slots)
        self.index.on_move(self._move_slots)
        super().__init__(tables, comm, pooled)

    def _new_engine(self, rows: list):
        t = self.tables[0]
        eng = _Engine(
            [TableSpec(self.index.capacity(), t.dim, keyed=False, init_range=DYNAMIC_INIT)],
            self.feature_table,
            pooling=Pooling.SUM if self.pooled else Pooling.NONE,
            layout=Layout.SAMPLE_MAJOR,
            optimizer=self.opt_spec,
            bounds_check=BoundsCheck.FATAL,
            seed=self.seed,
        )
        return eng

    # ---- the index's hooks ---------------------------------------------------------------------------
    def _reset_slots(self, slots) -> None:
        eng, xp = self.engine, device.xp()
        keys = device.to_host(self.index.arrays.keys[slots])
        rows = embedding_init.row_values_ref(keys, self.tables[0].dim, self.tables[0].seed, *DYNAMIC_INIT)
        eng.restart_rows(0, slots, xp.asarray(rows))

    def _move_slots(self, moved) -> None:
        old = self.engine
        new = self._new_engine([])
        used = device.xp().flatnonzero(moved >= 0)
        new.take_rows(0, old, used, moved[used])
        new.step = old.step
        new.set_hyper_parameters(learning_rate=old.learning_rate, scaler=old.optimizer.scaler)
        self.engine = new

    # ---- lookups and files ---------------------------------------------------------------------------
    def _engine_lookup(self, keys, offsets, training: bool):
        xp = device.xp()
        k = xp.asarray(keys).astype(np.uint64)
        if training:
            slots = self.index.find_or_insert(k, return_slots=True)[1]
            held = self.index.arrays.keys[xp.maximum(slots, 0)] == k  # not evicted by a later key of the batch
            slots = xp.where(held, slots, -1)
        else:
            slots = self.index.find_slots(k)
        skip = slots < 0
        return self.engine.forward(xp.where(skip, 0, slots), offsets, training=training, skip=skip)

    def grow(self, j: int, need: int) -> None:
        raise AssertionError("an evicting table never grows by rebuilding (its index doubles)")

    def size(self) -> int:
        """Keys held on this rank."""
        return self.index.size()

    def held_rows(self):
        """(keys (n,) int64, vectors (n, D)) host copies of the keys held, in slot order."""
        used = device.xp().flatnonzero(self.index.arrays.keys != np.uint64(EMPTY_KEY))
        keys = device.to_host(self.index.arrays.keys[used]).view(np.int64)
        return np.array(keys), np.array(device.to_host(self.engine.split_weights()[0][used]))

    def put_rows(self, keys, vectors) -> None:
        """Write (keys (n,) int64, vectors (n, D)), inserting the keys not held (embedding_load)."""
        xp = device.xp()
        k = xp.asarray(np.asarray(keys).view(np.uint64))
        slots = self.index.insert_or_assign(k, xp.zeros((k.shape[0], 1), np.float32), return_slots=True)
        ok = slots >= 0
        self.engine.split_weights()[0][slots[ok]] = xp.asarray(np.asarray(vectors, np.float32))[ok]
