"""The torch face of FBGEMM's TBE (numbactr/fbgemm_gpu/torch_tbe.py): autograd's backward runs the engine's
fused update in place (no dense weight gradient), per-sample-weight gradients, OptimType.NONE's sparse
gradient, memory shared between tensors and the engine, state_dict, FBGEMM's iteration counting, and
examples/fbgemm_dlrm.py (a PyTorch DLRM written for FBGEMM, one import changed) trains."""

import importlib.util
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from numbactr.fbgemm_gpu.array_tbe import ArrayTBE  # noqa: E402
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: E402
    ComputeDevice,
    EmbeddingLocation,
    OptimType,
    PoolingMode,
    SparseType,
    SplitTableBatchedEmbeddingBagsCodegen,
)

HOST = (EmbeddingLocation.HOST, ComputeDevice.CPU)
EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "fbgemm_dlrm.py"


pytestmark = pytest.mark.usefixtures("cpu")  # conftest.py: the cpu device for every test


def pair(specs, **kw):
    """(torch face, array face) with the same arguments and the same starting weights."""
    mod = SplitTableBatchedEmbeddingBagsCodegen([(r, d, *HOST) for r, d in specs], **kw)
    arr = ArrayTBE([(r, d, *HOST) for r, d in specs], **kw)
    torch.manual_seed(0)
    mod.init_embedding_weights_uniform(-1, 1)
    for a, w in zip(arr.split_embedding_weights(), mod.split_embedding_weights()):
        a[...] = w.numpy()
    return mod, arr


def test_module_shape_parameters_and_fbgemm_attributes():
    mod = SplitTableBatchedEmbeddingBagsCodegen([(5, 4, *HOST), (3, 8, *HOST)], feature_table_map=[0, 1, 0])
    assert isinstance(mod, torch.nn.Module)
    assert [p.shape for p in mod.parameters()] == [torch.Size([0])]  # FBGEMM's placeholder only
    assert (mod.total_D, mod.max_D, mod.D_offsets.tolist()) == (16, 8, [0, 4, 12, 16])
    assert mod.current_device == torch.device("cpu")


@pytest.mark.parametrize("opt", [OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM, OptimType.LAMB])
def test_autograd_backward_runs_the_fused_update(opt):
    specs, ftm = [(9, 8), (5, 4)], [0, 1, 0]
    mod, arr = pair(specs, feature_table_map=ftm, optimizer=opt, learning_rate=0.05, pooling_mode=PoolingMode.MEAN)
    rng = np.random.default_rng(0)
    for _ in range(3):
        lens = rng.integers(0, 3, 3 * 4)
        off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        idx = rng.integers(0, 5, off[-1]).astype(np.int64)
        psw = rng.random(off[-1]).astype(np.float32)
        t_psw = torch.from_numpy(psw.copy()).requires_grad_()
        out = mod(torch.from_numpy(idx), torch.from_numpy(off), per_sample_weights=t_psw)
        want = arr(idx, off, psw)
        np.testing.assert_array_equal(out.detach().numpy(), want)
        dy = rng.standard_normal(want.shape).astype(np.float32)
        (out * torch.from_numpy(dy)).sum().backward()
        grads = arr.backward(dy)
        np.testing.assert_array_equal(t_psw.grad.numpy(), grads.per_sample_weights)
        assert mod.placeholder_autograd_tensor.grad is None  # no dense weight gradient
    for a, b in zip(mod.split_embedding_weights(), arr.split_embedding_weights()):
        np.testing.assert_array_equal(a.numpy(), b)
    for sa, sb in zip(mod.split_optimizer_states(), arr.split_optimizer_states()):
        for a, b in zip(sa, sb):
            np.testing.assert_array_equal(a.numpy(), b)
    assert int(mod.iter.item()) == 3 and mod.step == 3


def test_output_used_twice_gets_one_update_with_the_summed_gradient():
    mod, arr = pair([(6, 4)], learning_rate=1.0)
    idx, off = np.array([1, 2, 1]), np.array([0, 2, 3])
    out = mod(torch.from_numpy(idx), torch.from_numpy(off))
    (out.sum() + 2 * out[:, :2].sum()).backward()
    arr(idx, off)
    arr.backward(np.array([[3, 3, 1, 1], [3, 3, 1, 1]], np.float32))
    np.testing.assert_allclose(mod.split_embedding_weights()[0].numpy(), arr.split_embedding_weights()[0])


