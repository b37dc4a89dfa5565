"""HugeCTR v23.12's four-input MultiHeadAttention (issue 13, item 6): bottoms [query (B, Lf, H*d),
key (B, Lt, H*d), value (B, Lt, H*d), mask (B, 1, Lf, Lt)] -> (B, Lf, H*d).

Checked against torch's scaled_dot_product_attention in float64 (forward and autograd gradients), by
float64 central differences through numbactr's own tape, sim == cpu, and at model level against the
v23.08 spelling of the same attention (3-input MHA, masked Softmax, 2-input MHA): the v23.12 BST graph
(test/pybind_test/bst_fp32_1gpu.py, shrunk) trains bit for bit as that one does.
"""

import json
import math
import warnings

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.autograd import Tape, Tensor
from numbactr.layers import REGISTRY, RunInfo
from tests.gradcheck import assert_grad_close
from tests.layer_sim_cpu import assert_sim_matches_cpu, run_layer
from tests.sample_graphs import BST_IN, D, _model, bst_dense, emb, make_data

L = hugectr.Layer_t
MHA = L.MultiHeadAttention
RNG = np.random.default_rng(7)


def _inputs(b=2, lf=3, lt=4, heads=2, d=3, mask_rows=True, dtype=np.float32, rng=RNG):
    q = rng.normal(size=(b, lf, heads * d)).astype(dtype)
    k = rng.normal(size=(b, lt, heads * d)).astype(dtype)
    v = rng.normal(size=(b, lt, heads * d)).astype(dtype)
    mask = (rng.random((b, 1, lf if mask_rows else 1, lt)) < 0.6).astype(dtype)
    mask[..., 0] = 1.0  # every query row keeps a key ...
    return q, k, v, mask


def _torch_attention(q, k, v, mask, heads):
    """torch's own attention with HugeCTR's additive mask -(1 - mask) * 10000, float64, with autograd."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    t = [torch.tensor(np.asarray(a, np.float64), requires_grad=i < 3) for i, a in enumerate((q, k, v, mask))]
    b, lf, hd = q.shape
    d = hd // heads

    def split(x):  # (B, L, H*d) -> (B, H, L, d)
        return x.reshape(x.shape[0], x.shape[1], heads, d).transpose(1, 2)

    o = F.scaled_dot_product_attention(split(t[0]), split(t[1]), split(t[2]), attn_mask=-(1.0 - t[3]) * 10000.0)
    return t, o.transpose(1, 2).reshape(b, lf, hd)


@pytest.mark.parametrize("mask_rows", [True, False])
@pytest.mark.parametrize("lf,lt,heads,d", [(3, 4, 2, 3), (4, 4, 1, 2), (2, 5, 3, 1)])
def test_matches_torch_forward_and_backward(lf, lt, heads, d, mask_rows):
    torch = pytest.importorskip("torch")
    q, k, v, mask = _inputs(lf=lf, lt=lt, heads=heads, d=d, mask_rows=mask_rows)
    layer, (y,), grads = run_layer(MHA, [q, k, v, mask], ["o"], "cpu", num_attention_heads=heads)
    assert layer.out_shapes == [(2, lf, heads * d)] and grads[3] is None  # the mask gets no gradient
    t, o = _torch_attention(q, k, v, mask, heads)
    np.testing.assert_allclose(y, o.detach().numpy(), rtol=2e-5, atol=2e-6)
    dy = np.random.default_rng(0).normal(size=y.shape)  # run_layer's upstream gradient (seed 0)
    o.backward(torch.tensor(dy))
    for got, want in zip(grads[:3], t[:3]):
        np.testing.assert_allclose(got, want.grad.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lf,lt", [(3, 4), (4, 4)])
def test_three_input_one_top_is_unmasked_attention(lf, lt):
    """v23.12 with 3 bottoms and 1 top: the same attention without a mask (plain softmax)."""
    torch = pytest.importorskip("torch")
    q, k, v, _ = _inputs(lf=lf, lt=lt, heads=2, d=3)
    layer, (y,), grads = run_layer(MHA, [q, k, v], ["o"], "cpu", num_attention_heads=2)
    assert layer.out_shapes == [(2, lf, 6)] and layer.mode == "attention" and not layer.masked
    t, o = _torch_attention(q, k, v, np.ones((2, 1, 1, lt)), 2)  # a mask of ones masks nothing
    np.testing.assert_allclose(y, o.detach().numpy(), rtol=2e-5, atol=2e-6)
    o.backward(torch.tensor(np.random.default_rng(0).normal(size=y.shape)))
    for got, want in zip(grads, t[:3]):
        np.testing.assert_allclose(got, want.grad.numpy(), rtol=1e-4, atol=1e-5)
    assert_sim_matches_cpu(MHA, [q[:, :2], k[:, :3], v[:, :3]], ["o"], num_attention_heads=2)


def test_masked_keys_take_no_weight():
    """A masked key's value cannot reach the output (its weight exp(-10000) is 0 in float32)."""
    q, k, v, mask = _inputs(lf=3, lt=4, heads=2, d=2)
    mask[:, :, :, 2] = 0.0
    _, (y,), _ = run_layer(MHA, [q, k, v, mask], ["o"], "cpu", num_attention_heads=2)
    v2 = v.copy()
    v2[:, 2] = 1e3
    k2 = k.copy()
    k2[:, 2] = -7.0
    _, (y2,), _ = run_layer(MHA, [q, k2, v2, mask], ["o"], "cpu", num_attention_heads=2)
    np.testing.assert_array_equal(y, y2)


