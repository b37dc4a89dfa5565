"""Embedding cache: C slots of a fast tier holding the rows in use of a larger backing tier (LRU / LFU).

Shapes: T tables, R rows in all (linear row r = row_offsets[t] + local row), C slots in all (linear slot
s = slot_offsets[t] + local slot; a slot of table t only ever holds rows of table t), U distinct rows of
a batch, M of them missing from the cache.

Cache state (device arrays, kept by numbactr.embedding.cache.EmbeddingCache):
    slot_row (C,) int64   linear row held by the slot, -1 when empty
    row_slot (R,) int64   linear slot holding the row, -1 when the row is not cached
    stamp    (C,) int64   batch clock of the slot's last use (LRU)
    freq     (C,) int64   the held row's access count since the table began (LFU; it travels with the row
                          to the backing tier and back, FBGEMM's lfu_state)
    pin      (C,) int32   training lookups whose backward has not run yet (their slots must stay put)
    dirty    (C,) int8    1 once the held row was updated; it is written back when evicted

Placing a batch (prefetch), batch clock c, unique rows u (U,) ascending with occurrence counts n (U,):
    slot_of(u)   = row_slot[u]                           hit when >= 0
    priority p_s = BLOCKED (int64 max)  when pin_s > 0 or slot s holds a row of this batch
                   -1                   when the slot is empty
                   stamp_s              LRU: the least recently used goes first
                   freq_s * 2^32 + stamp_s  LFU: the least frequently used, ties by LRU
    victims      per table t, its slots sorted by (p, slot) (stable): the M_t misses of table t, in
                 ascending row order, take the first M_t of them; M_t > #(p != BLOCKED of table t)
                 is an error (the batch needs more distinct rows than the table's free slots hold)
    evict/install  old = slot_row[v]: row_slot[old] = -1 (its weights and optimizer states written back
                 to the backing tier first when dirty); slot_row[v] = m, row_slot[m] = v, dirty[v] = 0,
                 the row's weights, states and freq loaded from the backing tier
    touch        stamp[slot_of(u)] = c, freq[slot_of(u)] += n
Every step is a pure function of the state and the batch (ties broken by slot number), so the NumPy
reference, the simulator and a GPU choose the same victims.

FBGEMM: fbgemm_gpu/split_table_batched_embeddings_ops_training.py (prefetch, lxu_cache_*), its
lru_cache_find_uncached / lru_cache_insert and lfu_* kernels; FBGEMM's cache is 32-way set
associative (a row may only go to the ways of its set, rows that do not fit are read from UVM), ours is
fully associative per table (exact LRU / LFU; a batch that does not fit is an error, never a fallback).
Their design, our code.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int64

from .launch import launch_1d, launch_lanes, lanes_for

LRU, LFU = 0, 1
POLICIES = {"lru": LRU, "lfu": LFU}
BLOCKED = np.iinfo(np.int64).max          # priority of a slot that must not be evicted
EMPTY_PRIORITY = -1                         # empty slots are taken first
FREQ_SHIFT = 32                             # LFU priority: freq << 32 | stamp


class CacheCapacityError(RuntimeError):
    """A batch needs more distinct rows of a table than that table's cache can hold at once."""


