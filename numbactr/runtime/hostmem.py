"""Host buffers for tables that are read and written at random rows: embedding weights, optimizer states,
hash-table slots.

A lookup into a table of millions of rows touches a different page almost every time. With 4 KiB pages
each of those reads also misses the TLB and walks the page tables (twice over in a virtual machine); with
2 MiB pages a 64 MiB table needs 32 TLB entries and the walks disappear. Linux gives an anonymous mapping
transparent huge pages when it is advised to (``madvise(MADV_HUGEPAGE)``; the system setting
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``), but only for the 2 MiB-aligned
stretches of it. ``host_zeros`` therefore maps 2 MiB more than asked and hands out the aligned part.

It pays: the embedding forward over a large table ran about a third faster on aligned huge pages than on
4 KiB pages or NumPy's own allocation (docs/decisions/0007-huge-pages.md has the measurement).

``NUMBACTR_HUGE_PAGES=0`` asks for 4 KiB pages instead (``madvise(MADV_NOHUGEPAGE)``). Buffers under
HUGE_MIN_BYTES, systems without ``madvise`` and device arrays are unaffected.
"""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np

HUGE_PAGE = 2 << 20  # bytes: x86-64 and arm64 (4 KiB granule) transparent huge pages
HUGE_MIN_BYTES = 4 << 20  # smaller buffers fit the TLB anyway; their rounding would waste memory
ENV = "NUMBACTR_HUGE_PAGES"
# private, not mmap's default MAP_SHARED: a shared anonymous mapping is shmem, which gets no transparent huge
# pages (shmem_enabled), and a forked child's writes would show in the parent's tables
_PRIVATE = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)


def huge_pages_wanted() -> bool:
    """NUMBACTR_HUGE_PAGES: 1 (default) or 0."""
    value = os.environ.get(ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def available_bytes() -> int | None:
    """Host memory a new allocation can still fill: MemAvailable + SwapFree from /proc/meminfo (None where
    the system does not say)."""
    try:
        with open("/proc/meminfo") as f:
            info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.split()[1:2]}
    except (OSError, ValueError, IndexError):
        return None
    if "MemAvailable" not in info:
        return None
    return info["MemAvailable"] + info.get("SwapFree", 0)


def check_fits(nbytes: int, what: str, hint: str = "") -> None:
    """MemoryError naming `what` when filling nbytes of fresh host memory would exceed what is available
    (Linux hands out memory lazily, so an oversized table would otherwise be killed by the kernel while it is
    initialized, with no message at all)."""
    avail = available_bytes()
    if avail is not None and nbytes > avail:
        raise MemoryError(
            f"{what} needs {_gb(nbytes)} of host memory but only {_gb(avail)} are available"
            + (f"; {hint}" if hint else "")
        )


def host_zeros(n: int, dtype, huge: bool | None = None) -> np.ndarray:
    """A zeroed 1-D host array of n elements, in huge pages when it is big (see the module docstring) and
    huge is True (None: as NUMBACTR_HUGE_PAGES says).

    The array keeps its mapping alive (its base); the memory is returned when the last view is gone."""
    dtype = np.dtype(dtype)
    nbytes = int(n) * dtype.itemsize
    if nbytes == 0:
        return np.zeros(0, dtype)
    if huge is None:
        huge = huge_pages_wanted()
    huge = huge and nbytes >= HUGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap.mmap, "madvise")
    try:
        return _host_zeros(nbytes, dtype, huge)
    except OSError as e:
        if e.errno != errno.ENOMEM:
            raise
        avail = available_bytes()
        raise MemoryError(
            f"cannot map {_gb(nbytes)} of host memory ({n} x {dtype.name})"
            + (f"; {_gb(avail)} are available" if avail is not None else "")
        ) from None


def _host_zeros(nbytes: int, dtype, huge: bool) -> np.ndarray:
    if not huge:
        mem = mmap.mmap(-1, nbytes, flags=_PRIVATE)  # zero-filled by the kernel
        if hasattr(mmap, "MADV_NOHUGEPAGE") and hasattr(mem, "madvise"):
            mem.madvise(mmap.MADV_NOHUGEPAGE)
        return np.frombuffer(mem, dtype)
    mem = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=_PRIVATE)
    mem.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(mem, np.uint8)
    start = (-raw.ctypes.data) % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype)


def host_full(n: int, value, dtype, huge: bool | None = None) -> np.ndarray:
    """host_zeros filled with value."""
    out = host_zeros(n, dtype, huge)
    if value != 0:
        out.fill(value)
    return out


def huge_page_bytes(a: np.ndarray) -> int:
    """How many bytes of a's pages are huge pages now (Linux: /proc/self/smaps; 0 where unknown): for
    tests and benchmarks that want to see what the kernel granted."""
    lo = a.ctypes.data
    hi = lo + a.nbytes
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(x, 16) for x in head.split("-"))
                    inside = start < hi and end > lo
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total
