"""DynamicEmb's table options (NVIDIA recsys-examples ``dynamicemb.DynamicEmbTableOptions``), its score
strategies, initializers and frequency admission, with DynamicEmb's names.

    DynamicEmbTableOptions(dim, max_capacity, init_capacity=None, max_load_factor=0.5,
                           score_strategy=DynamicEmbScoreStrategy.TIMESTAMP, bucket_capacity=128,
                           initializer_args=DynamicEmbInitializerArgs(), eval_initializer_args=CONSTANT 0,
                           admit_strategy=None, admission_counter=None)

How a score strategy maps onto HierarchicalKV's evicting table (numbactr.embedding.evicting):
  TIMESTAMP    kCustomized, every key of a forward scored with the host's nanosecond clock (DynamicEmb reads
               the device's global timer; either grows from one forward to the next).
  STEP         kCustomized, every key of a forward scored with the table's step (1 for the first forward).
  CUSTOMIZED   kCustomized, the scores given to the forward (one per index) or set by set_score.
  LFU          kLfu, + 1 for every occurrence of a key.
  NO_EVICTION  no key is ever evicted: a new key that finds its bucket full is refused (numbactr scores a
               held key 2**63 - 1 and each new key lower than every key before it, so HierarchicalKV's rule,
               a new key below its bucket's minimum is refused, never lets one push another out).

A key that is not stored (refused, not admitted, or pushed out by a later key of the same forward) is used
with its initializer row in that forward and gets no update, as DynamicEmb does for keys it does not
admit. Admission (``admit_strategy=FrequencyAdmissionStrategy(threshold)``): a key not in the table is
counted in a bounded counter table (``admission_counter=KVCounter(capacity, bucket_capacity)``, itself a
HierarchicalKV table whose least counted keys give way when it is full) and enters the table once its
count reaches the threshold; admitted keys leave the counter.
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass, field

import numpy as np

from numbactr.kernels import embedding_init

__all__ = [
    "DynamicEmbScoreStrategy",
    "DynamicEmbInitializerMode",
    "DynamicEmbInitializerArgs",
    "DynamicEmbTableOptions",
    "FrequencyAdmissionStrategy",
    "KVCounter",
]


class DynamicEmbScoreStrategy(enum.IntEnum):
    """How the keys of a forward are scored (module docstring)."""

    TIMESTAMP = 0
    STEP = 1
    CUSTOMIZED = 2
    LFU = 3
    NO_EVICTION = 4


class DynamicEmbInitializerMode(enum.Enum):
    NORMAL = "normal"
    UNIFORM = "uniform"
    CONSTANT = "constant"


@dataclass
class DynamicEmbInitializerArgs:
    """How new rows start: NORMAL (mean, std_dev), UNIFORM (lower, upper; None: -+sqrt(1 / max_capacity))
    or CONSTANT (value). Drawn from a hash of (seed, key, d): the same on every device."""

    mode: DynamicEmbInitializerMode = DynamicEmbInitializerMode.UNIFORM
    mean: float = 0.0
    std_dev: float = 1.0
    lower: float | None = None
    upper: float | None = None
    value: float = 0.0

    def rows(self, keys: np.ndarray, dim: int, seed: int, capacity: int) -> np.ndarray:
        """(n, dim) float32 initial rows of keys (n,) uint64 (host)."""
        keys = np.asarray(keys, np.uint64)
        if self.mode == DynamicEmbInitializerMode.CONSTANT:
            return np.full((keys.shape[0], dim), self.value, np.float32)
        if self.mode == DynamicEmbInitializerMode.UNIFORM:
            bound = float(np.sqrt(1.0 / capacity))
            lo = -bound if self.lower is None else float(self.lower)
            hi = bound if self.upper is None else float(self.upper)
            return embedding_init.row_values_ref(keys, dim, seed, lo, hi)
        # NORMAL: Box-Muller over two hashed uniforms per value
        u = embedding_init.row_values_ref(keys, 2 * dim, seed, 0.0, 1.0).astype(np.float64)
        z = np.sqrt(-2.0 * np.log(1.0 - u[:, :dim])) * np.cos(2.0 * np.pi * u[:, dim:])
        return (self.mean + self.std_dev * z).astype(np.float32)


@dataclass
class KVCounter:
    """The bounded table that counts keys not yet admitted (DynamicEmb's KVCounter)."""

    capacity: int
    bucket_capacity: int = 1024


class FrequencyAdmissionStrategy:
    """Admit a key once it was seen threshold times (DynamicEmb's FrequencyAdmissionStrategy);
    initializer_args: the rows of keys not admitted (None: the table's initializer)."""

    def __init__(self, threshold: int, initializer_args: DynamicEmbInitializerArgs | None = None):
        if not isinstance(threshold, numbers.Integral) or threshold < 0:
            raise ValueError(f"FrequencyAdmissionStrategy: threshold must be a non-negative integer, got {threshold!r}")
        self.threshold = int(threshold)
        self.initializer_args = initializer_args

    def admit(self, keys: np.ndarray, frequencies: np.ndarray) -> np.ndarray:
        """(N,) bool: frequency >= threshold."""
        if keys.shape[0] != frequencies.shape[0]:
            raise ValueError(
                f"FrequencyAdmissionStrategy.admit: {keys.shape[0]} keys but {frequencies.shape[0]} frequencies"
            )
        return np.asarray(frequencies) >= self.threshold


def _eval_default() -> DynamicEmbInitializerArgs:
    return DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT, value=0.0)


