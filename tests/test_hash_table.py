import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.embedding.hash_table import EMPTY_KEY, HashTable, HashTableFullError
from numbactr.kernels import hash_table as hk
from tests.kernel_util import SIMULATED, host

TOP = 2**64 - 2  # the largest usable key (2**64 - 1 is reserved)
EXTREMES = [0, 1, 2, TOP, TOP - 1, 2**63, 2**63 - 1, 2**32 - 1, 2**32, 2**53 + 1]


def xp():
    if SIMULATED:
        return np
    import cupy

    return cupy


def kernel_table(max_rows, **kw):
    return HashTable(max_rows, use_kernels=True, xp=xp(), **kw)


def ref_table(max_rows, **kw):
    return HashTable(max_rows, use_kernels=False, **kw)


def compiled_table(max_rows, **kw):
    """the cpu device's table: numba-compiled CPU code (kernels/hash_table_cpu.py); a small table takes
    the serial insert"""
    return HashTable(max_rows, use_kernels=False, compiled=True, **kw)


def compiled_hashed_table(max_rows, **kw):
    """the compiled table without its direct index: every key hashed and probed"""
    return HashTable(max_rows, use_kernels=False, compiled=True, direct=False, **kw)


def compiled_parallel_table(max_rows, **kw):
    """the compiled table forced onto the large tables' insert: a parallel find, then the misses claimed"""
    t = compiled_table(max_rows, **kw)
    t.serial_slots = 0
    return t


class DictModel:
    """The spec in plain Python: a new key gets the next row, in order of first occurrence."""

    def __init__(self, max_rows):
        self.rows, self.max_rows = {}, max_rows

    def insert(self, keys):
        new = list(dict.fromkeys(int(k) for k in keys if int(k) not in self.rows))
        if len(self.rows) + len(new) > self.max_rows:
            raise HashTableFullError(len(new), len(self.rows), self.max_rows)
        for k in new:
            self.rows[k] = len(self.rows)
        return np.array([self.rows[int(k)] for k in keys], dtype=np.int64)

    def find(self, keys):
        return np.array([self.rows.get(int(k), -1) for k in keys], dtype=np.int64)


def table_state(t):
    return host(t._tkeys).copy(), host(t._trows).copy()


def check_invariants(t):
    tkeys, trows = table_state(t)
    occupied = tkeys != EMPTY_KEY
    assert np.array_equal(occupied, trows >= 0), "every occupied slot has a row, free slots none"
    assert np.array_equal(np.sort(trows[occupied]), np.arange(t.size)), "rows form range(size)"
    if t._tfirst is not None:
        assert (host(t._tfirst) == hk.INT64_MAX).all(), "insert scratch reset"
    if t._direct is not None:  # the compiled table's direct index: the row of every small key held, -1 else
        expect = np.full(t._direct.shape[0], -1, np.int64)
        small = occupied & (tkeys < t._direct.shape[0])
        expect[tkeys[small].astype(np.int64)] = trows[small]
        np.testing.assert_array_equal(t._direct, expect)


def insert_all(tables, keys):
    """Insert into every table; all must succeed with equal rows or all fail with the same error."""
    results = []
    for t in tables:
        before = table_state(t)
        try:
            results.append(("ok", host(t.insert(keys))))
        except HashTableFullError as e:
            results.append(("full", (e.needed, e.used, e.max_rows)))
            after = table_state(t)
            assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1]), (
                "a failed insert must leave the table unchanged"
            )
        check_invariants(t)
    kinds = {r[0] for r in results}
    assert len(kinds) == 1, results
    if "ok" in kinds:
        for r in results[1:]:
            np.testing.assert_array_equal(r[1], results[0][1])
    else:
        assert len({r[1] for r in results}) == 1, results
    return results[0]


# key strategy: a small pool gives duplicates within and across batches, plus extremes and random keys
KEY = st.one_of(st.integers(0, 12), st.sampled_from(EXTREMES), st.integers(0, TOP))
BATCH = st.lists(KEY, max_size=70).map(lambda ks: np.array(ks, dtype=np.uint64))


