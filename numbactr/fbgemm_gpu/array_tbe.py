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
    backward scales the rows by f, sets prev_iter = iter and then runs DECOUPLE's update (TBECore._decayed_lookup;
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

import os
import warnings
from dataclasses import dataclass, fields

import numpy as np

from numbactr.runtime import device
from numbactr import log
from numbactr.embedding.engine import BoundsCheck, Grads, LookupContext, Pooling, TableBatchedEmbedding
from numbactr.embedding.tiered import CacheConfig, TieredEmbedding
from numbactr.fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    BoundsCheckMode,
    CacheAlgorithm,
    ComputeDevice,
    EmbeddingLocation,
    PoolingMode,
    RecordCacheMetrics,
    WeightDecayMode,
)
from numbactr.fbgemm_gpu.tbe_args import (
    _COUNTS_ITER,
    _PRECISION,
    _V2_BOUNDS,
    WHO,
    FBGEMMAssertion,
    TBEConfig,
    _dtype_name,
    _emainplace_mode,
    _enum,
    _specs,
    _VBE,
    _vbe_layout,
    check_supported,
    consumed_preallocated_keys,
    optimizer_spec,
    prefetch_passes,
    table_name_for_logging,
)
from numbactr.fbgemm_gpu.tbe_cache import TBECache, cache_slots
from numbactr.fbgemm_gpu.tbe_optimizer import TBEOptimizerState

# names importable from here before the module was split (tbe_args holds them)
from numbactr.fbgemm_gpu.tbe_args import SUPPORTED_OPTIMIZERS, OptimizerArgs  # noqa: F401

__all__ = ["TBEConfig", "TBECore", "ArrayTBE", "Lookup", "SUPPORTED_OPTIMIZERS"]


@dataclass
class Lookup:
    """One forward, for its backward: the engine's context, FBGEMM's iteration, the VBE layout if any."""

    ctx: LookupContext
    iteration: int
    vbe: _VBE | None = None
    writeback: object = None  # use_writeback_bwd_prehook: (indices, offsets), for the backward's mask
    global_decay: object = None  # DECOUPLE_GLOBAL: the linear rows the backward decays (engine.touched_rows)


