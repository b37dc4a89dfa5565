"""``hugectr.Model``: build the graph (add), compile, train (fit or the low-level loop), evaluate.

Tensors by name: Input creates the label, dense and sparse-input tensors; every SparseEmbedding and
DenseLayer adds its tops. Shapes are inferred at add() with the per-rank batch B; a wrong name or
shape fails there with a message naming the layer and tensors.

Model is the public face (HugeCTR's names and signatures) and holds the state; the work is done by
numbactr.train's modules, which take the Model: graph (add, compile, summary), step (one training step,
CUDA graphs), overflow (mixed-precision skips, non-finite losses), fit (the loops, the readers' sources)
and io (snapshots). Why a façade: scripts written for HugeCTR see one class, while each part of the
training can be read on its own.
"""

from __future__ import annotations

import numpy as np

from numbactr.config import DataReaderParams, Input, OptParamsPy, Solver
from numbactr.validate import number as _number, warn_ignored
from numbactr.distributed.comm import world
from numbactr.embedding import collection
from numbactr.embedding.sparse_embedding import HashEmbedding
from numbactr.files import checkpoint, graph_json
from numbactr.metrics import MetricAccumulator
from numbactr.optim import LearningRateScheduler
from numbactr.runtime import device
from numbactr import log
from numbactr.train import fit, graph, io, overflow, step
from numbactr.runtime import precision
from numbactr.train import training_cache
from numbactr.train.fit import ReaderHandle
from numbactr.train.graph import ModelError

__all__ = ["Model", "ModelError", "ReaderHandle"]


