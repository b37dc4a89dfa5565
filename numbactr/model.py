"""``hugectr.Model``: build the graph (add), compile, train (fit or the low-level loop), evaluate.

Tensors by name: Input creates the label, dense and sparse-input tensors; every SparseEmbedding and
DenseLayer adds its tops. Shapes are inferred at add() with the per-rank batch B; a wrong name or
shape fails there with a message naming the layer and tensors.
"""
from __future__ import annotations

import math
import time

import numpy as np

from numbactr.files import checkpoint, graph_json
from numbactr import hugectr_exact as compat, ops
from numbactr.runtime import device
from numbactr import log
from numbactr.train import training_cache as etc
from numbactr.runtime import precision
from numbactr.autograd import Tape, Tensor
from numbactr.autograd.tape import autocast
from numbactr.distributed.comm import world
from numbactr.data import staging
from numbactr.config import (DataReaderParams, DenseLayer, GroupDenseLayer, Input, OptParamsPy, Solver, SparseEmbedding,
                     _number, warn_ignored)
from numbactr.embedding import collection as ebc
from numbactr.embedding.factory import make_embedding
from numbactr.embedding.sparse_embedding import HashEmbedding, OneHotEmbedding
from numbactr.enums import Embedding_t, MetricsType, Tensor_t
from numbactr.layers import LayerError, RunInfo, build
from numbactr.metrics import MetricAccumulator
from numbactr.optim import DenseOptimizer, LearningRateScheduler


class ModelError(ValueError):
    """The model graph or its use is wrong; the message names the offending layer or tensor."""


