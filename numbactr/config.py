"""The configuration objects of HugeCTR's Python API: Solver, DataReaderParams, OptParamsPy, Input,
DataReaderSparseParam, SparseEmbedding, DenseLayer. Plain classes holding what the user passed,
with HugeCTR's defaults (spec §1, §2.1, §3.1, §5, §6.0); validation happens here where it can.

Validation: a non-finite or out-of-range value (learning rate, schedule, scaler, optimizer
hyperparameters) is a ValueError naming the argument and its range. An argument numbactr accepts but
does not act on (an option it does not implement, a reader setting the chosen format does not use, a
hyperparameter the chosen optimizer does not have, source files after the first) is an
IgnoredArgumentWarning naming it, raised only when the user set it to something other than its default.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from numbactr.data.raw_async import AsyncParam
from numbactr.data.source import DataSourceParams
from numbactr.enums import (
    Activation_t,
    Check_t,
    CommunicationType,
    DataReaderType_t,
    Embedding_t,
    FcPosition_t,
    GroupLayer_t,
    HybridEmbeddingType,
    Initializer_t,
    Layer_t,
    LrPolicy_t,
    MetricsType,
    Optimizer_t,
    Regularizer_t,
    Update_t,
)
from numbactr.validate import IgnoredArgumentWarning, warn_ignored  # noqa: F401 (hugectr.IgnoredArgumentWarning)
from numbactr.validate import expect as _expect, number as _number


def _sizes(who: str, values) -> list:
    """slot_size_array: whole numbers >= 0 (a float such as 2.7 is refused, not truncated)."""
    _expect(not isinstance(values, (str, bytes)), f"{who}: slot_size_array must be a list of sizes, got {values!r}")
    out = []
    for s, v in enumerate(values):
        whole = isinstance(v, numbers.Integral) or (isinstance(v, numbers.Real) and float(v).is_integer())
        _expect(
            whole and not isinstance(v, bool) and v >= 0,
            f"{who}: slot_size_array[{s}] must be a whole number >= 0, got {v!r}",
        )
        out.append(int(v))
    return out


def _flag(who: str, name: str, v) -> bool:
    """A yes/no argument: True/False (numpy's too, or the integers 0/1); a string such as "False" is refused
    (it would read as true)."""
    import numpy as np

    _expect(
        isinstance(v, (bool, np.bool_)) or (isinstance(v, numbers.Integral) and v in (0, 1)),
        f"{who}: {name} must be True or False, got {v!r}",
    )
    return bool(v)


@dataclass(frozen=True)
class Solver:
    """Read-only solver settings (``hugectr.CreateSolver``). Batch sizes are GLOBAL (all ranks)."""

    model_name: str = ""
    seed: int = 0
    lr_policy: Any = LrPolicy_t.fixed
    lr: float = 0.001
    warmup_steps: int = 1
    decay_start: int = 0
    decay_steps: int = 1
    decay_power: float = 2.0
    end_lr: float = 0.0
    max_eval_batches: int = 100
    batchsize_eval: int = 2048
    batchsize: int = 2048
    vvgpu: tuple = ((0,),)
    repeat_dataset: bool = True
    use_mixed_precision: bool = False
    enable_tf32_compute: bool = False
    scaler: float = 1.0
    # numbactr only: the half dtype of mixed precision, "float16" (HugeCTR's) or "bfloat16" (ml_dtypes)
    mixed_precision_dtype: str = "float16"
    metrics_spec: Any = None
    i64_input_key: bool = False
    use_algorithm_search: bool = True
    use_cuda_graph: bool = True
    gen_loss_summary: bool = True
    train_intra_iteration_overlap: bool = False
    train_inter_iteration_overlap: bool = False
    eval_intra_iteration_overlap: bool = False
    eval_inter_iteration_overlap: bool = False
    device_layout: Any = None
    use_embedding_collection: bool = False
    all_reduce_algo: Any = None
    grouped_all_reduce: bool = False
    num_iterations_statistics: int = 20
    perf_logging: bool = False
    drop_incomplete_batch: bool = True
    kafka_brockers: str = ""
    training_callbacks: tuple = ()
    data_source_params: Any = None  # HugeCTR v3.5-v3.7: where its model files lived (HDFS)


# CreateSolver's positional order, HugeCTR's (include/pybind/solver_wrapper.hpp)
_SOLVER_ORDER = (
    "model_name seed lr_policy lr warmup_steps decay_start decay_steps decay_power end_lr "
    "max_eval_batches batchsize_eval batchsize vvgpu repeat_dataset use_mixed_precision "
    "enable_tf32_compute scaler metrics_spec i64_input_key use_algorithm_search use_cuda_graph "
    "gen_loss_summary train_intra_iteration_overlap train_inter_iteration_overlap "
    "eval_intra_iteration_overlap eval_inter_iteration_overlap device_layout use_embedding_collection "
    "all_reduce_algo grouped_all_reduce num_iterations_statistics perf_logging drop_incomplete_batch "
    "kafka_brockers training_callbacks"
).split()

# Solver options numbactr does not act on: (value(s) that ask for nothing, why a different value is ignored)
_SOLVER_IGNORED = {
    "train_intra_iteration_overlap": (
        (False,),
        "a HugeCTR GPU-pipelining option; numbactr runs each step in order (the results are the same)",
    ),
    "train_inter_iteration_overlap": ((False,), "a HugeCTR GPU-pipelining option (the results are the same)"),
    "eval_intra_iteration_overlap": ((False,), "a HugeCTR GPU-pipelining option (the results are the same)"),
    "eval_inter_iteration_overlap": ((False,), "a HugeCTR GPU-pipelining option (the results are the same)"),
    "all_reduce_algo": ((None, "NCCL"), "numbactr's ranks reduce through MPI (distributed/comm.py)"),
    "grouped_all_reduce": ((False,), "numbactr reduces the dense gradients in one call anyway"),
    "device_layout": ((None, "LocalFirst"), "deprecated in HugeCTR; numbactr has one device per process"),
    "perf_logging": ((False,), "numbactr writes no MLPerf-style logs"),
    "kafka_brockers": (("",), "numbactr has no Kafka model export (embedding training cache)"),
}


def CreateSolver(*args, **kw) -> Solver:  # noqa: N802 (HugeCTR's name)
    """``hugectr.CreateSolver``: HugeCTR's arguments, by keyword or in its positional order (model_name,
    seed, lr_policy, lr, ...), with its defaults (spec §1). Out-of-range values raise ValueError; options
    numbactr does not act on warn (IgnoredArgumentWarning) when set."""
    _expect(len(args) <= len(_SOLVER_ORDER), f"CreateSolver: at most {len(_SOLVER_ORDER)} positional arguments")
    for name, value in zip(_SOLVER_ORDER, args):
        _expect(name not in kw, f"CreateSolver: {name} given twice")
        kw[name] = value
    known = set(Solver.__dataclass_fields__)
    unknown = sorted(set(kw) - known)
    _expect(not unknown, f"CreateSolver: unknown argument(s) {unknown}")
    if "vvgpu" in kw:
        kw["vvgpu"] = tuple(tuple(int(g) for g in node) for node in kw["vvgpu"])
        _expect(
            len(kw["vvgpu"]) > 0 and all(len(n) > 0 for n in kw["vvgpu"]), "CreateSolver: vvgpu has an empty node list"
        )
    if kw.get("metrics_spec") is None:
        kw["metrics_spec"] = {MetricsType.AUC: 1.0}
    kw["training_callbacks"] = tuple(kw.get("training_callbacks", ()))
    for j, cb in enumerate(kw["training_callbacks"]):
        _expect(
            isinstance(cb, TrainingCallback),
            f"CreateSolver: training_callbacks[{j}] must be a hugectr.TrainingCallback (a subclass of it), got {cb!r}",
        )
    s = Solver(**kw)
    who = "CreateSolver"
    for name, f in Solver.__dataclass_fields__.items():
        if f.type in ("bool", bool) and name in kw:
            _flag(who, name, kw[name])
    _expect(
        s.lr_policy in tuple(LrPolicy_t),
        f"CreateSolver: lr_policy must be a hugectr.LrPolicy_t "
        f"({', '.join(f'LrPolicy_t.{m.name}' for m in LrPolicy_t)}), got {s.lr_policy!r}",
    )
    for name in ("batchsize", "batchsize_eval"):
        _number(who, name, getattr(s, name), 0, lo_open=True, integer=True)
    _number(who, "lr", s.lr, 0.0, lo_open=True)
    _number(who, "end_lr", s.end_lr, 0.0)
    _number(who, "warmup_steps", s.warmup_steps, 0, integer=True)
    _number(who, "decay_start", s.decay_start, 0, integer=True)
    _number(who, "decay_steps", s.decay_steps, 1, integer=True)
    _number(who, "decay_power", s.decay_power, 1.0)
    _number(who, "scaler", s.scaler, 0.0, lo_open=True)
    _number(who, "max_eval_batches", s.max_eval_batches, 0, integer=True)
    _number(who, "seed", s.seed, 0, integer=True)
    _expect(
        isinstance(s.metrics_spec, dict) and all(isinstance(m, MetricsType) for m in s.metrics_spec),
        f"CreateSolver: metrics_spec must map MetricsType members to thresholds, got {s.metrics_spec!r}",
    )
    for m, v in s.metrics_spec.items():
        _number(who, f"metrics_spec[{m!r}]", v)
    _expect(
        not (s.use_mixed_precision and s.enable_tf32_compute),
        "CreateSolver: use_mixed_precision and enable_tf32_compute cannot both be True",
    )
    from numbactr.runtime.precision import HALF_DTYPES, half_dtype  # mixed precision: numbactr/runtime/precision.py

    _expect(
        s.mixed_precision_dtype in HALF_DTYPES,
        f"CreateSolver: mixed_precision_dtype must be one of {HALF_DTYPES}, got {s.mixed_precision_dtype!r}",
    )
    half_dtype(s)  # bfloat16 without ml_dtypes: a clear error now
    for name, (fine, why) in _SOLVER_IGNORED.items():
        v = getattr(s, name)
        if name in kw and v not in fine and getattr(v, "name", None) not in fine:
            warn_ignored(who, name, v, why, stacklevel=2)
    if s.data_source_params is not None:
        from numbactr.data.source import DataSourceParams

        _expect(
            isinstance(s.data_source_params, DataSourceParams),
            f"CreateSolver: data_source_params must be a hugectr.data.DataSourceParams, got {s.data_source_params!r}",
        )
        if not s.data_source_params.is_local():
            warn_ignored(
                who,
                "data_source_params",
                s.data_source_params,
                "HugeCTR v3.5-v3.7 kept its model files "
                "on HDFS through it; numbactr writes and reads them on the local disk (copy them with "
                "hugectr.data.DataSource(...).move_to_local(); training data on HDFS is read through "
                "DataReaderParams(data_source_params=...))",
                stacklevel=2,
            )
    from numbactr.runtime.device import use_vvgpu  # each rank's GPU: vvgpu[node][local rank % len]

    unused = use_vvgpu(s.vvgpu)
    if unused:
        warn_ignored(who, "vvgpu", [list(n) for n in s.vvgpu], f"in part: {unused}", stacklevel=2)
    return s


# DataReaderParams' positional order, HugeCTR's (include/pybind/model_wrapper.hpp): keyset comes third
_READER_ARGS = (
    "data_reader_type",
    "source",
    "keyset",
    "eval_source",
    "check_type",
    "cache_eval_data",
    "num_samples",
    "eval_num_samples",
    "float_label_dense",
    "read_file_sequentially",
    "num_workers",
    "slot_size_array",
    "data_source_params",
    "async_param",
)


@dataclass(init=False)
class DataReaderParams:
    """``hugectr.DataReaderParams`` (spec §2.1). Positional arguments in HugeCTR's order: (data_reader_type,
    source, keyset, eval_source, check_type, cache_eval_data, ...); the four-argument form (data_reader_type,
    source, eval_source, check_type), which HugeCTR itself would refuse, is read that way too."""

    data_reader_type: Any
    source: Any
    eval_source: str
    check_type: Any
    keyset: Any = ""
    cache_eval_data: int = 0
    num_samples: int = 0
    eval_num_samples: int = 0
    float_label_dense: bool = False
    read_file_sequentially: bool = False
    # None: not chosen by the script; numbactr.runtime.threads sizes it for this machine (HugeCTR's default is 12,
    # which numbactr uses under compat.hugectr_exact())
    num_workers: int | None = None
    slot_size_array: list = field(default_factory=list)
    data_source_params: Any = None
    async_param: Any = None

    def __init__(self, *args, **kw):
        if len(args) == 4 and isinstance(args[3], Check_t):  # (type, source, eval_source, check_type)
            args = (args[0], args[1], kw.pop("keyset", ""), args[2], args[3])
        if len(args) > len(_READER_ARGS):
            raise TypeError(f"DataReaderParams takes at most {len(_READER_ARGS)} positional arguments, got {len(args)}")
        for name, value in zip(_READER_ARGS, args):
            if name in kw:
                raise TypeError(f"DataReaderParams: got multiple values for argument {name!r}")
            kw[name] = value
        unknown = sorted(set(kw) - set(_READER_ARGS))
        if unknown:
            raise TypeError(f"DataReaderParams: unexpected argument(s) {unknown}")
        missing = [n for n in ("data_reader_type", "source", "eval_source", "check_type") if n not in kw]
        if missing:
            raise TypeError(f"DataReaderParams: missing required argument(s) {missing}")
        for f in fields(self):
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            setattr(self, f.name, kw.get(f.name, default))
        self.__post_init__()

    def __post_init__(self):
        _expect(
            isinstance(self.data_reader_type, DataReaderType_t),
            f"DataReaderParams: data_reader_type must be a DataReaderType_t, got {self.data_reader_type!r}",
        )
        _expect(
            isinstance(self.check_type, Check_t),
            f"DataReaderParams: check_type must be a Check_t, got {self.check_type!r}",
        )
        if isinstance(self.source, str):
            self.source = [self.source]
        _expect(
            bool(self.source) and all(isinstance(s, str) and s for s in self.source),
            "DataReaderParams: source must be a non-empty file-list path (or list of paths)",
        )
        _expect(
            isinstance(self.eval_source, str) and bool(self.eval_source),
            "DataReaderParams: eval_source must be a non-empty file-list path",
        )
        if self.num_workers is not None:
            _number("DataReaderParams", "num_workers", self.num_workers, 1, integer=True)
        for name in ("num_samples", "eval_num_samples", "cache_eval_data"):
            _number("DataReaderParams", name, getattr(self, name), 0, integer=True)
        self.slot_size_array = _sizes("DataReaderParams", self.slot_size_array)
        _expect(
            self.async_param is None or isinstance(self.async_param, AsyncParam),
            f"DataReaderParams: async_param must be a hugectr.AsyncParam, got {self.async_param!r}",
        )
        _expect(
            self.data_source_params is None or isinstance(self.data_source_params, DataSourceParams),
            f"DataReaderParams: data_source_params must be a hugectr.data.DataSourceParams, got "
            f"{self.data_source_params!r}",
        )
        self._warn_ignored()

    def _warn_ignored(self) -> None:
        t, T = self.data_reader_type, DataReaderType_t
        notes = []
        if self.cache_eval_data:
            notes.append(
                (
                    "cache_eval_data",
                    self.cache_eval_data,
                    "numbactr caches no eval batches: every evaluation reads on through the eval source",
                )
            )
        if t == T.RawAsync:  # num_samples: the RawAsync reader itself compares it with the file
            if self.float_label_dense:
                notes.append(
                    (
                        "float_label_dense",
                        True,
                        "RawAsync's layout comes from async_param (multi_hot_reader, is_dense_float)",
                    )
                )
        elif t != T.Raw:
            for name in ("num_samples", "eval_num_samples", "float_label_dense"):
                if getattr(self, name):
                    notes.append((name, getattr(self, name), f"used only by the Raw reader, not {t.name}"))
            if self.slot_size_array and t == T.Norm:
                notes.append(
                    (
                        "slot_size_array",
                        self.slot_size_array,
                        "used only by the Parquet reader (key offsets); Norm keys are read verbatim",
                    )
                )
        if self.slot_size_array and t in (T.Raw, T.RawAsync):
            notes.append(
                (
                    "slot_size_array",
                    self.slot_size_array,
                    f"used only by the Parquet reader (key offsets); {t.name} keys are read verbatim",
                )
            )
        if self.read_file_sequentially and t != T.Parquet:
            notes.append(("read_file_sequentially", True, f"used only by the Parquet reader, not {t.name}"))
        if self.async_param is not None and t != T.RawAsync:
            notes.append(("async_param", self.async_param, f"used only by the RawAsync reader, not {t.name}"))
        for name, value, why in notes:
            warn_ignored("DataReaderParams", name, value, why, stacklevel=4)


@dataclass
class OptParamsPy:
    """``hugectr.CreateOptimizer`` result; ``initialized=False`` means 'use the model's optimizer'."""

    optimizer_type: Any = Optimizer_t.Adam
    update_type: Any = Update_t.Global
    beta: float = 0.0
    lambda1: float = 0.0
    lambda2: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-7
    initial_accu_value: float = 0.0
    momentum_factor: float = 0.0
    atomic_update: bool = True
    initialized: bool = False

    @property
    def n_states(self) -> int:
        """State arrays per weight, as HugeCTR counts them for table sizing (spec §5.2)."""
        t = self.optimizer_type
        if t == Optimizer_t.Adam:
            return 3 if self.update_type == Update_t.LazyGlobal else 2
        return {
            Optimizer_t.AdaGrad: 1,
            Optimizer_t.MomentumSGD: 1,
            Optimizer_t.Nesterov: 1,
            Optimizer_t.SGD: 0,
            Optimizer_t.Ftrl: 2,
        }.get(t, 0)


