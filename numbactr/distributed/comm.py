"""Collectives between ranks — the ONLY module that imports mpi4py.

``mpiexec -n N python train.py`` gives N ranks, one device each. Without mpi4py, or in a plain
``python train.py``, there is one rank and every collective is the identity. Buffers are NumPy arrays;
on GPUs the caller stages device arrays through the host (NCCL through cupy is not wired yet).

If any rank raises, ``install_abort_hook`` prints its error and aborts the whole MPI job at once, so
the other ranks do not hang in their next collective.
"""
from __future__ import annotations

import sys
import traceback

import numpy as np


class Comm:
    """One rank's view of the job: rank, size and the collectives numbactr uses."""

    def __init__(self, mpi_comm=None):
        self._c = mpi_comm
        self.rank = mpi_comm.Get_rank() if mpi_comm is not None else 0
        self.size = mpi_comm.Get_size() if mpi_comm is not None else 1

    def allreduce_sum(self, x: np.ndarray) -> np.ndarray:
        """Element-wise sum over ranks, in place; returns x."""
        if self.size > 1:
            from mpi4py import MPI
            self._c.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        return x

    def allgather_rows(self, x: np.ndarray) -> np.ndarray:
        """Concatenate every rank's rows (rank order); row counts may differ."""
        if self.size == 1:
            return x
        x = np.ascontiguousarray(x)
        counts = np.array(self._c.allgather(x.shape[0]), dtype=np.int64)
        width = int(np.prod(x.shape[1:], dtype=np.int64))
        out = np.empty((int(counts.sum()),) + x.shape[1:], dtype=x.dtype)
        self._c.Allgatherv(x.reshape(-1), [out.reshape(-1), counts * width])
        return out

    def gather_rows(self, x: np.ndarray, root: int = 0) -> np.ndarray | None:
        """Every rank's rows concatenated in rank order on ``root`` (None on the other ranks); row counts
        may differ. Like allgather_rows, but only one rank holds the whole (e.g. a snapshot's writer)."""
        if self.size == 1:
            return x
        x = np.ascontiguousarray(x)
        counts = self._c.gather(x.shape[0], root=root)
        if self.rank != root:
            self._c.Gatherv(x.reshape(-1), None, root=root)
            return None
        counts = np.array(counts, dtype=np.int64)
        width = int(np.prod(x.shape[1:], dtype=np.int64))
        out = np.empty((int(counts.sum()),) + x.shape[1:], dtype=x.dtype)
        self._c.Gatherv(x.reshape(-1), [out.reshape(-1), counts * width], root=root)
        return out

    def alltoallv(self, parts: list[np.ndarray]) -> list[np.ndarray]:
        """parts[d] goes to rank d; returns what every rank sent here, in rank order.
        All parts share dtype and trailing shape (rows may differ, also be empty)."""
        if self.size == 1:
            return [parts[0]]
        sample = parts[0]
        tail = sample.shape[1:]
        width = int(np.prod(tail, dtype=np.int64))
        send_counts = np.array([p.shape[0] for p in parts], dtype=np.int64)
        recv_counts = np.empty(self.size, dtype=np.int64)
        self._c.Alltoall(send_counts, recv_counts)
        send = np.ascontiguousarray(np.concatenate([p.reshape(-1, *tail) for p in parts]))
        recv = np.empty((int(recv_counts.sum()),) + tail, dtype=sample.dtype)
        self._c.Alltoallv([send.reshape(-1), send_counts * width], [recv.reshape(-1), recv_counts * width])
        return np.split(recv, np.cumsum(recv_counts)[:-1])

    def bcast(self, obj, root: int = 0):
        return obj if self.size == 1 else self._c.bcast(obj, root=root)

    def barrier(self) -> None:
        if self.size > 1:
            self._c.Barrier()

    def abort(self, code: int = 1) -> None:
        if self.size > 1:
            self._c.Abort(code)


_world: Comm | None = None


def world() -> Comm:
    """The job's communicator (created on first use; one rank without mpi4py)."""
    global _world
    if _world is None:
        try:
            from mpi4py import MPI
        except ImportError:
            _world = Comm(None)
        else:
            _world = Comm(MPI.COMM_WORLD)
            if _world.size > 1:
                install_abort_hook(_world)
    return _world


def install_abort_hook(comm: Comm) -> None:
    """An uncaught exception on any rank prints it (with the rank) and aborts every rank promptly."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        sys.stderr.write(f"numbactr: rank {comm.rank} of {comm.size} failed; aborting the job\n")
        traceback.print_exception(kind, value, tb)
        sys.stderr.flush()
        try:
            comm.abort(1)
        finally:
            previous(kind, value, tb)

    sys.excepthook = hook
