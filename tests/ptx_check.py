"""Compile every kernel in numbactr.kernels for a real GPU architecture, without a GPU: to PTX, then to the
GPU's machine code (a cubin), as numba-cuda does before a launch.

Run as a separate process (the simulator is fixed per process):
    python tests/ptx_check.py [--cc 9.0] [--shard I/N] [--no-link] [--report FILE] [module ...]
(--shard I/N compiles every N-th check starting at the I-th, so N processes share the work.)
Each kernel module lists ``PTX_CHECKS = [(kernel, signature), ...]``.

Two stages per kernel:
1. **PTX** (numba's front end and NVVM): catches what the simulator lets through: Python containers, calls to
   plain Python functions, mistyped arithmetic.
2. **cubin** (link): the kernel's PTX and the CUDA C++ it calls (numba-cuda's float16 operators are C++
   compiled by NVRTC) linked by nvJitLink, whose ptxas assembles SASS for ``sm_<cc>``. It catches what NVVM
   lets through and a GPU would refuse at its first launch: unresolved functions, too much shared memory,
   more registers than a thread may have. ptxas also says what each kernel costs a streaming multiprocessor:
   registers, spilled bytes, shared memory, stack. Spills (registers stored to local memory, a slow path on
   every hot loop) fail the check; the registers give each kernel's theoretical occupancy (``occupancy``).
   The kernel's own jit options (fastmath, launch bounds, a register cap) are used, as at launch.
nvJitLink and NVRTC come with numba-cuda[cu12] (the test extra); without them the link stage is skipped
and says so (tests/test_ptx.py fails instead on CI).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import sys
import time

# what one streaming multiprocessor of compute capability 8.0 / 9.0 holds (CUDA C Programming Guide,
# "Technical Specifications per Compute Capability"; the occupancy calculator's allocation units)
SM_LIMITS = {
    (8, 0): dict(regs=65536, threads=2048, blocks=32, smem=167936, block_reserved_smem=1024),
    (9, 0): dict(regs=65536, threads=2048, blocks=32, smem=233472, block_reserved_smem=1024),
}
REG_UNIT = 256  # registers are allocated per warp in units of 256
SMEM_UNIT = 128  # shared memory is allocated per block in units of 128 bytes
#: the block size the launch helpers give most kernels on a GPU (kernels.launch.THREADS, REDUCE_THREADS,
#: and launch_lanes' lanes x rows); the interaction's one-block-per-sample kernels use 128
DEFAULT_BLOCK = 256


def occupancy(regs: int, smem: int, threads: int = DEFAULT_BLOCK, cc=(9, 0)) -> float:
    """Theoretical occupancy (resident warps / the SM's maximum) of blocks of `threads` threads using `regs`
    registers per thread and `smem` bytes of static shared memory per block."""
    lim = SM_LIMITS.get(tuple(cc), SM_LIMITS[(9, 0)])
    warps = -(-threads // 32)
    per_warp = -(-max(regs, 1) * 32 // REG_UNIT) * REG_UNIT
    by_regs = (lim["regs"] // per_warp) // warps
    by_threads = lim["threads"] // (warps * 32)
    block_smem = -(-smem // SMEM_UNIT) * SMEM_UNIT + lim["block_reserved_smem"]
    by_smem = lim["smem"] // block_smem
    blocks = min(by_regs, by_threads, lim["blocks"], by_smem)
    return blocks * warps / (lim["threads"] // 32)


_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log: str, entry: str | None = None) -> dict:
    """The kernel's resources from ptxas' verbose log (``-v``): the lines of the entry function `entry` (of
    the first entry function compiled when `entry` is None or not in the log)."""
    names = re.findall(r"Compiling entry function '([^']+)'", log)
    if not names:
        raise ValueError(f"no entry function in the ptxas log:\n{log[-2000:]}")
    target = entry if entry in names else names[0]
    res, compiling, props_of = {}, None, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            compiling = m.group(1)
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            props_of = m.group(1)
            continue
        m = _PROPS.search(line)
        if m and props_of == target and "stack" not in res:
            res.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _USED.search(line)
        if m and compiling == target and "regs" not in res:
            res.update(regs=int(m.group(1)), barriers=int(m.group(2) or 0), smem=int(m.group(3) or 0))
    if "regs" not in res:
        raise ValueError(f"no resource line for {target} in the ptxas log:\n{log[-2000:]}")
    res.setdefault("stack", 0)
    res.setdefault("spill_stores", 0)
    res.setdefault("spill_loads", 0)
    return res


def link_available() -> tuple[bool, str]:
    """Whether this machine can link a cubin without a GPU (nvJitLink >= 12.3 and cuda.core's Linker)."""
    try:
        from numba.cuda.cudadrv.driver import _have_nvjitlink

        if not _have_nvjitlink():
            return False, "nvJitLink (>= 12.3) not found: pip install 'numba-cuda[cu12]'"
        _linker_api()
        return True, ""
    except Exception as exc:  # noqa: BLE001 - any import failure means: cannot link here
        return False, f"{type(exc).__name__}: {exc}"


def _linker_api():
    try:
        from cuda.core import Linker, LinkerOptions, ObjectCode
    except ImportError:
        from cuda.core.experimental import Linker, LinkerOptions, ObjectCode
    return Linker, LinkerOptions, ObjectCode


def _jit_options(kernel) -> dict:
    opts = dict(getattr(kernel, "targetoptions", {}) or {})
    return {k: opts[k] for k in ("fastmath", "launch_bounds", "max_registers") if opts.get(k)}


def build(kernel, sig, cc, link: bool):
    """(code, resources or None). Without `link`: the kernel's PTX for sm_<cc>. With it: the cubin's resources,
    built as numba-cuda builds a kernel where nvJitLink is installed (its default then): the kernel and the
    CUDA C++ it calls compiled to LTO-IR (NVVM, NVRTC), then linked with link-time optimization into a cubin.
    (numba-cuda's PTX route for the C++ asks NVRTC for PTX, which needs a driver to say whether it can load
    it; LTO-IR does not.)"""
    fn = getattr(kernel, "py_func", kernel)
    jit = _jit_options(kernel)
    common = dict(fastmath=jit.get("fastmath", False), launch_bounds=jit.get("launch_bounds"))
    if not link:
        from numba import cuda

        ptx, _ = cuda.compile_ptx(fn, sig, cc=cc, **common)
        if f".target sm_{cc[0]}{cc[1]}" not in ptx:
            raise AssertionError(f"the PTX does not target sm_{cc[0]}{cc[1]}")
        return ptx, None
    from numba.cuda.compiler import compile_all

    codes, _ = compile_all(fn, sig, device=False, abi="numba", output="ltoir", cc=cc, **common)
    Linker, LinkerOptions, ObjectCode = _linker_api()
    objs = [c if isinstance(c, ObjectCode) else ObjectCode.from_ltoir(getattr(c, "data", c)) for c in codes]
    options = LinkerOptions(
        arch=f"sm_{cc[0]}{cc[1]}",
        link_time_optimization=True,
        ptxas_options=["-v"],
        max_register_count=jit.get("max_registers"),
    )
    linker = Linker(*objs, options=options)
    try:
        cubin = linker.link("cubin")
    except Exception as exc:
        log = ""
        try:
            log = linker.get_error_log() or ""
        except Exception:  # noqa: BLE001 - the error itself is what matters
            pass
        raise RuntimeError(f"link for sm_{cc[0]}{cc[1]} failed: {exc}\n{log[-2000:]}") from exc
    res = parse_ptxas_log(linker.get_info_log())
    res["occupancy"] = occupancy(res["regs"], res["smem"], DEFAULT_BLOCK, cc)
    return cubin, res


def kernel_modules():
    import numbactr.kernels as pkg

    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name == "launch":
            continue
        yield info.name, importlib.import_module(f"numbactr.kernels.{info.name}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cc", default="9.0")
    ap.add_argument("--shard", default="0/1", help="I/N: this process's share of the checks")
    ap.add_argument("--no-link", action="store_true", help="PTX only (no cubin, no resources)")
    ap.add_argument("--report", help="write each kernel's resources to this JSON-lines file")
    ap.add_argument("modules", nargs="*")
    args = ap.parse_args(argv)
    cc = tuple(int(p) for p in args.cc.split("."))
    shard, shards = (int(p) for p in args.shard.split("/"))
    from numba import config

    assert not config.ENABLE_CUDASIM
    link, why = (False, "--no-link") if args.no_link else link_available()
    if not link:
        print(f"link stage skipped: {why}")
    index = -1
    failures, count, linked, rows = [], 0, 0, []
    for name, mod in kernel_modules():
        if args.modules and name not in args.modules:
            continue
        checks = getattr(mod, "PTX_CHECKS", None)
        if checks is None:
            if shard == 0:
                failures.append(f"{name}: no PTX_CHECKS list")
            continue
        for kernel, sig in checks:
            index += 1
            if index % shards != shard:
                continue
            fn = getattr(kernel, "py_func", kernel)
            t = time.time()
            try:
                _, res = build(kernel, sig, cc, link)
            except Exception as exc:  # report every failure, not just the first
                failures.append(f"{name}.{fn.__name__} {sig}: {type(exc).__name__}: {exc}")
                continue
            count += 1
            if res is None:
                print(f"ok   {name}.{fn.__name__} {sig} ({time.time() - t:.1f}s)")
                continue
            linked += 1
            rows.append(dict(module=name, kernel=fn.__name__, sig=str(sig), **res))
            print(
                f"ok   {name}.{fn.__name__} {sig} ({time.time() - t:.1f}s) regs {res['regs']} "
                f"smem {res['smem']} stack {res['stack']} spills {res['spill_stores']}/{res['spill_loads']} "
                f"occupancy {res['occupancy']:.0%}"
            )
            if res["spill_stores"] or res["spill_loads"]:
                failures.append(
                    f"{name}.{fn.__name__} {sig}: spills registers to local memory "
                    f"({res['spill_stores']} bytes stored, {res['spill_loads']} loaded, "
                    f"{res['regs']} registers)"
                )
    if args.report:
        with open(args.report, "a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
    for f in failures:
        print("FAIL", f)
    print(f"{count} kernels compiled to PTX for sm_{cc[0]}{cc[1]}, {len(failures)} failures")
    if link:
        print(f"{linked} kernels linked to cubins for sm_{cc[0]}{cc[1]}")
    return 1 if failures else 0


if __name__ == "__main__":
    # the real compiler, not the simulator (before numba is imported; not at import: tests/test_ptx.py imports
    # this module into a test session, whose environment must keep its simulator setting)
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    sys.exit(main())
