"""Hash-based sparse embeddings (spec §5.2, §5.3), on one rank or model-parallel over ranks.

Per rank: a value pool (V, D), a key -> row HashTable (new keys take the next free row, in order of first
occurrence) and a sparse optimizer. A new key's vector is drawn U(-0.05, 0.05) from a hash of
(seed, key) (kernels/embedding_init.py), so every device and every sharding starts from the same
vectors. Training inserts unseen keys; evaluation only looks them up (a missing key adds a zero vector
but still counts in the mean denominator).

One rank:   (B, S) bags of keys -> rows -> pooled (B, S, D);  dY -> unique-row gradients -> update.
R ranks (mpiexec), TorchRec's input_dist -> lookup -> output_dist:
  1. input_dist  every key occurrence goes to its owner (key % R, or slot % R for Localized);
  2. lookup      the owner inserts/finds the keys it received and returns one vector per occurrence;
  3. output_dist the sender pools the returned vectors into its own bags (sum or mean).
  Backward runs the same wires in reverse: the sender turns dY of each bag into one gradient per key
  occurrence and sends it to the owner, which sums per row and updates its rows. Embedding gradients are
  never allreduced (model parallel).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import device, ops
from ..autograd import Context, Function, Tensor
from ..distributed.comm import world
from ..distributed.sharding import key_owner
from ..enums import Embedding_t
from ..kernels import embedding_bag as EB
from ..kernels import embedding_init as EI
from ..optim import SparseOptimizer
from .hash_table import HashTable, HashTableFullError

COMBINERS = {"sum": EB.SUM, "mean": EB.MEAN}
INIT_RANGE = (-0.05, 0.05)


@dataclass
class SparseGrad:
    """Gradient of an embedding table restricted to the rows one batch touched."""
    rows: object     # (U,) int64, unique, first-occurrence order
    values: object   # (U, D) float32

    def __add__(self, other):
        raise NotImplementedError("an embedding table read by two lookups in one step is not supported")


def reduce_by_row(rows, per_key_grad, offsets, combiner) -> SparseGrad:
    """Sum the gradients of key occurrences that share a row: (U,) rows, (U, D) grads.
    ``per_key_grad`` is either dY per bag (with CSR ``offsets``) or one row per key (offsets = arange)."""
    if not device.uses_kernels():
        return SparseGrad(*EB.embedding_bag_backward_ref(per_key_grad, rows, offsets, combiner))
    xp = device.xp()
    # Deduplicate rows with a small per-batch hash table: its row numbers ARE the compact index of
    # each unique table row, in first-occurrence order (the same order as the reference).
    dedup = HashTable(max(rows.shape[0], 1), use_kernels=True, xp=xp)
    hit = rows >= 0
    local = xp.full(rows.shape[0], -1, np.int64)
    if bool(hit.any()):
        local[hit] = dedup.insert(rows[hit])
    uniq = dedup.keys_by_row().astype(np.int64)                                  # (U,)
    grad = xp.zeros((uniq.shape[0], per_key_grad.shape[1]), np.float32)          # (U, D)
    bag_ids = xp.empty(rows.shape[0], np.int64)                                  # (N,)
    EB.bag_of_key(offsets, bag_ids)
    EB.embedding_bag_backward(per_key_grad, local, offsets, bag_ids, combiner, grad)
    return SparseGrad(uniq, grad)


class EmbeddingBagFn(Function):
    """One rank: pooled lookup of table rows."""

    @staticmethod
    def forward(ctx: Context, pool, rows=None, offsets=None, combiner=0, shape=()):
        ctx.rows, ctx.offsets, ctx.combiner = rows, offsets, combiner
        return ops.embedding_bag_forward(pool, rows, offsets, combiner).reshape(shape)   # (B, S, D)

    @staticmethod
    def backward(ctx: Context, dy):
        dy2 = device.contig(dy.reshape(-1, dy.shape[-1]))                             # (B*S, D)
        return reduce_by_row(ctx.rows, dy2, ctx.offsets, ctx.combiner)


class ShardedEmbeddingBagFn(Function):
    """R ranks: input_dist -> owner lookup -> output_dist, and the reverse in backward."""

    @staticmethod
    def forward(ctx: Context, pool, emb=None, keys=None, offsets=None, training=True, shape=()):
        xp, comm = device.xp(), emb.comm
        keys_h, offsets_h = device.to_host(keys), device.to_host(offsets).astype(np.int64)
        n, slots = keys_h.shape[0], shape[1]
        slot = key_slots(offsets_h, n, slots)                                        # (N,)
        owner = key_owner(keys_h, slot, comm.size, emb.by_slot)
        order = np.argsort(owner, kind="stable")                   # occurrences grouped by owner
        counts = np.bincount(owner, minlength=comm.size)
        cuts = np.cumsum(counts)[:-1]
        # 1. input_dist: keys to their owners; a Localized table in training also receives each key's
        #    slot, which the owner records for new keys (where the key goes when reloaded on R' ranks)
        send = keys_h[order].astype(np.uint64)
        record = training and emb.row_slot is not None
        if record:
            send = np.stack([send, slot[order].astype(np.uint64)], axis=1)          # (N, 2)
        recv_keys = comm.alltoallv(np.split(send, cuts))
        got = np.concatenate(recv_keys)
        got, got_slots = (got[:, 0], xp.asarray(got[:, 1].astype(np.int64))) if record else (got, None)
        # 2. lookup on the owner: one vector per received occurrence (zeros where missing in eval)
        rows = emb.rows_for(xp.asarray(got), training, got_slots)                  # (M,)
        vecs = xp.zeros((got.shape[0], pool.shape[1]), np.float32)
        hit = rows >= 0
        if got.shape[0]:
            vecs[hit] = pool[rows[hit]]
        recv_counts = [k.shape[0] for k in recv_keys]
        back_cuts = np.cumsum(recv_counts)[:-1]
        # 3. output_dist: vectors (and "missing" flags) back to the senders, then pooled there
        vec_parts = comm.alltoallv(np.split(device.to_host(vecs), back_cuts))
        hit_parts = comm.alltoallv(np.split(device.to_host(hit).astype(np.int8), back_cuts))
        mine = np.empty((n, pool.shape[1]), np.float32)
        mine[order] = np.concatenate(vec_parts)
        present = np.empty(n, np.int8)
        present[order] = np.concatenate(hit_parts)
        positions = np.where(present > 0, np.arange(n), -1).astype(np.int64)
        ctx.emb, ctx.order, ctx.cuts, ctx.back_cuts, ctx.rows = emb, order, cuts, back_cuts, rows
        ctx.offsets = xp.asarray(offsets_h)
        out = ops.embedding_bag_forward(xp.asarray(mine), xp.asarray(positions), ctx.offsets, emb.combiner)
        return out.reshape(shape)

    @staticmethod
    def backward(ctx: Context, dy):
        xp, comm = device.xp(), ctx.emb.comm
        dy2 = device.contig(dy.reshape(-1, dy.shape[-1]))                             # (B*S, D)
        n = int(device.to_host(ctx.offsets)[-1])
        # one gradient per key occurrence: dY of its bag, / nnz for mean
        per_key = reduce_by_row(xp.arange(n, dtype=np.int64), dy2, ctx.offsets, ctx.emb.combiner).values
        per_key_h = device.to_host(per_key)
        parts = comm.alltoallv(np.split(per_key_h[ctx.order], ctx.cuts))             # to the owners
        got = xp.asarray(np.concatenate(parts)) if parts else xp.zeros((0, dy2.shape[1]), np.float32)
        m = got.shape[0]
        return reduce_by_row(ctx.rows, got, xp.arange(m + 1, dtype=np.int64), EB.SUM)


def key_slots(offsets, n: int, slots: int):
    """(N,) int64 slot of each of the n keys of CSR bags ``offsets`` (B*S + 1,): bag b is slot b % S."""
    if isinstance(offsets, np.ndarray):
        bag = np.repeat(np.arange(offsets.shape[0] - 1, dtype=np.int64), np.diff(offsets))
    else:                                                        # device offsets (gpu): a kernel
        bag = device.xp().empty(n, np.int64)
        EB.bag_of_key(offsets, bag)
    return bag % slots


def max_vocabulary_size_per_gpu(workspace_mb: float, vec_size: int, n_states: int) -> int:
    """HugeCTR's sizing: floor(workspace_MB * 2^20 / ((1 + n_states) * 4 * vec_size))."""
    return int(math.floor(workspace_mb * 2 ** 20 / ((1 + n_states) * 4 * vec_size)))


