"""The embedding cache's bookkeeping: which of C fast-tier slots holds which row, LRU / LFU victims, pins.

EmbeddingCache knows rows and slots only (no row data, no engine): numbactr.embedding.tiered moves the
rows between the engine's cache buffers and a backing tier, and the inference parameter server can put
the same cache in front of another store. The math and the kernels are numbactr.kernels.cache.

    cache = EmbeddingCache(capacities=[C_0, ...], table_rows=[V_0, ...], policy="lru")
    plan = cache.place(rows)          # rows (N,) linear rows (-1: none) of the next batch
        # plan.victims (M,) slots now holding plan.misses (M,); plan.evicted (M,) the rows they held
        # (-1: empty) with plan.evicted_dirty and plan.evicted_freq: the caller writes those rows back,
        # loads the misses, then calls cache.finish(plan, loaded_freq)
    cache.pin(plan.unique_slots); ...; cache.unpin(plan.unique_slots, dirty=True)   # a training step

On the cpu device the state is NumPy arrays updated with the reference's vectorized steps; on gpu and
sim the kernels update device arrays, and a placement reads back only the per-table miss counts and the
misses / victims / evicted rows the data movement needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from numbactr.runtime import device
from numbactr.kernels import cache
from numbactr.kernels.cache import CacheCapacityError

__all__ = ["EmbeddingCache", "CacheStats", "Placement", "CacheCapacityError", "POLICIES"]

POLICIES = cache.POLICIES


@dataclass
class CacheStats:
    """Counters since the cache was made (or reset()). Occurrence counts (lookups, hits) count every index
    of every placed batch; unique counts, FBGEMM's uvm_cache_stats, count distinct rows per batch."""

    batches: int = 0  # placements (FBGEMM's N_calls)
    lookups: int = 0  # row occurrences placed (N_requested_indices)
    hits: int = 0  # occurrences whose row was already cached
    unique_rows: int = 0  # distinct rows per batch, summed (N_unique_indices)
    unique_misses: int = 0  # distinct rows loaded from the backing tier (N_unique_misses)
    batches_with_misses: int = 0  # FBGEMM's cache_miss_counter[0]
    evictions: int = 0  # rows pushed out of their slot
    writebacks: int = 0  # evicted (or flushed) rows written back because they were updated
    table_misses: list = field(default_factory=list)  # (T,) unique misses per table

    @property
    def misses(self) -> int:
        """Occurrences whose row had to be loaded."""
        return self.lookups - self.hits

    @property
    def hit_rate(self) -> float:
        """hits / lookups (occurrences), 0 before any lookup."""
        return self.hits / self.lookups if self.lookups else 0.0

    def reset(self) -> None:
        n = len(self.table_misses)
        for f in self.__dataclass_fields__:
            setattr(self, f, [0] * n if f == "table_misses" else 0)


@dataclass
class Placement:
    """One batch's placement. Device arrays: slots (N,) linear slot of each occurrence (-1 for rows -1),
    unique_rows (U,), unique_slots (U,), counts (U,) occurrences. Host arrays (M,): misses, victims, evicted,
    evicted_dirty,
    evicted_freq; miss_start (T + 1,) the misses of table t are misses[miss_start[t]:miss_start[t+1]]."""

    slots: object
    unique_rows: object
    unique_slots: object
    counts: object
    misses: np.ndarray
    victims: np.ndarray
    evicted: np.ndarray
    evicted_dirty: np.ndarray
    evicted_freq: np.ndarray
    miss_start: np.ndarray


