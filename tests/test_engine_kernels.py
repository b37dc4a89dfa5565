"""The engine's numba.cuda kernels (kernels/tbe.py, run in the simulator here, on a GPU with -m gpu) equal
the NumPy reference: every optimizer's fused update over several steps, FP16 stochastic rounding in
distribution, bounds-check modes, keyed tables; and a training step's launches and host reads are
counted so that a new launch or host synchronization shows without a GPU."""

import numpy as np
import pytest

from numbactr.runtime import device
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
)
from numbactr.kernels import launch
from tests.engine_cases import OPTIMIZER_CASES, Case, assert_same_training, random_steps, run

pytestmark = pytest.mark.skipif(not device.uses_kernels(), reason="needs the sim or gpu device")


@pytest.mark.parametrize(
    "kind,update,wd_mode", OPTIMIZER_CASES, ids=[f"{k.name}-{u.name}-{m.name}" for k, u, m in OPTIMIZER_CASES]
)
def test_fused_update_equals_reference_for_every_optimizer(kind, update, wd_mode):
    rng = np.random.default_rng(int(kind) * 3 + int(update))
    tables, fmap = [(6, 5), (4, 3)], [0, 1, 0]
    case = Case(
        tables,
        fmap,
        kind=kind,
        update=update,
        wd_mode=wd_mode,
        pooling=Pooling.MEAN,
        max_norm=0.9,
        clip=True,
        steps=random_steps(rng, tables, fmap, n_steps=2, batch=2),
    )
    assert_same_training(case, run(case, "ref"), run(case, "kernels"))


def _weights_and_states(engine) -> list:
    return [np.asarray(w).copy() for w in engine.split_weights()] + [
        np.asarray(x).copy() for st in engine.split_optimizer_states() for x in st
    ]


@pytest.mark.parametrize(
    "kind,update,wd_mode", OPTIMIZER_CASES, ids=[f"{k.name}-{u.name}-{m.name}" for k, u, m in OPTIMIZER_CASES]
)
def test_update_kernel_compiled_for_the_optimizer_equals_the_generic_one(kind, update, wd_mode, monkeypatch):
    """The engine launches the update kernel compiled for its optimizer kind and weight-decay mode
    (kernels.tbe.make_update_kernel's kind_const / wd_mode_const: the other kinds' branches folded away);
    it trains bit for bit as the kernel that reads them from ki."""
    from numbactr.kernels import tbe

    rng = np.random.default_rng(int(kind) * 5 + int(update) + 1)
    tables, fmap = [(6, 5), (4, 3)], [0, 1, 0]
    case = Case(
        tables,
        fmap,
        kind=kind,
        update=update,
        wd_mode=wd_mode,
        max_norm=0.9,
        steps=random_steps(rng, tables, fmap, n_steps=2, batch=2),
    )
    made, real = [], tbe.make_update_kernel

    def recording(*args):
        made.append(args[4:])
        return real(*args)

    monkeypatch.setattr(tbe, "make_update_kernel", recording)
    special = _weights_and_states(run(case, "kernels")[0])
    assert set(made) == {(int(kind), int(wd_mode))}
    monkeypatch.setattr(tbe, "make_update_kernel", lambda *args: real(*args[:4], -1, -1))
    generic = _weights_and_states(run(case, "kernels")[0])
    assert len(special) == len(generic)
    for a, b in zip(special, generic):
        np.testing.assert_array_equal(a, b)


def test_adam_rowwise_bias_correction_equals_reference():
    rng = np.random.default_rng(21)
    tables, fmap = [(6, 5), (4, 3)], [0, 1, 0]
    case = Case(
        tables,
        fmap,
        kind=Optim.ADAM,
        rowwise_bias_correction=True,
        steps=random_steps(rng, tables, fmap, n_steps=3, batch=2),
    )
    assert_same_training(case, run(case, "ref"), run(case, "kernels"))


@pytest.mark.parametrize(
    "pooling,layout,weights,output",
    [
        (Pooling.SUM, Layout.SAMPLE_MAJOR, Precision.FP16, Precision.FP16),
        (Pooling.NONE, Layout.FEATURE_MAJOR, Precision.FP16, Precision.FP32),
        (Pooling.NONE, Layout.SAMPLE_MAJOR, Precision.FP32, Precision.FP16),
    ],
)
def test_pooling_layout_precision_combinations(pooling, layout, weights, output):
    rng = np.random.default_rng(3)
    tables, fmap = [(5, 6), (7, 6)], [1, 0, 1]
    case = Case(
        tables,
        fmap,
        pooling=pooling,
        layout=layout,
        weights=weights,
        output=output,
        kind=Optim.PARTIAL_ROWWISE_LAMB,
        steps=random_steps(rng, tables, fmap, n_steps=2, batch=2),
    )
    assert_same_training(case, run(case, "ref"), run(case, "kernels"))


def test_fp16_stochastic_rounding_in_distribution_on_the_kernels():
    # 600 rows take the same SGD step of a quarter float16 step: about a quarter of them move up one step
    e = TableBatchedEmbedding(
        [(600, 1)],
        weights_precision=Precision.FP16,
        impl="kernels",
        optimizer=OptimizerSpec(Optim.EXACT_SGD, learning_rate=1.0),
    )
    e.split_weights()[0][:] = 1.0
    ulp = 2.0**-10
    out, ctx = e.forward(np.arange(600), np.arange(601))
    e.backward(ctx, np.full((600, 1), -0.25 * ulp, np.float32))
    w = device.to_host(e.split_weights()[0])[:, 0].astype(np.float64)
    assert set(np.unique(w)) == {1.0, 1.0 + ulp}
    assert abs(np.mean(w == 1.0 + ulp) - 0.25) < 4 * np.sqrt(0.25 * 0.75 / 600)