@given(
    batches=st.lists(BATCH, min_size=1, max_size=3),
    max_rows=st.integers(0, 150),
    load_factor=st.sampled_from([0.5, 0.75, 1.0]),
)
def test_insert_kernel_and_reference_match_the_spec(batches, max_rows, load_factor):
    tk, tr = kernel_table(max_rows, load_factor=load_factor), ref_table(max_rows, load_factor=load_factor)
    tc = compiled_table(max_rows, load_factor=load_factor)
    th = compiled_hashed_table(max_rows, load_factor=load_factor)
    tp = compiled_parallel_table(max_rows, load_factor=load_factor)
    model = DictModel(max_rows)
    for keys in batches:
        kind, res = insert_all([tk, tr, tc, th, tp], keys)
        try:
            expect = model.insert(keys)
        except HashTableFullError as e:
            assert (kind, res) == ("full", (e.needed, e.used, e.max_rows))
            continue
        assert kind == "ok"
        np.testing.assert_array_equal(res, expect)
        assert tk.size == tr.size == len(model.rows)
    seen = np.concatenate(batches)
    probe = np.concatenate([seen, np.array(EXTREMES, np.uint64)])
    expect = model.find(probe)
    np.testing.assert_array_equal(host(tk.find(probe)), expect)
    np.testing.assert_array_equal(tr.find(probe), expect)
    np.testing.assert_array_equal(tc.find(probe), expect)
    np.testing.assert_array_equal(th.find(probe), expect)
    np.testing.assert_array_equal(tp.find(probe), expect)
    by_row = np.array(list(model.rows), dtype=np.uint64)
    np.testing.assert_array_equal(host(tk.keys_by_row()), by_row)
    np.testing.assert_array_equal(tr.keys_by_row(), by_row)
    np.testing.assert_array_equal(tc.keys_by_row(), by_row)
    np.testing.assert_array_equal(tp.keys_by_row(), by_row)


