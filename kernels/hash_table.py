"""Key -> row hash table: open addressing over uint64 keys, linear probing, CAS insert.

Table state, C slots (allocated and initialised by the caller):
    tkeys  (C,) uint64  key in the slot, EMPTY_KEY = 2**64 - 1 when free
    trows  (C,) int64   row of that key in the value pool, -1 while none is assigned
    tfirst (C,) int64   INT64_MAX between calls; during an insert, the smallest batch position that
                        claimed the slot (the key's first occurrence)
home slot = fmix64(key) % C (murmur3 finaliser, all in uint64), then slots home+1, home+2, ... mod C.

insert(keys (N,) uint64, base) -> rows (N,) int64:
    known keys keep their row; keys new to the table get rows base, base+1, ... in the order of their
    FIRST occurrence in the batch (so the GPU, the simulator and the reference agree exactly, whatever
    the thread interleaving), i.e. rows[i] = base + #{distinct new keys first seen before i}.
    Kernels: claim (CAS a slot per key, atomic.min of the batch position into tfirst) -> mark
    (flags[i] = 1 at a new key's first occurrence) -> exclusive scan of flags (scan.py) -> host reads the
    number of new keys and checks it against max_rows BEFORE any row is assigned -> assign -> gather.
    On failure the slots claimed by the batch are rolled back, leaving the table exactly as it was
    (removing only keys that arrived in this batch cannot break an older key's probe chain).
find(keys (N,)) -> rows (N,) int64, -1 for absent keys (probe stops at EMPTY or after C slots).

Invariant between calls: every occupied slot has a row >= 0 and tfirst is all INT64_MAX.

HugeCTR: HugeCTR/src/hashtable/nv_hashtable.cu (get_insert / get_mark; HugeCTR hands new keys the next
value of a global counter in thread order, numbactr in first-occurrence order so runs are reproducible).
"""
from __future__ import annotations

import warnings

import numpy as np
from numba import cuda, int64, uint64

from .launch import count_host_read, launch_1d
from .scan import exclusive_scan
from .hash64 import fmix64, fmix64_ref

EMPTY_KEY = np.uint64(0xFFFFFFFFFFFFFFFF)     # reserved: marks a free slot
NO_ROW = -1
INT64_MAX = np.iinfo(np.int64).max


class HashTableFullError(RuntimeError):
    """A batch brings more new keys than the table has rows left. The table is left unchanged."""

    def __init__(self, needed: int, used: int, max_rows: int, hint: str = ""):
        self.needed, self.used, self.max_rows = int(needed), int(used), int(max_rows)
        msg = (f"embedding table full: this batch needs {self.needed} more rows, {self.used} of "
               f"max_rows={self.max_rows} used ({self.max_rows - self.used} free); "
               f"raise workspace_size_per_gpu_in_mb")
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)


# ---- NumPy reference (vectorised: probes all unresolved keys at once) -------------------------
def _home_slots_ref(keys: np.ndarray, capacity: int) -> np.ndarray:
    """murmur3 fmix64 of each key (hash64.fmix64_ref) modulo the capacity, keys' shape."""
    keys = np.asarray(keys)
    return (fmix64_ref(keys) % np.uint64(capacity)).astype(np.int64).reshape(keys.shape)


