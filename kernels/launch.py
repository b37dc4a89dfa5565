"""Launch configuration shared by every kernel module.

Every kernel is a grid-stride loop, so any grid computes the same result: the simulator gets a tiny
grid (threads are Python threads there, ~0.2 ms each), a GPU gets a full one.
"""
from __future__ import annotations

import functools
import math

from numba import config, cuda

SIMULATED = bool(config.ENABLE_CUDASIM)

#: kernel launches and device-to-host reads since reset_counts(): a training step's counts are tested
#: on the sim device, so a launch or a host synchronization added to the step shows without a GPU.
#: Launches go through the helpers below (or count_launch); host reads through numbactr.runtime.device.to_host.
COUNTS = {"launches": 0, "host_reads": 0}


#: the stream every launch of the kernel modules goes to: 0 (the default stream) unless ``on_stream``
#: names another (numbactr.train.cuda_graphs captures a training step on its own stream)
_STREAM = [0]


def current_stream():
    return _STREAM[0]


class on_stream:
    """``with on_stream(s):`` launches go to the numba stream s (e.g. ``cuda.external_stream(cupy_stream.ptr)``)."""

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        self.prev, _STREAM[0] = _STREAM[0], self.stream
        return self.stream

    def __exit__(self, *exc):
        _STREAM[0] = self.prev
        return False


def launch(kernel, grid, block, *args, shared: int = 0) -> None:
    """``kernel[grid, block, stream, shared](*args)`` on the current stream, counted: for kernels whose grid
    the helpers below do not size."""
    count_launch()
    kernel[grid, block, _STREAM[0], shared](*args)


def count_launch(n: int = 1) -> None:
    COUNTS["launches"] += n


def count_host_read(n: int = 1) -> None:
    COUNTS["host_reads"] += n


def reset_counts() -> dict:
    """Zero the counters; returns the counts before the reset."""
    before = dict(COUNTS)
    COUNTS.update(launches=0, host_reads=0)
    return before

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
    count_launch()
    kernel[blocks, tpb, _STREAM[0]](*args)


def launch_rows(kernel, rows: int, *args, threads: int | None = None) -> None:
    """One block per row (grid-stride over rows), for kernels reducing a row in shared memory."""
    if rows <= 0:
        return
    tpb = threads or REDUCE_THREADS
    cap = 2 if SIMULATED else 32 * _sm_count()
    count_launch()
    kernel[max(1, min(rows, cap)), tpb, _STREAM[0]](*args)


def lanes_for(width: int) -> int:
    """Threads along a row of `width` elements: the power of two >= width, between 4 and 32 (a warp),
    so consecutive threads read consecutive elements of one row (coalesced) and a warp never splits
    across more rows than it must. The simulator uses at most 4."""
    lanes = 4
    while lanes < width and lanes < 32:
        lanes *= 2
    return min(lanes, 4) if SIMULATED else lanes


def block_rows(lanes: int) -> int:
    """Items per block of a lanes kernel (blocks of THREADS threads; 8 in the simulator)."""
    return max(1, (8 if SIMULATED else THREADS) // lanes)


def launch_lanes(kernel, items: int, lanes: int, *args) -> None:
    """Launch ``kernel[blocks, (lanes, block_rows(lanes))](*args)``: threadIdx.x walks the elements of
    one item (a bag, a row), threadIdx.y picks the item, grid-stride over `items`; nothing when items == 0."""
    if items <= 0:
        return
    rows = block_rows(lanes)
    cap = 2 if SIMULATED else 32 * _sm_count()
    count_launch()
    kernel[max(1, min(math.ceil(items / rows), cap)), (lanes, rows), _STREAM[0]](*args)
