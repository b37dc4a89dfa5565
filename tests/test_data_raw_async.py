"""HugeCTR's RawAsync reader and AsyncParam (numbactr.data.raw_async): batches equal to the Raw reader's
(one-hot) or to the layout decoded by hand (multi-hot), HugeCTR's batch shuffle, rank split, direct I/O and
its fallback, clear errors, and training on RawAsync data exactly as on Raw data (in process and under
mpiexec)."""

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import numbactr as hugectr
from numbactr import hugectr_exact as compat
from numbactr.data import DataFormatError
from numbactr.data.errors import DataWarning
from numbactr.data.raw import write_raw_file
from numbactr.data.raw_async import AsyncParam, RawAsyncFile, raw_async_stride, write_raw_async_file
from numbactr.data.reader import DataReader
from numbactr.enums import Alignment_t, DataReaderType_t as T

ONE_HOT = dict(multi_hot_reader=False, is_dense_float=False)


def one_hot(threads=2, per_thread=2, shuffle=False):
    return AsyncParam(threads, per_thread, 4 * per_thread + 2, 2, 512, shuffle, Alignment_t.Non, **ONE_HOT)


def raw_reader(path, n, B, L, D, S, i64=False, repeat=False, rank=0, ranks=1, W=2):
    return DataReader(T.Raw, path, B, L, D, [S], None, i64, repeat, rank, ranks, num_workers=W, num_samples=n)


def async_reader(path, B, L, D, S, ap, nnz=None, i64=False, repeat=False, rank=0, ranks=1, **kw):
    return DataReader(
        T.RawAsync, path, B, L, D, [S], None if nnz is None else [nnz], i64, repeat, rank, ranks, async_param=ap, **kw
    )


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert (x.size, x.global_size, x.batch_size) == (y.size, y.global_size, y.batch_size)
        np.testing.assert_array_equal(x.label, y.label)
        np.testing.assert_array_equal(x.dense, y.dense)
        assert len(x.sparse) == len(y.sparse)
        for (k1, o1), (k2, o2) in zip(x.sparse, y.sparse):
            assert k1.dtype == k2.dtype
            np.testing.assert_array_equal(k1, k2)
            np.testing.assert_array_equal(o1, o2)


def random_raw(path, n, L, D, S, seed=0):
    rng = np.random.default_rng(seed)
    write_raw_file(
        path, rng.integers(0, 2, (n, L)), rng.integers(0, 10**6, (n, D)), rng.integers(-(2**31), 2**31, (n, S))
    )


# --- AsyncParam ---------------------------------------------------------------------------------------


def test_async_param_arguments_defaults_and_errors():
    a = hugectr.AsyncParam(32, 4, 10, 2, 512, True, hugectr.Alignment_t.Non, False, False)  # HugeCTR's docs
    assert (
        a.num_threads,
        a.num_batches_per_thread,
        a.max_num_requests_per_thread,
        a.io_depth,
        a.io_alignment,
        a.shuffle,
        a.aligned_type,
        a.multi_hot_reader,
        a.is_dense_float,
    ) == (32, 4, 10, 2, 512, True, Alignment_t.Non, False, False)
    b = hugectr.AsyncParam(
        num_threads=1, num_batches_per_thread=16, shuffle=False, multi_hot_reader=True, is_dense_float=True
    )
    assert (b.max_num_requests_per_thread, b.io_depth, b.io_alignment, b.aligned_type) == (0, 0, 0, Alignment_t.Non)
    assert hugectr.AsyncParam(1, 2, shuffle=False).multi_hot_reader is True  # pybind defaults
    assert hugectr.Alignment_t is Alignment_t and hugectr.Auto is Alignment_t.Auto
    with pytest.raises(TypeError, match="shuffle is required"):
        AsyncParam(1, 2)
    for kw, msg in [
        (dict(num_threads=0), "num_threads must be an integer >= 1"),
        (dict(num_batches_per_thread=1.5), "num_batches_per_thread"),
        (dict(io_alignment=500), "power of two"),
        (dict(io_depth=-1), "io_depth"),
        (dict(shuffle=1), "shuffle must be True or False"),
        (dict(aligned_type="Auto"), "aligned_type"),
    ]:
        args = dict(num_threads=2, num_batches_per_thread=2, shuffle=False) | kw
        with pytest.raises(ValueError, match=msg):
            AsyncParam(**args)
    with pytest.raises(ValueError, match="async_param must be a hugectr.AsyncParam"):
        hugectr.DataReaderParams(
            data_reader_type=T.RawAsync,
            source=["x"],
            eval_source="y",
            check_type=hugectr.Check_t.Non,
            async_param=(16, 4),
        )


