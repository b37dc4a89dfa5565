"""The ranking metrics end to end: a tiny model trained on users' items in the NCF eval layout (per user, the
held-out positive followed by its sampled negatives), scored by Model.get_eval_metrics() and by `numbactr
predict --metrics`, each against numbactr.metrics' NumPy functions on the same predictions; CreateSolver's
and predict's checks of the options."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.cli import main
from numbactr.data.file_list import write_file_list
from numbactr.data.norm import write_norm_file
from numbactr.metrics import group_auc, hit_rate_at_k, log_loss, ndcg_at_k, roc_auc
from numbactr.runtime import device

USERS, ITEMS, NEG = 30, 40, 9  # eval: per user 1 positive + 9 negatives = groups of 10
M = hugectr.MetricsType
SPEC = {M.AUC: 1.0, M.AverageLoss: 0.0, M.HitRateAtK: 1.0, M.NDCGAtK: 1.0, M.GroupAUC: 1.0, M.LogLoss: 1.0}


def write_data(folder):
    """Slot 0: the user id (keys 0..USERS-1), slot 1: the item id (keys 1000+). A user likes an item when
    their planted tastes agree; train rows are random pairs, eval rows the NCF layout."""
    rng = np.random.default_rng(3)
    taste_u, taste_i = rng.normal(size=(USERS, 2)), rng.normal(size=(ITEMS, 2))
    like = taste_u @ taste_i.T  # (USERS, ITEMS)

    def write(name, users, items, label):
        path = os.path.join(folder, name, "part0.data")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        keys = np.stack([users, 1000 + items], 1).astype(np.int64)
        write_norm_file(path, label, np.zeros((len(users), 1), np.float32), keys, key_dtype=np.int64)
        write_file_list(os.path.join(folder, name, "_file_list.txt"), [path])
        return os.path.join(folder, name, "_file_list.txt")

    u = rng.integers(0, USERS, 3000)
    i = rng.integers(0, ITEMS, 3000)
    train = write("train", u, i, (like[u, i] > 0).astype(np.float32))
    users, items, labels = [], [], []
    for user in range(USERS):
        order = np.argsort(-like[user])
        pos = order[rng.integers(0, 5)]  # one of the user's favourites
        negs = rng.choice(order[ITEMS // 2 :], NEG, replace=False)  # items the user dislikes
        users += [user] * (NEG + 1)
        items += [pos, *negs]
        labels += [1.0] + [0.0] * NEG
    evl = write("eval", np.array(users), np.array(items), np.array(labels, np.float32))
    return train, evl


def build(train, evl, **solver_kw):
    solver = hugectr.CreateSolver(
        batchsize=64,
        batchsize_eval=40,  # 300 eval rows: 7 batches and a partial one of 20
        max_eval_batches=100,
        lr=0.01,
        vvgpu=[[0]],
        i64_input_key=True,
        metrics_spec=SPEC,
        metrics_k=3,
        **solver_kw,
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[train], eval_source=evl, check_type=hugectr.Check_t.Sum
    )
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.Adam))
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=1,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 2)],
        )
    )
    m.add(hugectr.SparseEmbedding(hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, 4, "sum", "emb", "data1"))
    L = hugectr.Layer_t
    m.add(hugectr.DenseLayer(L.Reshape, ["emb"], ["flat"], leading_dim=8))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["flat"], ["fc1"], num_output=8))
    m.add(hugectr.DenseLayer(L.ReLU, ["fc1"], ["relu1"]))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["relu1"], ["fc2"], num_output=1))
    m.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc2", "label"], ["loss"]))
    m.compile()
    return m


def test_eval_and_predict_metrics_agree_with_the_numpy_functions(tmp_path, capsys):
    device.set_device("cpu")
    train, evl = write_data(str(tmp_path))
    m = build(train, evl, eval_group_slot=0)  # the user id slot names the groups
    m.fit(max_iter=150, display=0, eval_interval=150, snapshot=0)
    seen = []
    add = m.metrics.add

    def spy(preds, labels, loss, groups=None):
        seen.append((np.array(preds), np.array(labels), groups))
        add(preds, labels, loss, groups)

    m.metrics.add = spy
    got = dict(m.eval_whole_source())
    assert list(got) == ["AUC", "AverageLoss", "HitRate@3", "NDCG@3", "GroupAUC", "LogLoss"]
    assert [len(s[0]) for s in seen] == [40] * 7 + [20]  # the partial last batch: its valid rows only
    p, y = np.concatenate([s[0] for s in seen]), np.concatenate([s[1] for s in seen])
    users = np.concatenate([s[2] for s in seen])
    np.testing.assert_array_equal(users, np.repeat(np.arange(USERS), NEG + 1))  # the slot's key per row
    assert got["HitRate@3"] == hit_rate_at_k(y, p, users, 3) == hit_rate_at_k(y, p, NEG + 1, 3)
    assert got["NDCG@3"] == ndcg_at_k(y, p, users, 3)
    assert got["GroupAUC"] == group_auc(y, p, users) and got["AUC"] == roc_auc(y, p)
    assert got["LogLoss"] == log_loss(y, p) == pytest.approx(got["AverageLoss"], rel=1e-3)
    assert got["HitRate@3"] > 0.5  # it learned the planted tastes (chance: 3/10)

    m.graph_to_json(str(tmp_path / "graph.json"))
    m.save_params_to_files(str(tmp_path / "m"), 150)
    base = ["predict", str(tmp_path / "graph.json"), "--dense", str(tmp_path / "m_dense_150.model")]
    base += ["--sparse", str(tmp_path / "m0_sparse_150.model"), "--source", evl, "--batch-size", "64"]
    out, js = str(tmp_path / "p.csv"), str(tmp_path / "metrics.json")
    capsys.readouterr()
    ask = ["--metrics", "auc,logloss,gauc,hr@3,ndcg@3,hr@1"]
    assert main(base + ["--output", out] + ask + ["--group-size", "10", "--metrics-json", js]) == 0
    printed = capsys.readouterr().out
    q = np.loadtxt(out, delimiter=",", skiprows=1).astype(np.float32)  # 9 digits: the float32 values exactly
    np.testing.assert_allclose(q, p[:, 0], rtol=1e-5, atol=1e-6)  # the eval's predictions, by inference
    metrics = json.load(open(js))
    assert list(metrics) == ["AUC", "LogLoss", "GroupAUC", "HitRate@3", "NDCG@3", "HitRate@1"]
    assert metrics["HitRate@3"] == hit_rate_at_k(y, q, NEG + 1, 3) and metrics["HitRate@1"] == hit_rate_at_k(
        y, q, NEG + 1, 1
    )
    assert metrics["NDCG@3"] == ndcg_at_k(y, q, NEG + 1, 3) and metrics["GroupAUC"] == group_auc(y, q, NEG + 1)
    assert metrics["AUC"] == roc_auc(y, q) and metrics["LogLoss"] == log_loss(y, q)
    assert metrics["GroupAUC"] == pytest.approx(got["GroupAUC"], abs=1e-3)
    assert f"NDCG@3: {metrics['NDCG@3']:.6f}" in printed
    assert main(base + ["--output", out, "--metrics", "gauc,ndcg@3", "--group-slot", "0", "--metrics-json", js]) == 0
    by_slot = json.load(open(js))
    assert by_slot == {"GroupAUC": metrics["GroupAUC"], "NDCG@3": metrics["NDCG@3"]}

    capsys.readouterr()
    for extra, message in (
        (["--metrics", "gauc"], "--metrics GroupAUC score groups of samples (users): give --group-size N"),
        (["--metrics", "hr"], "'hr' needs a cutoff K >= 1, as hr@10"),
        (["--metrics", "mrr"], "unknown metric 'mrr' (known: auc, logloss, gauc, hr@K, ndcg@K)"),
        (["--metrics", "gauc", "--group-slot", "2"], "--group-slot 2: the model's data has 2 sparse slots (0..1)"),
        (["--metrics", "gauc", "--group-size", "7"], "300 rows are not whole groups of 7 consecutive rows"),
        (["--metrics", "gauc", "--group-size", "5", "--group-slot", "0"], "give --group-size or --group-slot"),
        (["--metrics-json", js], "--metrics-json needs --metrics"),
    ):
        assert main(base + ["--output", out] + extra) == 1
        assert message in capsys.readouterr().err


def test_create_solver_checks_the_metric_options():
    with pytest.raises(ValueError, match=r"MetricsType.HitRateAtK, MetricsType.GroupAUC, which score groups"):
        hugectr.CreateSolver(metrics_spec={M.HitRateAtK: 1.0, M.GroupAUC: 1.0})
    with pytest.raises(ValueError, match=r"batchsize_eval \(2048\) must be a multiple of eval_group_size \(100\)"):
        hugectr.CreateSolver(metrics_spec={M.HitRateAtK: 1.0}, eval_group_size=100)
    with pytest.raises(ValueError, match="give eval_group_size .* or eval_group_slot .*, not both"):
        hugectr.CreateSolver(eval_group_size=8, eval_group_slot=0)
    with pytest.raises(ValueError, match="metrics_k must lie in"):
        hugectr.CreateSolver(metrics_k=0)
    with pytest.raises(ValueError, match="eval_group_slot must be an integer"):
        hugectr.CreateSolver(eval_group_slot="user")
    s = hugectr.CreateSolver(metrics_spec={M.NDCGAtK: 1.0}, metrics_k=5, batchsize_eval=1000, eval_group_size=100)
    assert (s.metrics_k, s.eval_group_size, s.eval_group_slot) == (5, 100, None)


def test_compile_refuses_a_group_slot_the_input_lacks(tmp_path):
    device.set_device("cpu")
    train, evl = write_data(str(tmp_path))
    with pytest.raises(hugectr.ModelError, match=r"eval_group_slot=2\): the Input has 2 sparse slots \(0..1"):
        build(train, evl, eval_group_slot=2)
