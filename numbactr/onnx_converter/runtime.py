"""onnxruntime over an exported model: a session with a given thread count, fed numbactr's batches.

For ``numbactr bench inference`` (its onnxruntime column) and anyone serving the ONNX model::

    from numbactr.onnx_converter.runtime import onnxruntime_predictor
    ort_model = onnxruntime_predictor(graph_config, dense_model, sparse_models, threads=2)
    ort_model.predict(dense, sparse)       # dense (B, dense_dim); sparse: per sparse input (keys, offsets)
    ort_model.predict_batch(batch)         # a numbactr.data.batch.Batch (what the readers yield)
    ort_model.predict_csr(dense_feature, embeddingcolumns, row_ptrs)   # HugeCTR's InferenceSession request

``onnxruntime_predictor`` converts the trained model's files in memory (numbactr.onnx_converter.export)
and opens an onnxruntime CPU session with ``threads`` intra-op threads and one inter-op thread (the
graph is a chain, so more would only wait). ``OnnxPredictor(path_or_model, threads)`` opens an exported
.onnx file the same way. predict / predict_batch return {label name: (B, k) float32} in the Data layer's
label order; predict_csr returns them side by side, (B, sum of k), as HugeCTR's session returns its
num_samples * label_dim values.

Keys arrive as numbactr's CSR, ``keys`` (N,) and ``offsets`` (B*S + 1,) with bag b*S + s = sample b's
slot s (numbactr.data.batch.Batch.sparse), and are padded here to the model's (B, S, max nnz) int64 input
with -1 (``pad_bags``); a (B, S, W) int64 array is taken as it is.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np

from numbactr.onnx_converter import OnnxExportError, require_onnxruntime
from numbactr.onnx_converter.export import (
    META_PREFIX,
    MAX_INLINE_BYTES,
    _initializer_bytes,
    load_trained_model,
    model_to_onnx,
    save,
)
from numbactr.onnx_converter.embedding import PAD_KEY


def pad_bags(keys, offsets, batch: int, slots: int, width: int, name: str = "sparse input") -> np.ndarray:
    """(B, S, W) int64 keys from CSR ``keys`` (N,), ``offsets`` (B*S + 1,): each bag's keys, then -1."""
    keys = np.asarray(keys)
    offsets = np.asarray(offsets, np.int64)
    bags = batch * slots
    if offsets.shape != (bags + 1,) or offsets[0] != 0 or offsets[-1] != keys.shape[0]:
        raise ValueError(
            f"{name}: offsets must have B*S + 1 = {batch}*{slots} + 1 = {bags + 1} entries from 0 to "
            f"the {keys.shape[0]} keys, got {offsets.shape[0]} entries"
            + (f" from {offsets[0]} to {offsets[-1]}" if offsets.size else "")
        )
    nnz = np.diff(offsets)
    if (nnz < 0).any():
        raise ValueError(f"{name}: offsets decrease at bag {int(np.argmax(nnz < 0))}")
    if nnz.size and int(nnz.max()) > width:
        b = int(np.argmax(nnz > width))
        raise ValueError(
            f"{name}: sample {b // slots}, slot {b % slots} holds {int(nnz[b])} keys; the model takes at "
            f"most {width} per slot (the input's nnz_per_slot)"
        )
    k64 = keys.view(np.int64) if keys.dtype == np.uint64 else keys.astype(np.int64)
    out = np.full((bags, width), PAD_KEY, np.int64)
    bag = np.repeat(np.arange(bags), nnz)
    out[bag, np.arange(k64.shape[0]) - offsets[:-1][bag]] = k64
    return out.reshape(batch, slots, width)


