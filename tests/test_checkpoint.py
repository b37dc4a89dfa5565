"""save_params_to_files / load_* round trip in HugeCTR's file layouts (spec §7)."""

import os

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from tests.model_util import tiny_data, tiny_dlrm
from tests.mpi.snapshot_run import build, load_all, state


def test_save_then_load_restores_the_model_and_its_optimizer(tmp_path, cpu):
    tr, ev = tiny_data(str(tmp_path))
    a = tiny_dlrm(tr, ev)
    for _ in range(5):
        a.train()
    prefix = str(tmp_path / "ck")
    a.save_params_to_files(prefix, 5)
    files = sorted(os.listdir(tmp_path))
    assert {"ck_dense_5.model", "ck_opt_dense_5.model", "ck0_sparse_5.model", "ck0_opt_sparse_5.model"} <= set(files)
    assert os.path.getsize(prefix + "_dense_5.model") == 4 * a.n_params
    assert os.path.getsize(prefix + "_opt_dense_5.model") == 2 * 4 * a.n_params  # Adam: m, v
    e = a.embeddings[0]
    keys = np.fromfile(prefix + "0_sparse_5.model/key", "<i8")
    assert keys.size == e.table.size and set(keys) <= set(range(18))
    assert os.path.getsize(prefix + "0_sparse_5.model/emb_vector") == 4 * keys.size * e.vec

    b = tiny_dlrm(tr, ev, seed=7)  # different initial weights
    b.load_dense_weights(prefix + "_dense_5.model")
    b.load_dense_optimizer_states(prefix + "_opt_dense_5.model")
    b.load_sparse_weights([prefix + "0_sparse_5.model"])
    b.load_sparse_optimizer_states({"emb": prefix + "0_opt_sparse_5.model"})
    b.dense_optimizer.t = a.dense_optimizer.t  # HugeCTR does not store Adam's step either
    b.embeddings[0].engine.step = e.engine.step
    b._train_reader, a._train_reader = None, None
    np.testing.assert_array_equal(b.weights, a.weights)
    np.testing.assert_array_equal(b.embeddings[0].dump()[1], e.dump()[1])
    for _ in range(3):  # both continue from the same state on the same data
        a.train()
        b.train()
        assert b.get_current_loss() == pytest.approx(a.get_current_loss(), rel=1e-6)


def test_bad_files_are_clear_errors(tmp_path, cpu):
    tr, ev = tiny_data(str(tmp_path))
    m = tiny_dlrm(tr, ev)
    bad = tmp_path / "short.model"
    bad.write_bytes(b"\0" * 12)
    with pytest.raises(ValueError, match=r"short.model.*12 bytes.*needs exactly"):
        m.load_dense_weights(str(bad))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        m.load_sparse_weights([str(tmp_path / "nope")])
    with pytest.raises(ValueError, match=r"2 files for 1 embeddings"):
        m.load_sparse_weights(["a", "b"])
    with pytest.raises(ValueError, match="no embedding named"):
        m.load_sparse_weights({"other": "a"})


