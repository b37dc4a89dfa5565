"""From a trained model's files (or a live numbactr Model) to an ONNX ModelProto and a .onnx file.

    model = load_trained_model(graph_config, dense_model, sparse_models, ntp_file)   # a numbactr Model
    proto = model_to_onnx(model, convert_embedding=True, graph_name="hugectr")
    save(proto, "model.onnx")

``load_trained_model`` builds the graph JSON with numbactr's reader (numbactr.files.graph_json, which names the
layer and key of a malformed file) and loads the files through numbactr.files.checkpoint (sizes against the
graph, keys, BatchNorm statistics, and the snapshot manifest when there is one), so the ONNX model holds
exactly the weights numbactr would predict with. ``model_to_onnx`` writes each layer's eval forward
(numbactr.onnx_converter.layers) and each embedding (numbactr.onnx_converter.embedding) as ONNX.
"""

from __future__ import annotations

import json
import os

import numpy as np

from numbactr.files import checkpoint
from numbactr import log
from numbactr.runtime import atomic, device
from numbactr.onnx_converter import OnnxExportError, require_onnx
from numbactr.onnx_converter.embedding import PAD_KEY, emit_embedding
from numbactr.onnx_converter.graph import BATCH, OnnxGraph
from numbactr.onnx_converter.layers import EMITTERS, PREDICTIONS

# a model whose initializers exceed this is saved with its tensors in "<file>.data" beside it (protobuf
# cannot serialize a message over 2 GiB)
MAX_INLINE_BYTES = 1 << 30
META_PREFIX = "numbactr."


def supported_layer_types() -> list[str]:
    """The layer types the converter writes (every dense Layer_t numbactr builds, and the losses)."""
    return sorted(EMITTERS) + sorted(PREDICTIONS)


def _build_batch(graph_config: str) -> int:
    """The batch size to build the graph with: 1 unless a layer fixes the rows (GRU's batchsize; Gather
    reads rows up to its largest index). The file is read again, with its errors, by construct_from_json."""
    try:
        with open(graph_config, "rb") as f:
            layers = json.loads(f.read().decode("utf-8"))["layers"][1:]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return 1
    rows = 1
    for d in layers:
        try:
            if d["type"] == "GRU":
                rows = max(rows, int(d["gru_param"]["batchsize"]))
            elif d["type"] == "Gather":
                rows = max(rows, 1 + max(int(i) for i in d["indices"]))
        except (KeyError, TypeError, ValueError):
            continue  # a malformed layer: its error comes from the reader
    return rows


def load_trained_model(graph_config: str, dense_model: str, sparse_models=None, ntp_file: str | None = None):
    """A compiled numbactr Model of ``graph_config`` holding the weights of ``dense_model`` (and its
    BatchNorm statistics from ``ntp_file``, by default ``dense_model + ".ntp.json"``) and, when
    ``sparse_models`` is given (one folder per embedding, in the graph's order), the embedding tables."""
    import numbactr as hugectr

    for what, path in (("graph_config", graph_config), ("dense_model", dense_model)):
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise OnnxExportError(f"ONNX export: {what} must be a file path, got {path!r}")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"ONNX export: {what} {str(path)!r} does not exist or is not a file")
    graph_config, dense_model = str(graph_config), str(dense_model)
    rows = _build_batch(graph_config)
    solver = hugectr.CreateSolver(batchsize=rows, batchsize_eval=rows, i64_input_key=True, vvgpu=[[0]])
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=[graph_config],
        eval_source=graph_config,
        check_type=hugectr.Check_t.Sum,
    )
    model = hugectr.Model(solver, reader, hugectr.CreateOptimizer())
    if model.ranks > 1:
        raise OnnxExportError(
            "ONNX export runs in one process (each of several ranks would hold only its "
            "share of the embedding tables); run it without mpiexec"
        )
    model.construct_from_json(graph_config, include_dense_network=True)
    try:
        model.compile()
    except ValueError as e:
        raise OnnxExportError(f"graph JSON {graph_config!r}: {e}") from None
    # HugeCTR's tests pass ntp_file="" for "none": the statistics are then where save() puts them
    checkpoint.load_dense_weights(model, dense_model, ntp_path=str(ntp_file) if ntp_file else None)
    if sparse_models is not None:
        if isinstance(sparse_models, (str, os.PathLike)):
            sparse_models = [sparse_models]
        files = [str(p) for p in sparse_models]
        for p in files:
            if not os.path.isdir(p):
                raise FileNotFoundError(
                    f"ONNX export: sparse model {p!r} is not a folder (a sparse model is "
                    "a folder holding key and emb_vector)"
                )
        model.load_sparse_weights(files)
    return model


