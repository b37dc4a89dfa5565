"""HugeCTR's sample graphs (spec §8), shrunk to test size and built through the HugeCTR API:
DCN, Wide&Deep, DeepFM, GMF (NCF), DIN-like, BST-like and MMoE, each on generated Norm data with a
learnable signal."""

from __future__ import annotations

import os

import numpy as np

import numbactr as hugectr
from numbactr.data.file_list import write_file_list
from numbactr.data.norm import NormWriter

L = hugectr.Layer_t
KEYS = 5  # keys per slot


def make_data(folder, inputs, dense=3, labels=1, n_train=384, n_eval=128, seed=0, dense_fn=None):
    """inputs: [(name, slots, nnz)], keys of slot s of input i in [offset, offset + KEYS). Labels come
    from a hidden linear rule over keys and dense features. dense_fn(rng, n) may override the dense."""
    rng = np.random.default_rng(seed)
    total_slots = sum(s for _, s, _ in inputs)
    w = rng.normal(0, 1.5, (labels, total_slots, KEYS))
    u = rng.normal(0, 1.0, (labels, dense))

    def split(n, name):
        x = dense_fn(rng, n) if dense_fn else rng.normal(0, 1, (n, dense)).astype(np.float32)
        slot_keys, logit, col = [], np.zeros((n, labels)), 0
        for _, slots, nnz in inputs:
            for s in range(slots):
                k = rng.integers(0, KEYS, (n, nnz))
                logit += w[:, col, k].mean(axis=2).T
                slot_keys.append((k + col * KEYS).astype(np.int64))
                col += 1
        logit += x @ u.T
        y = (rng.random((n, labels)) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        path = os.path.join(folder, name, "part0.data")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with NormWriter(path, labels, dense, total_slots, key_dtype=np.int64) as wr:
            wr.write(y, x, slot_keys)
        lst = os.path.join(folder, name, "_file_list.txt")
        write_file_list(lst, [path])
        return lst

    return split(n_train, "train"), split(n_eval, "eval")


def _model(
    data,
    inputs,
    dense,
    label_dims=(1,),
    label_names=("label",),
    batch=32,
    lr=0.01,
    opt=hugectr.Optimizer_t.Adam,
    seed=0,
):
    solver = hugectr.CreateSolver(
        batchsize=batch, batchsize_eval=batch, max_eval_batches=2, lr=lr, vvgpu=[[0]], i64_input_key=True, seed=seed
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=[data[0]],
        eval_source=data[1],
        check_type=hugectr.Check_t.Sum,
    )
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer(optimizer_type=opt))
    sparse = [hugectr.DataReaderSparseParam(n, nnz, False, s) for n, s, nnz in inputs]
    if len(label_dims) == 1:
        m.add(
            hugectr.Input(
                label_dim=label_dims[0],
                label_name=label_names[0],
                dense_dim=dense,
                dense_name="dense",
                data_reader_sparse_param_array=sparse,
            )
        )
    else:
        m.add(
            hugectr.Input(
                label_dims=list(label_dims),
                label_names=list(label_names),
                dense_dim=dense,
                dense_name="dense",
                data_reader_sparse_param_array=sparse,
            )
        )
    return m


def emb(m, bottom, top, vec, combiner="sum"):
    m.add(
        hugectr.SparseEmbedding(hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, vec, combiner, top, bottom)
    )


def D(m, t, bottoms, tops, **kw):
    m.add(hugectr.DenseLayer(t, bottoms, tops, **kw))


# ---- the graphs ------------------------------------------------------------------------------
DCN_IN = [("data1", 4, 2)]


