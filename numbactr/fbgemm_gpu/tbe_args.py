"""FBGEMM's TBE arguments: the constructor's config, the enum and layout mapping, and the checks.

Contract: TBEConfig holds FBGEMM's constructor arguments after (embedding_specs, feature_table_map) in FBGEMM's
order and defaults; check_supported raises (or warns, for an argument without effect here) where FBGEMM's rules
or numbactr's support reject them; optimizer_spec maps FBGEMM's optimizer settings onto the engine's fused
optimizer (numbactr.embedding.engine.OptimizerSpec); _vbe_layout pads a variable-batch input to the engine's
fixed batch. Why a module of its own: the array, torch and dense faces (array_tbe, torch_tbe, dense_tbe) read
the same arguments, so each mapping is written once. What each argument does: array_tbe.py's docstring.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np

from numbactr.runtime import device
from numbactr.validate import IgnoredArgumentWarning
from numbactr.embedding.engine import CounterRegularization, Optim, OptimizerSpec, Precision, WeightDecay
from numbactr.fbgemm_gpu.optimizer_config import EmainplaceModeDefinition
from numbactr.fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    BoundsCheckMode,
    CacheAlgorithm,
    ComputeDevice,
    EmbeddingLocation,
    PoolingMode,
    WeightDecayMode,
)

#: FBGEMM optimizer -> the engine's fused optimizer
_ENGINE_OPTIM = {
    EmbOptimType.NONE: Optim.NONE,
    EmbOptimType.EXACT_SGD: Optim.EXACT_SGD,
    EmbOptimType.EXACT_ADAGRAD: Optim.EXACT_ADAGRAD,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: Optim.EXACT_ROWWISE_ADAGRAD,
    EmbOptimType.ADAM: Optim.ADAM,
    EmbOptimType.PARTIAL_ROWWISE_ADAM: Optim.PARTIAL_ROWWISE_ADAM,
    EmbOptimType.LAMB: Optim.LAMB,
    EmbOptimType.PARTIAL_ROWWISE_LAMB: Optim.PARTIAL_ROWWISE_LAMB,
    # rowwise AdaGrad whose training forwards also move each row's second half towards its first (ema_inplace)
    EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD: Optim.EXACT_ROWWISE_ADAGRAD,
    EmbOptimType.LARS_SGD: Optim.LARS_SGD,
}
#: FBGEMM's rowwise AdaGrad kinds: rowwise momentum1 and the rowwise weight-decay modes
_ROWWISE = frozenset({EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD})
SUPPORTED_OPTIMIZERS = tuple(_ENGINE_OPTIM)
#: optimizers whose forward advances FBGEMM's `iter` (ADAM and LAMB kinds read it as the step t)
_COUNTS_ITER = frozenset(
    {
        EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        EmbOptimType.ADAM,
        EmbOptimType.PARTIAL_ROWWISE_ADAM,
        EmbOptimType.LAMB,
        EmbOptimType.PARTIAL_ROWWISE_LAMB,
        EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD,
    }
)
#: optimizers that take weight_decay (the rest ignore it, as in FBGEMM)
_DECAYS = _COUNTS_ITER | {EmbOptimType.LARS_SGD}
#: get_optimizer_state()'s names of split_optimizer_states()'s entries (PyTorch optimizers' names)
_STATE_NAMES = {
    EmbOptimType.EXACT_ADAGRAD: ("sum",),
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: ("sum",),
    EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD: ("sum",),
    EmbOptimType.ADAM: ("exp_avg", "exp_avg_sq"),
    EmbOptimType.PARTIAL_ROWWISE_ADAM: ("exp_avg", "exp_avg_sq"),
    EmbOptimType.LAMB: ("exp_avg", "exp_avg_sq"),
    EmbOptimType.PARTIAL_ROWWISE_LAMB: ("exp_avg", "exp_avg_sq"),
    EmbOptimType.EXACT_SGD: (),
}
_PRECISION = {SparseType.FP32: Precision.FP32, SparseType.FP16: Precision.FP16, SparseType.INT8: Precision.INT8}
_OUTPUT_DTYPES = (SparseType.FP32, SparseType.FP16)
_WEIGHT_DECAY = {
    WeightDecayMode.NONE: WeightDecay.NONE,
    WeightDecayMode.L2: WeightDecay.L2,
    WeightDecayMode.DECOUPLE: WeightDecay.DECOUPLE,
    WeightDecayMode.COUNTER: WeightDecay.COUNTER,
    WeightDecayMode.COWCLIP: WeightDecay.COWCLIP,
}
#: get_optimizer_state()'s names of the states some modes add (kernels.tbe.PREV_ITER / ROW_COUNTER)
_EXTRA_STATE_NAMES = {"prev_iter": "prev_iter", "row_counter": "row_counter"}
_V2_BOUNDS = {
    BoundsCheckMode.V2_IGNORE: BoundsCheckMode.IGNORE,
    BoundsCheckMode.V2_WARNING: BoundsCheckMode.WARNING,
    BoundsCheckMode.V2_FATAL: BoundsCheckMode.FATAL,
}
WHO = "SplitTableBatchedEmbeddingBagsCodegen"


@dataclass
class TBEConfig:
    """FBGEMM's constructor arguments after embedding_specs and feature_table_map, in FBGEMM's order and
    with FBGEMM's defaults (so positional calls keep working). What numbactr does with each:"""

    cache_algorithm: object = CacheAlgorithm.LRU  # MANAGED_CACHING tables: LRU | LFU
    cache_load_factor: float = 0.2  #   the cache's rows / the caching tables' rows
    cache_sets: int = 0  #   > 0: the cache holds cache_sets * 32 rows
    cache_reserved_memory: float = 0.0  #   bytes of the fast tier the cache leaves free
    cache_precision: object = None  # None: weights_precision (no other supported)
    weights_precision: object = SparseType.FP32  # FP32 | FP16 | INT8 (forward only, as FBGEMM's CPU)
    output_dtype: object = SparseType.FP32  # FP32 | FP16
    enforce_hbm: bool = False  # cache placement (as cache_*)
    optimizer: object = EmbOptimType.EXACT_SGD  # SUPPORTED_OPTIMIZERS
    record_cache_metrics: object = None  # RecordCacheMetrics: get_cache_miss_counter & co.
    gather_uvm_cache_stats: bool = False  # get_uvm_cache_stats
    stochastic_rounding: bool = True  # FP16 weights: stochastic rounding of updates
    gradient_clipping: bool = False  # clamp dLoss/dout to +-max_gradient
    max_gradient: float = 1.0
    max_norm: float = 0.0  # EXACT_ROWWISE_ADAGRAD: cap updated rows' L2 norm
    learning_rate: float = 0.01
    eps: float = 1.0e-8
    momentum: float = 0.9  # LARS_SGD's momentum
    weight_decay: float = 0.0
    weight_decay_mode: object = WeightDecayMode.NONE  # NONE | L2 | DECOUPLE | COUNTER | COWCLIP (rowwise Adagrad)
    eta: float = 0.001  # LARS_SGD's trust coefficient
    beta1: float = 0.9
    beta2: float = 0.999
    ensemble_mode: object = None  # ENSEMBLE_ROWWISE_ADAGRAD only (not supported): unused
    emainplace_mode: object = None  # EMAINPLACE_ROWWISE_ADAGRAD's EmainplaceModeDefinition
    counter_based_regularization: object = None  # WeightDecayMode.COUNTER's settings
    cowclip_regularization: object = None  # WeightDecayMode.COWCLIP's settings
    pooling_mode: object = PoolingMode.SUM  # SUM | MEAN | NONE
    device: object = None  # must agree with numbactr's device (see TBECore)
    bounds_check_mode: object = BoundsCheckMode.WARNING  # FATAL | WARNING | IGNORE | NONE (+ V2_ forms)
    uvm_non_rowwise_momentum: bool = False  # UVM placement: warns when set
    use_experimental_tbe: bool = False  # FBGEMM's kernel choice: warns when set
    prefetch_pipeline: bool = False  # prefetch() on a worker thread (LRU only, FBGEMM's)
    stats_reporter_config: object = None  # FBGEMM's monitoring hooks: warn when set
    table_names: object = None  # kept as .table_names
    optimizer_state_dtypes: object = None  # only FP32 states (else NotImplementedError)
    multipass_prefetch_config: object = None  # prefetch in several passes: warns when set
    global_weight_decay: object = None  # WeightDecayMode.DECOUPLE_GLOBAL's start_iter, lower_bound
    uvm_host_mapped: bool = False  # UVM allocation: warns when set
    extra_optimizer_config: object = None  # writeback (EXACT_SGD); rowwise bias correction (ADAM)
    tbe_input_multiplexer_config: object = None  # FBGEMM's monitoring hooks: warn when set
    embedding_table_index_type: object = None  # int32 | int64 (None: int64); numbactr reads both
    embedding_table_offset_type: object = None  #   kinds of indices and offsets as they come
    embedding_shard_info: object = None  # sharding metadata for FBGEMM's monitoring: kept
    enable_raw_embedding_streaming: bool = False  # not implemented
    res_params: object = None  # raw embedding streaming only: unused
    is_qr_tbe: bool = False  # unused
    preallocated_host_buffers: object = None  # {"weights"/"momentum1"/"momentum2": 1-D host array}: the
    #   tables' storage (HOST tables, dims a multiple of 16 bytes)


