"""HybridSparseEmbedding (numbactr/embedding/hybrid.py): HugeCTR's frequent/infrequent split, equality with
LocalizedSlotSparseEmbeddingOneHot on one rank and under mpiexec -n 2, the snapshot format shared with the
one-hot embedding, and the errors for what HugeCTR's hybrid embedding does not take."""

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.autograd import Tape
from numbactr.embedding.hybrid import (
    HybridEmbedding,
    HybridEmbeddingParam,
    frequency_threshold,
    hybrid_split,
    infrequent_owner,
)
from numbactr.embedding.factory import make_embedding
from tests.mpi_util import MPIEXEC, needs_mpi

HERE = Path(__file__).parent
E, O, C = hugectr.Embedding_t, hugectr.Optimizer_t, hugectr.CommunicationType
SIZES = [20, 30, 4]
S, D = len(SIZES), 4
OFFSET = np.array([0, 20, 50], np.int64)

pytestmark = pytest.mark.usefixtures("cpu")


def param(p_dup_max=0.26, max_frequent=1000, comm=C.NVLink_SingleNode, **kw):
    return HybridEmbeddingParam(
        max_frequent, -1, p_dup_max, 1.3e11, 1.9e11, 1.0, comm, hugectr.HybridEmbeddingType.Distributed, **kw
    )


def build(etype, hp=None, nnz=1, optimizer=O.SGD, sizes=SIZES):
    cfg = hugectr.SparseEmbedding(
        etype, 1, D, "sum", "e", "data", slot_size_array=list(sizes), hybrid_embedding_param=hp
    )
    return make_embedding(
        cfg,
        hugectr.DataReaderSparseParam("data", nnz, True, len(sizes)),
        hugectr.CreateOptimizer(optimizer_type=optimizer),
        seed=3,
    )


def batch(rng, b=12):
    """(per-slot ids (b*S,), offsets (b*S + 1,)): one id per slot, skewed toward small ids."""
    ids = np.minimum(rng.geometric(0.3, (b, S)) - 1, np.array(SIZES) - 1).astype(np.int64)
    return ids.reshape(-1), np.arange(b * S + 1, dtype=np.int64)


def step(emb, keys, offsets, dy, training=True):
    tape = Tape() if training else None
    out = emb.forward(tape, device.xp().asarray(keys), offsets, dy.shape[0], training)
    if training:
        tape.backward({id(out): (out, device.xp().asarray(dy))})
        emb.update(0.5, 1.0)
    return np.array(device.to_host(out.data))


# ---- the split, by hand ------------------------------------------------------------------------------
def test_threshold_formulas():
    # NVLink_SingleNode: B * I * sqrt(2 p / (M (M - 1))), M = B / R; p = 54/64 makes it 8 * 3/8 = 3 exactly
    p = param(p_dup_max=54 / 64)
    assert frequency_threshold(p, 4, 1, 1, 2) == 3.0
    assert frequency_threshold(p, 4, 2, 1, 2) == pytest.approx(8 * math.sqrt(2 * 54 / 64 / 2))
    assert frequency_threshold(p, 4, 4, 1, 2) == math.inf  # M = 1: HugeCTR divides by zero
    # IB_NVLink(_Hier): I * N * a2a / ar * ratio * N / (N - 1); one node divides by zero: nothing frequent
    ib = param(comm=C.IB_NVLink)
    assert frequency_threshold(ib, 64, 16, 2, 20) == pytest.approx(20 * 2 * 1.9e11 / 1.3e11 * 2)
    assert frequency_threshold(ib, 64, 8, 1, 20) == math.inf


