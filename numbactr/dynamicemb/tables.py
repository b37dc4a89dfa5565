"""DynamicEmb's tables on numbactr's engine: HierarchicalKV's evicting index in front of the embedding engine.

    tables = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=8, max_capacity=1024, ...), ...],
                                           table_names=["item", "user"], pooling_mode=DynamicEmbPoolingMode.SUM,
                                           optimizer=OptimizerSpec(Optim.ADAM, learning_rate=1e-3))
    out = tables.forward(indices, offsets, scores=None)   # FBGEMM's feature-major CSR: table t's bags are
    tables.backward(dout)                                 # offsets[t*B : (t+1)*B + 1]; out (B, sum D_t)
    dumps, next_scores = incremental_dump(model, score_threshold)

Each table (DynamicEmbeddingTable) keeps its keys in numbactr.embedding.evicting.EvictingTable (scored as
numbactr.dynamicemb.options says) and its rows in an unkeyed table of the engine, one row per slot of the
index, as numbactr.sok.hybrid does for SOK: the engine's pooling and fused optimizers are used as they are.
A key that takes a slot starts from the table's initializer, its optimizer state from its initial value
(an evicted key's row and state never reach the next key); when the index doubles the engine is rebuilt,
every row and state following its key. Keys not stored in a training forward read their initializer row
and are not updated; an evaluation forward reads a missing key as eval_initializer_args' constant.

incremental_dump(model, score_threshold) (DynamicEmb's name): the keys of every table whose score is at
least the threshold, with their rows; with STEP scores, the keys used since that step. It also returns
each table's current score (get_score), the threshold for the next dump. model: a
BatchedDynamicEmbeddingTables or any object holding some in its attributes (found by walking them; a
torch Module's submodules too), named by their attribute path as DynamicEmb names collections.
"""

from __future__ import annotations

import enum
import time

import numpy as np

from numbactr.runtime import device
from numbactr.embedding.engine import BoundsCheck, Layout, OptimizerSpec, Pooling, TableBatchedEmbedding
from numbactr.embedding.evicting import EvictingTable
from numbactr.dynamicemb.options import DynamicEmbScoreStrategy as Score
from numbactr.dynamicemb.options import DynamicEmbTableOptions, KVCounter

__all__ = [
    "DynamicEmbPoolingMode",
    "DynamicEmbeddingTable",
    "BatchedDynamicEmbeddingTables",
    "incremental_dump",
    "get_score",
    "set_score",
]

_HELD = (1 << 63) - 1  # NO_EVICTION: the score of every held key; new keys count down from _NEW
_NEW = 1 << 62


class DynamicEmbPoolingMode(enum.IntEnum):
    SUM = 0
    MEAN = 1


