"""FBGEMM's TBE enums with FBGEMM's names and integer values (fbgemm_gpu 1.8: tbe/config/embedding_config.py,
tbe/cache/cache_config.py, tbe/config/optimizer_config.py; re-exported by FBGEMM from this module path).

numbactr maps them onto numbactr.embedding.engine's enums in numbactr/fbgemm_gpu/tbe.py; FBGEMM's own enum
members (when fbgemm_gpu is installed beside numbactr) are accepted too, by value.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = [
    "EmbeddingLocation",
    "ComputeDevice",
    "PoolingMode",
    "BoundsCheckMode",
    "CacheAlgorithm",
    "RecordCacheMetrics",
    "WeightDecayMode",
    "MultiPassPrefetchConfig",
    "round_up",
]


class EmbeddingLocation(enum.IntEnum):
    """Where a table's rows live. DEVICE, MANAGED and HOST: the engine's one buffer on numbactr's device;
    MANAGED_CACHING: every row in host memory behind a cache of hot rows on the device (on the cpu
    device a RAM cache over host memory), numbactr.embedding.tiered; MTIA is not supported."""

    DEVICE = 0
    MANAGED = 1
    MANAGED_CACHING = 2
    HOST = 3
    MTIA = 4

    @classmethod
    def from_str(cls, key: str) -> "EmbeddingLocation":
        try:
            return cls[key.upper()]
        except KeyError:
            raise ValueError(f"Cannot parse value into EmbeddingLocation: {key}") from None


class ComputeDevice(enum.IntEnum):
    """Where the lookup runs. numbactr runs it on numbactr.runtime.device's device (gpu: CUDA; cpu/sim: CPU)."""

    CPU = 0
    CUDA = 1
    MTIA = 2


class PoolingMode(enum.IntEnum):
    SUM = 0
    MEAN = 1
    NONE = 2  # sequence embeddings: one output row per index

    def do_pooling(self) -> bool:
        return self is not PoolingMode.NONE

    @classmethod
    def from_str(cls, key: str) -> "PoolingMode":
        try:
            return cls[key.upper()]
        except KeyError:
            raise ValueError(f"Cannot parse value into PoolingMode: {key}") from None


class BoundsCheckMode(enum.IntEnum):
    FATAL = 0  # raise
    WARNING = 1  # warn once per call, set bad indices to row 0, repair offsets
    IGNORE = 2  # the same silently
    NONE = 3  # no check (the caller promises valid input)
    V2_IGNORE = 4  # FBGEMM's second bounds-check kernel: same semantics as the mode without V2_
    V2_WARNING = 5
    V2_FATAL = 6


class CacheAlgorithm(enum.Enum):
    LRU = 0
    LFU = 1


class RecordCacheMetrics(NamedTuple):
    """Which cache counters a MANAGED_CACHING TBE keeps (get_cache_miss_counter, get_table_wise_cache_miss)."""

    record_cache_miss_counter: bool = False
    record_tablewise_cache_miss: bool = False


class MultiPassPrefetchConfig(NamedTuple):
    """FBGEMM's multi-pass prefetch: split a prefetch's indices into up to num_passes passes of at least
    min_splitable_pass_size (get_prefetch_passes computes them; numbactr's own prefetch is one pass)."""

    num_passes: int = 12
    min_splitable_pass_size: int = 6 * 1024 * 1024


class WeightDecayMode(enum.IntEnum):
    NONE = 0
    L2 = 1  # EXACT_ROWWISE_ADAGRAD: g += wd * w before the accumulator
    DECOUPLE = 2  # EXACT_ROWWISE_ADAGRAD: w *= 1 - lr * wd
    COUNTER = 3  # counter-based regularization (not in numbactr)
    COWCLIP = 4  # (not in numbactr)
    DECOUPLE_GLOBAL = 5  # global weight decay (not in numbactr)


def round_up(a: int, b: int) -> int:
    """a rounded up to a multiple of b."""
    return int((a + b - 1) // b) * b