def test_split_matches_hand_computed_example():
    cats = np.array([9, 7, 3, 2, 0])
    counts = np.array([1, 3, 3, 2, 5])
    # threshold 3: 0 (5), 3 (3), 7 (3) reach it; ties by ascending category
    freq, capped = hybrid_split(cats, counts, 3.0, 1, 100)
    assert freq.tolist() == [0, 3, 7] and not capped
    # two ranks: 3 rounded up to 4, the next most frequent (2) joins
    assert hybrid_split(cats, counts, 3.0, 2, 100)[0].tolist() == [0, 3, 7, 2]
    # rounding up past the categories seen takes R back off: 3 seen, 4 -> 2
    assert hybrid_split(cats[2:], counts[2:], 2.0, 2, 100)[0].tolist() == [0, 3]
    # the cap keeps the most frequent
    freq, capped = hybrid_split(cats, counts, 3.0, 1, 2)
    assert freq.tolist() == [0, 3] and capped
    assert hybrid_split(cats, counts, math.inf, 2, 100)[0].tolist() == []
    # infrequent owners: frequent {0, 3} of 10 categories; infrequent 1 2 4 5 6 7 8 9 go round-robin
    owners = infrequent_owner(np.array([1, 2, 4, 5, 6, 7, 8, 9]), np.array([0, 3]), 2)
    assert owners.tolist() == [0, 1, 0, 1, 0, 1, 0, 1]


def test_take_statistics_counts_categories_not_ids():
    """Per-slot id 0 of slots 0 and 1 are different categories (0 and 20); the counts decide, the capped
    list is the most frequent ones."""
    emb = build(E.HybridSparseEmbedding, param(p_dup_max=54 / 64, max_frequent=2))
    # B = 4 samples, 2 iterations, one rank: threshold 3 (test_threshold_formulas)
    ids = np.array([[0, 0, 1], [0, 5, 1], [0, 5, 2], [3, 5, 3], [0, 5, 1], [3, 7, 3], [3, 8, 0], [9, 9, 3]], np.int64)
    offs = np.arange(4 * S + 1, dtype=np.int64)
    emb.take_statistics([(ids[:4].reshape(-1), offs, 4), (ids[4:].reshape(-1), offs, 4)], 4, 2)
    assert emb.threshold == 3.0
    # counts: cat 0: 5, cat 25 (slot 1 id 5): 4, cat 53 (slot 2 id 3): 3, cat 3: 3, cat 51: 3 -> capped at 2
    assert emb.frequent.tolist() == [0, 25]
    # the valid-rows count leaves padded rows out
    emb2 = build(E.HybridSparseEmbedding, param(p_dup_max=54 / 64))
    emb2.take_statistics([(ids[:4].reshape(-1), offs, 4), (ids[4:].reshape(-1), offs, 1)], 4, 2)
    assert sorted(emb2.frequent.tolist()) == [0, 25, 51]  # 0: 4, 25: 4, 51: 3 (53 only 2 here)


