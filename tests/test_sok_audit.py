"""numbactr.sok against SOK's own semantics where an audit found them apart (SOK's Python sources, Keras'
optimizer_v2 Adam): a table looked up several times before the step applies the sum of its gradients once;
Adam's t is the wrapper's step count for every table; a wrapped torch.optim.Adam is Keras' Adam (every row
of a sok.Variable, the touched rows of a DynamicVariable); a DynamicVariable inserts new keys in
evaluation too; all2all_dense_embedding, incremental_model_dump, filter_variables and SOK's optimizers on
SOK's variables; a plain torch optimizer's mistake names the fix. Each test fails on the code before."""

import datetime
import io
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from numbactr.runtime import device  # noqa: E402

import numbactr.sok as sok  # noqa: E402

B1, B2, EPS = 0.9, 0.999, 1e-8


@pytest.fixture(autouse=True)
def _cpu():
    old = device.kind()
    device.set_device("cpu")
    sok.init(seed=0, set_torch_threads=False)
    yield
    device.set_device(old)


def csr(bags):
    """(values, offsets) tensors of a list of bags."""
    vals = torch.tensor([k for b in bags for k in b], dtype=torch.int64)
    offs = torch.tensor(np.concatenate([[0], np.cumsum([len(b) for b in bags])]), dtype=torch.int64)
    return vals, offs


def rows_of(var) -> dict:
    keys, values = sok.export(var)
    return dict(zip(keys.tolist(), values.numpy().copy()))


def grads(bags, comb, C, dim):
    """{key: summed gradient} of sum(C * pooled) for one lookup's bags (float64)."""
    g = {}
    for i, b in enumerate(bags):
        for k in b:
            g[k] = g.get(k, np.zeros(dim)) + C[i] * (1.0 / len(b) if comb == "mean" else 1.0)
    return g


# ---- 1. several lookups of one table before the step -------------------------------------------------
@pytest.mark.parametrize("kind", ["variable", "dynamic"])
def test_a_table_used_several_times_applies_the_sum_of_its_gradients_once(kind):
    """Two lookup_sparse calls, lookup_sparse([v, v]) and all2all_dense_embedding of the same table in one
    forward: one Adam update with the summed gradient, equal to one lookup of the concatenated ids."""
    rng = np.random.default_rng(0)
    D = 3
    T0 = rng.standard_normal((12, D)).astype(np.float32)
    parts = [([[1, 1, 2], [3]], "sum"), ([[2, 5], [1]], "mean"), ([[7], [1, 3, 3]], "sum"), ([[4, 1]], "mean")]
    dense_ids = torch.tensor([[2, 9], [1, 1]])
    Cs = [torch.from_numpy(rng.standard_normal((len(b), D)).astype(np.float32)) for b, _ in parts]
    Cd = torch.from_numpy(rng.standard_normal((2, 2, D)).astype(np.float32))

    def make():
        sok.init(seed=0, set_torch_threads=False)
        if kind == "variable":
            return sok.Variable(T0.copy())
        return sok.DynamicVariable(dimension=D, initializer="0.5")

    def opt_of(v):
        return sok.OptimizerWrapper(torch.optim.Adam([v.placeholder], lr=0.05))

    # several uses in one forward
    v = make()
    opt = opt_of(v)
    for _ in range(2):
        opt.zero_grad()
        a = sok.lookup_sparse(v, csr(parts[0][0]), combiners=parts[0][1])
        b, c = sok.lookup_sparse([v, v], [csr(parts[1][0]), csr(parts[2][0])], combiners=[parts[1][1], parts[2][1]])
        d = sok.lookup_sparse(v, csr(parts[3][0]), combiners=parts[3][1])
        e = sok.all2all_dense_embedding(v, dense_ids)
        loss = sum((o * C).sum() for o, C in zip((a, b, c, d), Cs)) + (e * Cd).sum()
        loss.backward()
        opt.step()
    assert opt.iterations == 2 and v.table.engine.step == 2
    got = rows_of(v)

    # the same as one lookup of the concatenated ids (every part's bags, then the dense ids one per bag), 'sum'
    # with each occurrence's gradient: a 'mean' bag of L keys is L one-key bags with C / L
    ref = make()
    ref_opt = opt_of(ref)
    for _ in range(2):
        ref_opt.zero_grad()
        bags, C = [], []
        for (bs, comb), Ci in zip(parts, Cs):
            for i, bag in enumerate(bs):
                if comb == "sum":
                    bags.append(bag)
                    C.append(Ci[i])
                else:
                    bags += [[k] for k in bag]
                    C += [Ci[i] / len(bag)] * len(bag)
        bags += [[k] for k in dense_ids.reshape(-1).tolist()]
        C += list(Cd.reshape(-1, D))
        out = sok.lookup_sparse(ref, csr(bags), combiners="sum")
        (out * torch.stack(C)).sum().backward()
        ref_opt.step()
    want = rows_of(ref)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)


