"""numbactr.sok on one rank: SOK's layers equal PyTorch's own embeddings (nn.Embedding, F.embedding_bag) in
forward and training, a PyTorch model with SOK layers reaches the same losses as with nn.EmbeddingBag, the
optimizer wrappers apply torch's rules (and SOK's global Adam), every input form gives the same bags, and
bad input is a clear error. Sharded runs: tests/test_sok_mpi.py."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from numbactr.runtime import device  # noqa: E402
from numbactr.kernels.embedding_init import row_values_ref  # noqa: E402

import numbactr.sok as sok  # noqa: E402
from numbactr.sok.table import SETTINGS, VocabularyFullError  # noqa: E402

F = torch.nn.functional


@pytest.fixture(autouse=True)
def _cpu():
    old = device.kind()
    device.set_device("cpu")
    sok.init(seed=0, set_torch_threads=False)
    yield
    device.set_device(old)


def bag_ids(rng, bags, max_nnz, vocab):
    """(values, offsets) of `bags` bags of 0..max_nnz keys in [0, vocab), empty bags included."""
    lens = rng.integers(0, max_nnz + 1, bags)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return torch.from_numpy(rng.integers(0, vocab, offsets[-1])), torch.from_numpy(offsets)


# ---- forward ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_hashtable", [True, False])
def test_all2all_dense_is_nn_embedding_per_key(use_hashtable):
    B, S, nnz, D = 4, 3, 2, 5
    emb = sok.All2AllDenseEmbedding(40, D, S, nnz, use_hashtable=use_hashtable)
    ids = torch.randint(0, 40, (B, S, nnz), generator=torch.Generator().manual_seed(1))
    out = emb(ids)
    assert out.shape == (B, S, nnz, D) and out.requires_grad
    # every key starts at the hash of (seed, key), keyed or not: the table's seed is SETTINGS.seed + index
    want = row_values_ref(ids.reshape(-1).numpy().astype(np.uint64), D, emb.table.seed, -0.05, 0.05)
    np.testing.assert_array_equal(out.detach().reshape(-1, D).numpy(), want)
    # the rows shown by weight / keys() are those vectors
    table = dict(zip(emb.keys().tolist(), emb.weight.numpy()))
    np.testing.assert_array_equal(np.stack([table[k] for k in ids.reshape(-1).tolist()]), want)
    uniq = torch.unique(ids.reshape(-1))
    dyn = sok.All2AllDenseEmbedding(40, D, S, nnz, dynamic_input=True, use_hashtable=use_hashtable)
    got = dyn(uniq)
    assert got.shape == (uniq.shape[0], D)
    np.testing.assert_array_equal(
        got.detach().numpy(), row_values_ref(uniq.numpy().astype(np.uint64), D, dyn.table.seed, -0.05, 0.05)
    )


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_distributed_embedding_is_embedding_bag_in_every_input_form(combiner):
    B, S, max_nnz, V, D = 5, 3, 3, 30, 4
    emb = sok.DistributedEmbedding(combiner, V, D, S, max_nnz, use_hashtable=False)
    vals, offs = bag_ids(np.random.default_rng(0), B * S, max_nnz, V)
    out = emb((vals, offs))
    assert out.shape == (B, S, D)
    want = F.embedding_bag(vals, emb.weight, offs[:-1], mode=combiner).view(B, S, D)
    np.testing.assert_allclose(out.detach().numpy(), want.numpy(), rtol=1e-6, atol=1e-7)
    rows = torch.repeat_interleave(torch.arange(B * S), torch.diff(offs))
    cols = torch.cat([torch.arange(int(n)) for n in torch.diff(offs)])
    coo = torch.sparse_coo_tensor(torch.stack([rows, cols]), vals, (B * S, max_nnz), check_invariants=True)
    perm = torch.randperm(vals.shape[0], generator=torch.Generator().manual_seed(3))  # uncoalesced order
    shuffled = torch.sparse_coo_tensor(
        torch.stack([rows, cols])[:, perm], vals[perm], (B * S, max_nnz), check_invariants=True
    )
    with warnings.catch_warnings():  # torch says its CSR tensors are beta, on their first use
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        csr = torch.sparse_csr_tensor(offs, cols, vals, (B * S, max_nnz), check_invariants=True)
    for form in (coo, shuffled, csr):
        np.testing.assert_array_equal(emb(form).detach().numpy(), out.detach().numpy())
    dense = torch.randint(0, V, (B, S, 2))
    np.testing.assert_array_equal(emb(dense).detach().numpy(), emb(dense.reshape(B * S, 2)).detach().numpy())


def test_evaluation_finds_only_and_a_missing_key_counts_in_the_mean():
    emb = sok.DistributedEmbedding("mean", 10, 4, 1, 2)
    emb((torch.tensor([7]), torch.tensor([0, 1])))  # key 7 inserted in training
    emb.eval()
    out = emb((torch.tensor([7, 9]), torch.tensor([0, 2])))  # 9 was never seen: zeros, counted
    np.testing.assert_array_equal(out.detach().numpy()[0, 0], emb.weight.numpy()[0] / 2)
    assert emb.keys().tolist() == [7]


# ---- training ---------------------------------------------------------------------------------------
def test_sgd_and_adam_steps_equal_torch_on_the_touched_rows():
    """SGD == dense nn.EmbeddingBag + torch SGD; Adam == nn.EmbeddingBag(sparse=True) + SparseAdam (Adam on
    the rows a batch touched, SOK's wrapper semantics); Adagrad == torch Adagrad on sparse gradients."""
    V, D, S, B = 25, 4, 2, 6
    rng = np.random.default_rng(5)
    for kind in ("sgd", "adam", "adagrad"):
        emb = sok.DistributedEmbedding("mean", V, D, S, 3, use_hashtable=False)
        ref = torch.nn.EmbeddingBag(V, D, mode="mean", sparse=kind != "sgd")
        with torch.no_grad():
            ref.weight.copy_(emb.weight)
        if kind == "sgd":
            opt, ref_opt = sok.SGD(emb.parameters(), lr=0.3), torch.optim.SGD(ref.parameters(), lr=0.3)
        elif kind == "adam":
            opt = sok.OptimizerWrapper(torch.optim.Adam(emb.parameters(), lr=0.05, betas=(0.8, 0.9), eps=1e-6))
            ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.05, betas=(0.8, 0.9), eps=1e-6)
        else:
            opt = sok.OptimizerWrapper(torch.optim.Adagrad(emb.parameters(), lr=0.1, initial_accumulator_value=0.2))
            ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1, initial_accumulator_value=0.2)
        for _ in range(4):
            vals, offs = bag_ids(rng, B * S, 3, V)
            target = torch.from_numpy(rng.normal(size=(B, S, D)).astype(np.float32))
            for module, o in ((emb, opt), (ref, ref_opt)):
                o.zero_grad()
                out = module((vals, offs)) if module is emb else module(vals, offs[:-1])
                ((out.view(B, S, D) - target) ** 2).sum().backward()
                with torch.sparse.check_sparse_tensor_invariants(enable=True):  # (torch warns when unsaid)
                    o.step()
            np.testing.assert_allclose(
                emb.weight.numpy(), ref.weight.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=kind
            )


