"""A failed load changes nothing: every weight, optimizer state, BatchNorm statistic, table size, key -> row
map and slot record of the live model is the same afterwards, and the error names the file and what was
expected. Damage is made here on purpose, without the manifest (HugeCTR's files: structural checks) and
with it (any change is a size or checksum mismatch)."""

import json
import os

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.files import checkpoint
from numbactr.runtime import device
from numbactr.data.errors import DataFormatError
from tests.model_util import tiny_data
from tests.mpi.snapshot_run import build, load_all, state


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("tx")), n_train=240, n_eval=96)


@pytest.fixture
def saved(tmp_path, data, cpu):
    """A snapshot ck@3 (Localized, Adam, BatchNorm) and its model's state."""
    a = build(*data)
    for _ in range(3):
        a.train()
    a.save_params_to_files(str(tmp_path / "ck"), 3)
    return tmp_path, state(a)


def everything(model) -> dict:
    """Copies of all the live state a load may touch, internals of the hash table included."""
    e = model.embeddings[0]
    out = {
        "weights": model.weights,
        "pool": e.weight.data,
        "row_slot": e.row_slot,
        "tkeys": e.table._tkeys,
        "trows": e.table._trows,
        "size": np.array(e.table.size),
        "by_row": e.table.keys_by_row(),
    }
    out.update({f"dense{k}": s for k, s in enumerate(model.dense_optimizer.states)})
    out.update({f"sparse{k}": s for k, s in enumerate(e.states)})
    for j, b in enumerate(checkpoint.norm_layers(model)):
        out[f"bn{j}"] = np.stack([b.running_mean, b.running_var])
    return {k: np.array(device.to_host(v)) for k, v in out.items()}


@pytest.fixture
def victim(data, cpu):
    """A live model in another state than the snapshot: other initial weights, other training."""
    b = build(*data, seed=4)
    for _ in range(2):
        b.train()
    return b


def path(folder, name):
    return str(folder / name)


def edit_raw(file, dtype, change):
    a = np.fromfile(file, dtype)
    a = change(a.copy())
    a.astype(dtype).tofile(file)


def drop_manifest(folder):
    os.remove(folder / "ck_3.manifest.json")


