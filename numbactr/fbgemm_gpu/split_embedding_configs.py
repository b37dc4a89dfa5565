"""FBGEMM's optimizer and precision enums (fbgemm_gpu 1.8 split_embedding_configs: EmbOptimType, SparseType),
with FBGEMM's names and string values. ``OptimType`` is FBGEMM's other name for EmbOptimType.

numbactr's TBE runs EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD, ADAM, PARTIAL_ROWWISE_ADAM, LAMB,
PARTIAL_ROWWISE_LAMB and NONE (FBGEMM's CPU build runs only the first three), with FP32 or FP16 weights
and output; the other members exist so that scripts naming them import, and get a clear error when used.
"""

from __future__ import annotations

import enum

import numpy as np

__all__ = ["EmbOptimType", "OptimType", "SparseType"]


@enum.unique
class EmbOptimType(enum.Enum):
    SGD = "sgd"  # FBGEMM: deprecated (non-deterministic atomics)
    EXACT_SGD = "exact_sgd"
    LAMB = "lamb"
    ADAM = "adam"
    EXACT_ADAGRAD = "exact_adagrad"
    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"
    LARS_SGD = "lars_sgd"
    PARTIAL_ROWWISE_ADAM = "partial_row_wise_adam"
    PARTIAL_ROWWISE_LAMB = "partial_row_wise_lamb"
    ROWWISE_ADAGRAD = "row_wise_adagrad"  # FBGEMM: deprecated
    SHAMPOO = "shampoo"
    SHAMPOO_V2 = "shampoo_v2"
    MADGRAD = "madgrad"
    EXACT_ROWWISE_WEIGHTED_ADAGRAD = "exact_row_wise_weighted_adagrad"
    ENSEMBLE_ROWWISE_ADAGRAD = "ensemble_row_wise_adagrad"
    EMAINPLACE_ROWWISE_ADAGRAD = "ema_in_place_row_wise_adagrad"
    NONE = "none"  # no update: the backward returns the sparse gradient

    def __str__(self) -> str:
        return self.value


OptimType = EmbOptimType

#: SparseType -> (FBGEMM's integer code, bits per element, is a float format, torch dtype name)
_SPARSE = {
    "fp32": (0, 32, True, "float32"),
    "fp16": (1, 16, True, "float16"),
    "int8": (2, 8, False, "uint8"),
    "int4": (3, 4, False, "quint4x2"),
    "int2": (4, 2, False, "quint2x4"),
    "bf16": (5, 16, True, "bfloat16"),
    "fp8": (6, 8, True, "uint8"),
    "mx4": (7, 4, False, "uint8"),
    "nfp8": (8, 8, True, "float8_e4m3fn"),
}
#: FBGEMM's SparseType.from_int, which (unlike as_int) reads 8 as MX4 and 9 as NFP8
_FROM_INT = {0: "fp32", 1: "fp16", 2: "int8", 3: "int4", 4: "int2", 5: "bf16", 6: "fp8", 8: "mx4", 9: "nfp8"}


@enum.unique
class SparseType(enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    FP8 = "fp8"
    NFP8 = "nfp8"
    INT8 = "int8"
    INT4 = "int4"
    INT2 = "int2"
    BF16 = "bf16"
    MX4 = "mx4"

    def __str__(self) -> str:
        return self.value

    @staticmethod
    def from_int(ty: int) -> "SparseType":
        if ty not in _FROM_INT:
            raise ValueError(f"Unsupported sparse type: {ty}")
        return SparseType(_FROM_INT[ty])

    def as_int(self) -> int:
        return _SPARSE[self.value][0]

    def bit_rate(self) -> int:
        return _SPARSE[self.value][1]

    def is_float(self) -> bool:
        return _SPARSE[self.value][2]

    def as_dtype(self):
        """The torch dtype (imports torch)."""
        import torch

        return getattr(torch, _SPARSE[self.value][3])

    @staticmethod
    def from_dtype(dtype, is_mx: bool = False) -> "SparseType":
        """SparseType of a torch or NumPy dtype (float32, float16, bfloat16, int8/uint8)."""
        name = str(dtype)
        name = name[len("torch.") :] if name.startswith("torch.") else np.dtype(dtype).name
        if name in ("int8", "uint8"):
            return SparseType.MX4 if is_mx and name == "uint8" else SparseType.INT8
        for value, (_, _, _, torch_name) in _SPARSE.items():
            if torch_name == name and value not in ("fp8", "mx4"):
                return SparseType(value)
        raise ValueError(f"Unsupported sparse dtype: {dtype}")
