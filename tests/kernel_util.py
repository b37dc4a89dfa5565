"""Helpers shared by kernel tests: run on sim (or gpu), compare with references."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from numba import config

SIMULATED = bool(config.ENABLE_CUDASIM)


def dev(a: np.ndarray):
    """A 'device' copy of a host array: the numpy array itself in the simulator, cupy on a GPU."""
    if SIMULATED:
        return np.ascontiguousarray(a).copy()
    import cupy

    return cupy.asarray(a)


def host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def empty_like_dev(a):
    return dev(np.zeros_like(np.asarray(a) if SIMULATED else host(a)))


def f32_arrays(shape, lo=-10.0, hi=10.0):
    return hnp.arrays(np.float32, shape, elements=st.floats(lo, hi, width=32, allow_nan=False, allow_infinity=False))