# --- one-hot: the Raw reader's batches ----------------------------------------------------------------


@pytest.mark.parametrize(
    "n,B,L,D,S,threads,i64",
    [(103, 10, 1, 3, 4, 3, False), (64, 16, 2, 13, 26, 1, True), (7, 8, 1, 0, 1, 4, False), (50, 7, 3, 2, 5, 8, True)],
)
def test_one_hot_batches_equal_the_raw_readers(tmp_path, n, B, L, D, S, threads, i64):
    p = str(tmp_path / "d.bin")
    random_raw(p, n, L, D, S)
    ap = one_hot(threads)
    for R in (1, 2):
        if B % R:
            continue
        for r in range(R):
            want = list(raw_reader(p, n, B, L, D, S, i64, rank=r, ranks=R))
            got = list(async_reader(p, B, L, D, S, ap, i64=i64, rank=r, ranks=R))
            assert_same_batches(got, want)
            assert got[-1].global_size == n - (len(got) - 1) * B  # the partial last batch
    # repeat mode: the same stream, pass after pass, the partial batch each time
    want = raw_reader(p, n, B, L, D, S, i64, repeat=True)
    got = async_reader(p, B, L, D, S, ap, i64=i64, repeat=True)
    k = 3 * -(-n // B) + 1
    assert_same_batches([b for _, b in zip(range(k), got)], [b for _, b in zip(range(k), want)])
    want.close(), got.close()


def test_multi_hot_reader_with_hotness_one_reads_the_raw_layout(tmp_path):
    p = str(tmp_path / "d.bin")
    random_raw(p, 40, 1, 3, 4, seed=1)
    ap = AsyncParam(2, 3, shuffle=False, is_dense_float=False)  # multi-hot, int dense, 32-bit keys
    assert_same_batches(list(async_reader(p, 16, 1, 3, 4, ap, nnz=[1] * 4)), list(raw_reader(p, 40, 16, 1, 3, 4)))


# --- multi-hot layout ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dense_float,i64,threads", [(True, False, 1), (True, True, 3), (False, True, 2), (False, False, 5)]
)
def test_multi_hot_layout_decoded_by_hand(tmp_path, dense_float, i64, threads):
    rng = np.random.default_rng(3)
    n, B, L, D, nnz = 37, 8, 2, 3, [2, 1, 3]
    K = sum(nnz)
    label = rng.integers(0, 2, (n, L))
    dense = rng.normal(0, 5, (n, D)).astype(np.float32) if dense_float else rng.integers(0, 1000, (n, D))
    keys = rng.integers(-(2**40), 2**40, (n, K)) if i64 else rng.integers(0, 2**32, (n, K))
    p = str(tmp_path / "m.bin")
    write_raw_async_file(p, label, dense, keys, dense_float, wide_keys=i64)
    assert os.path.getsize(p) == n * raw_async_stride(L, D, nnz, i64) == n * (4 * (L + D) + (8 if i64 else 4) * K)
    ap = AsyncParam(threads, 2, shuffle=False, is_dense_float=dense_float)
    got = list(async_reader(p, B, L, D, 3, ap, nnz=nnz, i64=i64))
    assert len(got) == 5 and [b.size for b in got] == [8, 8, 8, 8, 5]
    want_dense = dense if dense_float else np.log(dense.astype(np.float32) + np.float32(1))
    for i, b in enumerate(got):
        rows = slice(i * B, i * B + b.size)
        np.testing.assert_array_equal(b.label[: b.size], label[rows].astype(np.float32))
        np.testing.assert_array_equal(b.dense[: b.size], want_dense[rows])
        assert not b.label[b.size :].any() and not b.dense[b.size :].any()  # padding rows
        k, off = b.sparse[0]
        assert k.dtype == (np.int64 if i64 else np.uint64)
        np.testing.assert_array_equal(k, keys[rows].reshape(-1).astype(k.dtype))
        bag = np.diff(off)
        np.testing.assert_array_equal(bag[: b.size * 3], np.tile(nnz, b.size))
        assert not bag[b.size * 3 :].any() and off.shape == (B * 3 + 1,)


