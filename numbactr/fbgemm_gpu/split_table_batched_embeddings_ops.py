"""FBGEMM's older all-in-one module path (it re-exports the common, config and training names)."""

from numbactr.fbgemm_gpu.split_embedding_configs import SparseType
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    BoundsCheckMode,
    CacheAlgorithm,
    EmbeddingLocation,
    PoolingMode,
    round_up,
)
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    OptimType,
    SplitTableBatchedEmbeddingBagsCodegen,
    WeightDecayMode,
)

__all__ = [
    "SparseType",
    "BoundsCheckMode",
    "CacheAlgorithm",
    "EmbeddingLocation",
    "PoolingMode",
    "round_up",
    "ComputeDevice",
    "OptimType",
    "SplitTableBatchedEmbeddingBagsCodegen",
    "WeightDecayMode",
]