def test_a_shared_layer_and_gradient_accumulation_sum_their_gradients():
    """An All2AllDenseEmbedding called twice (pooling NONE) and two backward passes before one SGD step:
    every occurrence's gradient reaches its row once."""
    emb = sok.All2AllDenseEmbedding(16, 2, 1, 2, use_hashtable=False)
    w0 = emb.weight.clone()
    opt = sok.SGD(emb.parameters(), lr=1.0)
    (emb(torch.tensor([[[1, 2]]])).sum() + emb(torch.tensor([[[2, 2]]])).sum()).backward()
    emb(torch.tensor([[[5, 1]]])).sum().backward()
    opt.step()
    want = w0.clone()
    for k, n in {1: 2, 2: 3, 5: 1}.items():
        want[k] -= n
    torch.testing.assert_close(emb.weight, want)


# ---- 2. Adam's t: the wrapper's step count -----------------------------------------------------------
def lazy_adam(steps, dim, lr, init, t_of):
    """Keras' Adam on a DynamicVariable through SOK's wrapper (the touched rows only): {key: row}; t_of(i)
    is step i's t."""
    W, m, s = {}, {}, {}
    for i, g in enumerate(steps):
        t = t_of(i)
        for k, gk in g.items():
            W.setdefault(k, np.full(dim, init))
            m[k] = B1 * m.get(k, 0) + (1 - B1) * gk
            s[k] = B2 * s.get(k, 0) + (1 - B2) * gk * gk
            W[k] = W[k] - lr * np.sqrt(1 - B2**t) / (1 - B1**t) * m[k] / (np.sqrt(s[k]) + EPS)
    return W


def test_adam_counts_the_wrappers_steps_for_every_table():
    """SOK: the wrapper's iterations, shared: a table without gradient at step 1 uses t = 2 at step 2."""
    D, lr = 2, 0.1
    a = sok.DynamicVariable(dimension=D, initializer="0")
    b = sok.DynamicVariable(dimension=D, initializer="0")
    opt = sok.OptimizerWrapper(torch.optim.Adam([a.placeholder, b.placeholder], lr=lr, eps=EPS))
    batches = [[[1, 2]], [[2, 3]], [[3]]]
    Cs = [np.array([[1.0, -2.0]]), np.array([[0.5, 0.25]]), np.array([[-1.0, 3.0]])]
    for i, (bags, C) in enumerate(zip(batches, Cs)):
        opt.zero_grad()
        loss = (sok.lookup_sparse(a, csr(bags), combiners="sum") * torch.tensor(C, dtype=torch.float32)).sum()
        if i > 0:
            loss = (
                loss + (sok.lookup_sparse(b, csr(bags), combiners="sum") * torch.tensor(C, dtype=torch.float32)).sum()
            )
        loss.backward()
        opt.step()
    steps_b = [grads(bags, "sum", C, D) for bags, C in zip(batches[1:], Cs[1:])]
    want = lazy_adam(steps_b, D, lr, 0.0, lambda i: i + 2)
    got = rows_of(b)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)
    assert opt.iterations == 3
    # the count is in the state dict; an older state dict (no count) resumes at its tables' largest step
    sd = opt.state_dict()
    assert sd["sok_iterations"] == 3
    fresh = sok.OptimizerWrapper(torch.optim.Adam([a.placeholder, b.placeholder], lr=lr, eps=EPS))
    fresh.load_state_dict(torch.load(io.BytesIO(_saved(sd)), weights_only=False))
    assert fresh.iterations == 3
    old = {k: v for k, v in sd.items() if k != "sok_iterations"}
    old["sok_tables"] = [{**st, "step": n} for st, n in zip(sd["sok_tables"], (3, 2))]
    fresh.load_state_dict(old)
    assert fresh.iterations == 3


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ---- 3. a wrapped torch.optim.Adam is Keras' Adam ----------------------------------------------------
def test_wrapped_adam_moves_every_row_of_a_variable_and_the_touched_rows_of_a_dynamic_variable():
    """Keras' _resource_apply_sparse decays m and v of every row and moves every row of a tf.Variable
    (sok.Variable); SOK's wrapper hands Keras only the touched rows of a DynamicVariable."""
    rng = np.random.default_rng(3)
    V, D, lr = 6, 2, 0.05
    T0 = rng.standard_normal((V, D)).astype(np.float32)
    batches = [
        ([[1, 2], [2]], rng.standard_normal((2, D))),
        ([[4]], rng.standard_normal((1, D))),
        ([[1, 5, 5]], rng.standard_normal((1, D))),
    ]
    var = sok.Variable(T0.copy())
    dyn = sok.DynamicVariable(dimension=D, initializer="0")
    opt = sok.OptimizerWrapper(torch.optim.Adam([var.placeholder, dyn.placeholder], lr=lr, eps=EPS))
    for bags, C in batches:
        opt.zero_grad()
        c = torch.tensor(C, dtype=torch.float32)
        (
            (sok.lookup_sparse(var, csr(bags), combiners="sum") * c).sum()
            + (sok.lookup_sparse(dyn, csr(bags), combiners="sum") * c).sum()
        ).backward()
        opt.step()
    W, m, s = T0.astype(np.float64), np.zeros((V, D)), np.zeros((V, D))
    for t, (bags, C) in enumerate(batches, 1):
        g = np.zeros((V, D))
        for k, gk in grads(bags, "sum", C, D).items():
            g[k] = gk
        m, s = B1 * m + (1 - B1) * g, B2 * s + (1 - B2) * g * g
        W = W - lr * np.sqrt(1 - B2**t) / (1 - B1**t) * m / (np.sqrt(s) + EPS)
    np.testing.assert_allclose(var.weight.numpy(), W, rtol=1e-5, atol=1e-6)
    touched_rule = lazy_adam([grads(b, "sum", C, D) for b, C in batches], D, lr, 0.0, lambda i: i + 1)
    moved = T0[2] + touched_rule[2]  # row 2, touched at step 1 only: moved on by its momentum
    assert np.abs(var.weight.numpy()[2] - moved).max() > 1e-3
    want = lazy_adam([grads(b, "sum", C, D) for b, C in batches], D, lr, 0.0, lambda i: i + 1)
    got = rows_of(dyn)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)
    # torch.optim.SparseAdam keeps the touched-rows rule on a sok.Variable
    lazy = sok.Variable(T0.copy())
    sopt = sok.OptimizerWrapper(torch.optim.SparseAdam([lazy.placeholder], lr=lr, eps=EPS))
    sok.lookup_sparse(lazy, csr([[1]]), combiners="sum").sum().backward()
    sopt.step()
    row1 = lazy.weight.numpy()[1].copy()
    sok.lookup_sparse(lazy, csr([[2]]), combiners="sum").sum().backward()
    sopt.step()
    np.testing.assert_array_equal(lazy.weight.numpy()[1], row1)


