"""kill -9 during save_params_to_files, at every file boundary (tests/mpi/snapshot_run.py kill).

The child (one process per kill point, forked from one that paid the imports) trains, saves ck@1, trains on, then saves ck@2 (a new iteration) and ck@1 again (overwriting
the previous snapshot), SIGKILLing itself at the k-th boundary: a staged file half written, or just
before an os.replace or the removal of the staging folder. Here, for every k: the previous snapshot
loads exactly as it was saved, the interrupted one loads completely new or fails with a clear error
(never a mix, never half of one), and the next save finishes or clears what the killed one left.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from numbactr.files import snapshot
from numbactr.data.errors import DataFormatError
from tests.model_util import tiny_data
from tests.mpi.snapshot_run import build, load_all, state

CHILD = pathlib.Path(__file__).parent / "mpi" / "snapshot_run.py"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("kill")), n_train=240, n_eval=96)


def child(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    return subprocess.run(
        [sys.executable, str(CHILD), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def loads(data, prefix, it):
    """The state a fresh model gets from the snapshot, or the clear error the load raised."""
    model = build(*data, seed=5)
    try:
        load_all(model, str(prefix), it)
    except (DataFormatError, FileNotFoundError) as e:
        return e
    return state(model)


def equal(got, want) -> bool:
    return isinstance(got, dict) and set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)


def leftovers(folder):
    return [n for n in os.listdir(folder) if ".staging-" in n or ".pending." in n]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the child forks one process per kill point")
def test_kill_at_every_boundary_leaves_a_loadable_snapshot(tmp_path, data, cpu, monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # as in the child: see kill_each
    os.makedirs(tmp_path / "count")
    r = child("kill", tmp_path / "count", *data, 0, 0, "files")
    assert r.returncode == 0, r.stderr[-3000:]
    first, total = map(int, re.search(r"BOUNDARIES (\d+) (\d+)", r.stdout).groups())
    # per save: 8 staged writes (7 files + journal), 9 renames (journal, 7 files, journal -> manifest), 1 rmtree
    assert (first, total) == (18, 36)
    r = child("kill_each", tmp_path, *data, total, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    codes = dict(line.split() for line in r.stdout.splitlines() if line.startswith("k"))
    for k in range(1, total + 1):
        assert codes.get(f"k{k}") == str(-signal.SIGKILL), f"k={k}: {codes.get(f'k{k}')}\n{r.stderr[-3000:]}"
        folder = tmp_path / f"k{k}"
        s1, s2 = (dict(np.load(folder / f"S{i}.npz")) for i in (1, 2))
        one, two = loads(data, folder / "ck", 1), loads(data, folder / "ck", 2)
        if k <= first:  # killed while saving ck@2: ck@1 untouched
            assert equal(one, s1), f"k={k}: the previous snapshot changed: {one!r}"
            assert equal(two, s2) or (isinstance(two, FileNotFoundError) and "ck_dense_2.model" in str(two)), (
                f"k={k}: the interrupted snapshot is neither complete nor absent: {two!r}"
            )
        else:  # killed while overwriting ck@1 (ck@2 complete)
            assert equal(one, s1) or equal(one, s2), f"k={k}: ck@1 loads as neither the old nor the new: {one!r}"
            assert equal(two, s2), f"k={k}: {two!r}"
        # the next save of the prefix finishes a committed save and removes uncommitted leftovers
        again = build(*data, seed=9)
        again.save_params_to_files(str(folder / "ck"), 3)
        assert leftovers(folder) == [], f"k={k}"
        assert equal(loads(data, folder / "ck", 3), state(again))
        after = loads(data, folder / "ck", 1)
        assert equal(after, s1) or (k > first and equal(after, s2)), f"k={k}"


def test_the_commit_order_survives_a_power_loss(tmp_path, data, cpu, monkeypatch):
    """What a kill cannot show (the kill test skips fsync): staged files are durable before the journal
    is written, the journal before the first file moves, each move before the manifest appears."""
    events = []
    real = snapshot._write_durable, snapshot._fsync_dir, os.replace
    monkeypatch.setattr(snapshot, "_write_durable", lambda p, b: (events.append(("write", p)), real[0](p, b)))
    monkeypatch.setattr(snapshot, "_fsync_dir", lambda p: (events.append(("sync", p)), real[1](p)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("move", a, b)), real[2](a, b)))
    model = build(*data)
    model.train()
    model.save_params_to_files(str(tmp_path / "ck"), 1)
    moves = [i for i, e in enumerate(events) if e[0] == "move"]
    journal, files, manifest = moves[0], moves[1:-1], moves[-1]
    assert events[journal][2].endswith("ck_1.manifest.pending.json") and len(files) == 7
    assert events[manifest][2].endswith("ck_1.manifest.json")
    staged = [i for i, e in enumerate(events) if e[0] == "write" and ".staging-" in e[1]]
    synced = {e[1] for e in events[staged[-1] : journal] if e[0] == "sync"}
    assert len(staged) == 7 and {os.path.dirname(events[i][1]) for i in staged} <= synced
    assert ("sync", str(tmp_path)) in events[journal : files[0]]  # the commit point
    for i in files:  # each moved file's folder is synced before the manifest
        assert ("sync", os.path.dirname(events[i][2])) in events[i:manifest]
    assert ("sync", str(tmp_path)) in events[manifest:]