# hyperparameter -> (range checked by CreateOptimizer as _number arguments, optimizers that use it)
_OPT_ARGS = {
    "beta1": (dict(lo=0.0, hi=1.0, hi_open=True), {Optimizer_t.Adam}),
    "beta2": (dict(lo=0.0, hi=1.0, hi_open=True), {Optimizer_t.Adam}),
    "epsilon": (dict(lo=0.0, lo_open=True), {Optimizer_t.Adam, Optimizer_t.AdaGrad}),
    "initial_accu_value": (dict(lo=0.0), {Optimizer_t.AdaGrad}),
    "momentum_factor": (dict(lo=0.0, hi=1.0, hi_open=True), {Optimizer_t.MomentumSGD, Optimizer_t.Nesterov}),
    "beta": (dict(lo=0.0), {Optimizer_t.Ftrl}),
    "lambda1": (dict(lo=0.0), {Optimizer_t.Ftrl}),
    "lambda2": (dict(lo=0.0), {Optimizer_t.Ftrl}),
}


def CreateOptimizer(
    optimizer_type=Optimizer_t.Adam,
    update_type=Update_t.Global,
    beta=0.0,
    lambda1=0.0,  # noqa: N802
    lambda2=0.0,
    beta1=0.9,
    beta2=0.999,
    epsilon=1e-7,
    initial_accu_value=0.0,
    momentum_factor=0.0,
    atomic_update=True,
) -> OptParamsPy:
    """``hugectr.CreateOptimizer`` (spec §3.1). There is no lr: the Solver's lr/scheduler drives all.

    Every hyperparameter must be finite and in its range (beta1, beta2, momentum_factor in [0, 1),
    epsilon > 0, the others >= 0), else ValueError; one the chosen optimizer does not use, set to a
    non-default value, warns (IgnoredArgumentWarning).
    """
    _expect(
        isinstance(optimizer_type, Optimizer_t),
        f"CreateOptimizer: optimizer_type must be an Optimizer_t, got {optimizer_type!r}",
    )
    _expect(isinstance(update_type, Update_t), f"CreateOptimizer: update_type must be an Update_t, got {update_type!r}")
    _expect(isinstance(atomic_update, bool), f"CreateOptimizer: atomic_update must be a bool, got {atomic_update!r}")
    given = dict(
        beta=beta,
        lambda1=lambda1,
        lambda2=lambda2,
        beta1=beta1,
        beta2=beta2,
        epsilon=epsilon,
        initial_accu_value=initial_accu_value,
        momentum_factor=momentum_factor,
    )
    defaults = CreateOptimizer.__defaults__
    names = CreateOptimizer.__code__.co_varnames[: len(defaults)]
    for name, (rng, users) in _OPT_ARGS.items():
        _number("CreateOptimizer", name, given[name], **rng)
        if optimizer_type not in users and given[name] != defaults[names.index(name)]:
            warn_ignored(
                "CreateOptimizer",
                name,
                given[name],
                f"Optimizer_t.{optimizer_type.name} does not use it "
                f"(it is a hyperparameter of {', '.join(sorted(u.name for u in users))})",
                stacklevel=2,
            )
    if optimizer_type != Optimizer_t.SGD and not atomic_update:
        warn_ignored(
            "CreateOptimizer", "atomic_update", False, f"only SGD uses it, not {optimizer_type.name}", stacklevel=2
        )
    return OptParamsPy(
        optimizer_type,
        update_type,
        beta,
        lambda1,
        lambda2,
        beta1,
        beta2,
        epsilon,
        initial_accu_value,
        momentum_factor,
        atomic_update,
        initialized=True,
    )