def _find_unique_ref(tkeys: np.ndarray, trows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Row of each key (keys (U,) uint64), -1 if absent."""
    cap = tkeys.shape[0]
    rows = np.full(keys.shape[0], NO_ROW, dtype=np.int64)
    todo = np.arange(keys.shape[0])                  # positions still probing
    slot = _home_slots_ref(keys, cap)                 # (U,) current probe slot of each key
    for _ in range(cap):
        if todo.size == 0:
            break
        s = slot[todo]
        here = tkeys[s]
        hit = here == keys[todo]
        rows[todo[hit]] = trows[s[hit]]
        todo = todo[~hit & (here != EMPTY_KEY)]      # EMPTY ends the chain: absent
        slot[todo] = (slot[todo] + 1) % cap
    return rows


def hash_find_ref(tkeys: np.ndarray, trows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """rows (N,) int64 of keys (N,) uint64; -1 for keys not in the table. Reads the table only."""
    keys = np.asarray(keys, dtype=np.uint64).reshape(-1)
    if keys.size == 0:
        return np.zeros(0, dtype=np.int64)
    uniq, inverse = np.unique(keys, return_inverse=True)
    return _find_unique_ref(tkeys, trows, uniq)[inverse.reshape(-1)]


def hash_insert_ref(tkeys: np.ndarray, trows: np.ndarray, keys: np.ndarray, base: int,
                    max_rows: int) -> tuple[np.ndarray, int]:
    """Insert keys (N,) uint64 into the table IN PLACE; returns (rows (N,) int64, number of new keys).

    New keys get rows base, base+1, ... in order of first occurrence. Raises HashTableFullError,
    leaving the table untouched, when base + new > max_rows (or fewer free slots than new keys).
    """
    keys = np.asarray(keys, dtype=np.uint64).reshape(-1)
    if keys.size == 0:
        return np.zeros(0, dtype=np.int64), 0
    cap = tkeys.shape[0]
    uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    urows = _find_unique_ref(tkeys, trows, uniq)      # (U,) existing rows, -1 for new keys
    new = np.flatnonzero(urows == NO_ROW)
    new = new[np.argsort(first[new], kind="stable")]  # new keys in first-occurrence order
    n_new = int(new.size)
    free_slots = int(np.count_nonzero(tkeys == EMPTY_KEY))
    if base + n_new > max_rows or n_new > free_slots:
        raise HashTableFullError(n_new, base, max_rows)
    urows[new] = base + np.arange(n_new, dtype=np.int64)

    # place the new keys: each round, every pending key looks at its current slot; among keys that
    # reach the same empty slot the earliest (first occurrence) wins, the rest move on
    pend = new                                        # (P,) indices into uniq, first-occurrence order
    slot = _home_slots_ref(uniq[pend], cap)
    for _ in range(cap):
        if pend.size == 0:
            break
        free = tkeys[slot] == EMPTY_KEY
        # np.unique returns the first index of each slot value: the earliest pending key wins it
        _, win_at = np.unique(np.where(free, slot, -1), return_index=True)
        win = np.zeros(pend.size, dtype=bool)
        win[win_at] = True
        win &= free
        tkeys[slot[win]] = uniq[pend[win]]
        trows[slot[win]] = urows[pend[win]]
        pend, slot = pend[~win], (slot[~win] + 1) % cap
    if pend.size:   # cannot happen: free_slots >= n_new was checked
        raise AssertionError("hash_insert_ref: probing failed with free slots left")
    return urows[inverse.reshape(-1)], n_new


# ---- kernels (one thread per key, grid-stride) ------------------------------------------------
# The home slot is an inline device function (inline=True device functions compile in
# tests/ptx_check.py without a GPU; non-inline ones ask the driver for the device).
@cuda.jit(device=True, inline=True)
def _home_slot(key, cap):
    """murmur3's fmix64 of the key, modulo the capacity, all in uint64 (see hash64.fmix64_ref); fmix64
    wraps explicitly, so the simulator raises no overflow warning."""
    return int64(fmix64(key) % uint64(cap))


@cuda.jit
def hash_assign_kernel(trows, tfirst, slots, flags, pos, base):
    """trows[slot] <- base + pos[i] at each first occurrence; tfirst back to INT64_MAX."""
    for i in range(cuda.grid(1), slots.shape[0], cuda.gridsize(1)):
        if flags[i] != 0:
            s = slots[i]
            trows[s] = base + pos[i]
            tfirst[s] = int64(0x7FFFFFFFFFFFFFFF)


@cuda.jit
def hash_gather_kernel(trows, slots, rows):
    """rows[i] <- trows[slots[i]]."""
    for i in range(cuda.grid(1), slots.shape[0], cuda.gridsize(1)):
        rows[i] = trows[slots[i]]


@cuda.jit
def hash_rollback_kernel(tkeys, trows, tfirst, slots):
    """Free every slot this batch claimed (still without a row) and reset its tfirst."""
    for i in range(cuda.grid(1), slots.shape[0], cuda.gridsize(1)):
        s = slots[i]
        if s >= 0 and trows[s] == -1:
            tfirst[s] = int64(0x7FFFFFFFFFFFFFFF)
            tkeys[s] = uint64(0xFFFFFFFFFFFFFFFF)


@cuda.jit
def hash_find_kernel(tkeys, trows, keys, rows):
    """rows[i] <- row of keys[i], -1 when absent (probe ends at EMPTY or after C slots)."""
    empty = uint64(0xFFFFFFFFFFFFFFFF)
    cap = tkeys.shape[0]
    for i in range(cuda.grid(1), keys.shape[0], cuda.gridsize(1)):
        key = keys[i]
        s = _home_slot(key, cap)
        row = int64(-1)
        for _ in range(cap):
            here = tkeys[s]
            if here == key:
                row = trows[s]
                break
            if here == empty:
                break
            s += 1
            if s == cap:
                s = 0
        rows[i] = row


@cuda.jit
def hash_dump_kernel(tkeys, trows, out):
    """out[trows[s]] <- tkeys[s] for every slot s holding a row: the keys in row order."""
    for s in range(cuda.grid(1), tkeys.shape[0], cuda.gridsize(1)):
        r = trows[s]
        if r >= 0:
            out[r] = tkeys[s]


# ---- claim and mark (both inserts), then the deferred insert: no host read (a GPU training step's path) --
# The deferred insert's row counter lives on the device (dsize (1,) int64) and every error goes into err (4,) int64, which the
# caller reads when it chooses to (HashTable.check): err[0] the first error's code (ERR_FULL: rows ran out,
# ERR_NO_SLOT: no free slot), err[1] the new keys that batch needed, err[2] the rows in use then, err[3] the
# smallest batch position of a reserved key (EMPTY_KEY), INT64_MAX when none. A batch that does not fit is
# rolled back on the device exactly as the eager insert rolls it back: its new keys get row -1 (looked up as
# nothing, never updated) and the table is as before. Occurrences of other tables (occ_table[i] != t, for
# t >= 0) are skipped: slot SKIP, rows_out left as it was.
ERR_FULL, ERR_NO_SLOT = 1, 2
SKIP = -2


@cuda.jit
def hash_claim_kernel(tkeys, trows, tfirst, keys, occ_table, t, slots, status, err):
    """slots[i] <- slot holding keys[i] (claimed by CAS if new); for keys without a row yet,
    tfirst[slot] <- min batch position; status[0] <- 1 and slots[i] = -1 when the probe visited every
    slot without success. trows is only read (no kernel writes it during the claim). Only the
    occurrences of table t (occ_table[i] == t; all when t < 0) take part, the others get slot SKIP; a
    reserved key (EMPTY_KEY: the eager insert rejects it on the host first) gets slot -1 and its position
    goes to err[3] (atomic min)."""
    empty = uint64(0xFFFFFFFFFFFFFFFF)
    cap = tkeys.shape[0]
    for i in range(cuda.grid(1), keys.shape[0], cuda.gridsize(1)):
        if t >= 0 and occ_table[i] != t:
            slots[i] = SKIP
            continue
        key = keys[i]
        if key == empty:
            slots[i] = -1
            cuda.atomic.min(err, 3, int64(i))
            continue
        s = _home_slot(key, cap)
        found = int64(-1)
        for _ in range(cap):
            here = tkeys[s]
            if here == key:
                found = s
                break
            if here == empty:
                old = cuda.atomic.cas(tkeys, s, empty, key)
                if old == empty or old == key:      # we won, or another thread inserted this key
                    found = s
                    break
            s += 1
            if s == cap:
                s = 0
        slots[i] = found
        if found < 0:
            status[0] = 1                           # every writer stores 1: a benign race
        elif trows[found] == -1:                    # known keys skip the atomic (hot keys repeat)
            cuda.atomic.min(tfirst, found, int64(i))


@cuda.jit
def hash_mark_kernel(trows, tfirst, slots, flags):
    """flags[i] <- 1 where keys[i] is a new key's first occurrence in the batch, else 0 (skipped and failed
    occurrences, slot < 0, never are)."""
    for i in range(cuda.grid(1), slots.shape[0], cuda.gridsize(1)):
        s = slots[i]
        flags[i] = int64(1) if s >= 0 and trows[s] == -1 and tfirst[s] == i else int64(0)


@cuda.jit(device=True, inline=True)
def _over(pos, n, dsize, max_rows, status):
    """Does this batch fail (no slot for some key, or more new keys than rows left)?"""
    return status[0] != 0 or dsize[0] + pos[n] > max_rows


@cuda.jit
def hash_assign_deferred_kernel(tkeys, trows, tfirst, slots, flags, pos, dsize, max_rows, status, err):
    """Rows dsize[0] + pos[i] for the batch's new keys; or, when the batch fails, its claimed slots freed
    (thread 0 records the first failure in err)."""
    n = slots.shape[0]
    over = _over(pos, n, dsize, max_rows, status)
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        s = slots[i]
        if over:
            if s >= 0 and trows[s] == -1:           # claimed by this batch: free it (duplicates agree)
                tkeys[s] = uint64(0xFFFFFFFFFFFFFFFF)
                tfirst[s] = int64(0x7FFFFFFFFFFFFFFF)
            if i == 0 and err[0] == 0:
                err[0] = ERR_NO_SLOT if status[0] != 0 else ERR_FULL
                err[1] = pos[n]
                err[2] = dsize[0]
        elif flags[i] != 0:
            trows[s] = dsize[0] + pos[i]
            tfirst[s] = int64(0x7FFFFFFFFFFFFFFF)


@cuda.jit
def hash_gather_deferred_kernel(trows, slots, pos, dsize, max_rows, status, rows):
    """rows[i] <- trows[slots[i]] (-1 for failed keys; skipped occurrences untouched); thread 0 then moves
    the row counter past the new keys (when the batch did not fail)."""
    n = slots.shape[0]
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        s = slots[i]
        if s >= 0:
            rows[i] = trows[s]
        elif s == -1:
            rows[i] = -1
    if cuda.grid(1) == 0 and not _over(pos, n, dsize, max_rows, status):
        dsize[0] = dsize[0] + pos[n]


@cuda.jit
def scatter_flagged_kernel(dst, rows, flags, values):
    """dst[rows[i]] <- values[i] where flags[i] != 0 and rows[i] >= 0 (e.g. a Localized table's slot of each
    new row, from its key's first occurrence)."""
    for i in range(cuda.grid(1), rows.shape[0], cuda.gridsize(1)):
        r = rows[i]
        if flags[i] != 0 and r >= 0:
            dst[r] = values[i]


# ---- launch wrappers (allocate nothing but error-path host copies) ----------------------------
def _host(a) -> np.ndarray:
    if hasattr(a, "get"):               # cupy
        return a.get()
    if hasattr(a, "copy_to_host"):      # numba device array
        return a.copy_to_host()
    return np.asarray(a)


def hash_find(tkeys, trows, keys, rows_out) -> None:
    """rows_out (N,) int64 <- row of each key (N,) uint64, -1 when absent."""
    launch_1d(hash_find_kernel, keys.shape[0], tkeys, trows, keys, rows_out)


def hash_insert(tkeys, trows, tfirst, keys, base: int, max_rows: int, slots, flags, pos, rows_out,
                status, occ_table, err, *, scan_threads: int | None = None, partials=None) -> int:
    """Insert keys (N,) uint64; rows_out (N,) int64 <- their rows; returns the number of new keys.

    Scratch from the caller: slots (N,) int64, flags (N,) int64, pos (N + 1,) int64, status (1,) int32,
    occ_table (any small int64 array: every key takes part) and err (4,) int64 (see the deferred insert;
    the keys must hold no EMPTY_KEY, which the caller rejects first), and optionally partials (scan.scan_partials_size(N),) int64, which spreads the scan over many blocks.
    Raises HashTableFullError when base + new > max_rows (or no slot is left), after rolling the batch
    back: the table is then exactly as before the call.
    """
    n = keys.shape[0]
    if n == 0:
        return 0
    status[0] = 0
    launch_1d(hash_claim_kernel, n, tkeys, trows, tfirst, keys, occ_table, np.int64(-1), slots, status, err)
    count_host_read(2)                  # status[0] and pos[n] below come back to the host
    if int(status[0]) != 0:
        # the probe of some key found no slot: roll back, then count the distinct new keys for the error
        launch_1d(hash_rollback_kernel, n, tkeys, trows, tfirst, slots)
        hash_find(tkeys, trows, keys, rows_out)
        k, r = _host(keys), _host(rows_out)
        needed = int(np.unique(k[r == NO_ROW]).size)
        raise HashTableFullError(needed, base, max_rows, hint=f"all {tkeys.shape[0]} hash slots taken")
    launch_1d(hash_mark_kernel, n, trows, tfirst, slots, flags)
    exclusive_scan(flags, pos, threads=scan_threads, partials=partials)
    n_new = int(pos[n])
    if not 0 <= n_new <= n:
        # A scan total outside [0, n] is impossible for 0/1 flags. Seen once in the simulator (a
        # lost write, not reproduced since): say so, scan again, and stop if it happens twice.
        warnings.warn(f"hash_insert: scan of {n} flags gave {n_new}; scanning again", stacklevel=2)
        exclusive_scan(flags, pos, threads=scan_threads, partials=partials)
        n_new = int(pos[n])
        if not 0 <= n_new <= n:
            launch_1d(hash_rollback_kernel, n, tkeys, trows, tfirst, slots)
            raise RuntimeError(f"hash_insert: exclusive scan of {n} first-occurrence flags returned {n_new} twice")
    if base + n_new > max_rows:
        launch_1d(hash_rollback_kernel, n, tkeys, trows, tfirst, slots)
        raise HashTableFullError(n_new, base, max_rows)
    launch_1d(hash_assign_kernel, n, trows, tfirst, slots, flags, pos, np.int64(base))
    launch_1d(hash_gather_kernel, n, trows, slots, rows_out)
    return n_new


def hash_insert_deferred(tkeys, trows, tfirst, keys, occ_table, t: int, dsize, max_rows: int, slots, flags, pos,
                         rows_out, status, err, *, scan_threads: int | None = None, partials=None) -> None:
    """Insert the keys (N,) uint64 of table t's occurrences (occ_table (N,) int64; t < 0: all) with no host
    read: rows_out[i] <- the row of keys[i] (-1 when the batch failed or the key is reserved; untouched for
    other tables' occurrences), flags[i] = 1 at each new key's first occurrence, dsize[0] += new keys. See
    the section comment above for err. Scratch as hash_insert's."""
    n = keys.shape[0]
    if n == 0:
        return
    status[0] = 0
    launch_1d(hash_claim_kernel, n, tkeys, trows, tfirst, keys, occ_table, np.int64(t), slots, status, err)
    launch_1d(hash_mark_kernel, n, trows, tfirst, slots, flags)
    exclusive_scan(flags, pos, threads=scan_threads, partials=partials)
    launch_1d(hash_assign_deferred_kernel, n, tkeys, trows, tfirst, slots, flags, pos, dsize, np.int64(max_rows),
              status, err)
    launch_1d(hash_gather_deferred_kernel, n, trows, slots, pos, dsize, np.int64(max_rows), status, rows_out)


def scatter_flagged(dst, rows, flags, values) -> None:
    """dst (V,) int64 [rows[i]] <- values[i] at flagged occurrences (see scatter_flagged_kernel)."""
    launch_1d(scatter_flagged_kernel, rows.shape[0], dst, rows, flags, values)


def hash_dump(tkeys, trows, out) -> None:
    """out (size,) uint64 <- the keys in row order (out[r] = key of row r)."""
    launch_1d(hash_dump_kernel, tkeys.shape[0], tkeys, trows, out)


PTX_CHECKS = [
    (hash_assign_kernel, "void(int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64)"),
    (hash_gather_kernel, "void(int64[::1], int64[::1], int64[::1])"),
    (hash_rollback_kernel, "void(uint64[::1], int64[::1], int64[::1], int64[::1])"),
    (hash_find_kernel, "void(uint64[::1], int64[::1], uint64[::1], int64[::1])"),
    (hash_dump_kernel, "void(uint64[::1], int64[::1], uint64[::1])"),
    (hash_claim_kernel, "void(uint64[::1], int64[::1], int64[::1], uint64[::1], int64[::1], int64, int64[::1], "
                               "int32[::1], int64[::1])"),
    (hash_mark_kernel, "void(int64[::1], int64[::1], int64[::1], int64[::1])"),
    (hash_assign_deferred_kernel, "void(uint64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], "
                                  "int64[::1], int64, int32[::1], int64[::1])"),
    (scatter_flagged_kernel, "void(int64[::1], int64[::1], int64[::1], int64[::1])"),
    (hash_gather_deferred_kernel, "void(int64[::1], int64[::1], int64[::1], int64[::1], int64, int32[::1], int64[::1])"),
]
