"""SOK's DynamicVariable(var_type="hybrid") evicts (numbactr/sok/hybrid.py): a stream of ten times more
distinct keys than max_capacity trains without error and keeps at most max_capacity keys; an evicted key's
row and optimizer state are reset for the key taking its slot; sok.sparse_read_and_evict returns what an
insertion evicted; incremental_model_dump dumps only held keys; the low-frequency filter admits new keys
with filter_ratio, deterministically; the initializers; the same stream on the sim device's kernels."""

import datetime

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from numbactr.runtime import device  # noqa: E402

import numbactr.sok as sok  # noqa: E402
from numbactr.sok.hybrid import initial_rows  # noqa: E402


@pytest.fixture(autouse=True)
def _cpu():
    old = device.kind()
    device.set_device("cpu")
    sok.init(seed=0, set_torch_threads=False)
    yield
    device.set_device(old)


def _now():
    return datetime.datetime.now(datetime.timezone.utc)


def _stream(d, opt, steps: int, per_step: int, start: int = 0, check=None):
    """Train d on fresh keys: step s looks up keys start + s*per_step ... (bags of 4, 'sum'), loss sum(out^2)."""
    for s in range(steps):
        ids = torch.arange(start + s * per_step, start + (s + 1) * per_step).reshape(-1, 4)
        out = sok.lookup_sparse(d, ids, combiners="sum")
        loss = out.pow(2).sum()
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if check is not None:
            check(s)


def test_a_stream_of_ten_times_the_capacity_trains_evicts_and_dumps():
    d = sok.DynamicVariable(4, name="stream", max_capacity=256, init_capacity=64, max_bucket_size=32)
    assert d.backend_type == "hybrid" and d.table.index.max_capacity() == 256
    opt = sok.OptimizerWrapper(torch.optim.Adam([d.placeholder], lr=0.01))
    sizes = []
    _stream(d, opt, 20, 128, check=lambda s: sizes.append(d.size))  # 2560 distinct keys
    assert max(sizes) <= 256 and sizes[-1] > 128  # grew (64 -> 256 slots), then evicted
    held = set(sok.export(d)[0].tolist())
    assert held and held <= set(range(2560)) and max(held) == 2559  # the newest keys stay (kLru)
    before = dict(zip(*(t.numpy().tolist() for t in sok.export(d))))
    since = _now()
    emb, ev_keys, ev_values = sok.sparse_read_and_evict(d, torch.arange(10_000, 10_128).reshape(2, 64))
    assert emb.shape == (2, 64, 4) and ev_keys.shape[0] == ev_values.shape[0] > 0 and d.size <= 256
    now_held = set(sok.export(d)[0].tolist())
    for k, v in zip(ev_keys.tolist(), ev_values.numpy()):
        assert k not in now_held and np.allclose(v, before[k])  # gone, with its trained row
    np.testing.assert_allclose(
        emb.reshape(-1, 4).numpy(), initial_rows(np.arange(10_000, 10_128), 4, d.table.seed, ("normal",))
    )
    keys, values = sok.incremental_model_dump(d, since)
    assert set(keys[0].tolist()) == set(range(10_000, 10_128)) & now_held  # evicted keys are not dumped
    got = dict(zip(sok.export(d)[0].tolist(), sok.export(d)[1].numpy()))
    for k, v in zip(keys[0].tolist(), values[0]):
        np.testing.assert_array_equal(v, got[k])


def test_an_evicted_keys_row_and_optimizer_state_are_reset_for_the_next_key():
    d = sok.DynamicVariable(2, initializer="0.5", max_capacity=4)  # one bucket of 4 slots
    opt = sok.OptimizerWrapper(torch.optim.Adagrad([d.placeholder], lr=0.1, initial_accumulator_value=0.25))
    for keys in ([1, 2], [3, 4], [2, 3, 4]):  # key 1 is the least recently used
        sok.lookup_sparse(d, torch.tensor([keys]), combiners="sum").sum().backward()
        opt.step()
    accum = dict(zip(d.table.optimizer_state()["keys"].tolist(), d.table.optimizer_state()["states"]["accum"]))
    assert accum[1][0] > 0.25  # key 1 learned something
    out = sok.lookup_sparse(d, torch.tensor([[9]]), combiners="sum")  # evicts key 1
    np.testing.assert_array_equal(out.detach().numpy(), [[0.5, 0.5]])  # 9's initial row, not 1's
    st = d.table.optimizer_state()
    assert sorted(st["keys"].tolist()) == [2, 3, 4, 9]
    nine = st["keys"].tolist().index(9)
    np.testing.assert_array_equal(st["states"]["accum"][nine], [0.25, 0.25])  # not key 1's accumulator


def test_held_gradients_follow_their_keys_when_a_later_lookup_evicts_or_grows():
    d = sok.DynamicVariable(1, initializer="0", max_capacity=4, init_capacity=2, max_bucket_size=2)
    opt = sok.SGD([d], lr=1.0)
    a = sok.lookup_sparse(d, torch.tensor([[1, 2]]), combiners="sum")  # 1 and 2 held
    b = sok.lookup_sparse(d, torch.tensor([[3, 4, 5, 6, 7, 8]]), combiners="sum")  # grows, then evicts
    (a.sum() + 2 * b.sum()).backward()
    opt.step()
    got = dict(zip(sok.export(d)[0].tolist(), sok.export(d)[1][:, 0].tolist()))
    assert len(got) <= 4
    for k, v in got.items():
        assert v == (-1.0 if k in (1, 2) else -2.0)  # each update reached its own key, never another's


