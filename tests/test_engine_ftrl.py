"""The engine's HUGECTR_FTRL (HugeCTR's Ftrl on the touched rows, EmbeddingCollection's): its fused update on
every device is kernels/optimizers.py's ftrl_update_ref applied to the rows' summed gradients, bit for bit
(the numba.cuda kernels in the simulator, the compiled CPU code, the NumPy reference), lr = 0 included."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numbactr.runtime import device
from numbactr.embedding.engine import (
    Layout,
    Optim,
    OptimizerSpec,
    Pooling,
    TableBatchedEmbedding,
    UpdateType,
    state_specs,
)
from numbactr.kernels import optimizers as OPT


def _batch(rng, n_features: int, batch: int, rows: list, ftm: list):
    lens = rng.integers(0, 4, n_features * batch)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    bag_feature = np.arange(n_features * batch) % n_features  # SAMPLE_MAJOR: bag b*F + f
    idx = np.concatenate([rng.integers(0, rows[ftm[f]], n) for f, n in zip(bag_feature, lens)] + [[]])
    return idx.astype(np.int64), off


def _engines(impl: str, tables, ftm, pooling, hp: dict, seed: int):
    spec = OptimizerSpec(Optim.HUGECTR_FTRL, **hp)
    kw = dict(pooling=pooling, layout=Layout.SAMPLE_MAJOR, impl=impl, seed=seed)
    ftrl = TableBatchedEmbedding(tables, ftm, optimizer=spec, **kw)
    grads = TableBatchedEmbedding(tables, ftm, optimizer=OptimizerSpec(Optim.NONE), **kw)
    for e in (ftrl, grads):
        e.init_uniform(-0.5, 0.5, seed)
    return ftrl, grads


def _train_against_reference(impl: str, seed: int, lr: float, pooling, steps: int = 3):
    """The fused HUGECTR_FTRL against optimizer NONE's row gradients + ftrl_update_ref on the same rows."""
    rng = np.random.default_rng(seed)
    tables, ftm = [(6, 3), (4, 5)], [0, 1, 0]
    if pooling == Pooling.NONE:
        tables = [(6, 4), (4, 4)]
    hp = dict(
        learning_rate=lr,
        beta=float(rng.uniform(0, 1)),
        lambda1=float(rng.uniform(0, 0.05)),
        lambda2=float(rng.uniform(0, 0.1)),
        scaler=float(rng.choice([1.0, 4.0])),
    )
    ftrl, grads = _engines(impl, tables, ftm, pooling, hp, seed)
    xp = device.xp()
    w = [np.array(device.to_host(v)) for v in grads.split_weights()]
    zn = [[np.zeros_like(x), np.zeros_like(x)] for x in w]
    B = 3
    for _ in range(steps):
        idx, off = _batch(rng, len(ftm), B, [t[0] for t in tables], ftm)
        outs = []
        for e in (ftrl, grads):
            out, ctx = e.forward(xp.asarray(idx), xp.asarray(off))
            outs.append((out, ctx))
        dy = rng.normal(size=outs[0][0].shape).astype(np.float32)
        ftrl.backward(outs[0][1], xp.asarray(dy))
        sparse = grads.backward(outs[1][1], xp.asarray(dy)).sparse
        for t, (rows, vals) in enumerate(sparse.per_table()):
            if rows.size:
                d = tables[t][1]
                w[t][rows], zn[t][0][rows], zn[t][1][rows] = OPT.ftrl_update_ref(
                    w[t][rows],
                    zn[t][0][rows],
                    zn[t][1][rows],
                    np.ascontiguousarray(vals[:, :d]),
                    hp["learning_rate"],
                    hp["beta"],
                    hp["lambda1"],
                    hp["lambda2"],
                    hp["scaler"],
                )
        for t, v in enumerate(grads.split_weights()):  # the NONE engine follows the same rows
            v[...] = xp.asarray(w[t])
    for t, (got_w, got_s) in enumerate(zip(ftrl.split_weights(), ftrl.split_optimizer_states())):
        np.testing.assert_array_equal(np.array(device.to_host(got_w)).view(np.uint32), w[t].view(np.uint32))
        for got, want in zip(got_s, zn[t]):
            np.testing.assert_array_equal(np.array(device.to_host(got)).view(np.uint32), want.view(np.uint32))
    return w


LRS = [0.0, 0.05, 0.7]
POOLINGS = [Pooling.SUM, Pooling.MEAN, Pooling.NONE]


@pytest.mark.skipif(not device.uses_kernels(), reason="needs the sim or gpu device")
@pytest.mark.skipif(device.kind() == "gpu", reason="bit for bit in the simulator (a GPU may contract to FMA)")
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), lr=st.sampled_from(LRS), pooling=st.sampled_from(POOLINGS))
def test_kernels_equal_ftrl_reference_on_summed_gradients(seed, lr, pooling):
    _train_against_reference("kernels", seed, lr, pooling)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), lr=st.sampled_from(LRS), pooling=st.sampled_from(POOLINGS))
def test_compiled_cpu_equals_ftrl_reference_on_summed_gradients(seed, lr, pooling):
    device.set_device("cpu")  # (the autouse _restore_device switches back)
    _train_against_reference("cpu", seed, lr, pooling)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), lr=st.sampled_from(LRS), pooling=st.sampled_from(POOLINGS))
def test_engine_reference_equals_ftrl_reference_on_summed_gradients(seed, lr, pooling):
    """impl "ref" (its NONE and its Ftrl both take the float64 row sums rounded to float32)."""
    device.set_device("cpu")
    _train_against_reference("ref", seed, lr, pooling)


def test_frozen_lr_keeps_weights_and_sums_states():
    """lr = 0: the weights stay (HugeCTR would divide by 0), z += g / scaler, n += (g / scaler)^2."""
    eng = TableBatchedEmbedding(
        [(3, 2)],
        optimizer=OptimizerSpec(
            Optim.HUGECTR_FTRL, learning_rate=0.0, beta=0.1, lambda1=0.01, lambda2=0.01, scaler=2.0
        ),
    )
    eng.init_uniform(-1, 1, 2)
    xp = device.xp()
    before = np.array(device.to_host(eng.split_weights()[0]))
    _, ctx = eng.forward(xp.asarray(np.array([1], np.int64)), xp.asarray(np.array([0, 1], np.int64)))
    eng.backward(ctx, xp.asarray(np.array([[3.0, -1.0]], np.float32)))
    np.testing.assert_array_equal(device.to_host(eng.split_weights()[0]), before)
    z, n = (np.array(device.to_host(s)) for s in eng.split_optimizer_states()[0])
    np.testing.assert_array_equal(z, [[0, 0], [1.5, -0.5], [0, 0]])
    np.testing.assert_array_equal(n, [[0, 0], [2.25, 0.25], [0, 0]])


def test_states_and_settings():
    """Two per-element states z, n (HugeCTR's order); LOCAL only (the collection applies it to the touched
    rows whatever HugeCTR's update_type says)."""
    assert [(n, r) for n, r, _ in state_specs(OptimizerSpec(Optim.HUGECTR_FTRL))] == [("z", False), ("n", False)]
    with pytest.raises(ValueError, match="LOCAL only"):
        TableBatchedEmbedding([(3, 2)], optimizer=OptimizerSpec(Optim.HUGECTR_FTRL, update_type=UpdateType.GLOBAL))
