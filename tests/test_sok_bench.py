"""`numbactr bench sok --quick`: SOK's seed benchmark runs every implementation on one rank and, when
mpiexec is there, on two (its own mpiexec subprocess), and prints sane figures."""

import os
import shutil
import sys

import pytest

pytest.importorskip("torch")

from numbactr.bench import cli as bench
from numbactr.runtime import device  # noqa: E402


@pytest.fixture
def on_cpu():
    old = device.kind()
    device.set_device("cpu")
    yield
    device.set_device(old)


def test_quick_sok(capsys, on_cpu):
    assert bench.main(["sok", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "### SOK's seed benchmark" in out and "100 slots x 10 keys" in out
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.splitlines()
        if line.startswith("| ") and not line.startswith("| impl")
    ]
    assert {(r[0], r[1]) for r in rows} >= {
        ("torch nn.Embedding", "1"),
        ("torch nn.Embedding sparse", "1"),
        ("numbactr.sok", "1"),
        ("numbactr.sok no hash", "1"),
    }
    for r in rows:
        assert r[3] == "64" and float(r[4]) > 0 and float(r[5].replace(",", "")) > 0
        if r[0] == "torch nn.Embedding":
            assert r[6] == r[8] == "1.00"  # the native row is the reference
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if mpiexec is not None:
        assert {r[0] for r in rows if r[1] == "2"} == {"torch nn.Embedding", "numbactr.sok", "numbactr.sok no hash"}
