"""Shared by the engine tests: random lookups, engines built alike under two implementations, and the
comparisons (float32 to rounding, float16 weights to one float16 step: stochastic rounding of two float32
values that differ in their last bit may pick different neighbours)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from numbactr.embedding.engine import (
    BoundsCheck,
    CounterRegularization,
    CounterWeightDecay,
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

GLOBAL_KINDS = (Optim.HUGECTR_ADAM, Optim.HUGECTR_MOMENTUM_SGD, Optim.HUGECTR_NESTEROV)


def updates_of(kind) -> list:
    ups = [UpdateType.LOCAL]
    if kind in GLOBAL_KINDS:
        ups.append(UpdateType.GLOBAL)
    if kind == Optim.HUGECTR_ADAM:
        ups.append(UpdateType.LAZY_GLOBAL)
    return ups


#: every (optimizer, update type, weight-decay mode) the engine runs
OPTIMIZER_CASES = [
    (k, u, m)
    for k in Optim
    for u in updates_of(k)
    for m in (tuple(WeightDecay) if k == Optim.EXACT_ROWWISE_ADAGRAD else (WeightDecay.NONE,))
]

#: the counter settings a Case uses for COUNTER / COWCLIP unless it names its own: COUNTER decoupled decay
#: with a halflife, the tail-id learning-rate decrease above a ratio threshold of max_counter, renewed every
#: step, after an adjustment iteration; COWCLIP with L2 decay and an every-step-reset counter
COUNTER_DEFAULTS = {
    WeightDecay.COUNTER: CounterRegularization(
        CounterWeightDecay.DECOUPLE,
        halflife=2,
        adjustment_iter=1,
        adjustment_ub=0.5,
        learning_rate_mode=1,
        tail_id_threshold=0.3,
        tail_id_threshold_is_ratio=True,
        max_counter_update_freq=1,
    ),
    WeightDecay.COWCLIP: CounterRegularization(
        CounterWeightDecay.L2, halflife=0, max_counter_update_freq=-1, weight_norm_coefficient=0.5, lower_bound=1e-3
    ),
}


@dataclass
class Case:
    """An engine configuration and the lookups of a few training steps."""

    tables: list
    fmap: list
    pooling: Pooling = Pooling.SUM
    layout: Layout = Layout.FEATURE_MAJOR
    kind: Optim = Optim.EXACT_SGD
    update: UpdateType = UpdateType.LOCAL
    wd_mode: WeightDecay = WeightDecay.NONE
    weights: Precision = Precision.FP32
    output: Precision = Precision.FP32
    bounds: BoundsCheck = BoundsCheck.IGNORE
    max_norm: float = 0.0
    clip: bool = False
    steps: list = field(default_factory=list)  # [(indices, offsets, per_sample_weights or None, dy_seed)]
    counter: CounterRegularization | None = None  # COUNTER / COWCLIP settings (default: COUNTER_DEFAULTS)
    rowwise_bias_correction: bool = False  # ADAM

    def engine(self, impl: str) -> TableBatchedEmbedding:
        decay = (
            0.01
            if self.kind in (Optim.ADAM, Optim.LAMB, Optim.PARTIAL_ROWWISE_ADAM, Optim.PARTIAL_ROWWISE_LAMB)
            or self.wd_mode != WeightDecay.NONE
            else 0.0
        )
        opt = OptimizerSpec(
            self.kind,
            learning_rate=0.05,
            weight_decay=decay,
            weight_decay_mode=self.wd_mode,
            update_type=self.update,
            momentum=0.9,
            beta2=0.99,
            scaler=2.0,
            initial_accumulator=0.1,
            max_norm=self.max_norm,
            gradient_clipping=self.clip,
            max_gradient=0.5,
            counter=self.counter or COUNTER_DEFAULTS.get(self.wd_mode),
            rowwise_bias_correction=self.rowwise_bias_correction,
        )
        e = TableBatchedEmbedding(
            self.tables,
            self.fmap,
            pooling=self.pooling,
            layout=self.layout,
            optimizer=opt,
            weights_precision=self.weights,
            output_dtype=self.output,
            bounds_check=self.bounds,
            seed=11,
            impl=impl,
        )
        e.init_uniform(-0.5, 0.5, seed=4)
        return e


def random_steps(rng, tables, fmap, n_steps=2, batch=3, max_len=3, psw=True, bad=False) -> list:
    """Lookups for n_steps: ragged and empty bags, repeated rows within and across features, -1 rows."""
    steps = []
    for s in range(n_steps):
        lens = rng.integers(0, max_len + 1, size=len(fmap) * batch)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        n = int(offsets[-1])
        low = min(TableSpec(*t).rows if not isinstance(t, TableSpec) else t.rows for t in tables)
        hi = low + 2 if bad else max(low, 1)
        indices = rng.integers(-1, hi, size=n).astype(np.int64)  # few rows: duplicates are frequent
        weights = rng.normal(size=n).astype(np.float32) if psw else None
        steps.append((indices, offsets, weights, s))
    return steps


#: the weight and output precisions a training case draws (INT8 weights are forward only:
#: tests/test_engine_int8.py)
TRAINED_PRECISIONS = [Precision.FP32, Precision.FP16]


@st.composite
def cases(draw, kinds=None, keyed=False):
    """A small random Case for hypothesis."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    pooling = draw(st.sampled_from(list(Pooling)))
    n_tables = draw(st.integers(1, 3))
    dims = (
        [draw(st.integers(1, 9))] * n_tables
        if pooling == Pooling.NONE
        else [draw(st.integers(1, 9)) for _ in range(n_tables)]
    )
    tables = [(draw(st.integers(1, 6)), d) for d in dims]
    fmap = draw(st.lists(st.integers(0, n_tables - 1), min_size=1, max_size=4))
    kind, update, wd = draw(
        st.sampled_from(OPTIMIZER_CASES if kinds is None else [c for c in OPTIMIZER_CASES if c[0] in kinds])
    )
    case = Case(
        tables,
        fmap,
        pooling=pooling,
        layout=draw(st.sampled_from(list(Layout))),
        kind=kind,
        update=update,
        wd_mode=wd,
        weights=draw(st.sampled_from(TRAINED_PRECISIONS)),
        output=draw(st.sampled_from(TRAINED_PRECISIONS)),
        max_norm=draw(st.sampled_from([0.0, 0.7])),
        clip=draw(st.booleans()),
    )
    case.steps = random_steps(rng, tables, fmap, psw=draw(st.booleans()))
    return case