class OnnxPredictor:
    """An onnxruntime session over a model numbactr exported, with its inputs described by the model's
    metadata (the dense input, the sparse inputs with their slots and widths, the outputs)."""

    def __init__(self, model, threads: int = 1):
        ort = require_onnxruntime()
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"OnnxPredictor: threads must be a positive int, got {threads!r}")
        self._tmp = None
        if not isinstance(model, (str, os.PathLike, bytes)):  # a ModelProto
            if _initializer_bytes(model) > MAX_INLINE_BYTES:  # too large for one message: via a file
                self._tmp = tempfile.TemporaryDirectory(prefix="numbactr-onnx-")
                path = os.path.join(self._tmp.name, "model.onnx")
                save(model, path)
                model = path
            else:
                model = model.SerializeToString()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.threads = threads
        self.session = ort.InferenceSession(
            model if isinstance(model, bytes) else str(model), sess_options=opts, providers=["CPUExecutionProvider"]
        )
        meta = self.session.get_modelmeta().custom_metadata_map
        try:
            self.dense_name = meta[META_PREFIX + "dense"]
            self.sparse = [tuple(x) for x in json.loads(meta[META_PREFIX + "sparse"])]  # (name, S, W)
            self.tables = [tuple(x) for x in json.loads(meta[META_PREFIX + "tables"])]  # (name, S)
            self.vectors = [tuple(x) for x in json.loads(meta[META_PREFIX + "embedding_inputs"])]
            self.outputs = json.loads(meta[META_PREFIX + "outputs"])
        except (KeyError, ValueError):
            raise OnnxExportError(
                f"OnnxPredictor: {model if isinstance(model, str) else 'the model'} was not "
                "exported by numbactr (its metadata does not describe the inputs)"
            ) from None
        self.dense_dim = next(i.shape[1] for i in self.session.get_inputs() if i.name == self.dense_name)

    def feeds(self, dense, sparse) -> dict:
        """The session's input dict. ``sparse``: one entry per sparse input (the Data layer's order), a
        (keys, offsets) CSR pair or a (B, S, W) int64 array; for a model exported without its embeddings,
        one (B, S, D) float32 array of vectors per embedding."""
        dense = np.ascontiguousarray(dense, np.float32)
        if dense.ndim != 2 or dense.shape[1] != self.dense_dim:
            raise ValueError(
                f"dense {self.dense_name!r}: expected (B, {self.dense_dim}) features, got shape {dense.shape}"
            )
        batch = dense.shape[0]
        feeds = {self.dense_name: dense}
        want = self.sparse or self.vectors
        if len(sparse) != len(want):
            raise ValueError(f"expected {len(want)} sparse inputs {[w[0] for w in want]}, got {len(sparse)}")
        for (name, slots, width), x in zip(want, sparse):
            if self.vectors:
                x = np.ascontiguousarray(x, np.float32)
            elif isinstance(x, tuple):
                x = pad_bags(x[0], x[1], batch, slots, width, f"sparse input {name!r}")
            else:
                x = np.ascontiguousarray(x, np.int64)
            if x.shape != (batch, slots, width):
                raise ValueError(f"input {name!r}: expected shape ({batch}, {slots}, {width}), got {x.shape}")
            feeds[name] = x
        return feeds

    def predict(self, dense, sparse) -> dict:
        """{label: (B, k) predictions} for one batch (see feeds for the arguments)."""
        return dict(zip(self.outputs, self.session.run(self.outputs, self.feeds(dense, sparse))))

    def predict_batch(self, batch) -> dict:
        """predict on a numbactr.data.batch.Batch (all its B rows, padding included)."""
        return self.predict(batch.dense, batch.sparse)

    def predict_csr(self, dense_feature, embeddingcolumns, row_ptrs) -> np.ndarray:
        """HugeCTR's ``InferenceSession.predict(dense_feature, embeddingcolumns, row_ptrs)`` request: the
        dense features of every sample (flat), the keys of every embedding table concatenated (tables in
        the graph's order), and per table its row pointers (num_samples * slots + 1, from 0). Returns
        (num_samples, sum of label dims) float32."""
        row_ptrs = np.asarray(row_ptrs, np.int64)
        keys = np.asarray(embeddingcolumns)
        slots = sum(s for _, s in self.tables)
        samples = (row_ptrs.shape[0] - len(self.tables)) // max(slots, 1)
        if samples * slots + len(self.tables) != row_ptrs.shape[0]:
            raise ValueError(
                f"row_ptrs holds {row_ptrs.shape[0]} entries: not num_samples * {slots} slots + "
                f"{len(self.tables)} tables"
            )
        dense = np.asarray(dense_feature, np.float32)
        if dense.size != samples * self.dense_dim:
            raise ValueError(
                f"dense_feature holds {dense.size} values: not num_samples {samples} * dense_dim {self.dense_dim}"
            )
        by_input, r0, k0 = {}, 0, 0
        for name, s in self.tables:
            ptr = row_ptrs[r0 : r0 + samples * s + 1]
            by_input[name] = (keys[k0 : k0 + ptr[-1]], ptr)
            r0, k0 = r0 + samples * s + 1, k0 + int(ptr[-1])
        if k0 != keys.shape[0]:
            raise ValueError(f"embeddingcolumns holds {keys.shape[0]} keys; the row pointers account for {k0}")
        sparse = [
            by_input.get(name, (np.zeros(0, np.int64), np.zeros(samples * s + 1, np.int64)))
            for name, s, _ in self.sparse
        ]
        out = self.predict(dense.reshape(samples, self.dense_dim), sparse)
        return np.concatenate([out[name] for name in self.outputs], axis=1)


def onnxruntime_predictor(
    graph_config: str, dense_model: str, sparse_models, ntp_file: str | None = None, threads: int = 1
) -> OnnxPredictor:
    """An OnnxPredictor for a trained model's files (the graph JSON, the dense model, one sparse model
    folder per embedding; ``ntp_file`` as in convert), converted in memory."""
    model = load_trained_model(graph_config, dense_model, sparse_models, ntp_file)
    return OnnxPredictor(model_to_onnx(model, True), threads)