def workspace_mb_for(rows: int, vec_size: int, n_states: int) -> int:
    return int(math.ceil(rows * (1 + n_states) * 4 * vec_size / 2 ** 20))


class HashEmbedding:
    """DistributedSlotSparseEmbeddingHash / LocalizedSlotSparseEmbeddingHash (identical on one rank)."""

    def __init__(self, cfg, sparse_param, opt, seed: int, comm=None):
        if cfg.embedding_type not in (Embedding_t.DistributedSlotSparseEmbeddingHash,
                                      Embedding_t.LocalizedSlotSparseEmbeddingHash):
            raise NotImplementedError(f"SparseEmbedding {cfg.sparse_embedding_name!r}: "
                                      f"{cfg.embedding_type.name} is not supported by numbactr (HybridSparseEmbedding: use "
                                      "LocalizedSlotSparseEmbeddingOneHot, the same math)")
        self.cfg, self.opt, self.seed = cfg, opt, int(seed)
        self.comm = comm or world()
        self.by_slot = cfg.embedding_type == Embedding_t.LocalizedSlotSparseEmbeddingHash
        self.name = cfg.sparse_embedding_name
        self.slots, self.vec = sparse_param.slot_num, cfg.embedding_vec_size
        self.combiner = COMBINERS[cfg.combiner]
        self.n_states = opt.n_states
        self.max_rows = max_vocabulary_size_per_gpu(cfg.workspace_size_per_gpu_in_mb, self.vec, self.n_states)
        if self.by_slot and cfg.slot_size_array:
            # Localized with slot_size_array: the table holds exactly the owned slots' keys (this wins
            # over the workspace), padded to the largest share over ranks as HugeCTR does
            sizes = list(cfg.slot_size_array)
            if len(sizes) != self.slots or any(v <= 0 for v in sizes):
                raise ValueError(f"SparseEmbedding {self.name!r}: slot_size_array needs one positive size per "
                                 f"slot ({self.slots} slots), got {sizes}")
            R = self.comm.size
            self.max_rows = max(sum(sizes[s] for s in range(r, self.slots, R)) for r in range(R))
        if self.max_rows <= 0:
            raise ValueError(f"SparseEmbedding {self.name!r}: workspace_size_per_gpu_in_mb="
                             f"{cfg.workspace_size_per_gpu_in_mb} holds no row of width {self.vec} with "
                             f"{opt.optimizer_type.name} ({self.n_states} state arrays); each row needs "
                             f"{(1 + self.n_states) * 4 * self.vec} bytes")
        xp = device.xp()
        self.weight = Tensor(xp.zeros((self.max_rows, self.vec), np.float32), name=f"{self.name}.pool",
                             requires_grad=True)                                     # (V, D)
        self.table = HashTable(self.max_rows, use_kernels=device.uses_kernels(), xp=xp)
        # Localized: the slot of each row's key, recorded at insertion (HugeCTR's slot_id), so a snapshot
        # reloaded on R' ranks puts every key on rank slot % R', where lookups look for it; -1 = unknown
        self.row_slot = xp.full(self.max_rows, -1, np.int64) if self.by_slot else None      # (V,)
        self.optimizer = SparseOptimizer(opt, (self.max_rows, self.vec), f"SparseEmbedding {self.name!r}")
        self.frozen = False

    def output_shape(self, batch: int) -> tuple:
        return (batch, self.slots, self.vec)

    def rows_for(self, keys, training: bool, slots=None):
        """Rows of keys (N,) on this rank's table: inserted (and initialized) in training, found in eval.
        ``slots`` (N,) int64, the slot of each key, is needed in training when the table records slots."""
        if not training:
            return self.table.find(keys)
        before = self.table.size
        try:
            rows = self.table.insert(keys)
        except HashTableFullError as e:
            need = e.used + e.needed             # distinct keys seen so far, this batch's included
            if self.by_slot and self.cfg.slot_size_array:
                fix = (f"its size is the sum of this rank's slot_size_array entries ({self.max_rows}), so some "
                       f"slot holds more distinct keys than its entry: raise the entries")
            else:
                mb = workspace_mb_for(need, self.vec, self.n_states)
                fix = (f"workspace_size_per_gpu_in_mb={self.cfg.workspace_size_per_gpu_in_mb} holds {self.max_rows}; "
                       f"those {need} rows need ceil(rows * (1 + {self.n_states} {self.opt.optimizer_type.name} "
                       f"state arrays) * 4 bytes * embedding_vec_size {self.vec} / 2^20) = {mb} MB (HugeCTR's "
                       f"sizing): set workspace_size_per_gpu_in_mb to at least {mb}")
            raise HashTableFullError(
                e.needed, e.used, e.max_rows,
                hint=f"SparseEmbedding {self.name!r}{self._where()}: the keys seen so far need {need} rows "
                     f"({e.used} in use + {e.needed} new in this batch); {fix}"
            ) from None
        if self.table.size > before:
            self._init_rows(rows, keys, before)
            if self.row_slot is not None:
                self._record_slots(rows, slots, before)
        return rows

    def _record_slots(self, rows, slots, first_new: int) -> None:
        """row_slot of the rows just handed out = the slot of their key's first occurrence."""
        if slots is None:
            raise ValueError(f"SparseEmbedding {self.name!r}: inserting keys needs their slots "
                             "(a Localized table records the slot of every key)")
        xp = device.xp()
        new = xp.nonzero(rows >= first_new)[0]                   # occurrences of new keys, batch order
        _, first = xp.unique(rows[new], return_index=True)       # rows first_new.. in order, first sighting
        self.row_slot[first_new:self.table.size] = xp.asarray(slots)[new[first]]

    def _init_rows(self, rows, keys, first_new: int) -> None:
        pool = self.weight.data
        k64 = keys.astype(np.uint64)
        if device.uses_kernels():
            EI.init_new_rows(pool, rows, device.xp().ascontiguousarray(k64), first_new, self.seed, *INIT_RANGE)
        else:
            new = rows >= first_new
            pool[rows[new]] = EI.row_values_ref(k64[new], self.vec, self.seed, *INIT_RANGE)

    def _where(self) -> str:
        return f" on rank {self.comm.rank}" if self.comm.size > 1 else ""

    def forward(self, tape, keys, offsets, batch: int, training: bool) -> Tensor:
        xp = device.xp()
        tape = tape if training else None
        if self.comm.size > 1:
            return ShardedEmbeddingBagFn.apply(tape, self.weight, emb=self, keys=keys, offsets=offsets,
                                               training=training, shape=self.output_shape(batch),
                                               name=self.name)
        keys, offsets = xp.asarray(keys), xp.asarray(offsets)
        slots = key_slots(offsets, keys.shape[0], self.slots) if training and self.row_slot is not None else None
        rows = self.rows_for(keys, training, slots)
        return EmbeddingBagFn.apply(tape, self.weight, rows=rows, offsets=offsets,
                                    combiner=self.combiner, shape=self.output_shape(batch), name=self.name)

    @property
    def rows_in_use(self) -> int:
        return self.table.size

    def dump(self):
        """(keys (n,) uint64 in row order, vectors (n, D)) held by this rank."""
        n = self.table.size
        return (device.to_host(self.table.keys_by_row()).astype(np.uint64),
                np.ascontiguousarray(device.to_host(self.weight.data[:n])))

    def dump_slots(self):
        """(n,) uint64 slot of each key in dump() order (HugeCTR's slot_id; 2**64-1 where unknown: keys
        loaded from a file without slot_id), or None for a Distributed table (HugeCTR writes none)."""
        if self.row_slot is None:
            return None
        return device.to_host(self.row_slot[:self.table.size]).astype(np.uint64)

    def dump_states(self) -> list:
        """The sparse optimizer's state arrays on the host, HugeCTR's per-rank file layout: (V, D) each,
        row r = the state of dump()'s r-th key (rows past the table size: initial values)."""
        return [np.ascontiguousarray(device.to_host(s)) for s in self.optimizer.states]

    def rows_of(self, keys: np.ndarray) -> np.ndarray:
        """(n,) int64 host rows of keys (n,) uint64 in this rank's table, -1 where absent."""
        return device.to_host(self.table.find(device.xp().asarray(keys))).astype(np.int64)

    def load(self, keys: np.ndarray, vectors: np.ndarray, slots: np.ndarray | None = None) -> None:
        """Replace the table by ``keys`` (n,) uint64 in rows 0..n-1 with ``vectors`` (n, D) and, for a
        Localized table, ``slots`` (n,) int64 (-1: unknown). The caller (numbactr.checkpoint) has already
        checked that they are this rank's keys, unique, not reserved and at most max_rows, so nothing
        here can fail half way. Optimizer states move with their keys; keys new to the table start
        from the initial state."""
        xp = device.xp()
        k = xp.asarray(keys.astype(np.uint64))
        old = self.table.find(k)                          # (n,) each key's row before, -1 if absent
        self.table.clear()
        self.table.insert(k)                              # unique keys, empty table: rows 0..n-1
        self.weight.data[:k.shape[0]] = xp.asarray(vectors.astype(np.float32))
        if self.row_slot is not None:
            self.row_slot.fill(-1)
            if slots is not None:
                self.row_slot[:k.shape[0]] = xp.asarray(slots.astype(np.int64))
        self.optimizer.take_rows(old)

    def update(self, lr: float, scaler: float) -> None:
        g = self.weight.grad
        self.weight.grad = None
        if g is None:
            return
        self.optimizer.step(self.weight.data, g.rows, g.values, self.rows_in_use,
                            0.0 if self.frozen else lr, scaler)


