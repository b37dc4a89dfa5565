"""The engine's NumPy reference (kernels/tbe.py): worked examples, float64 gradient checks, every
optimizer's row rule against hand-derived values, FP16 rounding in distribution, FBGEMM's bounds-check
modes and keyed tables (HugeCTR's sparse optimizers against their references: tests/test_optimizers.py)."""

import numpy as np
import pytest

from numbactr.embedding.engine import (
    BoundsCheck,
    EmbeddingBoundsError,
    Layout,
    OptimizerSpec,
    Optim,
    Pooling,
    Precision,
    TableBatchedEmbedding,
    TableSpec,
    UpdateType,
    WeightDecay,
)
from numbactr.kernels import tbe as K
from tests.gradcheck import assert_grad_close

# two tables, three features: f0 -> t0 (V=5, D=2), f1 -> t1 (V=3, D=3), f2 -> t0
TABLES = [np.arange(10, dtype=np.float64).reshape(5, 2), 100 + np.arange(9, dtype=np.float64).reshape(3, 3)]
FMAP = [0, 1, 0]
B = 2
# feature-major bags (f, b): f0b0 [1, 1]  f0b1 []  f1b0 [2]  f1b1 [0, -1]  f2b0 [4]  f2b1 [0, 3, 3]
ROWS = np.array([1, 1, 2, 0, -1, 4, 0, 3, 3], np.int64)
OFFS = np.array([0, 2, 2, 3, 5, 6, 9], np.int64)


def engine(**kw):
    kw.setdefault("impl", "ref")
    return TableBatchedEmbedding(**kw)


pytestmark = pytest.mark.usefixtures("cpu")  # conftest.py: the cpu device for every test


def test_forward_by_hand_sum_mean_none():
    t0, t1 = TABLES
    out = K.tbe_forward_ref(TABLES, FMAP, ROWS, OFFS, B, Pooling.SUM, Layout.FEATURE_MAJOR)
    want = np.zeros((2, 7))
    want[0, 0:2], want[1, 0:2] = 2 * t0[1], 0
    want[0, 2:5], want[1, 2:5] = t1[2], t1[0]  # -1 adds nothing
    want[0, 5:7], want[1, 5:7] = t0[4], t0[0] + 2 * t0[3]
    np.testing.assert_array_equal(out, want)
    mean = K.tbe_forward_ref(TABLES, FMAP, ROWS, OFFS, B, Pooling.MEAN, Layout.FEATURE_MAJOR)
    scale = np.array([[1 / 2] * 2 + [1] * 3 + [1] * 2, [1] * 2 + [1 / 2] * 3 + [1 / 3] * 2])  # -1 counts in L
    np.testing.assert_allclose(mean, want * scale)
    same_d = [TABLES[0], TABLES[0]]
    none = K.tbe_forward_ref(same_d, [0, 1, 0], ROWS, OFFS, B, Pooling.NONE, Layout.FEATURE_MAJOR)
    np.testing.assert_array_equal(none[4], 0)
    np.testing.assert_array_equal(none[0], t0[1])
    np.testing.assert_array_equal(none[7], t0[3])


def test_per_sample_weights_and_sample_major_layout():
    p = np.arange(1, 10, dtype=np.float64)
    out = K.tbe_forward_ref(TABLES, FMAP, ROWS, OFFS, B, Pooling.SUM, Layout.FEATURE_MAJOR, p)
    np.testing.assert_allclose(out[1, 5:7], 7 * TABLES[0][0] + (8 + 9) * TABLES[0][3])
    # the same bags listed sample-major: bag b*F + f
    order = [0, 2, 4, 1, 3, 5]  # sample-major bag -> feature-major bag
    lens = np.diff(OFFS)
    rows_sm = np.concatenate([ROWS[OFFS[j] : OFFS[j + 1]] for j in order])
    offs_sm = np.concatenate([[0], np.cumsum(lens[order])])
    out_sm = K.tbe_forward_ref(TABLES, FMAP, rows_sm, offs_sm, B, Pooling.MEAN, Layout.SAMPLE_MAJOR)
    np.testing.assert_allclose(
        out_sm, K.tbe_forward_ref(TABLES, FMAP, ROWS, OFFS, B, Pooling.MEAN, Layout.FEATURE_MAJOR)
    )