@dataclass
class DataReaderSparseParam:
    """``hugectr.DataReaderSparseParam(top_name, nnz_per_slot, is_fixed_length, slot_num)``."""

    top_name: str
    nnz_per_slot: Any
    is_fixed_length: bool
    slot_num: int

    def __post_init__(self):
        _expect(
            isinstance(self.slot_num, int) and self.slot_num > 0,
            f"DataReaderSparseParam {self.top_name!r}: slot_num must be a positive int",
        )
        if isinstance(self.nnz_per_slot, int):
            self.nnz_per_slot = [self.nnz_per_slot] * self.slot_num
        self.nnz_per_slot = [int(n) for n in self.nnz_per_slot]
        _expect(
            len(self.nnz_per_slot) == self.slot_num,
            f"DataReaderSparseParam {self.top_name!r}: nnz_per_slot has {len(self.nnz_per_slot)} "
            f"entries for slot_num={self.slot_num}",
        )
        _expect(
            all(n > 0 for n in self.nnz_per_slot),
            f"DataReaderSparseParam {self.top_name!r}: nnz_per_slot entries must be > 0",
        )

    @property
    def max_feature_num(self) -> int:
        return sum(self.nnz_per_slot)


class Input:
    """``hugectr.Input``: label(s), dense features and sparse inputs (spec §5.1)."""

    def __init__(
        self,
        label_dim=None,
        label_name=None,
        dense_dim=0,
        dense_name="dense",
        data_reader_sparse_param_array=(),
        *rest,
        label_dims=None,
        label_names=None,
        label_weights=None,
    ):
        if isinstance(dense_dim, (list, tuple)):
            # HugeCTR's third overload: (label_dims, label_names, label_weights, dense_dim, dense_name, sparse)
            _expect(label_weights is None and len(rest) <= 1, "Input: label_weights given twice")
            label_weights, dense_dim, dense_name = dense_dim, dense_name, data_reader_sparse_param_array
            data_reader_sparse_param_array = rest[0] if rest else ()
        elif rest:
            raise TypeError(
                f"Input takes at most 5 positional arguments (6 with label_weights third), got {5 + len(rest)}"
            )
        if label_dims is None:
            label_dims = label_dim
        if label_names is None:
            label_names = label_name
        multi = isinstance(label_dims, (list, tuple))
        self.label_dims = list(label_dims) if multi else [label_dims]
        self.label_names = list(label_names) if multi else [label_names]
        _expect(
            all(isinstance(d, int) and d > 0 for d in self.label_dims),
            f"Input: label dims must be positive ints, got {label_dims!r}",
        )
        _expect(
            len(self.label_dims) == len(self.label_names) and all(self.label_names),
            "Input: give one label name per label dim",
        )
        self.label_weights = list(label_weights) if label_weights else [1.0] * len(self.label_dims)
        _expect(
            len(self.label_weights) == len(self.label_dims),
            f"Input: label_weights has "
            f"{len(self.label_weights)} weight(s) but there are {len(self.label_dims)} label(s) "
            f"{self.label_names}: give one weight per label",
        )
        for j, w in enumerate(self.label_weights):
            _number("Input", f"label_weights[{j}]", w, 0.0)
        _expect(
            isinstance(dense_dim, int) and dense_dim >= 0, f"Input: dense_dim must be an int >= 0, got {dense_dim!r}"
        )
        self.dense_dim = dense_dim
        self.dense_name = dense_name
        self.sparse = list(data_reader_sparse_param_array)
        _expect(
            all(isinstance(p, DataReaderSparseParam) for p in self.sparse),
            "Input: data_reader_sparse_param_array must hold DataReaderSparseParam objects",
        )
        names = self.label_names + [dense_name] + [p.top_name for p in self.sparse]
        _expect(len(set(names)) == len(names), f"Input: tensor names must be unique, got {names}")

    @property
    def label_dim(self) -> int:
        return sum(self.label_dims)


