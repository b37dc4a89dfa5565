"""Tiny DLRM-shaped models and data for model-level tests (cpu and sim)."""

from __future__ import annotations

import os

import numpy as np

import numbactr as hugectr
from numbactr.data.file_list import write_file_list
from numbactr.data.norm import write_norm_file


def tiny_data(folder, n_train=512, n_eval=256, slots=3, dense=2, keys_per_slot=6, seed=0, files=2):
    """Labels from a known rule over keys and dense features, so a model can learn them."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 1.5, (slots, keys_per_slot))
    u = rng.normal(0, 1.0, dense)

    def make(n, name):
        keys = rng.integers(0, keys_per_slot, (n, slots))
        x = rng.normal(0, 1, (n, dense)).astype(np.float32)
        logit = w[np.arange(slots), keys].sum(1) + x @ u
        label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        gkeys = keys + np.arange(slots) * keys_per_slot  # globally offset keys, one per slot
        paths = []
        for f, idx in enumerate(np.array_split(np.arange(n), files)):
            p = os.path.join(folder, name, f"part{f}.data")
            os.makedirs(os.path.dirname(p), exist_ok=True)
            write_norm_file(p, label[idx], x[idx], gkeys[idx].astype(np.int64), key_dtype=np.int64)
            paths.append(p)
        lst = os.path.join(folder, name, "_file_list.txt")
        write_file_list(lst, paths)
        return lst

    return make(n_train, "train"), make(n_eval, "eval")


def tiny_dlrm(
    train,
    evl,
    *,
    batch=64,
    lr=0.01,
    optimizer=hugectr.Optimizer_t.Adam,
    update=hugectr.Update_t.Global,
    slots=3,
    dense=2,
    vec=4,
    seed=0,
    embedding=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
):
    solver = hugectr.CreateSolver(
        batchsize=batch, batchsize_eval=batch, max_eval_batches=4, lr=lr, vvgpu=[[0]], i64_input_key=True, seed=seed
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[train], eval_source=evl, check_type=hugectr.Check_t.Sum
    )
    opt = hugectr.CreateOptimizer(optimizer_type=optimizer, update_type=update)
    model = hugectr.Model(solver, reader, opt)
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=dense,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, slots)],
        )
    )
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=embedding,
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=vec,
            combiner="sum",
            sparse_embedding_name="emb",
            bottom_name="data1",
            slot_size_array=[6] * slots if "OneHot" in embedding.name else [],
        )
    )
    L = hugectr.Layer_t
    model.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc1"], num_output=vec))
    model.add(hugectr.DenseLayer(L.ReLU, ["fc1"], ["relu1"]))
    model.add(hugectr.DenseLayer(L.Interaction, ["relu1", "emb"], ["inter"]))
    model.add(hugectr.DenseLayer(L.InnerProduct, ["inter"], ["fc2"], num_output=8))
    model.add(hugectr.DenseLayer(L.ReLU, ["fc2"], ["relu2"]))
    model.add(hugectr.DenseLayer(L.Reshape, ["emb"], ["flat"], leading_dim=slots * vec))
    model.add(hugectr.DenseLayer(L.Concat, ["relu2", "flat"], ["cat"]))
    model.add(hugectr.DenseLayer(L.InnerProduct, ["cat"], ["fc3"], num_output=1))
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc3", "label"], ["loss"]))
    model.compile()
    return model
