"""kernels/block.py: the shared tree reductions, called from a test kernel in the simulator."""
import functools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numba import cuda, float32

from numbactr.kernels.block import block_sum, block_sum2, block_sum_ref


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
