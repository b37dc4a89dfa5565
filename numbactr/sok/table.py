"""One SOK table on this rank: its engine, who owns which key, and the gradient held until the optimizer step.

Arrays only (NumPy on cpu/sim, CuPy on gpu); numbactr/sok/layers.py puts torch around it. Every SOK layer
and variable is one SokTable over ONE numbactr.embedding.engine.TableBatchedEmbedding: one table (V, D)
read by F features (a layer's slots; a variable's lookup is one feature), CSR bags in HugeCTR's
sample-major order (bag b*F + f).

Ownership under R ranks (mpiexec), SOK's rules:
  distributed  key k lives on rank k % R. A keyed table (use_hashtable=True, DynamicVariable) keeps the key
               itself in its hash table; an unkeyed one (use_hashtable=False, sok.Variable) is a global
               table of V rows of which rank r holds rows r, r + R, r + 2R, ... as its local rows k // R
               (SOK's DistributedVariable).
  localized    (mode="localized:t") the whole table lives on rank t; the other ranks hold no row.
Lookups under R > 1 run through numbactr.embedding.sharded.ShardedTable (input_dist -> owner lookup ->
output_dist); on one rank the engine looks the batch up directly.

Initial rows: a keyed table's new key k starts U(lo, hi) (or a constant) from a hash of (seed, k) when it
is first inserted in training, and an unkeyed table's global row k starts from the same hash of (seed, k)
unless initial values are given: the same vectors on every device and every rank count, so sharded runs
equal one-rank runs, and use_hashtable=True/False start a key at the same vector.

Updates: backward only holds the gradient (hold); the optimizer's step applies it (apply) with the engine's
fused backward + optimizer, SOK's apply_gradients. A table used by several lookups before the step (two
lookup_sparse calls, lookup_sparse([v, v], ...), a shared embedding, gradient accumulation) holds one
gradient per lookup, as SOK's tape returns one per use; the step applies their sum once, exactly as one
lookup of the concatenated ids would (a row's occurrences summed in lookup order, the optimizer run once).
Only an OptimizerWrapper's step applies them: a table that no wrapper holds refuses a second backward (a
plain torch optimizer never updates it). Under R ranks each sender's gradient reaches the owner divided by R
when gradient division is on (numbactr.sok.init's default, TorchRec's rule): with each rank's loss the mean
over its own samples and the dense gradients averaged, training then follows the one-rank run on the
global batch. SOK itself sums the ranks' gradients (init(gradient_division=False)).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, fields, replace

import numpy as np

from numbactr.runtime import device
from numbactr.distributed.comm import world
from numbactr.distributed.sharding import key_owner
from numbactr.embedding.engine import (
    FIXED_HYPER_PARAMETERS,
    BoundsCheck,
    Layout,
    LookupContext,
    OptimizerSpec,
    Optim,
    Pooling,
    TableBatchedEmbedding,
    TableSpec,
    UpdateType,
)
from numbactr.embedding.hash_table import EMPTY_KEY, HashTableFullError
from numbactr.embedding.sharded import ShardedTable, owner_offsets
from numbactr.kernels import embedding_init

DISTRIBUTED = -1  # SokTable.target of a distributed table (else the owning rank)
INIT_RANGE = (-0.05, 0.05)  # SOK's default initializer: random_uniform(-0.05, 0.05)
#: the engine optimizer a table has before an optimizer takes it (plain SGD keeps no state to lose)
DEFAULT_OPTIMIZER = OptimizerSpec(Optim.EXACT_SGD, learning_rate=0.0)
_FIXED = FIXED_HYPER_PARAMETERS  # what shapes the optimizer states


@dataclass
class Settings:
    """numbactr.sok.init's settings: the seed of the tables' initial rows (table i of this process uses
    seed + i), and whether a sharded table divides each rank's gradient by R."""

    seed: int = 0
    gradient_division: bool = True
    tables: int = 0  # tables created so far (every rank creates them in the same order)


SETTINGS = Settings()


