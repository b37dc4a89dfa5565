"""HugeCTR's graph JSON (spec §7.4): ``Model.graph_to_json`` and ``Model.construct_from_json``.

One table, ``PARAMS``, says how each DenseLayer attribute is written under each layer type, so writing
and reading stay mirror images. The writer writes every key HugeCTR's writer (``save_graph_to_json`` in
``src/pybind/add_dense_layer.cpp``) writes, when HugeCTR writes it: Concat ``axis``, Softmax ``factor``,
Reshape ``leading_dim`` and ``time_step`` (unless ``selected``), MLP ``num_output`` with ``use_bias`` or
``biases`` and ``activation`` or ``activations`` appear even at their defaults, because HugeCTR's own
tools (its ONNX converter, its MLP reader) index them without a default. HugeCTR forgets Reshape
``shape``, Select ``dim``/``index``, MultiCross ``projection_dim`` (spec §10.16) and every layer's
``compute_config``; numbactr writes them as extra keys (``compute_config`` as ``{"async_wgrad": .., "fuse_wb":
..}``, only when one is True), which HugeCTR's reader ignores.
"""

from __future__ import annotations

import json

from numbactr.config import (
    CreateOptimizer,
    DataReaderSparseParam,
    DenseLayer,
    DenseLayerComputeConfig,
    Input,
    OptParamsPy,
    SparseEmbedding,
    warn_ignored,
)
from numbactr.enums import (
    Activation_t,
    Embedding_t,
    FcPosition_t,
    Initializer_t,
    Layer_t,
    Optimizer_t,
    Regularizer_t,
    Update_t,
)

_INIT = ("weight_init_type", "bias_init_type", "gamma_init_type", "beta_init_type")


def _always(cfg) -> bool:
    """Written whatever its value; optional on read (HugeCTR's reader defaults it)."""
    return True


def _selected(cfg) -> bool:
    return bool(cfg.selected)


def _unselected(cfg) -> bool:
    return not cfg.selected


def _compute_config_set(cfg) -> bool:
    return cfg.compute_config != DenseLayerComputeConfig()


# HugeCTR's writer drops compute_config; numbactr writes it (when not the default) as an extra key
_COMPUTE = (None, "compute_config", "compute_config", _compute_config_set)


