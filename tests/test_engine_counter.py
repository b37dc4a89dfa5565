"""Counter-based regularization (WeightDecay.COUNTER / COWCLIP: FBGEMM's rowwise AdaGrad with a per-row
counter) and ADAM's rowwise bias correction in the engine: worked examples computed by hand, max_counter's
renewal, the reference against the compiled CPU path, and clear errors. The kernels' equality with the
reference is in tests/test_engine_kernels.py (OPTIMIZER_CASES), FBGEMM's own CPU build is the oracle in
tests/test_fbgemm_face_diff.py."""

import math

import numpy as np
import pytest

from numbactr.embedding.engine import (
    CounterRegularization,
    CounterWeightDecay,
    OptimizerSpec,
    Optim,
    TableBatchedEmbedding,
    WeightDecay,
)
from tests.engine_cases import Case, assert_same_training, random_steps, run

pytestmark = pytest.mark.usefixtures("cpu")  # conftest.py: the host implementations (ref, cpu)


def engine(impl, opt, rows=4, dim=2):
    e = TableBatchedEmbedding([(rows, dim)], optimizer=opt, impl=impl, stochastic_rounding=False)
    e.split_weights()[0][:] = np.arange(rows * dim, dtype=np.float32).reshape(rows, dim) / 10 + 0.1
    return e


def step(e, rows, dy):
    """One SUM lookup of one bag per given row (batch = len(rows)) and its update with dLoss/dout = dy."""
    out, ctx = e.forward(np.asarray(rows, np.int64), np.arange(len(rows) + 1, dtype=np.int64))
    e.backward(ctx, np.asarray(dy, np.float32).reshape(out.shape))


@pytest.mark.parametrize("impl", ["ref", "cpu"])
def test_counter_tail_id_decrease_by_hand(impl):
    """COUNTER, TAIL_ID_LR_DECREASE (mode 1), ratio threshold, max_counter renewed every 2 steps, decoupled
    decay with a halflife: three steps computed by hand."""
    c = CounterRegularization(
        CounterWeightDecay.DECOUPLE,
        halflife=2,
        adjustment_ub=0.5,
        learning_rate_mode=1,
        tail_id_threshold=0.5,
        tail_id_threshold_is_ratio=True,
        max_counter_update_freq=2,
    )
    lr, wd, eps = 0.1, 0.2, 1e-3
    e = engine(
        impl,
        OptimizerSpec(
            Optim.EXACT_ROWWISE_ADAGRAD,
            learning_rate=lr,
            weight_decay=wd,
            eps=eps,
            weight_decay_mode=WeightDecay.COUNTER,
            counter=c,
        ),
    )
    w = e.split_weights()[0].astype(np.float64).copy()
    m, cnt, prev = np.zeros(4), np.zeros(4), np.zeros(4)
    max_counter = 1.0
    rho = math.log(2) / 2
    for t, (rows, g) in enumerate(
        [([0, 0, 1], [[1, 2], [1, 0], [0, 1]]), ([0, 2], [[1, 1], [2, 0]]), ([0, 1], [[0, 1], [1, 1]])], start=1
    ):
        if t % 2 == 0:  # renewed before the step's update
            max_counter = cnt.max() + 1
        gsum = {}
        for r, gr in zip(rows, g):
            gsum[r] = gsum.get(r, 0) + np.asarray(gr, np.float64)
        for r, gr in gsum.items():
            delta = 1 if prev[r] == 0 else t - prev[r]
            cnt[r] = 1 + math.exp(-delta * rho) * cnt[r]
            freq = 2 / cnt[r]
            m[r] += (gr @ gr) / 2
            u0 = lr / (math.sqrt(m[r]) + eps)
            u = u0
            if cnt[r] > math.floor(0.5 * max_counter):
                u = u0 * min(max(((cnt[r] + 1) / max_counter) ** 0.5, 0.1), 1.0)
            w[r] = (1 - freq * wd * lr) * w[r] - u * gr
            prev[r] = t
        step(e, rows, g)
        np.testing.assert_allclose(e.split_weights()[0], w, rtol=1e-5, atol=1e-6)
        m1, prev_iter, row_counter = e.split_optimizer_states()[0]
        np.testing.assert_allclose(m1, m, rtol=1e-6)
        np.testing.assert_allclose(row_counter, cnt, rtol=1e-6)
        np.testing.assert_array_equal(prev_iter, prev)
        assert float(e.max_counter[0]) == pytest.approx(max_counter)
    assert max_counter > 1  # the renewal happened and mattered


