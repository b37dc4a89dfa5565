"""Which device runs numbactr: ``gpu``, ``sim`` or ``cpu``.

| device | executes                                             | arrays |
|--------|------------------------------------------------------|--------|
| gpu    | the numba.cuda kernels on a real GPU                  | cupy   |
| sim    | the same kernels in Numba's CUDA simulator            | numpy  |
| cpu    | compiled CPU code (numba) or the NumPy references    | numpy  |

On cpu an op runs its compiled CPU version (numba's CPU JIT) where it has one and its NumPy reference
otherwise. ``NUMBACTR_CPU_REFERENCE=1`` in the environment, or the ``reference_ops()`` context manager,
makes the cpu device run the NumPy references only (the test oracle): ops decide per call, the embedding
engine when it is built (its impl "ref" instead of "cpu").

Choice, in order: ``NUMBACTR_DEVICE=gpu|sim|cpu``; else ``sim`` when the process already runs
Numba's simulator (``NUMBA_ENABLE_CUDASIM=1``); else ``gpu`` when a CUDA GPU and cupy are present;
else ``cpu``. ``sim`` must be chosen before numba is first imported, so this module sets
``NUMBA_ENABLE_CUDASIM`` itself when asked for ``sim``; ``import numbactr`` does that first thing.
One line on stdout says which device runs, why (numba's own reason when there is no CUDA GPU), and
the thread plan (numbactr.runtime.threads: BLAS/numba threads and reader workers).

On gpu each rank takes one GPU, chosen before any allocation from its local rank on its node
(numbactr.distributed.placement.choose_gpu: local rank i uses ``vvgpu[node][i % len]`` when CreateSolver
was given a vvgpu, else visible GPU ``i % visible``; a rank whose launcher pinned it to one GPU through
CUDA_VISIBLE_DEVICES takes that GPU whatever vvgpu lists); numba and CuPy are both pointed at it.
``numbactr device`` (numbactr.runtime.device_report) prints what was found and what does not fit.
"""

from __future__ import annotations

import contextlib
import os
import sys

from numbactr.runtime import sim_strict

DEVICES = ("gpu", "sim", "cpu")


class DeviceError(RuntimeError):
    """The requested device cannot run here."""


_state = {"kind": None, "why": "", "gpu": None, "vvgpu": None}


def _asked() -> str | None:
    asked = os.environ.get("NUMBACTR_DEVICE", "").strip().lower()
    if not asked:
        return None
    if asked not in DEVICES:
        raise DeviceError(f"NUMBACTR_DEVICE={asked!r} is not one of {', '.join(DEVICES)}")
    return asked


def _numba_simulated() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def _resolve() -> tuple[str, str]:
    asked = _asked()
    if asked == "sim":
        if "numba" in sys.modules and not _numba_simulated():
            raise DeviceError(
                "NUMBACTR_DEVICE=sim needs NUMBA_ENABLE_CUDASIM=1 before numba is first "
                "imported; import numbactr before numba (or export NUMBA_ENABLE_CUDASIM=1)"
            )
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        return "sim", "NUMBACTR_DEVICE=sim: kernels run in Numba's CUDA simulator"
    if asked == "cpu":
        return "cpu", f"NUMBACTR_DEVICE=cpu: {_cpu_ops()}"
    if _numba_simulated():
        if asked == "gpu":
            raise DeviceError(
                "NUMBACTR_DEVICE=gpu, but NUMBA_ENABLE_CUDASIM=1 puts numba in simulator "
                "mode; unset NUMBA_ENABLE_CUDASIM"
            )
        return "sim", "NUMBA_ENABLE_CUDASIM=1: kernels run in Numba's CUDA simulator"
    from numba import cuda

    if not cuda.is_available():
        reason = _cuda_reason(cuda.cuda_error())
        if asked == "gpu":
            raise DeviceError(
                f"NUMBACTR_DEVICE=gpu, but no CUDA GPU is usable here: {reason}; use NUMBACTR_DEVICE=cpu or sim"
            )
        return "cpu", f"{_cpu_ops()}; no CUDA GPU: {reason}"
    try:
        import cupy  # noqa: F401
    except ImportError:
        if asked == "gpu":
            raise DeviceError("NUMBACTR_DEVICE=gpu needs cupy: pip install 'numbactr[gpu]'") from None
        return "cpu", "a CUDA GPU is present but cupy is not installed (pip install 'numbactr[gpu]')"
    gpu, how = _select_gpu(cuda, cupy)
    name = cuda.get_current_device().name
    if isinstance(name, bytes):
        name = name.decode()
    return "gpu", f"numba.cuda kernels on GPU {gpu} {name} ({how})"


