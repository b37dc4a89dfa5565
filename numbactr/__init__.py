"""numbactr: HugeCTR's Python training API, re-implemented with numba.cuda kernels.

import numbactr as hugectr      # the one changed line in a HugeCTR training script
"""

from numbactr.runtime import device  # noqa: F401  (first: may switch numba to its simulator; public: numbactr.device.set_device)
from numbactr.distributed.comm import guard_launch as _guard_launch

# under `mpiexec -n N` (N > 1) MPI starts here, and from the next line on a failing rank ends the whole job
# (numbactr/distributed/comm.py); a plain run only reads two environment variables
_guard_launch()
from numbactr import enums as _enums
from numbactr.config import (
    CreateOptimizer,
    CreateSolver,
    DataReaderParams,
    DataReaderSparseParam,
    DenseLayer,
    DenseLayerComputeConfig,
    GroupDenseLayer,
    IgnoredArgumentWarning,
    Input,
    OptParamsPy,
    Solver,
    SparseEmbedding,
)
from numbactr.enums import *  # noqa: F401,F403  (the enum classes)
from numbactr.data.raw_async import AsyncParam
from numbactr import data  # noqa: F401  (hugectr.data.DataSourceParams)
from numbactr.model import Model, ModelError
from numbactr.config import TrainingCallback
from numbactr.train.training_cache import EmbeddingTrainingCache
from numbactr.embedding.collection import EmbeddingCollectionConfig, EmbeddingTableConfig
from numbactr.config import HybridEmbeddingParam
from numbactr.train.training_cache import CreateETC, CreateHMemCache, EmbeddingTrainingCacheParams, HMemCacheConfig  # noqa: F401
from numbactr.optim import LearningRateScheduler
from numbactr import tools  # noqa: F401  (hugectr.tools.DataGenerator)
from numbactr import inference  # noqa: F401,E402  (hugectr.inference.InferenceParams, ...)

# HugeCTR registers these three on the top-level module too (include/pybind/common_wrapper.hpp)
from numbactr.inference.params import DatabaseOverflowPolicy_t, DatabaseType_t, UpdateSourceType_t  # noqa: E402

from numbactr import hugectr_alias as _alias

globals().update(_enums.exported_members())  # pybind export_values(): hugectr.Adam, hugectr.Norm, ...
globals().update(
    inference.params.pybind_members(  # their export_values(): hugectr.redis_cluster, ...
        DatabaseType_t, DatabaseOverflowPolicy_t, UpdateSourceType_t
    )
)

__version__ = "0.1.0"
_alias.install()  # `from hugectr.inference import ...` after `import numbactr as hugectr`

__all__ = [
    "AsyncParam",
    "CreateETC",
    "CreateHMemCache",
    "CreateOptimizer",
    "CreateSolver",
    "DataReaderParams",
    "DataReaderSparseParam",
    "DenseLayer",
    "DenseLayerComputeConfig",
    "GroupDenseLayer",
    "IgnoredArgumentWarning",
    "Input",
    "LearningRateScheduler",
    "Model",
    "ModelError",
    "EmbeddingCollectionConfig",
    "EmbeddingTableConfig",
    "HybridEmbeddingParam",
    "CommunicationStrategy",
    "DatabaseOverflowPolicy_t",
    "DatabaseType_t",
    "OptParamsPy",
    "Solver",
    "SparseEmbedding",
    "TrainingCallback",
    "EmbeddingTrainingCache",
    "UpdateSourceType_t",
    "tools",
]
