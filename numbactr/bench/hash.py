"""`numbactr bench hash`: hash-table insert/find in Mkeys/s, numbactr's table beside a torch key index."""

import numpy as np

from numbactr.bench.common import HASH_COLUMNS, Env, Table, _host, measure


# ---- hash table --------------------------------------------------------------------------------
class TorchKeyIndex:
    """Key -> row as one would write it in plain PyTorch: a sorted key tensor and its rows.

    insert: torch.unique dedups the batch, searchsorted finds known keys, new keys take the next rows
    (in sorted-key order) and the index is re-sorted; find: one searchsorted.
    Keys are int64 (uint64 keys reinterpreted; the order differs but stays consistent).
    """

    def __init__(self, torch, dev: str):
        self.torch, self.dev = torch, dev
        self.clear()

    def clear(self) -> None:
        t = self.torch
        self.keys = t.empty(0, dtype=t.int64, device=self.dev)  # (size,) sorted
        self.rows = t.empty(0, dtype=t.int64, device=self.dev)  # (size,) row of each key
        self.size = 0

    def _lookup(self, keys):
        """(rows (N,) with -1 for absent keys, hit (N,) bool)."""
        t = self.torch
        if self.size == 0:
            return (
                t.full(keys.shape, -1, dtype=t.int64, device=self.dev),
                t.zeros(keys.shape, dtype=t.bool, device=self.dev),
            )
        pos = t.searchsorted(self.keys, keys).clamp_(max=self.size - 1)
        hit = self.keys[pos] == keys
        return t.where(hit, self.rows[pos], t.full_like(pos, -1)), hit

    def insert(self, keys):
        t = self.torch
        uniq, inverse = t.unique(keys, return_inverse=True)  # (U,) sorted, (N,)
        urows, hit = self._lookup(uniq)
        new = ~hit
        n_new = int(new.sum())
        if n_new:
            urows[new] = t.arange(self.size, self.size + n_new, dtype=t.int64, device=self.dev)
            merged, order = t.sort(t.cat([self.keys, uniq[new]]))
            self.keys, self.rows = merged, t.cat([self.rows, urows[new]])[order]
            self.size += n_new
        return urows[inverse]

    def find(self, keys):
        return self._lookup(keys)[0]


def hash_keys(dist: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n,) uint64 batch keys: 'uniform' over [0, 2**63), or 'power-law' (alpha 1.2 over 10 n keys,
    HugeCTR's generator) — many repeats, like a Criteo slot."""
    if dist == "uniform":
        return rng.integers(0, 2**63 - 1, n, dtype=np.int64).view(np.uint64)
    from numbactr.data.synthetic import power_law_keys

    return power_law_keys(rng, n, 10 * n, 1.2).astype(np.uint64)


def fixed_table(env: Env, max_rows: int, load_factor: float):
    """numbactr's fixed (never evicting) key -> row table on the path the engine's keyed tables take on this
    device: the kernels (gpu/sim), else the compiled CPU table (or the NumPy reference where the cpu device
    runs its references only). Also measured by ``numbactr bench hkv``."""
    from numbactr.embedding.hash_table import HashTable
    from numbactr.runtime import device

    compiled = not env.kernels and device.compiled_cpu()
    return HashTable(max_rows, load_factor=load_factor, use_kernels=env.kernels, xp=env.xp, compiled=compiled)


def table_path(env: Env) -> str:
    """Which code numbactr's tables run on this device, in words (for a table's notes)."""
    from numbactr.runtime import device

    if env.kernels:
        return "numba.cuda kernels"
    return "compiled CPU code" if device.compiled_cpu() else "the NumPy reference"


def bench_hash(env: Env, *, n: int, load_factor: float = 0.75, min_time: float = 1.0, seed: int = 0) -> Table:
    tab = Table(f"hash table insert/find ({env.kind})", HASH_COLUMNS)
    tab.notes = env.header() + [
        f"batch of {n:,} keys; table rows = the batch's distinct keys, capacity = rows / {load_factor} "
        f"(load factor {load_factor} once the batch is in)",
        "insert-new: empty table (cleared outside the timer); insert-known: every key already present "
        "(the steady training state); find: every key present",
        "Mkeys/s = batch keys (duplicates included) / median time",
        f"numbactr: the table the engine's keyed tables use on this device ({table_path(env)})",
        "torch: torch.unique dedup + sorted keys with searchsorted (re-sorted on insert)",
    ]
    rng = np.random.default_rng(seed)
    for dist in ("uniform", "power-law"):
        keys_h = hash_keys(dist, n, rng)  # (N,) uint64
        distinct = int(np.unique(keys_h).size)
        keys = env.xp.asarray(keys_h)
        table = fixed_table(env, distinct, load_factor)
        inserted = {}

        def insert():
            inserted["rows"] = table.insert(keys)

        t_new = measure(insert, sync=env.sync, setup=table.clear, min_time=min_time)
        t_known = measure(insert, sync=env.sync, min_time=min_time)
        t_find = measure(lambda: table.find(keys), sync=env.sync, min_time=min_time)
        found = np.asarray(_host(table.find(keys)))
        if table.size != distinct or not np.array_equal(found, _host(inserted["rows"])):
            raise AssertionError(f"bench hash: numbactr table disagrees with itself ({dist})")
        for op, t in (("insert-new", t_new), ("insert-known", t_known), ("find", t_find)):
            tab.add("numbactr", dist, op, n, distinct, table.capacity, 1e3 * t, n / t / 1e6)

        if env.torch is not None:
            torch = env.torch
            tkeys = torch.from_numpy(keys_h.view(np.int64)).to(env.torch_dev)
            idx = TorchKeyIndex(torch, env.torch_dev)
            out = {}

            def tinsert():
                out["rows"] = idx.insert(tkeys)

            s_new = measure(tinsert, sync=env.torch_sync, setup=idx.clear, min_time=min_time)
            s_known = measure(tinsert, sync=env.torch_sync, min_time=min_time)
            s_find = measure(lambda: idx.find(tkeys), sync=env.torch_sync, min_time=min_time)
            if idx.size != distinct or not torch.equal(idx.find(tkeys), out["rows"]):
                raise AssertionError(f"bench hash: torch key index disagrees with itself ({dist})")
            for op, t in (("insert-new", s_new), ("insert-known", s_known), ("find", s_find)):
                tab.add(env.torch_label, dist, op, n, distinct, "-", 1e3 * t, n / t / 1e6)
        table = keys = None  # free this size's table and keys before the next
    return tab
