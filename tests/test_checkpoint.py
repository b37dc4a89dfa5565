"""save_params_to_files / load_* round trip in HugeCTR's file layouts (spec §7)."""
import os

import numpy as np
import pytest

from numbactr import device
from tests.model_util import tiny_data, tiny_dlrm


@pytest.fixture
def cpu():
    before = device.kind()
    device.set_device("cpu")
    yield
    device.set_device(before)


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
    assert os.path.getsize(prefix + "_opt_dense_5.model") == 2 * 4 * a.n_params            # Adam: m, v
    e = a.embeddings[0]
    keys = np.fromfile(prefix + "0_sparse_5.model/key", "<i8")
    assert keys.size == e.table.size and set(keys) <= set(range(18))
    assert os.path.getsize(prefix + "0_sparse_5.model/emb_vector") == 4 * keys.size * e.vec

    b = tiny_dlrm(tr, ev, seed=7)                 # different initial weights
    b.load_dense_weights(prefix + "_dense_5.model")
    b.load_dense_optimizer_states(prefix + "_opt_dense_5.model")
    b.load_sparse_weights([prefix + "0_sparse_5.model"])
    b.load_sparse_optimizer_states({"emb": prefix + "0_opt_sparse_5.model"})
    b.dense_optimizer.t = a.dense_optimizer.t     # HugeCTR does not store Adam's step either
    b.embeddings[0].optimizer.t = e.optimizer.t
    b._train_reader, a._train_reader = None, None
    np.testing.assert_array_equal(b.weights, a.weights)
    np.testing.assert_array_equal(b.embeddings[0].dump()[1], e.dump()[1])
    for _ in range(3):                            # both continue from the same state on the same data
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
