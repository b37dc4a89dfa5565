"""numbactr.sok under mpiexec -n 2 and -n 3 equals one rank on the same global batches (issue 11 item 5).

tests/mpi/sok_run.py trains a PyTorch model with every kind of SOK table (keyed and unkeyed layers, a
distributed and a localized Variable, a DynamicVariable), the dense part data-parallel through
broadcast_parameters and average_gradients; each mpiexec run is its own subprocess with a timeout. The
first step's embeddings are identical (the lookups are exact); later steps agree to float32 rounding (the
ranks' gradients are divided by R and averaged, the one-rank run divides once).
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.mpi_util import MPIEXEC, needs_mpi

pytest.importorskip("torch")

HERE = pathlib.Path(__file__).parent


@pytest.mark.mpi
@needs_mpi
def test_sharded_sok_model_equals_one_rank(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    results = {}
    for ranks in (1, 2, 3):
        out = tmp_path / f"r{ranks}.npz"
        r = subprocess.run(
            [MPIEXEC, "-n", str(ranks), sys.executable, str(HERE / "mpi" / "sok_run.py"), str(out)],
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, f"mpiexec -n {ranks} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        assert "Warning" not in r.stderr, r.stderr[-3000:]
        results[ranks] = dict(np.load(out))
    one = results[1]
    assert one["loss"][-1] != one["loss"][0] and one["dyn:keys"].max() >= 2**30
    for ranks in (2, 3):
        got = results[ranks]
        assert got.keys() == one.keys()
        np.testing.assert_array_equal(got["emb"][0], one["emb"][0])  # first lookups: exact
        for name, want in one.items():
            have = got[name]
            if name.startswith("dense:"):  # an unkeyed layer holds max_vocabulary_size_per_gpu rows per rank
                assert have.shape[0] == ranks * want.shape[0]
                np.testing.assert_array_equal(got["dense:keys"][:16], one["dense:keys"])
                have = have[: want.shape[0]]
            if name.endswith(":keys"):
                np.testing.assert_array_equal(have, want, err_msg=f"{ranks} ranks: {name}")
            else:
                np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6, err_msg=f"{ranks} ranks: {name}")


@pytest.mark.mpi
@needs_mpi
def test_two_ranks_resume_from_their_torch_checkpoints_exactly(tmp_path):
    """mpiexec -n 2: each rank torch.saves its model's and optimizers' state_dicts after step 2, loads them
    into a fresh model and trains on; every output and table equals the run without a break, bit for bit."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    results = []
    for mode in ([], ["resume"]):
        out = tmp_path / f"{'-'.join(mode) or 'plain'}.npz"
        r = subprocess.run(
            [MPIEXEC, "-n", "2", sys.executable, str(HERE / "mpi" / "sok_run.py"), str(out), *mode],
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, f"mpiexec -n 2 {mode} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        results.append(dict(np.load(out)))
    plain, resumed = results
    assert plain.keys() == resumed.keys()
    for name, want in plain.items():
        np.testing.assert_array_equal(resumed[name], want, err_msg=name)


@pytest.mark.mpi
@needs_mpi
def test_sok_dump_on_two_ranks_loads_on_two_and_on_one(tmp_path):
    """mpiexec -n 2: sok.dump writes SOK's files of the trained tables, and each rank's sok.load into a
    fresh model gives its rows and optimizer states back (checked inside the run); one rank then loads the
    same folder and holds every row the two ranks held."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    out, folder = tmp_path / "r2.npz", tmp_path / "sok_files"
    r = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, str(HERE / "mpi" / "sok_run.py"), str(out), "dump", str(folder)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, f"mpiexec -n 2 dump failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    two = dict(np.load(out))
    sys.path.insert(0, str(HERE / "mpi"))
    try:
        import sok_run
    finally:
        sys.path.pop(0)
    from numbactr.runtime import device
    import numbactr.sok as sok

    old = device.kind()
    device.set_device("cpu")
    try:
        model, opt, opt_vars = sok_run.build(sok.init(seed=3, set_torch_threads=False))
        sok.load(str(folder), [model.dist, model.loc], opt)  # (the unkeyed layer's size follows the ranks)
        sok.load(str(folder), [model.var, model.dyn], opt_vars)
        for name in ("dist", "var", "dyn", "loc"):
            module = getattr(model, name)
            keys, rows = module.keys().numpy(), module.weight.detach().numpy()
            order = np.argsort(keys, kind="stable")
            np.testing.assert_array_equal(keys[order], two[f"{name}:keys"], err_msg=name)
            np.testing.assert_array_equal(rows[order], two[f"{name}:rows"], err_msg=name)
    finally:
        device.set_device(old)


@pytest.mark.mpi
@needs_mpi
def test_the_example_learns_and_two_ranks_print_one_ranks_losses():
    """examples/sok_demo.py: the loss falls, and mpiexec -n 2 prints the one-rank run's losses."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    example = str(HERE.parent / "examples" / "sok_demo.py")
    printed = {}
    for ranks in (1, 2):
        r = subprocess.run(
            [MPIEXEC, "-n", str(ranks), sys.executable, example],
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0 and "Warning" not in r.stderr, f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        printed[ranks] = [float(line.split("loss ")[1]) for line in r.stdout.splitlines() if line.startswith("step ")]
        last = r.stdout.splitlines()[-1]
        first, final = (float(x.split()[0]) for x in last.split("loss ")[1].split("->"))
        assert last.startswith(f"{ranks} rank(s)") and final < first - 0.05
    assert len(printed[1]) == 4
    np.testing.assert_allclose(printed[2], printed[1], atol=2e-4)  # printed with 4 decimals
