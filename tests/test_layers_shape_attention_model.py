"""A tiny attention-style model built from the shape and attention layers trains through the real
HugeCTR API: loss falls on cpu, and one step on sim (numba kernels) equals one step on cpu."""

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from tests.model_util import tiny_data

L = hugectr.Layer_t


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("attn")))


def attention_model(train, evl, batch=16, lr=0.05):
    solver = hugectr.CreateSolver(
        batchsize=batch, batchsize_eval=batch, max_eval_batches=2, lr=lr, vvgpu=[[0]], i64_input_key=True, seed=1
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[train], eval_source=evl, check_type=hugectr.Check_t.Sum
    )
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.Adam))
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 3)],
        )
    )
    m.add(
        hugectr.SparseEmbedding(hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, 4, "sum", "emb", "data1")
    )  # (B, 3, 4)
    dl = hugectr.DenseLayer
    m.add(dl(L.Slice, ["dense"], ["len", "d2"], ranges=[(0, 1), (0, 2)]))  # (B, 1), (B, 2)
    m.add(dl(L.SequenceMask, ["len", "len"], ["mask"], max_sequence_len_from=3, max_sequence_len_to=3))
    m.add(dl(L.MultiHeadAttention, ["emb", "emb", "emb"], ["scores", "v"], num_attention_heads=2))
    m.add(dl(L.Softmax, ["scores", "mask"], ["probs"], factor=1.0))
    m.add(dl(L.MultiHeadAttention, ["probs", "v"], ["att"]))  # (B, 3, 4)
    m.add(dl(L.ReduceMean, ["att"], ["pooled3"], axis=1))  # (B, 1, 4)
    m.add(dl(L.Reshape, ["pooled3"], ["pooled"], leading_dim=4))  # (B, 4)
    m.add(dl(L.Select, ["emb"], ["sel"], dim=1, index=[2, 0]))  # (B, 2, 4)
    m.add(dl(L.FusedReshapeConcatGeneral, ["sel", "sel"], ["rows"]))  # (2B, 8)
    m.add(dl(L.Reshape, ["rows"], ["sel_flat"], leading_dim=16))  # (B, 16)
    m.add(dl(L.ReduceSum, ["emb"], ["sum3"], axis=2))  # (B, 3, 1)
    m.add(dl(L.Reshape, ["sum3"], ["sums"], leading_dim=3))  # (B, 3)
    m.add(dl(L.Softmax, ["sums"], ["w"]))
    m.add(dl(L.Concat, ["pooled", "sel_flat", "w", "d2"], ["cat"]))  # (B, 25)
    m.add(dl(L.InnerProduct, ["cat"], ["fc"], num_output=1))
    m.add(dl(L.BinaryCrossEntropyLoss, ["fc", "label"], ["loss"]))
    m.compile()
    return m


def test_attention_model_learns_on_cpu(data, on_device):
    on_device("cpu")
    m = attention_model(*data)
    losses = []
    for _ in range(40):
        assert m.train()
        losses.append(m.get_current_loss())
    assert np.isfinite(losses).all()
    assert np.mean(losses[-8:]) < np.mean(losses[:8]), losses


def test_one_step_on_sim_matches_cpu(data, on_device):
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    got = {}
    for kind in ("cpu", "sim"):
        on_device(kind)
        m = attention_model(*data, batch=8)
        assert m.train()
        got[kind] = (m.get_current_loss(), np.array(m.weights), np.array(m.embeddings[0].weight.data))
    (l0, w0, e0), (l1, w1, e1) = got["cpu"], got["sim"]
    assert l0 == pytest.approx(l1, rel=1e-5)
    np.testing.assert_allclose(w1, w0, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(e1, e0, rtol=1e-4, atol=1e-6)
