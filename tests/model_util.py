"""Tiny DLRM-shaped models and data for model-level tests (cpu and sim)."""

from __future__ import annotations

import os

import numpy as np

import numbactr as hugectr
from numbactr.data.file_list import write_file_list
from numbactr.data.norm import write_norm_file


def tiny_data(folder, n_train=512, n_eval=256, slots=3, dense=2, keys_per_slot=6, seed=0, files=2):
    """Labels from a known rule over keys and dense features, so a model can learn them. Returns the train and
    eval file lists of globally offset keys (slot s's in [6s, 6s + 6): the hash embeddings' convention);
    beside each, a twin of the same samples with per-slot keys in [0, 6), which one-hot embeddings read (they
    add the slot offsets themselves, as HugeCTR's do): one_hot_lists."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 1.5, (slots, keys_per_slot))
    u = rng.normal(0, 1.0, dense)

    def make(n, name):
        keys = rng.integers(0, keys_per_slot, (n, slots))
        x = rng.normal(0, 1, (n, dense)).astype(np.float32)
        logit = w[np.arange(slots), keys].sum(1) + x @ u
        label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        gkeys = keys + np.arange(slots) * keys_per_slot  # globally offset keys, one per slot
        for sub, k in ((name, gkeys), (name + ONE_HOT_TWIN, keys)):
            paths = []
            for f, idx in enumerate(np.array_split(np.arange(n), files)):
                p = os.path.join(folder, sub, f"part{f}.data")
                os.makedirs(os.path.dirname(p), exist_ok=True)
                write_norm_file(p, label[idx], x[idx], k[idx].astype(np.int64), key_dtype=np.int64)
                paths.append(p)
            write_file_list(os.path.join(folder, sub, "_file_list.txt"), paths)
        return os.path.join(folder, name, "_file_list.txt")

    return make(n_train, "train"), make(n_eval, "eval")


ONE_HOT_TWIN = "_per_slot"


def one_hot_lists(embedding, *lists):
    """The file lists a model with this embedding type reads: tiny_data's per-slot twins for the one-hot
    embeddings (OneHot, Hybrid), the lists themselves otherwise (lists not written by tiny_data too)."""
    if "OneHot" not in embedding.name and "Hybrid" not in embedding.name:
        return lists
    twins = []
    for lst in lists:
        d = os.path.dirname(lst)
        twin = os.path.join(d + ONE_HOT_TWIN, os.path.basename(lst))
        twins.append(twin if os.path.exists(twin) else lst)
    return tuple(twins)


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
    repeat=True,
):
    """``train``: a file list, or a list of them (read in order as one data set)."""
    if isinstance(train, list):
        source = train
    else:
        train, evl = one_hot_lists(embedding, train, evl)
        source = [train]
    solver = hugectr.CreateSolver(
        batchsize=batch,
        batchsize_eval=batch,
        max_eval_batches=4,
        lr=lr,
        vvgpu=[[0]],
        i64_input_key=True,
        seed=seed,
        repeat_dataset=repeat,
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=source, eval_source=evl, check_type=hugectr.Check_t.Sum
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
