"""Training batches staged on the device one step ahead (numbactr.data.staging.DeviceStager): on sim the same
slots and hand-over as on a GPU (without its streams). Staged training equals unstaged training, the reader's
stream (epoch ends, partial batches, a new source) is unchanged, and one-hot offsets are made on the device."""

import dataclasses

import numpy as np
import pytest

from numbactr.runtime import device
from numbactr.data.staging import DeviceStager
from numbactr.train import step as train_step
from tests.model_util import tiny_data, tiny_dlrm

pytestmark = pytest.mark.skipif(not device._numba_simulated(), reason="needs the simulator")


def _run(tmp_path, monkeypatch, stage: str, *, n_train=20, batch=4, repeat=True, calls=7):
    monkeypatch.setenv("NUMBACTR_STAGE_INPUTS", stage)
    device.set_device("sim")
    tr, ev = tiny_data(str(tmp_path), n_train=n_train, n_eval=32, files=1)
    m = tiny_dlrm(tr, ev, batch=batch, lr=0.05)
    m.solver = dataclasses.replace(m.solver, repeat_dataset=repeat, drop_incomplete_batch=False)
    steps = []
    for _ in range(calls):
        steps.append(m.train())
    return m, steps


def test_staged_training_equals_unstaged(tmp_path, monkeypatch):
    staged, s_steps = _run(tmp_path / "a", monkeypatch, "1", calls=3)
    plain, p_steps = _run(tmp_path / "b", monkeypatch, "0", calls=3)
    assert s_steps == p_steps == [True] * 3
    assert isinstance(staged._stager, DeviceStager) and plain._stager is None
    assert staged._stager.uploads == 4  # each step stages the next batch
    assert staged._stager.device_offsets == 4  # one key per slot: offsets made on the device
    np.testing.assert_array_equal(np.asarray(staged.weights), np.asarray(plain.weights))
    np.testing.assert_array_equal(
        np.asarray(staged.embeddings[0].weight.data), np.asarray(plain.embeddings[0].weight.data)
    )
    assert staged.get_current_loss() == plain.get_current_loss()


def test_epoch_end_partial_batch_and_a_new_source(tmp_path, monkeypatch):
    # 10 rows in batches of 4: the third batch has 2 valid rows and 2 padded rows with empty bags, the fourth
    # call meets the end of the epoch
    staged, s_steps = _run(tmp_path / "a", monkeypatch, "1", n_train=10, repeat=False, calls=4)
    plain, p_steps = _run(tmp_path / "b", monkeypatch, "0", n_train=10, repeat=False, calls=4)
    assert s_steps == p_steps == [True, True, True, False]
    st = staged._stager
    assert st.uploads == 3 and st.device_offsets == 2  # the padded batch's offsets were uploaded
    np.testing.assert_array_equal(np.asarray(staged.weights), np.asarray(plain.weights))
    # a new source: the new reader starts from its first row (a batch staged from the old one is dropped)
    for m in (staged, plain):
        m.set_source(m.reader_params.source[0], m.reader_params.eval_source)
        assert m.train() and m.train()
    np.testing.assert_array_equal(np.asarray(staged.weights), np.asarray(plain.weights))
    monkeypatch.setenv("NUMBACTR_STAGE_INPUTS", "yes")
    with pytest.raises(ValueError, match="NUMBACTR_STAGE_INPUTS must be 0 or 1"):
        staged.train()


def test_reader_workers_write_the_pinned_buffers(tmp_path, monkeypatch):
    # after the first batches (queued before the stager gave the reader's pass its arena), every array is
    # uploaded from the block a worker wrote it in: no copy on the training thread, and blocks are reused
    staged, s_steps = _run(tmp_path / "a", monkeypatch, "1", n_train=24, calls=6)
    st = staged._stager
    copies_then, direct_then = st.host_copies, st.direct_uploads
    assert staged.train() and staged.train()
    plain, p_steps = _run(tmp_path / "b", monkeypatch, "0", n_train=24, calls=8)  # (the flag is global)
    assert s_steps + [True] * 2 == p_steps == [True] * 8
    state = (st.host_copies, st.direct_uploads, st.arena.blocks, st.arena.reused)
    assert st.host_copies == copies_then, state  # none since: each batch came in arena blocks
    assert st.direct_uploads == direct_then + 2 * 3, state  # label, dense, keys (offsets made on the device)
    # label, dense, keys and offsets per batch, for the batches in flight (queued, held, staged); the reader's
    # worker reuses released blocks for the batches it prefetches after them (it runs on its own: wait for it)
    import time

    deadline = time.monotonic() + 30
    while st.arena.reused == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert st.arena.reused > 0 and st.arena.blocks <= 4 * 10, state
    np.testing.assert_array_equal(np.asarray(staged.weights), np.asarray(plain.weights))
    np.testing.assert_array_equal(
        np.asarray(staged.embeddings[0].weight.data), np.asarray(plain.embeddings[0].weight.data)
    )


