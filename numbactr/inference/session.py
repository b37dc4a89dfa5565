"""HugeCTR's inference sessions: InferenceSession (CreateInferenceSession) and InferenceModel.

    params = InferenceParams(model_name="dcn", max_batchsize=1024, hit_rate_threshold=1.0,
                             dense_model_file="dcn_dense_2000.model", sparse_model_files=["dcn0_sparse_2000.model"],
                             use_gpu_embedding_cache=True, cache_size_percentage=0.2, i64_input_key=False)
    session = CreateInferenceSession("dcn.json", params)          # the graph JSON graph_to_json wrote
    session.predict(dense_feature, embeddingcolumns, row_ptrs)    # CSR request -> [prediction per sample]
    session.predict(num_batches, source, DataReaderType_t.Norm, Check_t.Sum)    # from a file list
    model = InferenceModel("dcn.json", params); model.predict(...); model.evaluate(...) (AUC)

What runs (shapes: B samples, T tables, S_t slots, N_t keys, D_t width, P predictions per sample):
  * the graph JSON is read by numbactr.files.graph_json (errors name the file, layer and key); its dense layers
    are numbactr's layers, weights from dense_model_file in HugeCTR's layout (numbactr.files.checkpoint, with the
    BatchNorm .ntp.json), run forward on the current numbactr device (gpu kernels, sim, cpu compiled ops);
  * each loss layer is replaced by its activation, as HugeCTR's inference does: BinaryCrossEntropyLoss and
    MultiCrossEntropyLoss by a sigmoid, CrossEntropyLoss by the softmax; the prediction (B, P) is the loss
    layers' activations side by side in graph order (HugeCTR's multi_task_combined_pred);
  * table t's keys (N_t,) are made distinct, their vectors come from the parameter server
    (numbactr.inference.hps: embedding cache -> volatile -> persistent database -> default value) into the
    rows of a table-batched embedding engine, which pools the bags (sum / mean, the graph's combiner)
    exactly as training's evaluation does: the predictions equal Model.export_predictions of the model
    that wrote the files. A one-hot table (LocalizedSlotSparseEmbeddingOneHot, HybridSparseEmbedding) takes
    per-slot ids, as in training: they become the table's keys (key + the slot's offset from slot_size_array,
    one_hot_categories), the keys its snapshot holds.
CSR requests (InferenceSession.predict(dense_feature, embeddingcolumns, row_ptrs)), HugeCTR's layout:
  dense_feature (n * dense_dim,), row_ptrs the tables' row pointers one after the other, table t's
  n * S_t + 1 of them starting at 0 (slot-major per sample: bag b * S_t + s), embeddingcolumns the tables'
  keys one after the other; n = (len(row_ptrs) - T) / sum_t S_t <= max_batchsize.
Tables are the graph's embeddings in graph order; sparse_model_files[t] is table t's folder.
"""

from __future__ import annotations

import math

import numpy as np

from numbactr.files import checkpoint, graph_json
from numbactr.runtime import device
from numbactr import log
from numbactr import ops
from numbactr.autograd import Tensor
from numbactr.autograd.tape import _POLICY as _AUTOCAST
from numbactr.data.validation import slot_offsets
from numbactr.config import DataReaderParams, DenseLayer, Input, SparseEmbedding
from numbactr.embedding.engine import BoundsCheck, Layout, Optim, OptimizerSpec, TableBatchedEmbedding, TableSpec
from numbactr.embedding.sparse_embedding import POOLING
from numbactr.enums import DataReaderType_t, Embedding_t, MetricsType
from numbactr.layers import LayerError, RunInfo, build
from numbactr.layers.losses import sigmoid, softmax2
from numbactr.metrics import column_metric, row_group_keys
from numbactr.ops import sigmoid as bce_sigmoid
from numbactr.inference.hps import ParameterServer, check_keys, lane_stride
from numbactr.inference.params import InferenceParams, ParameterServerConfig

__all__ = ["InferenceSession", "InferenceModel", "CreateInferenceSession", "InferenceGraph"]

# each loss layer's activation, as the loss layer's own predictions() computes it in training's evaluation
ACTIVATIONS = {"BinaryCrossEntropyLoss": bce_sigmoid, "CrossEntropyLoss": softmax2, "MultiCrossEntropyLoss": sigmoid}


