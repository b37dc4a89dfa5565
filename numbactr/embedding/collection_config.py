"""HugeCTR's EmbeddingCollection configuration objects, checked as they are built.

HugeCTR's names and arguments (v23.08/v23.12 ``embedding_collection_wrapper.hpp``):

    EmbeddingTableConfig(name, max_vocabulary_size, ev_size, opt_params_or_empty=None, init_param_or_empty=None)
    EmbeddingCollectionConfig(use_exclusive_keys=False, comm_strategy=CommunicationStrategy.Uniform)
        .embedding_lookup(table_config, bottom_name, top_name, combiner)          one lookup, one top
        .embedding_lookup([table_config], [bottom_name], top_name, [combiner])    HugeCTR's batch-major form
        .shard(shard_matrix, shard_strategy)

A table is static (max_vocabulary_size = V > 0: row = key) or dynamic (-1: a growing hash table); a combiner
is "sum", "average" (or "mean") or "concat". Why checked here and not at model.add: the error then points at
the line of the script that made the mistake. What the objects do at run time: collection.py.
"""

from __future__ import annotations

import numpy as np

from numbactr.config import OptParamsPy
from numbactr.enums import CommunicationStrategy
from numbactr.embedding.engine import Pooling

__all__ = ["EmbeddingTableConfig", "EmbeddingCollectionConfig", "CollectionError", "COMBINERS", "MAX_EV"]

COMBINERS = {"sum": Pooling.SUM, "average": Pooling.MEAN, "mean": Pooling.MEAN, "concat": Pooling.NONE}
MAX_EV = 1024  # HugeCTR's largest embedding vector


class CollectionError(ValueError):
    """A wrong EmbeddingCollection configuration or input; the message names the table/lookup."""


