"""The evicting hash table (kernels/hkv_ref.py, hkv_cpu.py, hkv.py; numbactr.embedding.evicting): the compiled
cpu version and the numba.cuda kernels equal the NumPy reference bit for bit, and the reference keeps the
invariants of its contract (capacity, every key present or reported, victims at their bucket's minimum, scores
per strategy, ties to the lowest slot, find read-only, exact predicate selection)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numbactr.embedding.evicting import EvictingTable
from numbactr.kernels import hkv as K
from numbactr.kernels import hkv_cpu as C
from numbactr.kernels import hkv_ref as R
from numbactr.kernels.hkv_math import EMPTY_KEY, LO32, MAX_SCORE, Arrays, EvictStrategy, Mode, Status
from tests.kernel_util import dev, host

REF = (R.upsert_ref, R.find_ref, R.match_ref, R.erase_ref, R.double_ref)
CPU = (C.upsert_cpu, C.find_cpu, C.match_cpu, C.erase_cpu, C.double_cpu)
KERNELS = (K.upsert, K.find, K.match, K.erase, K.double)
D = 3


def copy(t: Arrays, to=np.asarray) -> Arrays:
    return Arrays(*(to(np.array(host(a))) for a in t))


def same(a, b):
    a, b = [host(x) for x in a], [host(x) for x in b]
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and np.array_equal(x, y)


# ---- one insert into a full bucket, worked by hand -------------------------------------------------
def full_bucket(impl, to=np.asarray):
    """One bucket of 4 slots holding keys 11, 12, 13, 14 with scores 5, 3, 3, 7 (kCustomized)."""
    t = copy(R.new_arrays(1, 4, 2), to)
    keys = to(np.array([11, 12, 13, 14], np.uint64))
    vin = to(np.arange(8, dtype=np.float32).reshape(4, 2))
    st_, *_ = impl[0](
        t, keys, to(np.array([5, 3, 3, 7], np.uint64)), vin, vin, Mode.INSERT_OR_ASSIGN, EvictStrategy.kCustomized, 1, 0
    )
    assert list(host(st_)) == [Status.INSERTED] * 4
    return t


@pytest.mark.parametrize("impl", [REF, CPU], ids=["ref", "cpu"])
def test_one_insert_into_a_full_bucket_by_hand(impl):
    t = full_bucket(impl)
    keys = np.array([20, 21, 12], np.uint64)
    vin = np.full((3, 2), 9.0, np.float32)
    status, slots, ek, ev, es = impl[0](
        t, keys, np.array([4, 2, 8], np.uint64), vin, vin, Mode.INSERT_OR_ASSIGN, EvictStrategy.kCustomized, 2, 0
    )
    # 20 (score 4): the minimum 3 is held by slots 1 and 2: the lower slot, 1 (key 12), leaves
    # 21 (score 2): below the bucket's minimum (now 3, slot 2): refused, reported with its own score
    # 12 (score 8): evicted a moment ago, so new again: the minimum is slot 2 (key 13, score 3)
    assert list(status) == [Status.EVICTED, Status.REFUSED, Status.EVICTED]
    assert list(slots) == [1, -1, 2]
    assert list(ek) == [12, 21, 13] and list(es) == [3, 2, 3]
    assert np.array_equal(ev, [[2, 3], [9, 9], [4, 5]])
    assert list(t.keys) == [11, 20, 12, 14] and list(t.scores) == [5, 4, 8, 7] and list(t.sizes) == [4]


def test_one_insert_into_a_full_bucket_in_the_simulator():
    t = full_bucket(KERNELS, dev)
    keys, vin = dev(np.array([20, 21, 12], np.uint64)), dev(np.full((3, 2), 9.0, np.float32))
    out = K.upsert(
        t, keys, dev(np.array([4, 2, 8], np.uint64)), vin, vin, Mode.INSERT_OR_ASSIGN, EvictStrategy.kCustomized, 2, 0
    )
    r = full_bucket(REF)
    same(
        list(t) + list(out),
        list(r)
        + list(
            R.upsert_ref(
                r,
                host(keys),
                np.array([4, 2, 8], np.uint64),
                host(vin),
                host(vin).copy(),
                Mode.INSERT_OR_ASSIGN,
                EvictStrategy.kCustomized,
                2,
                0,
            )
        ),
    )


# ---- random op sequences: cpu == reference, and the reference's invariants ----------------------------
def batches(max_keys, max_ops):
    key = st.integers(0, 40) | st.sampled_from([0, 2**63, 2**64 - 2, 2**32 + 1])
    batch = st.tuples(
        st.sampled_from(["foi", "ioa", "assign", "find", "erase", "export", "double"]),
        st.lists(key, min_size=0, max_size=max_keys),
        st.integers(0, 2**64 - 1),
        st.lists(st.integers(0, 6) | st.just(2**64 - 1), min_size=max_keys, max_size=max_keys),
    )
    return st.lists(batch, min_size=1, max_size=max_ops)


def run(impl, t, ops, strategy, to=np.asarray, check=None):
    """Apply ops to t with impl; returns (t, every output in order)."""
    outs, rng = [], np.random.default_rng(0)
    for step, (op, keys, thr, given_) in enumerate(ops, start=1):
        k = np.array(keys, np.uint64)
        g = np.array(given_[: len(keys)], np.uint64)
        vin = rng.standard_normal((len(keys), D)).astype(np.float32)
        if op in ("foi", "ioa", "assign"):
            mode = {"foi": Mode.FIND_OR_INSERT, "ioa": Mode.INSERT_OR_ASSIGN, "assign": Mode.ASSIGN}[op]
            before = copy(t)
            vout = to(np.zeros_like(vin))
            out = impl[0](t, to(k), to(g), to(vin), vout, mode, strategy, step, step // 3)
            outs += list(out) + [vout]
            if check:
                check(before, t, k, g, vin, host(vout), mode, strategy, step, step // 3, [host(x) for x in out])
        elif op == "find":
            before = copy(t)
            outs += list(impl[1](t, to(k)))
            same(before, t)  # find writes nothing
        elif op in ("erase", "export"):
            slots = impl[2](t, thr & 1, thr >> 1 & 15)
            outs.append(slots)
            if check:
                sc, used = host(t.scores), host(t.keys) != np.uint64(EMPTY_KEY)
                want = np.flatnonzero(used & ((sc < (thr >> 1 & 15)) if thr & 1 == 0 else (sc >= (thr >> 1 & 15))))
                assert np.array_equal(host(slots), want)  # exactly the predicate's slots
            if op == "erase":
                impl[3](t, slots)
        elif t.sizes.shape[0] < 8:
            t, moved = impl[4](t)
            outs.append(moved)
        check_shape(t)
    return t, outs


def check_shape(t):
    keys, sizes = host(t.keys), host(t.sizes)
    bsz = keys.shape[0] // sizes.shape[0]
    occupied = (keys != np.uint64(EMPTY_KEY)).reshape(-1, bsz)
    assert np.array_equal(occupied.sum(1), sizes) and (sizes <= bsz).all()  # never over capacity
    kept = keys[keys != np.uint64(EMPTY_KEY)]
    assert np.unique(kept).size == kept.size  # a key lives in one slot
    assert (R.bucket_of_ref(kept, sizes.shape[0]) == np.flatnonzero(occupied) // bsz).all()
    assert (host(t.scores)[keys == np.uint64(EMPTY_KEY)] == 0).all()


def expected_score(strategy, old, g, clock, epoch):
    """The strategies' scores, written out again for the test (old None: a new key)."""
    g = int(g)
    return {
        EvictStrategy.kLru: clock,
        EvictStrategy.kLfu: g if old is None else min(old + g, MAX_SCORE),
        EvictStrategy.kEpochLru: epoch << 32 | clock,
        EvictStrategy.kEpochLfu: epoch << 32 | min(min(g, LO32) + (0 if old is None else old & LO32), LO32),
        EvictStrategy.kCustomized: g,
    }[strategy]