class InferenceGraph:
    """A graph JSON as inference runs it: graph_json.construct adds the Input, the embeddings (configs only:
    their vectors come from the parameter server) and the dense layers, built for batch `batch`; the dense
    weights are one flat float32 vector in HugeCTR's file order (spec §7.2), each layer's parameters views
    of it, so numbactr.files.checkpoint loads the dense model file into it."""

    def __init__(self, path: str, batch: int):
        self.path, self.batch = path, batch
        self.input: Input | None = None
        self.embeddings: list[SparseEmbedding] = []
        self.layers: list = []
        self.shapes: dict[str, tuple] = {}
        self.sparse_inputs: dict[str, int] = {}
        graph_json.construct(self, path, True)
        if self.input is None:
            raise ValueError(f"graph JSON {path!r}: no Data layer")
        self.losses = [layer for layer in self.layers if layer.is_loss]
        if not self.losses:
            raise ValueError(f"graph JSON {path!r}: no loss layer, so nothing says which tensor is the prediction")
        self.dense_layers = [layer for layer in self.layers if not layer.is_loss]
        xp = device.xp()
        self.n_params = sum(math.prod(s) for layer in self.layers for s in layer.param_shapes())
        self.weights = xp.zeros(self.n_params, np.float32)
        off = 0
        for layer in self.layers:
            layer.params = []
            for i, s in enumerate(layer.param_shapes()):
                n = math.prod(s)
                layer.params.append(
                    Tensor(self.weights[off : off + n].reshape(s), name=f"{layer.cfg.top_names[0]}.w{i}")
                )
                off += n
        # label columns in the reader's block: alphabetical order of the label names (numbactr.train.graph.add_input)
        self.label_columns, col = {}, 0
        for i in sorted(range(len(self.input.label_names)), key=lambda i: self.input.label_names[i]):
            self.label_columns[self.input.label_names[i]] = (col, col + self.input.label_dims[i])
            col += self.input.label_dims[i]

    def add(self, item) -> None:
        """graph_json.construct's callback (Model.add's role): records configs, infers shapes."""
        B = self.batch
        if isinstance(item, Input):
            self.input = item
            for name, dim in zip(item.label_names, item.label_dims):
                self.shapes[name] = (B, dim)
            self.shapes[item.dense_name] = (B, item.dense_dim)
            for i, p in enumerate(item.sparse):
                self.sparse_inputs[p.top_name] = i
            return
        if isinstance(item, SparseEmbedding):
            if item.bottom_name not in self.sparse_inputs:
                raise ValueError(
                    f"embedding {item.sparse_embedding_name!r}: bottom {item.bottom_name!r} is not a "
                    f"sparse input of the Data layer ({sorted(self.sparse_inputs)})"
                )
            slots = self.input.sparse[self.sparse_inputs[item.bottom_name]].slot_num
            self.shapes[item.sparse_embedding_name] = (B, slots, item.embedding_vec_size)
            self.embeddings.append(item)
            return
        if not isinstance(item, DenseLayer):
            raise TypeError(f"InferenceGraph.add: unexpected {type(item).__name__}")
        for b in item.bottom_names:
            if b not in self.shapes:
                raise ValueError(f"bottom tensor {b!r} does not exist; known tensors: {sorted(self.shapes)}")
        try:
            layer = build(item, [self.shapes[b] for b in item.bottom_names])
        except LayerError as e:
            raise ValueError(str(e)) from None
        labels = set(self.input.label_names)
        if not layer.is_loss and labels & set(item.bottom_names):
            raise ValueError(f"{item.layer_type.name} reads a label tensor; inference has no labels")
        for t, s in zip(item.top_names, layer.out_shapes):
            self.shapes[t] = tuple(s)
        self.layers.append(layer)

    def sparse_param(self, e: SparseEmbedding):
        return self.input.sparse[self.sparse_inputs[e.bottom_name]]

    def ps_config(self, params: InferenceParams) -> ParameterServerConfig:
        """The parameter server's view of this graph: table t = embedding t (name, width, most keys a
        sample queries)."""
        if len(params.sparse_model_files) != len(self.embeddings):
            raise ValueError(
                f"InferenceParams: {len(params.sparse_model_files)} sparse_model_files for the "
                f"{len(self.embeddings)} embedding tables of graph {self.path!r} "
                f"({[e.sparse_embedding_name for e in self.embeddings]})"
            )
        name = params.model_name
        return ParameterServerConfig(
            {name: [e.sparse_embedding_name for e in self.embeddings]},
            {name: [e.embedding_vec_size for e in self.embeddings]},
            {name: [self.sparse_param(e).max_feature_num for e in self.embeddings]},
            [params],
            params.volatile_db,
            params.persistent_db,
            params.update_source,
        )


