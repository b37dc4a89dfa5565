"""Numba's simulator gives all threads of a block one cuda.shared.array per source line (kernels/_simulator_fix.py).

The race in the simulator's own code needs a thread switch between "no array yet" and "store mine".
test_fix_is_needed shows the simulator's unpatched code failing: its np.empty waits until every thread of the
block has called it, so each thread is sure to have seen no array first (a barrier, not a timing game: an
earlier version slept 2 ms there instead, and on a loaded CI machine the other threads were not scheduled
within the sleep, so every thread found the first one's array and the test failed). The fixed code cannot
be tested that way (it calls np.empty once, under its lock, and the barrier would only time out): its
tests make every allocation slow (np.empty sleeps, which lets the block's other threads run), so any window
the lock left open would show.
"""

from __future__ import annotations

import threading
import time

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


class _GatheringEmpty:
    """Stands in for the numpy module: empty() returns once `n` threads are in it (or after 10 s)."""

    def __init__(self, n):
        self.gate = threading.Barrier(n)

    def __getattr__(self, name):
        return getattr(np, name)

    def empty(self, *a, **k):
        try:
            self.gate.wait(timeout=10)
        except threading.BrokenBarrierError:
            pass
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
        got[i] = array_method(shared, 8, np.float32)  # held: a freed array's id could be reused

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return [id(a) for a in got]


def test_fix_is_installed():
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    assert FakeCUDAShared.array is _simulator_fix._locked_shared_array
    assert _simulator_fix.apply() is True  # idempotent


def test_fix_is_needed(monkeypatch):
    # the simulator's own method: every thread checks for the array before any stores one, so all 16 make
    # their own, and the block's threads disagree about its "shared" array
    from numba.cuda.simulator import kernelapi

    monkeypatch.setattr(kernelapi, "np", _GatheringEmpty(16))
    assert len(set(_arrays_seen_by_threads(_simulator_fix._original, n=16))) == 16


def test_every_thread_gets_the_one_array(slow_allocation):
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    assert len(set(_arrays_seen_by_threads(FakeCUDAShared.array))) == 1


@cuda.jit
def _reverse_through_shared(x, out):
    a = cuda.shared.array(32, float32)
    b = cuda.shared.array(32, float32)  # another line: another array
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
