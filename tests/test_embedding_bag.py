import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numbactr.kernels import embedding_bag as eb
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host

RTOL, ATOL = 1e-5, 1e-5


@st.composite
def bags(draw, max_bags=10, max_len=5, max_rows=8, max_d=6, missing=True):
    """(table (V, D) f32, rows (N,) i64 with optional -1, offsets (nbags+1,) i64, combiner)."""
    v = draw(st.integers(1, max_rows))
    d = draw(st.integers(1, max_d))
    lens = draw(st.lists(st.integers(0, max_len), min_size=0, max_size=max_bags))
    offsets = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int64)
    lo = -1 if missing else 0
    rows = draw(hnp.arrays(np.int64, int(offsets[-1]), elements=st.integers(lo, v - 1)))
    table = draw(f32_arrays((v, d)))
    combiner = draw(st.sampled_from([eb.SUM, eb.MEAN]))
    return table, rows, offsets, combiner


def run_forward(table, rows, offsets, combiner):
    out = dev(np.full((len(offsets) - 1, table.shape[1]), np.nan, np.float32))  # kernel writes all
    eb.embedding_bag_forward(dev(table), dev(rows), dev(offsets), combiner, out)
    return host(out)


def run_backward(dy, rows, offsets, combiner):
    """(unique_rows, grad) from the kernels, the way an embedding layer would call them."""
    uniq, local = eb.first_occurrence_index(rows)
    bag_ids = dev(np.full(rows.shape, -7, np.int64))
    eb.bag_of_key(dev(offsets), bag_ids)
    grad = dev(np.zeros((uniq.size, dy.shape[1]), np.float32))
    eb.embedding_bag_backward(dev(dy), dev(local), dev(offsets), bag_ids, combiner, grad)
    return uniq, host(grad)


# ---- kernels vs references -------------------------------------------------------------------
@given(case=bags())
def test_forward_kernel_matches_ref(case):
    table, rows, offsets, combiner = case
    np.testing.assert_allclose(
        run_forward(table, rows, offsets, combiner),
        eb.embedding_bag_forward_ref(table, rows, offsets, combiner),
        rtol=RTOL,
        atol=ATOL,
    )


@given(lens=st.lists(st.integers(0, 6), max_size=20))
def test_bag_of_key_kernel(lens):
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    bag_ids = dev(np.full(int(offsets[-1]), -7, np.int64))
    eb.bag_of_key(dev(offsets), bag_ids)
    np.testing.assert_array_equal(host(bag_ids), np.repeat(np.arange(len(lens)), lens))


@given(case=bags(), data=st.data())
def test_backward_kernel_matches_ref(case, data):
    table, rows, offsets, combiner = case
    dy = data.draw(f32_arrays((len(offsets) - 1, table.shape[1])))
    uniq, grad = run_backward(dy, rows, offsets, combiner)
    ref_uniq, ref_grad = eb.embedding_bag_backward_ref(dy, rows, offsets, combiner)
    np.testing.assert_array_equal(uniq, ref_uniq)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL)


# ---- explicit cases (numbers worked out by hand) ----------------------------------------------
TABLE = np.array([[1, 2], [10, 20], [100, 200]], np.float32)  # (V=3, D=2)
ROWS = np.array([2, 0, 0, -1, 1, 1, 2], np.int64)  # (N=7,)
OFFSETS = np.array([0, 1, 1, 4, 7], np.int64)  # bags: [2] [] [0,0,-1] [1,1,2]


def test_forward_by_hand():
    want_sum = np.array([[100, 200], [0, 0], [2, 4], [120, 240]], np.float32)
    want_mean = np.array([[100, 200], [0, 0], [2 / 3, 4 / 3], [40, 80]], np.float32)
    for combiner, want in ((eb.SUM, want_sum), (eb.MEAN, want_mean)):
        np.testing.assert_allclose(eb.embedding_bag_forward_ref(TABLE, ROWS, OFFSETS, combiner), want, rtol=1e-6)
        np.testing.assert_allclose(run_forward(TABLE, ROWS, OFFSETS, combiner), want, rtol=1e-6)


def test_first_occurrence_index():
    uniq, local = eb.first_occurrence_index(np.array([5, -1, 3, 5, 9, 3, -1], np.int64))
    np.testing.assert_array_equal(uniq, [5, 3, 9])
    np.testing.assert_array_equal(local, [0, -1, 1, 0, 2, 1, -1])
    assert uniq.dtype == np.int64 and local.dtype == np.int64


def test_backward_by_hand_duplicates_accumulate():
    dy = np.array([[1, 1], [5, 5], [3, 6], [30, 60]], np.float32)  # (nbags=4, D=2)
    # unique rows in first-seen order: 2, 0, 1.  sum: row 2 <- bag0 + bag3; row 0 <- 2 x bag2;
    # row 1 <- 2 x bag3.  mean: bag2 scaled 1/3 (the missing key counts), bag3 scaled 1/3.
    cases = {eb.SUM: [[31, 61], [6, 12], [60, 120]], eb.MEAN: [[11, 21], [2, 4], [20, 40]]}
    for combiner, want in cases.items():
        uniq, grad = eb.embedding_bag_backward_ref(dy, ROWS, OFFSETS, combiner)
        np.testing.assert_array_equal(uniq, [2, 0, 1])
        np.testing.assert_allclose(grad, want, rtol=1e-6)
        uniq, grad = run_backward(dy, ROWS, OFFSETS, combiner)
        np.testing.assert_allclose(grad, want, rtol=1e-6)


