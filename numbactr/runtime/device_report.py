"""``numbactr device``: what numbactr finds on this machine and what does not fit.

Two halves, so that a test can check every diagnosis without the hardware it is about:

* ``gather()`` probes the machine into a dict of plain facts, each probe in its own try/except (a probe
  that fails leaves its fact None and its error under ``errors``): the device numbactr resolves, the
  NVIDIA driver, the CUDA version the driver supports, the GPUs (name, compute capability, memory),
  numba-cuda and the CUDA major of its bindings and compiler wheels, CuPy and the CUDA major its wheel
  was built for, NCCL, MPI and this rank's placement and GPU.
* ``diagnose(facts)`` is pure: a list of (level, message), level "error" (numbactr cannot use the GPU
  as installed), "warning" (it runs, not as intended) or "note".

``report(facts, diagnoses)`` formats both; ``main()`` prints them and returns 1 when a diagnosis is an
error, else 0 (a machine without a GPU is a note, not an error: numbactr runs on cpu there); a device
that cannot be resolved ends the command with its one-line error after the report.
"""

from __future__ import annotations

import os
import re

#: CUDA 13 dropped the GPUs below compute capability 7.5 (Maxwell, Pascal, Volta); CUDA 12 starts at 5.0
MIN_CC = {12: (5, 0), 13: (7, 5)}


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _major(ver: str | None) -> int | None:
    m = re.match(r"\s*(\d+)", ver or "")
    return int(m.group(1)) if m else None


def _cuda_int(v: int) -> str:
    """CUDA's integer version (12040) as '12.4'."""
    return f"{v // 1000}.{(v % 1000) // 10}"


def cupy_wheels() -> dict[str, str]:
    """Installed CuPy distributions: name -> version (cupy-cuda12x, cupy-cuda13x, cupy from source...)."""
    from importlib.metadata import distributions

    out = {}
    for d in distributions():
        name = (d.metadata["Name"] or "").lower()
        if name == "cupy" or name.startswith("cupy-cuda") or name.startswith("cupy-rocm"):
            out[name] = d.version
    return out


def wheel_cuda_major(name: str) -> int | None:
    """The CUDA major a CuPy wheel is built for: cupy-cuda12x -> 12, cupy-cuda13x -> 13; None otherwise."""
    m = re.fullmatch(r"cupy-cuda(\d+)x", name)
    return int(m.group(1)) if m else None


