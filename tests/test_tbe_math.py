"""kernels/tbe_math.py: the float16 conversions the engine's fp16 tables use (compiled for the cpu path by
kernels/tbe_cpu.py, for the kernels by kernels/tbe.py) against NumPy's IEEE float16, and stochastic
rounding's expectation. The optimizer rules of tbe_math are tested through the engine (test_engine_*)."""

import numpy as np
from hypothesis import given, strategies as st

from numbactr.kernels import tbe_cpu as T


def test_half_to_float_is_numpys_for_every_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    got = np.array([T.half_to_float(np.uint16(b)) for b in bits], np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # -0.0 included


EDGES = [
    0.0,
    -0.0,
    65504.0,
    65519.99,
    65520.0,
    -65520.0,
    1e9,
    np.inf,
    -np.inf,
    2.0**-24,
    2.0**-25,
    3 * 2.0**-26,
    2.0**-14,
    2.0**-14 - 2.0**-25,
    1.0 + 2.0**-11,
    1.0 + 3 * 2.0**-11,
    1e-30,
]


@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
def test_nearest_even_is_numpys_float16(xs):
    xs = np.array(xs + EDGES, np.float32)
    with np.errstate(over="ignore"):  # beyond 65504: inf, as IEEE says
        want = xs.astype(np.float16).view(np.uint16)
    got = np.array([T.float_to_half_bits(x, np.uint64(0), False) for x in xs], np.uint16)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(np.uint16(T.float_to_half_bits(np.float32(np.nan), np.uint64(0), False)).view(np.float16))


@given(st.floats(min_value=-60000.0, max_value=60000.0, width=32, allow_subnormal=True))
def test_stochastic_rounding_is_unbiased_between_the_two_neighbours(x):
    x = np.float32(x)
    n = 4096
    hashes = (np.arange(n, dtype=np.uint64) * np.uint64((1 << 24) // n)) << np.uint64(40)  # u = k/n, evenly
    vals = np.array([np.uint16(T.float_to_half_bits(x, h, True)).view(np.float16) for h in hashes], np.float64)
    lo = (
        np.float64(np.float16(x))
        if np.float16(x) <= x
        else np.float64(np.nextafter(np.float16(x), np.float16(-np.inf)))
    )
    hi = lo if lo == x else np.float64(np.nextafter(np.float16(lo), np.float16(np.inf)))
    assert set(np.unique(vals)) <= {lo, hi}  # only the two float16 neighbours of x
    if hi != lo:  # E[value] = x, to the grid of u
        assert abs(vals.mean() - np.float64(x)) <= (hi - lo) / n + 1e-12