class SparseEmbedding:
    """``hugectr.SparseEmbedding`` (spec §5.2)."""

    def __init__(
        self,
        embedding_type,
        workspace_size_per_gpu_in_mb=0,
        embedding_vec_size=1,
        combiner="sum",
        sparse_embedding_name="",
        bottom_name="",
        slot_size_array=(),
        optimizer=None,
        hybrid_embedding_param=None,
        embedding_cache=None,
    ):
        _expect(
            isinstance(embedding_type, Embedding_t),
            f"SparseEmbedding {sparse_embedding_name!r}: embedding_type must be an Embedding_t, got {embedding_type!r}",
        )
        _expect(
            combiner in ("sum", "mean"),
            f"SparseEmbedding {sparse_embedding_name!r}: combiner must be 'sum' or 'mean', got {combiner!r}",
        )
        _expect(
            isinstance(embedding_vec_size, int) and 0 < embedding_vec_size <= 1024,
            f"SparseEmbedding {sparse_embedding_name!r}: embedding_vec_size must be in 1..1024",
        )
        _expect(
            bool(sparse_embedding_name) and bool(bottom_name),
            "SparseEmbedding: sparse_embedding_name and bottom_name are required",
        )
        _number(
            f"SparseEmbedding {sparse_embedding_name!r}",
            "workspace_size_per_gpu_in_mb",
            workspace_size_per_gpu_in_mb,
            0,
        )
        _expect(
            optimizer is None or isinstance(optimizer, OptParamsPy),
            f"SparseEmbedding "
            f"{sparse_embedding_name!r}: optimizer must be a hugectr.CreateOptimizer(...) result (or None for "
            f"the model's optimizer), got {optimizer!r}",
        )
        self.embedding_type = embedding_type
        self.workspace_size_per_gpu_in_mb = workspace_size_per_gpu_in_mb
        self.embedding_vec_size = embedding_vec_size
        self.combiner = combiner
        self.sparse_embedding_name = sparse_embedding_name
        self.bottom_name = bottom_name
        self.slot_size_array = _sizes(f"SparseEmbedding {sparse_embedding_name!r}", slot_size_array)
        self.optimizer = optimizer if optimizer is not None else OptParamsPy()
        self.hybrid_embedding_param = hybrid_embedding_param
        # numbactr's extra: the table in a backing tier behind a cache (numbactr.embedding.tiered.TierSpec)
        _expect(
            embedding_cache is None or isinstance(embedding_cache, TierSpec),
            f"SparseEmbedding {sparse_embedding_name!r}: embedding_cache must be a "
            f"numbactr.embedding.tiered.TierSpec, got {embedding_cache!r}",
        )
        _expect(
            embedding_cache is None or embedding_cache.backing in ("host", "memmap"),
            f"SparseEmbedding {sparse_embedding_name!r}: embedding_cache backing must be 'host' or 'memmap' "
            "(its size is known from workspace_size_per_gpu_in_mb / slot_size_array)",
        )
        self.embedding_cache = embedding_cache
        who = f"SparseEmbedding {sparse_embedding_name!r}"
        if hybrid_embedding_param is not None and embedding_type != Embedding_t.HybridSparseEmbedding:
            warn_ignored(
                who,
                "hybrid_embedding_param",
                hybrid_embedding_param,
                f"used only by HybridSparseEmbedding, not {embedding_type.name}",
                stacklevel=2,
            )
        if embedding_type == Embedding_t.HybridSparseEmbedding:
            _expect(
                hybrid_embedding_param is None or isinstance(hybrid_embedding_param, HybridEmbeddingParam),
                f"{who}: hybrid_embedding_param must be a HybridEmbeddingParam, got {hybrid_embedding_param!r}",
            )
            _expect(
                bool(self.slot_size_array),
                f"{who}: HybridSparseEmbedding needs slot_size_array (one vocabulary size per slot)",
            )
        if self.slot_size_array and embedding_type == Embedding_t.DistributedSlotSparseEmbeddingHash:
            warn_ignored(
                who,
                "slot_size_array",
                self.slot_size_array,
                "DistributedSlotSparseEmbeddingHash hashes its keys: its size comes from workspace_size_per_gpu_in_mb",
                stacklevel=2,
            )


