"""Ranks: a sharded run (mpiexec -n 2, -n 3) equals the one-rank run on the same global batch.

Each run is its own mpiexec process (tests/mpi/run_tiny.py), so a failure or hang is contained by a
timeout; the comparison happens here. Batch 12 splits evenly over 2 and 3 ranks; 3 slots and 18 keys
spread unevenly over 2 ranks (Localized: slots 0,2 on rank 0, slot 1 on rank 1).
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import numbactr as hugectr  # noqa: F401  (first: picks the device, as a script's import does)
from numbactr.optim import SUPPORTED
from tests.model_util import tiny_data
from tests.mpi_util import MPIEXEC, needs_mpi

HERE = pathlib.Path(__file__).parent
pytestmark = needs_mpi


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("mpi")), n_train=240, n_eval=96)


def run(tmp, ranks, data, emb, opt, update, steps=5, fail_at=-1, timeout=240):
    out = tmp / f"r{ranks}_{emb}_{opt}_{update}.npz"
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM",)}
    env["NUMBACTR_DEVICE"] = "cpu"
    cmd = [
        MPIEXEC,
        "-n",
        str(ranks),
        sys.executable,
        str(HERE / "mpi" / "run_tiny.py"),
        str(out),
        *data,
        emb,
        opt,
        update,
        str(steps),
        str(fail_at),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL)
    return r, out


# every optimizer x update type on the row-wise (Distributed) table; the slot-wise tables share the
# optimizer code, so two representative optimizers each keep the suite short
COMBOS = [("DistributedSlotSparseEmbeddingHash", o.name, u.name) for o, u in sorted(SUPPORTED, key=str)]
COMBOS += [(emb, "SGD", "Local") for emb in ("LocalizedSlotSparseEmbeddingHash", "LocalizedSlotSparseEmbeddingOneHot")]
COMBOS += [
    (emb, "Adam", "Global") for emb in ("LocalizedSlotSparseEmbeddingHash", "LocalizedSlotSparseEmbeddingOneHot")
]


@pytest.fixture(scope="module")
def all_combos(tmp_path_factory, data):
    """Every combination trained by one job per rank count (1, 2, 3): a fresh model per combination, in
    turn, so the interpreter and MPI start three times instead of three times per combination. Returns
    {ranks: (completed process, folder of EMB_OPT_UPDATE.npz)}."""
    runs = {}
    lists = [",".join(c[i] for c in COMBOS) for i in range(3)]
    for ranks in (1, 2, 3):
        folder = tmp_path_factory.mktemp(f"combos{ranks}")
        env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM",)}
        env["NUMBACTR_DEVICE"] = "cpu"
        cmd = [
            MPIEXEC,
            "-n",
            str(ranks),
            sys.executable,
            str(HERE / "mpi" / "run_tiny.py"),
            str(folder),
            *data,
            *lists,
            "5",
        ]
        runs[ranks] = (
            subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, stdin=subprocess.DEVNULL),
            folder,
        )
    return runs


@pytest.mark.mpi
@pytest.mark.parametrize("emb,opt,update", COMBOS)
def test_sharded_equals_one_rank(all_combos, emb, opt, update):
    results = {}
    for ranks in (1, 2, 3):
        r, folder = all_combos[ranks]
        out = folder / f"{emb}_{opt}_{update}.npz"
        assert out.exists(), (
            f"mpiexec -n {ranks} (exit {r.returncode}) wrote no {out.name}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        )
        results[ranks] = dict(np.load(out))
    one = results[1]
    for ranks in (2, 3):
        got = results[ranks]
        np.testing.assert_allclose(got["emb_out"], one["emb_out"], rtol=1e-6, atol=1e-7)  # forward
        np.testing.assert_allclose(got["wgrad"], one["wgrad"], rtol=1e-4, atol=1e-7)  # dense grads
        np.testing.assert_allclose(got["losses"], one["losses"], rtol=1e-5)  # loss per step
        np.testing.assert_allclose(got["weights"], one["weights"], rtol=1e-4, atol=1e-6)  # dense weights
        np.testing.assert_array_equal(got["keys"], one["keys"])  # same keys...
        np.testing.assert_allclose(got["vecs"], one["vecs"], rtol=1e-4, atol=1e-6)  # ...same rows
        assert got["auc"] == pytest.approx(float(one["auc"]), abs=1e-3)  # preds equal to ~1e-6


@pytest.mark.mpi
def test_one_rank_dying_aborts_the_job_promptly(tmp_path, data):
    r, _ = run(tmp_path, 2, data, "DistributedSlotSparseEmbeddingHash", "SGD", "Local", steps=4, fail_at=2, timeout=120)
    assert r.returncode != 0
    assert "planted failure on rank 1 at step 2" in r.stderr
    assert "aborting the job" in r.stderr
