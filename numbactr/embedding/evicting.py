"""A table that never fills: HierarchicalKV's evicting hash table (SOK's "hybrid" backend) for one device.

``EvictingTable(dim, init_capacity, max_capacity, ...)`` keeps rows of keys that keep arriving. Keys hash to
buckets of ``max_bucket_size`` slots; the table doubles while its load factor would pass
``max_load_factor``, up to ``max_capacity``; a key arriving at a full bucket takes the slot of the bucket's
lowest score, or is refused when its own score is lower still. The scores follow ``evict_strategy``
(kLru, kLfu, kEpochLru, kEpochLfu, kCustomized). The contract, the tie rule and the order within a batch are
kernels/hkv_ref.py's docstring; the methods keep HierarchicalKV's names.

Where it runs: the NumPy reference (kernels/hkv_ref.py), the compiled cpu version (kernels/hkv_cpu.py) or the
numba.cuda kernels (kernels/hkv.py), picked for the current device by numbactr.ops.dispatch.pick when the
table is made; all three give the same table, bit for bit.

Optimizer state. A slot that takes a new key must forget what its old key learned. The table resets what it
owns: ``slot_state(name, width, fill)`` makes a per-slot array (C, width) that is refilled with ``fill``
wherever a new key lands and follows its keys when the table doubles. State kept elsewhere registers
``on_reset(fn)`` (called with the reset slots, (M,) int64) and ``on_move(fn)`` (called with moved (C,)
int64: the new slot of each old slot, -1 where free, after a doubling); ``return_slots=True`` hands the slot
of each key to a caller that indexes its own arrays.
"""

from __future__ import annotations

import numpy as np

from numbactr.kernels import hkv as _k
from numbactr.kernels import hkv_cpu as _cpu
from numbactr.kernels import hkv_ref as _ref
from numbactr.kernels.hkv_math import EMPTY_KEY, Arrays, EvictStrategy, Mode, Pred, Status
from numbactr.ops.dispatch import pick
from numbactr.runtime import device

__all__ = ["EvictingTable", "EvictStrategy", "Status"]

# (upsert, find, match, erase, double) of each implementation, with kernels/hkv_ref.py's signatures
_REF = (_ref.upsert_ref, _ref.find_ref, _ref.match_ref, _ref.erase_ref, _ref.double_ref)
_CPU = (_cpu.upsert_cpu, _cpu.find_cpu, _cpu.match_cpu, _cpu.erase_cpu, _cpu.double_cpu)
_KERNELS = (_k.upsert, _k.find, _k.match, _k.erase, _k.double)
_PREDS = {"score_lt": Pred.SCORE_LT, "score_ge": Pred.SCORE_GE, "ttl": Pred.SCORE_LT}


