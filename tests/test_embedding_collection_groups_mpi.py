"""Grouped EmbeddingCollection tables under mpiexec -n 2 and -n 3 (tests/mpi/ebc_group_run.py): model-parallel
tables on the same ranks share one engine (each key's table travels beside it), and every top (training and
evaluation) and every row equals, bit for bit, one engine per table on the same ranks and the grouped
collection on one rank."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.mpi_util import MPIEXEC, needs_mpi

HERE = pathlib.Path(__file__).parent
pytestmark = needs_mpi


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ebc_group_mpi")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    out = {}
    for ranks in (1, 2, 3):
        path = tmp / f"r{ranks}.npz"
        cmd = [MPIEXEC, "-n", str(ranks), sys.executable, str(HERE / "mpi" / "ebc_group_run.py"), str(path)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, f"mpiexec -n {ranks} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        out[ranks] = dict(np.load(path))
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_grouped_equals_separate_and_one_rank(results, ranks):
    got, one = results[ranks], results[1]
    # one rank: {p, r} (pooled), {q}, {d1}, {d2}, {u, v}; R ranks: {p, q}, {r}, {d1, d2}, {u, v}
    assert got["grouped_groups"][0] == (5 if ranks == 1 else 4) and got["separate_groups"][0] == 7
    names = sorted(k[len("grouped_") :] for k in got if k.startswith("grouped_") and not k.endswith("_groups"))
    assert "eval_p_avg" in names and "d1_keys" in names and "q_rows" in names
    for k in names:
        np.testing.assert_array_equal(got[f"grouped_{k}"], got[f"separate_{k}"], err_msg=f"{ranks} ranks: {k}")
        np.testing.assert_array_equal(got[f"grouped_{k}"], one[f"grouped_{k}"], err_msg=f"{ranks} vs 1: {k}")