def test_multi_hot_reader_splits_several_sparse_inputs(tmp_path):
    """One sparse input per table (HugeCTR's DLRM-DCNv2 scripts): a sample's keys are the inputs' slots in order."""
    rng = np.random.default_rng(4)
    n, B, L, D = 21, 8, 1, 2
    nnz_in = [[2, 1], [3], [1, 1]]  # three inputs: 2, 1 and 2 slots
    flat = [v for per in nnz_in for v in per]
    keys = rng.integers(0, 1000, (n, sum(flat)))
    p = str(tmp_path / "m.bin")
    write_raw_async_file(p, rng.integers(0, 2, (n, L)), rng.normal(0, 1, (n, D)).astype(np.float32), keys, True)
    r = DataReader(
        T.RawAsync,
        p,
        B,
        L,
        D,
        [2, 1, 2],
        nnz_in,
        False,
        False,
        async_param=AsyncParam(2, 2, shuffle=False, is_dense_float=True),
    )
    got = list(r)
    assert [b.size for b in got] == [8, 8, 5]
    cols = np.cumsum([0] + [sum(per) for per in nnz_in])
    for i, b in enumerate(got):
        rows = keys[i * B : i * B + b.size]
        for j, per in enumerate(nnz_in):
            k, off = b.sparse[j]
            np.testing.assert_array_equal(k, rows[:, cols[j] : cols[j + 1]].reshape(-1).astype(k.dtype))
            np.testing.assert_array_equal(np.diff(off)[: b.size * len(per)], np.tile(per, b.size))


# --- shuffle ------------------------------------------------------------------------------------------


def test_shuffle_permutes_whole_batches_once_and_every_rank_agrees(tmp_path):
    n, B = 90, 8  # 12 batches, the last one of 2 samples
    p = str(tmp_path / "d.bin")
    ids = np.arange(n)
    write_raw_file(p, ids[:, None] % 2, ids[:, None], ids[:, None] * 3)
    nb = -(-n // B)

    def first_rows(reader, k):
        return [(int(np.expm1(b.dense[0, 0]).round()), b.global_size) for _, b in zip(range(k), reader)]

    ap = one_hot(3, shuffle=True)
    got = list(async_reader(p, B, 1, 1, 1, ap, seed=7))
    starts = [s for s, _ in first_rows(iter(got), nb)]
    assert sorted(starts) == list(range(0, n, B)) and starts != sorted(starts)  # a permutation of batches
    for b, s in zip(got, starts):  # consecutive inside
        np.testing.assert_array_equal(np.expm1(b.dense[: b.size, 0]).round(), np.arange(s, s + b.size))
        assert b.size == min(B, n - s)
    rep = async_reader(p, B, 1, 1, 1, ap, seed=7, repeat=True)
    assert [s for s, _ in first_rows(rep, 3 * nb)] == starts * 3  # the same every pass
    rep.close()
    assert [s for s, _ in first_rows(iter(async_reader(p, B, 1, 1, 1, ap, seed=8)), nb)] != starts
    plain = [s for s, _ in first_rows(iter(async_reader(p, B, 1, 1, 1, ap, seed=7, shuffle=False)), nb)]
    assert plain == list(range(0, n, B))  # the eval reader's order
    # two ranks: each gets its half of the same shuffled batch
    for r in range(2):
        half = list(async_reader(p, B, 1, 1, 1, ap, seed=7, rank=r, ranks=2))
        for b, s in zip(half, starts):
            lo = s + r * B // 2
            assert b.global_size == min(B, n - s)
            np.testing.assert_array_equal(np.expm1(b.dense[: b.size, 0]).round(), np.arange(lo, lo + b.size))


# --- I/O paths ----------------------------------------------------------------------------------------


def test_direct_io_and_its_fallback_read_the_same_bytes(tmp_path, monkeypatch):
    p = str(tmp_path / "d.bin")
    random_raw(p, 300, 1, 13, 26, seed=4)  # 160-byte samples: reads straddle 4096-byte blocks
    ref = RawAsyncFile(p, 1, 13, [1] * 26, False, False, False, direct_io=False)
    want = [ref.rows(a, b) for a, b in [(0, 1), (5, 40), (25, 26), (100, 300), (299, 300)]]
    direct = RawAsyncFile(p, 1, 13, [1] * 26, False, False, False, io_alignment=512, direct_io=True)
    for (a, b), w in zip([(0, 1), (5, 40), (25, 26), (100, 300), (299, 300)], want):
        for x, y in zip(direct.rows(a, b), w):
            np.testing.assert_array_equal(x, y)
    # a filesystem that accepts O_DIRECT at open but refuses the read (EINVAL): buffered reads from then on
    real = os.preadv
    calls = []

    def refuse_once(fd, bufs, off):
        calls.append(off)
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, off)

    f = RawAsyncFile(p, 1, 13, [1] * 26, False, False, False, direct_io=True)
    f.direct = True
    monkeypatch.setattr(os, "preadv", refuse_once)
    for x, y in zip(f.rows(5, 40), want[1]):
        np.testing.assert_array_equal(x, y)
    assert not f.direct and calls == [0, 5 * 160]
    for rf in (ref, direct, f):
        rf.close()
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):  # tmpfs: O_DIRECT refused at open on many kernels
        q = os.path.join(shm, f"numbactr-raw-async-{os.getpid()}.bin")
        shutil.copy(p, q)
        try:
            t = RawAsyncFile(q, 1, 13, [1] * 26, False, False, False, direct_io=True)
            for x, y in zip(t.rows(100, 300), want[3]):
                np.testing.assert_array_equal(x, y)
            t.close()
        finally:
            os.remove(q)


