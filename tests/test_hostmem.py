"""numbactr.runtime.hostmem: host tables in 2 MiB-aligned huge pages, and the engine's results not depending on it."""

import os

import numpy as np
import pytest

from numbactr.runtime import hostmem
from numbactr.embedding.engine import impl_cpu as engine_cpu
from numbactr.embedding.engine import Optim, OptimizerSpec, Pooling, TableBatchedEmbedding


@pytest.mark.parametrize("dtype", [np.float32, np.uint16, np.int64, np.uint64])
def test_big_buffer_is_zeroed_aligned_and_writable(dtype):
    n = (hostmem.HUGE_MIN_BYTES // np.dtype(dtype).itemsize) + 3
    a = hostmem.host_zeros(n, dtype, huge=True)
    assert a.shape == (n,) and a.dtype == np.dtype(dtype) and a.flags.writeable and a.flags.c_contiguous
    assert a.ctypes.data % hostmem.HUGE_PAGE == 0
    assert not a.any()
    a[-1] = 5
    assert a[-1] == 5 and a.sum() == 5


def test_small_buffer_and_switched_off(monkeypatch):
    small = hostmem.host_zeros(10, np.float32, huge=True)
    assert small.shape == (10,) and not small.any()
    monkeypatch.setenv(hostmem.ENV, "0")
    assert not hostmem.huge_pages_wanted()
    big = hostmem.host_zeros(hostmem.HUGE_MIN_BYTES, np.uint8)
    assert big.shape == (hostmem.HUGE_MIN_BYTES,) and not big.any()
    assert hostmem.host_zeros(0, np.int64).shape == (0,)
    full = hostmem.host_full(7, -1, np.int64)
    assert (full == -1).all()


def test_bad_switch_value_is_an_error(monkeypatch):
    monkeypatch.setenv(hostmem.ENV, "yes")
    with pytest.raises(ValueError, match="NUMBACTR_HUGE_PAGES must be 0 or 1, got 'yes'"):
        hostmem.host_zeros(1, np.float32)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("huge", [True, False])
def test_a_forked_child_writes_its_own_copy(huge):
    """The mapping is private: a child process writing the table leaves the parent's table alone."""
    a = hostmem.host_zeros(hostmem.HUGE_MIN_BYTES // 4, np.float32, huge=huge)
    a[:3] = 1.0
    pid = os.fork()
    if pid == 0:  # the child: write, then leave without cleanup
        a[:] = 9.0
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert a[:3].tolist() == [1.0, 1.0, 1.0] and a[3:].max() == 0.0


def test_huge_page_bytes_reports_within_the_array():
    a = hostmem.host_zeros(hostmem.HUGE_MIN_BYTES // 4, np.float32, huge=True)
    a[:] = 1.0
    got = hostmem.huge_page_bytes(a)
    assert 0 <= got <= a.nbytes + hostmem.HUGE_PAGE  # what the kernel granted; 0 where THP is off


@pytest.mark.parametrize("pooling", [Pooling.SUM, Pooling.MEAN, Pooling.NONE])
@pytest.mark.parametrize("psw", [False, True])
def test_engine_bits_do_not_depend_on_huge_pages(monkeypatch, pooling, psw):
    """The backward's copy of dy into huge pages (taken from 4 MiB up; forced here for a small batch) and
    the huge-page tables give the same forward output, weights and states, bit for bit."""
    monkeypatch.setattr(engine_cpu, "HUGE_MIN_BYTES", 0)
    rng = np.random.default_rng(3)
    tables, fmap, batch = [(50, 8), (30, 8 if pooling == Pooling.NONE else 4)], [0, 1, 0], 16
    hot = rng.integers(0, 4, len(fmap) * batch)
    offsets = np.concatenate([[0], np.cumsum(hot)]).astype(np.int64)
    n = int(offsets[-1])
    indices = np.concatenate(
        [rng.integers(0, tables[t][0], hot[f * batch : (f + 1) * batch].sum()) for f, t in enumerate(fmap)]
    ).astype(np.int64)
    weights = rng.uniform(0.5, 1.5, n).astype(np.float32) if psw else None
    results = []
    for huge in ("1", "0"):
        monkeypatch.setenv(hostmem.ENV, huge)
        eng = TableBatchedEmbedding(
            tables, fmap, pooling=pooling, optimizer=OptimizerSpec(Optim.EXACT_ROWWISE_ADAGRAD, 0.1)
        )
        assert eng.huge_pages == (huge == "1")
        for t, w in enumerate(eng.split_weights()):
            w[...] = np.random.default_rng(t).uniform(-1, 1, w.shape)
        for _ in range(2):
            out, ctx = eng.forward(indices, offsets, weights)
            eng.backward(ctx, np.random.default_rng(7).standard_normal(out.shape).astype(np.float32))
        results.append(
            (out.copy(), [w.copy() for w in eng.split_weights()], [s.copy() for s in eng.split_optimizer_states()])
        )
    (o1, w1, s1), (o0, w0, s0) = results
    np.testing.assert_array_equal(o1, o0)
    for a, b in zip(w1 + [x for st in s1 for x in st], w0 + [x for st in s0 for x in st]):
        np.testing.assert_array_equal(a, b)


def test_oversized_buffers_and_tables_are_clear_memory_errors(monkeypatch):
    # a mapping the kernel refuses: MemoryError with the size, not OSError ENOMEM
    with pytest.raises(MemoryError, match=r"cannot map .* GB of host memory"):
        hostmem.host_zeros(1 << 58, np.float32)
    # a table that would be initialized past the available memory: refused before a page is touched
    monkeypatch.setattr(hostmem, "available_bytes", lambda: 1 << 20)
    with pytest.raises(
        MemoryError,
        match=r"initializing SparseEmbedding 'big' \(1200000 rows x 16\) needs "
        r"0\.08 GB of host memory but only 0\.00 GB are available",
    ):
        _onehot("big", [600000, 600000])


def test_whole_table_fill_in_chunks_equals_one_piece(monkeypatch):
    from numbactr.embedding.engine import buffers as E
    from numbactr.kernels import embedding_init as EI

    monkeypatch.setattr(E, "FILL_CHUNK_ELEMS", 100)  # 6 rows of 16 per chunk
    view = np.zeros((45, 16), np.float32)
    scale = np.linspace(0.1, 1.0, 45).astype(np.float32)
    E.fill_uniform_rows(view, 7, 3, -0.5, 0.5, row_scale=scale)
    want = EI.row_values_ref(np.arange(7, 52, dtype=np.uint64), 16, 3, -0.5, 0.5) * scale[:, None]
    assert np.array_equal(view, want)
    # the one-hot embedding's initial table is the same as before the fill was chunked
    e = _onehot("small", [30, 15])
    bound = np.repeat(np.sqrt(1.0 / np.array([30, 15], np.float64)), [30, 15]).astype(np.float32)
    want = EI.row_values_ref(np.arange(45, dtype=np.uint64), 16, e.seed, -1.0, 1.0) * bound[:, None]
    assert np.array_equal(np.asarray(e.weight.data), want)


def _onehot(name, sizes):
    import numbactr as hugectr
    from numbactr.embedding.factory import make_embedding

    cfg = hugectr.SparseEmbedding(
        embedding_type=hugectr.Embedding_t.LocalizedSlotSparseEmbeddingOneHot,
        slot_size_array=sizes,
        embedding_vec_size=16,
        sparse_embedding_name=name,
        bottom_name="data1",
        workspace_size_per_gpu_in_mb=1,
    )
    param = hugectr.DataReaderSparseParam("data1", 1, True, len(sizes))
    return make_embedding(cfg, param, hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.SGD), 0)