def model_to_onnx(model, convert_embedding: bool = True, graph_name: str = "hugectr"):
    """The ONNX ModelProto of a compiled numbactr Model's eval forward (see the package docstring for its
    inputs and outputs); OnnxExportError naming a layer it cannot write."""
    if not getattr(model, "compiled", False):
        raise OnnxExportError("ONNX export: the model is not compiled (call compile() and load its weights)")
    if model.ranks > 1:
        raise OnnxExportError(
            "ONNX export runs in one process: with several ranks each holds only its share of the embedding tables"
        )
    g = OnnxGraph(str(graph_name))
    inp = model.input
    g.add_input(inp.dense_name, "float", [BATCH, inp.dense_dim])
    widths = {p.top_name: max(p.nnz_per_slot) for p in inp.sparse}
    if convert_embedding:
        for p in inp.sparse:
            g.add_input(p.top_name, "int64", [BATCH, p.slot_num, widths[p.top_name]])
    losses = {layer.cfg.bottom_names[1]: layer for layer, _ in model.losses}
    with log.progress(total=len(model.embeddings) + len(model.layers), desc="ONNX export", unit="layer") as bar:
        for e in model.embeddings:
            if convert_embedding:
                emit_embedding(g, e, e.cfg.bottom_name, widths[e.cfg.bottom_name], g.claim(e.name))
            else:
                g.add_input(e.name, "float", [BATCH, e.slots, e.vec])
            bar.update()
        for layer in model.layers:
            _emit_layer(g, layer)
            bar.update()
    outputs = []
    for label in inp.label_names:  # the Data layer's label order
        if label in losses:
            g.add_output(label, [BATCH, losses[label].in_shapes[0][1]])
            outputs.append(label)
    meta = {
        "dense": inp.dense_name,
        "outputs": json.dumps(outputs),
        "pad_key": str(PAD_KEY),
        "sparse": json.dumps(
            [[p.top_name, p.slot_num, widths[p.top_name]] for p in inp.sparse] if convert_embedding else []
        ),
        "embedding_inputs": json.dumps(
            [] if convert_embedding else [[e.name, e.slots, e.vec] for e in model.embeddings]
        ),
        "tables": json.dumps([[e.cfg.bottom_name, e.slots] for e in model.embeddings]),
    }
    proto = g.model({META_PREFIX + k: v for k, v in meta.items()})
    if _initializer_bytes(proto) <= MAX_INLINE_BYTES:
        require_onnx().checker.check_model(proto, full_check=True)
    return proto


def _emit_layer(g, layer) -> None:
    where = f"{layer.type_name} layer (bottom {layer.cfg.bottom_names} -> top {layer.cfg.top_names})"
    if layer.is_loss:  # HugeCTR's inference: the loss becomes its activation
        op, attrs = PREDICTIONS[layer.type_name]
        label = layer.cfg.bottom_names[1]
        g.op(op, [layer.cfg.bottom_names[0]], g.claim(label), out=label, **attrs)
        return
    emit = EMITTERS.get(layer.type_name)
    if emit is None:
        raise OnnxExportError(
            f"ONNX export: {where}: layer type {layer.type_name} is not supported by the "
            f"converter; supported: {', '.join(supported_layer_types())}"
        )
    tops = [g.claim(t) for t in layer.cfg.top_names]
    ws = [np.asarray(device.to_host(p.data), np.float32) for p in layer.params]
    emit(g, layer, list(layer.cfg.bottom_names), ws, tops)


def _initializer_bytes(proto) -> int:
    return sum(len(t.raw_data) for t in proto.graph.initializer)


def save(proto, path: str) -> None:
    """Write ``proto`` to ``path`` (through a temporary file, so an interrupted export leaves no partial
    model); a model whose initializers exceed MAX_INLINE_BYTES keeps them in ``<path>.data`` beside it
    (onnx moves them out of ``proto`` itself then)."""
    onnx = require_onnx()
    path = str(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"ONNX export: the folder of {path!r} does not exist")
    with atomic.atomic_path(path, tmp=path + ".partial") as tmp:
        if _initializer_bytes(proto) > MAX_INLINE_BYTES:
            data = os.path.basename(path) + ".data"
            onnx.save_model(
                proto, tmp, save_as_external_data=True, all_tensors_to_one_file=True, location=data, size_threshold=1024
            )
            onnx.checker.check_model(tmp, full_check=True)
        else:
            onnx.save_model(proto, tmp)
