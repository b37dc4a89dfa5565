"""numbactr.data.make_reader: HugeCTR's sample order with W workers, repeat / epoch mode, the per-rank
split, set_source, close, prefetch, and bad data found by the reader (non-finite values, key bounds)."""

import gc
import os
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from numbactr.config import DataReaderParams
from numbactr.data import DataFormatError, DataReader, make_reader
from numbactr.data.errors import DataWarning
from numbactr.data.file_list import write_file_list
from numbactr.data.norm import write_norm_file
from numbactr.data.parquet import ParquetDatasetWriter
from numbactr.data.raw import write_raw_file
from numbactr.enums import Check_t, DataReaderType_t as T

SUM, NON = Check_t.Sum, Check_t.Non


def write_id_files(d, sizes, check=SUM, start=0):
    """Norm files whose sample i carries its global id in the label and in both keys (2 slots)."""
    files, gid = [], start
    os.makedirs(d, exist_ok=True)
    for f, n in enumerate(sizes):
        ids = np.arange(gid, gid + n)
        p = os.path.join(d, f"f{f}.data")
        write_norm_file(
            p,
            ids.reshape(-1, 1),
            np.stack([ids, -ids], 1).astype(np.float32),
            np.stack([ids * 2, ids * 2 + 1], 1),
            check,
            np.int64,
        )
        files.append(p)
        gid += n
    lst = os.path.join(d, "list.txt")
    write_file_list(lst, files)
    return lst


def ref_order(sizes, W, B, repeat, max_batches):
    """HugeCTR's order: worker w streams files w, w+W, ... (mod N with repeat) into B-sample batches
    (partial at its end in epoch mode); batches are taken round-robin over unfinished workers."""
    N = len(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)])

    def worker(w):
        k, buf = 0, []
        while True:
            idx = w + k * W
            if idx >= N:
                if not repeat:
                    break
                idx %= N
            k += 1
            for s in range(starts[idx], starts[idx + 1]):
                buf.append(s)
                if len(buf) == B:
                    yield buf
                    buf = []
        if buf:
            yield buf

    gens = [worker(w) for w in range(W)]
    alive = [True] * W
    out, w = [], 0
    while any(alive) and len(out) < max_batches:
        if alive[w]:
            b = next(gens[w], None)
            if b is None:
                alive[w] = False
            else:
                out.append(b)
        w = (w + 1) % W
    return out


def norm_params(lst, W, **kw):
    return DataReaderParams(T.Norm, lst, lst, SUM, num_workers=W, **kw)


def batch_ids(b):
    return b.label[: b.size, 0].astype(np.int64).tolist()


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=5),
    W=st.integers(1, 4),
    B=st.integers(1, 6),
    repeat=st.booleans(),
)
def test_sample_order_matches_hugectr(tmp_path_factory, sizes, W, B, repeat):
    if sum(sizes) == 0 and repeat:
        sizes = sizes + [3]
    W = min(W, len(sizes))
    d = str(tmp_path_factory.mktemp("order"))
    lst = write_id_files(d, sizes)
    r = make_reader(norm_params(lst, W), lst, B, 1, 2, [2], [[1, 1]], True, repeat)
    N = len(sizes)
    starved = [w for w in range(W) if all(sizes[(w + k * W) % N] == 0 for k in range(N))]
    if repeat and starved:  # HugeCTR would spin forever on a worker whose files are all empty
        with pytest.raises(ValueError, match=f"worker {starved[0]} found no samples"):
            with r:
                list(zip(range(10**4), r))
        return
    want = ref_order(sizes, W, B, repeat, 40)
    got = []
    with r:
        it = iter(r)
        for _ in range(len(want) if repeat else 10**6):
            b = next(it, None)
            if b is None:
                break
            got.append(batch_ids(b))
            assert b.batch_size == B
            keys, off = b.sparse[0]
            ids = np.array(batch_ids(b))
            np.testing.assert_array_equal(keys[: 2 * b.size], np.stack([ids * 2, ids * 2 + 1], 1).reshape(-1))
            assert (np.diff(off)[2 * b.size :] == 0).all() and off[-1] == 2 * b.size  # padding: empty bags
            assert (b.label[b.size :] == 0).all() and (b.dense[b.size :] == 0).all()
    assert got == want


