"""CreateSolver / Solver, DataReaderParams, CreateOptimizer / OptParamsPy, and the TrainingCallback a solver
takes: what a whole training run is configured with (spec §1, §2.1, §3.1)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from numbactr.data.raw_async import AsyncParam
from numbactr.data.source import DataSourceParams
from numbactr.enums import (
    Check_t,
    DataReaderType_t,
    LrPolicy_t,
    MetricsType,
    Optimizer_t,
    Update_t,
)
from numbactr.metrics import GROUPED
from numbactr.validate import warn_ignored
from numbactr.validate import expect as _expect, number as _number
from numbactr.config.checks import _flag, _sizes


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
    # numbactr only: the cutoff K of MetricsType.HitRateAtK / NDCGAtK, and the groups (users) that they and
    # GroupAUC score: every eval_group_size consecutive eval rows, or the rows sharing the key of sparse slot
    # eval_group_slot (numbered over all sparse inputs, as the data file lays them out). The metrics_spec value
    # of numbactr's metrics is not used (HugeCTR's is a threshold: AUC's stops training when exceeded)
    metrics_k: int = 10
    eval_group_size: int = 0
    eval_group_slot: Any = None
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
    _check_groups(s)
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


def _check_groups(s: Solver) -> None:
    """metrics_k, eval_group_size, eval_group_slot: consistent with each other and with metrics_spec."""
    who = "CreateSolver"
    _number(who, "metrics_k", s.metrics_k, 1, integer=True)
    _number(who, "eval_group_size", s.eval_group_size, 0, integer=True)
    if s.eval_group_slot is not None:
        _number(who, "eval_group_slot", s.eval_group_slot, 0, integer=True)
    _expect(
        not (s.eval_group_size and s.eval_group_slot is not None),
        f"CreateSolver: give eval_group_size ({s.eval_group_size}) or eval_group_slot ({s.eval_group_slot}), "
        "not both: the groups are either blocks of consecutive eval rows or the rows sharing a slot's key",
    )
    grouped = [f"MetricsType.{m.name}" for m in GROUPED if m in s.metrics_spec]
    _expect(
        not grouped or s.eval_group_size or s.eval_group_slot is not None,
        f"CreateSolver: metrics_spec asks for {', '.join(grouped)}, which score groups of eval rows (users): "
        "give eval_group_size=N (every N consecutive eval rows are one group, e.g. 100 for a held-out "
        "positive and its 99 sampled negatives) or eval_group_slot=S (the key of sparse slot S is the "
        "row's group, e.g. the user id)",
    )
    if s.eval_group_size and s.batchsize_eval % s.eval_group_size:
        fit = max(1, s.batchsize_eval // s.eval_group_size) * s.eval_group_size
        _expect(
            False,
            f"CreateSolver: batchsize_eval ({s.batchsize_eval}) must be a multiple of eval_group_size "
            f"({s.eval_group_size}): every evaluation goes on where the last stopped, and must start on a "
            f"group boundary (e.g. batchsize_eval={fit})",
        )


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
    source, eval_source, check_type), which HugeCTR itself would refuse, is read that way too.

    source: a file list, or a list of them. Without the embedding training cache every list is read, in
    order, as one data set (HugeCTR reads source[0] alone there); with it, fit trains on each list in turn
    after loading its keyset. eval_source: one file list (a string, as in HugeCTR)."""

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
            "DataReaderParams: eval_source must be one non-empty file-list path (a string, as in HugeCTR), got "
            f"{self.eval_source!r}; to evaluate on several lists, write one file list naming all their files "
            "(numbactr.data.file_list.write_file_list)",
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