class TBECore(TBECache, TBEOptimizerState):
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
            raise ValueError(
                f"{WHO}: every table must be read by at least one feature (FBGEMM's rule); "
                f"table(s) {unread} are not in feature_table_map"
            )
        self.feature_table_map = ftm

        self.optimizer = _enum(EmbOptimType, cfg.optimizer, "optimizer")
        if cfg.preallocated_host_buffers is not None:
            unconsumed = set(cfg.preallocated_host_buffers) - consumed_preallocated_keys(self.optimizer)
            if unconsumed:
                raise FBGEMMAssertion(
                    f"{WHO}: preallocated_host_buffers contains keys not consumed by optimizer={self.optimizer}: "
                    f"{sorted(unconsumed)}; this optimizer's keys: {sorted(consumed_preallocated_keys(self.optimizer))}"
                )
        self.pooling_mode = _enum(PoolingMode, cfg.pooling_mode, "pooling_mode")
        self.weights_precision = _enum(SparseType, cfg.weights_precision, "weights_precision")
        out_dtype = _enum(SparseType, cfg.output_dtype, "output_dtype")
        self.output_dtype = out_dtype.as_int()  # FBGEMM keeps the int code
        self.stochastic_rounding = bool(cfg.stochastic_rounding)
        self.table_names = cfg.table_names
        self.embedding_table_index_type = _dtype_name(cfg.embedding_table_index_type, "embedding_table_index_type")
        self.embedding_table_offset_type = _dtype_name(cfg.embedding_table_offset_type, "embedding_table_offset_type")
        self.mixed_D = len(set(dims)) > 1
        if self.mixed_D and self.pooling_mode == PoolingMode.NONE:
            raise ValueError(
                f"{WHO}: mixed dimension tables are only supported with pooling "
                f"(PoolingMode.NONE needs equal dims, got {dims})"
            )
        bounds = _enum(
            BoundsCheckMode,
            int(
                os.environ.get(
                    "FBGEMM_TBE_BOUNDS_CHECK_MODE",
                    _enum(BoundsCheckMode, cfg.bounds_check_mode, "bounds_check_mode").value,
                )
            ),
            "bounds_check_mode (FBGEMM_TBE_BOUNDS_CHECK_MODE)",
        )
        bounds = _V2_BOUNDS.get(bounds, bounds)
        self.bounds_check_mode_int = int(bounds)
        check_supported(
            cfg, self.optimizer, self.weights_precision, out_dtype, self.pooling_mode, dims, locations, compute_devices
        )
        self.current_device = self._resolve_device(cfg.device, compute_devices[0])

        feature_dims = [dims[t] for t in ftm]
        self.total_D = int(sum(feature_dims))
        self.max_D = int(max(dims))
        self.D_offsets = np.concatenate([[0], np.cumsum(feature_dims)]).astype(np.int32)  # (F + 1,)
        self.feature_dims = np.asarray(feature_dims, np.int64)
        engine_args = dict(
            pooling=Pooling(int(self.pooling_mode)),
            optimizer=optimizer_spec(cfg, self.optimizer),
            weights_precision=_PRECISION[self.weights_precision],
            output_dtype=_PRECISION[out_dtype],
            bounds_check=BoundsCheck(int(bounds)),
            stochastic_rounding=self.stochastic_rounding,
            seed=0 if seed is None else int(seed),
        )
        caching = [t for t, loc in enumerate(locations) if loc == EmbeddingLocation.MANAGED_CACHING]
        self.cache_algorithm = _enum(CacheAlgorithm, cfg.cache_algorithm, "cache_algorithm")
        self.record_cache_metrics = cfg.record_cache_metrics or RecordCacheMetrics(False, False)
        self.gather_uvm_cache_stats = bool(cfg.gather_uvm_cache_stats)
        if caching:
            cache = CacheConfig(
                self.cache_algorithm.name.lower(),
                capacities=cache_slots(cfg, self.weights_precision, rows, dims, caching, engine_args["optimizer"]),
                prefetch_thread=bool(cfg.prefetch_pipeline),
            )
            self.engine = TieredEmbedding(list(zip(rows, dims)), ftm, cache=cache, **engine_args)
        else:
            self.engine = TableBatchedEmbedding(list(zip(rows, dims)), ftm, **engine_args)
        self.cached = bool(caching)
        extra = cfg.extra_optimizer_config
        self.writeback = bool(getattr(extra, "use_writeback_bwd_prehook", False))
        self.writeback_first_feature_only = self.writeback and bool(
            getattr(extra, "writeback_first_feature_only", False)
        )
        if cfg.preallocated_host_buffers and all(loc == EmbeddingLocation.HOST for loc in locations):
            self._adopt_host_buffers(cfg.preallocated_host_buffers)  # FBGEMM: only HOST tables have host buffers
        self._cache_base = None  # stats at the last reset_cache_miss_counter / reset_uvm_cache_stats
        self._uvm_base = None
        self.emainplace_mode = _emainplace_mode(cfg.emainplace_mode)
        self.global_weight_decay = (
            self.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD
            and _enum(WeightDecayMode, cfg.weight_decay_mode, "weight_decay_mode") == WeightDecayMode.DECOUPLE_GLOBAL
        )
        gwd_cfg = cfg.global_weight_decay
        self.gwd_start_iter = int(getattr(gwd_cfg, "start_iter", 0) or 0)
        self.gwd_lower_bound = float(getattr(gwd_cfg, "lower_bound", 0.0) or 0.0)
        if self.optimizer == EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD:
            odd = [t for t, d in enumerate(dims) if d % 2]
            if odd:
                raise FBGEMMAssertion(
                    f"{WHO}: EMAINPLACE_ROWWISE_ADAGRAD splits each row into halves, so every "
                    f"table's dim must be even; table(s) {odd} have dims "
                    f"{[dims[t] for t in odd]}"
                )

    # ---- arguments ------------------------------------------------------------------------------------
    def _adopt_host_buffers(self, buffers: dict) -> None:
        """FBGEMM's preallocated_host_buffers: caller-owned 1-D arrays become the weights ("weights") and
        optimizer states ("momentum1", "momentum2") as they are (their contents are kept, nothing is zeroed),
        so the caller's array and the module's weights_host / momentum*_host share memory. FBGEMM's checks:
        size, contiguity, 1-D, dtype, host memory."""
        eng = self.engine
        if eng.impl == "kernels":
            raise NotImplementedError(
                f"{WHO}: preallocated_host_buffers need host tables, but numbactr's "
                f"{device.kind()} device keeps them in device memory"
            )
        if not eng.int8 and any(int(s) != int(d) for s, d in zip(eng.strides, eng.dims)):
            lane = 4 if eng.weights.dtype == np.float32 else 8
            raise NotImplementedError(
                f"{WHO}: preallocated_host_buffers need every table's dim to be a multiple of "
                f"{lane} for {self.weights_precision.name} weights (numbactr pads rows to 16 "
                f"bytes, so other dims do not have FBGEMM's layout; dims {list(map(int, eng.dims))})"
            )
        named = {"weights": eng.weights}
        named.update({f"momentum{i + 1}": state for i, state in enumerate(eng.states[:2])})
        adopted = {}
        for key, buf in buffers.items():
            own = named[key]
            where = f"{WHO}: preallocated_host_buffer for '{key}_host'"
            if not isinstance(buf, np.ndarray):
                raise FBGEMMAssertion(
                    f"{where} must be in host memory (the module runs on cpu), got {type(buf).__name__}"
                )
            if buf.size != own.size:
                raise FBGEMMAssertion(f"{where}: size mismatch, expected {own.size}, got {buf.size}")
            if not buf.flags.c_contiguous:
                raise FBGEMMAssertion(f"{where} must be contiguous")
            if buf.ndim != 1:
                raise FBGEMMAssertion(f"{where} must be 1D, got {buf.ndim}D with shape {buf.shape}")
            if buf.dtype != own.dtype:
                raise FBGEMMAssertion(f"{where}: dtype mismatch, expected {own.dtype}, got {buf.dtype}")
            adopted[key] = buf
        eng.adopt_host_buffers(
            weights=adopted.get("weights"),
            states={i: adopted[f"momentum{i + 1}"] for i in range(2) if f"momentum{i + 1}" in adopted},
        )

    def _resolve_device(self, wanted, compute_device) -> str:
        """'cuda' on the gpu device, else 'cpu' (see the class docstring)."""
        name = "" if wanted is None else (f"cuda:{wanted}" if isinstance(wanted, int) else str(wanted))
        wants_cpu = name.startswith("cpu") or (not name and compute_device == ComputeDevice.CPU)
        if device.kind() == "gpu":
            if wants_cpu:
                raise ValueError(
                    f"{WHO}: ComputeDevice.CPU / device='cpu' asked for, but numbactr runs on the gpu "
                    "device in this process; set NUMBACTR_DEVICE=cpu to run the TBE on the CPU"
                )
            return "cuda"
        if not wants_cpu:
            log.info_once(
                "fbgemm-cuda-on-cpu",
                f"{WHO}: ComputeDevice.CUDA / device={name or 'cuda'} runs on "
                f"numbactr's {device.kind()} device ({device.describe()})",
            )
        return "cpu"

    @property
    def counts_iterations(self) -> bool:
        """True when FBGEMM's forward advances `iter` for this optimizer."""
        return self.optimizer in _COUNTS_ITER

    # ---- lookup and update -------------------------------------------------------------------------------
    def lookup(
        self,
        indices,
        offsets,
        per_sample_weights=None,
        feature_requires_grad=None,
        batch_size_per_feature_per_rank=None,
        total_unique_indices=None,
        *,
        iteration: int = 0,
        global_decay: bool = False,
        **unsupported,
    ):
        """(output, Lookup): output (B, total_D), (N, D) for PoolingMode.NONE, or 1-D for VBE input.

        indices (N,) and offsets (F*B + 1,) int32/int64 arrays of this device; per_sample_weights (N,)
        float; feature_requires_grad (F,); iteration: FBGEMM's iter of this forward (the update's t).
        global_decay (a training forward of WeightDecayMode.DECOUPLE_GLOBAL from its start_iter on): the lookup
        reads each row scaled by its global weight decay (_decayed_lookup) and its backward applies the decay.
        FBGEMM's hash_zch_*, vbe_output* arguments are not implemented (an error when given).
        """
        given = sorted(k for k, v in unsupported.items() if v is not None)
        if given:
            raise NotImplementedError(f"{WHO}.forward: {', '.join(given)} not implemented in numbactr")
        xp = device.xp()
        indices, offsets = xp.asarray(indices), xp.asarray(offsets)
        if self.optimizer == EmbOptimType.NONE and (
            total_unique_indices is None or int(total_unique_indices) > indices.size
        ):
            raise ValueError(
                f"{WHO}: OptimType.NONE requires total_unique_indices <= the number of indices "
                f"({indices.size}), got {total_unique_indices!r}"
            )
        vbe = None
        if batch_size_per_feature_per_rank is not None:
            if self.pooling_mode == PoolingMode.NONE:
                raise ValueError(
                    f"{WHO}: batch_size_per_feature_per_rank (variable batch) needs pooling; "
                    "PoolingMode.NONE has one output row per index already"
                )
            if offsets.ndim != 1 or offsets.shape[0] < 1:
                raise ValueError(f"{WHO}: offsets must be 1-D with sum(B) + 1 entries, got shape {offsets.shape}")
            vbe = _vbe_layout(batch_size_per_feature_per_rank, self.feature_dims, int(offsets.shape[0]) - 1)
            offsets = offsets[xp.asarray(vbe.offset_src)]
        if self.writeback and vbe is not None:
            raise FBGEMMAssertion(f"{WHO}: VBE is not supported with writeback_bwd_prehook (FBGEMM's rule)")
        if per_sample_weights is not None and self.pooling_mode == PoolingMode.NONE:
            # FBGEMM's training TBE returns sequence rows unweighted (its no-pooling kernels take no weights)
            warnings.warn(
                f"{WHO}: per_sample_weights are not applied with PoolingMode.NONE (as in FBGEMM): the "
                "rows come back unweighted and the weights get no gradient",
                RuntimeWarning,
                stacklevel=3,
            )
            per_sample_weights = None
        rows = None
        if global_decay:  # the forward reads the decayed rows; the tables change only in the backward
            out, ctx, rows = self._decayed_lookup(
                indices, offsets, per_sample_weights, feature_requires_grad, int(iteration)
            )
        else:
            out, ctx = self.engine.forward(
                indices, offsets, per_sample_weights, feature_requires_grad=feature_requires_grad
            )
        if vbe is not None:
            out = out.reshape(-1)[xp.asarray(vbe.out_index)]
        return out, Lookup(ctx, int(iteration), vbe, (indices, offsets) if self.writeback else None, rows)

    def update(self, lookup: Lookup, grad_output) -> Grads:
        """The fused backward + optimizer of one lookup with dLoss/doutput (the output's shape); returns the
        engine's Grads (per-sample-weight gradients; the sparse row gradient for OptimType.NONE)."""
        xp = device.xp()
        dy = xp.asarray(grad_output)
        if lookup.vbe is not None:
            want = lookup.vbe.out_index.shape
            if dy.shape != want:
                raise ValueError(
                    f"{WHO}: the gradient of a variable-batch output must have shape {want}, got {dy.shape}"
                )
            full = xp.zeros(lookup.vbe.batch * self.total_D, np.float32)
            full[xp.asarray(lookup.vbe.out_index)] = dy
            dy = full.reshape(lookup.vbe.batch, self.total_D)
        if lookup.writeback is not None:  # FBGEMM's writeback hook acts on dLoss/doutput
            dy = dy * self._writeback_mask(*lookup.writeback).astype(dy.dtype)
        if self.counts_iterations:
            self.engine.step = lookup.iteration - 1  # the engine's update uses t = step + 1
        if lookup.global_decay is None:
            return self.engine.backward(lookup.ctx, dy)
        # the rows' decay from their prev_iter now, then the update; an update that fails (a gradient of the
        # wrong shape) leaves the rows and prev_iter as they were
        saved = self._decay_before_update(lookup.global_decay, lookup.iteration)
        try:
            return self.engine.backward(lookup.ctx, dy)
        except BaseException:
            self._undo_decay(lookup.global_decay, saved)
            raise

    # ---- state ------------------------------------------------------------------------------------------
    def split_embedding_weights(self) -> list:
        """[(V_t, D_t) views of the weights, one per table] (writes reach the engine)."""
        return self.engine.split_weights()


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

    def forward(
        self,
        indices,
        offsets,
        per_sample_weights=None,
        feature_requires_grad=None,
        batch_size_per_feature_per_rank=None,
        total_unique_indices=None,
        *,
        return_lookup: bool = False,
        **unsupported,
    ):
        """The lookup (see TBECore.lookup); in training mode its context waits for backward()."""
        self.step += 1
        if self.counts_iterations:
            self.iter[0] += 1
        if self.training and self.optimizer == EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD:
            self.ema_inplace(int(self.iter[0]))
        out, lookup = self.lookup(
            indices,
            offsets,
            per_sample_weights,
            feature_requires_grad,
            batch_size_per_feature_per_rank,
            total_unique_indices,
            iteration=int(self.iter[0]),
            global_decay=self.decays_globally(int(self.iter[0]), self.training),
            **unsupported,
        )
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

    params = [
        inspect.Parameter("embedding_specs", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("feature_table_map", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
    ]
    params += [
        inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=f.default) for f in fields(TBEConfig)
    ]
    params.append(inspect.Parameter("seed", inspect.Parameter.KEYWORD_ONLY, default=None))
    return inspect.Signature(params)


SIGNATURE = _signature()
ArrayTBE.__signature__ = SIGNATURE