# --- errors -------------------------------------------------------------------------------------------


def test_errors_name_the_file_and_the_byte_offset(tmp_path):
    p = str(tmp_path / "d.bin")
    random_raw(p, 10, 1, 2, 3)  # 24-byte samples
    with open(p, "ab") as f:
        f.write(b"\0" * 5)
    with pytest.raises(
        DataFormatError,
        match=r"RawAsync file .*d\.bin', byte offset 240, record 10: file length "
        r"245 is not a whole",
    ):
        async_reader(p, 4, 1, 2, 3, one_hot())
    e = str(tmp_path / "empty.bin")
    open(e, "wb").close()
    with pytest.raises(DataFormatError, match="byte offset 0.*not a whole, non-zero number"):
        async_reader(e, 4, 1, 2, 3, one_hot())
    with pytest.raises(DataFormatError, match="cannot be read"):
        async_reader(str(tmp_path / "missing.bin"), 4, 1, 2, 3, one_hot())
    random_raw(p, 10, 1, 2, 3)
    with pytest.warns(DataWarning, match="holds 10 samples but num_samples is 12: RawAsync reads the whole file"):
        async_reader(p, 4, 1, 2, 3, one_hot(), num_samples=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        async_reader(p, 4, 1, 2, 3, one_hot(), num_samples=10)  # agreeing: no warning
    # HugeCTR's rules (add_input.cpp)
    with pytest.raises(ValueError, match=r"multi_hot_reader=False\) reads exactly one sparse input"):
        DataReader(T.RawAsync, p, 4, 1, 2, [2, 1], None, False, False, async_param=one_hot())
    with pytest.raises(ValueError, match="set is_dense_float=False"):
        async_reader(p, 4, 1, 2, 3, AsyncParam(2, 2, 10, 2, 512, False, multi_hot_reader=False))
    with pytest.raises(ValueError, match=r"max_num_requests_per_thread \(4\) must exceed 2 \* num_batches_per_thread"):
        async_reader(p, 4, 1, 2, 3, AsyncParam(2, 2, 4, 2, 512, False, **ONE_HOT))
    with pytest.raises(ValueError, match="hotness >= 1 for each of the 3 slots"):
        async_reader(p, 4, 1, 2, 3, AsyncParam(2, 2, shuffle=False), nnz=[1, 0, 2])
    before = compat.hugectr_exact()
    compat.set_hugectr_exact(True)
    try:
        with pytest.raises(ValueError, match="Epoch mode cannot be used with the one-hot RawAsync"):
            async_reader(p, 4, 1, 2, 3, one_hot(), repeat=False)
    finally:
        compat.set_hugectr_exact(before)
    # a file cut short while a pass reads it
    random_raw(p, 100, 1, 2, 3)
    r = async_reader(p, 8, 1, 2, 3, one_hot(1, 1))
    os.truncate(p, 50 * 24)
    with pytest.raises(DataFormatError, match=r"byte offset 1200, record 50: file ends at byte 1200"):
        list(r)
    # a bad value is reported at its byte offset, as the Raw reader does
    write_raw_file(p, [[0], [1], [1]], [[0, 1], [2, -3], [0, 0]], [[1, 2, 3]] * 3)
    with pytest.raises(DataFormatError, match=r"RawAsync file .* byte offset 32, record 1.*dense"):
        list(async_reader(p, 4, 1, 2, 3, one_hot()))


# --- training -----------------------------------------------------------------------------------------

SLOTS = [5, 7, 3, 4]


def planted_raw(folder, n, seed):
    """Labels from a known rule over one key per slot and the (log1p) dense counts; per-slot keys, as HugeCTR's
    tools write Raw one-hot data (the one-hot embedding adds the slot offsets)."""
    rng = np.random.default_rng(seed)
    keys = np.stack([rng.integers(0, s, n) for s in SLOTS], 1)
    w = [np.linspace(-2, 2, s) for s in SLOTS]
    dense = rng.integers(0, 50, (n, 2))
    logit = sum(w[k][keys[:, k]] for k in range(len(SLOTS))) + 0.5 * np.log1p(dense[:, 0]) - 1
    label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    p = os.path.join(folder, f"data{seed}.bin")
    write_raw_file(p, label[:, None], dense, keys)
    return p


def build(kind, train, evl, n_train, n_eval, repeat, ap=None, batch=32):
    solver = hugectr.CreateSolver(
        batchsize=batch,
        batchsize_eval=batch,
        max_eval_batches=100,
        lr=0.05,
        vvgpu=[[0]],
        repeat_dataset=repeat,
        i64_input_key=False,
        seed=3,
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=kind,
        source=[train],
        eval_source=evl,
        check_type=hugectr.Check_t.Non,
        num_samples=n_train,
        eval_num_samples=n_eval,
        async_param=ap,
    )
    opt = hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.Adam)
    model = hugectr.Model(solver, reader, opt)
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, len(SLOTS))],
        )
    )
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.LocalizedSlotSparseEmbeddingOneHot,
            slot_size_array=SLOTS,
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=4,
            combiner="sum",
            sparse_embedding_name="emb",
            bottom_name="data1",
        )
    )
    L = hugectr.Layer_t
    model.add(hugectr.DenseLayer(L.Reshape, ["emb"], ["flat"], leading_dim=4 * len(SLOTS)))
    model.add(hugectr.DenseLayer(L.Concat, ["flat", "dense"], ["cat"]))
    model.add(hugectr.DenseLayer(L.InnerProduct, ["cat"], ["fc1"], num_output=8))
    model.add(hugectr.DenseLayer(L.ReLU, ["fc1"], ["relu1"]))
    model.add(hugectr.DenseLayer(L.InnerProduct, ["relu1"], ["fc2"], num_output=1))
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc2", "label"], ["loss"]))
    model.compile()
    return model