class DynamicEmbeddingTable:
    """One dynamic table (module docstring). Args: name, options, pooling (Pooling.SUM / MEAN), optimizer
    (the engine's OptimizerSpec), seed (initial rows)."""

    def __init__(self, name: str, options: DynamicEmbTableOptions, pooling, optimizer: OptimizerSpec, seed: int):
        self.who = f"DynamicEmb table {name!r}"
        options.check(self.who)
        self.name, self.opts, self.pooling, self.seed = name, options, pooling, int(seed)
        self.dim = int(options.dim)
        cap = int(options.max_capacity)
        bucket = min(int(options.bucket_capacity), 1 << (cap.bit_length() - 1))
        hkv = "kLfu" if options.score_strategy == Score.LFU else "kCustomized"
        try:
            self.index = EvictingTable(1, options.init_capacity or cap, cap, options.max_load_factor, bucket, hkv)
        except ValueError as e:
            raise ValueError(f"{self.who}: {e}") from None
        self.counter = None
        if options.admit_strategy is not None:
            c = options.admission_counter or KVCounter(cap)
            c_bucket = min(int(c.bucket_capacity), 1 << (int(c.capacity).bit_length() - 1))
            self.counter = EvictingTable(1, c.capacity, c.capacity, 1.0, c_bucket, "kCustomized")
        self.step = 0  # training forwards so far (STEP scores)
        self.score = None  # CUSTOMIZED: the score set_score gave, for forwards given none
        self.last_score = 0  # the score of the last training forward (TIMESTAMP, STEP, CUSTOMIZED)
        self._new_keys = 0  # NO_EVICTION: new keys scored so far
        self.index.on_reset(self._reset_slots)
        self.index.on_move(self._move_slots)
        self.engine = self._new_engine(optimizer)
        self._ctx = None

    def _new_engine(self, optimizer) -> TableBatchedEmbedding:
        return TableBatchedEmbedding(
            [(self.index.capacity(), self.dim)],
            [0],
            pooling=self.pooling,
            layout=Layout.FEATURE_MAJOR,
            optimizer=optimizer,
            bounds_check=BoundsCheck.FATAL,
            seed=self.seed,
        )

    def _initial(self, keys, args=None) -> np.ndarray:
        args = args or self.opts.initializer_args
        return args.rows(device.to_host(keys), self.dim, self.seed, int(self.opts.max_capacity))

    # ---- the index's hooks -------------------------------------------------------------------------
    def _reset_slots(self, slots) -> None:
        eng, xp = self.engine, device.xp()
        eng.split_weights()[0][slots] = xp.asarray(self._initial(self.index.arrays.keys[slots]))
        for view, (name, _, _) in zip(eng.split_optimizer_states()[0], eng._state_specs()):
            view[slots] = eng.initial_state_value(name)

    def _move_slots(self, moved) -> None:
        old = self.engine
        new = self._new_engine(old.optimizer)
        used = device.xp().flatnonzero(moved >= 0)
        new.split_weights()[0][moved[used]] = old.split_weights()[0][used]
        for nv, ov in zip(new.split_optimizer_states()[0], old.split_optimizer_states()[0]):
            nv[moved[used]] = ov[used]
        new.step = old.step
        self.engine = new

    # ---- a forward ---------------------------------------------------------------------------------
    def forward(self, keys, offsets, scores=None, training: bool = True):
        """Pooled (B, D) of keys (N,) in bags offsets (B + 1,); scores (N,) for CUSTOMIZED (optional when
        set_score gave one)."""
        xp = device.xp()
        k = xp.asarray(keys).astype(np.uint64)
        offsets = xp.asarray(offsets).astype(np.int64)
        if training:
            slots, rows_args = self._train_slots(k, scores), None
            if self.opts.admit_strategy is not None:
                rows_args = self.opts.admit_strategy.initializer_args
        else:
            slots = self.index.find_slots(k)
        miss = slots < 0
        out, ctx = self.engine.forward(xp.where(miss, 0, slots), offsets, training=training, skip=miss)
        self._ctx = ctx if training else None
        at = np.flatnonzero(device.to_host(miss))
        if at.size:  # keys not stored read their initializer rows (evaluation: the constant)
            rows = self._initial(k[xp.asarray(at)], rows_args if training else self.opts.eval_initializer_args)
            out = out + xp.asarray(self._pooled(rows, at, device.to_host(offsets), out.shape))
        return out

    def _pooled(self, rows, at, offsets, shape) -> np.ndarray:
        """(B, D) the bags' sums (or means) of rows (M, D), the occurrences at (M,) of bags offsets (B + 1,)."""
        lens = np.diff(offsets)
        bag = np.repeat(np.arange(lens.shape[0]), lens)[at]
        extra = np.zeros(shape, np.float32)
        if self.pooling == Pooling.MEAN:
            rows = rows / lens[bag][:, None]
        np.add.at(extra, bag, rows)
        return extra

    def _train_slots(self, k, scores):
        """(N,) the slot of each key of a training forward, -1 where not stored (admission, refusal, pushed
        out by a later key of the forward)."""
        xp = device.xp()
        self.step += 1
        admit = xp.ones(k.shape[0], bool)
        if self.counter is not None:
            admit = xp.asarray(self._admitted(k))
        ka = k[admit]
        s = self._scores(ka, None if scores is None else xp.asarray(scores)[admit])
        slots = xp.full(k.shape[0], -1, np.int64)
        if ka.shape[0]:
            slots[admit] = self.index.find_or_insert(ka, scores=s, return_slots=True)[1]
        held = self.index.arrays.keys[xp.maximum(slots, 0)] == k
        return xp.where(held, slots, -1)

    def _admitted(self, k) -> np.ndarray:
        """(N,) bool: held keys, and new keys whose count (the counter's, plus this forward's) reaches the
        threshold; those leave the counter (score 0: the first to give way), the others' counts are kept."""
        kh = device.to_host(k)
        held = device.to_host(self.index.find_slots(k)) >= 0
        uk, inv, cnt = np.unique(kh[~held], return_inverse=True, return_counts=True)
        _, found, old = self.counter.find(uk, return_scores=True)
        count = np.where(device.to_host(found), device.to_host(old), 0).astype(np.int64) + cnt
        ok = self.opts.admit_strategy.admit(uk, count)
        zeros = np.zeros((uk.shape[0], 1), np.float32)
        if (~ok).any():
            self.counter.insert_or_assign(uk[~ok], zeros[~ok], scores=count[~ok])
        if ok.any():
            self.counter.assign(uk[ok], zeros[ok], scores=np.zeros(int(ok.sum()), np.int64))
        admit = held.copy()
        admit[~held] = ok[inv.reshape(-1)]
        return admit

    def _scores(self, k, given):
        """The scores of keys k of a training forward (options' module docstring); None for LFU."""
        xp, n, strat = device.xp(), k.shape[0], self.opts.score_strategy
        if strat == Score.LFU:
            return None
        if strat == Score.NO_EVICTION:
            held = self.index.find_slots(k) >= 0
            rank = xp.cumsum(~held) - 1  # new keys in order
            s = xp.where(held, np.uint64(_HELD), (_NEW - self._new_keys - rank).astype(np.uint64))
            self._new_keys += int((~held).sum())
            return s
        if strat == Score.CUSTOMIZED:
            if given is None and self.score is None:
                raise ValueError(f"{self.who}: score_strategy CUSTOMIZED needs scores (forward's or set_score's)")
            if given is not None:
                return given
            value = self.score
        else:
            value = self.step if strat == Score.STEP else time.time_ns()
        self.last_score = int(value)
        return xp.full(n, value, np.uint64)

    def backward(self, dout) -> None:
        """The fused optimizer's update from dLoss/dout (B, D) of the last training forward."""
        if self._ctx is None:
            raise RuntimeError(f"{self.who}: backward needs a training forward first")
        ctx, self._ctx = self._ctx, None
        self.engine.backward(ctx, device.xp().asarray(dout, np.float32))

    # ---- what is held ------------------------------------------------------------------------------
    def current_score(self) -> int:
        """The score the next forward gives (DynamicEmb's get_score): the next dump's threshold."""
        strat = self.opts.score_strategy
        if strat == Score.STEP:
            return self.step + 1
        if strat == Score.TIMESTAMP:
            return time.time_ns()
        return int(self.score if self.score is not None else self.last_score)

    def export(self, threshold: int = 0):
        """(keys (n,) int64, rows (n, D) float32) host copies of the keys whose score is >= threshold."""
        keys, _, _ = self.index.export_batch_if("score_ge", int(threshold))
        slots = self.index.find_slots(keys)
        rows = self.engine.split_weights()[0][slots]
        return np.array(device.to_host(keys)).view(np.int64), np.array(device.to_host(rows))

    def size(self) -> int:
        return self.index.size()


