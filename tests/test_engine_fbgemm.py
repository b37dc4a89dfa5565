"""Differential tests against FBGEMM's own CPU TBE (fbgemm-gpu-cpu, optional: pip install
'numbactr[fbgemm]'): forward outputs, and weights and optimizer states after several steps, for the
optimizers FBGEMM's CPU build runs (EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD on one table; its
rowwise kernel fails inside FBGEMM with several tables). Skipped when fbgemm_gpu is not installed.

FBGEMM's CPU backward treats features of one table that are not next to each other in
feature_table_map as separate tables (one update each); the engine sums every feature of a table into
one update, which is the exact gradient. The cases below keep each table's features together."""

import numpy as np
import pytest

from numbactr.runtime import device
from numbactr.embedding.engine import BoundsCheck, OptimizerSpec, Optim, Pooling, Precision, TableBatchedEmbedding
from tests.engine_cases import assert_weights_close

torch = pytest.importorskip("torch")
fbgemm = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, PoolingMode  # noqa: E402

OPTIMS = {
    Optim.EXACT_SGD: EmbOptimType.EXACT_SGD,
    Optim.EXACT_ADAGRAD: EmbOptimType.EXACT_ADAGRAD,
    Optim.EXACT_ROWWISE_ADAGRAD: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
}
POOLS = {Pooling.SUM: PoolingMode.SUM, Pooling.MEAN: PoolingMode.MEAN}


@pytest.fixture(autouse=True)
def _cpu():
    old = device.kind()
    device.set_device("cpu")
    torch.manual_seed(0)
    yield
    device.set_device(old)


def _pair(tables, fmap, kind, pooling, impl, precision=Precision.FP32):
    specs = [(v, d, fbgemm.EmbeddingLocation.HOST, fbgemm.ComputeDevice.CPU) for v, d in tables]
    theirs = fbgemm.SplitTableBatchedEmbeddingBagsCodegen(
        specs,
        feature_table_map=fmap,
        optimizer=OPTIMS[kind],
        learning_rate=0.05,
        eps=1e-6,
        pooling_mode=POOLS[pooling],
        bounds_check_mode=BoundsCheckMode.FATAL,
        weights_precision=SparseType.FP16 if precision == Precision.FP16 else SparseType.FP32,
        stochastic_rounding=False,
    )
    ours = TableBatchedEmbedding(
        tables,
        fmap,
        pooling=pooling,
        bounds_check=BoundsCheck.FATAL,
        impl=impl,
        optimizer=OptimizerSpec(kind, learning_rate=0.05, eps=1e-6),
        weights_precision=precision,
        stochastic_rounding=False,
    )
    rng = np.random.default_rng(1)
    for w_ours, w_theirs in zip(ours.split_weights(), theirs.split_embedding_weights()):
        init = rng.uniform(-0.5, 0.5, size=w_ours.shape).astype(w_ours.dtype)
        w_ours[...] = init
        w_theirs.copy_(torch.from_numpy(init))
    return ours, theirs


def _batch(rng, tables, fmap, batch, max_len, dtype):
    lens = rng.integers(0, max_len + 1, size=len(fmap) * batch)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(dtype)
    feat = np.repeat(np.repeat(np.arange(len(fmap)), batch), lens)
    rows = np.array([tables[fmap[f]][0] for f in feat], np.int64)
    indices = (rng.integers(0, 1 << 30, size=feat.size) % np.maximum(rows, 1)).astype(dtype)
    return indices, offsets


CASES = [
    (Optim.EXACT_SGD, [(40, 8), (25, 4)], [0, 0, 1], Pooling.SUM),
    (Optim.EXACT_SGD, [(40, 8), (25, 4)], [0, 1, 1], Pooling.MEAN),
    (Optim.EXACT_ADAGRAD, [(30, 12), (9, 4)], [0, 1, 1, 1], Pooling.SUM),
    (Optim.EXACT_ADAGRAD, [(30, 12), (9, 4)], [0, 0, 1], Pooling.MEAN),
    (Optim.EXACT_ROWWISE_ADAGRAD, [(50, 16)], [0, 0, 0], Pooling.SUM),
    (Optim.EXACT_ROWWISE_ADAGRAD, [(50, 16)], [0, 0], Pooling.MEAN),
]