@dataclass(frozen=True)
class DenseLayerComputeConfig:
    """``hugectr.DenseLayerComputeConfig(async_wgrad=False, fuse_wb=False)``: how HugeCTR schedules a
    dense layer's backward, never what it computes (spec §6.0). HugeCTR reads it in MLP (both),
    MultiCross (async_wgrad) and the fp16 FusedInnerProduct / two-top Interaction (async_wgrad).

    * ``async_wgrad``: the weight-gradient GEMMs run on a second CUDA stream, overlapping the
      data-gradient GEMMs of the layers below. numbactr runs every layer on one stream (cupy's
      current stream), so there is nothing to overlap: accepted, no effect.
    * ``fuse_wb``: each layer's bias gradient comes from its own wgrad GEMM's epilogue (cuBLASLt
      BGRADB) instead of the dReLU epilogue of the layer above. numbactr has no cuBLASLt epilogues and
      always computes the bias gradient in the one kernel that applies the ReLU mask
      (kernels/fused_bias_act.py), the fusion HugeCTR's default already makes: accepted, no effect.

    Both give the same numbers either way, so numbactr keeps them (graph JSON, summary) without a
    warning; HugeCTR's graph JSON writer drops them and numbactr writes them as an extra
    ``compute_config`` object only when one is True.
    """

    async_wgrad: bool = False
    fuse_wb: bool = False

    def __post_init__(self):
        for name in ("async_wgrad", "fuse_wb"):
            v = getattr(self, name)
            _expect(isinstance(v, bool), f"DenseLayerComputeConfig: {name} must be a bool, got {v!r}")


