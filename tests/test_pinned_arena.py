"""Reader workers writing batches straight into a stager's pinned arena (numbactr.data.staging.PinnedArena,
numbactr.data.reader._assemble): the batches are the same as without it (ragged bags, partial batches padded
with zeros, rank slices, Raw and Norm), blocks come back only after their upload's event and are reused, and
the arena is set while the workers already run."""

import os

import numpy as np
import pytest

from numbactr.config import DataReaderParams
from numbactr.data import make_reader
from numbactr.data.file_list import write_file_list
from numbactr.data.norm import NormWriter
from numbactr.data.raw import write_raw_file
from numbactr.data.staging import BatchMemory, PinnedArena
from numbactr.enums import Check_t, DataReaderType_t as T


def _ragged_norm(d, sizes, seed=0):
    """Norm files of 2 slots with 0-3 keys per slot (empty bags included)."""
    rng = np.random.default_rng(seed)
    os.makedirs(d, exist_ok=True)
    files = []
    for f, n in enumerate(sizes):
        p = os.path.join(d, f"f{f}.data")
        nnz = rng.integers(0, 4, (n, 2))
        offsets = np.concatenate([[0], np.cumsum(nnz.reshape(-1))])
        keys = rng.integers(0, 1000, int(offsets[-1]))
        with NormWriter(p, 1, 3, 2, Check_t.Sum, np.int64) as w:
            w.write_csr(rng.random((n, 1)), rng.normal(size=(n, 3)), keys, offsets)
        files.append(p)
    lst = os.path.join(d, "list.txt")
    write_file_list(lst, files)
    return lst


class _Poisoning(PinnedArena):
    """An arena whose released blocks are filled with 0xFF: a batch that relied on fresh zeros would show."""

    def release(self, memory, event=None):
        for b in memory.blocks:
            b[:] = 0xFF
        super().release(memory, event)


def _same(a, b):
    assert a.size == b.size and a.global_size == b.global_size
    np.testing.assert_array_equal(a.label, b.label)
    np.testing.assert_array_equal(a.dense, b.dense)
    assert len(a.sparse) == len(b.sparse)
    for (ka, oa), (kb, ob) in zip(a.sparse, b.sparse):
        assert ka.dtype == kb.dtype and oa.dtype == ob.dtype
        np.testing.assert_array_equal(ka, kb)
        np.testing.assert_array_equal(oa, ob)


@pytest.mark.parametrize("W,B,rank,ranks", [(1, 4, 0, 1), (2, 6, 0, 1), (2, 6, 1, 2)])
def test_norm_batches_in_the_arena_equal_plain_ones(tmp_path, W, B, rank, ranks):
    lst = _ragged_norm(str(tmp_path), [41, 29])  # more batches than the queues hold before the arena
    params = DataReaderParams(T.Norm, lst, lst, Check_t.Sum, num_workers=W)
    args = (params, lst, B, 1, 3, [2], None, True, False)
    plain = list(make_reader(*args, rank=rank, ranks=ranks))
    arena = _Poisoning(gpu=False)
    p = iter(make_reader(*args, rank=rank, ranks=ranks))
    p.memory.arena = arena  # set while the workers already run: some batches predate it
    got = []
    for b in p:
        if b.memory is not None:
            assert b.memory.arena is arena
            for a in (b.label, b.dense, *[x for kv in b.sparse for x in kv]):
                assert b.memory.owns(a)
        got.append(b)
    assert len(got) == len(plain) and any(b.memory is not None for b in got)
    for g, q in zip(got, plain):
        _same(g, q)
        if g.memory is not None:
            arena.release(g.memory)  # poisoned, then reused by the batches after
            assert g.memory.blocks == []


def test_reused_blocks_keep_later_batches_right(tmp_path):
    lst = _ragged_norm(str(tmp_path), [43], seed=3)
    params = DataReaderParams(T.Norm, lst, lst, Check_t.Sum, num_workers=1)
    args = (params, lst, 5, 1, 3, [2], None, True, False)
    plain = list(make_reader(*args))
    arena = _Poisoning(gpu=False)
    r = make_reader(*args, queue_depth=1)
    p = iter(r)
    p.memory.arena = arena
    got = []
    for b in p:
        got.append((b.size, b.label.copy(), b.dense.copy(), [(k.copy(), o.copy()) for k, o in b.sparse]))
        if b.memory is not None:
            arena.release(b.memory)
    for (size, label, dense, sparse), q in zip(got, plain):
        assert size == q.size
        np.testing.assert_array_equal(label, q.label)  # the partial batch's padding rows are zero
        np.testing.assert_array_equal(dense, q.dense)
        for (k, o), (kq, oq) in zip(sparse, q.sparse):
            np.testing.assert_array_equal(k, kq)
            np.testing.assert_array_equal(o, oq)
    assert arena.reused > 0 and arena.blocks <= 4 * 5  # a few batches' blocks, handed out again


def test_raw_batches_in_the_arena(tmp_path):
    p = str(tmp_path / "d.raw")
    n = 97
    write_raw_file(p, np.arange(n).reshape(-1, 1) % 2, np.arange(2 * n).reshape(n, 2), np.arange(3 * n).reshape(n, 3))
    params = DataReaderParams(T.Raw, p, p, Check_t.Non, num_samples=n, eval_num_samples=n, num_workers=2)
    args = (params, p, 4, 1, 2, [3], None, False, False)
    plain = list(make_reader(*args))
    it = iter(make_reader(*args))
    it.memory.arena = PinnedArena(gpu=False)
    got = list(it)
    assert len(got) == len(plain) == 25 and any(b.memory is not None for b in got)
    for g, q in zip(got, plain):
        _same(g, q)


class _Event:
    def __init__(self):
        self.done = False


def test_blocks_return_only_after_their_event():
    arena = PinnedArena(gpu=False)
    m1 = BatchMemory(arena)
    a = m1.empty((10,), np.float32)
    assert arena.blocks == 1 and a.nbytes == 40
    ev = _Event()
    arena.release(m1, ev)
    m2 = BatchMemory(arena)
    b = m2.empty((3, 3), np.int64)  # same size class, but the upload is not done
    assert arena.blocks == 2 and not np.shares_memory(a, b)
    ev.done = True
    c = m2.empty((5,), np.float64)
    assert arena.reused == 1 and np.shares_memory(a, c)  # given back after its event, then reused
    assert m2.owns(b) and m2.owns(c) and not m2.owns(np.zeros(3))
    big = m2.empty((3000,), np.float32)  # 12000 bytes: a 16 KiB block
    assert big.base is not None and arena.blocks == 3
