"""Building a Model's graph: add() and its checks, compile() (the flat weight vector, the losses, the
bias + ReLU fusion), summary(), and the readers of the graph's inputs.

Every function takes the Model and changes its graph attributes (input, embeddings, collections, layers,
shapes, sparse_inputs, losses, weights, ...) in place. Shapes are inferred as each item is added, with the
per-rank batch B: why here and not at compile() is that a wrong name or shape then fails at the add() that
made it, with a message naming that layer and its tensors.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from numbactr.autograd import Tensor
from numbactr.config import DenseLayer, GroupDenseLayer, Input, SparseEmbedding
from numbactr.embedding import collection
from numbactr.embedding.factory import make_embedding
from numbactr.enums import Embedding_t
from numbactr.files import graph_json
from numbactr.layers import LayerError, build
from numbactr.optim import DenseOptimizer
from numbactr.runtime import device
from numbactr.train import training_cache


class ModelError(ValueError):
    """The model graph or its use is wrong; the message names the offending layer or tensor."""


ModelError.__module__ = "numbactr.model"  # its public home (numbactr.model re-exports it)


def add(
    model,
    item=None,
    input=None,
    sparse_embedding=None,
    dense_layer=None,  # noqa: A002 (Model.add's
    group_dense_layer=None,
    ebc_config=None,
) -> None:  # keywords, HugeCTR's names)
    """Model.add: the one item given, checked against the graph so far."""
    given = [x for x in (item, input, sparse_embedding, dense_layer, group_dense_layer, ebc_config) if x is not None]
    if len(given) != 1:
        raise ModelError(
            f"Model.add takes one Input, SparseEmbedding, DenseLayer, GroupDenseLayer or "
            f"EmbeddingCollectionConfig, got {len(given)}"
        )
    item = given[0]
    if model.compiled:
        raise ModelError("Model.add: the model is already compiled")
    if isinstance(item, Input):
        return add_input(model, item)
    if model.input is None:
        raise ModelError(f"Model.add({type(item).__name__}): add the Input first")
    if isinstance(item, SparseEmbedding):
        return add_embedding(model, item)
    if isinstance(item, collection.EmbeddingCollectionConfig):
        return add_collection(model, item)
    if isinstance(item, DenseLayer):
        return add_dense(model, item)
    if isinstance(item, GroupDenseLayer):
        return add_group(model, item)
    raise ModelError(
        f"Model.add: cannot add a {type(item).__name__}; expected Input, SparseEmbedding, DenseLayer or GroupDenseLayer"
    )


def new_tensor(model, name: str, shape: tuple, who: str) -> None:
    if name in model.shapes:
        raise ModelError(f"{who}: top tensor name {name!r} already exists")
    model.shapes[name] = tuple(int(d) for d in shape)


def add_input(model, inp: Input) -> None:
    if model.input is not None:
        raise ModelError("Model.add(Input): the model already has an Input")
    model.input = inp
    # The reader delivers one combined label block; its columns go to the label names in
    # alphabetical order of the names (HugeCTR's std::map, spec §4.2 / §10.13).
    model.label_columns = {}
    col = 0
    for i in sorted(range(len(inp.label_names)), key=lambda i: inp.label_names[i]):
        model.label_columns[inp.label_names[i]] = (col, col + inp.label_dims[i])
        col += inp.label_dims[i]
    for name, dim in zip(inp.label_names, inp.label_dims):
        new_tensor(model, name, (model.batch, dim), "Input label")
    new_tensor(model, inp.dense_name, (model.batch, inp.dense_dim), "Input dense")
    for i, p in enumerate(inp.sparse):
        new_tensor(model, p.top_name, (model.batch, p.slot_num), "Input sparse")
        model.sparse_inputs[p.top_name] = i


def add_embedding(model, cfg: SparseEmbedding) -> None:
    who = f"SparseEmbedding {cfg.sparse_embedding_name!r}"
    if model.layers:
        raise ModelError(f"{who}: embeddings must be added before dense layers")
    if cfg.bottom_name not in model.sparse_inputs:
        raise ModelError(
            f"{who}: bottom_name {cfg.bottom_name!r} is not a sparse input; sparse inputs: "
            f"{sorted(model.sparse_inputs)}"
        )
    if any(e.cfg.bottom_name == cfg.bottom_name for e in model.embeddings):
        raise ModelError(f"{who}: sparse input {cfg.bottom_name!r} already feeds an embedding")
    param = model.input.sparse[model.sparse_inputs[cfg.bottom_name]]
    opt = cfg.optimizer if cfg.optimizer.initialized else model.opt_params
    if model.etc is not None:  # a Cached parameter server: the table tiered on the local path
        tier = training_cache.tier_for(model.etc, len(model.embeddings), model.comm.rank, model.comm.size)
        if tier is not None:
            cfg.embedding_cache = tier
    emb = make_embedding(cfg, param, opt, model.solver.seed, model.comm)
    if cfg.embedding_type == Embedding_t.HybridSparseEmbedding:
        emb.statistics_source = functools.partial(hybrid_statistics, model)  # read at its first lookup
    new_tensor(model, cfg.sparse_embedding_name, emb.output_shape(model.batch), who)
    model.embeddings.append(emb)


def hybrid_statistics(model, emb) -> None:
    """A HybridSparseEmbedding's split from the first num_iterations_statistics global batches of the
    training source (this rank's rows of each), read by a reader of their own so the training stream
    starts from its first batch (HugeCTR reads them when the model is built)."""
    n = model.solver.num_iterations_statistics
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ModelError(f"CreateSolver: num_iterations_statistics must be an integer >= 0, got {n!r}")
    reader = make_reader(model, model.reader_params.source, model.solver.batchsize, False)
    batches = []
    try:
        for batch in iter(reader):
            if len(batches) >= n:
                break
            keys, offsets = batch.sparse[model.sparse_inputs[emb.cfg.bottom_name]]
            batches.append((keys, offsets, batch.size))
    finally:
        close = getattr(reader, "close", None)
        if close is not None:
            close()
    emb.take_statistics(batches, model.solver.batchsize, n)


def add_collection(model, cfg) -> None:
    """An EmbeddingCollectionConfig: its tables on this job's ranks, its lookups' tops."""
    who = f"EmbeddingCollection{len(model.collections)}"
    if not model.solver.use_embedding_collection:
        raise ModelError(f"Model.add({who}): needs CreateSolver(use_embedding_collection=True), as in HugeCTR")
    if model.layers:
        raise ModelError(f"{who}: embeddings must be added before dense layers")
    taken = {t.name for c in model.collections for t in c.tables}
    dup = sorted(taken & {t.name for t in cfg.tables})
    if dup:
        raise ModelError(f"{who}: table name(s) {dup} are already in another EmbeddingCollection")
    params = {p.top_name: p for p in model.input.sparse}
    try:
        coll = collection.EmbeddingCollection(
            cfg, len(model.collections), params, model.opt_params, model.solver.seed, model.comm
        )
    except collection.CollectionError as e:
        raise ModelError(str(e)) from None
    for name, shape in coll.tops(model.batch):
        new_tensor(model, name, shape, who)
    model.collections.append(coll)


def add_dense(model, cfg: DenseLayer) -> None:
    who = f"DenseLayer {cfg.layer_type.name} (top {cfg.top_names})"
    for b in cfg.bottom_names:
        if b not in model.shapes:
            raise ModelError(f"{who}: bottom tensor {b!r} does not exist; known tensors: {sorted(model.shapes)}")
        if b in model.sparse_inputs:
            raise ModelError(f"{who}: bottom {b!r} is a sparse input; feed it through a SparseEmbedding")
    try:
        layer = build(cfg, [model.shapes[b] for b in cfg.bottom_names])
    except LayerError as e:
        raise ModelError(str(e)) from None
    if len(layer.out_shapes) != len(cfg.top_names):
        raise ModelError(f"{who}: produces {len(layer.out_shapes)} tensors, {len(cfg.top_names)} top names given")
    for t, s in zip(cfg.top_names, layer.out_shapes):
        new_tensor(model, t, s, who)
    model.layers.append(layer)


def add_group(model, group: GroupDenseLayer) -> None:
    """Add the layers the group expands into (HugeCTR's names), all or none: a layer that fails
    leaves the model as it was before the group."""
    n_layers, tensors = len(model.layers), set(model.shapes)
    try:
        for cfg in group.expand():
            add_dense(model, cfg)
    except ModelError as e:
        del model.layers[n_layers:]
        for t in set(model.shapes) - tensors:
            del model.shapes[t]
        raise ModelError(f"GroupDenseLayer {group.group_layer_type.name} (tops {group.top_name_list}): {e}") from None


def compile(model, loss_names=None, loss_weights=None) -> None:
    if model.compiled:
        raise ModelError("Model.compile: already compiled")
    if model.input is None:
        raise ModelError("Model.compile: the model has no Input")
    if len(model.layers) + len(model.embeddings) + len(model.collections) < 2:
        raise ModelError("Model.compile: a model needs at least two layers")
    losses = [layer for layer in model.layers if layer.is_loss]
    if not losses:
        raise ModelError("Model.compile: the model has no loss layer")
    for layer in losses:  # swapped bottoms would train nothing and report no error
        pred, label = layer.cfg.bottom_names
        if label not in model.input.label_names or pred in model.input.label_names:
            raise ModelError(
                f"Model.compile: {layer.type_name} (top {layer.cfg.top_names[0]!r}) has bottoms "
                f"{layer.cfg.bottom_names}; they must be [prediction, label] with the label one "
                f"of the Input's label tensors {model.input.label_names}"
                + (" (the two look swapped)" if pred in model.input.label_names else "")
            )
    by_label = {layer.cfg.bottom_names[1]: layer for layer in losses}
    if loss_names is not None or loss_weights is not None:
        loss_names, loss_weights = list(loss_names or []), list(loss_weights or [])
        if len(loss_names) != len(loss_weights):
            raise ModelError(f"Model.compile: {len(loss_names)} loss_names but {len(loss_weights)} loss_weights")
        missing = [n for n in loss_names if n not in by_label]
        if missing:
            raise ModelError(
                f"Model.compile: loss_names {missing} are not the label (second bottom) of any "
                f"loss layer; loss labels: {sorted(by_label)}"
            )
        weights = dict(zip(loss_names, loss_weights))
    else:
        weights = dict(zip(model.input.label_names, model.input.label_weights))
    model.losses = [(layer, float(weights.get(layer.cfg.bottom_names[1], 1.0))) for layer in losses]
    model.loss_layer = losses[0]
    # one flat float32 weight vector, layer order, each layer's weights in index order (spec §7.2)
    shapes = [(layer, s) for layer in model.layers for s in layer.param_shapes()]
    model.n_params = sum(math.prod(s) for _, s in shapes)
    host = np.empty(model.n_params, np.float32)
    off = 0
    for layer in model.layers:
        for s, init in zip(layer.param_shapes(), layer.init_params(model.rng)):
            n = math.prod(s)
            host[off : off + n] = np.asarray(init, np.float32).reshape(-1)
            off += n
    xp = device.xp()
    model.weights = xp.asarray(host)
    model.wgrads = xp.zeros_like(model.weights)
    off = 0
    model._plans = {}  # (numbactr.train.plan) new parameter Tensors: plans made before point at the old ones
    for layer in model.layers:
        layer.params, layer.grad_views = [], []
        for i, s in enumerate(layer.param_shapes()):
            n = math.prod(s)
            layer.params.append(
                Tensor(
                    model.weights[off : off + n].reshape(s), requires_grad=True, name=f"{layer.cfg.top_names[0]}.w{i}"
                )
            )
            layer.grad_views.append(model.wgrads[off : off + n].reshape(s))
            off += n
    model.dense_optimizer = DenseOptimizer(model.opt_params, model.n_params)
    used = {b for layer in model.layers for b in layer.cfg.bottom_names}
    used |= {e.cfg.bottom_name for e in model.embeddings}
    used |= {b for c in model.collections for b in c.bottoms}
    loss_tops = {layer.cfg.top_names[0] for layer, _ in model.losses}
    model.unused_tensors = [t for t in model.shapes if t not in used and t not in loss_tops]
    fuse_bias_relu(model)
    if model.etc is not None:  # one PS per embedding; existing sparse models are trained further
        try:
            training_cache.check_embeddings(model, model.etc)
        except training_cache.ETCError as e:
            raise ModelError(str(e)) from None
    model.compiled = True
    if model.etc is not None:
        training_cache.load_existing(model, model.etc)


def fuse_bias_relu(model) -> None:
    """Pair each InnerProduct (2-D) whose output only a ReLU reads with that ReLU: on gpu and sim the
    InnerProduct then runs bias + ReLU in one epilogue kernel each way (FusedInnerProduct's) and the ReLU
    passes its input on (numbactr.ops.fuse_bias_relu); its output tensor is then not kept."""
    readers: dict[str, list] = {}
    for layer in model.layers:
        for b in layer.cfg.bottom_names:
            readers.setdefault(b, []).append(layer)
    taken = {e.cfg.bottom_name for e in model.embeddings} | {b for c in model.collections for b in c.bottoms}
    model._fused_tops, model._last_fused = {}, {}
    for layer in model.layers:
        if layer.type_name != "InnerProduct" or len(layer.in_shapes[0]) != 2:
            continue
        top = layer.cfg.top_names[0]
        after = readers.get(top, [])
        if len(after) == 1 and after[0].type_name == "ReLU" and top not in taken:
            layer.relu_after, after[0].fused_into = after[0], layer
            model._fused_tops[top] = after[0].cfg.top_names[0]


def summary(model) -> None:
    line = "—" * 116
    inp = model.input
    out = [
        "=" * 51 + "Model Summary" + "=" * 53,
        "Model structure on each GPU",
        f"{'Label':<40}{'Dense':<30}{'Sparse':<30}",
        f"{','.join(inp.label_names):<40}{inp.dense_name:<30}{','.join(p.top_name for p in inp.sparse):<30}",
        f"{','.join(_fmt(model.shapes[n]) for n in inp.label_names):<40}{_fmt(model.shapes[inp.dense_name]):<30}",
        line,
        f"{'Layer Type':<40}{'Input Name':<30}{'Output Name':<30}{'Output Shape':<30}",
        line,
    ]
    rows = [(e.cfg.embedding_type.name, [e.cfg.bottom_name], [e.name]) for e in model.embeddings]
    rows += [(c.name, c.bottoms, [n for n, _ in c.tops(0)]) for c in model.collections]
    # dense layers as HugeCTR lists them, with the Slice copies it inserts for tensors read twice
    shapes = dict(model.shapes)
    for d in graph_json.slice_expanded(model) if model.input is not None else []:
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


def make_reader(model, source: str, batch: int, repeat: bool, eval: bool = False):
    """A reader of this rank's rows of GLOBAL batches of `batch` samples (numbactr.data.make_reader)."""
    from numbactr.data import make_reader as data_reader
    from numbactr.data.validation import LabelRule, SlotRanges

    inp = model.input
    # one-hot tables (OneHot, Hybrid) have no hash: they take per-slot keys in [0, size_s) and add the slot
    # offsets themselves (HugeCTR's do_unique_key), so a key outside its slot would train another slot's rows
    bounds = [None] * len(inp.sparse)
    for e in model.embeddings:
        kind = e.cfg.embedding_type
        if kind in (Embedding_t.LocalizedSlotSparseEmbeddingOneHot, Embedding_t.HybridSparseEmbedding):
            if e.cfg.slot_size_array:
                sizes = np.asarray(e.cfg.slot_size_array, np.int64)
                bounds[model.sparse_inputs[e.cfg.bottom_name]] = SlotRanges(
                    np.zeros_like(sizes),
                    sizes,
                    f"{kind.name} {e.name!r} (slot_size_array; it takes per-slot keys and adds the slot offsets)",
                )
    # each loss layer states what its label columns may hold (numbactr.data.validation.LABEL_KINDS)
    rules = [None] * inp.label_dim
    for layer, _ in model.losses:
        c0, c1 = model.label_columns[layer.cfg.bottom_names[1]]
        rule = LabelRule(layer.label_kind, f"{layer.type_name} {layer.cfg.top_names[0]!r}")
        rules[c0:c1] = [rule] * (c1 - c0)
    return data_reader(
        model.reader_params,
        source,
        batch,
        inp.label_dim,
        inp.dense_dim,
        [sp.slot_num for sp in inp.sparse],
        [sp.nnz_per_slot for sp in inp.sparse],
        model.solver.i64_input_key,
        repeat,
        rank=model.comm.rank,
        ranks=model.ranks,
        eval=eval,
        key_bound=bounds,
        label_rules=rules,
        seed=model.solver.seed,
    )


def require_compiled(model, what: str) -> None:
    if not model.compiled:
        raise ModelError(f"Model.{what}: call compile() first")


def _names(x) -> list:
    return [x] if isinstance(x, str) else list(x)


def _fmt(shape: tuple) -> str:
    return "(" + ",".join(str(d) for d in shape) + ")"