_DENSE_DEFAULTS = dict(
    factor=1.0,
    eps=1e-5,
    gamma_init_type=Initializer_t.Default,
    beta_init_type=Initializer_t.Default,
    dropout_rate=0.5,
    elu_alpha=1.0,
    num_output=1,
    weight_init_type=Initializer_t.Default,
    bias_init_type=Initializer_t.Default,
    num_layers=0,
    leading_dim=0,
    time_step=0,
    batchsize=1,
    SeqLength=1,
    vector_size=1,
    selected=False,
    selected_slots=(),
    ranges=(),
    indices=(),
    weight_dims=(),
    projection_dim=0,
    out_dim=0,
    axis=1,
    max_sequence_len_from=1,
    max_sequence_len_to=1,
    max_sequence_len=1,
    num_attention_heads=1,
    transpose_b=False,
    target_weight_vec=(),
    use_regularizer=False,
    regularizer_type=Regularizer_t.L1,
    pos_type=FcPosition_t.Non,
    act_type=Activation_t.Relu,
    num_outputs=(),
    use_bias=True,
    activations=(),
    biases=(),
    compute_config=DenseLayerComputeConfig(),
    shape=(),
    dim=0,
    index=(),
)
_DENSE_DEFAULTS["lambda"] = 0.0
# DenseLayer's parameters after (layer_type, bottom_names, top_names) in HugeCTR's positional order
_DENSE_ORDER = (
    "factor eps gamma_init_type beta_init_type dropout_rate elu_alpha num_output weight_init_type "
    "bias_init_type num_layers leading_dim time_step batchsize SeqLength vector_size selected selected_slots "
    "ranges indices weight_dims projection_dim out_dim axis max_sequence_len_from max_sequence_len_to "
    "num_attention_heads transpose_b target_weight_vec use_regularizer regularizer_type lambda pos_type "
    "act_type num_outputs use_bias activations biases compute_config shape dim index"
).split()


_INITS = ("weight_init_type", "bias_init_type")
_LOSS = ("use_regularizer", "regularizer_type", "lambda")
# the DenseLayer parameters each layer type reads (tests/test_validation_config.py checks this table
# against the layer classes); any other parameter set to a non-default value warns as ignored
_LAYER_PARAMS = {
    "InnerProduct": ("num_output",) + _INITS,
    "FusedInnerProduct": ("num_output", "pos_type", "act_type", "compute_config") + _INITS,
    "MLP": ("num_outputs", "num_output", "use_bias", "biases", "act_type", "activations", "compute_config") + _INITS,
    "MultiCross": ("num_layers", "projection_dim", "compute_config") + _INITS,
    "Interaction": ("compute_config",),
    "BatchNorm": ("factor", "eps", "gamma_init_type", "beta_init_type"),
    "LayerNorm": ("eps", "gamma_init_type", "beta_init_type"),
    "PReLU_Dice": ("elu_alpha", "eps"),
    "ELU": ("elu_alpha",),
    "Dropout": ("dropout_rate",),
    "Scale": ("axis", "factor"),
    "WeightMultiply": ("weight_dims", "weight_init_type"),
    "FmOrder2": ("out_dim",),
    "Concat": ("axis",),
    "Reshape": ("leading_dim", "time_step", "selected", "selected_slots", "shape"),
    "ReduceSum": ("axis",),
    "ReduceMean": ("axis",),
    "Slice": ("ranges",),
    "Select": ("dim", "index"),
    "Gather": ("indices",),
    # max_sequence_len: HugeCTR v23.06's one-bottom form
    "SequenceMask": ("max_sequence_len_from", "max_sequence_len_to", "max_sequence_len"),
    "MultiHeadAttention": ("num_attention_heads", "transpose_b"),
    "Softmax": ("factor",),
    "GRU": ("num_output", "batchsize", "SeqLength", "vector_size") + _INITS,
    "BinaryCrossEntropyLoss": _LOSS,
    "CrossEntropyLoss": _LOSS,
    "MultiCrossEntropyLoss": _LOSS + ("target_weight_vec",),
}


class DenseLayer:
    """``hugectr.DenseLayer(layer_type, bottom_names, top_names, **params)`` (spec §6.0).

    ``lambda`` is a Python keyword: pass it as ``**{"lambda": 0.1}`` (read back as ``.lambda_``).
    """

    def __init__(self, layer_type, bottom_names, top_names, *args, **params):
        _expect(isinstance(layer_type, Layer_t), f"DenseLayer: layer_type must be a Layer_t, got {layer_type!r}")
        _expect(
            len(args) <= len(_DENSE_ORDER),
            f"DenseLayer {layer_type.name}: at most {3 + len(_DENSE_ORDER)} positional arguments, got {3 + len(args)}",
        )
        for name, value in zip(_DENSE_ORDER, args):  # HugeCTR's positional order (model_wrapper.hpp)
            _expect(name not in params, f"DenseLayer {layer_type.name}: {name} given twice")
            params[name] = value
        unknown = sorted(set(params) - set(_DENSE_DEFAULTS))
        _expect(not unknown, f"DenseLayer {layer_type.name} {list(top_names)!r}: unknown parameter(s) {unknown}")
        if isinstance(bottom_names, str):
            bottom_names = [bottom_names]
        if isinstance(top_names, str):
            top_names = [top_names]
        self.layer_type = layer_type
        self.bottom_names = list(bottom_names)
        self.top_names = list(top_names)
        _expect(
            bool(self.bottom_names) and bool(self.top_names),
            f"DenseLayer {layer_type.name}: bottom_names and top_names must not be empty",
        )
        for k, v in _DENSE_DEFAULTS.items():
            setattr(self, "lambda_" if k == "lambda" else k, params.get(k, v))
            if k in params and isinstance(params[k], bool) and not isinstance(v, bool) and isinstance(v, int):
                raise ValueError(
                    f"DenseLayer {layer_type.name} {list(top_names)!r}: {k} must be an integer, got {params[k]!r}"
                )
        _expect(
            isinstance(self.compute_config, DenseLayerComputeConfig),
            f"DenseLayer {layer_type.name} {self.top_names!r}: compute_config must be a "
            f"DenseLayerComputeConfig, got {self.compute_config!r}",
        )
        self.given = dict(params)  # what the user set explicitly (for graph JSON)
        used = _LAYER_PARAMS.get(layer_type.name, ())
        for k, v in params.items():
            if k not in used and not _same(v, _DENSE_DEFAULTS[k]):
                why = f"Layer_t.{layer_type.name} does not use it"
                if k == "compute_config":
                    why += " (HugeCTR reads it only in MLP, MultiCross, FusedInnerProduct and Interaction)"
                warn_ignored(f"DenseLayer {layer_type.name} {self.top_names!r}", k, v, why, stacklevel=2)