def check_keys_one_by_one(before, after, keys, g, vin, vout, mode, strategy, clock, epoch, out):
    """The batch equals its keys applied one at a time (the batch order), and each single step keeps the
    contract: found -> its score; new -> a free slot (the lowest), or its full bucket's minimum (the lowest
    slot among equal minima) when not below it, else refused."""
    t = copy(before)
    bsz = t.keys.shape[0] // t.sizes.shape[0]
    status = out[0]
    for i in range(keys.shape[0]):
        prev = copy(t)
        b = int(R.bucket_of_ref(keys[i : i + 1], t.sizes.shape[0])[0])
        lo = b * bsz
        bk, bs = prev.keys[lo : lo + bsz], prev.scores[lo : lo + bsz]
        r = R.upsert_ref(
            t, keys[i : i + 1], g[i : i + 1], vin[i : i + 1], np.zeros((1, D), np.float32), mode, strategy, clock, epoch
        )
        s, slot = r[0][0], r[1][0]
        assert s == status[i]
        old = int(bs[bk == keys[i]][0]) if (bk == keys[i]).any() else None
        if s == Status.FOUND:
            assert t.scores[slot] == expected_score(strategy, old, g[i], clock, epoch)
        elif s == Status.INSERTED:
            assert slot == lo + np.flatnonzero(bk == np.uint64(EMPTY_KEY))[0]
        elif s in (Status.EVICTED, Status.REFUSED):
            assert (bk != np.uint64(EMPTY_KEY)).all()
            low = bs.min()
            new = expected_score(strategy, None, g[i], clock, epoch)
            assert (s == Status.REFUSED) == (new < int(low))
            if s == Status.EVICTED:
                assert slot == lo + np.flatnonzero(bs == low)[0] and r[4][0] == low and r[2][0] == bk[slot - lo]
        if s in (Status.INSERTED, Status.EVICTED):
            assert t.scores[slot] == expected_score(strategy, None, g[i], clock, epoch)
    same(t, after)
    # every key of an inserting batch is in the table, or was reported (refused, or evicted later on)
    if mode != Mode.ASSIGN:
        reported = set(out[2][(status == Status.EVICTED) | (status == Status.REFUSED)].tolist())
        assert set(keys.tolist()) <= set(after.keys.tolist()) | reported


