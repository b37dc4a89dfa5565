"""Model level: a tiny DLRM through the HugeCTR API trains on cpu; sim (real kernels) matches cpu."""

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.embedding.factory import make_embedding
from tests.model_util import tiny_data, tiny_dlrm


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("tiny")))


def test_tiny_dlrm_learns_on_cpu(data, on_device):
    on_device("cpu")
    model = tiny_dlrm(*data)
    model.fit(max_iter=120, display=40, eval_interval=0)
    losses = model.history["loss"]
    assert losses[-1] < losses[0]
    auc = dict(model.eval_whole_source())["AUC"]
    assert auc > 0.8, auc


@pytest.mark.parametrize(
    "optimizer,update",
    [(hugectr.Optimizer_t.Adam, hugectr.Update_t.Global), (hugectr.Optimizer_t.SGD, hugectr.Update_t.Local)],
)
def test_one_step_on_sim_matches_cpu(data, on_device, optimizer, update):
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    states = {}
    for dev in ("cpu", "sim"):
        on_device(dev)
        model = tiny_dlrm(*data, batch=16, optimizer=optimizer, update=update, lr=0.05)
        assert model.train()
        emb = model.embeddings[0]
        states[dev] = (
            model.get_current_loss(),
            np.array(model.weights),
            np.array(emb.weight.data),
            emb.table.size,
            np.array(emb.table.find(np.arange(9))),
        )
    (l0, w0, p0, n0, r0), (l1, w1, p1, n1, r1) = states["cpu"], states["sim"]
    assert n0 == n1 and np.array_equal(r0, r1)  # same keys -> same rows
    assert l0 == pytest.approx(l1, rel=1e-5)
    np.testing.assert_allclose(w1, w0, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(p1, p0, rtol=1e-4, atol=1e-6)


def test_loss_falls_through_the_real_kernels_on_sim(data, on_device):
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    on_device("sim")
    model = tiny_dlrm(*data, batch=16, lr=0.05)
    losses = []
    for _ in range(8):
        assert model.train()
        losses.append(model.get_current_loss())
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses


def _model(tmp, **solver):
    tr, ev = tmp
    s = hugectr.CreateSolver(batchsize=8, batchsize_eval=8, i64_input_key=True, **solver)
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
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 3)],
        )
    )
    return m


def test_bad_graphs_fail_at_add_with_names(data):
    m = _model(data)
    L = hugectr.Layer_t
    with pytest.raises(hugectr.ModelError, match="SparseEmbedding 'e'.*bottom_name 'dense' is not a sparse input"):
        m.add(
            hugectr.SparseEmbedding(hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, 4, "sum", "e", "dense")
        )
    with pytest.raises(hugectr.ModelError, match="bottom tensor 'nope' does not exist"):
        m.add(hugectr.DenseLayer(L.ReLU, ["nope"], ["r"]))
    with pytest.raises(hugectr.ModelError, match="is a sparse input"):
        m.add(hugectr.DenseLayer(L.ReLU, ["data1"], ["r"]))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc1"], num_output=4))
    with pytest.raises(hugectr.ModelError, match="top tensor name 'fc1' already exists"):
        m.add(hugectr.DenseLayer(L.ReLU, ["dense"], ["fc1"]))
    with pytest.raises(hugectr.ModelError, match=r"Interaction.*'fc1' \(8, 4\).*'dense' \(8, 2\)"):
        m.add(hugectr.DenseLayer(L.Interaction, ["fc1", "dense"], ["i"]))
    with pytest.raises(hugectr.ModelError, match=r"'fc1' \(8, 4\).*'dense' \(8, 2\)"):
        m.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc1", "dense"], ["loss"]))
    with pytest.raises(hugectr.ModelError, match=r"GRU layer .*'fc1' \(8, 4\)"):
        m.add(hugectr.DenseLayer(L.GRU, ["fc1"], ["g"]))
    with pytest.raises(ValueError, match="unknown parameter"):
        hugectr.DenseLayer(L.ReLU, ["fc1"], ["r"], num_ouptut=3)


def test_compile_needs_a_loss(data):
    m = _model(data)
    m.add(hugectr.DenseLayer(hugectr.Layer_t.InnerProduct, ["dense"], ["fc1"], num_output=1))
    m.add(hugectr.DenseLayer(hugectr.Layer_t.ReLU, ["fc1"], ["r"]))
    with pytest.raises(hugectr.ModelError, match="no loss layer"):
        m.compile()


def test_solver_and_params_validation():
    with pytest.raises(ValueError, match="unknown argument"):
        hugectr.CreateSolver(batch_size=3)
    with pytest.raises(ValueError, match="decay_power"):
        hugectr.CreateSolver(decay_power=0.5)
    with pytest.raises(ValueError, match="nnz_per_slot has 2 entries for slot_num=3"):
        hugectr.DataReaderSparseParam("d", [1, 1], False, 3)
    with pytest.raises(ValueError, match="combiner"):
        hugectr.SparseEmbedding(hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, 4, "max", "e", "d")


