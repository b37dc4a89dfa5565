"""Collectives between ranks, and how the job ends when a rank fails: the ONLY module importing mpi4py.

``mpiexec -n N python train.py`` gives N ranks, one device each. A plain ``python train.py`` is one rank
whose collectives are the identity. ``allreduce_sum`` and ``alltoallv`` take NumPy arrays (MPI) or CuPy
device arrays: device buffers travel by NCCL (numbactr.distributed.nccl) when every rank has a GPU of its own
and cupy.cuda.nccl imports, and staged through host memory and MPI otherwise (``transport()`` says which
and why; ``NUMBACTR_COMM=mpi`` forces the host path, ``=nccl`` makes NCCL's absence an error). The choice
is ``placement.choose_transport``, made once, on the first device collective, from every rank's facts.
Each rank's node and local rank (``Comm.placement``) come from MPI's shared-memory split communicator;
numbactr.runtime.device picks the rank's GPU from them before any allocation.

A failing rank ends the whole job within seconds and says which rank and why. Under a multi-rank launch,
``import numbactr`` calls ``guard_launch()``: the launcher's environment says so (``PMI_SIZE`` from
MPICH's hydra and Intel MPI, ``OMPI_COMM_WORLD_SIZE`` from Open MPI, ``MV2_COMM_WORLD_SIZE`` from
MVAPICH2: a dictionary look-up, so a plain run neither imports mpi4py nor pays anything), MPI starts, and
a guard is installed before the script's next line:

* An uncaught exception (KeyboardInterrupt too): "numbactr: rank r of R failed; aborting the job" and
  the traceback on stderr, then MPI_Abort with exit code 1.
* ``sys.exit(c)`` or ``os._exit(c)`` with c != 0: "numbactr: rank r of R called sys.exit(c) ...;
  aborting the job", MPI_Abort(c) at once.
* A rank that leaves with code 0 (``sys.exit(0)``, the script's end, ``os._exit(0)``, ``MPI.Finalize()``,
  or a SystemExit whose code numbactr cannot see, e.g. ``raise SystemExit(2)``) while another needs it:
  the other aborts as soon as it waits for it in a numbactr collective: "numbactr: rank r of R has left
  the job (sys.exit(0)) after n collectives, but rank q waits for it in allreduce_sum (collective n+1);
  aborting the job".
* A normal end: each rank tells every other that it leaves and waits until all have (the exit
  handshake), so ranks that finish seconds or hours apart finalize MPI together and nobody is aborted.
* A rank killed by a signal (SIGKILL, the OOM killer): hydra kills the others at once and prints "BAD
  TERMINATION ... PID p ... Killed (signal 9)"; rank 0's first line, "numbactr: 2 ranks (rank: pid@host)
  0: 4242@node1, 1: 4243@node1", names the rank behind that PID. Nothing inside a rank can add to it:
  the others are SIGKILLed in the same instant.
* An error before ``import numbactr`` is out of reach: the other ranks wait in MPI_Init for every rank
  (measured), so a script should import numbactr first.

Why: the report must reach the output before the abort, and a rank that left must be noticed without a
timeout, however slow the others are; docs/decisions/0006-rank-failure-guard.md has the details and the
measurements behind them (tests/test_rank_failures.py checks each case above).
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import sys
import threading
import time
import traceback

import numpy as np

from numbactr.distributed.placement import (
    Placement,
    choose_transport,
    local_from_env,
    node_of,
    own_gpus,
    pci_key,
    pci_key_from_text,
)

# the launcher's environment: (size, rank) variables set by MPICH/Intel MPI, Open MPI, MVAPICH2
_LAUNCH_ENV = (
    ("PMI_SIZE", "PMI_RANK"),
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"),
)
_NAP_SHARE, _NAP_MAX_S = 0.1, 10e-3  # exit handshake: sleep this share of the time waited, at most 10 ms
_WATCH_S = 0.05  # the watchdog tests for notes of leaving peers this often
_DRAIN_S = 5.0  # longest wait for the launcher to read a failing rank's report
_LEFT = 1  # tag of the "I am leaving" note on the guard's communicator
_HOW = {0: "its script ended", 1: "sys.exit", 2: "os._exit", 3: "MPI.Finalize"}


def launched() -> tuple[int, int, str]:
    """(size, rank, variable) of a multi-process launch according to the launcher's environment, or
    (1, 0, "") without one. Reads os.environ only."""
    for size_var, rank_var in _LAUNCH_ENV:
        size, rank = os.environ.get(size_var, ""), os.environ.get(rank_var, "")
        if size.isdigit() and int(size) > 1:
            return int(size), int(rank) if rank.isdigit() else -1, size_var
    return 1, 0, ""


def gpu_pci_key(gpu: int) -> int:
    """placement.pci_key of visible GPU `gpu` (its PCI domain, bus and device: numba-cuda's
    ``Device.get_device_identity()``, a driver attribute query, else CuPy's ``Device(gpu).pci_bus_id``),
    or -1 when neither can read it (transport() then stays on host MPI)."""
    try:
        from numba import cuda

        ident = cuda.gpus[gpu].get_device_identity()
        return pci_key(ident["pci_domain_id"], ident["pci_bus_id"], ident["pci_device_id"])
    except Exception:  # noqa: BLE001 (an older numba-cuda, a driver error: try CuPy)
        pass
    try:
        import cupy

        return pci_key_from_text(cupy.cuda.Device(gpu).pci_bus_id)
    except Exception:  # noqa: BLE001 (PlacementError too: an unreadable bus id)
        return -1


class Comm:
    """One rank's view of the job: rank, size and the collectives numbactr uses.

    All ranks enter these collectives in the same order; ``calls`` counts those this rank has entered,
    which is how the guard tells a peer whose part is still in flight from one that will never come."""

    def __init__(self, mpi_comm=None):
        self._c = mpi_comm
        self.rank = mpi_comm.Get_rank() if mpi_comm is not None else 0
        self.size = mpi_comm.Get_size() if mpi_comm is not None else 1
        self.calls = 0
        self.count_exchanges = 0  # alltoallv row counts exchanged before the rows (statistics, tests)
        self.current = ""  # the collective this rank is in (named in abort messages)
        self._guard: _Guard | None = None
        self.placement = Placement(self.rank, self.size)  # world() fills in node and local rank
        self._transport: tuple[str, str] | None = None  # ('nccl' | 'mpi', why), on first device use
        self._nccl = None

    # -- device buffers ------------------------------------------------------------------------------
    def transport(self) -> tuple[str, str]:
        """('nccl' | 'mpi', why) for device buffers, decided once for the whole job: every rank shares
        its (node, PCI address of its GPU, NCCL importable) in one allgather, so all ranks take the same
        path. The PCI address, not the visible index, tells the GPUs apart: under per-rank
        CUDA_VISIBLE_DEVICES every rank's GPU is its visible GPU 0 (``placement.own_gpus``). A collective:
        every rank calls it at the same point (the first device collective does)."""
        if self._transport is not None:
            return self._transport
        kind, gpu = _device_probe()
        if self.size == 1:
            self._transport = choose_transport(1, kind, True, False)
            return self._transport
        from numbactr.distributed import nccl

        mine = np.array(
            [self.placement.node, -1 if gpu is None else gpu_pci_key(gpu), int(kind == "gpu" and nccl.importable())],
            dtype=np.int64,
        )
        every = np.empty((self.size, 3), dtype=np.int64)
        self._enter("transport")
        self._wait(self._c.Iallgather(mine, every))
        own, why = own_gpus([(int(n), int(k)) for n, k, _ in every])
        self._transport = choose_transport(
            self.size, kind, own, bool(every[:, 2].all()), os.environ.get("NUMBACTR_COMM", ""), why
        )
        if self._transport[0] == "nccl":
            # the unique id travels by this Comm's bcast: one more guarded collective, on every rank alike
            self._nccl = nccl.NcclComm(self._c, bcast=self.bcast)
        return self._transport

    def allreduce_sum(self, x):
        """Element-wise sum over ranks, in place; returns x. x is a NumPy array or a CuPy device array
        (NCCL or host-staged MPI, ``transport()``)."""
        if self.size > 1 and _on_device(x):
            if self.transport()[0] == "nccl":
                self._enter("allreduce_sum")
                return self._nccl.allreduce_sum(x)
            host = self.allreduce_sum(x.get())
            x.set(host)
            return x
        if self.size > 1:
            MPI = _mpi()
            self._enter("allreduce_sum")
            self._wait(self._c.Iallreduce(MPI.IN_PLACE, x, op=MPI.SUM))
        return x

    def allgather_rows(self, x: np.ndarray) -> np.ndarray:
        """Concatenate every rank's rows (rank order); row counts may differ."""
        if self.size == 1:
            return x
        self._enter("allgather_rows")
        x = np.ascontiguousarray(x)
        mine, counts = np.array([x.shape[0]], dtype=np.int64), np.empty(self.size, dtype=np.int64)
        self._wait(self._c.Iallgather(mine, counts))
        width = int(np.prod(x.shape[1:], dtype=np.int64))
        out = np.empty((int(counts.sum()),) + x.shape[1:], dtype=x.dtype)
        sizes = counts * width
        self._wait(self._c.Iallgatherv(x.reshape(-1), [out.reshape(-1), sizes]))
        return out

    def allgather(self, x):
        """Every rank's x (one shape and dtype on every rank) concatenated along the first axis in rank
        order, (R * n, ...): a NumPy array by MPI, a CuPy array by NCCL (or staged through the host). Fixed
        sizes, no count exchange: a CUDA graph can hold it (a key-owned table's gathered exchange)."""
        if self.size == 1:
            return x
        if _on_device(x):
            if self.transport()[0] == "nccl":
                self._enter("allgather")
                return self._nccl.allgather(x)
            import cupy

            return cupy.asarray(self.allgather(x.get()))
        self._enter("allgather")
        x = np.ascontiguousarray(x)
        out = np.empty((self.size * x.shape[0],) + x.shape[1:], dtype=x.dtype)
        self._wait(self._c.Iallgather(x.reshape(-1), out.reshape(-1)))
        return out

    def reduce_scatter_sum(self, x):
        """x (R * n, ...) on every rank: this rank's block of n rows of the element-wise sum over ranks (rank
        r gets rows r*n .. (r+1)*n - 1). A NumPy array by MPI, a CuPy array by NCCL (or staged through the
        host). Fixed sizes, like allgather."""
        if x.shape[0] % self.size:
            raise ValueError(f"reduce_scatter_sum: {x.shape[0]} rows do not split over {self.size} ranks")
        if self.size == 1:
            return x
        if _on_device(x):
            if self.transport()[0] == "nccl":
                self._enter("reduce_scatter_sum")
                return self._nccl.reduce_scatter_sum(x)
            import cupy

            return cupy.asarray(self.reduce_scatter_sum(x.get()))
        self._enter("reduce_scatter_sum")
        MPI = _mpi()
        x = np.ascontiguousarray(x)
        out = np.empty((x.shape[0] // self.size,) + x.shape[1:], dtype=x.dtype)
        self._wait(self._c.Ireduce_scatter_block(x.reshape(-1), out.reshape(-1), op=MPI.SUM))
        return out

    def gather_rows(self, x: np.ndarray, root: int = 0) -> np.ndarray | None:
        """Every rank's rows concatenated in rank order on ``root`` (None on the other ranks); row counts
        may differ. Like allgather_rows, but only one rank holds the whole (e.g. a snapshot's writer)."""
        if self.size == 1:
            return x
        self._enter("gather_rows")
        x = np.ascontiguousarray(x)
        mine = np.array([x.shape[0]], dtype=np.int64)
        counts = np.empty(self.size, dtype=np.int64) if self.rank == root else None
        self._wait(self._c.Igather(mine, counts, root=root))
        if self.rank != root:
            self._wait(self._c.Igatherv(x.reshape(-1), None, root=root))
            return None
        width = int(np.prod(x.shape[1:], dtype=np.int64))
        out = np.empty((int(counts.sum()),) + x.shape[1:], dtype=x.dtype)
        sizes = counts * width
        self._wait(self._c.Igatherv(x.reshape(-1), [out.reshape(-1), sizes], root=root))
        return out

    def alltoallv(self, parts: list[np.ndarray], recv_rows=None) -> list[np.ndarray]:
        """parts[d] goes to rank d; returns what every rank sent here, in rank order.
        All parts share dtype and trailing shape (rows may differ, also be empty).

        recv_rows: the rows each rank sends here, when the caller knows them (the reverse of an earlier
        exchange, or a fixed exchange plan: numbactr.embedding.sharded); else they are exchanged first, one
        more collective (``count_exchanges`` counts those)."""
        if self.size == 1:
            return [parts[0]]
        if recv_rows is not None and len(recv_rows) != self.size:
            raise ValueError(f"alltoallv: {len(recv_rows)} receive counts for {self.size} ranks")
        if _on_device(parts[0]):
            return self._device_alltoallv(parts, recv_rows)
        self._enter("alltoallv")
        sample = parts[0]
        tail = sample.shape[1:]
        width = int(np.prod(tail, dtype=np.int64))
        send_counts = np.array([p.shape[0] for p in parts], dtype=np.int64)
        recv_counts = self._recv_counts(send_counts, recv_rows)
        send = np.ascontiguousarray(np.concatenate([p.reshape(-1, *tail) for p in parts]))
        recv = np.empty((int(recv_counts.sum()),) + tail, dtype=sample.dtype)
        send_sizes, recv_sizes = send_counts * width, recv_counts * width
        self._wait(self._c.Ialltoallv([send.reshape(-1), send_sizes], [recv.reshape(-1), recv_sizes]))
        return np.split(recv, np.cumsum(recv_counts)[:-1])

    def _recv_counts(self, send_counts: np.ndarray, recv_rows) -> np.ndarray:
        """The rows each rank sends here: recv_rows as given, or exchanged (MPI alltoall of the counts)."""
        if recv_rows is not None:
            return np.asarray([int(r) for r in recv_rows], dtype=np.int64)
        recv_counts = np.empty(self.size, dtype=np.int64)
        self._wait(self._c.Ialltoall(send_counts, recv_counts))
        self.count_exchanges += 1
        return recv_counts

    def _device_alltoallv(self, parts: list, recv_rows=None) -> list:
        """alltoallv of CuPy arrays: the row counts over MPI (host integers known from the shapes; none when
        the caller gives recv_rows, so a captured step enqueues NCCL work only), the rows over NCCL, or all of
        it staged through the host."""
        import cupy

        if self.transport()[0] != "nccl":
            return [cupy.asarray(p) for p in self.alltoallv([p.get() for p in parts], recv_rows)]
        if len(parts) != self.size:
            raise ValueError(f"alltoallv: {len(parts)} parts for {self.size} ranks")
        send_counts = np.array([p.shape[0] for p in parts], dtype=np.int64)
        self._enter("alltoallv")
        recv_counts = self._recv_counts(send_counts, recv_rows)
        return self._nccl.alltoallv(parts, [int(r) for r in recv_counts])

    def bcast(self, obj, root: int = 0):
        """root's obj on every rank (pickled)."""
        if self.size == 1:
            return obj
        self._enter("bcast")
        data = np.frombuffer(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), dtype=np.uint8) if self.rank == root else None
        n = np.array([0 if data is None else data.size], dtype=np.int64)
        self._wait(self._c.Ibcast(n, root=root))
        buf = data.copy() if data is not None else np.empty(int(n[0]), dtype=np.uint8)
        self._wait(self._c.Ibcast(buf, root=root))
        return obj if self.rank == root else pickle.loads(buf.tobytes())

    def barrier(self) -> None:
        """Return once every rank has called barrier."""
        if self.size > 1:
            self._enter("barrier")
            self._wait(self._c.Ibarrier())

    def abort(self, code: int = 1, why: str = "") -> None:
        """End every rank of the job now with exit code `code`, after printing `why` (one rank)."""
        if self.size > 1 and self._guard is not None:
            head = f"numbactr: rank {self.rank} of {self.size} aborts the job"
            self._guard.abort(f"{head}: {why}\n" if why else head + "\n", code)
        elif self.size > 1:
            self._c.Abort(code)

    # -- waiting -----------------------------------------------------------------------------------
    def _enter(self, name: str) -> None:
        self.calls += 1
        self.current = name

    def _wait(self, req) -> None:
        """Complete a non-blocking MPI request; the guard aborts the job as soon as a peer that this
        collective needs has left (module docstring)."""
        g = self._guard
        if g is None:
            req.Wait()
        elif g.watchdog is None:  # MPI without thread support: watch in this thread
            g.check()
            while g.MPI.Request.Waitany([req, g.note_req]) != 0:
                g.take_note()
                g.check()
        else:
            with g.lock:
                g.check()  # a peer that left before this collective began
                g.waiting = True
            try:
                req.Wait()
            finally:
                g.waiting = False


def _mpi():
    from mpi4py import MPI

    return MPI


def _on_device(x) -> bool:
    """True for a CuPy array (a device buffer), without importing cupy."""
    return type(x).__module__.split(".")[0] == "cupy"


def _placement(comm: Comm, MPI) -> Placement:
    """This rank's node and local rank from MPI's shared-memory split (ranks that share a node's
    memory), numbering nodes by their first rank. A collective over COMM_WORLD."""
    shm = comm._c.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        leader = shm.allreduce(comm.rank, op=MPI.MIN)
        node, nodes = node_of(comm._c.allgather(leader), comm.rank)
        return Placement(comm.rank, comm.size, shm.Get_rank(), shm.Get_size(), node, nodes, "MPI shared-memory split")
    finally:
        shm.Free()


def placement() -> Placement:
    """This rank's placement: from MPI under a multi-rank launch, else from the launcher's local-rank
    variables if any (e.g. one process started by srun), else the one-process default."""
    if launched()[0] > 1:
        return world().placement
    local = local_from_env(os.environ)
    if local is None:
        return Placement()
    lr, ls, var = local
    return Placement(0, 1, lr, ls if ls is not None else lr + 1, 0, 1, var)


_world: Comm | None = None


def _no_device() -> tuple[str, None]:
    return "cpu", None


#: () -> (device kind, this rank's GPU index or None). distributed knows ranks, not devices: the device
#: layer hands its probe in (numbactr.runtime.device registers it when imported), so no import points up.
_device_probe = _no_device


def set_device_probe(probe) -> None:
    """Hand the collectives the function that says which device this rank runs (kind, GPU index)."""
    global _device_probe
    _device_probe = probe


def world() -> Comm:
    """The job's communicator, created on first use (one rank without MPI). With several ranks it also
    installs the guard that ends the job when a rank fails."""
    global _world
    if _world is not None:
        return _world
    size, rank, var = launched()
    try:
        MPI = _mpi()
    except ImportError:
        if size > 1:  # each rank would train alone on its own copy: refuse
            raise ImportError(
                f"numbactr: this process was started as rank {rank} of {size} ({var}={size}) "
                f"but mpi4py is not installed: pip install 'numbactr[mpi]'"
            ) from None
        _world = Comm(None)
        return _world
    comm = Comm(MPI.COMM_WORLD)
    if size > 1 and comm.size != size:
        raise RuntimeError(
            f"numbactr: the launcher started {size} processes ({var}={size}) but MPI sees "
            f"{comm.size}: mpi4py's MPI library ({MPI.Get_library_version().splitlines()[0]}) "
            f"is not the one of this mpiexec"
        )
    if comm.size > 1:
        from numbactr import log

        log.set_rank(comm.rank)
        comm.placement = _placement(comm, MPI)
        comm._guard = _Guard(comm, MPI)
    _world = comm
    return comm


def guard_launch() -> None:
    """Called by ``import numbactr``: under a multi-rank launch start MPI and the guard now, so that an
    error before the first Model still ends the job. Costs nothing without a launch."""
    if launched()[0] > 1:
        world()


# ---------------------------------------------------------------------------------------------------
# the guard


class _ScriptExit(SystemExit):
    """What sys.exit raises under a launch. The interpreter drops an uncaught SystemExit after the script
    has unwound, with no Python frame left: only then is its code the process's exit code, and only then
    does it tell the guard. One caught by the script (or by pytest) dies inside the handling frame."""

    def __init__(self, guard: _Guard, status):
        super().__init__(status)
        self._guard = guard

    def __del__(self):
        try:
            sys._getframe(1)
        except ValueError:
            self._guard.exit_code = _exit_code(self.code)


def _exit_code(status) -> int:
    """The exit status the process gets from sys.exit(status) or os._exit(status) (0-255, as POSIX keeps
    the low byte: sys.exit(256) succeeds)."""
    if status is None:
        return 0
    return int(status) & 0xFF if isinstance(status, int) else 1


class _Guard:
    """Ends the job when this rank fails, and lets it leave cleanly when it ends (module docstring)."""

    def __init__(self, comm: Comm, MPI):
        self.comm, self.MPI = comm, MPI
        self.pid = os.getpid()
        self.ctl = comm._c.Dup()  # its notes never meet numbactr's or the script's messages
        self.peers = [p for p in range(comm.size) if p != comm.rank]
        self.note = np.zeros(4, dtype=np.int64)  # a leaving peer's rank, how, exit code, collectives entered
        self.note_req = self.ctl.Irecv(self.note, source=MPI.ANY_SOURCE, tag=_LEFT)
        self.left: dict[int, tuple[int, int, int]] = {}  # peer -> (how, exit code, collectives entered)
        self.exit_code: int | None = None  # the code of the sys.exit that ended the script
        self.leaving = False
        self.lock = threading.Lock()  # the watchdog's notes and checks against the main thread's waits
        self.waiting = False  # the main thread waits in collective number comm.calls
        self.stop_watching = threading.Event()
        self.watchdog = None
        if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            self.watchdog = threading.Thread(target=self.watch, name="numbactr-rank-watchdog", daemon=True)
            self.watchdog.start()
        self.real_exit, self.real_finalize = os._exit, MPI.Finalize
        where = self.ctl.gather((self.pid, socket.gethostname()), root=0)
        if comm.rank == 0:
            print(
                f"numbactr: {comm.size} ranks (rank: pid@host) "
                + ", ".join(f"{r}: {pid}@{host}" for r, (pid, host) in enumerate(where)),
                flush=True,
            )
        sys.excepthook = self.excepthook
        sys.exit = self.sys_exit
        os._exit = self.os_exit
        MPI.Finalize = self.finalize
        atexit.register(self.at_exit)

    # -- ending -------------------------------------------------------------------------------------
    def abort(self, report: str, code: int) -> None:
        """Write report to stderr, wait until the launcher has read it, then end every rank with `code`."""
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        _write_all(2, report)
        _drain((1, 2), _DRAIN_S)
        try:
            self.MPI.COMM_WORLD.Abort(code)
        finally:
            self.real_exit(code)

    def excepthook(self, kind, value, tb) -> None:
        if os.getpid() != self.pid:  # a forked child is no rank
            sys.__excepthook__(kind, value, tb)
            return
        c = self.comm
        self.abort(
            f"numbactr: rank {c.rank} of {c.size} failed; aborting the job\n"
            + "".join(traceback.format_exception(kind, value, tb)),
            1,
        )

    def sys_exit(self, status=None):
        if os.getpid() != self.pid or threading.current_thread() is not threading.main_thread():
            raise SystemExit(status)  # a thread's SystemExit ends only the thread
        raise _ScriptExit(self, status)

    def os_exit(self, status: int):
        if os.getpid() == self.pid:
            self.leave(2, _exit_code(status))
            if not self.MPI.Is_finalized():
                self.real_finalize()  # so that the launcher does not kill the ranks still exiting
        self.real_exit(status)

    def finalize(self) -> None:
        """MPI.Finalize called by the script: the exit handshake first (no MPI call may follow it)."""
        if os.getpid() == self.pid:
            self.leave(3, 0)
        self.real_finalize()

    def at_exit(self) -> None:
        if os.getpid() != self.pid:
            return
        try:
            self.leave(0 if self.exit_code is None else 1, self.exit_code or 0)
        except BaseException:  # (Ctrl-C in the handshake) Python would only print it, then hang
            self.excepthook(*sys.exc_info())  # in MPI_Finalize: abort with the report instead

    def leave(self, how: int, code: int) -> None:
        """This rank ends: abort at once for a non-zero code; else tell every peer and wait until all have
        left too (the exit handshake), however long they take. A peer that still needs this rank aborts
        the job instead."""
        if self.leaving:
            return
        self.leaving = True
        c = self.comm
        if code != 0:
            self.abort(
                f"numbactr: rank {c.rank} of {c.size} called {_HOW[how]}({code}) while the other ranks "
                f"may still need it; aborting the job\n",
                code,
            )
        if self.watchdog is not None and self.watchdog is not threading.current_thread():
            self.stop_watching.set()  # from here on this thread takes the notes
            self.watchdog.join()
        note = np.array([c.rank, how, code, c.calls], dtype=np.int64)
        sends = [self.ctl.Isend(note, dest=p, tag=_LEFT) for p in self.peers]
        t0 = time.perf_counter()  # sleeping, not spinning: the peers may need the cores for hours
        while len(self.left) < len(self.peers):
            if self.note_req.Test():
                self.take_note()
            else:
                time.sleep(min(_NAP_SHARE * (time.perf_counter() - t0), _NAP_MAX_S))
        self.MPI.Request.Waitall(sends)
        self.ctl.Free()

    # -- watching -----------------------------------------------------------------------------------
    def watch(self) -> None:
        """The watchdog thread: take the notes of leaving peers as they come, and abort the job when the
        collective the main thread waits in needs one of them."""
        try:
            while not self.stop_watching.wait(_WATCH_S):
                with self.lock:
                    while len(self.left) < len(self.peers) and self.note_req.Test():
                        self.take_note()
                    if self.waiting:
                        self.check()
        except BaseException:  # a watchdog that died would watch no more: end the job, say why
            self.excepthook(*sys.exc_info())

    def take_note(self) -> None:
        """Record the note note_req has received, and post the receive of the next one."""
        p, how, code, n = (int(v) for v in self.note)
        self.left[p] = (how, code, n)
        self.note_req = (
            self.ctl.Irecv(self.note, source=self.MPI.ANY_SOURCE, tag=_LEFT)
            if len(self.left) < len(self.peers)
            else self.MPI.REQUEST_NULL
        )

    def check(self) -> None:
        """Abort the job if a peer has left that the collective this rank waits in still needs."""
        c = self.comm
        for p, (how, code, n) in self.left.items():
            if n < c.calls:  # p entered n collectives; this is collective number c.calls
                what = _HOW[how] if how == 0 else f"{_HOW[how]}({code})"
                self.abort(
                    f"numbactr: rank {p} of {c.size} has left the job ({what}) after {n} collective"
                    f"{'' if n == 1 else 's'}, "
                    f"but rank {c.rank} waits for it in {c.current} (collective {c.calls}); "
                    f"aborting the job\n",
                    1,
                )


def _write_all(fd: int, text: str) -> None:
    data = text.encode("utf-8", "replace")
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:  # stderr closed: nothing to tell, the abort still happens
        pass


def _drain(fds, limit_s: float) -> None:
    """Wait (at most limit_s) until whoever reads these pipes (the launcher) has read them empty."""
    try:
        import fcntl
        import stat
        import struct
        import termios
    except ImportError:  # not a POSIX system: nothing to wait for
        return

    def unread(fd: int) -> int:
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                return 0  # a terminal or a file has the bytes already
            return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:
            return 0

    deadline = time.monotonic() + limit_s
    while any(unread(fd) for fd in fds) and time.monotonic() < deadline:
        time.sleep(0.001)