@pytest.mark.parametrize("repeat", [True, False])
def test_fit_on_raw_async_equals_fit_on_raw(cpu, tmp_path, repeat):
    train, evl = planted_raw(str(tmp_path), 200, 0), planted_raw(str(tmp_path), 70, 1)
    runs = {}
    for kind, ap in [
        (T.Raw, None),
        (T.RawAsync, one_hot(3)),
        (T.RawAsync, AsyncParam(2, 4, shuffle=False, is_dense_float=False)),
    ]:
        m = build(kind, train, evl, 200, 70, repeat, ap)
        if repeat:
            m.fit(max_iter=20, display=1, eval_interval=10, snapshot=0)  # wraps the 7-batch file
        else:
            m.fit(num_epochs=2, display=1, eval_interval=5, snapshot=0)
        runs[(kind, id(ap))] = (m.history["loss"], m.history["auc"])
    (raw_loss, raw_auc), *others = runs.values()
    # epoch mode: 6 full batches per epoch (drop_incomplete_batch skips the partial 7th)
    assert len(raw_loss) == (20 if repeat else 12) and len(raw_auc) >= 2
    for loss, auc in others:
        assert loss == raw_loss and auc == raw_auc  # the same batches, so the same numbers


def test_shuffle_changes_the_training_order_not_the_batch_count(cpu, tmp_path):
    train, evl = planted_raw(str(tmp_path), 200, 0), planted_raw(str(tmp_path), 70, 1)
    m = build(T.RawAsync, train, evl, 200, 70, False, one_hot(2, shuffle=True))
    m.fit(num_epochs=1, display=1, eval_interval=0, snapshot=0)
    assert len(m.history["loss"]) == 6  # the partial batch is dropped
    plain = build(T.Raw, train, evl, 200, 70, False)
    plain.fit(num_epochs=1, display=1, eval_interval=0, snapshot=0)
    assert m.history["loss"] != plain.history["loss"]  # another batch order trains otherwise


