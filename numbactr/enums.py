"""HugeCTR's enums, defined once. Members are also exported at module level by numbactr/__init__
(pybind's export_values: ``hugectr.Adam`` works as well as ``hugectr.Optimizer_t.Adam``)."""

from __future__ import annotations

import enum


class _Enum(enum.Enum):
    def __repr__(self):
        return f"{type(self).__name__}.{self.name}"


def _make(name: str, members: str) -> type:
    return _Enum(name, [(m, i) for i, m in enumerate(members.split())])


Check_t = _make("Check_t", "Sum Non")
DataReaderType_t = _make("DataReaderType_t", "Norm Raw Parquet RawAsync")
DataReaderSparse_t = _make("DataReaderSparse_t", "Distributed Localized")
SourceType_t = _make("SourceType_t", "FileList Mmap Parquet")
FileSystemType_t = _make("FileSystemType_t", "Local HDFS S3 GCS Other")
Embedding_t = _make(
    "Embedding_t",
    "DistributedSlotSparseEmbeddingHash LocalizedSlotSparseEmbeddingHash "
    "LocalizedSlotSparseEmbeddingOneHot HybridSparseEmbedding",
)
Initializer_t = _make("Initializer_t", "Default Uniform XavierNorm XavierUniform Zero")
Layer_t = _make(
    "Layer_t",
    "BatchNorm LayerNorm BinaryCrossEntropyLoss Reshape Select Concat "
    "CrossEntropyLoss Dropout ElementwiseMultiply ELU InnerProduct FusedInnerProduct "
    "MLP Interaction MultiCrossEntropyLoss ReLU ReLUHalf Sigmoid Slice WeightMultiply "
    "FmOrder2 Add ReduceSum Softmax Gather PReLU_Dice GRU MatrixMultiply "
    "MultiHeadAttention Scale FusedReshapeConcat FusedReshapeConcatGeneral Sub "
    "ReduceMean MultiCross Cast SequenceMask",
)
GroupLayer_t = _make("GroupLayer_t", "GroupFusedInnerProduct")
Alignment_t = _make("Alignment_t", "Auto Non")
LrPolicy_t = _make("LrPolicy_t", "fixed")
Optimizer_t = _make("Optimizer_t", "Ftrl Adam RMSProp AdaGrad MomentumSGD Nesterov SGD")
Update_t = _make("Update_t", "Local Global LazyGlobal")
Activation_t = _make("Activation_t", "Relu Non")
FcPosition_t = _make("FcPosition_t", "Non Head Body Tail Isolated")
Regularizer_t = _make("Regularizer_t", "L1 L2")
MetricsRawType = _make("MetricsRawType", "Loss Pred Label")
#: HugeCTR's five, then numbactr's own (numbactr.metrics): HitRateAtK and NDCGAtK (cutoff CreateSolver(metrics_k=)),
#: GroupAUC (groups: CreateSolver(eval_group_size=) or eval_group_slot=), LogLoss
MetricsType = _make("MetricsType", "AUC AverageLoss HitRate NDCG SMAPE HitRateAtK NDCGAtK GroupAUC LogLoss")
DeviceLayout = _make("DeviceLayout", "LocalFirst NodeFirst")
AllReduceAlgo = _make("AllReduceAlgo", "OneShot NCCL")
#: HybridSparseEmbedding's (numbactr.embedding.hybrid). Registered before Distribution_t as in HugeCTR's
#: pybind module, so hugectr.Distributed is HybridEmbeddingType.Distributed there and here (the last
#: registered wins over DataReaderSparse_t.Distributed)
HybridEmbeddingType = _make("HybridEmbeddingType", "Distributed")
CommunicationType = _make("CommunicationType", "IB_NVLink_Hier IB_NVLink NVLink_SingleNode")
Distribution_t = _make("Distribution_t", "Uniform PowerLaw")
PowerLaw_t = _make("PowerLaw_t", "Long Medium Short Specific")
Tensor_t = _make("Tensor_t", "Train Evaluate")
Error_t = _make(
    "Error_t",
    "Success FileCannotOpen BrokenFile OutOfMemory OutOfBound WrongInput IllegalCall "
    "NotInitialized UnSupportedFormat InvalidEnv MpiError CublasError CudnnError "
    "CudaDriverError CudaRuntimeError NcclError DataCheckError UnspecificError EndOfFile",
)
TrainPSType_t = _make(
    "TrainPSType_t", "Staged Cached"
)  # the embedding training cache (numbactr/train/training_cache.py)
#: EmbeddingCollectionConfig's comm_strategy. Not in ALL: exporting its members at module level would make
#: hugectr.Uniform this enum's instead of Distribution_t's (the DataGenerator's)
CommunicationStrategy = _make("CommunicationStrategy", "Uniform Hierarchical")

#: every enum, in pybind registration order (later names win on module-level collisions, as in HugeCTR)
ALL = [
    Check_t,
    DataReaderType_t,
    DataReaderSparse_t,
    SourceType_t,
    FileSystemType_t,
    Embedding_t,
    Initializer_t,
    Layer_t,
    GroupLayer_t,
    Alignment_t,
    LrPolicy_t,
    Optimizer_t,
    Update_t,
    Activation_t,
    FcPosition_t,
    Regularizer_t,
    MetricsRawType,
    MetricsType,
    DeviceLayout,
    AllReduceAlgo,
    HybridEmbeddingType,
    CommunicationType,
    Distribution_t,
    PowerLaw_t,
    Tensor_t,
    TrainPSType_t,
    Error_t,
]


def exported_members() -> dict:
    out = {}
    for e in ALL:
        for m in e:
            out[m.name] = m
    out["Hierarchical"] = CommunicationStrategy.Hierarchical  # the one member of it no other enum has
    return out


__all__ = [e.__name__ for e in ALL] + ["CommunicationStrategy"]
