"""One mini-batch as the data readers hand it to the model.

Shapes (B = batch size, S_i = slots of sparse input i, N_i = keys of input i in this batch):
  label  (B, label_dim) float32
  dense  (B, dense_dim) float32
  sparse [ (keys (N_i,) uint64|int64, offsets (B*S_i + 1,) int64) for each sparse input ]
         CSR over bags: bag index = sample * S_i + slot, keys of bag j are
         keys[offsets[j]:offsets[j+1]].
  size   number of valid rows; a partial last batch is padded to B rows with zero label/dense and
         empty slots (HugeCTR pads the same way), so rows [size, B) carry no data.
  global_size  valid rows of the whole GLOBAL batch this rank's slice comes from (readers set it; with
         one rank it equals size). A rank's slice may be empty (size 0) while the global batch is not:
         "end of data" is global_size == 0, "incomplete batch" is global_size < B * ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Batch:
    label: np.ndarray  # (B, label_dim) float32
    dense: np.ndarray  # (B, dense_dim) float32
    sparse: list = field(default_factory=list)  # [(keys (N,), offsets (B*S+1,) int64), ...]
    size: int = -1  # valid rows; -1 in the constructor means "all B rows"
    global_size: int = -1  # valid rows of the global batch; -1 means "= size"
    #: the host blocks the arrays live in when a reader worker assembled the batch in a stager's pinned
    #: arena (numbactr.data.staging.PinnedArena); None for ordinary arrays
    memory: object = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.size < 0:
            self.size = int(self.label.shape[0])
        if self.global_size < 0:
            self.global_size = self.size

    @property
    def batch_size(self) -> int:
        """B, the padded row count (>= size)."""
        return int(self.label.shape[0])

    def num_slots(self, i: int) -> int:
        """S_i, the slot count of sparse input i."""
        _, offsets = self.sparse[i]
        return (len(offsets) - 1) // max(self.batch_size, 1) if self.batch_size else 0

    def nnz(self, i: int) -> np.ndarray:
        """(B, S_i) int64 key count of every bag of sparse input i."""
        _, offsets = self.sparse[i]
        return np.diff(offsets).reshape(self.batch_size, -1)

    def bag_keys(self, i: int, sample: int, slot: int) -> np.ndarray:
        """Keys of one (sample, slot) bag of sparse input i (a view)."""
        keys, offsets = self.sparse[i]
        s = self.num_slots(i)
        j = sample * s + slot
        return keys[offsets[j] : offsets[j + 1]]