def test_multi_hot_fit_equals_the_same_samples_in_norm(cpu, tmp_path):
    """Multi-hot RawAsync (float dense, 64-bit keys, hotness [2, 1, 3]) trains exactly as Norm holding the
    same samples (the embedding-collection-style reader of HugeCTR's dlrm train.py, on a hash embedding)."""
    from numbactr.data.file_list import write_file_list
    from numbactr.data.norm import NormWriter

    rng = np.random.default_rng(5)
    nnz = [2, 1, 3]
    paths = {}
    for name, n in (("train", 160), ("eval", 64)):
        label = rng.integers(0, 2, (n, 1))
        dense = rng.normal(size=(n, 2)).astype(np.float32)
        keys = rng.integers(0, 40, (n, sum(nnz))) + np.repeat(np.arange(3) * 40, nnz)
        raw = str(tmp_path / f"{name}.bin")
        write_raw_async_file(raw, label, dense, keys, True, wide_keys=True)
        norm = str(tmp_path / f"{name}.data")
        cuts = np.cumsum([0] + nnz)
        with NormWriter(norm, 1, 2, 3, key_dtype=np.int64) as w:
            w.write(
                label.astype(np.float32),
                dense,
                [(keys[:, cuts[k] : cuts[k + 1]].reshape(-1), np.full(n, nnz[k])) for k in range(3)],
            )
        write_file_list(str(tmp_path / f"{name}.txt"), [norm])
        paths[name] = (raw, str(tmp_path / f"{name}.txt"))
    losses = []
    for kind in (T.Norm, T.RawAsync):
        pick = 0 if kind == T.RawAsync else 1
        solver = hugectr.CreateSolver(
            batchsize=32, batchsize_eval=32, max_eval_batches=2, lr=0.05, vvgpu=[[0]], i64_input_key=True, seed=1
        )
        reader = hugectr.DataReaderParams(
            data_reader_type=kind,
            source=[paths["train"][pick]],
            eval_source=paths["eval"][pick],
            check_type=hugectr.Check_t.Sum,
            num_workers=1,
            async_param=AsyncParam(2, 2, shuffle=False) if kind == T.RawAsync else None,
        )
        model = hugectr.Model(solver, reader, hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.Adam))
        model.add(
            hugectr.Input(
                label_dim=1,
                label_name="label",
                dense_dim=2,
                dense_name="dense",
                data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", nnz, True, 3)],
            )
        )
        model.add(
            hugectr.SparseEmbedding(hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, 4, "sum", "emb", "data1")
        )
        L = hugectr.Layer_t
        model.add(hugectr.DenseLayer(L.Reshape, ["emb"], ["flat"], leading_dim=12))
        model.add(hugectr.DenseLayer(L.Concat, ["flat", "dense"], ["cat"]))
        model.add(hugectr.DenseLayer(L.InnerProduct, ["cat"], ["fc1"], num_output=1))
        model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc1", "label"], ["loss"]))
        model.compile()
        model.fit(max_iter=8, display=1, eval_interval=8, snapshot=0)
        losses.append((model.history["loss"], model.history["auc"]))
    assert losses[0] == losses[1] and len(losses[0][0]) == 8


