"""FBGEMM's rules that only its GPU build runs, on numbactr's face: global weight decay
(WeightDecayMode.DECOUPLE_GLOBAL with EXACT_ROWWISE_ADAGRAD) and LARS_SGD.

FBGEMM's CPU build has no kernels for them, so the oracle for global weight decay is FBGEMM's rule as its
CUDA templates write it (embedding_forward_split_kernel_template.cu, the backward's compute_global_weight_decay
and the rowwise_adagrad optimizer with weight_decay_mode 5), in float64 and in FBGEMM's formulation: the
stored rows stay undecayed in the forward, which scales each row it reads by
f = max(lower_bound, (1 - lr wd) ** max(it - prev_iter - 1, 0)) (1 when prev_iter = 0), and the backward
scales the row by the same f, sets prev_iter = it and applies decoupled rowwise AdaGrad. numbactr's forward
reads the decayed rows and puts the stored ones back; its backward decays them before the update. The two
must give the same outputs, rows and states, also for a forward no backward follows, a forward that raises
and an index the bounds check repairs.
LARS_SGD's oracle is its optimizer template (codegen/genscript/optimizers.py, lars_sgd) in float64.
"""

import numpy as np
import pytest

from numbactr.fbgemm_gpu.array_tbe import ArrayTBE
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    GlobalWeightDecayDefinition,
    OptimType,
    PoolingMode,
    WeightDecayMode,
)

pytestmark = pytest.mark.usefixtures("cpu")  # conftest.py: the cpu device for every test

LR, WD, EPS = 0.05, 0.2, 1e-8


def fbgemm_gwd_reference(weights, batches, grads, start_iter, lower_bound, pooling="SUM"):
    """FBGEMM's GPU rule in float64: per step, the pooled outputs, then the update; returns outputs, rows,
    momentum1, prev_iter (per table)."""
    w = [np.array(x, np.float64) for x in weights]
    m = [np.zeros(len(x)) for x in weights]
    p = [np.zeros(len(x)) for x in weights]
    base = 1.0 - LR * WD
    outs = []
    for it, ((per_feature, ftm), dy) in enumerate(zip(batches, grads), start=1):
        apply = it >= start_iter

        def factor(t, r):
            if not apply or p[t][r] == 0:
                return 1.0
            return max(lower_bound, base ** max(it - p[t][r] - 1, 0.0))

        cols, gsum = [], [dict() for _ in w]
        col = 0
        for f, bags in enumerate(per_feature):
            t = ftm[f]
            dim = w[t].shape[1]
            out_f = np.zeros((len(bags), dim))
            for b, rows in enumerate(bags):
                scale = 1.0 / len(rows) if pooling == "MEAN" and rows else 1.0
                for r in rows:
                    out_f[b] += scale * factor(t, r) * w[t][r]
                    gsum[t][r] = gsum[t].get(r, 0.0) + scale * dy[b, col : col + dim]
            cols.append(out_f)
            col += dim
        outs.append(np.concatenate(cols, axis=1))
        for t, rows in enumerate(gsum):
            for r, g in rows.items():
                f = factor(t, r)
                if apply:
                    p[t][r] = it
                m[t][r] += np.mean(g * g)
                mult = LR / (np.sqrt(m[t][r]) + EPS)
                w[t][r] = (1.0 - LR * WD) * (f * w[t][r]) - mult * g
    return outs, w, m, p