@pytest.mark.parametrize("pooling", [Pooling.SUM, Pooling.MEAN, Pooling.NONE])
def test_backward_ref_matches_float64_central_differences(pooling):
    rng = np.random.default_rng(3)
    tables = [rng.normal(size=(5, 2)), rng.normal(size=(3, 2))]
    p = rng.normal(size=ROWS.size)
    args = (ROWS, OFFS, B, pooling, Layout.FEATURE_MAJOR)
    out = K.tbe_forward_ref(tables, FMAP, *args, p)
    dy = rng.normal(size=out.shape)
    grads = K.tbe_backward_ref([2, 2], FMAP, *args, dy, p)
    for t in range(2):
        dense = np.zeros_like(tables[t])
        rows, g = grads[t]
        dense[rows] = g

        def f(x, t=t):
            tt = list(tables)
            tt[t] = x
            return K.tbe_forward_ref(tt, FMAP, *args, p)

        assert_grad_close(dense, f, tables[t], dy)
    dp = K.per_sample_weights_grad_ref(tables, FMAP, *args, dy)
    assert_grad_close(dp, lambda x: K.tbe_forward_ref(tables, FMAP, *args, x), p, dy)


def test_backward_sums_duplicates_in_occurrence_order_and_skips_missing():
    dy = np.ones((2, 7))
    (r0, g0), (r1, g1) = K.tbe_backward_ref([2, 3], FMAP, ROWS, OFFS, B, Pooling.SUM, Layout.FEATURE_MAJOR, dy)
    np.testing.assert_array_equal(r0, [0, 1, 3, 4])  # ascending; row 2 of t0 never read
    np.testing.assert_array_equal(g0[:, 0], [1, 2, 2, 1])
    np.testing.assert_array_equal(r1, [0, 2])  # the -1 occurrence gives nothing


# ---- optimizers -------------------------------------------------------------------------------------
HP = OptimizerSpec(learning_rate=0.1, eps=1e-8, beta1=0.9, beta2=0.999, weight_decay=0.0).hp()
W = np.array([[3.0, 4.0]])  # |w| = 5
G = np.array([[1.0, -2.0]])


def upd(kind, states, step=1, hp=HP, **kw):
    return K.optimizer_update_ref(kind, hp, W, G, states, step, **kw)


def test_sgd_and_adagrad_rules():
    w, _ = upd(Optim.EXACT_SGD, [])
    np.testing.assert_allclose(w, [[2.9, 4.2]], rtol=1e-6)
    w, (m,) = upd(Optim.EXACT_ADAGRAD, [np.array([[3.0, 0.0]])])
    np.testing.assert_allclose(m, [[4.0, 4.0]])
    np.testing.assert_allclose(w, [[3 - 0.1 * 1 / 2, 4 + 0.1 * 2 / 2]], rtol=1e-6)


@pytest.mark.parametrize("mode", [WeightDecay.NONE, WeightDecay.L2, WeightDecay.DECOUPLE])
def test_rowwise_adagrad_rule(mode):
    hp = dict(HP, weight_decay=0.5)
    w, (m,) = upd(Optim.EXACT_ROWWISE_ADAGRAD, [np.array([1.0])], hp=hp, weight_decay_mode=mode)
    gd = G + 0.5 * W if mode == WeightDecay.L2 else G
    m_want = 1.0 + np.mean(gd**2)
    u = np.float32(0.1) / (np.sqrt(m_want) + np.float32(1e-8))
    c = {WeightDecay.NONE: 1.0, WeightDecay.L2: 1 - u * 0.5, WeightDecay.DECOUPLE: 1 - np.float32(0.1) * 0.5}[mode]
    np.testing.assert_allclose(m, [m_want])
    np.testing.assert_allclose(w, c * W - u * G, rtol=1e-6)


