"""The parameter server's database tiers: keyed stores of embedding vectors, one table per tag.

    db = make_volatile(VolatileDatabaseParams(...))      # HashMapBackend | RedisClusterBackend | None
    db = make_persistent(PersistentDatabaseParams(...))  # RocksDBBackend | None
    db.insert(tag, keys, values)              keys (n,) uint64 distinct, values (n, D) float32
    values, found = db.fetch(tag, keys, D)    values (n, D) float32 (zeros where not found), found (n,) bool
    db.erase(tag, keys)                       the keys leave the table (absent keys are ignored)
    db.size(tag); db.close()

Keys are 64-bit whatever the model's key type (HugeCTR's 32-bit keys are the same numbers), stored as 8
little-endian bytes where a store takes bytes; a vector is D little-endian float32.

HashMapBackend (HugeCTR's HashMap / ParallelHashMap): in this process, numbactr's open-addressing HashTable
(key -> row, compiled CPU code) over a growing (rows, D) array per table; an erased key's row is marked
free and taken again by the same key (the HashTable keeps every key it saw: erase frees the value, not
the key's place in the index).
RedisClusterBackend (HugeCTR's RedisCluster): a Redis server (or cluster) through the redis client, so
several inference processes share one table. The address is HugeCTR's "host[:port][,host[:port]...]", of
which, as in HugeCTR, the first node is used (a cluster node leads the client to the others), or
numbactr's "host:port;host:port..." (all a cluster's startup nodes). HugeCTR's layout: table ``tag`` is split into
``num_partitions`` hashes ``hps_et{<tag>/p<k>}v`` (k = key % num_partitions; the braces keep a hash on
one cluster node), field = the key's bytes, value = the vector's bytes. Requests carry at most
``max_batch_size`` keys.
RocksDBBackend (HugeCTR's RocksDB): an embedded RocksDB (rocksdict) at ``path``, one column family per
table, key bytes -> vector bytes; it outlives the process and may be larger than memory.
"""

from __future__ import annotations

import numpy as np

from numbactr.embedding.hash_table import HashTable
from numbactr.inference.params import DatabaseType_t

__all__ = [
    "HashMapBackend",
    "RedisClusterBackend",
    "RocksDBBackend",
    "make_volatile",
    "make_persistent",
    "BackendError",
]


class BackendError(RuntimeError):
    """A database tier is missing, unreachable or refused a request; the message names the backend and the
    configuration key to change."""


def _key_bytes(keys: np.ndarray) -> list:
    raw = np.ascontiguousarray(keys, dtype="<u8").tobytes()
    return [raw[i : i + 8] for i in range(0, len(raw), 8)]


