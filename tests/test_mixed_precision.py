"""Mixed precision (issue 13, item 1): CreateSolver(use_mixed_precision=True, scaler=S).

fp16 activations, activation gradients and embedding outputs with float32 master weights; the static loss
scale (what it buys: gradients that would flush to zero in fp16 survive); the overflow skip (numbactr's
addition); the fp16-only graph forms of HugeCTR's DLRM fp16 samples (FusedInnerProduct Head/Body/Tail, the
two-top Interaction, the two-bottom MLP, GroupDenseLayer); and a model trained in mixed precision reaching
the fp32 model's AUC on planted-signal data.
"""

import os
import warnings

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.runtime import precision
from numbactr.train import overflow
from numbactr.data.synthetic import make_planted_dataset
from numbactr.autograd import Tape, Tensor
from numbactr.autograd.tape import autocast
from numbactr.ops.dense import FcBiasAct
from tests.model_util import tiny_data

L = hugectr.Layer_t
P = hugectr.FcPosition_t
A = hugectr.Activation_t
SLOTS, DENSE, VEC = 3, 2, 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("mp")), n_train=256, n_eval=128, slots=SLOTS, dense=DENSE)


def _model(data, mixed, scaler=1.0, opt=hugectr.Optimizer_t.Adam, lr=0.01, batch=32, dtype="float16"):
    solver = hugectr.CreateSolver(
        batchsize=batch,
        batchsize_eval=batch,
        max_eval_batches=2,
        lr=lr,
        vvgpu=[[0]],
        i64_input_key=True,
        seed=3,
        use_mixed_precision=mixed,
        scaler=scaler,
        mixed_precision_dtype=dtype,
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=[data[0]],
        eval_source=data[1],
        check_type=hugectr.Check_t.Sum,
    )
    o = hugectr.CreateOptimizer(optimizer_type=opt, update_type=hugectr.Update_t.Global)
    m = hugectr.Model(solver, reader, o)
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=DENSE,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, SLOTS)],
        )
    )
    m.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=VEC,
            combiner="sum",
            sparse_embedding_name="emb",
            bottom_name="data1",
            optimizer=o,
        )
    )
    return m


def _four(t):
    return [t, t + "_mask", t + "_dRelu", t + "_db"]


def fused_dlrm(data, mixed=True, **kw):
    """samples/dlrm/dgx_a100.py's graph, shrunk: FusedInnerProduct Head/Body/Tail bottom MLP, the two-top
    Interaction, a Head taking both Interaction tops, and the top MLP as a GroupDenseLayer."""
    m = _model(data, mixed, **kw)
    fc = L.FusedInnerProduct
    m.add(hugectr.DenseLayer(fc, ["dense"], _four("fc1"), num_output=8, pos_type=P.Head))
    m.add(hugectr.DenseLayer(fc, _four("fc1"), _four("fc2"), num_output=6, pos_type=P.Body))
    m.add(hugectr.DenseLayer(fc, _four("fc2"), ["fc3"], num_output=VEC, pos_type=P.Tail))
    m.add(hugectr.DenseLayer(L.Interaction, ["fc3", "emb"], ["inter", "inter_grad"]))
    m.add(hugectr.DenseLayer(fc, ["inter", "inter_grad"], _four("fc4"), num_output=16, pos_type=P.Head))
    m.add(hugectr.DenseLayer(fc, _four("fc4"), ["fc5"], num_output=8, pos_type=P.Tail))
    m.add(
        hugectr.GroupDenseLayer(
            hugectr.GroupLayer_t.GroupFusedInnerProduct, ["fc5"], ["fc6", "fc7"], [4, 1], last_act_type=A.Non
        )
    )
    m.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc7", "label"], ["loss"]))
    m.compile()
    return m


