"""One rank fails in a chosen way; tests/test_rank_failures.py checks how the whole job ends.

    mpiexec -n R python tests/mpi/rank_fault.py TRAIN_LIST EVAL_LIST FAULT RANK STEP OTHERS [THREADS]

Every rank trains the tiny DLRM of tests/model_util.py for 4 steps; rank RANK does FAULT before step STEP
(STEP -1: right after ``import numbactr``, before any Model exists). From STEP on the other ranks either
go on training (OTHERS=train: they need the failed rank in their next collective) or work for 10 minutes
without any collective (OTHERS=away: only an abort at once ends the job in time).

FAULT: raise (RuntimeError), exit3 (sys.exit(3)), exit0 (sys.exit(0)), os_exit4 (os._exit(4)), sigkill,
flood_raise (2 MB to stdout, then raise), stall_raise (raise while the launcher's proxy, this process's
parent, is stopped for 1 s, so that the traceback and the abort wait in it together), extra (one
collective more than the others), clean_end (a normal end: RANK finishes 3 s after the others, and every
rank catches a sys.exit(5), finalizes MPI itself and ends with sys.exit(0)).
THREADS: mpi4py's thread level (default multiple; with less the guard has no watchdog thread).
"""

import os
import signal
import subprocess
import sys
import time

os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import mpi4py  # noqa: E402
import numpy as np  # noqa: E402

mpi4py.rc.thread_level = sys.argv[7] if len(sys.argv) > 7 else "multiple"
import numbactr as hugectr  # noqa: E402  (under mpiexec the guard starts here)
from numbactr.distributed.comm import world  # noqa: E402
from tests.model_util import tiny_dlrm  # noqa: E402

TRAIN, EVAL, FAULT, WHO, AT, OTHERS = sys.argv[1:7]
WHO, AT = int(WHO), int(AT)
comm = world()


def fail():
    if FAULT in ("raise", "flood_raise", "stall_raise"):
        if FAULT == "flood_raise":
            os.write(1, b"rank %d logs a line before it fails\n" % comm.rank * 60000)
        if FAULT == "stall_raise":
            proxy = os.getppid()
            subprocess.Popen(
                [sys.executable, "-c", f"import os, signal, time; time.sleep(1); os.kill({proxy}, signal.SIGCONT)"]
            )
            os.kill(proxy, signal.SIGSTOP)
        raise RuntimeError(f"planted failure on rank {comm.rank} at step {AT}")
    if FAULT in ("exit3", "exit0"):
        sys.exit(int(FAULT[-1]))
    if FAULT == "os_exit4":
        os._exit(4)
    if FAULT == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError(f"unknown fault {FAULT!r}")


def at_step(step):
    if step != AT:
        return
    if comm.rank == WHO:
        fail()
    elif OTHERS == "away":
        time.sleep(600)


at_step(-1)
model = tiny_dlrm(TRAIN, EVAL, batch=12, lr=0.05, optimizer=hugectr.Optimizer_t.SGD, update=hugectr.Update_t.Local)
for step in range(4):
    at_step(step)
    assert model.train()
if FAULT == "extra" and comm.rank == WHO:
    comm.allreduce_sum(np.ones(1))
print(f"rank {comm.rank} finished training", flush=True)
if FAULT == "clean_end":
    if comm.rank == WHO:
        time.sleep(3)
    try:
        sys.exit(5)
    except SystemExit:
        pass
    from mpi4py import MPI

    MPI.Finalize()
    sys.exit(0)
