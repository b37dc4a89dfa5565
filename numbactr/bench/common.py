"""What every benchmark shares: result tables, the device/torch environment, peak bandwidth, timing."""

import contextlib
import datetime
import os
import platform
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

HASH_COLUMNS = ["impl", "keys", "op", "batch keys", "distinct", "capacity", "ms", "Mkeys/s"]
EMBEDDING_FWD_COLUMNS = ["impl", "threads", "pooling", "B", "features", "L", "D", "rows", "fwd ms", "fwd GB/s"]
EMBEDDING_BWD_COLUMNS = [
    "impl",
    "threads",
    "pooling",
    "optimizer",
    "state B/row",
    "B",
    "features",
    "L",
    "D",
    "rows",
    "bwd+upd ms",
    "bwd+upd GB/s",
]
EMBEDDING_PEAK_COLUMNS = ["fwd % peak", "bwd+upd % peak"]  # appended on a GPU (peak: peak_bandwidth)
DLRM_COLUMNS = ["impl", "threads", "batch", "slots", "rows", "D", "step ms", "samples/s"]

#: peak memory bandwidth in GB/s by device-name fragments; the first entry whose fragments all occur
#: in the (lower-cased) name wins, so the more specific names come first
KNOWN_GPU_BANDWIDTH = [
    (("h200",), 4800.0, "H200"),
    (("h100", "pcie"), 2000.0, "H100 PCIe"),
    (("h100",), 3350.0, "H100 SXM"),
    (("a100", "80gb", "pcie"), 1935.0, "A100 80GB PCIe"),
    (("a100", "80gb"), 2039.0, "A100 80GB"),
    (("a100",), 1555.0, "A100 40GB"),
]


# ---- results -----------------------------------------------------------------------------------
@dataclass
class Table:
    """One benchmark's result: a title, context lines and a markdown table."""

    title: str
    columns: list
    rows: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    #: the cells as given (numbers unformatted), for the JSON results (numbactr.bench.results)
    raw: list = field(default_factory=list)

    def add(self, *cells) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title}: {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([_cell(c) for c in cells])
        self.raw.append(list(cells))

    def markdown(self) -> str:
        out = [f"### {self.title}", ""]
        out += [f"- {n}" for n in self.notes]
        out += [
            "",
            "| " + " | ".join(self.columns) + " |",
            "|" + "|".join("---" if i == 0 else "---:" for i in range(len(self.columns))) + "|",
        ]
        out += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(out) + "\n"


def _cell(v) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}"
    if v is None or not np.isfinite(v):
        return "-"
    v = float(v)
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}" if v < 1 else f"{v:.2f}"