def plain_dlrm(data, mixed=False, **kw):
    """The same math written with fp32 HugeCTR's layers: InnerProduct + ReLU, one-top Interaction."""
    m = _model(data, mixed, **kw)
    prev = "dense"
    for name, n in (("fc1", 8), ("fc2", 6), ("fc3", VEC)):
        m.add(hugectr.DenseLayer(L.InnerProduct, [prev], [name + "_lin"], num_output=n))
        m.add(hugectr.DenseLayer(L.ReLU, [name + "_lin"], [name]))
        prev = name
    m.add(hugectr.DenseLayer(L.Interaction, ["fc3", "emb"], ["inter"]))
    prev = "inter"
    for name, n in (("fc4", 16), ("fc5", 8), ("fc6", 4)):
        m.add(hugectr.DenseLayer(L.InnerProduct, [prev], [name + "_lin"], num_output=n))
        m.add(hugectr.DenseLayer(L.ReLU, [name + "_lin"], [name]))
        prev = name
    m.add(hugectr.DenseLayer(L.InnerProduct, [prev], ["fc7"], num_output=1))
    m.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc7", "label"], ["loss"]))
    m.compile()
    return m


def _train(m, steps):
    m.start_data_reading()
    out = []
    for _ in range(steps):
        assert m.train()
        out.append(m.get_current_loss())
    return out


def _emb_weights(m):
    return np.array(device.to_host(m.embeddings[0].weight.data), copy=True)


# ---- the Solver ------------------------------------------------------------------------------------
def test_solver_accepts_mixed_precision_and_tf32():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "numbactr has no mixed precision" warning any more
        hugectr.CreateSolver(use_mixed_precision=True, scaler=1024)
        hugectr.CreateSolver(enable_tf32_compute=True)
    with pytest.raises(ValueError, match="use_mixed_precision and enable_tf32_compute cannot both be True"):
        hugectr.CreateSolver(use_mixed_precision=True, enable_tf32_compute=True)
    with pytest.raises(ValueError, match="mixed_precision_dtype must be one of"):
        hugectr.CreateSolver(use_mixed_precision=True, mixed_precision_dtype="float8")


# ---- storage policy ----------------------------------------------------------------------------------
def test_activations_half_master_weights_float32(data, cpu):
    m = fused_dlrm(data)
    _train(m, 2)
    t = m._last_tensors[True]
    for name in ("dense", "fc1", "fc3", "emb", "inter", "inter_grad", "fc5", "fc7"):
        assert t[name].data.dtype == np.float16, name
    assert t["inter_grad"] is t["inter"]  # the two-top Interaction's second top
    assert t["label"].data.dtype == np.float32 and t["loss"].data.dtype == np.float32
    assert m.weights.dtype == np.float32 and m.wgrads.dtype == np.float32
    assert m.embeddings[0].weight.data.dtype == np.float32
    assert np.isfinite(m.get_current_loss())
    # the half-precision activations are exactly the fp16 rounding of what check_out_tensor returns
    a = m.check_out_tensor("fc3", hugectr.Tensor_t.Train)
    assert a.dtype == np.float32 and np.array_equal(a.astype(np.float16).astype(np.float32), a)
    # eval runs in mixed precision too; the metric sees float32 probabilities
    m.eval()
    assert m._last_tensors[False]["inter"].data.dtype == np.float16
    assert m.loss_layer.predictions().dtype == np.float32