def test_round_robin_with_unequal_workers(tmp_path):
    # worker 0 gets files 0, 2 (7 + 1 samples), worker 1 file 1 (2 samples); B = 3
    lst = write_id_files(str(tmp_path), [7, 2, 1])
    r = make_reader(norm_params(lst, 2), lst, 3, 1, 2, [2], None, True, False)
    assert [batch_ids(b) for b in r] == [[0, 1, 2], [7, 8], [3, 4, 5], [6, 9]]
    assert [batch_ids(b) for b in r] == [[0, 1, 2], [7, 8], [3, 4, 5], [6, 9]]  # iter() restarts


def test_more_workers_than_files_warns_and_uses_one_worker_per_file(tmp_path):
    from numbactr import hugectr_exact as compat

    lst = write_id_files(str(tmp_path), [3, 3])
    with pytest.warns(UserWarning, match=r"has 2 file\(s\) but num_workers is 3.*using 2 worker"):
        r = make_reader(norm_params(lst, 3), lst, 2, 1, 2, [2], None, True, False)
    assert r.num_workers == 2
    compat.set_hugectr_exact(True)  # HugeCTR itself refuses
    try:
        with pytest.raises(ValueError, match=r"has 2 file\(s\) but num_workers is 3"):
            make_reader(norm_params(lst, 3), lst, 2, 1, 2, [2], None, True, False)
    finally:
        compat.set_hugectr_exact(False)
    with pytest.raises(ValueError, match=r"num_workers must lie in \[1, inf\), got 0"):
        make_reader(norm_params(lst, 0), lst, 2, 1, 2, [2], None, True, False)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("W", [1, 2])
def test_rank_slices_are_the_global_batch_split(tmp_path, ranks, W):
    lst = write_id_files(str(tmp_path), [13, 6])
    B = 8
    glob = list(make_reader(norm_params(lst, W), lst, B, 1, 2, [2], None, True, False))
    for r in range(ranks):
        part = list(make_reader(norm_params(lst, W), lst, B, 1, 2, [2], None, True, False, rank=r, ranks=ranks))
        assert len(part) == len(glob)
        lo, hi = r * B // ranks, (r + 1) * B // ranks
        for g, p in zip(glob, part):
            assert p.batch_size == hi - lo
            assert p.size == max(0, min(hi - lo, g.size - lo))
            assert p.global_size == g.size == g.global_size
            np.testing.assert_array_equal(p.label, g.label[lo:hi])
            np.testing.assert_array_equal(p.dense, g.dense[lo:hi])
            gk, go = g.sparse[0]
            pk, po = p.sparse[0]
            np.testing.assert_array_equal(pk, gk[go[2 * lo] : go[2 * hi]])
            np.testing.assert_array_equal(po, go[2 * lo : 2 * hi + 1] - go[2 * lo])
    with pytest.raises(ValueError, match="divisible"):
        make_reader(norm_params(lst, 1), lst, 6, 1, 2, [2], None, True, False, rank=0, ranks=4)


def test_repeat_never_ends_and_wraps_by_file_sequence(tmp_path):
    # N = 3 files, W = 2: worker 0 reads files 0, 2, 1, 0, ... (w + k*W mod N), worker 1 reads 1, 0, 2, ...
    lst = write_id_files(str(tmp_path), [2, 2, 2])
    r = make_reader(norm_params(lst, 2), lst, 2, 1, 2, [2], None, True, True)
    it = iter(r)
    got = [batch_ids(next(it)) for _ in range(6)]
    r.close()
    assert got == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3], [4, 5]]


