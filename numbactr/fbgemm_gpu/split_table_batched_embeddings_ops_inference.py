"""FBGEMM's inference TBE, IntNBitTableBatchedEmbeddingBagsCodegen, on numbactr's engine (imports torch):

    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
 -> from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

Each table has its own row type: FP32, FP16, FP8 (FBGEMM's HFP8, fp8_exponent_bits / _bias), INT8, INT4 or INT2 (kernels/nbit_rows.py has the byte layouts:
float16 scale and bias at the start of an integer row, or at its end with reverse_qparam; INT4/INT2 packed
low bits first; rows padded to row_alignment bytes, 1 on the CPU and 16 on a GPU by default; each table's
bytes start on a 128-byte line with cacheline_alignment). The bytes are the engine's weights buffer
(Precision.INT8 with one row codec per table) and `weights_host` / `weights_dev` is that buffer, so
`split_embedding_weights()` views write straight into the tables. A lookup decodes the rows it touches to
float32 and pools them (SUM, MEAN, or NONE for sequence embeddings; per-sample weights) on the device's
forward; the output is FP16 (FBGEMM's default), FP32 or BF16. INT8 output of pooled embeddings is each
feature's block quantized to FBGEMM's fused 8-bit rows (D_f + 8 bytes, as FBGEMM's GPU kernels; its CPU
kernel leaves those bytes unset); INT8 or INT4 output with PoolingMode.NONE is each row's stored bytes
(tables of that type only), uint8 or torch.quint4x2 as FBGEMM's. There is no backward: this is FBGEMM's
inference module.

As in FBGEMM, the weights are allocated by initialize_weights() (or fill_random_weights(), or weight_lists at
construction) and a forward before that is an error; fill_random_weights() fills each table's weight bytes
(not the scale and bias) with random bytes, as FBGEMM does. assign_embedding_weights() copies
(weights, scale_shift) pairs in.

Pruning (index_remapping, set_index_remappings): each table's original indices are checked against its
original rows (bounds_check_mode), then mapped to rows; a pruned index (-1) reads nothing. FBGEMM's hash-map
remapping (use_array_for_index_remapping=False) maps the same and is kept as an array here.

embedding_inplace_update (per-table row lists) and embedding_inplace_update_internal (FBGEMM's flat form,
through the pruning map) overwrite stored rows for a serving model's updates.

Not implemented (each a clear error): NFP8 rows, the UVM cache (MANAGED_CACHING), pooled INT4 output.
The table locations follow the training face's rule: the module runs on numbactr's device (DEVICE/MANAGED
tables without a GPU run on the cpu device, said once in the log).
"""

from __future__ import annotations

import warnings
from itertools import accumulate

import numpy as np
import torch
from torch import nn

from numbactr.runtime import device
from numbactr import log
from numbactr.embedding.engine import (
    BoundsCheck,
    EmbeddingBoundsError,
    Layout,
    Optim,
    OptimizerSpec,
    Pooling,
    Precision,
    TableBatchedEmbedding,
)
from numbactr.kernels import tbe
from numbactr.kernels import fused8bit
from numbactr.kernels import nbit_rows
from numbactr.runtime.torch_bridge import as_array as _as_array
from numbactr.runtime.torch_bridge import as_tensor as _as_tensor
from numbactr.fbgemm_gpu.tbe_args import _enum
from numbactr.fbgemm_gpu.split_embedding_configs import SparseType
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    BoundsCheckMode,
    CacheAlgorithm,
    EmbeddingLocation,
    PoolingMode,
)

__all__ = [
    "IntNBitTableBatchedEmbeddingBagsCodegen",
    "rounded_row_size_in_bytes",
    "unpadded_row_size_in_bytes",
    "align_to_cacheline",
]

WHO = "IntNBitTableBatchedEmbeddingBagsCodegen"
DEFAULT_SCALE_BIAS_SIZE_IN_BYTES = nbit_rows.SCALE_BIAS_BYTES
_TYPES = {
    SparseType.FP32: "fp32",
    SparseType.FP16: "fp16",
    SparseType.FP8: "fp8",
    SparseType.INT8: "int8",
    SparseType.INT4: "int4",
    SparseType.INT2: "int2",
}
_OUTPUTS = {SparseType.FP32: torch.float32, SparseType.FP16: torch.float16, SparseType.BF16: torch.bfloat16}


