"""FBGEMM's SplitTableBatchedEmbeddingBagsCodegen as a torch.nn.Module on numbactr's engine (imports torch).

The module holds a TBECore (numbactr/fbgemm_gpu/array_tbe.py: FBGEMM's arguments mapped onto the engine)
and runs each lookup as a torch.autograd.Function whose backward is the engine's fused backward +
optimizer: the tables are updated in place during loss.backward() and no dense weight gradient exists,
as in FBGEMM (the module's one parameter, `placeholder_autograd_tensor`, is empty and gets no gradient;
with OptimType.NONE the weights are the parameter `weights_dev` of shape (sum V, D) and get a sparse COO
gradient). Tensors and the engine's arrays share memory: torch.from_numpy / .numpy() on the CPU,
DLPack with CuPy on a GPU (numbactr's gpu device), so split_embedding_weights() returns views that
write through to the engine, and nothing is copied per step.

state_dict() holds the engine's buffers under FBGEMM's names (weights_host / momentum1_host /
momentum2_host on the CPU, *_dev on a GPU) as flat arrays in the engine's layout: table after table,
rows padded to 16 bytes (FBGEMM's layout for FP32 tables, whose dims FBGEMM requires to be multiples of 4).
With MANAGED_CACHING tables the rows live in host memory behind the cache (numbactr.embedding.tiered):
weights_uvm / momentum*_uvm are those host arrays (table after table, rows of D_t values, unpadded) and
lxu_cache_weights the cache's slots; state_dict() flushes the cache first, and a load_state_dict() empties
it, so that saved and loaded tables are whole.
"""

from __future__ import annotations

import torch
from torch import nn

from numbactr.runtime import device
from numbactr.embedding.engine import state_specs
from numbactr.runtime.torch_bridge import as_array as _as_array
from numbactr.runtime.torch_bridge import as_tensor as _as_tensor
from numbactr.fbgemm_gpu.array_tbe import SIGNATURE, TBECore
from numbactr.fbgemm_gpu.tbe_args import WHO, FBGEMMAssertion, OptimizerArgs, prefetch_passes, table_name_for_logging
from numbactr.fbgemm_gpu.split_embedding_configs import EmbOptimType

__all__ = ["SplitTableBatchedEmbeddingBagsCodegen"]


class _Lookup(torch.autograd.Function):
    """out = the TBE lookup; backward = the engine's fused update (no gradient for the weights, except the
    sparse one of OptimType.NONE), and the gradient of the per-sample weights."""

    @staticmethod
    def forward(ctx, core, inputs, iteration, placeholder, weights, per_sample_weights):
        out, lookup = core.lookup(**inputs, per_sample_weights=_as_array(per_sample_weights), iteration=iteration)
        ctx.core, ctx.lookup = core, lookup
        ctx.psw_dtype = None if per_sample_weights is None else per_sample_weights.dtype
        return _as_tensor(out)

    @staticmethod
    def backward(ctx, grad_output):
        grads = ctx.core.update(ctx.lookup, _as_array(grad_output))
        d_psw = d_weights = None
        if ctx.needs_input_grad[5] and grads.per_sample_weights is not None:
            d_psw = _as_tensor(grads.per_sample_weights).to(ctx.psw_dtype)
        if ctx.needs_input_grad[4] and grads.sparse is not None:
            rows, values = _as_tensor(grads.sparse.rows), _as_tensor(grads.sparse.values)
            n_rows, dim = int(ctx.core.engine.row_offsets[-1]), ctx.core.max_D
            # the engine's rows are ascending and distinct: a coalesced tensor, no invariant check needed
            d_weights = torch.sparse_coo_tensor(
                rows.reshape(1, -1), values[:, :dim], (n_rows, dim), check_invariants=False, is_coalesced=True
            )
        return None, None, None, None, d_weights, d_psw


