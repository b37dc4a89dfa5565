"""HugeCTR's SparseEmbedding (spec §5.2-§5.4) on the table-batched engine, on one rank or model-parallel.

Each SparseEmbedding is a thin face over ONE numbactr.embedding.engine.TableBatchedEmbedding: one table
(V, D) read by S features, the embedding's slots, in HugeCTR's sample-major CSR (bag b*S + s,
Layout.SAMPLE_MAJOR), so all slots are one fused lookup and the pooled (B, S*D) output is (B, S, D).
  Distributed / Localized hash: a keyed table. The engine's hash table maps key -> row: a new key takes the
      next row, in order of first occurrence, and starts U(-0.05, 0.05) from a hash of (seed, key), so every
      device and every sharding starts from the same vectors. Training inserts unseen keys; evaluation only
      finds them (a missing key adds a zero vector but still counts in the mean's nnz).
  OneHot: an unkeyed table, row = key.
  HybridSparseEmbedding: a OneHot table whose frequent rows are replicated on every rank and the others
      owned round-robin (numbactr.embedding.hybrid, a subclass of OneHotEmbedding).
The engine's fused optimizer is HugeCTR's sparse optimizer (numbactr.embedding.hugectr_optimizers.sparse_optimizer_spec) and its
state arrays are the embedding's (``states``: (V, D) each, HugeCTR's file order), which checkpoints save.

A training step: the forward looks the batch up; the tape's backward only keeps dLoss/dout (or, on an owner
rank, the gradients sent to it); ``update(lr, scaler)``, which Model.train calls once the step's loss passed
its finite check, runs the engine's fused backward + optimizer (rows grouped by a sort, each row's gradient
summed in occurrence order, the optimizer applied in the same pass) with that step's scheduled lr, or
lr = 0 when frozen (HugeCTR's freeze: the states keep updating). A step stopped by a non-finite loss
therefore changes no row.

R ranks (mpiexec): the table is model-parallel through numbactr.embedding.sharded.ShardedTable (TorchRec's
input_dist -> owner lookup -> output_dist, and the reverse in backward; its docstring has the steps). Every
key occurrence goes to its owner, key % R (Distributed) or slot % R (Localized, OneHot); a Localized table
in training also sends each key's slot, which the owner records for new keys (HugeCTR's slot_id: where the
key goes when a snapshot is reloaded on R' ranks). The owner looks its occurrences up with pooling NONE,
the senders pool the vectors that come back, and the owner's update() applies the gradients the senders
returned, summed in the global batch's order: sharded == one rank, bit for bit. Embedding gradients are
never allreduced (model parallel).
"""

from __future__ import annotations


import numpy as np

from numbactr.config import max_vocabulary_size_per_gpu, workspace_mb_for  # noqa: F401 (importable from here as before)
from numbactr.runtime import device
from numbactr.autograd import Tensor
from numbactr.distributed.comm import world
from numbactr.distributed.sharding import key_owner, key_owner_of
from numbactr.enums import Embedding_t
from numbactr.kernels import embedding_bag
from numbactr.kernels import hash_table as _ht
from numbactr.kernels.tbe import STATES
from numbactr.embedding.hugectr_optimizers import sparse_optimizer_spec
from numbactr.ops.embedding_bag import LookupFn
from numbactr.embedding.engine import BoundsCheck, Layout, Pooling, TableBatchedEmbedding, TableSpec, fill_uniform_rows
from numbactr.embedding.hash_table import HashTableFullError
from numbactr.embedding.tiered import TieredEmbedding
from numbactr.embedding.sharded import ShardedLookup, ShardedTable

POOLING = {"sum": Pooling.SUM, "mean": Pooling.MEAN}
INIT_RANGE = (-0.05, 0.05)


def key_slots(offsets, n: int, slots: int):
    """(N,) int64 slot of each of the n keys of CSR bags ``offsets`` (B*S + 1,): bag b is slot b % S."""
    if device.is_host_array(offsets):
        bag = np.repeat(np.arange(offsets.shape[0] - 1, dtype=np.int64), np.diff(offsets))
    else:  # device offsets (gpu): a kernel
        bag = device.xp().empty(n, np.int64)
        embedding_bag.bag_of_key(offsets, bag)
    return bag % slots