def unpadded_row_size_in_bytes(
    dim: int, weight_ty: SparseType, scale_bias_size_in_bytes: int = DEFAULT_SCALE_BIAS_SIZE_IN_BYTES
) -> int:
    return nbit_rows.unpadded_row_bytes(dim, _type(weight_ty, "weight_ty"), scale_bias_size_in_bytes)


def rounded_row_size_in_bytes(
    dim: int,
    weight_ty: SparseType,
    row_alignment: int,
    scale_bias_size_in_bytes: int = DEFAULT_SCALE_BIAS_SIZE_IN_BYTES,
) -> int:
    return nbit_rows.row_bytes(dim, _type(weight_ty, "weight_ty"), row_alignment, scale_bias_size_in_bytes)


def align_to_cacheline(a: int) -> int:
    return -(-int(a) // 128) * 128


def _type(ty, what: str) -> str:
    ty = _enum(SparseType, ty, what)
    if ty not in _TYPES:
        raise NotImplementedError(
            f"{WHO}: {what}={ty.name} is not implemented in numbactr (FP32, FP16, FP8, INT8, INT4, INT2)"
        )
    return _TYPES[ty]


class IntNBitTableBatchedEmbeddingBagsCodegen(nn.Module):
    """FBGEMM's inference TBE (module docstring); FBGEMM's constructor arguments."""

    def __init__(
        self,
        embedding_specs,
        feature_table_map=None,
        index_remapping=None,
        pooling_mode=PoolingMode.SUM,
        device=None,
        bounds_check_mode=BoundsCheckMode.WARNING,
        weight_lists=None,
        pruning_hash_load_factor: float = 0.5,
        use_array_for_index_remapping: bool = True,
        output_dtype=SparseType.FP16,
        cache_algorithm=CacheAlgorithm.LRU,
        cache_load_factor: float = 0.2,
        cache_sets: int = 0,
        cache_reserved_memory: float = 0.0,
        enforce_hbm: bool = False,
        record_cache_metrics=None,
        gather_uvm_cache_stats=False,
        row_alignment=None,
        fp8_exponent_bits=None,
        fp8_exponent_bias=None,
        cache_assoc: int = 32,
        scale_bias_size_in_bytes: int = DEFAULT_SCALE_BIAS_SIZE_IN_BYTES,
        cacheline_alignment: bool = True,
        uvm_host_mapped: bool = False,
        reverse_qparam: bool = False,
        feature_names_per_table=None,
        indices_dtype=torch.int32,
    ):
        super().__init__()
        specs = list(embedding_specs or [])
        if not specs:
            raise ValueError(
                f"{WHO}: embedding_specs is empty; give at least one (name, rows, dim, SparseType, "
                "EmbeddingLocation) table"
            )
        names, rows, dims, tys, locations = [], [], [], [], []
        for t, spec in enumerate(specs):
            if len(spec) != 5:
                raise ValueError(
                    f"{WHO}: embedding_specs[{t}] = {spec!r}: expected (feature name, rows, dim, "
                    "SparseType, EmbeddingLocation)"
                )
            name, r, d, ty, loc = spec
            if not (isinstance(r, (int, np.integer)) and isinstance(d, (int, np.integer))) or r < 0 or d < 1:
                raise ValueError(
                    f"{WHO}: embedding_specs[{t}]: rows must be an integer >= 0 and dim an integer >= 1, "
                    f"got rows={r!r}, dim={d!r}"
                )
            names.append(name)
            rows.append(int(r))
            dims.append(int(d))
            tys.append(_enum(SparseType, ty, f"embedding_specs[{t}] weights type"))
            locations.append(_enum(EmbeddingLocation, loc, f"embedding_specs[{t}] location"))
        self._refuse(locations, output_dtype, tys, pooling_mode)
        self.embedding_specs = specs
        self.feature_names = names
        self.pooling_mode = _enum(PoolingMode, pooling_mode, "pooling_mode")
        self.output_dtype = _enum(SparseType, output_dtype, "output_dtype").as_int()
        self._out_type = SparseType.from_int(self.output_dtype)
        self.scale_bias_size_in_bytes = int(scale_bias_size_in_bytes)
        if self.scale_bias_size_in_bytes != DEFAULT_SCALE_BIAS_SIZE_IN_BYTES:
            raise NotImplementedError(
                f"{WHO}: scale_bias_size_in_bytes={scale_bias_size_in_bytes}: numbactr reads "
                "float16 scale and bias (4 bytes)"
            )
        self.reverse_qparam = bool(reverse_qparam)
        self.bounds_check_mode_int = _enum(BoundsCheckMode, bounds_check_mode, "bounds_check_mode").value
        self.current_device = torch.device("cuda" if device_kind() == "gpu" else "cpu")
        if any(loc != EmbeddingLocation.HOST for loc in locations) and self.current_device.type == "cpu":
            log.info_once(
                "fbgemm-nbit-on-cpu", f"{WHO}: tables placed on a GPU run on numbactr's {device_kind()} device"
            )
        self.use_cpu = self.current_device.type == "cpu"
        self.row_alignment = int(row_alignment) if row_alignment is not None else (1 if self.use_cpu else 16)
        ftm = list(range(len(specs))) if feature_table_map is None else [int(t) for t in feature_table_map]
        bad = [t for t in ftm if not 0 <= t < len(specs)]
        if bad or not ftm:
            raise ValueError(f"{WHO}: feature_table_map {ftm} must name tables 0..{len(specs) - 1}")
        if set(ftm) != set(range(len(specs))):
            raise ValueError(f"{WHO}: each table must have at least one feature (feature_table_map {ftm})")
        if len({dims[t] for t in ftm}) > 1 and self.pooling_mode == PoolingMode.NONE:
            raise ValueError(f"{WHO}: mixed dimension tables are only supported for pooling tables")
        self.feature_table_map = ftm
        self.weights_tys_list = tys
        self.fp8_exponent_bits = 4 if fp8_exponent_bits is None else int(fp8_exponent_bits)  # FBGEMM's FP8
        self.fp8_exponent_bias = 7 if fp8_exponent_bias is None else int(fp8_exponent_bias)  # default_config
        codecs = []
        for t, (d, ty) in enumerate(zip(dims, tys)):
            try:
                codecs.append(
                    nbit_rows.nbit_codec(
                        d,
                        _TYPES[ty],
                        self.row_alignment,
                        self.reverse_qparam,
                        self.scale_bias_size_in_bytes,
                        self.fp8_exponent_bits,
                        self.fp8_exponent_bias,
                    )
                )
            except ValueError as e:
                raise ValueError(f"{WHO}: embedding_specs[{t}]: {e}") from None
        self.D_offsets = list(accumulate([0] + [dims[t] for t in ftm]))
        self.total_D = self.D_offsets[-1]
        self.engine = TableBatchedEmbedding(
            list(zip(rows, dims)),
            ftm,
            pooling=Pooling(int(self.pooling_mode)),
            optimizer=OptimizerSpec(Optim.NONE),
            weights_precision=Precision.INT8,
            output_dtype=Precision.FP32,
            bounds_check=BoundsCheck(self.bounds_check_mode_int),
            row_codecs=codecs,
            table_align=128 if cacheline_alignment else 1,
        )
        self.weights_offsets = [int(o) for o in self.engine.elem_offsets[:-1]]
        self.weight_initialized = False
        where = "host" if self.use_cpu else "dev"
        self._where = where
        for name in ("weights_dev", "weights_host", "weights_uvm"):
            setattr(self, name, torch.zeros(0, dtype=torch.uint8, device=self.current_device))
        self.rows = rows
        self._remap = None  # pruning: per table, original index -> row (-1 pruned) or None
        self.original_rows_per_table = [rows[t] for t in ftm]
        if weight_lists:
            self.initialize_weights()
            self.assign_embedding_weights(weight_lists)
        if index_remapping:
            self.set_index_remappings(index_remapping, pruning_hash_load_factor, use_array_for_index_remapping)

    @staticmethod
    def _refuse(locations, output_dtype, tys, pooling_mode) -> None:
        if EmbeddingLocation.MANAGED_CACHING in locations:
            raise NotImplementedError(
                f"{WHO}: the UVM cache (EmbeddingLocation.MANAGED_CACHING) is not implemented "
                "in numbactr's inference TBE"
            )
        for t, ty in enumerate(tys):
            _type(ty, f"embedding_specs[{t}] weights type")
        out = _enum(SparseType, output_dtype, "output_dtype")
        pooled = _enum(PoolingMode, pooling_mode, "pooling_mode") != PoolingMode.NONE
        if out in (SparseType.INT8, SparseType.INT4) and not pooled:
            # FBGEMM: each row's stored bytes, which needs the tables to hold rows of that type
            if any(ty != out for ty in tys):
                raise ValueError(
                    f"{WHO}: output_dtype={out.name} with PoolingMode.NONE returns the stored rows, "
                    f"so every table's weights must be {out.name} too (FBGEMM: int8 output are only "
                    "supported for int8 weights)"
                )
        elif out == SparseType.INT4:
            raise NotImplementedError(
                f"{WHO}: output_dtype=INT4 is implemented for PoolingMode.NONE (each row's "
                "stored bytes); pooled INT4 output is not"
            )
        elif out not in _OUTPUTS and out != SparseType.INT8:
            raise NotImplementedError(
                f"{WHO}: output_dtype={out.name} is not implemented in numbactr (FP32, FP16, "
                "BF16, INT8, and INT4 with PoolingMode.NONE)"
            )

    # ---- weights ---------------------------------------------------------------------------------------
    def initialize_weights(self) -> None:
        """Allocate the tables (zeros), once (FBGEMM's lazy allocation)."""
        if not self.weight_initialized:
            buf = _as_tensor(self.engine.weights)
            setattr(self, f"weights_{self._where}", buf)
            self.weight_initialized = True

    def _need_weights(self, what: str) -> None:
        if not self.weight_initialized:
            raise RuntimeError(
                f"{WHO}: {what} needs the weights: call initialize_weights(), fill_random_weights() "
                "or assign_embedding_weights() first (weight needs to be initialized)"
            )

    def split_embedding_weights_with_scale_bias(self, split_scale_bias_mode: int = 1) -> list:
        """Per table (weights, scale_bias, None) (mode 1), (weights, scale, bias) as float16 views (mode 2),
        or (row bytes with padding, None, None) (mode 0): uint8 views into the tables (FBGEMM's)."""
        self._need_weights("split_embedding_weights")
        out = []
        sb = self.scale_bias_size_in_bytes
        for t, view in enumerate(self.engine.split_weights()):
            rows = _as_tensor(view)
            if split_scale_bias_mode == 0:
                out.append((rows, None, None))
                continue
            if split_scale_bias_mode not in (1, 2):
                raise ValueError(f"{WHO}: split_scale_bias_mode {split_scale_bias_mode} is not 0, 1 or 2")
            _, _, dim, ty, _ = self.embedding_specs[t]
            rows = rows[:, : unpadded_row_size_in_bytes(dim, self.weights_tys_list[t], sb)]
            if _TYPES[self.weights_tys_list[t]] not in nbit_rows.QUANTIZED:
                out.append((rows, None, None))
                continue
            w, qp = (rows[:, :-sb], rows[:, -sb:]) if self.reverse_qparam else (rows[:, sb:], rows[:, :sb])
            if split_scale_bias_mode == 1:
                out.append((w, qp, None))
            else:
                out.append((w, qp[:, : sb // 2].view(torch.float16), qp[:, sb // 2 :].view(torch.float16)))
        return out

    def split_embedding_weights(self, split_scale_shifts: bool = True) -> list:
        """Per table (weights, scale_shift or None) uint8 views (split_scale_shifts=False: (row bytes, None))."""
        return [(w, s) for w, s, _ in self.split_embedding_weights_with_scale_bias(1 if split_scale_shifts else 0)]

    def fill_random_weights(self) -> None:
        """Each table's weight bytes (not the scale and bias) filled with random bytes 0..254 from torch's
        generator, as FBGEMM's fill_random_weights."""
        self.initialize_weights()
        for w, _ in self.split_embedding_weights():
            step = max(1, (1 << 24) // max(w.shape[1], 1))  # row chunks: no table-sized temporary
            for lo in range(0, w.shape[0], step):
                part = w[lo : lo + step]
                part.copy_(torch.randint(0, 255, tuple(part.shape), dtype=torch.uint8))

    def assign_embedding_weights(self, q_weight_list) -> None:
        """Copy [(weights, scale_shift or None)] (one per table) into split_embedding_weights()."""
        self.initialize_weights()
        dest = self.split_embedding_weights()
        if len(q_weight_list) != len(dest):
            raise ValueError(
                f"{WHO}: assign_embedding_weights needs {len(dest)} (weights, scale_shift) pairs, got "
                f"{len(q_weight_list)}"
            )
        for t, ((w, s), (src_w, src_s)) in enumerate(zip(dest, q_weight_list)):
            if tuple(src_w.shape) != tuple(w.shape):
                raise ValueError(
                    f"{WHO}: table {t}'s weights must have shape {tuple(w.shape)}, got {tuple(src_w.shape)}"
                )
            w.copy_(src_w)
            if (src_s is None) != (s is None):
                raise ValueError(
                    f"{WHO}: table {t} ({self.weights_tys_list[t].name}) "
                    + ("has a scale_shift; give one" if s is not None else "has no scale_shift")
                )
            if s is not None:
                s.copy_(src_s)

    # ---- forward ---------------------------------------------------------------------------------------
    def forward(self, indices, offsets, per_sample_weights=None):
        """(B, total_D) pooled embeddings ((N, D) for PoolingMode.NONE) in output_dtype."""
        self._need_weights("forward")
        if indices.dtype not in (torch.int32, torch.int64) or offsets.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"{WHO}: indices and offsets must be int32 or int64, got {indices.dtype} and {offsets.dtype}"
            )
        if per_sample_weights is not None and self.pooling_mode == PoolingMode.NONE:
            # FBGEMM's inference lookup returns the rows unweighted for sequence embeddings
            warnings.warn(
                f"{WHO}: per_sample_weights are not applied with PoolingMode.NONE (as in FBGEMM's "
                "inference TBE): the rows come back unweighted",
                RuntimeWarning,
                stacklevel=2,
            )
            per_sample_weights = None
        psw = None if per_sample_weights is None else _as_array(per_sample_weights.float().contiguous())
        idx, off = _as_array(indices.contiguous()), _as_array(offsets.contiguous())
        if self._remap is not None:
            idx, off = self._pruned(idx, off)
        ty = self._out_type
        if ty in (SparseType.INT8, SparseType.INT4) and self.pooling_mode == PoolingMode.NONE:
            return self._stored_rows(idx, off, ty)
        with torch.no_grad():
            out, _ = self.engine.forward(idx, off, psw, training=False)
        if ty == SparseType.INT8:  # pooled: each feature's block quantized
            xp = device.xp()
            d = self.D_offsets
            out = xp.concatenate(
                [fused8bit.quantize_rows(out[:, d[f] : d[f + 1]], xp) for f in range(len(d) - 1)], axis=1
            )
            return _as_tensor(out)
        return _as_tensor(out).to(_OUTPUTS[ty])

    def _stored_rows(self, idx, off, ty):
        """INT8 / INT4 output of sequence embeddings: each occurrence's stored row bytes (scale and bias, then
        the values; no row padding), FBGEMM's layout: uint8 (N, row bytes) for INT8, quint4x2 (N, 2 * row
        bytes) for INT4."""
        _, _, dim, _, _ = self.embedding_specs[0]
        width = unpadded_row_size_in_bytes(dim, ty, self.scale_bias_size_in_bytes)
        rows = _as_tensor(self.engine.forward_bytes(idx, off, width))
        if ty == SparseType.INT8:
            return rows
        packed = torch._empty_affine_quantized(
            (rows.shape[0], 2 * width), scale=1.0, zero_point=0, dtype=torch.quint4x2, device=rows.device
        )
        if rows.numel():
            packed.untyped_storage().copy_(rows.contiguous().untyped_storage())
        return packed

    def _pruned(self, idx, off):
        """FBGEMM's pruning: the indices checked against the tables' original rows (bounds_check_mode), then
        mapped to their rows; a pruned index becomes -1, which reads nothing."""
        xp = device.xp()
        F = len(self.feature_table_map)
        n = idx.shape[0]
        if off.ndim != 1 or (off.shape[0] - 1) % F:
            raise ValueError(f"{WHO}: offsets has {off.shape[0]} entries; it needs F*B + 1 with F = {F} features")
        batch = (off.shape[0] - 1) // F
        off_h = np.asarray(device.to_host(off)).astype(np.int64)
        fixed, _ = tbe.check_offsets_ref(off_h, n, BoundsCheck.IGNORE)
        mode = BoundsCheck(self.bounds_check_mode_int)
        rows, bad, first = tbe.check_indices_ref(
            device.to_host(idx),
            fixed,
            np.asarray(self.original_rows_per_table),
            batch,
            int(Layout.FEATURE_MAJOR),
            BoundsCheck.IGNORE if mode == BoundsCheck.FATAL else mode,
        )
        if bad:
            if mode == BoundsCheck.FATAL:
                raise EmbeddingBoundsError(tbe.bounds_message(first, bad, mode) + " (before pruning)")
            if mode == BoundsCheck.WARNING:
                warnings.warn(
                    f"{WHO}: " + tbe.bounds_message(first, bad, mode) + " (before pruning)",
                    RuntimeWarning,
                    stacklevel=3,
                )
        for f, t in enumerate(self.feature_table_map):
            remap = self._remap[t]
            if remap is None:
                continue
            lo, hi = fixed[f * batch], fixed[(f + 1) * batch]
            part = rows[lo:hi]
            ok = part >= 0
            part[ok] = remap[part[ok]]
        return xp.asarray(rows), xp.asarray(fixed)

    def set_index_remappings(
        self, index_remapping, pruning_hash_load_factor: float = 0.5, use_array_for_index_remapping: bool = True
    ) -> None:
        """Pruning: index_remapping[t] (original rows,) maps table t's original indices to its rows (-1: the
        row was pruned), or None for a table without pruning. FBGEMM keeps the map as an array or, with
        use_array_for_index_remapping=False, a hash map (pruning_hash_load_factor); both map the same, and
        numbactr keeps an array for either."""
        maps = list(index_remapping)
        if len(maps) != len(self.rows):
            raise ValueError(
                f"{WHO}: index_remapping needs one entry (a tensor or None) per table ({len(self.rows)}), "
                f"got {len(maps)}"
            )
        out, original = [], []
        for t, m in enumerate(maps):
            if m is None:
                out.append(None)
                original.append(self.rows[t])
                continue
            a = np.asarray(
                _as_array(m.detach().cpu() if isinstance(m, torch.Tensor) else torch.as_tensor(m)), np.int64
            ).reshape(-1)
            bad = (a < -1) | (a >= self.rows[t])
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(
                    f"{WHO}: index_remapping[{t}][{i}] = {int(a[i])}: a table of {self.rows[t]} rows maps "
                    "an index to a row in [0, rows) or to -1 (pruned)"
                )
            out.append(a)
            original.append(a.shape[0])
        self._remap = out if any(m is not None for m in out) else None
        self.original_rows_per_table = [original[t] for t in self.feature_table_map]

    def set_index_remappings_array(self, index_remapping) -> None:
        self.set_index_remappings(index_remapping, use_array_for_index_remapping=True)

    # ---- FBGEMM's other methods ------------------------------------------------------------------------
    def embedding_inplace_update(self, update_table_indices, update_row_indices, update_weights) -> None:
        """Overwrite stored rows (a serving model's update): for each i, table update_table_indices[i]'s rows
        update_row_indices[i] (rows of the table, not pruned indices) get update_weights[i], uint8
        (len(rows), padded row bytes) in the table's own byte format (split_embedding_weights(False)). All
        updates are checked before any row changes."""
        if not (len(update_table_indices) == len(update_row_indices) == len(update_weights)):
            raise ValueError(
                f"{WHO}: embedding_inplace_update needs one row list and one weights tensor per table "
                f"index, got {len(update_table_indices)}, {len(update_row_indices)} and "
                f"{len(update_weights)}"
            )
        self._need_weights("embedding_inplace_update")
        views = self.split_embedding_weights(split_scale_shifts=False)
        todo = []
        for i, (t, rows, w) in enumerate(zip(update_table_indices, update_row_indices, update_weights)):
            t = self._table_index(t, f"update_table_indices[{i}]")
            rows = self._update_rows(rows, t, f"update_row_indices[{i}]")
            dest = views[t][0]
            if (
                not isinstance(w, torch.Tensor)
                or w.dtype != torch.uint8
                or tuple(w.shape) != (len(rows), dest.shape[1])
            ):
                raise ValueError(
                    f"{WHO}: update_weights[{i}] must be uint8 of shape ({len(rows)}, {dest.shape[1]}) "
                    f"(table {t}'s padded row bytes), got "
                    f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}"
                )
            todo.append((dest, rows, w))
        for dest, rows, w in todo:
            if len(rows):
                dest[torch.as_tensor(rows, device=dest.device)] = w.to(dest.device)

    def embedding_inplace_update_internal(self, update_table_indices, update_row_indices, update_weights) -> None:
        """FBGEMM's flat form: update_table_indices[k] and update_row_indices[k] (an original index, mapped
        through the pruning map; a pruned index is skipped) name the k-th row, and update_weights is its
        padded row bytes, concatenated (uint8, 1-D)."""
        tables = [self._table_index(t, f"update_table_indices[{k}]") for k, t in enumerate(update_table_indices)]
        if len(tables) != len(update_row_indices):
            raise ValueError(
                f"{WHO}: update_table_indices ({len(tables)}) and update_row_indices "
                f"({len(update_row_indices)}) must have the same length"
            )
        self._need_weights("embedding_inplace_update_internal")
        views = self.split_embedding_weights(split_scale_shifts=False)
        widths = [views[t][0].shape[1] for t in tables]
        w = update_weights
        if not isinstance(w, torch.Tensor) or w.dtype != torch.uint8 or w.dim() != 1 or w.numel() != sum(widths):
            raise ValueError(
                f"{WHO}: update_weights must be 1-D uint8 of {sum(widths)} bytes (the rows' padded "
                f"bytes, concatenated), got {getattr(w, 'dtype', type(w).__name__)} "
                f"{tuple(getattr(w, 'shape', ()))}"
            )
        updates, at = [], 0
        for k, (t, r, width) in enumerate(zip(tables, update_row_indices, widths)):
            original = (
                self._remap[t].shape[0] if self._remap is not None and self._remap[t] is not None else self.rows[t]
            )
            r = int(r)
            if not 0 <= r < original:
                raise ValueError(f"{WHO}: update_row_indices[{k}] = {r} is outside table {t}'s {original} indices")
            if self._remap is not None and self._remap[t] is not None:
                r = int(self._remap[t][r])
            if r >= 0:
                updates.append((views[t][0], r, w[at : at + width]))
            at += width
        for dest, r, row in updates:
            dest[r] = row.to(dest.device)

    def _table_index(self, t, what: str) -> int:
        if not isinstance(t, (int, np.integer)) or not 0 <= int(t) < len(self.rows):
            raise ValueError(f"{WHO}: {what} = {t!r} is not a table (0..{len(self.rows) - 1})")
        return int(t)

    def _update_rows(self, rows, t: int, what: str) -> list:
        rows = [int(r) for r in (rows.tolist() if isinstance(rows, torch.Tensor) else rows)]
        bad = [r for r in rows if not 0 <= r < self.rows[t]]
        if bad:
            raise ValueError(f"{WHO}: {what} has row {bad[0]}, outside table {t}'s {self.rows[t]} rows")
        return rows


def device_kind() -> str:
    return device.kind()