ONE_HOT = (Embedding_t.LocalizedSlotSparseEmbeddingOneHot, Embedding_t.HybridSparseEmbedding)


def one_hot_categories(e: SparseEmbedding, keys, offsets, slots: int) -> np.ndarray:
    """A one-hot table's keys (N,) (LocalizedSlotSparseEmbeddingOneHot, HybridSparseEmbedding) as its table's
    keys: at inference it is the plain table its snapshot holds (row = category), and, as in training, its
    input holds per-slot ids: key + the offset of its slot (slot_size_array) is the category. ValueError
    naming the key, slot and sample for a key outside its slot's vocabulary. offsets (n*S + 1,): bag b*S + s
    is sample b's slot s."""
    keys_h = np.asarray(device.to_host(keys)).astype(np.int64)
    off = np.asarray(device.to_host(offsets)).astype(np.int64)
    sizes = np.asarray(e.slot_size_array, np.int64)
    if sizes.shape != (slots,):
        raise ValueError(
            f"{e.embedding_type.name} {e.sparse_embedding_name!r}: slot_size_array has {sizes.size} "
            f"entries for its {slots} slots (graph JSON)"
        )
    bag = np.repeat(np.arange(off.shape[0] - 1, dtype=np.int64), np.diff(off))
    slot = bag % slots
    bad = (keys_h < 0) | (keys_h >= sizes[slot])
    if bad.any():
        at = int(np.argmax(bad))
        raise ValueError(
            f"{e.embedding_type.name} {e.sparse_embedding_name!r}: key {int(keys_h[at])} of slot "
            f"{int(slot[at])} (sample {int(bag[at]) // slots}) is outside the slot's vocabulary [0, "
            f"{int(sizes[slot[at]])}) given by slot_size_array (one-hot embeddings take per-slot "
            "ids and add the slot offsets themselves)"
        )
    return keys_h + slot_offsets(sizes)[slot]


class _Pooler:
    """Table t's pooling: an embedding engine with one unkeyed table whose rows are the request's vectors
    (rows grow to the largest request; the engine is rebuilt then)."""

    def __init__(self, e: SparseEmbedding, slots: int):
        self.e, self.slots, self.dim = e, slots, e.embedding_vec_size
        self.rows = 0
        self.engine = None

    def block(self, rows: int):
        """(>= rows, stride) view of the engine's weights, rebuilt larger when needed."""
        if rows > self.rows:
            self.rows = max(1024, 1 << (rows - 1).bit_length())
            self.engine = TableBatchedEmbedding(
                [TableSpec(self.rows, self.dim)],
                [0] * self.slots,
                pooling=POOLING[self.e.combiner],
                layout=Layout.SAMPLE_MAJOR,
                optimizer=OptimizerSpec(Optim.NONE),
                bounds_check=BoundsCheck.NONE,
            )
        return self.engine.weights[: self.rows * lane_stride(self.dim)].reshape(self.rows, lane_stride(self.dim))

    def pool(self, rows: np.ndarray, offsets: np.ndarray, batch: int):
        """(B, S, D) pooled bags of occurrences reading block rows (N,) (-1: nothing), CSR offsets (B*S + 1,)."""
        xp = device.xp()
        # the rows come from the cache lookup (block rows or -1) and the offsets were checked with the
        # request: the engine's bounds check would only repeat that work
        out = self.engine.forward_rows(xp.asarray(rows, dtype=np.int64), xp.asarray(offsets, dtype=np.int64), batch)
        return out.reshape(batch, self.slots, self.dim)


