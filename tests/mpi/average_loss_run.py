"""Evaluate the tiny DLRM (untrained, seeded) on every eval sample and print AverageLoss and AUC.

    [mpiexec -n R] python tests/mpi/average_loss_run.py TRAIN_LIST EVAL_LIST BATCH

Rank 0 prints `AverageLoss <value> AUC <value>`; the weights are the seeded initial ones, so every rank
count scores the same predictions and must report the same metrics.
"""

import os
import sys

os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numbactr as hugectr  # noqa: E402
from numbactr.distributed.comm import world  # noqa: E402
from tests.model_util import tiny_dlrm  # noqa: E402


def main():
    train, evl, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = tiny_dlrm(train, evl, batch=batch)
    model.reader_params.num_workers = 1
    model.metrics.spec = {hugectr.MetricsType.AUC: 1.0, hugectr.MetricsType.AverageLoss: 1.0}
    m = dict(model.eval_whole_source())
    if world().rank == 0:
        print(f"AverageLoss {m['AverageLoss']:.9f} AUC {m['AUC']:.9f}", flush=True)


if __name__ == "__main__":
    main()