def _pow2_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class EvictingTable:
    """An evicting key -> row table of width ``dim`` (see the module docstring).

    Capacities are whole buckets, a power of two of them: ``max_capacity`` is rounded down to
    ``max_bucket_size * 2**k`` (the table never holds more than asked for), ``init_capacity`` up to
    ``max_bucket_size * 2**j`` (at most the maximum). ``initializer``: the rows of new keys in
    find_or_insert: None or ``"zeros"`` (0), a number (that constant), ``"normal"`` / ``"random"`` (N(0, 1),
    SOK's hybrid default), ``"uniform"`` (U(-1, 1)) or a callable ``f(n, dim, rng) -> (n, dim)``; drawn on the
    host from ``numpy.random.default_rng(seed)``, so every device gets the same rows.
    """

    def __init__(
        self,
        dim: int,
        init_capacity: int,
        max_capacity: int,
        max_load_factor: float = 0.5,
        max_bucket_size: int = 128,
        evict_strategy="kLru",
        initializer=None,
        dtype=np.float32,
        seed: int = 0,
    ):
        dim, bsz = int(dim), int(max_bucket_size)
        if dim < 1:
            raise ValueError(f"EvictingTable: dim must be >= 1, got {dim}")
        if bsz < 1:
            raise ValueError(f"EvictingTable: max_bucket_size must be >= 1, got {bsz}")
        if int(max_capacity) < bsz:
            raise ValueError(
                f"EvictingTable: max_capacity={max_capacity} is less than one bucket (max_bucket_size={bsz})"
            )
        if not 0.0 < float(max_load_factor) <= 1.0:
            raise ValueError(f"EvictingTable: max_load_factor must be in (0, 1], got {max_load_factor}")
        if isinstance(evict_strategy, str):
            if evict_strategy not in EvictStrategy.__members__:
                raise ValueError(
                    f"EvictingTable: evict_strategy {evict_strategy!r} is not one of {list(EvictStrategy.__members__)}"
                )
            evict_strategy = EvictStrategy[evict_strategy]
        self.strategy = EvictStrategy(evict_strategy)
        self.dim, self.bucket_size = dim, bsz
        self.max_load_factor = float(max_load_factor)
        self._max_buckets = _pow2_at_most(int(max_capacity) // bsz)
        nb = min(_pow2_at_least(-(-max(int(init_capacity), 1) // bsz)), self._max_buckets)
        self.dtype = np.dtype(dtype)
        self._init = initializer
        self._rng = np.random.default_rng(seed)
        self._impl = pick(kernel=_KERNELS, cpu=_CPU, ref=_REF)
        self.xp = device.xp() if self._impl is _KERNELS else np
        self._t = _ref.new_arrays(nb, bsz, dim, self.dtype, self.xp)
        self.clock = 0  # + 1 before every batch that writes scores (kLru, kEpochLru)
        self.epoch = 0
        self._state: dict[str, tuple[object, float]] = {}
        self._on_reset: list = []
        self._on_move: list = []

    # ---- size ---------------------------------------------------------------------------------------
    def capacity(self) -> int:
        return self._t.keys.shape[0]

    def max_capacity(self) -> int:
        return self._max_buckets * self.bucket_size

    def size(self) -> int:
        """Keys in the table (one host read on a GPU)."""
        return int(self._t.sizes.sum())

    def load_factor(self) -> float:
        return self.size() / self.capacity()

    def __len__(self) -> int:
        return self.size()

    def __repr__(self) -> str:
        return (
            f"EvictingTable(dim={self.dim}, size={self.size()}, capacity={self.capacity()}, "
            f"max_capacity={self.max_capacity()}, {self.strategy.name})"
        )

    @property
    def arrays(self) -> Arrays:
        """The table's arrays (keys, values, scores, sizes): read them, do not write."""
        return self._t

    def set_global_epoch(self, epoch: int) -> None:
        """The epoch of kEpochLru / kEpochLfu scores (the high 32 bits)."""
        if not 0 <= int(epoch) < 1 << 32:
            raise ValueError(f"EvictingTable.set_global_epoch: epoch must be in [0, 2**32), got {epoch}")
        self.epoch = int(epoch)

    # ---- per-slot state and hooks ------------------------------------------------------------------------
    def slot_state(self, name: str, width: int, fill: float = 0.0, dtype=np.float32):
        """The per-slot array (capacity, width) called name, made on first use: reset to fill where a new key
        lands, moved with its keys when the table doubles (e.g. an optimizer's accumulator). A doubling replaces
        the array: ask for it again after an inserting call rather than keeping it."""
        if name not in self._state:
            self._state[name] = (self.xp.full((self.capacity(), int(width)), fill, dtype=dtype), fill)
        return self._state[name][0]

    def on_reset(self, fn) -> None:
        """fn(slots (M,) int64) after every batch in which new keys took slots."""
        self._on_reset.append(fn)

    def on_move(self, fn) -> None:
        """fn(moved (old capacity,) int64) after every doubling: the new slot of each old slot, -1 if free."""
        self._on_move.append(fn)

    # ---- operations ----------------------------------------------------------------------------------------
    def find(self, keys, return_scores: bool = False):
        """(values (N, dim), founds (N,) bool[, scores (N,) uint64]); zeros for absent keys; no score changes."""
        keys = self._keys(keys, "find")
        rows, found, scores = self._impl[1](self._t, keys)
        return (rows, found, scores) if return_scores else (rows, found)

    def find_or_insert(self, keys, scores=None, return_slots: bool = False, return_evicted: bool = False):
        """values (N, dim): the rows of known keys (their scores updated), new keys inserted with rows from the
        initializer (a refused key's initial row is returned but not stored). return_slots: also (N,) int64
        slots, -1 where refused. return_evicted: also (evicted_keys (E,) uint64, at (E,) int64), the keys this
        call pushed out of the table and the positions of the keys that took their slots (refused keys are
        not reported: they were never stored)."""
        keys = self._keys(keys, "find_or_insert")
        vin = self._initial_rows(keys.shape[0])
        vout = self.xp.empty_like(vin)
        status, slots, ev_keys, *_ = self._upsert(keys, scores, vin, vout, Mode.FIND_OR_INSERT, "find_or_insert")
        out = (vout, slots) if return_slots else (vout,)
        if return_evicted:
            at = self.xp.flatnonzero(status == int(Status.EVICTED))
            out += ((ev_keys[at], at),)
        return out if len(out) > 1 else vout

    def find_slots(self, keys):
        """(N,) int64 the slot of each key, -1 where absent; no score changes (for a caller that keeps rows of
        its own beside the table, e.g. an optimizer state to load). Reads each key's bucket directly."""
        keys = self._keys(keys, "find_slots")
        xp, t, bsz = self.xp, self._t, self.bucket_size
        out = xp.full(keys.shape[0], -1, dtype=np.int64)
        lane = xp.arange(bsz, dtype=np.int64)[None, :]
        step = max(1, (1 << 20) // bsz)  # (step, B) candidates at a time
        for lo in range(0, keys.shape[0], step):
            k = keys[lo : lo + step]
            b = xp.asarray(_ref.bucket_of_ref(device.to_host(k), t.sizes.shape[0]))
            cand = b[:, None] * bsz + lane
            hit = t.keys[cand] == k[:, None]
            first = cand[xp.arange(k.shape[0]), xp.argmax(hit, axis=1)]
            out[lo : lo + step] = xp.where(hit.any(axis=1), first, -1)
        return out

    def insert_or_assign(self, keys, values, scores=None, return_slots: bool = False):
        """Write values (N, dim) to the keys, inserting new ones (a full bucket evicts, see insert_and_evict).
        return_slots: the (N,) int64 slots, -1 where refused."""
        keys = self._keys(keys, "insert_or_assign")
        _, slots, *_ = self._upsert(
            keys,
            scores,
            self._values(values, keys, "insert_or_assign"),
            None,
            Mode.INSERT_OR_ASSIGN,
            "insert_or_assign",
        )
        return slots if return_slots else None

    def insert_and_evict(self, keys, values, scores=None):
        """insert_or_assign, returning what left: (evicted_keys (E,) uint64, evicted_values (E, dim),
        evicted_scores (E,) uint64) in input order of the keys that caused them; a refused key is reported
        with its own row and score."""
        keys = self._keys(keys, "insert_and_evict")
        status, _, ev_keys, ev_vals, ev_scores = self._upsert(
            keys,
            scores,
            self._values(values, keys, "insert_and_evict"),
            None,
            Mode.INSERT_OR_ASSIGN,
            "insert_and_evict",
        )
        at = self.xp.flatnonzero((status == int(Status.EVICTED)) | (status == int(Status.REFUSED)))
        return ev_keys[at], ev_vals[at], ev_scores[at]

    def assign(self, keys, values, scores=None):
        """Write values (N, dim) to the keys already in the table (scores updated); others are ignored."""
        keys = self._keys(keys, "assign")
        self._upsert(keys, scores, self._values(values, keys, "assign"), None, Mode.ASSIGN, "assign")

    def erase_if(self, pred: str, threshold: int, now: int | None = None) -> int:
        """Erase the keys whose score satisfies pred: ``"score_lt"`` (score < threshold), ``"score_ge"`` (score
        >= threshold) or ``"ttl"`` (score < now - threshold, now the clock by default: kLru keys not touched in
        the last threshold batches). Returns how many."""
        slots = self._match(pred, threshold, now, "erase_if")
        self._impl[3](self._t, slots)
        return int(slots.shape[0])

    def export_batch_if(self, pred: str, threshold: int, now: int | None = None):
        """(keys (M,) uint64, values (M, dim), scores (M,) uint64) of the keys satisfying pred (as erase_if),
        in slot order; nothing changes."""
        slots = self._match(pred, threshold, now, "export_batch_if")
        return self._t.keys[slots], self._t.values[slots], self._t.scores[slots]

    def export_batch(self):
        """Every key, row and score, in slot order."""
        return self.export_batch_if("score_ge", 0)

    def reserve(self, capacity: int) -> None:
        """Double until the capacity is at least capacity (or the maximum)."""
        while self.capacity() < int(capacity) and self.capacity() < self.max_capacity():
            self._double()

    def clear(self) -> None:
        """Forget every key (capacity, clock and per-slot state stay)."""
        self._t.keys.fill(np.uint64(EMPTY_KEY))
        self._t.scores.fill(0)
        self._t.sizes.fill(0)

    # ---- helpers -------------------------------------------------------------------------------------------
    def _upsert(self, keys, scores, vin, vout, mode, what):
        n = keys.shape[0]
        if mode != Mode.ASSIGN:  # growth, counting the whole batch in (HierarchicalKV's rule)
            while self.capacity() < self.max_capacity() and self.size() + n > self.max_load_factor * self.capacity():
                self._double()
        self.clock += 1
        given = self._scores(scores, n, what)
        vout = vin if vout is None else vout  # only FIND_OR_INSERT writes vout: one array type for every mode
        out = self._impl[0](self._t, keys, given, vin, vout, int(mode), int(self.strategy), self.clock, self.epoch)
        status, slots = out[0], out[1]
        if self._state or self._on_reset:
            reset = slots[(status == int(Status.INSERTED)) | (status == int(Status.EVICTED))]
            for arr, fill in self._state.values():
                arr[reset] = fill
            for fn in self._on_reset if reset.shape[0] else ():
                fn(reset)
        return out

    def _double(self) -> None:
        new, moved = self._impl[4](self._t)
        self._t = new
        used = self.xp.flatnonzero(moved >= 0)
        for name, (arr, fill) in self._state.items():
            grown = self.xp.full((self.capacity(),) + arr.shape[1:], fill, dtype=arr.dtype)
            grown[moved[used]] = arr[used]
            self._state[name] = (grown, fill)
        for fn in self._on_move:
            fn(moved)

    def _match(self, pred, threshold, now, what):
        if pred not in _PREDS:
            raise ValueError(f"EvictingTable.{what}: pred {pred!r} is not one of {list(_PREDS)}")
        threshold = int(threshold)
        if pred == "ttl":
            threshold = max((self.clock if now is None else int(now)) - threshold, 0)
        if not 0 <= threshold < 1 << 64:
            raise ValueError(f"EvictingTable.{what}: threshold must be in [0, 2**64), got {threshold}")
        return self._impl[2](self._t, _PREDS[pred], threshold)

    def _keys(self, keys, what):
        """Any integer array -> contiguous (N,) uint64 on the table's device (int64 -1 wraps to the reserved
        2**64 - 1, refused with its position)."""
        xp = self.xp
        keys = xp.asarray(keys)
        if keys.dtype.kind not in "iu":
            raise TypeError(f"EvictingTable.{what}: keys must be integers, got {keys.dtype}")
        k64 = xp.ascontiguousarray(keys.reshape(-1).astype(np.uint64, copy=False))
        bad = k64 == np.uint64(EMPTY_KEY)
        if k64.shape[0] and bool(bad.any()):
            raise ValueError(
                f"EvictingTable.{what}: key at position {int(xp.argmax(bad))} is 2**64-1 (int64 -1), which is "
                "reserved: it marks free slots"
            )
        return k64

    def _values(self, values, keys, what):
        values = self.xp.ascontiguousarray(self.xp.asarray(values, dtype=self.dtype))
        if values.shape != (keys.shape[0], self.dim):
            raise ValueError(
                f"EvictingTable.{what}: values must have shape ({keys.shape[0]}, {self.dim}) for "
                f"{keys.shape[0]} keys, got {tuple(values.shape)}"
            )
        return values

    def _scores(self, scores, n, what):
        """The given scores (N,) uint64: required for kCustomized, 1 each by default for the LFU kinds, unused
        (zeros) for the LRU kinds."""
        xp = self.xp
        if scores is None:
            if self.strategy == EvictStrategy.kCustomized:
                raise ValueError(f"EvictingTable.{what}: evict_strategy kCustomized needs scores, one per key")
            lfu = self.strategy in (EvictStrategy.kLfu, EvictStrategy.kEpochLfu)
            return (xp.ones if lfu else xp.zeros)(n, dtype=np.uint64)
        s = xp.asarray(scores)
        if s.dtype.kind not in "iu" or s.shape != (n,):
            raise ValueError(
                f"EvictingTable.{what}: scores must be ({n},) integers (one per key), got {s.dtype} {tuple(s.shape)}"
            )
        if s.dtype.kind == "i" and s.shape[0] and bool((s < 0).any()):
            raise ValueError(f"EvictingTable.{what}: scores must be >= 0 (position {int(xp.argmax(s < 0))})")
        return xp.ascontiguousarray(s.astype(np.uint64))

    def _initial_rows(self, n):
        init, d = self._init, self.dim
        if init is None or init == "zeros":
            rows = np.zeros((n, d))
        elif callable(init):
            rows = np.asarray(init(n, d, self._rng))
            if rows.shape != (n, d):
                raise ValueError(f"EvictingTable: the initializer returned shape {rows.shape}, expected {(n, d)}")
        elif init in ("normal", "random"):
            rows = self._rng.standard_normal((n, d))
        elif init == "uniform":
            rows = self._rng.uniform(-1.0, 1.0, (n, d))
        elif isinstance(init, (int, float)):
            rows = np.full((n, d), float(init))
        else:
            raise ValueError(
                f"EvictingTable: initializer {init!r} is not None, 'zeros', 'normal', 'random', 'uniform', a number "
                "or a callable"
            )
        return self.xp.ascontiguousarray(self.xp.asarray(rows.astype(self.dtype)))
