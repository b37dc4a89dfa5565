"""The hierarchical parameter server (HugeCTR's HPS): an embedding cache on the device in front of a
volatile and a persistent database.

    ps = ParameterServer(ParameterServerConfig(...))     # fills the tiers from the sparse model folders
    cache = ps.cache(model_name)                        # that model's embedding cache
    rows = cache.lookup(t, keys, block)                 # table t's vectors of keys into block rows
    ps.lookup(model_name, t, keys)                      # the databases alone: (values, found)
    HPS(ps_config | "hps.json").lookup(keys, model_name, table_id)   # HugeCTR's Python HPS: (n, D)
    HPS(...).lookup_fromdlpack(keys, out_tensor, model_name, table_id)  # into a DLPack tensor, in place

One request for table t with keys (U,) distinct, as HugeCTR's EmbeddingCache::lookup does it:
  1. device cache (use_gpu_embedding_cache; RAM on the cpu device): numbactr.embedding.cache.EmbeddingCache
     (slots, LRU) over the rows of a key -> row hash table; its slots' vectors live in a (C_t, stride)
     buffer. hit rate = cached keys / U.
  2. hit rate < hit_rate_threshold: the misses are fetched from the databases at once, merged into the
     answer and inserted into the cache (evicting the least recently used slots no key of this request
     holds). hit rate >= hit_rate_threshold: the misses answer with the table's default value for this
     request (HugeCTR's asynchronous mode) and are fetched and inserted right after it (HugeCTR inserts
     them on a worker thread; numbactr before the next request, so runs are reproducible). With the
     threshold 1.0, as NVIDIA's tests use it (or any threshold > 1), every answer is exact.
  3. databases (HierParameterServer::lookup): the volatile tier, then for its misses the persistent tier
     (with cache_missed_embeddings, what it found is copied up into the volatile tier); a key no tier
     holds gets default_value_for_each_table. Such keys are not cached (HugeCTR caches the default).
At start every table is read from its sparse model folder (numbactr.files.checkpoint's reader and checks) into
the tiers whose initialize_after_startup is set, every key into each, as HugeCTR does (the volatile one
takes only the first initial_cache_rate x its capacity of a table larger than its capacity, overflow_margin
x num_partitions, and only when a persistent tier filled at start holds them all: _volatile_share); the
cache starts empty, or, with cache_refresh_percentage_per_iteration > 0 and init_ec, holds the
first keys of each file. refresh_embedding_cache() reads every cached key again from the databases in
steps of that percentage of the cache, so a cache follows tiers that another process updated.

On the cpu device a warm request (every key known and cached, the usual case) takes one compiled pass
instead (serve_pooled, kernels/hash_table_cpu.serve_cached_cpu): find, read the slots, stamp them used, and
pool the bags straight from the cache's buffer with the embedding engine's compiled pooling, with the same
sums, counts and LRU state as the path above and no copy of the rows into a block.

A key whose vector no tier has and whose default is 0 comes back as row -1: the embedding engine then adds
nothing for it but still counts it in a mean, exactly what training's evaluation does with an unseen key,
so predictions equal the trained model's bit for bit.
"""

from __future__ import annotations

import ctypes
import math
import os
import weakref
from dataclasses import dataclass

import numpy as np

from numbactr.runtime import device
from numbactr import log
from numbactr.files.checkpoint import read_sparse_model
from numbactr.embedding.cache import EmbeddingCache
from numbactr.embedding.hash_table import HashTable
from numbactr.kernels import cache as KC
from numbactr.kernels.hash_table_cpu import first_occurrences
from numbactr.kernels.hash_table_cpu import serve_cached_cpu as _serve_cached_cpu
from numbactr.inference.backends import make_persistent, make_volatile
from numbactr.inference.hps_update import apply_update
from numbactr.inference.params import ParameterServerConfig, make_tag_name

__all__ = ["ParameterServer", "ModelCache", "HPS", "TierStats", "SLAB", "lane_stride"]

SLAB = 64  # HugeCTR's cache unit: SLAB_SIZE 32 x SET_ASSOCIATIVITY 2 keys
_FIRST_ROWS = 1024  # rows of a cache's key -> row table before it doubles