def _decode(blobs: list, width: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(values (n, D), found (n,)) from a store's answers (bytes, or None where the key is absent)."""
    found = np.fromiter((b is not None for b in blobs), bool, len(blobs))
    values = np.zeros((len(blobs), width), np.float32)
    if found.any():
        got = [b for b in blobs if b is not None]
        bad = next((len(b) for b in got if len(b) != 4 * width), None)
        if bad is not None:
            raise BackendError(
                f"{what}: a stored vector holds {bad} bytes; this table's vectors are {width} "
                f"float32 ({4 * width} bytes): the database holds another model's table of that name"
            )
        values[found] = np.frombuffer(b"".join(got), "<f4").reshape(-1, width)
    return values, found


class HashMapBackend:
    """In-process table store (module docstring)."""

    name = "HashMap"

    def __init__(self, params=None):
        self.tables: dict[str, list] = {}  # tag -> [HashTable, values (V, D), held (V,) bool]

    def _grow(self, tag: str, need: int, width: int) -> list:
        entry = self.tables.get(tag)
        if entry is None:
            entry = self.tables[tag] = [
                HashTable(1024, use_kernels=False, compiled=True),
                np.zeros((1024, width), np.float32),
                np.zeros(1024, bool),
            ]
        index, values, held = entry
        if values.shape[1] != width:
            raise BackendError(f"HashMap table {tag!r} holds vectors of width {values.shape[1]}, not {width}")
        if need > index.max_rows:
            # Rebuilt from the held rows only: an erased key (an evicted one, say) leaves its index entry
            # until here, so a stream of keys that come and go keeps the table near twice what it holds.
            live = held[: index.size]
            n_live = int(live.sum())
            cap = index.max_rows
            while cap < need - index.size + n_live:
                cap *= 2
            bigger = HashTable(cap, use_kernels=False, compiled=True)
            bigger.insert(index.keys_by_row()[live])  # row order in, row order out: rows 0..n_live-1
            grown = np.zeros((cap, width), np.float32)
            grown[:n_live] = values[: index.size][live]
            kept = np.zeros(cap, bool)
            kept[:n_live] = True
            entry[:] = [bigger, grown, kept]
        return entry

    def insert(self, tag: str, keys: np.ndarray, values: np.ndarray) -> None:
        entry = self.tables.get(tag)
        rows = 0 if entry is None else entry[0].size
        index, store, held = self._grow(tag, rows + keys.shape[0], values.shape[1])
        at = index.insert(keys)
        store[at], held[at] = values, True

    def fetch(self, tag: str, keys: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        out = np.zeros((keys.shape[0], width), np.float32)
        entry = self.tables.get(tag)
        if entry is None:
            return out, np.zeros(keys.shape[0], bool)
        rows = entry[0].find(keys)
        found = rows >= 0
        found[found] = entry[2][rows[found]]
        out[found] = entry[1][rows[found]]
        return out, found

    def erase(self, tag: str, keys: np.ndarray) -> None:
        entry = self.tables.get(tag)
        if entry is not None and keys.shape[0]:
            rows = entry[0].find(keys)
            entry[2][rows[rows >= 0]] = False

    def size(self, tag: str) -> int:
        entry = self.tables.get(tag)
        return 0 if entry is None else int(entry[2][: entry[0].size].sum())

    def close(self) -> None:
        self.tables.clear()


class RedisClusterBackend:
    """Redis tier (module docstring); a server that cannot be reached is a BackendError naming
    volatile_db.address."""

    name = "RedisCluster"

    def __init__(self, params):
        try:
            import redis
            from redis.cluster import ClusterNode, RedisCluster
        except ImportError:
            raise BackendError(
                "volatile_db.type RedisCluster needs the redis client library, which is not "
                "installed: pip install redis (or numbactr's [hps] extra)"
            ) from None
        self.params = params
        nodes, seed_only = _redis_nodes(params.address)
        kw = dict(socket_connect_timeout=5, socket_timeout=30)
        if params.password:
            kw.update(username=params.user_name, password=params.password)
        if params.enable_tls:
            kw.update(
                ssl=True,
                ssl_ca_certs=params.tls_ca_certificate,
                ssl_certfile=params.tls_client_certificate,
                ssl_keyfile=params.tls_client_key,
            )
        try:
            if seed_only or len(nodes) == 1:
                # HugeCTR's form: one node (the first of a ',' list) that a cluster client starts from; a
                # server not in cluster mode serves as a plain Redis (as numbactr always allowed)
                host, port = nodes[0]
                self.client = redis.Redis(host=host, port=port, max_connections=params.num_node_connections, **kw)
                if int(self.client.info("cluster").get("cluster_enabled", 0)):
                    self.client.close()
                    self.client = RedisCluster(startup_nodes=[ClusterNode(host, port)], **kw)
            else:
                self.client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **kw)
            self.client.ping()
        except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
            raise BackendError(
                f"volatile_db (RedisCluster) at {params.address!r} cannot be reached: {e} (set "
                "volatile_db.address to a running redis-server, or volatile_db.type to another "
                "backend)"
            ) from None

    def _hkey(self, tag: str, part: int) -> str:
        return f"hps_et{{{tag}/p{part}}}v"

    def _parts(self, keys: np.ndarray):
        """(partition, positions in keys) of every partition that keys touch."""
        part = keys % np.uint64(self.params.num_partitions)
        for p in np.unique(part):
            yield int(p), np.flatnonzero(part == p)

    def _run(self, what: str, fn):
        import redis

        try:
            return fn()
        except redis.RedisError as e:
            raise BackendError(f"volatile_db (RedisCluster) at {self.params.address!r}: {what} failed: {e}") from None

    def insert(self, tag: str, keys: np.ndarray, values: np.ndarray) -> None:
        step = self.params.max_batch_size
        vals = np.ascontiguousarray(values, "<f4")
        for part, pos in self._parts(keys):
            hkey = self._hkey(tag, part)
            for lo in range(0, pos.size, step):
                sel = pos[lo : lo + step]
                mapping = dict(zip(_key_bytes(keys[sel]), (v.tobytes() for v in vals[sel])))
                self._run(f"HSET {hkey}", lambda: self.client.hset(hkey, mapping=mapping))

    def fetch(self, tag: str, keys: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        blobs = [None] * keys.shape[0]
        step = self.params.max_batch_size
        for part, pos in self._parts(keys):
            hkey = self._hkey(tag, part)
            for lo in range(0, pos.size, step):
                sel = pos[lo : lo + step]
                got = self._run(f"HMGET {hkey}", lambda: self.client.hmget(hkey, _key_bytes(keys[sel])))
                for i, b in zip(sel.tolist(), got):
                    blobs[i] = b
        return _decode(blobs, width, f"RedisCluster table {tag!r}")

    def erase(self, tag: str, keys: np.ndarray) -> None:
        step = self.params.max_batch_size
        for part, pos in self._parts(keys):
            hkey = self._hkey(tag, part)
            for lo in range(0, pos.size, step):
                fields = _key_bytes(keys[pos[lo : lo + step]])
                self._run(f"HDEL {hkey}", lambda: self.client.hdel(hkey, *fields))

    def size(self, tag: str) -> int:
        return sum(
            self._run("HLEN", lambda p=p: self.client.hlen(self._hkey(tag, p)))
            for p in range(self.params.num_partitions)
        )

    def close(self) -> None:
        self.client.close()


def _redis_nodes(address: str) -> tuple[list, bool]:
    """([(host, port)], seed_only) of volatile_db.address. HugeCTR's form "host[:port][,host[:port]...]"
    (hps_database_backend.md): like HugeCTR's RedisClusterBackend (src/hps/redis_backend.cpp), only the part
    before the first ',' is used, the node a cluster client starts from (seed_only True). numbactr's own
    "host:port;host:port..." (kept): every entry is a startup node of a Redis cluster. A missing port is
    6379 (redis-plus-plus's default)."""
    if ";" in address:
        parts, seed_only = [p for p in address.split(";") if p.strip()], False
    else:
        parts, seed_only = [address.split(",", 1)[0]], True
    nodes = []
    for part in parts:
        part = part.strip()
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "6379")
        if not host or not port.isdigit():
            raise BackendError(
                f"volatile_db.address {address!r}: {part!r} is not host[:port] (the address is "
                "'host[:port][,host[:port]...]', of which the first is used)"
            )
        nodes.append((host, int(port)))
    if not nodes:
        raise BackendError(f"volatile_db.address {address!r} names no host[:port]")
    return nodes, seed_only


class RocksDBBackend:
    """RocksDB tier (module docstring); a path that cannot be opened is a BackendError naming
    persistent_db.path."""

    name = "RocksDB"

    def __init__(self, params):
        try:
            from rocksdict import AccessType, Options, Rdict
        except ImportError:
            raise BackendError(
                "persistent_db.type RocksDB needs rocksdict (an embedded RocksDB), which is not "
                "installed: pip install rocksdict (or numbactr's [hps] extra)"
            ) from None
        self.params = params
        self._opt = Options(raw_mode=True)
        self._opt.create_if_missing(not params.read_only)
        self._opt.increase_parallelism(params.num_threads)
        access = AccessType.read_only() if params.read_only else AccessType.read_write()
        try:
            self.db = Rdict(params.path, self._opt, access_type=access)
        except Exception as e:  # noqa: BLE001 (rocksdict raises plain Exception: missing, locked, corrupt)
            raise BackendError(
                f"persistent_db (RocksDB) at path {params.path!r} cannot be opened"
                f"{' read-only' if params.read_only else ''}: {e} (persistent_db.path)"
            ) from None
        self._cfs = {}

    def _family(self, tag: str, create: bool):
        cf = self._cfs.get(tag)
        if cf is None:
            try:
                cf = self.db.get_column_family(tag)
            except Exception:  # noqa: BLE001 (no such column family)
                if not create:
                    return None
                cf = self.db.create_column_family(tag, self._opt)
            self._cfs[tag] = cf
        return cf

    def insert(self, tag: str, keys: np.ndarray, values: np.ndarray) -> None:
        from rocksdict import WriteBatch

        if self.params.read_only:
            raise BackendError(
                f"persistent_db (RocksDB) at {self.params.path!r} is read_only: nothing can be "
                "inserted (persistent_db.read_only)"
            )
        self._family(tag, True)
        handle = self.db.get_column_family_handle(tag)
        vals = np.ascontiguousarray(values, "<f4")
        step = self.params.max_batch_size
        for lo in range(0, keys.shape[0], step):
            batch = WriteBatch(raw_mode=True)
            batch.set_default_column_family(handle)
            for k, v in zip(_key_bytes(keys[lo : lo + step]), vals[lo : lo + step]):
                batch.put(k, v.tobytes())
            self.db.write(batch)

    def fetch(self, tag: str, keys: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        cf = self._family(tag, False)
        if cf is None:
            return np.zeros((keys.shape[0], width), np.float32), np.zeros(keys.shape[0], bool)
        blobs = []
        step = self.params.max_batch_size
        for lo in range(0, keys.shape[0], step):
            blobs += cf.get(_key_bytes(keys[lo : lo + step]))
        return _decode(blobs, width, f"RocksDB table {tag!r}")

    def erase(self, tag: str, keys: np.ndarray) -> None:
        from rocksdict import WriteBatch

        if self.params.read_only:
            raise BackendError(
                f"persistent_db (RocksDB) at {self.params.path!r} is read_only: nothing can be "
                "erased (persistent_db.read_only)"
            )
        if self._family(tag, False) is None:
            return
        handle = self.db.get_column_family_handle(tag)
        step = self.params.max_batch_size
        for lo in range(0, keys.shape[0], step):
            batch = WriteBatch(raw_mode=True)
            batch.set_default_column_family(handle)
            for k in _key_bytes(keys[lo : lo + step]):
                batch.delete(k)
            self.db.write(batch)

    def size(self, tag: str) -> int:
        cf = self._family(tag, False)
        return 0 if cf is None else sum(1 for _ in cf.keys())

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None
            self._cfs = {}


def make_volatile(params):
    """The volatile tier of VolatileDatabaseParams (None when Disabled)."""
    t = params.type
    if t == DatabaseType_t.Disabled:
        return None
    if t in (DatabaseType_t.HashMap, DatabaseType_t.ParallelHashMap):
        return HashMapBackend(params)
    return RedisClusterBackend(params)  # (the params checked that nothing else gets here)


def make_persistent(params):
    """The persistent tier of PersistentDatabaseParams (None when Disabled)."""
    return RocksDBBackend(params) if params.backend == DatabaseType_t.RocksDB else None
