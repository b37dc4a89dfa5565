"""HugeCTR's SparseEmbedding with numbactr's max_capacity (numbactr/embedding/sparse_evicting.py): below the
capacity it trains bit for bit as the fixed hash table; a stream of ten times the capacity trains without
error and keeps at most max_capacity keys; an evicted key's row and optimizer state do not reach the next
key; a lower tier keeps evicted rows and gives them back; incremental dumps report evicted keys; snapshots
round-trip; bad options are clear errors."""

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.autograd import Tape
from numbactr.embedding.factory import make_embedding
from numbactr.embedding.sparse_evicting import EvictingHashEmbedding
from numbactr.inference.backends import HashMapBackend
from numbactr.runtime import device

E, O, U = hugectr.Embedding_t, hugectr.Optimizer_t, hugectr.Update_t
S, D, B = 2, 4, 8

pytestmark = pytest.mark.usefixtures("cpu")  # conftest.py: the cpu device for every test


def embedding(etype=E.DistributedSlotSparseEmbeddingHash, opt=O.Adam, **kw):
    cfg = hugectr.SparseEmbedding(etype, 1, D, "sum", "e", "data", **kw)
    return make_embedding(
        cfg,
        hugectr.DataReaderSparseParam("data", 2, False, S),
        hugectr.CreateOptimizer(optimizer_type=opt, update_type=U.Local),
        seed=3,
    )


def batch(first: int, n: int = B * S):
    """B*S one-key bags of fresh keys first.. (a few repeats of the batch's first key)."""
    keys = (np.arange(first, first + n, dtype=np.int64) * 7919 + 11) % (1 << 40)
    keys[::5] = keys[0]
    return keys, np.arange(n + 1, dtype=np.int64)


def step(emb, keys, offsets, rng, training=True):
    tape = Tape()
    out = emb.forward(tape, keys, offsets, B, training=training)
    if training:
        tape.backward({id(out): (out, rng.normal(size=out.data.shape).astype(np.float32))})
        emb.update(0.05, 1.0)
    return np.array(device.to_host(out.data))


def test_below_its_capacity_it_trains_as_the_fixed_table():
    fixed, evict = embedding(), embedding(max_capacity=4096, max_bucket_size=64)
    assert isinstance(evict, EvictingHashEmbedding) and not isinstance(fixed, EvictingHashEmbedding)
    r1, r2 = np.random.default_rng(0), np.random.default_rng(0)
    for s in range(5):
        keys, off = batch(s * 8)  # overlapping batches: found keys and new ones
        np.testing.assert_array_equal(step(fixed, keys, off, r1, s != 3), step(evict, keys, off, r2, s != 3))
    kf, vf = fixed.dump()
    ke, ve = evict.dump()
    of, oe = np.argsort(kf), np.argsort(ke)
    np.testing.assert_array_equal(kf[of], ke[oe])
    np.testing.assert_array_equal(vf[of], ve[oe])
    sf = fixed.dump_states()
    for a, b in zip(sf, evict.dump_states()):
        np.testing.assert_array_equal(a[: kf.size][of], b[oe])