@pytest.mark.parametrize("impl", ["ref", "cpu"])
def test_cowclip_and_adagradw_by_hand(impl):
    """COWCLIP with L2 decay clips the multiplier by cnt max(wnc |w|, lower) / |g'|; COUNTER ADAGRADW (halflife
    -1) multiplies it by sqrt(cnt) and applies the decays a row skipped: (1 - wd lr)^(delta - 1)."""
    lr, wd, eps = 0.1, 0.1, 1e-3
    clip = CounterRegularization(
        CounterWeightDecay.L2, halflife=-1, max_counter_update_freq=-1, weight_norm_coefficient=0.05, lower_bound=1e-3
    )
    e = engine(
        impl,
        OptimizerSpec(
            Optim.EXACT_ROWWISE_ADAGRAD,
            learning_rate=lr,
            weight_decay=wd,
            eps=eps,
            weight_decay_mode=WeightDecay.COWCLIP,
            counter=clip,
        ),
    )
    w = e.split_weights()[0][1].astype(np.float64).copy()
    g = np.array([3.0, -4.0])
    step(e, [1], [g])
    gd = g + wd * w
    m = gd @ gd / 2
    u = min(1.0, 1 * max(0.05 * math.sqrt(w @ w), 1e-3) / math.sqrt(gd @ gd)) * lr / (math.sqrt(m) + eps)
    np.testing.assert_allclose(e.split_weights()[0][1], (1 - wd * u) * w - u * g, rtol=1e-5)

    adagradw = CounterRegularization(CounterWeightDecay.ADAGRADW, halflife=-1, max_counter_update_freq=-1)
    e = engine(
        impl,
        OptimizerSpec(
            Optim.EXACT_ROWWISE_ADAGRAD,
            learning_rate=lr,
            weight_decay=wd,
            eps=eps,
            weight_decay_mode=WeightDecay.COUNTER,
            counter=adagradw,
        ),
    )
    w = e.split_weights()[0][2].astype(np.float64).copy()
    step(e, [2], [g])  # t = 1: first sight, delta = 1
    m = g @ g / 2
    u = lr / (math.sqrt(m) + eps) * math.sqrt(1)
    w = (1 - wd * lr) * w - u * g
    np.testing.assert_allclose(e.split_weights()[0][2], w, rtol=1e-5)
    step(e, [0], [g])  # t = 2: row 2 untouched
    step(e, [2], [g / 2])  # t = 3: delta = 2, one skipped decay
    m += (g / 2) @ (g / 2) / 2
    lazy = (1 - wd * lr) ** (2 - 1)
    u = lr / (math.sqrt(m) + eps) * math.sqrt(2) * lazy
    w = (1 - wd * lr) * lazy * w - u * g / 2
    np.testing.assert_allclose(e.split_weights()[0][2], w, rtol=1e-5)


