"""Softmax, MatrixMultiply and MultiHeadAttention layers: sim == cpu through the tape, HugeCTR-exact
softmax, validation at Model.add(), JSON keys."""

import math

import numpy as np
import pytest

import numbactr as hugectr
from numbactr import hugectr_exact as compat
from numbactr.kernels import softmax as sm
from tests.layer_sim_cpu import assert_sim_matches_cpu, run_layer

L = hugectr.Layer_t
RNG = np.random.default_rng(0)


def _x(*shape, scale=1.0):
    return (RNG.normal(size=shape) * scale).astype(np.float32)


@pytest.fixture
def hugectr_exact():
    before = compat.hugectr_exact()
    compat.set_hugectr_exact(True)
    yield
    compat.set_hugectr_exact(before)


def test_softmax_layer():
    x = _x(3, 2, 5, scale=3.0)
    layer, (y,), (dx,) = assert_sim_matches_cpu(L.Softmax, [x], ["y"])
    np.testing.assert_allclose(y.sum(-1), 1.0, rtol=1e-5)
    assert layer.json_params() == {"factor": 1.0}


def test_softmax_stable_by_default_and_overflowing_in_hugectr_exact_mode(hugectr_exact):
    x = np.array([[100.0, 101.0], [0.0, 1.0]], np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # HugeCTR's formula overflows, on purpose here
        _, (y_exact,), _ = run_layer(L.Softmax, [x], ["y"], "cpu")
    assert np.isnan(y_exact[0]).all()  # exp(100)/exp(101) overflow: inf/inf
    np.testing.assert_allclose(y_exact[1], sm.softmax_forward_ref(x[1:], True)[0], rtol=1e-6)
    assert_sim_matches_cpu(L.Softmax, [x[1:]], ["y"])  # same kernels in exact mode on sim
    compat.set_hugectr_exact(False)
    _, (y,), _ = run_layer(L.Softmax, [x], ["y"], "cpu")
    np.testing.assert_allclose(y[0], [1 / (1 + math.e), math.e / (1 + math.e)], rtol=1e-6)


@pytest.mark.parametrize("mask_rows", ["per_row", "broadcast"])
def test_masked_softmax_layer(mask_rows):
    x = _x(2, 3, 4, 5)
    mshape = (2, 1, 4, 5) if mask_rows == "per_row" else (2, 1, 1, 5)
    mask = (RNG.random(mshape) < 0.7).astype(np.float32)
    mask[..., 0] = 1.0  # every row sees a key
    layer, (y,), (dx, dmask) = assert_sim_matches_cpu(L.Softmax, [x, mask], ["y"], factor=0.5)
    np.testing.assert_allclose(y, sm.masked_softmax_forward_ref(x, mask, 0.5), rtol=1e-5, atol=1e-7)
    assert dmask is None and np.all(y[np.broadcast_to(mask, y.shape) == 0] < 1e-6)
    assert layer.json_params() == {"factor": 0.5}


@pytest.mark.parametrize(
    "a_shape,b_shape,out",
    [
        ((4, 3), (3, 5), (4, 5)),
        ((2, 4, 3), (2, 3, 5), (2, 4, 5)),
        ((2, 2, 4, 3), (2, 2, 3, 5), (2, 2, 4, 5)),
        ((4, 3), (3, 2, 5), (4, 2, 5)),
    ],
)
def test_matrix_multiply_layer(a_shape, b_shape, out):
    a, b = _x(*a_shape), _x(*b_shape)
    layer, (y,), (da, db) = assert_sim_matches_cpu(L.MatrixMultiply, [a, b], ["y"], rtol=1e-5, atol=1e-5)
    assert y.shape == out
    ref = (a @ b.reshape(3, -1)).reshape(out) if len(a_shape) == 2 and len(b_shape) == 3 else a @ b
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    assert da.shape == a_shape and db.shape == b_shape


def test_multi_head_attention_qkv_mode():
    q, k, v = _x(2, 3, 6), _x(2, 3, 6), _x(2, 3, 6)
    layer, (scores, vh), (dq, dk, dv) = assert_sim_matches_cpu(
        L.MultiHeadAttention, [q, k, v], ["s", "v"], num_attention_heads=2
    )
    assert layer.out_shapes == [(2, 2, 3, 3), (2, 2, 3, 3)]
    qh = q.reshape(2, 3, 2, 3).transpose(0, 2, 1, 3)
    kh = k.reshape(2, 3, 2, 3).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(scores, qh @ kh.transpose(0, 1, 3, 2) / math.sqrt(3), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(vh, v.reshape(2, 3, 2, 3).transpose(0, 2, 1, 3))
    assert layer.json_params() == {"num_attention_heads": 2, "transpose_b": False}


def test_multi_head_attention_4d_modes_compose_to_attention():
    q, k, vv = _x(2, 2, 3, 4), _x(2, 2, 5, 4), _x(2, 2, 5, 4)
    _, (s,), _ = assert_sim_matches_cpu(L.MultiHeadAttention, [q, k], ["s"], transpose_b=True)
    np.testing.assert_allclose(s, q @ k.transpose(0, 1, 3, 2) / 2.0, rtol=1e-5, atol=1e-6)
    layer, (o,), (ds, dv) = assert_sim_matches_cpu(L.MultiHeadAttention, [s, vv], ["o"], transpose_b=False)
    assert layer.out_shapes == [(2, 3, 8)]
    np.testing.assert_allclose(o, (s @ vv).transpose(0, 2, 1, 3).reshape(2, 3, 8), rtol=1e-5, atol=1e-6)


def _model():
    solver = hugectr.CreateSolver(batchsize=8, batchsize_eval=8, i64_input_key=True)
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=["unused.txt"],
        eval_source="unused.txt",
        check_type=hugectr.Check_t.Sum,
    )
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer())
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=6,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 3)],
        )
    )
    m.add(
        hugectr.SparseEmbedding(hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, 4, "sum", "emb", "data1")
    )  # emb (8, 3, 4)
    return m