@pytest.mark.parametrize("strategy", ["kLru", "kLfu", "kEpochLru", "kEpochLfu"])
def test_a_stream_of_ten_times_the_capacity_trains_and_keeps_at_most_the_capacity(strategy):
    emb = embedding(max_capacity=64, max_bucket_size=16, evict_strategy=strategy)
    rng = np.random.default_rng(2)
    for s in range(40):  # 640 distinct keys through a table of 64
        out = step(emb, *batch(s * B * S), rng)
        assert np.isfinite(out).all() and emb.size() <= 64
    keys, rows = emb.dump()
    assert 32 < keys.size <= 64 and emb.index.capacity() == 64
    if strategy == "kLru":  # the last batch's keys are held
        assert np.isin(batch(39 * B * S)[0], keys.view(np.int64)).all()
    # evaluation finds without inserting: a held key reads its row, a missing key zeros
    probe = np.array([keys.view(np.int64)[0], 5], np.int64)
    out = step(emb, np.repeat(probe, B), np.arange(2 * B + 1, dtype=np.int64), rng, training=False)
    np.testing.assert_allclose(out[0, 0], rows[0], rtol=1e-6)
    np.testing.assert_array_equal(out[B // 2, 1], np.zeros(D))
    assert emb.size() == keys.size


def test_an_evicted_keys_row_and_state_do_not_reach_the_next_key():
    emb = embedding(max_capacity=16, max_bucket_size=16)  # one bucket: the 17th key evicts the oldest
    rng = np.random.default_rng(5)
    for s in range(2):
        step(emb, *batch(s * 16), rng)  # 16 keys, trained twice
    states = emb.engine.split_optimizer_states()[0]
    assert all(np.abs(v).max() > 0 for v in states[:2])  # Adam's m and v moved
    newcomer = np.full(B * S, 999_983, np.int64)
    tape = Tape()
    emb.forward(tape, newcomer, np.arange(B * S + 1, dtype=np.int64), B, training=True)  # no update
    slot = int(emb.rows_of(np.array([999_983], np.uint64))[0])
    assert slot >= 0 and emb.size() == 16
    from numbactr.kernels import embedding_init

    fresh = embedding_init.row_values_ref(np.array([999_983], np.uint64), D, 3, -0.05, 0.05)[0]
    np.testing.assert_array_equal(np.array(device.to_host(emb.weight.data[slot])), fresh)
    for v in emb.engine.split_optimizer_states()[0][:2]:
        np.testing.assert_array_equal(np.array(device.to_host(v[slot])), 0.0)


def test_a_lower_tier_keeps_evicted_rows_and_gives_them_back():
    tier = HashMapBackend()
    emb = embedding(max_capacity=16, max_bucket_size=16, evict_to=tier)
    rng = np.random.default_rng(6)
    first, off = batch(0)
    step(emb, first, off, rng)
    k0, v0 = emb.dump()
    step(emb, *batch(100), rng)  # 13 new keys push most of the first ones out
    gone = k0[~np.isin(k0, emb.dump()[0])]
    assert gone.size and tier.size("e") == gone.size
    vals, found = tier.fetch("e", gone, D)
    assert found.all()
    by_key = dict(zip(k0.tolist(), v0))
    np.testing.assert_array_equal(vals, np.stack([by_key[k] for k in gone.tolist()]))
    # the key comes back: it reads the row it left with, and the tier no longer holds it
    back = np.full(B * S, int(gone[0]), np.int64)
    out = step(emb, back, np.arange(B * S + 1, dtype=np.int64), rng, training=False)
    np.testing.assert_array_equal(out[0, 0], np.zeros(D))  # evaluation does not insert
    tape = Tape()
    out = emb.forward(tape, back, np.arange(B * S + 1, dtype=np.int64), B, training=True)
    np.testing.assert_array_equal(np.array(device.to_host(out.data))[0, 0], by_key[int(gone[0])])
    assert not tier.fetch("e", gone[:1], D)[1][0]


def test_incremental_dumps_carry_updated_and_evicted_keys():
    emb = embedding(max_capacity=16, max_bucket_size=16)
    rng = np.random.default_rng(7)
    step(emb, *batch(0), rng)
    keys, rows, evicted = emb.incremental_dump()
    held, vecs = emb.dump()
    assert set(keys.tolist()) == set(held.tolist()) and evicted.size == 0
    assert emb.incremental_dump()[0].size == 0  # nothing changed since
    step(emb, *batch(100), rng)
    keys, rows, evicted = emb.incremental_dump()
    now = emb.dump()[0]
    assert set(evicted.tolist()) == set(held.tolist()) - set(now.tolist()) and evicted.size
    assert not np.isin(evicted, now).any() and np.isin(keys, now).all()
    by_key = dict(zip(*emb.dump()))
    for k, r in zip(keys.tolist(), rows):
        np.testing.assert_array_equal(r, by_key[k])


def test_snapshots_round_trip_with_states_and_slot_ids():
    emb = embedding(E.LocalizedSlotSparseEmbeddingHash, max_capacity=32, max_bucket_size=8)
    rng = np.random.default_rng(8)
    for s in range(4):
        step(emb, *batch(s * 16), rng)
    keys, rows = emb.dump()
    slots, states = emb.dump_slots(), emb.dump_states()
    assert ((slots == 0) | (slots == 1)).all()
    fresh = embedding(E.LocalizedSlotSparseEmbeddingHash, max_capacity=32, max_bucket_size=8)
    fresh.load(keys, rows, slots.astype(np.int64))
    at = fresh.rows_of(keys)
    for st, view in zip(states, fresh.states):
        view[at] = st
    k2, r2 = fresh.dump()
    o, o2 = np.argsort(keys), np.argsort(k2)
    np.testing.assert_array_equal(k2[o2], keys[o])
    np.testing.assert_array_equal(r2[o2], rows[o])
    np.testing.assert_array_equal(fresh.dump_slots()[o2], slots[o])
    probe = batch(48)
    np.testing.assert_array_equal(
        step(emb, *probe, np.random.default_rng(9)), step(fresh, *probe, np.random.default_rng(9))
    )


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="max_capacity is for the hash embeddings"):
        hugectr.SparseEmbedding(E.LocalizedSlotSparseEmbeddingOneHot, 1, D, "sum", "e", "d", [4], max_capacity=8)
    with pytest.raises(ValueError, match="max_capacity must be a positive"):
        hugectr.SparseEmbedding(E.DistributedSlotSparseEmbeddingHash, 1, D, "sum", "e", "d", max_capacity=0)
    with pytest.raises(ValueError, match="evict_strategy must be one of"):
        hugectr.SparseEmbedding(E.DistributedSlotSparseEmbeddingHash, 1, D, "sum", "e", "d", evict_strategy="kFifo")
    with pytest.raises(ValueError, match="evict_to needs max_capacity"):
        hugectr.SparseEmbedding(E.DistributedSlotSparseEmbeddingHash, 1, D, "sum", "e", "d", evict_to=HashMapBackend())
    with pytest.raises(ValueError, match="less than one bucket"):
        embedding(max_capacity=8, max_bucket_size=16)


def evicting_model(train, evl, **sparse_kw):
    """Input (3 slots, 2 dense) -> SparseEmbedding (with numbactr's options) -> concat -> logistic loss."""
    solver = hugectr.CreateSolver(
        batchsize=32, batchsize_eval=32, max_eval_batches=2, lr=0.01, vvgpu=[[0]], i64_input_key=True, seed=0
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[train], eval_source=evl, check_type=hugectr.Check_t.Sum
    )
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer(optimizer_type=O.Adam, update_type=U.Global))
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 3)],
        )
    )
    m.add(hugectr.SparseEmbedding(E.DistributedSlotSparseEmbeddingHash, 0, D, "sum", "emb", "data1", **sparse_kw))
    L = hugectr.Layer_t
    m.add(hugectr.DenseLayer(L.Reshape, ["emb"], ["flat"], leading_dim=3 * D))
    m.add(hugectr.DenseLayer(L.Concat, ["dense", "flat"], ["cat"]))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["cat"], ["fc"], num_output=1))
    m.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc", "label"], ["loss"]))
    m.compile()
    return m