@settings(max_examples=100, deadline=None)
@given(
    ops=batches(12, 6),
    strategy=st.sampled_from(list(EvictStrategy)),
    nb=st.sampled_from([1, 2, 4]),
    bsz=st.sampled_from([2, 4, 8]),
)
def test_compiled_equals_reference_and_the_contract_holds(ops, strategy, nb, bsz):
    r, r_out = run(REF, R.new_arrays(nb, bsz, D), ops, strategy, check=check_keys_one_by_one)
    c, c_out = run(CPU, R.new_arrays(nb, bsz, D), ops, strategy)
    same(r, c)
    same(r_out, c_out)


@settings(max_examples=3, deadline=None)
@given(ops=batches(16, 3), strategy=st.sampled_from(list(EvictStrategy)))
def test_kernels_equal_reference(ops, strategy):
    r, r_out = run(REF, R.new_arrays(2, 4, D), ops, strategy)
    k, k_out = run(KERNELS, copy(R.new_arrays(2, 4, D), dev), ops, strategy, to=dev)
    same(r, k)
    same(r_out, k_out)


def dense_ops(seed, n=16, count=5):
    """Batches of n keys from 0..39 into 2 buckets of 4 slots: full buckets, evictions and refusals."""
    rng = np.random.default_rng(seed)
    kinds = ["ioa", "foi", "find", "ioa", "assign", "foi", "export", "erase", "double", "foi"]
    return [
        (
            kinds[j % len(kinds)],
            rng.integers(0, 40, n).tolist(),
            int(rng.integers(0, 64)),
            rng.integers(0, 4, n).tolist(),
        )
        for j in range(count)
    ]