def dcn(data, **kw):
    m = _model(data, DCN_IN, 3, **kw)
    emb(m, "data1", "sparse_embedding1", 4)
    D(m, L.Reshape, ["sparse_embedding1"], ["reshape1"], leading_dim=16)
    D(m, L.Concat, ["reshape1", "dense"], ["concat1"])  # (B, 19), read twice
    D(m, L.MultiCross, ["concat1"], ["multicross1"], num_layers=2)
    D(m, L.InnerProduct, ["concat1"], ["fc1"], num_output=16)
    D(m, L.ReLU, ["fc1"], ["relu1"])
    D(m, L.Dropout, ["relu1"], ["dropout1"], dropout_rate=0.2)
    D(m, L.Concat, ["dropout1", "multicross1"], ["concat2"])
    D(m, L.InnerProduct, ["concat2"], ["fc2"], num_output=1)
    D(m, L.BinaryCrossEntropyLoss, ["fc2", "label"], ["loss"])
    return m


WDL_IN = [("wide_data", 2, 1), ("deep_data", 3, 1)]


def wdl(data, **kw):
    m = _model(data, WDL_IN, 3, **kw)
    emb(m, "wide_data", "sparse_embedding2", 1)
    emb(m, "deep_data", "sparse_embedding1", 4)
    D(m, L.Reshape, ["sparse_embedding1"], ["reshape1"], leading_dim=12)
    D(m, L.Reshape, ["sparse_embedding2"], ["reshape2"], leading_dim=2)
    D(m, L.ReduceSum, ["reshape2"], ["wide_redn"], axis=1)
    D(m, L.Concat, ["reshape1", "dense"], ["concat1"])
    D(m, L.InnerProduct, ["concat1"], ["fc1"], num_output=16)
    D(m, L.ReLU, ["fc1"], ["relu1"])
    D(m, L.Dropout, ["relu1"], ["dropout1"], dropout_rate=0.2)
    D(m, L.InnerProduct, ["dropout1"], ["fc2"], num_output=1)
    D(m, L.Add, ["fc2", "wide_redn"], ["add1"])
    D(m, L.BinaryCrossEntropyLoss, ["add1", "label"], ["loss"])
    return m


DEEPFM_IN = [("data1", 3, 1)]


def deepfm(data, **kw):
    m = _model(data, DEEPFM_IN, 3, **kw)
    emb(m, "data1", "sparse_embedding1", 5)
    D(m, L.Reshape, ["sparse_embedding1"], ["reshape1"], leading_dim=5)  # (B*3, 5)
    D(m, L.Slice, ["reshape1"], ["slice11", "slice12"], ranges=[(0, 4), (4, 5)])
    D(m, L.Reshape, ["slice11"], ["reshape2"], leading_dim=12)
    D(m, L.Reshape, ["slice12"], ["reshape3"], leading_dim=3)
    D(m, L.WeightMultiply, ["dense"], ["weight_multiply1"], weight_dims=[3, 4])
    D(m, L.WeightMultiply, ["dense"], ["weight_multiply2"], weight_dims=[3, 1])
    D(m, L.Concat, ["reshape2", "weight_multiply1"], ["concat1"])  # (B, 24)
    D(m, L.InnerProduct, ["concat1"], ["fc1"], num_output=16)
    D(m, L.ReLU, ["fc1"], ["relu1"])
    D(m, L.InnerProduct, ["relu1"], ["fc2"], num_output=1)
    D(m, L.FmOrder2, ["concat1"], ["fmorder2"], out_dim=4)
    D(m, L.ReduceSum, ["fmorder2"], ["reducesum1"], axis=1)
    D(m, L.Concat, ["reshape3", "weight_multiply2"], ["concat2"])
    D(m, L.ReduceSum, ["concat2"], ["reducesum2"], axis=1)
    D(m, L.Add, ["fc2", "reducesum1", "reducesum2"], ["add"])
    D(m, L.BinaryCrossEntropyLoss, ["add", "label"], ["loss"])
    return m


GMF_IN = [("data", 2, 1)]


def gmf(data, **kw):
    m = _model(data, GMF_IN, 3, **kw)
    emb(m, "data", "gmf_embedding", 4)
    D(m, L.Reshape, ["gmf_embedding"], ["reshape1"], leading_dim=8)
    D(m, L.Slice, ["reshape1"], ["user", "item"], ranges=[(0, 4), (4, 8)])
    D(m, L.ElementwiseMultiply, ["user", "item"], ["multiply1"])
    D(m, L.Concat, ["multiply1", "dense"], ["concat1"])
    D(m, L.InnerProduct, ["concat1"], ["gmf_out"], num_output=1)
    D(m, L.BinaryCrossEntropyLoss, ["gmf_out", "label"], ["loss"])
    return m