@given(keys=st.lists(st.integers(0, 2**20), min_size=1, max_size=80), max_rows=st.integers(1, 12))
def test_small_tables_with_heavy_collisions(keys, max_rows):
    # few slots, many distinct keys: long probe chains, wrap-around, and often a full table
    keys = np.array(keys, dtype=np.uint64)
    tk, tr = kernel_table(max_rows, load_factor=1.0), ref_table(max_rows, load_factor=1.0)
    tc = compiled_table(max_rows, load_factor=1.0)
    tp = compiled_parallel_table(max_rows, load_factor=1.0)
    model = DictModel(max_rows)
    for part in (keys[: len(keys) // 2], keys[len(keys) // 2 :]):
        kind, res = insert_all([tk, tr, tc, tp], part)
        try:
            np.testing.assert_array_equal(res, model.insert(part))
        except HashTableFullError as e:
            assert (kind, res) == ("full", (e.needed, e.used, e.max_rows))
    np.testing.assert_array_equal(host(tk.find(keys)), model.find(keys))
    np.testing.assert_array_equal(tr.find(keys), model.find(keys))
    np.testing.assert_array_equal(tc.find(keys), model.find(keys))
    np.testing.assert_array_equal(tp.find(keys), model.find(keys))


@given(present=st.lists(KEY, max_size=60, unique=True), absent=st.lists(KEY, max_size=60))
def test_find_of_absent_keys_is_minus_one_and_never_inserts(present, absent):
    present = np.array(present, dtype=np.uint64)
    absent = np.array([k for k in absent if k not in set(present.tolist())], dtype=np.uint64)
    for t in (kernel_table(100), ref_table(100)):
        rows = host(t.insert(present))
        np.testing.assert_array_equal(rows, np.arange(len(present)))
        np.testing.assert_array_equal(host(t.find(absent)), -np.ones(len(absent), np.int64))
        np.testing.assert_array_equal(host(t.find(present)), rows)
        assert t.size == len(present)


def test_keys_colliding_on_one_home_slot():
    # 40 keys that all hash to slot 3 of a 64-slot table: one chain of 40, found in insertion order
    cap = 64
    cand = np.arange(200_000, dtype=np.uint64)
    keys = cand[hk._home_slots_ref(cand, cap) == 3][:40]
    assert keys.size == 40
    batch = np.concatenate([keys[::-1], keys, keys[5:9]])
    for t in (kernel_table(48, load_factor=0.75), ref_table(48, load_factor=0.75)):
        assert t.capacity == cap
        rows = host(t.insert(batch))
        np.testing.assert_array_equal(rows[:40], np.arange(40))
        np.testing.assert_array_equal(rows[40:80], np.arange(40)[::-1])
        tkeys, _ = table_state(t)
        np.testing.assert_array_equal(np.sort(tkeys[3:43]), np.sort(keys))  # contiguous chain
        np.testing.assert_array_equal(host(t.find(keys)), np.arange(40)[::-1])


@pytest.mark.parametrize("key", [0, 1, 12345, 2**32, 2**53 + 1, 2**63, TOP])
def test_kernel_hash_matches_reference_home_slot(key):
    # uint64 arithmetic in the kernel (no float promotion): one key lands on the reference home slot
    t = kernel_table(700, load_factor=0.7)
    t.insert(np.array([key], dtype=np.uint64))
    tkeys, trows = table_state(t)
    home = int(hk._home_slots_ref(np.array([key], np.uint64), t.capacity)[0])
    assert tkeys[home] == np.uint64(key) and trows[home] == 0
    assert np.count_nonzero(tkeys != EMPTY_KEY) == 1


PTX_SCRIPT = """
import os
os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
from numba import cuda
from numbactr.kernels import hash_table as hk
probing = [(k, sig) for k, sig in hk.PTX_CHECKS if k.py_func.__name__ in ("hash_claim_kernel", "hash_find_kernel")]
assert len(probing) == 2, probing
for kernel, sig in probing:
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    assert "rem.u64" in ptx and "rem.s64" not in ptx, "home slot must use an unsigned 64-bit modulus"
    assert "cvt.rn.f64" not in ptx and ".f64" not in ptx, "hash arithmetic must not go through float64"
print("ok")
"""


def test_compiled_hash_uses_unsigned_64bit_arithmetic():
    # the simulator cannot see numba's GPU integer typing (u64 % i64 -> signed int64): check the PTX
    from tests.test_ptx import _nvvm_available

    if not _nvvm_available():
        pytest.skip("NVVM not installed (pip install 'numba-cuda[cu12]')")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    r = subprocess.run([sys.executable, "-c", PTX_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    "make", [kernel_table, ref_table, compiled_table, compiled_hashed_table, compiled_parallel_table]
)
def test_key_dtypes_uint32_int64_uint64(make):
    t = make(10)
    rows = host(t.insert(np.array([7, 2**32 - 1, 7, 0], dtype=np.uint32)))
    np.testing.assert_array_equal(rows, [0, 1, 0, 2])
    np.testing.assert_array_equal(host(t.find(np.array([2**32 - 1, 0, 7], dtype=np.int64))), [1, 2, 0])
    np.testing.assert_array_equal(host(t.insert(np.array([[5], [7]], dtype=np.uint64))), [3, 0])
    # a negative int64 key is its two's complement uint64 (HugeCTR uses keys verbatim)
    np.testing.assert_array_equal(host(t.insert(np.array([-2], dtype=np.int64))), [4])
    np.testing.assert_array_equal(host(t.find(np.array([TOP], dtype=np.uint64))), [4])
    with pytest.raises(TypeError, match="integers"):
        t.insert(np.array([1.0]))


@pytest.mark.parametrize(
    "make", [kernel_table, ref_table, compiled_table, compiled_hashed_table, compiled_parallel_table]
)
@pytest.mark.parametrize("bad", [np.array([3, 4, -1], np.int64), np.array([3, 4, 2**64 - 1], np.uint64)])
def test_reserved_key_is_rejected(make, bad):
    t = make(10)
    t.insert(np.array([3], np.uint64))
    with pytest.raises(ValueError, match=r"key (-1|18446744073709551615) at position 2 .*2\*\*64-1"):
        t.insert(bad)
    with pytest.raises(ValueError, match="reserved"):
        t.find(bad)
    assert t.size == 1
    check_invariants(t)


@pytest.mark.parametrize(
    "make", [kernel_table, ref_table, compiled_table, compiled_hashed_table, compiled_parallel_table]
)
def test_full_table_error_leaves_table_usable(make):
    t = make(5)
    np.testing.assert_array_equal(host(t.insert(np.array([10, 11, 10], np.uint64))), [0, 1, 0])
    with pytest.raises(HashTableFullError) as info:
        t.insert(np.array([11, 12, 13, 14, 15, 12], np.uint64))  # 4 new keys, 3 rows free
    err = info.value
    assert isinstance(err, RuntimeError)
    assert (err.needed, err.used, err.max_rows) == (4, 2, 5)
    assert "needs 4 more rows" in str(err) and "2 of max_rows=5 used" in str(err)
    assert "workspace_size_per_gpu_in_mb" in str(err)
    assert t.size == 2
    np.testing.assert_array_equal(host(t.find(np.array([10, 11, 12], np.uint64))), [0, 1, -1])
    check_invariants(t)
    # a batch that fits still works, and fills the table exactly
    np.testing.assert_array_equal(host(t.insert(np.array([13, 10, 12, 14], np.uint64))), [2, 0, 3, 4])
    assert t.size == 5
    np.testing.assert_array_equal(host(t.insert(np.array([14, 10], np.uint64))), [4, 0])
    with pytest.raises(HashTableFullError, match="needs 1 more rows"):
        t.insert(np.array([99], np.uint64))


@pytest.mark.parametrize(
    "make", [kernel_table, ref_table, compiled_table, compiled_hashed_table, compiled_parallel_table]
)
def test_batch_larger_than_every_slot(make):
    # load_factor 1: 40 distinct keys cannot all claim one of 8 slots (kernel: the probe-exhaustion path)
    t = make(8, load_factor=1.0)
    t.insert(np.array([1, 2, 3], np.uint64))
    keys = np.concatenate([np.arange(100, 140, dtype=np.uint64), np.array([2, 105], np.uint64)])
    with pytest.raises(HashTableFullError) as info:
        t.insert(keys)
    assert (info.value.needed, info.value.used, info.value.max_rows) == (40, 3, 8)
    check_invariants(t)
    np.testing.assert_array_equal(host(t.find(np.array([1, 2, 3, 100], np.uint64))), [0, 1, 2, -1])
    np.testing.assert_array_equal(host(t.insert(np.array([9, 1], np.uint64))), [3, 0])


@pytest.mark.parametrize(
    "make", [kernel_table, ref_table, compiled_table, compiled_hashed_table, compiled_parallel_table]
)
def test_zero_rows_empty_batches_and_clear(make):
    t0 = make(0)
    assert t0.capacity == 1
    assert host(t0.insert(np.zeros(0, np.uint64))).shape == (0,)
    with pytest.raises(HashTableFullError):
        t0.insert(np.array([4], np.uint64))
    t = make(6)
    assert host(t.find(np.zeros(0, np.int64))).shape == (0,)
    assert host(t.keys_by_row()).shape == (0,)
    t.insert(np.array([5, 6, 5], np.uint64))
    t.clear()
    assert t.size == 0 and host(t.keys_by_row()).shape == (0,)
    np.testing.assert_array_equal(host(t.find(np.array([5, 6], np.uint64))), [-1, -1])
    np.testing.assert_array_equal(host(t.insert(np.array([6, 7], np.uint64))), [0, 1])
    check_invariants(t)


def test_constructor_validation_and_capacity():
    assert ref_table(100).capacity == 134 and ref_table(100, load_factor=0.5).capacity == 200
    assert ref_table(3, load_factor=1.0).capacity == 3
    with pytest.raises(ValueError, match="load_factor"):
        ref_table(10, load_factor=1.5)
    with pytest.raises(ValueError, match="max_rows"):
        ref_table(-1)


@pytest.mark.parametrize("make", [ref_table, compiled_table, compiled_hashed_table, compiled_parallel_table])
def test_reference_at_scale_matches_dict_model(make):
    # the vectorised reference and the compiled table (the cpu device path) on a realistic batch: Zipf
    # keys, 3 batches; the compiled insert finds in parallel, then inserts the misses in batch order
    rng = np.random.default_rng(7)
    t, model = make(60_000), DictModel(60_000)
    for _ in range(3):
        keys = rng.zipf(1.3, 20_000).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        np.testing.assert_array_equal(t.insert(keys), model.insert(keys))
    check_invariants(t)
    np.testing.assert_array_equal(t.keys_by_row(), np.array(list(model.rows), dtype=np.uint64))


@pytest.mark.gpu
def test_hash_table_on_gpu_1m_keys():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**62, size=600_000, dtype=np.uint64)
    batch = rng.choice(keys, size=1_000_000)  # 1M keys with duplicates
    batch[:10] = [0, TOP, TOP - 1, 1, 2, 3, 0, TOP, 5, 5]
    tk, tr = kernel_table(1_000_000), ref_table(1_000_000)
    for part in (batch[:400_000], batch):
        xk = xp().asarray(part)
        np.testing.assert_array_equal(host(tk.insert(xk)), tr.insert(part))
        assert tk.size == tr.size
    np.testing.assert_array_equal(host(tk.find(xp().asarray(keys))), tr.find(keys))
    np.testing.assert_array_equal(host(tk.keys_by_row()), tr.keys_by_row())
    check_invariants(tk)
    with pytest.raises(HashTableFullError):
        tk.insert(xp().asarray(rng.integers(2**62, 2**63, size=500_000, dtype=np.uint64)))
    check_invariants(tk)


# ---- the deferred insert (a GPU training step's path: no host read) ---------------------------------------
@given(
    batches=st.lists(st.tuples(BATCH, st.integers(0, 2**70)), min_size=1, max_size=4),
    max_rows=st.integers(0, 40),
    load_factor=st.sampled_from([0.5, 1.0]),
)
def test_deferred_insert_equals_the_eager_insert(batches, max_rows, load_factor):
    """insert_deferred over the occurrences of table 0 (occ == 0; the others keep rows_out's values): the rows,
    the new-key flags, the table and the size equal the spec's; a batch that does not fit gets rows -1 for its
    new keys and
    leaves the table as before, and check() raises the first such batch's HashTableFullError."""
    t = kernel_table(max_rows, load_factor=load_factor)
    model = DictModel(max_rows)
    first_error = None
    for keys, mask_bits in batches:
        occ = np.array([(mask_bits >> i) & 1 for i in range(keys.shape[0])], np.int64)  # 0: this table
        mine = occ == 0
        before = table_state(t)
        rows_out = np.full(keys.shape[0], 777, np.int64)
        known = set(model.rows)
        try:
            expect = model.insert(keys[mine])
            failed = False
        except HashTableFullError as e:
            failed = True
            first_error = first_error or (e.needed, e.used, e.max_rows)
        from tests.kernel_util import dev

        rows, flags, _ = t.insert_deferred(dev(keys), dev(occ), 0, rows_out=dev(rows_out))
        rows, flags = host(rows), host(flags)
        np.testing.assert_array_equal(rows[~mine], 777)  # other tables' occurrences untouched
        if failed:  # known keys keep their rows, new ones get -1
            np.testing.assert_array_equal(rows[mine], model.find(keys[mine]))
            after = table_state(t)
            assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])
        else:
            np.testing.assert_array_equal(rows[mine], expect)
            first_new = np.zeros(keys.shape[0], bool)
            seen = set()
            for i in np.flatnonzero(mine):
                k = int(keys[i])
                if k not in known and k not in seen:
                    first_new[i] = True
                    seen.add(k)
            np.testing.assert_array_equal(flags.astype(bool), first_new)
        assert t.size == len(model.rows)
        check_invariants(t)
    if first_error is None:
        t.check()
    else:
        with pytest.raises(HashTableFullError) as info:
            t.check()
        # a batch that found no free slot counts only the keys that claimed one: a lower bound
        if info.value.max_rows > 0 and "hash slots taken" not in str(info.value):
            assert (info.value.needed, info.value.used, info.value.max_rows) == first_error
        t.check()  # the record was cleared
    np.testing.assert_array_equal(host(t.keys_by_row()), np.array(list(model.rows), dtype=np.uint64))


def test_deferred_insert_records_a_reserved_key_and_reads_nothing():
    from numbactr.kernels import launch
    from tests.kernel_util import dev

    t = kernel_table(10)
    launch.reset_counts()
    rows, flags, _ = t.insert_deferred(dev(np.array([5, 2**64 - 1, 6, 5], np.uint64)))
    assert launch.reset_counts()["host_reads"] == 0
    np.testing.assert_array_equal(host(rows), [0, -1, 1, 0])
    np.testing.assert_array_equal(host(flags), [1, 0, 1, 0])
    assert t.size == 2  # one read of the device counter
    with pytest.raises(ValueError, match=r"position 1 of a batch is reserved"):
        t.check()
    t.check()
    # the eager insert continues from the device's count
    np.testing.assert_array_equal(host(t.insert(np.array([7, 5], np.uint64))), [2, 0])
    rows, _, _ = t.insert_deferred(dev(np.array([8, 7], np.uint64)))
    np.testing.assert_array_equal(host(rows), [3, 2])
    assert len(t) == 4
    check_invariants(t)
