"""What the rank guard costs: the tiny DLRM's training step with numbactr's collectives and with others.

    mpiexec -n 2 python tests/mpi/guard_bench.py [ROUNDS]        # also -n 3 (oversubscribed on 2 cores)

In one job, rounds of 50 steps alternate between four ways to wait in the collectives, so every way
sees the same machine load:
  blocking  the plain blocking MPI calls numbactr used before the guard (nothing detects a departed rank)
  guarded   numbactr's: non-blocking call + MPI_Wait, the watchdog thread watching for departed ranks
  poll      rejected: MPI_Test in a loop for 2 ms, then sleeps of 10% of the time waited (<= 1 ms)
  waitany   rejected: one MPI_Waitany over the collective and the receive of departure notes
Rank 0 prints the median step time of each and the median over rounds of its ratio to blocking.
"""

import os
import sys
import tempfile
import time

os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import numbactr as hugectr  # noqa: E402
from numbactr.distributed.comm import world  # noqa: E402
from tests.model_util import tiny_data, tiny_dlrm  # noqa: E402

comm = world()
raw = comm._c


def blocking_allreduce_sum(x):
    raw.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    return x


def blocking_allgather_rows(x):
    x = np.ascontiguousarray(x)
    counts = np.array(raw.allgather(x.shape[0]), dtype=np.int64)
    width = int(np.prod(x.shape[1:], dtype=np.int64))
    out = np.empty((int(counts.sum()),) + x.shape[1:], dtype=x.dtype)
    raw.Allgatherv(x.reshape(-1), [out.reshape(-1), counts * width])
    return out


def blocking_alltoallv(parts, recv_rows=None):
    # (the counts are exchanged whether or not the caller knows them: they are the same)
    tail = parts[0].shape[1:]
    width = int(np.prod(tail, dtype=np.int64))
    send_counts = np.array([p.shape[0] for p in parts], dtype=np.int64)
    recv_counts = np.empty(comm.size, dtype=np.int64)
    raw.Alltoall(send_counts, recv_counts)
    send = np.ascontiguousarray(np.concatenate([p.reshape(-1, *tail) for p in parts]))
    recv = np.empty((int(recv_counts.sum()),) + tail, dtype=parts[0].dtype)
    raw.Alltoallv([send.reshape(-1), send_counts * width], [recv.reshape(-1), recv_counts * width])
    return np.split(recv, np.cumsum(recv_counts)[:-1])


def poll_wait(req):
    t0 = time.perf_counter()
    done = req.Test()
    while not done and time.perf_counter() - t0 < 2e-3:
        done = req.Test()
    while not done:
        comm._guard.check()
        time.sleep(min(0.1 * (time.perf_counter() - t0), 1e-3))
        done = req.Test()


def waitany_wait(req):
    g = comm._guard
    g.check()
    while MPI.Request.Waitany([req, g.note_req]) != 0:
        g.take_note()
        g.check()


WAYS = {
    "blocking": {
        "allreduce_sum": blocking_allreduce_sum,
        "allgather_rows": blocking_allgather_rows,
        "alltoallv": blocking_alltoallv,
    },
    "guarded": {},
    "poll": {"_wait": poll_wait},
    "waitany": {"_wait": waitany_wait},
}


def use(way):
    """Make the world communicator wait the given way (instance attributes shadow Comm's methods)."""
    for name in ("allreduce_sum", "allgather_rows", "alltoallv", "_wait"):
        vars(comm).pop(name, None)
    vars(comm).update(WAYS[way])


def main(rounds):
    with tempfile.TemporaryDirectory() as folder:  # each rank writes the same tiny data (same seed)
        model = tiny_dlrm(
            *tiny_data(folder, n_train=240, n_eval=96),
            batch=12,
            lr=0.05,
            optimizer=hugectr.Optimizer_t.SGD,
            update=hugectr.Update_t.Local,
        )
        for _ in range(5):
            model.train()
        ms = {way: [] for way in WAYS}
        for _ in range(rounds):
            for way in WAYS:
                use(way)
                raw.Barrier()
                t0 = time.perf_counter()
                for _ in range(50):
                    model.train()
                raw.Barrier()
                ms[way].append((time.perf_counter() - t0) / 50 * 1e3)
        use("guarded")
    if comm.rank == 0:
        base = np.array(ms["blocking"])
        print(f"{comm.size} ranks, tiny DLRM training step, {rounds} interleaved rounds of 50 steps:")
        for way, v in ms.items():
            v = np.array(v)
            print(
                f"  {way:9s} median {np.median(v):7.3f} ms (best round {v.min():6.3f} ms), median ratio to "
                f"blocking {np.median(v / base):.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
