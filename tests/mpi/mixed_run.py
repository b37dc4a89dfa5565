"""Train the tiny DLRM in mixed precision on this rank and save what tests/test_mixed_precision_mpi.py compares.

    mpiexec -n R python tests/mpi/mixed_run.py OUT.npz TRAIN_LIST EVAL_LIST STEPS

Two models, one after the other: "ok" at scaler 1024 and "over" at scaler 1e30 (every step overflows).
Rank 0 writes, per model, the loss of every step, the dense weights after the last step, every key's
final embedding vector (gathered from its owner) and each rank's count of skipped (overflowed) steps.
"""

import os
import sys
import warnings

os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402

import numbactr as hugectr  # noqa: E402
from numbactr.runtime import device
from numbactr.runtime import precision  # noqa: E402
from numbactr.distributed.comm import world  # noqa: E402
from tests.model_util import tiny_dlrm  # noqa: E402


def train(train, evl, scaler: float, steps: int, comm) -> dict:
    create = hugectr.CreateSolver
    hugectr.CreateSolver = lambda **kw: create(**kw, use_mixed_precision=True, scaler=scaler)
    try:
        model = tiny_dlrm(
            train,
            evl,
            batch=12,
            lr=0.05,
            optimizer=hugectr.Optimizer_t.Adam,
            embedding=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
        )
    finally:
        hugectr.CreateSolver = create
    w0 = device.to_host(model.weights).copy()
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", precision.GradientOverflowWarning)
        for _ in range(steps):
            assert model.train()
            losses.append(model.get_current_loss())
    keys, vecs = model.embeddings[0].dump()
    all_keys, all_vecs = comm.allgather_rows(keys), comm.allgather_rows(vecs)
    order = np.argsort(all_keys)
    skipped = comm.allgather_rows(np.array([[model.skipped_steps]], np.int64)).reshape(-1)
    return dict(
        losses=np.array(losses),
        weights0=w0,
        weights=device.to_host(model.weights),
        keys=all_keys[order],
        vecs=all_vecs[order],
        skipped=skipped,
    )


def main():
    out, train_list, eval_list, steps = sys.argv[1:5]
    comm = world()
    res = {}
    for tag, scaler in (("ok", 1024.0), ("over", 1e30)):
        res.update({f"{tag}_{k}": v for k, v in train(train_list, eval_list, scaler, int(steps), comm).items()})
    if comm.rank == 0:
        np.savez(out, **res)


if __name__ == "__main__":
    main()