# ---- 4. a DynamicVariable inserts new keys in evaluation ---------------------------------------------
def test_a_dynamic_variable_inserts_new_keys_in_evaluation_as_sok_does():
    d = sok.DynamicVariable(dimension=2, initializer="1")
    sok.lookup_sparse(d, csr([[5]]), combiners="sum")
    d.eval()
    out = sok.lookup_sparse(d, csr([[5, 6]]), combiners="mean")
    np.testing.assert_array_equal(out.detach().numpy(), [[1.0, 1.0]])
    assert d.size == 2 and sorted(sok.export(d)[0].tolist()) == [5, 6]
    np.testing.assert_array_equal(sok.all2all_dense_embedding(d, torch.tensor([9])).detach().numpy(), [[1.0, 1.0]])
    assert d.size == 3


# ---- 5. SOK's other entry points ---------------------------------------------------------------------
def test_all2all_dense_embedding_reads_every_key_and_trains_its_rows():
    T0 = np.arange(20, dtype=np.float32).reshape(10, 2)
    v = sok.Variable(T0.copy())
    ids = torch.tensor([[3, 1, 3], [0, 9, 3]])
    out = sok.all2all_dense_embedding(v, ids)
    assert out.shape == (2, 3, 2)
    np.testing.assert_array_equal(out.detach().numpy(), T0[ids.numpy()])
    opt = sok.SGD([v], lr=0.5)  # SOK's optimizers take the variables themselves
    out.sum().backward()
    opt.step()
    want = T0.copy()
    for k, n in {3: 3, 1: 1, 0: 1, 9: 1}.items():
        want[k] -= 0.5 * n
    np.testing.assert_array_equal(v.weight.numpy(), want)
    d = sok.DynamicVariable(dimension=2, initializer="2")
    got = sok.all2all_dense_embedding(d, torch.tensor([2**40, 7, 7]))
    np.testing.assert_array_equal(got.detach().numpy(), np.full((3, 2), 2.0))
    with pytest.raises(TypeError, match="sok.Variable or sok.DynamicVariable"):
        sok.all2all_dense_embedding(torch.nn.Embedding(3, 2), torch.tensor([1]))


