"""Run under ``mpiexec -n 2`` with NUMBACTR_DEVICE=gpu (tests/test_gpu_select.py): each rank takes its own GPU
from its local rank, and Comm's device collectives (allreduce_sum float32/float16, alltoallv) give the same
results by NCCL (one GPU per rank) or by host-staged MPI (ranks sharing a GPU). Prints one line per rank."""

import numbactr  # noqa: F401  (first: starts MPI, resolves nothing yet)
from numbactr.runtime import device
from numbactr.distributed.comm import world

import cupy
import numpy as np
from numba import cuda

comm = world()
assert device.kind() == "gpu", device.describe()
gpu = device.gpu_index()
pl = comm.placement
want_gpu = pl.local_rank % len(cuda.gpus)
assert gpu == want_gpu == cupy.cuda.Device().id, (gpu, want_gpu, cupy.cuda.Device().id)
transport, why = comm.transport()
expect = "nccl" if len(cuda.gpus) >= pl.local_size else "mpi"
assert transport == expect, (transport, why, len(cuda.gpus))
R, r = comm.size, comm.rank
for dt in (np.float32, np.float16):
    x = cupy.arange(1000, dtype=dt) % 7 + r
    comm.allreduce_sum(x)
    want = sum(np.arange(1000) % 7 + q for q in range(R)).astype(dt)
    np.testing.assert_array_equal(x.get(), want)
# alltoallv: rank r sends (d + 1) * (r + 1) rows of width 3 to rank d, each row filled with 100 r + d
parts = [cupy.full(((d + 1) * (r + 1), 3), 100 * r + d, dtype=cupy.float32) for d in range(R)]
got = comm.alltoallv(parts)
assert len(got) == R
for s, g in enumerate(got):
    assert isinstance(g, cupy.ndarray)
    assert g.shape == ((r + 1) * (s + 1), 3), (s, g.shape)
    assert bool((g == 100 * s + r).all())
print(f"rank {r}: GPU {gpu} transport {transport} ok", flush=True)