def test_fully_masked_row_is_hugectr_s():
    """A query row with every key masked: HugeCTR subtracts 10000 from every score of the row, so the
    row's softmax is the unmasked one (torch with the same additive mask agrees; a boolean -inf mask
    would give NaN). In float32, score - 10000 keeps ~1e-3 of the score (its ulp at 10000), as in
    HugeCTR's kernel, so that row agrees to 1e-3; the others as tightly as before."""
    q, k, v, mask = _inputs(lf=3, lt=4, heads=2, d=2)
    mask[0, 0, 1, :] = 0.0
    _, (y,), _ = run_layer(MHA, [q, k, v, mask], ["o"], "cpu", num_attention_heads=2)
    _, o = _torch_attention(q, k, v, mask, 2)
    o = o.detach().numpy()
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y[0, 1], o[0, 1], atol=1e-3)
    y[0, 1] = o[0, 1] = 0.0
    np.testing.assert_allclose(y, o, rtol=2e-5, atol=2e-6)


def test_gradient_check_float64_through_the_tape():
    """numbactr's hand-written backwards (split, scaled QK, masked softmax, matmul, merge), chained by
    the tape, against float64 central differences of numbactr's own forward."""
    q, k, v, mask = _inputs(b=1, lf=2, lt=3, heads=2, d=2, dtype=np.float64, rng=np.random.default_rng(3))
    device.set_device("cpu")
    cfg = hugectr.DenseLayer(MHA, ["q", "k", "v", "m"], ["o"], num_attention_heads=2)
    layer = REGISTRY[MHA](cfg, [x.shape for x in (q, k, v, mask)])
    dy = np.random.default_rng(1).normal(size=layer.out_shapes[0])

    def forward(xs):
        ts = [Tensor(x, requires_grad=i < 3) for i, x in enumerate(xs)]
        tape = Tape()
        (o,) = layer.forward(tape, ts, RunInfo(training=True, valid=1))
        return tape, ts, o

    tape, ts, o = forward([q, k, v, mask])
    assert o.data.dtype == np.float64
    tape.backward({id(o): (o, dy)})
    for i in range(3):

        def f(x, i=i):
            xs = [q, k, v, mask]
            xs[i] = x
            return forward(xs)[2].data

        # eps 1e-4: masked scores carry a -10000 offset, so a 1e-6 step would lose digits to cancellation.
        # atol 5e-6: the softmax backward y*(dy - sum dy*y) (HugeCTR's) is exact for e/sum(e); the 1e-6 HugeCTR
        # adds to the sum makes the max-shifted forward move by O(1e-6 * y) with the row max, which it ignores
        assert_grad_close(ts[i].grad, f, [q, k, v][i], dy, rtol=1e-5, atol=5e-6, eps=1e-4)


@pytest.mark.parametrize("mask_rows", [True, False])
def test_sim_kernels_match_cpu(mask_rows):
    q, k, v, mask = _inputs(lf=2, lt=3, heads=2, d=2, mask_rows=mask_rows)
    assert_sim_matches_cpu(MHA, [q, k, v, mask], ["o"], num_attention_heads=2)