DIN_IN = [("hist", 4, 1), ("ad", 1, 1)]


def din(data, **kw):
    S, V = 4, 4
    m = _model(data, DIN_IN, 3, **kw)
    emb(m, "hist", "hist_emb", V)  # (B, S, V)
    emb(m, "ad", "ad_emb", V)  # (B, 1, V)
    D(m, L.Reshape, ["hist_emb"], ["hist_rows"], leading_dim=V)  # (B*S, V)
    D(m, L.Reshape, ["ad_emb"], ["ad_vec"], leading_dim=V)  # (B, V)
    D(m, L.Scale, ["ad_vec"], ["ad_rows"], axis=1, factor=S)  # (B*S, V)
    D(m, L.Sub, ["hist_rows", "ad_rows"], ["diff"])
    D(m, L.ElementwiseMultiply, ["hist_rows", "ad_rows"], ["prod"])
    D(m, L.Concat, ["hist_rows", "ad_rows", "diff", "prod"], ["att_in"])  # (B*S, 4V)
    D(m, L.InnerProduct, ["att_in"], ["att_fc1"], num_output=8)
    D(m, L.PReLU_Dice, ["att_fc1"], ["att_dice"], elu_alpha=0.2, eps=1e-8)
    D(m, L.InnerProduct, ["att_dice"], ["att_fc2"], num_output=1)  # (B*S, 1)
    D(m, L.Reshape, ["att_fc2"], ["att_logits"], leading_dim=S)  # (B, S)
    D(m, L.Softmax, ["att_logits"], ["att_w"])
    D(m, L.Scale, ["att_w"], ["att_w_rep"], axis=0, factor=V)  # (B, S*V)
    D(m, L.Reshape, ["hist_emb"], ["hist_flat"], leading_dim=S * V)  # (B, S*V)
    D(m, L.ElementwiseMultiply, ["att_w_rep", "hist_flat"], ["weighted"])
    D(m, L.Reshape, ["weighted"], ["weighted3"], shape=[-1, S, V])
    D(m, L.ReduceSum, ["weighted3"], ["pooled3"], axis=1)  # (B, 1, V)
    D(m, L.Reshape, ["pooled3"], ["pooled"], leading_dim=V)
    D(m, L.Concat, ["pooled", "ad_vec", "dense"], ["top_in"])
    D(m, L.InnerProduct, ["top_in"], ["fc1"], num_output=8)
    D(m, L.PReLU_Dice, ["fc1"], ["dice1"], elu_alpha=0.2, eps=1e-8)
    D(m, L.InnerProduct, ["dice1"], ["fc2"], num_output=1)
    D(m, L.BinaryCrossEntropyLoss, ["fc2", "label"], ["loss"])
    return m


BST_IN = [("hist", 4, 1), ("user", 1, 1)]


def bst_dense(rng, n):
    """Sequence lengths 1..4 as floats (BST passes them through the dense input)."""
    return rng.integers(1, 5, (n, 1)).astype(np.float32)