def test_host_mirrors_serve_the_batch_handed_out_and_hold_its_blocks(tmp_path, monkeypatch):
    """Several ranks route keys on the host: a stager with host_mirrors registers the handed-out batch's host
    arrays, so device.to_host of its device arrays reads nothing back (and returns read-only values equal to
    the device's); the previous batch's mirrors go when the next batch is handed out, and its arena blocks are
    released only then (a worker may not overwrite them while the step still reads them)."""
    from numbactr.kernels import launch

    monkeypatch.setenv("NUMBACTR_STAGE_INPUTS", "1")
    device.set_device("sim")
    tr, ev = tiny_data(str(tmp_path), n_train=24, n_eval=8, files=1)
    m = tiny_dlrm(tr, ev, batch=4, lr=0.05)
    m.ranks = 2  # (the model's own step stays one rank's: only the stager)
    stager = train_step.stager_for_step(m)
    m.ranks = 1
    assert stager.host_mirrors
    m.start_data_reading()
    previous = None
    for _ in range(8):
        batch = stager.next(m._train_reader, lambda reader: train_step.fetch_for_staging(m, reader))
        arrays = [batch.label, batch.dense] + [x for kv in batch.sparse for x in kv]
        launch.reset_counts()
        hosts = [device.to_host(a) for a in arrays]
        assert launch.reset_counts()["host_reads"] == 0
        for a, h in zip(arrays, hosts):
            np.testing.assert_array_equal(h, np.asarray(a))
            assert not h.flags.writeable and h is not a
        if previous is not None:
            # the last batch is retired: a read of its arrays (their slot now holds the batch staged after this
            # one) is a device read again
            # (a one-hot input's offsets are one device arange for every batch: still the current batch's)
            stale = [a for a in previous if not any(a is b for b in arrays)]
            launch.reset_counts()
            for a in stale:
                device.to_host(a)
            assert len(stale) == 3 and launch.reset_counts()["host_reads"] == 3
        previous = arrays
    stager.close()  # (a model replacing its stager): the mirrors go
    assert all(device.host_mirror(a) is None for a in arrays)
    # one-rank stagers keep no mirrors
    assert not DeviceStager().host_mirrors


def test_host_mirrored_batches_keep_their_arena_blocks_until_retired():
    """With host_mirrors, a batch's arena blocks (where a reader worker wrote it) are released when the next
    batch is handed out, not when its upload is done: the step reads their host mirrors until then. A
    synthetic reader whose every batch lies in arena blocks (a real reader's first batches may be queued
    before the stager hands it the arena, so how many use it depends on thread timing)."""
    from types import SimpleNamespace

    from numbactr.data.batch import Batch

    device.set_device("sim")
    stager = DeviceStager(host_mirrors=True)
    reader = SimpleNamespace(memory=SimpleNamespace(arena=None))
    rng = np.random.default_rng(0)

    def fetch(_reader):
        mem = reader.memory.arena.batch_memory()
        label, dense = mem.empty((4, 1), np.float32), mem.empty((4, 3), np.float32)
        keys = mem.empty((6,), np.int64)
        label[:], dense[:], keys[:] = rng.random((4, 1)), rng.random((4, 3)), rng.integers(0, 9, 6)
        offsets = np.array([0, 2, 3, 3, 6], np.int64)  # not one-hot: uploaded as well (a copy)
        return Batch(label, dense, [(keys, offsets)], 4, memory=mem)

    held = []
    for step in range(6):
        stager.next(reader, fetch)
        pairs, (mem, _event) = stager._out
        assert mem is not None and len(mem.blocks) == 3  # label, dense, keys: still the batch's
        for d, h in pairs:
            np.testing.assert_array_equal(device.to_host(d), h)
        if held:
            assert held[-1].blocks == []  # the batch before it: released on hand-over
        held.append(mem)
        assert stager.pending[1][3][0].blocks  # the batch staged behind it keeps its blocks too
    assert stager.direct_uploads == 3 * 7 and stager.host_copies == 7  # 6 handed out, 1 staged; offsets copied
    assert stager.arena.reused > 0  # released blocks went to later batches
    stager.close()
    assert held[-1].blocks == []


def test_arena_binds_each_worker_thread_to_the_ranks_gpu(monkeypatch):
    """A worker thread starts on GPU 0: before its first CUDA call (a pinned allocation, an upload event's
    query) the arena makes the rank's GPU its device, once per thread, and never sets GPU 0 back (which would
    put a context on GPU 0 for every rank). CuPy stands in here: no GPU on this machine."""
    import sys
    import threading
    import types

    from numbactr.data.staging import PinnedArena

    calls = []

    class Runtime:
        @staticmethod
        def getDevice():
            return 3

        @staticmethod
        def setDevice(i):
            calls.append((threading.current_thread().name, i))

    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=Runtime, alloc_pinned_memory=lambda n: bytearray(n))
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    arena = PinnedArena(gpu=True)
    assert arena.device_id == 3

    def worker():
        for n in (10, 5000, 10):
            arena.take(n)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(i for _, i in calls) == [3, 3]  # each thread once, to GPU 3 only
    assert len({t for t, _ in calls}) == 2