def _value(x):
    """An enum member's value (FBGEMM passes .value of its enums to OptimizerArgs), or x itself."""
    return getattr(x, "value", x)


class OptimizerArgs(NamedTuple):
    """FBGEMM's OptimizerArgs (fbgemm_gpu 1.8's fields, its order): what a module's ``optimizer_args`` reads
    back. The learning rate is not among them (FBGEMM keeps it in learning_rate_tensor)."""

    stochastic_rounding: bool
    gradient_clipping: bool
    max_gradient: float
    max_norm: float
    eps: float
    beta1: float
    beta2: float
    weight_decay: float
    weight_decay_mode: int
    eta: float
    momentum: float
    counter_halflife: int
    adjustment_iter: int
    adjustment_ub: float
    learning_rate_mode: int
    grad_sum_decay: int
    tail_id_threshold: float
    is_tail_id_thresh_ratio: int
    total_hash_size: int
    weight_norm_coefficient: float
    lower_bound: float
    regularization_mode: int
    use_rowwise_bias_correction: bool


#: arguments accepted but without effect in numbactr: a non-default value warns (IgnoredArgumentWarning)
_IGNORED = {
    "uvm_non_rowwise_momentum": "optimizer states live beside the weights in the engine's storage",
    "use_experimental_tbe": "numbactr has one TBE implementation per device",
    "multipass_prefetch_config": "numbactr places a batch's rows in one pass",
    "stats_reporter_config": "FBGEMM's stats reporter is not supported",
    "tbe_input_multiplexer_config": "FBGEMM's input multiplexer is not supported",
    "uvm_host_mapped": "numbactr allocates no UVM",
}