# ---- NumPy reference ------------------------------------------------------------------------------
def unique_rows_ref(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(u (U,) ascending distinct rows >= 0, n (U,) their occurrence counts) of rows (N,) int64."""
    rows = np.asarray(rows, np.int64)
    return np.unique(rows[rows >= 0], return_counts=True)


def priorities_ref(slot_row, stamp, freq, pin, hit_slots, policy: int) -> np.ndarray:
    """(C,) int64 eviction priorities (see the module docstring); hit_slots: slots of this batch."""
    if policy == LFU:
        p = (np.asarray(freq, np.int64) << FREQ_SHIFT) | np.minimum(stamp, (1 << FREQ_SHIFT) - 1)
    else:
        p = np.asarray(stamp, np.int64).copy()
    p[np.asarray(slot_row) < 0] = EMPTY_PRIORITY
    p[np.asarray(pin) > 0] = BLOCKED
    p[np.asarray(hit_slots)[np.asarray(hit_slots) >= 0]] = BLOCKED
    return p


def victims_ref(prio: np.ndarray, slot_offsets: np.ndarray, misses: np.ndarray,
                row_offsets: np.ndarray) -> np.ndarray:
    """(M,) the victim slot of each miss (misses (M,) ascending linear rows): per table, its first M_t
    slots in (priority, slot) order; CacheCapacityError when a table lacks evictable slots. O(C_t) per
    table with misses (a partition finds the M_t-th priority; only the M_t chosen slots are sorted)."""
    victims = np.empty(misses.shape[0], np.int64)
    miss_start = np.searchsorted(misses, row_offsets)
    for t in range(slot_offsets.shape[0] - 1):
        m0, m1 = int(miss_start[t]), int(miss_start[t + 1])
        if m1 == m0:
            continue
        lo, hi = int(slot_offsets[t]), int(slot_offsets[t + 1])
        p = prio[lo:hi]
        want = m1 - m0
        free = int(np.count_nonzero(p != BLOCKED))
        if want > free:
            raise CacheCapacityError(capacity_message(t, want, free, hi - lo))
        kth = np.partition(p, want - 1)[want - 1]           # the want-th smallest priority
        below = np.flatnonzero(p < kth)                      # all of these are taken,
        ties = np.flatnonzero(p == kth)[:want - below.size]  # then the lowest slots of priority kth
        chosen = np.concatenate([below, ties])
        victims[m0:m1] = lo + chosen[np.lexsort((chosen, p[chosen]))]
    return victims


def capacity_message(t: int, missing: int, free: int, capacity: int) -> str:
    return (f"embedding cache of table {t}: this batch needs {missing} rows loaded but only {free} of its "
            f"{capacity} cache slots can take them (the rest hold rows of this batch or of lookups whose "
            "backward has not run); give the cache more rows (cache_load_factor / byte budget) or use "
            "smaller batches")


def place_ref(state: dict, rows: np.ndarray, slot_offsets: np.ndarray, row_offsets: np.ndarray,
              policy: int, clock: int) -> dict:
    """The whole placement of one batch on a copy of `state` (slot_row, row_slot, stamp, freq, pin, dirty,
    and row_freq (R,): the backing tier's LFU counts): the test oracle. Returns {'state', 'slots' (N,)
    (-1 for rows -1), 'misses', 'victims', 'evicted' (M,) old rows (-1: the slot was empty),
    'evicted_dirty' (M,)}. Row data is not modelled here (numbactr.embedding.tiered moves it)."""
    s = {k: np.array(v, copy=True) for k, v in state.items()}
    u, n = unique_rows_ref(rows)
    hit = s["row_slot"][u]
    misses = u[hit < 0]
    prio = priorities_ref(s["slot_row"], s["stamp"], s["freq"], s["pin"], hit, policy)
    victims = victims_ref(prio, slot_offsets, misses, row_offsets)
    evicted = s["slot_row"][victims].copy()
    evicted_dirty = s["dirty"][victims].copy()
    held = evicted >= 0
    s["row_freq"][evicted[held]] = s["freq"][victims[held]]
    s["row_slot"][evicted[held]] = -1
    s["slot_row"][victims] = misses
    s["row_slot"][misses] = victims
    s["dirty"][victims] = 0
    s["freq"][victims] = s["row_freq"][misses]
    slots_u = s["row_slot"][u]
    s["stamp"][slots_u] = clock
    s["freq"][slots_u] += n
    rows = np.asarray(rows, np.int64)
    slots = np.where(rows >= 0, s["row_slot"][np.maximum(rows, 0)], -1)
    return dict(state=s, slots=slots, misses=misses, victims=victims, evicted=evicted,
                evicted_dirty=evicted_dirty)


# ---- kernels (gpu, sim) -----------------------------------------------------------------------------
@cuda.jit
def lookup_kernel(u, row_slot, slots):
    """slots[i] <- row_slot[u[i]] (u (U,) distinct rows)."""
    for i in range(cuda.grid(1), u.shape[0], cuda.gridsize(1)):
        slots[i] = row_slot[u[i]]


@cuda.jit
def priority_kernel(slot_row, stamp, freq, pin, policy, prio):
    """prio[s] <- the slot's eviction priority before this batch's hits are blocked."""
    for s in range(cuda.grid(1), prio.shape[0], cuda.gridsize(1)):
        if pin[s] > 0:
            prio[s] = BLOCKED
        elif slot_row[s] < 0:
            prio[s] = EMPTY_PRIORITY
        elif policy == LFU:
            prio[s] = (freq[s] << FREQ_SHIFT) | min(stamp[s], int64((1 << FREQ_SHIFT) - 1))
        else:
            prio[s] = stamp[s]


@cuda.jit
def block_kernel(slots, prio):
    """prio[slots[i]] <- BLOCKED for every hit (slots (U,), -1 for misses)."""
    for i in range(cuda.grid(1), slots.shape[0], cuda.gridsize(1)):
        if slots[i] >= 0:
            prio[slots[i]] = BLOCKED


@cuda.jit
def victims_kernel(misses, row_offsets, miss_start, slot_offsets, order, victims):
    """victims[i] <- the (i - miss_start[t])-th slot of table t in priority order (order (C,): each
    table's slots sorted by priority, in the table's own range)."""
    n_tables = row_offsets.shape[0] - 1
    for i in range(cuda.grid(1), misses.shape[0], cuda.gridsize(1)):
        lo, hi = 0, n_tables                # the table of the row: row_offsets[t] <= row < row_offsets[t + 1]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if row_offsets[mid] <= misses[i]:
                lo = mid
            else:
                hi = mid
        victims[i] = order[slot_offsets[lo] + i - miss_start[lo]]


@cuda.jit
def install_kernel(misses, victims, slot_row, row_slot, dirty, evicted, evicted_dirty):
    """Each miss takes its victim slot: evicted[i] <- the row it held (-1: none), evicted_dirty[i] <- its
    dirty flag; the maps point at the new row, which starts clean. Victims are distinct, and evicted rows
    (cached) never equal misses (uncached): no two threads write one place."""
    for i in range(cuda.grid(1), misses.shape[0], cuda.gridsize(1)):
        v = victims[i]
        old = slot_row[v]
        evicted[i] = old
        evicted_dirty[i] = dirty[v]
        if old >= 0:
            row_slot[old] = -1
        slot_row[v] = misses[i]
        row_slot[misses[i]] = v
        dirty[v] = 0


@cuda.jit
def touch_kernel(u, counts, row_slot, stamp, freq, clock):
    """stamp[slot] <- clock and freq[slot] += counts[i] for the slot of every row u[i] of the batch."""
    for i in range(cuda.grid(1), u.shape[0], cuda.gridsize(1)):
        s = row_slot[u[i]]
        stamp[s] = clock
        freq[s] += counts[i]


@cuda.jit
def pin_kernel(slots, pin, delta, dirty, mark_dirty):
    """pin[slots[i]] += delta (distinct slots); dirty[slots[i]] <- 1 when mark_dirty (a backward ran)."""
    for i in range(cuda.grid(1), slots.shape[0], cuda.gridsize(1)):
        s = slots[i]
        if s >= 0:
            pin[s] += delta
            if mark_dirty:
                dirty[s] = 1


@cuda.jit
def occurrence_slots_kernel(rows, row_slot, slots):
    """slots[k] <- row_slot[rows[k]], -1 where rows[k] = -1 (the engine's "no row")."""
    for k in range(cuda.grid(1), rows.shape[0], cuda.gridsize(1)):
        r = rows[k]
        slots[k] = row_slot[r] if r >= 0 else -1


@cuda.jit
def gather_rows_kernel(src, idx, out):
    """out[i, d] <- src[idx[i], d] for d < D: rows of a cache buffer (V, stride >= D) into a dense (n, D)
    staging array. threadIdx.x walks d, threadIdx.y / the grid the rows."""
    i0 = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
    for i in range(i0, idx.shape[0], cuda.gridDim.x * cuda.blockDim.y):
        for d in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
            out[i, d] = src[idx[i], d]


@cuda.jit
def scatter_rows_kernel(dst, idx, src):
    """dst[idx[i], d] <- src[i, d] for d < D (dst (V, stride >= D), src (n, D), idx distinct)."""
    i0 = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
    for i in range(i0, idx.shape[0], cuda.gridDim.x * cuda.blockDim.y):
        for d in range(cuda.threadIdx.x, src.shape[1], cuda.blockDim.x):
            dst[idx[i], d] = src[i, d]


# ---- wrappers (allocate nothing) --------------------------------------------------------------------
def lookup(u, row_slot, slots) -> None:
    launch_1d(lookup_kernel, u.shape[0], u, row_slot, slots)


def priorities(slot_row, stamp, freq, pin, hit_slots, policy: int, prio) -> None:
    launch_1d(priority_kernel, prio.shape[0], slot_row, stamp, freq, pin, np.int64(policy), prio)
    launch_1d(block_kernel, hit_slots.shape[0], hit_slots, prio)


def victims(misses, row_offsets, miss_start, slot_offsets, order, out) -> None:
    launch_1d(victims_kernel, misses.shape[0], misses, row_offsets, miss_start, slot_offsets, order, out)


def install(misses, victims_, slot_row, row_slot, dirty, evicted, evicted_dirty) -> None:
    launch_1d(install_kernel, misses.shape[0], misses, victims_, slot_row, row_slot, dirty, evicted,
              evicted_dirty)


def touch(u, counts, row_slot, stamp, freq, clock: int) -> None:
    launch_1d(touch_kernel, u.shape[0], u, counts, row_slot, stamp, freq, np.int64(clock))


def pin(slots, pin_, delta: int, dirty, mark_dirty: bool) -> None:
    launch_1d(pin_kernel, slots.shape[0], slots, pin_, np.int32(delta), dirty, bool(mark_dirty))


def occurrence_slots(rows, row_slot, out) -> None:
    launch_1d(occurrence_slots_kernel, rows.shape[0], rows, row_slot, out)


def gather_rows(src, idx, out) -> None:
    """out (n, D) <- src[idx, :D] for a cache buffer src (V, stride)."""
    launch_lanes(gather_rows_kernel, idx.shape[0], lanes_for(out.shape[1]), src, idx, out)


def scatter_rows(dst, idx, src) -> None:
    """dst[idx, :D] <- src (n, D) for a cache buffer dst (V, stride)."""
    launch_lanes(scatter_rows_kernel, idx.shape[0], lanes_for(src.shape[1]), dst, idx, src)


PTX_CHECKS = [
    (lookup_kernel, "void(int64[::1], int64[::1], int64[::1])"),
    (priority_kernel, "void(int64[::1], int64[::1], int64[::1], int32[::1], int64, int64[::1])"),
    (block_kernel, "void(int64[::1], int64[::1])"),
    (victims_kernel, "void(int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64[::1])"),
    (install_kernel, "void(int64[::1], int64[::1], int64[::1], int64[::1], int8[::1], int64[::1], int8[::1])"),
    (touch_kernel, "void(int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64)"),
    (pin_kernel, "void(int64[::1], int32[::1], int32, int8[::1], boolean)"),
    (occurrence_slots_kernel, "void(int64[::1], int64[::1], int64[::1])"),
    (gather_rows_kernel, "void(float32[:, ::1], int64[::1], float32[:, ::1])"),
    (gather_rows_kernel, "void(uint16[:, ::1], int64[::1], uint16[:, ::1])"),
    (scatter_rows_kernel, "void(float32[:, ::1], int64[::1], float32[:, ::1])"),
    (scatter_rows_kernel, "void(int64[:, ::1], int64[::1], int64[:, ::1])"),
]
