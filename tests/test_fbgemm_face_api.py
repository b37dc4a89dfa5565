"""FBGEMM's TBE module surface beside fbgemm_gpu's own (an audit against fbgemm-gpu-cpu 1.8): optimizer_args,
learning_rate_tensor, get_optimizer_buffer, reset_cache_states, and sequence embeddings that ignore
per_sample_weights as FBGEMM's do. Skipped without torch; the side-by-side checks without fbgemm_gpu."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from numbactr.fbgemm_gpu import split_table_batched_embeddings_ops_training as NB  # noqa: E402
from numbactr.fbgemm_gpu.split_embedding_configs import EmbOptimType as NO  # noqa: E402
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # noqa: E402
    ComputeDevice as NC,
    EmbeddingLocation as NL,
    PoolingMode as NP,
)


def _fbgemm():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")


def _pair(optimizer="EXACT_ROWWISE_ADAGRAD", pooling="SUM", **kw):
    FB = _fbgemm()
    from fbgemm_gpu.split_embedding_configs import EmbOptimType as FO
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        ComputeDevice as FC,
        EmbeddingLocation as FL,
        PoolingMode as FP,
    )

    rows = [(5, 4), (6, 4)]
    f = FB.SplitTableBatchedEmbeddingBagsCodegen(
        [(v, d, FL.HOST, FC.CPU) for v, d in rows],
        optimizer=getattr(FO, optimizer),
        pooling_mode=getattr(FP, pooling),
        **kw,
    )
    n = NB.SplitTableBatchedEmbeddingBagsCodegen(
        [(v, d, NL.HOST, NC.CPU) for v, d in rows],
        optimizer=getattr(NO, optimizer),
        pooling_mode=getattr(NP, pooling),
        **kw,
    )
    with torch.no_grad():
        for a, b in zip(f.split_embedding_weights(), n.split_embedding_weights()):
            a.copy_(torch.linspace(-1, 1, a.numel()).view_as(a))
            b.copy_(a)
    return f, n


IDX, OFF = torch.tensor([0, 1, 4, 2, 3, 5]), torch.tensor([0, 1, 3, 4, 6])


def test_optimizer_args_and_learning_rate_read_back_as_fbgemms():
    f, n = _pair(learning_rate=0.05, eps=0.1, weight_decay=0.01)
    assert n.optimizer_args._fields == f.optimizer_args._fields
    assert n.optimizer_args == f.optimizer_args
    assert n.get_learning_rate() == f.get_learning_rate()  # float32, as FBGEMM's tensor holds it
    n.update_hyper_parameters({"eps": 0.2})
    assert n.optimizer_args.eps == pytest.approx(0.2)


def test_a_rate_written_into_learning_rate_tensor_trains_the_next_step():
    f, n = _pair(learning_rate=0.05)
    for m in (f, n):
        m.learning_rate_tensor.fill_(0.5)
        m(IDX, OFF).pow(2).sum().backward()
    for a, b in zip(f.split_embedding_weights(), n.split_embedding_weights()):
        torch.testing.assert_close(b, a)
    assert n.get_learning_rate() == pytest.approx(0.5)
    n.set_learning_rate(0.25)
    assert float(n.learning_rate_tensor) == 0.25


def test_sequence_embeddings_ignore_per_sample_weights_as_fbgemm():
    f, n = _pair("EXACT_SGD", "NONE", learning_rate=0.1)
    psw = torch.tensor([0.5, 2.0, 3.0, 1.5, 0.25, 4.0])
    with pytest.warns(RuntimeWarning, match="per_sample_weights are not applied with PoolingMode.NONE"):
        out = n(IDX, OFF, psw)
    torch.testing.assert_close(out, f(IDX, OFF, psw))
    dy = torch.linspace(-1, 1, out.numel()).view_as(out)
    f(IDX, OFF, psw).backward(dy)
    with pytest.warns(RuntimeWarning):
        n(IDX, OFF, psw).backward(dy)
    for a, b in zip(f.split_embedding_weights(), n.split_embedding_weights()):
        torch.testing.assert_close(b, a)


def test_get_optimizer_buffer_and_reset_cache_states():
    n = NB.SplitTableBatchedEmbeddingBagsCodegen([(5, 4, NL.HOST, NC.CPU)], optimizer=NO.EXACT_ROWWISE_ADAGRAD)
    assert n.get_optimizer_buffer("momentum1_host").shape == (5,)
    with pytest.raises(ValueError, match="Optimizer buffer nope not found"):
        n.get_optimizer_buffer("nope")
    n.reset_cache_states()  # no cache: nothing to do (as FBGEMM)
