"""The configuration objects of HugeCTR's Python API: Solver, DataReaderParams, OptParamsPy, Input,
DataReaderSparseParam, SparseEmbedding, DenseLayer. Plain classes holding what the user passed,
with HugeCTR's defaults (spec §1, §2.1, §3.1, §5, §6.0); validation happens here where it can.

Validation: a non-finite or out-of-range value (learning rate, schedule, scaler, optimizer
hyperparameters) is a ValueError naming the argument and its range. An argument numbactr accepts but
does not act on (an option it does not implement, a reader setting the chosen format does not use, a
hyperparameter the chosen optimizer does not have, source files after the first) is an
IgnoredArgumentWarning naming it, raised only when the user set it to something other than its default.
"""

from numbactr.config.embedding import CacheConfig as CacheConfig
from numbactr.config.embedding import HybridEmbeddingParam as HybridEmbeddingParam
from numbactr.config.embedding import SparseEmbedding as SparseEmbedding
from numbactr.config.embedding import TierSpec as TierSpec
from numbactr.config.embedding import max_vocabulary_size_per_gpu as max_vocabulary_size_per_gpu
from numbactr.config.embedding import workspace_mb_for as workspace_mb_for
from numbactr.config.graph import _DENSE_DEFAULTS as _DENSE_DEFAULTS
from numbactr.config.graph import _DENSE_ORDER as _DENSE_ORDER
from numbactr.config.graph import _LAYER_PARAMS as _LAYER_PARAMS
from numbactr.config.graph import DataReaderSparseParam as DataReaderSparseParam
from numbactr.config.graph import DenseLayer as DenseLayer
from numbactr.config.graph import DenseLayerComputeConfig as DenseLayerComputeConfig
from numbactr.config.graph import GroupDenseLayer as GroupDenseLayer
from numbactr.config.graph import Input as Input
from numbactr.config.solver import CreateOptimizer as CreateOptimizer
from numbactr.config.solver import CreateSolver as CreateSolver
from numbactr.config.solver import DataReaderParams as DataReaderParams
from numbactr.config.solver import OptParamsPy as OptParamsPy
from numbactr.config.solver import Solver as Solver
from numbactr.config.solver import TrainingCallback as TrainingCallback
from numbactr.validate import IgnoredArgumentWarning as IgnoredArgumentWarning
from numbactr.validate import warn_ignored as warn_ignored
