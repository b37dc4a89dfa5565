"""The loss layer's L1/L2 regularizer reaches the model: loss term and weight gradient (spec §6.3)."""

import numpy as np
import pytest

import numbactr as hugectr
from tests.model_util import tiny_data


def build(data, reg=None, lam=0.0):
    tr, ev = data
    s = hugectr.CreateSolver(batchsize=16, batchsize_eval=16, lr=0.1, i64_input_key=True, seed=3)
    r = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[tr], eval_source=ev, check_type=hugectr.Check_t.Sum
    )
    m = hugectr.Model(s, r, hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.SGD))
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 3)],
        )
    )
    m.add(hugectr.SparseEmbedding(hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, 4, "sum", "emb", "data1"))
    m.add(hugectr.DenseLayer(hugectr.Layer_t.Reshape, ["emb"], ["flat"], leading_dim=12))
    m.add(hugectr.DenseLayer(hugectr.Layer_t.Concat, ["flat", "dense"], ["cat"]))
    m.add(hugectr.DenseLayer(hugectr.Layer_t.InnerProduct, ["cat"], ["fc"], num_output=1))
    kw = {} if reg is None else {"use_regularizer": True, "regularizer_type": reg, "lambda": lam}
    m.add(hugectr.DenseLayer(hugectr.Layer_t.BinaryCrossEntropyLoss, ["fc", "label"], ["loss"], **kw))
    m.compile()
    return m


@pytest.mark.parametrize("reg", [hugectr.Regularizer_t.L2, hugectr.Regularizer_t.L1])
def test_regularizer_adds_its_term_and_gradient(tmp_path, cpu, reg):
    data = tiny_data(str(tmp_path))
    plain, regd = build(data), build(data, reg, 0.5)
    w0 = np.array(plain.weights, dtype=np.float64)
    assert plain.train() and regd.train()
    b, lam, lr = 16, 0.5, 0.1
    if reg == hugectr.Regularizer_t.L2:
        term, grad = lam / (2 * b) * np.sum(w0**2), lam / b * w0
    else:
        term, grad = lam / b * np.sum(np.abs(w0)), lam / b * np.where(w0 > 0, 1.0, -1.0)  # sign(0) = -1
    assert regd.get_current_loss() == pytest.approx(plain.get_current_loss() + term, rel=1e-5)
    np.testing.assert_allclose(np.array(regd.weights) - np.array(plain.weights), -lr * grad, rtol=1e-4, atol=1e-7)
    assert '"regularizer"' in open(_json(regd, tmp_path)).read()


def _json(m, tmp_path):
    p = tmp_path / "g.json"
    m.graph_to_json(str(p))
    return p