def make(specs, ftm, start_iter, lower_bound, pooling):
    face = ArrayTBE(
        [(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in specs],
        ftm,
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        weight_decay=WD,
        eps=EPS,
        weight_decay_mode=WeightDecayMode.DECOUPLE_GLOBAL,
        pooling_mode=getattr(PoolingMode, pooling),
        global_weight_decay=GlobalWeightDecayDefinition(start_iter=start_iter, lower_bound=lower_bound),
    )
    face.init_embedding_weights_uniform(-1, 1)
    return face


@pytest.mark.parametrize("start_iter,lower_bound,pooling", [(0, 0.0, "SUM"), (3, 0.0, "SUM"), (0, 0.9, "MEAN")])
def test_global_weight_decay_follows_fbgemms_rule(start_iter, lower_bound, pooling):
    specs, ftm = [(6, 4), (5, 8)], [0, 1, 0]
    face = make(specs, ftm, start_iter, lower_bound, pooling)
    weights0 = [np.array(w) for w in face.split_embedding_weights()]
    rng = np.random.default_rng(7)
    batches, grads, outs = [], [], []
    for step in range(8):
        batch = 3
        # rows come and go, so that some miss several iterations (the decay they catch up on)
        per_feature = [
            [list(rng.integers(0, 3 if step % 3 else 5, rng.integers(0, 3))) for _ in range(batch)] for _ in ftm
        ]
        lens = [len(bag) for bags in per_feature for bag in bags]
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        indices = np.array([r for bags in per_feature for bag in bags for r in bag], np.int64)
        out = face(indices, offsets)
        dy = rng.standard_normal(out.shape).astype(np.float32)
        face.backward(dy)
        batches.append((per_feature, ftm))
        grads.append(dy.astype(np.float64))
        outs.append(np.array(out))
    want_outs, want_w, want_m, want_p = fbgemm_gwd_reference(weights0, batches, grads, start_iter, lower_bound, pooling)
    for got, want in zip(outs, want_outs):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    for t, (w, (m, p)) in enumerate(zip(face.split_embedding_weights(), face.split_optimizer_states())):
        np.testing.assert_allclose(w, want_w[t], rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(m, want_m[t], rtol=2e-5, atol=1e-7)
        np.testing.assert_array_equal(p, want_p[t])
    assert any(np.any(p > 0) for _, p in face.split_optimizer_states()) == (start_iter <= 8)
    # the decay matters: plain DECOUPLE (decay on updates only) ends elsewhere
    plain = ArrayTBE(
        [(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in specs],
        ftm,
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        weight_decay=WD,
        eps=EPS,
        weight_decay_mode=WeightDecayMode.DECOUPLE,
        pooling_mode=getattr(PoolingMode, pooling),
    )
    for a, b in zip(plain.split_embedding_weights(), weights0):
        a[...] = b
    for (per_feature, _), dy in zip(batches, grads):
        lens = [len(bag) for bags in per_feature for bag in bags]
        plain(
            np.array([r for bags in per_feature for bag in bags for r in bag], np.int64),
            np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        )
        plain.backward(dy.astype(np.float32))
    assert not all(np.allclose(a, b) for a, b in zip(plain.split_embedding_weights(), face.split_embedding_weights()))


def test_global_weight_decay_state_names_eval_and_refusals():
    face = make([(6, 4)], [0], 0, 0.0, "SUM")
    assert face.optimizer_state_names() == ("sum", "prev_iter")
    assert set(face.get_optimizer_state()[0]) == {"sum", "prev_iter", "iter"}
    idx, off = np.array([1, 2]), np.array([0, 1, 2])
    face(idx, off)
    face.backward(np.ones((2, 4), np.float32))
    face.iter[0] = 9  # rows 1, 2 were updated at iteration 1
    face.eval()
    before = np.array(face.split_embedding_weights()[0])
    out = face(idx, off)  # iteration 10: an eval forward applies no decay
    np.testing.assert_array_equal(out, before[[1, 2]])
    face.train()
    out = face(idx, off)  # iteration 11: the 9 iterations 2..10 missed
    np.testing.assert_allclose(out, before[[1, 2]] * (1 - LR * WD) ** 9, rtol=1e-5)
    face.update_hyper_parameters({"lower_bound": 0.5})
    assert face.gwd_lower_bound == 0.5
    with pytest.raises(ValueError, match="DECOUPLE_GLOBAL"):
        ArrayTBE(
            [(6, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            optimizer=OptimType.EXACT_ADAGRAD,
            weight_decay_mode=WeightDecayMode.DECOUPLE_GLOBAL,
            global_weight_decay=GlobalWeightDecayDefinition(),
        )
    with pytest.raises(NotImplementedError, match="PoolingMode.NONE"):
        make([(6, 4)], [0], 0, 0.0, "NONE")
    with pytest.raises(NotImplementedError, match="MANAGED_CACHING"):
        ArrayTBE(
            [(6, 4, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA)],
            optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
            weight_decay_mode=WeightDecayMode.DECOUPLE_GLOBAL,
            global_weight_decay=GlobalWeightDecayDefinition(),
        )


def _gwd_face(n_features=1, bounds="WARNING", lr=0.1, wd=0.5):
    from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_training import BoundsCheckMode

    face = ArrayTBE(
        [(4, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        [0] * n_features,
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=lr,
        weight_decay=wd,
        eps=1e-8,
        weight_decay_mode=WeightDecayMode.DECOUPLE_GLOBAL,
        bounds_check_mode=getattr(BoundsCheckMode, bounds),
        global_weight_decay=GlobalWeightDecayDefinition(start_iter=0, lower_bound=0.0),
    )
    face.split_embedding_weights()[0][...] = 1.0
    return face


def _gwd_step(face, idx, backward=True):
    """One forward of one bag per feature (idx: a row per feature) and, by default, its backward with a zero
    gradient (the update then only decays: DECOUPLE's (1 - lr wd) and the global decay)."""
    out = np.array(face(np.array(idx, np.int64), np.arange(len(idx) + 1, dtype=np.int64)))
    if backward:
        face.backward(np.zeros(out.shape, np.float32))
    return out


def test_global_weight_decay_forward_without_backward_changes_no_table():
    """FBGEMM's forward only scales the rows it reads; the backward decays the rows and sets prev_iter. A
    training forward that no backward follows (a no_grad pass in training mode) must leave the tables and
    prev_iter as they were."""
    base = 1 - 0.1 * 0.5
    face = _gwd_face()
    _gwd_step(face, [0])  # it 1: row 0 updated (prev_iter 1), w = base
    for _ in range(3):
        _gwd_step(face, [1])  # its 2..4: row 0 not read
    rows, prev = np.array(face.split_embedding_weights()[0]), np.array(face.split_optimizer_states()[0][1])
    out5 = _gwd_step(face, [0], backward=False)  # it 5: forward only
    np.testing.assert_allclose(out5[0], base * base**3, rtol=1e-6)
    np.testing.assert_array_equal(face.split_embedding_weights()[0], rows)
    np.testing.assert_array_equal(face.split_optimizer_states()[0][1], prev)
    out6 = _gwd_step(face, [0])  # it 6: row 0 missed iterations 2..5
    np.testing.assert_allclose(out6[0], base * base**4, rtol=1e-6)
    np.testing.assert_allclose(face.split_embedding_weights()[0][0], base**6, rtol=1e-6)
    assert face.split_optimizer_states()[0][1][0] == 6


def test_global_weight_decay_reads_the_rows_the_bounds_check_repairs():
    """Under WARNING an index outside its table reads row 0 (FBGEMM's bounds check rewrites it): row 0 is read
    with its missed decay, decayed and updated, and its prev_iter set, as for an index of 0."""
    base = 1 - 0.1 * 0.5
    face = _gwd_face(bounds="WARNING")
    _gwd_step(face, [0])
    for _ in range(3):
        _gwd_step(face, [1])
    with pytest.warns(Warning):
        out5 = _gwd_step(face, [99])  # it 5: 99 -> row 0
    np.testing.assert_allclose(out5[0], base * base**3, rtol=1e-6)
    np.testing.assert_allclose(face.split_embedding_weights()[0][0], base**5, rtol=1e-6)
    assert face.split_optimizer_states()[0][1][0] == 5
    np.testing.assert_allclose(_gwd_step(face, [0])[0], base**5, rtol=1e-6)  # it 6: nothing missed


def test_global_weight_decay_failed_forward_leaves_the_tables_untouched():
    """FATAL: a bad index in the second feature raises; the first feature's rows and prev_iter stay as they
    were (FBGEMM checks before any kernel reads or writes)."""
    from numbactr.embedding.engine import EmbeddingBoundsError

    face = _gwd_face(n_features=2, bounds="FATAL")
    _gwd_step(face, [0, 1])
    for _ in range(3):
        _gwd_step(face, [2, 2])
    rows, prev = np.array(face.split_embedding_weights()[0]), np.array(face.split_optimizer_states()[0][1])
    with pytest.raises(EmbeddingBoundsError):
        face(np.array([0, 99], np.int64), np.array([0, 1, 2], np.int64))
    np.testing.assert_array_equal(face.split_embedding_weights()[0], rows)
    np.testing.assert_array_equal(face.split_optimizer_states()[0][1], prev)
    # a backward whose gradient has the wrong shape fails before any row or prev_iter changes
    face(np.array([0, 1], np.int64), np.array([0, 1, 2], np.int64))
    with pytest.raises(Exception):
        face.backward(np.zeros((1, 3), np.float32))
    np.testing.assert_array_equal(face.split_embedding_weights()[0], rows)
    np.testing.assert_array_equal(face.split_optimizer_states()[0][1], prev)


def test_global_weight_decay_needs_a_weight_decay():
    """FBGEMM takes the global-decay path only with weight_decay > 0: with 0, prev_iter is never written, so
    rows are not decayed later for iterations before a weight decay was set."""
    face = _gwd_face(wd=0.0)
    _gwd_step(face, [0])
    assert not np.any(face.split_optimizer_states()[0][1])
    face.update_hyper_parameters({"weight_decay": 0.5})
    for _ in range(3):
        _gwd_step(face, [1])
    # row 0 was never recorded: read undecayed at iteration 5, then decayed by the update's (1 - lr wd) only
    np.testing.assert_allclose(_gwd_step(face, [0])[0], 1.0, rtol=1e-6)
    np.testing.assert_allclose(face.split_embedding_weights()[0][0], 1 - 0.1 * 0.5, rtol=1e-6)
    assert face.split_optimizer_states()[0][1][0] == 5


def test_torch_module_global_weight_decay_buffers_and_round_trip():
    torch = pytest.importorskip("torch")
    from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    kw = dict(
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        weight_decay=WD,
        weight_decay_mode=WeightDecayMode.DECOUPLE_GLOBAL,
        global_weight_decay=GlobalWeightDecayDefinition(),
    )
    mod = SplitTableBatchedEmbeddingBagsCodegen([(6, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], **kw)
    mod.init_embedding_weights_uniform(-1, 1)
    arr = make([(6, 4)], [0], 0, 0.0, "SUM")
    arr.split_embedding_weights()[0][...] = mod.split_embedding_weights()[0].numpy()
    for step in range(5):
        rows = [0, 1] if step % 2 else [2, 0]
        idx, off = np.array(rows), np.array([0, 1, 2])
        out = mod(torch.from_numpy(idx), torch.from_numpy(off))
        out.backward(torch.ones_like(out))
        arr(idx, off)
        arr.backward(np.ones((2, 4), np.float32))
    np.testing.assert_array_equal(mod.split_embedding_weights()[0].numpy(), arr.split_embedding_weights()[0])
    assert {"prev_iter_host", "momentum1_host", "iter"} <= set(mod.state_dict())
    assert set(mod.get_optimizer_state()[0]) == {"sum", "prev_iter", "iter"}
    again = SplitTableBatchedEmbeddingBagsCodegen([(6, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], **kw)
    again.load_state_dict(mod.state_dict())
    np.testing.assert_array_equal(again.split_optimizer_states()[0][1].numpy(), arr.split_optimizer_states()[0][1])


@pytest.mark.parametrize("pooling,wd", [("SUM", 0.01), ("MEAN", 0.0)])
def test_lars_sgd_follows_fbgemms_template(pooling, wd):
    """Per touched row: rate = lr eta |w| / (|g| + wd |w|), m = momentum m + rate (g + wd w), w -= m; the
    row's g is its summed gradient; FBGEMM's forward counts no iteration for LARS_SGD."""
    lr, eta, mom = 0.5, 0.01, 0.9
    specs, ftm = [(7, 8), (5, 4)], [0, 1, 0]
    face = ArrayTBE(
        [(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in specs],
        ftm,
        optimizer=OptimType.LARS_SGD,
        learning_rate=lr,
        eta=eta,
        momentum=mom,
        weight_decay=wd,
        pooling_mode=getattr(PoolingMode, pooling),
    )
    face.init_embedding_weights_uniform(-1, 1)
    w = [np.array(x, np.float64) for x in face.split_embedding_weights()]
    m = [np.zeros_like(x) for x in w]
    rng = np.random.default_rng(3)
    batch = 4
    for _ in range(4):
        lens = rng.integers(0, 3, len(ftm) * batch)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        feat = np.repeat(np.arange(len(ftm) * batch) // batch, lens)
        indices = np.array([rng.integers(0, specs[ftm[f]][0]) for f in feat], np.int64)
        out = face(indices, offsets)
        dy = rng.standard_normal(out.shape).astype(np.float32)
        face.backward(dy)
        grads = [dict() for _ in specs]
        cols = np.concatenate([[0], np.cumsum([specs[t][1] for t in ftm])])
        for k, (f, r) in enumerate(zip(feat, indices)):
            bag = np.searchsorted(offsets, k, side="right") - 1
            scale = 1.0 / lens[bag] if pooling == "MEAN" else 1.0
            t = ftm[f]
            grads[t][r] = grads[t].get(r, 0.0) + scale * dy[bag % batch, cols[f] : cols[f + 1]].astype(np.float64)
        for t, rows in enumerate(grads):
            for r, g in rows.items():
                wn, gn = np.linalg.norm(w[t][r]), np.linalg.norm(g)
                rate = lr * eta * wn / (gn + wd * wn)
                m[t][r] = mom * m[t][r] + rate * (g + wd * w[t][r])
                w[t][r] = w[t][r] - m[t][r]
    for t in range(len(specs)):
        np.testing.assert_allclose(face.split_embedding_weights()[t], w[t], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(face.split_optimizer_states()[t][0], m[t], rtol=1e-4, atol=1e-7)
    assert int(face.iter[0]) == 0  # no iteration counted, as FBGEMM
    with pytest.raises(NotImplementedError, match="(?i)lars_sgd"):
        face.get_optimizer_state()