class VocabularyFullError(HashTableFullError):
    """A keyed SOK table has no row left for this batch's new keys (the table is unchanged)."""

    def __init__(self, e: HashTableFullError, who: str, option: str):
        self.needed, self.used, self.max_rows = e.needed, e.used, e.max_rows
        RuntimeError.__init__(
            self,
            f"{who}: this batch brings {e.needed} new keys, {e.used} of the "
            f"{e.max_rows} rows this rank holds are in use; raise {option} to at "
            f"least {e.used + e.needed}",
        )


def init_range(initializer, who: str) -> tuple:
    """(lo, hi) of an initializer SOK accepts as a name or a number: None, 'random', 'random_uniform'
    (U(-0.05, 0.05)), 'zeros', 'ones', a number or a numeric string (a constant), or (lo, hi)."""
    if initializer is None or initializer in ("", "random", "random_uniform"):
        return INIT_RANGE
    if isinstance(initializer, str):
        named = {"zeros": 0.0, "ones": 1.0}
        if initializer in named:
            return (named[initializer],) * 2
        try:
            value = float(initializer)
        except ValueError:
            raise ValueError(
                f"{who}: initializer {initializer!r} is not supported; give 'random' (U(-0.05, "
                "0.05)), 'zeros', 'ones', a number or (lo, hi)"
            ) from None
        return (value, value)
    if isinstance(initializer, (int, float, np.number)) and not isinstance(initializer, bool):
        return (float(initializer),) * 2
    if isinstance(initializer, tuple) and len(initializer) == 2:
        lo, hi = (float(v) for v in initializer)
        if not lo <= hi:
            raise ValueError(f"{who}: initializer range {initializer} needs lo <= hi")
        return (lo, hi)
    raise ValueError(
        f"{who}: initializer {initializer!r} is not supported; give 'random' (U(-0.05, 0.05)), "
        "'zeros', 'ones', a number or (lo, hi)"
    )