def test_dgx_a100_shaped_script(cpu, tmp_path):
    # --- samples/dlrm/dgx_a100.py (HugeCTR v23.08): the reader as written there, sizes reduced; its
    # HybridSparseEmbedding replaced by LocalizedSlotSparseEmbeddingOneHot, its fp16 FusedInnerProduct by
    # InnerProduct (neither is this test's subject) ---
    train, evl = planted_raw(str(tmp_path), 256, 0), planted_raw(str(tmp_path), 96, 1)
    batchsize = 32
    num_reading_threads = 4
    num_batches_per_threads = 4
    expected_io_block_size = batchsize * 10
    io_depth = 2
    io_alignment = 512
    bytes_size_per_batches = (len(SLOTS) + 1 + 2) * 4 * batchsize
    max_nr_per_threads = num_batches_per_threads * (bytes_size_per_batches // expected_io_block_size + 2)
    solver = hugectr.CreateSolver(
        max_eval_batches=3,
        batchsize_eval=batchsize,
        batchsize=batchsize,
        vvgpu=[[0]],
        repeat_dataset=True,
        lr=0.5,
        warmup_steps=2,
        i64_input_key=False,
        metrics_spec={hugectr.MetricsType.AUC: 0.8025},
        drop_incomplete_batch=False,
    )
    with pytest.warns(hugectr.IgnoredArgumentWarning, match="slot_size_array"):
        reader = hugectr.DataReaderParams(
            data_reader_type=hugectr.DataReaderType_t.RawAsync,
            source=[train],
            eval_source=evl,
            check_type=hugectr.Check_t.Non,
            num_samples=256,
            eval_num_samples=96,
            slot_size_array=SLOTS,
            async_param=hugectr.AsyncParam(
                num_reading_threads,
                num_batches_per_threads,
                max_nr_per_threads,
                io_depth,
                io_alignment,
                True,
                hugectr.Alignment_t.Auto,
                multi_hot_reader=False,
                is_dense_float=False,
            ),
        )
    optimizer = hugectr.CreateOptimizer(
        optimizer_type=hugectr.Optimizer_t.SGD, update_type=hugectr.Update_t.Local, atomic_update=True
    )
    model = hugectr.Model(solver, reader, optimizer)
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, len(SLOTS))],
        )
    )
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.LocalizedSlotSparseEmbeddingOneHot,
            workspace_size_per_gpu_in_mb=1,
            slot_size_array=SLOTS,
            embedding_vec_size=8,
            combiner="sum",
            sparse_embedding_name="sparse_embedding1",
            bottom_name="data1",
            optimizer=optimizer,
        )
    )
    L = hugectr.Layer_t
    model.add(hugectr.DenseLayer(layer_type=L.InnerProduct, bottom_names=["dense"], top_names=["fc1"], num_output=8))
    model.add(hugectr.DenseLayer(layer_type=L.ReLU, bottom_names=["fc1"], top_names=["relu1"]))
    model.add(
        hugectr.DenseLayer(
            layer_type=L.Interaction, bottom_names=["relu1", "sparse_embedding1"], top_names=["interaction1"]
        )
    )
    model.add(
        hugectr.DenseLayer(layer_type=L.InnerProduct, bottom_names=["interaction1"], top_names=["fc4"], num_output=1)
    )
    model.add(
        hugectr.DenseLayer(layer_type=L.BinaryCrossEntropyLoss, bottom_names=["fc4", "label"], top_names=["loss"])
    )
    model.compile()
    model.summary()
    model.fit(max_iter=16, display=8, eval_interval=8, snapshot=0)
    assert len(model.history["loss"]) == 2 and len(model.history["auc"]) == 2
    assert all(np.isfinite(model.history["loss"]))


MPI_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, ROOT)
    import numpy as np
    from tests.test_data_raw_async import build, one_hot
    from numbactr.enums import DataReaderType_t as T
    from numbactr.distributed.comm import world
    kind = T.RawAsync if sys.argv[3] == "async" else T.Raw
    m = build(kind, sys.argv[1], sys.argv[2], 200, 70, True, one_hot(2) if kind == T.RawAsync else None)
    m.fit(max_iter=9, display=1, eval_interval=9, snapshot=0)
    if world().rank == 0:
        print("LOSSES", " ".join(f"{v:.9g}" for v in m.history["loss"]), "AUC", f"{m.history['auc'][-1]:.9g}")
""")


def test_two_ranks_split_raw_async_batches_as_raw(tmp_path):
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if mpiexec is None:
        pytest.skip("mpiexec not found (pip install 'numbactr[mpi]')")
    train, evl = planted_raw(str(tmp_path), 200, 0), planted_raw(str(tmp_path), 70, 1)
    script = tmp_path / "run.py"
    script.write_text(MPI_SCRIPT.replace("ROOT", repr(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    out = {}
    for kind in ("raw", "async"):
        r = subprocess.run(
            [mpiexec, "-n", "2", sys.executable, str(script), train, evl, kind],
            env=env,
            cwd=str(tmp_path),
            capture_output=True,
            text=True,
            timeout=240,
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        out[kind] = r.stdout.split("LOSSES", 1)[1].strip()
    assert out["async"] == out["raw"] and len(out["raw"].split("AUC")[0].split()) == 9