def test_bad_input_fails_clearly():
    def model():
        m = _model(("unused", "unused"), [("hist", 4, 1)], 1, batch=8)
        emb(m, "hist", "e", 4)  # (8, 4, 4)
        D(m, L.SequenceMask, ["dense", "dense"], ["mask"], max_sequence_len_from=4, max_sequence_len_to=4)
        D(m, L.InnerProduct, ["e"], ["q"], num_output=6)  # (8, 4, 6)
        D(m, L.InnerProduct, ["e"], ["k"], num_output=6)
        D(m, L.Reshape, ["e"], ["e3"], shape=[-1, 2, 8])  # (8, 2, 8)
        D(m, L.SequenceMask, ["dense", "dense"], ["m43"], max_sequence_len_from=4, max_sequence_len_to=3)
        return m

    m = model()
    D(m, MHA, ["q", "k", "k", "mask"], ["o"], num_attention_heads=3)
    assert m.shapes["o"] == (8, 4, 6)
    err = hugectr.ModelError
    with pytest.raises(err, match=r"expects 1 top tensor\(s\), got 2"):
        D(m, MHA, ["q", "k", "k", "mask"], ["o2", "o3"], num_attention_heads=3)
    D(m, MHA, ["q", "k", "k"], ["o3"], num_attention_heads=3)  # v23.12's unmasked form
    assert m.shapes["o3"] == (8, 4, 6)
    with pytest.raises(err, match=r"must share B and H\*d.*'e3' \(8, 2, 8\)"):
        D(m, MHA, ["q", "e3", "e3"], ["o2"], num_attention_heads=3)
    with pytest.raises(err, match=r"expects \(2, 3, 4\) bottom tensor\(s\), got 5"):
        D(m, MHA, ["q", "k", "k", "mask", "mask"], ["o2"])
    with pytest.raises(err, match=r"width 6 of 'q' \(8, 4, 6\) is not divisible by num_attention_heads=4"):
        D(m, MHA, ["q", "k", "k", "mask"], ["o2"], num_attention_heads=4)
    with pytest.raises(err, match=r"Q, K, V must be 3-D, got 'q' \(8, 4, 6\), 'mask' \(8, 1, 4, 4\)"):
        D(m, MHA, ["q", "mask", "k", "mask"], ["o2"], num_attention_heads=3)
    with pytest.raises(err, match=r"must share B and H\*d.*'e3' \(8, 2, 8\)"):
        D(m, MHA, ["q", "k", "e3", "mask"], ["o2"], num_attention_heads=3)
    with pytest.raises(
        err,
        match=r"mask 'm43' \(8, 1, 4, 3\) does not fit Q \(8, 4, 6\) and K \(8, 4, 6\): "
        r"need \(8, 1, 4, 4\) or \(8, 1, 1, 4\)",
    ):
        D(m, MHA, ["q", "k", "k", "m43"], ["o2"], num_attention_heads=3)
    with pytest.raises(err, match=r"mask 'e' \(8, 4, 4\) does not fit"):
        D(m, MHA, ["q", "k", "k", "e"], ["o2"], num_attention_heads=3)
    with pytest.raises(err, match="num_attention_heads must be a positive int, got 0"):
        D(m, MHA, ["q", "k", "k", "mask"], ["o2"], num_attention_heads=0)


# ---- model level: v23.12's BST graph ------------------------------------------------------------
T, V, H = 4, 4, 2


def _bst(data, four_input: bool, masked: bool = True):
    """test/pybind_test/bst_fp32_1gpu.py (v23.12), shrunk; four_input=False spells the attention as v23.08
    did (scores, masked Softmax, values); masked=False drops the mask (v23.12's three-input form)."""
    m = _model(data, BST_IN, 1)
    emb(m, "hist", "hist_emb", V)  # (B, T, V)
    emb(m, "user", "user_emb", V)
    D(m, L.SequenceMask, ["dense", "dense"], ["sequence_mask"], max_sequence_len_from=T, max_sequence_len_to=T)
    for name in ("query_emb", "key_emb", "value_emb"):
        D(m, L.InnerProduct, ["hist_emb"], [name], num_output=8)  # (B, T, 8)
    if four_input:
        D(
            m,
            MHA,
            ["query_emb", "key_emb", "value_emb"] + ["sequence_mask"] * masked,
            ["attention_out"],
            num_attention_heads=H,
        )
    else:
        D(m, MHA, ["query_emb", "key_emb", "value_emb"], ["scores", "v4"], num_attention_heads=H)
        D(m, L.Softmax, ["scores", "sequence_mask"], ["probs"])
        D(m, MHA, ["probs", "v4"], ["attention_out"])
    D(m, L.Add, ["attention_out", "query_emb"], ["attention_add_shortcut"])
    D(m, L.LayerNorm, ["attention_add_shortcut"], ["attention_layer_norm"])
    D(m, L.InnerProduct, ["attention_layer_norm"], ["attention_ffn1"], num_output=16)
    D(m, L.InnerProduct, ["attention_ffn1"], ["attention_ffn2"], num_output=8)
    D(m, L.Add, ["attention_ffn2", "attention_layer_norm"], ["attention_ffn_shortcut"])
    D(m, L.LayerNorm, ["attention_ffn_shortcut"], ["attention_ffn_layer_norm"])
    D(m, L.ReduceMean, ["attention_ffn_layer_norm"], ["reduce"], axis=1)  # (B, 1, 8)
    D(m, L.Reshape, ["reduce"], ["reshape_attention_out"], leading_dim=8)
    D(m, L.Reshape, ["user_emb"], ["reshape_user"], leading_dim=V)
    D(m, L.Concat, ["reshape_attention_out", "reshape_user"], ["concat"])
    D(m, L.InnerProduct, ["concat"], ["fc1"], num_output=8)
    D(m, L.ReLU, ["fc1"], ["relu1"])
    D(m, L.InnerProduct, ["relu1"], ["fc2"], num_output=1)
    D(m, L.BinaryCrossEntropyLoss, ["fc2", "label"], ["loss"])
    return m