@dataclass
class DynamicEmbTableOptions:
    """One dynamic table's options (DynamicEmb's names; module docstring). max_capacity: the most keys the
    table holds (required); init_capacity: the first capacity (None: max_capacity), doubling while the load
    factor would pass max_load_factor; bucket_capacity: the slots of a bucket (HierarchicalKV's
    max_bucket_size). eval_initializer_args: what an evaluation lookup of a missing key reads (CONSTANT)."""

    dim: int | None = None
    max_capacity: int | None = None
    init_capacity: int | None = None
    max_load_factor: float = 0.5
    score_strategy: DynamicEmbScoreStrategy = DynamicEmbScoreStrategy.TIMESTAMP
    bucket_capacity: int = 128
    initializer_args: DynamicEmbInitializerArgs = field(default_factory=DynamicEmbInitializerArgs)
    eval_initializer_args: DynamicEmbInitializerArgs = field(default_factory=_eval_default)
    admit_strategy: FrequencyAdmissionStrategy | None = None
    admission_counter: KVCounter | None = None

    def check(self, who: str) -> None:
        """ValueError naming the option that is wrong."""

        def positive(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{who}: {name} must be a positive integer, got {v!r}")

        positive("dim")
        positive("max_capacity")
        positive("bucket_capacity")
        if self.init_capacity is not None:
            positive("init_capacity")
        if not isinstance(self.score_strategy, DynamicEmbScoreStrategy):
            raise ValueError(f"{who}: score_strategy must be a DynamicEmbScoreStrategy, got {self.score_strategy!r}")
        if self.eval_initializer_args.mode != DynamicEmbInitializerMode.CONSTANT:
            raise ValueError(f"{who}: eval_initializer_args must be CONSTANT (DynamicEmb's rule)")
        if self.admit_strategy is not None and not isinstance(self.admit_strategy, FrequencyAdmissionStrategy):
            raise ValueError(
                f"{who}: admit_strategy must be a FrequencyAdmissionStrategy or None, got {self.admit_strategy!r}"
            )
        if self.admission_counter is not None and not isinstance(self.admission_counter, KVCounter):
            raise ValueError(f"{who}: admission_counter must be a KVCounter or None, got {self.admission_counter!r}")
