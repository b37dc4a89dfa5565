"""Epoch mode (repeat_dataset=False): train() returns False at the end, set_source restarts, fit(num_epochs)."""

import pytest

import numbactr as hugectr
from tests.model_util import tiny_data


def build(tr, ev, drop=True):
    s = hugectr.CreateSolver(
        batchsize=100,
        batchsize_eval=100,
        max_eval_batches=10,
        i64_input_key=True,
        repeat_dataset=False,
        drop_incomplete_batch=drop,
    )
    r = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=[tr],
        eval_source=ev,
        check_type=hugectr.Check_t.Sum,
        num_workers=1,
    )
    m = hugectr.Model(s, r, hugectr.CreateOptimizer())
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 3)],
        )
    )
    m.add(hugectr.SparseEmbedding(hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, 4, "sum", "emb", "data1"))
    m.add(hugectr.DenseLayer(hugectr.Layer_t.Reshape, ["emb"], ["flat"], leading_dim=12))
    m.add(hugectr.DenseLayer(hugectr.Layer_t.InnerProduct, ["flat"], ["fc"], num_output=1))
    m.add(hugectr.DenseLayer(hugectr.Layer_t.BinaryCrossEntropyLoss, ["fc", "label"], ["loss"]))
    m.compile()
    return m


@pytest.mark.parametrize("drop,steps", [(True, 5), (False, 6)])  # 512 samples, batch 100
def test_train_returns_false_at_the_end_of_the_epoch(tmp_path, cpu, drop, steps):
    tr, ev = tiny_data(str(tmp_path), n_train=512, files=1)
    m = build(tr, ev, drop)
    n = 0
    while m.train():
        n += 1
    assert n == steps
    assert not m.train()  # stays at the end until set_source
    m.get_data_reader_train().set_source()
    assert m.train()
    m.set_source(tr, ev)
    assert sum(1 for _ in iter(m.train, False)) == steps


def test_fit_num_epochs(tmp_path, cpu, capsys):
    tr, ev = tiny_data(str(tmp_path), n_train=512, files=1)
    m = build(tr, ev)
    m.fit(num_epochs=2, display=5, eval_interval=5)
    out = capsys.readouterr().out
    assert "Epoch 0" in out and "Epoch 1" in out
    assert m.history["iter"] == [5, 10]
    assert len(m.history["auc"]) == 2
    with pytest.raises(hugectr.ModelError, match="num_epochs must be > 0"):
        m.fit(num_epochs=0)
