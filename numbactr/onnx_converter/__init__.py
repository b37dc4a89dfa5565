"""ONNX export of trained HugeCTR models: HugeCTR's ``hugectr2onnx`` on numbactr.

HugeCTR's script changes one import line::

    from numbactr.onnx_converter import hugectr2onnx      # HugeCTR: import hugectr2onnx
    hugectr2onnx.converter.convert(onnx_model_path="wdl.onnx", graph_config="wdl.json",
                                   dense_model="wdl_dense_2000.model", convert_embedding=True,
                                   sparse_models=["wdl0_sparse_2000.model", "wdl1_sparse_2000.model"])

How it works (numbactr.onnx_converter.export): the graph JSON is built into a numbactr Model (HugeCTR's
reader, numbactr.files.graph_json) and the files are loaded with numbactr.files.checkpoint's verified loaders, so a
file that does not fit the graph stops with the loader's error naming the file. Every layer's eval forward
is then written as ONNX operators (numbactr.onnx_converter.layers, one emitter per Layer_t; the loss
becomes its activation as in HugeCTR's inference: BinaryCrossEntropyLoss and MultiCrossEntropyLoss a
Sigmoid, CrossEntropyLoss a Softmax), and each embedding a lookup of its keys in a table initializer
(numbactr.onnx_converter.embedding).

The ONNX model (opset 17; ai.onnx.ml 2 for tables whose keys need a hash map):
  inputs   the dense features ``<dense name>`` float (batch, dense_dim); per sparse input ``<name>`` int64
           (batch, slots, max nnz) keys, a slot's keys first and -1 after them (HugeCTR's converter
           takes the same tensor; -1 is the key numbactr's hash tables reserve). With
           convert_embedding=False, per embedding ``<embedding name>`` float (batch, slots, width) instead.
  outputs  one per loss layer, named after its label: (batch, 1) for BinaryCrossEntropyLoss, (batch, 2)
           for CrossEntropyLoss, (batch, T) for MultiCrossEntropyLoss, in the Data layer's label order.
  metadata numbactr.dense, numbactr.sparse ([name, slots, max nnz] per input), numbactr.tables (the
           embeddings' inputs in graph order), numbactr.outputs, numbactr.embedding_inputs: what
           numbactr.onnx_converter.runtime reads to feed the model.
A key the table does not hold gives a zero vector that still counts in a mean (numbactr's evaluation
and HugeCTR's default_value_for_each_table = 0); a one-hot key outside its table, an error in numbactr,
reads a zero vector too. Predictions equal numbactr's eval forward within 1e-5 (tests/test_onnx_converter.py,
every layer type numbactr has). Under numbactr.hugectr_exact.hugectr_exact() the export follows the exact
forward (GRU's seq-major layout and h0 = 0); onnxruntime's Softmax always subtracts the row max.

onnxruntime (numbactr.onnx_converter.runtime): ``onnxruntime_predictor(graph_config, dense_model,
sparse_models, threads=...)`` builds a session from a trained model's files; its ``predict(dense, sparse)``
runs a batch, ``predict_csr`` takes HugeCTR's InferenceSession request (dense_feature, embeddingcolumns,
row_ptrs). ``numbactr export-onnx`` is the command line.

Needs the ``onnx`` extra (``pip install numbactr[onnx]``: onnx and onnxruntime).
"""

from __future__ import annotations

EXTRA_HINT = "install the onnx extra: pip install 'numbactr[onnx]' (onnx and onnxruntime)"


def require_onnx():
    """The onnx module, or ImportError saying which extra to install."""
    try:
        import onnx
    except ImportError as e:
        raise ImportError(f"ONNX export needs the onnx package ({e}); {EXTRA_HINT}") from None
    return onnx


def require_onnxruntime():
    """The onnxruntime module, or ImportError saying which extra to install."""
    try:
        import onnxruntime
    except ImportError as e:
        raise ImportError(f"running an exported model needs onnxruntime ({e}); {EXTRA_HINT}") from None
    return onnxruntime


class OnnxExportError(ValueError):
    """A model or file the converter cannot turn into ONNX; the message names the layer or file."""
