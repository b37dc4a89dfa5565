"""Train the tiny DLRM for a few steps on this rank and save what the equality tests compare.

    mpiexec -n R python tests/mpi/run_tiny.py OUT.npz TRAIN_LIST EVAL_LIST EMB OPT UPDATE STEPS [FAIL_AT]
    mpiexec -n R python tests/mpi/run_tiny.py OUT_DIR TRAIN_LIST EVAL_LIST EMB,EMB.. OPT,OPT.. UPDATE,UPDATE.. STEPS

The second form trains one fresh model per (EMB, OPT, UPDATE) of the comma-separated lists, one after the
other in this one job (the interpreter, MPI and the compiled code start once), and writes
OUT_DIR/EMB_OPT_UPDATE.npz for each.

Rank 0 writes: the loss of every step, the dense weights after the last step, the dense gradient and
the embedding output (whole global batch, gathered from all ranks) of the first step, and every
key's final embedding vector (gathered from its owner).
"""

import os
import sys

os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402

import numbactr as hugectr  # noqa: E402
from numbactr.runtime import device  # noqa: E402
from numbactr.distributed.comm import world  # noqa: E402
from tests.model_util import tiny_dlrm  # noqa: E402


def main():
    out, train, evl, embs, opts, updates, steps = sys.argv[1:8]
    fail_at = int(sys.argv[8]) if len(sys.argv) > 8 else -1
    combos = list(zip(embs.split(","), opts.split(","), updates.split(",")))
    if len(combos) == 1 and out.endswith(".npz"):
        train_one(out, train, evl, *combos[0], steps, fail_at)
        return
    for emb, opt, update in combos:
        train_one(os.path.join(out, f"{emb}_{opt}_{update}.npz"), train, evl, emb, opt, update, steps, fail_at)


def train_one(out, train, evl, emb, opt, update, steps, fail_at):
    comm = world()
    model = tiny_dlrm(
        train,
        evl,
        batch=12,
        lr=0.05,
        optimizer=hugectr.Optimizer_t[opt],
        update=hugectr.Update_t[update],
        embedding=hugectr.Embedding_t[emb],
    )
    e = model.embeddings[0]
    losses, first = [], {}
    captured = {}
    orig = e.forward

    def spy(*a, **k):
        t = orig(*a, **k)
        captured.setdefault("emb_out", device.to_host(t.data).copy())
        return t

    e.forward = spy
    for step in range(int(steps)):
        if step == fail_at and comm.rank == comm.size - 1:
            raise RuntimeError(f"planted failure on rank {comm.rank} at step {step}")
        assert model.train()
        losses.append(model.get_current_loss())
        if step == 0:
            first["wgrad"] = device.to_host(model.wgrads).copy()
    emb_out = comm.allgather_rows(captured["emb_out"])
    keys, vecs = e.dump()
    all_keys, all_vecs = comm.allgather_rows(keys), comm.allgather_rows(vecs)
    order = np.argsort(all_keys)
    metrics = dict(model.eval_whole_source())
    if comm.rank == 0:
        np.savez(
            out,
            losses=np.array(losses),
            weights=device.to_host(model.weights),
            wgrad=first["wgrad"],
            emb_out=emb_out,
            keys=all_keys[order],
            vecs=all_vecs[order],
            auc=metrics["AUC"],
        )


if __name__ == "__main__":
    main()
