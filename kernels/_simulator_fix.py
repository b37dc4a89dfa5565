"""A fix for a data race in Numba's CUDA simulator (numba-cuda 0.30), applied when the simulator is on.

The simulator runs every CUDA thread of a block as a Python thread. ``cuda.shared.array(shape, dtype)``
returns the block's array for the calling source line, created by whichever thread gets there first::

    res = allocations.get(line)          # thread A: None
    if res is None:                      # (the interpreter may switch threads here)
        res = np.empty(shape, dtype)     # thread B: also None, makes its own array
        allocations[line] = res

Two threads that both see no array each make one, and the block's threads then disagree about which array
is "shared": the writes of one never reach the others, exactly as if a ``syncthreads`` had failed. It is
rare (a switch must fall in that window of the first call of a launch), so on a loaded machine it showed as
a different simulator test failing in each full run: a scan with wrong partial sums, a bias gradient off in
one column, a layer-norm variance below zero. tests/test_simulator_fix.py makes the race likely and
checks that every thread gets the one array.

The replacement below does the lookup and the insertion under one lock, and finds the caller's line with
``sys._getframe`` (the key the simulator uses: file name and line number of the caller). Dynamic shared
memory (``shape == 0``) has no race and keeps the simulator's own code.
"""
from __future__ import annotations

import sys
import threading

import numpy as np

_lock = threading.Lock()


def _locked_shared_array(self, shape, dtype, alignment=None):
    from numba.np import numpy_support
    from numba.core import types
    if shape == 0 or alignment is not None:
        return _original(self, shape, dtype, alignment)       # dynamic memory / the simulator's own error
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    frame = sys._getframe(1)
    key = (frame.f_code.co_filename, frame.f_lineno)
    with _lock:
        res = self._allocations.get(key)
        if res is None:
            res = np.empty(shape, dtype)
            self._allocations[key] = res
    return res


_original = None


def apply() -> bool:
    """Install the locked ``shared.array`` into the simulator; True when the simulator is on (idempotent)."""
    global _original
    from numba import config
    if not config.ENABLE_CUDASIM:
        return False
    from numba.cuda.simulator import kernelapi
    cls = kernelapi.FakeCUDAShared
    if cls.array is not _locked_shared_array:
        _original = cls.array
        cls.array = _locked_shared_array
    return True


PTX_CHECKS = []   # no kernels: a patch of the simulator's host code