class HashEmbedding:
    """DistributedSlotSparseEmbeddingHash / LocalizedSlotSparseEmbeddingHash (identical on one rank)."""

    key_dtype = np.uint64  # keys on the wire between ranks

    def __init__(self, cfg, sparse_param, opt, seed: int, comm=None):
        if cfg.embedding_type not in (
            Embedding_t.DistributedSlotSparseEmbeddingHash,
            Embedding_t.LocalizedSlotSparseEmbeddingHash,
        ):
            raise ValueError(
                f"SparseEmbedding {cfg.sparse_embedding_name!r}: HashEmbedding is for the two hash "
                f"embeddings, not {cfg.embedding_type.name} (embedding.factory.make_embedding picks the class)"
            )
        self._configure(cfg, sparse_param, opt, seed, comm)
        self.by_slot = cfg.embedding_type == Embedding_t.LocalizedSlotSparseEmbeddingHash
        self.max_rows = max_vocabulary_size_per_gpu(cfg.workspace_size_per_gpu_in_mb, self.vec, self.n_states)
        if self.by_slot and cfg.slot_size_array:
            # Localized with slot_size_array: the table holds exactly the owned slots' keys (this wins
            # over the workspace), padded to the largest share over ranks as HugeCTR does
            sizes = list(cfg.slot_size_array)
            if len(sizes) != self.slots or any(v <= 0 for v in sizes):
                raise ValueError(
                    f"SparseEmbedding {self.name!r}: slot_size_array needs one positive size per "
                    f"slot ({self.slots} slots), got {sizes}"
                )
            R = self.comm.size
            self.max_rows = max(sum(sizes[s] for s in range(r, self.slots, R)) for r in range(R))
        if self.max_rows <= 0:
            raise ValueError(
                f"SparseEmbedding {self.name!r}: workspace_size_per_gpu_in_mb="
                f"{cfg.workspace_size_per_gpu_in_mb} holds no row of width {self.vec} with "
                f"{opt.optimizer_type.name} ({self.n_states} state arrays); each row needs "
                f"{(1 + self.n_states) * 4 * self.vec} bytes"
            )
        self._make_engine(TableSpec(self.max_rows, self.vec, keyed=True, init_range=INIT_RANGE))
        self.table = self.engine.hash_tables[0]
        # Localized: the slot of each row's key, recorded at insertion (HugeCTR's slot_id), so a snapshot
        # reloaded on R' ranks puts every key on rank slot % R', where lookups look for it; -1 = unknown
        self.row_slot = device.xp().full(self.max_rows, -1, np.int64) if self.by_slot else None  # (V,)

    def _configure(self, cfg, sparse_param, opt, seed: int, comm) -> None:
        self.cfg, self.opt, self.seed = cfg, opt, int(seed)
        self.comm = comm or world()
        self.name = cfg.sparse_embedding_name
        self.slots, self.vec = sparse_param.slot_num, cfg.embedding_vec_size
        self.n_states = opt.n_states
        self.frozen = False

    def _make_engine(self, table: TableSpec) -> None:
        """The engine: one table, the S slots its features in sample-major order, HugeCTR's optimizer; with
        numbactr's embedding_cache, the table in a backing tier behind a cache (numbactr.embedding.tiered)."""
        args = dict(
            pooling=POOLING[self.cfg.combiner],
            layout=Layout.SAMPLE_MAJOR,
            optimizer=sparse_optimizer_spec(self.opt, f"SparseEmbedding {self.name!r}"),
            bounds_check=BoundsCheck.FATAL,
            seed=self.seed,
        )
        tier = getattr(self.cfg, "embedding_cache", None)
        if tier is None:
            self.engine = TableBatchedEmbedding([table], [0] * self.slots, **args)
            # on the kernels (gpu, sim) the step reads no error flag or table size back, on one rank or several
            # (each rank its own engine and its sharded lookups' poolers); every rank reads them at display,
            # evaluation, snapshot and every NONFINITE_CHECK_EVERY steps (check_pending), and a rank that
            # finds an error raises it (numbactr.distributed.comm's guard then stops the whole job)
            self.engine.defer_checks = self.engine.impl == "kernels"
        elif self.comm.size > 1:
            raise NotImplementedError(
                f"SparseEmbedding {self.name!r}: embedding_cache (a tiered table) runs on "
                "one rank; sharded tiered tables are not implemented"
            )
        else:
            self.engine = TieredEmbedding(
                [table], [0] * self.slots, cache=tier.cache, backing=tier.backing, path=tier.path, **args
            )
        # (V, D): the engine's rows (a view; its row stride is padded to 16 bytes)
        self.weight = Tensor(self.engine.split_weights()[0], name=f"{self.name}.pool", requires_grad=True)
        self._pending = None  # (lookup, gradient) from this step's backward, for update()
        ranks = self.comm.size
        self._sharded = (
            ShardedTable(
                self.comm,
                self.vec,
                self.slots,
                self.engine.pooling,
                self._owner_lookup,
                key_dtype=self.key_dtype,
                defer_checks=self._deferred(),
                owner_of_keys=None if self.by_slot else (lambda k: key_owner_of(k, ranks)),
            )
            if ranks > 1
            else None
        )

    def output_shape(self, batch: int) -> tuple:
        return (batch, self.slots, self.vec)

    @property
    def states(self) -> list:
        """The optimizer's state arrays, (V, D) views of the engine's, in HugeCTR's file order (LazyGlobal
        Adam's per-row previous step, which HugeCTR's files do not hold, is left out)."""
        return self.engine.split_optimizer_states()[0][: len(STATES[self.engine.optimizer.kind])]

    # ---- a step ---------------------------------------------------------------------------------------
    def forward(self, tape, keys, offsets, batch: int, training: bool) -> Tensor:
        """Pooled (B, S, D) embeddings of this rank's keys (N,) in CSR bags ``offsets`` (B*S + 1,); in
        training the lookup goes on the tape."""
        if training:
            self._pending = None
        return LookupFn.apply(
            tape if training else None,
            self.weight,
            emb=self,
            keys=keys,
            offsets=offsets,
            training=training,
            shape=self.output_shape(batch),
            name=self.name,
        )

    def lookup(self, keys, offsets, training: bool):
        """(pooled (B, S*D), what hold_gradient needs)."""
        self._check_keys(keys)
        if self._sharded is not None:
            return self._sharded_lookup(keys, offsets, training)
        return self._engine_lookup(keys, offsets, training, self.engine.pooling)

    def hold_gradient(self, lookup, dy) -> None:
        """Keep this step's gradient for update(): dY (B, S, D) of a one-rank lookup; across ranks, one
        gradient per key occurrence goes to its owner (every rank takes part) and the owner keeps those."""
        if not isinstance(lookup, ShardedLookup):
            self._pending = (lookup, device.contig(dy.reshape(dy.shape[0], -1)))  # (B, S*D)
            return
        self._pending = self._sharded.gradients(lookup, dy.reshape(dy.shape[0], -1))  # (owned, (M, D))

    def update(self, lr: float, scaler: float) -> None:
        """The engine's fused backward + optimizer over the gradient held since this step's backward, with
        the step's learning rate (0 when frozen) and the Solver's loss scaler; nothing without one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self._set_rate(lr, scaler)
        from numbactr.runtime import step_values  # a replayed step sets the rate again (cuda_graphs)

        step_values.on_replay(("sparse", id(self)), lambda run: self._set_rate(run["lr"], run["scaler"]))
        self.engine.backward(*pending)

    def _set_rate(self, lr: float, scaler: float) -> None:
        eng = self.engine
        lr = 0.0 if self.frozen else float(lr)
        if eng.learning_rate != lr or eng.optimizer.scaler != scaler:
            eng.set_hyper_parameters(learning_rate=lr, scaler=float(scaler))

    def _check_keys(self, keys) -> None:
        """Hash tables take any key (the hash table rejects its reserved empty key)."""

    def _engine_lookup(self, keys, offsets, training: bool, pooling, slots=None, skip=None):
        """(out, LookupContext) of the engine's lookup; in training new keys are inserted and, in a
        Localized table, their slots recorded (``slots`` (N,) of the keys, else bag % S)."""
        table = self.table
        deferred = self._deferred()
        before = table.size if table is not None and not deferred else 0
        try:
            # (skip only where given: a gathered exchange's owner side; a tiered engine takes none)
            extra = {} if skip is None else {"skip": skip}
            out, ctx = self.engine.forward(keys, offsets, training=training, pooling=pooling, **extra)
        except HashTableFullError as e:
            raise self._full_error(e) from None
        new_rows = ctx.extra.get("new_rows")
        if training and self.row_slot is not None and new_rows:  # deferred: on the device
            rows, flags, _ = new_rows[0]
            if slots is None:
                slots = key_slots(device.xp().asarray(offsets), rows.shape[0], self.slots)
            _ht.scatter_flagged(self.row_slot, rows, flags, device.contig(slots.astype(np.int64)))
        elif training and self.row_slot is not None and not deferred and table.size > before:
            if slots is None:
                slots = key_slots(device.xp().asarray(offsets), ctx.rows.shape[0], self.slots)
            self._record_slots(ctx.extra.get("table_rows", ctx.rows), slots, before)  # tiered: rows, not slots
        return out, ctx

    def check_pending(self) -> None:
        """Raise what this table's lookups recorded on the device since the last check (a GPU training step
        reads nothing back: the model calls this at its check points, numbactr.model.Model.check_deferred)."""
        if not self._deferred():
            return
        try:
            self.engine.check_deferred()
        except HashTableFullError as e:
            raise self._full_error(e) from None
        if self._sharded is not None:
            self._sharded.check_deferred()

    def _deferred(self) -> bool:
        """Do this table's lookups defer their checks (a TableBatchedEmbedding with defer_checks; a tiered
        table's engine never does)?"""
        return bool(getattr(self.engine, "defer_checks", False))

    def _sharded_lookup(self, keys, offsets, training: bool):
        if self._sharded.gathers():  # a key-owned table's gathered exchange: its owners on the device
            return self._sharded.lookup(keys, offsets, None, training)
        keys_h, offsets_h = device.to_host(keys), device.to_host(offsets).astype(np.int64)
        slot = key_slots(offsets_h, keys_h.shape[0], self.slots)  # (N,)
        owner = key_owner(keys_h, slot, self.comm.size, self.by_slot)
        record = training and self.row_slot is not None  # a Localized table sends the slots of its keys
        # the keys and offsets as they came (device arrays, when staged): the device path gathers them there
        return self._sharded.lookup(keys, offsets, owner, training, payload=slot if record else None)

    def exchange_key_part(self, keys, offsets) -> int:
        """This rank's part of a fixed exchange key (numbactr.embedding.sharded) for a lookup of (keys,
        offsets), else -1. A key-owned (Distributed) table takes the gathered exchange, whose sizes the
        occurrence count N alone fixes, whatever the bags (each rank pools its own): N. A slot-owned table:
        N when every bag holds one key (offsets known on the host), for then the owners and the recorded
        slots follow from N alone (occurrence k is bag k, of slot k % S, owned by rank (k % S) % R): an
        exchange plan; -1 for multi-hot bags. numbactr.model joins every rank's parts into the step's key
        (ShardedTable.step_key)."""
        if self._sharded is None or type(self) not in (HashEmbedding, OneHotEmbedding):
            return -1
        if not self.by_slot:
            return int(keys.shape[0])
        host = offsets if device.is_host_array(offsets) else device.host_mirror(offsets)
        if host is None:
            return -1
        n = int(host.shape[0]) - 1
        if int(keys.shape[0]) != n or host[0] != 0 or host[-1] != n:
            return -1
        one_each = getattr(self, "_one_key_offsets", None)  # arange(n + 1), kept (a check every step)
        if one_each is None or one_each.shape[0] != n + 1:
            one_each = self._one_key_offsets = np.arange(n + 1, dtype=np.int64)
        return n if np.array_equal(host, one_each) else -1

    def _owner_lookup(self, keys, offsets, training: bool, slots, skip=None):
        """The owner's side of a sharded lookup: the received occurrences, pooling NONE (skip: occurrences
        another rank owns, in a gathered exchange)."""
        return self._engine_lookup(keys, offsets, training, Pooling.NONE, slots, skip=skip)

    def _full_error(self, e: HashTableFullError) -> HashTableFullError:
        """The hash table's error with what to change in the SparseEmbedding."""
        need = e.used + e.needed  # distinct keys seen so far, this batch's included
        if self.by_slot and self.cfg.slot_size_array:
            fix = (
                f"its size is the sum of this rank's slot_size_array entries ({self.max_rows}), so some "
                f"slot holds more distinct keys than its entry: raise the entries"
            )
        else:
            mb = workspace_mb_for(need, self.vec, self.n_states)
            fix = (
                f"workspace_size_per_gpu_in_mb={self.cfg.workspace_size_per_gpu_in_mb} holds {self.max_rows}; "
                f"those {need} rows need ceil(rows * (1 + {self.n_states} {self.opt.optimizer_type.name} "
                f"state arrays) * 4 bytes * embedding_vec_size {self.vec} / 2^20) = {mb} MB (HugeCTR's "
                f"sizing): set workspace_size_per_gpu_in_mb to at least {mb}"
            )
        return HashTableFullError(
            e.needed,
            e.used,
            e.max_rows,
            hint=f"SparseEmbedding {self.name!r}{self._where()}: the keys seen so far need {need} rows "
            f"({e.used} in use + {e.needed} new in this batch); {fix}",
        )

    def _record_slots(self, rows, slots, first_new: int) -> None:
        """row_slot of the rows just handed out = the slot of their key's first occurrence."""
        xp = device.xp()
        new = xp.nonzero(rows >= first_new)[0]  # occurrences of new keys, batch order
        _, first = xp.unique(rows[new], return_index=True)  # rows first_new.. in order, first sighting
        self.row_slot[first_new : self.table.size] = xp.asarray(slots)[new[first]]

    def _where(self) -> str:
        return f" on rank {self.comm.rank}" if self.comm.size > 1 else ""

    # ---- snapshots (numbactr.files.checkpoint) --------------------------------------------------------------
    def dump(self):
        """(keys (n,) uint64 in row order, vectors (n, D)) held by this rank (host copies: the cpu device's
        arrays would otherwise be views of the live table)."""
        self._write_back()
        n = self.table.size
        return (
            device.to_host(self.table.keys_by_row()).astype(np.uint64),
            np.array(device.to_host(self.weight.data[:n])),
        )

    def dump_slots(self):
        """(n,) uint64 slot of each key in dump() order (HugeCTR's slot_id; 2**64-1 where unknown: keys
        loaded from a file without slot_id), or None for a Distributed table (HugeCTR writes none)."""
        if self.row_slot is None:
            return None
        return device.to_host(self.row_slot[: self.table.size]).astype(np.uint64)

    def dump_states(self) -> list:
        """The sparse optimizer's state arrays on the host, HugeCTR's per-rank file layout: (V, D) each,
        row r = the state of dump()'s r-th key (rows past the table size: initial values)."""
        return [np.array(device.to_host(s)) for s in self.states]

    def _write_back(self) -> None:
        """A tiered table: every cached row written back and the cache emptied, so self.weight (the backing
        tier's rows) is the whole table for reading and writing."""
        if isinstance(self.engine, TieredEmbedding):
            self.engine.invalidate()

    def rows_of(self, keys: np.ndarray) -> np.ndarray:
        """(n,) int64 host rows of keys (n,) uint64 in this rank's table, -1 where absent."""
        return device.to_host(self.table.find(device.xp().asarray(keys))).astype(np.int64)

    def load(self, keys: np.ndarray, vectors: np.ndarray, slots: np.ndarray | None = None) -> None:
        """Replace the table by ``keys`` (n,) uint64 in rows 0..n-1 with ``vectors`` (n, D) and, for a
        Localized table, ``slots`` (n,) int64 (-1: unknown). The caller (numbactr.files.checkpoint) has already
        checked that they are this rank's keys, unique, not reserved and at most max_rows, so nothing
        here can fail half way. Optimizer states move with their keys; keys new to the table start
        from the initial state."""
        self._write_back()
        xp = device.xp()
        k = xp.asarray(keys.astype(np.uint64))
        old = self.table.find(k)  # (n,) each key's row before, -1 if absent
        self.table.clear()
        self.table.insert(k)  # unique keys, empty table: rows 0..n-1
        w = self.weight.data  # (a tiered table's rows are host memory on every device)
        w[: k.shape[0]] = (np if device.is_host_array(w) else xp).asarray(vectors.astype(np.float32))
        if self.row_slot is not None:
            self.row_slot.fill(-1)
            if slots is not None:
                self.row_slot[: k.shape[0]] = xp.asarray(slots.astype(np.int64))
        self.engine.take_state_rows(0, old)


