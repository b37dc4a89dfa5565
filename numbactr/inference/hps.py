"""The hierarchical parameter server (HugeCTR's HPS): an embedding cache on the device in front of a
volatile and a persistent database.

    ps = ParameterServer(ParameterServerConfig(...))     # fills the tiers from the sparse model folders
    cache = ps.cache(model_name)                        # that model's embedding cache
    rows = cache.lookup(t, keys, block)                 # table t's vectors of keys into block rows
    ps.lookup(model_name, t, keys)                      # the databases alone: (values, found)
    HPS(ps_config | "hps.json").lookup(keys, model_name, table_id)   # HugeCTR's Python HPS: (n, D)

One request for table t with keys (U,) distinct, as HugeCTR's EmbeddingCache::lookup does it:
  1. device cache (use_gpu_embedding_cache; RAM on the cpu device): numbactr.embedding.cache.EmbeddingCache
     (slots, LRU) over the rows of a key -> row hash table; its slots' vectors live in a (C_t, stride)
     buffer. hit rate = cached keys / U.
  2. hit rate < hit_rate_threshold: the misses are fetched from the databases at once, merged into the
     answer and inserted into the cache (evicting the least recently used slots no key of this request
     holds). hit rate >= hit_rate_threshold: the misses answer with the table's default value for this
     request (HugeCTR's asynchronous mode) and are fetched and inserted right after it (HugeCTR inserts
     them on a worker thread; numbactr before the next request, so runs are reproducible). With the
     threshold 1.0, as NVIDIA's tests use it, every answer is exact.
  3. databases (HierParameterServer::lookup): the volatile tier, then for its misses the persistent tier
     (with cache_missed_embeddings, what it found is copied up into the volatile tier); a key no tier
     holds gets default_value_for_each_table. Such keys are not cached (HugeCTR caches the default).
At start every table is read from its sparse model folder (numbactr.checkpoint's reader and checks) into
the tiers whose initialize_after_startup is set (the volatile one takes the first initial_cache_rate of the
keys); the cache starts empty, or, with cache_refresh_percentage_per_iteration > 0 and init_ec, holds the
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

import math
import os
import weakref
from dataclasses import dataclass

import numpy as np

from .. import device, log
from ..checkpoint import read_sparse_model
from ..embedding.cache import EmbeddingCache
from ..embedding.hash_table import HashTable
from ..kernels import cache as KC
from ..kernels.hash_table_cpu import first_occurrences
from ..kernels.hash_table_cpu import serve_cached_cpu as _serve_cached_cpu
from .backends import make_persistent, make_volatile
from .params import ParameterServerConfig, make_tag_name

__all__ = ["ParameterServer", "ModelCache", "HPS", "TierStats", "SLAB", "lane_stride"]

SLAB = 64                  # HugeCTR's cache unit: SLAB_SIZE 32 x SET_ASSOCIATIVITY 2 keys
_FIRST_ROWS = 1024         # rows of a cache's key -> row table before it doubles


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
                log.warn("HPS: volatile_db and persistent_db are both Disabled: every embedding is its table's "
                         "default value")
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
            need_keys = fill_vol or fill_per or (p.use_gpu_embedding_cache and p.init_ec
                                                 and p.cache_refresh_percentage_per_iteration > 0)
            if not need_keys:
                key_file = os.path.join(folder, "key")
                if not os.path.isfile(key_file):
                    raise FileNotFoundError(f"HPS: {what}: the sparse model folder {folder!r} has no key file")
                counts.append(os.path.getsize(key_file) // 8)
                first.append(np.zeros(0, np.uint64))
                continue
            keys, vectors = read_sparse_model(folder, table, vec)
            if not p.i64_input_key and keys.size and int(keys.max()) >= 2 ** 32:
                i = int(np.argmax(keys >= 2 ** 32))
                raise ValueError(f"HPS: {what}: key {int(keys[i])} at position {i} of {folder!r} does not fit the "
                                 "32-bit keys of i64_input_key=False")
            counts.append(int(keys.shape[0]))
            first.append(keys)
            tag = make_tag_name(name, table)
            if fill_vol:
                n = math.ceil(vol.initial_cache_rate * keys.shape[0])
                self.volatile.insert(tag, keys[:n], vectors[:n])
            if fill_per:
                self.persistent.insert(tag, keys, vectors)
        self.key_counts[name] = counts
        return first

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
            if name == "persistent" and self.volatile is not None and f.any() and \
                    self.config.volatile_db.cache_missed_embeddings:
                self.volatile.insert(tag, keys[rest[f]], v[f])
            rest = rest[~f]
        return values, found

    def refresh_embedding_cache(self, model_name: str, device_id: int = 0) -> None:
        self.cache(model_name).refresh()

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
        self.queried = [0] * len(self.dims)           # distinct keys asked per table
        self.hits = [0] * len(self.dims)              # of them found in the cache
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
                self._insert(t, keys[:self.capacities[t]])

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
            block = block_for(uniq.shape[0] + 1)       # + 1: the row of a non-zero default value
            return self.lookup(t, uniq, block)[inv.reshape(-1)]
        n = keys.shape[0]
        index = self.index[t]
        lin = index.find(keys)                                           # (N,) index row, -1 unknown key
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
        rank[order] = np.arange(miss_keys.size)                  # position of miss j in d_keys, less h
        at = np.empty(u, np.int64)                                # position of uniq[i] in d_keys
        at[hit] = np.arange(h)
        at[~hit] = h + rank[:u - h]
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
        u = _serve_cached_cpu(tkeys, trows, keys, offsets, cache.row_slot, int(cache.row_offsets[t]),
                              int(cache.slot_offsets[t]), self.buffers[t].reshape(-1), self.strides[t], self.dims[t],
                              bool(mean), scratch, cache.stamp, cache.freq, cache.clock + 1,
                              np.empty(self.dims[t], np.float32), out.reshape(-1))
        if u < 0:
            return None
        cache.clock += 1                      # the stamp the pass gave the request's rows (touch_cached's tick)
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
        if h / u >= self.params.hit_rate_threshold:       # HugeCTR's asynchronous mode: defaults now
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
            block[start:start + n_found, :self.dims[t]] = self._dev(values[found])
            rows_of[pos[found]] = start + np.arange(n_found)
        if n_found < pos.size and self.defaults[t] != 0.0:
            block[start + n_found, :self.dims[t]] = self.defaults[t]
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
        src[:, :self.dims[t]] = values[order]
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
            np.take(buf, idx, axis=0, out=out)          # no temporary of the gathered rows

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
            log.warn(f"HPS model {self.name!r}: the embedding cache is not enabled (use_gpu_embedding_cache) and "
                     "cannot be refreshed")
            return
        if pct <= 0:
            log.warn(f"HPS model {self.name!r}: cache_refresh_percentage_per_iteration must be > 0 to refresh the "
                     "embedding cache")
            return
        slots, rows, _ = self.cache.held()
        for t in range(len(self.dims)):
            lo, hi = self.cache.slot_offsets[t], self.cache.slot_offsets[t + 1]
            mine = (slots >= lo) & (slots < hi)
            local_slots = slots[mine] - lo
            keys = device.to_host(self.index[t].keys_by_row())[rows[mine] - self.cache.row_offsets[t]]
            step = max(1, int(pct * self.capacities[t]))
            for a in range(0, keys.size, step):
                values, found = self.ps.lookup(self.name, t, keys[a:a + step])
                src = np.zeros((int(found.sum()), self.strides[t]), np.float32)
                src[:, :self.dims[t]] = values[found]
                self._rows_to(self.buffers[t], local_slots[a:a + step][found], src)


class HPS:
    """``hugectr.inference.HPS``: direct lookups in the parameter server.

    HPS(ps_config) with a ParameterServerConfig, or HPS(hps_json_config_file) with HugeCTR's HPS JSON.
    lookup(h_keys, model_name, table_id, device_id=0) -> (n, D) float32: each key's vector through that
    model's embedding cache and the databases (default_value_for_each_table where none has it).
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
        m = self.config.models.get(model_name)
        if m is None:
            raise KeyError(f"HPS.lookup: the model name {model_name!r} does not exist in HPS; models: "
                           f"{sorted(self.config.models)}")
        if not 0 <= int(table_id) < len(m.names):
            raise IndexError(f"HPS.lookup: model {model_name!r} has tables 0..{len(m.names) - 1}, not {table_id}")
        t = int(table_id)
        keys = check_keys(h_keys, m.params.i64_input_key, "HPS.lookup h_keys")
        most = m.max_keys_per_sample[t] * m.params.max_batchsize
        if keys.shape[0] > most:
            raise ValueError(f"HPS.lookup: {keys.shape[0]} keys; at most maxnum_catfeature_query_per_table_per_sample"
                             f"[{t}] x max_batchsize = {most} per lookup")
        uniq, inv = np.unique(keys, return_inverse=True)
        cache = self.ps.cache(model_name)
        block = self._block(model_name, t, uniq.shape[0] + 1, cache.strides[t])
        rows = cache.lookup(t, uniq, block)
        out = np.zeros((uniq.shape[0], cache.dims[t]), np.float32)
        have = rows >= 0
        out[have] = device.to_host(block[:uniq.shape[0] + 1])[rows[have], :cache.dims[t]]
        return out[inv]

    def _block(self, model: str, t: int, rows: int, stride: int):
        """A reusable (>= rows, stride) device buffer for one table's answers."""
        b = self._blocks.get((model, t))
        if b is None or b.shape[0] < rows:
            b = self._blocks[(model, t)] = device.xp().zeros((max(rows, 1024), stride), np.float32)
        return b


def check_keys(keys, i64: bool, what: str) -> np.ndarray:
    """(n,) uint64 of integer keys: 32-bit keys (i64_input_key=False) must fit 32 bits, and -1 (2**64 - 1)
    is reserved; ValueError naming the first bad key and its position."""
    a = np.asarray(keys).reshape(-1)
    if a.size == 0:
        return np.zeros(0, np.uint64)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{what}: keys must be integers, got {a.dtype}")
    if not i64:
        bad = a.astype(np.uint64) >= 2 ** 32
        if a.dtype.kind == "i":
            bad |= a < 0
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{what}: key {int(a[i])} at position {i} does not fit the 32-bit keys of "
                             "i64_input_key=False")
    # 64-bit keys keep their bits (int64 -1 is 2**64 - 1), so a view serves; narrower ones are widened
    k = a.view(np.uint64) if a.dtype.itemsize == 8 and a.dtype.isnative else a.astype(np.uint64)
    reserved = k == np.uint64(2 ** 64 - 1)
    if reserved.any():
        i = int(np.argmax(reserved))
        raise ValueError(f"{what}: key -1 at position {i} is reserved (2**64 - 1 marks empty hash-table slots)")
    return k
