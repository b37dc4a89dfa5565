"""Training batches staged on the device one step ahead (numbactr.data.staging.DeviceStager): on sim the same
slots and hand-over as on a GPU (without its streams). Staged training equals unstaged training, the reader's
stream (epoch ends, partial batches, a new source) is unchanged, and one-hot offsets are made on the device."""
import dataclasses

import numpy as np
import pytest

from numbactr import device
from numbactr.data.staging import DeviceStager
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
    assert staged._stager.uploads == 4                            # each step stages the next batch
    assert staged._stager.device_offsets == 4                     # one key per slot: offsets made on the device
    np.testing.assert_array_equal(np.asarray(staged.weights), np.asarray(plain.weights))
    np.testing.assert_array_equal(np.asarray(staged.embeddings[0].weight.data),
                                  np.asarray(plain.embeddings[0].weight.data))
    assert staged.get_current_loss() == plain.get_current_loss()


def test_epoch_end_partial_batch_and_a_new_source(tmp_path, monkeypatch):
    # 10 rows in batches of 4: the third batch has 2 valid rows and 2 padded rows with empty bags, the fourth
    # call meets the end of the epoch
    staged, s_steps = _run(tmp_path / "a", monkeypatch, "1", n_train=10, repeat=False, calls=4)
    plain, p_steps = _run(tmp_path / "b", monkeypatch, "0", n_train=10, repeat=False, calls=4)
    assert s_steps == p_steps == [True, True, True, False]
    st = staged._stager
    assert st.uploads == 3 and st.device_offsets == 2             # the padded batch's offsets were uploaded
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
    plain, p_steps = _run(tmp_path / "b", monkeypatch, "0", n_train=24, calls=8)    # (the flag is global)
    assert s_steps + [True] * 2 == p_steps == [True] * 8
    state = (st.host_copies, st.direct_uploads, st.arena.blocks, st.arena.reused)
    assert st.host_copies == copies_then, state          # none since: each batch came in arena blocks
    assert st.direct_uploads == direct_then + 2 * 3, state   # label, dense, keys (offsets made on the device)
    # label, dense, keys and offsets per batch, for the batches in flight (queued, held, staged)
    assert st.arena.reused > 0 and st.arena.blocks <= 4 * 10, state
    np.testing.assert_array_equal(np.asarray(staged.weights), np.asarray(plain.weights))
    np.testing.assert_array_equal(np.asarray(staged.embeddings[0].weight.data),
                                  np.asarray(plain.embeddings[0].weight.data))
