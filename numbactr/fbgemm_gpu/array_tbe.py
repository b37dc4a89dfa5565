"""FBGEMM's SplitTableBatchedEmbeddingBagsCodegen on numbactr's engine, for NumPy and CuPy arrays.

This module maps FBGEMM's arguments, enums and layouts onto numbactr.embedding.engine.TableBatchedEmbedding
and holds no embedding math: the lookup, the fused backward + optimizer and the bounds checks are the
engine's. TBECore is the mapping; ArrayTBE is the face for arrays (forward, then an explicit backward);
numbactr/fbgemm_gpu/torch_tbe.py wraps a TBECore in a torch.nn.Module whose autograd backward runs the
same update. Shapes: T tables, F features, B batch, N indices, D width, V rows.

FBGEMM semantics kept (fbgemm_gpu 1.8, split_table_batched_embeddings_ops_training.py and its codegen):
  * input CSR: offsets (F*B + 1,), bag b of feature f at offsets[f*B + b]; output (B, sum_f D_f), or
    (N, D) for PoolingMode.NONE; MEAN divides by the bag length (an empty bag gives 0).
  * gradient_clipping clamps dLoss/dout elementwise to [-max_gradient, max_gradient] before the update
    (FBGEMM's backward clamps grad_output, not the summed row gradient); max_norm applies to
    EXACT_ROWWISE_ADAGRAD only; weight_decay is ignored by EXACT_SGD / EXACT_ADAGRAD, decoupled inside
    ADAM / PARTIAL_ROWWISE_ADAM / LAMB / PARTIAL_ROWWISE_LAMB (weight_decay_mode is ignored there), and
    NONE / L2 / DECOUPLE / COUNTER / COWCLIP for EXACT_ROWWISE_ADAGRAD.
  * COUNTER / COWCLIP (FBGEMM's rowwise_adagrad_with_counter): states momentum1, prev_iter, row_counter per
    row (get_optimizer_state: sum, prev_iter, row_counter, and iter for CounterWeightDecayMode.ADAGRADW);
    max_counter (a (1,) buffer) becomes 1 + the largest row counter every max_counter_update_freq
    iterations in COUNTER mode, over every table, as FBGEMM's GPU build computes it over its device tables
    (FBGEMM's CPU build keeps it at 1: its states are not device tables). max_norm is not applied, as in
    FBGEMM. A MANAGED_CACHING TBE renews it over every row too: the cache is flushed at a renewing
    iteration and the host rows' counters read (numbactr.embedding.tiered; FBGEMM's GPU build reads its
    device tables only).
  * EMAINPLACE_ROWWISE_ADAGRAD: rowwise AdaGrad (weight decay and max_norm as EXACT_ROWWISE_ADAGRAD's), and each
    training forward at an iteration that is a multiple of emainplace_mode.step_ema (from step_start on)
    first moves every row's second half towards its first half: slow += step_ema_coef * (fast - slow),
    torch.lerp_'s formula (ema_inplace; dims must be even).
  * LARS_SGD (FBGEMM's GPU kernels; its CPU build has none): per touched row, rate = lr eta |w| / (|g| + wd |w|),
    momentum1 = momentum momentum1 + rate (g + wd w), w -= momentum1 (the engine's Optim.LARS_SGD; a row with
    |g| + wd |w| = 0 gets rate 0 where FBGEMM divides by 0, which makes the row NaN). No iteration count and no
    get_optimizer_state names, as in FBGEMM.
  * WeightDecayMode.DECOUPLE_GLOBAL (EXACT_ROWWISE_ADAGRAD, FBGEMM's GPU kernels; its CPU build has none):
    a per-row prev_iter state (get_optimizer_state: sum, prev_iter, iter); from global_weight_decay.start_iter
    on, a training forward reads each row scaled by the decay of the iterations it missed,
    f = max(lower_bound, (1 - lr wd) ** max(iter - prev_iter - 1, 0)), and leaves the tables as they were; its
    backward scales the rows by f, sets prev_iter = iter and then runs DECOUPLE's update (TBECore._global_decay;
    the rows are those the lookup reads after the bounds check's repairs; with weight_decay 0 nothing, as in
    FBGEMM). Two differences: per-sample weights get the gradient of what the forward computed, dout . (f w)
    (FBGEMM's uses the stored rows, dout . w), and float16 rows are read as float16(f w) (FBGEMM scales them
    in float32 registers). Not with MANAGED_CACHING tables or PoolingMode.NONE.
  * ADAM with UserEnabledConfigDefinition(use_rowwise_bias_correction=True): the bias corrections use the
    row's own update count, a third per-row state row_counter (FBGEMM's GPU kernels; its CPU build has no
    ADAM).
  * `iter` counts forwards for EXACT_ROWWISE_ADAGRAD and the ADAM / LAMB kinds (their bias correction
    uses the count of the forward whose backward runs the update); `step` counts every forward.
  * variable batch per feature and rank (batch_size_per_feature_per_rank, VBE): offsets hold the bags
    feature-major, then rank, then sample; the output is 1-D, rank-major: for each rank r, for each
    feature f, its B_{f,r} pooled rows of D_f values.
  * split_embedding_weights() / split_optimizer_states(): per-table views in FBGEMM's order
    (momentum1 [, momentum2]; rowwise states (V,), per-element (V, D)); EXACT_SGD has no states and
    returns [] as FBGEMM does.
Differences, on purpose or not yet implemented (each raises or warns where it matters):
  * embedding dims need not be multiples of 4 (the engine pads rows to 16 bytes itself).
  * DEVICE and HOST tables live in the engine's one buffer on numbactr's device; MANAGED is host memory
    on the cpu device and device memory (not UVM) on a GPU, where it warns. MANAGED_CACHING is real
    (numbactr.embedding.tiered): every row and its optimizer states in host memory, a cache of
    cache_load_factor x the caching tables' rows on the device (cache_sets x 32 rows when cache_sets > 0;
    smaller when it would leave less than cache_reserved_memory bytes of the device free), LRU or LFU
    (cache_algorithm), rows staged by prefetch() or by the forward itself, evicted rows written back with
    their optimizer states; training equals uncached training bit for bit. FBGEMM's cache is 32-way set
    associative (rows that find no way in their set are read from UVM); numbactr's is fully associative
    per table, and a batch needing more rows than a table's free slots is an error (CacheCapacityError).
    FBGEMM caches only on CUDA; numbactr also on the cpu device (a RAM cache over host memory). When some
    tables are MANAGED_CACHING the other tables are cached whole (their slots = their rows).
    split_embedding_weights() / split_optimizer_states() flush the cache first (FBGEMM returns the UVM
    rows as they are, stale where the cache holds newer ones). cache_precision must equal weights_precision
    (FP16 weights are cached as FP16, stochastic rounding included: the same bits as uncached).
  * per-sample weights with MEAN pooling scale by 1/L in forward and backward (FBGEMM's GPU kernels;
    FBGEMM's CPU backward skips the 1/L there).
  * EXACT_ADAGRAD / EXACT_ROWWISE_ADAGRAD on a table read by several features sum the row's gradients of
    all its features before one update (FBGEMM's GPU kernels; FBGEMM's CPU build updates once per
    feature); FBGEMM's CPU build also ignores max_norm and, for unshared FP32 tables, weight decay.
  * set_optimizer_step(step) makes the next forward count step + 1 (FBGEMM's host copy of `iter` only
    picks a new value up while it is 0).
"""
from __future__ import annotations

import enum
import os
import warnings
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np

from numbactr.runtime import device
from numbactr import log
from numbactr.config import IgnoredArgumentWarning
from numbactr.embedding.engine import (BoundsCheck, CounterRegularization, CounterWeightDecay, EmbeddingBoundsError, Grads,
                                LookupContext, Optim, OptimizerSpec, Pooling, Precision, TableBatchedEmbedding,
                                WeightDecay, state_specs)
from numbactr.embedding.tiered import CacheConfig, TieredEmbedding, slot_bytes
from numbactr.kernels import tbe as K
from numbactr.fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_common import (BoundsCheckMode, CacheAlgorithm, ComputeDevice,
                                                        EmbeddingLocation, PoolingMode, RecordCacheMetrics,
                                                        WeightDecayMode)

__all__ = ["TBEConfig", "TBECore", "ArrayTBE", "Lookup", "SUPPORTED_OPTIMIZERS"]

