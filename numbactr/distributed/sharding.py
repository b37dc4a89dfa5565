"""Who owns what across ranks (HugeCTR semantics, TorchRec vocabulary).

- Data: the global batch is split contiguously, rank r gets rows [r*B/R, (r+1)*B/R) (spec §2.3).
- DistributedSlotSparseEmbeddingHash = row-wise sharding: key k lives on rank k % R.
- LocalizedSlotSparseEmbeddingHash = table-wise sharding: every key of slot s lives on rank s % R.
"""

from __future__ import annotations

import numpy as np


def rank_rows(global_batch: int, rank: int, ranks: int) -> tuple[int, int]:
    per = global_batch // ranks
    return rank * per, (rank + 1) * per


def split_batch(batch, rank: int, ranks: int):
    """This rank's rows of a global batch (a numbactr.data.batch.Batch, of the same type); valid rows are
    those of the global batch that fall here."""
    if ranks == 1:
        return batch
    r0, r1 = rank_rows(batch.batch_size, rank, ranks)
    sparse = []
    for keys, offsets in batch.sparse:
        slots = (len(offsets) - 1) // batch.batch_size
        o = offsets[r0 * slots : r1 * slots + 1]
        sparse.append((keys[o[0] : o[-1]], (o - o[0]).astype(np.int64)))
    valid = int(min(max(batch.size - r0, 0), r1 - r0))
    return type(batch)(batch.label[r0:r1], batch.dense[r0:r1], sparse, size=valid)


def key_owner(keys: np.ndarray, slots: np.ndarray, ranks: int, by_slot: bool) -> np.ndarray:
    """(N,) owning rank of every key occurrence: key % R (distributed) or slot % R (localized)."""
    if by_slot:
        return (slots % ranks).astype(np.int64)
    return key_owner_of(np.asarray(keys), ranks)


def key_owner_of(keys, ranks: int):
    """(N,) int64 owner of each key of a key-owned (distributed) table, key % R as uint64, in the keys' own
    array library (NumPy or CuPy: a gathered exchange computes it on the device)."""
    return (keys.astype(np.uint64) % np.uint64(ranks)).astype(np.int64)