class GroupDenseLayer:
    """``hugectr.GroupDenseLayer(group_layer_type, bottom_name_list, top_name_list, num_outputs,
    last_act_type=Activation_t.Relu)`` (HugeCTR v23.08 and before; spec §6.2).

    GroupLayer_t.GroupFusedInnerProduct is a stack of len(num_outputs) >= 2 FusedInnerProducts that
    Model.add expands exactly as HugeCTR's Model::add(GroupDenseLayer&) does: a Head (the bottoms of
    ``bottom_name_list``: one, or two for the fp16 Interaction's mask) with tops ``t0, t0_mask,
    t0_dRelu, t0_db``, Body layers chaining those four, and a Tail with the last top; every layer ReLU
    except the Tail, whose activation is ``last_act_type``. Layer i has ``num_outputs[i]`` outputs and
    tensor ``top_name_list[i]`` is its output. HugeCTR builds it only with use_mixed_precision=True;
    numbactr builds it in float32 too, as it builds FusedInnerProduct (numbactr/layers/dense.py).
    """

    def __init__(self, group_layer_type, bottom_name_list, top_name_list, num_outputs, last_act_type=Activation_t.Relu):
        who = "GroupDenseLayer"
        _expect(
            isinstance(group_layer_type, GroupLayer_t),
            f"{who}: group_layer_type must be a GroupLayer_t, got {group_layer_type!r}",
        )
        bottoms = [bottom_name_list] if isinstance(bottom_name_list, str) else list(bottom_name_list)
        tops = [top_name_list] if isinstance(top_name_list, str) else list(top_name_list)
        who = f"GroupDenseLayer {tops!r}"
        _expect(
            all(isinstance(n, str) and n for n in bottoms + tops),
            f"{who}: bottom_name_list and top_name_list must hold non-empty strings",
        )
        _expect(
            len(bottoms) in (1, 2),
            f"{who}: bottom_name_list must name 1 tensor (or 2: the fp16 "
            f"Interaction's output and mask), got {len(bottoms)}",
        )
        outs = list(num_outputs)
        _expect(
            all(isinstance(n, numbers.Integral) and not isinstance(n, bool) and n > 0 for n in outs),
            f"{who}: num_outputs must be positive ints, got {num_outputs!r}",
        )
        _expect(
            len(outs) >= 2,
            f"{who}: there should be at least two layers for GroupDenseLayer (num_outputs has {len(outs)})",
        )
        _expect(
            len(tops) == len(outs),
            f"{who}: top_name_list has {len(tops)} names for {len(outs)} layers (num_outputs); give one top per layer",
        )
        _expect(
            last_act_type in (Activation_t.Relu, Activation_t.Non),
            f"{who}: last_act_type must be Activation_t.Relu or Activation_t.Non, got {last_act_type!r}",
        )
        self.group_layer_type = group_layer_type
        self.bottom_name_list, self.top_name_list = bottoms, tops
        self.num_outputs = [int(n) for n in outs]
        self.last_act_type = last_act_type

    def expand(self) -> list:
        """The DenseLayers HugeCTR adds for this group, in order (HugeCTR's tensor names)."""
        n = len(self.num_outputs)
        # tensor_names[i]: the bottoms of layer i; layer i's tops are tensor_names[i + 1]
        tensor_names = (
            [self.bottom_name_list]
            + [[t, t + "_mask", t + "_dRelu", t + "_db"] for t in self.top_name_list[:-1]]
            + [self.top_name_list[-1:]]
        )
        layers = []
        for i, num_output in enumerate(self.num_outputs):
            pos = FcPosition_t.Head if i == 0 else FcPosition_t.Tail if i == n - 1 else FcPosition_t.Body
            act = self.last_act_type if i == n - 1 else Activation_t.Relu
            layers.append(
                DenseLayer(
                    Layer_t.FusedInnerProduct,
                    tensor_names[i],
                    tensor_names[i + 1],
                    num_output=num_output,
                    pos_type=pos,
                    act_type=act,
                )
            )
        return layers


def _same(a, b) -> bool:
    """Value equality that treats lists and tuples alike ([] == ())."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a is b or (type(a) is type(b) and a == b)


# ---- HugeCTR's embedding sizing (workspace_size_per_gpu_in_mb <-> rows) ----------------------------
def max_vocabulary_size_per_gpu(workspace_mb: float, vec_size: int, n_states: int) -> int:
    """HugeCTR's sizing: floor(workspace_MB * 2^20 / ((1 + n_states) * 4 * vec_size))."""
    return int(math.floor(workspace_mb * 2**20 / ((1 + n_states) * 4 * vec_size)))


def workspace_mb_for(rows: int, vec_size: int, n_states: int) -> int:
    return int(math.ceil(rows * (1 + n_states) * 4 * vec_size / 2**20))