def test_empty_inputs():
    # no bags at all
    offsets0 = np.zeros(1, np.int64)
    assert run_forward(TABLE, np.zeros(0, np.int64), offsets0, eb.SUM).shape == (0, 2)
    # bags but no keys: every bag is a zero vector under both combiners; backward touches no row
    offsets = np.zeros(4, np.int64)
    for combiner in (eb.SUM, eb.MEAN):
        np.testing.assert_array_equal(run_forward(TABLE, np.zeros(0, np.int64), offsets, combiner), 0)
        uniq, grad = run_backward(np.ones((3, 2), np.float32), np.zeros(0, np.int64), offsets, combiner)
        assert uniq.size == 0 and grad.shape == (0, 2)


def test_all_keys_missing_gives_zero_and_no_gradient():
    rows = np.full(4, -1, np.int64)
    offsets = np.array([0, 3, 4], np.int64)
    np.testing.assert_array_equal(run_forward(TABLE, rows, offsets, eb.MEAN), 0)
    uniq, grad = run_backward(np.ones((2, 2), np.float32), rows, offsets, eb.MEAN)
    assert uniq.size == 0 and grad.shape == (0, 2)


def test_extreme_values_and_long_bag():
    # one bag of 300 duplicates of a large value: float32 accumulation stays within rtol
    table = np.array([[3.0e30, -1.0e-30]], np.float32)
    rows = np.zeros(300, np.int64)
    offsets = np.array([0, 300], np.int64)
    for combiner in (eb.SUM, eb.MEAN):
        np.testing.assert_allclose(
            run_forward(table, rows, offsets, combiner),
            eb.embedding_bag_forward_ref(table.astype(np.float64), rows, offsets, combiner),
            rtol=1e-4,
        )


def test_bad_combiner_rejected():
    with pytest.raises(ValueError):
        eb.embedding_bag_forward(TABLE, ROWS, OFFSETS, 2, np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError):
        eb.embedding_bag_forward_ref(TABLE, ROWS, OFFSETS, 2)


def test_kernel_correct_for_other_launch_shapes():
    # grid-stride: any grid gives the same answer (1 thread, odd block, several blocks)
    rng = np.random.default_rng(1)
    table = rng.normal(size=(6, 5)).astype(np.float32)
    rows = rng.integers(-1, 6, size=17).astype(np.int64)
    offsets = np.array([0, 3, 3, 9, 10, 17], np.int64)
    want = eb.embedding_bag_forward_ref(table, rows, offsets, eb.MEAN)
    for blocks, tpb in ((1, 1), (1, 7), (3, 4)):
        out = np.full((5, 5), np.nan, np.float32)
        eb.embedding_bag_forward_kernel[blocks, tpb](table, rows, offsets, eb.MEAN, out)
        np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL)


# ---- gradient check of the reference backward -------------------------------------------------
@pytest.mark.parametrize("combiner", [eb.SUM, eb.MEAN])
def test_reference_gradient(combiner):
    rng = np.random.default_rng(0)
    v, d = 6, 3
    table = rng.normal(size=(v, d))
    rows = np.array([4, 1, 1, -1, 0, 4, 2, 2, 2, 5], np.int64)  # row 3 never used
    offsets = np.array([0, 3, 3, 5, 6, 10], np.int64)  # one empty bag, one missing key
    dy = rng.normal(size=(len(offsets) - 1, d))
    uniq, grad = eb.embedding_bag_backward_ref(dy, rows, offsets, combiner)
    full = np.zeros((v, d))
    full[uniq] = grad  # scatter to the whole table
    assert_grad_close(full, lambda t: eb.embedding_bag_forward_ref(t, rows, offsets, combiner), table, dy)


# ---- a larger launch on a real GPU ------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("combiner", [0, 1])
def test_embedding_bag_on_gpu(combiner):
    rng = np.random.default_rng(2)
    v, d, nbags = 5000, 64, 4096
    lens = rng.integers(0, 8, size=nbags)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    rows = rng.integers(-1, v, size=int(offsets[-1])).astype(np.int64)
    table = rng.normal(size=(v, d)).astype(np.float32)
    dy = rng.normal(size=(nbags, d)).astype(np.float32)
    np.testing.assert_allclose(
        run_forward(table, rows, offsets, combiner),
        eb.embedding_bag_forward_ref(table, rows, offsets, combiner),
        rtol=1e-4,
        atol=1e-4,
    )
    uniq, grad = run_backward(dy, rows, offsets, combiner)
    ref_uniq, ref_grad = eb.embedding_bag_backward_ref(dy, rows, offsets, combiner)
    np.testing.assert_array_equal(uniq, ref_uniq)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-4)
