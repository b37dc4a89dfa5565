"""sok.dump / sok.load in SOK's weight files: the files are SOK's byte for byte (written here from SOK's
layout by hand: 296-byte heads, <name>-key / -weight / -<Optimizer>-<slot>), files written that way load, a
dump loads back into a fresh model with the same rows and optimizer states (training then goes on as
without the break for SGD and Adagrad), and bad folders are clear errors that change nothing. Two ranks:
tests/test_sok_mpi.py."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from numbactr.runtime import device  # noqa: E402

import numbactr.sok as sok  # noqa: E402

F = torch.nn.functional
B, D = 6, 4


@pytest.fixture(autouse=True)
def _cpu():
    old = device.kind()
    device.set_device("cpu")
    yield
    device.set_device(old)


def sok_head(kind: int, slot: str, dtype_index: int) -> bytes:
    """SOK's file head, spelled out: 256 spaces (SOK leaves the table name blank), the kind (big-endian
    uint32), the slot name right-justified in 32 bytes, the data type index (big-endian uint32)."""
    return b" " * 256 + kind.to_bytes(4, "big") + slot.rjust(32).encode() + dtype_index.to_bytes(4, "big")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.var = sok.Variable(shape=[20, D], name="user/item:0")  # SOK's file name: user_item_0
        self.dyn = sok.DynamicVariable(dimension=D, name="dyn")
        self.loc = sok.Variable(shape=[7, D], mode="localized:0", name="loc")
        self.top = torch.nn.Linear(3 * D, 1)

    def forward(self, ids):
        parts = sok.lookup_sparse(
            [self.var, self.dyn, self.loc],
            [ids[:, :2] % 20, ids[:, 2:] * 1000, ids[:, :1] % 7],
            combiners=["sum", "mean", "sum"],
        )
        return self.top(torch.cat(parts, 1)).squeeze(1)


def make(opt: str):
    sok.init(seed=4, set_torch_threads=False)
    torch.manual_seed(0)
    net = Net()
    tables, dense = sok.filter_variables(net)
    rule = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.3),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.2),
        "adam": lambda p: torch.optim.Adam(p, lr=0.05),
    }[opt]
    return net, sok.OptimizerWrapper(rule(tables)), torch.optim.SGD(dense, lr=0.1)


def batches(n, seed=2):
    rng = np.random.default_rng(seed)
    return [
        (torch.from_numpy(rng.integers(0, 30, (B, 4))), torch.from_numpy(rng.integers(0, 2, B)).float())
        for _ in range(n)
    ]


def train(net, opts, data):
    losses = []
    for ids, y in data:
        loss = F.binary_cross_entropy_with_logits(net(ids), y)
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    return losses


def table_rows(m) -> dict:
    keys, values = sok.export(m)
    return dict(zip(keys.tolist(), values.numpy()))


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "adam"])
def test_dump_then_load_gives_the_rows_and_states_back(tmp_path, opt):
    data = batches(6)
    net, wrap, dense = make(opt)
    train(net, [wrap, dense], data[:3])
    tables = [net.var, net.dyn, net.loc]
    sok.dump(str(tmp_path), tables, wrap)
    slots = {"sgd": [], "adagrad": ["accumulator"], "adam": ["m", "v"]}[opt]
    name = {"sgd": "SGD", "adagrad": "Adagrad", "adam": "Adam"}[opt]
    assert sorted(os.listdir(tmp_path)) == sorted(
        f"{base}-{what}"
        for base in ("user_item_0", "dyn", "loc")
        for what in ["key", "weight"] + [f"{name}-{s}" for s in slots]
    )
    dense_state = dense.state_dict()
    top = {k: v.clone() for k, v in net.top.state_dict().items()}
    want_states = [m.table.optimizer_state() for m in tables]
    want_losses = train(net, [wrap, dense], data[3:])
    want_rows = [table_rows(m) for m in tables]

    net2, wrap2, dense2 = make(opt)
    net2.top.load_state_dict(top)
    dense2.load_state_dict(dense_state)
    sok.load(str(tmp_path), [net2.var, net2.dyn, net2.loc], wrap2)
    for m, want in zip([net2.var, net2.dyn, net2.loc], want_states):
        got = m.table.optimizer_state()
        assert sorted(got["keys"].tolist()) == sorted(want["keys"].tolist())
        assert (
            sorted(got["states"])
            == sorted(want["states"])
            == sorted({"sgd": [], "adagrad": ["accum"], "adam": ["m", "v"]}[opt])
        )
        for k, v in want["states"].items():  # each key's state, whatever row it landed in
            np.testing.assert_array_equal(got["states"][k][np.argsort(got["keys"])], v[np.argsort(want["keys"])])
    losses = train(net2, [wrap2, dense2], data[3:])
    if opt != "adam":  # Adam's step count is not in SOK's files (it restarts at 0)
        assert losses == want_losses
        for m, want in zip([net2.var, net2.dyn, net2.loc], want_rows):
            got = table_rows(m)
            assert got.keys() == want.keys()
            for k in want:
                np.testing.assert_array_equal(got[k], want[k])


def test_the_files_are_soks_byte_for_byte(tmp_path):
    net, wrap, dense = make("adam")
    train(net, [wrap, dense], batches(2))
    sok.dump(str(tmp_path), [net.var, net.dyn, net.loc], wrap)
    keys, values = sok.export(net.dyn)
    order = np.argsort(keys.numpy())
    raw = (tmp_path / "dyn-key").read_bytes()
    assert raw == sok_head(0, "", 1) + keys.numpy()[order].astype(np.int64).tobytes()
    assert (tmp_path / "dyn-weight").read_bytes() == sok_head(1, "", 5) + values.numpy()[order].tobytes()
    m = net.dyn.table.optimizer_state()
    assert (tmp_path / "dyn-Adam-v").read_bytes() == sok_head(2, "v", 5) + m["states"]["v"][order].tobytes()
    # a distributed Variable: int64 global rows; a localized one: uint64 rows 0..V-1
    assert (tmp_path / "user_item_0-key").read_bytes() == sok_head(0, "", 1) + np.arange(20, dtype=np.int64).tobytes()
    assert (tmp_path / "loc-key").read_bytes() == sok_head(0, "", 3) + np.arange(7, dtype=np.uint64).tobytes()
    assert (tmp_path / "loc-weight").read_bytes() == sok_head(1, "", 5) + net.loc.weight.detach().numpy().tobytes()


def test_files_written_the_soks_way_load(tmp_path):
    """A folder written by hand as SOK writes it (keys in any order, an int32 key file) loads."""
    rng = np.random.default_rng(3)
    keys = np.array([7000, 3, 2**40, 12], np.int64)
    vals = rng.standard_normal((4, D)).astype(np.float32)
    (tmp_path / "dyn-key").write_bytes(sok_head(0, "", 1) + keys.tobytes())
    (tmp_path / "dyn-weight").write_bytes(sok_head(1, "", 5) + vals.tobytes())
    rows = rng.standard_normal((20, D)).astype(np.float32)
    perm = rng.permutation(20)
    (tmp_path / "user_item_0-key").write_bytes(sok_head(0, "", 0) + perm.astype(np.int32).tobytes())
    (tmp_path / "user_item_0-weight").write_bytes(sok_head(1, "", 5) + rows[perm].tobytes())
    net, _, _ = make("sgd")
    sok.load(str(tmp_path), [net.dyn, net.var])
    got = table_rows(net.dyn)
    assert sorted(got) == sorted(keys.tolist())
    for k, v in zip(keys.tolist(), vals):
        np.testing.assert_array_equal(got[k], v)
    np.testing.assert_array_equal(net.var.weight.detach().numpy(), rows)


def test_bad_folders_are_clear_errors_that_change_nothing(tmp_path):
    net, wrap, dense = make("adagrad")
    train(net, [wrap, dense], batches(1))
    sok.dump(str(tmp_path), [net.var, net.dyn], wrap)
    before = [table_rows(net.var), table_rows(net.dyn)]
    with pytest.raises(ValueError, match="loc-key does not exist"):
        sok.load(str(tmp_path), [net.var, net.loc])
    good = (tmp_path / "dyn-weight").read_bytes()
    (tmp_path / "dyn-weight").write_bytes(good[:-4])
    with pytest.raises(ValueError, match="dyn-weight holds .* values for .* keys"):
        sok.load(str(tmp_path), [net.var, net.dyn])
    (tmp_path / "dyn-weight").write_bytes(good[:100])
    with pytest.raises(ValueError, match="less than SOK's 296-byte head"):
        sok.load(str(tmp_path), [net.dyn])
    (tmp_path / "dyn-weight").write_bytes(sok_head(0, "", 5) + good[296:])
    with pytest.raises(ValueError, match="is a key file, expected a weight file"):
        sok.load(str(tmp_path), [net.dyn])
    (tmp_path / "dyn-weight").write_bytes(good)
    state = tmp_path / "user_item_0-Adagrad-accumulator"
    state.unlink()
    with pytest.raises(ValueError, match="user_item_0-Adagrad-accumulator does not exist"):
        sok.load(str(tmp_path), [net.dyn, net.var], wrap)
    for m, want in zip([net.var, net.dyn], before):
        got = table_rows(m)
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    other = sok.Variable(shape=[20, D], name="other")
    with pytest.raises(ValueError, match="does not train 'other'"):
        sok.dump(str(tmp_path), [other], wrap)
    with pytest.raises(ValueError, match="share the files"):
        sok.dump(str(tmp_path), [net.var, sok.Variable(shape=[5, D], name="user_item_0")])
    with pytest.raises(TypeError, match="not a numbactr.sok variable"):
        sok.dump(str(tmp_path), [torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="'empty' holds no key yet"):
        sok.dump(str(tmp_path / "new"), [sok.DynamicVariable(dimension=D, name="empty")])
    assert not (tmp_path / "new").exists()  # nothing written