#: FBGEMM optimizer -> the engine's fused optimizer
_ENGINE_OPTIM = {
    EmbOptimType.NONE: Optim.NONE, EmbOptimType.EXACT_SGD: Optim.EXACT_SGD,
    EmbOptimType.EXACT_ADAGRAD: Optim.EXACT_ADAGRAD, EmbOptimType.EXACT_ROWWISE_ADAGRAD: Optim.EXACT_ROWWISE_ADAGRAD,
    EmbOptimType.ADAM: Optim.ADAM, EmbOptimType.PARTIAL_ROWWISE_ADAM: Optim.PARTIAL_ROWWISE_ADAM,
    EmbOptimType.LAMB: Optim.LAMB, EmbOptimType.PARTIAL_ROWWISE_LAMB: Optim.PARTIAL_ROWWISE_LAMB,
    # rowwise AdaGrad whose training forwards also move each row's second half towards its first (ema_inplace)
    EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD: Optim.EXACT_ROWWISE_ADAGRAD,
    EmbOptimType.LARS_SGD: Optim.LARS_SGD,
}
#: FBGEMM's rowwise AdaGrad kinds: rowwise momentum1 and the rowwise weight-decay modes
_ROWWISE = frozenset({EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD})
SUPPORTED_OPTIMIZERS = tuple(_ENGINE_OPTIM)
#: optimizers whose forward advances FBGEMM's `iter` (ADAM and LAMB kinds read it as the step t)
_COUNTS_ITER = frozenset({EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ADAM, EmbOptimType.PARTIAL_ROWWISE_ADAM,
                          EmbOptimType.LAMB, EmbOptimType.PARTIAL_ROWWISE_LAMB,
                          EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD})
#: optimizers that take weight_decay (the rest ignore it, as in FBGEMM)
_DECAYS = _COUNTS_ITER | {EmbOptimType.LARS_SGD}
#: get_optimizer_state()'s names of split_optimizer_states()'s entries (PyTorch optimizers' names)
_STATE_NAMES = {EmbOptimType.EXACT_ADAGRAD: ("sum",), EmbOptimType.EXACT_ROWWISE_ADAGRAD: ("sum",),
                EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD: ("sum",),
                EmbOptimType.ADAM: ("exp_avg", "exp_avg_sq"), EmbOptimType.PARTIAL_ROWWISE_ADAM: ("exp_avg", "exp_avg_sq"),
                EmbOptimType.LAMB: ("exp_avg", "exp_avg_sq"), EmbOptimType.PARTIAL_ROWWISE_LAMB: ("exp_avg", "exp_avg_sq"),
                EmbOptimType.EXACT_SGD: ()}
_PRECISION = {SparseType.FP32: Precision.FP32, SparseType.FP16: Precision.FP16, SparseType.INT8: Precision.INT8}
_OUTPUT_DTYPES = (SparseType.FP32, SparseType.FP16)
_WEIGHT_DECAY = {WeightDecayMode.NONE: WeightDecay.NONE, WeightDecayMode.L2: WeightDecay.L2,
                 WeightDecayMode.DECOUPLE: WeightDecay.DECOUPLE, WeightDecayMode.COUNTER: WeightDecay.COUNTER,
                 WeightDecayMode.COWCLIP: WeightDecay.COWCLIP}
#: get_optimizer_state()'s names of the states some modes add (kernels.tbe.PREV_ITER / ROW_COUNTER)
_EXTRA_STATE_NAMES = {"prev_iter": "prev_iter", "row_counter": "row_counter"}
_V2_BOUNDS = {BoundsCheckMode.V2_IGNORE: BoundsCheckMode.IGNORE, BoundsCheckMode.V2_WARNING: BoundsCheckMode.WARNING,
              BoundsCheckMode.V2_FATAL: BoundsCheckMode.FATAL}
WHO = "SplitTableBatchedEmbeddingBagsCodegen"


@dataclass
class TBEConfig:
    """FBGEMM's constructor arguments after embedding_specs and feature_table_map, in FBGEMM's order and
    with FBGEMM's defaults (so positional calls keep working). What numbactr does with each:"""
    cache_algorithm: object = CacheAlgorithm.LRU        # MANAGED_CACHING tables: LRU | LFU
    cache_load_factor: float = 0.2                      #   the cache's rows / the caching tables' rows
    cache_sets: int = 0                                 #   > 0: the cache holds cache_sets * 32 rows
    cache_reserved_memory: float = 0.0                  #   bytes of the fast tier the cache leaves free
    cache_precision: object = None                      # None: weights_precision (no other supported)
    weights_precision: object = SparseType.FP32         # FP32 | FP16 | INT8 (forward only, as FBGEMM's CPU)
    output_dtype: object = SparseType.FP32              # FP32 | FP16
    enforce_hbm: bool = False                           # cache placement (as cache_*)
    optimizer: object = EmbOptimType.EXACT_SGD          # SUPPORTED_OPTIMIZERS
    record_cache_metrics: object = None                 # RecordCacheMetrics: get_cache_miss_counter & co.
    gather_uvm_cache_stats: bool = False                # get_uvm_cache_stats
    stochastic_rounding: bool = True                    # FP16 weights: stochastic rounding of updates
    gradient_clipping: bool = False                     # clamp dLoss/dout to +-max_gradient
    max_gradient: float = 1.0
    max_norm: float = 0.0                               # EXACT_ROWWISE_ADAGRAD: cap updated rows' L2 norm
    learning_rate: float = 0.01
    eps: float = 1.0e-8
    momentum: float = 0.9                               # LARS_SGD's momentum
    weight_decay: float = 0.0
    weight_decay_mode: object = WeightDecayMode.NONE    # NONE | L2 | DECOUPLE | COUNTER | COWCLIP (rowwise Adagrad)
    eta: float = 0.001                                  # LARS_SGD's trust coefficient
    beta1: float = 0.9
    beta2: float = 0.999
    ensemble_mode: object = None                        # ENSEMBLE_ROWWISE_ADAGRAD only (not supported): unused
    emainplace_mode: object = None                      # EMAINPLACE_ROWWISE_ADAGRAD's EmainplaceModeDefinition
    counter_based_regularization: object = None         # WeightDecayMode.COUNTER's settings
    cowclip_regularization: object = None               # WeightDecayMode.COWCLIP's settings
    pooling_mode: object = PoolingMode.SUM              # SUM | MEAN | NONE
    device: object = None                               # must agree with numbactr's device (see TBECore)
    bounds_check_mode: object = BoundsCheckMode.WARNING  # FATAL | WARNING | IGNORE | NONE (+ V2_ forms)
    uvm_non_rowwise_momentum: bool = False              # UVM placement: warns when set
    use_experimental_tbe: bool = False                  # FBGEMM's kernel choice: warns when set
    prefetch_pipeline: bool = False                     # prefetch() on a worker thread (LRU only, FBGEMM's)
    stats_reporter_config: object = None                # FBGEMM's monitoring hooks: warn when set
    table_names: object = None                          # kept as .table_names
    optimizer_state_dtypes: object = None               # only FP32 states (else NotImplementedError)
    multipass_prefetch_config: object = None            # prefetch in several passes: warns when set
    global_weight_decay: object = None                  # WeightDecayMode.DECOUPLE_GLOBAL's start_iter, lower_bound
    uvm_host_mapped: bool = False                       # UVM allocation: warns when set
    extra_optimizer_config: object = None               # writeback (EXACT_SGD); rowwise bias correction (ADAM)
    tbe_input_multiplexer_config: object = None         # FBGEMM's monitoring hooks: warn when set
    embedding_table_index_type: object = None           # int32 | int64 (None: int64); numbactr reads both
    embedding_table_offset_type: object = None          #   kinds of indices and offsets as they come
    embedding_shard_info: object = None                 # sharding metadata for FBGEMM's monitoring: kept
    enable_raw_embedding_streaming: bool = False        # not implemented
    res_params: object = None                           # raw embedding streaming only: unused
    is_qr_tbe: bool = False                             # unused
    preallocated_host_buffers: object = None            # {"weights"/"momentum1"/"momentum2": 1-D host array}: the
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
#: FBGEMM's cache associativity: the cache holds a multiple of ASSOC rows (cache_sets * ASSOC)
ASSOC = 32


def _emainplace_mode(definition) -> dict:
    """FBGEMM's dict of an EmainplaceModeDefinition (None: the defaults), its values as floats."""
    from numbactr.fbgemm_gpu.optimizer_config import EmainplaceModeDefinition
    definition = EmainplaceModeDefinition() if definition is None else definition
    mode = {f.name: float(_value(getattr(definition, f.name))) for f in fields(EmainplaceModeDefinition)}
    if mode["step_ema"] < 1:
        raise ValueError(f"{WHO}: emainplace_mode.step_ema must be at least 1, got {mode['step_ema']}")
    return mode


def _lerp_(slow, fast, coef: float) -> None:
    """slow <- slow + coef * (fast - slow) in place, in float32 and by torch.lerp_'s formula (the other end's
    form for coef >= 0.5), so the rounding is PyTorch's; float16 rows are computed in float32 and rounded once."""
    w = np.float32(coef)
    a, b = slow.astype(np.float32), fast.astype(np.float32)
    diff = b - a
    out = a + w * diff if abs(w) < 0.5 else b - diff * (np.float32(1.0) - w)
    slow[...] = out.astype(slow.dtype)