def test_tape_gradients_take_their_tensors_dtype():
    """Under autocast: float32 math on half inputs, half outputs, a half activation gradient and a
    float32 weight gradient; a float32 tape gives the float32 result the half one rounds."""
    rng = np.random.default_rng(0)
    x32 = rng.normal(size=(5, 3)).astype(np.float32)
    w = rng.normal(size=(3, 2)).astype(np.float32)
    b = rng.normal(size=(2,)).astype(np.float32)
    dy = rng.normal(size=(5, 2)).astype(np.float32)
    results = {}
    for half in (None, np.float16):
        tape = Tape(watch_finite=True)
        xd = x32 if half is None else x32.astype(half)
        x, wt, bt = (Tensor(xd, requires_grad=True), Tensor(w, requires_grad=True), Tensor(b, requires_grad=True))
        with autocast(half):
            y = FcBiasAct.apply(tape, x, wt, bt, relu=True)
        tape.backward({id(y): (y, dy if half is None else dy.astype(half))})
        results[half] = (y.data, x.grad, wt.grad)
        assert tape.grads_finite()
    y16, dx16, dw16 = results[np.float16]
    assert y16.dtype == np.float16 and dx16.dtype == np.float16 and dw16.dtype == np.float32
    y32, dx32, dw32 = results[None]
    np.testing.assert_allclose(y16, y32, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(dx16, dx32, rtol=5e-3, atol=5e-3)
    np.testing.assert_allclose(dw16, dw32, rtol=5e-3, atol=5e-3)


# ---- the loss scale ----------------------------------------------------------------------------------
def _underflow_model(data, mixed, scaler):
    """dense -> fc1 (4) -> fc2 (1) -> BCE with fc2's weights ~1e-6: the gradient reaching fc1's output is
    ~1e-8, below float16's smallest subnormal (6e-8); the embedding feeds a separate branch."""
    m = _model(data, mixed, scaler=scaler, opt=hugectr.Optimizer_t.SGD, lr=1.0)
    m.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc1"], num_output=4))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["fc1"], ["fc2"], num_output=1))
    m.add(hugectr.DenseLayer(L.Reshape, ["emb"], ["flat"], leading_dim=SLOTS * VEC))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["flat"], ["fce"], num_output=1))
    m.add(hugectr.DenseLayer(L.Add, ["fc2", "fce"], ["logit"]))
    m.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["logit", "label"], ["loss"]))
    m.compile()
    fc1_w = slice(0, DENSE * 4)
    fc2_w = slice(DENSE * 4 + 4, DENSE * 4 + 4 + 4)
    m.weights[fc2_w] = np.float32(1e-6) * np.array([1.0, -0.7, 0.4, 0.9], np.float32)
    return m, fc1_w


def test_loss_scale_prevents_fp16_gradient_underflow(data, cpu):
    deltas = {}
    for mixed, scaler in ((False, 1.0), (True, 1.0), (True, 1024.0)):
        m, fc1_w = _underflow_model(data, mixed, scaler)
        before = np.array(m.weights[fc1_w], copy=True)
        _train(m, 1)
        deltas[(mixed, scaler)] = m.weights[fc1_w] - before
    ref = deltas[(False, 1.0)]
    assert np.abs(ref).max() > 1e-9  # fp32: fc1 moves (by ~1e-8-sized steps)
    assert np.all(deltas[(True, 1.0)] == 0)  # unscaled fp16: the gradient flushed to zero
    np.testing.assert_allclose(deltas[(True, 1024.0)], ref, rtol=2e-2, atol=1e-3 * np.abs(ref).max())


def test_overflow_skips_the_step_and_warns(data, cpu):
    m = fused_dlrm(data, scaler=1e30)  # scaled loss gradient beyond float16's 65504
    m.start_data_reading()
    w0 = np.array(m.weights, copy=True)
    # what the table holds after the step's lookup inserted its new keys but no update ran: the same model
    # trained one step with its embedding frozen (learning rate 0)
    frozen = fused_dlrm(data, scaler=1024)
    frozen.freeze_embedding()
    _train(frozen, 1)
    e0 = _emb_weights(frozen)
    with pytest.warns(
        precision.GradientOverflowWarning,
        match=r"iteration 1's gradients overflowed float16 "
        r"at scaler=1e\+30; its update was skipped",
    ):
        assert m.train()
    assert m.skipped_steps == 1 and m.step == 1
    assert np.isfinite(m.get_current_loss())  # the loss itself was fine: no FloatingPointError
    np.testing.assert_array_equal(m.weights, w0)
    np.testing.assert_array_equal(_emb_weights(m), e0)
    assert m.dense_optimizer.t == 0  # Adam's step count (bias correction) did not move
    # the same model at a sane scale trains normally (nothing skipped, weights move)
    ok = fused_dlrm(data, scaler=1024)
    with warnings.catch_warnings():
        warnings.simplefilter("error", precision.GradientOverflowWarning)
        _train(ok, 2)
    assert ok.skipped_steps == 0 and not np.array_equal(ok.weights, w0)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nonfinite_loss_still_raises(data, cpu):
    m = fused_dlrm(data, scaler=1024)
    m.weights[...] = np.float32(np.inf)
    m.start_data_reading()
    with pytest.raises(FloatingPointError, match="non-finite training loss at iteration 1"):
        m.train()


