"""The cpu device's compiled CPU ops (numba.njit) against their NumPy references, the oracle.

Each compiled op equals its reference (property tests over small shapes, edge cases, non-finite values;
shapes past kernels.parallel_cpu.PARALLEL_MIN for the parallel branch), with the same bits on 1 and 2
numba threads; the switch to references only
(numbactr.runtime.device.reference_ops / NUMBACTR_CPU_REFERENCE) works; and whole training steps of small DLRMs
on the cpu device equal the same steps computed with the references only (dense ops, dense optimizer and
the embedding engine's reference impl).
"""

import contextlib

import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numba.extending import intrinsic

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.kernels import bce, bias, interaction, relu
from numbactr.kernels import fused_bias_act as fba
from numbactr.kernels import optimizers as K
from numbactr.kernels import optimizers_cpu as C
from numbactr.kernels.parallel_cpu import PARALLEL_MIN
from numbactr.optim import DenseOptimizer
from tests.model_util import tiny_data, tiny_dlrm

O, U = hugectr.Optimizer_t, hugectr.Update_t
THREADS = (1, 2) if numba.config.NUMBA_NUM_THREADS >= 2 else (1,)


@contextlib.contextmanager
def numba_threads(n):
    before = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(before)


def each_thread_count(fn):
    """fn() under every thread count of THREADS; asserts the results are bit-identical, returns the first."""
    results = []
    for n in THREADS:
        with numba_threads(n):
            results.append(fn())
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)
    return results[0]


