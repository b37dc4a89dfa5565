"""EmbeddingCollection sharded under mpiexec -n 2 and -n 3 equals one rank (tests/mpi/ebc_run.py).

The collection alone (model-parallel tables on one rank and on every rank, a dynamic one among them, and a
data-parallel table; sum, average and concat lookups sharing tables): every step's tops, the evaluation
tops and every row equal one rank's bit for bit. A Model with the same placement on Norm files: losses,
evaluation output and the embedding_dump files equal one rank's to float rounding (the dense gradients are
summed over ranks in another order); the dumped keys are identical. Each mpiexec has its own timeout.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.model_util import tiny_data
from tests.mpi_util import MPIEXEC, needs_mpi

HERE = pathlib.Path(__file__).parent
pytestmark = needs_mpi


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ebc_mpi")
    data = tiny_data(str(tmp / "data"), n_train=240, n_eval=96)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    out = {}
    for ranks in (1, 2, 3):
        path = tmp / f"r{ranks}.npz"
        cmd = [MPIEXEC, "-n", str(ranks), sys.executable, str(HERE / "mpi" / "ebc_run.py"), str(path), *data]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, f"mpiexec -n {ranks} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        out[ranks] = dict(np.load(path))
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_collection_sharded_equals_one_rank_bit_for_bit(results, ranks):
    one, got = results[1], results[ranks]
    names = sorted(k for k in one if k.startswith("p1_"))
    assert names == sorted(k for k in got if k.startswith("p1_"))
    assert any("eval" in k for k in names) and "p1_b_keys" in names
    np.testing.assert_array_equal(one["p1_b_keys"], np.arange(8))  # dynamic: the keys trained (8, 9: eval only)
    assert one["p1_a_keys"].shape[0] == 10
    for k in names:
        np.testing.assert_array_equal(got[k], one[k], err_msg=k)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_model_sharded_equals_one_rank(results, ranks):
    one, got = results[1], results[ranks]
    assert got["p2_reloaded"][0] == 1  # each rank's rows came back from embedding_load
    np.testing.assert_allclose(got["p2_losses"], one["p2_losses"], rtol=1e-5)
    np.testing.assert_allclose(got["p2_eval"], one["p2_eval"], rtol=1e-5, atol=1e-6)
    for t in ("a", "b", "c"):
        np.testing.assert_array_equal(got[f"p2_{t}_key"], one[f"p2_{t}_key"])
        np.testing.assert_allclose(
            got[f"p2_{t}_emb_vector"].view("<f4"), one[f"p2_{t}_emb_vector"].view("<f4"), rtol=1e-4, atol=1e-6
        )
