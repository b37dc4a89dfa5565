"""A SparseEmbedding as ONNX: keys -> rows of a table initializer -> vectors -> pooled per slot.

Input: keys (B, S, W) int64, slot s's keys of a sample first and PAD_KEY (-1) after them, W = the
input's max nnz. The table initializer (1 + n, D) holds row 0 = zeros (the vector of a key the table
does not hold, HugeCTR's default_value_for_each_table = 0, and of padding) and the n trained vectors
in the sparse model's order. A key's row, 1 + its position in the table or 0:
  a lookup array when the keys are small non-negative integers (offset Criteo-style keys, one-hot
  tables): rows = lut[clip(key, -1, K)] (K = largest key + 1; lut[K] = 0, and Gather reads -1 as
  the last entry, so padding and any key outside [0, K) read 0). Used when K <= DENSE_SLACK * n or
  K <= DENSE_MIN: the array costs at most DENSE_SLACK int32 per key;
  an ai.onnx.ml LabelEncoder (a hash map, default 0) for any other keys (hashed uint64 ids).
The lookup array keeps such models in the default ONNX domain (runtimes without ai.onnx.ml run them) at
4 bytes per key where LabelEncoder's attributes take 16; onnxruntime runs both about equally fast
(1M keys, DLRM, batch 1024: 277k and 293k predictions/s on one core).
One-hot tables (LocalizedSlotSparseEmbeddingOneHot, HybridSparseEmbedding): their input holds per-slot
ids, as in training; one_hot_keys adds each slot's offset first (the snapshot is the table of categories).
Pooling: sum over W (missing keys add zeros); mean divides by the keys present, missing ones counted,
padding not: numbactr's evaluation (kernels/embedding_bag.py: a missing key adds nothing and counts in
nnz; bags of 0 or 1 keys are not scaled). W = 1 skips the reduction.
"""

from __future__ import annotations

import numpy as np
from numbactr.data.validation import slot_offsets

PAD_KEY = -1
DENSE_SLACK = 4
DENSE_MIN = 1 << 16


def key_rows(g, keys: str, table_keys: np.ndarray, hint: str) -> str:
    """Rows (int, keys' shape): 1 + the position of each key in ``table_keys`` (n,), 0 when absent."""
    k = np.asarray(table_keys).astype(np.uint64).view(np.int64)  # uint64 ids as ONNX's int64 keys
    n = k.size
    span = int(k.max()) + 1 if n else 0
    if n == 0 or (int(k.min()) >= 0 and span <= max(DENSE_SLACK * n, DENSE_MIN)):
        lut = np.zeros(span + 1, np.int32 if n < 2**31 - 1 else np.int64)
        lut[k] = np.arange(1, n + 1)
        clipped = g.op(
            "Clip",
            [keys, g.const(-1, f"{hint}/lo", np.int64), g.const(span, f"{hint}/hi", np.int64)],
            f"{hint}/clipped",
        )
        return g.op("Gather", [g.const(lut, f"{hint}/lut", lut.dtype), clipped], f"{hint}/rows", axis=0)
    return g.op(
        "LabelEncoder",
        [keys],
        f"{hint}/rows",
        domain="ai.onnx.ml",
        keys_int64s=k.tolist(),
        values_int64s=list(range(1, n + 1)),
        default_int64=0,
    )


def one_hot_keys(g, keys: str, slot_size_array, hint: str) -> str:
    """A one-hot table's per-slot ids (B, S, W) as its one-hot table's keys (categories): key + the
    offset of its slot (slot_size_array), as in training; a key outside [0, size_s) (and padding) becomes
    PAD_KEY, which reads the zero row (training stops on such a key instead)."""
    sizes = np.asarray(slot_size_array, np.int64)
    starts = slot_offsets(sizes).reshape(1, -1, 1)  # (1, S, 1)
    inside = g.op(
        "And",
        [
            g.op("Not", [g.op("Less", [keys, g.const(0, f"{hint}/zero", np.int64)], f"{hint}/neg")], f"{hint}/nonneg"),
            g.op("Less", [keys, g.const(sizes.reshape(1, -1, 1), f"{hint}/sizes", np.int64)], f"{hint}/below"),
        ],
        f"{hint}/inside",
    )
    cats = g.op("Add", [keys, g.const(starts, f"{hint}/starts", np.int64)], f"{hint}/shifted")
    return g.op("Where", [inside, cats, g.const(PAD_KEY, f"{hint}/padkey", np.int64)], f"{hint}/categories")


def emit_embedding(g, emb, keys: str, width: int, out: str) -> None:
    """Nodes defining ``out`` (B, S, D), the pooled lookup of ``keys`` (B, S, width) in embedding ``emb``
    (a numbactr HashEmbedding or OneHotEmbedding holding the trained table)."""
    table_keys, vectors = emb.dump()  # (n,), (n, D)
    table = np.concatenate([np.zeros((1, emb.vec), np.float32), np.asarray(vectors, np.float32)])
    t = g.const(table, f"{out}/table")
    pad = keys
    kind = getattr(getattr(emb.cfg, "embedding_type", None), "name", None)
    if kind in ("LocalizedSlotSparseEmbeddingOneHot", "HybridSparseEmbedding"):
        keys = one_hot_keys(g, keys, emb.cfg.slot_size_array, out)
    rows = key_rows(g, keys, table_keys, out)
    if width == 1:  # one key per slot: no bag to pool
        flat = g.op("Squeeze", [rows, g.ints([2], f"{out}/ax")], f"{out}/rows2")  # (B, S)
        g.op("Gather", [t, flat], out, out=out, axis=0)
        return
    vecs = g.op("Gather", [t, rows], f"{out}/vectors", axis=0)  # (B, S, W, D)
    axis = g.ints([2], f"{out}/ax")
    if emb.cfg.combiner == "sum":
        g.op("ReduceSum", [vecs, axis], out, out=out, keepdims=0)
        return
    total = g.op("ReduceSum", [vecs, axis], f"{out}/sum", keepdims=0)  # (B, S, D)
    present = g.op(
        "Cast",
        [
            g.op(
                "Not",
                [g.op("Equal", [pad, g.const(PAD_KEY, f"{out}/pad", np.int64)], f"{out}/is_pad")],
                f"{out}/is_key",
            )
        ],
        f"{out}/present",
        to=g.onnx.TensorProto.FLOAT,
    )
    nnz = g.op("ReduceSum", [present, axis], f"{out}/nnz", keepdims=1)  # (B, S, 1)
    scale = g.op("Reciprocal", [g.op("Max", [nnz, g.const(1.0, f"{out}/one")], f"{out}/count")], f"{out}/scale")
    g.op("Mul", [total, scale], out, out=out)