# ---- the fp16 graph forms ------------------------------------------------------------------------------
def test_fp16_graph_forms_equal_fp32_layers(data, cpu):
    fused, plain = fused_dlrm(data, mixed=True), plain_dlrm(data, mixed=False)
    assert fused.n_params == plain.n_params
    np.testing.assert_array_equal(fused.weights, plain.weights)  # same layers, same init order
    lf, lp = _train(fused, 4), _train(plain, 4)
    np.testing.assert_allclose(lf, lp, rtol=1e-2, atol=2e-3)
    np.testing.assert_allclose(fused.weights, plain.weights, rtol=2e-2, atol=2e-3)
    for name in ("fc3", "inter", "fc7"):
        np.testing.assert_allclose(
            fused.check_out_tensor(name, hugectr.Tensor_t.Train),
            plain.check_out_tensor(name, hugectr.Tensor_t.Train),
            rtol=2e-2,
            atol=2e-2,
        )
    assert lf[-1] < lf[0]  # it trains


def test_two_bottom_mlp_equals_one_bottom(data, cpu):
    def build(mixed, two):
        m = _model(data, mixed, scaler=1024 if mixed else 1.0)
        m.add(hugectr.DenseLayer(L.MLP, ["dense"], ["bot"], num_outputs=[6, VEC]))
        m.add(hugectr.DenseLayer(L.Interaction, ["bot", "emb"], ["inter", "inter_grad"] if two else ["inter"]))
        m.add(
            hugectr.DenseLayer(
                L.MLP,
                ["inter", "inter_grad"] if two else ["inter"],
                ["top"],
                num_outputs=[8, 1],
                activations=[A.Relu, A.Non],
            )
        )
        m.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["top", "label"], ["loss"]))
        m.compile()
        return m

    two, one = build(True, True), build(False, False)
    np.testing.assert_allclose(_train(two, 3), _train(one, 3), rtol=1e-2, atol=2e-3)
    with pytest.raises(hugectr.ModelError, match="second bottom 'fc' .* must have the first's shape"):
        m = _model(data, True)
        m.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc"], num_output=3))
        m.add(hugectr.DenseLayer(L.MLP, ["dense", "fc"], ["top"], num_outputs=[1]))


# ---- files -------------------------------------------------------------------------------------------------
def test_saved_dense_model_is_the_fp32_master_weights(data, tmp_path, cpu):
    m = fused_dlrm(data, scaler=1024)
    _train(m, 2)
    m.save_params_to_files(str(tmp_path / "mp"), 2)
    saved = np.fromfile(tmp_path / "mp_dense_2.model", np.float32)
    np.testing.assert_array_equal(saved, m.weights)
    assert os.path.getsize(tmp_path / "mp_dense_2.model") == 4 * m.n_params


# ---- bfloat16 ---------------------------------------------------------------------------------------------
def test_bfloat16_storage(data, cpu):
    bf16 = precision.bfloat16_dtype()
    if bf16 is None:
        pytest.skip("ml_dtypes is not installed")
    m = fused_dlrm(data, scaler=1.0, dtype="bfloat16")
    losses = _train(m, 3)
    t = m._last_tensors[True]
    assert t["inter"].data.dtype == bf16 and t["emb"].data.dtype == bf16 and m.weights.dtype == np.float32
    ref = _train(plain_dlrm(data), 3)
    np.testing.assert_allclose(losses, ref, rtol=3e-2, atol=1e-2)