class BatchedDynamicEmbeddingTables:
    """Several dynamic tables read in one call, one feature each (FBGEMM's feature-major CSR)."""

    def __init__(
        self,
        table_options: list,
        table_names: list | None = None,
        pooling_mode=DynamicEmbPoolingMode.SUM,
        optimizer: OptimizerSpec | None = None,
        seed: int = 0,
    ):
        if not table_options:
            raise ValueError("BatchedDynamicEmbeddingTables: table_options is empty")
        names = list(table_names or [f"t{i}" for i in range(len(table_options))])
        if len(names) != len(table_options) or len(set(names)) != len(names):
            raise ValueError(
                f"BatchedDynamicEmbeddingTables: table_names must be {len(table_options)} distinct names, got {names}"
            )
        pooling = {DynamicEmbPoolingMode.SUM: Pooling.SUM, DynamicEmbPoolingMode.MEAN: Pooling.MEAN}.get(pooling_mode)
        if pooling is None:
            raise ValueError(f"BatchedDynamicEmbeddingTables: pooling_mode must be SUM or MEAN, got {pooling_mode!r}")
        opt = optimizer or OptimizerSpec(learning_rate=0.01)
        self.tables = [
            DynamicEmbeddingTable(n, o, pooling, opt, seed * 1_000_003 + i)
            for i, (n, o) in enumerate(zip(names, table_options))
        ]
        self.table_names = names

    def forward(self, indices, offsets, scores=None, training: bool = True):
        """(B, sum D_t) of indices (N,) in bags offsets (T*B + 1,), table t's bags t*B..(t+1)*B - 1; scores
        (N,) (CUSTOMIZED tables)."""
        offsets = np.asarray(device.to_host(offsets), np.int64)
        T = len(self.tables)
        if (offsets.shape[0] - 1) % T:
            raise ValueError(f"BatchedDynamicEmbeddingTables: {offsets.shape[0] - 1} bags are not {T} tables' B bags")
        B = (offsets.shape[0] - 1) // T
        xp, outs = device.xp(), []
        for t, table in enumerate(self.tables):
            lo, hi = int(offsets[t * B]), int(offsets[(t + 1) * B])
            s = None if scores is None else xp.asarray(scores)[lo:hi]
            outs.append(table.forward(xp.asarray(indices)[lo:hi], offsets[t * B : (t + 1) * B + 1] - lo, s, training))
        return xp.concatenate(outs, axis=1)

    def backward(self, dout) -> None:
        at = 0
        for table in self.tables:
            table.backward(dout[:, at : at + table.dim])
            at += table.dim

    def set_score(self, scores: dict) -> None:
        for name, value in scores.items():
            self.tables[self.table_names.index(name)].score = int(value)

    def get_score(self) -> dict:
        return {n: t.current_score() for n, t in zip(self.table_names, self.tables)}