class Model:
    def __init__(self, solver: Solver, reader_params: DataReaderParams, opt_params: OptParamsPy, etc_params=None):
        if not isinstance(solver, Solver):
            raise ModelError("Model: first argument must come from CreateSolver()")
        if not isinstance(reader_params, DataReaderParams):
            raise ModelError("Model: second argument must be a DataReaderParams")
        if not isinstance(opt_params, OptParamsPy) or not opt_params.initialized:
            raise ModelError("Model: third argument must come from CreateOptimizer()")
        self.solver, self.reader_params, self.opt_params = solver, reader_params, opt_params
        # HugeCTR's embedding training cache (numbactr/train/training_cache.py): checked here, applied as embeddings are added
        self.etc = etc_params
        self._etc_cache = None
        self._etc_inc_files: list[str] = []  # keyset files behind the next get_incremental_model()
        self._etc_reader_keysets_pending = True  # the reader's own keysets not yet added to them
        if etc_params is not None:
            try:
                training_cache.check_model(self, etc_params)
            except training_cache.ETCError as e:
                raise ModelError(str(e)) from None
            self._etc_cache = training_cache.EmbeddingTrainingCache(self)
        else:
            if reader_params.keyset not in ("", [], ()):
                warn_ignored(
                    "DataReaderParams",
                    "keyset",
                    reader_params.keyset,
                    "used only by the embedding training cache (Model(..., CreateETC(...)))",
                    stacklevel=2,
                )
        device.kind()  # announce the device once, up front
        self.comm = world()
        self.ranks = self.comm.size
        log.set_rank(self.comm.rank)
        if solver.batchsize % self.ranks or solver.batchsize_eval % self.ranks:
            raise ModelError(
                f"batchsize {solver.batchsize} / batchsize_eval {solver.batchsize_eval} "
                f"must be divisible by the number of ranks ({self.ranks})"
            )
        self.batch = solver.batchsize // self.ranks
        self.batch_eval = solver.batchsize_eval // self.ranks
        self.rng = np.random.default_rng(solver.seed)
        self.input: Input | None = None
        self.embeddings: list[HashEmbedding] = []
        self.collections: list[collection.EmbeddingCollection] = []  # added EmbeddingCollectionConfigs
        self.layers: list = []  # built Layer objects, add order
        self.shapes: dict[str, tuple] = {}  # tensor name -> full shape (B first)
        self.sparse_inputs: dict[str, int] = {}  # sparse input name -> index in the batch
        self.compiled = False
        self.lr = solver.lr
        self.lr_scheduler = LearningRateScheduler(
            solver.lr, solver.warmup_steps, solver.decay_start, solver.decay_steps, solver.decay_power, solver.end_lr
        )
        self.dense_frozen = False
        self.step = 0
        self._current_loss = float("nan")
        # gpu/sim: the step's losses kept on the device (one array: the k losses, on several ranks summed
        # over them there, then the regularizer terms) with their weights, read only when current_loss is
        # asked for (display, evaluation, a user's call)
        self._pending_loss = None
        self.metrics = MetricAccumulator(
            solver.metrics_spec, solver.metrics_k, solver.eval_group_size, solver.eval_group_slot
        )
        self._train_reader = self._eval_reader = None
        self.history = {"iter": [], "loss": [], "lr": [], "eval_iter": [], "auc": []}
        self._last_tensors: dict[bool, dict] = {}  # training? -> the last forward's tensors by name
        self._fused_tops, self._last_fused = {}, {}  # InnerProduct tops fused with their ReLU (compile)
        self._stager = None  # numbactr.data.staging.DeviceStager, made when used
        self._graphs = None  # numbactr.train.cuda_graphs.StepGraphs, made when used
        self._plans: dict = {}  # numbactr.train.plan: StepPlan (None: not plannable) by plan key
        self._plan_why = None  # why the last step was not planned (None: it was, or no step yet)
        self._last_eval = None  # (predictions, labels) of the last eval batch
        # mixed precision (numbactr/runtime/precision.py): the activations' half dtype, None in float32
        self.half = precision.half_dtype(solver)
        self._skipped = 0  # mixed-precision steps skipped for overflow (read)
        self._skips_dev = None  # (1,) device count of steps skipped on the device
        self._skips_seen = 0  # the part of it already in _skipped
        if self.half is not None and self.half != np.float16 and device.kind() == "gpu":
            raise ModelError(
                "Model: mixed_precision_dtype='bfloat16' runs on the cpu and sim devices only "
                "(CuPy has no bfloat16 arrays); use 'float16' on a GPU"
            )
        self._tf32 = None  # the gpu device: TF32 as asked (set before each step)
        if device.kind() == "gpu":
            self._tf32 = bool(solver.enable_tf32_compute)
            said = precision.set_tf32(self._tf32)
            if said:
                log.info(said)

    # ---- graph ---------------------------------------------------------------------------------
    def add(
        self,
        item=None,
        *,
        input=None,
        sparse_embedding=None,
        dense_layer=None,  # noqa: A002 (HugeCTR's
        group_dense_layer=None,
        ebc_config=None,
    ) -> None:  # keyword names, one per overload)
        """One Input, SparseEmbedding, EmbeddingCollectionConfig, DenseLayer or GroupDenseLayer."""
        graph.add(self, item, input, sparse_embedding, dense_layer, group_dense_layer, ebc_config)

    def compile(self, loss_names=None, loss_weights=None) -> None:
        """The losses (with their weights), the flat weight vector and the dense optimizer."""
        graph.compile(self, loss_names, loss_weights)
        if self.solver.eval_group_slot is not None and self.input is not None:  # a clear error now, not at eval
            total = sum(sp.slot_num for sp in self.input.sparse)
            if self.solver.eval_group_slot >= total:
                raise ModelError(
                    f"CreateSolver(eval_group_slot={self.solver.eval_group_slot}): the Input has {total} "
                    f"sparse slots (0..{total - 1}, over its sparse inputs in order)"
                )

    def summary(self) -> None:
        graph.summary(self)

    def graph_to_json(self, graph_config_file: str) -> None:
        """Write HugeCTR's graph JSON (spec §7.4), auto-Slice layers included. An EmbeddingCollection is
        not written, as HugeCTR's writer writes none (its tables are saved by embedding_dump)."""
        if self.input is None:
            raise ModelError("Model.graph_to_json: the model is empty")
        graph_json.write(self, graph_config_file)

    def construct_from_json(self, graph_config_file: str, include_dense_network: bool) -> None:
        """Add the Input, embeddings and (with include_dense_network) dense layers of a graph JSON."""
        graph_json.construct(self, graph_config_file, include_dense_network)

    # ---- data ----------------------------------------------------------------------------------
    def _make_reader(self, source: str, batch: int, repeat: bool, eval: bool = False):  # noqa: A002
        """A reader of this rank's rows of GLOBAL batches of `batch` samples (graph.make_reader; kept on the
        Model for numbactr.bench, which reads its batches through it)."""
        return graph.make_reader(self, source, batch, repeat, eval)

    def start_data_reading(self) -> None:
        step.start_data_reading(self)

    def set_source(self, source, keyset=None, eval_source=None) -> None:
        """Epoch mode: read these file lists from now on (the next train()/eval() start a fresh pass).

        HugeCTR's two forms: ``set_source(source: str, eval_source: str)`` (epoch mode), and with the
        embedding training cache ``set_source(source: list, keyset: list, eval_source: str)``."""
        fit.set_source(self, source, keyset, eval_source)

    def get_data_reader_train(self) -> ReaderHandle:
        return ReaderHandle(self, train=True)

    def get_data_reader_eval(self) -> ReaderHandle:
        return ReaderHandle(self, train=False)

    # ---- the embedding training cache (numbactr/train/training_cache.py) ---------------------------
    def get_embedding_training_cache(self) -> "training_cache.EmbeddingTrainingCache":
        if self.etc is None:
            raise ModelError(
                "Model.get_embedding_training_cache: the model has no embedding training cache "
                "(Model(solver, reader, optimizer, CreateETC(...)))"
            )
        return self._etc_cache

    def dump_incremental_model_2kafka(self) -> None:
        """HugeCTR sends the rows changed since the last call to the Kafka brokers of CreateSolver(kafka_brockers)
        for its inference parameter server. numbactr has no Kafka producer: refused with what to do instead."""
        raise ModelError(
            "Model.dump_incremental_model_2kafka: numbactr cannot send to Kafka (no Kafka producer; "
            "CreateSolver's kafka_brockers is ignored). Get the changed rows with "
            "Model.get_incremental_model() and write them to the parameter server's databases "
            "(numbactr.inference: the HPS's Redis / RocksDB backends)"
        )

    def get_incremental_model(self) -> list:
        """ETC: per embedding, (keys (n,) int64, vectors (n, D) float32) of the keys in the keyset files
        of the sources trained since the last call (this rank's part of the table)."""
        return fit.get_incremental_model(self)

    # ---- training and evaluation ---------------------------------------------------------------
    #: how many steps a GPU run goes between reads of its non-finite flag (when no loss is read per step)
    NONFINITE_CHECK_EVERY = 64

    def train(self) -> bool:
        """One training iteration; False when an epoch-mode reader is exhausted."""
        if self._tf32 is not None:  # TF32 as this model asked (another may have changed it)
            precision.set_tf32(self._tf32)
        with device.held_choices():  # the ops' device choices read once per step
            return step.train(self)

    def eval(self) -> bool:
        """One evaluation batch; accumulates metrics. False at the end of an epoch-mode eval source."""
        if self._tf32 is not None:
            precision.set_tf32(self._tf32)
        with device.held_choices():
            return fit.eval_batch(self)

    def fit(
        self,
        num_epochs: int = 0,
        max_iter: int = 2000,
        display: int = 200,
        eval_interval: int = 1000,
        snapshot: int = 10000,
        snapshot_prefix: str = "",
    ) -> None:
        """HugeCTR's training loop (spec §4.1): non-epoch mode when the Solver repeats the dataset."""
        fit.fit(self, num_epochs, max_iter, display, eval_interval, snapshot, snapshot_prefix)

    def eval_whole_source(self) -> list[tuple[str, float]]:
        """numbactr extra: evaluate every sample of the eval source exactly once; returns the metrics."""
        return fit.eval_whole_source(self)

    def check_deferred(self) -> None:
        """Raise what the embeddings recorded on the device since the last check instead of reading it back in
        every step (gpu/sim, every rank its own: a FATAL bounds check, a full hash table, a reserved key; see
        SparseEmbedding.check_pending), and count the mixed-precision steps skipped on the device
        (overflow.sync_skips). Called every NONFINITE_CHECK_EVERY steps, at evaluation, snapshots and the end
        of fit; nothing is read when nothing was deferred."""
        for emb in self.embeddings:
            check = getattr(emb, "check_pending", None)
            if check is not None:
                check()
        overflow.sync_skips(self)

    @property
    def current_loss(self) -> float:
        """The last training step's reported loss; a loss kept on the device is read here, once."""
        return step.read_loss(self)

    @current_loss.setter
    def current_loss(self, value: float) -> None:
        self._pending_loss = None
        self._current_loss = value

    @property
    def skipped_steps(self) -> int:
        """Mixed-precision steps whose update was skipped because a gradient overflowed (reads the device
        count when skips are decided there)."""
        overflow.sync_skips(self)
        return self._skipped

    def get_current_loss(self) -> float:
        return self.current_loss

    def get_eval_metrics(self) -> list[tuple[str, float]]:
        return self.metrics.finalize()

    def export_predictions(self, output_prediction_file_name: str, output_label_file_name: str) -> None:
        """HugeCTR's export of the last evaluated batch's predictions and labels (fit.export_predictions)."""
        fit.export_predictions(self, output_prediction_file_name, output_label_file_name)

    def check_out_tensor(self, tensor_name: str, tensor_type) -> np.ndarray:
        """A host float32 copy of tensor ``tensor_name`` as the last training step (Tensor_t.Train) or
        evaluation batch (Tensor_t.Evaluate) computed it (fit.check_out_tensor)."""
        return fit.check_out_tensor(self, tensor_name, tensor_type)

    # ---- learning rate, frozen parts -----------------------------------------------------------
    def get_learning_rate_scheduler(self) -> LearningRateScheduler:
        return self.lr_scheduler

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the next steps (dense layers and embeddings): a finite number >= 0."""
        self.lr = float(_number("Model.set_learning_rate", "lr", lr, 0.0))

    def reset_learning_rate_scheduler(
        self, base_lr, warmup_steps=1, decay_start=0, decay_steps=1, decay_power=2.0, end_lr=0.0
    ) -> None:
        self.lr_scheduler = LearningRateScheduler(base_lr, warmup_steps, decay_start, decay_steps, decay_power, end_lr)

    def freeze_dense(self) -> None:
        self.dense_frozen = True

    def unfreeze_dense(self) -> None:
        self.dense_frozen = False

    def freeze_embedding(self, embedding_name: str | None = None) -> None:
        for e in self._embeddings_named(embedding_name):
            e.frozen = True

    def unfreeze_embedding(self, embedding_name: str | None = None) -> None:
        for e in self._embeddings_named(embedding_name):
            e.frozen = False

    def _embeddings_named(self, name):
        found = [e for e in self.embeddings if name is None or e.name == name]
        if name is not None and not found:
            raise ModelError(f"no embedding named {name!r}; embeddings: {[e.name for e in self.embeddings]}")
        return found

    # ---- files (layouts: numbactr/files/checkpoint.py) -------------------------------------------
    def save_params_to_files(self, prefix: str, iter: int = 0) -> None:  # noqa: A002 (HugeCTR's name)
        """Dense weights and optimizer states, one folder per embedding (spec §7.1-§7.3), plus a manifest,
        committed as one unit: a save killed at any point leaves the previous snapshot loadable. Every
        rank calls it and returns once all files exist."""
        io.save_params(self, prefix, iter)

    def embedding_dump(self, path: str, table_names=()) -> None:
        """HugeCTR's EmbeddingCollection dump: every named table ([] = all) into folder ``path``
        (numbactr.embedding.collection: layout, atomic commit). Every rank calls it."""
        graph.require_compiled(self, "embedding_dump")
        collection.dump(self.collections, self.comm, path, table_names, i64_keys=self.solver.i64_input_key)

    def embedding_load(self, path: str, table_names=()) -> None:
        """Load the named tables ([] = all) from an embedding_dump folder; checked before anything changes."""
        graph.require_compiled(self, "embedding_load")
        io.before_load(self)
        collection.load(self.collections, path, table_names)

    def load_dense_weights(self, dense_model_file: str, allow_missing_ntp: bool = False) -> None:
        """Dense weights and, with BatchNorm layers, their running statistics from
        ``dense_model_file + ".ntp.json"``: a missing .ntp.json is an error unless ``allow_missing_ntp``
        (numbactr's extra argument), which keeps the current running statistics. Every load_* checks
        all its input before it changes anything, so a failed load leaves the model as it was."""
        graph.require_compiled(self, "load_dense_weights")
        io.before_load(self)
        checkpoint.load_dense_weights(self, dense_model_file, allow_missing_ntp)

    def load_dense_optimizer_states(self, dense_opt_states_file: str) -> None:
        graph.require_compiled(self, "load_dense_optimizer_states")
        io.before_load(self)
        checkpoint.load_dense_optimizer_states(self, dense_opt_states_file)

    def load_sparse_weights(self, sparse_embedding_files=None, *, sparse_embedding_files_map=None) -> None:
        """A list (one folder per embedding, add order) or a dict {sparse_embedding_name: folder} (HugeCTR's
        keyword for the dict: sparse_embedding_files_map). Keys go to the rank that owns them on this run's
        rank count (key % R, or slot % R from slot_id)."""
        sparse_embedding_files = io.one_of(
            "load_sparse_weights",
            sparse_embedding_files=sparse_embedding_files,
            sparse_embedding_files_map=sparse_embedding_files_map,
        )
        graph.require_compiled(self, "load_sparse_weights")
        io.before_load(self)
        checkpoint.load_sparse_weights(self, sparse_embedding_files)

    def load_sparse_optimizer_states(self, sparse_opt_states_files=None, *, sparse_opt_states_files_map=None) -> None:
        """Like load_sparse_weights (the dict also as sparse_opt_states_files_map); each key's states go to the
        row that holds the key now, so load the matching sparse weights first."""
        sparse_opt_states_files = io.one_of(
            "load_sparse_optimizer_states",
            sparse_opt_states_files=sparse_opt_states_files,
            sparse_opt_states_files_map=sparse_opt_states_files_map,
        )
        graph.require_compiled(self, "load_sparse_optimizer_states")
        io.before_load(self)
        checkpoint.load_sparse_optimizer_states(self, sparse_opt_states_files)