def f32(rng, shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def assert_column_sums_close(got, want, terms):
    """Column sums of terms (..., N) in another float32 order: off by a few ulps of sum |terms|."""
    scale = np.abs(terms.reshape(-1, terms.shape[-1])).sum(axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(scale.max(initial=0.0)))


# ---- interaction ---------------------------------------------------------------------------------
@given(b=st.integers(0, 9), s=st.integers(0, 7), v=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_interaction_matches_reference(b, s, v, seed):
    rng = np.random.default_rng(seed)
    dense, emb = f32(rng, (b, v)), f32(rng, (b, s, v))
    dy = f32(rng, (b, interaction.interaction_out_width(s, v)))

    def run():
        out = np.full(dy.shape, np.nan, np.float32)
        d_dense, d_emb = np.full_like(dense, np.nan), np.full_like(emb, np.nan)
        interaction.interaction_forward_cpu(dense, emb, out)
        interaction.interaction_backward_cpu(dense, emb, dy, d_dense, d_emb)
        return out, d_dense, d_emb

    out, d_dense, d_emb = each_thread_count(run)
    tol = dict(rtol=1e-5, atol=1e-5 * v)
    np.testing.assert_allclose(out, interaction.interaction_forward_ref(dense, emb), **tol)
    ref_dense, ref_emb = interaction.interaction_backward_ref(dense, emb, dy)
    np.testing.assert_allclose(d_dense, ref_dense, **tol)
    np.testing.assert_allclose(d_emb, ref_emb, **tol)


def test_interaction_dlrm_shape_and_non_finite_values():
    rng = np.random.default_rng(3)
    b, s, v = 200, 26, 16  # several parallel chunks; the demo's widths
    dense, emb = f32(rng, (b, v)), f32(rng, (b, s, v))
    dy = f32(rng, (b, interaction.interaction_out_width(s, v)))
    d_dense, d_emb = np.empty_like(dense), np.empty_like(emb)
    interaction.interaction_backward_cpu(dense, emb, dy, d_dense, d_emb)
    ref_dense, ref_emb = interaction.interaction_backward_ref(dense, emb, dy)
    np.testing.assert_allclose(d_dense, ref_dense, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(d_emb, ref_emb, rtol=1e-5, atol=1e-4)
    # forward: nan and inf where the reference has them. (Not the backward: the reference multiplies the
    # zero diagonal of its pair-gradient matrix by Z_i, 0 * inf = nan, where the kernels skip j == i.)
    dense[1, 2], emb[2, 3, 4], emb[3, 0, 0] = np.inf, np.nan, -np.inf
    out = np.empty(dy.shape, np.float32)
    interaction.interaction_forward_cpu(dense, emb, out)
    np.testing.assert_allclose(out, interaction.interaction_forward_ref(dense, emb), rtol=1e-5, atol=1e-4)
    assert np.isnan(out[2]).any() and np.isinf(out[1]).any()
    assert out[:, -1].tolist() == [0.0] * b  # the pad


def test_interaction_wrapper_checks_shapes():
    dense, emb = np.zeros((2, 4), np.float32), np.zeros((2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="output/grad shape"):
        interaction.interaction_forward_cpu(dense, emb, np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="does not match dense"):
        interaction.interaction_backward_cpu(
            dense, np.zeros((2, 3, 5), np.float32), np.zeros((2, 11), np.float32), dense.copy(), emb.copy()
        )


# ---- ReLU, bias, fused bias + activation ---------------------------------------------------------
SPECIAL = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, -1e-45, 3.0, -3.0], np.float32)


def with_specials(rng, shape):
    x = f32(rng, shape)
    flat = x.reshape(-1)
    k = min(flat.size, SPECIAL.size)
    flat[rng.choice(flat.size, k, replace=False)] = SPECIAL[:k]
    return x


@given(m=st.integers(0, 40000), n=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_relu_matches_reference_exactly(m, n, seed):
    rng = np.random.default_rng(seed)
    x, dy = with_specials(rng, (m, n)), f32(rng, (m, n))

    def run():
        y, dx = np.empty_like(x), np.empty_like(x)
        relu.relu_forward_cpu(x, y)
        relu.relu_backward_cpu(y, dy, dx)
        return y, dx

    y, dx = each_thread_count(run)
    np.testing.assert_array_equal(y, relu.relu_forward_ref(x))  # NaN stays NaN, as np.maximum
    np.testing.assert_array_equal(dx, relu.relu_backward_ref(relu.relu_forward_ref(x), dy))


@given(m=st.integers(0, 700), n=st.integers(1, 40), three_d=st.booleans(), seed=st.integers(0, 2**16))
def test_bias_add_and_grad_match_reference(m, n, three_d, seed):
    rng = np.random.default_rng(seed)
    shape = (m, 2, n) if three_d else (m, n)
    y, b, dy = f32(rng, shape), f32(rng, (n,)), f32(rng, shape)

    def run():
        out, db = y.copy(), np.full(n, np.nan, np.float32)
        bias.bias_add_cpu(out, b)
        bias.bias_grad_cpu(dy, db)
        return out, db

    out, db = each_thread_count(run)
    np.testing.assert_array_equal(out, bias.bias_add_ref(y, b))
    assert_column_sums_close(db, bias.bias_grad_ref(dy), dy)
    with pytest.raises(ValueError, match="bias width"):
        bias.bias_add_cpu(y, np.zeros(n + 1, np.float32))
    with pytest.raises(ValueError, match="bias width"):
        bias.bias_grad_cpu(dy, np.zeros(n + 1, np.float32))


@given(
    m=st.integers(0, 600),
    n=st.integers(1, 40),
    relu_on=st.booleans(),
    has_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bias_act_matches_reference(m, n, relu_on, has_bias, seed):
    rng = np.random.default_rng(seed)
    pre, dy = with_specials(rng, (m, n)), f32(rng, (m, n))
    b = f32(rng, (n,)) if has_bias else None

    def run():
        y = pre.copy()
        fba.bias_act_forward_cpu(y, b, relu_on)
        d = np.full_like(y, np.nan)
        db = np.full(n, np.nan, np.float32) if has_bias else None
        fba.bias_act_backward_cpu(y, dy, relu_on, d, db)
        return (y, d) + ((db,) if has_bias else ())

    got = each_thread_count(run)
    y = fba.bias_act_forward_ref(pre, b, relu_on)
    d, db = fba.bias_act_backward_ref(y, dy, relu_on, has_bias)
    np.testing.assert_array_equal(got[0], y)
    np.testing.assert_array_equal(got[1], d)
    if has_bias:
        assert_column_sums_close(got[2], db, np.where(np.isfinite(d), d, 0))  # NaN where a NaN was summed


# ---- BCE -----------------------------------------------------------------------------------------
@given(n=st.integers(0, 300), seed=st.integers(0, 2**16), scale=st.sampled_from([1.0, 30.0, 1e4]), data=st.data())
def test_bce_matches_reference(n, seed, scale, data):
    b = data.draw(st.integers(0, n))
    rng = np.random.default_rng(seed)
    x = f32(rng, (n, 1), scale)
    y = rng.random((n, 1)).astype(np.float32)  # fractional labels too
    y[: n // 2] = np.round(y[: n // 2])
    grad_scale = 1.0 / max(b, 1)
    dx = np.full_like(x, np.nan)
    loss = bce.bce_forward_backward_cpu(x, y, dx, b, grad_scale)
    ref_loss, ref_dx = bce.bce_forward_backward_ref(x, y, b, grad_scale)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(dx.reshape(-1), ref_dx, rtol=1e-5, atol=1e-9)
    assert not dx[b:].any()


def test_parallel_branches_match_reference():
    """Shapes past PARALLEL_MIN run the prange branch: still the reference, and the same bits on 1 and 2 threads."""
    rng = np.random.default_rng(5)
    rows = PARALLEL_MIN // 300 + 7  # (rows, 300) > PARALLEL_MIN, a partial last chunk
    pre, dy, b = with_specials(rng, (rows, 300)), f32(rng, (rows, 300)), f32(rng, (300,))

    def dense_ops():
        y, d, db, db2, act = (
            pre.copy(),
            np.empty_like(pre),
            np.empty(300, np.float32),
            np.empty(300, np.float32),
            np.empty_like(pre),
        )
        bias.bias_add_cpu(y, b)
        bias.bias_grad_cpu(dy, db)
        relu.relu_forward_cpu(y, act)
        relu.relu_backward_cpu(act, dy, d)
        y2 = pre.copy()
        fba.bias_act_forward_cpu(y2, b, True)
        d2 = np.empty_like(pre)
        fba.bias_act_backward_cpu(y2, dy, True, d2, db2)
        return y, db, act, d, y2, d2, db2

    y, db, act, d, y2, d2, db2 = each_thread_count(dense_ops)
    np.testing.assert_array_equal(y, bias.bias_add_ref(pre, b))
    assert_column_sums_close(db, bias.bias_grad_ref(dy), dy)
    np.testing.assert_array_equal(act, relu.relu_forward_ref(y))
    np.testing.assert_array_equal(d, relu.relu_backward_ref(act, dy))
    ref_y = fba.bias_act_forward_ref(pre, b, True)
    ref_d, ref_db = fba.bias_act_backward_ref(ref_y, dy, True, True)
    np.testing.assert_array_equal(y2, ref_y)
    np.testing.assert_array_equal(d2, ref_d)
    assert_column_sums_close(db2, ref_db, np.where(np.isfinite(ref_d), ref_d, 0))

    bsz, s, v = 300, 26, 16  # 300 x 368 outputs x 16 > PARALLEL_MIN
    dense, emb = f32(rng, (bsz, v)), f32(rng, (bsz, s, v))
    dy = f32(rng, (bsz, interaction.interaction_out_width(s, v)))

    def inter():
        out, d_dense, d_emb = np.empty_like(dy), np.empty_like(dense), np.empty_like(emb)
        interaction.interaction_forward_cpu(dense, emb, out)
        interaction.interaction_backward_cpu(dense, emb, dy, d_dense, d_emb)
        return out, d_dense, d_emb

    out, d_dense, d_emb = each_thread_count(inter)
    np.testing.assert_allclose(out, interaction.interaction_forward_ref(dense, emb), rtol=1e-5, atol=1e-4)
    ref_dense, ref_emb = interaction.interaction_backward_ref(dense, emb, dy)
    np.testing.assert_allclose(d_dense, ref_dense, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(d_emb, ref_emb, rtol=1e-5, atol=1e-4)


def test_bce_checks_valid_rows():
    x = np.zeros((4, 1), np.float32)
    with pytest.raises(ValueError, match="valid rows b=5"):
        bce.bce_forward_backward_cpu(x, x, x.copy(), 5, 1.0)


# ---- dense optimizers ----------------------------------------------------------------------------
DENSE_RULES = {  # name: (compiled update, reference, number of states, extra hyper-parameters)
    "sgd": (C.sgd_update, K.sgd_update_ref, 0, ()),
    "momentum": (C.momentum_sgd_update, K.momentum_sgd_update_ref, 1, (0.9,)),
    "nesterov": (C.nesterov_update, K.nesterov_update_ref, 1, (0.9,)),
    "adagrad": (C.adagrad_update, K.adagrad_update_ref, 1, (1e-7,)),
    "adam": (C.adam_update, K.adam_update_ref, 2, (0.9, 0.999, 1e-7)),
}


@pytest.mark.parametrize("name", sorted(DENSE_RULES))
@pytest.mark.parametrize("p,lr,scaler", [(1, 0.01, 1.0), (37, 0.0, 1.0), (PARALLEL_MIN + 3, 0.05, 1024.0)])
def test_dense_update_matches_reference(name, p, lr, scaler):
    fn, ref, n_states, hyper = DENSE_RULES[name]
    rng = np.random.default_rng(p)
    w = f32(rng, (p,))
    states = [np.abs(f32(rng, (p,))) if name in ("adagrad", "adam") else f32(rng, (p,)) for _ in range(n_states)]
    ref_w, ref_states = w.copy(), [s.copy() for s in states]
    for t in (1, 2, 3):
        g = f32(rng, (p,), scaler)
        args = (lr, *hyper, t, scaler) if name == "adam" else (lr, *hyper, scaler)
        fn(w, *states, g, *args)
        out = ref(ref_w, *ref_states, g, *args)
        ref_w, ref_states = (out, []) if n_states == 0 else (out[0], list(out[1:]))
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)
    for s, r in zip(states, ref_states):
        np.testing.assert_allclose(s, r, rtol=1e-5, atol=1e-7)
    if lr == 0 and name != "momentum" and name != "nesterov":
        np.testing.assert_array_equal(w, ref_w)  # frozen: the weights do not move at all


HYPER = {
    O.SGD: {},
    O.MomentumSGD: dict(momentum_factor=0.5),
    O.Nesterov: dict(momentum_factor=0.5),
    O.Adam: dict(beta1=0.9, beta2=0.999, epsilon=1e-7),
    O.AdaGrad: dict(initial_accu_value=0.1, epsilon=1e-7),
    O.Ftrl: dict(beta=0.1, lambda1=0.01, lambda2=0.01),
}


@pytest.mark.parametrize("t", [O.SGD, O.MomentumSGD, O.Nesterov, O.Adam, O.AdaGrad, O.Ftrl])
def test_dense_optimizer_compiled_equals_references(t, cpu):
    rng = np.random.default_rng(1)
    w0, grads = f32(rng, (100,)), [f32(rng, (100,)) for _ in range(3)]
    results = []
    for mode in (contextlib.nullcontext, device.reference_ops):
        with mode():
            opt, w = DenseOptimizer(hugectr.CreateOptimizer(optimizer_type=t, **HYPER[t]), 100), w0.copy()
            for g in grads:
                opt.step(w, g, 0.01, 2.0)
            results.append((w, *opt.states))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# ---- the switch ----------------------------------------------------------------------------------
def test_reference_switch(cpu, monkeypatch):
    monkeypatch.delenv(device.ENV_REFERENCE, raising=False)
    assert device.compiled_cpu()
    with device.reference_ops():
        with device.reference_ops():
            assert not device.compiled_cpu()
        assert not device.compiled_cpu()
    assert device.compiled_cpu()
    monkeypatch.setenv(device.ENV_REFERENCE, "1")
    assert not device.compiled_cpu()
    monkeypatch.setenv(device.ENV_REFERENCE, "0")
    assert device.compiled_cpu()
    monkeypatch.setenv(device.ENV_REFERENCE, "yes")
    with pytest.raises(device.DeviceError, match="NUMBACTR_CPU_REFERENCE='yes'"):
        device.compiled_cpu()


def test_no_compiled_ops_off_the_cpu_device():
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    before = device.kind()
    device.set_device("sim")
    try:
        assert not device.compiled_cpu()
    finally:
        device.set_device(before)


# ---- whole training steps ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("cpu-compiled")), n_train=256, n_eval=64)


def mlp_dlrm(train, evl, *, optimizer, update, slots=3, dense=2, vec=4):
    """Bottom and top MLP layers (the fused bias + ReLU path) around a dot interaction."""
    solver = hugectr.CreateSolver(
        batchsize=64, batchsize_eval=64, max_eval_batches=1, lr=0.01, vvgpu=[[0]], i64_input_key=True
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[train], eval_source=evl, check_type=hugectr.Check_t.Sum
    )
    model = hugectr.Model(solver, reader, hugectr.CreateOptimizer(optimizer_type=optimizer, update_type=update))
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
            embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=vec,
            combiner="sum",
            sparse_embedding_name="emb",
            bottom_name="data1",
        )
    )
    L, A = hugectr.Layer_t, hugectr.Activation_t
    model.add(hugectr.DenseLayer(L.MLP, ["dense"], ["bottom"], num_outputs=[8, vec]))
    model.add(hugectr.DenseLayer(L.Interaction, ["bottom", "emb"], ["inter"]))
    model.add(
        hugectr.DenseLayer(
            L.MLP, ["inter"], ["top"], num_outputs=[8, 1], activations=[A.Relu, A.Non], biases=[True, False]
        )
    )
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["top", "label"], ["loss"]))
    model.compile()
    return model


def train_steps(build, data, steps, **kw):
    """(losses, dense weights, embedding rows) after ``steps`` training steps of a freshly built model."""
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        model = build(*data, **kw)
    losses = []
    for _ in range(steps):
        model.train()
        losses.append(model.get_current_loss())
    emb = model.embeddings[0]
    return model, np.array(losses), model.weights.copy(), np.array(emb.weight.data)


CASES = [
    (tiny_dlrm, O.Adam, U.Global),
    (tiny_dlrm, O.SGD, U.Local),
    (tiny_dlrm, O.MomentumSGD, U.Local),
    (tiny_dlrm, O.Nesterov, U.Global),
    (tiny_dlrm, O.AdaGrad, U.Local),
    (mlp_dlrm, O.Adam, U.Global),
]


@pytest.mark.parametrize("build,optimizer,update", CASES, ids=lambda c: getattr(c, "name", getattr(c, "__name__", c)))
def test_training_steps_compiled_equal_references(data, cpu, build, optimizer, update):
    fast = train_steps(build, data, 3, optimizer=optimizer, update=update)
    with device.reference_ops():
        ref = train_steps(build, data, 3, optimizer=optimizer, update=update)
    assert fast[0].embeddings[0].engine.impl == "cpu" and ref[0].embeddings[0].engine.impl == "ref"
    np.testing.assert_allclose(fast[1], ref[1], rtol=1e-5)  # losses
    np.testing.assert_allclose(fast[2], ref[2], rtol=1e-4, atol=1e-6)  # dense weights
    np.testing.assert_allclose(fast[3], ref[3], rtol=1e-4, atol=1e-6)  # embedding rows


@pytest.mark.parametrize("build", [tiny_dlrm, mlp_dlrm])
def test_training_step_runs_no_reference_op(data, cpu, build, monkeypatch):
    """On the cpu device a DLRM step calls none of the references that have a compiled version."""

    def refuse(*args, **kwargs):
        raise AssertionError("a NumPy reference ran where its compiled version should")

    refs = {
        relu: ["relu_forward_ref", "relu_backward_ref"],
        bias: ["bias_add_ref", "bias_grad_ref"],
        fba: ["bias_act_forward_ref", "bias_act_backward_ref"],
        bce: ["bce_forward_backward_ref"],
        interaction: ["interaction_forward_ref", "interaction_backward_ref"],
        K: ["adam_update_ref"],
    }
    for mod, names in refs.items():
        for name in names:
            monkeypatch.setattr(mod, name, refuse)
    losses = train_steps(build, data, 2, optimizer=O.Adam, update=U.Global)[1]
    assert np.isfinite(losses).all()


def test_parallel_functions_run_their_serial_twin_on_one_thread_with_the_same_bits():
    """kernels.parallel_cpu.pjit: one numba thread runs the serial twin (no parallel region to wake a
    worker for), more run the parallel one; chunking does not depend on the thread count, so a reduction
    (the bias gradient) and the interaction give identical bits either way. The twins keep separate
    entries in Numba's disk cache (their names differ)."""
    from numbactr.kernels.parallel_cpu import ParallelTwin
    from numbactr.kernels import tbe_cpu

    twin = bias._bias_grad_cpu
    assert isinstance(twin, ParallelTwin) and twin.serial.py_func.__qualname__ == "_bias_grad_cpu_serial"
    assert isinstance(tbe_cpu.radix_sort, ParallelTwin) and isinstance(tbe_cpu.fused_update, ParallelTwin)
    assert isinstance(tbe_cpu.forward, ParallelTwin)
    rng = np.random.default_rng(0)
    dy = rng.standard_normal((2 * PARALLEL_MIN // 64, 64)).astype(np.float32)  # past PARALLEL_MIN: chunks
    dense = rng.standard_normal((300, 16)).astype(np.float32)
    emb = rng.standard_normal((300, 26, 16)).astype(np.float32)
    got, ran = {}, []
    serial, parallel = twin.serial, twin.parallel
    twin.serial = lambda *a: (ran.append("serial"), serial(*a))[1]  # which twin a call runs
    twin.parallel = lambda *a: (ran.append("parallel"), parallel(*a))[1]
    before = numba.get_num_threads()
    try:
        for n in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(n)
            db = np.empty(64, np.float32)
            twin(dy, db)
            assert ran[-1] == ("serial" if n == 1 else "parallel")
            out = np.empty((300, interaction.interaction_out_width(26, 16)), np.float32)
            interaction.interaction_forward_cpu(dense, emb, out)
            got[n] = (db, out)
    finally:
        numba.set_num_threads(before)
        twin.serial, twin.parallel = serial, parallel
    first, last = got[1], got[max(got)]
    np.testing.assert_array_equal(first[0], last[0])
    np.testing.assert_array_equal(first[1], last[1])
    np.testing.assert_allclose(first[0], dy.sum(0), rtol=1e-4, atol=1e-3)


@intrinsic
def _meminfo_address(typingctx, arr):
    """The address of an array's meminfo (numba's reference-count handle): 0 for a borrowed array."""
    if not isinstance(arr, numba.types.Array):
        return None

    def codegen(context, builder, signature, args):
        held = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.ptrtoint(held.meminfo, context.get_value_type(numba.types.intp))

    return numba.types.intp(arr), codegen


def test_serial_twins_borrow_their_arrays_and_return_none_of_them():
    """kernels.parallel_cpu: the serial twin passes its body every array (and tuple of arrays) without
    its reference-count handle; results are the same, and a twin that would return an array (a borrowed
    one could outlive its owner) does not compile."""
    from numba import prange

    from numbactr.kernels.parallel_cpu import pjit

    @pjit(cache=False)
    def scale_rows(pair, x, out, k):
        a, b = pair
        for i in prange(x.shape[0]):
            out[i] = k * x[i] + a[i] - b[i]
        return out.shape[0]

    rng = np.random.default_rng(0)
    x, a, b = (rng.standard_normal(50).astype(np.float32) for _ in range(3))
    out = np.zeros(50, np.float32)
    assert scale_rows.serial((a, b), x, out, np.float32(2.0)) == 50
    np.testing.assert_array_equal(out, np.float32(2.0) * x + a - b)
    view = out[10:20]  # a view's owner stays alive after the call
    scale_rows.serial((a[:10], b[:10]), x[:10], view, np.float32(1.0))
    np.testing.assert_array_equal(out[10:20], x[:10] + a[:10] - b[:10])

    # what the bodies see: the serial twin's arrays carry no reference-count handle (a null meminfo), the
    # parallel twin's do (numba gives a parallel region's body its arrays borrowed itself, inside)
    @pjit(cache=False)
    def handles(pair, x, out):
        a, b = pair
        for i in prange(out.shape[0]):
            out[i] = x[i]
        return _meminfo_address(x), _meminfo_address(a), _meminfo_address(b)

    assert handles.serial((a, b), x, out) == (0, 0, 0)
    assert all(h != 0 for h in handles.parallel((a, b), x, out))

    @pjit(cache=False)
    def leaks(x):
        return x[1:]

    with pytest.raises(numba.core.errors.TypingError, match="must not return an array"):
        leaks.serial(x)

    @pjit(cache=False)
    def shift(x, out, k=np.float32(3.0)):
        for i in prange(x.shape[0]):
            out[i] = x[i] + k

    for twin in (shift.serial, shift.parallel):  # the defaults are the same for both twins
        out[:] = 0
        twin(x, out)
        np.testing.assert_array_equal(out, x + np.float32(3.0))