def _load_dense(g: InferenceGraph, p: InferenceParams) -> None:
    """The dense weights (and BatchNorm statistics) of the session. dense_model_file "" loads none, as in
    HugeCTR (src/inference/inference_session.cpp loads it only when the name is not empty): the weights
    stay zeros, with a warning; a non_trainable_params_file given is still read (HugeCTR reads it on its own)."""
    if p.dense_model_file:
        ntp = {"ntp_path": p.non_trainable_params_file} if p.non_trainable_params_file else {}
        checkpoint.load_dense_weights(g, p.dense_model_file, **ntp)
        return
    log.warn(
        f"InferenceSession {p.model_name!r}: dense_model_file is empty, so no dense weights are loaded (as in "
        f"HugeCTR): the {g.n_params} dense parameters are uninitialised (zeros) and the predictions are not "
        "the trained model's"
    )
    if p.non_trainable_params_file:
        path = p.non_trainable_params_file
        stats = checkpoint._read_ntp(g, path, checkpoint._Snapshot.of(path), False)
        for b, (mean, var) in zip(checkpoint.norm_layers(g), stats):
            b.load_ntp_entry({"mean": mean, "var": var})


class InferenceSession:
    """``hugectr.inference.InferenceSession`` (module docstring); made by CreateInferenceSession. A session
    that made its parameter server closes it with close() (or when it is collected)."""

    def __init__(
        self, model_config_path: str, inference_params: InferenceParams, parameter_server: ParameterServer | None = None
    ):
        if not isinstance(inference_params, InferenceParams):
            raise TypeError(f"inference_params must be an InferenceParams, got {inference_params!r}")
        p = self.params = inference_params
        self.graph = g = InferenceGraph(str(model_config_path), p.max_batchsize)
        config = g.ps_config(p)
        _load_dense(g, p)
        self._own_ps = parameter_server is None
        self.ps = ParameterServer(config) if parameter_server is None else parameter_server
        self.cache = self.ps.cache(p.model_name)
        self.poolers = [_Pooler(e, g.sparse_param(e).slot_num) for e in g.embeddings]
        self._last: dict = {}  # the last forward's arrays by tensor name (the tensors property)
        self._rows = (0, 0)  # the last forward's samples, and the rows it ran on (a graph's bucket)
        self._graphs = None  # numbactr.train.cuda_graphs.ForwardGraphs once used
        self._plans: dict = {}  # _plan()'s layer functions by (device, bias/ReLU fusion)

    @property
    def tensors(self) -> dict:
        """Every tensor of the last forward by name (made on demand: a request does not pay for them)."""
        return {k: Tensor(v) for k, v in self._last.items() if k != self._PREDICTIONS}

    def close(self) -> None:
        if self._own_ps:
            self.ps.close()

    # ---- the forward ---------------------------------------------------------------------------------
    def _run(self, dense: np.ndarray, sparse: list, n: int):
        """Predictions (n, P) of n samples: dense (n, dense_dim), sparse [(keys (N_t,), offsets (n*S_t + 1,))]
        per table; every tensor of the forward is kept (check_out_tensor)."""
        with device.held_choices():  # the ops' device choices read once per request
            return self._run_held(dense, sparse, n)

    def _run_held(self, dense: np.ndarray, sparse: list, n: int):
        g, xp = self.graph, device.xp()
        names = [g.input.dense_name]
        arrays = [xp.asarray(np.ascontiguousarray(dense, np.float32))]
        for tab, (e, pooler, (keys, offsets)) in enumerate(zip(g.embeddings, self.poolers, sparse)):
            if e.embedding_type in ONE_HOT:
                keys = one_hot_categories(e, keys, offsets, pooler.slots)
            # a warm request on the cpu device: found, pooled from the cache and its rows marked used in
            # one compiled pass; otherwise (GPU, a miss, a new key) the block path below
            pooled = self.cache.serve_pooled(
                tab, np.ascontiguousarray(keys, np.uint64), offsets, pooler.e.combiner == "mean"
            )
            if pooled is None:
                rows = self.cache.lookup_occurrences(tab, keys, pooler.block)  # (N,) block row per key
                pooled = pooler.pool(rows, offsets, n)
            else:
                pooled = xp.asarray(pooled).reshape(n, pooler.slots, pooler.dim)
            names.append(e.sparse_embedding_name)
            arrays.append(pooled)
        graphs = self._forward_graphs()
        if graphs is None:
            out = self._forward(names, arrays)
        else:  # the dense network as a CUDA graph per row bucket (use_cuda_graph)
            out = graphs.run(n, arrays, lambda buffers: self._forward(names, buffers))
        preds = out[self._PREDICTIONS]  # (a replay's dict is the graph's: left as it is)
        self._last = out
        self._rows = (n, preds.shape[0])
        return device.to_host(preds[:n])

    _PREDICTIONS = "\0predictions"

    def _forward(self, names: list, arrays: list, plan: bool = True) -> dict:
        """The dense network on inputs (arrays under the input names, all with the same rows): every
        tensor by name, and the predictions (rows, P) under _PREDICTIONS. With plan (the default, and
        without mixed precision) each layer runs its inference_fn where it has one: the same op forwards
        on the same arrays as layer.forward, without the Tensors and tape bookkeeping around them."""
        g = self.graph
        rows = arrays[0].shape[0]
        t = dict(zip(names, arrays))
        run = None
        for layer, fn in self._plan() if plan and _AUTOCAST.half is None else self._no_plan():
            bottoms = [t[b] for b in layer.cfg.bottom_names]
            if fn is not None:
                outs = fn(bottoms)
            else:
                if run is None:
                    run = RunInfo(training=False, valid=rows)
                outs = [o.data for o in layer.forward(None, [Tensor(a) for a in bottoms], run)]
            t.update(zip(layer.cfg.top_names, outs))
        preds = []
        for layer in g.losses:
            p = ACTIVATIONS[layer.type_name](t[layer.cfg.bottom_names[0]]).reshape(rows, -1)
            t[layer.cfg.top_names[0]] = p
            preds.append(p)
        t[self._PREDICTIONS] = device.xp().concatenate(preds, axis=1) if len(preds) > 1 else preds[0]
        return t

    def _plan(self) -> list:
        """[(layer, its inference_fn or None)] for the dense layers, made once per device and bias/ReLU
        fusion setting (a layer's fn is chosen by them)."""
        key = (device.kind(), ops.fuse_bias_relu())
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = [(layer, layer.inference_fn()) for layer in self.graph.dense_layers]
        return plan

    def _no_plan(self) -> list:
        return [(layer, None) for layer in self.graph.dense_layers]

    def _forward_graphs(self):
        """The CUDA graphs of the dense forward (numbactr.train.cuda_graphs.ForwardGraphs), or None: eager
        forwards, off the GPU, with use_cuda_graph=False or without NUMBACTR_CUDA_GRAPHS=1 (off by default
        until a GPU run has checked replays, as for training)."""
        if self._graphs is None and self.params.use_cuda_graph and device.kind() == "gpu":
            from numbactr.train import cuda_graphs

            if cuda_graphs.graphs_wanted():
                self._graphs = cuda_graphs.ForwardGraphs(self.params.max_batchsize)
        return self._graphs

    # ---- CSR requests --------------------------------------------------------------------------------
    def predict(self, *args, **kwargs):
        """predict(dense_feature, embeddingcolumns, row_ptrs) -> [float] (n * P, row-major), or
        predict(num_batches, source, data_reader_type, check_type, slot_size_array=[], num_samples=0,
        data_source_params=None) -> (num_batches * max_batchsize,) array, (.., P) when P > 1."""
        if "dense_feature" in kwargs or (args and not isinstance(args[0], (int, np.integer))):
            return self._predict_csr(*args, **kwargs)
        preds = self._predict_files(*args, **kwargs)[0]
        return preds[:, 0] if preds.shape[1] == 1 else preds

    def _predict_csr(self, dense_feature, embeddingcolumns, row_ptrs) -> list:
        g = self.graph
        slots = [g.sparse_param(e).slot_num for e in g.embeddings]
        rp = np.asarray(row_ptrs).reshape(-1)
        if rp.size and rp.dtype.kind not in "iu":
            raise ValueError(f"InferenceSession.predict: row_ptrs must be integers, got {rp.dtype}")
        rp = rp.astype(np.int64, copy=False)
        n, rem = divmod(rp.size - len(slots), sum(slots)) if slots else (0, 0)
        if not slots:
            n = len(dense_feature) // max(g.input.dense_dim, 1)
        if rem or n < 0:
            raise ValueError(
                f"InferenceSession.predict: {rp.size} row_ptrs do not describe whole samples: "
                f"table t needs n * S_t + 1 of them, slots per table {slots}"
            )
        if n > self.params.max_batchsize:
            raise ValueError(f"InferenceSession.predict: {n} samples exceed max_batchsize {self.params.max_batchsize}")
        dense = np.asarray(dense_feature, np.float32).reshape(-1)
        if dense.size != n * g.input.dense_dim:
            raise ValueError(
                f"InferenceSession.predict: dense_feature has {dense.size} values; {n} samples x "
                f"dense_dim {g.input.dense_dim} = {n * g.input.dense_dim}"
            )
        finite = np.isfinite(dense)
        if not finite.all():  # as the data readers refuse them: no NaN predictions
            i = int(np.argmin(finite))
            raise ValueError(
                f"InferenceSession.predict: dense_feature[{i}] = {dense[i]} (sample {i // g.input.dense_dim}"
                f", feature {i % g.input.dense_dim}) is not finite"
            )
        keys = check_keys(embeddingcolumns, self.params.i64_input_key, "InferenceSession.predict embeddingcolumns")
        sparse, r0, k0 = [], 0, 0
        for t, s in enumerate(slots):
            off = rp[r0 : r0 + n * s + 1]
            name = g.embeddings[t].sparse_embedding_name
            if off[0] != 0 or (off[1:] < off[:-1]).any():
                j = 0 if off[0] != 0 else int(np.argmax(np.diff(off) < 0)) + 1
                raise ValueError(
                    f"InferenceSession.predict: row_ptrs of table {t} ({name!r}) must start at 0 and "
                    f"never decrease; entry {j} of the table (row_ptrs[{r0 + j}]) is {int(off[j])}"
                )
            end = int(off[-1])
            if k0 + end > keys.size:
                raise ValueError(
                    f"InferenceSession.predict: the row_ptrs of tables 0..{t} need {k0 + end} keys; "
                    f"embeddingcolumns has {keys.size}"
                )
            most = n * g.sparse_param(g.embeddings[t]).max_feature_num
            if end > most:
                raise ValueError(
                    f"InferenceSession.predict: table {t} ({name!r}) gets {end} keys; its samples take "
                    f"at most {most} (nnz_per_slot of the graph's Data layer)"
                )
            sparse.append((keys[k0 : k0 + end], off))
            r0, k0 = r0 + n * s + 1, k0 + end
        if k0 != keys.size:
            raise ValueError(
                f"InferenceSession.predict: embeddingcolumns has {keys.size} keys; the row_ptrs account for {k0}"
            )
        if n == 0:
            return []
        return self._run(dense.reshape(n, -1), sparse, n).reshape(-1).tolist()

    # ---- files ---------------------------------------------------------------------------------------
    def _batches(
        self,
        num_batches: int,
        source: str,
        data_reader_type,
        check_type,
        slot_size_array=(),
        num_samples: int = 0,
        data_source_params=None,
        reading_file_sequentially: bool = False,
    ):
        """num_batches full batches of max_batchsize samples from the start of source (the reader repeats the
        data, as HugeCTR's inference reader does), or with num_batches None every sample once (the last
        batch may be partial); yields (batch, predictions (B, P) of its valid rows)."""
        from numbactr.data import make_reader

        once = num_batches is None
        if not once and (not isinstance(num_batches, (int, np.integer)) or num_batches < 0):
            raise ValueError(f"predict: num_batches must be an int >= 0, got {num_batches!r}")
        g = self.graph
        # data_source_params: data paths on a remote filesystem are read as in training (numbactr.data.source)
        params = DataReaderParams(
            data_reader_type=data_reader_type,
            source=[source],
            eval_source=source,
            check_type=check_type,
            slot_size_array=list(slot_size_array),
            data_source_params=data_source_params,
            num_samples=num_samples,
            read_file_sequentially=bool(reading_file_sequentially and data_reader_type == DataReaderType_t.Parquet),
        )
        inp = g.input
        reader = make_reader(
            params,
            source,
            self.params.max_batchsize,
            inp.label_dim,
            inp.dense_dim,
            [sp.slot_num for sp in inp.sparse],
            [sp.nnz_per_slot for sp in inp.sparse],
            self.params.i64_input_key,
            repeat=not once,
        )
        batches = iter(reader)
        try:
            with log.progress(total=None if once else int(num_batches), desc="inference", unit="batch") as bar:
                done = 0
                while once or done < num_batches:
                    batch = next(batches, None)
                    if batch is None or batch.size == 0:
                        break
                    sparse = [batch.sparse[g.sparse_inputs[e.bottom_name]] for e in g.embeddings]
                    sparse = [(check_keys(k, self.params.i64_input_key, f"{source}: keys"), o) for k, o in sparse]
                    yield batch, self._run(batch.dense, sparse, batch.batch_size)[: batch.size]
                    done += 1
                    bar.update(1)
        finally:
            reader.close()

    def _predict_files(
        self,
        num_batches,
        source,
        data_reader_type,
        check_type,
        slot_size_array=(),
        num_samples=0,
        data_source_params=None,
        reading_file_sequentially=False,
        group_slot=None,
    ):
        """(predictions (num_batches * B, P), labels (n, label_dim), the key of sparse slot group_slot per
        sample (n,) or None)."""
        preds, labels, groups = [], [], []
        slots = [sp.slot_num for sp in self.graph.input.sparse]
        for batch, p in self._batches(
            num_batches,
            source,
            data_reader_type,
            check_type,
            slot_size_array,
            num_samples,
            data_source_params,
            reading_file_sequentially,
        ):
            preds.append(p)
            labels.append(batch.label[: batch.size])
            if group_slot is not None:
                who = f"group slot {group_slot} ({source}, batch {len(preds) - 1})"
                groups.append(row_group_keys(batch.sparse, slots, group_slot, batch.size, who, device.to_host))
        if not preds:
            zeros = np.zeros((0, self._width()), np.float32), np.zeros((0, self.graph.input.label_dim), np.float32)
            return zeros + (None if group_slot is None else np.zeros(0, np.int64),)
        return np.concatenate(preds), np.concatenate(labels), None if group_slot is None else np.concatenate(groups)

    def predict_source(self, source: str, data_reader_type, check_type, slot_size_array=()) -> np.ndarray:
        """numbactr extra (``numbactr predict``): (n, P) predictions of every sample of source, once each, in
        file order."""
        return self._predict_files(None, source, data_reader_type, check_type, slot_size_array)[0]

    def score_source(self, source: str, data_reader_type, check_type, slot_size_array=(), group_slot=None):
        """numbactr extra (``numbactr predict --metrics``): every sample of source once, in file order:
        (predictions (n, P), metric_columns' (predictions, labels) (n, C) each, group keys (n,) or None).
        group_slot: the sparse slot (numbered over the sparse inputs in order) whose key is each sample's
        group (user)."""
        preds, labels, groups = self._predict_files(
            None, source, data_reader_type, check_type, slot_size_array, group_slot=group_slot
        )
        return preds, self.metric_columns(preds, labels), groups

    def metric_columns(self, preds: np.ndarray, labels: np.ndarray) -> tuple:
        """(predictions, labels), (n, C) each, column c of one against column c of the other: each loss
        layer's predictions against its label columns; CrossEntropy's (n, 2) softmax with class labels
        gives P(class 1)."""
        g, cols, p_cols, c = self.graph, [], [], 0
        for layer in g.losses:
            c0, c1 = g.label_columns[layer.cfg.bottom_names[1]]
            width = 2 if layer.type_name == "CrossEntropyLoss" else c1 - c0
            p = preds[:, c : c + width]
            if width == 2 and c1 - c0 == 1:  # CrossEntropy with class labels: P(class 1)
                p = p[:, 1:]
            p_cols.append(p)
            cols.append(labels[:, c0:c1])
            c += width
        return np.concatenate(p_cols, axis=1), np.concatenate(cols, axis=1)

    def prediction_names(self) -> list:
        """A name per prediction column: ``prediction`` for one, else ``<label>`` or ``<label>_<k>`` per loss
        layer (its label tensor's name)."""
        if self._width() == 1:
            return ["prediction"]
        names = []
        for layer in self.graph.losses:
            label = layer.cfg.bottom_names[1]
            k = 2 if layer.type_name == "CrossEntropyLoss" else self.graph.shapes[layer.cfg.bottom_names[0]][-1]
            names += [label] if k == 1 else [f"{label}_{i}" for i in range(k)]
        return names

    def _width(self) -> int:
        """P: predictions per sample."""
        g = self.graph
        return sum(
            2 if layer.type_name == "CrossEntropyLoss" else g.shapes[layer.cfg.bottom_names[0]][-1]
            for layer in g.losses
        )

    def evaluate(
        self,
        num_batches,
        source,
        data_reader_type,
        check_type,
        slot_size_array=(),
        num_samples=0,
        data_source_params=None,
        reading_file_sequentially=False,
    ) -> float:
        """AUC of num_batches batches (each loss layer against its label columns; several columns: the mean
        of their AUCs, as HugeCTR's AUC of label_dim > 1)."""
        preds, labels, _ = self._predict_files(
            num_batches,
            source,
            data_reader_type,
            check_type,
            slot_size_array,
            num_samples,
            data_source_params,
            reading_file_sequentially,
        )
        p, y = self.metric_columns(preds, labels)
        return column_metric(MetricsType.AUC, y, p)

    def refresh_embedding_cache(self) -> None:
        """HugeCTR's refresh: the cached vectors read again from the databases (numbactr.inference.hps)."""
        self.cache.refresh()

    def check_out_tensor(self, tensor_name: str) -> np.ndarray:
        """A host float32 copy of a tensor of the last forward (the dense input, an embedding output, a layer
        output, a loss layer's activation under the loss's top name)."""
        if tensor_name not in self.tensors:
            if not self._last:
                raise ValueError(f"check_out_tensor: nothing has been predicted yet, so {tensor_name!r} holds nothing")
            raise ValueError(
                f"check_out_tensor: cannot find tensor with name {tensor_name!r}; tensors: {sorted(self.tensors)}"
            )
        a = np.array(device.to_host(self.tensors[tensor_name].data), np.float32)
        n, rows = self._rows
        if rows != n and a.size % rows == 0:  # a graph's padded bucket: the request's samples only
            a = a.reshape(rows, -1)[:n].reshape((a.shape[0] * n // rows,) + a.shape[1:])
        return a


def CreateInferenceSession(model_config_path: str, inference_params: InferenceParams) -> InferenceSession:  # noqa: N802
    """``hugectr.inference.CreateInferenceSession``: a parameter server for the model and a session on it."""
    return InferenceSession(model_config_path, inference_params)


class InferenceModel:
    """``hugectr.inference.InferenceModel(model_config_path, inference_params)``: offline inference over
    files. HugeCTR splits each batch over deployed_devices; numbactr runs it on the current device.

    predict(num_batches, source, data_reader_type, check_type, slot_size_array=[], data_source_params=None,
    reading_file_sequentially=True) -> (num_batches * max_batchsize, P) float32; evaluate(...) -> AUC;
    check_out_tensor(tensor_name) -> the last batch's tensor."""

    def __init__(self, model_config_path: str, inference_params: InferenceParams):
        self.session = InferenceSession(model_config_path, inference_params)

    def predict(
        self,
        num_batches,
        source,
        data_reader_type,
        check_type,
        slot_size_array=(),
        data_source_params=None,
        reading_file_sequentially=True,
    ) -> np.ndarray:
        return self.session._predict_files(
            num_batches,
            source,
            data_reader_type,
            check_type,
            slot_size_array,
            0,
            data_source_params,
            reading_file_sequentially,
        )[0]

    def evaluate(
        self,
        num_batches,
        source,
        data_reader_type,
        check_type,
        slot_size_array=(),
        data_source_params=None,
        reading_file_sequentially=True,
    ) -> float:
        return self.session.evaluate(
            num_batches,
            source,
            data_reader_type,
            check_type,
            slot_size_array,
            0,
            data_source_params,
            reading_file_sequentially,
        )

    def check_out_tensor(self, tensor_name: str) -> np.ndarray:
        return self.session.check_out_tensor(tensor_name)

    def close(self) -> None:
        self.session.close()