# ---- environment -------------------------------------------------------------------------------
class Env:
    """The device numbactr runs on, its array module and synchronisation, and the torch baseline."""

    def __init__(self, use_torch: bool = True):
        from numbactr.runtime import device

        self.kind = device.kind()
        self.kernels = device.uses_kernels()
        self.xp = device.xp()
        self.device_name = _device_name(self.kind)
        self.torch = None
        self.torch_why = ""
        self.torch_dev = "cpu"
        if not use_torch:
            self.torch_why = "torch baseline skipped (--no-torch)"
        else:
            try:
                import torch
            except ImportError:
                self.torch_why = "torch not installed: no PyTorch baseline (pip install torch to compare)"
            else:
                self.torch = torch
                if self.kind == "gpu" and torch.cuda.is_available():
                    self.torch_dev = "cuda"
        self.peak_gbs, self.peak_src = (None, "")
        if self.kind == "gpu":
            self.peak_gbs, self.peak_src = peak_bandwidth(self.device_name)

    def sync(self) -> None:
        if self.kind == "gpu":
            import cupy

            cupy.cuda.runtime.deviceSynchronize()

    def torch_sync(self) -> None:
        if self.torch is not None and self.torch_dev == "cuda":
            self.torch.cuda.synchronize()

    @property
    def torch_label(self) -> str:
        return f"torch-{self.torch_dev}"

    def header(self) -> list:
        """Context lines every table starts with: device, date, versions."""
        now = datetime.datetime.now().astimezone()
        from numbactr.runtime import threads

        lines = [
            f"device: {self.kind} ({self.device_name})",
            f"date: {now.strftime('%Y-%m-%d %H:%M %Z')}",
            f"numpy {np.__version__}, python {platform.python_version()}",
            f"{threads.current().describe()} (numbactr.runtime.threads; NUMBACTR_THREADS=N sets the compute threads)",
        ]
        if hasattr(os, "getloadavg"):  # other work on the host skews every figure: say how much
            lines.append(f"host load average (1 min) at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        if self.kind == "sim":
            lines.append("WARNING: device=sim times Numba's CUDA simulator; these are not performance figures")
        if self.torch is not None:
            lines.append(
                f"torch {self.torch.__version__} on {self.torch_dev}"
                + (f" ({self.torch.get_num_threads()} threads)" if self.torch_dev == "cpu" else "")
            )
        else:
            lines.append(self.torch_why)
        return lines


def _device_name(kind: str) -> str:
    if kind == "gpu":
        from numba import cuda

        name = cuda.get_current_device().name
        return name.decode() if isinstance(name, bytes) else str(name)
    return f"{cpu_model()}, {os.cpu_count()} cores"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` says."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return cpu


def known_peak_bandwidth(name: str):
    """(GB/s, label) of a GPU in KNOWN_GPU_BANDWIDTH by its device name, or (None, '')."""
    low = name.lower()
    for frags, gbs, label in KNOWN_GPU_BANDWIDTH:
        if all(f in low for f in frags):
            return gbs, label
    return None, ""


def measure_copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """GB/s of a cupy device-to-device copy (read + write counted)."""
    import cupy

    src = cupy.ones(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    dst[...] = src
    cupy.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst[...] = src
    cupy.cuda.runtime.deviceSynchronize()
    return 2.0 * src.nbytes * reps / (time.perf_counter() - t0) / 1e9


def peak_bandwidth(name: str):
    """(GB/s, where it came from): the memory bandwidth the benchmarks' "% peak" columns divide by. The
    measured device-to-device copy (issue 14's goals are fractions of the measured bandwidth; a copy
    reaches about 90% of an H100's spec sheet), with the spec sheet's figure beside it; the spec sheet
    alone when the copy cannot run."""
    gbs, label = known_peak_bandwidth(name)
    spec = f"; {label} spec sheet: {gbs:g} GB/s" if gbs is not None else ""
    try:
        return measure_copy_bandwidth(), "measured cupy device-to-device copy, read + write counted" + spec
    except Exception as e:  # noqa: BLE001 (a benchmark keeps going without the fraction)
        if gbs is not None:
            return gbs, f"{label} spec sheet (the copy failed: {type(e).__name__}: {e})"
        return None, f"unknown ({type(e).__name__}: {e})"


def measure(fn, *, sync=None, setup=None, min_time: float = 1.0, max_reps: int = 50) -> float:
    """Median seconds of fn() after one warm-up call; repeats until min_time has passed (>= 1 rep).

    setup(), when given, runs before every call outside the timed region (e.g. clearing a table).
    """
    sync = sync or (lambda: None)
    if setup:
        setup()
    fn()  # warm-up: JIT compilation, first-touch page faults
    sync()
    times = []
    start = time.perf_counter()
    while not times or (time.perf_counter() - start < min_time and len(times) < max_reps):
        if setup:
            setup()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _host(a) -> np.ndarray:
    from numbactr.runtime import device

    return device.to_host(a)


@contextlib.contextmanager
def thread_count(env: Env, n):
    """numbactr's compute threads (numbactr.runtime.threads: BLAS + numba) and torch's intra-op threads (which
    FBGEMM's CPU kernels use) set to n inside; n = None leaves them (a GPU run)."""
    if n is None:
        yield
        return
    from numbactr.runtime import threads

    before = threads.current()
    torch_before = env.torch.get_num_threads() if env.torch is not None else None
    threads.configure(compute=n, reader_workers=before.reader_workers)
    if env.torch is not None:
        env.torch.set_num_threads(n)
    try:
        yield
    finally:
        threads.configure(compute=before.compute, reader_workers=before.reader_workers)
        if env.torch is not None:
            env.torch.set_num_threads(torch_before)


def _peak_cells(env, gbs_list) -> list:
    return [f"{100 * g / env.peak_gbs:.1f}%" for g in gbs_list] if env.peak_gbs else []
