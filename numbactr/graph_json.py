"""HugeCTR's graph JSON (spec §7.4): ``Model.graph_to_json`` and ``Model.construct_from_json``.

One table, ``PARAMS``, says how each DenseLayer attribute is written under each layer type, so writing
and reading stay mirror images. HugeCTR forgets Reshape ``shape``, Select ``dim``/``index`` and MultiCross
``projection_dim`` (spec §10.16); numbactr writes them as extra keys, which HugeCTR's reader ignores.
"""
from __future__ import annotations

import json

from .config import DataReaderSparseParam, DenseLayer, Input, OptParamsPy, SparseEmbedding
from .enums import (Activation_t, Embedding_t, FcPosition_t, Initializer_t, Layer_t, Optimizer_t,
                    Regularizer_t, Update_t)

_INIT = ("weight_init_type", "bias_init_type", "gamma_init_type", "beta_init_type")

# layer type -> (json group or None for top level) -> [(json key, DenseLayer attribute, always?)]
PARAMS: dict[str, list[tuple]] = {
    "InnerProduct": [("fc_param", "num_output", "num_output", True), ("fc_param", "weight_init", "weight_init_type", False),
                     ("fc_param", "bias_init", "bias_init_type", False)],
    "FusedInnerProduct": [("fc_param", "num_output", "num_output", True), ("fc_param", "weight_init", "weight_init_type", False),
                          ("fc_param", "bias_init", "bias_init_type", False), (None, "position", "pos_type", True),
                          (None, "activation", "act_type", True)],
    "MLP": [("mlp_param", "num_outputs", "num_outputs", True), ("mlp_param", "use_bias", "use_bias", False),
            ("mlp_param", "biases", "biases", False), ("mlp_param", "activation", "act_type", False),
            ("mlp_param", "activations", "activations", False), ("mlp_param", "weight_init", "weight_init_type", False),
            ("mlp_param", "bias_init", "bias_init_type", False)],
    "BatchNorm": [("bn_param", "factor", "factor", True), ("bn_param", "eps", "eps", True),
                  ("bn_param", "gamma_init", "gamma_init_type", False), ("bn_param", "beta_init", "beta_init_type", False)],
    "LayerNorm": [("ln_param", "eps", "eps", True), ("ln_param", "gamma_init", "gamma_init_type", False),
                  ("ln_param", "beta_init", "beta_init_type", False)],
    "Dropout": [(None, "rate", "dropout_rate", True)],
    "ELU": [("elu_param", "alpha", "elu_alpha", True)],
    "MultiCross": [("mc_param", "num_layers", "num_layers", True), ("mc_param", "weight_init", "weight_init_type", False),
                   ("mc_param", "bias_init", "bias_init_type", False), ("mc_param", "projection_dim", "projection_dim", False)],
    "Reshape": [(None, "leading_dim", "leading_dim", False), (None, "time_step", "time_step", False),
                (None, "selected", "selected_slots", False), (None, "shape", "shape", False)],
    "Concat": [(None, "axis", "axis", False)],
    "ReduceSum": [(None, "axis", "axis", True)],
    "ReduceMean": [(None, "axis", "axis", True)],
    "Slice": [(None, "ranges", "ranges", True)],
    "Select": [(None, "dim", "dim", True), (None, "index", "index", True)],
    "Gather": [(None, "indices", "indices", True)],
    "WeightMultiply": [(None, "weight_dims", "weight_dims", True), (None, "weight_init", "weight_init_type", False)],
    "FmOrder2": [(None, "out_dim", "out_dim", True)],
    "GRU": [("gru_param", "num_output", "num_output", True), ("gru_param", "batchsize", "batchsize", True),
            ("gru_param", "SeqLength", "SeqLength", True), ("gru_param", "vector_size", "vector_size", True),
            ("gru_param", "weight_init", "weight_init_type", False), ("gru_param", "bias_init", "bias_init_type", False)],
    "PReLU_Dice": [("prelu_dice_param", "alpha", "elu_alpha", True), ("prelu_dice_param", "eps", "eps", True)],
    "Scale": [("scale_param", "axis", "axis", True), ("scale_param", "factor", "factor", True)],
    "Softmax": [(None, "factor", "factor", False)],
    "SequenceMask": [(None, "max_sequence_len_from", "max_sequence_len_from", True),
                     (None, "max_sequence_len_to", "max_sequence_len_to", True)],
    "MultiHeadAttention": [(None, "num_attention_heads", "num_attention_heads", True),
                           (None, "transpose_b", "transpose_b", True)],
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
    return value


def _one_or_list(names):
    return names[0] if len(names) == 1 else list(names)


def _as_list(x):
    return [x] if isinstance(x, str) else list(x)


def dense_layer_json(cfg) -> dict:
    t = cfg.layer_type.name
    out = {"type": t, "bottom": _one_or_list(cfg.bottom_names), "top": _one_or_list(cfg.top_names)}
    for group, key, attr, always in PARAMS.get(t, []):
        if not always and attr not in cfg.given and not (attr == "selected_slots" and cfg.selected):
            continue
        v = _encode(attr, getattr(cfg, attr))
        if v is None:
            continue
        (out.setdefault(group, {}) if group else out)[key] = v
    if t in _LOSSES and cfg.use_regularizer:
        out["regularizer"] = cfg.regularizer_type.name
        out["lambda"] = cfg.lambda_
    return out


def dense_layer_from_json(d: dict) -> DenseLayer:
    t = d["type"]
    try:
        layer_type = Layer_t[t]
    except KeyError:
        raise ValueError(f"graph JSON: unknown layer type {t!r}") from None
    kw = {}
    for group, key, attr, _ in PARAMS.get(t, []):
        src = d.get(group, {}) if group else d
        if key in src:
            if attr == "selected_slots":
                kw["selected"] = True
            kw[attr] = _decode(attr, src[key])
    if t in _LOSSES and "regularizer" in d:
        kw.update(use_regularizer=True, regularizer_type=Regularizer_t[d["regularizer"]])
        kw["lambda"] = d.get("lambda", 0.0)
    return DenseLayer(layer_type, _as_list(d["bottom"]), _as_list(d["top"]), **kw)


def _optimizer_json(opt: OptParamsPy) -> dict:
    out = {"update_type": opt.update_type.name, "type": opt.optimizer_type.name}
    t = opt.optimizer_type
    if t == Optimizer_t.Adam:
        out["adam_hparam"] = {"beta1": opt.beta1, "beta2": opt.beta2, "epsilon": opt.epsilon}
    elif t == Optimizer_t.AdaGrad:
        out["adagrad_hparam"] = {"initial_accu_value": opt.initial_accu_value, "epsilon": opt.epsilon}
    elif t == Optimizer_t.MomentumSGD:
        out["momentum_sgd_hparam"] = {"momentum_factor": opt.momentum_factor}
    elif t == Optimizer_t.Nesterov:
        out["nesterov_hparam"] = {"momentum_factor": opt.momentum_factor}
    elif t == Optimizer_t.SGD:
        out["sgd_hparam"] = {"atomic_update": opt.atomic_update}
    elif t == Optimizer_t.Ftrl:
        out["ftrl_hparam"] = {"beta": opt.beta, "lambda1": opt.lambda1, "lambda2": opt.lambda2}
    return out


def _optimizer_from_json(d: dict) -> OptParamsPy:
    t = Optimizer_t[d["type"]]
    h = next((v for k, v in d.items() if k.endswith("_hparam")), {})
    kw = dict(optimizer_type=t, update_type=Update_t[d.get("update_type", "Global")])
    for k in ("beta1", "beta2", "epsilon", "initial_accu_value", "momentum_factor", "atomic_update", "beta",
              "lambda1", "lambda2"):
        if k in h:
            kw[k] = h[k]
    return OptParamsPy(initialized=True, **kw)


def model_to_json(model) -> dict:
    inp = model.input
    multi = len(inp.label_dims) > 1
    data = {"type": "Data",
            "label": {"top": inp.label_names if multi else inp.label_names[0],
                      "label_dim": inp.label_dims if multi else inp.label_dims[0]},
            "dense": {"top": inp.dense_name, "dense_dim": inp.dense_dim},
            "sparse": [{"top": p.top_name, "type": "DistributedSlot", "nnz_per_slot": p.nnz_per_slot,
                        "is_fixed_length": p.is_fixed_length, "slot_num": p.slot_num} for p in inp.sparse]}
    layers = [data]
    for e in model.embeddings:
        c = e.cfg
        hp = {"workspace_size_per_gpu_in_mb": c.workspace_size_per_gpu_in_mb,
              "max_vocabulary_size_global": e.max_rows * model.ranks,
              "embedding_vec_size": c.embedding_vec_size, "combiner": c.combiner}
        if c.slot_size_array:
            hp["slot_size_array"] = c.slot_size_array
        if c.embedding_type != Embedding_t.DistributedSlotSparseEmbeddingHash:
            data["sparse"][model.sparse_inputs[c.bottom_name]]["type"] = "LocalizedSlot"
        layers.append({"type": c.embedding_type.name, "bottom": c.bottom_name, "top": c.sparse_embedding_name,
                       "sparse_embedding_hparam": hp, "optimizer": _optimizer_json(e.opt)})
    layers += slice_expanded(model)
    out = {"layers": layers}
    if model.solver.model_name:
        out["model_name"] = model.solver.model_name
    return out


def slice_expanded(model) -> list[dict]:
    """Dense layers as HugeCTR lists them: a tensor read by k > 1 dense layers gets a Slice layer of k
    full copies (``<name>_slice0`` ...) before its first reader, and the readers are rewired (spec §4.2)."""
    cfgs = [layer.cfg for layer in model.layers]
    readers: dict[str, int] = {}
    for c in cfgs:
        for b in c.bottom_names:
            readers[b] = readers.get(b, 0) + 1
    used: dict[str, int] = {}
    out = []
    for c in cfgs:
        for b in c.bottom_names:
            if readers[b] > 1 and b not in used:
                width = model.shapes[b][-1]
                out.append({"type": "Slice", "bottom": b, "top": [f"{b}_slice{i}" for i in range(readers[b])],
                            "ranges": [[0, width]] * readers[b]})
                used[b] = 0
        d = dense_layer_json(c)
        bottoms = []
        for b in c.bottom_names:
            if readers[b] > 1:
                bottoms.append(f"{b}_slice{used[b]}")
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
    """Add the Input, the embeddings and (optionally) the dense layers described by a graph JSON."""
    with open(path) as f:
        try:
            graph = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"graph JSON {path!r}: not valid JSON ({e})") from None
    layers = graph.get("layers")
    if not isinstance(layers, list) or not layers or layers[0].get("type") != "Data":
        raise ValueError(f"graph JSON {path!r}: 'layers' must be a list starting with the Data layer")
    data = layers[0]
    lab, dense = data["label"], data["dense"]
    sparse = [DataReaderSparseParam(s["top"], s["nnz_per_slot"], s.get("is_fixed_length", False), s["slot_num"])
              for s in data.get("sparse", [])]
    if isinstance(lab["top"], list):
        model.add(Input(label_dims=lab["label_dim"], label_names=lab["top"], dense_dim=dense["dense_dim"],
                        dense_name=dense["top"], data_reader_sparse_param_array=sparse))
    else:
        model.add(Input(label_dim=lab["label_dim"], label_name=lab["top"], dense_dim=dense["dense_dim"],
                        dense_name=dense["top"], data_reader_sparse_param_array=sparse))
    for i, d in enumerate(layers[1:], start=1):
        t = d.get("type")
        if t in Embedding_t.__members__:
            hp = d.get("sparse_embedding_hparam", {})
            vec = hp.get("embedding_vec_size", 0)
            if not 0 < vec <= 1024:
                raise ValueError(f"graph JSON {path!r}, layer {i} ({t}): embedding_vec_size must be in 1..1024")
            if "workspace_size_per_gpu_in_mb" not in hp and "slot_size_array" not in hp:
                raise ValueError(f"graph JSON {path!r}, layer {i} ({t}): needs workspace_size_per_gpu_in_mb "
                                 "or slot_size_array")
            opt = _optimizer_from_json(d["optimizer"]) if "optimizer" in d else OptParamsPy()
            model.add(SparseEmbedding(Embedding_t[t], hp.get("workspace_size_per_gpu_in_mb", 0), vec,
                                      hp.get("combiner", "sum"), d["top"], d["bottom"],
                                      hp.get("slot_size_array", []), opt))
        elif include_dense_network:
            try:
                model.add(dense_layer_from_json(d))
            except (KeyError, TypeError) as e:
                raise ValueError(f"graph JSON {path!r}, layer {i} ({t}): missing or bad field {e}") from None