def _fast_tier_free_bytes() -> int:
    """Free memory where the cache lives: the GPU's on the gpu device, else the host's available RAM."""
    if device.kind() == "gpu":
        import cupy
        return int(cupy.cuda.runtime.memGetInfo()[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


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
            raise TypeError(f"{WHO}: {name} must be a {kind} (FBGEMM's config type), got {type(c).__name__} "
                            f"without {missing}")
        return c
    if mode == WeightDecayMode.COUNTER:
        c = settings("counter_based_regularization", "CounterBasedRegularizationDefinition",
                     ("counter_weight_decay_mode", "counter_halflife", "adjustment_iter", "adjustment_ub",
                      "learning_rate_mode", "tail_id_threshold", "max_counter_update_freq"))
        tail = c.tail_id_threshold
        return CounterRegularization(
            int(num(c.counter_weight_decay_mode)), int(c.counter_halflife), int(c.adjustment_iter),
            float(c.adjustment_ub), int(num(c.learning_rate_mode)), float(tail.val), bool(tail.is_ratio),
            int(c.max_counter_update_freq))
    if mode == WeightDecayMode.COWCLIP:
        c = settings("cowclip_regularization", "CowClipDefinition",
                     ("counter_weight_decay_mode", "counter_halflife", "weight_norm_coefficient", "lower_bound"))
        return CounterRegularization(int(num(c.counter_weight_decay_mode)), int(c.counter_halflife),
                                     max_counter_update_freq=-1,
                                     weight_norm_coefficient=float(c.weight_norm_coefficient),
                                     lower_bound=float(c.lower_bound))
    return None


def consumed_preallocated_keys(optimizer) -> set:
    """The preallocated_host_buffers keys an optimizer uses (FBGEMM's rule): weights always, momentum1 for
    every optimizer with a state, momentum2 for the two-state ones."""
    opt = _enum(EmbOptimType, optimizer, "optimizer")
    names = {"weights"}
    if opt not in (EmbOptimType.NONE, EmbOptimType.EXACT_SGD):
        names.add("momentum1")
    if opt in (EmbOptimType.ADAM, EmbOptimType.PARTIAL_ROWWISE_ADAM, EmbOptimType.LAMB,
               EmbOptimType.PARTIAL_ROWWISE_LAMB, EmbOptimType.ENSEMBLE_ROWWISE_ADAGRAD):
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
    return [(input_tensor[s:s + size], output_tensor[s:s + size], s) for s in range(0, n, size)]


def _specs(embedding_specs) -> list:
    """[(rows, dim, EmbeddingLocation, ComputeDevice)]: FBGEMM's 4-tuples; (rows, dim) and
    (rows, dim, location) are accepted too, the rest defaulting to this device."""
    try:
        specs = list(embedding_specs)
    except TypeError:
        raise ValueError(f"{WHO}: embedding_specs must be a list of (rows, dim, location, compute_device) "
                         f"tuples, got {embedding_specs!r}") from None
    if not specs:
        raise ValueError(f"{WHO}: embedding_specs is empty; give at least one table")
    default_cd = ComputeDevice.CUDA if device.kind() == "gpu" else ComputeDevice.CPU
    default_loc = EmbeddingLocation.DEVICE if default_cd == ComputeDevice.CUDA else EmbeddingLocation.HOST
    out = []
    for t, spec in enumerate(specs):
        spec = tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)
        if not 2 <= len(spec) <= 4:
            raise ValueError(f"{WHO}: embedding_specs[{t}] = {spec!r}: expected (rows, dim, location, "
                             "compute_device)")
        rows, dim = spec[0], spec[1]
        if not (isinstance(rows, (int, np.integer)) and isinstance(dim, (int, np.integer))) or rows < 0 or dim < 1:
            raise ValueError(f"{WHO}: embedding_specs[{t}]: rows must be an integer >= 0 and dim an integer "
                             f">= 1, got rows={rows!r}, dim={dim!r}")
        loc = _enum(EmbeddingLocation, spec[2], f"embedding_specs[{t}] location") if len(spec) > 2 else default_loc
        cd = _enum(ComputeDevice, spec[3], f"embedding_specs[{t}] compute_device") if len(spec) > 3 else default_cd
        out.append((int(rows), int(dim), loc, cd))
    return out


@dataclass
class _VBE:
    """Variable batch sizes laid out for the engine: every feature padded to `batch` bags (empty bags)."""
    batch: int                  # the padded B: the largest per-feature batch (summed over ranks)
    offset_src: np.ndarray      # (F*batch + 1,) padded offsets = offsets[offset_src]: feature f's k-th
                                # boundary is its own min(k, B_f)-th one, so padding bags are empty and
                                # the offsets' values (and the bounds check's view of them) are unchanged
    out_index: np.ndarray       # (sum_r sum_f B_fr D_f,) flat positions in the padded (batch, sum D)
                                # output, in FBGEMM's VBE output order (rank, feature, sample, d)


def _vbe_layout(batch_sizes, feature_dims: np.ndarray, n_bags: int) -> _VBE:
    """The padding of FBGEMM's variable-batch input, batch_sizes[f][r] = B_{f,r} (F lists of R counts)."""
    try:
        b = np.array([[int(x) for x in row] for row in batch_sizes], np.int64)     # (F, R)
    except (TypeError, ValueError):
        raise ValueError(f"{WHO}: batch_size_per_feature_per_rank must be a list of per-rank batch sizes "
                         f"for each feature, got {batch_sizes!r}") from None
    n_features = feature_dims.size
    if b.ndim != 2 or b.shape[0] != n_features or b.shape[1] < 1 or (b < 0).any():
        raise ValueError(f"{WHO}: batch_size_per_feature_per_rank must hold {n_features} lists (one per "
                         f"feature) of the same number of non-negative batch sizes (one per rank), got "
                         f"{batch_sizes!r}")
    if int(b.sum()) != n_bags:
        raise ValueError(f"{WHO}: batch_size_per_feature_per_rank sums to {int(b.sum())} bags, but offsets "
                         f"describe {n_bags} (offsets must have sum(B) + 1 entries)")
    per_feature = b.sum(axis=1)                                    # (F,)
    batch = int(per_feature.max())
    first = np.concatenate([[0], np.cumsum(per_feature)])         # (F + 1,) first input bag of each feature
    k = np.minimum(np.arange(batch), per_feature[:, None])          # (F, batch)
    offset_src = np.concatenate([(first[:-1, None] + k).reshape(-1), [n_bags]])
    start = np.concatenate([np.zeros((n_features, 1), np.int64), np.cumsum(b, axis=1)[:, :-1]], axis=1)  # (F, R)
    cols = np.concatenate([[0], np.cumsum(feature_dims)])
    pieces = []
    for r in range(b.shape[1]):
        for f in range(n_features):
            k = start[f, r] + np.arange(b[f, r])                   # this rank's bags of feature f
            pieces.append((k[:, None] * cols[-1] + cols[f] + np.arange(feature_dims[f])).reshape(-1))
    return _VBE(batch, offset_src.astype(np.int64), np.concatenate(pieces).astype(np.int64))


@dataclass
class Lookup:
    """One forward, for its backward: the engine's context, FBGEMM's iteration, the VBE layout if any."""
    ctx: LookupContext
    iteration: int
    vbe: _VBE | None = None
    writeback: object = None    # use_writeback_bwd_prehook: (indices, offsets), for the backward's mask
    global_decay: object = None  # DECOUPLE_GLOBAL: per table, the rows the backward decays (_global_decay_rows)


class TBECore:
    """FBGEMM's TBE arguments mapped onto numbactr's engine (no embedding math here; see the module doc).

    Args: FBGEMM's (embedding_specs, feature_table_map, then TBEConfig's fields), plus numbactr's
    keyword-only `seed` (stochastic rounding's random stream and init_embedding_weights_uniform; default 0).

    Device: the engine runs on numbactr.runtime.device's device. ComputeDevice.CUDA specs (or device="cuda") run
    there too when there is no GPU (said once in the log, as a HugeCTR script's vvgpu runs on cpu);
    ComputeDevice.CPU specs on the gpu device are an error (set NUMBACTR_DEVICE=cpu).
    """

    def __init__(self, embedding_specs, feature_table_map=None, *args, seed: int | None = None, **kwargs):
        try:
            cfg = TBEConfig(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{WHO}: {e}") from None
        self.config = cfg
        specs = _specs(embedding_specs)
        self.embedding_specs = specs
        n_tables = len(specs)
        rows, dims, locations, compute_devices = (list(x) for x in zip(*specs))
        self.dims = dims
        ftm = list(range(n_tables)) if feature_table_map is None else [int(t) for t in feature_table_map]
        bad = [t for t in ftm if not 0 <= t < n_tables]
        if not ftm or bad:
            raise ValueError(f"{WHO}: feature_table_map={feature_table_map!r} must name tables 0..{n_tables - 1}")
        unread = sorted(set(range(n_tables)) - set(ftm))
        if unread:
            raise ValueError(f"{WHO}: every table must be read by at least one feature (FBGEMM's rule); "
                             f"table(s) {unread} are not in feature_table_map")
        self.feature_table_map = ftm

        self.optimizer = _enum(EmbOptimType, cfg.optimizer, "optimizer")
        if cfg.preallocated_host_buffers is not None:
            unconsumed = set(cfg.preallocated_host_buffers) - consumed_preallocated_keys(self.optimizer)
            if unconsumed:
                raise FBGEMMAssertion(
                    f"{WHO}: preallocated_host_buffers contains keys not consumed by optimizer={self.optimizer}: "
                    f"{sorted(unconsumed)}; this optimizer's keys: {sorted(consumed_preallocated_keys(self.optimizer))}")
        self.pooling_mode = _enum(PoolingMode, cfg.pooling_mode, "pooling_mode")
        self.weights_precision = _enum(SparseType, cfg.weights_precision, "weights_precision")
        out_dtype = _enum(SparseType, cfg.output_dtype, "output_dtype")
        self.output_dtype = out_dtype.as_int()         # FBGEMM keeps the int code
        self.stochastic_rounding = bool(cfg.stochastic_rounding)
        self.table_names = cfg.table_names
        self.embedding_table_index_type = _dtype_name(cfg.embedding_table_index_type, "embedding_table_index_type")
        self.embedding_table_offset_type = _dtype_name(cfg.embedding_table_offset_type, "embedding_table_offset_type")
        self.mixed_D = len(set(dims)) > 1
        if self.mixed_D and self.pooling_mode == PoolingMode.NONE:
            raise ValueError(f"{WHO}: mixed dimension tables are only supported with pooling "
                             f"(PoolingMode.NONE needs equal dims, got {dims})")
        bounds = _enum(BoundsCheckMode, int(os.environ.get("FBGEMM_TBE_BOUNDS_CHECK_MODE",
                                                           _enum(BoundsCheckMode, cfg.bounds_check_mode,
                                                                 "bounds_check_mode").value)),
                       "bounds_check_mode (FBGEMM_TBE_BOUNDS_CHECK_MODE)")
        bounds = _V2_BOUNDS.get(bounds, bounds)
        self.bounds_check_mode_int = int(bounds)
        self._check_supported(cfg, out_dtype, locations, compute_devices)
        self.current_device = self._resolve_device(cfg.device, compute_devices[0])

        feature_dims = [dims[t] for t in ftm]
        self.total_D = int(sum(feature_dims))
        self.max_D = int(max(dims))
        self.D_offsets = np.concatenate([[0], np.cumsum(feature_dims)]).astype(np.int32)   # (F + 1,)
        self.feature_dims = np.asarray(feature_dims, np.int64)
        engine_args = dict(pooling=Pooling(int(self.pooling_mode)), optimizer=self._optimizer_spec(cfg),
                           weights_precision=_PRECISION[self.weights_precision], output_dtype=_PRECISION[out_dtype],
                           bounds_check=BoundsCheck(int(bounds)), stochastic_rounding=self.stochastic_rounding,
                           seed=0 if seed is None else int(seed))
        caching = [t for t, loc in enumerate(locations) if loc == EmbeddingLocation.MANAGED_CACHING]
        self.cache_algorithm = _enum(CacheAlgorithm, cfg.cache_algorithm, "cache_algorithm")
        self.record_cache_metrics = cfg.record_cache_metrics or RecordCacheMetrics(False, False)
        self.gather_uvm_cache_stats = bool(cfg.gather_uvm_cache_stats)
        if caching:
            cache = CacheConfig(self.cache_algorithm.name.lower(),
                                capacities=self._cache_slots(cfg, rows, dims, caching, engine_args["optimizer"]),
                                prefetch_thread=bool(cfg.prefetch_pipeline))
            self.engine = TieredEmbedding(list(zip(rows, dims)), ftm, cache=cache, **engine_args)
        else:
            self.engine = TableBatchedEmbedding(list(zip(rows, dims)), ftm, **engine_args)
        self.cached = bool(caching)
        extra = cfg.extra_optimizer_config
        self.writeback = bool(getattr(extra, "use_writeback_bwd_prehook", False))
        self.writeback_first_feature_only = self.writeback and bool(getattr(extra, "writeback_first_feature_only", False))
        if cfg.preallocated_host_buffers and all(loc == EmbeddingLocation.HOST for loc in locations):
            self._adopt_host_buffers(cfg.preallocated_host_buffers)   # FBGEMM: only HOST tables have host buffers
        self._cache_base = None              # stats at the last reset_cache_miss_counter / reset_uvm_cache_stats
        self._uvm_base = None
        self.emainplace_mode = _emainplace_mode(cfg.emainplace_mode)
        self.global_weight_decay = (self.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD and
                                    _enum(WeightDecayMode, cfg.weight_decay_mode, "weight_decay_mode")
                                    == WeightDecayMode.DECOUPLE_GLOBAL)
        gwd_cfg = cfg.global_weight_decay
        self.gwd_start_iter = int(getattr(gwd_cfg, "start_iter", 0) or 0)
        self.gwd_lower_bound = float(getattr(gwd_cfg, "lower_bound", 0.0) or 0.0)
        if self.optimizer == EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD:
            odd = [t for t, d in enumerate(dims) if d % 2]
            if odd:
                raise FBGEMMAssertion(f"{WHO}: EMAINPLACE_ROWWISE_ADAGRAD splits each row into halves, so every "
                                      f"table's dim must be even; table(s) {odd} have dims "
                                      f"{[dims[t] for t in odd]}")

    # ---- arguments ------------------------------------------------------------------------------------
    def _check_supported(self, cfg: TBEConfig, out_dtype, locations, compute_devices) -> None:
        opt = self.optimizer
        if opt in (EmbOptimType.SGD, EmbOptimType.ROWWISE_ADAGRAD):
            raise ValueError(f"{WHO}: Optimizer {opt} is deprecated in the CPU + GPU modes (FBGEMM); use "
                             f"EXACT_{opt.name}")
        if opt not in _ENGINE_OPTIM:
            raise NotImplementedError(f"{WHO}: optimizer {opt.name} is not implemented in numbactr; supported: "
                                      f"{', '.join(o.name for o in SUPPORTED_OPTIMIZERS)}")
        if self.weights_precision not in _PRECISION:
            raise NotImplementedError(f"{WHO}: weights_precision={self.weights_precision.name} is not implemented in "
                                      "numbactr (FP32, FP16, or INT8 forward only)")
        if out_dtype not in _OUTPUT_DTYPES:
            raise NotImplementedError(f"{WHO}: output_dtype={out_dtype.name} is not implemented in numbactr (FP32 or "
                                      "FP16)")
        if self.weights_precision == SparseType.INT8:
            if opt == EmbOptimType.NONE:
                raise NotImplementedError(f"{WHO}: INT8 weights with optimizer NONE (weights as a trainable "
                                          "parameter) are not supported: INT8 rows are forward only")
            if EmbeddingLocation.MANAGED_CACHING in locations:
                raise NotImplementedError(f"{WHO}: INT8 weights in MANAGED_CACHING tables are not supported "
                                          "(numbactr caches FP32 and FP16 rows only)")
        if len(set(compute_devices)) > 1:
            raise ValueError(f"{WHO}: Heterogenous compute_devices are NOT supported (got "
                             f"{[c.name for c in compute_devices]})")
        if ComputeDevice.MTIA in compute_devices or EmbeddingLocation.MTIA in locations:
            raise NotImplementedError(f"{WHO}: MTIA is not supported by numbactr")
        cpu = compute_devices[0] == ComputeDevice.CPU
        for t, loc in enumerate(locations):
            if cpu != (loc == EmbeddingLocation.HOST):
                raise ValueError(f"{WHO}: embedding_specs[{t}]: ComputeDevice.CPU goes with EmbeddingLocation.HOST "
                                 f"and HOST with CPU only (FBGEMM's rule), got {loc.name} on {compute_devices[0].name}")
        caching = [t for t, loc in enumerate(locations) if loc == EmbeddingLocation.MANAGED_CACHING]
        if caching:
            precision = self.weights_precision if cfg.cache_precision is None else \
                _enum(SparseType, cfg.cache_precision, "cache_precision")
            if precision != self.weights_precision:
                raise NotImplementedError(f"{WHO}: cache_precision={precision.name} differs from weights_precision: "
                                          "a cache in another precision is not implemented in numbactr")
            if opt == EmbOptimType.NONE:
                raise ValueError(f"{WHO}: OptimType.NONE supports only EmbeddingLocation.DEVICE (FBGEMM's rule), "
                                 f"tables {caching} are MANAGED_CACHING")
            if not float(cfg.cache_load_factor) > 0:
                raise ValueError(f"{WHO}: cache_load_factor must be > 0, got {cfg.cache_load_factor}")
            if cfg.prefetch_pipeline and _enum(CacheAlgorithm, cfg.cache_algorithm, "cache_algorithm") != \
                    CacheAlgorithm.LRU:
                raise ValueError(f"{WHO}: Only LRU cache policy supports prefetch_pipeline (FBGEMM's rule)")
            if cfg.record_cache_metrics is not None and not isinstance(cfg.record_cache_metrics, tuple):
                raise ValueError(f"{WHO}: record_cache_metrics must be a RecordCacheMetrics, got "
                                 f"{cfg.record_cache_metrics!r}")
        managed = [t for t, loc in enumerate(locations) if loc == EmbeddingLocation.MANAGED]
        if managed and device.kind() == "gpu":
            warnings.warn(f"{WHO}: EmbeddingLocation.MANAGED (tables {managed}) is ignored: numbactr allocates no "
                          "UVM, these tables live in GPU memory", IgnoredArgumentWarning, stacklevel=4)
        for name, why in _IGNORED.items():
            value = getattr(cfg, name)
            if value != TBEConfig.__dataclass_fields__[name].default:
                warnings.warn(f"{WHO}: {name}={value!r} is ignored: {why}", IgnoredArgumentWarning, stacklevel=4)

        mode = _enum(WeightDecayMode, cfg.weight_decay_mode, "weight_decay_mode")
        if mode == WeightDecayMode.DECOUPLE_GLOBAL and (opt != EmbOptimType.EXACT_ROWWISE_ADAGRAD or
                                                        cfg.global_weight_decay is None):
            raise ValueError(f"{WHO}: weight_decay_mode=DECOUPLE_GLOBAL needs EXACT_ROWWISE_ADAGRAD and "
                             "global_weight_decay (FBGEMM's rule)")
        if (mode == WeightDecayMode.COUNTER) != (cfg.counter_based_regularization is not None) or \
                (mode == WeightDecayMode.COWCLIP) != (cfg.cowclip_regularization is not None):
            raise ValueError(f"{WHO}: weight_decay_mode COUNTER / COWCLIP go together with "
                             "counter_based_regularization / cowclip_regularization (FBGEMM's rule)")
        if mode in (WeightDecayMode.COUNTER, WeightDecayMode.COWCLIP) and opt != EmbOptimType.EXACT_ROWWISE_ADAGRAD:
            raise ValueError(f"{WHO}: weight_decay_mode={mode.name} is only supported with "
                             "OptimType.EXACT_ROWWISE_ADAGRAD (FBGEMM's rule)")
        if opt == EmbOptimType.NONE and len(set(self.dims)) > 1:
            raise FBGEMMAssertion(f"{WHO}: OptimType.NONE does not support mixed embedding dimension (FBGEMM's "
                                  f"rule; dims {self.dims})")
        gwd = opt == EmbOptimType.EXACT_ROWWISE_ADAGRAD and mode == WeightDecayMode.DECOUPLE_GLOBAL
        if gwd and any(loc == EmbeddingLocation.MANAGED_CACHING for loc in locations):
            raise NotImplementedError(f"{WHO}: weight_decay_mode=DECOUPLE_GLOBAL with MANAGED_CACHING tables is not "
                                      "implemented in numbactr (the decay rewrites a batch's rows before the lookup)")
        if gwd and self.pooling_mode == PoolingMode.NONE:
            raise NotImplementedError(f"{WHO}: weight_decay_mode=DECOUPLE_GLOBAL needs pooling: FBGEMM has no global "
                                      "weight decay kernels for PoolingMode.NONE")
        if opt in _ROWWISE and mode not in _WEIGHT_DECAY and not gwd:
            raise NotImplementedError(f"{WHO}: weight_decay_mode={mode.name} is not implemented in numbactr "
                                      "(NONE, L2, DECOUPLE, COUNTER or COWCLIP; DECOUPLE_GLOBAL for "
                                      "EXACT_ROWWISE_ADAGRAD)")
        not_implemented = {
            "enable_raw_embedding_streaming": bool(cfg.enable_raw_embedding_streaming),
            "optimizer_state_dtypes": any(_enum(SparseType, v, "optimizer_state_dtypes") != SparseType.FP32
                                          for v in (cfg.optimizer_state_dtypes or {}).values()),
        }
        extra = cfg.extra_optimizer_config
        if getattr(extra, "use_rowwise_bias_correction", False) and opt != EmbOptimType.ADAM:
            raise FBGEMMAssertion(f"{WHO}: `use_rowwise_bias_correction` is only supported for OptimType.ADAM")
        if getattr(extra, "use_writeback_bwd_prehook", False) and opt != EmbOptimType.EXACT_SGD:
            raise FBGEMMAssertion(f"{WHO}: `use_writeback_bwd_prehook` is only supported for OptimType.EXACT_SGD")
        for name, used in not_implemented.items():
            if used:
                raise NotImplementedError(f"{WHO}: {name}={getattr(cfg, name)!r} is not implemented in numbactr")

    def _cache_slots(self, cfg: TBEConfig, rows, dims, caching, opt: OptimizerSpec) -> list:
        """Cache rows per table, FBGEMM's sizing: cache_sets * 32 rows, else ceil(cache_load_factor x the
        caching tables' rows / 32) sets, fewer when the cache would leave less than cache_reserved_memory
        bytes of the fast tier free; split among the caching tables in proportion to their rows (each
        1..V_t); the other tables are cached whole."""
        total_rows = sum(rows[t] for t in caching)
        per_slot = max(slot_bytes(dims[t], _PRECISION[self.weights_precision], state_specs(opt)) for t in caching)
        if int(cfg.cache_sets) > 0:
            total = int(cfg.cache_sets) * ASSOC
        else:
            total = max(1, (int(total_rows * float(cfg.cache_load_factor)) + ASSOC - 1) // ASSOC) * ASSOC
            free = _fast_tier_free_bytes() - int(cfg.cache_reserved_memory)
            if free <= 0:
                raise ValueError(f"{WHO}: cache_reserved_memory={cfg.cache_reserved_memory} leaves no memory "
                                 "for the cache")
            if total * per_slot > free:
                total = max(1, (free // per_slot) // ASSOC) * ASSOC
        slots = [int(r) for r in rows]
        for t in caching:
            slots[t] = int(min(rows[t], max(1, total * rows[t] // max(total_rows, 1))))
        return slots

    def _adopt_host_buffers(self, buffers: dict) -> None:
        """FBGEMM's preallocated_host_buffers: caller-owned 1-D arrays become the weights ("weights") and
        optimizer states ("momentum1", "momentum2") as they are (their contents are kept, nothing is zeroed),
        so the caller's array and the module's weights_host / momentum*_host share memory. FBGEMM's checks:
        size, contiguity, 1-D, dtype, host memory."""
        eng = self.engine
        if eng.impl == "kernels":
            raise NotImplementedError(f"{WHO}: preallocated_host_buffers need host tables, but numbactr's "
                                      f"{device.kind()} device keeps them in device memory")
        if not eng.int8 and any(int(s) != int(d) for s, d in zip(eng.strides, eng.dims)):
            lane = 4 if eng.weights.dtype == np.float32 else 8
            raise NotImplementedError(f"{WHO}: preallocated_host_buffers need every table's dim to be a multiple of "
                                      f"{lane} for {self.weights_precision.name} weights (numbactr pads rows to 16 "
                                      f"bytes, so other dims do not have FBGEMM's layout; dims {list(map(int, eng.dims))})")
        named = {"weights": eng.weights}
        named.update({f"momentum{i + 1}": state for i, state in enumerate(eng.states[:2])})
        adopted = {}
        for key, buf in buffers.items():
            own = named[key]
            where = f"{WHO}: preallocated_host_buffer for '{key}_host'"
            if not isinstance(buf, np.ndarray):
                raise FBGEMMAssertion(f"{where} must be in host memory (the module runs on cpu), got "
                                      f"{type(buf).__name__}")
            if buf.size != own.size:
                raise FBGEMMAssertion(f"{where}: size mismatch, expected {own.size}, got {buf.size}")
            if not buf.flags.c_contiguous:
                raise FBGEMMAssertion(f"{where} must be contiguous")
            if buf.ndim != 1:
                raise FBGEMMAssertion(f"{where} must be 1D, got {buf.ndim}D with shape {buf.shape}")
            if buf.dtype != own.dtype:
                raise FBGEMMAssertion(f"{where}: dtype mismatch, expected {own.dtype}, got {buf.dtype}")
            adopted[key] = buf
        eng.adopt_host_buffers(weights=adopted.get("weights"),
                               states={i: adopted[f"momentum{i + 1}"] for i in range(2) if f"momentum{i + 1}" in adopted})

    def _resolve_device(self, wanted, compute_device) -> str:
        """'cuda' on the gpu device, else 'cpu' (see the class docstring)."""
        name = "" if wanted is None else (f"cuda:{wanted}" if isinstance(wanted, int) else str(wanted))
        wants_cpu = name.startswith("cpu") or (not name and compute_device == ComputeDevice.CPU)
        if device.kind() == "gpu":
            if wants_cpu:
                raise ValueError(f"{WHO}: ComputeDevice.CPU / device='cpu' asked for, but numbactr runs on the gpu "
                                 "device in this process; set NUMBACTR_DEVICE=cpu to run the TBE on the CPU")
            return "cuda"
        if not wants_cpu:
            log.info_once("fbgemm-cuda-on-cpu", f"{WHO}: ComputeDevice.CUDA / device={name or 'cuda'} runs on "
                                                f"numbactr's {device.kind()} device ({device.describe()})")
        return "cpu"

    def _optimizer_spec(self, cfg: TBEConfig) -> OptimizerSpec:
        opt = self.optimizer
        mode = _enum(WeightDecayMode, cfg.weight_decay_mode, "weight_decay_mode")
        rowwise = opt in _ROWWISE
        counter = _counter_settings(cfg, mode) if opt == EmbOptimType.EXACT_ROWWISE_ADAGRAD else None
        gwd = opt == EmbOptimType.EXACT_ROWWISE_ADAGRAD and mode == WeightDecayMode.DECOUPLE_GLOBAL
        if gwd:          # the update is DECOUPLE's (FBGEMM's mode 5); the missed decay is applied per row first
            mode = WeightDecayMode.DECOUPLE
        return OptimizerSpec(
            _ENGINE_OPTIM[opt], learning_rate=float(cfg.learning_rate), eps=float(cfg.eps),
            beta1=float(cfg.beta1), beta2=float(cfg.beta2),
            weight_decay=float(cfg.weight_decay) if opt in _DECAYS else 0.0,
            weight_decay_mode=_WEIGHT_DECAY[mode] if rowwise else WeightDecay.NONE,
            # FBGEMM's rowwise_adagrad_with_counter takes no max_norm
            max_norm=float(cfg.max_norm) if rowwise and counter is None else 0.0,
            gradient_clipping=bool(cfg.gradient_clipping), max_gradient=float(cfg.max_gradient),
            counter=counter,
            rowwise_bias_correction=bool(getattr(cfg.extra_optimizer_config, "use_rowwise_bias_correction", False)),
            prev_iter_state=gwd,
            momentum=float(cfg.momentum) if opt == EmbOptimType.LARS_SGD else 0.0, eta=float(cfg.eta))

    @property
    def counts_iterations(self) -> bool:
        """True when FBGEMM's forward advances `iter` for this optimizer."""
        return self.optimizer in _COUNTS_ITER

    # ---- lookup and update -------------------------------------------------------------------------------
    def lookup(self, indices, offsets, per_sample_weights=None, feature_requires_grad=None,
               batch_size_per_feature_per_rank=None, total_unique_indices=None, *, iteration: int = 0,
               global_decay: bool = False, **unsupported):
        """(output, Lookup): output (B, total_D), (N, D) for PoolingMode.NONE, or 1-D for VBE input.

        indices (N,) and offsets (F*B + 1,) int32/int64 arrays of this device; per_sample_weights (N,)
        float; feature_requires_grad (F,); iteration: FBGEMM's iter of this forward (the update's t).
        global_decay (a training forward of WeightDecayMode.DECOUPLE_GLOBAL from its start_iter on): the lookup
        reads each row scaled by its global weight decay (_global_decay) and its backward applies the decay.
        FBGEMM's hash_zch_*, vbe_output* arguments are not implemented (an error when given).
        """
        given = sorted(k for k, v in unsupported.items() if v is not None)
        if given:
            raise NotImplementedError(f"{WHO}.forward: {', '.join(given)} not implemented in numbactr")
        xp = device.xp()
        indices, offsets = xp.asarray(indices), xp.asarray(offsets)
        if self.optimizer == EmbOptimType.NONE and (total_unique_indices is None or
                                                     int(total_unique_indices) > indices.size):
            raise ValueError(f"{WHO}: OptimType.NONE requires total_unique_indices <= the number of indices "
                             f"({indices.size}), got {total_unique_indices!r}")
        vbe = None
        if batch_size_per_feature_per_rank is not None:
            if self.pooling_mode == PoolingMode.NONE:
                raise ValueError(f"{WHO}: batch_size_per_feature_per_rank (variable batch) needs pooling; "
                                 "PoolingMode.NONE has one output row per index already")
            if offsets.ndim != 1 or offsets.shape[0] < 1:
                raise ValueError(f"{WHO}: offsets must be 1-D with sum(B) + 1 entries, got shape {offsets.shape}")
            vbe = _vbe_layout(batch_size_per_feature_per_rank, self.feature_dims, int(offsets.shape[0]) - 1)
            offsets = offsets[xp.asarray(vbe.offset_src)]
        if self.writeback and vbe is not None:
            raise FBGEMMAssertion(f"{WHO}: VBE is not supported with writeback_bwd_prehook (FBGEMM's rule)")
        if per_sample_weights is not None and self.pooling_mode == PoolingMode.NONE:
            # FBGEMM's training TBE returns sequence rows unweighted (its no-pooling kernels take no weights)
            warnings.warn(f"{WHO}: per_sample_weights are not applied with PoolingMode.NONE (as in FBGEMM): the "
                          "rows come back unweighted and the weights get no gradient", RuntimeWarning, stacklevel=3)
            per_sample_weights = None
        plan = self._global_decay_rows(indices, offsets) if global_decay else None
        saved = self._global_decay(plan, int(iteration), commit=False) if plan is not None else None
        try:
            out, ctx = self.engine.forward(indices, offsets, per_sample_weights,
                                           feature_requires_grad=feature_requires_grad)
        finally:                 # the forward read the decayed rows; the tables change only in the backward
            if saved is not None:
                self._restore_rows(saved)
        if vbe is not None:
            out = out.reshape(-1)[xp.asarray(vbe.out_index)]
        return out, Lookup(ctx, int(iteration), vbe, (indices, offsets) if self.writeback else None, plan)

    def _global_decay_rows(self, indices, offsets) -> list | None:
        """Global weight decay's rows of one lookup (offsets in the engine's layout, VBE padded): per table, the
        distinct rows the lookup reads, after the bounds check's repairs (an index outside its table is row 0
        under WARNING and IGNORE, as the lookup reads it; NONE reads nothing there). None when the check would
        raise (FATAL): the lookup raises, and nothing was decayed."""
        idx = np.asarray(device.to_host(indices)).astype(np.int64).reshape(-1)
        mode = self.engine.bounds_check
        n_feat = len(self.feature_table_map)
        feature_rows = np.array([int(self.embedding_specs[t][0]) for t in self.feature_table_map], np.int64)
        try:
            fixed, _ = K.check_offsets_ref(np.asarray(device.to_host(offsets)), idx.shape[0], mode)
            batch = (fixed.shape[0] - 1) // max(n_feat, 1)
            rows, _, _ = K.check_indices_ref(idx, fixed, feature_rows, batch, int(self.engine.layout), mode)
        except EmbeddingBoundsError:
            return None
        _, feat, _ = K._occurrences(fixed, n_feat, batch, int(self.engine.layout))
        table = np.asarray(self.feature_table_map, np.int64)[np.maximum(feat, 0)]
        read = (feat >= 0) & (rows >= 0)
        return [np.unique(rows[read & (table == t)]) for t in range(len(self.embedding_specs))]

    def _global_decay(self, plan: list, iteration: int, commit: bool) -> list:
        """Scale each row of `plan` (from _global_decay_rows) by its global weight decay at `iteration`,
        f = max(lower_bound, (1 - lr wd) ** max(iteration - prev_iter - 1, 0)) (1 for a row never updated,
        prev_iter = 0): FBGEMM's factor. commit=False (the forward): returns the rows' stored values, to put
        back after the lookup, so that a forward changes no table (FBGEMM's forward only scales what it reads).
        commit=True (the backward, before the update): keeps the scaled rows and sets prev_iter = iteration, as
        FBGEMM's backward does before its DECOUPLE update; float16 rows round after the decay (FBGEMM scales in
        registers) and again after the update."""
        xp = device.xp()
        lr = np.float32(self.engine.learning_rate)
        base = np.float32(np.float32(1.0) - lr * np.float32(self.engine.optimizer.weight_decay))
        it = np.float32(iteration)
        weights, states = self.split_embedding_weights(), self.engine.split_optimizer_states()
        saved = []
        for t, rows in enumerate(plan):
            if rows.shape[0] == 0:
                saved.append(None)
                continue
            rows_d = xp.asarray(rows)
            prev, w = states[t][1], weights[t]
            p = prev[rows_d]
            n = xp.maximum(it - p - np.float32(1.0), np.float32(0.0)).astype(np.float32)
            factor = xp.maximum(np.float32(self.gwd_lower_bound), xp.power(base, n).astype(np.float32))
            factor = xp.where(p == 0, np.float32(1.0), factor).astype(np.float32)
            old = w[rows_d]
            saved.append((rows_d, old, p.copy()))
            w[rows_d] = (old.astype(np.float32) * factor[:, None]).astype(w.dtype)
            if commit:
                prev[rows_d] = it
        return saved

    def _restore_rows(self, saved: list) -> None:
        """Put back what _global_decay changed (the rows, and prev_iter)."""
        states = self.engine.split_optimizer_states()
        for t, (w, kept) in enumerate(zip(self.split_embedding_weights(), saved)):
            if kept is not None:
                rows_d, old, prev = kept
                w[rows_d] = old
                states[t][1][rows_d] = prev

    def decays_globally(self, iteration: int, training: bool) -> bool:
        """Whether a forward at `iteration` applies global weight decay: in training, DECOUPLE_GLOBAL with a
        weight_decay above 0 (FBGEMM's condition: with 0, prev_iter is never written), from
        global_weight_decay.start_iter on."""
        return bool(training and self.global_weight_decay and iteration >= self.gwd_start_iter
                    and self.engine.optimizer.weight_decay > 0)

    def ema_inplace(self, iteration: int, emainplace_mode: dict | None = None) -> None:
        """FBGEMM's EMAINPLACE_ROWWISE_ADAGRAD step, which its training forwards take before the lookup: each
        row is a fast half (its first D/2 values, trained) and a slow half (the rest), and every step_ema
        iterations from step_start on, slow += step_ema_coef * (fast - slow) over the whole table.
        emainplace_mode: FBGEMM's dict of floats (default: this module's EmainplaceModeDefinition)."""
        mode = self.emainplace_mode if emainplace_mode is None else emainplace_mode
        iteration = int(iteration)
        if iteration % int(mode["step_ema"]) or iteration < int(mode["step_start"]):
            return
        for t, w in enumerate(self.split_embedding_weights()):      # a cache is flushed and emptied first
            dim = int(self.embedding_specs[t][1])
            if dim % 2:
                raise FBGEMMAssertion(f"{WHO}: table {t}'s dimension {dim} is odd, not supported for "
                                      "ema_inplace_rowwise_adagrad")
            _lerp_(w[:, dim // 2:dim], w[:, :dim // 2], float(mode["step_ema_coef"]))

    def _writeback_mask(self, indices, offsets):
        """FBGEMM's writeback (use_writeback_bwd_prehook, EXACT_SGD): SGD with lr 1 and a gradient of
        (old - new) "assigns" a row, so only the first occurrence of each (feature, index) in the batch keeps
        its gradient; the others' dLoss/doutput are zeroed. writeback_first_feature_only: only feature 0's
        first occurrences keep theirs (the other features are read-only). Returns the 0/1 float32 mask of
        dLoss/doutput: (N, 1) for PoolingMode.NONE, else (B, total_D), whose bags must hold at most one index
        (FBGEMM's writeback is for one-hot bags; it would misplace longer ones)."""
        xp = device.xp()
        idx, off = indices.astype(np.int64), offsets.astype(np.int64)
        n_feat = len(self.feature_table_map)
        n_bags = int(off.shape[0]) - 1
        batch = n_bags // n_feat
        lengths = xp.maximum(off[1:] - off[:-1], 0)
        bag = xp.repeat(xp.arange(n_bags, dtype=np.int64), lengths)[:idx.shape[0]]      # each index's bag
        considered = bag < batch if self.writeback_first_feature_only else xp.ones(bag.shape[0], bool)
        keep = xp.zeros(bag.shape[0], bool)
        if bag.shape[0]:
            span = int(idx.max()) + 1
            key = xp.where(considered, (bag // batch) * span + idx, -1)
            _, first = xp.unique(key, return_index=True)
            keep[first] = True
            keep &= considered
        if self.pooling_mode == PoolingMode.NONE:
            return keep.astype(np.float32)[:, None]
        if bag.shape[0] and int(lengths.max()) > 1:
            raise ValueError(f"{WHO}: use_writeback_bwd_prehook with pooling needs bags of at most one index "
                             f"(one-hot features); a bag here holds {int(lengths.max())}")
        bag_keep = xp.ones(n_bags, np.float32)
        bag_keep[bag[~keep]] = 0.0
        if self.writeback_first_feature_only:
            bag_keep[batch:] = 0.0
        return xp.repeat(bag_keep.reshape(n_feat, batch).T, xp.asarray(self.feature_dims), axis=1)

    def update(self, lookup: Lookup, grad_output) -> Grads:
        """The fused backward + optimizer of one lookup with dLoss/doutput (the output's shape); returns the
        engine's Grads (per-sample-weight gradients; the sparse row gradient for OptimType.NONE)."""
        xp = device.xp()
        dy = xp.asarray(grad_output)
        if lookup.vbe is not None:
            want = lookup.vbe.out_index.shape
            if dy.shape != want:
                raise ValueError(f"{WHO}: the gradient of a variable-batch output must have shape {want}, "
                                 f"got {dy.shape}")
            full = xp.zeros(lookup.vbe.batch * self.total_D, np.float32)
            full[xp.asarray(lookup.vbe.out_index)] = dy
            dy = full.reshape(lookup.vbe.batch, self.total_D)
        if lookup.writeback is not None:                      # FBGEMM's writeback hook acts on dLoss/doutput
            dy = dy * self._writeback_mask(*lookup.writeback).astype(dy.dtype)
        if self.counts_iterations:
            self.engine.step = lookup.iteration - 1         # the engine's update uses t = step + 1
        if lookup.global_decay is None:
            return self.engine.backward(lookup.ctx, dy)
        # the rows' decay from their prev_iter now, then the update; an update that fails (a gradient of the
        # wrong shape) leaves the rows and prev_iter as they were
        saved = self._global_decay(lookup.global_decay, lookup.iteration, commit=True)
        try:
            return self.engine.backward(lookup.ctx, dy)
        except BaseException:
            self._restore_rows(saved)
            raise

    # ---- state ------------------------------------------------------------------------------------------
    def split_embedding_weights(self) -> list:
        """[(V_t, D_t) views of the weights, one per table] (writes reach the engine)."""
        return self.engine.split_weights()

    def split_optimizer_states(self) -> list:
        """Per table, [momentum1 (, momentum2)] views in FBGEMM's order; [] for EXACT_SGD (FBGEMM's)."""
        self._need_optimizer("Getting optimizer states")
        states = self.engine.split_optimizer_states()
        return states if any(states) else []

    def optimizer_state_names(self) -> tuple:
        """get_optimizer_state()'s key of each state (PyTorch's names: sum, exp_avg, exp_avg_sq; then
        prev_iter, row_counter where the optimizer's mode keeps them)."""
        self._need_optimizer("Getting optimizer state")
        if self.optimizer not in _STATE_NAMES:              # FBGEMM names no states for LARS_SGD either
            raise NotImplementedError(f"Getting optimizer state {self.optimizer} is not implemented")
        names = _STATE_NAMES[self.optimizer]
        extra = [_EXTRA_STATE_NAMES[name] for name, _, _ in state_specs(self.engine.optimizer)[len(names):]]
        return names + tuple(extra)

    @property
    def state_wants_iter(self) -> bool:
        """FBGEMM's get_optimizer_state adds "iter" for COUNTER with CounterWeightDecayMode.ADAGRADW."""
        opt = self.engine.optimizer
        return self.global_weight_decay or (opt.weight_decay_mode == WeightDecay.COUNTER
                                            and int(opt.counter.weight_decay_mode) == int(CounterWeightDecay.ADAGRADW))

    @property
    def max_counter(self):
        """COUNTER / COWCLIP's max_counter, a (1,) float32 array of the engine's device (1 elsewhere)."""
        eng = self.engine
        return getattr(eng, "engine", eng).max_counter

    def set_learning_rate(self, lr: float) -> None:
        self._need_optimizer("Setting learning rate")
        self.engine.learning_rate = float(lr)

    def optimizer_args(self) -> OptimizerArgs:
        """FBGEMM's OptimizerArgs of this module, as its constructor fills them (the current eps, betas and
        weight decay: update_hyper_parameters changes them)."""
        from numbactr.fbgemm_gpu.optimizer_config import CounterBasedRegularizationDefinition, CowClipDefinition, UserEnabledConfigDefinition
        cfg, hp = self.config, self.engine.optimizer if hasattr(self.engine, "optimizer") else None
        counter = cfg.counter_based_regularization or CounterBasedRegularizationDefinition()
        cowclip = cfg.cowclip_regularization or CowClipDefinition()
        extra = cfg.extra_optimizer_config or UserEnabledConfigDefinition()
        mode = _enum(WeightDecayMode, cfg.weight_decay_mode, "weight_decay_mode")
        counted = self.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD and mode in (WeightDecayMode.COUNTER,
                                                                                    WeightDecayMode.COWCLIP)
        if counted:
            kept = counter if mode == WeightDecayMode.COUNTER else cowclip
            arg_mode, halflife = int(_value(kept.counter_weight_decay_mode)), int(kept.counter_halflife)
        else:
            arg_mode, halflife = int(_value(mode)), -1

        def current(name, default):
            return float(getattr(hp, name, default)) if hp is not None else float(default)

        return OptimizerArgs(
            bool(cfg.stochastic_rounding), bool(cfg.gradient_clipping), float(cfg.max_gradient), float(cfg.max_norm),
            current("eps", cfg.eps), current("beta1", cfg.beta1), current("beta2", cfg.beta2),
            current("weight_decay", cfg.weight_decay), arg_mode, float(cfg.eta), float(cfg.momentum), halflife,
            int(counter.adjustment_iter), float(counter.adjustment_ub), int(_value(counter.learning_rate_mode)),
            int(_value(counter.grad_sum_decay)), float(counter.tail_id_threshold.val),
            int(counter.tail_id_threshold.is_ratio), int(sum(int(spec[0]) for spec in self.embedding_specs)),
            float(cowclip.weight_norm_coefficient), float(cowclip.lower_bound), int(_value(mode)),
            bool(extra.use_rowwise_bias_correction))

    def get_learning_rate(self) -> float:
        """The rate as FBGEMM reads it back: float32 (its learning_rate_tensor)."""
        return float(np.float32(self.engine.learning_rate))

    def update_hyper_parameters(self, params_dict: dict) -> None:
        """FBGEMM's names: lr, eps, beta1, beta2, weight_decay and lower_bound (global weight decay's)."""
        self._need_optimizer("Setting hyper-parameters")
        unknown = sorted(set(params_dict) - {"lr", "eps", "beta1", "beta2", "weight_decay", "lower_bound"})
        if unknown:
            raise NotImplementedError(f"Setting hyper-parameter {unknown[0]} is not supported")
        values = {("learning_rate" if k == "lr" else k): float(v) for k, v in params_dict.items()
                  if k != "lower_bound" and not (k == "weight_decay" and self.optimizer not in _DECAYS)}
        self.engine.set_hyper_parameters(**values)
        if "lower_bound" in params_dict:
            self.gwd_lower_bound = float(params_dict["lower_bound"])       # global weight decay's floor

    def _need_optimizer(self, what: str) -> None:
        if self.optimizer == EmbOptimType.NONE:
            raise NotImplementedError(f"{what} is not supported for {self.optimizer}")

    # ---- the cache (MANAGED_CACHING) ---------------------------------------------------------------------
    def prefetch(self, indices, offsets, forward_stream=None, batch_size_per_feature_per_rank=None) -> None:
        """Stage the rows of the next forward in the cache (FBGEMM's prefetch; forward_stream has no
        meaning here: with prefetch_pipeline the staging runs on a worker thread). Nothing without
        MANAGED_CACHING tables."""
        if not self.cached:
            return
        xp = device.xp()
        indices, offsets = xp.asarray(indices), xp.asarray(offsets)
        if batch_size_per_feature_per_rank is not None:
            vbe = _vbe_layout(batch_size_per_feature_per_rank, self.feature_dims, int(offsets.shape[0]) - 1)
            offsets = offsets[xp.asarray(vbe.offset_src)]
        self.engine.prefetch(indices, offsets)

    def flush(self) -> None:
        """Write every updated cached row back to host memory (FBGEMM's flush)."""
        if self.cached:
            self.engine.flush()

    def reset_cache_states(self) -> None:
        """Empty the cache (FBGEMM's reset_cache_states, which TorchRec's purge calls); its updated rows are
        written back first, so nothing trained is lost (FBGEMM leaves that to a flush before)."""
        if self.cached:
            self.engine.invalidate(write_back=True)

    def _cache_counts(self) -> dict:
        st = self.engine.stats if self.cached else None
        table = np.array(st.table_misses if st else [0] * len(self.embedding_specs), np.int64)
        miss = np.array([st.batches_with_misses, st.unique_misses, st.unique_rows, st.lookups] if st else [0] * 4,
                        np.int64)
        uvm = np.array([st.batches, st.lookups, st.unique_rows, st.unique_misses, 0, 0] if st else [0] * 6, np.int64)
        return dict(miss=miss, table=table, uvm=uvm)

    def _need(self, flag: bool, what: str) -> None:
        if not flag:
            raise AssertionError(f"{what} should be true to access counter values")

    def get_cache_miss_counter(self) -> np.ndarray:
        """(4,) int64: forwards with a miss, unique misses, unique rows asked for, rows asked for (FBGEMM's
        cache_miss_counter; needs record_cache_metrics.record_cache_miss_counter)."""
        self._need(self.record_cache_metrics.record_cache_miss_counter, "record_cache_miss_counter")
        base = self._cache_base if self._cache_base is not None else 0
        return self._cache_counts()["miss"] - base

    def reset_cache_miss_counter(self) -> None:
        self._need(self.record_cache_metrics.record_cache_miss_counter, "record_cache_miss_counter")
        self._cache_base = self._cache_counts()["miss"]

    def get_table_wise_cache_miss(self) -> np.ndarray:
        """(T,) int64 unique misses per table (needs record_cache_metrics.record_tablewise_cache_miss)."""
        self._need(self.record_cache_metrics.record_tablewise_cache_miss, "record_tablewise_cache_miss")
        return self._cache_counts()["table"]

    def get_uvm_cache_stats(self) -> np.ndarray:
        """(6,) int64: N_called, N_requested_indices, N_unique_indices, N_unique_misses, and FBGEMM's
        set-conflict counts N_conflict_unique_misses, N_conflict_misses (always 0: a fully associative
        cache has no set conflicts); needs gather_uvm_cache_stats."""
        self._need(self.gather_uvm_cache_stats, "gather_uvm_cache_stats")
        base = self._uvm_base if self._uvm_base is not None else 0
        return self._cache_counts()["uvm"] - base

    def reset_uvm_cache_stats(self) -> None:
        self._need(self.gather_uvm_cache_stats, "gather_uvm_cache_stats")
        self._uvm_base = self._cache_counts()["uvm"]

    def print_uvm_cache_stats(self) -> None:
        s = self.get_uvm_cache_stats().tolist()
        names = ("N_called", "N_requested_indices", "N_unique_indices", "N_unique_misses",
                 "N_conflict_unique_misses", "N_conflict_misses")
        log.info(" ".join(f"{n}: {v}" for n, v in zip(names, s)))


class ArrayTBE(TBECore):
    """FBGEMM's TBE on NumPy (cpu, sim) or CuPy (gpu) arrays, without torch: forward, then backward.

        tbe = ArrayTBE([(1000, 16, EmbeddingLocation.HOST, ComputeDevice.CPU)] * 2, optimizer=...)
        out = tbe(indices, offsets)          # (B, 32)
        tbe.backward(dloss_dout)             # the fused update of the last training forward

    `iter` (a (1,) int64 array) and `step` count forwards as in FBGEMM. backward(grad, lookup) takes a
    Lookup from forward(..., return_lookup=True) when several forwards precede their backwards.
    """

    get_table_name_for_logging = staticmethod(table_name_for_logging)
    get_prefetch_passes = staticmethod(prefetch_passes)

    def __init__(self, embedding_specs, feature_table_map=None, *args, **kwargs):
        super().__init__(embedding_specs, feature_table_map, *args, **kwargs)
        self.iter = np.zeros(1, np.int64)
        self.step = 0
        self.training = True
        self._pending = None

    def forward(self, indices, offsets, per_sample_weights=None, feature_requires_grad=None,
                batch_size_per_feature_per_rank=None, total_unique_indices=None, *, return_lookup: bool = False,
                **unsupported):
        """The lookup (see TBECore.lookup); in training mode its context waits for backward()."""
        self.step += 1
        if self.counts_iterations:
            self.iter[0] += 1
        if self.training and self.optimizer == EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD:
            self.ema_inplace(int(self.iter[0]))
        out, lookup = self.lookup(indices, offsets, per_sample_weights, feature_requires_grad,
                                  batch_size_per_feature_per_rank, total_unique_indices,
                                  iteration=int(self.iter[0]),
                                  global_decay=self.decays_globally(int(self.iter[0]), self.training),
                                  **unsupported)
        if self.training:
            self._pending = lookup
        return (out, lookup) if return_lookup else out

    __call__ = forward

    def backward(self, grad_output, lookup: Lookup | None = None) -> Grads:
        """Run the fused update of `lookup` (default: the last training forward's, once) with dLoss/dout."""
        if lookup is None:
            lookup, self._pending = self._pending, None
            if lookup is None:
                raise RuntimeError(f"{WHO}.backward: no training forward is waiting for its backward")
        return self.update(lookup, grad_output)

    def train(self, mode: bool = True) -> "ArrayTBE":
        self.training = bool(mode)
        return self

    def eval(self) -> "ArrayTBE":
        return self.train(False)

    def set_optimizer_step(self, step: int) -> None:
        """The next forward counts iteration step + 1."""
        self._need_optimizer("Setting optimizer step")
        self.iter[0] = int(step)

    def get_optimizer_state(self) -> list:
        """Per table, {name: state view} with PyTorch's names (FBGEMM's get_optimizer_state)."""
        names = self.optimizer_state_names()
        extra = {"iter": self.iter} if self.state_wants_iter else {}
        return [dict(zip(names, states), **extra) for states in self.split_optimizer_states()]

    def init_embedding_weights_uniform(self, min_val: float, max_val: float) -> None:
        """Every weight U(min_val, max_val) from numbactr's hash of (seed, row, d) (torch's RNG in the
        torch face)."""
        self.engine.init_uniform(float(min_val), float(max_val))


# FBGEMM's constructor signature on both faces (help() and inspect show it)
def _signature():
    import inspect
    params = [inspect.Parameter("embedding_specs", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("feature_table_map", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
    params += [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=f.default)
               for f in fields(TBEConfig)]
    params.append(inspect.Parameter("seed", inspect.Parameter.KEYWORD_ONLY, default=None))
    return inspect.Signature(params)


SIGNATURE = _signature()
ArrayTBE.__signature__ = SIGNATURE
