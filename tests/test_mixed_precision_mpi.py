"""Mixed precision under mpiexec: two ranks (data-parallel dense, model-parallel embedding) equal one rank,
and an overflowed step is skipped on EVERY rank (the ranks agree through one allreduce), so no rank applies
a sparse update the others dropped. Each run is its own mpiexec process with a timeout (tests/mpi/mixed_run.py).
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
pytestmark = [needs_mpi, pytest.mark.mpi]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("mp_mpi")), n_train=240, n_eval=96)


def run(tmp, ranks, data, steps=4, timeout=300):
    out = tmp / f"r{ranks}.npz"
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM",)}
    env["NUMBACTR_DEVICE"] = "cpu"
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, str(HERE / "mpi" / "mixed_run.py"), str(out), *data, str(steps)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"mpiexec -n {ranks} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return dict(np.load(out))


def test_mixed_precision_two_ranks_equal_one_and_skip_together(tmp_path, data):
    one, two = run(tmp_path, 1, data), run(tmp_path, 2, data)
    # scaler 1024: nothing skipped; two ranks follow one rank to fp16 accuracy
    assert one["ok_skipped"].tolist() == [0] and two["ok_skipped"].tolist() == [0, 0]
    np.testing.assert_allclose(two["ok_losses"], one["ok_losses"], rtol=2e-3, atol=1e-4)
    np.testing.assert_allclose(two["ok_weights"], one["ok_weights"], rtol=1e-2, atol=1e-4)
    np.testing.assert_array_equal(two["ok_keys"], one["ok_keys"])
    np.testing.assert_allclose(two["ok_vecs"], one["ok_vecs"], rtol=1e-2, atol=1e-4)
    # scaler 1e30: every step overflows; both ranks skip all four, nothing moves (the embedding rows keep
    # their initial values: the same as the one-rank run's)
    assert two["over_skipped"].tolist() == [4, 4] and np.isfinite(two["over_losses"]).all()
    np.testing.assert_array_equal(two["over_weights"], two["over_weights0"])
    np.testing.assert_array_equal(two["over_keys"], one["over_keys"])
    np.testing.assert_array_equal(two["over_vecs"], one["over_vecs"])
