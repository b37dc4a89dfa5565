"""SparseEmbedding and what it takes: HybridEmbeddingParam, numbactr's TierSpec / CacheConfig (a table in a
backing tier behind a cache), and HugeCTR's sizing of a table from workspace_size_per_gpu_in_mb."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from numbactr.enums import (
    CommunicationType,
    Embedding_t,
    HybridEmbeddingType,
)
from numbactr.validate import warn_ignored
from numbactr.validate import expect as _expect, number as _number
from numbactr.config.checks import _sizes
from numbactr.config.solver import OptParamsPy


def max_vocabulary_size_per_gpu(workspace_mb: float, vec_size: int, n_states: int) -> int:
    """HugeCTR's sizing: floor(workspace_MB * 2^20 / ((1 + n_states) * 4 * vec_size))."""
    return int(math.floor(workspace_mb * 2**20 / ((1 + n_states) * 4 * vec_size)))


def workspace_mb_for(rows: int, vec_size: int, n_states: int) -> int:
    return int(math.ceil(rows * (1 + n_states) * 4 * vec_size / 2**20))


@dataclass
class CacheConfig:
    """The fast tier's size and policy.

    policy: "lru" or "lfu". load_factor: the fraction of each table's rows the cache holds (FBGEMM's
    cache_load_factor). budget_bytes: instead, the bytes the cache may use for rows (weights, optimizer
    states, bookkeeping), shared among the tables in proportion to their rows. capacities: instead, the
    slots of each table (1..V_t). min_slots: the least slots any table gets (load factor and budget).
    prefetch_thread: prefetch() stages rows on a worker thread (the next forward waits for it); HugeCTR's
    GLOBAL kinds prefetch synchronously (their pass touches every slot).
    """

    policy: str = "lru"
    load_factor: float | None = 0.2
    budget_bytes: int | None = None
    capacities: list | None = None
    min_slots: int = 1
    prefetch_thread: bool = False


