"""FBGEMM's TBE optimizer configuration types (fbgemm_gpu 1.8: tbe/config/optimizer_config.py, re-exported by
split_table_batched_embeddings_ops_training), with FBGEMM's names, fields and defaults, so that scripts which
build them import unchanged. numbactr runs all of them but EnsembleModeDefinition (ENSEMBLE_ROWWISE_ADAGRAD,
which FBGEMM gates as inactive; passing it with its optimizer is a clear error, see array_tbe.py). They stay
frozen dataclasses, as in FBGEMM, where config systems expect dataclasses.
"""

import enum
from dataclasses import dataclass, field

__all__ = [
    "CounterWeightDecayMode",
    "StepMode",
    "LearningRateMode",
    "GradSumDecay",
    "TailIdThreshold",
    "CounterBasedRegularizationDefinition",
    "CowClipDefinition",
    "GlobalWeightDecayDefinition",
    "UserEnabledConfigDefinition",
    "EnsembleModeDefinition",
    "EmainplaceModeDefinition",
    "DoesNotHavePrefix",
]


class DoesNotHavePrefix(Exception):
    """get_states(prefix) of a state the module does not keep (FBGEMM's exception)."""


class CounterWeightDecayMode(enum.IntEnum):
    NONE = 0
    L2 = 1
    DECOUPLE = 2
    ADAGRADW = 3


class StepMode(enum.IntEnum):
    NONE = 0
    USE_COUNTER = 1
    USE_ITER = 2


class LearningRateMode(enum.IntEnum):
    EQUAL = -1
    TAIL_ID_LR_INCREASE = 0
    TAIL_ID_LR_DECREASE = 1
    COUNTER_SGD = 2


class GradSumDecay(enum.IntEnum):
    NO_DECAY = -1
    CTR_DECAY = 0


@dataclass(frozen=True)
class TailIdThreshold:
    val: float = 0
    is_ratio: bool = False


@dataclass(frozen=True)
class CounterBasedRegularizationDefinition:
    """WeightDecayMode.COUNTER's settings (EXACT_ROWWISE_ADAGRAD with per-row prev_iter and row_counter states;
    the rules: numbactr/kernels/tbe_math.py, counter_row_scalars). grad_sum_decay is read by none of FBGEMM's
    kernels, nor by numbactr's."""

    counter_weight_decay_mode: CounterWeightDecayMode = CounterWeightDecayMode.NONE
    counter_halflife: int = -1
    adjustment_iter: int = -1
    adjustment_ub: float = 1.0
    learning_rate_mode: LearningRateMode = LearningRateMode.EQUAL
    grad_sum_decay: GradSumDecay = GradSumDecay.NO_DECAY
    tail_id_threshold: TailIdThreshold = field(default_factory=TailIdThreshold)
    max_counter_update_freq: int = 1000


@dataclass(frozen=True)
class CowClipDefinition:
    """WeightDecayMode.COWCLIP's settings (EXACT_ROWWISE_ADAGRAD; the multiplier clipped by the row counter
    times max(weight_norm_coefficient |w|, lower_bound) / |g|)."""

    counter_weight_decay_mode: CounterWeightDecayMode = CounterWeightDecayMode.NONE
    counter_halflife: int = -1
    weight_norm_coefficient: float = 0.0
    lower_bound: float = 0.0


@dataclass(frozen=True)
class GlobalWeightDecayDefinition:
    """WeightDecayMode.DECOUPLE_GLOBAL's settings (applied by numbactr.fbgemm_gpu.tbe_optimizer through the engine's scale_rows)."""

    start_iter: int = 0
    lower_bound: float = 0.0


@dataclass(frozen=True)
class UserEnabledConfigDefinition:
    """Opt-in modes. numbactr runs the writeback ones (EXACT_SGD: only the first occurrence of each
    (feature, index) in a batch keeps its gradient; writeback_first_feature_only: only feature 0's);
    precompute_writeback changes nothing here (numbactr computes the mask in the backward);
    use_rowwise_bias_correction (ADAM): the bias corrections use each row's own update count (a per-row
    row_counter state) instead of the iteration."""

    use_rowwise_bias_correction: bool = False
    use_writeback_bwd_prehook: bool = False
    writeback_first_feature_only: bool = False
    precompute_writeback: bool = False


@dataclass(frozen=True)
class EnsembleModeDefinition:
    """ENSEMBLE_ROWWISE_ADAGRAD's settings: not run by numbactr."""

    step_ema: float = 10000
    step_swap: float = 10000
    step_start: float = 0
    step_ema_coef: float = 0.6
    step_mode: StepMode = StepMode.USE_ITER


@dataclass(frozen=True)
class EmainplaceModeDefinition:
    """EMAINPLACE_ROWWISE_ADAGRAD's settings (numbactr.fbgemm_gpu.tbe_optimizer.TBEOptimizerState.ema_inplace)."""

    step_ema: float = 10
    step_start: float = 0
    step_ema_coef: float = 0.6
