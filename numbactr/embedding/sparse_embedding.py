"""Hash-based sparse embeddings (spec §5.2, §5.3) on one rank.

Per embedding: a value pool (V, D) pre-filled U(-0.05, 0.05) as HugeCTR does, a key -> row HashTable
(new keys take the next free row, in first-occurrence order), and a sparse optimizer. Training inserts
unseen keys; evaluation only looks them up (a missing key adds a zero vector but still counts in the
mean denominator).

Forward  (B, S) bags of keys -> rows -> pooled (B, S, D)
Backward dY (B, S, D) -> gradient per unique row (U, D) -> sparse optimizer update of those rows
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import device, ops
from ..autograd import Context, Function, Tensor
from ..enums import Embedding_t
from ..kernels import embedding_bag as EB
from ..optim import SparseOptimizer
from .hash_table import HashTable, HashTableFullError

COMBINERS = {"sum": EB.SUM, "mean": EB.MEAN}


@dataclass
class SparseGrad:
    """Gradient of an embedding table restricted to the rows one batch touched."""
    rows: object     # (U,) int64, unique, first-occurrence order
    values: object   # (U, D) float32

    def __add__(self, other):
        raise NotImplementedError("an embedding table read by two lookups in one step is not supported")


class EmbeddingBagFn(Function):
    @staticmethod
    def forward(ctx: Context, pool, rows=None, offsets=None, combiner=0, shape=()):
        ctx.rows, ctx.offsets, ctx.combiner = rows, offsets, combiner
        return ops.embedding_bag_forward(pool, rows, offsets, combiner).reshape(shape)   # (B, S, D)

    @staticmethod
    def backward(ctx: Context, dy):
        d = dy.shape[-1]
        dy2 = ops._contig(dy.reshape(-1, d))                          # (B*S, D)
        if not device.uses_kernels():
            return SparseGrad(*EB.embedding_bag_backward_ref(dy2, ctx.rows, ctx.offsets, ctx.combiner))
        xp, rows = device.xp(), ctx.rows
        # Deduplicate rows with a small per-batch hash table: its row numbers ARE the compact index
        # of each unique table row, in first-occurrence order (the same order as the reference).
        dedup = HashTable(rows.shape[0], use_kernels=True, xp=xp)
        local = dedup.insert(rows)                                    # (N,) in [0, U)
        uniq = dedup.keys_by_row().astype(np.int64)                   # (U,)
        grad = xp.zeros((uniq.shape[0], d), np.float32)               # (U, D)
        bag_ids = xp.empty(rows.shape[0], np.int64)                   # (N,)
        EB.bag_of_key(ctx.offsets, bag_ids)
        EB.embedding_bag_backward(dy2, local, ctx.offsets, bag_ids, ctx.combiner, grad)
        return SparseGrad(uniq, grad)


def max_vocabulary_size_per_gpu(workspace_mb: float, vec_size: int, n_states: int) -> int:
    """HugeCTR's sizing: floor(workspace_MB * 2^20 / ((1 + n_states) * 4 * vec_size))."""
    return int(math.floor(workspace_mb * 2 ** 20 / ((1 + n_states) * 4 * vec_size)))


def workspace_mb_for(rows: int, vec_size: int, n_states: int) -> int:
    return int(math.ceil(rows * (1 + n_states) * 4 * vec_size / 2 ** 20))


class HashEmbedding:
    """DistributedSlotSparseEmbeddingHash / LocalizedSlotSparseEmbeddingHash on a single rank
    (mathematically identical there, spec §5.3)."""

    def __init__(self, cfg, sparse_param, opt, rng, batch_size: int):
        if cfg.embedding_type not in (Embedding_t.DistributedSlotSparseEmbeddingHash,
                                      Embedding_t.LocalizedSlotSparseEmbeddingHash):
            raise NotImplementedError(f"SparseEmbedding {cfg.sparse_embedding_name!r}: "
                                      f"{cfg.embedding_type.name} is not implemented yet (tracked by issue 4)")
        self.cfg, self.opt = cfg, opt
        self.name = cfg.sparse_embedding_name
        self.slots, self.vec = sparse_param.slot_num, cfg.embedding_vec_size
        self.combiner = COMBINERS[cfg.combiner]
        self.n_states = opt.n_states
        self.max_rows = max_vocabulary_size_per_gpu(cfg.workspace_size_per_gpu_in_mb, self.vec, self.n_states)
        if self.max_rows <= 0:
            raise ValueError(f"SparseEmbedding {self.name!r}: workspace_size_per_gpu_in_mb="
                             f"{cfg.workspace_size_per_gpu_in_mb} holds no row of width {self.vec} with "
                             f"{opt.optimizer_type.name} ({self.n_states} state arrays); each row needs "
                             f"{(1 + self.n_states) * 4 * self.vec} bytes")
        xp = device.xp()
        pool = rng.uniform(-0.05, 0.05, (self.max_rows, self.vec)).astype(np.float32)   # (V, D)
        self.weight = Tensor(xp.asarray(pool), name=f"{self.name}.pool", requires_grad=True)
        self.table = HashTable(self.max_rows, use_kernels=device.uses_kernels(), xp=xp)
        self.optimizer = SparseOptimizer(opt, pool.shape, f"SparseEmbedding {self.name!r}")
        self.frozen = False

    def output_shape(self, batch: int) -> tuple:
        return (batch, self.slots, self.vec)

    def rows_for(self, keys, training: bool):
        if not training:
            return self.table.find(keys)
        try:
            return self.table.insert(keys)
        except HashTableFullError as e:
            need = e.used + e.needed
            raise HashTableFullError(
                e.needed, e.used, e.max_rows,
                hint=f"SparseEmbedding {self.name!r}: {need} rows needed but workspace_size_per_gpu_in_mb="
                     f"{self.cfg.workspace_size_per_gpu_in_mb} holds {self.max_rows}; set it to at least "
                     f"{workspace_mb_for(need, self.vec, self.n_states)}") from None

    def forward(self, tape, keys, offsets, batch: int, training: bool) -> Tensor:
        xp = device.xp()
        rows = self.rows_for(xp.asarray(keys), training)
        return EmbeddingBagFn.apply(tape if training else None, self.weight, rows=rows,
                                    offsets=xp.asarray(offsets), combiner=self.combiner,
                                    shape=self.output_shape(batch), name=self.name)

    def update(self, lr: float, scaler: float) -> None:
        g = self.weight.grad
        self.weight.grad = None
        if g is None:
            return
        self.optimizer.step(self.weight.data, g.rows, g.values, self.table.size,
                            0.0 if self.frozen else lr, scaler)