class Model:
    def __init__(self, solver: Solver, reader_params: DataReaderParams, opt_params: OptParamsPy,
                 etc_params=None):
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
        self._etc_inc_files: list[str] = []           # keyset files behind the next get_incremental_model()
        self._etc_reader_keysets_pending = True        # the reader's own keysets not yet added to them
        if etc_params is not None:
            try:
                etc.check_model(self, etc_params)
            except etc.ETCError as e:
                raise ModelError(str(e)) from None
            self._etc_cache = etc.EmbeddingTrainingCache(self)
        else:
            if len(reader_params.source) > 1:
                warn_ignored("DataReaderParams", "source[1:]", reader_params.source[1:], "only source[0] is read "
                             "(HugeCTR reads the others only with the embedding training cache, Model(..., "
                             "CreateETC(...))); use Model.set_source for epochs", stacklevel=2)
            if reader_params.keyset not in ("", [], ()):
                warn_ignored("DataReaderParams", "keyset", reader_params.keyset, "used only by the embedding "
                             "training cache (Model(..., CreateETC(...)))", stacklevel=2)
        device.kind()                                  # announce the device once, up front
        self.comm = world()
        self.ranks = self.comm.size
        log.set_rank(self.comm.rank)
        if solver.batchsize % self.ranks or solver.batchsize_eval % self.ranks:
            raise ModelError(f"batchsize {solver.batchsize} / batchsize_eval {solver.batchsize_eval} "
                             f"must be divisible by the number of ranks ({self.ranks})")
        self.batch = solver.batchsize // self.ranks
        self.batch_eval = solver.batchsize_eval // self.ranks
        self.rng = np.random.default_rng(solver.seed)
        self.input: Input | None = None
        self.embeddings: list[HashEmbedding] = []
        self.collections: list[ebc.EmbeddingCollection] = []     # added EmbeddingCollectionConfigs
        self.layers: list = []                         # built Layer objects, add order
        self.shapes: dict[str, tuple] = {}             # tensor name -> full shape (B first)
        self.sparse_inputs: dict[str, int] = {}        # sparse input name -> index in the batch
        self.compiled = False
        self.lr = solver.lr
        self.lr_scheduler = LearningRateScheduler(solver.lr, solver.warmup_steps, solver.decay_start,
                                                  solver.decay_steps, solver.decay_power, solver.end_lr)
        self.dense_frozen = False
        self.step = 0
        self._current_loss = float("nan")
        # gpu/sim: the step's losses kept on the device (one array: the k losses, on several ranks summed
        # over them there, then the regularizer terms) with their weights, read only when current_loss is
        # asked for (display, evaluation, a user's call)
        self._pending_loss = None
        self.metrics = MetricAccumulator(solver.metrics_spec)
        self._train_reader = self._eval_reader = None
        self.history = {"iter": [], "loss": [], "lr": [], "eval_iter": [], "auc": []}
        self._last_tensors: dict[bool, dict] = {}      # training? -> the last forward's tensors by name
        self._fused_tops, self._last_fused = {}, {}       # InnerProduct tops fused with their ReLU (compile)
        self._stager = None                            # numbactr.data.staging.DeviceStager, made when used
        self._graphs = None                            # numbactr.train.cuda_graphs.StepGraphs, made when used
        self._last_eval = None                         # (predictions, labels) of the last eval batch
        # mixed precision (numbactr/runtime/precision.py): the activations' half dtype, None in float32
        self.half = precision.half_dtype(solver)
        self._skipped = 0                              # mixed-precision steps skipped for overflow (read)
        self._skips_dev = None                         # (1,) device count of steps skipped on the device
        self._skips_seen = 0                           # the part of it already in _skipped
        if self.half is not None and self.half != np.float16 and device.kind() == "gpu":
            raise ModelError("Model: mixed_precision_dtype='bfloat16' runs on the cpu and sim devices only "
                             "(CuPy has no bfloat16 arrays); use 'float16' on a GPU")
        self._tf32 = None                              # the gpu device: TF32 as asked (set before each step)
        if device.kind() == "gpu":
            self._tf32 = bool(solver.enable_tf32_compute)
            said = precision.set_tf32(self._tf32)
            if said:
                log.info(said)

    # ---- graph construction --------------------------------------------------------------------
    def add(self, item=None, *, input=None, sparse_embedding=None, dense_layer=None,  # noqa: A002 (HugeCTR's
            group_dense_layer=None, ebc_config=None) -> None:                   # keyword names, one per overload)
        given = [x for x in (item, input, sparse_embedding, dense_layer, group_dense_layer, ebc_config)
                 if x is not None]
        if len(given) != 1:
            raise ModelError(f"Model.add takes one Input, SparseEmbedding, DenseLayer, GroupDenseLayer or "
                             f"EmbeddingCollectionConfig, got {len(given)}")
        item = given[0]
        if self.compiled:
            raise ModelError("Model.add: the model is already compiled")
        if isinstance(item, Input):
            return self._add_input(item)
        if self.input is None:
            raise ModelError(f"Model.add({type(item).__name__}): add the Input first")
        if isinstance(item, SparseEmbedding):
            return self._add_embedding(item)
        if isinstance(item, ebc.EmbeddingCollectionConfig):
            return self._add_collection(item)
        if isinstance(item, DenseLayer):
            return self._add_dense(item)
        if isinstance(item, GroupDenseLayer):
            return self._add_group(item)
        raise ModelError(f"Model.add: cannot add a {type(item).__name__}; expected Input, SparseEmbedding, "
                         "DenseLayer or GroupDenseLayer")

    def _new_tensor(self, name: str, shape: tuple, who: str) -> None:
        if name in self.shapes:
            raise ModelError(f"{who}: top tensor name {name!r} already exists")
        self.shapes[name] = tuple(int(d) for d in shape)

    def _add_input(self, inp: Input) -> None:
        if self.input is not None:
            raise ModelError("Model.add(Input): the model already has an Input")
        self.input = inp
        # The reader delivers one combined label block; its columns go to the label names in
        # alphabetical order of the names (HugeCTR's std::map, spec §4.2 / §10.13).
        self.label_columns = {}
        col = 0
        for i in sorted(range(len(inp.label_names)), key=lambda i: inp.label_names[i]):
            self.label_columns[inp.label_names[i]] = (col, col + inp.label_dims[i])
            col += inp.label_dims[i]
        for name, dim in zip(inp.label_names, inp.label_dims):
            self._new_tensor(name, (self.batch, dim), "Input label")
        self._new_tensor(inp.dense_name, (self.batch, inp.dense_dim), "Input dense")
        for i, p in enumerate(inp.sparse):
            self._new_tensor(p.top_name, (self.batch, p.slot_num), "Input sparse")
            self.sparse_inputs[p.top_name] = i

    def _add_embedding(self, cfg: SparseEmbedding) -> None:
        who = f"SparseEmbedding {cfg.sparse_embedding_name!r}"
        if self.layers:
            raise ModelError(f"{who}: embeddings must be added before dense layers")
        if cfg.bottom_name not in self.sparse_inputs:
            raise ModelError(f"{who}: bottom_name {cfg.bottom_name!r} is not a sparse input; sparse inputs: "
                             f"{sorted(self.sparse_inputs)}")
        if any(e.cfg.bottom_name == cfg.bottom_name for e in self.embeddings):
            raise ModelError(f"{who}: sparse input {cfg.bottom_name!r} already feeds an embedding")
        param = self.input.sparse[self.sparse_inputs[cfg.bottom_name]]
        opt = cfg.optimizer if cfg.optimizer.initialized else self.opt_params
        if self.etc is not None:          # a Cached parameter server: the table tiered on the local path
            tier = etc.tier_for(self.etc, len(self.embeddings), self.comm.rank, self.comm.size)
            if tier is not None:
                cfg.embedding_cache = tier
        emb = make_embedding(cfg, param, opt, self.solver.seed, self.comm)
        if cfg.embedding_type == Embedding_t.HybridSparseEmbedding:
            emb.statistics_source = self._hybrid_statistics       # read at its first lookup
        self._new_tensor(cfg.sparse_embedding_name, emb.output_shape(self.batch), who)
        self.embeddings.append(emb)

    def _hybrid_statistics(self, emb) -> None:
        """A HybridSparseEmbedding's split from the first num_iterations_statistics global batches of the
        training source (this rank's rows of each), read by a reader of their own so the training stream
        starts from its first batch (HugeCTR reads them when the model is built)."""
        n = self.solver.num_iterations_statistics
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ModelError(f"CreateSolver: num_iterations_statistics must be an integer >= 0, got {n!r}")
        reader = self._make_reader(self.reader_params.source[0], self.solver.batchsize, False)
        batches = []
        try:
            for batch in iter(reader):
                if len(batches) >= n:
                    break
                keys, offsets = batch.sparse[self.sparse_inputs[emb.cfg.bottom_name]]
                batches.append((keys, offsets, batch.size))
        finally:
            close = getattr(reader, "close", None)
            if close is not None:
                close()
        emb.take_statistics(batches, self.solver.batchsize, n)

    def _add_collection(self, cfg) -> None:
        """An EmbeddingCollectionConfig: its tables on this job's ranks, its lookups' tops."""
        who = f"EmbeddingCollection{len(self.collections)}"
        if not self.solver.use_embedding_collection:
            raise ModelError(f"Model.add({who}): needs CreateSolver(use_embedding_collection=True), as in HugeCTR")
        if self.layers:
            raise ModelError(f"{who}: embeddings must be added before dense layers")
        taken = {t.name for c in self.collections for t in c.tables}
        dup = sorted(taken & {t.name for t in cfg.tables})
        if dup:
            raise ModelError(f"{who}: table name(s) {dup} are already in another EmbeddingCollection")
        params = {p.top_name: p for p in self.input.sparse}
        try:
            coll = ebc.EmbeddingCollection(cfg, len(self.collections), params, self.opt_params, self.solver.seed,
                                           self.comm)
        except ebc.CollectionError as e:
            raise ModelError(str(e)) from None
        for name, shape in coll.tops(self.batch):
            self._new_tensor(name, shape, who)
        self.collections.append(coll)

    def _add_dense(self, cfg: DenseLayer) -> None:
        who = f"DenseLayer {cfg.layer_type.name} (top {cfg.top_names})"
        for b in cfg.bottom_names:
            if b not in self.shapes:
                raise ModelError(f"{who}: bottom tensor {b!r} does not exist; known tensors: {sorted(self.shapes)}")
            if b in self.sparse_inputs:
                raise ModelError(f"{who}: bottom {b!r} is a sparse input; feed it through a SparseEmbedding")
        try:
            layer = build(cfg, [self.shapes[b] for b in cfg.bottom_names])
        except LayerError as e:
            raise ModelError(str(e)) from None
        if len(layer.out_shapes) != len(cfg.top_names):
            raise ModelError(f"{who}: produces {len(layer.out_shapes)} tensors, {len(cfg.top_names)} top names given")
        for t, s in zip(cfg.top_names, layer.out_shapes):
            self._new_tensor(t, s, who)
        self.layers.append(layer)

    def _add_group(self, group: GroupDenseLayer) -> None:
        """Add the layers the group expands into (HugeCTR's names), all or none: a layer that fails
        leaves the model as it was before the group."""
        n_layers, tensors = len(self.layers), set(self.shapes)
        try:
            for cfg in group.expand():
                self._add_dense(cfg)
        except ModelError as e:
            del self.layers[n_layers:]
            for t in set(self.shapes) - tensors:
                del self.shapes[t]
            raise ModelError(f"GroupDenseLayer {group.group_layer_type.name} (tops {group.top_name_list}): "
                             f"{e}") from None

    # ---- compile -------------------------------------------------------------------------------
    def compile(self, loss_names=None, loss_weights=None) -> None:
        if self.compiled:
            raise ModelError("Model.compile: already compiled")
        if self.input is None:
            raise ModelError("Model.compile: the model has no Input")
        if len(self.layers) + len(self.embeddings) + len(self.collections) < 2:
            raise ModelError("Model.compile: a model needs at least two layers")
        losses = [layer for layer in self.layers if layer.is_loss]
        if not losses:
            raise ModelError("Model.compile: the model has no loss layer")
        for layer in losses:               # swapped bottoms would train nothing and report no error
            pred, label = layer.cfg.bottom_names
            if label not in self.input.label_names or pred in self.input.label_names:
                raise ModelError(f"Model.compile: {layer.type_name} (top {layer.cfg.top_names[0]!r}) has bottoms "
                                 f"{layer.cfg.bottom_names}; they must be [prediction, label] with the label one "
                                 f"of the Input's label tensors {self.input.label_names}"
                                 + (" (the two look swapped)" if pred in self.input.label_names else ""))
        by_label = {layer.cfg.bottom_names[1]: layer for layer in losses}
        if loss_names is not None or loss_weights is not None:
            loss_names, loss_weights = list(loss_names or []), list(loss_weights or [])
            if len(loss_names) != len(loss_weights):
                raise ModelError(f"Model.compile: {len(loss_names)} loss_names but {len(loss_weights)} loss_weights")
            missing = [n for n in loss_names if n not in by_label]
            if missing:
                raise ModelError(f"Model.compile: loss_names {missing} are not the label (second bottom) of any "
                                 f"loss layer; loss labels: {sorted(by_label)}")
            weights = dict(zip(loss_names, loss_weights))
        else:
            weights = dict(zip(self.input.label_names, self.input.label_weights))
        self.losses = [(layer, float(weights.get(layer.cfg.bottom_names[1], 1.0))) for layer in losses]
        self.loss_layer = losses[0]
        # one flat float32 weight vector, layer order, each layer's weights in index order (spec §7.2)
        shapes = [(layer, s) for layer in self.layers for s in layer.param_shapes()]
        self.n_params = sum(math.prod(s) for _, s in shapes)
        host = np.empty(self.n_params, np.float32)
        off = 0
        for layer in self.layers:
            for s, init in zip(layer.param_shapes(), layer.init_params(self.rng)):
                n = math.prod(s)
                host[off:off + n] = np.asarray(init, np.float32).reshape(-1)
                off += n
        xp = device.xp()
        self.weights = xp.asarray(host)
        self.wgrads = xp.zeros_like(self.weights)
        off = 0
        for layer in self.layers:
            layer.params, layer.grad_views = [], []
            for i, s in enumerate(layer.param_shapes()):
                n = math.prod(s)
                layer.params.append(Tensor(self.weights[off:off + n].reshape(s), requires_grad=True,
                                           name=f"{layer.cfg.top_names[0]}.w{i}"))
                layer.grad_views.append(self.wgrads[off:off + n].reshape(s))
                off += n
        self.dense_optimizer = DenseOptimizer(self.opt_params, self.n_params)
        used = {b for layer in self.layers for b in layer.cfg.bottom_names}
        used |= {e.cfg.bottom_name for e in self.embeddings}
        used |= {b for c in self.collections for b in c.bottoms}
        loss_tops = {layer.cfg.top_names[0] for layer, _ in self.losses}
        self.unused_tensors = [t for t in self.shapes if t not in used and t not in loss_tops]
        self._fuse_bias_relu()
        if self.etc is not None:          # one PS per embedding; existing sparse models are trained further
            try:
                etc.check_embeddings(self, self.etc)
            except etc.ETCError as e:
                raise ModelError(str(e)) from None
        self.compiled = True
        if self.etc is not None:
            etc.load_existing(self, self.etc)

    def _fuse_bias_relu(self) -> None:
        """Pair each InnerProduct (2-D) whose output only a ReLU reads with that ReLU: on gpu and sim the
        InnerProduct then runs bias + ReLU in one epilogue kernel each way (FusedInnerProduct's) and the ReLU
        passes its input on (numbactr.ops.fuse_bias_relu); its output tensor is then not kept."""
        readers: dict[str, list] = {}
        for layer in self.layers:
            for b in layer.cfg.bottom_names:
                readers.setdefault(b, []).append(layer)
        taken = {e.cfg.bottom_name for e in self.embeddings} | {b for c in self.collections for b in c.bottoms}
        self._fused_tops, self._last_fused = {}, {}
        for layer in self.layers:
            if layer.type_name != "InnerProduct" or len(layer.in_shapes[0]) != 2:
                continue
            top = layer.cfg.top_names[0]
            after = readers.get(top, [])
            if len(after) == 1 and after[0].type_name == "ReLU" and top not in taken:
                layer.relu_after, after[0].fused_into = after[0], layer
                self._fused_tops[top] = after[0].cfg.top_names[0]

    # ---- summary -------------------------------------------------------------------------------
    def summary(self) -> None:
        line = "—" * 116
        inp = self.input
        out = ["=" * 51 + "Model Summary" + "=" * 53,
               "Model structure on each GPU",
               f"{'Label':<40}{'Dense':<30}{'Sparse':<30}",
               f"{','.join(inp.label_names):<40}{inp.dense_name:<30}{','.join(p.top_name for p in inp.sparse):<30}",
               f"{','.join(_fmt(self.shapes[n]) for n in inp.label_names):<40}{_fmt(self.shapes[inp.dense_name]):<30}",
               line, f"{'Layer Type':<40}{'Input Name':<30}{'Output Name':<30}{'Output Shape':<30}", line]
        rows = [(e.cfg.embedding_type.name, [e.cfg.bottom_name], [e.name]) for e in self.embeddings]
        rows += [(c.name, c.bottoms, [n for n, _ in c.tops(0)]) for c in self.collections]
        # dense layers as HugeCTR lists them, with the Slice copies it inserts for tensors read twice
        shapes = dict(self.shapes)
        for d in graph_json.slice_expanded(self) if self.input is not None else []:
            bottoms, tops = _names(d["bottom"]), _names(d["top"])
            if d["type"] == "Slice" and len(set(bottoms)) == 1 and all(t.startswith(bottoms[0] + "_slice") for t in tops):
                shapes.update({t: shapes[bottoms[0]] for t in tops})
            rows.append((d["type"], bottoms, tops))
        for kind, bottoms, tops in rows:
            for i in range(max(len(bottoms), len(tops))):
                b = bottoms[i] if i < len(bottoms) else ""
                t = tops[i] if i < len(tops) else ""
                shape = _fmt(shapes[t]) if t and t in shapes and not kind.endswith("Loss") else ""
                out.append(f"{kind if i == 0 else '':<40}{b:<30}{t:<30}{shape:<30}".rstrip())
            out.append("-" * 116)
        print("\n".join(out), flush=True)

    # ---- data ----------------------------------------------------------------------------------
    def _make_reader(self, source: str, batch: int, repeat: bool, eval: bool = False):  # noqa: A002
        """A reader of this rank's rows of GLOBAL batches of `batch` samples (numbactr.data.make_reader)."""
        from numbactr.data import make_reader
        from numbactr.data.validation import LabelRule, SlotRanges
        inp = self.input
        # one-hot tables have no hash: row = key, and slot s owns rows [Σ_{j<s} size_j, Σ_{j<=s} size_j),
        # so a key outside its slot's block would silently train another slot's rows
        bounds = [None] * len(inp.sparse)
        for e in self.embeddings:
            if e.cfg.embedding_type == Embedding_t.LocalizedSlotSparseEmbeddingOneHot and e.cfg.slot_size_array:
                hi = np.cumsum(np.asarray(e.cfg.slot_size_array, np.int64))
                bounds[self.sparse_inputs[e.cfg.bottom_name]] = SlotRanges(
                    hi - np.asarray(e.cfg.slot_size_array, np.int64), hi,
                    f"LocalizedSlotSparseEmbeddingOneHot {e.name!r} (slot_size_array)")
            elif e.cfg.embedding_type == Embedding_t.HybridSparseEmbedding:
                # the hybrid embedding takes per-slot ids (it adds the slot offsets itself)
                sizes = np.asarray(e.cfg.slot_size_array, np.int64)
                bounds[self.sparse_inputs[e.cfg.bottom_name]] = SlotRanges(
                    np.zeros_like(sizes), sizes, f"HybridSparseEmbedding {e.name!r} (slot_size_array)")
        # each loss layer states what its label columns may hold (numbactr.data.validation.LABEL_KINDS)
        rules = [None] * inp.label_dim
        for layer, _ in self.losses:
            c0, c1 = self.label_columns[layer.cfg.bottom_names[1]]
            rule = LabelRule(layer.label_kind, f"{layer.type_name} {layer.cfg.top_names[0]!r}")
            rules[c0:c1] = [rule] * (c1 - c0)
        return make_reader(self.reader_params, source, batch, inp.label_dim, inp.dense_dim,
                           [sp.slot_num for sp in inp.sparse], [sp.nnz_per_slot for sp in inp.sparse],
                           self.solver.i64_input_key, repeat, rank=self.comm.rank, ranks=self.ranks, eval=eval,
                           key_bound=bounds, label_rules=rules, seed=self.solver.seed)

    def start_data_reading(self) -> None:
        self._require_compiled("start_data_reading")
        if self._train_reader is None:
            self._train_reader = iter(self._make_reader(self.reader_params.source[0], self.solver.batchsize,
                                                        self.solver.repeat_dataset))
        if self._eval_reader is None:
            self._eval_reader = iter(self._make_reader(self.reader_params.eval_source, self.solver.batchsize_eval,
                                                       self.solver.repeat_dataset, eval=True))

    def set_source(self, source, keyset=None, eval_source=None) -> None:
        """Epoch mode: read these file lists from now on (the next train()/eval() start a fresh pass).

        HugeCTR's two forms: ``set_source(source: str, eval_source: str)`` (epoch mode), and with the
        embedding training cache ``set_source(source: list, keyset: list, eval_source: str)``."""
        if self.etc is None and eval_source is None and isinstance(keyset, str):
            keyset, eval_source = None, keyset                # set_source(source, eval_source) positionally
        if self.solver.repeat_dataset:
            raise ModelError("Model.set_source is for epoch mode (CreateSolver(repeat_dataset=False))")
        if eval_source is None:
            raise ModelError("Model.set_source: eval_source is required")
        self._drop_graphs("a new source")
        if self.etc is None:
            if keyset is not None:
                raise ModelError("Model.set_source: keyset files are for the embedding training cache "
                                 "(Model(..., etc=CreateETC(...))); use set_source(source, eval_source)")
            self.reader_params.source, self.reader_params.eval_source = [str(source)], str(eval_source)
        else:
            if isinstance(source, str) or isinstance(keyset, str) or keyset is None:
                raise ModelError("Model.set_source with the embedding training cache takes lists: "
                                 "set_source(source=[file lists], keyset=[keyset files], eval_source=...)")
            source, keyset = [str(x) for x in source], [str(x) for x in keyset]
            if len(source) != len(keyset):
                raise ModelError(f"Model.set_source: {len(source)} sources but {len(keyset)} keyset files; "
                                 "give one keyset file per source")
            self._etc_take_reader_keysets()
            self.reader_params.source, self.reader_params.keyset = source, keyset
            self.reader_params.eval_source = str(eval_source)
            self._etc_inc_files += keyset
        self._train_reader = self._eval_reader = None

    def _etc_take_reader_keysets(self) -> None:
        if self._etc_reader_keysets_pending:
            self._etc_inc_files += list(self.reader_params.keyset)
            self._etc_reader_keysets_pending = False

    def get_embedding_training_cache(self) -> "etc.EmbeddingTrainingCache":
        if self.etc is None:
            raise ModelError("Model.get_embedding_training_cache: the model has no embedding training cache "
                             "(Model(solver, reader, optimizer, CreateETC(...)))")
        return self._etc_cache

    def dump_incremental_model_2kafka(self) -> None:
        """HugeCTR sends the rows changed since the last call to the Kafka brokers of CreateSolver(kafka_brockers)
        for its inference parameter server. numbactr has no Kafka producer: refused with what to do instead."""
        raise ModelError("Model.dump_incremental_model_2kafka: numbactr cannot send to Kafka (no Kafka producer; "
                         "CreateSolver's kafka_brockers is ignored). Get the changed rows with "
                         "Model.get_incremental_model() and write them to the parameter server's databases "
                         "(numbactr.inference: the HPS's Redis / RocksDB backends)")

    def get_incremental_model(self) -> list:
        """ETC: per embedding, (keys (n,) int64, vectors (n, D) float32) of the keys in the keyset files
        of the sources trained since the last call (this rank's part of the table)."""
        self._require_compiled("get_incremental_model")
        if self.etc is None:
            raise ModelError("Model.get_incremental_model is only supported with the embedding training cache")
        self.check_deferred()
        self._etc_take_reader_keysets()
        files, self._etc_inc_files = self._etc_inc_files, []
        return self._etc_cache.incremental(files)

    def get_data_reader_train(self) -> "ReaderHandle":
        return ReaderHandle(self, train=True)

    def get_data_reader_eval(self) -> "ReaderHandle":
        return ReaderHandle(self, train=False)

    # ---- one step ------------------------------------------------------------------------------
    def _forward(self, batch, training: bool, tape: Tape | None) -> dict:
        """Run the graph on one batch; returns every tensor by name."""
        xp = device.xp()
        inp = self.input
        dense = batch.dense
        if self.half is not None and dense.dtype != self.half:    # HugeCTR's reader hands fp16 dense input
            precision.check_dense_input(dense, self.half)
            dense = np.asarray(dense).astype(self.half)
        t: dict[str, Tensor] = {inp.dense_name: Tensor(xp.asarray(dense))}
        for name, (c0, c1) in self.label_columns.items():      # (host arrays, or device ones: staged)
            t[name] = Tensor(xp.ascontiguousarray(xp.asarray(batch.label)[:, c0:c1]))
        rows = batch.batch_size
        half = self.half
        with autocast(half):                           # embedding outputs in half precision
            for emb in self.embeddings:
                keys, offsets = batch.sparse[self.sparse_inputs[emb.cfg.bottom_name]]
                t[emb.name] = emb.forward(tape, keys, offsets, rows, training)
            for c in self.collections:
                t.update(c.forward(tape, {b: batch.sparse[self.sparse_inputs[b]] for b in c.bottoms},
                                   training))
        run = RunInfo(training=training, valid=batch.size, ranks=self.ranks, scaler=self.solver.scaler,
                      seed=self.solver.seed, step=self.step)
        for layer in self.layers:
            with autocast(half, keep_outputs=layer.is_loss):    # losses: float32 math and value
                outs = layer.forward(tape, [t[b] for b in layer.cfg.bottom_names], run)
            for name, o in zip(layer.cfg.top_names, outs):
                t[name] = o
        self._last_tensors[training] = t            # check_out_tensor reads them
        self._last_fused[training] = bool(self._fused_tops) and ops.fuse_bias_relu()
        return t

    def _loss_value(self, t: dict, valid: int, rank_rows: int | None = None) -> float:
        """Σ_i weight_i · loss_i (+ regularizer terms), averaged over ranks, as HugeCTR reports it.

        rank_rows (eval): this rank's valid rows; the ranks' losses (each a mean over its valid rows) are
        then weighted by them, giving the mean over the global batch's valid rows, not HugeCTR's plain
        mean of the ranks' means (which differ when a partial last batch fills the ranks unevenly)."""
        total = 0.0
        for layer, w in self.losses:
            total += w * float(device.to_host(t[layer.cfg.top_names[0]].data)[0])
        if self.ranks > 1 and rank_rows is not None:
            summed = self.comm.allreduce_sum(np.array([total * rank_rows, rank_rows], dtype=np.float64))
            total = float(summed[0] / summed[1]) if summed[1] > 0 else 0.0
        elif self.ranks > 1:
            total = float(self.comm.allreduce_sum(np.array([total]))[0]) / self.ranks
        for layer, _ in self.losses:
            total += self._regularizer(layer, valid, grad=False)
        return total

    def check_deferred(self) -> None:
        """Raise what the embeddings recorded on the device since the last check instead of reading it back in
        every step (gpu/sim, every rank its own: a FATAL bounds check, a full hash table, a reserved key; see
        SparseEmbedding.check_pending), and count the mixed-precision steps skipped on the device
        (_sync_skips). Called every NONFINITE_CHECK_EVERY steps, at evaluation, snapshots and the end of fit;
        nothing is read when nothing was deferred."""
        for emb in self.embeddings:
            check = getattr(emb, "check_pending", None)
            if check is not None:
                check()
        self._sync_skips()

    @property
    def current_loss(self) -> float:
        """The last training step's reported loss; a loss kept on the device is read here, once."""
        if self._pending_loss is not None:
            losses, weights, ranks = self._pending_loss
            host = device.to_host(losses)
            total = 0.0
            for i, w in enumerate(weights):            # the order and float math of _loss_value
                total += w * float(host[i])
            if ranks > 1:                              # host[i]: loss i summed over the ranks (_keep_loss)
                total /= ranks
            for term in host[len(weights):]:           # the regularizer terms, in loss-layer order
                total += float(term)
            self._pending_loss = None
            self._current_loss = total
        return self._current_loss

    @current_loss.setter
    def current_loss(self, value: float) -> None:
        self._pending_loss = None
        self._current_loss = value

    def _lazy_loss(self) -> bool:
        """Keep the training loss on the device (read lazily)? On gpu and sim, on one rank or several, with
        or without a regularizer (its term is computed on the device from the step's weights, before the
        update, and kept beside the losses); the cpu device's arrays are host memory (nothing to save
        there, and its path stays as it was)."""
        return device.kind() != "cpu"

    def _keep_loss(self, t: dict, rows: int) -> None:
        """Hold this step's losses as one device array (a copy: the loss tensors' buffers may be reused),
        followed by the loss layers' regularizer terms over ``rows`` (the global batch's rows, as
        _loss_value). On several ranks each loss is summed over the ranks on the device, in float64 (NCCL
        between GPUs of their own: enqueued on the stream, nothing read back; host-staged MPI otherwise), and
        current_loss divides by the rank count: the mean of the ranks' losses, as _loss_value reports it
        (which weights each rank's losses before the sum: the same value, to the last bit for one loss of
        weight 1). The regularizer terms are not summed (every rank holds the same dense weights)."""
        xp = device.xp()
        losses = xp.concatenate([t[layer.cfg.top_names[0]].data.reshape(1) for layer, _ in self.losses])
        if self.ranks > 1:
            losses = self.comm.allreduce_sum(xp.ascontiguousarray(losses.astype(np.float64)))
        terms = [self._regularizer(layer, rows, grad=False, kept=True) for layer, _ in self.losses]
        terms = [r.astype(losses.dtype) for r in terms if r is not None]
        if terms:
            losses = xp.concatenate([losses, *terms])
        self._pending_loss = (losses, tuple(w for _, w in self.losses), self.ranks)

    def _regularizer(self, loss_layer, batch_rows: int, grad: bool, kept: bool = False):
        """L1/L2 on every trainable weight of the layers added before ``loss_layer`` (spec §6.3), with
        b = the batch's row count. Those weights are one contiguous slice of the flat weight vector.
        grad=True adds the regularizer gradient into the flat wgrad; returns the loss term, or with
        kept=True (the kernels' devices) the term as a (1,) device array, None for no term, read nothing."""
        reg = getattr(loss_layer, "regularizer", None)
        if not reg:
            return None if kept else 0.0
        from numbactr.layers.losses import regularizer_grad, regularizer_term, regularizer_term_on_device
        kind, lam = reg
        end = sum(p.data.size for layer in self.layers[:self.layers.index(loss_layer)] for p in layer.params)
        if end == 0:
            return None if kept else 0.0
        if grad:
            regularizer_grad(self.weights[:end], kind, lam, batch_rows, self.wgrads[:end], accumulate=True)
            return 0.0
        if kept:
            return regularizer_term_on_device(self.weights[:end], kind, lam, batch_rows)
        return regularizer_term(self.weights[:end], kind, lam, batch_rows)

    def _next_batch(self, reader):
        """This rank's slice of the next global batch (None at the end of an epoch-mode source)."""
        try:
            batch = next(reader)
        except StopIteration:
            return None
        return batch                             # the reader already hands out this rank's rows

    def _next_train_batch(self):
        """The next training batch: through the device stager on a GPU-style step (the batch after it
        already uploading, numbactr.data.staging), else straight from the reader."""
        stager = self._stager_for_step()
        if stager is None:
            return self._next_batch(self._train_reader)
        return stager.next(self._train_reader, self._fetch_for_staging)

    def _fetch_for_staging(self, reader):
        batch = self._next_batch(reader)
        if batch is not None and self.half is not None:        # checked and converted on the host
            precision.check_dense_input(batch.dense, self.half)
            batch.dense = np.asarray(batch.dense).astype(self.half)
        return batch

    def _stager_for_step(self):
        """A DeviceStager when batches can live on the device for the whole step: the kernels and only
        SparseEmbeddings whose lookups read nothing back (no collection, no hybrid embedding). On several ranks
        the stager keeps each batch's host arrays as mirrors of its device arrays: the sharded embeddings
        route the keys on the host from them, without a device read."""
        if not staging.staging_enabled() or self.collections:
            return None
        if not all(getattr(getattr(e, "engine", None), "defer_checks", False) for e in self.embeddings):
            return None
        mirrors = self.ranks > 1
        if self._stager is None or self._stager.kind != device.kind() or self._stager.host_mirrors != mirrors:
            if self._stager is not None:
                self._stager.close()
            self._stager = staging.DeviceStager(host_mirrors=mirrors)
        return self._stager

    def train(self) -> bool:
        """One training iteration; False when an epoch-mode reader is exhausted."""
        if self._tf32 is not None:                   # TF32 as this model asked (another may have changed it)
            precision.set_tf32(self._tf32)
        with device.held_choices():                  # the ops' device choices read once per step
            return self._train()

    def _train(self) -> bool:
        self._require_compiled("train")
        self.start_data_reading()
        batch = self._next_train_batch()
        self._dropped_rows = 0
        while (batch is not None and batch.global_size < batch.batch_size * self.ranks
               and self.solver.drop_incomplete_batch):
            self._dropped_rows += batch.global_size
            batch = self._next_train_batch()                      # HugeCTR skips partial train batches
        if batch is None or batch.global_size == 0:
            return False
        graphs = self._graphs_for_step(batch)
        if graphs is not None:                        # the device half captured once, then replayed
            from numbactr.train import cuda_graphs
            try:
                graphs.step(batch, cuda_graphs.batch_key(self, batch), self._device_step, self._replay_run(),
                            self._host_snapshot)
            finally:
                self._clear_exchange_keys()
            self._after_device_step()
            return True
        tape = Tape(watch_finite=self.half is not None)
        try:
            t = self._forward_backward(batch, tape)
        finally:
            self._clear_exchange_keys()
        # data parallel: dense gradients are summed over ranks (each already carries 1/(b*R))
        if self.ranks > 1:
            # in place: a device array by NCCL (or staged through the host by Comm), a NumPy one by MPI
            self.comm.allreduce_sum(self.wgrads)
        rows = batch.batch_size * self.ranks          # HugeCTR's b: the full (padded) batch
        for layer, _ in self.losses:
            self._regularizer(layer, rows, grad=True)
        # the reported loss uses the weights this step ran with (before the update)
        if not self.solver.gen_loss_summary:
            self.current_loss = 0.0
        elif self._lazy_loss():
            self._keep_loss(t, rows)              # no host read in the step: read when asked for
        else:
            self.current_loss = self._loss_value(t, rows)
        self._check_finite_loss(t)                 # stops before a non-finite step updates any weight
        if (self.step + 1) % self.NONFINITE_CHECK_EVERY == 0:
            self.check_deferred()
        if self.half is not None and self._overflow_on_device():
            self._apply_updates(self._gate(tape))      # a skip decided on the device: nothing read
            self.step += 1
            return True
        if self.half is not None and not self._grads_finite(tape):
            self._skip_step()
            return True
        self._apply_updates()
        self.step += 1
        return True

    def _forward_backward(self, batch, tape: Tape) -> dict:
        """Forward, backward from the losses, and every layer's gradient into the flat wgrads; the tensors."""
        t = self._forward(batch, True, tape)
        xp = device.xp()
        seeds = {}
        for layer, w in self.losses:
            loss = t[layer.cfg.top_names[0]]
            # HugeCTR lets loss weights scale only the reported loss (spec §10.3); numbactr's gradient
            # is the gradient of the reported loss unless HugeCTR's exact behaviour is asked for.
            scale = 1.0 if compat.hugectr_exact() else w
            seeds[id(loss)] = (loss, xp.full((1,), scale, np.float32))
        tape.backward(seeds)
        for layer in self.layers:
            for p, gview in zip(layer.params, layer.grad_views):
                if p.grad is None:
                    gview[...] = 0
                else:
                    gview[...] = p.grad
                    p.grad = None
        return t

    def _apply_updates(self, gate=None) -> None:
        """The step's dense and sparse updates; with a gate (_gate), every update kernel reads it and
        changes nothing where it is 0."""
        lr = 0.0 if self.dense_frozen else self.lr
        holders = [self.dense_optimizer] + [e.engine for e in self.embeddings]
        for h in holders:
            h.gate = gate
        try:
            self.dense_optimizer.step(self.weights, self.wgrads, lr, self.solver.scaler)
            for emb in self.embeddings:
                emb.update(self.lr, self.solver.scaler)
            for c in self.collections:
                c.update(self.lr, self.solver.scaler)
        finally:
            for h in holders:
                h.gate = None

    # ---- mixed precision: a step whose gradients overflowed is skipped ---------------------------------
    #: HugeCTR's sparse optimizers, whose gated updates the engine skips exactly (Adam's step-dependent
    #: scalars computed on the device for the steps that update)
    _GATED_SPARSE = ("HUGECTR_SGD", "HUGECTR_MOMENTUM_SGD", "HUGECTR_NESTEROV", "HUGECTR_ADAGRAD", "HUGECTR_ADAM")

    def _overflow_on_device(self) -> bool:
        """Mixed precision: is an overflowed step skipped on the device (a gate the update kernels read,
        _gate) rather than after a host read of the flag (_grads_finite)? On the kernels' devices (gpu, sim)
        with hash or one-hot SparseEmbeddings on the embedding engine's kernels (on any number of ranks: the
        ranks agree on the gate, _gate), no stochastic rounding (its salts count every step) and HugeCTR's
        optimizers: their updates are all the step changes, so a shut gate leaves the model as a skipped
        step does (Adam's t is then counted on the device: precision.Gate). The host learns of skips at the
        check points (check_deferred, skipped_steps)."""
        from numbactr.embedding.engine import Optim, Precision
        if self.half is None or not device.uses_kernels() or self.collections:
            return False
        gated = {Optim[k] for k in self._GATED_SPARSE}
        for e in self.embeddings:
            eng = getattr(e, "engine", None)
            # (a tiered table's engine has no gate: it reads the flag)
            if type(e) not in (HashEmbedding, OneHotEmbedding) or getattr(eng, "impl", None) != "kernels":
                return False
            if eng.optimizer.kind not in gated or (eng.weights_precision == Precision.FP16 and
                                                    eng.stochastic_rounding):    # its salts count the steps
                return False
        return True

    def _gate(self, tape: Tape):
        """This step's gate (precision.Gate): go, (1,) int64 on the device, 1 when every gradient stayed
        finite, else 0; the device count of skipped steps grows by 1 - go. No host read.

        Several ranks agree on go: a step is skipped on every rank when any rank's gradients overflowed (a
        rank's flag sees only its own gradients, but its dense gradients were summed with the others' and
        its embedding rows are updated from every rank's). The ranks sum their 1 - go on the device (NCCL
        between GPUs; staged through the host by MPI otherwise, as the dense gradients are)."""
        xp = device.xp()
        if self._skips_dev is None:        # (made by an eager step: never inside a CUDA graph capture)
            self._skips_dev = xp.zeros(1, np.int64)
        ok = tape.finite_flag()
        if ok is None and self.ranks == 1:  # no gradient was watched: nothing can have overflowed
            return None
        go = xp.ones(1, np.int64) if ok is None else xp.asarray(ok).reshape(1).astype(np.int64)
        if self.ranks > 1:                 # every rank takes part, watched gradients or not
            bad = self.comm.allreduce_sum(1 - go)
            go = (bad == 0).astype(np.int64)
        self._skips_dev += 1 - go
        return precision.Gate(go, self._skips_dev, self)

    def _sync_skips(self) -> None:
        """Read the device count of skipped steps (one host read, at a check point) and account for the
        new ones as _skip_step does: counted, the embedding engines' step counters back to the steps that
        updated, one GradientOverflowWarning."""
        if self._skips_dev is None:
            return
        total = int(device.to_host(self._skips_dev)[0])
        new, self._skips_seen = total - self._skips_seen, total
        if new <= 0:
            return
        self._skipped += new
        for e in self.embeddings:
            e.engine.step -= new
        from numbactr.enums import Optimizer_t
        if self.dense_optimizer.opt.optimizer_type == Optimizer_t.Adam:
            self.dense_optimizer.t -= new
        import warnings
        warnings.warn(f"mixed precision: the gradients of {new} step(s) up to iteration {self.step} overflowed "
                      f"{self.half.name} at scaler={self.solver.scaler:g}; their updates were skipped "
                      f"({self._skipped} skipped so far). A smaller scaler avoids this",
                      precision.GradientOverflowWarning, stacklevel=3)

    @property
    def skipped_steps(self) -> int:
        """Mixed-precision steps whose update was skipped because a gradient overflowed (reads the device
        count when skips are decided there)."""
        self._sync_skips()
        return self._skipped

    # ---- CUDA graphs of the training step (numbactr.train.cuda_graphs) ----------------------------------------
    def _graphs_for_step(self, batch):
        """The StepGraphs runner when this step can be a replayed CUDA graph, else None (an eager step, for
        the reason numbactr.train.cuda_graphs.ineligible gives; captured graphs are dropped, since eager work may
        move their buffers)."""
        from numbactr.train import cuda_graphs
        why = cuda_graphs.ineligible(self, batch)
        if self.ranks > 1:
            why = self._agree_on_step(batch, why)
        if why is not None:
            if self._graphs is not None:
                self._graphs.drop(why)
            return None
        if self._graphs is None:
            self._graphs = cuda_graphs.StepGraphs()
        return self._graphs

    def _agree_on_step(self, batch, why: str | None) -> str | None:
        """Several ranks, before a training step: one host collective (no device read) in which every rank
        says whether its step can be a CUDA graph (``why`` is None) and, for each sharded SparseEmbedding,
        its part of the step's fixed exchange key (HashEmbedding.exchange_key_part). A table whose parts
        are all known gets the joined key for this step's lookup (numbactr.embedding.sharded: its input_dist
        counts are then exchanged once per key, not every step). Returns why the step cannot be a graph
        on every rank (None: it can, on all of them): a graph replays NCCL calls, so the ranks capture and
        replay together, and only with every exchange's sizes fixed by a plan already made."""
        from numbactr.train import cuda_graphs
        tables = [(e, e._sharded) for e in self.embeddings if getattr(e, "_sharded", None) is not None]
        plannable = any(getattr(e, "exchange_key_part", None) is not None and getattr(e, "by_slot", False)
                        for e, _ in tables)
        capturable = cuda_graphs.may_capture(self)
        if not plannable and not capturable:
            return why                  # no plan to make, no graph on any rank: no collective needed
        parts = [0 if why is None else 1]
        for emb, _ in tables:
            keys, offsets = batch.sparse[self.sparse_inputs[emb.cfg.bottom_name]]
            part = getattr(emb, "exchange_key_part", None)
            parts.append(part(keys, offsets) if part is not None else -1)
        every = self.comm.allgather_rows(np.array([parts], np.int64))         # (R, 1 + tables)
        planned = True
        graph_step = capturable and not every[:, 0].any()        # every rank's step may be a graph
        for t, (_, table) in enumerate(tables):
            key = table.step_key(every[:, 1 + t])
            if key is not None and key[0] == table.GATHERED and not graph_step:
                key = None              # (the gathered exchange moves R times the bytes: for graph steps only)
            table.fixed_key = key
            planned = planned and table.ready(key)
        if why is not None:
            return why
        if every[:, 0].any():
            return "another rank's step cannot be a graph"
        if not planned:
            return ("a sharded embedding's exchange sizes are not fixed (multi-hot bags, or ranks with batches of "
                    "different sizes), or its plan is made in this step")
        return None

    def _clear_exchange_keys(self) -> None:
        """The step's fixed exchange keys are for its own lookups only (an evaluation's are not planned)."""
        for e in self.embeddings:
            table = getattr(e, "_sharded", None)
            if table is not None:
                table.fixed_key = None

    def _before_load(self) -> None:
        """A load replaces counters and arrays: the skips counted on the device are accounted for first
        (the loaded step counters are then the host's), and the captured steps dropped."""
        self._sync_skips()
        self._drop_graphs("a load")

    def _drop_graphs(self, why: str) -> None:
        """Forget the captured steps before work that may reallocate what they point to (an evaluation
        batch can grow the embeddings' scratch; a load can replace arrays): they are captured again after
        the warm-up steps."""
        if self._graphs is not None:
            self._graphs.drop(why)

    def _replay_run(self) -> dict:
        """What a replayed step's host halves need (numbactr.runtime.step_values.on_replay): this step's number
        (0-based, as RunInfo.step), learning rates and the loss scaler."""
        return {"step": self.step, "lr": self.lr, "dense_lr": 0.0 if self.dense_frozen else self.lr,
                "scaler": self.solver.scaler}

    def _host_snapshot(self):
        """Save what a graph step's Python changes on the host before its device work (the counters its
        replay hooks advance); returns the function that puts it back (a failed capture)."""
        dense_t = self.dense_optimizer.t
        engines = [(e.engine, e.engine.step) for e in self.embeddings]
        calls = self.comm.calls                  # collectives a failed capture entered ran nothing

        def restore():
            self.dense_optimizer.t = dense_t
            self.comm.calls = calls
            for eng, step in engines:
                eng.step = step
        return restore

    def _device_step(self, batch) -> None:
        """The device half of a graph-eligible step (the loss kept on the device; on several ranks the dense
        gradients' and the loss's sums over NCCL and the embeddings' planned exchanges): what a CUDA graph
        captures. Everything it does on the host is registered for replays."""
        from numbactr.runtime import step_values
        calls = self.comm.calls
        tape = Tape(watch_finite=self.half is not None)
        t = self._forward_backward(batch, tape)
        # a replay's tensors are its capture's (check_out_tensor, the non-finite diagnosis), not those of the
        # graph captured last
        step_values.on_replay(("tensors", id(self)), lambda run: self._last_tensors.__setitem__(True, t))
        if self.ranks > 1:                       # NCCL, enqueued on the step's stream (captured with it)
            self.comm.allreduce_sum(self.wgrads)
        rows = batch.batch_size * self.ranks
        for layer, _ in self.losses:
            self._regularizer(layer, rows, grad=True)
        if self.solver.gen_loss_summary:
            self._keep_loss(t, rows)
            kept = self._pending_loss
            step_values.on_replay(("loss", id(self)), lambda run: setattr(self, "_pending_loss", kept))
        else:
            self.current_loss = 0.0
        self._note_nonfinite_loss(self._pending_loss[0] if self._pending_loss is not None else
                                  self._losses_array(t), self.step + 1)
        self._apply_updates(self._gate(tape) if self.half is not None else None)
        entered = self.comm.calls - calls
        if entered:                              # a replay enters the same collectives (the job guard counts them)
            comm = self.comm
            step_values.on_replay(("collectives", id(self)), lambda run: setattr(comm, "calls", comm.calls + entered))

    def _after_device_step(self) -> None:
        """The host half of a graph step: the step count and the periodic reads of the device flags (after
        the step's work was queued, where the eager step reads them before its update)."""
        self.step += 1
        if self.step % self.NONFINITE_CHECK_EVERY == 0:
            self.check_deferred()
            self._read_nonfinite_flag(self._last_tensors.get(True, {}), self.step)

    def _grads_finite(self, tape: Tape) -> bool:
        """Mixed precision: did every gradient of this step stay finite, on every rank? (The ranks agree,
        so a skipped step skips the model-parallel embedding updates everywhere.)"""
        ok = tape.grads_finite()
        if self.ranks > 1:
            ok = bool(self.comm.allreduce_sum(np.array([0.0 if ok else 1.0]))[0] == 0.0)
        return ok

    def _skip_step(self) -> None:
        """Drop this step's dense and sparse gradients without touching weights or optimizer states,
        count the skip and warn (numbactr/runtime/precision.py: HugeCTR would apply the inf/NaN gradients)."""
        import warnings
        for e in (*self.embeddings, *self.collections):
            for held in ("_pending", "_saved"):           # the gradients kept for update()
                if hasattr(e, held):
                    setattr(e, held, None)
        self.wgrads[...] = 0
        self._skipped += 1
        self.step += 1
        warnings.warn(f"mixed precision: iteration {self.step}'s gradients overflowed {self.half.name} at "
                      f"scaler={self.solver.scaler:g}; its update was skipped ({self._skipped} skipped "
                      f"so far). A smaller scaler avoids this", precision.GradientOverflowWarning, stacklevel=3)

    # how many steps a GPU run goes between reads of its non-finite flag (when no loss is read per step)
    NONFINITE_CHECK_EVERY = 64

    def _check_finite_loss(self, t: dict) -> None:
        """FloatingPointError when this step's loss is non-finite, naming the step, the loss layer and
        the first layer whose output went non-finite (found only then).

        A loss value the step already read to the host (gen_loss_summary=True on cpu) is checked.
        Otherwise no value is read each step on a GPU (the loss is kept on the device, _keep_loss, or
        not summarized at all): a device-side flag keeps the first
        non-finite step and is read every NONFINITE_CHECK_EVERY steps, so training stops up to that many
        steps late but names the step where it began (cpu/sim arrays are host memory: checked every
        step). fit() also stops at a display whose loss is NaN."""
        step = self.step + 1                       # 1-based, as fit() counts iterations
        if self.solver.gen_loss_summary and self._pending_loss is None:    # the value was read already
            if not math.isfinite(self.current_loss):
                raise self._nonfinite_loss(t, step, step)
            return
        losses = self._pending_loss[0] if self._pending_loss is not None else self._losses_array(t)
        if _host_memory(losses):
            if not np.isfinite(losses).all():
                raise self._nonfinite_loss(t, step, step)
            return
        self._note_nonfinite_loss(losses, step)
        if step % self.NONFINITE_CHECK_EVERY == 0:
            self._read_nonfinite_flag(t, step)

    def _losses_array(self, t: dict):
        xp = device.xp()
        return xp.concatenate([t[layer.cfg.top_names[0]].data.reshape(1) for layer, _ in self.losses])

    def _note_nonfinite_loss(self, losses, step: int) -> None:
        """The device flag keeps the first step (1-based) whose loss was non-finite; the step number comes
        from device memory (numbactr.runtime.step_values), so the same operation serves every step of a graph."""
        from numbactr.runtime import step_values
        xp = device.xp()
        flag = getattr(self, "_nonfinite_flag", None)
        if flag is None:
            flag = self._nonfinite_flag = xp.full((1,), -1, np.int64)
        sv = step_values.held(self, "_step_value", 1, np.int64)
        flag[...] = xp.where((flag < 0) & ~xp.isfinite(losses).all(), sv.put(step), flag)
        step_values.on_replay(("nonfinite", id(self)), lambda run: sv.put(run["step"] + 1))

    def _read_nonfinite_flag(self, t: dict, step: int) -> None:
        flag = getattr(self, "_nonfinite_flag", None)
        if flag is None:
            return
        first = int(device.to_host(flag)[0])
        if first >= 0:
            raise self._nonfinite_loss(t, first, step)

    def _nonfinite_loss(self, t: dict, step: int, now: int) -> FloatingPointError:
        """The error for a non-finite loss that appeared at `step` (detected at step `now`)."""
        def finite(a):
            return bool(np.isfinite(device.to_host(a)).all())
        values = [(layer, t[layer.cfg.top_names[0]].data) for layer, _ in self.losses]
        bad = [f"{layer.type_name} {layer.cfg.top_names[0]!r} = {float(device.to_host(v)[0])}"
               for layer, v in values if not finite(v)]
        what = ", ".join(bad) if bad else "the regularizer term (non-finite weights)"
        first = "no layer output is non-finite"
        for e in self.embeddings:
            if not finite(t[e.name].data):
                first = f"the first non-finite output is embedding {e.name!r}" + \
                    ("" if finite(e.weight.data) else " (its table holds non-finite values)")
                break
        else:
            for layer in self.layers:
                tops = [n for n in layer.cfg.top_names if not finite(t[n].data)]
                if tops:
                    weights = "" if all(finite(p.data) for p in layer.params) else " (its weights are non-finite)"
                    first = f"the first non-finite output is {layer.type_name} {tops[0]!r}{weights}"
                    break
        if now == step:
            where = f"at iteration {step}: {what}; {first}. Training stopped before this iteration's update"
        else:
            why = ("keeping the loss on the device, a GPU run" if self.solver.gen_loss_summary
                   else "with gen_loss_summary=False a GPU run")
            where = (f"first at iteration {step}, found at iteration {now} ({why} "
                     f"checks every {self.NONFINITE_CHECK_EVERY} iterations): now {what}; {first}")
        return FloatingPointError(f"non-finite training loss {where} (check the lr, the data, the initialization)")

    def eval(self) -> bool:
        """One evaluation batch; accumulates metrics. False at the end of an epoch-mode eval source."""
        if self._tf32 is not None:
            precision.set_tf32(self._tf32)
        with device.held_choices():
            return self._eval()

    def _eval(self) -> bool:
        self._require_compiled("eval")
        self._drop_graphs("evaluation")
        self.check_deferred()
        self.start_data_reading()
        batch = self._next_batch(self._eval_reader)
        if batch is None or batch.global_size == 0:
            return False
        t = self._forward(batch, False, None)
        n = batch.size
        preds, labels, outputs = [], [], []
        for layer, _ in self.losses:
            logits = getattr(layer, "logits", None)
            if self.half is not None and logits is not None and logits.data.dtype != np.float32:
                # mixed precision: the metric's sigmoid/softmax runs in float32 on the half logits
                layer.logits = Tensor(logits.data.astype(np.float32), name=logits.name)
            p = device.to_host(layer.predictions()).reshape(batch.batch_size, -1)[:n]
            y = device.to_host(t[layer.cfg.bottom_names[1]].data).reshape(batch.batch_size, -1)[:n]
            outputs.append(p)
            if p.shape[1] == 2 and y.shape[1] == 1:      # CrossEntropy with class labels: P(class 1)
                p = p[:, 1:]
            preds.append(p)
            labels.append(y)
        preds, labels = np.concatenate(preds, axis=1), np.concatenate(labels, axis=1)
        outputs = np.concatenate(outputs, axis=1)
        loss = self._loss_value(t, batch.batch_size * self.ranks, None if compat.hugectr_exact() else n)
        if self.ranks > 1:                      # every rank scores the whole global eval batch
            preds, labels = self.comm.allgather_rows(preds), self.comm.allgather_rows(labels)
            outputs = self.comm.allgather_rows(outputs)
        self.metrics.add(preds, labels, loss)
        self._last_eval = (outputs, labels)
        return True

    def export_predictions(self, output_prediction_file_name: str, output_label_file_name: str) -> None:
        """HugeCTR's export: the predictions and labels of the last evaluated batch (its valid rows),
        appended to the two text files as HugeCTR writes them: every value in C++'s default float
        format (6 significant digits, ``%g``) followed by one space, row-major, no newline.

        Predictions are what the inference API returns for the same samples: each loss layer's
        activation (sigmoid for BinaryCrossEntropy and MultiCrossEntropy, the (B, 2) softmax for
        CrossEntropy), loss layers side by side in graph order; labels the loss layers' label columns in
        the same order. HugeCTR refuses models with several labels; numbactr writes them (a superset).
        Only rank 0 writes; every rank holds the whole global batch (eval gathers it)."""
        self._require_compiled("export_predictions")
        if self._last_eval is None:
            raise ModelError("Model.export_predictions: no evaluation batch yet; it exports the last batch that "
                             "eval() (or fit's evaluation) scored")
        preds, labels = self._last_eval
        if self.comm.rank != 0:
            return
        for path, values in ((output_prediction_file_name, preds), (output_label_file_name, labels)):
            try:
                with open(path, "a") as f:
                    f.write("".join(f"{v:g} " for v in np.asarray(values, np.float32).reshape(-1).tolist()))
            except OSError as e:
                raise ModelError(f"Model.export_predictions: cannot open output file {path!r} ({e})") from None

    def check_out_tensor(self, tensor_name: str, tensor_type) -> np.ndarray:
        """A host float32 copy of tensor ``tensor_name`` as the last training step (Tensor_t.Train) or
        evaluation batch (Tensor_t.Evaluate) computed it, HugeCTR's shape with dim 0 over all ranks
        (every rank gets the whole tensor). Any tensor a layer, an embedding or the Input made, labels
        and dense included (not sparse inputs or loss values, as in HugeCTR). HugeCTR's backward
        overwrites many train tensors with their gradients in place; numbactr returns the forward
        values."""
        self._require_compiled("check_out_tensor")
        if not isinstance(tensor_type, Tensor_t):
            raise ModelError(f"Model.check_out_tensor: tensor_type must be a Tensor_t, got {tensor_type!r}")
        losses = {layer.cfg.top_names[0] for layer, _ in self.losses}
        if tensor_name not in self.shapes or tensor_name in self.sparse_inputs or tensor_name in losses:
            known = sorted(n for n in self.shapes if n not in self.sparse_inputs and n not in losses)
            raise ModelError(f"Model.check_out_tensor: cannot find tensor with name {tensor_name!r}; tensors: "
                             f"{known}")
        training = tensor_type == Tensor_t.Train
        if tensor_name in self._fused_tops and self._last_fused.get(training):
            raise ModelError(f"Model.check_out_tensor: {tensor_name!r} is not kept on this device: its InnerProduct "
                             f"runs fused with the ReLU after it (which gives {self._fused_tops[tensor_name]!r}); "
                             "set NUMBACTR_FUSE_BIAS_RELU=0 to keep it")
        t = self._last_tensors.get(training)
        if t is None:
            raise ModelError(f"Model.check_out_tensor: no {'training step' if training else 'evaluation batch'} "
                             f"has run yet, so {tensor_name!r} holds nothing")
        a = np.asarray(device.to_host(t[tensor_name].data), np.float32).reshape((-1,) + self.shapes[tensor_name][1:])
        return self.comm.allgather_rows(a) if self.ranks > 1 else a.copy()

    def eval_whole_source(self) -> list[tuple[str, float]]:
        """numbactr extra: evaluate every sample of the eval source exactly once; returns the metrics."""
        self._require_compiled("eval_whole_source")
        self.metrics.reset()
        self._eval_reader = iter(self._make_reader(self.reader_params.eval_source, self.solver.batchsize_eval, False,
                                                       eval=True))
        with log.progress(desc="eval, whole source", unit="batch") as bar:
            while self.eval():
                bar.update(1)
        self._eval_reader = None
        return self.get_eval_metrics()

    def get_current_loss(self) -> float:
        return self.current_loss

    def get_eval_metrics(self) -> list[tuple[str, float]]:
        return self.metrics.finalize()

    def get_learning_rate_scheduler(self) -> LearningRateScheduler:
        return self.lr_scheduler

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the next steps (dense layers and embeddings): a finite number >= 0."""
        self.lr = float(_number("Model.set_learning_rate", "lr", lr, 0.0))

    def reset_learning_rate_scheduler(self, base_lr, warmup_steps=1, decay_start=0, decay_steps=1,
                                      decay_power=2.0, end_lr=0.0) -> None:
        self.lr_scheduler = LearningRateScheduler(base_lr, warmup_steps, decay_start, decay_steps,
                                                  decay_power, end_lr)

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

    # ---- fit -----------------------------------------------------------------------------------
    def fit(self, num_epochs: int = 0, max_iter: int = 2000, display: int = 200, eval_interval: int = 1000,
            snapshot: int = 10000, snapshot_prefix: str = "") -> None:
        """HugeCTR's training loop (spec §4.1): non-epoch mode when the Solver repeats the dataset."""
        self._require_compiled("fit")
        for name, v in (("num_epochs", num_epochs), ("max_iter", max_iter), ("display", display),
                        ("eval_interval", eval_interval), ("snapshot", snapshot)):
            _number("fit", name, v, integer=True)
        s = self.solver
        if s.repeat_dataset and max_iter <= 0:
            raise ModelError("fit: max_iter must be > 0 when repeat_dataset=True")
        if not s.repeat_dataset and num_epochs <= 0 and self.etc is None:
            raise ModelError("fit: num_epochs must be > 0 when repeat_dataset=False (epoch mode)")
        if s.repeat_dataset and num_epochs:
            warn_ignored("Model.fit", "num_epochs", num_epochs, "with repeat_dataset=True fit runs max_iter "
                         "iterations (epochs need CreateSolver(repeat_dataset=False))", stacklevel=2)
        if not s.repeat_dataset and max_iter != 2000:
            warn_ignored("Model.fit", "max_iter", max_iter, "in epoch mode (repeat_dataset=False) fit runs "
                         "num_epochs passes over the source", stacklevel=2)
        try:
            self._fit_loop(num_epochs, max_iter, display, eval_interval, snapshot, snapshot_prefix)
            self.check_deferred()
        finally:
            # the readers' prefetch threads stop and are joined here (also on an error); each reader keeps
            # its place, so a later train()/eval()/fit() continues its stream as HugeCTR's readers do
            for reader in (self._train_reader, self._eval_reader):
                pause = getattr(reader, "pause", None)      # (a benchmark's batch cycle has no workers)
                if pause is not None:
                    pause()

    def _fit_loop(self, num_epochs: int, max_iter: int, display: int, eval_interval: int, snapshot: int,
                  snapshot_prefix: str) -> None:
        """fit's loop, after its argument checks."""
        s = self.solver
        log.info("Training source file: " + self.reader_params.source[0])
        log.info("Evaluation source file: " + self.reader_params.eval_source)
        # HugeCTR calls the training callbacks in iteration mode only (numbactr/config.py)
        callbacks = tuple(s.training_callbacks) if s.repeat_dataset else ()
        for cb in callbacks:
            cb.on_training_start()
        self.start_data_reading()
        t_display = time.time()
        it = 0
        epochs = 1 if s.repeat_dataset else num_epochs
        passes = [(self.reader_params.source[0], None)]
        if self.etc is not None:             # every file list in turn, its keyset first (HugeCTR's ETC mode)
            epochs = max(1, num_epochs)
            passes = list(zip(self.reader_params.source, self.reader_params.keyset))
            log.info(f"Use embedding training cache mode with number of training sources: {len(passes)}, "
                     f"number of epochs: {epochs}")
        for epoch, (source, keyset) in ((e, p) for e in range(epochs) for p in passes):
            if not s.repeat_dataset:
                self._train_reader = iter(self._make_reader(source, self.solver.batchsize, False))
                if keyset is not None:
                    self._etc_cache.update(keyset)
                    log.info(f"Training source file: {source}, keyset file: {keyset}")
                log.info(f"-----------------------------------Epoch {epoch}-----------------------------------")
            first = True
            while True:
                if s.repeat_dataset and it >= max_iter:
                    for cb in callbacks:
                        cb.on_training_end(max_iter - 1)
                    return
                lr = self.lr_scheduler.get_next()
                self.set_learning_rate(lr)
                if not self.train():
                    if first and not s.repeat_dataset:
                        dropped = getattr(self, "_dropped_rows", 0)
                        if not dropped:
                            raise ModelError(f"fit: epoch {epoch} trained nothing: the training source "
                                             f"{source!r} holds no samples (its files have 0 records)")
                        # HugeCTR trains nothing here too: legitimate, but worth saying
                        log.warn(f"fit: epoch {epoch} trained nothing: the training source {source!r} holds "
                                    f"{dropped} samples, fewer than one batch ({self.solver.batchsize}), and "
                                    "drop_incomplete_batch=True drops a partial batch")
                    break
                first = False
                if display > 0 and (it + 1) % display == 0:
                    loss = self.get_current_loss()
                    if math.isnan(loss):
                        raise FloatingPointError(f"Train loss is NaN at iteration {it + 1}")
                    log.info(f"Iter: {it + 1} Time({display} iters): {time.time() - t_display:.6f}s "
                             f"Loss: {loss:.6f} lr:{lr:.6f}")
                    self.history["iter"].append(it + 1)
                    self.history["loss"].append(loss)
                    self.history["lr"].append(lr)
                    t_display = time.time()
                if eval_interval > 0 and (it + 1) % eval_interval == 0:
                    if self._evaluate(it + 1, callbacks):
                        return
                if snapshot > 0 and it % snapshot == 0 and it != 0:
                    self.save_params_to_files(snapshot_prefix, it)
                it += 1

    def _evaluate(self, it: int, callbacks=()) -> bool:
        """Run max_eval_batches eval batches after `it` steps, log metrics; True when training should stop
        (the AUC target is hit, or a training callback's on_eval_end asked to stop)."""
        for cb in callbacks:
            cb.on_eval_start(it - 1)
        t0 = time.time()
        n, fresh = 0, False
        while n < self.solver.max_eval_batches:
            if not self.eval():
                if fresh:           # a reader just made gave no batch: the source holds no samples
                    raise ModelError(f"evaluation: the eval source {self.reader_params.eval_source!r} holds no "
                                     "samples (its files have 0 records)")
                self._eval_reader = iter(self._make_reader(self.reader_params.eval_source, self.solver.batchsize_eval, False,
                                                       eval=True))
                if n > 0:
                    break
                fresh = True
                continue
            n, fresh = n + 1, False
        target = self.solver.metrics_spec.get(MetricsType.AUC)
        hit = False
        metrics = self.get_eval_metrics()          # read once: reading them resets the accumulators
        if callbacks:
            results = {name: float(value) for name, value in metrics}
            stop = False
            for cb in callbacks:
                stop = bool(cb.on_eval_end(it - 1, results)) or stop
            if stop:
                log.info(f"A training callback stopped training at iteration {it}")
                for cb in callbacks:
                    cb.on_training_end(it - 1)
                return True
        for name, value in metrics:
            log.info(f"Evaluation, {name}: {value:.6f}")
            if name == "AUC":
                self.history["eval_iter"].append(it)
                self.history["auc"].append(value)
                if target is not None and value > target:
                    log.info(f"Hit target accuracy AUC {target} at {it}/{it} iterations")
                    hit = True
        log.info(f"Eval Time for {n} iters: {time.time() - t0:.6f}s")
        return hit

    # ---- graph JSON ----------------------------------------------------------------------------
    def graph_to_json(self, graph_config_file: str) -> None:
        """Write HugeCTR's graph JSON (spec §7.4), auto-Slice layers included. An EmbeddingCollection is
        not written, as HugeCTR's writer writes none (its tables are saved by embedding_dump)."""
        if self.input is None:
            raise ModelError("Model.graph_to_json: the model is empty")
        graph_json.write(self, graph_config_file)

    def construct_from_json(self, graph_config_file: str, include_dense_network: bool) -> None:
        """Add the Input, embeddings and (with include_dense_network) dense layers of a graph JSON."""
        graph_json.construct(self, graph_config_file, include_dense_network)

    # ---- files (layouts: numbactr/files/checkpoint.py) -------------------------------------------------
    def save_params_to_files(self, prefix: str, iter: int = 0) -> None:  # noqa: A002 (HugeCTR's name)
        """Dense weights and optimizer states, one folder per embedding (spec §7.1-§7.3), plus a manifest,
        committed as one unit: a save killed at any point leaves the previous snapshot loadable. Every
        rank calls it and returns once all files exist."""
        self._require_compiled("save_params_to_files")
        self.check_deferred()
        iter = checkpoint._iteration(iter)        # noqa: A001 (checked before any file is written)
        if self.etc is not None:      # ETC: the tables go to their sparse model folders, the rest under prefix
            etc.save_sparse_models(self, self.etc)
            checkpoint.save(self, prefix, iter, with_sparse=False)
            return
        checkpoint.save(self, prefix, iter)
        if self.collections:        # the tables: their own atomic dump beside the dense files
            self.embedding_dump(f"{prefix}_embedding_collection_{iter}")

    def embedding_dump(self, path: str, table_names=()) -> None:
        """HugeCTR's EmbeddingCollection dump: every named table ([] = all) into folder ``path``
        (numbactr.embedding.collection: layout, atomic commit). Every rank calls it."""
        self._require_compiled("embedding_dump")
        ebc.dump(self.collections, self.comm, path, table_names, i64_keys=self.solver.i64_input_key)

    def embedding_load(self, path: str, table_names=()) -> None:
        """Load the named tables ([] = all) from an embedding_dump folder; checked before anything changes."""
        self._require_compiled("embedding_load")
        self._before_load()
        ebc.load(self.collections, path, table_names)

    def load_dense_weights(self, dense_model_file: str, allow_missing_ntp: bool = False) -> None:
        """Dense weights and, with BatchNorm layers, their running statistics from
        ``dense_model_file + ".ntp.json"``: a missing .ntp.json is an error unless ``allow_missing_ntp``
        (numbactr's extra argument), which keeps the current running statistics. Every load_* checks
        all its input before it changes anything, so a failed load leaves the model as it was."""
        self._require_compiled("load_dense_weights")
        self._before_load()
        checkpoint.load_dense_weights(self, dense_model_file, allow_missing_ntp)

    def load_dense_optimizer_states(self, dense_opt_states_file: str) -> None:
        self._require_compiled("load_dense_optimizer_states")
        self._before_load()
        checkpoint.load_dense_optimizer_states(self, dense_opt_states_file)

    def load_sparse_weights(self, sparse_embedding_files=None, *, sparse_embedding_files_map=None) -> None:
        """A list (one folder per embedding, add order) or a dict {sparse_embedding_name: folder} (HugeCTR's
        keyword for the dict: sparse_embedding_files_map). Keys go to the rank that owns them on this run's
        rank count (key % R, or slot % R from slot_id)."""
        sparse_embedding_files = _one_of("load_sparse_weights", sparse_embedding_files=sparse_embedding_files,
                                         sparse_embedding_files_map=sparse_embedding_files_map)
        self._require_compiled("load_sparse_weights")
        self._before_load()
        checkpoint.load_sparse_weights(self, sparse_embedding_files)

    def load_sparse_optimizer_states(self, sparse_opt_states_files=None, *, sparse_opt_states_files_map=None) -> None:
        """Like load_sparse_weights (the dict also as sparse_opt_states_files_map); each key's states go to the
        row that holds the key now, so load the matching sparse weights first."""
        sparse_opt_states_files = _one_of("load_sparse_optimizer_states",
                                          sparse_opt_states_files=sparse_opt_states_files,
                                          sparse_opt_states_files_map=sparse_opt_states_files_map)
        self._require_compiled("load_sparse_optimizer_states")
        self._before_load()
        checkpoint.load_sparse_optimizer_states(self, sparse_opt_states_files)

    def _require_compiled(self, what: str) -> None:
        if not self.compiled:
            raise ModelError(f"Model.{what}: call compile() first")


