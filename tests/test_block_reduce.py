"""kernels/block_reduce.py: the shared tree reductions, called from a test kernel in the simulator."""

import functools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numba import cuda, float32

from numbactr.kernels.block_reduce import block_sum, block_sum2, block_sum_ref


@functools.lru_cache(maxsize=None)
def make(tpb):
    @cuda.jit
    def k(x, out):
        a = cuda.shared.array(tpb, float32)
        b = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        acc = float32(0.0)
        for i in range(t, x.shape[0], tpb):
            acc += x[i]
        a[t] = acc
        b[t] = float32(2.0) * acc
        block_sum2(a, b, t, tpb)
        c = a[0] + b[0]
        cuda.syncthreads()
        a[t] = acc
        block_sum(a, t, tpb)
        if t == 0:
            out[0] = a[0]
            out[1] = c

    return k


@pytest.mark.parametrize("tpb", [1, 2, 32, 64])
@given(n=st.integers(0, 300), seed=st.integers(0, 9))
def test_block_sums_match_reference(tpb, n, seed):
    x = np.random.default_rng(seed).normal(size=n).astype(np.float32)
    out = np.zeros(2, np.float32)
    make(tpb)[1, tpb](x, out)
    assert out[0] == pytest.approx(block_sum_ref(x), abs=1e-4)
    assert out[1] == pytest.approx(3 * block_sum_ref(x), abs=1e-4)


@functools.lru_cache(maxsize=None)
def make_mean_var(tpb):
    from numbactr.kernels.block_reduce import column_mean_var, row_mean_var

    @cuda.jit
    def k(x, col_out, row_out):
        part = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        for f in range(x.shape[1]):
            mu, var = column_mean_var(x, f, part, t, tpb)
            if t == 0:
                col_out[0, f] = mu
                col_out[1, f] = var
        for r in range(x.shape[0]):
            mu, var = row_mean_var(x, r, part, t, tpb)
            if t == 0:
                row_out[0, r] = mu
                row_out[1, r] = var

    return k


@pytest.mark.parametrize("tpb", [1, 4, 32])
@given(b=st.integers(1, 40), f=st.integers(1, 5), seed=st.integers(0, 9))
def test_mean_var_helpers_match_reference(tpb, b, f, seed):
    from numbactr.kernels.block_reduce import mean_var_ref

    x = np.random.default_rng(seed).normal(2.0, 3.0, (b, f)).astype(np.float32)
    col, row = np.zeros((2, f), np.float32), np.zeros((2, b), np.float32)
    make_mean_var(tpb)[1, tpb](x, col, row)
    np.testing.assert_allclose(col, np.stack(mean_var_ref(x, 0)), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(row, np.stack(mean_var_ref(x, 1)), rtol=1e-4, atol=1e-4)


@functools.lru_cache(maxsize=None)
def make_sum_max(tpb):
    from numbactr.kernels.block_reduce import block_max

    @cuda.jit
    def k(x, out):
        a = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        acc = float32(0.0)
        m = float32(-1e30)
        for i in range(t, x.shape[0], tpb):
            acc += x[i]
            m = max(m, x[i])
        a[t] = acc
        block_sum(a, t, tpb)
        if t == 0:
            out[0] = a[0]
        cuda.syncthreads()
        a[t] = m
        block_max(a, t, tpb)
        if t == 0:
            out[1] = a[0]

    return k


@pytest.mark.parametrize("tpb", [1, 3, 6, 12, 32])
@given(n=st.integers(1, 200), seed=st.integers(0, 9))
def test_block_sum_and_max_take_any_block_size(tpb, n, seed):
    x = np.random.default_rng(seed).normal(size=n).astype(np.float32)
    out = np.zeros(2, np.float32)
    make_sum_max(tpb)[1, tpb](x, out)
    assert out[0] == pytest.approx(block_sum_ref(x), abs=1e-4)
    assert out[1] == x.max()


@functools.lru_cache(maxsize=None)
def make_lane_sum(rows, lanes):
    from numbactr.kernels.block_reduce import lane_sum

    @cuda.jit
    def k(x, out):
        sh = cuda.shared.array((rows, lanes), float32)
        ty, tx = cuda.threadIdx.y, cuda.threadIdx.x
        acc = float32(0.0)
        for i in range(tx, x.shape[1], lanes):
            acc += x[ty, i]
        s = lane_sum(sh, ty, tx, acc, lanes)
        out[ty, tx] = s  # every lane of the row gets the row's sum

    return k


@pytest.mark.parametrize("rows,lanes", [(1, 1), (2, 4), (3, 32)])
@given(n=st.integers(0, 70), seed=st.integers(0, 9))
def test_lane_sum_gives_every_lane_its_rows_sum(rows, lanes, n, seed):
    x = np.random.default_rng(seed).normal(size=(rows, n)).astype(np.float32)
    out = np.full((rows, lanes), np.nan, np.float32)
    make_lane_sum(rows, lanes)[1, (lanes, rows)](x, out)
    for r in range(rows):
        np.testing.assert_allclose(out[r], block_sum_ref(x[r]), atol=1e-4)