def _train(m, steps):
    m.start_data_reading()
    out = []
    for _ in range(steps):
        assert m.train()
        out.append(m.get_current_loss())
    return out


@pytest.fixture(scope="module")
def bst_data(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp("bst4")), BST_IN, dense=1, dense_fn=bst_dense)


def test_bst_v23_12_graph_trains_as_the_v23_08_spelling(bst_data, tmp_path):
    device.set_device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new, old = _bst(bst_data, True), _bst(bst_data, False)
        new.compile()
        old.compile()
        ln, lo = _train(new, 5), _train(old, 5)
    assert ln == lo and np.isfinite(ln).all()
    np.testing.assert_array_equal(device.to_host(new.weights), device.to_host(old.weights))
    np.testing.assert_array_equal(
        new.check_out_tensor("attention_out", hugectr.Tensor_t.Train),
        old.check_out_tensor("attention_out", hugectr.Tensor_t.Train),
    )
    # graph JSON: HugeCTR's keys; read back, the same graph trains the same
    p = str(tmp_path / "bst.json")
    new.graph_to_json(p)
    (att,) = [d for d in json.load(open(p))["layers"] if d["type"] == "MultiHeadAttention"]
    assert att["num_attention_heads"] == H and att["transpose_b"] is False and att["top"] == "attention_out"
    assert len(att["bottom"]) == 4 and att["bottom"][3] == "sequence_mask"
    s = new.solver
    again = hugectr.Model(
        hugectr.CreateSolver(
            batchsize=s.batchsize,
            batchsize_eval=s.batchsize_eval,
            lr=s.lr,
            vvgpu=[[0]],
            i64_input_key=True,
            seed=s.seed,
        ),
        new.reader_params,
        new.opt_params,
    )
    again.construct_from_json(p, include_dense_network=True)
    again.compile()
    p2 = str(tmp_path / "again.json")
    again.graph_to_json(p2)
    assert json.load(open(p2)) == json.load(open(p))
    fresh = _bst(bst_data, True)
    fresh.compile()
    assert _train(again, 3) == _train(fresh, 3)
    assert math.isfinite(new.get_current_loss())


@pytest.mark.parametrize("masked", [True, False])
def test_onnx_export_predicts_the_same(bst_data, tmp_path, capfd, masked):
    """numbactr's hugectr2onnx writes the v23.12 attention as ONNX ops; onnxruntime == numbactr."""
    pytest.importorskip("onnxruntime")
    from tests.test_onnx_converter import assert_same, convert, eval_batches, ragged_batch

    device.set_device("cpu")
    m = _bst(bst_data, True, masked)
    m.compile()
    _train(m, 3)
    # sharper attention and a steeper head than 3 steps give, so that the mask and the softmax's scale
    # show in the predictions (a mask ignored moves them by ~1e-2, scores scaled by 1.1 by ~1e-3)
    for layer in m.layers:
        if layer.cfg.top_names[0] in ("query_emb", "key_emb", "fc1", "fc2"):
            for w in layer.params:
                w.data *= 6.0
    capfd.readouterr()
    predictor = convert(m, str(tmp_path))
    assert "onnxruntime" not in capfd.readouterr().err
    for batch in eval_batches(m, 1) + [ragged_batch(m, np.random.default_rng(2), 5)]:
        assert_same(m, predictor, batch)