class MLP(torch.nn.Module):
    """An embedding of S slots of width D (SOK's (B, S, D) or nn.EmbeddingBag's (B*S, D)) under an MLP."""

    def __init__(self, emb, slots, dim):
        super().__init__()
        self.emb, self.width = emb, slots * dim
        self.mlp = torch.nn.Sequential(torch.nn.Linear(self.width, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, bags):
        out = self.emb(*bags) if isinstance(self.emb, torch.nn.EmbeddingBag) else self.emb(bags)
        return self.mlp(out.reshape(-1, self.width))


def test_a_model_with_sok_layers_reaches_the_losses_of_nn_embedding_bag():
    """Issue 11 item 5: the same data, the same initial weights, Adam: the losses agree step by step."""
    V, D, S, B = 50, 8, 3, 16
    torch.manual_seed(0)
    sok_model = MLP(sok.DistributedEmbedding("sum", V, D, S, 4, use_hashtable=False), S, D)
    ref_model = MLP(torch.nn.EmbeddingBag(V, D, mode="sum", sparse=True), S, D)
    ref_model.mlp.load_state_dict(sok_model.mlp.state_dict())
    with torch.no_grad():
        ref_model.emb.weight.copy_(sok_model.emb.weight)
    opt = sok.OptimizerWrapper(torch.optim.Adam(sok_model.parameters(), lr=0.01))
    dense_opt = torch.optim.Adam(ref_model.mlp.parameters(), lr=0.01)
    emb_opt = torch.optim.SparseAdam(ref_model.emb.parameters(), lr=0.01)
    rng = np.random.default_rng(1)
    bce = torch.nn.BCEWithLogitsLoss()
    losses = {"sok": [], "torch": []}
    for _ in range(8):
        vals, offs = bag_ids(rng, B * S, 4, V)
        label = torch.from_numpy((rng.random((B, 1)) < 0.5).astype(np.float32))
        opt.zero_grad()
        loss = bce(sok_model((vals, offs)), label)
        loss.backward()
        opt.step()
        losses["sok"].append(loss.item())
        dense_opt.zero_grad()
        emb_opt.zero_grad()
        loss = bce(ref_model((vals, offs[:-1])), label)
        loss.backward()
        dense_opt.step()
        emb_opt.step()
        losses["torch"].append(loss.item())
    np.testing.assert_allclose(losses["sok"], losses["torch"], rtol=1e-5)
    assert losses["sok"][-1] != losses["sok"][0]


def test_sok_global_adam_moves_every_row_in_use():
    """sok.Adam (SOK's first API) is HugeCTR's Adam with Update_t.Global: rows not in the batch move too."""
    emb = sok.DistributedEmbedding("sum", 10, 2, 1, 2)
    opt = sok.Adam(emb.parameters(), learning_rate=0.1)
    rows = {}
    for step, keys in enumerate(([1, 2], [1], [3])):
        opt.zero_grad()
        emb((torch.tensor(keys), torch.tensor([0, len(keys)]))).sum().backward()
        opt.step()
        rows[step] = dict(zip(emb.keys().tolist(), emb.weight.numpy().copy()))
    assert not np.array_equal(rows[1][2], rows[0][2])  # key 2 was not in step 1's batch but moved
    # HugeCTR's global Adam by hand for key 2 (hot at step 1 only, g = 1; eps 1e-7): m, v decay afterwards
    w = row_values_ref(np.array([2], np.uint64), 2, emb.table.seed, -0.05, 0.05)[0].astype(np.float64)
    m = v = 0.0
    for t, g in ((1, 1.0), (2, 0.0), (3, 0.0)):
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        w = w - 0.1 * np.sqrt(1 - 0.999**t) / (1 - 0.9**t) * m / (np.sqrt(v) + 1e-7)
    np.testing.assert_allclose(rows[2][2], w, rtol=1e-5)
    with pytest.raises(ValueError, match="SOK tables only"):
        sok.Adam(list(emb.parameters()) + [torch.nn.Parameter(torch.zeros(3))])


def test_the_learning_rate_of_the_group_is_read_at_every_step_and_rebinding_keeps_rows():
    emb = sok.DistributedEmbedding("sum", 10, 2, 1, 2)
    ids = (torch.tensor([4]), torch.tensor([0, 1]))
    emb(ids)  # a key inserted before any optimizer exists
    before = emb.weight.clone()
    opt = sok.OptimizerWrapper(torch.optim.Adam(emb.parameters(), lr=0.5))  # rebuilds the engine's states
    assert emb.keys().tolist() == [4] and torch.equal(emb.weight, before)
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.0)
    opt.zero_grad()
    emb(ids).sum().backward()
    opt.step()
    sched.step()  # the group's lr: 0.5 -> 0
    first = emb.weight.clone()
    assert not torch.equal(first, before)
    opt.zero_grad()
    emb(ids).sum().backward()
    opt.step()
    assert torch.equal(emb.weight, first)  # lr 0 reached the table: no change
    with pytest.raises(ValueError, match="updated by HUGECTR_ADAM already"):
        sok.SGD(emb.parameters(), lr=0.1)


