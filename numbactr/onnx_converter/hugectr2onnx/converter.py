"""``hugectr2onnx.converter.convert``: HugeCTR's ONNX converter interface (onnx_converter/hugectr2onnx/
converter.py), with its arguments and defaults. Its command line is ``python -m
numbactr.onnx_converter.hugectr2onnx`` with HugeCTR's flags (--onnx_model_path, --graph_config,
--dense_model, --convert_embedding, --sparse_models, --ntp_file, --graph_name), or ``numbactr export-onnx``.

What the model takes and gives: numbactr.onnx_converter (package docstring).
"""

from __future__ import annotations

import os

from numbactr import log
from numbactr.onnx_converter import OnnxExportError
from numbactr.onnx_converter.export import load_trained_model, model_to_onnx, save


def convert(
    onnx_model_path,
    graph_config,
    dense_model,
    convert_embedding=False,
    sparse_models=None,
    ntp_file=None,
    graph_name="hugectr",
):
    """Convert a trained HugeCTR model to ONNX.

    Args:
        onnx_model_path: where to write the ONNX model.
        graph_config: the graph JSON of the model (``Model.graph_to_json``).
        dense_model: the dense weights file (``<prefix>_dense_<iter>.model``).
        convert_embedding: put the embedding tables in the model (its inputs are then keys); otherwise the
            model takes the embedding vectors (batch, slots, width) as inputs.
        sparse_models: the sparse model folders, one per embedding in the graph's order (needed with
            convert_embedding).
        ntp_file: the BatchNorm statistics (``.ntp.json``); None or "" reads ``dense_model + ".ntp.json"``.
        graph_name: the ONNX graph's name.

    Raises OnnxExportError (a ValueError) or FileNotFoundError naming the argument, file, layer or key.
    """
    if not isinstance(onnx_model_path, (str, os.PathLike)) or not str(onnx_model_path):
        raise OnnxExportError(f"ONNX export: onnx_model_path must be a file path, got {onnx_model_path!r}")
    if convert_embedding and not sparse_models:
        raise OnnxExportError(
            "ONNX export: convert_embedding=True needs sparse_models, one sparse model folder "
            "per embedding (e.g. ['wdl0_sparse_2000.model', 'wdl1_sparse_2000.model'])"
        )
    model = load_trained_model(graph_config, dense_model, sparse_models if convert_embedding else None, ntp_file)
    save(model_to_onnx(model, bool(convert_embedding), graph_name), str(onnx_model_path))
    log.info(f"ONNX model saved at {str(onnx_model_path)!r}")
