"""The CI scripts parse, and .ci/gpu (a GPU session's stages, README "A GPU session's checks") names its stages
when asked for none; its stages themselves need a GPU machine."""
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.mark.parametrize("script", ["run", "gpu"], ids=["ci_run", "ci_gpu"])   # (an id "gpu" would mark it gpu-only)
def test_ci_script_parses(script):
    subprocess.run(["bash", "-n", str(ROOT / ".ci" / script)], check=True, timeout=60)


def test_gpu_script_lists_its_stages(tmp_path):
    done = subprocess.run(["bash", str(ROOT / ".ci" / "gpu"), "nope"], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert done.returncode == 2
    for stage in ("wheels", "resolve", "check", "suite", "bench", "profile"):
        assert f"{stage} " in done.stdout