# ---- sim ----------------------------------------------------------------------------------------------------
def test_mixed_precision_on_sim_matches_cpu(data, on_device, monkeypatch):
    """With every op converting (NUMBACTR_HALF_KERNELS=0: float32 math on float32 copies, as on cpu) sim
    and cpu agree closely; sim's own float16 kernels and float16 GEMMs (the default) round at other places
    (the weights too, as tensor cores need), so they stay within a float16 rounding of that run."""
    res = {}
    for dev, native in (("sim", "0"), ("cpu", "0"), ("sim", "1")):
        monkeypatch.setenv("NUMBACTR_HALF_KERNELS", native)
        on_device(dev)
        m = fused_dlrm(data, scaler=1024, batch=16)
        res[dev + native] = (
            _train(m, 2),
            np.array(device.to_host(m.weights)),
            m._last_tensors[True]["inter"].data.dtype,
        )
    assert res["sim0"][2] == res["sim1"][2] == np.float16
    np.testing.assert_allclose(res["sim0"][0], res["cpu0"][0], rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(res["sim0"][1], res["cpu0"][1], rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(res["sim1"][0], res["sim0"][0], rtol=5e-3, atol=5e-4)
    np.testing.assert_allclose(res["sim1"][1], res["sim0"][1], rtol=1e-2, atol=1e-3)
    assert not np.array_equal(res["sim1"][1], res["sim0"][1])  # the float16 kernels did run


# ---- AUC on planted-signal data ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return make_planted_dataset(
        str(tmp_path_factory.mktemp("mp_planted")),
        16384,
        4096,
        dense_dim=4,
        slot_sizes=[50, 30, 20, 40],
        files=(1, 1),
        calibration_samples=5000,
    )


def _planted_model(ds, mixed):
    solver = hugectr.CreateSolver(
        batchsize=256,
        batchsize_eval=1024,
        max_eval_batches=4,
        lr=0.01,
        vvgpu=[[0]],
        i64_input_key=True,
        seed=1,
        use_mixed_precision=mixed,
        scaler=1024 if mixed else 1.0,
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=[ds.train_list],
        eval_source=ds.eval_list,
        check_type=hugectr.Check_t.Sum,
    )
    opt = hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.Adam)
    m = hugectr.Model(solver, reader, opt)
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=4,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 4)],
        )
    )
    m.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=8,
            combiner="sum",
            sparse_embedding_name="emb",
            bottom_name="data1",
            optimizer=opt,
        )
    )
    m.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc1"], num_output=8))
    m.add(hugectr.DenseLayer(L.ReLU, ["fc1"], ["r1"]))
    m.add(hugectr.DenseLayer(L.Interaction, ["r1", "emb"], ["inter"]))
    m.add(hugectr.DenseLayer(L.MLP, ["inter"], ["mlp"], num_outputs=[16, 1], activations=[A.Relu, A.Non]))
    m.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["mlp", "label"], ["loss"]))
    m.compile()
    return m


def test_mixed_precision_auc_matches_fp32(planted, cpu):
    aucs = {}
    for mixed in (False, True):
        m = _planted_model(planted, mixed)
        m.fit(max_iter=192, display=1000, eval_interval=10000)
        assert m.skipped_steps == 0
        aucs[mixed] = dict(m.eval_whole_source())["AUC"]
    assert aucs[False] > 0.70  # it learned the planted signal
    assert abs(aucs[True] - aucs[False]) < 0.002, aucs


# ---- TF32 ---------------------------------------------------------------------------------------------------
def _fake_cupy(monkeypatch, capability):
    """A stand-in for CuPy's modules (this machine has no GPU): records set_compute_type calls."""
    import sys
    import types

    calls = []
    linalg = types.SimpleNamespace(COMPUTE_TYPE_TF32=7, set_compute_type=lambda dt, ct: calls.append((dt, ct)))
    core = types.ModuleType("cupy._core")
    core._routines_linalg = linalg
    cupy = types.ModuleType("cupy")
    cupy._core = core
    cupy.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(compute_capability=capability))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy._core", core)
    monkeypatch.setitem(sys.modules, "cupy._core._routines_linalg", linalg)
    return calls


