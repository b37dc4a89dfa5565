"""How the compiled CPU versions of the dense ops (numba.njit) split their work.

Shared by the compiled sections of kernels/interaction.py, relu.py, bias.py, fused_bias_act.py and by
kernels/optimizers_cpu.py:
  * work is cut into chunks of a fixed size (never by the thread count), and a reduction adds one partial
    per chunk in chunk order: 1 or N threads give the same bits;
  * an op smaller than PARALLEL_MIN elements runs its chunks in the calling thread: waking numba's workers
    costs more than the work (a 4096 x 128 bias add took 0.03 ms alone and 0.2 ms as a 2-thread region on
    the busy 2-core sandbox);
  * loops walk 0-based views (x[lo:hi], y[m]): an index that may be negative makes numba test it for
    wraparound on every access, which keeps LLVM from vectorizing (measured 3-9x slower).
"""
from __future__ import annotations

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


#: no kernels here (compiled CPU code only)
PTX_CHECKS = []