class OneHotEmbedding(HashEmbedding):
    """LocalizedSlotSparseEmbeddingOneHot (spec §5.4): no hash table; row = key + the offset of its slot.

    Keys are per-slot ids, as HugeCTR's one-hot embedding takes them (``do_unique_key_flag``, on from
    Python): slot s's keys lie in [0, size_s) of slot_size_array, and each lookup first adds the slot's
    offset Σ_{j<s} size_j (HugeCTR's data_to_unique_categories), so slot s owns rows
    [Σ_{j<s} size_j, Σ_{j<=s} size_j) of the one (Σ sizes, D) table. That is what HugeCTR's DataGenerator
    (Raw) and tools/dlrm_script/dlrm_raw write. A key outside its slot's [0, size_s) is an error naming the
    key, slot and sample (it would otherwise read another slot's row). A row's key in a snapshot is its
    row (the offset key), as before, so snapshots keep their meaning. The block of slot s starts
    U(±sqrt(1/size_s)), drawn from a hash of (seed, row). Evaluation looks rows up exactly as training does
    (no insertion). Across ranks slot s belongs to rank s % R; each rank allocates the whole table but only
    its slots' rows are read or updated there (HugeCTR allocates only the owned blocks).
    """

    key_dtype = np.int64

    def __init__(self, cfg, sparse_param, opt, seed: int, comm=None):
        if cfg.embedding_type != Embedding_t.LocalizedSlotSparseEmbeddingOneHot:
            raise ValueError("OneHotEmbedding is for LocalizedSlotSparseEmbeddingOneHot")
        self._configure(cfg, sparse_param, opt, seed, comm)
        self.by_slot = True
        sizes = list(cfg.slot_size_array)
        if len(sizes) != self.slots or any(s <= 0 for s in sizes):
            raise ValueError(
                f"SparseEmbedding {self.name!r} (LocalizedSlotSparseEmbeddingOneHot): needs "
                f"slot_size_array with one positive size per slot ({self.slots} slots), got {sizes}"
            )
        self.max_rows = int(sum(sizes))
        self._make_engine(TableSpec(self.max_rows, self.vec))
        bound = np.repeat(np.sqrt(1.0 / np.asarray(sizes, np.float64)), sizes).astype(np.float32)  # (V,)
        fill_uniform_rows(
            self.weight.data, 0, self.seed, -1.0, 1.0, row_scale=bound, what=f"SparseEmbedding {self.name!r}"
        )
        self.table = None
        self.row_slot = None  # row = key: the slot of a row is given by slot_size_array

    def lookup(self, keys, offsets, training: bool):
        """HashEmbedding.lookup of the batch's rows (table_rows): per-slot keys become the table's keys."""
        return super().lookup(self.table_rows(keys, offsets), offsets, training)

    def table_rows(self, keys, offsets):
        """(N,) int64 rows of per-slot keys (N,) in CSR bags ``offsets`` (B*S + 1,), on the keys' device: key
        + the offset of its slot (bag b is slot b % S). A key outside its slot's [0, size_s) is a ValueError
        naming it, its slot and sample where the keys can be read on the host (host arrays, or a staged
        batch's host mirror); device keys of a deferred step are not read: such a key becomes row -1, which
        the engine's FATAL bounds check records on the device (it names the position, the feature = slot
        and the sample; raised at the check point)."""
        on_host = device.is_host_array(keys)
        xp = np if on_host else device.xp()
        off = offsets if on_host == device.is_host_array(offsets) else xp.asarray(device.to_host(offsets))
        slot = key_slots(off, int(keys.shape[0]), self.slots)  # (N,)
        start, size = self._slot_bounds(xp)
        k = keys.astype(np.int64)
        rows = k + start[slot]
        if on_host or not self._deferred() or device.host_mirror(keys) is not None:
            self._check_slot_keys(keys, offsets)
            return rows
        return xp.where((k >= 0) & (k < size[slot]), rows, -1)

    def _slot_bounds(self, xp):
        """((S,) first row of each slot, (S,) slot sizes) as xp arrays (kept per array module)."""
        kept = getattr(self, "_bounds_by_xp", None)
        if kept is None or kept[0] is not xp:
            sizes = np.asarray(self.cfg.slot_size_array, np.int64)
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            kept = self._bounds_by_xp = (xp, xp.asarray(starts), xp.asarray(sizes))
        return kept[1], kept[2]

    def _check_slot_keys(self, keys, offsets) -> None:
        """ValueError for the first key outside its slot's [0, size_s), read on the host."""
        keys_h = device.host_mirror(keys)
        keys_h = np.asarray(device.to_host(keys) if keys_h is None else keys_h).astype(np.int64)
        offs_h = device.host_mirror(offsets)
        offs_h = np.asarray(device.to_host(offsets) if offs_h is None else offs_h).astype(np.int64)
        bag = np.repeat(np.arange(offs_h.shape[0] - 1, dtype=np.int64), np.diff(offs_h))  # (N,)
        sizes = np.asarray(self.cfg.slot_size_array, np.int64)
        slot = bag % self.slots
        bad = (keys_h < 0) | (keys_h >= sizes[slot])
        if bad.any():
            at = int(np.argmax(bad))
            raise ValueError(
                f"SparseEmbedding {self.name!r} (LocalizedSlotSparseEmbeddingOneHot): key {int(keys_h[at])} "
                f"of slot {int(slot[at])} (sample {int(bag[at]) // self.slots}, position {at} of this batch) is "
                f"outside the slot's vocabulary [0, {int(sizes[slot[at]])}) given by slot_size_array; one-hot "
                "embeddings take per-slot keys and add the slot offsets themselves, as HugeCTR's do"
            )

    def slot_of_keys(self, keys: np.ndarray) -> np.ndarray:
        """(n,) int64 slot whose block of rows holds each key (n,) in [0, V)."""
        return np.searchsorted(np.cumsum(self.cfg.slot_size_array), np.asarray(keys, np.int64), side="right")

    def _owned_rows(self) -> np.ndarray:
        """Rows of the slots this rank owns (slot s on rank s % R), ascending: HugeCTR's dump order."""
        rows = np.arange(self.max_rows, dtype=np.int64)
        return rows[self.slot_of_keys(rows) % self.comm.size == self.comm.rank]

    def dump(self):
        """(keys, vectors) of the slots this rank owns (every row on one rank)."""
        self._write_back()
        mine = self._owned_rows()
        return mine.astype(np.uint64), np.ascontiguousarray(device.to_host(self.weight.data)[mine])

    def dump_slots(self):
        return self.slot_of_keys(self._owned_rows()).astype(np.uint64)

    def dump_states(self) -> list:
        """State arrays of this rank's rows in dump() order, (n, D) each (the whole table is allocated on
        every rank, but only the owned rows are state)."""
        mine = self._owned_rows()
        return [np.ascontiguousarray(device.to_host(s)[mine]) for s in self.states]

    def rows_of(self, keys: np.ndarray) -> np.ndarray:
        return np.asarray(keys).astype(np.int64)

    def load(self, keys: np.ndarray, vectors: np.ndarray, slots: np.ndarray | None = None) -> None:
        """Rows ``keys`` (n,) (validated in range by the caller) take ``vectors`` (n, D); other rows and
        every optimizer state stay as they are (row = key, so no state moves)."""
        self._write_back()
        w = self.weight.data  # (a tiered table's rows are host memory on every device)
        xp = np if device.is_host_array(w) else device.xp()
        w[xp.asarray(keys.astype(np.int64))] = xp.asarray(vectors.astype(np.float32))
