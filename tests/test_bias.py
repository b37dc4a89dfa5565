import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.kernels import bias
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host


@st.composite
def matrix_and_bias(draw, max_rows=12, max_cols=12):
    m = draw(st.integers(0, max_rows))
    n = draw(st.integers(1, max_cols))
    return draw(f32_arrays((m, n))), draw(f32_arrays((n,)))


@given(yb=matrix_and_bias())
def test_bias_add_kernel_matches_ref(yb):
    y, b = yb
    d_y = dev(y)
    bias.bias_add(d_y, dev(b))
    np.testing.assert_array_equal(host(d_y), bias.bias_add_ref(y, b))


@given(
    yb=matrix_and_bias(max_rows=40, max_cols=11), chunk=st.integers(1, 9), gx=st.integers(1, 3), gy=st.integers(1, 3)
)
def test_bias_grad_kernel_any_grid_matches_ref(yb, chunk, gx, gy):
    """Coalesced tiles over row chunks, the chunks' partial sums added in order: the column sums to rounding,
    the same bits at any grid."""
    dy, _ = yb
    got = []
    for grid in ((gx, gy), (1, 1)):
        db = dev(np.full(dy.shape[1], np.nan, np.float32))  # must be overwritten
        bias.bias_grad(dev(dy), db, chunk=chunk, grid=grid)
        got.append(host(db).copy())
    np.testing.assert_allclose(got[0], bias.bias_grad_ref(dy.astype(np.float64)), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(got[0], got[1])


@pytest.mark.parametrize("m", [0, 1, 2, 33])
def test_bias_grad_wrapper_small_row_counts(m):
    dy = np.arange(m * 3, dtype=np.float32).reshape(m, 3)
    db = dev(np.full(3, np.nan, np.float32))
    bias.bias_grad(dev(dy), db)
    np.testing.assert_allclose(host(db), dy.sum(axis=0), rtol=1e-6)


def test_bias_grad_more_rows_than_a_chunk():
    rng = np.random.default_rng(1)
    dy = rng.normal(size=(300, 2)).astype(np.float32)
    db = dev(np.zeros(2, np.float32))
    bias.bias_grad(dev(dy), db)
    np.testing.assert_allclose(host(db), dy.astype(np.float64).sum(axis=0), rtol=1e-5, atol=1e-4)


def test_bias_wrappers_accept_3d_and_empty():
    y = np.ones((2, 3, 4), np.float32)
    b = np.arange(4, dtype=np.float32)
    d_y = dev(y)
    bias.bias_add(d_y, dev(b))
    np.testing.assert_array_equal(host(d_y), y + b)
    db = dev(np.zeros(4, np.float32))
    bias.bias_grad(dev(y), db)
    np.testing.assert_array_equal(host(db), np.full(4, 6, np.float32))
    bias.bias_add(dev(np.zeros((0, 4), np.float32)), dev(b))  # no launch
    bias.bias_grad(dev(np.zeros((5, 0), np.float32)), dev(np.zeros(0, np.float32)))


def test_bias_wrappers_reject_width_mismatch():
    with pytest.raises(ValueError):
        bias.bias_add(np.zeros((2, 3), np.float32), np.zeros(4, np.float32))
    with pytest.raises(ValueError):
        bias.bias_grad(np.zeros((2, 3), np.float32), np.zeros(4, np.float32))


def test_bias_reference_gradient():
    rng = np.random.default_rng(0)
    y = rng.normal(size=(6, 5))
    b = rng.normal(size=5)
    dy = rng.normal(size=(6, 5))
    assert_grad_close(bias.bias_grad_ref(dy), lambda bb: bias.bias_add_ref(y, bb), b, dy)


@pytest.mark.gpu
@given(m=st.integers(0, 70000), n=st.integers(1, 1100), seed=st.integers(0, 2**32 - 1))
def test_bias_on_gpu(m, n, seed):
    rng = np.random.default_rng(seed)
    y = rng.normal(size=(m, n)).astype(np.float32)
    b = rng.normal(size=n).astype(np.float32)
    d_y = dev(y)
    bias.bias_add(d_y, dev(b))
    np.testing.assert_array_equal(host(d_y), bias.bias_add_ref(y, b))
    db = dev(np.full(n, np.nan, np.float32))
    bias.bias_grad(dev(y), db)
    np.testing.assert_allclose(host(db), bias.bias_grad_ref(y.astype(np.float64)), rtol=1e-4, atol=1e-3)