def test_filter_variables_and_sok_optimizers_take_sok_variables():
    v = sok.Variable(np.ones((4, 2), np.float32))
    d = sok.DynamicVariable(dimension=2)
    lin = torch.nn.Linear(2, 2)
    tables, other = sok.filter_variables([v, d, lin.weight])
    assert tables == [v, d] and len(other) == 1 and other[0] is lin.weight
    opt = sok.Adam(tables, learning_rate=0.1)
    assert [t for t, _ in opt._tables] == [v.table, d.table]
    sgd = sok.SGD([{"params": [v]}], lr=0.1)
    assert [t for t, _ in sgd._tables] == [v.table]


def test_incremental_model_dump_returns_the_keys_updated_since_a_time():
    d = sok.DynamicVariable(dimension=2, initializer="0", var_type="hybrid")
    opt = sok.SGD([d], lr=1.0)
    sok.lookup_sparse(d, csr([[1, 2]]), combiners="sum").sum().backward()
    opt.step()
    time.sleep(0.01)
    since = datetime.datetime.now(datetime.timezone.utc)
    time.sleep(0.01)
    sok.lookup_sparse(d, csr([[3, 2]]), combiners="sum").sum().backward()
    opt.step()
    keys, values = sok.incremental_model_dump(d, since)
    assert len(keys) == len(values) == 1
    order = np.argsort(keys[0])
    assert keys[0][order].tolist() == [2, 3]
    np.testing.assert_array_equal(values[0][order], [[-2.0, -2.0], [-1.0, -1.0]])
    keys, _ = sok.incremental_model_dump([d], [datetime.datetime.now(datetime.timezone.utc)])
    assert keys[0].size == 0
    with pytest.raises(ValueError, match="hybrid"):
        sok.incremental_model_dump(sok.DynamicVariable(dimension=2, var_type="hbm"), since)


# ---- 6. a plain torch optimizer ----------------------------------------------------------------------
def test_a_table_no_wrapper_holds_says_how_to_wrap_the_optimizer():
    v = sok.Variable(np.ones((4, 2), np.float32))
    opt = torch.optim.SGD([v.placeholder], lr=1.0)
    for step in range(2):
        opt.zero_grad()
        out = sok.lookup_sparse(v, csr([[1]]), combiners="sum")
        if step == 0:
            out.sum().backward()
            opt.step()
        else:
            with pytest.raises(RuntimeError, match="no sok.OptimizerWrapper holds this table.*sok.OptimizerWrapper\\("):
                out.sum().backward()


# ---- several lookups of a table under mpiexec ----------------------------------------------------------
_SHARDED_RUN = r"""
import os, sys
os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
sys.path.insert(0, sys.argv[2])
import numbactr  # noqa: F401  (first: under mpiexec it starts MPI and the rank guard)
import numpy as np
import torch
import numbactr.sok as sok
from numbactr.distributed.sharding import rank_rows

comm = sok.init(seed=1, set_torch_threads=False)
torch.set_num_threads(1)
v = sok.Variable(shape=(30, 3), name="v")
d = sok.DynamicVariable(3, name="d", max_capacity=100)
loc = sok.Variable(shape=(9, 3), mode="localized:0", name="loc")
opt = sok.OptimizerWrapper(torch.optim.Adam([v.placeholder, d.placeholder, loc.placeholder], lr=0.05))
rng = np.random.default_rng(0)
B = 6
r0, r1 = rank_rows(B, comm.rank, comm.size)
for step in range(3):
    ids1, ids2 = rng.integers(0, 30, (B, 2)), rng.integers(0, 30, (B, 3))
    C = torch.from_numpy(rng.standard_normal((B, 3)).astype(np.float32)[r0:r1])
    mine = lambda a: torch.from_numpy(a[r0:r1])  # noqa: E731
    opt.zero_grad()
    a, b = sok.lookup_sparse([v, v], [mine(ids1), mine(ids2)], combiners=["sum", "mean"])
    e = sok.all2all_dense_embedding(v, mine(ids1))
    f, g = sok.lookup_sparse([d, d], [mine(ids1 * 2 ** 33), mine(ids2 * 2 ** 33)], combiners=["mean", "sum"])
    h = sok.lookup_sparse(loc, mine(ids1 % 9), combiners="sum")
    h2 = sok.all2all_dense_embedding(loc, mine(ids2 % 9))
    loss = ((a + b + f + g + h) * C).sum() + (e ** 2).sum() + (h2 ** 2).sum() + ((f * g) ** 2).sum()
    loss.backward()
    opt.step()
out = {}
for name, m in (("v", v), ("d", d), ("loc", loc)):
    k = comm.allgather_rows(np.ascontiguousarray(m.keys().numpy()))
    w = comm.allgather_rows(np.ascontiguousarray(m.weight.numpy()))
    order = np.argsort(k, kind="stable")
    out[name + ":keys"], out[name + ":rows"] = k[order], w[order]
if comm.rank == 0:
    np.savez(sys.argv[1], **out)
"""


