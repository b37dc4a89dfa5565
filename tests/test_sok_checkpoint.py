"""numbactr.sok checkpoints with PyTorch's own calls: a model's state_dict() holds its SOK tables' rows and the
OptimizerWrapper's state_dict() their optimizer states, so torch.save / torch.load of both, in a fresh model
and optimizer, resumes training exactly where it stopped (the same losses and rows as training on without a
break); bad checkpoints are clear errors that change nothing. Two ranks: tests/test_sok_mpi.py."""

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from numbactr.runtime import device  # noqa: E402

import numbactr.sok as sok  # noqa: E402

F = torch.nn.functional
B, S, NNZ, D = 8, 3, 2, 4


@pytest.fixture(autouse=True)
def _cpu():
    old = device.kind()
    device.set_device("cpu")
    yield
    device.set_device(old)


class Net(torch.nn.Module):
    """A click model around one SOK table (each kind of table a SOK user builds)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "all2all_keyed":
            self.emb = sok.All2AllDenseEmbedding(64, D, S, NNZ, use_hashtable=True)
        elif kind == "all2all_rows":
            self.emb = sok.All2AllDenseEmbedding(64, D, S, NNZ, use_hashtable=False)
        elif kind == "distributed":
            self.emb = sok.DistributedEmbedding("sum", 64, D, S, NNZ)
        elif kind == "variable":
            self.emb = sok.Variable(shape=[64, D])
        else:
            self.emb = sok.DynamicVariable(dimension=D)
        self.top = torch.nn.Linear(S * D, 1)

    def forward(self, ids):
        if self.kind.startswith("all2all"):
            x = self.emb(ids).sum(2)
        elif self.kind == "distributed":
            x = self.emb(ids)
        else:
            flat = ids.reshape(B * S, NNZ)
            x = sok.lookup_sparse(self.emb, flat, combiners="sum")
        return self.top(x.reshape(B, S * D)).squeeze(1)


def make(kind: str, opt: str):
    sok.init(seed=3, set_torch_threads=False)  # a fresh process: tables created in the same order
    torch.manual_seed(0)
    net = Net(kind)
    tables, dense = sok.filter_variables(net)
    if opt == "sok_adam":
        return net, [sok.optimizers.Adam(tables, learning_rate=0.05), torch.optim.SGD(dense, lr=0.1)]
    make_opt = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.2),
        "adam": lambda p: torch.optim.Adam(p, lr=0.05),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    }[opt]
    return net, [sok.OptimizerWrapper(make_opt(net.parameters()))]


def batches(n: int, seed: int = 5):
    rng = np.random.default_rng(seed)
    return [
        (torch.from_numpy(rng.integers(0, 64, (B, S, NNZ))), torch.from_numpy(rng.integers(0, 2, B)).float())
        for _ in range(n)
    ]


def train(net, opts, data) -> list:
    losses = []
    for ids, y in data:
        loss = F.binary_cross_entropy_with_logits(net(ids), y)
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    return losses


def save(net, opts) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": net.state_dict(), "opts": [o.state_dict() for o in opts]}, buf)
    return buf.getvalue()


def load(blob: bytes, net, opts) -> None:
    ck = torch.load(io.BytesIO(blob), weights_only=False)
    net.load_state_dict(ck["model"])
    for o, sd in zip(opts, ck["opts"]):
        o.load_state_dict(sd)


def rows(net) -> dict:
    keys, values = sok.export(net.emb)
    return dict(zip(keys.tolist(), values.numpy()))


@pytest.mark.parametrize("kind", ["all2all_keyed", "all2all_rows", "distributed", "variable", "dynamic"])
@pytest.mark.parametrize("opt", ["sgd", "adam", "adagrad", "sok_adam"])
def test_torch_save_and_load_resume_training_exactly(kind, opt):
    data = batches(6)
    net, opts = make(kind, opt)
    train(net, opts, data[:3])
    blob = save(net, opts)
    want_losses = train(net, opts, data[3:])
    want_rows = rows(net)

    net2, opts2 = make(kind, opt)  # a fresh model: other rows until the load
    load(blob, net2, opts2)
    assert train(net2, opts2, data[3:]) == want_losses
    got_rows = rows(net2)
    assert got_rows.keys() == want_rows.keys()
    for k, v in want_rows.items():
        np.testing.assert_array_equal(got_rows[k], v)


def test_state_dict_holds_the_rows_and_the_optimizer_states():
    net, opts = make("dynamic", "adam")
    train(net, opts, batches(2))
    sd = net.state_dict()
    keys, values = sok.export(net.emb)
    assert set(sd) == {"emb.placeholder", "emb.keys", "emb.values", "top.weight", "top.bias"}
    np.testing.assert_array_equal(sd["emb.keys"].numpy(), keys.numpy())
    np.testing.assert_array_equal(sd["emb.values"].numpy(), values.numpy())
    st = opts[0].state_dict()["sok_tables"]
    assert len(st) == 1 and st[0]["optimizer"] == "HUGECTR_ADAM" and st[0]["step"] == 2
    assert {k: tuple(v.shape) for k, v in st[0]["states"].items()} == {"m": (len(keys), D), "v": (len(keys), D)}
    np.testing.assert_array_equal(st[0]["keys"].numpy(), keys.numpy())
    assert np.abs(st[0]["states"]["m"].numpy()).sum() > 0


def test_loading_without_the_optimizer_restarts_its_states_but_keeps_the_rows():
    """Only the model's state_dict: rows come back; a keyed table's optimizer states start from zero for
    keys it did not hold (here: a fresh table holds none)."""
    net, opts = make("all2all_keyed", "adam")
    train(net, opts, batches(2))
    want = rows(net)
    net2, opts2 = make("all2all_keyed", "adam")
    net2.load_state_dict(net.state_dict())
    assert rows(net2).keys() == want.keys()
    st = opts2[0].state_dict()["sok_tables"][0]
    assert st["step"] == 0 and not np.abs(st["states"]["m"].numpy()).any()


def test_bad_checkpoints_are_clear_errors_that_change_nothing():
    net, opts = make("variable", "adam")
    train(net, opts, batches(1))
    sd = net.state_dict()
    before = rows(net)

    bad = dict(sd)
    bad["emb.keys"] = sd["emb.keys"][:-1]
    bad["emb.values"] = sd["emb.values"][:-1]
    with pytest.raises(RuntimeError, match="holds 63 rows; this rank holds 64 rows"):
        net.load_state_dict(bad)
    bad = dict(sd)
    bad["emb.values"] = sd["emb.values"][:, :2]
    with pytest.raises(RuntimeError, match=r"values must be \(64, 4\)"):
        net.load_state_dict(bad)
    bad = dict(sd)
    del bad["emb.values"]
    with pytest.raises(RuntimeError, match="Missing key.*emb.values"):
        net.load_state_dict(bad)
    for k, v in before.items():
        np.testing.assert_array_equal(rows(net)[k], v)

    dyn, dopts = make("dynamic", "sgd")
    train(dyn, dopts, batches(1))
    dsd = dyn.state_dict()
    dup = dict(dsd)
    dup["emb.keys"] = torch.cat([dsd["emb.keys"][:1], dsd["emb.keys"][:-1]])
    with pytest.raises(RuntimeError, match="appears twice"):
        dyn.load_state_dict(dup)
    neg = dict(dsd)
    neg["emb.keys"] = dsd["emb.keys"].clone()
    neg["emb.keys"][0] = -1
    with pytest.raises(RuntimeError, match="reserved"):
        dyn.load_state_dict(neg)

    osd = opts[0].state_dict()
    with pytest.raises(ValueError, match="the state has 0 SOK table"):
        opts[0].load_state_dict({**osd, "sok_tables": []})
    wrong = {**osd, "sok_tables": [{**osd["sok_tables"][0], "optimizer": "EXACT_SGD"}]}
    with pytest.raises(ValueError, match="optimizer is EXACT_SGD, this table's is HUGECTR_ADAM"):
        opts[0].load_state_dict(wrong)
    short = {
        **osd,
        "sok_tables": [
            {
                **osd["sok_tables"][0],
                "states": {**osd["sok_tables"][0]["states"], "v": osd["sok_tables"][0]["states"]["v"][:, :1]},
            }
        ],
    }
    step_before = net.emb.table.engine.step
    with pytest.raises(ValueError, match="optimizer state v must be"):
        opts[0].load_state_dict(short)
    assert net.emb.table.engine.step == step_before