# ---- equality with the one-hot embedding ---------------------------------------------------------------
@pytest.mark.parametrize("dev", ["cpu", "sim"])
def test_one_rank_equals_one_hot(dev, on_device):
    """cpu: the compiled CPU engine; sim: the engine's numba.cuda kernels in the simulator."""
    if dev == "sim" and not device._numba_simulated():
        pytest.skip("needs the simulator")
    on_device(dev)
    rng = np.random.default_rng(0)
    hyb, one = build(E.HybridSparseEmbedding, param()), build(E.LocalizedSlotSparseEmbeddingOneHot)
    assert isinstance(hyb, HybridEmbedding)
    hyb.take_statistics([(*batch(rng), 12) for _ in range(4)], 12, 4)
    assert 0 < hyb.frequent.shape[0] < 54
    np.testing.assert_array_equal(device.to_host(hyb.weight.data), device.to_host(one.weight.data))
    saw = [0, 0]
    for t in range(5):
        keys, offs = batch(rng)
        fi = hyb.frequent_index(keys + OFFSET[np.arange(keys.shape[0]) % S])
        saw[0] += int((fi >= 0).sum())
        saw[1] += int((fi < 0).sum())
        dy = np.random.default_rng(100 + t).normal(0, 1, (12, S, D)).astype(np.float32)
        training = t < 4
        out_h = step(hyb, keys, offs, dy, training)
        out_o = step(one, keys, offs, dy, training)  # both take per-slot ids (HugeCTR's do_unique_key)
        np.testing.assert_allclose(out_h, out_o, rtol=0, atol=1e-6)
    assert saw[0] > 0 and saw[1] > 0  # both paths ran
    (kh, vh), (ko, vo) = hyb.dump(), one.dump()
    np.testing.assert_array_equal(kh, ko)
    np.testing.assert_allclose(vh, vo, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(hyb.dump_slots(), one.dump_slots())
    assert not np.allclose(vh, build(E.LocalizedSlotSparseEmbeddingOneHot).dump()[1])  # it did train


def test_snapshot_loads_across_one_hot_and_hybrid():
    rng = np.random.default_rng(1)
    hyb, one = build(E.HybridSparseEmbedding, param()), build(E.LocalizedSlotSparseEmbeddingOneHot)
    hyb.take_statistics([(*batch(rng), 12)], 12, 1)
    keys, offs = batch(rng)
    step(hyb, keys, offs, np.ones((12, S, D), np.float32))
    k, v = hyb.dump()
    one.load(k, v, hyb.dump_slots().astype(np.int64))
    np.testing.assert_array_equal(one.dump()[1], v)
    # and back: a one-hot table into a fresh hybrid one (before its statistics)
    v2 = v * 2 + 1
    fresh = build(E.HybridSparseEmbedding, param())
    fresh.load(k, v2)
    np.testing.assert_array_equal(fresh.dump()[1], v2)


def _sources(tmp_path):
    """Norm training files of the same samples, per-slot ids, once for each embedding (both add the offsets)."""
    from numbactr.data.norm import write_norm_file

    rng = np.random.default_rng(5)
    n = 256
    ids = np.minimum(rng.geometric(0.3, (n, S)) - 1, np.array(SIZES) - 1).astype(np.int64)
    x = rng.normal(0, 1, (n, 2)).astype(np.float32)
    label = (rng.random(n) < 0.5).astype(np.float32)
    out = {}
    for etype, keys in ((E.HybridSparseEmbedding, ids), (E.LocalizedSlotSparseEmbeddingOneHot, ids)):
        p = tmp_path / etype.name / "part0.data"
        p.parent.mkdir()
        write_norm_file(str(p), label, x, keys, key_dtype=np.int64)
        lst = tmp_path / etype.name / "list.txt"
        lst.write_text(f"1\n{p}\n")
        out[etype] = str(lst)
    return out


def _model(etype, src):
    solver = hugectr.CreateSolver(
        batchsize=32,
        batchsize_eval=32,
        max_eval_batches=2,
        lr=0.5,
        vvgpu=[[0]],
        i64_input_key=True,
        seed=7,
        num_iterations_statistics=4,
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[src], eval_source=src, check_type=hugectr.Check_t.Sum
    )
    model = hugectr.Model(solver, reader, hugectr.CreateOptimizer(optimizer_type=O.SGD))
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, S)],
        )
    )
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=etype,
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=D,
            combiner="sum",
            sparse_embedding_name="emb",
            bottom_name="data1",
            slot_size_array=SIZES,
            hybrid_embedding_param=param(p_dup_max=1.0) if etype == E.HybridSparseEmbedding else None,
        )
    )
    L = hugectr.Layer_t
    model.add(hugectr.DenseLayer(L.Reshape, ["emb"], ["flat"], leading_dim=S * D))
    model.add(hugectr.DenseLayer(L.Concat, ["flat", "dense"], ["cat"]))
    model.add(hugectr.DenseLayer(L.InnerProduct, ["cat"], ["fc"], num_output=1))
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc", "label"], ["loss"]))
    model.compile()
    return model