def gather() -> dict:
    """The facts of this machine (module docstring); never raises."""
    f: dict = {"errors": {}}

    def probe(key, fn):
        try:
            f[key] = fn()
        except Exception as e:  # noqa: BLE001 (each probe reports its own failure)
            f[key] = None
            f["errors"][key] = " ".join(f"{type(e).__name__}: {e}".split())[:300]

    from numbactr.runtime import device

    f["asked"] = os.environ.get("NUMBACTR_DEVICE", "").strip().lower() or None
    f["simulator"] = os.environ.get("NUMBA_ENABLE_CUDASIM", "") == "1"

    def resolve():
        try:
            device.kind()
        except device.DeviceError as e:
            f["device_exception"] = e
            raise
        return device.describe()

    probe("device", resolve)
    f["kind"] = device._state["kind"]
    f["gpu_index"] = device._state["gpu"]
    probe("nvidia_driver", _nvidia_driver)
    probe("numba", lambda: _dist_version("numba"))
    probe("numba_cuda", lambda: _dist_version("numba-cuda"))
    probe("cuda_bindings", lambda: _dist_version("cuda-bindings"))
    probe("cuda_toolkit_wheels", _toolkit_wheels)
    probe(
        "cuda_home",
        lambda: next(
            (
                p
                for p in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")
                if p and os.path.isdir(p)
            ),
            None,
        ),
    )
    probe("cupy_wheels", cupy_wheels)
    f["driver_cuda"] = f["gpus"] = f["numba_cuda_error"] = None
    if not f["simulator"]:
        probe("numba_cuda_available", _numba_available)
        probe("driver_cuda", _driver_cuda)
        probe("gpus", _gpus)
    else:
        f["numba_cuda_available"] = None
    probe("cupy", _cupy)
    probe("nccl", _nccl)
    probe("mpi", _mpi)
    probe("placement", _placement)
    f["visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    probe("transport_env", lambda: os.environ.get("NUMBACTR_COMM") or None)
    return f


def _nvidia_driver() -> str | None:
    """The kernel driver's version (e.g. '570.86.15') from /proc, None without an NVIDIA driver."""
    try:
        with open("/proc/driver/nvidia/version") as fh:
            text = fh.read()
    except OSError:
        return None
    m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([0-9][0-9.]+)", text)
    return m.group(1) if m else text.splitlines()[0][:100]


def _toolkit_wheels() -> dict[str, str]:
    """The CUDA compiler/runtime wheels numba-cuda's [cu12]/[cu13] extras install: name -> version."""
    names = (
        "cuda-toolkit",
        "nvidia-cuda-nvrtc-cu12",
        "nvidia-cuda-nvrtc",
        "nvidia-nvvm",
        "nvidia-cuda-nvcc-cu12",
        "nvidia-cuda-runtime-cu12",
        "nvidia-cuda-runtime",
        "nvidia-nvjitlink-cu12",
        "nvidia-nvjitlink",
    )
    return {n: v for n in names if (v := _dist_version(n))}


def _numba_available() -> dict:
    from numba import cuda

    from numbactr.runtime.device import _cuda_reason

    ok = bool(cuda.is_available())
    return {"available": ok, "reason": "" if ok else _cuda_reason(cuda.cuda_error())}


def _driver_cuda() -> str:
    """The newest CUDA the driver supports, 'major.minor' (numba's driver API)."""
    from numba.cuda.cudadrv.driver import driver

    major, minor = driver.get_version()
    return f"{major}.{minor}"


def _gpus() -> list[dict]:
    from numba import cuda

    from numbactr.distributed.comm import gpu_pci_key
    from numbactr.distributed.placement import pci_text

    out = []
    for g in cuda.gpus:
        name = g.name.decode() if isinstance(g.name, bytes) else g.name
        row = {"index": g.id, "name": name, "cc": "%d.%d" % g.compute_capability, "memory_gib": None}
        key = gpu_pci_key(g.id)  # what tells ranks' GPUs apart (Comm.transport)
        row["pci"] = pci_text(key) if key >= 0 else None
        try:
            import cupy

            props = cupy.cuda.runtime.getDeviceProperties(g.id)
            row["memory_gib"] = round(props["totalGlobalMem"] / 2**30, 1)
        except Exception:  # noqa: BLE001 (no CuPy: numba needs a context for the memory size)
            pass
        out.append(row)
    return out


def _cupy() -> dict | None:
    try:
        import cupy
    except ImportError:
        return None
    out = {"version": cupy.__version__, "runtime": None, "driver": None}
    try:
        out["runtime"] = _cuda_int(cupy.cuda.runtime.runtimeGetVersion())
        out["driver"] = _cuda_int(cupy.cuda.runtime.driverGetVersion())
    except Exception as e:  # noqa: BLE001 (a CuPy built for a newer CUDA than the driver)
        out["error"] = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    return out


def _nccl() -> dict | None:
    try:
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001
        return None
    out = {"version": None, "wheel": _dist_version("nvidia-nccl-cu12") or _dist_version("nvidia-nccl-cu13")}
    try:
        v = nccl.get_version()
        out["version"] = f"{v // 10000}.{(v % 10000) // 100}.{v % 100}" if v >= 10000 else str(v)
    except Exception as e:  # noqa: BLE001 (libnccl not found)
        out["error"] = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    return out


def _mpi() -> dict | None:
    try:
        import mpi4py
    except ImportError:
        return None
    from numbactr.distributed.comm import launched

    size, rank, var = launched()
    out = {"mpi4py": mpi4py.__version__, "launched_ranks": size, "library": None}
    if size > 1:  # MPI is running already (import numbactr started it)
        from mpi4py import MPI

        out["library"] = " ".join(MPI.Get_library_version().splitlines()[0].split())
    return out


def _placement() -> dict:
    from numbactr.distributed.comm import placement

    p = placement()
    return {
        "rank": p.rank,
        "size": p.size,
        "local_rank": p.local_rank,
        "local_size": p.local_size,
        "node": p.node,
        "nodes": p.nodes,
        "source": p.source,
    }


def _cc_tuple(cc: str) -> tuple[int, int]:
    a, b = cc.split(".")
    return int(a), int(b)


def _ver_tuple(v: str) -> tuple[int, int]:
    parts = [int(x) for x in re.findall(r"\d+", v)[:2]] + [0, 0]
    return parts[0], parts[1]


def diagnose(f: dict) -> list[tuple[str, str]]:
    """(level, message) for every way the facts do not fit; pure (no probing)."""
    out: list[tuple[str, str]] = []
    err, warn, note = (
        (lambda m: out.append(("error", m))),
        (lambda m: out.append(("warning", m))),
        (lambda m: out.append(("note", m))),
    )
    errors = f.get("errors") or {}
    if errors.get("device"):
        err(f"the device cannot be resolved: {errors['device']}")
    if f.get("simulator"):
        note(
            "simulator mode (NUMBA_ENABLE_CUDASIM=1 or NUMBACTR_DEVICE=sim): kernels run in Numba's CUDA "
            "simulator on the CPU, slowly, for tests; no GPU is used"
        )
        return out
    wheels = f.get("cupy_wheels") or {}
    cupy = f.get("cupy")
    driver = f.get("driver_cuda")
    gpus = f.get("gpus") or []
    avail = f.get("numba_cuda_available") or {}
    if not f.get("nvidia_driver") and not driver:
        reason = avail.get("reason") or ""
        note("no NVIDIA driver: numbactr runs on the cpu device" + (f" (numba: {reason})" if reason else ""))
        if wheels or cupy:
            note("CuPy is installed but unused without a driver")
        return out
    if driver and not gpus:
        err(
            f"the NVIDIA driver (CUDA {driver}) is loaded but numba sees no GPU: check CUDA_VISIBLE_DEVICES "
            f"and that the container was started with the GPUs (--gpus all)"
        )
    drv_major = _major(driver)
    if len(wheels) > 1:
        err(
            f"several CuPy wheels are installed ({', '.join(f'{k} {v}' for k, v in sorted(wheels.items()))}): "
            f"they overwrite each other's files; pip uninstall all but the one for CUDA {drv_major}"
        )
    cupy_major = next((wheel_cuda_major(n) for n in wheels if wheel_cuda_major(n)), None)
    extra = f"numbactr[cu{drv_major if drv_major in (12, 13) else 12}]"
    if cupy is None and gpus:
        err(f"a GPU is present but CuPy is not installed (or does not import): pip install '{extra}'")
    if cupy_major and drv_major and cupy_major > drv_major:
        err(
            f"CuPy is built for CUDA {cupy_major} (cupy-cuda{cupy_major}x) but the driver supports CUDA up to "
            f"{driver}: install cupy-cuda{drv_major}x ('numbactr[cu{drv_major}]') or upgrade the driver"
        )
    if cupy and cupy.get("error"):
        err(f"CuPy imports but cannot talk to the CUDA runtime/driver: {cupy['error']}")
    from numbactr.runtime.device import CUPY_NOSYNC_SORT, cupy_sort_synchronizes

    if cupy and cupy.get("version") and cupy_sort_synchronizes(cupy["version"]):
        warn(
            f"CuPy {cupy['version']} ends every sort with a host synchronization (the embedding's backward "
            f"sorts each step): each training step waits for the GPU and CUDA graphs stay off; install CuPy "
            f">= {CUPY_NOSYNC_SORT} (pip install '{extra}')"
        )
    bind_major = _major(f.get("cuda_bindings"))
    if f.get("numba_cuda") is None:
        err(f"numba-cuda is not installed: pip install '{extra}'")
    elif bind_major is None:
        err(f"numba-cuda {f['numba_cuda']} has no cuda-bindings: pip install 'numba-cuda[cu{drv_major}]'")
    else:
        if drv_major and bind_major > drv_major:
            err(
                f"numba-cuda's cuda-bindings {f['cuda_bindings']} are for CUDA {bind_major} but the driver "
                f"supports CUDA up to {driver}: pip install 'numba-cuda[cu{drv_major}]' or upgrade the driver"
            )
        tk = f.get("cuda_toolkit_wheels") or {}
        tk_major = (
            _major(tk.get("cuda-toolkit"))
            or _major(tk.get("nvidia-cuda-nvrtc-cu12"))
            or _major(tk.get("nvidia-cuda-nvrtc"))
        )
        if not tk and not f.get("cuda_home"):
            err(
                f"numba-cuda {f['numba_cuda']} has no CUDA compiler (NVVM/NVRTC): neither the [cu{bind_major}] "
                f"extra's wheels nor a CUDA toolkit (CUDA_HOME, /usr/local/cuda) is present: pip install "
                f"'numba-cuda[cu{bind_major}]'"
            )
        elif tk_major and tk_major != bind_major:
            warn(
                f"numba-cuda's bindings are for CUDA {bind_major} but its compiler wheels for CUDA {tk_major}: "
                f"reinstall with one extra, pip install 'numba-cuda[cu{bind_major}]'"
            )
        if cupy_major and cupy_major != bind_major:
            warn(
                f"CuPy is built for CUDA {cupy_major} and numba-cuda's bindings for CUDA {bind_major}: both "
                f"load, but two CUDA runtimes share the process; prefer one major (numbactr[cu{bind_major}])"
            )
    if avail and avail.get("available") is False and gpus:
        err("numba.cuda reports CUDA unavailable although GPUs are listed")
    tk_for_cc = cupy_major or bind_major
    for g in gpus:
        need = MIN_CC.get(tk_for_cc or 0)
        if need and g.get("cc") and _cc_tuple(g["cc"]) < need:
            err(
                f"GPU {g['index']} ({g['name']}, compute capability {g['cc']}) is older than CUDA "
                f"{tk_for_cc} supports (>= {need[0]}.{need[1]}): use the cu12 extra"
            )
    pl = f.get("placement") or {}
    from numbactr.distributed.placement import pinned_device

    pinned = pinned_device(f.get("visible_devices"))
    if gpus and pl.get("local_size", 1) > len(gpus):
        if pinned is not None and len(gpus) == 1:
            # a per-rank CUDA_VISIBLE_DEVICES (Slurm --gpus-per-task=1, a wrapper script): each rank sees only
            # its own GPU, so the count says nothing about sharing; Comm.transport compares PCI addresses
            note(
                f"CUDA_VISIBLE_DEVICES={pinned} shows this rank one GPU, as a launcher that gives each rank its "
                f"own does: it runs on it whatever vvgpu lists; the {pl['local_size']} ranks of this node use "
                f"NCCL when their GPUs' PCI addresses differ, host MPI when some share one (decided at the "
                f"first device collective)"
            )
        else:
            warn(
                f"{pl['local_size']} ranks on this node share {len(gpus)} GPU(s): ranks wrap around "
                f"(local rank i uses GPU i % {len(gpus)}) and collectives stage through host MPI, not NCCL"
            )
    nccl = f.get("nccl")
    if pl.get("size", 1) > 1 and gpus:
        if nccl is None or nccl.get("error"):
            warn(
                "several ranks with GPUs but cupy.cuda.nccl is unavailable"
                + (f" ({nccl['error']})" if nccl and nccl.get("error") else "")
                + f": collectives stage through host MPI; pip install 'nvidia-nccl-cu{cupy_major or drv_major}'"
            )
    if f.get("kind") == "cpu" and gpus and cupy is not None and not errors.get("device"):
        note("GPUs are present but the cpu device runs (NUMBACTR_DEVICE=cpu?)")
    mpi = f.get("mpi")
    if mpi is None:
        note("mpi4py is not installed: one rank only (pip install 'numbactr[mpi]' for mpiexec runs)")
    return out


def report(f: dict, diagnoses: list[tuple[str, str]]) -> str:
    """The facts and diagnoses as indented text."""
    lines = [f"device:        {f.get('device') or f.get('errors', {}).get('device')}"]
    if f.get("gpu_index") is not None:
        lines.append(f"this rank:     GPU {f['gpu_index']}")
    pl = f.get("placement")
    if pl:
        lines.append(
            f"placement:     rank {pl['rank']} of {pl['size']}, local rank {pl['local_rank']} of "
            f"{pl['local_size']} on node {pl['node']} of {pl['nodes']} ({pl['source']})"
        )
    lines.append(
        f"driver:        {f.get('nvidia_driver') or 'none'}"
        + (f", supports CUDA {f['driver_cuda']}" if f.get("driver_cuda") else "")
    )
    for g in f.get("gpus") or []:
        mem = f", {g['memory_gib']} GiB" if g.get("memory_gib") is not None else ""
        pci = f", PCI {g['pci']}" if g.get("pci") else ""
        lines.append(f"GPU {g['index']}:         {g['name']}, compute capability {g['cc']}{mem}{pci}")
    lines.append(
        f"numba:         {f.get('numba')}; numba-cuda {f.get('numba_cuda')}, cuda-bindings "
        f"{f.get('cuda_bindings')} (CUDA {_major(f.get('cuda_bindings')) or '?'})"
    )
    tk = f.get("cuda_toolkit_wheels") or {}
    lines.append(
        "CUDA wheels:   "
        + (", ".join(f"{k} {v}" for k, v in sorted(tk.items())) or "none")
        + (f"; toolkit at {f['cuda_home']}" if f.get("cuda_home") else "")
    )
    wheels = f.get("cupy_wheels") or {}
    cupy = f.get("cupy")
    cupy_line = (
        ", ".join(f"{k} {v} (CUDA {wheel_cuda_major(k) or '?'})" for k, v in sorted(wheels.items())) or "not installed"
    )
    if cupy and cupy.get("runtime"):
        cupy_line += f"; runtime CUDA {cupy['runtime']}, driver CUDA {cupy['driver']}"
    lines.append(f"CuPy:          {cupy_line}")
    nccl = f.get("nccl")
    lines.append(
        "NCCL:          "
        + (
            "not available (cupy.cuda.nccl does not import)"
            if nccl is None
            else f"{nccl.get('version') or nccl.get('error')} (wheel {nccl.get('wheel')})"
        )
    )
    mpi = f.get("mpi")
    lines.append(
        "MPI:           "
        + (
            "mpi4py not installed"
            if mpi is None
            else f"mpi4py {mpi['mpi4py']}, {mpi['launched_ranks']} rank(s) launched"
            + (f", {mpi['library']}" if mpi.get("library") else "")
        )
    )
    if f.get("visible_devices") is not None:
        lines.append(f"CUDA_VISIBLE_DEVICES: {f['visible_devices']}")
    if f.get("transport_env"):
        lines.append(f"NUMBACTR_COMM: {f['transport_env']}")
    for key, e in sorted((f.get("errors") or {}).items()):
        if key != "device" and (f.get("nvidia_driver") or key not in ("driver_cuda", "gpus")):
            lines.append(f"probe {key} failed: {e}")
    lines.append("diagnosis:" if diagnoses else "diagnosis:     everything found fits")
    lines.extend(f"  {level}: {msg}" for level, msg in diagnoses)
    return "\n".join(lines)


def main() -> int:
    """Print the report; 1 when a diagnosis is an error, else 0. A device that cannot be resolved (e.g.
    NUMBACTR_DEVICE=gpu without a GPU) is re-raised after the report, so that the command line ends with
    its one-line error as every command does."""
    facts = gather()
    found = diagnose(facts)
    print(report(facts, found), flush=True)
    if facts.get("device_exception") is not None:
        raise facts["device_exception"]
    return 1 if any(level == "error" for level, _ in found) else 0
