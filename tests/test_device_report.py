"""``numbactr device``: each diagnosis from hand-made facts (numbactr.runtime.device_report.diagnose is pure), and
the real command on this machine (whatever it has: it must print the report and succeed)."""

import os
import subprocess
import sys

import pytest

from numbactr.runtime import device_report as R

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

H100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "cc": "9.0", "memory_gib": 79.1}


def facts(**over):
    """A healthy CUDA 12 machine with one H100; `over` replaces facts."""
    f = {
        "errors": {},
        "asked": None,
        "simulator": False,
        "device": "device=gpu (...)",
        "kind": "gpu",
        "gpu_index": 0,
        "nvidia_driver": "570.86.15",
        "driver_cuda": "12.8",
        "gpus": [H100],
        "numba_cuda_available": {"available": True, "reason": ""},
        "numba": "0.68.1",
        "numba_cuda": "0.30.4",
        "cuda_bindings": "12.9.10",
        "cuda_toolkit_wheels": {"cuda-toolkit": "12.9.2.0"},
        "cuda_home": None,
        "cupy_wheels": {"cupy-cuda12x": "14.2.0"},
        "cupy": {"version": "14.2.0", "runtime": "12.9", "driver": "12.8"},
        "nccl": {"version": "2.32.3", "wheel": "2.32.3"},
        "mpi": {"mpi4py": "4.1.2", "launched_ranks": 1},
        "placement": {
            "rank": 0,
            "size": 1,
            "local_rank": 0,
            "local_size": 1,
            "node": 0,
            "nodes": 1,
            "source": "one process",
        },
        "transport_env": None,
    }
    f.update(over)
    return f


def levels(found, level):
    return [m for lv, m in found if lv == level]


def test_healthy_machine_has_nothing_to_say():
    assert R.diagnose(facts()) == []
    text = R.report(facts(), [])
    assert "NVIDIA H100" in text and "compute capability 9.0, 79.1 GiB" in text
    assert "cupy-cuda12x 14.2.0 (CUDA 12)" in text and "everything found fits" in text


@pytest.mark.parametrize(
    "over, words",
    [
        # CuPy for CUDA 13 under a driver that supports only CUDA 12
        (dict(cupy_wheels={"cupy-cuda13x": "14.2.0"}, driver_cuda="12.4"), "CuPy is built for CUDA 13"),
        # numba-cuda's bindings newer than the driver
        (
            dict(
                cuda_bindings="13.5.0",
                cuda_toolkit_wheels={"cuda-toolkit": "13.5.0"},
                cupy_wheels={},
                cupy=None,
                driver_cuda="12.8",
            ),
            "cuda-bindings 13.5.0 are for CUDA 13",
        ),
        # numba-cuda installed without an extra: no bindings
        (dict(cuda_bindings=None), "has no cuda-bindings: pip install 'numba-cuda[cu12]'"),
        # numba-cuda without the [cu12] compiler wheels and no toolkit on the machine
        (dict(cuda_toolkit_wheels={}, cuda_home=None), "has no CUDA compiler"),
        (dict(numba_cuda=None), "numba-cuda is not installed"),
        (
            dict(cupy=None, cupy_wheels={}, driver_cuda="13.0"),
            "CuPy is not installed (or does not import): pip install 'numbactr[cu13]'",
        ),
        (
            dict(cupy_wheels={"cupy-cuda12x": "14.2.0", "cupy-cuda13x": "14.2.0"}, driver_cuda="13.0"),
            "several CuPy wheels",
        ),
        (dict(gpus=[]), "numba sees no GPU"),
        (
            dict(cupy={"version": "14.2.0", "error": "CUDARuntimeError: cudaErrorInsufficientDriver"}),
            "cannot talk to the CUDA runtime",
        ),
        (
            dict(
                cupy_wheels={"cupy-cuda13x": "14.2.0"},
                cuda_bindings="13.5.0",
                driver_cuda="13.0",
                cuda_toolkit_wheels={"cuda-toolkit": "13.5.0"},
                gpus=[{"index": 0, "name": "Tesla V100", "cc": "7.0", "memory_gib": 16.0}],
            ),
            "older than CUDA 13",
        ),
        (dict(errors={"device": "DeviceError: NUMBACTR_DEVICE=gpu, but ..."}), "the device cannot be resolved"),
    ],
)
def test_errors(over, words):
    errs = levels(R.diagnose(facts(**over)), "error")
    assert any(words in m for m in errs), errs


@pytest.mark.parametrize(
    "over, words",
    [
        (dict(cuda_toolkit_wheels={"cuda-toolkit": "13.5.0"}), "compiler wheels for CUDA 13"),
        (dict(cupy_wheels={"cupy-cuda13x": "14.2.0"}, driver_cuda="13.0"), "two CUDA runtimes"),
        (
            dict(
                cupy_wheels={"cupy-cuda12x": "13.6.0"}, cupy={"version": "13.6.0", "runtime": "12.9", "driver": "12.8"}
            ),
            "CuPy 13.6.0 ends every sort with a host synchronization",
        ),
        (
            dict(
                placement={
                    "rank": 0,
                    "size": 4,
                    "local_rank": 0,
                    "local_size": 4,
                    "node": 0,
                    "nodes": 1,
                    "source": "MPI shared-memory split",
                }
            ),
            "4 ranks on this node share 1 GPU",
        ),
        (
            dict(
                nccl=None,
                gpus=[H100, dict(H100, index=1)],
                placement={
                    "rank": 0,
                    "size": 2,
                    "local_rank": 0,
                    "local_size": 2,
                    "node": 0,
                    "nodes": 1,
                    "source": "MPI shared-memory split",
                },
            ),
            "cupy.cuda.nccl is unavailable",
        ),
    ],
)
def test_warnings(over, words):
    found = R.diagnose(facts(**over))
    assert any(words in m for m in levels(found, "warning")), found
    assert not levels(found, "error"), found


def test_no_driver_and_simulator_are_notes():
    none = facts(
        nvidia_driver=None,
        driver_cuda=None,
        gpus=None,
        kind="cpu",
        cupy=None,
        cupy_wheels={},
        numba_cuda_available={"available": False, "reason": "CUDA driver library cannot be found"},
    )
    found = R.diagnose(none)
    assert levels(found, "error") == [] and any(
        "no NVIDIA driver" in m and "cannot be found" in m for m in levels(found, "note")
    )
    sim = R.diagnose(facts(simulator=True, kind="sim"))
    assert [lv for lv, _ in sim] == ["note"] and "simulator mode" in sim[0][1]


def test_wheel_cuda_major():
    assert R.wheel_cuda_major("cupy-cuda12x") == 12 and R.wheel_cuda_major("cupy-cuda13x") == 13
    assert R.wheel_cuda_major("cupy") is None


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_command_on_this_machine(device):
    env = dict(os.environ, NUMBACTR_DEVICE=device, PYTHONPATH=ROOT)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    out = subprocess.run(
        [sys.executable, "-m", "numbactr.cli", "device"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for head in ("device:", "placement:", "driver:", "numba:", "CuPy:", "NCCL:", "MPI:", "diagnosis:"):
        assert head in out.stdout, out.stdout
    assert f"device={device}" in out.stdout


def test_unresolvable_device_reports_then_fails_in_one_line():
    env = dict(os.environ, NUMBACTR_DEVICE="gpu", NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "numbactr.cli", "device"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert out.returncode == 1
    assert "diagnosis:" in out.stdout and "error: the device cannot be resolved" in out.stdout
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("numbactr device: error: NUMBACTR_DEVICE=gpu")