def bst(data, one_bottom_mask=False, **kw):
    T, V, H = 4, 4, 2
    m = _model(data, BST_IN, 1, **kw)
    emb(m, "hist", "hist_emb", V)  # (B, T, V)
    emb(m, "user", "user_emb", V)
    if one_bottom_mask:  # HugeCTR v23.06's form: (B, 1, 1, T), broadcast over the query rows
        D(m, L.SequenceMask, ["dense"], ["mask"], max_sequence_len=T)
    else:
        D(m, L.SequenceMask, ["dense", "dense"], ["mask"], max_sequence_len_from=T, max_sequence_len_to=T)
    for name in ("q", "k", "v"):
        D(m, L.InnerProduct, ["hist_emb"], [name], num_output=8)  # (B, T, 8)
    D(m, L.MultiHeadAttention, ["q", "k", "v"], ["scores", "v4"], num_attention_heads=H)
    D(m, L.Softmax, ["scores", "mask"], ["probs"])
    D(m, L.MultiHeadAttention, ["probs", "v4"], ["att"], num_attention_heads=H)  # (B, T, 8)
    D(m, L.InnerProduct, ["hist_emb"], ["res"], num_output=8)
    D(m, L.Add, ["att", "res"], ["att_res"])
    D(m, L.LayerNorm, ["att_res"], ["ln"])
    D(m, L.ReduceMean, ["ln"], ["pooled3"], axis=1)  # (B, 1, 8)
    D(m, L.Reshape, ["pooled3"], ["pooled"], leading_dim=8)
    D(m, L.Reshape, ["user_emb"], ["user_vec"], leading_dim=V)
    D(m, L.Concat, ["pooled", "user_vec"], ["top_in"])
    D(m, L.InnerProduct, ["top_in"], ["fc1"], num_output=8)
    D(m, L.ReLU, ["fc1"], ["relu1"])
    D(m, L.InnerProduct, ["relu1"], ["fc2"], num_output=1)
    D(m, L.BinaryCrossEntropyLoss, ["fc2", "label"], ["loss"])
    return m


MMOE_IN = [("data1", 3, 1)]


def mmoe(data, **kw):
    m = _model(data, MMOE_IN, 3, label_dims=(1, 1), label_names=("income", "married"), **kw)
    emb(m, "data1", "sparse_embedding1", 4)
    D(m, L.Reshape, ["sparse_embedding1"], ["reshape1"], leading_dim=12)
    D(m, L.Concat, ["reshape1", "dense"], ["inputs"])
    for e in range(2):
        D(m, L.InnerProduct, ["inputs"], [f"expert{e}_fc"], num_output=8)
        D(m, L.ReLU, [f"expert{e}_fc"], [f"expert{e}"])
    for task in ("income", "married"):
        D(m, L.InnerProduct, ["inputs"], [f"gate_{task}_fc"], num_output=2)
        D(m, L.Softmax, [f"gate_{task}_fc"], [f"gate_{task}"])
        D(m, L.Slice, [f"gate_{task}"], [f"g_{task}0", f"g_{task}1"], ranges=[(0, 1), (1, 2)])
        for e in range(2):
            D(m, L.Scale, [f"g_{task}{e}"], [f"g_{task}{e}_rep"], axis=0, factor=8)
            D(m, L.ElementwiseMultiply, [f"g_{task}{e}_rep", f"expert{e}"], [f"w_{task}{e}"])
        D(m, L.Add, [f"w_{task}0", f"w_{task}1"], [f"mix_{task}"])
        D(m, L.InnerProduct, [f"mix_{task}"], [f"tower_{task}"], num_output=4)
        D(m, L.ReLU, [f"tower_{task}"], [f"tower_{task}_relu"])
        D(m, L.InnerProduct, [f"tower_{task}_relu"], [f"out_{task}"], num_output=1)
        D(m, L.BinaryCrossEntropyLoss, [f"out_{task}", task], [f"loss_{task}"])
    return m


GRAPHS = {
    "dcn": (dcn, DCN_IN, 3, 1, None),
    "wdl": (wdl, WDL_IN, 3, 1, None),
    "deepfm": (deepfm, DEEPFM_IN, 3, 1, None),
    "gmf": (gmf, GMF_IN, 3, 1, None),
    "din": (din, DIN_IN, 3, 1, None),
    "bst": (bst, BST_IN, 1, 1, bst_dense),
    "mmoe": (mmoe, MMOE_IN, 3, 2, None),
}


def build(name, folder, compile_kw=None, **kw):
    fn, inputs, dense, labels, dense_fn = GRAPHS[name]
    data = make_data(folder, inputs, dense=dense, labels=labels, dense_fn=dense_fn)
    m = fn(data, **kw)
    if name == "mmoe":
        m.compile(loss_names=["income", "married"], loss_weights=[0.5, 0.5])
    else:
        m.compile()
    return m
