"""HugeCTR's embedding training cache (numbactr/train/training_cache.py): CreateETC's checks, training over several file lists
with their keyset files, the sparse model folders, incremental models, and equality with plain training."""

import os

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.data.file_list import write_file_list
from numbactr.data.norm import write_norm_file
from numbactr.model import ModelError
from tests.mpi_util import needs_mpi

L = hugectr.Layer_t
SLOTS, DENSE, VEC = 3, 2, 4


def _data(folder, parts=3, n=192, seed=0):
    """parts file lists of n samples, each with its keyset file (the keys it uses, uint32), and an eval list."""
    rng = np.random.default_rng(seed)
    out = []
    for p in range(parts + 1):
        keys = rng.integers(0, 20, (n, SLOTS)) + np.arange(SLOTS) * 20 + 60 * p * (p < parts)
        x = rng.normal(0, 1, (n, DENSE)).astype(np.float32)
        label = (rng.random(n) < 1 / (1 + np.exp(-(keys % 3 - 1).sum(1) - x[:, 0]))).astype(np.float32)
        data = os.path.join(folder, f"part{p}.data")
        write_norm_file(data, label, x, keys.astype(np.int64), key_dtype=np.uint32)
        lst = os.path.join(folder, f"file_list.{p}.txt")
        write_file_list(lst, [data])
        ks = os.path.join(folder, f"file_list.{p}.keyset")
        np.unique(keys).astype("<u4").tofile(ks)
        out.append((lst, ks))
    return out[:parts], out[parts][0]


def _model(sources, keysets, evl, etc=None, seed=3):
    solver = hugectr.CreateSolver(
        batchsize=64,
        batchsize_eval=64,
        max_eval_batches=2,
        lr=0.01,
        vvgpu=[[0]],
        repeat_dataset=False,
        i64_input_key=False,
        seed=seed,
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=sources,
        keyset=keysets,
        eval_source=evl,
        check_type=hugectr.Check_t.Sum,
    )
    opt = hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.Adam)
    model = hugectr.Model(solver, reader, opt, etc) if etc is not None else hugectr.Model(solver, reader, opt)
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=DENSE,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, SLOTS)],
        )
    )
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=VEC,
            combiner="sum",
            sparse_embedding_name="emb",
            bottom_name="data1",
        )
    )
    model.add(hugectr.DenseLayer(L.Reshape, ["emb"], ["flat"], leading_dim=SLOTS * VEC))
    model.add(hugectr.DenseLayer(L.Concat, ["flat", "dense"], ["cat"]))
    model.add(hugectr.DenseLayer(L.InnerProduct, ["cat"], ["fc1"], num_output=8))
    model.add(hugectr.DenseLayer(L.ReLU, ["fc1"], ["relu1"]))
    model.add(hugectr.DenseLayer(L.InnerProduct, ["relu1"], ["fc2"], num_output=1))
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc2", "label"], ["loss"]))
    model.compile()
    return model


def _table(model):
    keys, vecs = model.embeddings[0].dump()
    order = np.argsort(keys)
    return keys[order].astype(np.int64), np.asarray(vecs)[order]


def test_create_etc_checks_its_arguments(tmp_path):
    S, C = hugectr.TrainPSType_t.Staged, hugectr.TrainPSType_t.Cached
    assert hugectr.Staged is S  # pybind's export_values()
    p = hugectr.CreateETC(ps_types=[S, S], sparse_models=[str(tmp_path / "a"), str(tmp_path / "b")])
    assert p.ps_types == [S, S] and p.hmem_cache_configs == [None, None]
    hc = hugectr.CreateHMemCache(2, 0.5, 0)
    p = hugectr.CreateETC(
        [C, S, C], [str(tmp_path / x) for x in "abc"], local_paths=[str(tmp_path)], hmem_cache_configs=[hc]
    )
    assert p.hmem_cache_configs == [hc, None, hc]
    (tmp_path / "file").write_text("x")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "key").write_bytes(b"12345678")
    for kw, msg in [
        (dict(ps_types=[S], sparse_models=[]), "sparse_models is required"),
        (dict(ps_types=[S, S], sparse_models=["a"]), "2 ps_types but 1 sparse_models"),
        (dict(ps_types=["Staged"], sparse_models=["a"]), "TrainPSType_t"),
        (dict(ps_types=[S], sparse_models=[str(tmp_path / "file")]), "is a file"),
        (dict(ps_types=[S], sparse_models=[str(tmp_path / "broken")]), "no 'emb_vector' file"),
        (dict(ps_types=[C], sparse_models=["a"]), "needs local_paths"),
        (
            dict(ps_types=[C, C, S], sparse_models=["a", "b", "c"], local_paths=["."], hmem_cache_configs=[hc] * 3),
            "3 hmem_cache_configs for 2 Cached PS",
        ),
    ]:
        with pytest.raises(ValueError, match=msg):
            hugectr.CreateETC(**kw)
    with pytest.raises(ValueError, match="target_hit_rate"):
        hugectr.CreateHMemCache(2, 1.5, 0)