@dataclass
class TierSpec:
    """A tiered table's cache and backing tier in one argument (HugeCTR's SparseEmbedding takes it as its
    numbactr-only `embedding_cache`): cache (CacheConfig), backing ("host", "memmap" or "lmdb"), path (the
    memmap / lmdb directory; None: a temporary one)."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    backing: str = "host"
    path: str | None = None


class HybridEmbeddingParam:
    """``hugectr.HybridEmbeddingParam`` (HugeCTR v23.08's pybind order; the samples pass the eight positionally).

    Defaults are those HugeCTR's JSON reader uses (HugeCTR's Python binding has none). The two
    ``use_*_precompute_indices`` switches (newer HugeCTR) only move index computation into the reader thread;
    they change no result and numbactr accepts and ignores them. ``num_iterations_statistics`` is a
    CreateSolver argument, as in HugeCTR.
    """

    def __init__(
        self,
        max_num_frequent_categories=1,
        max_num_infrequent_samples=-1,
        p_dup_max=0.01,
        max_all_reduce_bandwidth=1.3e11,
        max_all_to_all_bandwidth=1.9e11,
        efficiency_bandwidth_ratio=1.0,
        communication_type=CommunicationType.IB_NVLink,
        hybrid_embedding_type=HybridEmbeddingType.Distributed,
        *,
        use_train_precompute_indices=False,
        use_eval_precompute_indices=False,
    ):
        who = "HybridEmbeddingParam"

        def integer(name, v, lo):
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{who}: {name} must be an integer >= {lo}, got {v!r}")
            return int(v)

        def real(name, v, lo_open, hi=None):
            if (
                not isinstance(v, numbers.Real)
                or isinstance(v, bool)
                or not math.isfinite(v)
                or v <= lo_open
                or (hi is not None and v > hi)
            ):
                rng = f"({lo_open}, {hi}]" if hi is not None else f"({lo_open}, inf)"
                raise ValueError(f"{who}: {name} must be a finite number in {rng}, got {v!r}")
            return float(v)

        self.max_num_frequent_categories = integer("max_num_frequent_categories", max_num_frequent_categories, 0)
        self.max_num_infrequent_samples = integer("max_num_infrequent_samples", max_num_infrequent_samples, -1)
        self.p_dup_max = real("p_dup_max", p_dup_max, 0.0, 1.0)
        self.max_all_reduce_bandwidth = real("max_all_reduce_bandwidth", max_all_reduce_bandwidth, 0.0)
        self.max_all_to_all_bandwidth = real("max_all_to_all_bandwidth", max_all_to_all_bandwidth, 0.0)
        self.efficiency_bandwidth_ratio = real("efficiency_bandwidth_ratio", efficiency_bandwidth_ratio, 0.0)
        if not isinstance(communication_type, CommunicationType):
            raise ValueError(
                f"{who}: communication_type must be a CommunicationType (IB_NVLink_Hier, IB_NVLink, "
                f"NVLink_SingleNode), got {communication_type!r}"
            )
        if not isinstance(hybrid_embedding_type, HybridEmbeddingType):
            raise ValueError(
                f"{who}: hybrid_embedding_type must be HybridEmbeddingType.Distributed, got {hybrid_embedding_type!r}"
            )
        self.communication_type = communication_type
        self.hybrid_embedding_type = hybrid_embedding_type
        self.use_train_precompute_indices = bool(use_train_precompute_indices)
        self.use_eval_precompute_indices = bool(use_eval_precompute_indices)

    def __repr__(self):
        return (
            f"HybridEmbeddingParam({self.max_num_frequent_categories}, {self.max_num_infrequent_samples}, "
            f"{self.p_dup_max}, {self.max_all_reduce_bandwidth}, {self.max_all_to_all_bandwidth}, "
            f"{self.efficiency_bandwidth_ratio}, {self.communication_type!r}, {self.hybrid_embedding_type!r})"
        )


EVICT_STRATEGIES = ("kLru", "kLfu", "kEpochLru", "kEpochLfu")


class SparseEmbedding:
    """``hugectr.SparseEmbedding`` (spec §5.2).

    numbactr's options for a hash embedding (keyword only; HugeCTR has none): ``max_capacity`` (None,
    HugeCTR's behaviour: the table holds what workspace_size_per_gpu_in_mb gives and a batch that needs
    more rows is a HashTableFullError; it never evicts) or the most keys the table holds, beyond which
    a new key takes the slot of its bucket's lowest-scored key (HierarchicalKV's evicting table:
    training streams past it without error; workspace_size_per_gpu_in_mb is then not used);
    ``evict_strategy`` (``"kLru"``, ``"kLfu"``, ``"kEpochLru"``, ``"kEpochLfu"``) and ``max_bucket_size``
    (128, or less below 128 keys) of that table; ``evict_to``: a lower tier that takes the rows of evicted
    keys instead of dropping them and gives a key back its row when it returns (any object with
    ``insert(tag, keys, values)``, ``fetch(tag, keys, width)`` and ``erase(tag, keys)``, e.g.
    numbactr.inference.backends' HashMapBackend, RedisClusterBackend, RocksDBBackend; the tag is the
    embedding's name). numbactr.embedding.sparse_evicting has the rules.
    """

    def __init__(
        self,
        embedding_type,
        workspace_size_per_gpu_in_mb=0,
        embedding_vec_size=1,
        combiner="sum",
        sparse_embedding_name="",
        bottom_name="",
        slot_size_array=(),
        optimizer=None,
        hybrid_embedding_param=None,
        embedding_cache=None,
        *,
        max_capacity=None,
        evict_strategy="kLru",
        max_bucket_size=None,
        evict_to=None,
    ):
        _expect(
            isinstance(embedding_type, Embedding_t),
            f"SparseEmbedding {sparse_embedding_name!r}: embedding_type must be an Embedding_t, got {embedding_type!r}",
        )
        _expect(
            combiner in ("sum", "mean"),
            f"SparseEmbedding {sparse_embedding_name!r}: combiner must be 'sum' or 'mean', got {combiner!r}",
        )
        _expect(
            isinstance(embedding_vec_size, int) and 0 < embedding_vec_size <= 1024,
            f"SparseEmbedding {sparse_embedding_name!r}: embedding_vec_size must be in 1..1024",
        )
        _expect(
            bool(sparse_embedding_name) and bool(bottom_name),
            "SparseEmbedding: sparse_embedding_name and bottom_name are required",
        )
        _number(
            f"SparseEmbedding {sparse_embedding_name!r}",
            "workspace_size_per_gpu_in_mb",
            workspace_size_per_gpu_in_mb,
            0,
        )
        _expect(
            optimizer is None or isinstance(optimizer, OptParamsPy),
            f"SparseEmbedding "
            f"{sparse_embedding_name!r}: optimizer must be a hugectr.CreateOptimizer(...) result (or None for "
            f"the model's optimizer), got {optimizer!r}",
        )
        self.embedding_type = embedding_type
        self.workspace_size_per_gpu_in_mb = workspace_size_per_gpu_in_mb
        self.embedding_vec_size = embedding_vec_size
        self.combiner = combiner
        self.sparse_embedding_name = sparse_embedding_name
        self.bottom_name = bottom_name
        self.slot_size_array = _sizes(f"SparseEmbedding {sparse_embedding_name!r}", slot_size_array)
        self.optimizer = optimizer if optimizer is not None else OptParamsPy()
        self.hybrid_embedding_param = hybrid_embedding_param
        # numbactr's extra: the table in a backing tier behind a cache (numbactr.embedding.tiered.TierSpec)
        _expect(
            embedding_cache is None or isinstance(embedding_cache, TierSpec),
            f"SparseEmbedding {sparse_embedding_name!r}: embedding_cache must be a "
            f"numbactr.embedding.tiered.TierSpec, got {embedding_cache!r}",
        )
        _expect(
            embedding_cache is None or embedding_cache.backing in ("host", "memmap"),
            f"SparseEmbedding {sparse_embedding_name!r}: embedding_cache backing must be 'host' or 'memmap' "
            "(its size is known from workspace_size_per_gpu_in_mb / slot_size_array)",
        )
        self.embedding_cache = embedding_cache
        who = f"SparseEmbedding {sparse_embedding_name!r}"
        self._evicting_options(who, max_capacity, evict_strategy, max_bucket_size, evict_to)
        if hybrid_embedding_param is not None and embedding_type != Embedding_t.HybridSparseEmbedding:
            warn_ignored(
                who,
                "hybrid_embedding_param",
                hybrid_embedding_param,
                f"used only by HybridSparseEmbedding, not {embedding_type.name}",
                stacklevel=2,
            )
        if embedding_type == Embedding_t.HybridSparseEmbedding:
            _expect(
                hybrid_embedding_param is None or isinstance(hybrid_embedding_param, HybridEmbeddingParam),
                f"{who}: hybrid_embedding_param must be a HybridEmbeddingParam, got {hybrid_embedding_param!r}",
            )
            _expect(
                bool(self.slot_size_array),
                f"{who}: HybridSparseEmbedding needs slot_size_array (one vocabulary size per slot)",
            )
        if self.slot_size_array and embedding_type == Embedding_t.DistributedSlotSparseEmbeddingHash:
            warn_ignored(
                who,
                "slot_size_array",
                self.slot_size_array,
                "DistributedSlotSparseEmbeddingHash hashes its keys: its size comes from workspace_size_per_gpu_in_mb",
                stacklevel=2,
            )

    def _evicting_options(self, who, max_capacity, evict_strategy, max_bucket_size, evict_to) -> None:
        """Check and keep numbactr's evicting-table options (class docstring)."""
        hashed = (Embedding_t.DistributedSlotSparseEmbeddingHash, Embedding_t.LocalizedSlotSparseEmbeddingHash)
        if max_capacity is not None:
            _expect(
                self.embedding_type in hashed,
                f"{who}: max_capacity is for the hash embeddings (Distributed / Localized), not "
                f"{self.embedding_type.name}",
            )
            _expect(
                isinstance(max_capacity, numbers.Integral) and not isinstance(max_capacity, bool) and max_capacity >= 1,
                f"{who}: max_capacity must be a positive key count or None, got {max_capacity!r}",
            )
            _expect(
                self.embedding_cache is None,
                f"{who}: max_capacity and embedding_cache cannot be combined (an evicting table is not tiered)",
            )
        _expect(
            evict_strategy in EVICT_STRATEGIES,
            f"{who}: evict_strategy must be one of {list(EVICT_STRATEGIES)}, got {evict_strategy!r}",
        )
        _expect(
            max_bucket_size is None
            or (isinstance(max_bucket_size, numbers.Integral) and not isinstance(max_bucket_size, bool)),
            f"{who}: max_bucket_size must be a positive integer or None, got {max_bucket_size!r}",
        )
        missing = [m for m in ("insert", "fetch", "erase") if not callable(getattr(evict_to, m, None))]
        _expect(
            evict_to is None or (max_capacity is not None and not missing),
            f"{who}: evict_to needs max_capacity and an object with insert, fetch and erase (a "
            f"numbactr.inference.backends backend), got {evict_to!r}",
        )
        self.max_capacity = None if max_capacity is None else int(max_capacity)
        self.evict_strategy, self.max_bucket_size, self.evict_to = evict_strategy, max_bucket_size, evict_to

    @property
    def evicting(self) -> bool:
        """A hash embedding with a max_capacity: it evicts rather than fill."""
        return self.max_capacity is not None