def test_enable_tf32_sets_cupys_float32_compute_type(monkeypatch):
    monkeypatch.delenv("CUPY_TF32", raising=False)
    calls = _fake_cupy(monkeypatch, "90")
    assert "TF32 tensor cores" in precision.enable_tf32()
    assert calls == [(np.float32, 7)] and os.environ["CUPY_TF32"] == "1"
    # a later model without enable_tf32_compute: CuPy's float32 compute type is undecided again (it reads
    # CUPY_TF32 at the next product) and CUPY_TF32 is as it was
    assert "no longer use TF32" in precision.disable_tf32()
    assert calls == [(np.float32, 7), (np.float32, 0)] and "CUPY_TF32" not in os.environ
    assert precision.disable_tf32() == "" and len(calls) == 2  # TF32 was not numbactr's: nothing to undo
    monkeypatch.setenv("CUPY_TF32", "1")  # the user's own setting is kept
    precision.enable_tf32()
    precision.disable_tf32()
    assert os.environ["CUPY_TF32"] == "1"
    # set_tf32: what each GPU model calls before its steps, so that TF32 follows the model that runs
    calls.clear()
    assert precision.set_tf32(True) and precision.set_tf32(True) == "" and calls == [(np.float32, 7)]
    assert precision.set_tf32(False) and precision.set_tf32(False) == "" and calls[-1] == (np.float32, 0)
    calls = _fake_cupy(monkeypatch, "70")  # Volta: no TF32, nothing set
    assert "has no TF32" in precision.enable_tf32() and calls == []
    precision.disable_tf32()


def test_tf32_has_no_effect_on_cpu(data, cpu, monkeypatch):
    monkeypatch.setattr(precision, "enable_tf32", lambda: pytest.fail("enable_tf32 called on the cpu device"))
    m = _model(data, False)
    assert m.solver.enable_tf32_compute is False
    solver = hugectr.CreateSolver(
        batchsize=32, batchsize_eval=32, vvgpu=[[0]], i64_input_key=True, enable_tf32_compute=True
    )
    hugectr.Model(solver, m.reader_params, m.opt_params)  # cpu: accepted, nothing to switch


# ---- every sample graph --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dcn", "wdl", "deepfm", "gmf", "din", "bst", "mmoe"])
def test_sample_graphs_train_in_mixed_precision(name, tmp_path, cpu, monkeypatch):
    """HugeCTR's sample graphs (tests/sample_graphs.py: MultiCross, FmOrder2, BatchNorm, Dropout, attention,
    several losses, ...) in mixed precision follow their fp32 losses to fp16 accuracy."""
    from tests import sample_graphs

    create = hugectr.CreateSolver
    losses = {}
    for mixed in (False, True):
        if mixed:
            monkeypatch.setattr(
                hugectr, "CreateSolver", lambda **kw: create(**kw, use_mixed_precision=True, scaler=1024)
            )
        m = sample_graphs.build(name, str(tmp_path / str(mixed)))
        losses[mixed] = _train(m, 3)
        assert m.eval() and m.skipped_steps == 0
        if mixed:
            tops = [t for layer in m.layers if not layer.is_loss for t in layer.cfg.top_names]
            assert all(m._last_tensors[False][t].data.dtype == np.float16 for t in tops)
    np.testing.assert_allclose(losses[True], losses[False], rtol=2e-3, atol=2e-3)


