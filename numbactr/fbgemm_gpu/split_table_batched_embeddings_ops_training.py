"""FBGEMM's training TBE under FBGEMM's module path: a PyTorch script changes one import line,

    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
 -> from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

With torch installed SplitTableBatchedEmbeddingBagsCodegen is a torch.nn.Module (numbactr/fbgemm_gpu/
torch_tbe.py), and DenseTableBatchedEmbeddingBagsCodegen, the dense-gradient TBE, is here too
(numbactr/fbgemm_gpu/dense_tbe.py); without torch it is ArrayTBE, the same face on NumPy/CuPy arrays with an explicit
backward() (numbactr/fbgemm_gpu/array_tbe.py, which also lists what each argument does here). The enums
FBGEMM's module exports are importable from here too, as in FBGEMM.
"""

from __future__ import annotations

from numbactr.runtime import device
from numbactr.fbgemm_gpu.array_tbe import ArrayTBE, SUPPORTED_OPTIMIZERS, TBECore, consumed_preallocated_keys
from numbactr.fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from numbactr.fbgemm_gpu.optimizer_config import (
    CounterBasedRegularizationDefinition,
    CounterWeightDecayMode,
    CowClipDefinition,
    DoesNotHavePrefix,
    EmainplaceModeDefinition,
    EnsembleModeDefinition,
    GlobalWeightDecayDefinition,
    GradSumDecay,
    LearningRateMode,
    StepMode,
    TailIdThreshold,
    UserEnabledConfigDefinition,
)
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    BoundsCheckMode,
    CacheAlgorithm,
    ComputeDevice,
    EmbeddingLocation,
    MultiPassPrefetchConfig,
    PoolingMode,
    RecordCacheMetrics,
    WeightDecayMode,
)

OptimType = EmbOptimType
_get_consumed_preallocated_keys = consumed_preallocated_keys  # FBGEMM's (private) name

try:
    import torch  # noqa: F401  (optional: decides which face this module exports)
except ImportError:
    SplitTableBatchedEmbeddingBagsCodegen = ArrayTBE
else:
    from numbactr.fbgemm_gpu.dense_tbe import DenseTableBatchedEmbeddingBagsCodegen  # noqa: F401 (FBGEMM's name)
    from numbactr.fbgemm_gpu.torch_tbe import SplitTableBatchedEmbeddingBagsCodegen

__all__ = [
    "SplitTableBatchedEmbeddingBagsCodegen",
    "ArrayTBE",
    "TBECore",
    "SUPPORTED_OPTIMIZERS",
    "EmbOptimType",
    "OptimType",
    "SparseType",
    "BoundsCheckMode",
    "CacheAlgorithm",
    "RecordCacheMetrics",
    "ComputeDevice",
    "EmbeddingLocation",
    "PoolingMode",
    "WeightDecayMode",
    "get_available_compute_device",
    "MultiPassPrefetchConfig",
    "UserEnabledConfigDefinition",
    "CounterBasedRegularizationDefinition",
    "CowClipDefinition",
    "GlobalWeightDecayDefinition",
    "EnsembleModeDefinition",
    "EmainplaceModeDefinition",
    "CounterWeightDecayMode",
    "LearningRateMode",
    "GradSumDecay",
    "TailIdThreshold",
    "StepMode",
    "DoesNotHavePrefix",
]
if "DenseTableBatchedEmbeddingBagsCodegen" in globals():  # with torch only
    __all__.append("DenseTableBatchedEmbeddingBagsCodegen")


def get_available_compute_device() -> ComputeDevice:
    """CUDA when numbactr runs on the gpu device, else CPU."""
    return ComputeDevice.CUDA if device.kind() == "gpu" else ComputeDevice.CPU