def test_model_with_etc_needs_epoch_mode_and_one_keyset_per_source(cpu, tmp_path):
    parts, evl = _data(str(tmp_path), parts=2)
    etc = hugectr.CreateETC([hugectr.TrainPSType_t.Staged], [str(tmp_path / "sparse")])
    solver = hugectr.CreateSolver(batchsize=64, batchsize_eval=64, repeat_dataset=True, vvgpu=[[0]])
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=[parts[0][0]],
        keyset=[parts[0][1]],
        eval_source=evl,
        check_type=hugectr.Check_t.Sum,
    )
    opt = hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.Adam)
    with pytest.raises(ModelError, match="epoch mode only"):
        hugectr.Model(solver, reader, opt, etc)
    with pytest.raises(ModelError, match="1 source\\(s\\) and 0 keyset"):
        _model([parts[0][0]], [], evl, etc)


def test_etc_fit_equals_plain_training_over_the_same_file_lists(cpu, tmp_path):
    parts, evl = _data(str(tmp_path))
    sources, keysets = [p[0] for p in parts], [p[1] for p in parts]
    sparse = str(tmp_path / "models" / "wdl_0_sparse_model")
    etc = hugectr.CreateETC(ps_types=[hugectr.TrainPSType_t.Staged], sparse_models=[sparse])
    m = _model(sources[:1], keysets[:1], evl, etc)
    m.set_source(source=sources, keyset=keysets, eval_source=evl)
    m.fit(num_epochs=1, display=100, eval_interval=100)
    # the same file lists one after another, without the cache
    ref = _model(sources[:1], [], evl)
    for src in sources:
        ref.set_source(src, evl)
        ref.fit(num_epochs=1, display=100, eval_interval=100)
    assert m.step == ref.step == 3 * 3
    np.testing.assert_array_equal(np.asarray(m.weights), np.asarray(ref.weights))
    for a, b in zip(_table(m), _table(ref)):
        np.testing.assert_array_equal(a, b)
    # incremental model: the keys of every keyset trained since the start, with their current vectors
    inc = m.get_incremental_model()
    want = np.unique(np.concatenate([np.fromfile(k, "<u4") for k in keysets]).astype(np.int64))
    keys, vecs = inc[0]
    assert len(inc) == 1 and np.array_equal(np.sort(keys), want)
    tk, tv = _table(m)
    np.testing.assert_array_equal(vecs[np.argsort(keys)], tv[np.isin(tk, want)])
    assert all(k.size == 0 for k, _ in m.get_incremental_model())  # nothing new since
    # the table goes to its sparse model folder, the dense files under the prefix
    m.save_params_to_files(str(tmp_path / "models" / "wdl"), 9)
    assert sorted(os.listdir(sparse)) == ["emb_vector", "key"]
    assert os.path.exists(str(tmp_path / "models" / "wdl_dense_9.model"))
    assert not os.path.exists(str(tmp_path / "models" / "wdl0_sparse_9.model"))
    saved = np.fromfile(os.path.join(sparse, "key"), "<i8")
    assert np.array_equal(np.sort(saved), tk)
    # incremental training: a new model on the existing sparse model starts from the saved table
    etc2 = hugectr.CreateETC(ps_types=[hugectr.TrainPSType_t.Staged], sparse_models=[sparse])
    m2 = _model(sources[:1], keysets[:1], evl, etc2, seed=11)
    for a, b in zip(_table(m2), (tk, tv)):
        np.testing.assert_array_equal(a, b)


