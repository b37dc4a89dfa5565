"""Snapshots of another model are refused (numbactr.files.checkpoint): the manifest records the dense layers'
parameter shapes, the optimizer types and each sparse folder's embedding name, and loading checks them
against the model (not only the value count); files without a manifest, and manifests written before
these records existed, load as before."""

import json
import os

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.files import checkpoint
from numbactr.data.errors import DataFormatError
from tests.model_util import tiny_data

L, O = hugectr.Layer_t, hugectr.Optimizer_t


def _model(tr, ev, fc=(3, 5), optimizer=O.Adam, sparse_optimizer=O.Adam, split=None, seed=0):
    """tiny_data's 3 slots (12 embedding values + 2 dense = 14 inputs) into InnerProducts 14->fc[0]->fc[1]->1.
    fc (3, 5) and (2, 10) both have 71 parameters. split=(a, b): two embeddings "wide" (a slots) and
    "deep" (b slots) of the same width instead of one "emb"."""
    solver = hugectr.CreateSolver(
        batchsize=64, batchsize_eval=64, max_eval_batches=2, lr=0.01, vvgpu=[[0]], i64_input_key=True, seed=seed
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[tr], eval_source=ev, check_type=hugectr.Check_t.Sum
    )
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer(optimizer_type=optimizer))
    tables = [("emb", 3)] if split is None else [("wide", split[0]), ("deep", split[1])]
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam(n + "_in", 1, True, s) for n, s in tables],
        )
    )
    for name, _ in tables:
        m.add(
            hugectr.SparseEmbedding(
                embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
                workspace_size_per_gpu_in_mb=1,
                embedding_vec_size=4,
                combiner="sum",
                sparse_embedding_name=name,
                bottom_name=name + "_in",
                optimizer=hugectr.CreateOptimizer(optimizer_type=sparse_optimizer),
            )
        )
    D = hugectr.DenseLayer
    for name, s in tables:
        m.add(D(L.Reshape, [name], [name + "_flat"], leading_dim=4 * s))
    for layer in [
        D(L.Concat, [n + "_flat" for n, _ in tables] + ["dense"], ["cat"]),
        D(L.InnerProduct, ["cat"], ["fa"], num_output=fc[0]),
        D(L.InnerProduct, ["fa"], ["fb"], num_output=fc[1]),
        D(L.InnerProduct, ["fb"], ["fc"], num_output=1),
        D(L.BinaryCrossEntropyLoss, ["fc", "label"], ["loss"]),
    ]:
        m.add(layer)
    m.compile()
    return m


def _trained(tmp_path, it=3, **kw):
    tr, ev = tiny_data(str(tmp_path), n_train=256, n_eval=128)
    a = _model(tr, ev, **kw)
    for _ in range(it):
        a.train()
    prefix = str(tmp_path / "A")
    a.save_params_to_files(prefix, it)
    return a, prefix, tr, ev


def _strip_manifest(prefix: str, it: int, *keys) -> None:
    """Rewrite the manifest as an older numbactr wrote it: without ``keys`` (top level, or "embeddings.K"
    in each embedding record), its own sha256 recomputed."""
    path = f"{prefix}_{it}.manifest.json"
    with open(path) as f:
        body = json.load(f)
    body.pop("manifest_sha256")
    for k in keys:
        if k.startswith("embeddings."):
            for r in body["embeddings"]:
                r.pop(k.split(".", 1)[1])
        else:
            body.pop(k)
    with open(path, "wb") as f:
        f.write(checkpoint._manifest_bytes(body))


# ---- dense weights: shapes, not only the count --------------------------------------------------
def test_dense_weights_of_another_model_with_the_same_count_are_refused(tmp_path, cpu):
    a, prefix, tr, ev = _trained(tmp_path)
    b = _model(tr, ev, fc=(2, 10))
    assert a.n_params == b.n_params == 71
    before = np.array(b.weights)
    with pytest.raises(
        DataFormatError,
        match=r"A_dense_3\.model.*another model.*InnerProduct 'fa'.*"
        r"\(14, 3\), \(3,\).*\(14, 2\), \(2,\)",
    ) as err:
        b.load_dense_weights(prefix + "_dense_3.model")
    assert "A_3.manifest.json" in str(err.value)
    with pytest.raises(DataFormatError, match=r"A_opt_dense_3\.model.*another model.*'fa'.*\(14, 3\).*\(14, 2\)"):
        b.load_dense_optimizer_states(prefix + "_opt_dense_3.model")
    np.testing.assert_array_equal(b.weights, before)  # nothing changed
    c = _model(tr, ev, seed=5)  # the same architecture loads
    c.load_dense_weights(prefix + "_dense_3.model")
    c.load_dense_optimizer_states(prefix + "_opt_dense_3.model")
    np.testing.assert_array_equal(c.weights, a.weights)