# layer type -> [(json group or None for top level, json key, DenseLayer attribute, when written)]. When
# written: True = always, and required on read; False = only when the user set it (optional on read);
# a predicate of the DenseLayer = when it holds (optional on read: the format defines the key's absence).
PARAMS: dict[str, list[tuple]] = {
    "InnerProduct": [
        ("fc_param", "num_output", "num_output", True),
        ("fc_param", "weight_init", "weight_init_type", False),
        ("fc_param", "bias_init", "bias_init_type", False),
    ],
    "FusedInnerProduct": [
        ("fc_param", "num_output", "num_output", True),
        ("fc_param", "weight_init", "weight_init_type", False),
        ("fc_param", "bias_init", "bias_init_type", False),
        # HugeCTR's parser: position absent = None, activation absent = Relu (its own
        # test/scripts/dlrm_fp16_1gpu.json leaves both out); numbactr writes both
        (None, "position", "pos_type", _always),
        (None, "activation", "act_type", _always),
        _COMPUTE,
    ],
    "MLP": [
        ("mlp_param", "num_output", "num_output", _always),
        ("mlp_param", "num_outputs", "num_outputs", True),
        ("mlp_param", "use_bias", "use_bias", lambda c: not c.biases),
        ("mlp_param", "biases", "biases", lambda c: bool(c.biases)),
        ("mlp_param", "activation", "act_type", lambda c: not c.activations),
        ("mlp_param", "activations", "activations", lambda c: bool(c.activations)),
        ("mlp_param", "weight_init", "weight_init_type", False),
        ("mlp_param", "bias_init", "bias_init_type", False),
        _COMPUTE,
    ],
    "BatchNorm": [
        ("bn_param", "factor", "factor", True),
        ("bn_param", "eps", "eps", True),
        ("bn_param", "gamma_init", "gamma_init_type", False),
        ("bn_param", "beta_init", "beta_init_type", False),
    ],
    "LayerNorm": [
        ("ln_param", "eps", "eps", True),
        ("ln_param", "gamma_init", "gamma_init_type", False),
        ("ln_param", "beta_init", "beta_init_type", False),
    ],
    "Dropout": [(None, "rate", "dropout_rate", True)],
    "ELU": [("elu_param", "alpha", "elu_alpha", True)],
    "MultiCross": [
        ("mc_param", "num_layers", "num_layers", True),
        ("mc_param", "weight_init", "weight_init_type", False),
        ("mc_param", "bias_init", "bias_init_type", False),
        ("mc_param", "projection_dim", "projection_dim", False),
        _COMPUTE,
    ],
    "Interaction": [_COMPUTE],
    "Reshape": [
        (None, "leading_dim", "leading_dim", _unselected),
        (None, "time_step", "time_step", _unselected),
        (None, "selected", "selected_slots", _selected),
        (None, "shape", "shape", False),
    ],
    "Concat": [(None, "axis", "axis", _always)],
    "ReduceSum": [(None, "axis", "axis", True)],
    "ReduceMean": [(None, "axis", "axis", True)],
    "Slice": [(None, "ranges", "ranges", True)],
    "Select": [(None, "dim", "dim", True), (None, "index", "index", True)],
    "Gather": [(None, "indices", "indices", True)],
    "WeightMultiply": [(None, "weight_dims", "weight_dims", True), (None, "weight_init", "weight_init_type", False)],
    "FmOrder2": [(None, "out_dim", "out_dim", True)],
    "GRU": [
        ("gru_param", "num_output", "num_output", True),
        ("gru_param", "batchsize", "batchsize", True),
        ("gru_param", "SeqLength", "SeqLength", True),
        ("gru_param", "vector_size", "vector_size", True),
        ("gru_param", "weight_init", "weight_init_type", False),
        ("gru_param", "bias_init", "bias_init_type", False),
    ],
    "PReLU_Dice": [("prelu_dice_param", "alpha", "elu_alpha", True), ("prelu_dice_param", "eps", "eps", True)],
    "Scale": [("scale_param", "axis", "axis", True), ("scale_param", "factor", "factor", True)],
    "Softmax": [(None, "factor", "factor", _always)],
    "SequenceMask": [
        (None, "max_sequence_len_from", "max_sequence_len_from", True),
        (None, "max_sequence_len_to", "max_sequence_len_to", True),
    ],
    "SequenceMask/1": [(None, "max_sequence_len", "max_sequence_len", True)],  # v23.06: one bottom
    "MultiHeadAttention": [
        (None, "num_attention_heads", "num_attention_heads", True),
        (None, "transpose_b", "transpose_b", True),
    ],
    "MultiCrossEntropyLoss": [(None, "target_weight", "target_weight_vec", True)],
}
_LOSSES = ("BinaryCrossEntropyLoss", "CrossEntropyLoss", "MultiCrossEntropyLoss")
_ENUM_ATTRS = {"pos_type": FcPosition_t, "act_type": Activation_t, **{a: Initializer_t for a in _INIT}}


def _encode(attr, value):
    if attr in _INIT:
        return None if value == Initializer_t.Default else value.name
    if attr == "pos_type":
        return "None" if value == FcPosition_t.Non else value.name
    if attr == "act_type":
        return "None" if value == Activation_t.Non else value.name
    if attr == "activations":
        return ["None" if a == Activation_t.Non else a.name for a in value]
    if attr == "selected_slots":
        return list(value) if value else None
    if attr == "compute_config":
        return {"async_wgrad": value.async_wgrad, "fuse_wb": value.fuse_wb}
    if attr in ("ranges",):
        return [list(r) for r in value]
    if isinstance(value, tuple):
        return list(value)
    return value


def _decode(attr, value):
    enum = _ENUM_ATTRS.get(attr)
    if enum is not None:
        return getattr(enum, "Non" if value == "None" else value)
    if attr == "activations":
        return [Activation_t.Non if a == "None" else Activation_t[a] for a in value]
    if attr == "ranges":
        return [tuple(r) for r in value]
    if attr == "compute_config":
        return DenseLayerComputeConfig(**value)
    return value


def _one_or_list(names):
    return names[0] if len(names) == 1 else list(names)


def _as_list(x):
    return [x] if isinstance(x, str) else list(x)


