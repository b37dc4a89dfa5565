"""AverageLoss is the mean log loss of the evaluated samples (batches weighted by their valid rows);
under compat.hugectr_exact() it is HugeCTR's plain mean of the per-batch losses (src/metrics.cu)."""

import numpy as np
import pytest

from numbactr import hugectr_exact as compat
from numbactr.runtime import device
from numbactr.enums import MetricsType
from numbactr.metrics import MetricAccumulator, average_loss
from tests.model_util import tiny_data, tiny_dlrm


@pytest.fixture
def exact_off():
    before = compat.hugectr_exact()
    compat.set_hugectr_exact(False)
    yield
    compat.set_hugectr_exact(before)


def test_weighting(exact_off):
    assert average_loss([0.5, 0.1], [64, 8]) == pytest.approx((0.5 * 64 + 0.1 * 8) / 72)
    assert np.isnan(average_loss([], []))
    compat.set_hugectr_exact(True)
    assert average_loss([0.5, 0.1], [64, 8]) == pytest.approx(0.3)


def test_accumulator_weights_by_valid_rows(exact_off):
    acc = MetricAccumulator({MetricsType.AverageLoss: 1.0})
    acc.add(np.full((4, 1), 0.5), np.ones((4, 1)), 1.0)
    acc.add(np.full((1, 1), 0.5), np.ones((1, 1)), 6.0)
    assert acc.finalize() == [("AverageLoss", pytest.approx(2.0))]  # (4 * 1 + 1 * 6) / 5
    assert acc.rows == [] and acc.losses == []  # finalize resets


def test_model_average_loss_is_the_exact_mean_log_loss_with_a_partial_last_batch(tmp_path, exact_off):
    device.set_device("cpu")
    train, evl = tiny_data(str(tmp_path), n_train=256, n_eval=200, files=1)
    model = tiny_dlrm(train, evl, batch=64)
    model.reader_params.num_workers = 1  # HugeCTR's default 12 needs 12 files in exact mode
    model.metrics.spec = {MetricsType.AUC: 1.0, MetricsType.AverageLoss: 1.0}
    model.fit(max_iter=6, display=0, eval_interval=0, snapshot=0)

    def run_eval(exact):
        compat.set_hugectr_exact(exact)
        model.metrics.reset()
        model._eval_reader = iter(model._make_reader(evl, 64, False, eval=True))
        while model.eval():
            pass
        p = np.concatenate(model.metrics.preds)[:, 0]
        y = np.concatenate(model.metrics.labels)[:, 0]
        losses, rows = list(model.metrics.losses), list(model.metrics.rows)
        return dict(model.get_eval_metrics())["AverageLoss"], p, y, losses, rows

    got, p, y, losses, rows = run_eval(False)
    assert rows == [64, 64, 64, 8]
    p = np.clip(p, 1e-7, 1 - 1e-7)
    exact = float(np.mean(-(y * np.log(p) + (1 - y) * np.log(1 - p))))
    assert got == pytest.approx(exact, rel=1e-4)
    hugectr_value, *_ = run_eval(True)
    assert hugectr_value == pytest.approx(np.mean(losses), rel=1e-6)
    assert abs(hugectr_value - exact) > 1e-4  # the last batch is over-weighted by HugeCTR


def test_two_ranks_report_the_one_rank_average_loss(tmp_path):
    """A partial last eval batch fills rank 0 and leaves rank 1 empty: the ranks' losses are weighted by
    their valid rows, so 2 ranks report the 1-rank AverageLoss (HugeCTR's mean of rank means would not)."""
    import os
    import shutil
    import subprocess
    import sys

    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if mpiexec is None:
        pytest.skip("mpiexec not found (pip install 'numbactr[mpi]')")
    train, evl = tiny_data(str(tmp_path), n_train=64, n_eval=200, files=1)
    script = os.path.join(os.path.dirname(__file__), "mpi", "average_loss_run.py")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    got = {}
    for ranks in (1, 2):
        r = subprocess.run(
            [mpiexec, "-n", str(ranks), sys.executable, script, train, evl, "64"],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        loss, auc = map(float, r.stdout.split("AverageLoss ")[1].split(" AUC "))
        got[ranks] = (loss, auc)
    assert got[2][0] == pytest.approx(got[1][0], rel=1e-5)
    assert got[2][1] == pytest.approx(got[1][1], rel=1e-6)