def test_lookup_sparse_variables_combiners_and_weights():
    v = sok.Variable(np.arange(24, dtype=np.float32).reshape(6, 4))
    dv = sok.DynamicVariable(dimension=4, initializer="13")
    assert v.shape == v.global_shape == (6, 4) and v.target_gpu == -1 and dv.target_gpu == -1
    ids_v = (torch.tensor([0, 5, 5, 2]), torch.tensor([0, 3, 3, 4]))  # bags [0,5,5] [] [2]
    ids_d = torch.tensor([[2**40, 3], [3, 3], [7, 8]])
    w_v = (torch.tensor([1.0, 2.0, 1.0, 0.5]), ids_v[1])
    one = sok.lookup_sparse(v, ids_v)  # a single param: a tensor, combiner 'mean'
    assert isinstance(one, torch.Tensor)
    W = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    np.testing.assert_allclose(one.detach().numpy(), F.embedding_bag(ids_v[0], W, ids_v[1][:-1], mode="mean").numpy())
    s, d = sok.lookup_sparse([v, dv], [ids_v, ids_d], sp_weights=[w_v, None], combiners=["sum", "mean"])
    want = F.embedding_bag(ids_v[0], W, ids_v[1][:-1], mode="sum", per_sample_weights=w_v[0])
    np.testing.assert_allclose(s.detach().numpy(), want.numpy())
    np.testing.assert_array_equal(d.detach().numpy(), np.full((3, 4), 13, np.float32))
    assert dv.size == 4 and sorted(sok.export(dv)[0].tolist()) == [3, 7, 8, 2**40]
    wm = sok.lookup_sparse([v], [ids_v], sp_weights=[w_v], combiners=["mean"])[0]
    np.testing.assert_allclose(wm.detach().numpy()[0], (W[0] + 2 * W[5] + W[5]).numpy() / 4)
    np.testing.assert_allclose(wm.detach().numpy()[2], W[2].numpy())  # 0.5 W[2] / 0.5
    sok.assign(dv, torch.tensor([3, 99]), torch.ones(2, 4))
    np.testing.assert_array_equal(sok.lookup_sparse(dv, torch.tensor([[99, 3]])).detach().numpy(), np.ones((1, 4)))
    frozen = sok.Variable(shape=(5, 2), initializer=torch.nn.init.ones_, trainable=False)
    out = sok.lookup_sparse(frozen, torch.tensor([[1, 2]]), combiners="sum")
    assert not out.requires_grad and torch.equal(out, torch.full((1, 2), 2.0))
    local = sok.Variable(shape=(3, 2), mode="localized:0")
    assert local.shape == (3, 2) and local.target_gpu == 0