def test_adam_first_step_moves_by_lr_times_sign():
    w, (m1, m2) = upd(Optim.ADAM, [np.zeros((1, 2)), np.zeros((1, 2))])
    np.testing.assert_allclose(w, W - 0.1 * np.sign(G), rtol=1e-5)
    np.testing.assert_allclose(m1, 0.1 * G, rtol=1e-6)
    w, (m1, m2) = upd(Optim.PARTIAL_ROWWISE_ADAM, [np.zeros((1, 2)), np.zeros(1)])
    np.testing.assert_allclose(m2, [0.001 * 2.5], rtol=1e-4)  # mean(g^2) = 2.5
    np.testing.assert_allclose(w, W - 0.1 * G / np.sqrt(2.5), rtol=1e-5)


def test_lamb_scales_the_adam_direction_by_the_trust_ratio():
    w, _ = upd(Optim.LAMB, [np.zeros((1, 2)), np.zeros((1, 2))])
    r = np.sign(G)  # first step: m_hat / sqrt(v_hat) = sign(g)
    np.testing.assert_allclose(w, W - 0.1 * (5 / np.sqrt(2)) * r, rtol=1e-5)
    w0, _ = K.optimizer_update_ref(Optim.LAMB, HP, np.zeros((1, 2)), G, [np.zeros((1, 2))] * 2, 1)
    np.testing.assert_array_equal(w0, 0)  # |w| = 0: FBGEMM's LAMB leaves the row


def test_max_norm():
    w, _ = upd(Optim.EXACT_SGD, [], hp=dict(HP, max_norm=1.0))
    np.testing.assert_allclose(np.linalg.norm(w), 1.0, rtol=1e-6)


def test_gradient_clipping_clamps_dloss_dout_not_the_row_sum():
    """FBGEMM's rule: each bag's gradient is clamped, then a row sums its (clamped) occurrences."""
    opt = OptimizerSpec(Optim.EXACT_SGD, learning_rate=1.0, gradient_clipping=True, max_gradient=0.5)
    e = TableBatchedEmbedding([(2, 2)], [0], optimizer=opt, impl="ref")
    e.split_weights()[0][...] = 0
    _, ctx = e.forward(np.array([1, 1, 1]), np.array([0, 1, 2, 3]))  # row 1 read by 3 bags
    e.backward(ctx, np.array([[0.4, -2.0], [0.4, -2.0], [0.4, -2.0]], np.float32))
    np.testing.assert_allclose(e.split_weights()[0][1], [-1.2, 1.5])  # 3 x clamp(g), not clamp(3 g)
    np.testing.assert_array_equal(e.split_weights()[0][0], 0)


@pytest.mark.parametrize("decay", [0.0, 0.01])
def test_adam_equals_torch_adamw_on_touched_rows(decay):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(4, 3))
    p = torch.nn.Parameter(torch.tensor(w0))
    opt = torch.optim.AdamW([p], lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=decay)
    hp = dict(HP, learning_rate=0.05, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=decay)
    w, s = w0, [np.zeros((4, 3)), np.zeros((4, 3))]
    for step in range(1, 4):
        g = rng.normal(size=(4, 3))
        p.grad = torch.tensor(g)
        opt.step()
        w, s = K.optimizer_update_ref(Optim.ADAM, hp, w, g, s, step)
    np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-5, atol=1e-6)


