"""Snapshots across rank counts, under mpiexec (tests/mpi/snapshot_run.py; every run has its own timeout).

A save on R ranks reloads exactly on R' ranks, R, R' in {1, 2, 3}, for every embedding type: the same
vectors, slots, optimizer states and BatchNorm statistics per key, the same eval AUC, and the same
training afterwards (so each key's optimizer state moved with it; the model has no BatchNorm, whose
statistics are per rank, so that R ranks train exactly as one). Localized keys live on rank slot % R
and are found there only if the reload places them by their slot_id. The same snapshots without their
manifests (HugeCTR's own files) reload too, and killing one rank during a save leaves the previous
snapshot loadable.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from numbactr.data.errors import DataFormatError
from tests.model_util import tiny_data
from tests.mpi.snapshot_run import OPTIMIZERS, build, load_all, state
from tests.mpi_util import MPIEXEC, needs_mpi

CHILD = pathlib.Path(__file__).parent / "mpi" / "snapshot_run.py"
pytestmark = [pytest.mark.mpi, needs_mpi]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("ranks")), n_train=240, n_eval=96)


def mpirun(ranks, *args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    return subprocess.run(
        [MPIEXEC, "-n", str(ranks), sys.executable, str(CHILD), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def assert_state(got, want, where, exact=True, prefix=""):
    names = [k[len(prefix) :] for k in want if k.startswith(prefix) and k != "auc" and (prefix or "cont_" not in k)]
    assert names, where
    for k in names:
        if exact:
            np.testing.assert_array_equal(got[prefix + k], want[prefix + k], err_msg=f"{where}: {k}")
        else:
            np.testing.assert_allclose(got[prefix + k], want[prefix + k], rtol=1e-4, atol=1e-6, err_msg=f"{where}: {k}")


def test_save_on_R_ranks_reloads_exactly_on_R_prime(tmp_path, data, cpu):
    for ranks in (1, 2, 3):
        r = mpirun(ranks, "save", tmp_path, *data)
        assert r.returncode == 0, f"save on {ranks}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    for ranks in (1, 2, 3):
        r = mpirun(ranks, "load", tmp_path, *data, 1, 2, 3)
        assert r.returncode == 0, f"load on {ranks}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    for emb in OPTIMIZERS:
        for saved in (1, 2, 3):
            folder = tmp_path / f"{emb}_R{saved}"
            ref = dict(np.load(folder / "ref.npz"))
            if "Localized" in emb and saved > 1:  # the keys really are spread by slot
                assert set(ref["slots"].tolist()) == {0, 1, 2}
            for loaded in (1, 2, 3):
                got = dict(np.load(folder / f"load_R{loaded}.npz"))
                where = f"{emb} saved on {saved}, loaded on {loaded}"
                assert_state(got, ref, where)  # bit for bit
                # predictions agree to rounding; a near-tie may still swap (test_mpi_sharded: the same)
                assert float(got["auc"]) == pytest.approx(float(ref["auc"]), abs=1e-3), where
                assert_state(got, ref, where + ", 2 steps later", exact=False, prefix="cont_")
            # the same files without the manifest are HugeCTR's layout: they load on one rank here
            (folder / "ck_3.manifest.json").unlink()
            model = build(*data, emb, *OPTIMIZERS[emb], seed=11, bn=False)
            load_all(model, str(folder / "ck"), 3)
            assert_state(state(model), ref, f"{emb} saved on {saved}, no manifest")


@pytest.mark.parametrize("rank,hook,at", [(1, "comm", 3), (1, "comm", 7), (0, "files", 12)])
def test_killing_one_rank_during_a_save_leaves_the_previous_snapshot(tmp_path, data, cpu, rank, hook, at):
    """Rank 1 dies inside the save's gathers (3) or final broadcast (7), or rank 0 half way through
    moving the committed files into place (12): mpiexec ends the job, nothing hangs."""
    r = mpirun(2, "kill", tmp_path, *data, at, rank, hook, timeout=120)
    assert r.returncode != 0, r.stdout[-2000:]
    s1, s2 = (dict(np.load(tmp_path / f"S{i}.npz")) for i in (1, 2))
    one = build(*data, seed=5)
    load_all(one, str(tmp_path / "ck"), 1)
    assert_state(state(one), s1, "the previous snapshot")
    two = build(*data, seed=5)
    try:
        load_all(two, str(tmp_path / "ck"), 2)
    except (DataFormatError, FileNotFoundError) as e:
        assert at != 12 and "ck_dense_2.model" in str(e), e  # after the commit point it must load
    else:
        assert_state(state(two), s2, "the interrupted snapshot")


def test_a_save_rank_0_cannot_write_raises_on_every_rank(tmp_path, data):
    r = mpirun(2, "fail", tmp_path, *data, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 0 raised FileNotFoundError: save_params_to_files: folder" in r.stdout
    assert "rank 1 raised RuntimeError: save_params_to_files(" in r.stdout and "rank 0 could not write" in r.stdout