def dense_layer_json(cfg) -> dict:
    t = cfg.layer_type.name
    out = {"type": t, "bottom": _one_or_list(cfg.bottom_names), "top": _one_or_list(cfg.top_names)}
    for group, key, attr, when in _params(t, cfg.bottom_names):
        if not (when(cfg) if callable(when) else when or attr in cfg.given):
            continue
        v = _encode(attr, getattr(cfg, attr))
        if v is None:
            continue
        (out.setdefault(group, {}) if group else out)[key] = v
    if t in _LOSSES and cfg.use_regularizer:
        out["regularizer"] = cfg.regularizer_type.name
        out["lambda"] = cfg.lambda_
    return out


# a Reshape needs one of its forms (leading_dim [+ time_step], selected slots, or numbactr's shape)
_RESHAPE_FORMS = ("leading_dim", "selected", "shape")


def _need(obj, key: str, where: str, path: str = ""):
    """obj[key], or ValueError naming where, the key and its path ("fc_param.num_output")."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: {path or 'the layer'} must be a JSON object, got {json.dumps(obj)[:60]}")
    if key not in obj:
        raise ValueError(f"{where}: missing key {(path + '.' if path else '') + key!r}")
    return obj[key]


def _enum(enum, name, where: str, key: str):
    try:
        return enum[name]
    except (KeyError, TypeError):
        raise ValueError(f"{where}: {key} {name!r} is not one of {list(enum.__members__)}") from None


# keys every layer object may hold besides its parameters ("name": HugeCTR's legacy configs)
_LAYER_KEYS = {"type", "bottom", "top", "name"}


def _warn_unknown(obj, known, where: str, path: str = "") -> None:
    """An unknown key (a typo, damage, another version's option) is not read: say so, since an optional
    parameter misspelled would otherwise silently take its default."""
    if isinstance(obj, dict):
        for k in obj:
            if k not in known:
                warn_ignored(
                    where,
                    f"unknown key {(path + '.' if path else '') + k!r}",
                    obj[k],
                    "numbactr does not read it",
                    stacklevel=5,
                )


def _params(t: str, bottoms) -> list:
    """PARAMS of layer type t; HugeCTR v23.06's one-bottom SequenceMask has its own key."""
    if t == "SequenceMask" and len(_as_list(bottoms)) == 1:
        return PARAMS["SequenceMask/1"]
    return PARAMS.get(t, [])


def dense_layer_from_json(d: dict, where: str = "graph JSON dense layer") -> DenseLayer:
    """A DenseLayer from its JSON object; ValueError naming `where` and the missing or bad key."""
    t = _need(d, "type", f"{where} (top {d.get('top')!r})" if isinstance(d, dict) else where)
    layer_type = _enum(Layer_t, t, where, "layer type")
    where = f"{where} ({t}, top {d.get('top')!r})"
    kw = {}
    for group, key, attr, when in _params(t, d.get("bottom", [])):
        required = when is True
        src = d
        if group:
            if group not in d and not required:
                continue
            src = _need(d, group, where)
        if not required and isinstance(src, dict) and key not in src:
            continue
        _need(src, key, where, group or "")
        if attr == "selected_slots":
            kw["selected"] = True
        try:
            kw[attr] = _decode(attr, src[key])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ValueError(
                f"{where}: bad value {json.dumps(src[key])[:60]} for key {(group + '.' if group else '') + key!r}"
            ) from None
    if t == "Reshape" and not any(k in d for k in _RESHAPE_FORMS):
        raise ValueError(f"{where}: missing key 'leading_dim' (or 'selected' / 'shape')")
    if t in _LOSSES and "regularizer" in d:
        kw.update(use_regularizer=True, regularizer_type=_enum(Regularizer_t, d["regularizer"], where, "regularizer"))
        kw["lambda"] = _need(d, "lambda", where)
    params = _params(t, d.get("bottom", []))
    _warn_unknown(
        d,
        _LAYER_KEYS | {g or k for g, k, _, _ in params} | ({"regularizer", "lambda"} if t in _LOSSES else set()),
        where,
    )
    for group in {g for g, _, _, _ in params if g}:
        _warn_unknown(d.get(group), {k for g, k, _, _ in params if g == group}, where, group)
    return DenseLayer(layer_type, _as_list(_need(d, "bottom", where)), _as_list(_need(d, "top", where)), **kw)


# optimizer type -> (JSON hyperparameter object, its keys = CreateOptimizer arguments), spec §7.4
_OPT_HPARAMS = {
    Optimizer_t.Adam: ("adam_hparam", ("beta1", "beta2", "epsilon")),
    Optimizer_t.AdaGrad: ("adagrad_hparam", ("initial_accu_value", "epsilon")),
    Optimizer_t.MomentumSGD: ("momentum_sgd_hparam", ("momentum_factor",)),
    Optimizer_t.Nesterov: ("nesterov_hparam", ("momentum_factor",)),
    Optimizer_t.SGD: ("sgd_hparam", ("atomic_update",)),
    Optimizer_t.Ftrl: ("ftrl_hparam", ("beta", "lambda1", "lambda2")),
}


def _optimizer_json(opt: OptParamsPy) -> dict:
    out = {"update_type": opt.update_type.name, "type": opt.optimizer_type.name}
    if opt.optimizer_type in _OPT_HPARAMS:
        group, keys = _OPT_HPARAMS[opt.optimizer_type]
        out[group] = {k: getattr(opt, k) for k in keys}
    return out


def _optimizer_from_json(d: dict, where: str) -> OptParamsPy:
    """Every key the writer writes is required: no hyperparameter silently takes a default."""
    t = _enum(Optimizer_t, _need(d, "type", where, "optimizer"), where, "optimizer type")
    kw = dict(
        optimizer_type=t,
        update_type=_enum(Update_t, _need(d, "update_type", where, "optimizer"), where, "optimizer update_type"),
    )
    if t in _OPT_HPARAMS:
        group, keys = _OPT_HPARAMS[t]
        h = _need(d, group, where, "optimizer")
        for k in keys:
            kw[k] = _need(h, k, where, f"optimizer.{group}")
        _warn_unknown(d, {"type", "update_type", group}, where, "optimizer")
        _warn_unknown(h, set(keys), where, f"optimizer.{group}")
    try:
        return CreateOptimizer(**kw)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def model_to_json(model) -> dict:
    inp = model.input
    multi = len(inp.label_dims) > 1
    data = {
        "type": "Data",
        "label": {
            "top": inp.label_names if multi else inp.label_names[0],
            "label_dim": inp.label_dims if multi else inp.label_dims[0],
        },
        "dense": {"top": inp.dense_name, "dense_dim": inp.dense_dim},
        "sparse": [
            {
                "top": p.top_name,
                "type": "DistributedSlot",
                "nnz_per_slot": p.nnz_per_slot,
                "is_fixed_length": p.is_fixed_length,
                "slot_num": p.slot_num,
            }
            for p in inp.sparse
        ],
    }
    layers = [data]
    for e in model.embeddings:
        c = e.cfg
        hp = {
            "workspace_size_per_gpu_in_mb": c.workspace_size_per_gpu_in_mb,
            "max_vocabulary_size_global": e.max_rows * model.ranks,
            "embedding_vec_size": c.embedding_vec_size,
            "combiner": c.combiner,
        }
        if c.slot_size_array:
            hp["slot_size_array"] = c.slot_size_array
        if c.embedding_type != Embedding_t.DistributedSlotSparseEmbeddingHash:
            data["sparse"][model.sparse_inputs[c.bottom_name]]["type"] = "LocalizedSlot"
        if c.embedding_type == Embedding_t.HybridSparseEmbedding:
            # the parameters in effect (without a hybrid_embedding_param: HugeCTR's SparseEmbedding defaults),
            # so construct_from_json rebuilds the same embedding
            param = c.hybrid_embedding_param or getattr(e, "param", None)
            if param is not None:
                hp.update(_hybrid_json(param))
        layers.append(
            {
                "type": c.embedding_type.name,
                "bottom": c.bottom_name,
                "top": c.sparse_embedding_name,
                "sparse_embedding_hparam": hp,
                "optimizer": _optimizer_json(e.opt),
            }
        )
    layers += slice_expanded(model)
    out = {"layers": layers}
    if model.solver.model_name:
        out["model_name"] = model.solver.model_name
    return out


#: HugeCTR's Slice takes at most 5 ranges (spec §4.2)
SLICE_MAX = 5


def _copies(name: str, k: int, width: int) -> tuple[list, list]:
    """(Slice layers, the k copy names) that give k full copies of tensor ``name``: one Slice when k <= 5,
    else a chain whose last top feeds the next Slice (``<name>_fanout<i>``), as HugeCTR's 5-range limit
    needs; every copy is ``<name>_slice<j>``."""
    layers, names, src = [], [], name
    while True:
        room = k - len(names)
        last = room <= SLICE_MAX
        tops = [f"{name}_slice{len(names) + j}" for j in range(room if last else SLICE_MAX - 1)]
        if not last:
            tops.append(f"{name}_fanout{len(layers)}")
        layers.append({"type": "Slice", "bottom": src, "top": tops, "ranges": [[0, width]] * len(tops)})
        if last:
            return layers, names + tops
        names += tops[:-1]
        src = tops[-1]


def slice_expanded(model) -> list[dict]:
    """Dense layers as HugeCTR lists them: a tensor read by k > 1 dense layers gets Slice layers of k full
    copies (``<name>_slice0`` ...; a chain of Slices past 5 readers) before its first reader, and the
    readers are rewired (spec §4.2)."""
    cfgs = [layer.cfg for layer in model.layers]
    readers: dict[str, int] = {}
    for c in cfgs:
        for b in c.bottom_names:
            readers[b] = readers.get(b, 0) + 1
    copies: dict[str, list] = {}
    used: dict[str, int] = {}
    out = []
    for c in cfgs:
        for b in c.bottom_names:
            if readers[b] > 1 and b not in copies:
                layers, copies[b] = _copies(b, readers[b], model.shapes[b][-1])
                out.extend(layers)
                used[b] = 0
        d = dense_layer_json(c)
        bottoms = []
        for b in c.bottom_names:
            if readers[b] > 1:
                bottoms.append(copies[b][used[b]])
                used[b] += 1
            else:
                bottoms.append(b)
        d["bottom"] = _one_or_list(bottoms)
        out.append(d)
    return out


def write(model, path: str) -> None:
    with open(path, "w") as f:
        json.dump(model_to_json(model), f, indent=2)


def construct(model, path: str, include_dense_network: bool) -> None:
    """Add the Input, the embeddings and (optionally) the dense layers described by a graph JSON.

    Bad files raise ValueError naming the file, the layer (index, type, top) and the missing or bad key.
    Optional keys (absent = the default HugeCTR's own reader gives them, or keys HugeCTR never writes):
    initializers (Default), Concat axis (1), Reshape time_step (0), Softmax factor (1), MultiCross
    projection_dim, MLP num_output/use_bias/biases/activation(s), a loss's regularizer (absent: none; with it,
    lambda is required), an embedding's optimizer (absent: the model's), one of workspace_size_per_gpu_in_mb
    and slot_size_array, and the informational max_vocabulary_size_global, model_name and sparse "type"
    (the embedding type decides). Every other key is required: nothing else silently defaults. A key
    numbactr does not read (a misspelled optional one, another version's option) warns
    (IgnoredArgumentWarning) naming the layer and the key.
    """
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
        graph = json.loads(text)
    except OSError as e:
        raise ValueError(f"graph JSON {path!r}: cannot be read ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"graph JSON {path!r}: not UTF-8 text at byte offset {e.start}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"graph JSON {path!r}: not valid JSON ({e})") from None
    layers = graph.get("layers") if isinstance(graph, dict) else None
    if not isinstance(layers, list) or not layers or not isinstance(layers[0], dict) or layers[0].get("type") != "Data":
        raise ValueError(f"graph JSON {path!r}: 'layers' must be a list starting with the Data layer")
    where = f"graph JSON {path!r}, layer 0 (Data)"
    data = layers[0]
    try:
        lab, dense = _need(data, "label", where), _need(data, "dense", where)
        sparse = []
        for k, sp in enumerate(_need(data, "sparse", where)):
            w = f"{where}, sparse[{k}]"
            sparse.append(
                DataReaderSparseParam(
                    _need(sp, "top", w),
                    _need(sp, "nnz_per_slot", w),
                    _need(sp, "is_fixed_length", w),
                    _need(sp, "slot_num", w),
                )
            )
        _warn_unknown(data, {"type", "label", "dense", "sparse", "name"}, where)
        _warn_unknown(lab, {"top", "label_dim"}, where, "label")
        _warn_unknown(dense, {"top", "dense_dim"}, where, "dense")
        for k, sp in enumerate(data["sparse"]):
            _warn_unknown(sp, {"top", "type", "nnz_per_slot", "is_fixed_length", "slot_num"}, where, f"sparse[{k}]")
        top, dims = _need(lab, "top", where, "label"), _need(lab, "label_dim", where, "label")
        dd, dn = _need(dense, "dense_dim", where, "dense"), _need(dense, "top", where, "dense")
        if isinstance(top, list):
            inp = Input(
                label_dims=dims, label_names=top, dense_dim=dd, dense_name=dn, data_reader_sparse_param_array=sparse
            )
        else:
            inp = Input(
                label_dim=dims, label_name=top, dense_dim=dd, dense_name=dn, data_reader_sparse_param_array=sparse
            )
        model.add(inp)
    except (ValueError, TypeError) as e:
        raise ValueError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    for i, d in enumerate(layers[1:], start=1):
        t = d.get("type") if isinstance(d, dict) else None
        where = f"graph JSON {path!r}, layer {i} ({t}, top {d.get('top') if isinstance(d, dict) else None!r})"
        try:
            if not isinstance(d, dict):
                raise ValueError(f"{where}: a layer must be a JSON object")
            if t in Embedding_t.__members__:
                model.add(_embedding_from_json(d, t, where))
            elif include_dense_network:
                model.add(dense_layer_from_json(d, f"graph JSON {path!r}, layer {i}"))
        except (ValueError, TypeError) as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith(f"graph JSON {path!r}") else f"{where}: {msg}") from None


