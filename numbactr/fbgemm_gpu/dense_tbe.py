"""FBGEMM's DenseTableBatchedEmbeddingBagsCodegen on numbactr's engine: the table-batched nn.EmbeddingBag with
dense gradients (imports torch).

Where SplitTableBatchedEmbeddingBagsCodegen updates its tables inside loss.backward() with a fused optimizer,
the dense TBE is an ordinary module: its one parameter `weights` (every table's rows, table after table, rows
of D_t values: FBGEMM's flat layout, drawn from torch.randn at construction as FBGEMM does) gets a dense
gradient, and any torch optimizer trains it. The lookup and the gradient are the engine's (optimizer NONE,
rows unpadded so that the parameter *is* the engine's buffer: no copy per step); the engine's row gradients
are scattered into the dense gradient.

FBGEMM's arguments: embedding_specs [(rows, dim)], feature_table_map, weights_precision (FP32 | FP16),
pooling_mode (SUM | MEAN | NONE), use_cpu, output_dtype (FP32 | FP16 | BF16), use_mtia (not supported). As with the
split TBE, the module runs on numbactr's device: use_cpu=False without a GPU runs on the cpu device (said
once in the log).
"""

from __future__ import annotations

from itertools import accumulate
from math import log2

import torch
from torch import nn

from numbactr.runtime import device
from numbactr import log
from numbactr.embedding.engine import BoundsCheck, Optim, OptimizerSpec, Pooling, Precision, TableBatchedEmbedding
from numbactr.runtime.torch_bridge import as_array as _as_array
from numbactr.runtime.torch_bridge import as_tensor as _as_tensor
from numbactr.fbgemm_gpu.tbe_args import _enum, _vbe_layout
from numbactr.fbgemm_gpu.split_embedding_configs import SparseType
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

__all__ = ["DenseTableBatchedEmbeddingBagsCodegen"]

WHO = "DenseTableBatchedEmbeddingBagsCodegen"
_PRECISION = {SparseType.FP32: Precision.FP32, SparseType.FP16: Precision.FP16}


class _DenseLookup(torch.autograd.Function):
    """out = the engine's lookup; backward: the dense gradient of the flat weights (the engine's row
    gradients scattered table by table) and the per-sample weights' gradient."""

    @staticmethod
    def forward(ctx, module, indices, offsets, weights, per_sample_weights, feature_requires_grad, vbe):
        xp = device.xp()
        offsets = _as_array(offsets)
        if vbe is not None:  # every feature padded to vbe.batch bags (empty ones)
            offsets = offsets[xp.asarray(vbe.offset_src)]
        out, lookup = module.engine.forward(
            _as_array(indices),
            offsets,
            _as_array(per_sample_weights),
            feature_requires_grad=_as_array(feature_requires_grad),
        )
        if vbe is not None:  # FBGEMM's 1-D variable-batch output, rank-major
            out = out.reshape(-1)[xp.asarray(vbe.out_index)]
        ctx.module, ctx.lookup, ctx.vbe = module, lookup, vbe
        ctx.psw_dtype = None if per_sample_weights is None else per_sample_weights.dtype
        return _as_tensor(out)

    @staticmethod
    def backward(ctx, grad_output):
        module, vbe = ctx.module, ctx.vbe
        dy = _as_array(grad_output.contiguous())
        if vbe is not None:
            xp = device.xp()
            full = xp.zeros(vbe.batch * module.total_D, dy.dtype)
            full[xp.asarray(vbe.out_index)] = dy
            dy = full.reshape(vbe.batch, module.total_D)
        grads = module.engine.backward(ctx.lookup, dy)
        d_weights = d_psw = None
        if ctx.needs_input_grad[3]:
            d_weights = torch.zeros_like(module.weights)
            if grads.sparse is not None:
                for t, (rows, values) in enumerate(grads.sparse.per_table()):
                    if len(rows):
                        n_rows, dim = module.embedding_specs[t]
                        lo = module.weights_physical_offsets[t]
                        view = d_weights[lo : lo + n_rows * dim].view(n_rows, dim)
                        view[torch.as_tensor(rows, device=view.device)] = torch.as_tensor(
                            values[:, :dim], device=view.device
                        ).to(view.dtype)
        if ctx.needs_input_grad[4] and grads.per_sample_weights is not None:
            d_psw = _as_tensor(grads.per_sample_weights).to(ctx.psw_dtype)
        return None, None, None, d_weights, d_psw, None, None