def test_model_trains_like_one_hot_and_shares_its_snapshots(tmp_path):
    """Model level: statistics from the training source's first batches (a reader of their own), the same
    losses and sparse weights as the one-hot model fed the same per-slot keys; each model's snapshot loads into a
    fresh model of the other kind."""
    src = _sources(tmp_path)
    runs = {}
    for etype in (E.HybridSparseEmbedding, E.LocalizedSlotSparseEmbeddingOneHot):
        model = _model(etype, src[etype])
        losses = []
        for _ in range(6):
            assert model.train()
            losses.append(model.get_current_loss())
        assert model.eval()
        model.save_params_to_files(str(tmp_path / etype.name / "snap"), 6)
        runs[etype] = (losses, model.embeddings[0].dump()[1], model.embeddings[0])
    (lh, vh, hyb), (lo, vo, _) = runs[E.HybridSparseEmbedding], runs[E.LocalizedSlotSparseEmbeddingOneHot]
    assert hyb.ready and 0 < hyb.frequent.shape[0]
    np.testing.assert_allclose(lh, lo, rtol=1e-6)
    np.testing.assert_allclose(vh, vo, rtol=0, atol=1e-6)
    for saved, loader in (
        (E.HybridSparseEmbedding, E.LocalizedSlotSparseEmbeddingOneHot),
        (E.LocalizedSlotSparseEmbeddingOneHot, E.HybridSparseEmbedding),
    ):
        fresh = _model(loader, src[loader])
        fresh.load_sparse_weights([str(tmp_path / saved.name / "snap0_sparse_6.model")])
        np.testing.assert_array_equal(fresh.embeddings[0].dump()[1], runs[saved][1], err_msg=f"{saved.name} file")