@pytest.mark.parametrize("strategy", list(EvictStrategy), ids=lambda s: s.name)
def test_dense_batches_evict_and_keep_the_contract(strategy):
    r, r_out = run(
        REF, R.new_arrays(2, 4, D), dense_ops(int(strategy), count=10), strategy, check=check_keys_one_by_one
    )
    c, c_out = run(CPU, R.new_arrays(2, 4, D), dense_ops(int(strategy), count=10), strategy)
    same(r, c)
    same(r_out, c_out)
    statuses = np.concatenate([o for o in r_out if o.dtype == np.int32])
    assert (statuses == Status.EVICTED).any()
    if strategy in (EvictStrategy.kLfu, EvictStrategy.kCustomized):
        assert (statuses == Status.REFUSED).any()


@pytest.mark.parametrize("strategy", list(EvictStrategy), ids=lambda s: s.name)
def test_kernels_equal_reference_on_dense_batches(strategy):
    r, r_out = run(REF, R.new_arrays(2, 4, D), dense_ops(int(strategy)), strategy)
    k, k_out = run(KERNELS, copy(R.new_arrays(2, 4, D), dev), dense_ops(int(strategy)), strategy, to=dev)
    same(r, k)
    same(r_out, k_out)


def test_parallel_find_equals_reference():
    """find_keys is a parallel_cpu.pjit twin: its parallel and serial compilations both give find_ref's bits."""
    rng = np.random.default_rng(3)
    t = R.new_arrays(8, 16, D)
    keys = rng.integers(0, 400, 300).astype(np.uint64)
    vin = rng.standard_normal((300, D)).astype(np.float32)
    C.upsert_cpu(t, keys, np.ones(300, np.uint64), vin, vin.copy(), Mode.INSERT_OR_ASSIGN, EvictStrategy.kLfu, 1, 0)
    query = rng.integers(0, 500, 5000).astype(np.uint64)  # present and absent keys, repeats
    for twin in (C.find_keys.parallel, C.find_keys.serial):
        out = (np.zeros((query.size, D), np.float32), np.zeros(query.size, bool), np.zeros(query.size, np.uint64))
        twin(*t, query, *out)
        same(out, R.find_ref(t, query))


# ---- the table object ---------------------------------------------------------------------------------
def stream(t: EvictingTable, steps=40, n=32, seed=0):
    """Drifting IDs: step s looks up keys of [4 s, 4 s + 200) and inserts 4 of [4 s + 200, 4 s + 400); returns
    what insert_and_evict reported."""
    rng, evicted = np.random.default_rng(seed), []
    for s in range(steps):
        keys = rng.integers(4 * s, 4 * s + 200, size=n)
        t.find_or_insert(keys)
        ek, ev, es = t.insert_and_evict(rng.integers(4 * s + 200, 4 * s + 400, size=4), np.full((4, t.dim), float(s)))
        evicted.append(host(ek))
        assert t.size() <= t.max_capacity()
    return np.concatenate(evicted)


def test_a_stream_of_more_keys_than_the_table_holds(cpu):
    t = EvictingTable(4, init_capacity=16, max_capacity=64, max_bucket_size=8, initializer=0.5)
    assert t.capacity() == 16
    evicted = stream(t)
    assert t.capacity() == t.max_capacity() == 64 and 32 < t.size() <= 64 and evicted.size > 0
    keys, values, scores = t.export_batch()
    assert keys.size == t.size() and (scores <= t.clock).all()
    rows, found = t.find(keys)
    assert found.all() and np.array_equal(rows, values)
    rows, found = t.find(np.setdiff1d(np.arange(400, dtype=np.uint64), keys))
    assert not found.any() and not rows.any()


def test_new_keys_get_initial_rows_and_reset_slot_state(cpu):
    t = EvictingTable(
        2, 4, 4, max_bucket_size=4, evict_strategy="kCustomized", initializer=lambda n, d, rng: np.full((n, d), 7.0)
    )
    acc = t.slot_state("acc", 1, fill=0.0)
    seen = []
    t.on_reset(lambda slots: seen.append(sorted(slots.tolist())))
    assert np.array_equal(t.find_or_insert([1, 2, 3, 4], scores=[5, 6, 7, 8]), np.full((4, 2), 7.0))
    acc[:] = 1.0  # the optimizer's state of 1, 2, 3, 4
    t.insert_or_assign([2], [[0.0, 1.0]], scores=[9])  # a hit: nothing reset
    slots = t.find_or_insert([9, 1], scores=[6, 1], return_slots=True)[1]  # 9 evicts 1 (score 5); 1 then refused
    assert slots[1] == -1 and acc[slots[0], 0] == 0.0 and acc.sum() == 3.0
    assert seen == [[0, 1, 2, 3], [int(slots[0])]]
    assert np.array_equal(t.find([2])[0], [[0.0, 1.0]])