def test_no_grad_forward_updates_nothing_but_counts_like_fbgemm():
    mod, _ = pair([(6, 4)], optimizer=OptimType.ADAM)
    before = mod.split_embedding_weights()[0].clone()
    with torch.no_grad():
        out = mod(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
    assert not out.requires_grad and torch.equal(before, mod.split_embedding_weights()[0])
    assert int(mod.iter.item()) == 1 and mod.step == 1


def test_tensors_share_memory_with_the_engine():
    mod = SplitTableBatchedEmbeddingBagsCodegen([(5, 4, *HOST)], optimizer=OptimType.EXACT_ADAGRAD)
    mod.split_embedding_weights()[0][2] = 7.0
    np.testing.assert_array_equal(mod.engine.split_weights()[0][2], 7.0)
    assert np.shares_memory(mod.weights_host.numpy(), mod.engine.weights)
    assert np.shares_memory(mod.momentum1_host.numpy(), mod.engine.states[0])


def test_init_uniform_uses_torchs_generator_like_fbgemm():
    mod = SplitTableBatchedEmbeddingBagsCodegen([(5, 4, *HOST), (3, 8, *HOST)])
    torch.manual_seed(3)
    mod.init_embedding_weights_uniform(-0.5, 0.5)
    torch.manual_seed(3)
    want = [torch.empty(5, 4).uniform_(-0.5, 0.5), torch.empty(3, 8).uniform_(-0.5, 0.5)]
    for a, b in zip(mod.split_embedding_weights(), want):
        assert torch.equal(a, b)


def test_state_dict_round_trip_and_loaded_iter():
    mod, _ = pair([(5, 4), (3, 8)], optimizer=OptimType.PARTIAL_ROWWISE_ADAM)
    out = mod(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
    out.sum().backward()
    state = mod.state_dict()
    assert {"weights_host", "momentum1_host", "momentum2_host", "iter"} <= set(state)
    fresh = SplitTableBatchedEmbeddingBagsCodegen(
        [(5, 4, *HOST), (3, 8, *HOST)], optimizer=OptimType.PARTIAL_ROWWISE_ADAM
    )
    fresh.load_state_dict(state)
    for a, b in zip(fresh.split_embedding_weights(), mod.split_embedding_weights()):
        assert torch.equal(a, b)
    for sa, sb in zip(fresh.split_optimizer_states(), mod.split_optimizer_states()):
        for a, b in zip(sa, sb):
            assert torch.equal(a, b)
    fresh(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
    assert fresh.iter_cpu == 2  # continues from the loaded iter, as FBGEMM's iter_cpu does
    fresh.set_optimizer_step(7)
    fresh(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
    assert (fresh.iter_cpu, int(fresh.iter.item())) == (8, 8)


def test_optimizer_none_gives_weights_dev_a_sparse_gradient():
    mod = SplitTableBatchedEmbeddingBagsCodegen([(5, 4, *HOST), (3, 4, *HOST)], optimizer=OptimType.NONE)
    assert mod.weights_dev.shape == (8, 4)
    out = mod(torch.tensor([1, 1, 2]), torch.tensor([0, 2, 3]), total_unique_indices=2)
    out.backward(torch.arange(8, dtype=torch.float32).reshape(1, 8))
    grad = mod.weights_dev.grad.coalesce()
    assert grad.is_sparse and grad.indices().tolist() == [[1, 7]]
    assert grad.values().tolist() == [[0, 2, 4, 6], [4, 5, 6, 7]]
    sgd = torch.optim.SGD([mod.weights_dev], lr=1.0)
    sgd.step()  # a torch optimizer updates the engine's rows
    np.testing.assert_array_equal(mod.engine.split_weights()[0][1], [0, -2, -4, -6])


def test_fp16_output_and_weights():
    mod = SplitTableBatchedEmbeddingBagsCodegen(
        [(5, 8, *HOST)], weights_precision=SparseType.FP16, output_dtype=SparseType.FP16
    )
    mod.init_embedding_weights_uniform(-1, 1)
    out = mod(torch.tensor([1, 2]), torch.tensor([0, 2]))
    assert out.dtype == torch.float16 and mod.split_embedding_weights()[0].dtype == torch.float16
    out.float().sum().backward()


def load_example():
    spec = importlib.util.spec_from_file_location("fbgemm_dlrm_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_dlrm_trains():
    example = load_example()
    losses, auc = example.main(steps=80, batch=64, table_rows=(50, 20, 80, 30), dim=8, log_every=0)
    assert np.mean(losses[-20:]) < np.mean(losses[:20]) - 0.02
    assert auc > 0.65