def _emainplace_mode(definition) -> dict:
    """FBGEMM's dict of an EmainplaceModeDefinition (None: the defaults), its values as floats."""
    definition = EmainplaceModeDefinition() if definition is None else definition
    mode = {f.name: float(_value(getattr(definition, f.name))) for f in fields(EmainplaceModeDefinition)}
    if mode["step_ema"] < 1:
        raise ValueError(f"{WHO}: emainplace_mode.step_ema must be at least 1, got {mode['step_ema']}")
    return mode


def _enum(cls, value, what: str):
    """value as a member of cls: a member, FBGEMM's own member (matched by value), a value or a name."""
    if isinstance(value, cls):
        return value
    raw = value.value if isinstance(value, enum.Enum) else value
    try:
        return cls(raw)
    except ValueError:
        pass
    if isinstance(raw, str) and raw.upper() in cls.__members__:
        return cls[raw.upper()]
    raise ValueError(f"{WHO}: {what}={value!r} is not a {cls.__name__} (one of {', '.join(cls.__members__)})")


def _dtype_name(dtype, what: str) -> str:
    """'int32' or 'int64' for a torch or NumPy integer dtype (None: int64)."""
    text = str(dtype)
    try:
        name = "int64" if dtype is None else text[6:] if text.startswith("torch.") else np.dtype(dtype).name
    except TypeError:
        name = text
    if name not in ("int32", "int64"):
        raise ValueError(f"{WHO}: {what} must be int32 or int64, got {dtype}")
    return name


