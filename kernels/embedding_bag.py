"""Embedding bag: pooled row lookup over CSR bags (one bag per (sample, slot)).

    table   (V, D)        float32 value pool
    rows    (N,)          int64 row of each key in `table`; -1 = key missing (eval only)
    offsets (nbags+1,)    int64 CSR: bag j holds keys offsets[j]:offsets[j+1]; nbags = B*S
    nnz_j   = offsets[j+1] - offsets[j]     (missing keys count too)
    scale_j = 1/nnz_j if combiner == MEAN and nnz_j > 1 else 1
    out[j, :] = scale_j * sum_{k in bag j, rows[k] >= 0} table[rows[k], :]      # (nbags, D)
    (an empty bag gives a zero vector)

Backward, with `local` (N,) the compact index u in [0, U) of each key's row among the batch's unique
rows (-1 for missing keys):

    grad[local[k], :] += scale_{bag(k)} * dy[bag(k), :]      # grad (U, D), duplicates accumulate

HugeCTR: HugeCTR/src/embeddings/forward_per_gpu_functor.cu (forward_sum / forward_mean + forward_scale)
and HugeCTR/src/embeddings/backward_functor.cu (wgrad = top_grad, or top_grad/nnz for mean, nnz > 1).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int64

from .launch import launch_1d

SUM = 0
MEAN = 1


# ---- NumPy reference -------------------------------------------------------------------------
def _bag_of_key_ref(offsets: np.ndarray) -> np.ndarray:
    """(N,) bag index of every key."""
    nnz = np.diff(np.asarray(offsets, dtype=np.int64))
    return np.repeat(np.arange(nnz.size, dtype=np.int64), nnz)


def _bag_scale_ref(offsets: np.ndarray, combiner: int, dtype) -> np.ndarray:
    """(nbags,) factor applied to each bag's sum: 1 for sum, 1/nnz for mean with nnz > 1."""
    if combiner not in (SUM, MEAN):
        raise ValueError(f"combiner must be 0 (sum) or 1 (mean), got {combiner!r}")
    nnz = np.diff(np.asarray(offsets, dtype=np.int64))
    scale = np.ones(nnz.size, dtype=dtype)
    if combiner == MEAN:
        many = nnz > 1
        scale[many] = 1.0 / nnz[many]
    return scale


def _segment_sum(values: np.ndarray, starts: np.ndarray, counts: np.ndarray, nseg: int) -> np.ndarray:
    """(nseg, D) sums of consecutive row segments of values (N, D); segment j = values[starts[j]:
    starts[j] + counts[j]]. Empty segments give 0 (np.add.reduceat alone would not)."""
    out = np.zeros((nseg, values.shape[1]), dtype=values.dtype)
    full = counts > 0
    if values.shape[0] and full.any():
        out[full] = np.add.reduceat(values, starts[full], axis=0)
    return out