class OneHotEmbedding(HashEmbedding):
    """LocalizedSlotSparseEmbeddingOneHot (spec §5.4): no hash table, row = key.

    Keys must already be globally offset (slot s's keys in [Σ_{j<s} size_j, Σ_{j<=s} size_j)); a key
    outside [0, Σ sizes) is an error naming it. The block of slot s starts U(±sqrt(1/size_s)), drawn from
    a hash of (seed, row). Evaluation looks rows up exactly as training does (no insertion). Across ranks
    slot s belongs to rank s % R; each rank allocates the whole table but only its slots' rows are read
    or updated there (HugeCTR allocates only the owned blocks).
    """

    def __init__(self, cfg, sparse_param, opt, seed: int, comm=None):
        if cfg.embedding_type != Embedding_t.LocalizedSlotSparseEmbeddingOneHot:
            raise ValueError("OneHotEmbedding is for LocalizedSlotSparseEmbeddingOneHot")
        self.cfg, self.opt, self.seed = cfg, opt, int(seed)
        self.comm = comm or world()
        self.by_slot = True
        self.name = cfg.sparse_embedding_name
        self.slots, self.vec = sparse_param.slot_num, cfg.embedding_vec_size
        self.combiner = COMBINERS[cfg.combiner]
        self.n_states = opt.n_states
        sizes = list(cfg.slot_size_array)
        if len(sizes) != self.slots or any(s <= 0 for s in sizes):
            raise ValueError(f"SparseEmbedding {self.name!r} (LocalizedSlotSparseEmbeddingOneHot): needs "
                             f"slot_size_array with one positive size per slot ({self.slots} slots), got {sizes}")
        self.max_rows = int(sum(sizes))
        bound = np.repeat(np.sqrt(1.0 / np.asarray(sizes, np.float64)), sizes).astype(np.float32)   # (V,)
        host = EI.row_values_ref(np.arange(self.max_rows, dtype=np.uint64), self.vec, self.seed, -1.0, 1.0)
        xp = device.xp()
        self.weight = Tensor(xp.asarray(host * bound[:, None]), name=f"{self.name}.pool", requires_grad=True)
        self.table = None
        self.row_slot = None                      # row = key: the slot of a row is given by slot_size_array
        self.optimizer = SparseOptimizer(opt, (self.max_rows, self.vec), f"SparseEmbedding {self.name!r}")
        self.frozen = False

    @property
    def rows_in_use(self) -> int:
        return self.max_rows

    def rows_for(self, keys, training: bool, slots=None):
        xp = device.xp()
        rows = xp.asarray(keys).astype(np.int64)
        bad = (rows < 0) | (rows >= self.max_rows)
        if rows.shape[0] and bool(bad.any()):
            at = int(xp.argmax(bad))
            raise ValueError(f"SparseEmbedding {self.name!r} (OneHot): key {int(rows[at])} at position {at} of "
                             f"this batch is outside the table [0, {self.max_rows}) given by slot_size_array; "
                             "one-hot keys must be globally offset per slot")
        return rows

    def forward(self, tape, keys, offsets, batch: int, training: bool) -> Tensor:
        xp = device.xp()
        tape = tape if training else None
        if self.comm.size > 1:
            return ShardedEmbeddingBagFn.apply(tape, self.weight, emb=self, keys=keys, offsets=offsets,
                                               training=training, shape=self.output_shape(batch), name=self.name)
        rows = self.rows_for(keys, training)
        return EmbeddingBagFn.apply(tape, self.weight, rows=rows, offsets=xp.asarray(offsets),
                                    combiner=self.combiner, shape=self.output_shape(batch), name=self.name)

    def slot_of_keys(self, keys: np.ndarray) -> np.ndarray:
        """(n,) int64 slot whose block of rows holds each key (n,) in [0, V)."""
        return np.searchsorted(np.cumsum(self.cfg.slot_size_array), np.asarray(keys, np.int64), side="right")

    def _owned_rows(self) -> np.ndarray:
        """Rows of the slots this rank owns (slot s on rank s % R), ascending: HugeCTR's dump order."""
        rows = np.arange(self.max_rows, dtype=np.int64)
        return rows[self.slot_of_keys(rows) % self.comm.size == self.comm.rank]

    def dump(self):
        """(keys, vectors) of the slots this rank owns (every row on one rank)."""
        mine = self._owned_rows()
        return mine.astype(np.uint64), np.ascontiguousarray(device.to_host(self.weight.data)[mine])

    def dump_slots(self):
        return self.slot_of_keys(self._owned_rows()).astype(np.uint64)

    def dump_states(self) -> list:
        """State arrays of this rank's rows in dump() order, (n, D) each (the whole table is allocated on
        every rank, but only the owned rows are state)."""
        mine = self._owned_rows()
        return [np.ascontiguousarray(device.to_host(s)[mine]) for s in self.optimizer.states]

    def rows_of(self, keys: np.ndarray) -> np.ndarray:
        return np.asarray(keys).astype(np.int64)

    def load(self, keys: np.ndarray, vectors: np.ndarray, slots: np.ndarray | None = None) -> None:
        """Rows ``keys`` (n,) (validated in range by the caller) take ``vectors`` (n, D); other rows and
        every optimizer state stay as they are (row = key, so no state moves)."""
        xp = device.xp()
        self.weight.data[xp.asarray(keys.astype(np.int64))] = xp.asarray(vectors.astype(np.float32))


def make_embedding(cfg, sparse_param, opt, seed: int, comm=None):
    """The embedding object for a SparseEmbedding config."""
    if cfg.embedding_type == Embedding_t.LocalizedSlotSparseEmbeddingOneHot:
        return OneHotEmbedding(cfg, sparse_param, opt, seed, comm)
    return HashEmbedding(cfg, sparse_param, opt, seed, comm)
