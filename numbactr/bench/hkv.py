"""``numbactr bench hkv``: the evicting table's throughput (HierarchicalKV's operations) beside the fixed table.

What it shows: the cost of eviction. numbactr.embedding.evicting.EvictingTable (kLru) runs
``insert_or_assign``, ``insert_and_evict``, ``find_or_insert`` and ``find`` on batches of keys against a table
filled to a load factor of 0.5 (half its slots taken: new keys find free slots) and 1.0 (every bucket full:
each new key evicts the bucket's lowest score, after a scan of its whole bucket). numbactr's fixed table
(numbactr.embedding.hash_table.HashTable, the table the engine's keyed tables use, built as ``numbactr bench
hash`` builds it) inserts and finds the same keys at load factor 0.5; it has no 1.0 rows, as a full fixed
table refuses new keys (HashTableFullError) instead of making room.

How it measures (HierarchicalKV's benchmark does the same in spirit): keys are consecutive integers (each
table hashes them); the table is filled once per (D, load factor) with ``insert_or_assign`` (at 1.0 until
every bucket is full); then each operation is timed on a batch of keys. Inserting operations get a batch of
keys never seen before at every repetition; at load factor 0.5 the keys a repetition added are erased
before the next one (``erase_if("score_ge", ...)`` outside the timer: kLru gives them the newest clock), so
the load stays where it was; at 1.0 the table stays full. ``find`` reads keys that are in the table.
M-KV/s = batch keys / median seconds / 1e6 (one key with its D-float value is one KV).

On a GPU the table also prints HierarchicalKV's published A100 figures beside the matching rows (D = 8,
load factor 0.5): published numbers, on other hardware, not measured here.
"""

from __future__ import annotations

import numpy as np

from numbactr.bench.common import Env, Table, _host, measure
from numbactr.bench.hash import fixed_table, table_path

COLUMNS = ["impl", "op", "keys", "D", "load factor", "capacity", "batch keys", "ms", "M-KV/s"]
PUBLISHED_COLUMN = "HierarchicalKV A100 M-KV/s (published)"
#: HierarchicalKV's README benchmark on an A100 (D = 8, load factor 0.5, batch of 1M keys), in M-KV/s:
#: a reference point from other hardware and another implementation, printed on a GPU, never measured here
PUBLISHED_A100 = {"find": 2500.0, "insert_or_assign": 1100.0, "insert_and_evict": 1100.0}
#: table slots and batch keys per device (None in FULL: chosen by device here)
BY_DEVICE = {"gpu": dict(capacity=1 << 24, batch=1 << 20), "cpu": dict(capacity=1 << 20, batch=1 << 16)}
FULL = dict(capacity=None, batch=None, dims=(8, 32), load_factors=(0.5, 1.0))
QUICK = dict(capacity=1 << 12, batch=256, dims=(8,), load_factors=(0.5, 1.0))
BUCKET = 128  # HierarchicalKV's default max_bucket_size


def published(op: str, dim: int, load_factor: float):
    """HierarchicalKV's published A100 M-KV/s for this row, or None where it published none we quote."""
    return PUBLISHED_A100.get(op) if dim == 8 and load_factor == 0.5 else None


def _fill(table, lf: float, batch: int, xp) -> int:
    """insert_or_assign keys 1, 2, ... in batches until lf of the slots are taken (lf 1.0: every bucket full,
    new keys evicting old ones meanwhile); returns the next unused key."""
    cap, nxt = table.capacity(), 1
    target = int(lf * cap)
    while table.size() < target:
        n = min(batch, target - table.size()) if lf < 1.0 else batch
        table.insert_or_assign(xp.arange(nxt, nxt + n, dtype=np.uint64), xp.zeros((n, table.dim), np.float32))
        nxt += n
        if nxt > 16 * cap:
            raise RuntimeError(f"bench hkv: the table did not fill to {lf} after {nxt - 1:,} keys")
    return nxt


def _evicting_rows(env: Env, tab: Table, dim, lf, capacity, batch, min_time, rng):
    """Time the evicting table's four operations at (dim, lf); one table row each."""
    from numbactr.embedding.evicting import EvictingTable

    xp = env.xp
    table = EvictingTable(dim, capacity, capacity, max_bucket_size=BUCKET, evict_strategy="kLru")
    nxt = [_fill(table, lf, batch, xp)]
    fill_clock, measured_lf = table.clock, table.load_factor()
    present = _host(table.export_batch()[0])
    known = xp.asarray(rng.choice(present, size=min(batch, present.size), replace=False))
    vals = xp.asarray(rng.standard_normal((batch, dim)).astype(np.float32))
    cur = {}

    def fresh():
        """Outside the timer: the next batch of new keys; at lf < 1 the previous batch's keys erased."""
        if lf < 1.0:
            table.erase_if("score_ge", fill_clock + 1)
        cur["keys"] = xp.arange(nxt[0], nxt[0] + batch, dtype=np.uint64)
        nxt[0] += batch

    ops = {  # find first: the inserts evict known keys at load factor 1.0
        "find": (lambda: table.find(known), None, "known"),
        "insert_or_assign": (lambda: table.insert_or_assign(cur["keys"], vals), fresh, "new"),
        "insert_and_evict": (lambda: table.insert_and_evict(cur["keys"], vals), fresh, "new"),
        "find_or_insert": (lambda: table.find_or_insert(cur["keys"]), fresh, "new"),
    }
    for op, (fn, setup, kind) in ops.items():
        t = measure(fn, sync=env.sync, setup=setup, min_time=min_time)
        keys = cur["keys"] if kind == "new" else known
        if not bool(table.find(keys)[1].all()) or table.size() > table.capacity():
            raise AssertionError(f"bench hkv: {op} at load factor {lf} lost keys of its batch")
        n = int(keys.shape[0])
        _add(
            tab,
            "EvictingTable",
            op,
            kind,
            dim,
            round(measured_lf, 3),
            capacity,
            n,
            1e3 * t,
            n / t / 1e6,
            ref=published(op, dim, lf),
        )


