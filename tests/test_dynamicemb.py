"""numbactr.dynamicemb (NVIDIA DynamicEmb's face): a stream of ten times max_capacity trains and keeps at most
max_capacity keys; rows train through the engine's optimizer; an evicted key's row and state do not reach
the next key; each score strategy evicts what it should (STEP, LFU, CUSTOMIZED with the forward's scores,
NO_EVICTION never); frequency admission with a bounded counter; incremental_dump by score; clear errors."""

import numpy as np
import pytest

from numbactr.dynamicemb import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy as Score,
    DynamicEmbTableOptions,
    FrequencyAdmissionStrategy,
    KVCounter,
    get_score,
    incremental_dump,
    set_score,
)
from numbactr.embedding.engine import Optim, OptimizerSpec
from numbactr.runtime import device

D = 4
pytestmark = pytest.mark.usefixtures("cpu")


def tables(score=Score.STEP, cap=64, bucket=16, opt=None, **kw):
    o = DynamicEmbTableOptions(dim=D, max_capacity=cap, bucket_capacity=bucket, score_strategy=score, **kw)
    return BatchedDynamicEmbeddingTables([o], ["t"], optimizer=opt or OptimizerSpec(learning_rate=0.1))


def one_each(keys):
    """One key a bag: (keys int64, offsets)."""
    keys = np.asarray(keys, np.int64)
    return keys, np.arange(keys.size + 1, dtype=np.int64)


def run(tb, keys, scores=None, train=True, rng=None):
    out = np.array(device.to_host(tb.forward(*one_each(keys), scores=scores, training=train)))
    if train:
        tb.backward((rng or np.random.default_rng(0)).normal(size=out.shape).astype(np.float32))
    return out


def held(tb):
    return set(tb.tables[0].export()[0].tolist())


def test_a_stream_of_ten_times_the_capacity_trains_and_keeps_at_most_the_capacity():
    tb, rng = tables(opt=OptimizerSpec(Optim.ADAM, learning_rate=0.01)), np.random.default_rng(1)
    for s in range(20):  # 640 distinct keys, 10x max_capacity
        out = run(tb, np.arange(s * 32, s * 32 + 32) * 7919 + 1, rng=rng)
        assert np.isfinite(out).all() and tb.tables[0].size() <= 64
    assert tb.tables[0].size() > 32
    assert set((np.arange(19 * 32, 20 * 32) * 7919 + 1).tolist()) <= held(tb)  # STEP: the newest stay


def test_rows_start_from_the_initializer_and_train_with_the_engine():
    init = DynamicEmbInitializerArgs(DynamicEmbInitializerMode.UNIFORM, lower=-0.5, upper=0.5)
    tb = tables(initializer_args=init)
    keys = np.array([5, 9, 11])
    start = init.rows(keys.astype(np.uint64), D, tb.tables[0].seed, 64)
    out = np.array(device.to_host(tb.forward(*one_each(keys))))
    np.testing.assert_array_equal(out, start)
    dout = np.ones_like(out)
    tb.backward(dout)
    np.testing.assert_allclose(run(tb, keys, train=False), start - 0.1 * dout, rtol=1e-6)  # SGD, lr 0.1
    np.testing.assert_array_equal(run(tb, [12345], train=False), np.zeros((1, D)))  # evaluation: no insert
    assert tb.tables[0].size() == 3


def test_an_evicted_keys_row_and_state_do_not_reach_the_next_key():
    tb = tables(cap=16, bucket=16, opt=OptimizerSpec(Optim.ADAM, learning_rate=0.1))
    t = tb.tables[0]
    run(tb, np.arange(16))
    run(tb, np.arange(16))
    assert all(np.abs(v).max() > 0 for v in t.engine.split_optimizer_states()[0][:2])
    tb.forward(*one_each([777]))  # the table is full: 777 takes the slot of the lowest score
    slot = int(t.index.find_slots(np.array([777], np.uint64))[0])
    assert slot >= 0 and t.size() == 16
    want = t.opts.initializer_args.rows(np.array([777], np.uint64), D, t.seed, 16)[0]
    np.testing.assert_array_equal(np.array(device.to_host(t.engine.split_weights()[0][slot])), want)
    for v in t.engine.split_optimizer_states()[0][:2]:
        np.testing.assert_array_equal(np.array(device.to_host(v[slot])), 0.0)


def test_lfu_keeps_the_frequent_keys():
    tb = tables(Score.LFU, cap=16, bucket=16)
    for _ in range(3):
        run(tb, np.arange(8))  # 8 keys seen 3 times each
    for s in range(10):
        run(tb, 1000 + np.arange(s * 8, s * 8 + 8))  # keys seen once
    assert set(range(8)) <= held(tb) and tb.tables[0].size() == 16