@pytest.mark.parametrize("mode", list(BoundsCheck))
def test_bounds_modes_on_the_kernels(mode):
    rng = np.random.default_rng(4)
    tables, fmap = [(4, 3), (9, 3)], [0, 1]
    steps = random_steps(rng, tables, fmap, n_steps=1, batch=3, bad=True)
    idx, offs, psw, seed = steps[0]
    offs = offs.copy()
    offs[2] = offs[3] + 1  # a decreasing pair of offsets
    case = Case(tables, fmap, bounds=mode, kind=Optim.EXACT_ADAGRAD, steps=[(idx, offs, psw, seed)])
    if mode == BoundsCheck.FATAL:
        for impl in ("ref", "kernels"):
            with pytest.raises(EmbeddingBoundsError, match=r"offsets\[3\] = "):
                run(case, impl)
        return
    if mode == BoundsCheck.WARNING:
        with pytest.warns(RuntimeWarning, match="outside its table") as w_ref:
            a = run(case, "ref")
        with pytest.warns(RuntimeWarning, match="outside its table") as w_k:
            b = run(case, "kernels")
        # the bounds warnings themselves (a cold compile may warn first, e.g. numba's own warnings)
        mine = [[str(x.message) for x in ws if "outside its table" in str(x.message)] for ws in (w_ref, w_k)]
        assert mine[0] and mine[0] == mine[1]
    else:
        a, b = run(case, "ref"), run(case, "kernels")
    assert_same_training(case, a, b)


def test_keyed_tables_on_the_kernels():
    keys = np.array([900, 2**63 + 5, 900, 17, 4, 17], np.uint64)
    got = []
    for impl in ("ref", "kernels"):
        e = TableBatchedEmbedding(
            [TableSpec(8, 4, keyed=True)],
            [0, 0],
            layout=Layout.SAMPLE_MAJOR,
            optimizer=OptimizerSpec(Optim.HUGECTR_ADAM, update_type=UpdateType.GLOBAL),
            impl=impl,
            seed=3,
        )
        out, ctx = e.forward(keys, np.array([0, 2, 3, 5, 6]))
        e.backward(ctx, np.ones(out.shape, np.float32))
        out2, ctx2 = e.forward(np.array([17, 555], np.uint64), np.array([0, 1, 1, 2, 2]), training=False)
        got.append((device.to_host(ctx.rows), device.to_host(ctx2.rows), device.to_host(e.split_weights()[0])))
    np.testing.assert_array_equal(got[0][0], [0, 1, 0, 2, 3, 2])
    np.testing.assert_array_equal(got[1][0], got[0][0])
    np.testing.assert_array_equal(got[1][1], [2, -1])
    np.testing.assert_allclose(got[1][2], got[0][2], rtol=1e-5, atol=1e-6)


def _step_counts(engine, idx, offs):
    launch.reset_counts()
    out, ctx = engine.forward(idx, offs)
    fwd = launch.reset_counts()
    engine.backward(ctx, np.ones(out.shape, np.float32))
    return fwd, launch.reset_counts()


def test_a_training_step_launches_a_fixed_number_of_kernels_and_reads_nothing_back():
    # 3 tables, 4 features, one launch per op for all of them; no host read in IGNORE mode
    e = TableBatchedEmbedding(
        [(9, 4), (5, 8), (7, 4)],
        [0, 1, 2, 0],
        bounds_check=BoundsCheck.IGNORE,
        optimizer=OptimizerSpec(Optim.EXACT_ROWWISE_ADAGRAD),
        impl="kernels",
    )
    idx = np.array([1, 2, 0, 4, 6, 3, 3, 8], np.int64)
    offs = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8], np.int64)
    fwd, bwd = _step_counts(e, idx, offs)
    # forward: clamp offsets, 3-phase max scan, check indices, lookup
    assert fwd == {"launches": 6, "host_reads": 0}
    # backward: linearize, sort, flags, 3-phase scan, segment starts, fused update
    assert bwd == {"launches": 8, "host_reads": 0}
    # the same counts for a bigger batch: nothing scales with the data
    fwd2, bwd2 = _step_counts(e, np.tile(idx, 5) % 5, np.arange(0, 41, 5, dtype=np.int64))
    assert (fwd2, bwd2) == (fwd, bwd)
    # WARNING reads the status back (one read); HugeCTR's Global adds its all-rows pass
    e.bounds_check = BoundsCheck.WARNING
    fwd3, _ = _step_counts(e, idx, offs)
    assert fwd3 == {"launches": 6, "host_reads": 1}
    g = TableBatchedEmbedding(
        [(9, 4)],
        [0, 0],
        bounds_check=BoundsCheck.NONE,
        impl="kernels",
        optimizer=OptimizerSpec(Optim.HUGECTR_ADAM, update_type=UpdateType.GLOBAL),
    )
    assert _step_counts(g, idx[:4], offs[:5])[1] == {"launches": 9, "host_reads": 0}