def _add(tab: Table, *cells, ref=None) -> None:
    """One row; on a GPU with the published figure (None: '-') in the last column."""
    tab.add(*cells, *([ref] if PUBLISHED_COLUMN in tab.columns else []))


def _fixed_rows(env: Env, tab: Table, lf, capacity, batch, min_time):
    """Time the fixed table's insert (new keys) and find (known keys) at load factor lf."""
    xp = env.xp
    table = fixed_table(env, capacity, 1.0)  # capacity slots, every one of them usable as a row
    fill = xp.arange(1, int(lf * capacity) + 1, dtype=np.uint64)
    new = xp.arange(fill.shape[0] + 1, fill.shape[0] + 1 + batch, dtype=np.uint64)
    known = fill[:: max(1, fill.shape[0] // batch)][:batch]

    def refill():
        """Outside the timer: back to the filled table, so every repetition inserts at load factor lf."""
        table.clear()
        table.insert(fill)

    for op, fn, setup, keys, kind in (
        ("insert", lambda: table.insert(new), refill, new, "new"),
        ("find", lambda: table.find(known), None, known, "known"),
    ):
        t = measure(fn, sync=env.sync, setup=setup, min_time=min_time)
        if bool((_host(table.find(keys)) < 0).any()):
            raise AssertionError(f"bench hkv: the fixed table's {op} lost keys of its batch")
        n = int(keys.shape[0])
        _add(tab, "HashTable (fixed)", op, kind, "-", lf, table.capacity, n, 1e3 * t, n / t / 1e6)


def bench_hkv(
    env: Env,
    *,
    capacity: int | None,
    batch: int | None,
    dims=(8, 32),
    load_factors=(0.5, 1.0),
    min_time: float = 1.0,
    seed: int = 0,
) -> Table:
    """The table of ``numbactr bench hkv`` (see the module docstring)."""
    defaults = BY_DEVICE["gpu" if env.kind == "gpu" else "cpu"]
    capacity = int(capacity or defaults["capacity"])
    batch = int(batch or defaults["batch"])
    if capacity % BUCKET or capacity & (capacity - 1) or batch > capacity // 4:
        raise ValueError(
            f"bench hkv: capacity {capacity} must be a power of two of whole {BUCKET}-slot buckets and batch "
            f"{batch} at most a quarter of it"
        )
    tab = Table(f"evicting hash table (HierarchicalKV's operations) ({env.kind})", list(COLUMNS))
    tab.notes = env.header() + [
        f"EvictingTable: {capacity:,} slots in buckets of {BUCKET}, kLru, float32 values of width D; "
        f"batches of {batch:,} keys; numbactr's {table_path(env)}",
        "load factor: the table's as measured after filling it; at 0.5 each repetition's new keys are erased "
        "before the next (outside the timer), at 1.0 every bucket is full and each new key evicts one",
        "keys new: never seen before, so inserted (at 1.0: each evicts its bucket's oldest key after scanning "
        "all its slots); keys known: in the table",
        "HashTable (fixed): numbactr's non-evicting key -> row table (no values: the rows live in the "
        "embedding), same capacity, refilled to 0.5 before each insert; a full fixed table refuses new keys "
        "(HashTableFullError), so it has no 1.0 rows",
        "M-KV/s = batch keys / median time / 1e6",
    ]
    if env.kind == "gpu":
        tab.columns.append(PUBLISHED_COLUMN)
        tab.notes.append(
            "HierarchicalKV A100 M-KV/s (published): figures from HierarchicalKV's README (A100, D 8, "
            "load factor 0.5, batch 1M, its own capacity): published numbers on other hardware, not measured here"
        )
    else:
        tab.notes.append(
            "HierarchicalKV publishes A100 figures (find ~2,500, insert_or_assign ~1,100, insert_and_evict "
            "~1,100 M-KV/s at D 8, load factor 0.5); they are printed beside GPU runs only"
        )
    rng = np.random.default_rng(seed)
    for lf in load_factors:
        for dim in dims:
            _evicting_rows(env, tab, dim, lf, capacity, batch, min_time, rng)
        if lf < 1.0:
            _fixed_rows(env, tab, lf, capacity, batch, min_time)
    return tab