def test_the_manifest_records_each_dense_layers_shapes(tmp_path, cpu):
    _, prefix, _, _ = _trained(tmp_path)
    with open(prefix + "_3.manifest.json") as f:
        dense = json.load(f)["dense"]
    assert dense["file"] == "A_dense_3.model" and dense["opt_file"] == "A_opt_dense_3.model"
    assert dense["optimizer"] == "Adam" and dense["states"] == 2
    assert dense["layers"] == [
        {"name": "fa", "type": "InnerProduct", "shapes": [[14, 3], [3]]},
        {"name": "fb", "type": "InnerProduct", "shapes": [[3, 5], [5]]},
        {"name": "fc", "type": "InnerProduct", "shapes": [[5, 1], [1]]},
    ]


def test_without_a_manifest_or_with_an_older_one_only_the_count_is_checked(tmp_path, cpu):
    a, prefix, tr, ev = _trained(tmp_path)
    _strip_manifest(prefix, 3, "dense")  # an older manifest: no shapes recorded
    b = _model(tr, ev, fc=(2, 10))
    b.load_dense_weights(prefix + "_dense_3.model")  # today's behaviour: the count fits
    np.testing.assert_array_equal(b.weights, a.weights)
    os.remove(prefix + "_3.manifest.json")  # HugeCTR's own files: raw float32
    c = _model(tr, ev, fc=(2, 10), seed=3)
    c.load_dense_weights(prefix + "_dense_3.model")
    c.load_dense_optimizer_states(prefix + "_opt_dense_3.model")
    np.testing.assert_array_equal(c.weights, a.weights)


def test_the_optimizer_state_file_is_not_taken_for_the_dense_model(tmp_path, cpu):
    """One state array (MomentumSGD) has exactly the dense model's size."""
    _, prefix, tr, ev = _trained(tmp_path, optimizer=O.MomentumSGD)
    b = _model(tr, ev, optimizer=O.MomentumSGD)
    with pytest.raises(DataFormatError, match=r"A_opt_dense_3\.model.*dense optimizer states.*not its dense model"):
        b.load_dense_weights(prefix + "_opt_dense_3.model")
    with pytest.raises(DataFormatError, match=r"A_dense_3\.model.*dense model.*not its dense optimizer states"):
        b.load_dense_optimizer_states(prefix + "_dense_3.model")


def test_inference_refuses_the_dense_model_of_another_model(tmp_path, cpu):
    from numbactr.inference import InferenceModel, InferenceParams

    _, prefix, tr, ev = _trained(tmp_path)
    _model(tr, ev, fc=(2, 10)).graph_to_json(str(tmp_path / "b.json"))
    p = InferenceParams(
        model_name="b",
        max_batchsize=64,
        hit_rate_threshold=1.0,
        dense_model_file=prefix + "_dense_3.model",
        sparse_model_files=[prefix + "0_sparse_3.model"],
        use_gpu_embedding_cache=False,
        cache_size_percentage=0.5,
        i64_input_key=True,
    )
    with pytest.raises(DataFormatError, match=r"A_dense_3\.model.*'fa'.*\(14, 3\).*\(14, 2\)"):
        InferenceModel(str(tmp_path / "b.json"), p)


# ---- optimizer types ----------------------------------------------------------------------------
def test_dense_states_of_another_optimizer_are_refused(tmp_path, cpu):
    """Adam (m, v) and Ftrl (z, n) both keep two arrays of the same size."""
    _, prefix, tr, ev = _trained(tmp_path)
    b = _model(tr, ev, optimizer=O.Ftrl)
    before = [np.array(s) for s in b.dense_optimizer.states]
    with pytest.raises(
        DataFormatError,
        match=r"A_opt_dense_3\.model.*Adam optimizer states.*A_3\.manifest\.json"
        r".*dense optimizer is Ftrl",
    ):
        b.load_dense_optimizer_states(prefix + "_opt_dense_3.model")
    for s, old in zip(b.dense_optimizer.states, before):
        np.testing.assert_array_equal(s, old)
    _strip_manifest(prefix, 3, "dense")  # older manifest: only the count
    b.load_dense_optimizer_states(prefix + "_opt_dense_3.model")


def test_sparse_states_of_another_optimizer_are_refused(tmp_path, cpu):
    """MomentumSGD and AdaGrad both keep one array per row."""
    _, prefix, tr, ev = _trained(tmp_path, sparse_optimizer=O.MomentumSGD)
    b = _model(tr, ev, sparse_optimizer=O.AdaGrad)
    b.load_sparse_weights([prefix + "0_sparse_3.model"])
    with pytest.raises(
        DataFormatError,
        match=r"A0_opt_sparse_3\.model.*MomentumSGD optimizer states.*"
        r"'emb' is trained with AdaGrad",
    ):
        b.load_sparse_optimizer_states([prefix + "0_opt_sparse_3.model"])
    _strip_manifest(prefix, 3, "embeddings.optimizer")
    b.load_sparse_optimizer_states([prefix + "0_opt_sparse_3.model"])


