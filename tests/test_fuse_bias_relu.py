"""An InnerProduct whose output only a ReLU reads runs bias + ReLU in one fused kernel each way on the kernel
devices (numbactr.model.Model._fuse_bias_relu, numbactr.ops.fuse_bias_relu): the same training as the two
layers apart, one launch fewer each way, and the unkept pre-activation tensor refused by check_out_tensor."""

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.kernels import launch
from numbactr.model import ModelError
from tests.model_util import tiny_data, tiny_dlrm

pytestmark = pytest.mark.skipif(not device._numba_simulated(), reason="needs the simulator")


def _train(tmp_path, monkeypatch, fuse: str, steps=3):
    monkeypatch.setenv("NUMBACTR_FUSE_BIAS_RELU", fuse)
    device.set_device("sim")
    tr, ev = tiny_data(str(tmp_path), n_train=64, n_eval=32)
    m = tiny_dlrm(tr, ev, batch=16, lr=0.05)
    launches = []
    for _ in range(steps):
        launch.reset_counts()
        assert m.train()
        launches.append(launch.reset_counts()["launches"])
    return m, launches


def test_fused_training_equals_the_two_layers(tmp_path, monkeypatch):
    fused, n_fused = _train(tmp_path / "a", monkeypatch, "1")
    plain, n_plain = _train(tmp_path / "b", monkeypatch, "0")
    # tiny_dlrm has two InnerProduct -> ReLU pairs (fc1/relu1, fc2/relu2): two launches fewer each way
    assert [p - f for p, f in zip(n_plain, n_fused)] == [4] * 3
    assert sorted(fused._fused_tops.items()) == [("fc1", "relu1"), ("fc2", "relu2")]
    np.testing.assert_allclose(np.asarray(fused.weights), np.asarray(plain.weights), rtol=1e-5, atol=1e-7)
    assert fused.get_current_loss() == pytest.approx(plain.get_current_loss(), rel=1e-6)
    np.testing.assert_array_equal(
        fused.check_out_tensor("relu1", hugectr.Tensor_t.Train), plain.check_out_tensor("relu1", hugectr.Tensor_t.Train)
    )
    with pytest.raises(ModelError, match="'fc1' is not kept on this device.*NUMBACTR_FUSE_BIAS_RELU=0"):
        fused.check_out_tensor("fc1", hugectr.Tensor_t.Train)
    monkeypatch.setenv("NUMBACTR_FUSE_BIAS_RELU", "2")
    with pytest.raises(ValueError, match="NUMBACTR_FUSE_BIAS_RELU must be 0 or 1"):
        fused.train()


def test_an_output_read_twice_is_not_fused(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBACTR_FUSE_BIAS_RELU", "1")
    device.set_device("sim")
    tr, ev = tiny_data(str(tmp_path), n_train=32, n_eval=32, slots=2)
    s = hugectr.CreateSolver(batchsize=16, batchsize_eval=16, lr=0.05, i64_input_key=True)
    r = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[tr], eval_source=ev, check_type=hugectr.Check_t.Sum
    )
    m = hugectr.Model(s, r, hugectr.CreateOptimizer())
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 2)],
        )
    )
    m.add(hugectr.SparseEmbedding(hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, 4, "sum", "emb", "data1"))
    L = hugectr.Layer_t
    m.add(hugectr.DenseLayer(L.Reshape, ["emb"], ["flat"], leading_dim=8))
    m.add(hugectr.DenseLayer(L.Concat, ["flat", "dense"], ["cat"]))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["cat"], ["fc1"], num_output=4))
    m.add(hugectr.DenseLayer(L.ReLU, ["fc1"], ["relu1"]))
    m.add(hugectr.DenseLayer(L.Add, ["fc1", "relu1"], ["sum"]))  # fc1 read twice: kept
    m.add(hugectr.DenseLayer(L.InnerProduct, ["sum"], ["fc2"], num_output=1))
    m.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc2", "label"], ["loss"]))
    m.compile()
    assert m._fused_tops == {}
    assert m.train()
    fc1 = m.check_out_tensor("fc1", hugectr.Tensor_t.Train)
    np.testing.assert_array_equal(m.check_out_tensor("relu1", hugectr.Tensor_t.Train), np.maximum(fc1, 0))
