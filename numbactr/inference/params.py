"""HugeCTR's inference configuration: InferenceParams, the database parameter blocks, their enums, and the
hierarchical parameter server's configuration (ParameterServerConfig: from InferenceParams and graph JSONs,
or from the HPS JSON file).

Names, arguments and defaults are HugeCTR's (v23.08: HugeCTR/include/pybind/inference_wrapper.hpp,
include/hps/inference_utils.hpp, src/hps/inference_utils.cpp). Every argument is accepted; one numbactr does
not act on warns (numbactr.IgnoredArgumentWarning) when it is set to something other than its default, and a
value out of range is a ValueError naming the argument.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field, fields

from numbactr.validate import IgnoredArgumentWarning, number as _number, warn_ignored
from numbactr.enums import _Enum


def _make_aliased(name: str, members: str, pybind_names: str) -> type:
    """An enum whose members also answer to HugeCTR's pybind names (hctr_enum_to_c_str: lower case,
    underscores), e.g. DatabaseType_t.redis_cluster is DatabaseType_t.RedisCluster; iteration and repr
    use the first names."""
    first, second = members.split(), pybind_names.split()
    assert len(first) == len(second)
    return _Enum(name, [(m, i) for i, m in enumerate(first)] + [(m, i) for i, m in enumerate(second)])


DatabaseType_t = _make_aliased(
    "DatabaseType_t",
    "Disabled HashMap ParallelHashMap MultiProcessHashMap RedisCluster RocksDB",
    "disabled hash_map parallel_hash_map multi_process_hash_map redis_cluster rocks_db",
)
DatabaseOverflowPolicy_t = _make_aliased(
    "DatabaseOverflowPolicy_t", "EvictRandom EvictLeastUsed EvictOldest", "evict_random evict_least_used evict_oldest"
)
UpdateSourceType_t = _make_aliased("UpdateSourceType_t", "Null KafkaMessageQueue", "null kafka_message_queue")
EmbeddingCacheType_t = _make_aliased(
    "EmbeddingCacheType_t", "Dynamic Static UVM Stochastic", "dynamic static uvm stochastic"
)


def pybind_members(*enums) -> dict:
    """HugeCTR's export_values() of these enums: each member under its pybind (lower-case) name, e.g.
    hugectr.redis_cluster (HugeCTR registers DatabaseType_t, DatabaseOverflowPolicy_t and
    UpdateSourceType_t on the top-level module, include/pybind/common_wrapper.hpp)."""
    return {n: m for e in enums for n, m in e.__members__.items() if n != m.name}


# the names the HPS JSON accepts for each database type (HugeCTR's get_hps_database_type)
_DB_NAMES = {
    DatabaseType_t.Disabled: ("disabled", "disable", "none"),
    DatabaseType_t.HashMap: ("hash_map", "hashmap", "hash", "map"),
    DatabaseType_t.ParallelHashMap: ("parallel_hash_map", "parallel_hashmap", "parallel_hash", "parallel_map"),
    DatabaseType_t.MultiProcessHashMap: (
        "multi_process_hash_map",
        "multi_process_hashmap",
        "multi_process_hash",
        "multi_process_map",
    ),
    DatabaseType_t.RedisCluster: ("redis_cluster", "redis"),
    DatabaseType_t.RocksDB: ("rocks_db", "rocksdb", "rocks"),
}
_POLICY_NAMES = {
    DatabaseOverflowPolicy_t.EvictRandom: "evict_random",
    DatabaseOverflowPolicy_t.EvictLeastUsed: "evict_least_used",
    DatabaseOverflowPolicy_t.EvictOldest: "evict_oldest",
}
_SOURCE_NAMES = {UpdateSourceType_t.Null: "null", UpdateSourceType_t.KafkaMessageQueue: "kafka_message_queue"}
_CACHE_NAMES = {t: t.name.lower() for t in EmbeddingCacheType_t}

TAG_PREFIX = "hps_et"  # HugeCTR's PS_EMBEDDING_TABLE_TAG_PREFIX
_TAG_PART = re.compile(r"[a-zA-Z0-9_\-]{1,120}")
_NO_MARGIN = 2**64 - 1  # HugeCTR's overflow_margin default: std::numeric_limits<size_t>::max()
_FILTERS = ["^hps_.+$"]


def make_tag_name(model_name: str, table_name: str) -> str:
    """HugeCTR's name of one model's table in the databases: ``hps_et.<model>.<table>``."""
    for what, name in (("model_name", model_name), ("embedding table name", table_name)):
        if not isinstance(name, str) or not _TAG_PART.fullmatch(name):
            raise ValueError(
                f"HPS: {what} {name!r} is invalid: it names database tables, so it must be 1-120 "
                "characters of letters, digits, '_' and '-'"
            )
    return f"{TAG_PREFIX}.{model_name}.{table_name}"


def _ignored(who: str, obj, notes: dict) -> None:
    """notes: argument -> why numbactr does not act on it; warns for those set away from their default."""
    for f in fields(obj):
        if f.name in notes and getattr(obj, f.name) != _default(f):
            warn_ignored(who, f.name, getattr(obj, f.name), notes[f.name], stacklevel=4)


def _default(f):
    return f.default_factory() if callable(f.default_factory) else f.default


@dataclass
class VolatileDatabaseParams:
    """``hugectr.inference.VolatileDatabaseParams``: the CPU-memory tier.

    type: ParallelHashMap / HashMap (numbactr: one in-process hash map, numbactr.inference.backends), or
    RedisCluster (the redis client against ``address``: HugeCTR's "host[:port][,host[:port]...]", of which
    HugeCTR, and numbactr, connect to the first (a cluster node finds the others itself; a server not in
    cluster mode is used as a plain Redis); numbactr's older "host:port;host:port..." gives every entry
    as a cluster's startup node; user_name/password, TLS, num_node_connections (the connection pool),
    num_partitions (hashes per table) and max_batch_size (keys per request) are honoured), or Disabled.
    initialize_after_startup fills it with every key of the sparse model files at start (HugeCTR's
    HierParameterServer). initial_cache_rate matters, as in HugeCTR, only for a table larger than the
    tier's capacity (overflow_margin x num_partitions; unlimited by default): the tier then takes the
    first round(initial_cache_rate x capacity) keys of the file, provided a persistent database filled at
    start holds them all; without one it keeps every key (no row is lost) and warns.
    cache_missed_embeddings copies what the persistent tier found into it.
    """

    type: object = DatabaseType_t.ParallelHashMap
    address: str = "127.0.0.1:7000"
    user_name: str = "default"
    password: str = ""
    num_partitions: int = field(default_factory=lambda: min(16, os.cpu_count() or 1))
    allocation_rate: int = 256 * 1024 * 1024
    shared_memory_size: int = 16 * 1024**3
    shared_memory_name: str = "hctr_mp_hash_map_database"
    shared_memory_auto_remove: bool = True
    num_node_connections: int = 5
    max_batch_size: int = 64 * 1024
    enable_tls: bool = False
    tls_ca_certificate: str = "cacertbundle.crt"
    tls_client_certificate: str = "client_cert.pem"
    tls_client_key: str = "client_key.pem"
    tls_server_name_identification: str = "redis.localhost"
    overflow_margin: int = _NO_MARGIN
    overflow_policy: object = DatabaseOverflowPolicy_t.EvictRandom
    overflow_resolution_target: float = 0.8
    initialize_after_startup: bool = True
    initial_cache_rate: float = 1.0
    cache_missed_embeddings: bool = False
    update_filters: list = field(default_factory=lambda: list(_FILTERS))

    def __post_init__(self):
        who = "VolatileDatabaseParams"
        _enum(who, "type", self.type, DatabaseType_t)
        _enum(who, "overflow_policy", self.overflow_policy, DatabaseOverflowPolicy_t)
        for name in ("num_partitions", "num_node_connections", "max_batch_size"):
            _number(who, name, getattr(self, name), 1, integer=True)
        _number(who, "initial_cache_rate", self.initial_cache_rate, 0.0, 1.0)
        _number(who, "overflow_resolution_target", self.overflow_resolution_target, 0.0, 1.0)
        if self.type == DatabaseType_t.MultiProcessHashMap:
            raise NotImplementedError(
                f"{who}: type MultiProcessHashMap (volatile_db.type) is not implemented in "
                "numbactr; to share one table between inference processes use "
                "RedisCluster (a redis-server)"
            )
        if self.type == DatabaseType_t.RocksDB:
            raise ValueError(f"{who}: type RocksDB is a persistent database (persistent_db.type), not a volatile one")
        kept = "numbactr's volatile tier holds every key it is given (no overflow handling)"
        hashmap = "used by HugeCTR's hash maps' allocator only"
        shm = "used only by MultiProcessHashMap"
        if self.overflow_margin != _NO_MARGIN:
            _number(who, "overflow_margin", self.overflow_margin, 1, integer=True)
            warnings.warn(
                f"{who}: overflow_margin={self.overflow_margin!r} is ignored except at start: it only "
                "sizes the start-up fill (a table larger than overflow_margin x num_partitions keys puts "
                "initial_cache_rate of that many in the volatile tier when a persistent database holds "
                "them all); numbactr has no overflow handling, so later inserts (cache_missed_embeddings) "
                "are not bounded",
                IgnoredArgumentWarning,
                stacklevel=3,
            )
        _ignored(
            who,
            self,
            {
                "overflow_policy": kept,
                "overflow_resolution_target": kept,
                "allocation_rate": hashmap,
                "shared_memory_size": shm,
                "shared_memory_name": shm,
                "shared_memory_auto_remove": shm,
                "update_filters": "numbactr has no Kafka update source",
            },
        )


@dataclass
class PersistentDatabaseParams:
    """``hugectr.inference.PersistentDatabaseParams``: the disk tier. backend RocksDB (an embedded RocksDB
    through rocksdict at ``path``: one column family per table, which outlives the process) or Disabled.
    The Python argument is ``backend`` (HugeCTR's pybind name); the HPS JSON key is ``type``."""

    backend: object = DatabaseType_t.Disabled
    path: str = field(default_factory=lambda: os.path.join(tempfile.gettempdir(), "rocksdb"))
    num_threads: int = 16
    read_only: bool = False
    max_batch_size: int = 64 * 1024
    initialize_after_startup: bool = True
    update_filters: list = field(default_factory=lambda: list(_FILTERS))

    def __post_init__(self):
        who = "PersistentDatabaseParams"
        _enum(who, "backend", self.backend, DatabaseType_t)
        _number(who, "num_threads", self.num_threads, 1, integer=True)
        _number(who, "max_batch_size", self.max_batch_size, 1, integer=True)
        if self.backend not in (DatabaseType_t.Disabled, DatabaseType_t.RocksDB):
            raise ValueError(
                f"{who}: backend {self.backend.name} (persistent_db.type) is not a persistent "
                "database; HugeCTR's persistent tier is RocksDB (or Disabled)"
            )
        if self.read_only and self.initialize_after_startup and self.backend == DatabaseType_t.RocksDB:
            raise ValueError(
                f"{who}: read_only=True cannot be filled at start (initialize_after_startup=True); "
                "open a database another process filled with initialize_after_startup=False"
            )
        _ignored(who, self, {"update_filters": "numbactr has no Kafka update source"})

    @property
    def type(self):
        """HugeCTR's struct field name for ``backend``."""
        return self.backend


@dataclass
class UpdateSourceParams:
    """``hugectr.inference.UpdateSourceParams``: HugeCTR's Kafka stream of model updates. numbactr has no
    Kafka consumer: type KafkaMessageQueue is an error, the other arguments are accepted and unused."""

    type: object = UpdateSourceType_t.Null
    brokers: str = "127.0.0.1:9092"
    metadata_refresh_interval_ms: int = 30000
    receive_buffer_size: int = 256 * 1024
    poll_timeout_ms: int = 500
    max_batch_size: int = 8 * 1024
    failure_backoff_ms: int = 50
    max_commit_interval: int = 32

    def __post_init__(self):
        _enum("UpdateSourceParams", "type", self.type, UpdateSourceType_t)
        if self.type != UpdateSourceType_t.Null:
            raise NotImplementedError(
                "UpdateSourceParams: type KafkaMessageQueue (update_source.type) is not "
                "implemented in numbactr: it has no Kafka consumer; refresh a model's tables "
                "by writing the volatile or persistent database and calling "
                "refresh_embedding_cache()"
            )


def _enum(who: str, name: str, value, enum) -> None:
    if not isinstance(value, enum):
        raise ValueError(f"{who}: {name} must be a {enum.__name__} ({', '.join(m.name for m in enum)}), got {value!r}")


# InferenceParams arguments numbactr does not act on (the results do not depend on them)
_GPU_TUNING = "a HugeCTR GPU tuning option; numbactr's results do not depend on it"
_PARAMS_IGNORED = {
    "use_mixed_precision": "numbactr's inference runs in float32 (training's mixed precision is not offered for inference)",
    "scaler": "the loss scaler matters only with mixed precision, which numbactr does not have",
    "use_algorithm_search": _GPU_TUNING,
    "use_context_stream": _GPU_TUNING,
    "number_of_worker_buffers_in_pool": _GPU_TUNING,
    "number_of_refresh_buffers_in_pool": _GPU_TUNING,
    "thread_pool_size": "numbactr inserts cache misses in the lookup's own thread",
    "deployed_devices": "numbactr runs one device per process (the current numbactr device)",
    "device_id": "numbactr runs on the current numbactr device",
    "refresh_delay": "numbactr has no background cache refresh; call refresh_embedding_cache()",
    "refresh_interval": "numbactr has no background cache refresh; call refresh_embedding_cache()",
    "maxnum_des_feature_per_sample": "used by HugeCTR's Triton backend only",
    "network_file": "used by HugeCTR's Triton backend only",
    "label_dim": "used by HugeCTR's Triton backend only",
    "slot_num": "used by HugeCTR's Triton backend only",
    "use_static_table": "numbactr's embedding cache is dynamic (embedding_cache_type Dynamic)",
    "embedding_cache_type": "numbactr's embedding cache is dynamic (embedding_cache_type Dynamic)",
    "fuse_embedding_table": "numbactr looks each table up on its own (the results are the same)",
    "use_hctr_cache_implementation": "numbactr has one embedding cache (numbactr.embedding.cache)",
    "enable_pagelock": _GPU_TUNING,
    "fp8_quant": "numbactr keeps embeddings in float32",
}


@dataclass
class InferenceParams:
    """``hugectr.inference.InferenceParams`` (HugeCTR's arguments, order and defaults).

    Honoured: model_name (the databases' table names), max_batchsize, hit_rate_threshold (any finite
    number, as in HugeCTR: > 1 turns the asynchronous inserts off), dense_model_file ("" loads no dense
    weights, as in HugeCTR, with a warning), sparse_model_files (one folder per embedding table, graph
    order), use_gpu_embedding_cache (the device cache; a RAM cache on the cpu device),
    cache_size_percentage, i64_input_key (32-bit keys otherwise), cache_refresh_percentage_per_iteration
    (keys per refresh step; with init_ec, > 0 also fills the cache at start), default_value_for_each_table
    (one value, or one per table: the vector of a key no tier holds; another count warns and gives every
    table the first value, as HugeCTR does),
    volatile_db, persistent_db, update_source, maxnum_catfeature_query_per_table_per_sample,
    embedding_vecsize_per_table and embedding_table_names (the HPS interface's tables),
    non_trainable_params_file (BatchNorm statistics; default: dense_model_file + ".ntp.json"), init_ec,
    use_cuda_graph (the dense forward as CUDA graphs on a GPU, numbactr.train.cuda_graphs.ForwardGraphs; for now
    only with NUMBACTR_CUDA_GRAPHS=1 as well).
    """

    model_name: str
    max_batchsize: int
    hit_rate_threshold: float
    dense_model_file: str
    sparse_model_files: list
    device_id: int = 0
    use_gpu_embedding_cache: bool = None
    cache_size_percentage: float = None
    i64_input_key: bool = None
    use_mixed_precision: bool = False
    scaler: float = 1.0
    use_algorithm_search: bool = True
    use_cuda_graph: bool = True
    number_of_worker_buffers_in_pool: int = 2
    number_of_refresh_buffers_in_pool: int = 1
    thread_pool_size: int = 16
    cache_refresh_percentage_per_iteration: float = 0.0
    deployed_devices: list = field(default_factory=lambda: [0])
    default_value_for_each_table: list = field(default_factory=lambda: [0.0])
    volatile_db: VolatileDatabaseParams = field(default_factory=VolatileDatabaseParams)
    persistent_db: PersistentDatabaseParams = field(default_factory=PersistentDatabaseParams)
    update_source: UpdateSourceParams = field(default_factory=UpdateSourceParams)
    maxnum_des_feature_per_sample: int = 26
    refresh_delay: float = 0.0
    refresh_interval: float = 0.0
    maxnum_catfeature_query_per_table_per_sample: list = field(default_factory=lambda: [26])
    embedding_vecsize_per_table: list = field(default_factory=lambda: [128])
    embedding_table_names: list = field(default_factory=lambda: [""])
    network_file: str = ""
    label_dim: int = 1
    slot_num: int = 10
    non_trainable_params_file: str = ""
    use_static_table: bool = False
    embedding_cache_type: object = EmbeddingCacheType_t.Dynamic
    use_context_stream: bool = True
    fuse_embedding_table: bool = False
    use_hctr_cache_implementation: bool = True
    init_ec: bool = True
    enable_pagelock: bool = False
    fp8_quant: bool = False

    def __post_init__(self):
        who = "InferenceParams"
        for name in ("use_gpu_embedding_cache", "cache_size_percentage", "i64_input_key"):
            if getattr(self, name) is None:
                raise TypeError(f"{who}: argument {name!r} is required (HugeCTR's binding gives it no default)")
        make_tag_name(self.model_name, "table")
        _number(who, "max_batchsize", self.max_batchsize, 1, integer=True)
        # HugeCTR takes any float: a request whose cache hit rate (0..1) is >= the threshold answers its
        # misses with the default value and inserts them after it; > 1 thus always fetches them at once
        # (asynchronous inserts off), <= 0 never does
        _number(who, "hit_rate_threshold", self.hit_rate_threshold)
        _number(who, "cache_size_percentage", self.cache_size_percentage, 0.0, 1.0, lo_open=True)
        _number(who, "cache_refresh_percentage_per_iteration", self.cache_refresh_percentage_per_iteration, 0.0, 1.0)
        if isinstance(self.sparse_model_files, str):
            self.sparse_model_files = [self.sparse_model_files]
        self.sparse_model_files = [str(p) for p in self.sparse_model_files]
        if not isinstance(self.dense_model_file, str):
            raise ValueError(f"{who}: dense_model_file must be a path, got {self.dense_model_file!r}")
        for name, kind in (
            ("volatile_db", VolatileDatabaseParams),
            ("persistent_db", PersistentDatabaseParams),
            ("update_source", UpdateSourceParams),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{who}: {name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        _enum(who, "embedding_cache_type", self.embedding_cache_type, EmbeddingCacheType_t)
        defaults = [float(v) for v in self.default_value_for_each_table]
        if not all(math.isfinite(v) for v in defaults):
            raise ValueError(f"{who}: default_value_for_each_table must be finite, got {defaults}")
        self.default_value_for_each_table = _fit_defaults(defaults, len(self.sparse_model_files), 3)
        _ignored(who, self, _PARAMS_IGNORED)

    def default_values(self, tables: int) -> list:
        """The default value of each of ``tables`` tables: one value broadcast, or one per table (any other
        count: a warning, and the first value, or 0, for every table, as HugeCTR does)."""
        return _fit_defaults(list(self.default_value_for_each_table), tables, 3)


def _fit_defaults(d: list, tables: int, stacklevel: int) -> list:
    """HugeCTR's InferenceParams constructor (src/hps/inference_utils.cpp): default_value_for_each_table
    whose size is not the number of tables warns and gives every table its first value (0 when empty).
    numbactr broadcasts a single value silently (its documented shorthand)."""
    if len(d) == tables:
        return list(d)
    if len(d) == 1:
        return d * tables
    value = d[0] if d else 0.0
    warnings.warn(
        f"InferenceParams: default_value_for_each_table has {len(d)} values for {tables} embedding "
        f"tables (sparse_model_files); as in HugeCTR, every table gets its first value ({value})",
        IgnoredArgumentWarning,
        stacklevel=stacklevel + 1,
    )
    return [value] * tables


@dataclass
class ModelTables:
    """What the parameter server keeps of one model: its params and, per table (graph order), the name,
    vector width, most keys a sample queries, and sparse model folder."""

    params: InferenceParams
    names: list
    vec_sizes: list
    max_keys_per_sample: list

    @property
    def files(self) -> list:
        return self.params.sparse_model_files


class ParameterServerConfig:
    """``hugectr.inference.ParameterServerConfig`` / HugeCTR's parameter_server_config: the models the HPS
    serves and the database tiers they share.

    ParameterServerConfig(emb_table_name, embedding_vec_size, max_feature_num_per_sample_per_emb_table,
    inference_params_array, volatile_db, persistent_db, update_source): dicts keyed by model name (HugeCTR's
    constructor); ParameterServerConfig.from_json(path): HugeCTR's HPS JSON file.
    """

    def __init__(
        self,
        emb_table_name: dict,
        embedding_vec_size: dict,
        max_feature_num_per_sample_per_emb_table: dict,
        inference_params_array: list,
        volatile_db: VolatileDatabaseParams | None = None,
        persistent_db: PersistentDatabaseParams | None = None,
        update_source: UpdateSourceParams | None = None,
    ):
        self.volatile_db = volatile_db or VolatileDatabaseParams()
        self.persistent_db = persistent_db or PersistentDatabaseParams()
        self.update_source = update_source or UpdateSourceParams()
        self.models: dict[str, ModelTables] = {}
        if not inference_params_array:
            raise ValueError("ParameterServerConfig: inference_params_array is empty: the HPS needs a model")
        for p in inference_params_array:
            if not isinstance(p, InferenceParams):
                raise ValueError(f"ParameterServerConfig: inference_params_array holds {p!r}, not InferenceParams")
            name = p.model_name
            if name in self.models:
                raise ValueError(f"ParameterServerConfig: model {name!r} appears twice")
            per = {}
            for key, d in (
                ("emb_table_name", emb_table_name),
                ("embedding_vec_size", embedding_vec_size),
                ("max_feature_num_per_sample_per_emb_table", max_feature_num_per_sample_per_emb_table),
            ):
                if name not in d:
                    raise ValueError(f"ParameterServerConfig: {key} has no entry for model {name!r}")
                per[key] = list(d[name])
                if len(per[key]) != len(p.sparse_model_files):
                    raise ValueError(
                        f"ParameterServerConfig: model {name!r} has {len(p.sparse_model_files)} "
                        f"sparse_model_files but {len(per[key])} entries in {key}"
                    )
            for t in per["emb_table_name"]:
                make_tag_name(name, t)
            for key in ("embedding_vec_size", "max_feature_num_per_sample_per_emb_table"):
                for v in per[key]:
                    _number("ParameterServerConfig", f"{key}[{name!r}]", v, 1, integer=True)
            if p.i64_input_key != inference_params_array[0].i64_input_key:
                raise ValueError(
                    "ParameterServerConfig: models disagree on i64_input_key; one parameter server "
                    "holds one key type (HugeCTR: 'Parameter server does not support hybrid key types')"
                )
            p.default_values(len(p.sparse_model_files))  # checks the count
            self.models[name] = ModelTables(
                p, per["emb_table_name"], per["embedding_vec_size"], per["max_feature_num_per_sample_per_emb_table"]
            )

    @property
    def i64_input_key(self) -> bool:
        return next(iter(self.models.values())).params.i64_input_key

    @classmethod
    def from_json(cls, path: str) -> "ParameterServerConfig":
        """HugeCTR's HPS JSON (hierarchical_parameter_server/hps_database_backend): "supportlonglong", the
        optional "volatile_db" / "persistent_db" / "update_source" blocks (HugeCTR's key names, a volatile
        block without "type" is Disabled) and "models", each with "model", "sparse_files",
        "deployed_device_list", "embedding_vecsize_per_table", "maxnum_catfeature_query_per_table_per_sample",
        "default_value_for_each_table" (required) and the optional keys with HugeCTR's defaults ("gpucache"
        True, "gpucacheper" 0.2, "hit_rate_threshold" 0.9, "max_batch_size" 64, "dense_file" "",
        "embedding_table_names" sparse_embedding0..., ...). Errors name the file and the key."""
        where = f"HPS JSON {path!r}"
        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read().decode("utf-8"))
        except OSError as e:
            raise ValueError(f"{where}: cannot be read ({e})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        j = _Json(doc, where)
        i64 = j.req("supportlonglong", bool)
        j.warn_unknown(
            {"supportlonglong", "volatile_db", "persistent_db", "update_source", "models", "fuse_embedding_table"}
        )
        vol = _VOLATILE_KEYS.read(j.sub("volatile_db"), VolatileDatabaseParams, {"type": DatabaseType_t.Disabled})
        per = _PERSISTENT_KEYS.read(j.sub("persistent_db"), PersistentDatabaseParams)
        src = _SOURCE_KEYS.read(j.sub("update_source"), UpdateSourceParams)
        if j.opt("fuse_embedding_table", bool, False):
            warn_ignored(where, "fuse_embedding_table", True, _PARAMS_IGNORED["fuse_embedding_table"], stacklevel=2)
        models = j.req("models", list)
        if not models:
            raise ValueError(f"{where}: 'models' is empty (no model configurations)")
        names, vecs, maxq, params = {}, {}, {}, []
        for i, m in enumerate(models):
            mj = _Json(m, f"{where}, models[{i}]")
            name = mj.opt("model", str, "")
            files = mj.req("sparse_files", list, str)
            devices = mj.req("deployed_device_list", list, int)
            if not devices:
                raise ValueError(f"{mj.where}: 'deployed_device_list' is empty")
            vec = mj.req("embedding_vecsize_per_table", list, int)
            defaults = mj.req("default_value_for_each_table", list, (int, float))
            defaults = (defaults + [0.0] * len(vec))[: len(vec)]  # HugeCTR pads with 0 / truncates
            tables = mj.opt("embedding_table_names", list, [f"sparse_embedding{k}" for k in range(len(files))], str)
            for key, val in (("embedding_vecsize_per_table", vec), ("embedding_table_names", tables)):
                if len(val) != len(files):
                    raise ValueError(f"{mj.where}: '{key}' has {len(val)} entries for {len(files)} 'sparse_files'")
            mj.warn_unknown(_MODEL_KEYS)
            kw = {}
            if "embedding_cache_type" in m:
                kind = mj.req("embedding_cache_type", str)
                match = [t for t, n in _CACHE_NAMES.items() if n == kind]
                if not match:
                    raise ValueError(
                        f"{mj.where}: key 'embedding_cache_type' is {kind!r}, not one of "
                        f"{sorted(_CACHE_NAMES.values())}"
                    )
                kw["embedding_cache_type"] = match[0]
            for key, (arg, typ, default) in _MODEL_OPTIONAL.items():
                value = mj.opt(key, typ, default)
                if value != default:
                    kw[arg] = value
            try:
                p = InferenceParams(
                    model_name=name,
                    max_batchsize=mj.opt("max_batch_size", int, 64),
                    hit_rate_threshold=float(mj.opt("hit_rate_threshold", (int, float), 0.9)),
                    dense_model_file=mj.opt("dense_file", str, ""),
                    sparse_model_files=files,
                    device_id=devices[-1],
                    use_gpu_embedding_cache=mj.opt("gpucache", bool, True),
                    cache_size_percentage=float(mj.opt("gpucacheper", (int, float), 0.2)),
                    i64_input_key=i64,
                    deployed_devices=devices,
                    volatile_db=vol,
                    persistent_db=per,
                    update_source=src,
                    default_value_for_each_table=defaults,
                    maxnum_catfeature_query_per_table_per_sample=mj.req(
                        "maxnum_catfeature_query_per_table_per_sample", list, int
                    ),
                    embedding_vecsize_per_table=vec,
                    embedding_table_names=tables,
                    **kw,
                )
            except (TypeError, ValueError) as e:
                raise ValueError(f"{mj.where}: {e}") from None
            names[name], vecs[name] = tables, vec
            maxq[name] = p.maxnum_catfeature_query_per_table_per_sample
            params.append(p)
        try:
            return cls(names, vecs, maxq, params, vol, per, src)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


# HPS JSON model keys beyond the required ones: JSON key -> (InferenceParams argument, type, default)
_MODEL_OPTIONAL = {
    "num_of_worker_buffer_in_pool": ("number_of_worker_buffers_in_pool", int, 2),
    "num_of_refresher_buffer_in_pool": ("number_of_refresh_buffers_in_pool", int, 1),
    "cache_refresh_percentage_per_iteration": ("cache_refresh_percentage_per_iteration", (int, float), 0.0),
    "maxnum_des_feature_per_sample": ("maxnum_des_feature_per_sample", int, 26),
    "refresh_delay": ("refresh_delay", (int, float), 0.0),
    "refresh_interval": ("refresh_interval", (int, float), 0.0),
    "use_static_table": ("use_static_table", bool, False),
    "use_context_stream": ("use_context_stream", bool, True),
    "use_hctr_cache_implementation": ("use_hctr_cache_implementation", bool, True),
    "thread_pool_size": ("thread_pool_size", int, 16),
    "init_ec": ("init_ec", bool, True),
    "enable_pagelock": ("enable_pagelock", bool, False),
    "fp8_quant": ("fp8_quant", bool, False),
    "fuse_embedding_table": ("fuse_embedding_table", bool, False),
}
_MODEL_KEYS = {
    "model",
    "sparse_files",
    "deployed_device_list",
    "embedding_vecsize_per_table",
    "max_batch_size",
    "default_value_for_each_table",
    "maxnum_catfeature_query_per_table_per_sample",
    "gpucache",
    "hit_rate_threshold",
    "gpucacheper",
    "dense_file",
    "embedding_table_names",
    "embedding_cache_type",
    "network_file",
    "label_dim",
    "slot_num",
    "non_trainable_params_file",
    *_MODEL_OPTIONAL,
}


class _Json:
    """One JSON object of the HPS file, read with errors naming the file and key path."""

    def __init__(self, obj, where: str):
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: must be a JSON object, got {json.dumps(obj)[:60]}")
        self.obj, self.where = obj, where

    def _check(self, key, value, typ, item=None):
        ok = _is(value, typ) and (item is None or all(_is(v, item) for v in value))
        if not ok:
            want = getattr(typ, "__name__", "number") + (f" of {getattr(item, '__name__', 'numbers')}" if item else "")
            raise ValueError(f"{self.where}: key {key!r} must be a {want}, got {json.dumps(value)[:60]}")
        return value

    def req(self, key: str, typ, item=None):
        if key not in self.obj:
            raise ValueError(f"{self.where}: missing key {key!r}")
        return self._check(key, self.obj[key], typ, item)

    def opt(self, key: str, typ, default, item=None):
        return self._check(key, self.obj[key], typ, item) if key in self.obj else default

    def sub(self, key: str):
        return _Json(self.obj[key], f"{self.where}, {key}") if key in self.obj else None

    def warn_unknown(self, known) -> None:
        for k in self.obj:
            if k not in known:
                warn_ignored(self.where, f"unknown key {k!r}", self.obj[k], "numbactr does not read it", stacklevel=3)


def _is(value, typ) -> bool:
    """isinstance, except that a JSON true/false is a bool only (not an int)."""
    types = typ if isinstance(typ, tuple) else (typ,)
    return bool in types if isinstance(value, bool) else isinstance(value, types)


class _Block:
    """How one database block of the HPS JSON maps to its parameter class: key -> (argument, type)."""

    def __init__(self, keys: dict, enums: dict):
        self.keys, self.enums = keys, enums

    def read(self, j: _Json | None, cls, overrides: dict | None = None):
        if j is None:
            return cls()
        kw = dict(overrides or {})
        j.warn_unknown(set(self.keys) | set(self.enums))
        for key, (arg, names) in self.enums.items():
            if key in j.obj:
                value = j.req(key, str)
                match = [e for e, ns in names.items() if value in (ns if isinstance(ns, tuple) else (ns,))]
                if not match:
                    accepted = sorted(n for ns in names.values() for n in (ns if isinstance(ns, tuple) else (ns,)))
                    raise ValueError(f"{j.where}: key {key!r} is {value!r}, not one of {accepted}")
                kw[arg] = match[0]
        for key, (arg, typ) in self.keys.items():
            if key in j.obj:
                kw[arg] = j.req(key, typ, str if arg == "update_filters" else None)
        try:
            return cls(**kw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{j.where}: {e}") from None


_VOLATILE_KEYS = _Block(
    {
        k: (k, t)
        for k, t in (
            ("address", str),
            ("user_name", str),
            ("password", str),
            ("num_partitions", int),
            ("allocation_rate", int),
            ("shared_memory_size", int),
            ("shared_memory_name", str),
            ("shared_memory_auto_remove", bool),
            ("num_node_connections", int),
            ("max_batch_size", int),
            ("enable_tls", bool),
            ("tls_ca_certificate", str),
            ("tls_client_certificate", str),
            ("tls_client_key", str),
            ("tls_server_name_identification", str),
            ("overflow_margin", int),
            ("overflow_resolution_target", (int, float)),
            ("initialize_after_startup", bool),
            ("initial_cache_rate", (int, float)),
            ("cache_missed_embeddings", bool),
            ("update_filters", list),
        )
    },
    {"type": ("type", _DB_NAMES), "overflow_policy": ("overflow_policy", _POLICY_NAMES)},
)
_PERSISTENT_KEYS = _Block(
    {
        k: (k, t)
        for k, t in (
            ("path", str),
            ("num_threads", int),
            ("read_only", bool),
            ("max_batch_size", int),
            ("initialize_after_startup", bool),
            ("update_filters", list),
        )
    },
    {"type": ("backend", _DB_NAMES)},
)
_SOURCE_KEYS = _Block(
    {
        k: (k, int)
        for k in (
            "metadata_refresh_interval_ms",
            "receive_buffer_size",
            "poll_timeout_ms",
            "max_batch_size",
            "failure_backoff_ms",
            "max_commit_interval",
        )
    }
    | {"brokers": ("brokers", str)},
    {"type": ("type", _SOURCE_NAMES)},
)