def _collections(model, path: str = "", seen=None, depth: int = 0):
    """(path, BatchedDynamicEmbeddingTables) held by model or its attributes (module docstring)."""
    seen = set() if seen is None else seen
    if id(model) in seen or depth > 6:
        return
    seen.add(id(model))
    if isinstance(model, BatchedDynamicEmbeddingTables):
        yield path or "model", model
        return
    children = dict(getattr(model, "__dict__", {}))
    children.update(children.pop("_modules", None) or {})
    for name, child in children.items():
        if hasattr(child, "__dict__") and not isinstance(child, (type, np.ndarray)):
            yield from _collections(child, f"{path}.{name}" if path else name, seen, depth + 1)


def _found(model, who: str) -> list:
    found = list(_collections(model))
    if not found:
        raise ValueError(f"{who}: the model holds no BatchedDynamicEmbeddingTables")
    return found


def incremental_dump(model, score_threshold):
    """({path: {table: (keys, rows)}}, {path: {table: next threshold}}): the keys scored at least the
    threshold (an int for every table, or {path: {table: int}}) with their rows (module docstring)."""
    dumps, scores = {}, {}
    for path, coll in _found(model, "incremental_dump"):
        dumps[path] = {}
        for name, table in zip(coll.table_names, coll.tables):
            th = score_threshold if isinstance(score_threshold, int) else score_threshold.get(path, {}).get(name)
            if th is None:
                continue
            dumps[path][name] = table.export(th)
        scores[path] = coll.get_score()
    return dumps, scores


def get_score(model) -> dict:
    """{path: {table: current score}} (DynamicEmb's get_score)."""
    return {path: coll.get_score() for path, coll in _found(model, "get_score")}


def set_score(model, table_score) -> None:
    """The score of every table's next forwards (CUSTOMIZED): an int for all, or {path: {table: int}}."""
    for path, coll in _found(model, "set_score"):
        if isinstance(table_score, int):
            coll.set_score({n: table_score for n in coll.table_names})
        else:
            coll.set_score({n: v for n, v in table_score.get(path, {}).items() if n in coll.table_names})