def _select_gpu(cuda, cupy) -> tuple[int, str]:
    """Make this rank's GPU current for numba and CuPy (before anything allocates); (index, why)."""
    from numbactr.distributed.comm import placement
    from numbactr.distributed.placement import PlacementError, choose_gpu

    try:
        pl = placement()
        gpu, why = choose_gpu(
            pl.local_rank, pl.node, len(cuda.gpus), _state["vvgpu"], os.environ.get("CUDA_VISIBLE_DEVICES")
        )
    except PlacementError as e:
        raise DeviceError(f"cannot choose this rank's GPU: {e}") from None
    cuda.select_device(gpu)
    cupy.cuda.Device(gpu).use()
    _state["gpu"] = gpu
    _no_interface_sync()
    return gpu, why


def _no_interface_sync() -> None:
    """Numba synchronizes the producer's stream (a host wait) each time a kernel argument comes in through
    the CUDA Array Interface with a stream, unless NUMBA_CUDA_ARRAY_INTERFACE_SYNC=0. numba-cuda 0.30 takes
    CuPy arrays through DLPack first (cudadrv.devicearray._to_strided_memory_view), which orders the streams
    on the device and never waits on the host, so this covers the other producers (arrays that offer only the
    interface). Every numbactr launch takes arrays made on the stream its kernels run on, so that wait would
    order nothing. Switched off here unless the environment sets it, in the environment too, so that numba's
    reload of its configuration (when a NUMBA_ variable changes) keeps it off."""
    if "NUMBA_CUDA_ARRAY_INTERFACE_SYNC" in os.environ:
        return
    os.environ["NUMBA_CUDA_ARRAY_INTERFACE_SYNC"] = "0"
    try:
        from numba.cuda.core import config as cuda_config
    except ImportError:  # older numba-cuda: numba's own config holds it
        from numba import config as cuda_config
    cuda_config.CUDA_ARRAY_INTERFACE_SYNC = 0


def gpu_index() -> int | None:
    """The index (among the visible GPUs) of this rank's GPU on the gpu device, else None."""
    return _state["gpu"] if kind() == "gpu" else None


def bind_thread() -> None:
    """Make this rank's GPU the calling thread's current device (nothing off the gpu device). A thread
    starts on GPU 0 in CUDA's runtime and in CuPy: a worker thread's CuPy work would run there, and its
    first CUDA call would put a context on GPU 0 for every rank."""
    gpu = gpu_index()
    if gpu is not None:
        import cupy

        if cupy.cuda.runtime.getDevice() != gpu:
            cupy.cuda.runtime.setDevice(gpu)


