"""HugeCTR's key convention for one-hot Raw data (spec §5.4): per-slot keys in [0, size_k), the offsets added by
the embedding (LocalizedSlotSparseEmbeddingOneHot's do_unique_key, HybridSparseEmbedding's
data_to_unique_categories). Both of NVIDIA's flows, on data written the way HugeCTR's tools write it:

  1. hugectr.tools.DataGenerator(Raw) then a RawAsync reader and a HybridSparseEmbedding (samples/dlrm/dgx_a100.py's
     structure, tiny sizes);
  2. Raw files as tools/dlrm_script/dlrm_raw writes them (int32 label, 13 int32 counts, 26 int32 per-slot
     category ids) and LocalizedSlotSparseEmbeddingOneHot (samples/dlrm/dlrm_kaggle_fp32.py's structure, tiny).

Each checks that training runs and that the rows it changed are exactly the rows k + Σ_{j<s} size_j of the
keys k the data holds in slot s: no slot reads another slot's rows, and a snapshot's keys are those rows.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.data.errors import DataFormatError
from numbactr.data.raw import write_raw_file

L = hugectr.Layer_t


def _changed_rows(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    return np.flatnonzero((before != after).any(axis=1))


def _expected_rows(keys: np.ndarray, sizes) -> np.ndarray:
    """Rows the per-slot keys (n, S) read: key + the offset of its slot."""
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return np.unique(keys + offsets)


def _solver(batch, **kw):
    return hugectr.CreateSolver(
        batchsize=batch, batchsize_eval=batch, max_eval_batches=2, lr=0.5, vvgpu=[[0]], repeat_dataset=True, **kw
    )


def test_data_generator_raw_then_raw_async_and_hybrid_embedding(cpu, tmp_path):
    """Flow 1: the generator writes per-slot keys; RawAsync + HybridSparseEmbedding trains on them."""
    sizes = [7, 3, 40, 11, 5, 23]
    n, batch = 1024, 64
    params = hugectr.tools.DataGeneratorParams(
        format=hugectr.DataReaderType_t.Raw,
        label_dim=1,
        dense_dim=13,
        num_slot=len(sizes),
        i64_input_key=False,
        source=str(tmp_path / "train_data.bin"),
        eval_source=str(tmp_path / "test_data.bin"),
        slot_size_array=sizes,
        nnz_array=[1] * len(sizes),
        check_type=hugectr.Check_t.Non,
        dist_type=hugectr.Distribution_t.PowerLaw,
        power_law_type=hugectr.PowerLaw_t.Short,
        num_samples=n,
        eval_num_samples=256,
        float_label_dense=False,  # int32 label and dense: the one-hot RawAsync layout
    )
    hugectr.tools.DataGenerator(params).generate()
    keys = np.fromfile(params.source, "<i4").reshape(n, 1 + 13 + len(sizes))[:, 14:]
    assert (keys >= 0).all() and (keys < sizes).all()  # HugeCTR's layout: per-slot ids

    threads, per_thread = 2, 2
    bytes_per_batch = (len(sizes) + 1 + 13) * 4 * batch
    with pytest.warns(hugectr.IgnoredArgumentWarning, match="slot_size_array"):  # as the sample passes it
        reader = hugectr.DataReaderParams(
            data_reader_type=hugectr.DataReaderType_t.RawAsync,
            source=[params.source],
            eval_source=params.eval_source,
            check_type=hugectr.Check_t.Non,
            num_samples=n,
            eval_num_samples=256,
            slot_size_array=sizes,
            async_param=hugectr.AsyncParam(
                threads,
                per_thread,
                per_thread * (bytes_per_batch // (batch * 10) + 2),
                2,
                512,
                False,
                hugectr.Alignment_t.Auto,
                multi_hot_reader=False,
                is_dense_float=False,
            ),
        )
    opt = hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.SGD, update_type=hugectr.Update_t.Local)
    model = hugectr.Model(_solver(batch, num_iterations_statistics=4), reader, opt)
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=13,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, len(sizes))],
        )
    )
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.HybridSparseEmbedding,
            workspace_size_per_gpu_in_mb=1,
            slot_size_array=sizes,
            embedding_vec_size=8,
            combiner="sum",
            sparse_embedding_name="sparse_embedding1",
            bottom_name="data1",
            optimizer=opt,
            hybrid_embedding_param=hugectr.HybridEmbeddingParam(
                1000,
                -1,
                0.03,
                1.3e11,
                2.6e11,
                1.0,
                hugectr.CommunicationType.NVLink_SingleNode,
                hugectr.HybridEmbeddingType.Distributed,
            ),
        )
    )
    model.add(hugectr.DenseLayer(L.MLP, ["dense"], ["mlp1"], num_outputs=[16, 8], act_type=hugectr.Activation_t.Relu))
    model.add(hugectr.DenseLayer(L.Interaction, ["mlp1", "sparse_embedding1"], ["interaction1"]))
    model.add(
        hugectr.DenseLayer(
            L.MLP,
            ["interaction1"],
            ["mlp2"],
            num_outputs=[16, 1],
            activations=[hugectr.Activation_t.Relu, hugectr.Activation_t.Non],
        )
    )
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["mlp2", "label"], ["loss"]))
    model.compile()
    emb = model.embeddings[0]
    before = emb.dump()[1].copy()
    model.fit(max_iter=16, display=8, eval_interval=8, snapshot=0)  # 16 batches of 64: the whole file
    assert len(model.history["loss"]) == 2 and np.isfinite(model.history["loss"]).all()
    assert emb.ready and emb.frequent.shape[0] > 0  # the split saw the per-slot ids as categories
    np.testing.assert_array_equal(_changed_rows(before, emb.dump()[1]), _expected_rows(keys, sizes))


def _dlrm_raw_file(path, n, sizes, rng):
    """A file as tools/dlrm_script/dlrm_raw writes it: per sample int32 label, 13 int32 counts and one int32
    per-slot category id per slot (its hash map assigns ids in [0, size_k))."""
    keys = np.stack([np.minimum(rng.geometric(0.2, n) - 1, s - 1) for s in sizes], 1)
    dense = rng.integers(0, 100, (n, 13))
    logit = 0.3 * np.log1p(dense[:, 0]) - 1 + np.where(keys[:, 0] % 2 == 0, 1.0, -1.0)
    label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    write_raw_file(str(path), label[:, None], dense, keys)
    return keys


def test_dlrm_raw_files_and_one_hot_embedding(cpu, tmp_path):
    """Flow 2: dlrm_kaggle_fp32.py (Raw reader, LocalizedSlotSparseEmbeddingOneHot, SGD) on dlrm_raw's files."""
    rng = np.random.default_rng(0)
    sizes = [int(v) for v in rng.integers(2, 30, 26)]
    n, batch = 768, 64
    keys = _dlrm_raw_file(tmp_path / "train_data.bin", n, sizes, rng)
    _dlrm_raw_file(tmp_path / "test_data.bin", 256, sizes, rng)
    assert (keys < sizes).all() and (keys[:, 1:] < np.cumsum(sizes)[:-1]).any()  # offset keys would differ
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the sample's relative paths
    try:
        reader = hugectr.DataReaderParams(
            data_reader_type=hugectr.DataReaderType_t.Raw,
            source=["./train_data.bin"],
            eval_source="./test_data.bin",
            num_samples=n,
            eval_num_samples=256,
            check_type=hugectr.Check_t.Non,
        )
        optimizer = hugectr.CreateOptimizer(
            optimizer_type=hugectr.Optimizer_t.SGD, update_type=hugectr.Update_t.Local, atomic_update=True
        )
        model = hugectr.Model(_solver(batch, warmup_steps=2), reader, optimizer)
        model.add(
            hugectr.Input(
                label_dim=1,
                label_name="label",
                dense_dim=13,
                dense_name="dense",
                data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, False, 26)],
            )
        )
        model.add(
            hugectr.SparseEmbedding(
                embedding_type=hugectr.Embedding_t.LocalizedSlotSparseEmbeddingOneHot,
                slot_size_array=sizes,
                workspace_size_per_gpu_in_mb=1,
                embedding_vec_size=8,
                combiner="sum",
                sparse_embedding_name="sparse_embedding1",
                bottom_name="data1",
                optimizer=optimizer,
            )
        )
        prev = "dense"
        for k, width in enumerate([32, 16, 8], 1):
            model.add(hugectr.DenseLayer(L.InnerProduct, [prev], [f"fc{k}"], num_output=width))
            model.add(hugectr.DenseLayer(L.ReLU, [f"fc{k}"], [f"relu{k}"]))
            prev = f"relu{k}"
        model.add(hugectr.DenseLayer(L.Interaction, [prev, "sparse_embedding1"], ["interaction1"]))
        prev = "interaction1"
        for k, width in enumerate([32, 16], 4):
            model.add(hugectr.DenseLayer(L.InnerProduct, [prev], [f"fc{k}"], num_output=width))
            model.add(hugectr.DenseLayer(L.ReLU, [f"fc{k}"], [f"relu{k}"]))
            prev = f"relu{k}"
        model.add(hugectr.DenseLayer(L.InnerProduct, [prev], ["fc8"], num_output=1))
        model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc8", "label"], ["loss"]))
        model.compile()
        emb = model.embeddings[0]
        before = emb.dump()[1].copy()
        model.fit(max_iter=12, display=6, eval_interval=6, snapshot=10000000, snapshot_prefix="dlrm")
        assert len(model.history["loss"]) == 2 and np.isfinite(model.history["loss"]).all()
        np.testing.assert_array_equal(_changed_rows(before, emb.dump()[1]), _expected_rows(keys, sizes))
        model.save_params_to_files("dlrm", 12)  # the snapshot's keys are the rows (the offset keys)
        saved = np.fromfile("dlrm0_sparse_12.model/key", "<i8")
        np.testing.assert_array_equal(saved, np.arange(sum(sizes)))
    finally:
        os.chdir(cwd)