def test_set_source_switches_files_and_close_stops_workers(tmp_path):
    a = write_id_files(str(tmp_path / "a"), [5])
    b = write_id_files(str(tmp_path / "b"), [3], start=100)
    r = make_reader(norm_params(a, 1), a, 4, 1, 2, [2], None, True, False)
    assert [batch_ids(x) for x in r] == [[0, 1, 2, 3], [4]]
    r.set_source(b)
    assert [batch_ids(x) for x in r] == [[100, 101, 102]]
    # a repeating pass keeps workers alive until close(); close() stops them promptly
    r = make_reader(norm_params(a, 1), a, 2, 1, 2, [2], None, True, True)
    it = iter(r)
    next(it)
    alive = [wk.thread for wk in it.workers]  # this pass's workers (other tests' may still be running)
    assert alive and all(t.is_alive() and t.name.startswith("numbactr-reader") for t in alive)
    t0 = time.perf_counter()
    r.close()
    assert time.perf_counter() - t0 < 30.0  # no hang (a liveness bound, not a speed target)
    assert not any(t.is_alive() for t in alive)
    with pytest.raises(StopIteration):
        next(it)


def test_dropping_a_reader_and_its_pass_stops_the_workers(tmp_path):
    # the model's pattern: it = iter(make_reader(...)); later it = iter(make_reader(...)) again
    a = write_id_files(str(tmp_path), [50])
    it = iter(make_reader(norm_params(a, 1), a, 2, 1, 2, [2], None, True, True))
    next(it)
    threads = [wk.thread for wk in it.workers]  # this pass's workers (other tests' may still be running)
    assert threads and all(t.is_alive() for t in threads)
    it = iter(make_reader(norm_params(a, 1), a, 2, 1, 2, [2], None, True, True))
    gc.collect()
    deadline = time.time() + 3
    while any(t.is_alive() for t in threads) and time.time() < deadline:
        time.sleep(0.02)
    assert not any(t.is_alive() for t in threads)


def test_prefetch_runs_ahead_of_the_consumer(tmp_path):
    lst = write_id_files(str(tmp_path), [64])
    r = make_reader(norm_params(lst, 1), lst, 4, 1, 2, [2], None, True, False)
    p = iter(r)
    next(p)
    deadline = time.time() + 3
    while p.queues[0].qsize() < p.queues[0].maxsize and time.time() < deadline:
        time.sleep(0.01)
    assert p.queues[0].qsize() == p.queues[0].maxsize == 4  # bounded and full while we "compute"
    assert sum(1 for _ in p) == 15
    r.close()


def test_worker_error_surfaces_in_sample_order(tmp_path):
    lst = write_id_files(str(tmp_path), [4, 4])
    raw = bytearray(open(os.path.join(tmp_path, "f1.data"), "rb").read())
    raw[-1] ^= 0xFF  # bad checksum in the last record of file 1
    open(os.path.join(tmp_path, "f1.data"), "wb").write(bytes(raw))
    r = make_reader(norm_params(lst, 2), lst, 2, 1, 2, [2], None, True, False)
    it = iter(r)
    assert batch_ids(next(it)) == [0, 1]  # worker 0's batch comes first ...
    # ... then worker 1's, whose file is decoded (and checked) a piece at a time: the error surfaces at
    # the first batch taken from the damaged piece
    with pytest.raises(DataFormatError, match=r"f1\.data.*record 3: bad checksum"):
        next(it)
    # with skip_bad_checksum the record is skipped and counted (HugeCTR skips it)
    r = make_reader(norm_params(lst, 1), lst, 8, 1, 2, [2], None, True, False, skip_bad_checksum=True)
    with pytest.warns(RuntimeWarning, match="skipped 1 sample"):
        assert [batch_ids(b) for b in r] == [[0, 1, 2, 3, 4, 5, 6]]
    assert r.skipped == 1


@pytest.mark.parametrize("check", [SUM, NON])
def test_non_finite_dense_is_an_error_naming_record_and_offset(tmp_path, check):
    d = np.zeros((6, 2), np.float32)
    d[4, 1] = np.nan
    p = str(tmp_path / "x.data")
    write_norm_file(p, np.zeros((6, 1)), d, np.arange(12).reshape(6, 2), check, np.int64)
    lst = str(tmp_path / "l.txt")
    write_file_list(lst, [p])
    r = make_reader(DataReaderParams(T.Norm, lst, lst, check, num_workers=1), lst, 4, 1, 2, [2], None, True, False)
    with pytest.raises(DataFormatError, match="non-finite dense") as e:
        list(r)
    rec = 4 + 4 + 4 + 2 * (4 + 8) + (5 if check is SUM else 0)  # bytes per record
    head = 69 if check is SUM else 64
    assert e.value.record == 4 and e.value.path == p
    assert e.value.offset == head + 4 * rec + (4 if check is SUM else 0) + 4 * (1 + 1)
    got = np.frombuffer(open(p, "rb").read()[e.value.offset : e.value.offset + 4], "<f4")[0]
    assert np.isnan(got)