def test_validation_messages():
    m = _model()
    m.add(hugectr.DenseLayer(L.MultiHeadAttention, ["emb", "emb", "emb"], ["s", "v"], num_attention_heads=2))
    assert m.shapes["s"] == (8, 2, 3, 3) and m.shapes["v"] == (8, 2, 3, 2)
    with pytest.raises(
        hugectr.ModelError,
        match=r"width 4 of 'emb' \(8, 3, 4\) is not divisible by "
        r"num_attention_heads=3",
    ):
        m.add(hugectr.DenseLayer(L.MultiHeadAttention, ["emb", "emb", "emb"], ["s2", "v2"], num_attention_heads=3))
    with pytest.raises(hugectr.ModelError, match=r"Q, K, V must all be 3-D.*'dense' \(8, 6\)"):
        m.add(hugectr.DenseLayer(L.MultiHeadAttention, ["emb", "emb", "dense"], ["s2", "v2"]))
    with pytest.raises(hugectr.ModelError, match=r"3 bottoms give 1 top .* or 2 .*, got 3"):
        m.add(hugectr.DenseLayer(L.MultiHeadAttention, ["emb", "emb", "emb"], ["s2", "v2", "x2"]))
    with pytest.raises(hugectr.ModelError, match=r"transpose_b=False needs scores .*'v' \(8, 2, 3, 2\)"):
        m.add(hugectr.DenseLayer(L.MultiHeadAttention, ["v", "v"], ["o"]))
    with pytest.raises(hugectr.ModelError, match=r"2 bottoms must be 4-D .*'emb' \(8, 3, 4\)"):
        m.add(hugectr.DenseLayer(L.MultiHeadAttention, ["s", "emb"], ["o"], transpose_b=True))
    m.add(hugectr.DenseLayer(L.MultiHeadAttention, ["s", "v"], ["o"]))  # (8,2,3,3) x (8,2,3,2)
    assert m.shapes["o"] == (8, 3, 4)
    with pytest.raises(hugectr.ModelError, match=r"mask 'dense' \(8, 6\) does not fit scores 's' \(8, 2, 3, 3\)"):
        m.add(hugectr.DenseLayer(L.Softmax, ["s", "dense"], ["p"]))
    with pytest.raises(hugectr.ModelError, match=r"Softmax.*expects \(1, 2\) bottom"):
        m.add(hugectr.DenseLayer(L.Softmax, ["s", "s", "s"], ["p"]))
    with pytest.raises(hugectr.ModelError, match=r"unsupported ranks: 'emb' \(8, 3, 4\) x 'dense' \(8, 6\)"):
        m.add(hugectr.DenseLayer(L.MatrixMultiply, ["emb", "dense"], ["mm"]))
    with pytest.raises(hugectr.ModelError, match=r"last dim of the first \(6\) must equal .* second \(8\)"):
        m.add(hugectr.DenseLayer(L.MatrixMultiply, ["dense", "dense"], ["mm"]))
    m.add(hugectr.DenseLayer(L.Select, ["emb"], ["e4"], dim=1, index=[0, 1, 2, 0]))  # (8, 4, 4)
    m.add(hugectr.DenseLayer(L.ReduceSum, ["e4"], ["e1"], axis=0))  # (1, 4, 4)
    with pytest.raises(hugectr.ModelError, match=r"'emb' \(8, 3, 4\) and 'e1' \(1, 4, 4\) must share their batch"):
        m.add(hugectr.DenseLayer(L.MatrixMultiply, ["emb", "e1"], ["mm"]))
    m.add(hugectr.DenseLayer(L.Softmax, ["s"], ["p"]))
    assert m.shapes["p"] == (8, 2, 3, 3)