# ---- the overflow skip decided on the device (gpu, sim): no host read in the step ---------------------
SCALERS = (1024.0, 1e30, 1024.0, 1e30, 1e30, 1024.0)  # 1e30: the scaled gradients overflow float16


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the simulator's inf - inf
@pytest.mark.parametrize("opt", [hugectr.Optimizer_t.SGD, hugectr.Optimizer_t.Adam])  # Adam: Global's all-rows pass
def test_overflow_skipped_on_the_device_equals_the_host_decision(data, on_device, opt, monkeypatch):
    """On the kernels' devices an overflowed step shuts a gate that every update kernel reads (dense and the
    embedding's fused update and all-rows pass; Update_t.Global): no host read in the step, and the model
    ends exactly where the host's decision (read the flag, skip the update) leaves it. Adam's t, dense and
    sparse (its bias corrections), counts only the steps that updated: on the device, as the host's count
    less the skips it has not read yet. The skips are counted and warned about at the next check point."""
    import dataclasses

    from numbactr.kernels import launch

    on_device("sim")
    dev, host = (plain_dlrm(data, mixed=True, opt=opt, batch=4) for _ in range(2))
    gated = overflow.overflow_on_device  # the host's decision: one read of the flag per step
    monkeypatch.setattr(overflow, "overflow_on_device", lambda model: model is not host and gated(model))
    assert overflow.overflow_on_device(dev)
    for m in (dev, host):
        m.start_data_reading()
    for i, scaler in enumerate(SCALERS):
        for m in (dev, host):
            m.solver = dataclasses.replace(m.solver, scaler=scaler)
        before = np.array(dev.weights, copy=True)
        launch.reset_counts()
        with warnings.catch_warnings():
            warnings.simplefilter("error", precision.GradientOverflowWarning)  # none yet: nothing was read
            assert dev.train()
        assert launch.reset_counts()["host_reads"] == 0, f"step {i + 1}"
        # the gate shut: the dense weights did not move (the lookup's new keys took their initial rows)
        assert np.array_equal(dev.weights, before) == (scaler == 1e30), f"step {i + 1}"
        with pytest.warns(precision.GradientOverflowWarning) if scaler == 1e30 else warnings.catch_warnings():
            assert host.train()
        np.testing.assert_array_equal(dev.weights, host.weights, err_msg=f"step {i + 1}")
        np.testing.assert_array_equal(_emb_weights(dev), _emb_weights(host), err_msg=f"step {i + 1}")
    assert dev._skipped == 0  # not read yet
    with pytest.warns(
        precision.GradientOverflowWarning,
        match=r"the gradients of 3 step\(s\) up to iteration 6 "
        r"overflowed float16 .* \(3 skipped so far\)",
    ):
        assert dev.skipped_steps == 3
    assert host.skipped_steps == 3 and dev.step == host.step == 6
    np.testing.assert_array_equal(dev.weights, host.weights)
    np.testing.assert_array_equal(_emb_weights(dev), _emb_weights(host))
    for a, b in zip(dev.dense_optimizer.states, host.dense_optimizer.states):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert dev.embeddings[0].engine.step == host.embeddings[0].engine.step == 3  # the steps that updated
    assert dev.dense_optimizer.t == host.dense_optimizer.t == (3 if opt == hugectr.Optimizer_t.Adam else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", precision.GradientOverflowWarning)
        dev.check_deferred()  # nothing new: no second warning
    # a second round after the read: the device's t goes on from the host's corrected count
    for scaler in (1e30, 1024.0):
        for m in (dev, host):
            m.solver = dataclasses.replace(m.solver, scaler=scaler)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", precision.GradientOverflowWarning)
                assert m.train()
    np.testing.assert_array_equal(dev.weights, host.weights)
    np.testing.assert_array_equal(_emb_weights(dev), _emb_weights(host))


def test_overflow_gate_is_for_the_kernels_devices(data, on_device):
    """The cpu device reads the flag (host memory: the read is free); several ranks on the kernels' devices
    agree on a device gate (tests/test_step_counts.py)."""
    on_device("sim")
    assert overflow.overflow_on_device(plain_dlrm(data, mixed=True, opt=hugectr.Optimizer_t.Adam, batch=4))
    on_device("cpu")
    assert not overflow.overflow_on_device(plain_dlrm(data, mixed=True, opt=hugectr.Optimizer_t.SGD, batch=4))