def _name_ok(name) -> bool:
    """Table names become folder names in embedding_dump."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


class EmbeddingTableConfig:
    """``hugectr.EmbeddingTableConfig``: one table of ``ev_size``-wide rows; max_vocabulary_size -1 is a
    dynamic (growing hash) table, V > 0 a static one of V rows indexed by key.

    numbactr's options for a dynamic table (keyword only; HugeCTR has none): ``max_capacity`` (None, HugeCTR's
    behaviour: the table grows as long as memory lasts and never evicts) or the most keys the table holds
    per rank, beyond which a new key takes the slot of its bucket's lowest-scored key (HierarchicalKV's
    evicting table, numbactr.embedding.evicting; training streams past it without error); ``evict_strategy``
    ("kLru", "kLfu", "kEpochLru", "kEpochLfu") and ``max_bucket_size`` (128, or less below 128 keys) of that
    table (numbactr.embedding.collection_evicting)."""

    def __init__(
        self,
        name,
        max_vocabulary_size,
        ev_size,
        opt_params_or_empty=None,
        init_param_or_empty=None,
        *,
        max_capacity=None,
        evict_strategy="kLru",
        max_bucket_size=None,
    ):
        if not _name_ok(name):
            raise CollectionError(
                f"EmbeddingTableConfig: name must be a non-empty string without '/' or '\\' "
                f"(it names the table's folder in embedding_dump), got {name!r}"
            )
        who = f"EmbeddingTableConfig {name!r}"
        if (
            isinstance(max_vocabulary_size, bool)
            or not isinstance(max_vocabulary_size, (int, np.integer))
            or not (max_vocabulary_size == -1 or max_vocabulary_size > 0)
        ):
            raise CollectionError(
                f"{who}: max_vocabulary_size must be -1 (dynamic table) or a positive row "
                f"count, got {max_vocabulary_size!r}"
            )
        if isinstance(ev_size, bool) or not isinstance(ev_size, (int, np.integer)) or not 1 <= ev_size <= MAX_EV:
            raise CollectionError(f"{who}: ev_size must be an integer in 1..{MAX_EV}, got {ev_size!r}")
        if opt_params_or_empty is not None and (
            not isinstance(opt_params_or_empty, OptParamsPy) or not opt_params_or_empty.initialized
        ):
            raise CollectionError(
                f"{who}: opt_params_or_empty must come from CreateOptimizer() or be None (the "
                f"model's optimizer), got {opt_params_or_empty!r}"
            )
        if init_param_or_empty is not None:
            raise NotImplementedError(
                f"{who}: init_param_or_empty is not supported by numbactr (HugeCTR's "
                "Python API has no way to build one either); leave it None"
            )
        if max_capacity is not None:
            if max_vocabulary_size != -1:
                raise CollectionError(f"{who}: max_capacity is for dynamic tables (max_vocabulary_size=-1)")
            if isinstance(max_capacity, bool) or not isinstance(max_capacity, (int, np.integer)) or max_capacity < 1:
                raise CollectionError(f"{who}: max_capacity must be a positive key count or None, got {max_capacity!r}")
        if evict_strategy not in ("kLru", "kLfu", "kEpochLru", "kEpochLfu"):
            raise CollectionError(
                f"{who}: evict_strategy must be 'kLru', 'kLfu', 'kEpochLru' or 'kEpochLfu', got {evict_strategy!r}"
            )
        self.max_capacity = None if max_capacity is None else int(max_capacity)
        self.evict_strategy, self.max_bucket_size = evict_strategy, max_bucket_size
        self.name = name
        self.max_vocabulary_size = int(max_vocabulary_size)
        self.ev_size = int(ev_size)
        self.opt_params_or_empty = opt_params_or_empty
        self.init_param_or_empty = None

    @property
    def dynamic(self) -> bool:
        return self.max_vocabulary_size == -1

    @property
    def evicting(self) -> bool:
        """A dynamic table with a max_capacity: it evicts rather than grow past it."""
        return self.max_capacity is not None

    def _same(self, other: "EmbeddingTableConfig") -> bool:
        fields = ("max_vocabulary_size", "ev_size", "opt_params_or_empty", "max_capacity", "evict_strategy")
        return all(getattr(self, f) == getattr(other, f) for f in fields) and (
            self.max_bucket_size == other.max_bucket_size
        )

    def __repr__(self):
        return (
            f"EmbeddingTableConfig(name={self.name!r}, max_vocabulary_size={self.max_vocabulary_size}, "
            f"ev_size={self.ev_size})"
        )


class EmbeddingCollectionConfig:
    """``hugectr.EmbeddingCollectionConfig``: lookups, tables (in order of first use) and the sharding.
    use_exclusive_keys and comm_strategy choose HugeCTR's GPU sort and communication algorithms; they do
    not change the math, and numbactr accepts them without acting on them."""

    def __init__(self, use_exclusive_keys: bool = False, comm_strategy=CommunicationStrategy.Uniform):
        if not isinstance(comm_strategy, CommunicationStrategy):
            raise CollectionError(
                f"EmbeddingCollectionConfig: comm_strategy must be a CommunicationStrategy "
                f"(Uniform or Hierarchical), got {comm_strategy!r}"
            )
        self.use_exclusive_keys = bool(use_exclusive_keys)
        self.comm_strategy = comm_strategy
        self.tables: list[EmbeddingTableConfig] = []
        self.lookups: list[tuple[str, str, str, str]] = []  # (table name, bottom, top, combiner)
        self.batch_major_top: str | None = None
        self.shard_matrix: list[list[str]] | None = None
        self.shard_strategy: list[tuple[str, list[str]]] | None = None

    def embedding_lookup(self, table_config, bottom_name, top_name, combiner) -> None:
        if isinstance(table_config, (list, tuple)):
            return self._batch_major(table_config, bottom_name, top_name, combiner)
        if not isinstance(table_config, EmbeddingTableConfig):
            raise CollectionError(
                f"embedding_lookup: table_config must be an EmbeddingTableConfig (or a list of "
                f"them), got {type(table_config).__name__}"
            )
        for what, v in (("bottom_name", bottom_name), ("top_name", top_name)):
            if not isinstance(v, str) or not v:
                raise CollectionError(
                    f"embedding_lookup (table {table_config.name!r}): {what} must be a non-empty string, got {v!r}"
                )
        if combiner not in COMBINERS:
            raise CollectionError(
                f"embedding_lookup {top_name!r} (table {table_config.name!r}): combiner "
                f"{combiner!r} is not supported; use 'sum', 'average' (or 'mean') or 'concat'"
            )
        if any(top_name == t for _, _, t, _ in self.lookups):
            raise CollectionError(f"embedding_lookup: top_name {top_name!r} is already a lookup's top")
        known = [t for t in self.tables if t.name == table_config.name]
        if known and not known[0]._same(table_config):
            raise CollectionError(
                f"embedding_lookup {top_name!r}: two different tables are named "
                f"{table_config.name!r} ({known[0]} and {table_config})"
            )
        if not known:
            self.tables.append(table_config)
        self.lookups.append((table_config.name, bottom_name, top_name, combiner))

    def _batch_major(self, tables, bottoms, top_name, combiners) -> None:
        """HugeCTR's list form: lookup i is named top_name + str(i) inside; only top_name is a tensor."""
        if self.lookups:
            raise CollectionError(
                "embedding_lookup with lists (one batch-major top) must be the collection's "
                "only embedding_lookup call (HugeCTR: 'empty lookup params required')"
            )
        if (
            not isinstance(bottoms, (list, tuple))
            or not isinstance(combiners, (list, tuple))
            or not len(tables) == len(bottoms) == len(combiners)
            or not tables
        ):
            raise CollectionError(
                f"embedding_lookup {top_name!r}: the list form needs equally long non-empty "
                f"lists of tables, bottom names and combiners, got {len(tables)}, "
                f"{len(bottoms) if isinstance(bottoms, (list, tuple)) else bottoms!r} and "
                f"{len(combiners) if isinstance(combiners, (list, tuple)) else combiners!r}"
            )
        if not isinstance(top_name, str) or not top_name:
            raise CollectionError(f"embedding_lookup: top_name must be a non-empty string, got {top_name!r}")
        for i, (t, b, c) in enumerate(zip(tables, bottoms, combiners)):
            self.embedding_lookup(t, b, f"{top_name}{i}", c)
        self.batch_major_top = top_name

    def shard(self, shard_matrix, shard_strategy) -> None:
        """shard_matrix: one list of table names per rank (GPU); shard_strategy: [("mp"|"dp", [names])]."""
        try:
            matrix = [[str(n) for n in row] for row in shard_matrix]
            strategy = [(str(s), [str(n) for n in names]) for s, names in shard_strategy]
        except (TypeError, ValueError):
            raise CollectionError(
                f"shard: shard_matrix must be a list of lists of table names and shard_strategy "
                f'a list of ("mp"|"dp", [table names]) pairs, got {shard_matrix!r} and '
                f"{shard_strategy!r}"
            ) from None
        self.shard_matrix, self.shard_strategy = matrix, strategy