def test_layout_is_hugectrs_slot_id_where_hugectr_writes_it(tmp_path, cpu):
    """Distributed folders hold key + emb_vector; Localized and OneHot add slot_id (uint64 per key, the
    slot each key was first seen in); the manifest is an extra file beside them."""
    tr, ev = tiny_data(str(tmp_path))
    for emb in (
        "DistributedSlotSparseEmbeddingHash",
        "LocalizedSlotSparseEmbeddingHash",
        "LocalizedSlotSparseEmbeddingOneHot",
    ):
        m = tiny_dlrm(tr, ev, embedding=hugectr.Embedding_t[emb])
        for _ in range(3):
            m.train()
        prefix = str(tmp_path / emb)
        m.save_params_to_files(prefix, 3)
        folder = prefix + "0_sparse_3.model"
        keys = np.fromfile(folder + "/key", "<i8")
        assert keys.size == 18 and os.path.getsize(folder + "/emb_vector") == 18 * 4 * 4
        if emb.startswith("Distributed"):
            assert sorted(os.listdir(folder)) == ["emb_vector", "key"]
        else:  # tiny_data: slot s holds keys 6s .. 6s+5
            np.testing.assert_array_equal(np.fromfile(folder + "/slot_id", "<u8"), keys // 6)
        assert os.path.exists(prefix + "_3.manifest.json")
        assert not [n for n in os.listdir(tmp_path) if "staging" in n or "pending" in n]


def test_hugectr_snapshot_without_manifest_loads(tmp_path, cpu):
    """HugeCTR writes no manifest: the same files load unverified, states mapped to their keys."""
    tr, ev = tiny_data(str(tmp_path))
    a = tiny_dlrm(tr, ev, embedding=hugectr.Embedding_t.LocalizedSlotSparseEmbeddingHash)
    for _ in range(4):
        a.train()
    prefix = str(tmp_path / "ck")
    a.save_params_to_files(prefix, 4)
    os.remove(prefix + "_4.manifest.json")
    b = tiny_dlrm(tr, ev, seed=3, embedding=hugectr.Embedding_t.LocalizedSlotSparseEmbeddingHash)
    b.load_dense_weights(prefix + "_dense_4.model")
    b.load_sparse_weights([prefix + "0_sparse_4.model"])
    b.load_sparse_optimizer_states([prefix + "0_opt_sparse_4.model"])
    ea, eb = a.embeddings[0], b.embeddings[0]
    np.testing.assert_array_equal(b.weights, a.weights)
    for x, y in zip(ea.dump() + (ea.dump_slots(),), eb.dump() + (eb.dump_slots(),)):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(ea.states, eb.states):
        np.testing.assert_array_equal(x, y)


def _two_gpu_hugectr_files(folder, keys, vec, max_rows, states):
    """A DistributedSlot snapshot as HugeCTR writes it on 2 GPUs: per GPU its keys (key % 2) in row order,
    GPUs concatenated; optimizer states (S, 2, max_rows, D) with the state of GPU g's j-th key in row j."""
    os.makedirs(folder + "0_sparse_7.model")
    np.asarray(keys, np.int64).tofile(folder + "0_sparse_7.model/key")
    vecs = np.arange(len(keys) * vec, dtype=np.float32).reshape(-1, vec)
    vecs.tofile(folder + "0_sparse_7.model/emb_vector")
    blocks = np.zeros((states, 2, max_rows, vec), np.float32)
    for i, k in enumerate(keys):
        g = k % 2
        j = sum(1 for q in keys[:i] if q % 2 == g)
        blocks[:, g, j] = 1000 * np.arange(1, states + 1)[:, None] + k  # distinct per key and state
    blocks.tofile(folder + "0_opt_sparse_7.model")
    return vecs


def test_hugectr_two_gpu_optimizer_states_follow_their_keys(tmp_path, cpu):
    tr, ev = tiny_data(str(tmp_path))
    m = tiny_dlrm(tr, ev)  # Distributed, Adam: m and v
    e = m.embeddings[0]
    keys = [4, 0, 2, 7, 3]  # GPU 0: 4, 0, 2; GPU 1: 7, 3
    prefix = str(tmp_path / "hc")
    vecs = _two_gpu_hugectr_files(prefix, keys, e.vec, e.max_rows, 2)
    m.load_sparse_weights([prefix + "0_sparse_7.model"])
    m.load_sparse_optimizer_states([prefix + "0_opt_sparse_7.model"])
    got_keys, got_vecs = e.dump()
    np.testing.assert_array_equal(got_keys, keys)  # one rank: file order
    np.testing.assert_array_equal(got_vecs, vecs)
    for s, st in enumerate(e.states):
        np.testing.assert_array_equal(st[:5], 1000 * (s + 1) + np.array(keys, np.float32)[:, None].repeat(4, 1))


def test_hugectr_states_that_no_rank_count_explains_are_an_error(tmp_path, cpu):
    tr, ev = tiny_data(str(tmp_path))
    m = tiny_dlrm(tr, ev)
    e = m.embeddings[0]
    prefix = str(tmp_path / "hc")
    _two_gpu_hugectr_files(prefix, [1, 0], e.vec, e.max_rows, 2)  # key 1 (GPU 1) before key 0 (GPU 0)
    m.load_sparse_weights([prefix + "0_sparse_7.model"])
    before = [s.copy() for s in e.states]
    with pytest.raises(ValueError, match=r"match no rank count.*tried \[2\].*not grouped by their rank"):
        m.load_sparse_optimizer_states([prefix + "0_opt_sparse_7.model"])
    for x, y in zip(before, e.states):
        np.testing.assert_array_equal(x, y)
    os.remove(prefix + "0_sparse_7.model/key")
    with pytest.raises(FileNotFoundError, match="key' does not exist"):
        m.load_sparse_optimizer_states([prefix + "0_opt_sparse_7.model"])


def test_rank_count_of_slot_sized_states_must_be_unambiguous(tmp_path, cpu):
    """slot_size_array [2, 2, 2]: a 1-rank and a 3-rank state file have the same size (6 rows). With every
    key present both put each key in the same row; with keys 0, 2, 4 (one per slot) they do not."""
    m = build(*tiny_data(str(tmp_path)), "LocalizedSlotSparseEmbeddingHash", sizes=[2, 2, 2])
    e = m.embeddings[0]
    assert e.max_rows == 6
    folder = str(tmp_path / "ls0_sparse_1.model")
    os.makedirs(folder)
    for keys in ([0, 1, 2, 3, 4, 5], [0, 2, 4]):
        np.asarray(keys, np.int64).tofile(folder + "/key")
        np.zeros((len(keys), e.vec), np.float32).tofile(folder + "/emb_vector")
        (np.asarray(keys) // 2).astype(np.uint64).tofile(folder + "/slot_id")
        states = np.arange(2 * 6 * e.vec, dtype=np.float32)
        states.tofile(str(tmp_path / "ls0_opt_sparse_1.model"))
        m.load_sparse_weights([folder])
        if len(keys) == 6:
            m.load_sparse_optimizer_states([str(tmp_path / "ls0_opt_sparse_1.model")])
            np.testing.assert_array_equal(e.states[1][:6], states.reshape(2, 6, e.vec)[1])
        else:
            with pytest.raises(ValueError, match=r"could come from \[1, 3\] ranks alike"):
                m.load_sparse_optimizer_states([str(tmp_path / "ls0_opt_sparse_1.model")])


def test_localized_keys_without_slot_id_load_on_one_rank_and_stay_unknown(tmp_path, cpu):
    tr, ev = tiny_data(str(tmp_path))
    m = tiny_dlrm(tr, ev, embedding=hugectr.Embedding_t.LocalizedSlotSparseEmbeddingHash)
    folder = str(tmp_path / "old0_sparse_2.model")
    os.makedirs(folder)
    np.arange(5, dtype=np.int64).tofile(folder + "/key")
    np.zeros((5, 4), np.float32).tofile(folder + "/emb_vector")
    m.load_sparse_weights([folder])
    e = m.embeddings[0]
    np.testing.assert_array_equal(e.dump_slots(), np.full(5, 2**64 - 1, np.uint64))
    m._train_reader = None
    m.train()  # new keys get their slots; old ones stay unknown
    slots = e.dump_slots()
    assert (slots[:5] == 2**64 - 1).all() and (slots[5:] < 3).all()
    m.save_params_to_files(str(tmp_path / "re"), 1)  # unknown slots are written as 2**64-1 ...
    assert (np.fromfile(str(tmp_path / "re0_sparse_1.model/slot_id"), "<u8")[:5] == 2**64 - 1).all()
    m.load_sparse_weights([str(tmp_path / "re0_sparse_1.model")])  # ... and read back as unknown
    np.testing.assert_array_equal(e.dump_slots(), slots)


def test_kernels_record_slots_and_a_snapshot_reloads_on_sim(tmp_path):
    """The kernel path (sim; gpu the same code): slots recorded at insertion, reload identical."""
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    before = device.kind()
    device.set_device("sim")
    try:
        data = tiny_data(str(tmp_path), n_train=48, n_eval=24)
        a = build(*data, batch=6)
        a.train()
        keys, _ = a.embeddings[0].dump()
        np.testing.assert_array_equal(a.embeddings[0].dump_slots(), keys // 6)
        a.save_params_to_files(str(tmp_path / "ck"), 1)
        b = build(*data, seed=3, batch=6)
        load_all(b, str(tmp_path / "ck"), 1)
        want, got = state(a), state(b)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    finally:
        device.set_device(before)


def test_fit_snapshots_are_committed_snapshots(tmp_path, cpu):
    tr, ev = tiny_data(str(tmp_path))
    m = tiny_dlrm(tr, ev)
    m.fit(max_iter=4, display=0, eval_interval=0, snapshot=2, snapshot_prefix=str(tmp_path / "fit"))
    assert os.path.exists(tmp_path / "fit_2.manifest.json")  # HugeCTR's 0-based it: after 3 steps
    b = tiny_dlrm(tr, ev, seed=4)
    b.load_dense_weights(str(tmp_path / "fit_dense_2.model"))
    b.load_sparse_weights([str(tmp_path / "fit0_sparse_2.model")])
    assert b.embeddings[0].table.size == m.embeddings[0].table.size
