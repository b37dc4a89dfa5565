"""Test-session setup. Runs before any test module imports numba.

Kernel tests run in Numba's CUDA simulator unless the process has a real GPU and NUMBACTR_DEVICE=gpu
(then `pytest -m gpu` runs the same property tests on the GPU).
"""

import os
import sys

if os.environ.get("NUMBACTR_DEVICE", "").lower() != "gpu":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # before ANY numba import

from numba import config  # noqa: E402

if config.ENABLE_CUDASIM:
    sys.setswitchinterval(1e-4)  # simulator barriers: 3-10x faster (see shared notes §4)

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    settings.get_profile("ci"),
    max_examples=20,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile(
    "gpu", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    from numba import cuda

    on_gpu = (not config_sim()) and cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a real CUDA GPU (NUMBACTR_DEVICE=gpu)")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)


def config_sim() -> bool:
    return bool(config.ENABLE_CUDASIM)


@pytest.fixture(autouse=True)
def _restore_device():
    """Every test leaves the device as it found it: tests switch between cpu and sim (or gpu) with
    device.set_device, and one that forgot to switch back would change the device of the tests after it."""
    from numbactr.runtime import device

    before = device.kind()
    yield
    device.set_device(before)


@pytest.fixture(scope="module", autouse=True)
def _restore_device_per_module():
    """The same for a test file: a module-scoped fixture that sets the device (a model trained once on cpu
    for the whole file) runs before _restore_device records it, so only this switches back. Without it the
    next file ran on that device (test_engine_kernel_props failed after test_inference_hybrid under xdist)."""
    from numbactr.runtime import device

    before = device.kind()
    yield
    device.set_device(before)


@pytest.fixture
def on_device():
    """set_device for the test (the autouse _restore_device switches back afterwards). A test that asks for
    the simulator in a process on a real GPU (NUMBACTR_DEVICE=gpu: numba fixed real CUDA at import, so
    'sim' cannot be had) is skipped, not failed: those tests compare the simulator's kernels with the cpu
    device, and the gpu-marked and gpu-device runs of the suite cover the kernels on the GPU."""
    from numbactr.runtime import device

    def switch(name):
        if name == "sim" and not device._numba_simulated():
            pytest.skip("runs the kernels in Numba's simulator; this process runs them on a real GPU")
        device.set_device(name)

    return switch


@pytest.fixture
def cpu():
    """Run the test on the cpu device (switched back afterwards by _restore_device)."""
    from numbactr.runtime import device

    device.set_device("cpu")


# ---- compile the cpu kernels on the other core while the first tests run ---------------------------------
_warmer = None


def pytest_sessionstart(session):
    """A fresh clone has no Numba cache: its first engine tests would compile for minutes on one core while
    the second idles. numbactr.tools.warm_cache compiles them in a background process (niced), which the
    tests' own compiles then find cached. NUMBACTR_WARM_CACHE=0 turns it off; it stops with the session."""
    global _warmer
    if os.environ.get("NUMBACTR_WARM_CACHE", "1") == "0" or hasattr(session.config, "workerinput"):
        return
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    # one thread: what the suite's tests run (numbactr gives 2 cores 1 compute thread); a test of two threads
    # compiles its parallel twins itself, and compiling them all here would hold the second core ~3 min more
    cmd = [sys.executable, "-m", "numbactr.tools.warm_cache", "--quiet", "--threads", "1"]
    try:
        _warmer = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=(lambda: os.nice(10)) if hasattr(os, "nice") else None,
        )
    except OSError:
        _warmer = None


def pytest_sessionfinish(session, exitstatus):
    if _warmer is not None and _warmer.poll() is None:
        _warmer.terminate()
        try:
            _warmer.wait(timeout=30)
        except Exception:
            _warmer.kill()