class FBGEMMAssertion(ValueError, AssertionError):
    """An argument FBGEMM rejects with an AssertionError (so `except AssertionError` code keeps working); a
    ValueError too, as numbactr's other argument errors are."""


def _counter_settings(cfg: TBEConfig, mode) -> CounterRegularization | None:
    """The engine's CounterRegularization from FBGEMM's CounterBasedRegularizationDefinition (COUNTER) or
    CowClipDefinition (COWCLIP); FBGEMM renews max_counter in COUNTER mode only. grad_sum_decay is carried
    by FBGEMM's definition but read by none of its kernels: numbactr ignores it too."""

    def num(x):
        return getattr(x, "value", x)

    def settings(name, kind, needs):
        c = getattr(cfg, name)
        missing = [n for n in needs if not hasattr(c, n)]
        if missing:
            raise TypeError(
                f"{WHO}: {name} must be a {kind} (FBGEMM's config type), got {type(c).__name__} without {missing}"
            )
        return c

    if mode == WeightDecayMode.COUNTER:
        c = settings(
            "counter_based_regularization",
            "CounterBasedRegularizationDefinition",
            (
                "counter_weight_decay_mode",
                "counter_halflife",
                "adjustment_iter",
                "adjustment_ub",
                "learning_rate_mode",
                "tail_id_threshold",
                "max_counter_update_freq",
            ),
        )
        tail = c.tail_id_threshold
        return CounterRegularization(
            int(num(c.counter_weight_decay_mode)),
            int(c.counter_halflife),
            int(c.adjustment_iter),
            float(c.adjustment_ub),
            int(num(c.learning_rate_mode)),
            float(tail.val),
            bool(tail.is_ratio),
            int(c.max_counter_update_freq),
        )
    if mode == WeightDecayMode.COWCLIP:
        c = settings(
            "cowclip_regularization",
            "CowClipDefinition",
            ("counter_weight_decay_mode", "counter_halflife", "weight_norm_coefficient", "lower_bound"),
        )
        return CounterRegularization(
            int(num(c.counter_weight_decay_mode)),
            int(c.counter_halflife),
            max_counter_update_freq=-1,
            weight_norm_coefficient=float(c.weight_norm_coefficient),
            lower_bound=float(c.lower_bound),
        )
    return None


def consumed_preallocated_keys(optimizer) -> set:
    """The preallocated_host_buffers keys an optimizer uses (FBGEMM's rule): weights always, momentum1 for
    every optimizer with a state, momentum2 for the two-state ones."""
    opt = _enum(EmbOptimType, optimizer, "optimizer")
    names = {"weights"}
    if opt not in (EmbOptimType.NONE, EmbOptimType.EXACT_SGD):
        names.add("momentum1")
    if opt in (
        EmbOptimType.ADAM,
        EmbOptimType.PARTIAL_ROWWISE_ADAM,
        EmbOptimType.LAMB,
        EmbOptimType.PARTIAL_ROWWISE_LAMB,
        EmbOptimType.ENSEMBLE_ROWWISE_ADAGRAD,
    ):
        names.add("momentum2")
    return names


def table_name_for_logging(table_names) -> str:
    """FBGEMM's get_table_name_for_logging: one name, or "<n tables>: [sorted distinct names]"."""
    if table_names is None:
        return "<Unknown>"
    names = sorted(set(table_names))
    return names[0] if len(names) == 1 else f"<{len(names)} tables>: {names}"