# ---- FP16 rounding ----------------------------------------------------------------------------------
def test_half_rounding_nearest_even_and_stochastic_in_distribution():
    x = np.array([1.0, 1 + 2**-11, 1 + 3 * 2**-11, -2.5e-6, 7e4, -np.inf, 0.0], np.float32)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(K.to_half_ref(x, None), x.astype(np.float16))
    lo, hi = np.float16(1.0), np.nextafter(np.float16(1.0), np.float16(2))
    v = np.float32(1.0) + np.float32(0.3) * (np.float32(hi) - np.float32(lo))  # 30% of the way to hi
    for sub in (v, np.float32(3.1e-6)):  # normal and subnormal float16 ranges
        bits = K.rounding_bits_ref(7, 3, np.arange(20000), 1, 0)[:, 0]
        got = K.to_half_ref(np.full(20000, sub, np.float32), bits)
        lo_s = np.float16(sub) if np.float16(sub) <= sub else np.nextafter(np.float16(sub), np.float16(0))
        hi_s = np.nextafter(lo_s, np.float16(np.inf))
        assert set(np.unique(got)) <= {lo_s, hi_s}
        frac = (np.float64(sub) - np.float64(lo_s)) / (np.float64(hi_s) - np.float64(lo_s))
        assert abs(np.mean(got == hi_s) - frac) < 0.015  # ~4 sigma of 20000 draws
        assert abs(np.mean(got.astype(np.float64)) - np.float64(sub)) < 0.015 * (np.float64(hi_s) - np.float64(lo_s))
    big = K.to_half_ref(np.array([7e4, -1e9, np.inf], np.float32), np.full(3, 2**32 - 1, np.uint32))
    np.testing.assert_array_equal(big, np.array([65504, -65504, np.inf], np.float16))


def test_fp16_engine_update_is_unbiased():
    # 4000 rows get the same sub-ulp SGD step: stochastic rounding moves ~ step/ulp of them one ulp
    e = engine(
        tables=[(4000, 1)],
        weights_precision=Precision.FP16,
        optimizer=OptimizerSpec(Optim.EXACT_SGD, learning_rate=1.0),
        bounds_check=BoundsCheck.FATAL,
    )
    e.split_weights()[0][:] = 1.0
    ulp = 2.0**-10
    out, ctx = e.forward(np.arange(4000), np.arange(4001))
    e.backward(ctx, np.full((4000, 1), -0.25 * ulp, np.float32))
    w = e.split_weights()[0][:, 0].astype(np.float64)
    assert set(np.unique(w)) == {1.0, 1.0 + ulp}
    assert abs(np.mean(w) - (1 + 0.25 * ulp)) < 0.03 * ulp
    e2 = engine(
        tables=[(4000, 1)],
        weights_precision=Precision.FP16,
        stochastic_rounding=False,
        optimizer=OptimizerSpec(Optim.EXACT_SGD, learning_rate=1.0),
    )
    e2.split_weights()[0][:] = 1.0
    out, ctx = e2.forward(np.arange(4000), np.arange(4001))
    e2.backward(ctx, np.full((4000, 1), -0.25 * ulp, np.float32))
    np.testing.assert_array_equal(e2.split_weights()[0], 1.0)  # nearest: the step is lost


# ---- bounds checks ----------------------------------------------------------------------------------
BAD_IDX = np.array([1, 7, 2, 0, -1, 4, -3, 3, 3], np.int64)  # 7 >= 5 rows (f0b0), -3 (f2b1)


def test_fatal_raises_naming_the_index():
    with pytest.raises(EmbeddingBoundsError, match=r"index 7 at position 1 \(feature 0, sample 0\).*5 rows"):
        K.check_indices_ref(BAD_IDX, OFFS, np.array([5, 3, 5]), B, Layout.FEATURE_MAJOR, BoundsCheck.FATAL)
    with pytest.raises(EmbeddingBoundsError, match="offsets"):
        K.check_offsets_ref(np.array([0, 3, 2, 9]), 9, BoundsCheck.FATAL)


@pytest.mark.parametrize("mode,fill", [(BoundsCheck.WARNING, 0), (BoundsCheck.IGNORE, 0), (BoundsCheck.NONE, -1)])
def test_repair_modes(mode, fill):
    rows, count, first = K.check_indices_ref(BAD_IDX, OFFS, np.array([5, 3, 5]), B, Layout.FEATURE_MAJOR, mode)
    want = BAD_IDX.copy()
    want[[1, 6]] = fill
    np.testing.assert_array_equal(rows, want)
    assert count == 2 and first == (1, 0, 0, 7, 5)
    fixed, n_bad = K.check_offsets_ref(np.array([-2, 3, 2, 7, 11]), 9, mode)
    np.testing.assert_array_equal(fixed, [0, 3, 3, 7, 9])  # FBGEMM's sequential repair
    assert n_bad == 3