# ---- under mpiexec -----------------------------------------------------------------------------------------
@pytest.mark.mpi
@needs_mpi
def test_two_ranks_equal_one_hot_and_one_rank(tmp_path):
    """tests/mpi/hybrid_run.py on 1 and 2 ranks: the hybrid embedding's outputs of every step, its evaluation
    output and its dumped table equal the one-hot embedding's in the same job and the hybrid's on one rank
    (float tolerance: the frequent gradients are summed per rank, then allreduced)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    res = {}
    for ranks in (1, 2):
        out = tmp_path / f"r{ranks}.npz"
        r = subprocess.run(
            [MPIEXEC, "-n", str(ranks), sys.executable, str(HERE / "mpi" / "hybrid_run.py"), str(out)],
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, f"mpiexec -n {ranks} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        res[ranks] = dict(np.load(out))
    assert res[2]["frequent"].size > 0 and res[2]["frequent"].size % 2 == 0
    assert res[2]["frequent"].size < res[2]["hyb:keys"].size  # infrequent ones too
    for ranks in (1, 2):
        got = res[ranks]
        np.testing.assert_array_equal(got["fresh:keys"], got["one:keys"])  # a one-hot snapshot reloaded
        np.testing.assert_array_equal(got["fresh:vecs"], got["one:vecs"])
        for name in [k[4:] for k in got if k.startswith("hyb:")]:
            a, b = got["hyb:" + name], got["one:" + name]
            if a.dtype.kind == "f":
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"{ranks} ranks: {name}")
                np.testing.assert_allclose(a, res[1]["hyb:" + name], rtol=0, atol=1e-5, err_msg=name)
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"{ranks} ranks: {name}")


# ---- what it does not take ------------------------------------------------------------------------------------
def test_padding_rows_of_a_partial_batch_read_zeros_and_train_nothing():
    """drop_incomplete_batch=False: the last batch's padding rows have empty bags; they read zeros and pass no
    gradient, so the step equals the same step on the valid rows alone."""
    rng = np.random.default_rng(1)
    stats = [(*batch(rng), 12) for _ in range(3)]
    a, b = build(E.HybridSparseEmbedding, param()), build(E.HybridSparseEmbedding, param())
    a.take_statistics(stats, 12, 3)
    b.take_statistics(stats, 12, 3)
    keys, _ = batch(rng, 9)  # 9 valid rows of a 12-row batch
    padded_offs = np.concatenate([np.arange(9 * S + 1), np.full(3 * S, 9 * S)]).astype(np.int64)
    dy = rng.normal(0, 1, (12, S, D)).astype(np.float32)
    out_a = step(a, keys, padded_offs, dy)
    out_b = step(b, keys, np.arange(9 * S + 1, dtype=np.int64), dy[:9])
    np.testing.assert_array_equal(out_a[:9], out_b)
    assert not out_a[9:].any()
    np.testing.assert_array_equal(device.to_host(a.weight.data), device.to_host(b.weight.data))
    # a bad key among them is named by its sample in the whole batch
    keys[7 * S + 2] = 99
    with pytest.raises(ValueError, match=r"key 99 of slot 2 \(sample 7\)"):
        a.lookup(keys, padded_offs, True)


def test_non_sgd_optimizer_is_an_error():
    with pytest.raises(ValueError, match="SGD only.*Adam"):
        build(E.HybridSparseEmbedding, param(), optimizer=O.Adam)


def test_multi_hot_input_is_an_error():
    with pytest.raises(ValueError, match=r"one-hot input.*nnz_per_slot \[2, 2, 2\]"):
        build(E.HybridSparseEmbedding, param(), nnz=2)
    emb = build(E.HybridSparseEmbedding, param())
    emb.take_statistics([], 12, 1)
    with pytest.raises(ValueError, match=r"exactly one key per slot.*bag 1 \(sample 0, slot 1\) .* 2 key"):
        emb.lookup(np.array([0, 1, 2, 3], np.int64), np.array([0, 1, 3, 4], np.int64), True)


def test_key_outside_its_slot_is_an_error():
    emb = build(E.HybridSparseEmbedding, param())
    emb.take_statistics([], 12, 1)
    with pytest.raises(ValueError, match=r"key 4 of slot 2 .* \[0, 4\)"):
        emb.lookup(np.array([0, 1, 4], np.int64), np.arange(4, dtype=np.int64), True)


def test_lookup_before_statistics_is_an_error():
    emb = build(E.HybridSparseEmbedding, param())
    with pytest.raises(RuntimeError, match="take_statistics"):
        emb.lookup(np.array([0, 1, 2], np.int64), np.arange(4, dtype=np.int64), True)


@pytest.mark.parametrize(
    "args,match",
    [
        (dict(max_num_frequent_categories=-1), "max_num_frequent_categories must be an integer >= 0"),
        (dict(max_num_infrequent_samples=-2), "max_num_infrequent_samples must be an integer >= -1"),
        (dict(p_dup_max=0.0), r"p_dup_max must be a finite number in \(0.0, 1.0\]"),
        (dict(p_dup_max=1.5), "p_dup_max"),
        (dict(max_all_reduce_bandwidth=0), "max_all_reduce_bandwidth"),
        (dict(max_all_to_all_bandwidth=math.inf), "max_all_to_all_bandwidth"),
        (dict(efficiency_bandwidth_ratio=-1.0), "efficiency_bandwidth_ratio"),
        (dict(communication_type="NVLink"), "communication_type must be a CommunicationType"),
        (dict(hybrid_embedding_type=hugectr.DataReaderSparse_t.Distributed), "hybrid_embedding_type"),
    ],
)
def test_bad_param_values_are_errors(args, match):
    with pytest.raises(ValueError, match=match):
        HybridEmbeddingParam(**args)


def test_config_errors():
    with pytest.raises(ValueError, match="hybrid_embedding_param must be a HybridEmbeddingParam"):
        hugectr.SparseEmbedding(
            E.HybridSparseEmbedding, 1, D, "sum", "e", "d", slot_size_array=SIZES, hybrid_embedding_param=object()
        )
    with pytest.raises(ValueError, match="needs slot_size_array"):
        hugectr.SparseEmbedding(E.HybridSparseEmbedding, 1, D, "sum", "e", "d", hybrid_embedding_param=param())
    with pytest.raises(ValueError, match="more than max_num_infrequent_samples=2"):
        emb = build(E.HybridSparseEmbedding, HybridEmbeddingParam(0, 2, 0.01, 1.3e11, 1.9e11, 1.0, C.IB_NVLink_Hier))
        emb.take_statistics([], 12, 1)
        emb.lookup(np.zeros(6, np.int64), np.arange(7, dtype=np.int64), True)


def test_surface_matches_hugectr():
    """The enums and HugeCTR's positional order (NVIDIA's dgx_a100.py passes eight arguments)."""
    assert [m.name for m in hugectr.CommunicationType] == ["IB_NVLink_Hier", "IB_NVLink", "NVLink_SingleNode"]
    assert [m.name for m in hugectr.HybridEmbeddingType] == ["Distributed"]
    assert hugectr.NVLink_SingleNode is C.NVLink_SingleNode
    p = hugectr.HybridEmbeddingParam(
        2,
        -1,
        0.01,
        1.3e11,
        1.9e11,
        1.0,
        hugectr.CommunicationType.NVLink_SingleNode,
        hugectr.HybridEmbeddingType.Distributed,
    )
    assert (p.max_num_frequent_categories, p.max_num_infrequent_samples, p.p_dup_max) == (2, -1, 0.01)
    assert p.communication_type == C.NVLink_SingleNode
    d = hugectr.HybridEmbeddingParam()
    assert (
        d.max_num_frequent_categories,
        d.max_num_infrequent_samples,
        d.p_dup_max,
        d.max_all_reduce_bandwidth,
        d.max_all_to_all_bandwidth,
        d.efficiency_bandwidth_ratio,
        d.communication_type,
    ) == (1, -1, 0.01, 1.3e11, 1.9e11, 1.0, C.IB_NVLink)


def test_dgx_a100_shaped_script(tmp_path):
    """samples/dlrm/dgx_a100.py (HugeCTR v23.08) at toy sizes: RawAsync with per-slot ids, SGD Local atomic,
    HybridSparseEmbedding with the sample's eight positional HybridEmbeddingParam arguments (max 2 frequent
    categories: here a cap), num_iterations_statistics=20 from CreateSolver, then fit with evaluation; its
    fp16 FusedInnerProduct stack is replaced by InnerProduct (not this test's subject)."""
    from numbactr.data.raw import write_raw_file

    slots = [5, 7, 3, 4]
    rng = np.random.default_rng(0)

    def raw(n, name):
        ids = np.stack([np.minimum(rng.geometric(0.4, n) - 1, s - 1) for s in slots], 1)
        dense = rng.integers(0, 50, (n, 2))
        logit = sum(np.linspace(-2, 2, s)[ids[:, k]] for k, s in enumerate(slots)) - 0.5
        label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
        p = str(tmp_path / f"{name}.bin")
        write_raw_file(p, label[:, None], dense, ids)  # per-slot ids: no offsets
        seen[name] = ids
        return p

    seen = {}

    batchsize = 32
    solver = hugectr.CreateSolver(
        max_eval_batches=3,
        batchsize_eval=batchsize,
        batchsize=batchsize,
        vvgpu=[[0]],
        repeat_dataset=True,
        lr=0.5,
        warmup_steps=2,
        i64_input_key=False,
        num_iterations_statistics=20,
        metrics_spec={hugectr.MetricsType.AUC: 0.8025},
        drop_incomplete_batch=False,
    )
    with pytest.warns(hugectr.IgnoredArgumentWarning, match="slot_size_array"):
        reader = hugectr.DataReaderParams(
            data_reader_type=hugectr.DataReaderType_t.RawAsync,
            source=[raw(256, "train")],
            eval_source=raw(96, "eval"),
            check_type=hugectr.Check_t.Non,
            num_samples=256,
            eval_num_samples=96,
            slot_size_array=slots,
            async_param=hugectr.AsyncParam(4, 4, 552960, 2, 512, True, hugectr.Alignment_t.Auto),
        )
    optimizer = hugectr.CreateOptimizer(
        optimizer_type=hugectr.Optimizer_t.SGD, update_type=hugectr.Update_t.Local, atomic_update=True
    )
    model = hugectr.Model(solver, reader, optimizer)
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, len(slots))],
        )
    )
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.HybridSparseEmbedding,
            workspace_size_per_gpu_in_mb=15000,
            slot_size_array=slots,
            embedding_vec_size=8,
            combiner="sum",
            sparse_embedding_name="sparse_embedding1",
            bottom_name="data1",
            optimizer=optimizer,
            hybrid_embedding_param=hugectr.HybridEmbeddingParam(
                2,
                -1,
                0.01,
                1.3e11,
                1.9e11,
                1.0,
                hugectr.CommunicationType.NVLink_SingleNode,
                hugectr.HybridEmbeddingType.Distributed,
            ),
        )
    )
    L = hugectr.Layer_t
    model.add(hugectr.DenseLayer(layer_type=L.InnerProduct, bottom_names=["dense"], top_names=["fc1"], num_output=8))
    model.add(hugectr.DenseLayer(layer_type=L.ReLU, bottom_names=["fc1"], top_names=["relu1"]))
    model.add(
        hugectr.DenseLayer(
            layer_type=L.Interaction, bottom_names=["relu1", "sparse_embedding1"], top_names=["interaction1"]
        )
    )
    model.add(
        hugectr.DenseLayer(layer_type=L.InnerProduct, bottom_names=["interaction1"], top_names=["fc4"], num_output=1)
    )
    model.add(
        hugectr.DenseLayer(layer_type=L.BinaryCrossEntropyLoss, bottom_names=["fc4", "label"], top_names=["loss"])
    )
    model.compile()
    model.summary()
    model.fit(max_iter=16, display=8, eval_interval=8, snapshot=0)
    # the statistics read the whole file (8 batches < 20): its two most frequent categories (ties: smaller)
    cats, counts = np.unique(seen["train"] + np.cumsum([0] + slots[:-1]), return_counts=True)
    assert model.embeddings[0].frequent.tolist() == cats[np.lexsort((cats, -counts))][:2].tolist()
    assert len(model.history["loss"]) == 2 and all(np.isfinite(model.history["loss"]))
    assert len(model.history["auc"]) == 2