def test_filter_variables_splits_tables_from_dense_parameters():
    model = MLP(sok.DistributedEmbedding("sum", 10, 2, 3, 1), 3, 2)
    tables, dense = sok.filter_variables(model)
    assert tables == [model.emb.placeholder] and len(dense) == 4
    assert sok.split_embedding_variable_from_others(list(model.parameters()))[0] == tables


# ---- errors -----------------------------------------------------------------------------------------
def test_bad_input_is_a_clear_error():
    emb = sok.DistributedEmbedding("sum", 8, 2, 2, 2, use_hashtable=False)
    with pytest.raises(ValueError, match=r"key 8 at position 1 of this batch is outside the table \[0, 8\)"):
        emb((torch.tensor([1, 8]), torch.tensor([0, 1, 2])))
    with pytest.raises(ValueError, match="more than max_nnz=2"):
        emb((torch.tensor([1, 2, 3]), torch.tensor([0, 3, 3])))
    with pytest.raises(ValueError, match="not batch \\* slot_num"):
        emb((torch.tensor([1]), torch.tensor([0, 1, 1, 1])))
    with pytest.raises(ValueError, match="offsets must be"):
        emb((torch.tensor([1, 2]), torch.tensor([0, 1])))
    with pytest.raises(TypeError, match="integer"):
        emb(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="twice"):
        emb(
            torch.sparse_coo_tensor(torch.tensor([[0, 0], [1, 1]]), torch.tensor([1, 2]), (2, 2), check_invariants=True)
        )
    keyed = sok.DistributedEmbedding("sum", 8, 2, 1, 2)
    with pytest.raises(ValueError, match="key -1 at position 0 .* reserved"):
        keyed((torch.tensor([-1]), torch.tensor([0, 1])))
    dense = sok.All2AllDenseEmbedding(8, 2, 3, 2)
    with pytest.raises(ValueError, match=r"shape \(batch, slot_num=3, nnz_per_slot=2\)"):
        dense(torch.zeros(4, 3, 1, dtype=torch.int64))
    full = sok.DynamicVariable(2, var_type="hbm", max_capacity=3)  # hybrid tables evict instead
    with pytest.raises(VocabularyFullError, match="raise max_capacity .* to at least 5"):
        sok.lookup_sparse(full, torch.tensor([[1, 2, 3, 4, 5]]))
    assert full.size == 0  # the table is unchanged
    with pytest.raises(ValueError, match="only 1 rank"):
        sok.Variable(shape=(3, 2), mode="localized:1")
    with pytest.raises(ValueError, match="initializer 'normal' is not supported"):
        sok.DynamicVariable(2, initializer="normal", var_type="hbm")  # hybrid's N(0, 1)