def lane_stride(dim: int) -> int:
    """The padded row width of a float32 table of width dim (the embedding engine's 16-byte rows)."""
    return -(-dim // 4) * 4


@dataclass
class TierStats:
    """Keys asked of a database tier and keys it had, since the server started."""

    queried: int = 0
    found: int = 0


class ParameterServer:
    """HugeCTR's HierParameterServer for the models of a ParameterServerConfig (module docstring)."""

    def __init__(self, config: ParameterServerConfig):
        self.config = config
        self.volatile = self.persistent = None
        self.stats = {"volatile": TierStats(), "persistent": TierStats()}
        self.key_counts: dict[str, list] = {}
        self._caches: dict[str, ModelCache] = {}
        try:
            self.volatile = make_volatile(config.volatile_db)
            self.persistent = make_persistent(config.persistent_db)
            first = {name: self._load(name, m) for name, m in config.models.items()}
            if self.volatile is None and self.persistent is None:
                log.warn(
                    "HPS: volatile_db and persistent_db are both Disabled: every embedding is its table's default value"
                )
            for name, m in config.models.items():
                self._caches[name] = ModelCache(self, name, m, self.key_counts[name], first[name])
        except BaseException:
            self.close()
            raise
        self._finalizer = weakref.finalize(self, _close, [self.volatile, self.persistent])

    def _load(self, name: str, m) -> list:
        """Count each table's keys and fill the tiers that initialize at start; returns per table the
        first keys of its file (what init_ec puts in the cache)."""
        p, counts, first = m.params, [], []
        vol, per = self.config.volatile_db, self.config.persistent_db
        fill_vol = self.volatile is not None and vol.initialize_after_startup
        fill_per = self.persistent is not None and per.initialize_after_startup
        for t, (table, folder, vec) in enumerate(zip(m.names, m.files, m.vec_sizes)):
            what = f"model {name!r} table {table!r} (sparse_model_files[{t}])"
            need_keys = (
                fill_vol
                or fill_per
                or (p.use_gpu_embedding_cache and p.init_ec and p.cache_refresh_percentage_per_iteration > 0)
            )
            if not need_keys:
                key_file = os.path.join(folder, "key")
                if not os.path.isfile(key_file):
                    raise FileNotFoundError(f"HPS: {what}: the sparse model folder {folder!r} has no key file")
                counts.append(os.path.getsize(key_file) // 8)
                first.append(np.zeros(0, np.uint64))
                continue
            keys, vectors = read_sparse_model(folder, table, vec)
            if not p.i64_input_key and keys.size and int(keys.max()) >= 2**32:
                i = int(np.argmax(keys >= 2**32))
                raise ValueError(
                    f"HPS: {what}: key {int(keys[i])} at position {i} of {folder!r} does not fit the "
                    "32-bit keys of i64_input_key=False"
                )
            counts.append(int(keys.shape[0]))
            first.append(keys)
            tag = make_tag_name(name, table)
            if fill_vol:
                n = self._volatile_share(what, keys.shape[0], fill_per)
                self.volatile.insert(tag, keys[:n], vectors[:n])
            if fill_per:
                self.persistent.insert(tag, keys, vectors)
        self.key_counts[name] = counts
        return first

    def _volatile_share(self, what: str, num_key: int, home: bool) -> int:
        """How many of a table's num_key keys (file order) the volatile tier takes at start. HugeCTR
        (HierParameterServer::update_database_per_model) inserts every key; initial_cache_rate only enters
        when the table exceeds the tier's capacity (VolatileBackend::capacity: overflow_margin x
        num_partitions, at least overflow_margin; unlimited by default), as round(rate x capacity) keys,
        and the tier's overflow handling then keeps about that many. numbactr has no overflow handling, so
        it takes that share only when a persistent database filled at start (`home`) holds every key;
        otherwise the volatile tier is the keys' only home and takes them all."""
        vol = self.config.volatile_db
        margin = int(vol.overflow_margin)
        capacity = max(margin * int(vol.num_partitions), margin)
        if num_key <= capacity:
            return num_key
        amount = min(num_key, int(vol.initial_cache_rate * capacity + 0.5))
        if home:
            log.info(
                f"HPS: {what}: {num_key} keys exceed the volatile database's capacity {capacity} "
                f"(overflow_margin x num_partitions); it takes the first {amount} (initial_cache_rate "
                f"{vol.initial_cache_rate}), the persistent database all of them"
            )
            return amount
        log.warn(
            f"HPS: {what}: {num_key} keys exceed the volatile database's capacity {capacity} "
            "(overflow_margin x num_partitions), but no persistent database filled at start holds them: "
            "the volatile database keeps every key (numbactr has no overflow handling)"
        )
        return num_key

    def cache(self, model_name: str) -> "ModelCache":
        """The embedding cache of a model (HugeCTR's get_embedding_cache)."""
        if model_name not in self._caches:
            raise KeyError(f"HPS: no model named {model_name!r}; models: {sorted(self._caches)}")
        return self._caches[model_name]

    def lookup(self, model_name: str, t: int, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values (n, D) float32, found (n,) bool) of table t's keys (n,) uint64 in the databases: the
        volatile tier, then the persistent one for what it misses (zeros where no tier has the key)."""
        m = self.config.models[model_name]
        tag, width = make_tag_name(model_name, m.names[t]), m.vec_sizes[t]
        values, found = np.zeros((keys.shape[0], width), np.float32), np.zeros(keys.shape[0], bool)
        rest = np.arange(keys.shape[0])
        for name, db in (("volatile", self.volatile), ("persistent", self.persistent)):
            if db is None or rest.size == 0:
                continue
            v, f = db.fetch(tag, keys[rest], width)
            self.stats[name].queried += int(rest.size)
            self.stats[name].found += int(f.sum())
            values[rest[f]], found[rest[f]] = v[f], True
            if (
                name == "persistent"
                and self.volatile is not None
                and f.any()
                and self.config.volatile_db.cache_missed_embeddings
            ):
                self.volatile.insert(tag, keys[rest[f]], v[f])
            rest = rest[~f]
        return values, found

    def refresh_embedding_cache(self, model_name: str, device_id: int = 0) -> None:
        self.cache(model_name).refresh()

    def update(self, model_name: str, table, keys, values, evicted=None) -> None:
        """Rows in, evicted keys out of the tiers and the cache (numbactr.inference.hps_update)."""
        apply_update(self, model_name, table, keys, values, evicted)

    def close(self) -> None:
        """Close the database connections (a RocksDB is flushed and unlocked)."""
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
        else:
            _close([self.volatile, self.persistent])


def _close(dbs) -> None:
    for db in dbs:
        if db is not None:
            db.close()


class ModelCache:
    """One model's embedding cache (HugeCTR's EmbeddingCache; module docstring). Tables in graph order."""

    def __init__(self, ps: ParameterServer, name: str, m, key_counts: list, first_keys: list):
        self.ps, self.name, self.tables = ps, name, m
        p = m.params
        self.params = p
        self.defaults = p.default_values(len(m.names))
        self.dims = list(m.vec_sizes)
        self.strides = [lane_stride(d) for d in self.dims]
        self.queried = [0] * len(self.dims)  # distinct keys asked per table
        self.hits = [0] * len(self.dims)  # of them found in the cache
        self.enabled = bool(p.use_gpu_embedding_cache)
        if not self.enabled:
            return
        self.kernels = device.uses_kernels()
        self.xp = device.xp() if self.kernels else np
        self.capacities = [SLAB * math.ceil(max(p.cache_size_percentage * n, SLAB) / SLAB) for n in key_counts]
        self.index = [self._new_index(_FIRST_ROWS) for _ in self.dims]
        self.cache = EmbeddingCache(self.capacities, [_FIRST_ROWS] * len(self.dims), "lru", use_kernels=self.kernels)
        self.buffers = [self.xp.zeros((c, s), np.float32) for c, s in zip(self.capacities, self.strides)]
        if p.cache_refresh_percentage_per_iteration > 0 and p.init_ec:
            for t, keys in enumerate(first_keys):
                self._insert(t, keys[: self.capacities[t]])

    def _new_index(self, rows: int) -> HashTable:
        return HashTable(rows, use_kernels=self.kernels, xp=self.xp, compiled=not self.kernels)

    @property
    def hit_rates(self) -> list:
        """Per table: the share of the distinct keys asked since start that the cache held."""
        return [h / q if q else 0.0 for h, q in zip(self.hits, self.queried)]

    # ---- a request -----------------------------------------------------------------------------------
    def lookup(self, t: int, keys: np.ndarray, block) -> np.ndarray:
        """Put table t's vectors of keys (U,) uint64 (distinct, host) into rows of block (>= U rows of
        stride_t float32, a device array); returns the block row of each key (U,) int64 host, -1 for a key
        with no vector whose default is 0 (the engine then adds nothing for it)."""
        u = keys.shape[0]
        rows_of = np.full(u, -1, np.int64)
        self.queried[t] += u
        if not self.enabled:
            values, found = self.ps.lookup(self.name, t, keys)
            return self._answer(t, values, found, np.arange(u), block, 0, rows_of)
        xp = self.xp
        lin = self.index[t].find(xp.asarray(keys))
        slot = xp.where(lin >= 0, self.cache.row_slot[xp.maximum(lin, 0) + int(self.cache.row_offsets[t])], -1)
        hit = device.to_host(slot >= 0) if self.kernels else slot >= 0
        return self._serve(t, keys, lin, slot, hit, block, rows_of)

    def lookup_occurrences(self, t: int, keys: np.ndarray, block_for) -> np.ndarray:
        """Table t's vectors of a request's keys (N,) uint64 (host, duplicates allowed): block_for(rows) gives
        a block of at least that many rows (stride_t), which receives the distinct keys' vectors; returns
        the block row of every occurrence (N,) int64 (-1 as in lookup). The same answer, statistics and
        cache changes as lookup() of the distinct keys; on the cpu device without a sort of the keys: the
        cache's key -> row table finds every occurrence and the rows are de-duplicated in one pass in order
        of first occurrence (only keys the table does not know are sorted, to de-duplicate them)."""
        if not self.enabled or self.kernels:
            uniq, inv = np.unique(keys, return_inverse=True)
            block = block_for(uniq.shape[0] + 1)  # + 1: the row of a non-zero default value
            return self.lookup(t, uniq, block)[inv.reshape(-1)]
        n = keys.shape[0]
        index = self.index[t]
        lin = index.find(keys)  # (N,) index row, -1 unknown key
        mark = self._marks(t)
        uniq, first, occ = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
        u = int(first_occurrences(lin, mark, uniq, first, occ))
        uniq, first = uniq[:u], first[:u]
        slot = self.cache.row_slot[uniq + int(self.cache.row_offsets[t])]
        if not (lin < 0).any() and (slot >= 0).all():
            # every key known and cached (a warm cache's usual request): _serve's hit path with the distinct
            # keys in order of first occurrence, whose block rows are then 0..u-1, so each occurrence's
            # block row is its distinct key's position, occ
            self.queried[t] += u
            self.hits[t] += u
            block = block_for(u + 1)
            self._rows_from(self.buffers[t], slot - int(self.cache.slot_offsets[t]), block[:u])
            self._touch(t, uniq)
            return occ
        unknown = np.flatnonzero(lin < 0)
        if unknown.size:
            new_keys, new_inv = np.unique(keys[unknown], return_inverse=True)
        else:
            new_keys, new_inv = keys[:0], None
        # the distinct keys as lookup() orders them where it matters: the misses ascending (which of them
        # the cache takes when it cannot take all, and the rows they get, follow that order)
        hit = slot >= 0
        h = int(hit.sum())
        miss_keys = np.concatenate([keys[first[~hit]], new_keys])
        order = np.argsort(miss_keys, kind="stable")
        d_keys = np.concatenate([keys[first[hit]], miss_keys[order]])
        d_lin = np.concatenate([uniq[hit], np.concatenate([uniq[~hit], np.full(new_keys.size, -1, np.int64)])[order]])
        d_slot = np.concatenate([slot[hit], np.full(miss_keys.size, -1, np.int64)])
        self.queried[t] += int(d_keys.shape[0])
        block = block_for(d_keys.shape[0] + 1)
        rows_of = self._serve(t, d_keys, d_lin, d_slot, d_slot >= 0, block, np.full(d_keys.shape[0], -1, np.int64))
        rank = np.empty(miss_keys.size, np.int64)
        rank[order] = np.arange(miss_keys.size)  # position of miss j in d_keys, less h
        at = np.empty(u, np.int64)  # position of uniq[i] in d_keys
        at[hit] = np.arange(h)
        at[~hit] = h + rank[: u - h]
        out = np.empty(n, np.int64)
        known = occ >= 0
        out[known] = rows_of[at[occ[known]]]
        if unknown.size:
            out[unknown] = rows_of[h + rank[u - h + new_inv.reshape(-1)]]
        return out

    def serve_pooled(self, t: int, keys: np.ndarray, offsets: np.ndarray, mean: bool):
        """A warm request's fast path on the cpu device: the pooled bags (J, D_t) float32 of table t's keys
        (N,) uint64 and CSR offsets (J + 1,) int64, read straight from the cache's vectors in one compiled
        pass (kernels/hash_table_cpu.serve_cached_cpu), when every key is known and cached; None otherwise
        (nothing changed: the caller takes lookup_occurrences and pools the block). The same answer, hit
        statistics and LRU state as that path: the pooling is the engine's own compiled code."""
        if not self.enabled or self.kernels:
            return None
        n = keys.shape[0]
        offsets = np.ascontiguousarray(offsets, np.int64)
        tkeys, trows = self.index[t].probe_arrays()
        scratch = getattr(self, "_serve_scratch", None)
        if scratch is None or scratch.shape[0] < n:
            scratch = self._serve_scratch = np.empty(max(n, 1024), np.int64)
        out = np.empty((offsets.shape[0] - 1, self.dims[t]), np.float32)
        cache = self.cache
        u = _serve_cached_cpu(
            tkeys,
            trows,
            keys,
            offsets,
            cache.row_slot,
            int(cache.row_offsets[t]),
            int(cache.slot_offsets[t]),
            self.buffers[t].reshape(-1),
            self.strides[t],
            self.dims[t],
            bool(mean),
            scratch,
            cache.stamp,
            cache.freq,
            cache.clock + 1,
            np.empty(self.dims[t], np.float32),
            out.reshape(-1),
        )
        if u < 0:
            return None
        cache.clock += 1  # the stamp the pass gave the request's rows (touch_cached's tick)
        self.queried[t] += u
        self.hits[t] += u
        return out

    def _marks(self, t: int) -> np.ndarray:
        """Table t's scratch for first_occurrences: -1 for every row of its key -> row table."""
        marks = getattr(self, "_mark_arrays", None)
        if marks is None:
            marks = self._mark_arrays = {}
        need = self.index[t].max_rows
        if t not in marks or marks[t].shape[0] < need:
            marks[t] = np.full(need, -1, np.int64)
        return marks[t]

    def _serve(self, t: int, keys, lin, slot, hit, block, rows_of) -> np.ndarray:
        """The rest of lookup: keys (U,) distinct with their index rows lin, cache slots slot and hit flags;
        the hits are copied into block rows 0.., the misses answered (and cached) after them."""
        xp = self.xp
        u = keys.shape[0]
        h = int(hit.sum())
        self.hits[t] += h
        hit_pos, miss_pos = np.flatnonzero(hit), np.flatnonzero(~hit)
        if h:
            self._rows_from(self.buffers[t], slot[xp.asarray(hit_pos)] - int(self.cache.slot_offsets[t]), block[:h])
            rows_of[hit_pos] = np.arange(h)
            self._touch(t, lin[xp.asarray(hit_pos)])
        if not miss_pos.size:
            return rows_of
        if h / u >= self.params.hit_rate_threshold:  # HugeCTR's asynchronous mode: defaults now
            found = np.zeros(miss_pos.size, bool)
            self._answer(t, None, found, miss_pos, block, h, rows_of)
            self._insert(t, keys[miss_pos], keep=lin[xp.asarray(hit_pos)])
            return rows_of
        values, found = self.ps.lookup(self.name, t, keys[miss_pos])
        self._answer(t, values, found, miss_pos, block, h, rows_of)
        self._cache(t, keys[miss_pos][found], values[found], keep=lin[xp.asarray(hit_pos)])
        return rows_of

    def _answer(self, t, values, found, pos, block, start: int, rows_of) -> np.ndarray:
        """Rows start.. of block take the found values of keys[pos], then (default != 0) one row of the
        default value for the keys not found; rows_of[pos] says which row each key reads."""
        n_found = int(found.sum())
        if n_found:
            block[start : start + n_found, : self.dims[t]] = self._dev(values[found])
            rows_of[pos[found]] = start + np.arange(n_found)
        if n_found < pos.size and self.defaults[t] != 0.0:
            block[start + n_found, : self.dims[t]] = self.defaults[t]
            rows_of[pos[~found]] = start + n_found
        return rows_of

    def _dev(self, a):
        return device.xp().asarray(a)

    def _touch(self, t: int, lin) -> None:
        """The hits of a request (distinct rows, all cached) are used now (LRU): nothing moves."""
        self.cache.touch_cached(lin + int(self.cache.row_offsets[t]))

    def _insert(self, t: int, keys: np.ndarray, keep=None) -> None:
        """Fetch keys (distinct, not cached) from the databases and cache those found."""
        if keys.size:
            values, found = self.ps.lookup(self.name, t, keys)
            self._cache(t, keys[found], values[found], keep)

    def _cache(self, t: int, keys: np.ndarray, values: np.ndarray, keep=None) -> None:
        """Insert keys (m,) with values (m, D) into table t's cache: as many as there are slots beside the
        rows `keep` of this request (which stay), the least recently used slots giving way."""
        xp = self.xp
        n_keep = 0 if keep is None else int(keep.shape[0])
        m = min(keys.shape[0], self.capacities[t] - n_keep)
        if m <= 0:
            return
        keys, values = keys[:m], values[:m]
        index = self._grow(t, self.index[t].size + m)
        lin = index.insert(xp.asarray(keys)) + int(self.cache.row_offsets[t])
        batch = lin if keep is None else xp.concatenate([keep + int(self.cache.row_offsets[t]), lin])
        plan = self.cache.place(batch, count=False)
        # plan.misses are the new rows, ascending; their victims are the slots they now hold
        order = np.argsort(device.to_host(lin) if self.kernels else lin, kind="stable")
        src = np.zeros((m, self.strides[t]), np.float32)
        src[:, : self.dims[t]] = values[order]
        self._rows_to(self.buffers[t], plan.victims - self.cache.slot_offsets[t], src)
        self.cache.finish(plan)

    def _grow(self, t: int, need: int) -> HashTable:
        """Table t's key -> row table with room for `need` keys (doubling; rows kept) and the cache's row
        space with it."""
        index = self.index[t]
        if need > index.max_rows:
            cap = index.max_rows
            while cap < need:
                cap *= 2
            bigger = self._new_index(cap)
            if index.size:
                bigger.insert(index.keys_by_row())
            self.index[t] = index = bigger
            self.cache.grow_rows(t, cap)
        return index

    def _rows_from(self, buf, idx, out) -> None:
        """out (n, stride) <- buf[idx] (device arrays)."""
        if self.kernels:
            KC.gather_rows(buf, self.xp.ascontiguousarray(idx), out)
        else:
            np.take(buf, idx, axis=0, out=out)  # no temporary of the gathered rows

    def _rows_to(self, buf, idx: np.ndarray, src: np.ndarray) -> None:
        """buf[idx] <- src (n, stride) host rows."""
        if self.kernels:
            KC.scatter_rows(buf, self.xp.asarray(idx), self.xp.asarray(src))
        else:
            buf[idx] = src

    # ---- refresh -------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """HugeCTR's refresh_embedding_cache: every cached key's vector read again from the databases, in
        steps of cache_refresh_percentage_per_iteration of a table's slots (nothing, with a warning, when
        the cache is off or that percentage is 0, as in HugeCTR)."""
        pct = self.params.cache_refresh_percentage_per_iteration
        if not self.enabled:
            log.warn(
                f"HPS model {self.name!r}: the embedding cache is not enabled (use_gpu_embedding_cache) and "
                "cannot be refreshed"
            )
            return
        if pct <= 0:
            log.warn(
                f"HPS model {self.name!r}: cache_refresh_percentage_per_iteration must be > 0 to refresh the "
                "embedding cache"
            )
            return
        slots, rows, _ = self.cache.held()
        for t in range(len(self.dims)):
            lo, hi = self.cache.slot_offsets[t], self.cache.slot_offsets[t + 1]
            mine = (slots >= lo) & (slots < hi)
            local_slots = slots[mine] - lo
            keys = device.to_host(self.index[t].keys_by_row())[rows[mine] - self.cache.row_offsets[t]]
            step = max(1, int(pct * self.capacities[t]))
            for a in range(0, keys.size, step):
                values, found = self.ps.lookup(self.name, t, keys[a : a + step])
                src = np.zeros((int(found.sum()), self.strides[t]), np.float32)
                src[:, : self.dims[t]] = values[found]
                self._rows_to(self.buffers[t], local_slots[a : a + step][found], src)


class HPS:
    """``hugectr.inference.HPS``: direct lookups in the parameter server.

    HPS(ps_config) with a ParameterServerConfig, or HPS(hps_json_config_file) with HugeCTR's HPS JSON.
    lookup(h_keys, model_name, table_id, device_id=0) -> (n, D) float32: each key's vector through that
    model's embedding cache and the databases (default_value_for_each_table where none has it).
    lookup_fromdlpack(keys, out_tensor, model_name, table_id, device_id=0): the same into a DLPack tensor.
    """

    def __init__(self, ps_config=None, *, hps_json_config_file: str | None = None):
        source = hps_json_config_file if ps_config is None else ps_config
        if isinstance(source, (str, os.PathLike)):
            source = ParameterServerConfig.from_json(os.fspath(source))
        if not isinstance(source, ParameterServerConfig):
            raise TypeError(f"HPS: expected a ParameterServerConfig or an HPS JSON path, got {source!r}")
        self.config = source
        self.ps = ParameterServer(source)
        self._blocks: dict = {}

    def lookup(self, h_keys, model_name: str, table_id: int, device_id: int = 0) -> np.ndarray:
        m, t = self._table(model_name, table_id, "HPS.lookup")
        keys = check_keys(h_keys, m.params.i64_input_key, "HPS.lookup h_keys")
        return self._lookup(keys, model_name, m, t, "HPS.lookup")

    def lookup_fromdlpack(self, keys, out_tensor, model_name: str, table_id: int, device_id: int = 0) -> None:
        """HugeCTR's HPS.lookup_fromdlpack (include/pybind/hps_wrapper.hpp): table table_id's vectors of
        the keys written into out_tensor in place.

        keys and out_tensor are DLPack tensors: the capsules of ``torch.utils.dlpack.to_dlpack`` (HugeCTR's
        form; they are read, not consumed, so ``from_dlpack(out_capsule)`` afterwards sees the vectors) or
        objects with ``__dlpack__`` (a torch tensor, a NumPy array, a CuPy array), on the CPU or a CUDA
        device. keys: integers of any shape, read in row-major order (HugeCTR reads int64); out_tensor:
        C-contiguous float32 of any shape with at least len(keys) x embedding_vec_size elements, of which
        the first len(keys) x embedding_vec_size receive the vectors key after key (the rest are left as
        they are). device_id names HugeCTR's embedding cache of that device; numbactr has one cache.
        """
        m, t = self._table(model_name, table_id, "HPS.lookup_fromdlpack")
        who = "HPS.lookup_fromdlpack"
        with _DLPackView(keys, f"{who} keys", writable=False) as kv:
            if kv.array.dtype.kind not in "iu":
                raise TypeError(f"{who}: keys must be an integer tensor (HugeCTR reads int64), got {kv.array.dtype}")
            host_keys = kv.to_host()
        flat = check_keys(host_keys, m.params.i64_input_key, f"{who} keys")
        with _DLPackView(out_tensor, f"{who} out_tensor", writable=True) as ov:
            width = m.vec_sizes[t]
            need = flat.shape[0] * width
            if ov.array.dtype != np.float32:
                raise TypeError(f"{who}: out_tensor must be float32, got {ov.array.dtype}")
            if ov.array.size < need:
                raise ValueError(
                    f"{who}: out_tensor {tuple(ov.array.shape)} holds {ov.array.size} values; "
                    f"{flat.shape[0]} keys x embedding_vec_size {width} of table {t} = {need} needed "
                    "(HugeCTR: out_tensor must hold at least number of keys x embedding vector size)"
                )
            if not ov.contiguous:
                raise ValueError(
                    f"{who}: out_tensor {tuple(ov.array.shape)} is not C-contiguous; the vectors are "
                    "written key after key into its memory (pass a contiguous tensor)"
                )
            vectors = self._lookup(flat, model_name, m, t, who)
            ov.write_flat(vectors.reshape(-1))

    def _table(self, model_name: str, table_id, who: str):
        m = self.config.models.get(model_name)
        if m is None:
            raise KeyError(
                f"{who}: the model name {model_name!r} does not exist in HPS; models: {sorted(self.config.models)}"
            )
        if not 0 <= int(table_id) < len(m.names):
            raise IndexError(f"{who}: model {model_name!r} has tables 0..{len(m.names) - 1}, not {table_id}")
        return m, int(table_id)

    def _lookup(self, keys: np.ndarray, model_name: str, m, t: int, who: str) -> np.ndarray:
        """(n, D) float32 of table t's keys (n,) uint64 (checked)."""
        most = m.max_keys_per_sample[t] * m.params.max_batchsize
        if keys.shape[0] > most:
            raise ValueError(
                f"{who}: {keys.shape[0]} keys; at most maxnum_catfeature_query_per_table_per_sample"
                f"[{t}] x max_batchsize = {most} per lookup"
            )
        uniq, inv = np.unique(keys, return_inverse=True)
        cache = self.ps.cache(model_name)
        block = self._block(model_name, t, uniq.shape[0] + 1, cache.strides[t])
        rows = cache.lookup(t, uniq, block)
        out = np.zeros((uniq.shape[0], cache.dims[t]), np.float32)
        have = rows >= 0
        out[have] = device.to_host(block[: uniq.shape[0] + 1])[rows[have], : cache.dims[t]]
        return out[inv.reshape(-1)]

    def _block(self, model: str, t: int, rows: int, stride: int):
        """A reusable (>= rows, stride) device buffer for one table's answers."""
        b = self._blocks.get((model, t))
        if b is None or b.shape[0] < rows:
            b = self._blocks[(model, t)] = device.xp().zeros((max(rows, 1024), stride), np.float32)
        return b


