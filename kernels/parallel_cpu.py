"""How the compiled CPU versions of the dense ops (numba.njit) split their work.

Shared by the compiled sections of kernels/interaction.py, relu.py, bias.py, fused_bias_act.py and by
kernels/optimizers_cpu.py:
  * work is cut into chunks of a fixed size (never by the thread count), and a reduction adds one partial
    per chunk in chunk order: 1 or N threads give the same bits;
  * an op smaller than PARALLEL_MIN elements runs its chunks in the calling thread: waking numba's workers
    costs more than the work (a 4096 x 128 bias add took 0.03 ms alone and 0.2 ms as a 2-thread region on
    the busy 2-core sandbox);
  * loops walk 0-based views (x[lo:hi], y[m]): an index that may be negative makes numba test it for
    wraparound on every access, which keeps LLVM from vectorizing (measured 3-9x slower);
  * every parallel function is a ``pjit`` twin: compiled with parallel=True and, beside it, without; a call
    from Python runs the serial twin when numba runs one thread. Even with one thread a prange loop is a
    parallel region, and under the workqueue layer (numbactr.threads picks it: its workers sleep) a region
    costs a worker's wake-up: 92 us per region on this sandbox (omp: 1 us), against 0.2 us for the same
    loop compiled serially; the engine's backward opens seven of them. Chunks do not depend on the thread
    count, so both twins give the same bits.
"""
from __future__ import annotations

import functools
import types

import numba
from numba import float32, njit

FLAT_CHUNK = 1 << 14      # elements per chunk of a flat elementwise op
ROW_CHUNK = 256           # rows per chunk of a row-wise op
PARALLEL_MIN = 1 << 20    # elements (or multiply-adds) below which an op runs in the calling thread


@njit(cache=True)
def sum_partials(part, out):
    """out (N,) = the rows of part (chunks, N) added in order."""
    for k in range(out.shape[0]):
        out[k] = float32(0.0)
    for c in range(part.shape[0]):
        p = part[c]
        for k in range(out.shape[0]):
            out[k] += p[k]


class ParallelTwin:
    """A function compiled twice, ``parallel`` (njit(parallel=True)) and ``serial`` (njit, prange as range),
    each compiled on first use; calling it from Python runs the serial twin when numba runs one thread in
    the calling thread (numba.get_num_threads()), else the parallel one. The serial twin is a copy of the
    function under the name <name>_serial, so the two keep separate entries in Numba's on-disk cache (its
    index does not tell the parallel flag apart)."""

    def __init__(self, fn, opts: dict):
        self.py_func = fn
        self.parallel = njit(parallel=True, **opts)(fn)
        twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__,
                                  fn.__closure__)
        twin.__qualname__ = fn.__qualname__ + "_serial"
        twin.__module__, twin.__doc__ = fn.__module__, fn.__doc__
        self.serial = njit(**opts)(twin)
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        return (self.serial if numba.get_num_threads() == 1 else self.parallel)(*args)

    @property
    def signatures(self) -> list:
        """The signatures compiled so far, in either twin."""
        return list(self.serial.signatures) + list(self.parallel.signatures)


def pjit(**opts):
    """Decorator: a ParallelTwin of the function with njit options opts (cache=True, fastmath...; not
    parallel, which the twin sets)."""
    opts.pop("parallel", None)
    return lambda fn: ParallelTwin(fn, opts)


#: no kernels here (compiled CPU code only)
PTX_CHECKS = []
