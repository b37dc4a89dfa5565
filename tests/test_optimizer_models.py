"""Model level, per optimizer x update type: a tiny DLRM learns on cpu; one sim step equals cpu."""

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.optim import SUPPORTED
from tests.model_util import tiny_data, tiny_dlrm

O, U = hugectr.Optimizer_t, hugectr.Update_t
COMBOS = sorted(SUPPORTED, key=lambda c: (c[0].name, c[1].name))
# SGD-like rules (momentum_factor defaults to 0) need a larger step than the adaptive ones
LR = {O.SGD: 0.2, O.MomentumSGD: 0.2, O.Nesterov: 0.2, O.AdaGrad: 0.05, O.Adam: 0.01, O.Ftrl: 0.05}


def _id(c):
    return f"{c[0].name}-{c[1].name}"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("tiny_opt")))


def _losses(model, steps):
    out = []
    for _ in range(steps):
        assert model.train()
        out.append(model.get_current_loss())
    return np.array(out)


def _falls(losses):
    first, last = losses[:15].mean(), losses[-15:].mean()
    assert np.isfinite(losses).all() and last < first - 0.01, (first, last)


@pytest.mark.parametrize("combo", COMBOS, ids=_id)
def test_loss_falls_on_cpu(data, on_device, combo):
    on_device("cpu")
    opt, upd = combo
    model = tiny_dlrm(*data, batch=32, lr=LR[opt], optimizer=opt, update=upd)
    _falls(_losses(model, 60))


def _ftrl_dlrm(train, evl, lr, batch=32, slots=3, dense=2, vec=4):
    """tiny_dlrm's graph with Ftrl on the dense weights and SGD on the embedding (as HugeCTR's ftrl sample)."""
    solver = hugectr.CreateSolver(
        batchsize=batch, batchsize_eval=batch, max_eval_batches=4, lr=lr, vvgpu=[[0]], i64_input_key=True, seed=0
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[train], eval_source=evl, check_type=hugectr.Check_t.Sum
    )
    model = hugectr.Model(
        solver, reader, hugectr.CreateOptimizer(optimizer_type=O.Ftrl, beta=0.1, lambda1=0.001, lambda2=0.001)
    )
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
            optimizer=hugectr.CreateOptimizer(optimizer_type=O.SGD),
        )
    )
    L = hugectr.Layer_t
    model.add(hugectr.DenseLayer(L.Reshape, ["emb"], ["flat"], leading_dim=slots * vec))
    model.add(hugectr.DenseLayer(L.Concat, ["dense", "flat"], ["cat"]))
    model.add(hugectr.DenseLayer(L.InnerProduct, ["cat"], ["fc1"], num_output=8))
    model.add(hugectr.DenseLayer(L.ReLU, ["fc1"], ["relu1"]))
    model.add(hugectr.DenseLayer(L.InnerProduct, ["relu1"], ["fc2"], num_output=1))
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc2", "label"], ["loss"]))
    model.compile()
    return model


def test_ftrl_dense_loss_falls_on_cpu(data, on_device):
    on_device("cpu")
    _falls(_losses(_ftrl_dlrm(*data, lr=LR[O.Ftrl]), 60))


@pytest.mark.parametrize("update", [U.Local, U.Global, U.LazyGlobal], ids=lambda u: u.name)
def test_ftrl_as_embedding_optimizer_raises(data, on_device, update):
    on_device("cpu")
    with pytest.raises(NotImplementedError, match=r"SparseEmbedding 'emb'.*Ftrl.*Update_t\." + update.name):
        tiny_dlrm(*data, optimizer=O.Ftrl, update=update)


@pytest.mark.parametrize("opt", [O.SGD, O.MomentumSGD, O.Nesterov, O.AdaGrad], ids=lambda o: o.name)
def test_lazy_global_needs_adam(data, on_device, opt):
    on_device("cpu")
    with pytest.raises(NotImplementedError, match=rf"{opt.name} with Update_t.LazyGlobal.*only implemented for Adam"):
        tiny_dlrm(*data, optimizer=opt, update=U.LazyGlobal)


def _state_after_steps(build, steps):
    model = build()
    for _ in range(steps):
        assert model.train()
    emb = model.embeddings[0]
    return (
        model.get_current_loss(),
        np.array(model.weights),
        np.array(emb.weight.data),
        [np.array(s) for s in model.dense_optimizer.states],
        [np.array(s) for s in emb.states],
    )


def _sim_equals_cpu(on_device, build, steps=2):
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    got = {}
    for dev in ("cpu", "sim"):
        on_device(dev)
        got[dev] = _state_after_steps(build, steps)
    (l0, w0, p0, ds0, ss0), (l1, w1, p1, ds1, ss1) = got["cpu"], got["sim"]
    assert l0 == pytest.approx(l1, rel=1e-5)
    np.testing.assert_allclose(w1, w0, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(p1, p0, rtol=1e-4, atol=1e-6)
    for a, b in zip(ds1 + ss1, ds0 + ss0):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("combo", COMBOS, ids=_id)
def test_two_steps_on_sim_match_cpu(data, on_device, combo):
    """Two steps, so that the second one reads the states the first wrote (momentum, lazy prev_time)."""
    opt, upd = combo
    _sim_equals_cpu(on_device, lambda: tiny_dlrm(*data, batch=16, lr=LR[opt], optimizer=opt, update=upd))


def test_ftrl_two_steps_on_sim_match_cpu(data, on_device):
    _sim_equals_cpu(on_device, lambda: _ftrl_dlrm(*data, lr=LR[O.Ftrl], batch=16))
