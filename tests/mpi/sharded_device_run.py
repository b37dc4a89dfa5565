"""tests/mpi/embedding_sharded_run.py with the sharded tables' device-path exchanges
(numbactr.embedding.sharded.exchange_on_device) on every rank, whatever the device:

    mpiexec -n R python tests/mpi/sharded_device_run.py OUT.npz [force|auto]

force (the default): the device path runs on the cpu device too (its arrays are NumPy's, exchanged by
MPI), which checks its gathers, splits and scatter against the one-rank run without a GPU. auto: the
path the job picks (NCCL on GPUs of their own). Each rank prints how many lookups took the device path."""

import os
import runpy
import sys

os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import numbactr  # noqa: E402,F401  (first: starts MPI)
from numbactr.distributed.comm import world  # noqa: E402
from numbactr.embedding import sharded  # noqa: E402

mode = sys.argv[2] if len(sys.argv) > 2 else "force"
if mode == "force":
    sharded.exchange_on_device = lambda comm: comm.size > 1
used = {"device": 0}
on_device = sharded.ShardedTable._lookup_on_device


def counted(self, *args, **kwargs):
    used["device"] += 1
    return on_device(self, *args, **kwargs)


sharded.ShardedTable._lookup_on_device = counted
sys.argv = [os.path.join(HERE, "embedding_sharded_run.py"), sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
comm = world()
print(f"rank {comm.rank}: device-path lookups {used['device']} transport {comm.transport()[0]}", flush=True)