def test_key_bound_for_one_hot_tables(tmp_path):
    lst = write_id_files(str(tmp_path), [5])  # keys 0..9
    r = make_reader(norm_params(lst, 1), lst, 5, 1, 2, [2], None, True, False, key_bound=10)
    assert sum(b.size for b in r) == 5
    r = make_reader(norm_params(lst, 1), lst, 5, 1, 2, [2], None, True, False, key_bound=9)
    with pytest.raises(
        DataFormatError,
        match=r"record 4.*key 9 of sparse input 0 slot 1 is outside the "
        r"table \[0, 9\)",
    ):
        list(r)


def test_reader_constructor_errors(tmp_path):
    lst = write_id_files(str(tmp_path), [3])
    with pytest.raises(ValueError, match="batch_size"):
        make_reader(norm_params(lst, 1), lst, 0, 1, 2, [2], None, True, False)
    with pytest.raises(ValueError, match="nnz_per_slot"):
        make_reader(norm_params(lst, 1), lst, 2, 1, 2, [2], [[1]], True, False)
    with pytest.raises(ValueError, match="cannot be read"):
        make_reader(norm_params(lst, 1), str(tmp_path / "missing.txt"), 2, 1, 2, [2], None, True, False)
    with pytest.raises(DataFormatError, match="RawAsync file .*list.txt.*not a whole"):  # a Raw file, not a list
        make_reader(DataReaderParams(T.RawAsync, lst, lst, SUM), lst, 2, 1, 2, [2], None, True, False)
    with pytest.raises(DataFormatError, match="slot_num=2 but the reader"):
        list(make_reader(norm_params(lst, 1), lst, 2, 1, 2, [3], None, True, False))


def test_parquet_uses_one_worker_per_local_device(tmp_path):
    w = ParquetDatasetWriter(str(tmp_path), 1, 1, 1)
    for f in range(3):
        w.write_file(f"p{f}.parquet", np.arange(4) + 10 * f, np.zeros(4), [np.arange(4)])
    lst = w.close()
    p = DataReaderParams(T.Parquet, lst, lst, NON, num_workers=12)
    assert make_reader(p, lst, 2, 1, 1, [1], None, True, False).num_workers == 1
    assert make_reader(p, lst, 2, 1, 1, [1], None, True, False, local_devices=8).num_workers == 3
    p.read_file_sequentially = True
    assert make_reader(p, lst, 2, 1, 1, [1], None, True, False, local_devices=8).num_workers == 8
    r = make_reader(p, lst, 3, 1, 1, [1], None, True, False, local_devices=2)
    assert r.num_workers == 2
    # worker 0: files 0, 2; worker 1: file 1 -> round robin
    assert [b.label[: b.size, 0].tolist() for b in r] == [[0, 1, 2], [10, 11, 12], [3, 20, 21], [13], [22, 23]]


def test_raw_through_make_reader_uses_eval_num_samples(tmp_path):
    p = str(tmp_path / "r.bin")
    write_raw_file(p, np.arange(10).reshape(-1, 1), np.zeros((10, 1)), np.arange(10).reshape(-1, 1), False)
    prm = DataReaderParams(T.Raw, p, p, NON, num_samples=10, eval_num_samples=7, num_workers=3)
    assert sum(b.size for b in make_reader(prm, p, 4, 1, 1, [1], None, False, False)) == 10
    with pytest.warns(DataWarning, match="holds 10 samples but num_samples is 7: the last 3 are never read"):
        assert sum(b.size for b in make_reader(prm, p, 4, 1, 1, [1], None, False, False, eval=True)) == 7
    assert isinstance(make_reader(prm, p, 4, 1, 1, [1], None, False, False), DataReader)
