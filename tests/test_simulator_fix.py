"""Numba's simulator gives all threads of a block one cuda.shared.array per source line (kernels/_simulator_fix.py).

The race in the simulator's own code needs a thread switch between "no array yet" and "store mine". These
tests make every allocation slow (np.empty sleeps, which lets the block's other threads run), so without
the lock the threads of a block would each see no array and make their own: deterministic, not a timing
game. test_fix_is_needed shows the simulator's unpatched code failing under the same conditions.
"""
from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest
from numba import cuda, float32

import numbactr.kernels  # noqa: F401  (installs the fix)
from numbactr.kernels import _simulator_fix
from tests.kernel_util import SIMULATED

pytestmark = pytest.mark.skipif(not SIMULATED, reason="a fix for Numba's CUDA simulator")


class _SlowEmpty:
    """Stands in for the numpy module: empty() sleeps first, everything else is numpy's."""
    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(*a, **k):
        time.sleep(0.002)
        return np.empty(*a, **k)


@pytest.fixture
def slow_allocation(monkeypatch):
    from numba.cuda.simulator import kernelapi
    monkeypatch.setattr(kernelapi, "np", _SlowEmpty())
    monkeypatch.setattr(_simulator_fix, "np", _SlowEmpty())


def _arrays_seen_by_threads(array_method, n=16):
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    shared = FakeCUDAShared(0)
    got = [None] * n
    go = threading.Barrier(n)

    def run(i):
        go.wait()
        got[i] = id(array_method(shared, 8, np.float32))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return got


def test_fix_is_installed():
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    assert FakeCUDAShared.array is _simulator_fix._locked_shared_array
    assert _simulator_fix.apply() is True                  # idempotent


def test_fix_is_needed(slow_allocation):
    # the simulator's own method under the same slow allocation: the threads disagree
    assert len(set(_arrays_seen_by_threads(_simulator_fix._original))) > 1


def test_every_thread_gets_the_one_array(slow_allocation):
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    assert len(set(_arrays_seen_by_threads(FakeCUDAShared.array))) == 1


@cuda.jit
def _reverse_through_shared(x, out):
    a = cuda.shared.array(32, float32)
    b = cuda.shared.array(32, float32)     # another line: another array
    t = cuda.threadIdx.x
    a[t] = x[cuda.blockIdx.x, t]
    b[t] = -x[cuda.blockIdx.x, t]
    cuda.syncthreads()
    out[cuda.blockIdx.x, t] = a[31 - t] + 10.0 * b[t]


def test_kernel_sees_one_shared_array_per_line(slow_allocation):
    x = np.arange(3 * 32, dtype=np.float32).reshape(3, 32)
    out = np.zeros_like(x)
    _reverse_through_shared[3, 32](x, out)
    np.testing.assert_array_equal(out, x[:, ::-1] - 10.0 * x)