# ---- numbactr's extras -------------------------------------------------------------------------
class TrainingCallback:
    """``hugectr.TrainingCallback``: hooks Model.fit calls (HugeCTR's include/training_callback.hpp).

    Subclass it and pass instances as ``CreateSolver(training_callbacks=[...])``. In fit's iteration mode
    (repeat_dataset=True), as HugeCTR's Model::fit does:

        on_training_start()                    before the first step
        on_eval_start(iter)                    before each evaluation (iter: the 0-based step just trained)
        on_eval_end(iter, {"AUC": ..., ...})   after it, with the metrics; True from any callback stops training
                                               (every callback's on_training_end(iter) is called, then fit returns)
        on_training_end(iter)                  after the last step (iter = max_iter - 1)

    HugeCTR calls none of them in epoch mode (repeat_dataset=False) and none when the AUC target ends the run;
    numbactr does the same. A method a subclass does not define is an error when fit calls it (HugeCTR's are
    pure virtual).
    """

    def on_training_start(self) -> None:
        raise NotImplementedError(f"{type(self).__name__}.on_training_start: a TrainingCallback must define it")

    def on_training_end(self, current_iter: int) -> None:
        raise NotImplementedError(f"{type(self).__name__}.on_training_end: a TrainingCallback must define it")

    def on_eval_start(self, current_iter: int) -> bool:
        raise NotImplementedError(f"{type(self).__name__}.on_eval_start: a TrainingCallback must define it")

    def on_eval_end(self, current_iter: int, eval_results: dict) -> bool:
        raise NotImplementedError(f"{type(self).__name__}.on_eval_end: a TrainingCallback must define it")


@dataclass
class CacheConfig:
    """The fast tier's size and policy.

    policy: "lru" or "lfu". load_factor: the fraction of each table's rows the cache holds (FBGEMM's
    cache_load_factor). budget_bytes: instead, the bytes the cache may use for rows (weights, optimizer
    states, bookkeeping), shared among the tables in proportion to their rows. capacities: instead, the
    slots of each table (1..V_t). min_slots: the least slots any table gets (load factor and budget).
    prefetch_thread: prefetch() stages rows on a worker thread (the next forward waits for it); HugeCTR's
    GLOBAL kinds prefetch synchronously (their pass touches every slot).
    """

    policy: str = "lru"
    load_factor: float | None = 0.2
    budget_bytes: int | None = None
    capacities: list | None = None
    min_slots: int = 1
    prefetch_thread: bool = False


@dataclass
class TierSpec:
    """A tiered table's cache and backing tier in one argument (HugeCTR's SparseEmbedding takes it as its
    numbactr-only `embedding_cache`): cache (CacheConfig), backing ("host", "memmap" or "lmdb"), path (the
    memmap / lmdb directory; None: a temporary one)."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    backing: str = "host"
    path: str | None = None


class HybridEmbeddingParam:
    """``hugectr.HybridEmbeddingParam`` (HugeCTR v23.08's pybind order; the samples pass the eight positionally).

    Defaults are those HugeCTR's JSON reader uses (HugeCTR's Python binding has none). The two
    ``use_*_precompute_indices`` switches (newer HugeCTR) only move index computation into the reader thread;
    they change no result and numbactr accepts and ignores them. ``num_iterations_statistics`` is a
    CreateSolver argument, as in HugeCTR.
    """

    def __init__(
        self,
        max_num_frequent_categories=1,
        max_num_infrequent_samples=-1,
        p_dup_max=0.01,
        max_all_reduce_bandwidth=1.3e11,
        max_all_to_all_bandwidth=1.9e11,
        efficiency_bandwidth_ratio=1.0,
        communication_type=CommunicationType.IB_NVLink,
        hybrid_embedding_type=HybridEmbeddingType.Distributed,
        *,
        use_train_precompute_indices=False,
        use_eval_precompute_indices=False,
    ):
        who = "HybridEmbeddingParam"

        def integer(name, v, lo):
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{who}: {name} must be an integer >= {lo}, got {v!r}")
            return int(v)

        def real(name, v, lo_open, hi=None):
            if (
                not isinstance(v, numbers.Real)
                or isinstance(v, bool)
                or not math.isfinite(v)
                or v <= lo_open
                or (hi is not None and v > hi)
            ):
                rng = f"({lo_open}, {hi}]" if hi is not None else f"({lo_open}, inf)"
                raise ValueError(f"{who}: {name} must be a finite number in {rng}, got {v!r}")
            return float(v)

        self.max_num_frequent_categories = integer("max_num_frequent_categories", max_num_frequent_categories, 0)
        self.max_num_infrequent_samples = integer("max_num_infrequent_samples", max_num_infrequent_samples, -1)
        self.p_dup_max = real("p_dup_max", p_dup_max, 0.0, 1.0)
        self.max_all_reduce_bandwidth = real("max_all_reduce_bandwidth", max_all_reduce_bandwidth, 0.0)
        self.max_all_to_all_bandwidth = real("max_all_to_all_bandwidth", max_all_to_all_bandwidth, 0.0)
        self.efficiency_bandwidth_ratio = real("efficiency_bandwidth_ratio", efficiency_bandwidth_ratio, 0.0)
        if not isinstance(communication_type, CommunicationType):
            raise ValueError(
                f"{who}: communication_type must be a CommunicationType (IB_NVLink_Hier, IB_NVLink, "
                f"NVLink_SingleNode), got {communication_type!r}"
            )
        if not isinstance(hybrid_embedding_type, HybridEmbeddingType):
            raise ValueError(
                f"{who}: hybrid_embedding_type must be HybridEmbeddingType.Distributed, got {hybrid_embedding_type!r}"
            )
        self.communication_type = communication_type
        self.hybrid_embedding_type = hybrid_embedding_type
        self.use_train_precompute_indices = bool(use_train_precompute_indices)
        self.use_eval_precompute_indices = bool(use_eval_precompute_indices)

    def __repr__(self):
        return (
            f"HybridEmbeddingParam({self.max_num_frequent_categories}, {self.max_num_infrequent_samples}, "
            f"{self.p_dup_max}, {self.max_all_reduce_bandwidth}, {self.max_all_to_all_bandwidth}, "
            f"{self.efficiency_bandwidth_ratio}, {self.communication_type!r}, {self.hybrid_embedding_type!r})"
        )