def test_customized_scores_come_from_the_forward_or_set_score():
    tb = tables(Score.CUSTOMIZED, cap=16, bucket=16)
    run(tb, np.arange(16), scores=np.arange(100, 116))
    run(tb, [500], scores=np.array([50]))  # below the bucket's minimum: refused, reads its initial row
    assert 500 not in held(tb) and tb.tables[0].size() == 16
    run(tb, [600], scores=np.array([200]))  # above: pushes out the key scored 100
    assert 600 in held(tb) and 0 not in held(tb)
    with pytest.raises(ValueError, match="CUSTOMIZED needs scores"):
        tb.forward(*one_each([1]))
    set_score(tb, 300)
    run(tb, [700])
    assert 700 in held(tb) and 1 not in held(tb) and get_score(tb) == {"model": {"t": 300}}


def test_no_eviction_refuses_new_keys_when_full():
    tb = tables(Score.NO_EVICTION, cap=16, bucket=16)
    run(tb, np.arange(10))
    run(tb, np.arange(10, 30))  # 20 new keys, 6 slots left
    first = held(tb)
    assert set(range(10)) <= first and len(first) == 16
    run(tb, np.arange(100, 140))
    assert held(tb) == first


def test_frequency_admission_with_a_bounded_counter():
    adm = FrequencyAdmissionStrategy(3, DynamicEmbInitializerArgs(DynamicEmbInitializerMode.CONSTANT, value=0.5))
    tb = tables(admit_strategy=adm, admission_counter=KVCounter(16, 16))
    t = tb.tables[0]
    for _ in range(2):  # seen twice: not admitted, read the strategy's initializer, never updated
        np.testing.assert_array_equal(run(tb, [42]), np.full((1, D), 0.5))
    assert t.size() == 0
    run(tb, [42])  # the third time: admitted, gone from the counter
    assert held(tb) == {42}
    _, found, score = t.counter.find(np.array([42], np.uint64), return_scores=True)
    assert not found[0] or score[0] == 0
    run(tb, [7, 7, 7])  # three occurrences in one forward count too
    assert 7 in held(tb)
    for s in range(10):  # 100 keys seen once: the counter holds at most its capacity
        run(tb, 5000 + np.arange(s * 10, s * 10 + 10))
    assert t.counter.size() <= 16 and held(tb) == {42, 7}


def test_incremental_dump_by_step():
    class Model:
        def __init__(self):
            self.sparse = tables(cap=64)

    m = Model()
    for s in range(5):
        run(m.sparse, np.arange(s * 4, s * 4 + 4))
    dumps, nxt = incremental_dump(m, 4)  # the keys of forwards 4 and 5
    keys, rows = dumps["sparse"]["t"]
    assert set(keys.tolist()) == set(range(12, 20)) and nxt == {"sparse": {"t": 6}}
    np.testing.assert_array_equal(rows, run(m.sparse, keys, train=False))
    run(m.sparse, [3, 100])
    keys, _ = incremental_dump(m, {"sparse": {"t": nxt["sparse"]["t"]}})[0]["sparse"]["t"]
    assert set(keys.tolist()) == {3, 100}
    with pytest.raises(ValueError, match="holds no BatchedDynamicEmbeddingTables"):
        incremental_dump(object(), 0)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="max_capacity must be a positive integer"):
        tables(cap=0)
    with pytest.raises(ValueError, match="eval_initializer_args must be CONSTANT"):
        tables(eval_initializer_args=DynamicEmbInitializerArgs())
    with pytest.raises(ValueError, match="threshold must be a non-negative"):
        FrequencyAdmissionStrategy(-1)
    with pytest.raises(ValueError, match="pooling_mode must be SUM or MEAN"):
        BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=D, max_capacity=8)], pooling_mode=7)
    with pytest.raises(ValueError, match="2 distinct names"):
        o = DynamicEmbTableOptions(dim=D, max_capacity=8, bucket_capacity=8)
        BatchedDynamicEmbeddingTables([o, o], ["a", "a"])
    assert DynamicEmbPoolingMode.MEAN == 1


def test_two_tables_mean_bags_with_a_key_not_admitted():
    never = FrequencyAdmissionStrategy(100, DynamicEmbInitializerArgs(DynamicEmbInitializerMode.CONSTANT, value=1.0))
    a = DynamicEmbTableOptions(dim=2, max_capacity=16, bucket_capacity=16, score_strategy=Score.STEP)
    b = DynamicEmbTableOptions(dim=3, max_capacity=16, bucket_capacity=16, admit_strategy=never)
    tb = BatchedDynamicEmbeddingTables([a, b], ["a", "b"], pooling_mode=DynamicEmbPoolingMode.MEAN)
    # B = 2: table a's bags [1, 2], [3]; table b's bags [4], [5, 6]
    keys = np.array([1, 2, 3, 4, 5, 6], np.int64)
    offsets = np.array([0, 2, 3, 4, 6], np.int64)
    out = np.array(device.to_host(tb.forward(keys, offsets)))
    ra = a.initializer_args.rows(np.array([1, 2, 3], np.uint64), 2, tb.tables[0].seed, 16)
    np.testing.assert_allclose(out[:, :2], [(ra[0] + ra[1]) / 2, ra[2]], rtol=1e-6)
    np.testing.assert_array_equal(out[:, 2:], np.ones((2, 3)))  # b's keys are never admitted: its constant
    tb.backward(np.ones_like(out))
    assert tb.tables[0].size() == 3 and tb.tables[1].size() == 0
