"""NCCL between ranks with one GPU each, through CuPy's ``cupy.cuda.nccl``.

``Comm`` (numbactr.distributed.comm) hands device buffers here when ``placement.choose_transport``
picked NCCL: every rank has a GPU of its own and cupy.cuda.nccl imports. The NCCL communicator is built
once per job: rank 0 makes the unique id, MPI broadcasts it (``Comm.bcast``, a guarded collective), every
rank joins with ``ncclCommInitRank`` on its current GPU (chosen by numbactr.runtime.device before any allocation). Collectives run on CuPy's current
stream, so they are ordered with the kernels around them and need no host synchronization of their own.

* ``allreduce_sum(x)``: in place, float32/float16/float64/int32/int64 (bfloat16 has no CuPy dtype);
  alltoallv also moves uint32/uint64 (hash keys), int8/uint8.
* ``allgather(x)`` and ``reduce_scatter_sum(x)``: fixed sizes (every rank's x has the same shape), what a
  key-owned table's gathered exchange uses (numbactr.embedding.sharded).
* ``alltoallv(parts, recv_rows)``: parts[d] (a device array) to rank d as grouped send/recv; the row
  counts travel over MPI beforehand (small host integers the caller knows from shapes), so each receive
  buffer is allocated at its exact size without reading the device.
"""

from __future__ import annotations

import numpy as np


def importable() -> bool:
    """True when cupy.cuda.nccl imports and reports a NCCL library (the wheels load libnccl lazily)."""
    try:
        from cupy.cuda import nccl  # imports without NCCL's names (available False) when libnccl is missing

        return bool(getattr(nccl, "available", True)) and bool(nccl.get_version())
    except Exception:  # noqa: BLE001 (ImportError, or CuPy's error when libnccl cannot load)
        return False


def _dtypes(nccl) -> dict:
    types = {
        np.dtype(np.float32): nccl.NCCL_FLOAT32,
        np.dtype(np.float16): nccl.NCCL_FLOAT16,
        np.dtype(np.float64): nccl.NCCL_FLOAT64,
        np.dtype(np.int32): nccl.NCCL_INT32,
        np.dtype(np.int64): nccl.NCCL_INT64,
        np.dtype(np.uint8): nccl.NCCL_UINT8,
        np.dtype(np.int8): nccl.NCCL_INT8,
    }
    # hash keys travel as uint64 (numbactr.embedding.sharded); NCCL has the unsigned types since 2.0
    for dt, name in ((np.uint32, "NCCL_UINT32"), (np.uint64, "NCCL_UINT64")):
        if hasattr(nccl, name):
            types[np.dtype(dt)] = getattr(nccl, name)
    return types


class NcclComm:
    """One NCCL communicator over all ranks of an MPI communicator (mpi4py), on this rank's current GPU.

    ``bcast(obj, root=0)`` carries rank 0's unique id to every rank (default: the communicator's own
    pickling ``bcast``). The id is whatever CuPy's ``get_unique_id`` returns (a tuple of ints before CuPy
    14, bytes since), handed unchanged to ``NcclCommunicator(ndev, commId, rank)``, which takes that type."""

    def __init__(self, mpi_comm, bcast=None):
        import cupy
        from cupy.cuda import nccl

        self._nccl, self._cupy = nccl, cupy
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = (bcast or mpi_comm.bcast)(uid, root=0)
        self.device = cupy.cuda.Device().id
        self._c = nccl.NcclCommunicator(self.size, uid, self.rank)
        self._types = _dtypes(nccl)

    def close(self) -> None:
        """Destroy the NCCL communicator now (CuPy also does when the object is collected)."""
        if self._c is not None:
            self._c.destroy()
            self._c = None

    def _type(self, a, what: str):
        t = self._types.get(np.dtype(a.dtype))
        if t is None:
            raise TypeError(f"NCCL {what}: dtype {a.dtype} is not one of {', '.join(str(d) for d in self._types)}")
        if not a.flags.c_contiguous:
            raise ValueError(f"NCCL {what}: the buffer must be C-contiguous")
        return t

    def _stream(self) -> int:
        return self._cupy.cuda.get_current_stream().ptr

    def allreduce_sum(self, x):
        """Element-wise sum over ranks of the device array x, in place; returns x."""
        t = self._type(x, "allreduce_sum")
        if x.size:
            self._c.allReduce(x.data.ptr, x.data.ptr, x.size, t, self._nccl.NCCL_SUM, self._stream())
        return x

    def alltoallv(self, parts: list, recv_rows: list[int]) -> list:
        """parts[d] (device arrays sharing dtype and trailing shape) go to rank d; returns the arrays rank
        s sent here (recv_rows[s] rows each), in rank order. One NCCL group of sends and receives."""
        if len(parts) != self.size or len(recv_rows) != self.size:
            raise ValueError(
                f"NCCL alltoallv: {len(parts)} parts / {len(recv_rows)} receive counts for {self.size} ranks"
            )
        cp, nccl = self._cupy, self._nccl
        sample = parts[0]
        tail = sample.shape[1:]
        parts = [cp.ascontiguousarray(p) for p in parts]
        t = self._type(parts[0], "alltoallv")
        for d, p in enumerate(parts):
            if p.dtype != sample.dtype or p.shape[1:] != tail:
                raise ValueError(
                    f"NCCL alltoallv: part {d} is {p.dtype}{p.shape}, part 0 {sample.dtype}"
                    f"{sample.shape}: dtype and trailing shape must match"
                )
        out = [cp.empty((int(r),) + tail, dtype=sample.dtype) for r in recv_rows]
        stream = self._stream()
        nccl.groupStart()
        try:
            for peer in range(self.size):
                if parts[peer].size:
                    self._c.send(parts[peer].data.ptr, parts[peer].size, t, peer, stream)
                if out[peer].size:
                    self._c.recv(out[peer].data.ptr, out[peer].size, t, peer, stream)
        finally:
            nccl.groupEnd()
        return out

    def allgather(self, x):
        """Every rank's x (device arrays of one shape and dtype on every rank) concatenated along the first
        axis in rank order: (R * x.shape[0], ...). ncclAllGather."""
        cp = self._cupy
        x = cp.ascontiguousarray(x)
        t = self._type(x, "allgather")
        out = cp.empty((self.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype)
        if x.size:
            self._c.allGather(x.data.ptr, out.data.ptr, x.size, t, self._stream())
        return out

    def reduce_scatter_sum(self, x):
        """x (R * n, ...) on every rank: this rank's block of n rows of the element-wise sum over ranks.
        ncclReduceScatter."""
        cp = self._cupy
        if x.shape[0] % self.size:
            raise ValueError(f"NCCL reduce_scatter_sum: {x.shape[0]} rows do not split over {self.size} ranks")
        x = cp.ascontiguousarray(x)
        t = self._type(x, "reduce_scatter_sum")
        out = cp.empty((x.shape[0] // self.size,) + tuple(x.shape[1:]), dtype=x.dtype)
        if out.size:
            self._c.reduceScatter(x.data.ptr, out.data.ptr, out.size, t, self._nccl.NCCL_SUM, self._stream())
        return out