def test_engine_warning_mode_warns_once_and_counts():
    e = engine(tables=[(5, 2), (3, 3)], feature_table_map=FMAP)
    with pytest.warns(RuntimeWarning, match=r"index 7 at position 1.*set to row 0 \(1 more"):
        out, ctx = e.forward(BAD_IDX, OFFS)
    assert e.bounds_warnings == 2
    np.testing.assert_array_equal(ctx.rows[[1, 6]], 0)
    e_fatal = engine(tables=[(5, 2), (3, 3)], feature_table_map=FMAP, bounds_check=BoundsCheck.FATAL)
    with pytest.raises(EmbeddingBoundsError):
        e_fatal.forward(BAD_IDX, OFFS)


def test_bad_shapes_are_clear_errors():
    e = engine(tables=[(5, 2)], feature_table_map=[0, 0])
    with pytest.raises(ValueError, match="F\\*B \\+ 1"):
        e.forward(np.zeros(3, np.int64), np.zeros(4, np.int64))
    with pytest.raises(TypeError, match="integer"):
        e.forward(np.zeros(3), np.zeros(5, np.int64))
    out, ctx = e.forward(np.zeros(2, np.int64), np.array([0, 1, 1, 2, 2]))
    with pytest.raises(ValueError, match="shape"):
        e.backward(ctx, np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="same dim"):
        engine(tables=[(5, 2), (5, 3)], pooling=Pooling.NONE)
    with pytest.raises(ValueError, match="feature_table_map"):
        engine(tables=[(5, 2)], feature_table_map=[1])
    with pytest.raises(ValueError, match="LAZY_GLOBAL"):
        engine(tables=[(5, 2)], optimizer=OptimizerSpec(Optim.HUGECTR_SGD, update_type=UpdateType.LAZY_GLOBAL))
    adam = engine(tables=[(5, 2)], optimizer=OptimizerSpec(Optim.HUGECTR_ADAM))
    adam.set_hyper_parameters(learning_rate=0.5, beta1=0.8)
    assert adam.learning_rate == 0.5 and adam.optimizer.beta1 == 0.8
    with pytest.raises(ValueError, match="fixed when the engine is built"):
        adam.set_hyper_parameters(update_type=UpdateType.LAZY_GLOBAL)  # would need a prev_step state
    with pytest.raises(ValueError, match="unknown"):
        adam.set_hyper_parameters(betta1=0.8)


# ---- keyed tables -----------------------------------------------------------------------------------
def test_keyed_rows_first_occurrence_init_and_eval_missing_counts_in_mean():
    from numbactr.kernels.embedding_init import row_values_ref

    e = engine(
        tables=[TableSpec(10, 3, keyed=True)],
        feature_table_map=[0, 0],
        pooling=Pooling.MEAN,
        layout=Layout.SAMPLE_MAJOR,
        seed=5,
    )
    keys = np.array([2**63 + 9, 40, 40, 7], np.uint64)  # (b0,s0) [k, 40] (b0,s1) [40] (b1,s0) [7]
    out, ctx = e.forward(keys, np.array([0, 2, 3, 4, 4]))
    np.testing.assert_array_equal(ctx.rows, [0, 1, 1, 2])
    np.testing.assert_array_equal(
        e.split_weights()[0][:3], row_values_ref(np.array([2**63 + 9, 40, 7], np.uint64), 3, 5, -0.05, 0.05)
    )
    out, ctx = e.forward(np.array([40, 99], np.uint64), np.array([0, 2, 2, 2, 2]), training=False)
    np.testing.assert_array_equal(ctx.rows, [1, -1])
    np.testing.assert_allclose(out[0, :3], e.split_weights()[0][1] / 2, rtol=1e-6)  # L = 2: missing counts
    assert e.hash_tables[0].size == 3