class SokTable:
    """One SOK table on this rank (module docstring).

    Args:
        who: what the user created, for messages (e.g. "All2AllDenseEmbedding 'emb'").
        dim: D.
        keyed: keys go through a hash table (any int64 key but -1); else keys are rows of a global table.
        capacity: keyed tables: the keys this rank can hold; option: the argument that sets it (for errors).
        global_rows: unkeyed tables: V, the global table's rows (keys must be in [0, V)).
        features: F, the features of this table's bags (a layer's slot_num; 1 for a variable).
        pooling: the default pooling (lookup can override it per call).
        target: DISTRIBUTED or the rank holding the whole table (SOK's mode="localized:t").
        init: (lo, hi) of new rows (init_range); initial: unkeyed tables: the global (V, D) values instead.
        trainable: False: lookups hold no gradient and the table never changes.
        comm: the job's communicator (default numbactr.distributed.comm.world()).
        adam_update: the engine's UpdateType for a wrapped torch.optim.Adam (numbactr.sok.optimizer): LOCAL
            (the touched rows: SOK's OptimizerWrapper on a DynamicVariable, the layers) or GLOBAL (every row:
            Keras' Adam on a sok.Variable, a tf.Variable).
        stamps: keep each row's last insertion / update time (HierarchicalKV's scores: sok.incremental_model_dump).
    """

    def __init__(
        self,
        who: str,
        dim: int,
        *,
        keyed: bool,
        capacity: int = 0,
        option: str = "",
        global_rows: int = 0,
        features: int = 1,
        pooling=Pooling.SUM,
        target: int = DISTRIBUTED,
        init=INIT_RANGE,
        initial=None,
        trainable: bool = True,
        comm=None,
        adam_update=UpdateType.LOCAL,
        stamps: bool = False,
    ):
        self.who, self.dim, self.keyed, self.option = who, int(dim), bool(keyed), option
        self.adam_update = UpdateType(adam_update)
        self.wrappers = weakref.WeakSet()  # the OptimizerWrappers training this table (their step applies it)
        self.features, self.pooling, self.target = int(features), Pooling(pooling), int(target)
        self.trainable = bool(trainable)
        self.comm = comm or world()
        rank, ranks = self.comm.rank, self.comm.size
        if self.dim < 1:
            raise ValueError(f"{who}: the embedding width must be >= 1, got {dim}")
        if self.features < 1:
            raise ValueError(f"{who}: slot_num must be >= 1, got {features}")
        if self.target != DISTRIBUTED and not 0 <= self.target < ranks:
            raise ValueError(
                f"{who}: there are only {ranks} rank(s), cannot put the table on rank {self.target} "
                "(mode='localized:t' needs 0 <= t < number of ranks)"
            )
        self.seed = SETTINGS.seed + SETTINGS.tables
        SETTINGS.tables += 1
        self.division = SETTINGS.gradient_division
        held_here = self.target in (DISTRIBUTED, rank)
        if self.keyed:
            if int(capacity) < 1:
                raise ValueError(f"{who}: {option} must be >= 1, got {capacity}")
            self.capacity, self.global_rows = int(capacity), 0
            rows = self.capacity if held_here else 0
        else:
            self.global_rows = int(global_rows)
            if self.global_rows < 1:
                raise ValueError(f"{who}: the table needs at least one row, got {global_rows}")
            self.capacity = 0
            rows = self._held_rows().size
        self.spec = TableSpec(rows, self.dim, keyed=self.keyed, init_range=tuple(init))
        self.engine = self._new_engine(DEFAULT_OPTIMIZER)
        if not self.keyed and rows:
            self._init_rows(initial)
        self._pending = []  # [(lookup number, lookup context, gradient)] of this step's backwards
        self._lookups = 0  # lookups so far (orders the held gradients as the lookups ran)
        self._poolers = {}  # pooling -> optimizer-NONE engine: a pooled lookup's gradient per occurrence
        # (capacity + 1,) int64 ns: each row's last insertion / update time (the last entry: a sink for -1)
        self.stamps = device.xp().zeros(self.capacity + 1, np.int64) if stamps and self.keyed else None
        self._sharded = None
        if ranks > 1:
            self._sharded = ShardedTable(
                self.comm,
                self.dim,
                self.features,
                self.pooling,
                self._owner_lookup,
                key_dtype=np.uint64 if self.keyed else np.int64,
            )

    # ---- rows ---------------------------------------------------------------------------------------
    def _held_rows(self) -> np.ndarray:
        """(V_local,) global rows of an unkeyed table held by this rank, in local row order."""
        rank, ranks = self.comm.rank, self.comm.size
        if self.target == DISTRIBUTED:
            return np.arange(rank, self.global_rows, ranks, dtype=np.int64)
        return np.arange(self.global_rows if rank == self.target else 0, dtype=np.int64)

    def _init_rows(self, initial) -> None:
        held = self._held_rows()
        if initial is None:
            vals = embedding_init.row_values_ref(held.astype(np.uint64), self.dim, self.seed, *self.spec.init_range)
        else:
            vals = np.asarray(initial, np.float32)[held]
        self.weights()[...] = device.xp().asarray(vals)

    def weights(self):
        """(V_local, D) view of the rows this rank holds (keyed: the rows in use, in insertion order)."""
        return self.engine.split_weights()[0][: self.engine.live_rows(0)]

    def keys(self):
        """(V_local,) int64 key (global row) of every row weights() shows."""
        if self.keyed:
            return device.to_host(self.engine.hash_tables[0].keys_by_row()).view(np.int64)
        return self._held_rows()

    def _new_engine(self, spec: OptimizerSpec) -> TableBatchedEmbedding:
        return TableBatchedEmbedding(
            [self.spec],
            [0] * self.features,
            pooling=self.pooling,
            layout=Layout.SAMPLE_MAJOR,
            optimizer=spec,
            bounds_check=BoundsCheck.FATAL,
            seed=self.seed,
        )

    # ---- checkpoints (numbactr.sok.layers' state_dict, OptimizerWrapper.state_dict) ------------------
    def owners(self, keys: np.ndarray) -> np.ndarray:
        """(n,) the rank that owns each key (int64 keys on the host)."""
        if self.target != DISTRIBUTED:
            return np.full(keys.shape, self.target, np.int64)
        return (keys.astype(np.uint64) % np.uint64(self.comm.size)).astype(np.int64)

    def state(self) -> tuple:
        """(keys (n,) int64, values (n, D) float32) host copies of the rows this rank holds."""
        return np.array(self.keys(), np.int64), np.array(device.to_host(self.weights()), np.float32)

    def check_state(self, keys: np.ndarray, what: str):
        """A checkpoint's keys (n,) int64 for this rank, checked (ValueError naming what is wrong): unique,
        this rank's, valid keys (keyed: not -1, at most the capacity; unkeyed: exactly the rows this rank
        holds). Returns an unkeyed table's local rows of the keys (None for a keyed table)."""
        who = f"{self.who}{self._where()}: {what}"
        if keys.ndim != 1:
            raise ValueError(f"{who}: keys must be 1-D, got shape {keys.shape}")
        uniq, first = np.unique(keys, return_index=True)
        if uniq.size != keys.size:
            dup = np.setdiff1d(np.arange(keys.size), first)[0]
            raise ValueError(f"{who}: key {keys[dup]} appears twice (position {dup})")
        foreign = np.flatnonzero(self.owners(keys) != self.comm.rank)
        if foreign.size:
            k = foreign[0]
            owner = int(self.owners(keys[k : k + 1])[0])
            raise ValueError(
                f"{who}: key {keys[k]} (position {k}) belongs to rank {owner}, not rank "
                f"{self.comm.rank}: a torch checkpoint is loaded by the same number of ranks that "
                "saved it, each rank its own (sok.dump / sok.load move tables between rank counts)"
            )
        if not self.keyed:
            held = self._held_rows()
            if keys.size != held.size or not np.array_equal(uniq, held):
                raise ValueError(
                    f"{who}: holds {keys.size} rows; this rank holds {held.size} rows of the "
                    f"{self.global_rows}-row table (saved by another number of ranks, or another table?)"
                )
            return keys // self.comm.size if self.target == DISTRIBUTED else keys
        try:
            self._check_keys(device.xp().asarray(keys))
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        if keys.size > self.capacity:
            raise ValueError(
                f"{who}: holds {keys.size} keys; this rank's table holds at most {self.capacity} (raise {self.option})"
            )
        return None

    def _state_rows(self, keys: np.ndarray, what: str, insert: bool) -> np.ndarray:
        """(n,) the local rows of a checkpoint's keys (n,) int64 on this rank, checked first (check_state).
        insert (a keyed table's weights): the table is rebuilt to hold just these keys, in this order,
        optimizer states following their keys."""
        rows = self.check_state(keys, what)
        if not self.keyed:
            return rows
        xp = device.xp()
        who = f"{self.who}{self._where()}: {what}"
        table = self.engine.hash_tables[0]
        k = xp.asarray(keys.astype(np.uint64))
        if not insert:
            rows = np.asarray(device.to_host(table.find(k)), np.int64)
            missing = np.flatnonzero(rows < 0)
            if missing.size:
                raise ValueError(
                    f"{who}: key {keys[missing[0]]} is not in the table (load the model's state_dict "
                    "before the optimizer's)"
                )
            return rows
        old = table.find(k)  # (n,) each key's row before, -1 if absent
        table.clear()
        table.insert(k)  # unique keys, empty table: rows 0..n-1
        self.engine.take_state_rows(0, old)
        if self.stamps is not None:
            self.stamps[...] = 0
        return np.arange(keys.size, dtype=np.int64)

    def load_state(self, keys, values) -> None:
        """Rows (keys (n,) int64, values (n, D)) of a state() taken on this rank: an unkeyed table's held rows
        are overwritten; a keyed table then holds exactly these keys (optimizer states follow their keys,
        new keys start from the initial state). A held gradient is dropped."""
        keys = np.asarray(keys).astype(np.int64, copy=False).reshape(-1)
        values = np.asarray(values, np.float32)
        if values.shape != (keys.size, self.dim):
            raise ValueError(
                f"{self.who}{self._where()}: the checkpoint's values must be ({keys.size}, {self.dim}), "
                f"got {values.shape}"
            )
        rows = self._state_rows(keys, "the checkpoint", insert=self.keyed)
        self.engine.split_weights()[0][device.xp().asarray(rows)] = device.xp().asarray(values)
        self.stamp(rows)
        self._pending = []

    def optimizer_state(self) -> dict:
        """The engine optimizer's state of the rows this rank holds: {"optimizer", "step", "keys",
        "states": {name: host array (n, ...)}}."""
        n = self.engine.live_rows(0)
        names = [name for name, _, _ in self.engine._state_specs()]
        views = self.engine.split_optimizer_states()[0]
        return {
            "optimizer": Optim(self.engine.optimizer.kind).name,
            "step": int(self.engine.step),
            "keys": np.array(self.keys(), np.int64),
            "states": {name: np.array(device.to_host(v[:n])) for name, v in zip(names, views)},
        }

    def load_optimizer_state(self, st: dict) -> None:
        """optimizer_state() of this rank, taken with the same optimizer: the states of its keys (which the
        table must hold) and the step count."""
        rows, names, views = self.check_optimizer_state(st)
        xp = device.xp()
        for name, view in zip(names, views):
            view[xp.asarray(rows)] = xp.asarray(np.asarray(st["states"][name]).astype(view.dtype, copy=False))
        self.engine.step = int(st["step"])

    def check_optimizer_state(self, st: dict) -> tuple:
        """load_optimizer_state's checks (ValueError naming what is wrong): (rows, state names, views)."""
        kind = Optim(self.engine.optimizer.kind).name
        if st.get("optimizer") != kind:
            raise ValueError(
                f"{self.who}{self._where()}: the checkpoint's table optimizer is {st.get('optimizer')}, "
                f"this table's is {kind}"
            )
        keys = np.asarray(st["keys"]).astype(np.int64, copy=False).reshape(-1)
        rows = self._state_rows(keys, "the optimizer checkpoint", insert=False)
        names = [name for name, _, _ in self.engine._state_specs()]
        if sorted(st["states"]) != sorted(names):
            raise ValueError(
                f"{self.who}{self._where()}: the checkpoint has optimizer states {sorted(st['states'])}, "
                f"this table's optimizer keeps {sorted(names)}"
            )
        views = self.engine.split_optimizer_states()[0]
        for name, view in zip(names, views):
            want = (keys.size,) + tuple(view.shape[1:])
            if np.shape(st["states"][name]) != want:
                raise ValueError(
                    f"{self.who}{self._where()}: optimizer state {name} must be {want}, got "
                    f"{np.shape(st['states'][name])}"
                )
        return rows, names, views

    # ---- lookup -------------------------------------------------------------------------------------
    def lookup(self, keys, offsets, training: bool, per_sample_weights=None, pooling=None):
        """(out, what hold() needs): out (B, F*D) pooled, or (N, D) for pooling NONE, of keys (N,) int in
        CSR bags offsets (F*B + 1,) of this rank's samples. Every rank takes part when R > 1. training: a
        keyed table inserts new keys (else they read zeros)."""
        self._check_keys(keys)
        self._lookups += 1
        if self._sharded is None:
            out, ctx = self._forward(keys, offsets, training, pooling, per_sample_weights)
            return out, _Numbered(ctx, self._lookups)
        keys_h = device.to_host(keys)
        if self.target == DISTRIBUTED:
            owner = key_owner(keys_h, None, self.comm.size, by_slot=False)  # key % R
        else:
            owner = np.full(keys_h.shape[0], self.target, np.int64)
        out, sharded = self._sharded.lookup(
            keys_h, offsets, owner, training, per_sample_weights=per_sample_weights, pooling=pooling
        )
        return out, _Numbered(sharded, self._lookups)

    def _owner_lookup(self, keys, offsets, training: bool, payload):
        """The owner's side of a sharded lookup (pooling NONE); a distributed unkeyed table's key k is its
        local row k // R."""
        if not self.keyed and self.target == DISTRIBUTED:
            keys = keys // self.comm.size
        return self._forward(keys, offsets, training, Pooling.NONE, None)

    def _forward(self, keys, offsets, training, pooling, per_sample_weights):
        try:
            out, ctx = self.engine.forward(keys, offsets, per_sample_weights, training=training, pooling=pooling)
        except HashTableFullError as e:
            raise VocabularyFullError(e, self.who + self._where(), self.option) from None
        if training:
            self.stamp(ctx.rows)
        return out, ctx

    def stamp(self, rows) -> None:
        """Record now as the last insertion / update time of local rows (-1 entries ignored), when kept."""
        if self.stamps is None:
            return
        xp = device.xp()
        rows = xp.asarray(rows).astype(np.int64, copy=False).reshape(-1)
        if rows.shape[0]:
            self.stamps[xp.where(rows >= 0, rows, self.capacity)] = time.time_ns()

    def updated_since(self, ns: int):
        """(keys (n,) int64, values (n, D) float32) host copies of the rows this rank holds that were inserted
        or updated at or after time ns (time.time_ns()); needs stamps."""
        n = self.engine.live_rows(0)
        mine = np.flatnonzero(device.to_host(self.stamps[:n]) >= ns)
        keys, values = self.state()
        return keys[mine], values[mine]

    def _check_keys(self, keys) -> None:
        """Every key valid before anything moves (a bad key names its position in this rank's batch)."""
        xp = device.xp()
        if keys.dtype.kind not in "iu":
            raise TypeError(f"{self.who}: keys must be integers, got {keys.dtype}")
        if not keys.shape[0]:
            return
        if self.keyed:
            bad = keys.astype(np.uint64) == EMPTY_KEY
            what = "is reserved (-1 marks an empty hash-table slot)"
        else:
            bad = (keys < 0) | (keys >= self.global_rows)
            what = f"is outside the table [0, {self.global_rows})"
        if bool(bad.any()):
            at = int(xp.argmax(bad))
            raise ValueError(f"{self.who}{self._where()}: key {int(keys[at])} at position {at} of this batch {what}")

    def _where(self) -> str:
        return f" on rank {self.comm.rank}" if self.comm.size > 1 else ""

    # ---- gradients and updates ----------------------------------------------------------------------
    def hold(self, lookup, dy) -> None:
        """Keep dy, dLoss/dout of one lookup (its output's shape), for apply(); a table looked up several times
        before the step keeps one per lookup. Under R ranks every rank sends its occurrences' gradients to
        their owners now (a collective)."""
        if not self.trainable:
            return
        if self._pending and not len(self.wrappers):
            raise RuntimeError(
                f"{self.who}: a second backward, and no sok.OptimizerWrapper holds this table: its "
                "gradients are applied only by a wrapper's step() (a plain torch optimizer never "
                "updates a SOK table); wrap the optimizer: opt = sok.OptimizerWrapper("
                "torch.optim.SGD(model.parameters(), lr=...)) (or sok.SGD / sok.Adam), then "
                "loss.backward(); opt.step(); opt.zero_grad()"
            )
        xp = device.xp()
        dy = xp.ascontiguousarray(xp.asarray(dy, dtype=np.float32))
        if self._sharded is None:
            self._pending.append((lookup.number, lookup.ctx, dy))
            return
        if self.division:
            dy = dy / np.float32(self.comm.size)
        self._pending.append((lookup.number, *self._sharded.gradients(lookup.ctx, dy)))

    def has_gradient(self) -> bool:
        return bool(self._pending)

    def apply(self) -> None:
        """The engine's fused backward + optimizer over the gradients held since the last step, if any: one
        update with the sum of every held lookup's gradient."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        if len(pending) == 1:
            _, ctx, dy = pending[0]
        else:
            ctx, dy = self._merged(sorted(pending, key=lambda p: p[0]))
        self.engine.backward(ctx, dy)
        self.stamp(ctx.rows)

    def _merged(self, pending) -> tuple:
        """(ctx, dy) of one unpooled lookup holding every occurrence of the held lookups, in lookup order,
        each with its own gradient: the update of the lookup of the concatenated ids."""
        xp = device.xp()
        rows, grads = [], []
        for _, ctx, dy in pending:
            rows.append(xp.asarray(ctx.rows).astype(np.int64, copy=False))
            grads.append(self._per_occurrence(ctx, dy))
        rows = xp.concatenate(rows)
        return (
            LookupContext(rows, owner_offsets(rows.shape[0], self.features), None, 1, Pooling.NONE),
            xp.ascontiguousarray(xp.concatenate(grads)),
        )

    def _per_occurrence(self, ctx, dy):
        """(N, D) the gradient of each occurrence of a lookup from its dLoss/dout (pooled: the bag's gradient,
        / L for MEAN, times the per-sample weight), by the engine's own pooling arithmetic."""
        xp = device.xp()
        n = ctx.rows.shape[0]
        if ctx.pooling == Pooling.NONE:
            return xp.asarray(dy).reshape(n, self.dim)
        if not n:
            return xp.zeros((0, self.dim), np.float32)
        eng = self._poolers.get(ctx.pooling)
        if eng is None or eng.rows[0] < n:
            eng = self._poolers[ctx.pooling] = TableBatchedEmbedding(
                [(max(n, 1) * 3 // 2 + 1, self.dim)],
                [0] * self.features,
                pooling=ctx.pooling,
                layout=Layout.SAMPLE_MAJOR,
                optimizer=OptimizerSpec(Optim.NONE),
                bounds_check=BoundsCheck.FATAL,
            )
        own = LookupContext(xp.arange(n, dtype=np.int64), ctx.offsets, ctx.per_sample_weights, ctx.batch, ctx.pooling)
        return eng.backward(own, dy).sparse.values[:n, : self.dim]

    def drop_gradient(self) -> None:
        self._pending = []

    def set_optimizer(self, spec: OptimizerSpec) -> None:
        """Train this table with spec from now on. Hyper-parameters just change; another optimizer kind
        rebuilds the engine's state arrays, which only a table not updated yet may do (its rows and keys
        are kept)."""
        eng = self.engine
        if all(getattr(eng.optimizer, f) == getattr(spec, f) for f in _FIXED):
            hp = {f.name: getattr(spec, f.name) for f in fields(OptimizerSpec) if f.name not in _FIXED}
            if any(getattr(eng.optimizer, k) != v for k, v in hp.items()):
                eng.set_hyper_parameters(**hp)
            return
        if eng.step > 0:
            raise ValueError(
                f"{self.who}: was updated by {eng.optimizer.kind.name} already; a table's optimizer "
                f"cannot become {Optim(spec.kind).name} (its optimizer states would be lost)"
            )
        new = self._new_engine(replace(spec))
        self._carry_rows(eng, new)
        self.engine = new

    def _carry_rows(self, old, new) -> None:
        """A rebuilt engine (another optimizer) takes the old one's keys and rows."""
        n = old.live_rows(0)
        if self.keyed and n:
            new.hash_tables[0].insert(old.hash_tables[0].keys_by_row())  # rows 0..n-1, in the same order
        new.split_weights()[0][:n] = old.split_weights()[0][:n]

    def put_rows(self, keys, values) -> None:
        """sok.assign's write: keys (n,) int64 on the host (this rank's, checked) take values (n, D); new keys
        are inserted (their optimizer states start from the initial ones)."""
        xp = device.xp()
        rows = self.engine.hash_tables[0].insert(xp.asarray(keys))
        self.engine.split_weights()[0][rows] = xp.asarray(values)
        self.stamp(rows)

    @property
    def keeps_times(self) -> bool:
        """Does the table keep each key's last insertion / update time (sok.incremental_model_dump)?"""
        return self.stamps is not None


class _Numbered:
    """What a lookup leaves for hold() (the engine's LookupContext, or a sharded table's ShardedLookup) and
    its number among the table's lookups (apply() sums the held gradients in lookup order)."""

    __slots__ = ("ctx", "number")

    def __init__(self, ctx, number: int):
        self.ctx, self.number = ctx, number