def write_json(file, doc):
    with open(file, "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))


def keys_with(folder, keys):
    """Replace the key file (and emb_vector, slot_id to match) by ``keys``."""
    sp = folder / "ck0_sparse_3.model"
    n = len(keys)
    np.asarray(keys, np.int64).tofile(sp / "key")
    np.zeros((n, 4), np.float32).tofile(sp / "emb_vector")
    (np.asarray(keys, np.int64) // 6 % 3).astype(np.uint64).tofile(sp / "slot_id")


NTP = "ck_dense_3.model.ntp.json"
CASES = {
    # name: (damage(folder), load(model, folder), error type, message pattern)
    "dense truncated": (
        lambda f: edit_raw(f / "ck_dense_3.model", "<f4", lambda a: a[:-1]),
        lambda m, f: m.load_dense_weights(path(f, "ck_dense_3.model")),
        DataFormatError,
        r"ck_dense_3.model.*holds \d+ bytes; this model needs exactly",
    ),
    "ntp not JSON": (
        lambda f: write_json(f / NTP, '{"layers": [{"type": "BatchNorm", "mean": [0.1, 0.'),
        lambda m, f: m.load_dense_weights(path(f, "ck_dense_3.model")),
        DataFormatError,
        r"ntp.json.*not valid JSON",
    ),
    "ntp wrong width": (
        lambda f: write_json(f / NTP, {"layers": [{"type": "BatchNorm", "mean": [0.0] * 3, "var": [1.0] * 3}]}),
        lambda m, f: m.load_dense_weights(path(f, "ck_dense_3.model")),
        DataFormatError,
        r"layers\[0\] \(BatchNorm 'bn1'\)\.mean must be a list of 4 numbers.*got 3",
    ),
    "ntp two layers": (
        lambda f: write_json(f / NTP, {"layers": [{"mean": [0.0] * 4, "var": [1.0] * 4}] * 2}),
        lambda m, f: m.load_dense_weights(path(f, "ck_dense_3.model")),
        DataFormatError,
        r"lists 2 BatchNorm layers; the model has 1",
    ),
    "ntp negative var": (
        lambda f: write_json(f / NTP, {"layers": [{"mean": [0.0] * 4, "var": [1, -1, 1, 1]}]}),
        lambda m, f: m.load_dense_weights(path(f, "ck_dense_3.model")),
        DataFormatError,
        r"negative variance",
    ),
    "ntp missing": (
        lambda f: os.remove(f / NTP),
        lambda m, f: m.load_dense_weights(path(f, "ck_dense_3.model")),
        FileNotFoundError,
        r"ntp.json' does not exist.*1 BatchNorm.*allow_missing_ntp=True",
    ),
    "dense opt size": (
        lambda f: edit_raw(f / "ck_opt_dense_3.model", "<f4", lambda a: a[:-3]),
        lambda m, f: m.load_dense_optimizer_states(path(f, "ck_opt_dense_3.model")),
        DataFormatError,
        r"ck_opt_dense_3.model.*needs exactly .*2 state arrays",
    ),
    "vectors short": (
        lambda f: edit_raw(f / "ck0_sparse_3.model/emb_vector", "<f4", lambda a: a[:-4]),
        lambda m, f: m.load_sparse_weights([path(f, "ck0_sparse_3.model")]),
        DataFormatError,
        r"emb_vector.*needs exactly .*18 keys in .*key.* x embedding_vec_size 4",
    ),
    "key not int64": (
        lambda f: edit_raw(f / "ck0_sparse_3.model/key", "<u1", lambda a: a[:-3]),
        lambda m, f: m.load_sparse_weights([path(f, "ck0_sparse_3.model")]),
        DataFormatError,
        r"key.*is not a whole number of int64 values",
    ),
    "duplicate key": (
        lambda f: keys_with(f, [0, 1, 2, 1]),
        lambda m, f: m.load_sparse_weights([path(f, "ck0_sparse_3.model")]),
        DataFormatError,
        r"byte offset 24: key 1 appears at positions 1 and 3",
    ),
    "reserved key": (
        lambda f: keys_with(f, [0, -1]),
        lambda m, f: m.load_sparse_weights([path(f, "ck0_sparse_3.model")]),
        DataFormatError,
        r"key -1 at position 1 is reserved",
    ),
    "too many keys": (
        lambda f: keys_with(f, np.arange(30000)),
        lambda m, f: m.load_sparse_weights([path(f, "ck0_sparse_3.model")]),
        DataFormatError,
        r"holds 30000 keys, and the table holds 21845 rows.*at least 2",
    ),
    "slot out of range": (
        lambda f: edit_raw(f / "ck0_sparse_3.model/slot_id", "<u8", lambda a: a + 3),
        lambda m, f: m.load_sparse_weights([path(f, "ck0_sparse_3.model")]),
        DataFormatError,
        r"slot_id\[0\] = [3-5] \(key \d+\) is outside the embedding's 3 slots",
    ),
    "slot_id short": (
        lambda f: edit_raw(f / "ck0_sparse_3.model/slot_id", "<u8", lambda a: a[:-1]),
        lambda m, f: m.load_sparse_weights([path(f, "ck0_sparse_3.model")]),
        DataFormatError,
        r"slot_id.*needs exactly 144 .*one per key",
    ),
    "sparse opt size": (
        lambda f: edit_raw(f / "ck0_opt_sparse_3.model", "<f4", lambda a: a[:-4]),
        lambda m, f: m.load_sparse_optimizer_states([path(f, "ck0_opt_sparse_3.model")]),
        DataFormatError,
        r"ck0_opt_sparse_3.model.*not a whole number of rows of 2 states x 4",
    ),
    "states before weights": (
        lambda f: keys_with(f, np.arange(100, 118)),  # keys the live table lacks
        lambda m, f: m.load_sparse_optimizer_states([path(f, "ck0_opt_sparse_3.model")]),
        DataFormatError,
        r"key 100 \(position 0 of .*\) is not in the model's table: load "
        r"the sparse weights of this snapshot first",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_failed_load_changes_nothing(saved, victim, case):
    folder, _ = saved
    damage, load, kind, pattern = CASES[case]
    drop_manifest(folder)  # HugeCTR's files: only structure can be checked
    damage(folder)
    before = everything(victim)
    with pytest.raises(kind, match=pattern):
        load(victim, folder)
    after = everything(victim)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=f"{case}: {k} changed")


@pytest.mark.parametrize(
    "name,load",
    [
        ("ck_dense_3.model.ntp.json", lambda m, f: m.load_dense_weights(path(f, "ck_dense_3.model"))),
        ("ck0_sparse_3.model/emb_vector", lambda m, f: m.load_sparse_weights([path(f, "ck0_sparse_3.model")])),
        ("ck0_opt_sparse_3.model", lambda m, f: m.load_sparse_optimizer_states([path(f, "ck0_opt_sparse_3.model")])),
    ],
)
def test_with_a_manifest_a_changed_byte_names_the_file_and_the_checksum(saved, victim, name, load):
    folder, _ = saved
    raw = bytearray((folder / name).read_bytes())
    raw[len(raw) // 2] ^= 0x04  # a valid value still, size unchanged
    (folder / name).write_bytes(bytes(raw))
    before = everything(victim)
    with pytest.raises(
        DataFormatError,
        match=rf"{name.split('/')[-1]}.*does not match its manifest.*"
        r"ck_3.manifest.json.*checksum differs",
    ):
        load(victim, folder)
    after = everything(victim)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=f"{name}: {k} changed")


def test_missing_ntp_is_an_error_unless_asked_to_keep_the_statistics(saved, victim):
    folder, want = saved
    drop_manifest(folder)
    os.remove(folder / NTP)
    bn = checkpoint.norm_layers(victim)[0]
    kept = (bn.running_mean.copy(), bn.running_var.copy())
    with pytest.raises(FileNotFoundError, match="allow_missing_ntp"):
        victim.load_dense_weights(path(folder, "ck_dense_3.model"))
    victim.load_dense_weights(path(folder, "ck_dense_3.model"), allow_missing_ntp=True)
    np.testing.assert_array_equal(victim.weights, want["weights"])
    np.testing.assert_array_equal(bn.running_mean, kept[0])
    np.testing.assert_array_equal(bn.running_var, kept[1])


def test_after_the_failures_the_snapshot_loads_whole(saved, victim):
    folder, want = saved
    load_all(victim, str(folder / "ck"), 3)
    got = state(victim)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_weights_reload_keeps_each_keys_optimizer_state(saved, data):
    """load_sparse_weights rebuilds the table in file order; a key the live table held keeps its state
    in its new row, a key new to it starts from the initial state (never another key's)."""
    folder, _ = saved
    m = build(*data, seed=2)
    for _ in range(2):
        m.train()
    e = m.embeddings[0]
    keys, _ = e.dump()
    held = {int(k): [np.array(s[r]) for s in e.states] for r, k in enumerate(keys)}
    drop_manifest(folder)
    kept = [int(k) for k in keys[::-1][:5]]  # reversed: every row moves
    keys_with(folder, kept + [1000, 1001])
    m.load_sparse_weights([path(folder, "ck0_sparse_3.model")])
    for r, k in enumerate(kept + [1000, 1001]):
        for s, old in zip(e.states, held.get(k, [np.zeros(4, np.float32)] * 2)):
            np.testing.assert_array_equal(s[r], old, err_msg=f"key {k}")
    assert np.array_equal(e.dump_slots(), np.array([k // 6 % 3 for k in kept + [1000, 1001]], np.uint64))


def test_a_bad_second_embedding_leaves_the_first_untouched(tmp_path, data, cpu):
    """All embeddings' files are checked before any table changes."""

    def two_tables(seed):
        solver = hugectr.CreateSolver(
            batchsize=12, batchsize_eval=12, lr=0.05, vvgpu=[[0]], i64_input_key=True, seed=seed
        )
        reader = hugectr.DataReaderParams(
            data_reader_type=hugectr.DataReaderType_t.Norm,
            source=[data[0]],
            eval_source=data[1],
            check_type=hugectr.Check_t.Sum,
        )
        m = hugectr.Model(solver, reader, hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.Adam))
        m.add(
            hugectr.Input(
                label_dim=1,
                label_name="label",
                dense_dim=2,
                dense_name="dense",
                data_reader_sparse_param_array=[
                    hugectr.DataReaderSparseParam("a", 1, True, 2),
                    hugectr.DataReaderSparseParam("b", 1, True, 1),
                ],
            )
        )
        for name, bottom in (("ea", "a"), ("eb", "b")):
            m.add(
                hugectr.SparseEmbedding(
                    embedding_type=hugectr.Embedding_t.LocalizedSlotSparseEmbeddingHash,
                    workspace_size_per_gpu_in_mb=1,
                    embedding_vec_size=4,
                    combiner="sum",
                    sparse_embedding_name=name,
                    bottom_name=bottom,
                )
            )
        L = hugectr.Layer_t
        m.add(hugectr.DenseLayer(L.Concat, ["ea", "eb"], ["cat3"], axis=1))
        m.add(hugectr.DenseLayer(L.Reshape, ["cat3"], ["flat"], leading_dim=12))
        m.add(hugectr.DenseLayer(L.InnerProduct, ["flat"], ["fc"], num_output=1))
        m.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc", "label"], ["loss"]))
        m.compile()
        for _ in range(2):
            m.train()
        return m

    a, b = two_tables(0), two_tables(5)
    a.save_params_to_files(str(tmp_path / "two"), 2)
    os.remove(tmp_path / "two_2.manifest.json")
    keys = np.fromfile(tmp_path / "two1_sparse_2.model/key", "<i8")
    np.concatenate([keys, keys[:1]]).tofile(tmp_path / "two1_sparse_2.model/key")  # a duplicate
    np.zeros((keys.size + 1, 4), np.float32).tofile(tmp_path / "two1_sparse_2.model/emb_vector")
    os.remove(tmp_path / "two1_sparse_2.model/slot_id")
    before = [(e.dump(), np.array(e.row_slot)) for e in b.embeddings]
    with pytest.raises(DataFormatError, match=r"two1_sparse_2.model/key.*appears at positions 0 and"):
        b.load_sparse_weights([str(tmp_path / "two0_sparse_2.model"), str(tmp_path / "two1_sparse_2.model")])
    for e, ((k, v), slots) in zip(b.embeddings, before):
        np.testing.assert_array_equal(e.dump()[0], k)
        np.testing.assert_array_equal(e.dump()[1], v)
        np.testing.assert_array_equal(e.row_slot, slots)