def prefetch_passes(multipass_prefetch_config, input_tensor, output_tensor) -> list:
    """FBGEMM's get_prefetch_passes: [(input[s:e], output[s:e], s)] covering the inputs in order, in at most
    num_passes passes of at least min_splitable_pass_size (the last may be shorter); one pass without a
    config. (numbactr's own prefetch places a batch in one pass; this is FBGEMM's helper for callers.)"""
    if multipass_prefetch_config is None:
        return [(input_tensor, output_tensor, 0)]
    n_passes = int(multipass_prefetch_config.num_passes)
    n = int(input_tensor.shape[0])
    if n <= n_passes or n_passes == 1:
        return [(input_tensor, output_tensor, 0)]
    size = max(-(-n // n_passes), int(multipass_prefetch_config.min_splitable_pass_size))
    return [(input_tensor[s : s + size], output_tensor[s : s + size], s) for s in range(0, n, size)]


def _specs(embedding_specs) -> list:
    """[(rows, dim, EmbeddingLocation, ComputeDevice)]: FBGEMM's 4-tuples; (rows, dim) and
    (rows, dim, location) are accepted too, the rest defaulting to this device."""
    try:
        specs = list(embedding_specs)
    except TypeError:
        raise ValueError(
            f"{WHO}: embedding_specs must be a list of (rows, dim, location, compute_device) "
            f"tuples, got {embedding_specs!r}"
        ) from None
    if not specs:
        raise ValueError(f"{WHO}: embedding_specs is empty; give at least one table")
    default_cd = ComputeDevice.CUDA if device.kind() == "gpu" else ComputeDevice.CPU
    default_loc = EmbeddingLocation.DEVICE if default_cd == ComputeDevice.CUDA else EmbeddingLocation.HOST
    out = []
    for t, spec in enumerate(specs):
        spec = tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)
        if not 2 <= len(spec) <= 4:
            raise ValueError(f"{WHO}: embedding_specs[{t}] = {spec!r}: expected (rows, dim, location, compute_device)")
        rows, dim = spec[0], spec[1]
        if not (isinstance(rows, (int, np.integer)) and isinstance(dim, (int, np.integer))) or rows < 0 or dim < 1:
            raise ValueError(
                f"{WHO}: embedding_specs[{t}]: rows must be an integer >= 0 and dim an integer "
                f">= 1, got rows={rows!r}, dim={dim!r}"
            )
        loc = _enum(EmbeddingLocation, spec[2], f"embedding_specs[{t}] location") if len(spec) > 2 else default_loc
        cd = _enum(ComputeDevice, spec[3], f"embedding_specs[{t}] compute_device") if len(spec) > 3 else default_cd
        out.append((int(rows), int(dim), loc, cd))
    return out


@dataclass
class _VBE:
    """Variable batch sizes laid out for the engine: every feature padded to `batch` bags (empty bags)."""

    batch: int  # the padded B: the largest per-feature batch (summed over ranks)
    offset_src: np.ndarray  # (F*batch + 1,) padded offsets = offsets[offset_src]: feature f's k-th
    # boundary is its own min(k, B_f)-th one, so padding bags are empty and
    # the offsets' values (and the bounds check's view of them) are unchanged
    out_index: np.ndarray  # (sum_r sum_f B_fr D_f,) flat positions in the padded (batch, sum D)
    # output, in FBGEMM's VBE output order (rank, feature, sample, d)


def _vbe_layout(batch_sizes, feature_dims: np.ndarray, n_bags: int) -> _VBE:
    """The padding of FBGEMM's variable-batch input, batch_sizes[f][r] = B_{f,r} (F lists of R counts)."""
    try:
        b = np.array([[int(x) for x in row] for row in batch_sizes], np.int64)  # (F, R)
    except (TypeError, ValueError):
        raise ValueError(
            f"{WHO}: batch_size_per_feature_per_rank must be a list of per-rank batch sizes "
            f"for each feature, got {batch_sizes!r}"
        ) from None
    n_features = feature_dims.size
    if b.ndim != 2 or b.shape[0] != n_features or b.shape[1] < 1 or (b < 0).any():
        raise ValueError(
            f"{WHO}: batch_size_per_feature_per_rank must hold {n_features} lists (one per "
            f"feature) of the same number of non-negative batch sizes (one per rank), got "
            f"{batch_sizes!r}"
        )
    if int(b.sum()) != n_bags:
        raise ValueError(
            f"{WHO}: batch_size_per_feature_per_rank sums to {int(b.sum())} bags, but offsets "
            f"describe {n_bags} (offsets must have sum(B) + 1 entries)"
        )
    per_feature = b.sum(axis=1)  # (F,)
    batch = int(per_feature.max())
    first = np.concatenate([[0], np.cumsum(per_feature)])  # (F + 1,) first input bag of each feature
    k = np.minimum(np.arange(batch), per_feature[:, None])  # (F, batch)
    offset_src = np.concatenate([(first[:-1, None] + k).reshape(-1), [n_bags]])
    start = np.concatenate([np.zeros((n_features, 1), np.int64), np.cumsum(b, axis=1)[:, :-1]], axis=1)  # (F, R)
    cols = np.concatenate([[0], np.cumsum(feature_dims)])
    pieces = []
    for r in range(b.shape[1]):
        for f in range(n_features):
            k = start[f, r] + np.arange(b[f, r])  # this rank's bags of feature f
            pieces.append((k[:, None] * cols[-1] + cols[f] + np.arange(feature_dims[f])).reshape(-1))
    return _VBE(batch, offset_src.astype(np.int64), np.concatenate(pieces).astype(np.int64))


def check_supported(
    cfg: TBEConfig, opt, weights_precision, out_dtype, pooling_mode, dims, locations, compute_devices
) -> None:
    """Raise (or warn, for arguments without effect here) where FBGEMM's rules or numbactr's support reject
    the arguments; opt, weights_precision and pooling_mode are the resolved members, dims the tables' dims."""
    if opt in (EmbOptimType.SGD, EmbOptimType.ROWWISE_ADAGRAD):
        raise ValueError(f"{WHO}: Optimizer {opt} is deprecated in the CPU + GPU modes (FBGEMM); use EXACT_{opt.name}")
    if opt not in _ENGINE_OPTIM:
        raise NotImplementedError(
            f"{WHO}: optimizer {opt.name} is not implemented in numbactr; supported: "
            f"{', '.join(o.name for o in SUPPORTED_OPTIMIZERS)}"
        )
    if weights_precision not in _PRECISION:
        raise NotImplementedError(
            f"{WHO}: weights_precision={weights_precision.name} is not implemented in "
            "numbactr (FP32, FP16, or INT8 forward only)"
        )
    if out_dtype not in _OUTPUT_DTYPES:
        raise NotImplementedError(f"{WHO}: output_dtype={out_dtype.name} is not implemented in numbactr (FP32 or FP16)")
    if weights_precision == SparseType.INT8:
        if opt == EmbOptimType.NONE:
            raise NotImplementedError(
                f"{WHO}: INT8 weights with optimizer NONE (weights as a trainable "
                "parameter) are not supported: INT8 rows are forward only"
            )
        if EmbeddingLocation.MANAGED_CACHING in locations:
            raise NotImplementedError(
                f"{WHO}: INT8 weights in MANAGED_CACHING tables are not supported "
                "(numbactr caches FP32 and FP16 rows only)"
            )
    if len(set(compute_devices)) > 1:
        raise ValueError(
            f"{WHO}: Heterogenous compute_devices are NOT supported (got {[c.name for c in compute_devices]})"
        )
    if ComputeDevice.MTIA in compute_devices or EmbeddingLocation.MTIA in locations:
        raise NotImplementedError(f"{WHO}: MTIA is not supported by numbactr")
    cpu = compute_devices[0] == ComputeDevice.CPU
    for t, loc in enumerate(locations):
        if cpu != (loc == EmbeddingLocation.HOST):
            raise ValueError(
                f"{WHO}: embedding_specs[{t}]: ComputeDevice.CPU goes with EmbeddingLocation.HOST "
                f"and HOST with CPU only (FBGEMM's rule), got {loc.name} on {compute_devices[0].name}"
            )
    caching = [t for t, loc in enumerate(locations) if loc == EmbeddingLocation.MANAGED_CACHING]
    if caching:
        precision = (
            weights_precision
            if cfg.cache_precision is None
            else _enum(SparseType, cfg.cache_precision, "cache_precision")
        )
        if precision != weights_precision:
            raise NotImplementedError(
                f"{WHO}: cache_precision={precision.name} differs from weights_precision: "
                "a cache in another precision is not implemented in numbactr"
            )
        if opt == EmbOptimType.NONE:
            raise ValueError(
                f"{WHO}: OptimType.NONE supports only EmbeddingLocation.DEVICE (FBGEMM's rule), "
                f"tables {caching} are MANAGED_CACHING"
            )
        if not float(cfg.cache_load_factor) > 0:
            raise ValueError(f"{WHO}: cache_load_factor must be > 0, got {cfg.cache_load_factor}")
        if (
            cfg.prefetch_pipeline
            and _enum(CacheAlgorithm, cfg.cache_algorithm, "cache_algorithm") != CacheAlgorithm.LRU
        ):
            raise ValueError(f"{WHO}: Only LRU cache policy supports prefetch_pipeline (FBGEMM's rule)")
        if cfg.record_cache_metrics is not None and not isinstance(cfg.record_cache_metrics, tuple):
            raise ValueError(
                f"{WHO}: record_cache_metrics must be a RecordCacheMetrics, got {cfg.record_cache_metrics!r}"
            )
    managed = [t for t, loc in enumerate(locations) if loc == EmbeddingLocation.MANAGED]
    if managed and device.kind() == "gpu":
        warnings.warn(
            f"{WHO}: EmbeddingLocation.MANAGED (tables {managed}) is ignored: numbactr allocates no "
            "UVM, these tables live in GPU memory",
            IgnoredArgumentWarning,
            stacklevel=4,
        )
    for name, why in _IGNORED.items():
        value = getattr(cfg, name)
        if value != TBEConfig.__dataclass_fields__[name].default:
            warnings.warn(f"{WHO}: {name}={value!r} is ignored: {why}", IgnoredArgumentWarning, stacklevel=4)

    mode = _enum(WeightDecayMode, cfg.weight_decay_mode, "weight_decay_mode")
    if mode == WeightDecayMode.DECOUPLE_GLOBAL and (
        opt != EmbOptimType.EXACT_ROWWISE_ADAGRAD or cfg.global_weight_decay is None
    ):
        raise ValueError(
            f"{WHO}: weight_decay_mode=DECOUPLE_GLOBAL needs EXACT_ROWWISE_ADAGRAD and "
            "global_weight_decay (FBGEMM's rule)"
        )
    if (mode == WeightDecayMode.COUNTER) != (cfg.counter_based_regularization is not None) or (
        mode == WeightDecayMode.COWCLIP
    ) != (cfg.cowclip_regularization is not None):
        raise ValueError(
            f"{WHO}: weight_decay_mode COUNTER / COWCLIP go together with "
            "counter_based_regularization / cowclip_regularization (FBGEMM's rule)"
        )
    if mode in (WeightDecayMode.COUNTER, WeightDecayMode.COWCLIP) and opt != EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        raise ValueError(
            f"{WHO}: weight_decay_mode={mode.name} is only supported with "
            "OptimType.EXACT_ROWWISE_ADAGRAD (FBGEMM's rule)"
        )
    if opt == EmbOptimType.NONE and len(set(dims)) > 1:
        raise FBGEMMAssertion(
            f"{WHO}: OptimType.NONE does not support mixed embedding dimension (FBGEMM's rule; dims {dims})"
        )
    gwd = opt == EmbOptimType.EXACT_ROWWISE_ADAGRAD and mode == WeightDecayMode.DECOUPLE_GLOBAL
    if gwd and any(loc == EmbeddingLocation.MANAGED_CACHING for loc in locations):
        raise NotImplementedError(
            f"{WHO}: weight_decay_mode=DECOUPLE_GLOBAL with MANAGED_CACHING tables is not "
            "implemented in numbactr (the decay rewrites a batch's rows before the lookup)"
        )
    if gwd and pooling_mode == PoolingMode.NONE:
        raise NotImplementedError(
            f"{WHO}: weight_decay_mode=DECOUPLE_GLOBAL needs pooling: FBGEMM has no global "
            "weight decay kernels for PoolingMode.NONE"
        )
    if opt in _ROWWISE and mode not in _WEIGHT_DECAY and not gwd:
        raise NotImplementedError(
            f"{WHO}: weight_decay_mode={mode.name} is not implemented in numbactr "
            "(NONE, L2, DECOUPLE, COUNTER or COWCLIP; DECOUPLE_GLOBAL for "
            "EXACT_ROWWISE_ADAGRAD)"
        )
    not_implemented = {
        "enable_raw_embedding_streaming": bool(cfg.enable_raw_embedding_streaming),
        "optimizer_state_dtypes": any(
            _enum(SparseType, v, "optimizer_state_dtypes") != SparseType.FP32
            for v in (cfg.optimizer_state_dtypes or {}).values()
        ),
    }
    extra = cfg.extra_optimizer_config
    if getattr(extra, "use_rowwise_bias_correction", False) and opt != EmbOptimType.ADAM:
        raise FBGEMMAssertion(f"{WHO}: `use_rowwise_bias_correction` is only supported for OptimType.ADAM")
    if getattr(extra, "use_writeback_bwd_prehook", False) and opt != EmbOptimType.EXACT_SGD:
        raise FBGEMMAssertion(f"{WHO}: `use_writeback_bwd_prehook` is only supported for OptimType.EXACT_SGD")
    for name, used in not_implemented.items():
        if used:
            raise NotImplementedError(f"{WHO}: {name}={getattr(cfg, name)!r} is not implemented in numbactr")


def optimizer_spec(cfg: TBEConfig, opt) -> OptimizerSpec:
    """The engine's fused optimizer for FBGEMM optimizer ``opt`` (an EmbOptimType) and its settings."""
    mode = _enum(WeightDecayMode, cfg.weight_decay_mode, "weight_decay_mode")
    rowwise = opt in _ROWWISE
    counter = _counter_settings(cfg, mode) if opt == EmbOptimType.EXACT_ROWWISE_ADAGRAD else None
    gwd = opt == EmbOptimType.EXACT_ROWWISE_ADAGRAD and mode == WeightDecayMode.DECOUPLE_GLOBAL
    if gwd:  # the update is DECOUPLE's (FBGEMM's mode 5); the missed decay is applied per row first
        mode = WeightDecayMode.DECOUPLE
    return OptimizerSpec(
        _ENGINE_OPTIM[opt],
        learning_rate=float(cfg.learning_rate),
        eps=float(cfg.eps),
        beta1=float(cfg.beta1),
        beta2=float(cfg.beta2),
        weight_decay=float(cfg.weight_decay) if opt in _DECAYS else 0.0,
        weight_decay_mode=_WEIGHT_DECAY[mode] if rowwise else WeightDecay.NONE,
        # FBGEMM's rowwise_adagrad_with_counter takes no max_norm
        max_norm=float(cfg.max_norm) if rowwise and counter is None else 0.0,
        gradient_clipping=bool(cfg.gradient_clipping),
        max_gradient=float(cfg.max_gradient),
        counter=counter,
        rowwise_bias_correction=bool(getattr(cfg.extra_optimizer_config, "use_rowwise_bias_correction", False)),
        prev_iter_state=gwd,
        momentum=float(cfg.momentum) if opt == EmbOptimType.LARS_SGD else 0.0,
        eta=float(cfg.eta),
    )