@pytest.mark.parametrize("impl", ["ref", "cpu"])
def test_adam_rowwise_bias_correction_by_hand(impl):
    """A row updated at steps 1 and 3 is corrected with its own count (1, then 2), not with t = 3."""
    lr, b1, b2, eps, wd = 0.1, 0.9, 0.99, 1e-8, 0.01
    e = engine(
        impl,
        OptimizerSpec(
            Optim.ADAM, learning_rate=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, rowwise_bias_correction=True
        ),
    )
    w = e.split_weights()[0][1].astype(np.float64).copy()
    m, v = np.zeros(2), np.zeros(2)
    for n, (rows, g) in enumerate([([1], [1.0, -2.0]), ([0], [1.0, 1.0]), ([1], [0.5, 0.5])]):
        step(e, rows, [g])
        if rows == [1]:
            k = 1 if n == 0 else 2
            m = b1 * m + (1 - b1) * np.asarray(g)
            v = b2 * v + (1 - b2) * np.square(g)
            w = w - lr * (m / (1 - b1**k) / (np.sqrt(v / (1 - b2**k)) + eps) + wd * w)
    np.testing.assert_allclose(e.split_weights()[0][1], w, rtol=1e-5)
    np.testing.assert_array_equal(e.split_optimizer_states()[0][2], [1, 2, 0, 0])


@pytest.mark.parametrize(
    "wd_mode,rbc", [(WeightDecay.COUNTER, False), (WeightDecay.COWCLIP, False), (WeightDecay.NONE, True)]
)
def test_compiled_cpu_equals_the_reference(wd_mode, rbc):
    rng = np.random.default_rng(int(wd_mode) + rbc)
    tables, fmap = [(6, 5), (4, 3)], [0, 1, 0]
    kind = Optim.ADAM if rbc else Optim.EXACT_ROWWISE_ADAGRAD
    case = Case(
        tables,
        fmap,
        kind=kind,
        wd_mode=wd_mode,
        rowwise_bias_correction=rbc,
        steps=random_steps(rng, tables, fmap, n_steps=4, batch=3),
    )
    a, b = run(case, "ref"), run(case, "cpu")
    assert_same_training(case, a, b)
    assert float(a[0].max_counter[0]) == float(b[0].max_counter[0])


def test_bad_counter_settings_get_clear_errors():
    c = CounterRegularization()
    with pytest.raises(ValueError, match="COUNTER / COWCLIP"):
        TableBatchedEmbedding([(4, 2)], optimizer=OptimizerSpec(Optim.EXACT_ROWWISE_ADAGRAD, counter=c))
    with pytest.raises(ValueError, match="COUNTER / COWCLIP"):
        TableBatchedEmbedding(
            [(4, 2)], optimizer=OptimizerSpec(Optim.EXACT_ROWWISE_ADAGRAD, weight_decay_mode=WeightDecay.COUNTER)
        )
    with pytest.raises(ValueError, match="EXACT_ROWWISE_ADAGRAD"):
        TableBatchedEmbedding(
            [(4, 2)], optimizer=OptimizerSpec(Optim.EXACT_ADAGRAD, counter=c, weight_decay_mode=WeightDecay.COWCLIP)
        )
    with pytest.raises(ValueError, match="learning_rate_mode"):
        TableBatchedEmbedding(
            [(4, 2)],
            optimizer=OptimizerSpec(
                Optim.EXACT_ROWWISE_ADAGRAD,
                weight_decay_mode=WeightDecay.COUNTER,
                counter=CounterRegularization(learning_rate_mode=5),
            ),
        )
    with pytest.raises(ValueError, match="only defined for ADAM"):
        TableBatchedEmbedding([(4, 2)], optimizer=OptimizerSpec(Optim.LAMB, rowwise_bias_correction=True))
    e = TableBatchedEmbedding(
        [(4, 2)], optimizer=OptimizerSpec(Optim.EXACT_ROWWISE_ADAGRAD, weight_decay_mode=WeightDecay.COUNTER, counter=c)
    )
    with pytest.raises(ValueError, match="other optimizer states"):
        e.set_hyper_parameters(weight_decay_mode=WeightDecay.L2, counter=None)
    e.set_hyper_parameters(counter=CounterRegularization(adjustment_ub=2.0))  # same states: allowed
    assert e.optimizer.counter.adjustment_ub == 2.0