def test_growth_moves_keys_and_slot_state(cpu):
    t = EvictingTable(1, 4, 64, max_bucket_size=4)
    moves = []
    t.on_move(moves.append)
    t.insert_or_assign([10, 11], [[1.0], [2.0]])
    slots = t.insert_or_assign([10, 11], [[1.0], [2.0]], return_slots=True)  # grows to 8 slots first
    t.slot_state("s", 1)[slots] = [[10.0], [11.0]]  # the state array after growth
    t.insert_or_assign(np.arange(20, 40), np.arange(20, 40, dtype=np.float32)[:, None])
    assert t.capacity() == 64 and len(moves) == 4  # 4 -> 64 slots: (2 + 20) > 0.5 * 32
    slots = t.insert_or_assign([10, 11], [[1.0], [2.0]], return_slots=True)
    assert np.array_equal(t.slot_state("s", 1)[slots, 0], [10.0, 11.0])


def test_ttl_and_score_predicates(cpu):
    t = EvictingTable(1, 8, 8, max_bucket_size=8)
    for k in range(5):
        t.insert_or_assign([k], [[float(k)]])  # kLru: key k has score k + 1
    keys, _, scores = t.export_batch_if("ttl", 2)  # older than clock 5 - 2 = 3: keys 0, 1
    assert sorted(keys.tolist()) == [0, 1] and (scores < 3).all()
    assert sorted(t.export_batch_if("score_ge", 4)[0].tolist()) == [3, 4]
    assert t.erase_if("ttl", 2) == 2 and t.size() == 3 and not t.find([0, 1])[1].any()


def test_epoch_strategies_keep_the_epoch_in_the_high_bits(cpu):
    t = EvictingTable(1, 8, 8, max_bucket_size=8, evict_strategy="kEpochLfu")
    t.set_global_epoch(3)
    t.find_or_insert([5, 5, 6], scores=[2, 2**40, 1])
    assert list(t.find([5, 6], return_scores=True)[2]) == [3 << 32 | LO32, 3 << 32 | 1]


def test_bad_input_is_named(cpu):
    t = EvictingTable(2, 8, 8, max_bucket_size=8, evict_strategy="kCustomized")
    with pytest.raises(ValueError, match="position 1 is 2\\*\\*64-1"):
        t.find_or_insert(np.array([3, -1]), scores=[1, 1])
    with pytest.raises(ValueError, match="needs scores"):
        t.find_or_insert([3])
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        t.insert_or_assign([1, 2], np.zeros((2, 3)), scores=[1, 1])
    with pytest.raises(ValueError, match="evict_strategy 'LRU'"):
        EvictingTable(2, 128, 128, evict_strategy="LRU")
    with pytest.raises(ValueError, match="less than one bucket"):
        EvictingTable(2, 8, 64)
    with pytest.raises(ValueError, match="pred 'older'"):
        t.erase_if("older", 3)


def test_the_table_is_the_same_on_every_device(on_device):
    """cpu (compiled), the reference and the simulator's kernels: one short stream, the same table."""
    from numbactr.runtime import device

    tables = []
    for name in ("cpu", "ref", "sim"):
        on_device("cpu" if name == "ref" else name)
        with device.reference_ops() if name == "ref" else _nothing():
            t = EvictingTable(2, 8, 16, max_bucket_size=4, evict_strategy="kLfu", initializer="normal")
            stream(t, steps=3, n=12)
            tables.append(t.arrays)
    same(tables[0], tables[1])
    same(tables[0], tables[2])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