class DenseTableBatchedEmbeddingBagsCodegen(nn.Module):
    """Table-batched nn.EmbeddingBag(sparse=False) (FBGEMM's name and arguments; see the module docstring)."""

    def __init__(
        self,
        embedding_specs,
        feature_table_map=None,
        weights_precision=SparseType.FP32,
        pooling_mode=PoolingMode.SUM,
        use_cpu: bool = False,
        output_dtype=SparseType.FP32,
        use_mtia: bool = False,
    ) -> None:
        super().__init__()
        if use_mtia:
            raise NotImplementedError(f"{WHO}: MTIA is not supported by numbactr")
        specs = [(int(r), int(d)) for r, d in embedding_specs]
        if not specs or any(r < 0 or d <= 0 for r, d in specs):
            raise ValueError(
                f"{WHO}: embedding_specs must be a non-empty list of (rows >= 0, dim > 0), got {embedding_specs!r}"
            )
        ftm = list(range(len(specs))) if feature_table_map is None else [int(t) for t in feature_table_map]
        if not ftm or any(not 0 <= t < len(specs) for t in ftm):
            raise ValueError(f"{WHO}: feature_table_map={feature_table_map!r} must name tables 0..{len(specs) - 1}")
        self.embedding_specs = specs
        self.feature_table_map = ftm
        self.pooling_mode = _enum(PoolingMode, pooling_mode, "pooling_mode")
        self.weights_precision = _enum(SparseType, weights_precision, "weights_precision")
        out_dtype = _enum(SparseType, output_dtype, "output_dtype")
        if self.weights_precision not in _PRECISION:
            raise NotImplementedError(
                f"{WHO}: weights_precision={self.weights_precision.name} is not implemented in numbactr (FP32 or FP16)"
            )
        if out_dtype not in _PRECISION and out_dtype != SparseType.BF16:
            raise NotImplementedError(
                f"{WHO}: output_dtype={out_dtype.name} is not implemented in numbactr (FP32, FP16 or BF16)"
            )
        # BF16 output: the engine pools in float32 and torch rounds the result (NumPy has no bfloat16)
        self._cast_to = torch.bfloat16 if out_dtype == SparseType.BF16 else None
        self.output_dtype = out_dtype.as_int()
        self.use_cpu, self.use_mtia = bool(use_cpu), False
        if device.kind() == "gpu":
            if use_cpu:
                raise ValueError(
                    f"{WHO}: use_cpu=True asked for, but numbactr runs on the gpu device in this "
                    "process; set NUMBACTR_DEVICE=cpu to run the TBE on the CPU"
                )
            self.current_device = torch.device("cuda")
        else:
            if not use_cpu:
                log.info_once(
                    "fbgemm-dense-cuda-on-cpu",
                    f"{WHO}: use_cpu=False runs on numbactr's {device.kind()} device ({device.describe()})",
                )
            self.current_device = torch.device("cpu")

        rows, dims = zip(*specs)
        feature_dims = [dims[t] for t in ftm]
        self.total_D = int(sum(feature_dims))
        self.max_D = int(max(dims))
        self.register_buffer(
            "D_offsets", torch.tensor([0, *accumulate(feature_dims)], dtype=torch.int32, device=self.current_device)
        )
        self.register_buffer("feature_dims", torch.tensor(feature_dims, dtype=torch.int64))
        cum_rows = [0, *accumulate(rows)]
        self.total_hash_size_bits = 0 if cum_rows[-1] == 0 else int(log2(float(cum_rows[-1])) + 1)
        self.register_buffer(
            "hash_size_cumsum",
            torch.tensor([cum_rows[t] for t in ftm] + [cum_rows[-1]], dtype=torch.int64, device=self.current_device),
        )
        self.weights_physical_offsets = [0, *accumulate(r * d for r, d in specs)]
        self.register_buffer(
            "weights_offsets",
            torch.tensor(
                [self.weights_physical_offsets[t] for t in ftm], dtype=torch.int64, device=self.current_device
            ),
        )

        # the engine's flat buffer, unpadded, is the parameter (shared memory: torch.from_numpy / DLPack)
        self.engine = TableBatchedEmbedding(
            specs,
            ftm,
            pooling=Pooling(int(self.pooling_mode)),
            optimizer=OptimizerSpec(Optim.NONE),
            weights_precision=_PRECISION[self.weights_precision],
            output_dtype=_PRECISION.get(out_dtype, Precision.FP32),
            bounds_check=BoundsCheck.WARNING,
            pad_rows=False,
        )
        assert int(self.engine.elem_offsets[-1]) == self.weights_physical_offsets[-1]
        self.weights = nn.Parameter(_as_tensor(self.engine.weights))
        with torch.no_grad():  # FBGEMM: torch.randn over the flat buffer
            self.weights.copy_(torch.randn(self.weights.shape[0], dtype=self.weights.dtype, device=self.current_device))

    def forward(
        self,
        indices,
        offsets,
        per_sample_weights=None,
        feature_requires_grad=None,
        batch_size_per_feature_per_rank=None,
    ):
        """(B, total_D) pooled embeddings ((N, D) for PoolingMode.NONE); `weights` gets a dense gradient.

        batch_size_per_feature_per_rank (variable batch sizes, F lists of per-rank counts): the offsets hold
        the bags feature-major, then rank, then sample, and the output is FBGEMM's 1-D VBE layout (for each
        rank, each feature's B_{f,r} pooled rows), as the split TBE and FBGEMM's GPU kernels give it (FBGEMM's
        CPU build ignores the argument)."""
        vbe = None
        if batch_size_per_feature_per_rank is not None:
            if self.pooling_mode == PoolingMode.NONE:
                raise ValueError(
                    f"{WHO}: batch_size_per_feature_per_rank (variable batch) needs pooling; "
                    "PoolingMode.NONE has one output row per index already"
                )
            vbe = _vbe_layout(batch_size_per_feature_per_rank, self.feature_dims.numpy(), int(offsets.shape[0]) - 1)
        self._rebind()
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.float()
        out = _DenseLookup.apply(self, indices, offsets, self.weights, per_sample_weights, feature_requires_grad, vbe)
        return out if self._cast_to is None else out.to(self._cast_to)

    def _rebind(self) -> None:
        """Point the engine at `weights` again if the parameter's storage was replaced (weights.data = ...)."""
        w = self.weights.detach()
        if w.data_ptr() != _as_tensor(self.engine.weights).data_ptr():
            if w.dim() != 1 or w.numel() != self.weights_physical_offsets[-1] or not w.is_contiguous():
                raise ValueError(
                    f"{WHO}: weights must stay a contiguous ({self.weights_physical_offsets[-1]},) "
                    f"tensor, got {tuple(w.shape)}"
                )
            self.engine.weights = _as_array(w)

    def split_embedding_weights(self) -> list:
        """[(rows_t, D_t) views of `weights`, one per table] (writes reach the tables)."""
        w = self.weights.detach()
        return [
            w[lo : lo + r * d].view(r, d) for (r, d), lo in zip(self.embedding_specs, self.weights_physical_offsets)
        ]

    def init_embedding_weights_uniform(self, min_val: float, max_val: float) -> None:
        for view in self.split_embedding_weights():
            view.uniform_(min_val, max_val)