@pytest.mark.parametrize("impl", ["cpu", "ref"])
@pytest.mark.parametrize(
    "kind,tables,fmap,pooling", CASES, ids=[f"{k.name}-{p.name}-{len(t)}t{len(f)}f" for k, t, f, p in CASES]
)
def test_matches_fbgemm_over_several_steps(kind, tables, fmap, pooling, impl):
    ours, theirs = _pair(tables, fmap, kind, pooling, impl)
    rng = np.random.default_rng(7)
    for step in range(4):
        dtype = np.int32 if step % 2 else np.int64
        indices, offsets = _batch(rng, tables, fmap, batch=6, max_len=4, dtype=dtype)
        out_theirs = theirs(torch.from_numpy(indices), torch.from_numpy(offsets))
        out_ours, ctx = ours.forward(indices, offsets)
        np.testing.assert_allclose(out_ours, out_theirs.detach().numpy(), rtol=1e-5, atol=1e-6)
        dy = rng.normal(size=out_ours.shape).astype(np.float32)
        out_theirs.backward(torch.from_numpy(dy))
        ours.backward(ctx, dy)
    for w_ours, w_theirs in zip(ours.split_weights(), theirs.split_embedding_weights()):
        np.testing.assert_allclose(w_ours, w_theirs.numpy(), rtol=1e-5, atol=1e-6)
    for s_ours, s_theirs in zip(ours.split_optimizer_states(), theirs.split_optimizer_states()):
        for a, b in zip(s_ours, s_theirs):
            np.testing.assert_allclose(a, b.numpy(), rtol=1e-5, atol=1e-7)


def test_per_sample_weights_and_their_gradient_match_fbgemm():
    tables, fmap = [(20, 8)], [0, 0]
    ours, theirs = _pair(tables, fmap, Optim.EXACT_SGD, Pooling.SUM, "cpu")
    rng = np.random.default_rng(3)
    indices, offsets = _batch(rng, tables, fmap, batch=5, max_len=3, dtype=np.int64)
    psw = rng.normal(size=indices.size).astype(np.float32)
    psw_t = torch.from_numpy(psw.copy()).requires_grad_(True)
    out_theirs = theirs(torch.from_numpy(indices), torch.from_numpy(offsets), per_sample_weights=psw_t)
    out_ours, ctx = ours.forward(indices, offsets, psw)
    np.testing.assert_allclose(out_ours, out_theirs.detach().numpy(), rtol=1e-5, atol=1e-6)
    dy = rng.normal(size=out_ours.shape).astype(np.float32)
    out_theirs.backward(torch.from_numpy(dy))
    grads = ours.backward(ctx, dy)
    np.testing.assert_allclose(grads.per_sample_weights, psw_t.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        ours.split_weights()[0], theirs.split_embedding_weights()[0].numpy(), rtol=1e-5, atol=1e-6
    )


def test_fp16_weights_round_to_nearest_like_fbgemm():
    tables, fmap = [(30, 8)], [0, 0]
    ours, theirs = _pair(tables, fmap, Optim.EXACT_SGD, Pooling.SUM, "cpu", Precision.FP16)
    rng = np.random.default_rng(5)
    for _ in range(3):
        indices, offsets = _batch(rng, tables, fmap, batch=4, max_len=3, dtype=np.int64)
        out_theirs = theirs(torch.from_numpy(indices), torch.from_numpy(offsets))
        out_ours, ctx = ours.forward(indices, offsets)
        dy = rng.normal(size=out_ours.shape).astype(np.float32)
        out_theirs.backward(torch.from_numpy(dy))
        ours.backward(ctx, dy)
    # each update rounds once; float32 sums in another order may land on the other side of a tie
    assert_weights_close(ours.split_weights()[0], theirs.split_embedding_weights()[0].numpy(), Precision.FP16, steps=3)