def test_low_level_loop_and_a_cached_parameter_server(cpu, tmp_path):
    """HugeCTR's wdl_etc_low_level.py pattern; the Cached PS (a tiered table on local_paths) trains like
    the Staged one."""
    parts, evl = _data(str(tmp_path), parts=2)
    results = []
    for ps in (hugectr.TrainPSType_t.Staged, hugectr.TrainPSType_t.Cached):
        etc = hugectr.CreateETC(
            ps_types=[ps],
            sparse_models=[str(tmp_path / f"sparse_{ps.name}")],
            local_paths=[str(tmp_path)],
            hmem_cache_configs=[hugectr.CreateHMemCache(2, 0.5, 0)],
        )
        m = _model([parts[0][0]], [parts[0][1]], evl, etc)
        reader, cache = m.get_data_reader_train(), m.get_embedding_training_cache()
        losses = []
        for file_list, keyset in parts:
            reader.set_source(file_list)
            cache.update(keyset)
            while m.train():
                losses.append(m.get_current_loss())
        assert len(losses) == 6
        results.append((losses, _table(m)))
        with pytest.raises(ValueError, match="2 keyset files for 1 embeddings"):
            cache.update([parts[0][1], parts[1][1]])
        with pytest.raises(FileNotFoundError, match="nope.keyset"):
            cache.update(str(tmp_path / "nope.keyset"))
    (l1, t1), (l2, t2) = results
    np.testing.assert_allclose(l1, l2, rtol=0, atol=1e-6)
    for a, b in zip(t1, t2):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_etc_only_methods_and_the_epoch_set_source(cpu, tmp_path):
    parts, evl = _data(str(tmp_path), parts=1)
    m = _model([parts[0][0]], [], evl)
    with pytest.raises(ModelError, match="only supported with the embedding training cache"):
        m.get_incremental_model()
    with pytest.raises(ModelError, match="no embedding training cache"):
        m.get_embedding_training_cache()
    with pytest.raises(ModelError, match="keyset files are for the embedding training cache"):
        m.set_source(source=parts[0][0], keyset=[parts[0][1]], eval_source=evl)
    m.set_source(parts[0][0], evl)  # HugeCTR's epoch-mode form, positionally
    assert m.reader_params.source == [parts[0][0]]


@pytest.mark.mpi
@needs_mpi
def test_etc_under_mpiexec_equals_one_rank(tmp_path):
    """tests/mpi/etc_run.py on 1 and 2 ranks: the same dense weights and saved table (to float32 rounding); each rank's incremental
    model is its own keys (together all of them); the second model loads the whole saved table."""
    import subprocess
    import sys
    from tests.mpi_util import MPIEXEC

    _data(str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    got = {}
    for ranks in (1, 2):
        out = tmp_path / f"r{ranks}"
        out.mkdir()
        cmd = [
            MPIEXEC,
            "-n",
            str(ranks),
            sys.executable,
            os.path.join(os.path.dirname(__file__), "mpi", "etc_run.py"),
            str(tmp_path),
            str(out),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, f"mpiexec -n {ranks} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        got[ranks] = dict(np.load(out / "result.npz"))
        assert not [p for p in os.listdir(out) if p.startswith("numbactr_etc_")]  # scratch removed
    one, two = got[1], got[2]
    assert not one["cached_warned"][0] and two["cached_warned"][0]
    np.testing.assert_array_equal(two["saved_keys"], one["saved_keys"])
    for k in ("weights", "saved_vecs"):  # the dense gradients are summed over the ranks in another order
        np.testing.assert_allclose(two[k], one[k], rtol=1e-4, atol=1e-6, err_msg=k)
    for g in (one, two):
        np.testing.assert_array_equal(g["loaded_keys"], g["saved_keys"])
        np.testing.assert_array_equal(g["loaded_vecs"], g["saved_vecs"])
    assert two["n_inc"].size == 2 and two["n_inc"].sum() == one["n_inc"].sum() == one["saved_keys"].size