def _host_array(key: str, buf):
    """A preallocated host buffer as a NumPy view of the same memory (FBGEMM's checks follow in TBECore)."""
    if not isinstance(buf, torch.Tensor):
        return buf
    if buf.device.type != "cpu":
        raise FBGEMMAssertion(
            f"{WHO}: preallocated_host_buffer device mismatch for '{key}_host': expected cpu, got {buf.device}"
        )
    try:
        return buf.detach().numpy()
    except TypeError:  # a dtype NumPy lacks (bfloat16, ...)
        raise FBGEMMAssertion(
            f"{WHO}: preallocated_host_buffer dtype mismatch for '{key}_host': got {buf.dtype}"
        ) from None


def _state_buffer_names(opt) -> list:
    """FBGEMM's buffer prefixes of the engine's states: momentum1, momentum2, then prev_iter / row_counter."""
    names = [name for name, _, _ in state_specs(opt)]
    return [f"momentum{i + 1}" if name not in ("prev_iter", "row_counter") else name for i, name in enumerate(names)]


class SplitTableBatchedEmbeddingBagsCodegen(nn.Module):
    """FBGEMM's Table Batched Embedding (TBE) on numbactr's engine; FBGEMM's constructor arguments (see
    numbactr/fbgemm_gpu/array_tbe.py for what each does here and where numbactr differs).

    The numbactr-only keyword `seed` seeds stochastic rounding (default: torch.initial_seed(), so
    torch.manual_seed governs it as it governs FBGEMM's). Weights start at 0; init_embedding_weights_uniform
    draws them with torch's generator, in FBGEMM's order.
    """

    get_table_name_for_logging = staticmethod(table_name_for_logging)
    get_prefetch_passes = staticmethod(prefetch_passes)

    def __init__(self, embedding_specs, feature_table_map=None, *args, seed: int | None = None, **kwargs):
        super().__init__()
        if kwargs.get("preallocated_host_buffers"):
            kwargs["preallocated_host_buffers"] = {
                k: _host_array(k, v) for k, v in kwargs["preallocated_host_buffers"].items()
            }
        core = TBECore(
            embedding_specs,
            feature_table_map,
            *args,
            seed=torch.initial_seed() % 2**63 if seed is None else seed,
            **kwargs,
        )
        self._core = core
        for name in (
            "embedding_specs",
            "feature_table_map",
            "optimizer",
            "pooling_mode",
            "weights_precision",
            "output_dtype",
            "stochastic_rounding",
            "bounds_check_mode_int",
            "table_names",
            "dims",
            "mixed_D",
            "total_D",
            "max_D",
            "embedding_table_index_type",
            "embedding_table_offset_type",
        ):
            setattr(self, name, getattr(core, name))
        self.current_device = torch.device(core.current_device)
        self.is_nobag = not core.pooling_mode.do_pooling()
        self.placeholder_autograd_tensor = nn.Parameter(torch.zeros(0, device=self.current_device))
        self.register_buffer("D_offsets", torch.from_numpy(core.D_offsets).to(self.current_device), persistent=False)
        self.register_buffer(
            "iter", torch.zeros(1, dtype=torch.int64, device=self.current_device), persistent=core.counts_iterations
        )
        self.iter_cpu = 0  # FBGEMM's host copy of `iter`: no device read per step
        # FBGEMM's learning-rate tensor (float32, on the host): a value written into it is the next step's rate
        self.learning_rate_tensor = torch.tensor(
            core.get_learning_rate() if self.optimizer != EmbOptimType.NONE else 0.0, dtype=torch.float32
        )
        self.step = 0
        where = "dev" if self.current_device.type == "cuda" else "host"
        engine = core.engine
        if core.cached:
            self._register_cached_buffers(engine)
        elif self.optimizer == EmbOptimType.NONE:
            # all dims are equal (FBGEMM's rule for NONE), so every table has the same padded row stride
            flat = _as_tensor(engine.weights).view(-1, int(engine.strides[0]))[:, : self.max_D]
            self.weights_dev = nn.Parameter(flat)  # (sum V, D)
        else:
            self.register_buffer(f"weights_{where}", _as_tensor(engine.weights))
        if not core.cached:
            for name, state in zip(_state_buffer_names(engine.optimizer), engine.states):
                self.register_buffer(f"{name}_{where}", _as_tensor(state))
        self._register_layout(core, where)
        if self.optimizer != EmbOptimType.NONE:  # FBGEMM's max_counter: kept in COUNTER / COWCLIP mode
            counted = engine.optimizer.counter is not None
            self.register_buffer(
                "max_counter",
                _as_tensor(core.max_counter)
                if counted
                else torch.ones(1, dtype=torch.float32, device=self.current_device),
                persistent=counted,
            )

    def _register_layout(self, core, where: str) -> None:
        """FBGEMM's description of where each state lives, for weights and every optimizer state: the
        per-table lists {prefix}_physical_placements (PlacementType: 0 DEVICE, 2 MANAGED_CACHING, 3 HOST) and
        {prefix}_physical_offsets (each table's first element in its flat buffer), the per-feature buffers
        {prefix}_placements / {prefix}_offsets, and empty {prefix}_dev / _host / _uvm buffers for the places a
        state does not live in (non-persistent: the state_dict holds the real buffers only)."""
        engine = core.engine
        n_tables = len(core.embedding_specs)
        if core.cached:
            where, place = "uvm", 2
            store = engine.store
            elem, rows = store.elem_offsets, store.row_offsets
            specs = engine._specs
        else:
            if self.optimizer == EmbOptimType.NONE:  # its weights are the parameter weights_dev (FBGEMM: DEVICE)
                where = "dev"
            place = 0 if where == "dev" else 3
            elem, rows = engine.elem_offsets, engine.row_offsets
            specs = engine._state_specs()
        prefixes = [("weights", False)]
        if self.optimizer != EmbOptimType.NONE:
            prefixes += [(name, per_row) for name, (_, per_row, _) in zip(_state_buffer_names(engine.optimizer), specs)]
        ftm = list(core.feature_table_map)
        for prefix, per_row in prefixes:
            offsets = [int(x) for x in (rows if per_row else elem)[:n_tables]]
            setattr(self, f"{prefix}_physical_offsets", offsets)
            setattr(self, f"{prefix}_physical_placements", [place] * n_tables)
            self.register_buffer(
                f"{prefix}_offsets",
                torch.tensor([offsets[t] for t in ftm], dtype=torch.int64, device=self.current_device),
                persistent=False,
            )
            self.register_buffer(
                f"{prefix}_placements",
                torch.full((len(ftm),), place, dtype=torch.int32, device=self.current_device),
                persistent=False,
            )
            for other in ("dev", "host", "uvm"):
                if other != where and not hasattr(self, f"{prefix}_{other}"):
                    self.register_buffer(
                        f"{prefix}_{other}", torch.zeros(0, device=self.current_device), persistent=False
                    )

    def get_states(self, prefix: str) -> tuple:
        """FBGEMM's (dev, host, uvm, placements, offsets) of one state: weights, momentum1, momentum2,
        prev_iter or row_counter; DoesNotHavePrefix where the module keeps no such state."""
        from numbactr.fbgemm_gpu.optimizer_config import DoesNotHavePrefix

        if not hasattr(self, f"{prefix}_physical_placements"):
            raise DoesNotHavePrefix()
        return (
            getattr(self, f"{prefix}_dev"),
            getattr(self, f"{prefix}_host"),
            getattr(self, f"{prefix}_uvm"),
            torch.tensor(getattr(self, f"{prefix}_physical_placements"), dtype=torch.int32),
            torch.tensor(getattr(self, f"{prefix}_physical_offsets"), dtype=torch.int64),
        )

    def get_all_states(self) -> list:
        """get_states of weights, momentum1, momentum2, prev_iter and row_counter, those the module has."""
        return [
            self.get_states(p)
            for p in ("weights", "momentum1", "momentum2", "prev_iter", "row_counter")
            if hasattr(self, f"{p}_physical_placements")
        ]

    def _register_cached_buffers(self, tier) -> None:
        """FBGEMM's names for a cached TBE: the host rows (weights_uvm, momentum*_uvm) and the cache."""
        flat = tier.store.flat  # weights, the optimizer states, the LFU counts
        self.register_buffer("weights_uvm", _as_tensor(flat[0]))
        for name, state in zip(_state_buffer_names(tier.optimizer), flat[1:-1]):
            self.register_buffer(f"{name}_uvm", _as_tensor(state))
        self.register_buffer("lxu_cache_weights", _as_tensor(tier.engine.weights), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, keys: tier.invalidate(write_back=False))

    def state_dict(self, *args, **kwargs):
        """The module's state (FBGEMM's buffer names); a cache is flushed first, so the rows are whole."""
        self.flush()
        return super().state_dict(*args, **kwargs)

    @property
    def engine(self):
        """numbactr's TableBatchedEmbedding under this module."""
        return self._core.engine

    def forward(
        self,
        indices,
        offsets,
        per_sample_weights=None,
        feature_requires_grad=None,
        batch_size_per_feature_per_rank=None,
        total_unique_indices=None,
        hash_zch_identities=None,
        hash_zch_runtime_meta=None,
        vbe_output=None,
        vbe_output_offsets=None,
    ):
        """(B, total_D) pooled embeddings ((N, D) for PoolingMode.NONE, 1-D for variable batch sizes).

        indices (N,) and offsets (F*B + 1,) int32/int64 on this module's device; per_sample_weights (N,);
        feature_requires_grad (F,). loss.backward() updates the tables with the fused optimizer.
        """
        for name, t in (("indices", indices), ("offsets", offsets), ("per_sample_weights", per_sample_weights)):
            if isinstance(t, torch.Tensor) and t.device.type != self.current_device.type:
                raise ValueError(
                    f"{WHO}.forward: {name} is on {t.device}, this module runs on "
                    f"{self.current_device} (numbactr's {device.kind()} device)"
                )
        self.step += 1
        if self.optimizer != EmbOptimType.NONE:
            lr = float(self.learning_rate_tensor)
            if lr != self._core.get_learning_rate():  # written into the tensor, as FBGEMM allows
                self._core.set_learning_rate(lr)
        if self._core.counts_iterations:
            if self.iter_cpu == 0:  # FBGEMM's rule: pick up a loaded or set `iter`
                self.iter_cpu = int(self.iter.item())
            self.iter_cpu += 1
            self.iter.add_(1)
        if self.training and self.optimizer == EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD:
            self.ema_inplace(self._core.emainplace_mode)
        inputs = dict(
            indices=_as_array(indices),
            offsets=_as_array(offsets),
            feature_requires_grad=_as_array(feature_requires_grad),
            batch_size_per_feature_per_rank=batch_size_per_feature_per_rank,
            total_unique_indices=total_unique_indices,
            global_decay=self._core.decays_globally(self.iter_cpu, self.training),
        )
        # hash_zch_identities / hash_zch_runtime_meta: FBGEMM keeps them only for raw embedding streaming (which
        # numbactr does not offer: the constructor rejects it); they never change the lookup, so they are ignored.
        unsupported = dict(vbe_output=vbe_output, vbe_output_offsets=vbe_output_offsets)
        given = sorted(k for k, v in unsupported.items() if v is not None)
        if given:
            raise NotImplementedError(f"{WHO}.forward: {', '.join(given)} not implemented in numbactr")
        weights = self.weights_dev if self.optimizer == EmbOptimType.NONE else None
        return _Lookup.apply(
            self._core, inputs, self.iter_cpu, self.placeholder_autograd_tensor, weights, per_sample_weights
        )

    # ---- FBGEMM's methods ---------------------------------------------------------------------------------
    def split_embedding_weights(self) -> list:
        """[(V_t, D_t) tensor views of the weights, one per table]."""
        return [_as_tensor(w) for w in self._core.split_embedding_weights()]

    def split_optimizer_states(self) -> list:
        """Per table, [momentum1 (, momentum2)] tensor views in FBGEMM's order ([] for EXACT_SGD)."""
        return [[_as_tensor(s) for s in states] for states in self._core.split_optimizer_states()]

    def get_optimizer_state(self) -> list:
        """Per table, {name: state view} with PyTorch's names (sum; exp_avg, exp_avg_sq)."""
        names = self._core.optimizer_state_names()
        extra = {"iter": self.iter} if self._core.state_wants_iter else {}
        return [dict(zip(names, states), **extra) for states in self.split_optimizer_states()]

    def init_embedding_weights_uniform(self, min_val: float, max_val: float) -> None:
        """Every table's weights U(min_val, max_val) from torch's generator, table by table (FBGEMM's way);
        INT8 tables: those values, each row quantized (FBGEMM's FloatToFused8BitRowwiseQuantized)."""
        from numbactr.kernels.fused8bit import QPARAM_BYTES, quantize_rows_ref

        with torch.no_grad():
            for w in self.split_embedding_weights():
                if w.dtype == torch.uint8:
                    vals = torch.empty(w.shape[0], w.shape[1] - QPARAM_BYTES).uniform_(min_val, max_val)
                    w.copy_(torch.from_numpy(quantize_rows_ref(vals.numpy())).to(w.device))
                else:
                    w.uniform_(min_val, max_val)

    def ema_inplace(self, emainplace_mode: dict) -> None:
        """FBGEMM's EMA step of EMAINPLACE_ROWWISE_ADAGRAD at this iteration: every step_ema iterations from
        step_start on, each row's second half moves step_ema_coef of the way to its first half."""
        with torch.no_grad():
            self._core.ema_inplace(self.iter_cpu, emainplace_mode)

    def set_learning_rate(self, lr: float) -> None:
        self._core.set_learning_rate(lr)
        self.learning_rate_tensor.fill_(float(lr))

    def get_learning_rate(self) -> float:
        return self._core.get_learning_rate()

    @property
    def optimizer_args(self) -> OptimizerArgs:
        """FBGEMM's OptimizerArgs of this module (its fields; the values numbactr trains with)."""
        return self._core.optimizer_args()

    def get_optimizer_buffer(self, state: str) -> torch.Tensor:
        """The buffer named ``state`` (FBGEMM's names: momentum1_host, momentum2_dev, ...)."""
        if self.optimizer == EmbOptimType.NONE:
            raise NotImplementedError(f"Getting optimizer buffer is not supported for {self.optimizer}")
        for name, buffer in self.named_buffers():
            if name == state:
                return buffer
        raise ValueError(f"Optimizer buffer {state} not found")

    def reset_cache_states(self) -> None:
        """Empty the cache of MANAGED_CACHING tables (after writing its updated rows back)."""
        self._core.reset_cache_states()

    def update_hyper_parameters(self, params_dict: dict) -> None:
        """FBGEMM's names: lr, eps, beta1, beta2, weight_decay, lower_bound (global weight decay's floor)."""
        self._core.update_hyper_parameters(params_dict)
        if "lr" in params_dict:
            self.learning_rate_tensor.fill_(float(params_dict["lr"]))

    def set_optimizer_step(self, step: int) -> None:
        """The next forward counts iteration step + 1."""
        self._core._need_optimizer("Setting optimizer step")
        self.iter.fill_(int(step))
        self.iter_cpu = int(step)

    def prefetch(self, indices, offsets, forward_stream=None, batch_size_per_feature_per_rank=None) -> None:
        """Stage the rows of the next forward in the cache (MANAGED_CACHING tables; nothing otherwise)."""
        self._core.prefetch(_as_array(indices), _as_array(offsets), forward_stream, batch_size_per_feature_per_rank)

    def flush(self) -> None:
        """Write every updated cached row back to host memory."""
        self._core.flush()

    def get_cache_miss_counter(self) -> torch.Tensor:
        """(4,) forwards with a miss, unique misses, unique rows asked for, rows asked for."""
        return torch.from_numpy(self._core.get_cache_miss_counter())

    def reset_cache_miss_counter(self) -> None:
        self._core.reset_cache_miss_counter()

    def get_table_wise_cache_miss(self) -> torch.Tensor:
        """(T,) unique misses per table."""
        return torch.from_numpy(self._core.get_table_wise_cache_miss())

    def get_uvm_cache_stats(self) -> torch.Tensor:
        """(6,) N_called, N_requested_indices, N_unique_indices, N_unique_misses, 0, 0."""
        return torch.from_numpy(self._core.get_uvm_cache_stats())

    def reset_uvm_cache_stats(self) -> None:
        self._core.reset_uvm_cache_stats()

    def print_uvm_cache_stats(self) -> None:
        self._core.print_uvm_cache_stats()


SplitTableBatchedEmbeddingBagsCodegen.__signature__ = SIGNATURE