def test_workspace_too_small_for_the_keys_names_the_workspace_needed(data):
    tr, ev = data
    m = _model(data)
    # 3 slots x 6 keys = 18 rows needed; 300 bytes of workspace holds 2 rows of width 4 with Adam
    m.add(
        hugectr.SparseEmbedding(
            hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 300 / 2**20, 4, "sum", "emb", "data1"
        )
    )
    m.add(hugectr.DenseLayer(hugectr.Layer_t.Reshape, ["emb"], ["flat"], leading_dim=12))
    m.add(hugectr.DenseLayer(hugectr.Layer_t.InnerProduct, ["flat"], ["fc"], num_output=1))
    m.add(hugectr.DenseLayer(hugectr.Layer_t.BinaryCrossEntropyLoss, ["fc", "label"], ["loss"]))
    m.compile()
    with pytest.raises(RuntimeError, match=r"embedding table full.*'emb'.*workspace_size_per_gpu_in_mb"):
        m.train()
        m.check_deferred()  # a kernel device (sim, gpu) keeps the error until its next check point


def test_lr_schedule_matches_hugectr_formula():
    s = hugectr.LearningRateScheduler(1.0, warmup_steps=2, decay_start=4, decay_steps=2, decay_power=2.0, end_lr=0.1)
    got = [s.get_next() for _ in range(7)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 1.0, 0.25, 0.1, 0.1])


def test_localized_slot_size_array_sets_the_capacity(data, on_device):
    on_device("cpu")
    m = _model(data)
    m.add(
        hugectr.SparseEmbedding(
            hugectr.Embedding_t.LocalizedSlotSparseEmbeddingHash, 0, 4, "sum", "emb", "data1", slot_size_array=[6, 6, 6]
        )
    )
    assert m.embeddings[0].max_rows == 18  # wins over workspace_size_per_gpu_in_mb=0
    with pytest.raises(ValueError, match="slot_size_array needs one positive size per slot"):
        m2 = _model(data)
        m2.add(
            hugectr.SparseEmbedding(
                hugectr.Embedding_t.LocalizedSlotSparseEmbeddingHash, 0, 4, "sum", "e", "data1", slot_size_array=[6, 6]
            )
        )


def test_several_embeddings_each_with_its_own_optimizer_and_freeze(tmp_path, on_device):
    """Wide&Deep-style: two embeddings, one with its own SGD; freezing one leaves its rows unchanged."""
    from tests.sample_graphs import make_data, wdl

    on_device("cpu")
    data = make_data(str(tmp_path), [("wide_data", 2, 1), ("deep_data", 3, 1)])
    m = wdl(data)
    wide = m.embeddings[0]  # rebuilt with its own SGD, as SparseEmbedding(optimizer=...) builds it
    m.embeddings[0] = make_embedding(
        wide.cfg,
        m.input.sparse[m.sparse_inputs[wide.cfg.bottom_name]],
        hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.SGD),
        m.solver.seed,
    )
    m.compile()
    m.train()
    m.freeze_embedding("sparse_embedding2")
    before = np.array(m.embeddings[0].weight.data)
    deep_before = np.array(m.embeddings[1].weight.data)
    m.train()
    np.testing.assert_array_equal(
        m.embeddings[0].weight.data[: m.embeddings[0].table.size], before[: m.embeddings[0].table.size]
    )
    assert not np.array_equal(m.embeddings[1].weight.data, deep_before)
    m.unfreeze_embedding()
    m.train()
    assert not np.array_equal(m.embeddings[0].weight.data, before)
    with pytest.raises(hugectr.ModelError, match="no embedding named"):
        m.freeze_embedding("nope")


@pytest.mark.gpu
def test_one_step_on_gpu_matches_cpu(data, on_device):
    """Runs where a GPU exists (NUMBACTR_DEVICE=gpu pytest -m gpu): the real kernels on cupy arrays."""
    states = {}
    for dev in ("cpu", "gpu"):
        on_device(dev)
        model = tiny_dlrm(*data, batch=64, lr=0.05)
        for _ in range(3):
            assert model.train()
        states[dev] = (
            model.get_current_loss(),
            device.to_host(model.weights),
            device.to_host(model.embeddings[0].weight.data),
        )
    (l0, w0, p0), (l1, w1, p1) = states["cpu"], states["gpu"]
    assert l1 == pytest.approx(l0, rel=1e-4)
    np.testing.assert_allclose(w1, w0, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(p1, p0, rtol=1e-3, atol=1e-5)
