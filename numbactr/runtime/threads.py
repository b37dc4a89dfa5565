"""How many threads numbactr computes with and how many reader workers it starts, decided in one place.

Three pools share the cores of a process:
  compute  the BLAS/OpenMP threads of the matrix products (NumPy's OpenBLAS; set at run time with
           threadpoolctl) and numba's CPU threads (numba.set_num_threads), which never run at the same
           time as the BLAS threads: both are the training step's compute;
  readers  the data reader's prefetch workers, which decode the next batches while the step runs.
When they add up to more than the cores, everything slows down: OpenBLAS's threads spin while they wait
for work, so on a 2-core machine 2 BLAS threads next to a reader worker trained the demo about 2x slower
than 1 BLAS thread (README, "Measured").

Plan for C cores (the CPUs this process may run on, shared out among the MPI ranks on this host):
    reader workers = max(1, C // 4)           used when DataReaderParams(num_workers=...) is not given;
                                              a Norm/Parquet reader also takes at most one per file
    compute        = max(1, C - reader workers)
so 2 cores -> 1 + 1, 8 -> 6 + 2, 16 -> 12 + 4. Overrides, in order:
    configure(compute=..., reader_workers=...)             (API, any time; re-applies the limits)
    NUMBACTR_THREADS=N, NUMBACTR_READER_WORKERS=N         (environment)
    OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MKL_NUM_THREADS, NUMBA_NUM_THREADS set by the user are
    left as they are (the BLAS or numba pool then keeps the user's size; describe() says so).
A HugeCTR script that sets num_workers keeps it (the sample order depends on it); under
numbactr.hugectr_exact.hugectr_exact() the unset default is HugeCTR's 12. The plan is applied when the device is
first resolved (the start-up line prints it), or by configure().
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV_COMPUTE = "NUMBACTR_THREADS"
ENV_READERS = "NUMBACTR_READER_WORKERS"
BLAS_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
#: environment variables that tell how many ranks of an MPI job share this host (MPICH/Hydra, Open MPI)
LOCAL_RANKS_ENV = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


@dataclass
class ThreadPlan:
    cores: int  # CPUs of this process (affinity mask / ranks on this host)
    compute: int  # BLAS/OpenMP and numba threads
    reader_workers: int  # default reader workers
    blas: str = "not applied yet"
    numba: str = "not applied yet"

    def describe(self) -> str:
        return (
            f"threads: compute {self.compute} (BLAS: {self.blas}; numba: {self.numba}), reader "
            f"workers {self.reader_workers}; {self.cores} core{'s' if self.cores != 1 else ''}"
        )


_plan: ThreadPlan | None = None
_blas_limiter = None


def available_cores() -> int:
    """CPUs this process may use, divided among the MPI ranks that share the host."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    for name in LOCAL_RANKS_ENV:
        local = _env_int(name)
        if local:
            return max(1, cores // local)
    return max(1, cores)


def _env_int(name: str) -> int | None:
    """A positive integer from the environment, None when unset; anything else is a clear error."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={raw!r}: expected a positive whole number of threads")
    return value


def decide(compute: int | None = None, reader_workers: int | None = None, cores: int | None = None) -> ThreadPlan:
    """The plan (nothing applied): explicit arguments, else the environment, else the split above."""
    cores = cores or available_cores()
    readers = reader_workers or _env_int(ENV_READERS) or max(1, cores // 4)
    comp = compute or _env_int(ENV_COMPUTE) or max(1, cores - readers)
    for name, v in (("compute", comp), ("reader_workers", readers)):
        if int(v) < 1:
            raise ValueError(f"threads: {name} must be >= 1, got {v}")
    return ThreadPlan(int(cores), int(comp), int(readers))


def _apply_blas(n: int, explicit: bool) -> str:
    global _blas_limiter
    user = [f"{k}={os.environ[k]}" for k in BLAS_ENV if os.environ.get(k, "").strip()]
    if user and not explicit:
        return f"as set by {', '.join(user)}"
    from threadpoolctl import threadpool_info, threadpool_limits

    if _blas_limiter is not None:
        _blas_limiter.restore_original_limits()
    # process-wide for every BLAS/OpenMP library loaded now (NumPy's OpenBLAS); kept until reconfigured
    _blas_limiter = threadpool_limits(limits=n)
    libs = sorted({f"{i['internal_api']} {i['num_threads']}" for i in threadpool_info()})
    return ", ".join(libs) if libs else "no BLAS/OpenMP library loaded"


def _apply_numba(n: int, explicit: bool) -> str:
    import numba

    if not os.environ.get("NUMBA_THREADING_LAYER", "").strip():
        # Before numba starts its pool (get/set_num_threads start it): numba's default OpenMP layer
        # spin-waits between parallel regions; on a busy host (other processes, BLAS threads spinning
        # too) each region of a 2-thread run then waited for a scheduler time slice: a 0.35 ms ReLU took
        # 8 ms, the DLRM step 0.5-0.7 s instead of 40-60 ms. workqueue threads sleep. It is not
        # thread-safe: numbactr calls its compiled code from one thread (the training step);
        # NUMBA_THREADING_LAYER overrides this choice.
        numba.config.THREADING_LAYER = "workqueue"
    limit = numba.config.NUMBA_NUM_THREADS
    if os.environ.get("NUMBA_NUM_THREADS", "").strip() and not explicit:
        return f"{numba.get_num_threads()} as set by NUMBA_NUM_THREADS={os.environ['NUMBA_NUM_THREADS']}"
    # numba's setting is per calling thread: the training step (and its numba CPU kernels) runs here
    numba.set_num_threads(min(n, limit))
    return str(numba.get_num_threads())


def configure(compute: int | None = None, reader_workers: int | None = None) -> ThreadPlan:
    """Decide and apply the thread plan (see the module docstring); returns it."""
    global _plan
    plan = decide(compute, reader_workers)
    explicit = compute is not None or _env_int(ENV_COMPUTE) is not None
    plan.blas = _apply_blas(plan.compute, explicit)
    plan.numba = _apply_numba(plan.compute, explicit)
    _plan = plan
    return plan


def current() -> ThreadPlan:
    """The applied plan (applies the default one on first use)."""
    return _plan if _plan is not None else configure()


def reader_workers() -> int:
    """Reader workers to start when the user gave no num_workers."""
    return current().reader_workers
