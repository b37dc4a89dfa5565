"""Bad input an audit found accepted silently (or refused with an unclear error), now refused clearly.

Each case: what a user could write, and the error that names what and where. (The snapshot cases are in
tests/test_snapshot_mismatch.py.)"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.data.errors import DataFormatError
from numbactr.data.file_list import write_file_list
from numbactr.data.norm import write_norm_file
from numbactr.data.parquet import ParquetDatasetWriter
from numbactr.model import ModelError

from .model_util import tiny_data, tiny_dlrm


# API surface and input checks, nothing device-specific: on the cpu device (the session's simulator would run
# every training step's kernels as Python threads, ~30 s a test)
pytestmark = pytest.mark.usefixtures("cpu")

L = hugectr.Layer_t


def _norm_list(folder, label, dense, keys, key_dtype=np.int64):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "part0.data")
    write_norm_file(path, label, dense, keys, key_dtype=key_dtype)
    lst = os.path.join(folder, "_file_list.txt")
    write_file_list(lst, [path])
    return lst


def _model(
    train,
    evl,
    *,
    fmt=hugectr.DataReaderType_t.Norm,
    nnz=1,
    reader_kw=None,
    solver_kw=None,
    loss=L.BinaryCrossEntropyLoss,
    label_dim=1,
    slots=3,
):
    kw = dict(batchsize=32, batchsize_eval=32, max_eval_batches=2, lr=0.01, vvgpu=[[0]], i64_input_key=True)
    kw.update(solver_kw or {})
    solver = hugectr.CreateSolver(**kw)
    reader = hugectr.DataReaderParams(
        data_reader_type=fmt, source=[train], eval_source=evl, check_type=hugectr.Check_t.Sum, **(reader_kw or {})
    )
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.Adam))
    m.add(
        hugectr.Input(
            label_dim=label_dim,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", nnz, nnz == 1, slots)],
        )
    )
    m.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=4,
            combiner="sum",
            sparse_embedding_name="emb",
            bottom_name="data1",
        )
    )
    m.add(hugectr.DenseLayer(L.Reshape, ["emb"], ["flat"], leading_dim=slots * 4))
    m.add(hugectr.DenseLayer(L.Concat, ["flat", "dense"], ["cat"]))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["cat"], ["fc"], num_output=2 if loss == L.CrossEntropyLoss else 1))
    m.add(hugectr.DenseLayer(loss, ["fc", "label"], ["loss"]))
    m.compile()
    return m


def _data(n, seed=0, slots=3):
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 6, (n, slots)) + np.arange(slots) * 6
    return (rng.random(n) < 0.5).astype(np.float32), rng.normal(0, 1, (n, 2)).astype(np.float32), keys


def test_epoch_mode_with_an_empty_eval_source_is_an_error_not_a_hang(tmp_path):
    y, x, k = _data(128)
    train = _norm_list(str(tmp_path / "train"), y, x, k)
    empty = _norm_list(str(tmp_path / "eval"), y[:0], x[:0], k[:0])
    m = _model(train, empty, solver_kw=dict(repeat_dataset=False))
    box = {}

    def fit():
        try:
            m.fit(num_epochs=1, display=100, eval_interval=2)
        except BaseException as e:  # noqa: BLE001 (handed to the test thread)
            box["error"] = e

    t = threading.Thread(target=fit, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "fit hung on an eval source without samples"
    assert isinstance(box.get("error"), ModelError)
    assert "eval source" in str(box["error"]) and "no samples" in str(box["error"])


def test_epoch_mode_with_an_empty_training_source_is_an_error(tmp_path):
    y, x, k = _data(128)
    empty = _norm_list(str(tmp_path / "train"), y[:0], x[:0], k[:0])
    evl = _norm_list(str(tmp_path / "eval"), y, x, k)
    m = _model(empty, evl, solver_kw=dict(repeat_dataset=False))
    with pytest.raises(ModelError, match="epoch 0 trained nothing.*holds no samples"):
        m.fit(num_epochs=2, display=100, eval_interval=100)


def test_epoch_mode_with_fewer_samples_than_a_batch_trains_nothing_as_hugectr(tmp_path, capsys):
    """20 samples, batch 32, drop_incomplete_batch (the default): HugeCTR drops the partial batch and trains
    nothing; not an error (the source has samples), but a warning that says why; without dropping, they train."""
    y, x, k = _data(128)
    small = _norm_list(str(tmp_path / "train"), y[:20], x[:20], k[:20])
    evl = _norm_list(str(tmp_path / "eval"), y, x, k)
    m = _model(small, evl, solver_kw=dict(repeat_dataset=False))
    m.fit(num_epochs=2, display=100, eval_interval=100)
    assert m.step == 0
    err = capsys.readouterr().err
    assert "epoch 0 trained nothing" in err and "holds 20 samples, fewer than one batch (32)" in err
    keep = _model(small, evl, solver_kw=dict(repeat_dataset=False, drop_incomplete_batch=False))
    keep.fit(num_epochs=2, display=100, eval_interval=100)
    assert keep.step == 2


def test_learning_rate_setters_refuse_negative_and_non_finite_rates(tmp_path):
    m = tiny_dlrm(*tiny_data(str(tmp_path), n_train=128, n_eval=64, files=1))
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="set_learning_rate: lr must"):
            m.set_learning_rate(bad)
    m.set_learning_rate(0.0)  # zero is a rate (a frozen step), accepted
    with pytest.raises(ValueError, match="base_lr must lie in"):
        m.reset_learning_rate_scheduler(base_lr=-1.0)
    with pytest.raises(ValueError, match="end_lr must lie in"):
        m.reset_learning_rate_scheduler(base_lr=0.1, end_lr=-5.0)
    with pytest.raises(ValueError, match="decay_start must lie in"):
        m.reset_learning_rate_scheduler(base_lr=0.1, decay_start=-7)
    with pytest.raises(ValueError, match="base_lr must be finite"):
        m.reset_learning_rate_scheduler(base_lr=float("nan"))
    m.reset_learning_rate_scheduler(base_lr=0.1, warmup_steps=2, decay_start=3, decay_steps=2, end_lr=0.01)
    assert [round(m.get_learning_rate_scheduler().get_next(), 6) for _ in range(3)] == [0.05, 0.1, 0.1]


def test_norm_samples_with_more_keys_than_their_sparse_param_holds_are_an_error(tmp_path):
    y, x, k = _data(64)
    multi = [np.stack([k[:, s]] * 3, 1) for s in range(3)]  # three keys in every slot: 9 a sample
    lst = _norm_list(str(tmp_path / "d"), y, x, multi)
    m = _model(lst, lst, nnz=2)  # holds 3 x 2 = 6 a sample
    with pytest.raises(
        DataFormatError,
        match=r"record 0: 9 keys in sparse input 0 \(per slot: 3, 3, 3\), but "
        r"its DataReaderSparseParam holds at most 6 a sample",
    ):
        m.fit(max_iter=2, display=100, eval_interval=100)
    ok = _model(lst, lst, nnz=3)  # declared as three: fine
    ok.fit(max_iter=2, display=100, eval_interval=100)


def test_a_norm_slot_may_hold_more_than_its_own_nnz_per_slot_as_in_hugectr(tmp_path):
    """HugeCTR's Norm reader bounds a sample's keys by the sum of nnz_per_slot, not each slot by its own: 3 +
    1 + 1 keys with nnz_per_slot 2 each (5 <= 6) train."""
    y, x, k = _data(64)
    uneven = [np.stack([k[:, 0]] * 3, 1), k[:, 1:2], k[:, 2:3]]
    lst = _norm_list(str(tmp_path / "d"), y, x, uneven)
    m = _model(lst, lst, nnz=2)
    m.fit(max_iter=2, display=100, eval_interval=100)
    assert m.step == 2


def test_parquet_keys_past_their_slot_size_are_an_error_for_hash_tables_too(tmp_path):
    n = 64
    y, x, k = _data(n)
    local = k - np.arange(3) * 6  # per-slot ids in [0, 6)
    local[5, 0] = 9  # past slot 0's size 6: slot 1's id 3
    w = ParquetDatasetWriter(str(tmp_path / "pq"), 1, 2, 3)
    w.write_file("part0.parquet", y, x, [local[:, s] for s in range(3)])
    lst = w.close()
    m = _model(lst, lst, fmt=hugectr.DataReaderType_t.Parquet, reader_kw=dict(slot_size_array=[6, 6, 6]))
    with pytest.raises(
        DataFormatError,
        match=r"record 5: key 9 of sparse input 0 slot 0 is outside slot "
        r"0's range \[0, 6\) of DataReaderParams.slot_size_array",
    ):
        m.fit(max_iter=2, display=100, eval_interval=100)


def test_input_label_weights_are_checked():
    sp = [hugectr.DataReaderSparseParam("data1", 1, True, 3)]
    with pytest.raises(ValueError, match=r"label_weights has 2 weight\(s\) but there are 1 label"):
        hugectr.Input(
            label_dims=[1], label_names=["y"], dense_dim=2, label_weights=[5.0, 7.0], data_reader_sparse_param_array=sp
        )
    with pytest.raises(ValueError, match=r"label_weights\[0\] must lie in"):
        hugectr.Input(
            label_dims=[1], label_names=["y"], dense_dim=2, label_weights=[-1.0], data_reader_sparse_param_array=sp
        )
    with pytest.raises(ValueError, match=r"label_weights\[1\] must be finite"):
        hugectr.Input(
            label_dims=[1, 1],
            label_names=["a", "b"],
            dense_dim=2,
            label_weights=[1.0, float("nan")],
            data_reader_sparse_param_array=sp,
        )
    assert hugectr.Input(
        label_dims=[1, 1],
        label_names=["a", "b"],
        dense_dim=2,
        label_weights=[0.5, 2],
        data_reader_sparse_param_array=sp,
    ).label_weights == [0.5, 2]


def test_create_solver_refuses_strings_for_yes_no_options_and_unknown_lr_policies():
    for name in ("repeat_dataset", "i64_input_key", "use_mixed_precision"):
        with pytest.raises(ValueError, match=f"CreateSolver: {name} must be True or False, got 'False'"):
            hugectr.CreateSolver(batchsize=8, **{name: "False"})
    s = hugectr.CreateSolver(batchsize=8, i64_input_key=np.bool_(True), repeat_dataset=1)
    assert s.i64_input_key is not None and s.repeat_dataset
    with pytest.raises(ValueError, match="lr_policy must be a hugectr.LrPolicy_t"):
        hugectr.CreateSolver(batchsize=8, lr_policy="poly")
    assert hugectr.CreateSolver(batchsize=8, lr_policy=hugectr.LrPolicy_t.fixed).lr_policy == hugectr.LrPolicy_t.fixed


def test_slot_sizes_must_be_whole_numbers():
    T = hugectr.DataReaderType_t
    with pytest.raises(ValueError, match=r"slot_size_array\[1\] must be a whole number >= 0, got 2.7"):
        hugectr.DataReaderParams(
            data_reader_type=T.Parquet,
            source=["a"],
            eval_source="b",
            check_type=hugectr.Check_t.Non,
            slot_size_array=[3, 2.7],
        )
    assert hugectr.DataReaderParams(
        data_reader_type=T.Parquet,
        source=["a"],
        eval_source="b",
        check_type=hugectr.Check_t.Non,
        slot_size_array=[3, 2.0],
    ).slot_size_array == [3, 2]
    with pytest.raises(ValueError, match=r"SparseEmbedding 'e': slot_size_array\[0\] must be a whole number"):
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.LocalizedSlotSparseEmbeddingOneHot,
            embedding_vec_size=4,
            sparse_embedding_name="e",
            bottom_name="d",
            slot_size_array=[1.5],
        )


def test_sparse_embedding_arguments_of_the_wrong_type_are_named():
    E = hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash
    kw = dict(embedding_type=E, embedding_vec_size=4, sparse_embedding_name="emb", bottom_name="d")
    with pytest.raises(ValueError, match=r"SparseEmbedding 'emb': optimizer must be a hugectr.CreateOptimizer"):
        hugectr.SparseEmbedding(workspace_size_per_gpu_in_mb=1, optimizer="adam", **kw)
    with pytest.raises(ValueError, match=r"workspace_size_per_gpu_in_mb must be a number, got '8'"):
        hugectr.SparseEmbedding(workspace_size_per_gpu_in_mb="8", **kw)
    with pytest.raises(ValueError, match=r"workspace_size_per_gpu_in_mb must be finite"):
        hugectr.SparseEmbedding(workspace_size_per_gpu_in_mb=float("inf"), **kw)
    opt = hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.SGD)
    assert hugectr.SparseEmbedding(workspace_size_per_gpu_in_mb=1, optimizer=opt, **kw).optimizer is opt


def test_a_bool_for_a_count_is_refused():
    with pytest.raises(
        ValueError,
        match=r"DenseLayer InnerProduct \['fc'\]: num_output must be an integer, "
        r"got True",
    ):
        hugectr.DenseLayer(L.InnerProduct, ["x"], ["fc"], num_output=True)
    assert hugectr.DenseLayer(L.InnerProduct, ["x"], ["fc"], num_output=3).num_output == 3


def test_fit_arguments_must_be_integers(tmp_path):
    m = tiny_dlrm(*tiny_data(str(tmp_path), n_train=128, n_eval=64, files=1))
    with pytest.raises(ValueError, match="fit: max_iter must be an integer, got '5'"):
        m.fit(max_iter="5", display=1, eval_interval=100)
    with pytest.raises(ValueError, match="fit: eval_interval must be an integer"):
        m.fit(max_iter=5, display=1, eval_interval=2.5)


def test_negative_target_weights_are_refused(tmp_path):
    y, x, k = _data(64)
    lst = _norm_list(str(tmp_path / "d"), np.stack([y, y], 1), x, k)
    solver = hugectr.CreateSolver(batchsize=32, batchsize_eval=32, max_eval_batches=1, vvgpu=[[0]], i64_input_key=True)
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[lst], eval_source=lst, check_type=hugectr.Check_t.Sum
    )
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer())
    m.add(
        hugectr.Input(
            label_dim=2,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 3)],
        )
    )
    m.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc"], num_output=2))
    with pytest.raises(ModelError, match=r"MultiCrossEntropyLoss .*target_weight_vec must be finite and >= 0"):
        m.add(hugectr.DenseLayer(L.MultiCrossEntropyLoss, ["fc", "label"], ["loss"], target_weight_vec=[1.0, -0.5]))


def test_cross_entropy_reads_float_labels_as_hugectr_does(tmp_path):
    """HugeCTR's CrossEntropyLoss takes class 1 for a label >= 0.5 (its DataGenerator writes float labels);
    labels outside [0, 1] are still an error."""
    y, x, k = _data(64)
    y = np.random.default_rng(3).random(64).astype(np.float32)  # floats in [0, 1)
    lst = _norm_list(str(tmp_path / "d"), y, x, k)
    m = _model(lst, lst, loss=L.CrossEntropyLoss)
    m.fit(max_iter=2, display=100, eval_interval=100)
    y[7] = 1.5
    bad = _norm_list(str(tmp_path / "bad"), y, x, k)
    m = _model(bad, bad, loss=L.CrossEntropyLoss)
    with pytest.raises(DataFormatError, match=r"record 7.*label\[0\] = 1.5 must lie in \[0, 1\]"):
        m.fit(max_iter=2, display=100, eval_interval=100)


def test_a_key_width_mismatch_says_so(tmp_path):
    y, x, k = _data(64)
    lst = _norm_list(str(tmp_path / "d"), y, x, k, key_dtype=np.uint32)  # 32-bit keys in the file
    m = _model(lst, lst)  # i64_input_key=True
    with pytest.raises(DataFormatError, match=r"keys are read as 64-bit \(CreateSolver\(i64_input_key=True\)\)"):
        m.fit(max_iter=2, display=100, eval_interval=100)