# HugeCTR's JSON names of the hybrid embedding's parameters (sparse_embedding_hparam); its reader spells
# CommunicationType.IB_NVLink_Hier "IB_NVLink_Hierarchical"
_HYBRID_KEYS = (
    "max_num_frequent_categories",
    "max_num_infrequent_samples",
    "p_dup_max",
    "max_all_reduce_bandwidth",
    "max_all_to_all_bandwidth",
    "efficiency_bandwidth_ratio",
)
_COMM_JSON = {
    "IB_NVLink_Hier": "IB_NVLink_Hierarchical",
    "IB_NVLink": "IB_NVLink",
    "NVLink_SingleNode": "NVLink_SingleNode",
}


def _hybrid_json(p) -> dict:
    out = {k: getattr(p, k) for k in _HYBRID_KEYS}
    out["communication_type"] = _COMM_JSON[p.communication_type.name]
    return out


def _hybrid_from_json(hp: dict, where: str):
    from numbactr.config import HybridEmbeddingParam
    from numbactr.enums import CommunicationType

    kw = {k: hp[k] for k in _HYBRID_KEYS if k in hp}
    if "communication_type" in hp:
        names = {v: k for k, v in _COMM_JSON.items()}
        name = names.get(hp["communication_type"], hp["communication_type"])
        if name not in _COMM_JSON:
            raise ValueError(
                f"{where}: sparse_embedding_hparam.communication_type must be one of "
                f"{sorted(names)}, got {hp['communication_type']!r}"
            )
        kw["communication_type"] = CommunicationType[name]
    try:
        return HybridEmbeddingParam(**kw)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _embedding_from_json(d: dict, t: str, where: str) -> SparseEmbedding:
    hp = _need(d, "sparse_embedding_hparam", where)
    vec = _need(hp, "embedding_vec_size", where, "sparse_embedding_hparam")
    if isinstance(vec, bool) or not isinstance(vec, int) or not 0 < vec <= 1024:
        raise ValueError(f"{where}: embedding_vec_size must be in 1..1024, got {vec!r}")
    if "workspace_size_per_gpu_in_mb" not in hp and "slot_size_array" not in hp:
        raise ValueError(
            f"{where}: missing key 'sparse_embedding_hparam.workspace_size_per_gpu_in_mb' (or "
            f"'sparse_embedding_hparam.slot_size_array')"
        )
    _warn_unknown(d, _LAYER_KEYS | {"sparse_embedding_hparam", "optimizer"}, where)
    hybrid = t == "HybridSparseEmbedding"
    _warn_unknown(
        hp,
        {
            "workspace_size_per_gpu_in_mb",
            "max_vocabulary_size_global",
            "embedding_vec_size",
            "combiner",
            "slot_size_array",
        }
        | (set(_HYBRID_KEYS) | {"communication_type"} if hybrid else set()),
        where,
        "sparse_embedding_hparam",
    )
    opt = _optimizer_from_json(d["optimizer"], where) if "optimizer" in d else OptParamsPy()
    extra = {"hybrid_embedding_param": _hybrid_from_json(hp, where)} if hybrid else {}
    return SparseEmbedding(
        Embedding_t[t],
        hp.get("workspace_size_per_gpu_in_mb", 0),
        vec,
        _need(hp, "combiner", where, "sparse_embedding_hparam"),
        _need(d, "top", where),
        _need(d, "bottom", where),
        hp.get("slot_size_array", []),
        opt,
        **extra,
    )