def test_the_low_frequency_filter_admits_new_keys_with_filter_ratio():
    def run():
        sok.init(seed=3, set_torch_threads=False)
        d = sok.DynamicVariable(2, initializer="1", filter_ratio=0.5)
        outs = [
            sok.lookup_sparse(
                d, torch.arange(s * 400, s * 400 + 400).reshape(100, 4), combiners="sum", use_low_frequency_filter=True
            )
            for s in range(3)
        ]
        return d, outs

    d, outs = run()
    assert 450 < d.size < 750  # about half of 1200 new keys
    held = set(sok.export(d)[0].tolist())
    for s, out in enumerate(outs):  # a refused key adds zero: a bag sums its admitted keys' rows
        admitted = np.isin(np.arange(s * 400, s * 400 + 400), list(held)).reshape(100, 4).sum(1)
        np.testing.assert_array_equal(out.detach().numpy()[:, 0], admitted.astype(np.float32))
    d2, outs2 = run()
    assert held == set(sok.export(d2)[0].tolist())  # deterministic
    shut = sok.DynamicVariable(2, initializer="1", filter_ratio=0.0)
    sok.lookup_sparse(shut, torch.tensor([[7]]))  # without the filter: inserted
    out = sok.lookup_sparse(shut, torch.tensor([[7, 8]]), combiners="mean", use_low_frequency_filter=True)
    np.testing.assert_array_equal(out.detach().numpy(), [[0.5, 0.5]])  # 7 found, 8 refused (counted in the mean)
    assert shut.size == 1
    with pytest.raises(ValueError, match="use_low_frequency_filter needs"):
        sok.lookup_sparse(sok.DynamicVariable(2, var_type="hbm"), torch.tensor([[1]]), use_low_frequency_filter=True)


def test_initializers_and_strategies():
    keys = torch.arange(4000).reshape(1000, 4)
    normal = sok.DynamicVariable(8)  # SOK's hybrid default: N(0, 1)
    sok.all2all_dense_embedding(normal, keys)
    w = sok.export(normal)[1].numpy()
    assert abs(w.mean()) < 0.03 and abs(w.std() - 1.0) < 0.03
    uniform = sok.DynamicVariable(8, initializer="uniform")
    w = sok.all2all_dense_embedding(uniform, keys).detach().numpy()
    assert w.min() >= -1 and w.max() <= 1 and w.std() > 0.5
    for strategy in ("kLru", "kLfu", "kEpochLru", "kEpochLfu"):
        d = sok.DynamicVariable(2, max_capacity=32, evict_strategy=strategy)
        _stream(d, sok.SGD([d], lr=0.1), 4, 64)
        assert d.size <= 32
    with pytest.raises(ValueError, match="evict_strategy"):
        sok.DynamicVariable(2, evict_strategy="kFifo")
    with pytest.raises(ValueError, match="filter_ratio"):
        sok.DynamicVariable(2, filter_ratio=1.5)


def test_a_checkpoint_and_sok_files_round_trip_through_a_hybrid_table(tmp_path):
    d = sok.DynamicVariable(3, name="h", max_capacity=64, max_bucket_size=16)
    opt = sok.OptimizerWrapper(torch.optim.Adam([d.placeholder], lr=0.05))
    _stream(d, opt, 6, 32)
    sok.dump(str(tmp_path), [d], opt)
    keys, rows = (t.numpy() for t in sok.export(d))
    m = opt.state_dict()["sok_tables"][0]["states"]["m"].numpy()
    sok.init(seed=0, set_torch_threads=False)
    e = sok.DynamicVariable(3, name="h", max_capacity=64, max_bucket_size=16)
    opt2 = sok.OptimizerWrapper(torch.optim.Adam([e.placeholder], lr=0.05))
    sok.load(str(tmp_path), [e], opt2)
    k2, r2 = (t.numpy() for t in sok.export(e))
    o, o2 = np.argsort(keys), np.argsort(k2)
    np.testing.assert_array_equal(k2[o2], keys[o])
    np.testing.assert_array_equal(r2[o2], rows[o])
    m2 = opt2.state_dict()["sok_tables"][0]["states"]["m"].numpy()
    np.testing.assert_array_equal(m2[o2], m[o])


def test_the_simulators_kernels_evict_as_the_cpu_path():
    got = {}
    for kind in ("cpu", "sim"):
        device.set_device(kind)
        sok.init(seed=1, set_torch_threads=False)
        d = sok.DynamicVariable(2, max_capacity=8, max_bucket_size=4, init_capacity=4)
        opt = sok.OptimizerWrapper(torch.optim.Adam([d.placeholder], lr=0.1))
        _stream(d, opt, 3, 8)
        keys, rows = (t.numpy() for t in sok.export(d))
        got[kind] = (keys[np.argsort(keys)], rows[np.argsort(keys)])
    np.testing.assert_array_equal(got["sim"][0], got["cpu"][0])
    np.testing.assert_allclose(got["sim"][1], got["cpu"][1], rtol=1e-5, atol=1e-6)