def test_frozen_embedding_keeps_its_rows():
    """freeze_embedding: lr 0 for both the frequent and the infrequent rows (the gradients still travel)."""
    rng = np.random.default_rng(2)
    emb = build(E.HybridSparseEmbedding, param())
    emb.take_statistics([(*batch(rng), 12) for _ in range(4)], 12, 4)
    before = emb.dump()[1]
    emb.frozen = True
    step(emb, *batch(rng), np.ones((12, S, D), np.float32))
    np.testing.assert_array_equal(emb.dump()[1], before)
    emb.frozen = False
    step(emb, *batch(rng), np.ones((12, S, D), np.float32))
    assert not np.array_equal(emb.dump()[1], before)


def test_graph_json_round_trips_the_hybrid_parameters(tmp_path):
    """graph_to_json writes HugeCTR's hybrid keys in sparse_embedding_hparam (IB_NVLink_Hier spelled as its
    reader spells it) and reading the JSON back gives the same HybridEmbeddingParam."""
    import json
    from numbactr.files.graph_json import _embedding_from_json

    model = _model(E.HybridSparseEmbedding, _sources(tmp_path)[E.HybridSparseEmbedding])
    model.embeddings[0].cfg.hybrid_embedding_param = param(p_dup_max=0.5, max_frequent=7, comm=C.IB_NVLink_Hier)
    path = tmp_path / "g.json"
    model.graph_to_json(str(path))
    layer = next(d for d in json.loads(path.read_text())["layers"] if d["type"] == "HybridSparseEmbedding")
    hp = layer["sparse_embedding_hparam"]
    assert hp["communication_type"] == "IB_NVLink_Hierarchical"
    assert hp["p_dup_max"] == 0.5 and hp["max_num_frequent_categories"] == 7
    back = _embedding_from_json(layer, "HybridSparseEmbedding", "layer 1").hybrid_embedding_param
    want = model.embeddings[0].cfg.hybrid_embedding_param
    assert vars(back) == vars(want)
    hp["communication_type"] = "Carrier_Pigeon"
    with pytest.raises(ValueError, match="communication_type"):
        _embedding_from_json(layer, "HybridSparseEmbedding", "layer 1")
    # without a hybrid_embedding_param the JSON holds the defaults in effect (HugeCTR's SparseEmbedding
    # defaults, not HybridEmbeddingParam's), so the rebuilt embedding is the same
    model.embeddings[0].cfg.hybrid_embedding_param = None
    model.graph_to_json(str(path))
    layer = next(d for d in json.loads(path.read_text())["layers"] if d["type"] == "HybridSparseEmbedding")
    back = _embedding_from_json(layer, "HybridSparseEmbedding", "layer 1").hybrid_embedding_param
    assert vars(back) == vars(model.embeddings[0].param)
