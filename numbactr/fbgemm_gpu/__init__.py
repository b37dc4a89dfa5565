"""FBGEMM's Table Batched Embedding (TBE) interface on numbactr's embedding engine, under FBGEMM's module
paths, so that a PyTorch script written for fbgemm_gpu changes its import lines only:

    from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen, EmbeddingLocation, ComputeDevice, PoolingMode)
    from numbactr.fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType, SparseType

Modules (FBGEMM 1.8's names): split_table_batched_embeddings_ops_training (the module and every enum),
split_table_batched_embeddings_ops_common (EmbeddingLocation, ComputeDevice, PoolingMode, BoundsCheckMode,
CacheAlgorithm, WeightDecayMode), split_embedding_configs (EmbOptimType / OptimType, SparseType) and
split_table_batched_embeddings_ops (the old all-in-one path). Importing this package imports neither
torch nor the engine; the training module imports torch when it is installed (then the TBE is a
torch.nn.Module) and works on NumPy/CuPy arrays without it (array_tbe.ArrayTBE, explicit backward).
What each FBGEMM argument does here, and where numbactr differs from FBGEMM: array_tbe.py's docstring.
"""