def use_vvgpu(vvgpu) -> str:
    """Record CreateSolver's vvgpu for the choice of this rank's GPU; returns what the caller should warn
    about ("" when nothing): GPUs vvgpu lists that no rank of this job uses, or a GPU already chosen
    before the solver was created that differs from vvgpu's."""
    from numbactr.distributed.comm import placement
    from numbactr.distributed.placement import DEFAULT_VVGPU, choose_gpu, idle_gpus

    vv = tuple(tuple(int(g) for g in n) for n in vvgpu)
    _state["vvgpu"] = vv
    if vv == DEFAULT_VVGPU:
        return ""
    pl = placement()
    notes = []
    idle = idle_gpus(pl, vv)
    if idle:
        notes.append(
            f"numbactr runs one GPU per process (local rank i of node n uses vvgpu[n][i % len]); this "
            f"job has {pl.size} rank(s), {pl.local_size} per node on {pl.nodes} node(s), so "
            f"{', '.join(f'node {n} GPU {g}' for n, g in idle)} stay(s) idle; start one rank per "
            f"listed GPU (mpiexec -n {sum(len(n) for n in vv)})"
        )
    if _state["kind"] == "gpu" and _state["gpu"] is not None:
        from numba import cuda

        want, _ = choose_gpu(pl.local_rank, pl.node, len(cuda.gpus), vv, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if want != _state["gpu"]:
            notes.append(
                f"the device was resolved before CreateSolver, on GPU {_state['gpu']}, and stays "
                f"there (vvgpu asks for GPU {want}); create the solver before anything uses the device"
            )
    return "; ".join(notes)


def _cpu_ops() -> str:
    """What the cpu device runs, for the start-up line."""
    if os.environ.get(ENV_REFERENCE, "").strip() == "1":
        return f"NumPy reference ops ({ENV_REFERENCE}=1)"
    return "compiled CPU ops"


def _cuda_reason(err) -> str:
    """numba's reason for having no CUDA: the first non-empty line of its message, which starts with a
    newline ("\nCUDA driver library cannot be found.\nEnsure that ...")."""
    lines = [ln.strip() for ln in str(err or "").splitlines() if ln.strip()]
    return lines[0].rstrip(".") if lines else "numba reports no CUDA driver or device"


def kind() -> str:
    """The device in use: 'gpu', 'sim' or 'cpu' (resolved on first call, announced once).

    The announcement also applies and states the thread plan (numbactr.runtime.threads)."""
    if _state["kind"] is None:
        _state["kind"], _state["why"] = _resolve()
        from numbactr.runtime import threads

        plan = threads.current()
        print(f"numbactr: device={_state['kind']} ({_state['why']}); {plan.describe()}", flush=True)
    return _state["kind"]


def describe() -> str:
    """'device=<kind> (<why>)' for the device in use (resolves it first)."""
    kind()
    return f"device={_state['kind']} ({_state['why']})"


def set_device(name: str) -> None:
    """Switch device at run time, e.g. tests comparing ``cpu`` with ``sim`` in one process.

    ``sim`` and ``gpu`` are exclusive per process (numba fixes simulator mode at import), so the only
    switches allowed are between ``cpu`` and whichever of ``sim``/``gpu`` numba is in.
    """
    if name not in DEVICES:
        raise DeviceError(f"unknown device {name!r}; expected one of {', '.join(DEVICES)}")
    if name != "cpu":
        sim = _numba_simulated()
        if name == "sim" and not sim:
            raise DeviceError("device 'sim' needs NUMBA_ENABLE_CUDASIM=1 before numba is imported")
        if name == "gpu":
            from numba import cuda

            if sim or not cuda.is_available():
                raise DeviceError("device 'gpu' is not available in this process")
    _state["kind"], _state["why"] = name, f"set_device({name!r}) was called"
    if _held[0] is not None:  # inside held_choices(): hold the new device's answer
        _held[0] = _read_compiled()


def uses_kernels() -> bool:
    """True when ops launch numba.cuda kernels (gpu or sim), False for NumPy references."""
    return kind() != "cpu"


ENV_REFERENCE = "NUMBACTR_CPU_REFERENCE"
_reference_depth = [0]  # reference_ops() nesting


_held = [None]  # compiled_cpu()'s answer while a held_choices() block is open


def compiled_cpu() -> bool:
    """True when ops on the cpu device run their compiled CPU versions (where they have one): the device
    is cpu, NUMBACTR_CPU_REFERENCE is unset or 0, and no reference_ops() block is open."""
    if _reference_depth[0]:
        return False
    held = _held[0]
    return _read_compiled() if held is None else held


def _read_compiled() -> bool:
    if kind() != "cpu":
        return False
    raw = os.environ.get(ENV_REFERENCE, "").strip()
    if raw not in ("", "0", "1"):
        raise DeviceError(f"{ENV_REFERENCE}={raw!r}: expected 1 (NumPy references only) or 0")
    return raw != "1"


@contextlib.contextmanager
def held_choices():
    """Inside the block compiled_cpu() answers from one reading of the environment (a whole forward or
    training step asks it once per op; reading NUMBACTR_CPU_REFERENCE costs about a microsecond, which a
    one-sample inference request notices). reference_ops() and set_device() still take effect inside."""
    if _held[0] is not None:
        yield
        return
    _held[0] = _read_compiled()
    try:
        yield
    finally:
        _held[0] = None


@contextlib.contextmanager
def reference_ops():
    """Inside the block the cpu device runs every op's NumPy reference, not its compiled CPU version
    (tests compare the two); an embedding engine built inside uses its reference impl."""
    _reference_depth[0] += 1
    try:
        yield
    finally:
        _reference_depth[0] -= 1


def xp():
    """The array module of the current device: cupy on gpu, numpy otherwise (on sim inside
    numbactr.runtime.sim_strict.strict(), a numpy whose arrays record implicit host reads)."""
    k = kind()
    if k == "gpu":
        import cupy

        return cupy
    if k == "sim" and sim_strict.active():
        return sim_strict.XP
    import numpy

    return numpy


def is_host_array(a) -> bool:
    """Is `a` host memory (a NumPy array), reading which costs no device-to-host copy? Inside
    numbactr.runtime.sim_strict.strict() a sim array made there counts as device memory, as a CuPy array does on a
    GPU."""
    import numpy

    return isinstance(a, numpy.ndarray) and not (sim_strict.active() and isinstance(a, sim_strict.DeviceArray))


def contig(a):
    """a itself when C-contiguous, else a contiguous copy (kernels take contiguous arrays)."""
    return a if a.flags.c_contiguous else xp().ascontiguousarray(a)


def empty(shape, dtype="float32"):
    """An uninitialized array of the current device."""
    return xp().empty(tuple(shape), dtype)


#: id(device array) -> (the device array, a read-only host array holding the same values): the host copies of
#: staged input arrays (numbactr.data.staging.DeviceStager with host_mirrors), which to_host returns without
#: reading the device; the device array is held so that its id is not reused while it is registered
_host_mirrors: dict = {}


def add_host_mirrors(pairs) -> None:
    """Register (device array, host array) pairs of equal contents for to_host (the caller removes them with
    remove_host_mirrors before either changes)."""
    for dev, host in pairs:
        view = host.view()
        view.flags.writeable = False
        _host_mirrors[id(dev)] = (dev, view)


def remove_host_mirrors(pairs) -> None:
    for dev, _ in pairs:
        m = _host_mirrors.get(id(dev))
        if m is not None and m[0] is dev:
            del _host_mirrors[id(dev)]


def host_mirror(a):
    """The registered read-only host copy of device array `a`, or None."""
    m = _host_mirrors.get(id(a))
    return m[1] if m is not None and m[0] is a else None


def to_host(a):
    """A NumPy copy (or view) of a device array; counted as a host read (kernels.launch.COUNTS). A staged input
    array's registered host copy (add_host_mirrors) is returned as it is, read-only: no read of the device."""
    import numpy

    mirror = host_mirror(a)
    if mirror is not None:
        return mirror
    from numbactr.kernels.launch import count_host_read

    count_host_read()
    if hasattr(a, "get"):
        return a.get()
    return numpy.asarray(a)


# Runs at `import numbactr`, before anything imports numba: the simulator must be chosen first.
if os.environ.get("NUMBACTR_DEVICE", "").strip().lower() == "sim" and "numba" not in sys.modules:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


#: the first CuPy whose sorts enqueue without a host synchronization (thrust's par_nosync policy; CuPy 13's
#: par policy synchronizes the stream at the end of every sort, which invalidates a stream capture)
CUPY_NOSYNC_SORT = 14


def cupy_sort_synchronizes(version: str | None = None) -> bool:
    """Does this CuPy (``version``, default the installed one) end every sort with a host synchronization?
    The embedding's backward sorts each step's rows with CuPy (kernels.tbe), so with such a CuPy a step waits
    for the GPU once per step and cannot be captured."""
    if version is None:
        try:
            import cupy
        except ImportError:  # no CuPy: no CuPy sort either (the cpu and sim devices)
            return False
        version = cupy.__version__
    try:
        major = int(str(version).split(".")[0])
    except ValueError:
        return False  # a source build with an odd version string: assume a current one
    return major < CUPY_NOSYNC_SORT


def _probe() -> tuple[str, int | None]:
    return kind(), gpu_index()


from numbactr.distributed import comm as _comm  # noqa: E402  (device -> distributed: the rank's placement)

_comm.set_device_probe(_probe)