# ---- sparse folders: matched by embedding name ----------------------------------------------------
def test_sparse_folders_in_the_wrong_order_are_refused(tmp_path, cpu):
    a, prefix, tr, ev = _trained(tmp_path, split=(2, 1))
    wide, deep = prefix + "0_sparse_3.model", prefix + "1_sparse_3.model"
    b = _model(tr, ev, split=(2, 1))
    with pytest.raises(DataFormatError, match=r"A1_sparse_3\.model.*embedding 'deep'.*not of 'wide'"):
        b.load_sparse_weights([deep, wide])
    assert b.embeddings[0].table.size == 0 and b.embeddings[1].table.size == 0  # nothing loaded
    b.load_sparse_weights([wide, deep])
    b.load_sparse_weights({"deep": deep, "wide": wide})
    for x, y in zip(a.embeddings, b.embeddings):
        assert sorted(x.dump()[0]) == sorted(y.dump()[0])
    with pytest.raises(DataFormatError, match=r"A1_opt_sparse_3\.model.*embedding 'deep'.*not of 'wide'"):
        b.load_sparse_optimizer_states([prefix + "1_opt_sparse_3.model", prefix + "0_opt_sparse_3.model"])
    b.load_sparse_optimizer_states([prefix + "0_opt_sparse_3.model", prefix + "1_opt_sparse_3.model"])


def test_a_dict_names_its_target_and_a_renamed_embedding_loads(tmp_path, cpu):
    """A dict says which embedding takes which folder (HugeCTR loads it so, whatever the folder's origin); a
    list matches by position, and a folder saved from an embedding this model does not have (a renamed one)
    loads there, as in HugeCTR: only another embedding of this model's own name is taken for a wrong order."""
    a, prefix, tr, ev = _trained(tmp_path, split=(2, 1))
    wide, deep = prefix + "0_sparse_3.model", prefix + "1_sparse_3.model"
    b = _model(tr, ev, split=(2, 1))
    b.load_sparse_weights({"wide": deep, "deep": wide})
    assert sorted(b.embeddings[0].dump()[0]) == sorted(a.embeddings[1].dump()[0])
    b.load_sparse_optimizer_states({"wide": prefix + "1_opt_sparse_3.model", "deep": prefix + "0_opt_sparse_3.model"})
    one, one_prefix, tr1, ev1 = _trained(tmp_path / "one")
    renamed = _model(tr1, ev1)
    renamed.embeddings[0].name = "emb_renamed"
    for files in ([one_prefix + "0_sparse_3.model"], {"emb_renamed": one_prefix + "0_sparse_3.model"}):
        renamed.load_sparse_weights(files)
        assert sorted(renamed.embeddings[0].dump()[0]) == sorted(one.embeddings[0].dump()[0])
    renamed.load_sparse_optimizer_states([one_prefix + "0_opt_sparse_3.model"])


def test_sparse_folders_without_names_load_in_the_order_given(tmp_path, cpu):
    """Without a manifest (HugeCTR's files) nothing says which embedding a folder holds: as before."""
    _, prefix, tr, ev = _trained(tmp_path, split=(2, 1))
    os.remove(prefix + "_3.manifest.json")
    b = _model(tr, ev, split=(2, 1))
    b.load_sparse_weights([prefix + "1_sparse_3.model", prefix + "0_sparse_3.model"])
    assert set(b.embeddings[0].dump()[0]) == set(range(12, 18))  # "deep"'s keys: the files decide


# ---- smaller argument checks --------------------------------------------------------------------------
def test_non_integral_iteration_is_refused(tmp_path, cpu):
    tr, ev = tiny_data(str(tmp_path), n_train=128, n_eval=64)
    m = _model(tr, ev)
    for bad in (2.5, 2.0, "3", True):
        with pytest.raises(TypeError, match=r"iter must be an integer"):
            m.save_params_to_files(str(tmp_path / "ck"), bad)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ck")]
    with pytest.raises(ValueError, match=r"iter must be >= 0"):
        m.save_params_to_files(str(tmp_path / "ck"), -1)
    m.save_params_to_files(str(tmp_path / "ck"), np.int64(4))
    assert os.path.exists(str(tmp_path / "ck_dense_4.model"))


def test_a_single_folder_string_is_refused_with_a_clear_message(tmp_path, cpu):
    """HugeCTR's binding takes List[str] or Dict[str, str]; a str is neither."""
    _, prefix, tr, ev = _trained(tmp_path)
    b = _model(tr, ev)
    with pytest.raises(TypeError, match=r"load_sparse_weights: expects a list of sparse model folders.*\['emb'\]"):
        b.load_sparse_weights(prefix + "0_sparse_3.model")
    with pytest.raises(TypeError, match=r"load_sparse_optimizer_states: expects a list of sparse optimizer-state"):
        b.load_sparse_optimizer_states(prefix + "0_opt_sparse_3.model")