def embedding_bag_forward_ref(table: np.ndarray, rows: np.ndarray, offsets: np.ndarray,
                              combiner: int) -> np.ndarray:
    """(nbags, D) pooled rows, in table's dtype."""
    rows = np.asarray(rows, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    hit = rows >= 0
    vals = table[np.where(hit, rows, 0)]                            # (N, D) gathered rows
    vals[~hit] = 0                                                  # missing keys add nothing
    out = _segment_sum(vals, offsets[:-1], np.diff(offsets), len(offsets) - 1)
    return out * _bag_scale_ref(offsets, combiner, table.dtype)[:, None]


def first_occurrence_index(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique rows in first-occurrence order (U,) and each key's index into them (N,); -1 stays -1."""
    rows = np.asarray(rows, dtype=np.int64)
    local = np.full(rows.shape, -1, dtype=np.int64)
    hit = rows >= 0
    uniq, first, inverse = np.unique(rows[hit], return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")             # sorted-unique position -> first-seen rank
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    local[hit] = rank[inverse]
    return uniq[order].astype(np.int64), local


def embedding_bag_backward_ref(dy: np.ndarray, rows: np.ndarray, offsets: np.ndarray,
                               combiner: int) -> tuple[np.ndarray, np.ndarray]:
    """(unique_rows (U,), grad (U, D)): gradient of every row the batch touched, first-seen order."""
    uniq, local = first_occurrence_index(rows)
    bag = _bag_of_key_ref(offsets)                                  # (N,)
    hit = local >= 0
    wgrad = dy[bag[hit]] * _bag_scale_ref(offsets, combiner, dy.dtype)[bag[hit], None]   # (N_hit, D)
    # duplicates accumulate: sort occurrences by their unique row, then sum each run
    order = np.argsort(local[hit], kind="stable")
    counts = np.bincount(local[hit], minlength=uniq.size)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return uniq, _segment_sum(wgrad[order], starts, counts, uniq.size)


# ---- kernels ---------------------------------------------------------------------------------
@cuda.jit
def embedding_bag_forward_kernel(table, rows, offsets, combiner, out):
    # One (bag, d) output element per loop step: consecutive threads read consecutive d of the same
    # row, so the gather from `table` is coalesced. Each thread walks the bag's keys itself.
    d_size = out.shape[1]
    for i in range(cuda.grid(1), out.shape[0] * d_size, cuda.gridsize(1)):
        j = i // d_size
        d = i - j * d_size
        begin = offsets[j]
        end = offsets[j + 1]
        acc = float32(0.0)
        for k in range(begin, end):
            r = rows[k]
            if r >= int64(0):                   # -1: key missing in eval, contributes 0
                acc += table[r, d]
        nnz = end - begin
        if combiner == MEAN and nnz > int64(1):
            acc *= float32(1.0) / float32(nnz)  # HugeCTR forward_scale: multiply by 1/nnz
        out[j, d] = acc


@cuda.jit
def bag_of_key_kernel(offsets, bag_ids):
    # One bag per loop step; the bag writes its own index over its key range.
    for j in range(cuda.grid(1), offsets.shape[0] - 1, cuda.gridsize(1)):
        for k in range(offsets[j], offsets[j + 1]):
            bag_ids[k] = j


@cuda.jit
def embedding_bag_backward_kernel(dy, local, offsets, bag_ids, combiner, grad):
    # One (key, d) element per loop step. Keys sharing a row (within or across bags) hit the same
    # grad element, hence the atomic add.
    d_size = grad.shape[1]
    for i in range(cuda.grid(1), local.shape[0] * d_size, cuda.gridsize(1)):
        k = i // d_size
        d = i - k * d_size
        u = local[k]
        if u >= int64(0):
            j = bag_ids[k]
            g = dy[j, d]
            nnz = offsets[j + 1] - offsets[j]
            if combiner == MEAN and nnz > int64(1):
                g *= float32(1.0) / float32(nnz)
            cuda.atomic.add(grad, (u, d), g)


# ---- launch wrappers (allocate nothing; arrays are contiguous, float32 / int64) --------------
def _check_combiner(combiner: int) -> int:
    if combiner not in (SUM, MEAN):
        raise ValueError(f"combiner must be 0 (sum) or 1 (mean), got {combiner!r}")
    return int(combiner)


def embedding_bag_forward(table, rows, offsets, combiner: int, out) -> None:
    """out (nbags, D) = pooled rows of each bag (every element written)."""
    combiner = _check_combiner(combiner)
    launch_1d(embedding_bag_forward_kernel, out.shape[0] * out.shape[1],
              table, rows, offsets, combiner, out)


def bag_of_key(offsets, bag_ids) -> None:
    """bag_ids (N,) = bag index of every key."""
    launch_1d(bag_of_key_kernel, offsets.shape[0] - 1, offsets, bag_ids)


def embedding_bag_backward(dy, local, offsets, bag_ids, combiner: int, grad) -> None:
    """grad (U, D) += scaled dy of every key's bag, at the key's compact row; grad zeroed by caller.

    bag_ids (N,) comes from `bag_of_key(offsets, bag_ids)`.
    """
    combiner = _check_combiner(combiner)
    launch_1d(embedding_bag_backward_kernel, local.shape[0] * grad.shape[1],
              dy, local, offsets, bag_ids, combiner, grad)


PTX_CHECKS = [
    (embedding_bag_forward_kernel,
     "void(float32[:, ::1], int64[::1], int64[::1], int64, float32[:, ::1])"),
    (bag_of_key_kernel, "void(int64[::1], int64[::1])"),
    (embedding_bag_backward_kernel,
     "void(float32[:, ::1], int64[::1], int64[::1], int64[::1], int64, float32[:, ::1])"),
]