def test_one_hot_refuses_a_globally_offset_key_beyond_its_slot(cpu, tmp_path):
    """Offset keys (numbactr's earlier convention) are refused with the file, record and slot named."""
    sizes = [4, 6]
    keys = np.array([[1, 2], [3, 5], [2, 4 + 5]])  # record 2's slot 1 holds 9: an offset key, outside [0, 6)
    write_raw_file(str(tmp_path / "d.bin"), np.zeros((3, 1), np.int64), np.zeros((3, 1), np.int64), keys)
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Raw,
        source=[str(tmp_path / "d.bin")],
        eval_source=str(tmp_path / "d.bin"),
        num_samples=3,
        eval_num_samples=3,
        check_type=hugectr.Check_t.Non,
    )
    model = hugectr.Model(_solver(3), reader, hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.SGD))
    model.add(hugectr.Input(1, "label", 1, "dense", [hugectr.DataReaderSparseParam("data1", 1, True, 2)]))
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.LocalizedSlotSparseEmbeddingOneHot,
            slot_size_array=sizes,
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=4,
            combiner="sum",
            sparse_embedding_name="e",
            bottom_name="data1",
        )
    )
    model.add(hugectr.DenseLayer(L.Reshape, ["e"], ["flat"], leading_dim=8))
    model.add(hugectr.DenseLayer(L.InnerProduct, ["flat"], ["fc"], num_output=1))
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc", "label"], ["loss"]))
    model.compile()
    with pytest.raises(
        DataFormatError,
        match=r"d\.bin.*record 2: key 9 of sparse input 0 slot 1 is outside "
        r"slot 1's range \[0, 6\) of LocalizedSlotSparseEmbeddingOneHot 'e'",
    ):
        model.train()