def test_a_model_streams_ten_times_the_capacity_and_snapshots_round_trip(tmp_path):
    from tests.model_util import tiny_data

    train, evl = tiny_data(str(tmp_path), n_train=640, n_eval=64, keys_per_slot=110)  # 330 distinct keys
    m = evicting_model(train, evl, max_capacity=32, max_bucket_size=16)
    m.fit(max_iter=20, display=0, eval_interval=20, snapshot=0)  # 640 samples, every key seen
    emb = m.embeddings[0]
    assert isinstance(emb, EvictingHashEmbedding) and 16 < emb.size() <= 32
    m.save_params_to_files(str(tmp_path / "s"), 20)
    keys, rows = emb.dump()
    fresh = evicting_model(train, evl, max_capacity=32, max_bucket_size=16)
    fresh.load_sparse_weights([str(tmp_path / "s0_sparse_20.model")])
    k2, r2 = fresh.embeddings[0].dump()
    o, o2 = np.argsort(keys), np.argsort(k2)
    np.testing.assert_array_equal(k2[o2], keys[o])
    np.testing.assert_array_equal(r2[o2], rows[o])
    fresh.load_sparse_optimizer_states([str(tmp_path / "s0_opt_sparse_20.model")])
    for a, b in zip(emb.dump_states(), fresh.embeddings[0].dump_states()):
        np.testing.assert_array_equal(b[o2], a[o])


def test_the_simulated_kernels_train_as_the_cpu_at_a_tiny_shape(on_device):
    """cpu vs the numba.cuda kernels in the simulator: a short stream with evictions, bit for bit."""

    def stream():
        emb, rng, outs = embedding(opt=O.SGD, max_capacity=16, max_bucket_size=16), np.random.default_rng(3), []
        for s in range(3):
            outs.append(step(emb, *batch(s * 12), rng))
        return outs, [np.sort(a) for a in emb.dump()[:1]]

    on_device("cpu")
    want = stream()
    on_device("sim")
    got = stream()
    for a, b in zip(want[0] + want[1], got[0] + got[1]):
        np.testing.assert_array_equal(a, b)