@pytest.mark.mpi
def test_several_lookups_of_a_sharded_table_train_as_on_one_rank(tmp_path):
    """mpiexec -n 2: tables looked up several times per step (lookup_sparse([v, v]), all2all_dense_embedding)
    hold one gradient per lookup on their owners and end where the one-rank run ends."""
    import os
    import pathlib
    import subprocess
    import sys

    from tests.mpi_util import HAVE_MPI, MPIEXEC

    if not HAVE_MPI:
        pytest.skip("needs mpiexec and mpi4py")
    script = tmp_path / "run.py"
    script.write_text(_SHARDED_RUN)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    root = str(pathlib.Path(__file__).resolve().parents[1])
    results = {}
    for ranks in (1, 2):
        out = tmp_path / f"r{ranks}.npz"
        r = subprocess.run(
            [MPIEXEC, "-n", str(ranks), sys.executable, str(script), str(out), root],
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, f"mpiexec -n {ranks} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        results[ranks] = dict(np.load(out))
    for name, want in results[1].items():
        if name.endswith(":keys"):
            np.testing.assert_array_equal(results[2][name], want, err_msg=name)
        else:
            np.testing.assert_allclose(results[2][name], want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_sok_variable_classes_comm_tool_and_read_and_evict():
    """SOK's sok.Variable returns a DistributedVariable or a LocalizedVariable by mode (both sok.Variables, with
    SOK's global_shape / target_gpu / num_gpus / global_gpu_id / key_map); the classes take SOK's own
    arguments; set_comm_tool takes SOK's tool; sparse_read_and_evict is a clear NotImplementedError."""
    import numbactr.sok as sok

    sok.init()
    v = sok.Variable(np.arange(15, dtype=np.float32).reshape(5, 3))
    assert type(v) is sok.DistributedVariable and isinstance(v, sok.Variable)
    assert v.target_gpu == -1 and v.global_shape == (5, 3) and v.num_gpus == 1 and v.global_gpu_id == 0
    np.testing.assert_array_equal(v.key_map(np.array([0, 4])), [0, 4])
    loc = sok.Variable(np.ones((4, 2), np.float32), mode="localized:0")
    assert type(loc) is sok.LocalizedVariable and loc.target_gpu == 0
    direct = sok.LocalizedVariable(np.ones((4, 2), np.float32), target_gpu=0, validate_shape=True)
    assert direct.mode == "localized:0"
    dist = sok.DistributedVariable(shape=(6, 2), initializer="random", name="d", global_gpu_id=0, num_gpus=1)
    assert dist.shape == (6, 2)
    with pytest.raises(ValueError, match="num_gpus"):
        sok.DistributedVariable(shape=(6, 2), num_gpus=4)
    with pytest.raises(ValueError, match="target_gpu"):
        sok.LocalizedVariable(np.ones((4, 2), np.float32))
    # SOK's positional order: (initial_value, trainable, collections, validate_shape, caching_device, name, ...)
    named = sok.Variable(np.ones((4, 2), np.float32), False, None, True, None, "pos_name")
    assert named.name == "pos_name" and not named.table.trainable
    with pytest.raises(ValueError, match="collections"):
        sok.Variable(np.ones((4, 2), np.float32), True, "my_table")  # a name where SOK has collections
    with pytest.raises(TypeError):
        sok.DistributedVariable(np.ones((4, 2), np.float32), *([None] * 17))  # more than SOK's arguments
    sok.set_comm_tool("horovod")
    with pytest.raises(ValueError, match="tool"):
        sok.set_comm_tool("nccl")
    with pytest.raises(TypeError, match="var_type 'hybrid'"):  # a static table never evicts
        sok.sparse_read_and_evict(v, torch.tensor([1]))
    # the subclasses train like any sok.Variable
    opt = sok.OptimizerWrapper(torch.optim.SGD(list(loc.parameters()), lr=0.5))
    out = sok.lookup_sparse(loc, torch.tensor([[1, 2]]).to_sparse(), combiners="sum")
    out.sum().backward()
    opt.step()
    assert not np.allclose(loc.table.weights()[1], 1.0)
