"""The engine's row operations (kernels/tbe_row_ops.py: scale_rows, lerp_halves; FBGEMM's global weight decay
and EMA in place) and what the FBGEMM face reads around them (touched_rows, row_state, copy_rows /
restore_rows): the numba.cuda kernels in the simulator and the compiled CPU code against the NumPy
reference, bit for bit, on random tiny tables of both precisions."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numbactr.runtime import device
from numbactr.embedding.engine import (
    BoundsCheck,
    Layout,
    Optim,
    OptimizerSpec,
    Precision,
    TableBatchedEmbedding,
    WeightDecay,
    lerp_halves_of,
)
from numbactr.kernels import tbe_row_ops as RO

PRECISIONS = [Precision.FP32, Precision.FP16]


def _engine(dims, rows, precision, impl, seed=3, **kw):
    eng = TableBatchedEmbedding(
        list(zip(rows, dims)),
        weights_precision=precision,
        impl=impl,
        seed=seed,
        optimizer=OptimizerSpec(Optim.EXACT_SGD),
        **kw,
    )
    eng.init_uniform(-2.0, 2.0, seed)
    return eng


def _weights(eng) -> list:
    return [np.array(device.to_host(w)) for w in eng.split_weights()]


def _assert_same_bits(a: list, b: list) -> None:
    for x, y in zip(a, b):
        np.testing.assert_array_equal(
            x.view(np.uint16 if x.dtype == np.float16 else np.uint32),
            y.view(np.uint16 if y.dtype == np.float16 else np.uint32),
        )


@st.composite
def tables(draw, even: bool = False):
    n = draw(st.integers(1, 3))
    dims = [draw(st.integers(1, 5)) * (2 if even else 1) + (0 if even else draw(st.integers(0, 1))) for _ in range(n)]
    rows = [draw(st.integers(0, 5)) for _ in range(n)]
    if sum(rows) == 0:
        rows[0] = 1
    return dims, rows, draw(st.sampled_from(PRECISIONS))


def _scale_case(total: int, seed: int):
    rng = np.random.default_rng(seed)
    rows = rng.permutation(total)[: rng.integers(0, total + 1)].astype(np.int64)
    factors = rng.uniform(-3.0, 3.0, rows.shape[0]).astype(np.float32)
    factors[rng.random(rows.shape[0]) < 0.2] = np.float32(1e5)  # float16 overflow: inf, as NumPy's cast
    return rows, factors


def _check_scale(impl: str, dims, rows, precision, seed: int) -> None:
    eng, ref = _engine(dims, rows, precision, impl), _engine(dims, rows, precision, "ref")
    lin, factors = _scale_case(int(sum(rows)), seed)
    with np.errstate(over="ignore"):
        eng.scale_rows(device.xp().asarray(lin), device.xp().asarray(factors))
        RO.scale_rows_ref(ref.weights, ref.elem_offsets, ref.strides, ref.dims, ref.row_offsets, lin, factors)
    _assert_same_bits(_weights(eng), _weights(ref))


def _check_lerp(impl: str, dims, rows, precision, coef: float) -> None:
    eng, ref = _engine(dims, rows, precision, impl), _engine(dims, rows, precision, "ref")
    eng.lerp_halves(coef)
    views = _weights(ref)
    lerp_halves_of(views, coef)
    _assert_same_bits(_weights(eng), views)


# ---- kernels (simulator) against the reference ------------------------------------------------------
kernels_only = pytest.mark.skipif(not device.uses_kernels(), reason="needs the sim or gpu device")


@kernels_only
@settings(max_examples=12, deadline=None)
@given(case=tables(), seed=st.integers(0, 2**16))
def test_scale_rows_kernel_matches_reference(case, seed):
    _check_scale("kernels", *case, seed)


@kernels_only
@settings(max_examples=12, deadline=None)
@given(case=tables(even=True), coef=st.sampled_from([0.0, 0.3, 0.5, 0.6, 1.0, -0.25, 1.5]))
def test_lerp_halves_kernel_matches_reference(case, coef):
    _check_lerp("kernels", *case, coef)


# ---- compiled CPU against the reference -------------------------------------------------------------
@settings(max_examples=12, deadline=None)
@given(case=tables(), seed=st.integers(0, 2**16))
def test_scale_rows_cpu_matches_reference(case, seed):
    device.set_device("cpu")  # (the autouse _restore_device switches back)
    _check_scale("cpu", *case, seed)


@settings(max_examples=12, deadline=None)
@given(case=tables(even=True), coef=st.sampled_from([0.0, 0.3, 0.5, 0.6, 1.0, -0.25, 1.5]))
def test_lerp_halves_cpu_matches_reference(case, coef):
    device.set_device("cpu")
    _check_lerp("cpu", *case, coef)


# ---- the reference itself, and the engine's plumbing ------------------------------------------------
def test_references_by_hand():
    """scale_rows multiplies each listed row (and nothing else) in float32; lerp_halves is torch.lerp_'s
    formula: a + c (b - a) below 1/2, b - (b - a)(1 - c) from 1/2 on."""
    w = np.arange(12, dtype=np.float32)  # two tables: 2 rows of 2 (stride 4), 1 row of 4
    elem_off, strides, dims, row_off = (np.array(x, np.int64) for x in ([0, 8, 12], [4, 4], [2, 4], [0, 2, 3]))
    RO.scale_rows_ref(w, elem_off, strides, dims, row_off, np.array([2, 0]), np.array([0.5, -1.0], np.float32))
    np.testing.assert_array_equal(w, [-0.0, -1, 2, 3, 4, 5, 6, 7, 4, 4.5, 5, 5.5])
    v = np.array([[1.0, 3.0, 2.0, 7.0]], np.float32)
    RO.lerp_rows_ref(v, 0.25)
    np.testing.assert_array_equal(v, [[1.0, 3.0, 2.0 + 0.25 * (1.0 - 2.0), 7.0 + 0.25 * (3.0 - 7.0)]])
    v = np.array([[1.0, 3.0, 2.0, 7.0]], np.float32)
    RO.lerp_rows_ref(v, 0.75)
    np.testing.assert_array_equal(v, [[1.0, 3.0, 1.0 - (1.0 - 2.0) * 0.25, 3.0 - (3.0 - 7.0) * 0.25]])


@pytest.mark.parametrize("impl", ["ref", "cpu", "kernels"])
@pytest.mark.parametrize("layout", list(Layout))
def test_touched_rows_state_and_copy_restore(impl, layout):
    """touched_rows: the distinct linear rows a lookup reads after the bounds check (a bad index reads row 0
    under IGNORE; -1 reads nothing); row_state: the flat per-row state; copy_rows / restore_rows round trip."""
    if impl == "kernels" and not device.uses_kernels():
        pytest.skip("needs the sim or gpu device")
    if impl != "kernels" and device.kind() == "gpu":
        pytest.skip("host impls")
    eng = TableBatchedEmbedding(
        [(5, 3), (4, 6)],
        [0, 1, 0],
        layout=layout,
        impl=impl,
        bounds_check=BoundsCheck.IGNORE,
        optimizer=OptimizerSpec(
            Optim.EXACT_ROWWISE_ADAGRAD, weight_decay_mode=WeightDecay.DECOUPLE, prev_iter_state=True
        ),
    )
    eng.init_uniform(-1, 1, 5)
    xp = device.xp()
    # B = 2: bags in the layout's order; feature 1 reads table 1 (rows 5..8), features 0 and 2 table 0
    per_bag = {(0, 0): [1, 1], (0, 1): [4], (1, 0): [3, 9], (1, 1): [], (2, 0): [-1], (2, 1): [2, 1]}
    order = sorted(
        per_bag,
        key=(lambda fb: fb[0] * 2 + fb[1]) if layout == Layout.FEATURE_MAJOR else (lambda fb: fb[1] * 3 + fb[0]),
    )
    idx = [i for fb in order for i in per_bag[fb]]
    off = np.concatenate([[0], np.cumsum([len(per_bag[fb]) for fb in order])])
    ctx = eng.lookup(xp.asarray(np.array(idx, np.int64)), xp.asarray(off.astype(np.int64)))
    got = device.to_host(eng.touched_rows(ctx))
    np.testing.assert_array_equal(got, [1, 2, 4, 5 + 0, 5 + 3])  # index 9 of table 1 (4 rows) reads row 0
    out = eng.pool(ctx)
    want, _ = eng.forward(xp.asarray(np.array(idx, np.int64)), xp.asarray(off.astype(np.int64)))
    np.testing.assert_array_equal(device.to_host(out), device.to_host(want))
    prev = eng.row_state("prev_iter")
    assert prev.shape == (9,)
    with pytest.raises(KeyError):
        eng.row_state("row_counter")
    before = _weights(eng)
    lin = xp.asarray(np.array([0, 6, 8], np.int64))
    saved = eng.copy_rows(lin)
    eng.scale_rows(lin, xp.asarray(np.array([2.0, 3.0, -1.0], np.float32)))
    after = _weights(eng)
    np.testing.assert_array_equal(after[0][0], before[0][0] * 2)
    np.testing.assert_array_equal(after[1][[1, 3]], before[1][[1, 3]] * np.array([[3.0], [-1.0]], np.float32))
    np.testing.assert_array_equal(after[0][1:], before[0][1:])
    eng.restore_rows(lin, saved)
    _assert_same_bits(_weights(eng), before)


def test_row_ops_refuse_what_they_cannot_do():
    eng = TableBatchedEmbedding([(3, 3)], optimizer=OptimizerSpec(Optim.EXACT_SGD))
    with pytest.raises(ValueError, match="even"):
        eng.lerp_halves(0.5)
    with pytest.raises(ValueError, match="rows"):
        eng.scale_rows(device.xp().zeros(2, np.int64), device.xp().ones(3, np.float32))
