"""Compile every kernel in numbactr.kernels to PTX for a real GPU architecture, without a GPU.

Run as a separate process (the simulator is fixed per process):
    python tests/ptx_check.py [--cc 9.0] [--shard I/N] [module ...]
(--shard I/N compiles every N-th check starting at the I-th, so N processes share the work.)
Each kernel module lists ``PTX_CHECKS = [(kernel, signature), ...]``. Compiling catches what the
simulator lets through: Python containers, calls to plain Python functions, mistyped arithmetic.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import time

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)


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
    ap.add_argument("modules", nargs="*")
    args = ap.parse_args(argv)
    cc = tuple(int(p) for p in args.cc.split("."))
    shard, shards = (int(p) for p in args.shard.split("/"))
    index = -1
    from numba import config, cuda
    assert not config.ENABLE_CUDASIM
    failures, count = [], 0
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
                ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
                assert f".target sm_{cc[0]}{cc[1]}" in ptx
                count += 1
                print(f"ok   {name}.{fn.__name__} {sig} ({time.time() - t:.1f}s)")
            except Exception as exc:  # report every failure, not just the first
                failures.append(f"{name}.{fn.__name__} {sig}: {type(exc).__name__}: {exc}")
    for f in failures:
        print("FAIL", f)
    print(f"{count} kernels compiled to PTX for sm_{cc[0]}{cc[1]}, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