def _one_of(who: str, **given):
    """The one argument given of two names for it (HugeCTR's overloads: a list, or a dict by another name)."""
    set_ = [(k, v) for k, v in given.items() if v is not None]
    if len(set_) != 1:
        raise TypeError(f"Model.{who}: give one of {' or '.join(given)}, got {[k for k, _ in set_] or 'none'}")
    return set_[0][1]


class ReaderHandle:
    """What ``get_data_reader_train()/get_data_reader_eval()`` return: HugeCTR's reader controls."""

    def __init__(self, model: Model, train: bool):
        self.model, self.train = model, train

    def set_source(self, file_name: str = "") -> None:
        """Restart from the first sample of ``file_name`` ("" = the current source)."""
        m, p = self.model, self.model.reader_params
        if self.train:
            if file_name:
                p.source = [file_name]
            m._train_reader = iter(m._make_reader(p.source[0], m.solver.batchsize, m.solver.repeat_dataset))
        else:
            if file_name:
                p.eval_source = file_name
            m._eval_reader = iter(m._make_reader(p.eval_source, m.solver.batchsize_eval, m.solver.repeat_dataset,
                                                 eval=True))

    def is_started(self) -> bool:
        return (self.model._train_reader if self.train else self.model._eval_reader) is not None


def _host_memory(a) -> bool:
    """True when reading `a` costs no device-to-host copy (cpu and sim arrays are NumPy's)."""
    return device.is_host_array(a)


def _names(x) -> list:
    return [x] if isinstance(x, str) else list(x)


def _fmt(shape: tuple) -> str:
    return "(" + ",".join(str(d) for d in shape) + ")"