class EmbeddingCache:
    """Slots of T tables: table t owns capacities[t] slots and holds rows of its own table_rows[t] rows.

    Args:
        capacities: (T,) slots per table, each >= 1.
        table_rows: (T,) rows per table (a keyed table's row count grows: grow_rows).
        policy: "lru" or "lfu" (see numbactr.kernels.cache).
        use_kernels: launch the numba.cuda kernels (gpu, sim); default: numbactr.runtime.device.uses_kernels().
    """

    def __init__(self, capacities, table_rows, policy: str = "lru", *, use_kernels: bool | None = None):
        caps = np.asarray(capacities, np.int64).reshape(-1)
        rows = np.asarray(table_rows, np.int64).reshape(-1)
        if caps.shape != rows.shape or caps.size == 0:
            raise ValueError(f"capacities {list(caps)} and table_rows {list(rows)} need one entry per table")
        if (caps < 1).any():
            raise ValueError(f"every table needs at least one cache slot, got capacities {list(caps)}")
        if str(policy).lower() not in POLICIES:
            raise ValueError(f"cache policy must be one of {sorted(POLICIES)}, got {policy!r}")
        self.policy_name = str(policy).lower()
        self.policy = POLICIES[self.policy_name]
        self.use_kernels = device.uses_kernels() if use_kernels is None else bool(use_kernels)
        self.xp = device.xp() if self.use_kernels else np
        self.capacities = caps
        self.slot_offsets = np.concatenate([[0], np.cumsum(caps)]).astype(np.int64)
        self.table_rows = rows.copy()
        self.row_offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        xp, n = self.xp, int(self.slot_offsets[-1])
        self.slot_row = xp.full(n, -1, np.int64)  # (C,)
        self.row_slot = xp.full(int(self.row_offsets[-1]), -1, np.int64)  # (R,)
        self.stamp = xp.zeros(n, np.int64)
        self.freq = xp.zeros(n, np.int64)
        self.pins = xp.zeros(n, np.int32)
        self.dirty = xp.zeros(n, np.int8)
        self.slot_table = np.repeat(np.arange(caps.size), caps)  # (C,) host: table of each slot
        self.clock = 0
        self.stats = CacheStats(table_misses=[0] * caps.size)
        if self.use_kernels:
            self._dev_row_off = xp.asarray(self.row_offsets)
            self._dev_slot_off = xp.asarray(self.slot_offsets)

    @property
    def n_slots(self) -> int:
        return int(self.slot_offsets[-1])

    # ---- placing a batch --------------------------------------------------------------------------
    def place(self, rows, count: bool = True) -> Placement:
        """Map the batch's linear rows (N,) int64 (-1: no row) to slots: hits keep theirs, misses take the
        policy's victims among the slots neither pinned nor used by this batch; the maps point at the new
        rows when this returns. The caller then writes evicted dirty rows back, loads the misses' rows into
        their victims and calls finish(). CacheCapacityError (nothing changed) when a table's misses
        outnumber its free slots. count=False leaves the stats alone (a forward placing the batch its
        prefetch already counted)."""
        rows = self.xp.asarray(rows).astype(np.int64, copy=False)
        plan = self._place_kernels(rows) if self.use_kernels else self._place_host(rows)
        self.clock += 1
        if count:
            self._count(rows, plan)
        return plan

    def _count(self, rows, plan: Placement) -> None:
        st = self.stats
        n_occ = int(rows.shape[0]) - int((rows < 0).sum())
        miss_occ = int(self._miss_occurrences(plan))
        st.batches += 1
        st.lookups += n_occ
        st.hits += n_occ - miss_occ
        st.unique_rows += int(plan.unique_rows.shape[0])
        st.unique_misses += int(plan.misses.shape[0])
        st.batches_with_misses += int(plan.misses.shape[0] > 0)
        st.evictions += int((plan.evicted >= 0).sum())
        for t in range(len(st.table_misses)):
            st.table_misses[t] += int(plan.miss_start[t + 1] - plan.miss_start[t])

    def finish(self, plan: Placement, loaded_freq=None) -> None:
        """After the rows moved: the misses' LFU counts (loaded_freq (M,), their backing tier's; zeros when
        None), then every row of the batch is stamped with the clock and counted."""
        xp = self.xp
        if plan.misses.shape[0]:
            lf = np.zeros(plan.misses.shape[0], np.int64) if loaded_freq is None else np.asarray(loaded_freq)
            self.freq[xp.asarray(plan.victims)] = xp.asarray(lf.astype(np.int64))
        if self.use_kernels:
            cache.touch(plan.unique_rows, plan.counts, self.row_slot, self.stamp, self.freq, self.clock)
        else:
            s = plan.unique_slots
            self.stamp[s] = self.clock
            self.freq[s] += plan.counts

    def touch_cached(self, rows) -> None:
        """Host arrays: rows (U,) distinct and all cached are used once more; the same state as
        finish(place(rows, count=False)) without ranking or sorting anything."""
        if self.use_kernels:
            self.finish(self.place(rows, count=False))
            return
        slots = self.row_slot[np.asarray(rows, np.int64)]
        if (slots < 0).any():
            raise ValueError("touch_cached: a row is not cached")
        self.clock += 1
        self.stamp[slots] = self.clock
        self.freq[slots] += 1

    def _place_host(self, rows) -> Placement:
        u, n = cache.unique_rows_ref(rows)
        hit = self.row_slot[u]
        misses = u[hit < 0]
        if misses.shape[0]:
            victims = self._empty_victims(misses)
            if victims is None:
                prio = cache.priorities_ref(self.slot_row, self.stamp, self.freq, self.pins, hit, self.policy)
                victims = cache.victims_ref(prio, self.slot_offsets, misses, self.row_offsets)
        else:  # every row cached: no priorities to rank (an O(C) pass saved)
            victims = np.zeros(0, np.int64)
        return self._install_host(rows, u, n, misses, victims)

    def _empty_victims(self, misses):
        """victims_ref's answer when every table with misses has enough empty, unpinned slots (a cache
        still filling up): empty slots have the lowest priority and ties go to the lower slot, so the
        victims are each table's first empty slots in slot order; None otherwise. Saves ranking all C
        priorities (a partition of the whole cache) for every batch with misses."""
        starts = np.searchsorted(misses, self.row_offsets)
        victims = np.empty(misses.shape[0], np.int64)
        for t in range(self.capacities.size):
            m0, m1 = int(starts[t]), int(starts[t + 1])
            if m1 == m0:
                continue
            lo, hi = int(self.slot_offsets[t]), int(self.slot_offsets[t + 1])
            empty = np.flatnonzero(self.slot_row[lo:hi] < 0)[: m1 - m0]
            if empty.shape[0] < m1 - m0 or self.pins[lo + empty].any():
                return None
            victims[m0:m1] = lo + empty
        return victims

    def _install_host(self, rows, u, n, misses, victims) -> Placement:
        evicted = self.slot_row[victims]
        evicted_dirty = self.dirty[victims]
        evicted_freq = self.freq[victims]
        self.row_slot[evicted[evicted >= 0]] = -1
        self.slot_row[victims] = misses
        self.row_slot[misses] = victims
        self.dirty[victims] = 0
        slots = np.where(rows >= 0, self.row_slot[np.maximum(rows, 0)], -1)
        return Placement(
            slots,
            u,
            self.row_slot[u],
            n,
            misses,
            victims,
            evicted,
            evicted_dirty,
            evicted_freq,
            np.searchsorted(misses, self.row_offsets),
        )

    def _place_kernels(self, rows) -> Placement:
        xp = self.xp
        valid = rows[rows >= 0]
        u, n = xp.unique(valid, return_counts=True)  # (U,) ascending, cupy / numpy
        u, n = u.astype(np.int64), n.astype(np.int64)
        hit = xp.empty(u.shape[0], np.int64)
        cache.lookup(u, self.row_slot, hit)
        prio = xp.empty(self.n_slots, np.int64)
        cache.priorities(self.slot_row, self.stamp, self.freq, self.pins, hit, self.policy, prio)
        misses = u[hit < 0]
        miss_start = xp.searchsorted(misses, self._dev_row_off)
        # one host read: misses per table and evictable slots per table
        free = xp.concatenate([xp.zeros(1, np.int64), xp.cumsum((prio != cache.BLOCKED).astype(np.int64))])
        counts = device.to_host(xp.concatenate([miss_start, free[self._dev_slot_off]]))
        t1 = self.capacities.size + 1
        miss_start_h, free_h = counts[:t1], np.diff(counts[t1:])
        for t in range(self.capacities.size):
            want = int(miss_start_h[t + 1] - miss_start_h[t])
            if want > free_h[t]:
                raise CacheCapacityError(cache.capacity_message(t, want, int(free_h[t]), int(self.capacities[t])))
        order = xp.empty(self.n_slots, np.int64)
        for t in range(self.capacities.size):  # each table's slots by priority
            if miss_start_h[t + 1] > miss_start_h[t]:
                lo, hi = int(self.slot_offsets[t]), int(self.slot_offsets[t + 1])
                order[lo:hi] = lo + xp.argsort(prio[lo:hi], kind="stable")
        victims = xp.empty(misses.shape[0], np.int64)
        cache.victims(misses, self._dev_row_off, miss_start, self._dev_slot_off, order, victims)
        evicted_freq = self.freq[victims]
        evicted = xp.empty(misses.shape[0], np.int64)
        evicted_dirty = xp.empty(misses.shape[0], np.int8)
        cache.install(misses, victims, self.slot_row, self.row_slot, self.dirty, evicted, evicted_dirty)
        slots = xp.empty(rows.shape[0], np.int64)
        cache.occurrence_slots(rows, self.row_slot, slots)
        uslots = xp.empty(u.shape[0], np.int64)
        cache.lookup(u, self.row_slot, uslots)
        h = device.to_host
        return Placement(
            slots, u, uslots, n, h(misses), h(victims), h(evicted), h(evicted_dirty), h(evicted_freq), miss_start_h
        )

    def _miss_occurrences(self, plan: Placement) -> int:
        """Occurrences of the batch's missing rows (their counts)."""
        if plan.misses.shape[0] == 0:
            return 0
        xp = self.xp
        is_miss = xp.zeros(plan.unique_rows.shape[0], np.bool_)
        is_miss[xp.searchsorted(plan.unique_rows, xp.asarray(plan.misses))] = True
        return int(plan.counts[is_miss].sum())

    # ---- pins and dirt ----------------------------------------------------------------------------
    def pin(self, unique_slots) -> None:
        """A training lookup holds these distinct slots until its backward: no placement evicts them."""
        self._pin(unique_slots, 1, False)

    def unpin(self, unique_slots, dirty: bool) -> None:
        """Release a lookup's slots; dirty: its backward updated their rows (written back on eviction)."""
        self._pin(unique_slots, -1, dirty)

    def _pin(self, slots, delta: int, dirty: bool) -> None:
        if self.use_kernels:
            cache.pin(slots, self.pins, delta, self.dirty, dirty)
        else:
            self.pins[slots] += delta
            if dirty:
                self.dirty[slots] = 1

    def mark_all_dirty(self) -> None:
        """Every held row counts as updated (HugeCTR's Global update moves every row each step)."""
        self.dirty[self.slot_row >= 0] = 1

    # ---- whole-cache operations --------------------------------------------------------------------
    def held(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slots, rows, dirty) host arrays of every slot holding a row."""
        slot_row = device.to_host(self.slot_row) if self.use_kernels else self.slot_row
        slots = np.flatnonzero(slot_row >= 0)
        dirty = device.to_host(self.dirty) if self.use_kernels else self.dirty
        return slots, slot_row[slots], dirty[slots].astype(bool)

    def clean(self) -> None:
        """Every held row is now equal to its backing copy (after a flush)."""
        self.dirty[...] = 0

    def invalidate(self) -> None:
        """Forget every row (the caller wrote the dirty ones back first); pins must be released."""
        if int(self.pins.sum()):
            raise RuntimeError(
                "the embedding cache cannot be emptied while a training lookup waits for its "
                "backward (its rows are pinned)"
            )
        self.row_slot[...] = -1
        self.slot_row[...] = -1
        self.stamp[...] = 0
        self.freq[...] = 0
        self.dirty[...] = 0

    def forget(self, rows) -> None:
        """These rows (n,) int64 leave the cache without a write-back (their keys were erased upstream, e.g.
        evicted by a training table): their slots become empty. Rows not cached are ignored."""
        rows = self.xp.asarray(rows).astype(np.int64, copy=False)
        slots = self.row_slot[rows]
        slots = slots[slots >= 0]
        self.row_slot[rows] = -1
        self.slot_row[slots] = -1
        self.stamp[slots] = 0
        self.freq[slots] = 0
        self.dirty[slots] = 0

    def grow_rows(self, t: int, rows: int) -> None:
        """Table t now has `rows` rows (a keyed table's new keys): the row -> slot map grows."""
        rows = int(rows)
        if rows <= self.table_rows[t]:
            return
        xp = self.xp
        add = rows - int(self.table_rows[t])
        at = int(self.row_offsets[t + 1])
        self.row_slot = xp.concatenate([self.row_slot[:at], xp.full(add, -1, np.int64), self.row_slot[at:]])
        shifted = self.slot_row >= at  # rows of later tables move up
        self.slot_row[shifted] += add
        self.table_rows[t] = rows
        self.row_offsets = np.concatenate([[0], np.cumsum(self.table_rows)]).astype(np.int64)
        if self.use_kernels:
            self._dev_row_off = xp.asarray(self.row_offsets)
