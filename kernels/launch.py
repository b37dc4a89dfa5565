"""Launch configuration shared by every kernel module.

Every kernel is a grid-stride loop, so any grid computes the same result: the simulator gets a tiny
grid (threads are Python threads there, ~0.2 ms each), a GPU gets a full one.
"""
from __future__ import annotations

import functools
import math

from numba import config, cuda

SIMULATED = bool(config.ENABLE_CUDASIM)

#: threads per block for elementwise/grid-stride kernels
THREADS = 32 if SIMULATED else 256
#: threads per block for kernels that reduce in shared memory (a power of two, <= 1024)
REDUCE_THREADS = 32 if SIMULATED else 256
MAX_THREADS_PER_BLOCK = 1024


@functools.lru_cache(maxsize=None)
def _sm_count() -> int:
    if SIMULATED:
        return 1
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def check_block_size(tpb: int) -> None:
    """Block sizes of shared-memory tree reductions: a power of two in 1..1024."""
    if tpb < 1 or tpb > MAX_THREADS_PER_BLOCK or tpb & (tpb - 1):
        raise ValueError(f"block size (tpb) must be a power of two in 1..{MAX_THREADS_PER_BLOCK}, got {tpb}")


def grid_1d(n: int, threads: int | None = None) -> tuple[int, int]:
    """(blocks, threads) for a grid-stride loop over n items; n must be > 0."""
    threads = threads or THREADS
    if not 0 < threads <= MAX_THREADS_PER_BLOCK:
        raise ValueError(f"threads per block must be in 1..{MAX_THREADS_PER_BLOCK}, got {threads}")
    need = math.ceil(n / threads)
    cap = 2 if SIMULATED else 32 * _sm_count()
    return max(1, min(need, cap)), threads


def launch_1d(kernel, n: int, *args, threads: int | None = None) -> None:
    """Launch ``kernel[blocks, threads](*args)`` sized for n items; does nothing when n == 0."""
    if n <= 0:
        return
    blocks, tpb = grid_1d(n, threads)
    kernel[blocks, tpb](*args)


def launch_rows(kernel, rows: int, *args, threads: int | None = None) -> None:
    """One block per row (grid-stride over rows), for kernels reducing a row in shared memory."""
    if rows <= 0:
        return
    tpb = threads or REDUCE_THREADS
    cap = 2 if SIMULATED else 32 * _sm_count()
    kernel[max(1, min(rows, cap)), tpb](*args)