def test_a_second_backward_before_the_step_and_unsupported_optimizers_are_errors():
    emb = sok.DistributedEmbedding("sum", 8, 2, 1, 1)
    ids = (torch.tensor([1]), torch.tensor([0, 1]))
    emb(ids).sum().backward()
    with pytest.raises(RuntimeError, match="a second backward, and no sok.OptimizerWrapper holds this table"):
        emb(ids).sum().backward()
    opt = sok.SGD(emb.parameters(), lr=0.1)
    opt.zero_grad()  # drops the held gradient
    emb(ids).sum().backward()
    opt.step()
    for bad in (torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.9), torch.optim.RMSprop(emb.parameters())):
        with pytest.raises(NotImplementedError):
            sok.OptimizerWrapper(bad)


def test_init_restarts_the_table_seeds():
    sok.init(seed=7, set_torch_threads=False)
    a = sok.DynamicVariable(3)
    sok.init(seed=7, set_torch_threads=False)
    b = sok.DynamicVariable(3)
    assert a.table.seed == b.table.seed == 7 and SETTINGS.tables == 1
    ids = torch.tensor([[5, 6]])
    assert torch.equal(sok.lookup_sparse(a, ids), sok.lookup_sparse(b, ids))


def test_the_simulators_kernels_train_as_the_cpu_path():
    """The same SOK steps on the sim device (the engine's numba.cuda kernels) and on cpu."""
    got = {}
    for kind in ("cpu", "sim"):
        device.set_device(kind)
        sok.init(seed=1, set_torch_threads=False)
        emb = sok.DistributedEmbedding("mean", 16, 4, 2, 2)
        opt = sok.OptimizerWrapper(torch.optim.Adam(emb.parameters(), lr=0.1))
        for keys, offsets in (([3, 5, 5, 9], [0, 2, 3, 3, 4]), ([9, 2, 3], [0, 1, 1, 3, 3])):
            opt.zero_grad()
            (emb((torch.tensor(keys), torch.tensor(offsets))) ** 2).sum().backward()
            opt.step()
        got[kind] = dict(zip(emb.keys().tolist(), emb.weight.numpy().copy()))
    assert got["sim"].keys() == got["cpu"].keys()
    for k, row in got["cpu"].items():
        np.testing.assert_allclose(got["sim"][k], row, rtol=1e-5, atol=1e-7)
