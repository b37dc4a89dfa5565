"""Every tutorial runs to completion in the simulator (link 4 of the chain of trust).

Each tutorials/NN_name.py runs in its own process (the simulator is fixed per process) with
NUMBACTR_DEVICE=sim, must exit 0 within TIMEOUT_S, and must print "tutorial NN OK" as proof that it
reached its end rather than exiting early.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TUTORIALS = sorted((ROOT / "tutorials").glob("*.py"))
TIMEOUT_S = 120


def test_tutorials_exist():
    assert TUTORIALS, "no tutorials/*.py found"


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.name for p in TUTORIALS])
def test_tutorial_runs(path):
    env = dict(os.environ, NUMBACTR_DEVICE="sim", NUMBA_ENABLE_CUDASIM="1", PYTHONBREAKPOINT="0")
    env.pop("STEP", None)                                  # never stop at a tutorial's breakpoint
    r = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    tail = r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, tail
    number = re.match(r"(\d+)_", path.name)
    want = f"tutorial {number.group(1)} OK" if number else "OK"
    assert want in r.stdout, f"{path.name} did not print {want!r}:\n{tail}"