# ---- DLPack (HPS.lookup_fromdlpack) -------------------------------------------------------------------
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_DL_CODES = {0: "i", 1: "u", 2: "f"}  # kDLInt, kDLUInt, kDLFloat (bfloat16, complex: refused)
_DL_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY


def _capsule_api():
    api = ctypes.pythonapi
    api.PyCapsule_IsValid.restype, api.PyCapsule_IsValid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_GetName.restype, api.PyCapsule_GetName.argtypes = ctypes.c_char_p, [ctypes.py_object]
    return api


class _DLPackView:
    """A view of a DLPack tensor's memory (a capsule, read without consuming it, or an object with
    __dlpack__): .array is a NumPy array over host memory, or over a CUDA device's memory a numba device
    array (.on_gpu). Used inside a with block: the exporter's capsule stays alive until it ends."""

    def __init__(self, obj, what: str, writable: bool):
        self.what, self.capsule, self.on_gpu, self.contiguous = what, None, False, True
        if isinstance(obj, np.ndarray):
            if writable and not obj.flags.writeable:
                raise ValueError(f"{what}: the array is read-only")
            self.array, self.contiguous = obj, bool(obj.flags.c_contiguous)
            return
        if type(obj).__name__ == "PyCapsule":
            self.capsule = obj
        elif hasattr(obj, "__dlpack__"):
            try:
                self.capsule = obj.__dlpack__()
            except Exception as e:  # noqa: BLE001 (each exporter raises its own kind)
                raise TypeError(f"{what}: {type(obj).__name__} cannot be exported through DLPack: {e}") from None
        else:
            raise TypeError(
                f"{what}: expected a DLPack capsule (torch.utils.dlpack.to_dlpack(t)) or a tensor with "
                f"__dlpack__ (torch, NumPy, CuPy), got {type(obj).__name__}"
            )
        self._parse(writable)

    def _parse(self, writable: bool) -> None:
        api, cap, what = _capsule_api(), self.capsule, self.what
        if api.PyCapsule_IsValid(cap, b"dltensor"):
            dl = _DLManagedTensor.from_address(api.PyCapsule_GetPointer(cap, b"dltensor")).dl_tensor
        elif api.PyCapsule_IsValid(cap, b"dltensor_versioned"):
            managed = _DLManagedTensorVersioned.from_address(api.PyCapsule_GetPointer(cap, b"dltensor_versioned"))
            if writable and managed.flags & _DL_READ_ONLY:
                raise ValueError(f"{what}: the DLPack tensor is read-only")
            dl = managed.dl_tensor
        else:
            name = api.PyCapsule_GetName(cap)
            used = name is not None and name.startswith(b"used_")
            raise ValueError(
                f"{what}: "
                + (
                    "the DLPack capsule was already consumed (a capsule can be turned into "
                    "a tensor once; pass a fresh to_dlpack() capsule)"
                    if used
                    else f"the capsule is not a DLPack tensor (its name is {name!r})"
                )
            )
        code, bits, lanes = dl.dtype.code, dl.dtype.bits, dl.dtype.lanes
        if code not in _DL_CODES or lanes != 1 or bits not in (8, 16, 32, 64):
            raise TypeError(f"{what}: unsupported DLPack dtype (code {code}, {bits} bits, {lanes} lanes)")
        dtype = np.dtype(f"<{_DL_CODES[code]}{bits // 8}")
        shape = tuple(int(dl.shape[i]) for i in range(dl.ndim))
        compact = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            compact[i] = compact[i + 1] * shape[i + 1]
        strides = compact if not dl.strides else [int(dl.strides[i]) for i in range(dl.ndim)]
        if any(s < 0 for s in strides):
            raise ValueError(f"{what}: negative strides are not supported")
        n = math.prod(shape)
        self.contiguous = n == 0 or all(st == c for st, c, d in zip(strides, compact, shape) if d > 1)
        span = 0 if n == 0 else (sum((d - 1) * st for d, st in zip(shape, strides)) + 1) * dtype.itemsize
        ptr = (dl.data or 0) + int(dl.byte_offset)
        kind = dl.device.device_type
        byte_strides = tuple(st * dtype.itemsize for st in strides)
        if kind in (_DL_CPU, _DL_CUDA_HOST, _DL_CUDA_MANAGED):
            buf = (ctypes.c_char * span).from_address(ptr) if span else bytearray(0)
            self.array = np.ndarray(shape, dtype, buffer=buf, strides=byte_strides if n else None)
        elif kind == _DL_CUDA:
            try:
                from numba import cuda

                if not cuda.is_available():
                    raise RuntimeError("no CUDA device")
            except Exception as e:  # noqa: BLE001
                raise ValueError(
                    f"{what}: the tensor is on CUDA device {dl.device.device_id}, but this process has no CUDA ({e})"
                ) from None
            self.on_gpu = True
            self.array = cuda.from_cuda_array_interface(
                {
                    "shape": shape,
                    "typestr": dtype.str,
                    "data": (ptr, not writable),
                    "version": 2,
                    "strides": byte_strides if n else None,
                },
                owner=cap,
                sync=False,
            )
        else:
            raise ValueError(f"{what}: DLPack device type {kind} is not supported (CPU or CUDA)")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.array = self.capsule = None

    def to_host(self) -> np.ndarray:
        """A host copy (or view) of the tensor, row-major order."""
        if self.on_gpu:
            return self.array.copy_to_host()
        return np.asarray(self.array)

    def write_flat(self, values: np.ndarray) -> None:
        """The first values.size elements of the (C-contiguous) tensor <- values (host, float32)."""
        if self.on_gpu:
            flat = self.array.reshape(self.array.size) if self.array.size else self.array
            if values.size:
                flat[: values.size].copy_to_device(np.ascontiguousarray(values))
            return
        self.array.reshape(-1)[: values.size] = values


def check_keys(keys, i64: bool, what: str) -> np.ndarray:
    """(n,) uint64 of integer keys: 32-bit keys (i64_input_key=False) must fit 32 bits, and -1 (2**64 - 1)
    is reserved; ValueError naming the first bad key and its position."""
    a = np.asarray(keys).reshape(-1)
    if a.size == 0:
        return np.zeros(0, np.uint64)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{what}: keys must be integers, got {a.dtype}")
    if not i64:
        bad = a.astype(np.uint64) >= 2**32
        if a.dtype.kind == "i":
            bad |= a < 0
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"{what}: key {int(a[i])} at position {i} does not fit the 32-bit keys of i64_input_key=False"
            )
    # 64-bit keys keep their bits (int64 -1 is 2**64 - 1), so a view serves; narrower ones are widened
    k = a.view(np.uint64) if a.dtype.itemsize == 8 and a.dtype.isnative else a.astype(np.uint64)
    reserved = k == np.uint64(2**64 - 1)
    if reserved.any():
        i = int(np.argmax(reserved))
        raise ValueError(f"{what}: key -1 at position {i} is reserved (2**64 - 1 marks empty hash-table slots)")
    return k
