"""``numbactr export-onnx``: a trained model's graph JSON and model files -> an ONNX model.

    numbactr export-onnx dcn.json dcn_dense_2000.model -o dcn.onnx
    numbactr export-onnx dcn.json dcn_dense_2000.model dcn0_sparse_2000.model -o dcn.onnx --ntp-file x.ntp.json
    numbactr export-onnx dcn.json dcn_dense_2000.model --dense-only -o dcn_dense.onnx

Without sparse model folders on the line, they are the ones beside the dense model under HugeCTR's names
(``<prefix>_dense_<iter>.model`` -> ``<prefix><i>_sparse_<iter>.model`` for embedding i). A progress bar
follows the layers; the last line says what the model takes and gives.
"""

from __future__ import annotations

import os

from numbactr.files import checkpoint
from numbactr import log

DESCRIPTION = (
    "Convert a trained HugeCTR model (its graph JSON, dense model, sparse model folders and BatchNorm "
    "statistics) to an ONNX model whose predictions under onnxruntime equal numbactr's."
)
EPILOG = (
    "The ONNX model takes the dense features (batch, dense_dim) float and, per sparse input, its keys "
    "(batch, slots, max nnz) int64 with -1 after a slot's keys; it gives one output per loss layer, named "
    "after its label. Without sparse model folders on the line, those beside the dense model are read "
    "(<prefix><i>_sparse_<iter>.model for <prefix>_dense_<iter>.model)."
)


def add_arguments(p) -> None:
    p.add_argument("graph_config", help="the graph JSON (Model.graph_to_json)")
    p.add_argument("dense_model", help="the dense weights file, <prefix>_dense_<iter>.model")
    p.add_argument(
        "sparse_models",
        nargs="*",
        help="the sparse model folders, one per embedding in the graph's "
        "order (default: the ones beside the dense model)",
    )
    p.add_argument("-o", "--output", required=True, help="the ONNX file to write")
    p.add_argument("--ntp-file", default=None, help="BatchNorm statistics (default: <dense_model>.ntp.json)")
    p.add_argument(
        "--dense-only",
        action="store_true",
        help="leave the embedding tables out: the model then takes each embedding's vectors "
        "(batch, slots, width) instead of keys (HugeCTR's convert_embedding=False)",
    )
    p.add_argument("--graph-name", default="hugectr", help="the ONNX graph's name (default: hugectr)")


def run(args) -> int:
    from numbactr.onnx_converter.export import load_trained_model, model_to_onnx, save

    sparse = None
    if not args.dense_only:
        sparse = args.sparse_models or checkpoint.sparse_models_beside(
            args.graph_config, args.dense_model, "export-onnx"
        )
    elif args.sparse_models:
        raise ValueError("export-onnx: --dense-only takes no sparse model folders")
    model = load_trained_model(args.graph_config, args.dense_model, sparse, args.ntp_file)
    proto = model_to_onnx(model, not args.dense_only, args.graph_name)
    save(proto, args.output)
    ins = ", ".join(f"{i.name} {_dims(i)}" for i in proto.graph.input)
    outs = ", ".join(f"{o.name} {_dims(o)}" for o in proto.graph.output)
    size = sum(os.path.getsize(p) for p in (args.output, args.output + ".data") if os.path.exists(p))
    size_text = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
    log.info(f"export-onnx: wrote {args.output!r} ({size_text}); inputs {ins}; outputs {outs}")
    return 0


def _dims(value_info) -> str:
    from numbactr.onnx_converter import require_onnx

    t = value_info.type.tensor_type
    kind = "int64" if t.elem_type == require_onnx().TensorProto.INT64 else "float"
    return "(" + ", ".join(d.dim_param or str(d.dim_value) for d in t.shape.dim) + f") {kind}"