def half_ulp(x) -> np.ndarray:
    """The float16 spacing at x (one step to the next float16 away from zero)."""
    a = np.abs(np.asarray(x, np.float16))
    return np.nextafter(a, np.float16(np.inf)).astype(np.float64) - a.astype(np.float64)


def assert_weights_close(got, want, precision, rtol=2e-5, atol=2e-6, what="weights", steps=1) -> None:
    """float32: to rounding; float16: within `steps` float16 steps (one possible flip per update)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if precision == Precision.FP16:
        tol = 1.01 * steps * np.maximum(half_ulp(got), half_ulp(want)) + 1e-7
    else:
        tol = atol + rtol * np.abs(want)
    bad = np.abs(got - want) > tol
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} differ: got {got[bad][:4]}, want {want[bad][:4]}"


def run(case: Case, impl: str, dtype_out=np.float32) -> tuple:
    """(engine, outputs, grads) after the case's steps; dy of step s is N(0, 1) from seed s."""
    e = case.engine(impl)
    outs, grads = [], []
    for indices, offsets, psw, seed in case.steps:
        out, ctx = e.forward(indices, offsets, psw)
        outs.append(np.asarray(out, np.float64))
        dy = np.random.default_rng(seed).normal(size=out.shape).astype(dtype_out)
        grads.append(e.backward(ctx, dy))
    return e, outs, grads


def assert_same_training(case: Case, a: tuple, b: tuple) -> None:
    """Engines a and b (from run) agree on outputs, per-sample-weight gradients, weights and states."""
    (ea, outs_a, grads_a), (eb, outs_b, grads_b) = a, b
    fp16 = case.weights == Precision.FP16 or case.output == Precision.FP16
    for oa, ob in zip(outs_a, outs_b):
        # outputs are computed from weights that may already differ by a float16 step
        np.testing.assert_allclose(oa, ob, rtol=2e-2 if fp16 else 2e-5, atol=2e-2 if fp16 else 2e-6)
    for ga, gb in zip(grads_a, grads_b):
        if ga.per_sample_weights is not None:
            np.testing.assert_allclose(
                ga.per_sample_weights, gb.per_sample_weights, rtol=2e-2 if fp16 else 2e-5, atol=5e-2 if fp16 else 2e-5
            )
        if ga.sparse is not None:
            for (ra, va), (rb, vb) in zip(ga.sparse.per_table(), gb.sparse.per_table()):
                np.testing.assert_array_equal(ra, rb)
                np.testing.assert_allclose(va, vb, rtol=2e-5, atol=2e-6)
    for wa, wb in zip(ea.split_weights(), eb.split_weights()):
        assert_weights_close(wa, wb, case.weights, steps=len(case.steps))
    if case.weights == Precision.FP32:
        for sa, sb in zip(ea.split_optimizer_states(), eb.split_optimizer_states()):
            for x, y in zip(sa, sb):
                np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=1e-4, atol=1e-6)
