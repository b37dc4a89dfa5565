"""Chain of trust, link 3: every kernel compiles for sm_90 on a machine without a GPU: to PTX, and linked into
the cubin a GPU would load (nvJitLink's ptxas), with no register spilled (tests/ptx_check.py)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))

import ptx_check  # noqa: E402  (tests/ is not a package on sys.path by default)


def _probe(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def _nvvm_available() -> bool:
    code = "from numba import cuda\ndef k(x):\n    x[0] = 1\ncuda.compile_ptx(k, 'void(float32[:])', cc=(9, 0))"
    return _probe(code).returncode == 0


def _link_available() -> tuple[bool, str]:
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import ptx_check; print(ptx_check.link_available())"
    out = _probe(code)
    return ("(True," in out.stdout), (out.stdout + out.stderr).strip()


def test_every_kernel_compiles_and_links_for_sm90(tmp_path):
    if not _nvvm_available():
        if os.environ.get("CI"):
            pytest.fail("NVVM not found: install the test extra (numba-cuda[cu12]) so kernels compile")
        pytest.skip("NVVM not installed (pip install 'numba-cuda[cu12]')")
    link, why = _link_available()
    if not link and os.environ.get("CI"):
        pytest.fail(f"cannot link cubins without a GPU here ({why}): the test extra brings nvJitLink")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    report = tmp_path / "resources.jsonl"
    # two processes share the checks (the suite itself runs on one core)
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "ptx_check.py"), "--cc", "9.0", "--shard", f"{i}/2", "--report", str(report)]
            + ([] if link else ["--no-link"]),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    text = "\n".join(o + e for o, e in outs)
    print(text[-8000:])
    assert all(p.returncode == 0 for p in procs), text[-8000:]
    compiled = sum(int(line.split()[0]) for o, _ in outs for line in o.splitlines() if "kernels compiled" in line)
    assert compiled > 100, text[-4000:]
    if not link:
        pytest.skip(f"PTX only: {why}")
    linked = sum(int(line.split()[0]) for o, _ in outs for line in o.splitlines() if "kernels linked" in line)
    assert linked == compiled, text[-4000:]
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    assert len(rows) == linked
    assert all(0 < r["regs"] <= 255 and r["spill_stores"] == 0 == r["spill_loads"] for r in rows)
    assert all(0 < r["occupancy"] <= 1 for r in rows)


# ---- the pieces of the check, on fixed inputs ------------------------------------------------------
_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Function properties for _Z6helperv
ptxas         .     24 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_90'
ptxas info    : Function properties for _Z6kernelPf
ptxas         .     16 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 86 registers, used 1 barriers, 1024 bytes smem, 380 bytes cmem[0]
ptxas info    : Compile time = 12.0 ms
"""


def test_ptxas_log_is_read_for_the_entry_function():
    res = ptx_check.parse_ptxas_log(_LOG)
    assert res == dict(regs=86, barriers=1, smem=1024, stack=16, spill_stores=4, spill_loads=12)
    plain = (
        "ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
        "ptxas info    : Function properties for k\n"
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 26 registers, used 0 barriers\n"
    )
    assert ptx_check.parse_ptxas_log(plain) == dict(regs=26, barriers=0, smem=0, stack=0, spill_stores=0, spill_loads=0)
    with pytest.raises(ValueError, match="no entry function"):
        ptx_check.parse_ptxas_log("ptxas info    : 0 bytes gmem\n")


@pytest.mark.parametrize(
    "regs, smem, threads, expect",
    [
        (32, 0, 256, 1.0),  # 8 blocks of 8 warps: 64 warps, the whole SM
        (40, 0, 256, 0.75),  # 40 x 32 = 1280 registers a warp: 51 warps fit, 6 blocks of 8
        (64, 0, 256, 0.5),
        (86, 0, 256, 0.25),  # 88 registers a thread after rounding: 23 warps, 2 blocks
        (255, 0, 256, 0.125),  # 8 warps: one block
        (32, 48 * 1024, 128, 4 * 4 / 64),  # shared memory limits it to 4 blocks of 4 warps
        (16, 0, 32, 0.5),  # at most 32 blocks an SM: 32 warps of 64
    ],
)
def test_theoretical_occupancy(regs, smem, threads, expect):
    assert ptx_check.occupancy(regs, smem, threads) == pytest.approx(expect)


def test_importing_the_check_leaves_the_environment_alone(monkeypatch):
    """This module imports ptx_check into the test session: the simulator setting of the session (and of the
    subprocesses its tests start) must survive it (only running ptx_check as a script drops it)."""
    import importlib

    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    importlib.reload(ptx_check)
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
