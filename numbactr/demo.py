"""The main job: train a DLRM on planted-signal synthetic data and compare with the Bayes-optimal AUC.

The model is built through the HugeCTR API exactly as a HugeCTR script would (``import numbactr as
hugectr``): 13 dense features, 26 slots with Criteo-like power-law cardinalities, bottom MLP
13-64-32-16, DLRM dot interaction with the 26 embeddings (width 16), top MLP 128-64-1, sigmoid BCE.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def build_dlrm(
    hugectr,
    train_list: str,
    eval_list: str,
    *,
    batch: int,
    batch_eval: int,
    eval_batches: int,
    lr: float,
    workspace_mb: int,
    vec: int = 16,
    slots: int = 26,
    dense: int = 13,
    seed: int = 0,
):
    solver = hugectr.CreateSolver(
        max_eval_batches=eval_batches,
        batchsize_eval=batch_eval,
        batchsize=batch,
        lr=lr,
        vvgpu=[[0]],
        repeat_dataset=True,
        i64_input_key=True,
        seed=seed,
        metrics_spec={hugectr.MetricsType.AUC: 1.0},
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=[train_list],
        eval_source=eval_list,
        check_type=hugectr.Check_t.Sum,
    )
    optimizer = hugectr.CreateOptimizer(
        optimizer_type=hugectr.Optimizer_t.Adam,
        update_type=hugectr.Update_t.Global,
        beta1=0.9,
        beta2=0.999,
        epsilon=1e-7,
    )
    model = hugectr.Model(solver, reader, optimizer)
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=dense,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, slots)],
        )
    )
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
            workspace_size_per_gpu_in_mb=workspace_mb,
            embedding_vec_size=vec,
            combiner="sum",
            sparse_embedding_name="sparse_embedding1",
            bottom_name="data1",
            optimizer=optimizer,
        )
    )
    L = hugectr.Layer_t
    bottom = "dense"
    for i, width in enumerate((64, 32, vec), start=1):
        model.add(hugectr.DenseLayer(L.InnerProduct, [bottom], [f"fc{i}"], num_output=width))
        model.add(hugectr.DenseLayer(L.ReLU, [f"fc{i}"], [f"relu{i}"]))
        bottom = f"relu{i}"
    model.add(hugectr.DenseLayer(L.Interaction, ["relu3", "sparse_embedding1"], ["interaction1"]))
    bottom = "interaction1"
    for i, width in enumerate((128, 64), start=4):
        model.add(hugectr.DenseLayer(L.InnerProduct, [bottom], [f"fc{i}"], num_output=width))
        model.add(hugectr.DenseLayer(L.ReLU, [f"fc{i}"], [f"relu{i}"]))
        bottom = f"relu{i}"
    model.add(hugectr.DenseLayer(L.InnerProduct, [bottom], ["fc6"], num_output=1))
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc6", "label"], ["loss"]))
    model.compile()
    return model


def full_eval_auc(model) -> float:
    """AUC over the whole eval set (every eval file once)."""
    return dict(model.eval_whole_source())["AUC"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The demo's options (shared by `numbactr demo` and `python -m numbactr.demo`)."""
    ap.add_argument(
        "--out",
        default="runs/demo",
        metavar="DIR",
        help="folder for the learning curve (PNG + CSV) and, under DIR/data, the generated data (default: %(default)s)",
    )
    ap.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="where generated data sets are kept and reused, one folder per parameter set (default: OUT/data)",
    )
    ap.add_argument(
        "--regenerate-data",
        action="store_true",
        help="write the data set again even when a complete copy for these parameters exists",
    )
    ap.add_argument(
        "--train-samples",
        type=int,
        default=800_000,
        metavar="N",
        help="training samples, one epoch of them is trained (default: %(default)s)",
    )
    ap.add_argument(
        "--eval-samples",
        type=int,
        default=50_000,
        metavar="N",
        help="evaluation samples; all are scored at the end (default: %(default)s)",
    )
    ap.add_argument("--batch", type=int, default=1024, metavar="B", help="training batch size (default: %(default)s)")
    ap.add_argument(
        "--iters",
        type=int,
        default=0,
        metavar="N",
        help="training iterations (default 0: one epoch, train-samples // batch)",
    )
    ap.add_argument("--lr", type=float, default=0.002, help="Adam learning rate (default: %(default)s)")
    ap.add_argument(
        "--rows",
        type=int,
        default=200_000,
        metavar="V",
        help="embedding rows over the 26 slots, split like Criteo's cardinalities (default: %(default)s)",
    )
    ap.add_argument("--seed", type=int, default=1, help="seed of the data and the model (default: %(default)s)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="numbactr demo", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return ap


def run(args) -> int:
    """Generate (or reuse) the data, train one epoch, evaluate all eval samples, plot."""
    import numbactr as hugectr
    from numbactr.runtime import device
    from numbactr import log
    from numbactr.data.synthetic import cached_planted_dataset, criteo_like_slot_sizes, folder_size
    from numbactr.config import workspace_mb_for
    from numbactr.files.plot import save_learning_curve

    for name in ("train_samples", "eval_samples", "batch", "rows"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    device.kind()  # the start-up line (device, threads) comes first
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    data, reused = cached_planted_dataset(
        args.data_dir or os.path.join(args.out, "data"),
        regenerate=args.regenerate_data,
        num_train=args.train_samples,
        num_eval=args.eval_samples,
        slot_sizes=criteo_like_slot_sizes(26, args.rows),
        seed=args.seed,
    )
    how = "reused" if reused else f"written in {time.time() - t0:.1f}s"
    print(
        f"numbactr: planted-signal data: {args.train_samples} train / {args.eval_samples} eval samples, "
        f"26 slots ({sum(data.slot_size_array)} keys), Bayes-optimal eval AUC {data.bayes_auc:.4f}; "
        f"{how}: {data.out_dir} ({folder_size(data.out_dir) / 2**20:.0f} MiB)",
        flush=True,
    )
    iters = args.iters or max(args.train_samples // args.batch, 1)
    eval_interval = max(iters // 8, 1)
    model = build_dlrm(
        hugectr,
        data.train_list,
        data.eval_list,
        batch=args.batch,
        batch_eval=4096,
        eval_batches=3,
        lr=args.lr,
        workspace_mb=workspace_mb_for(sum(data.slot_size_array), 16, 2) + 1,
        seed=args.seed,
    )
    model.summary()
    t1 = time.time()
    model.fit(max_iter=iters, display=max(iters // 20, 1), eval_interval=eval_interval, snapshot=0)
    train_s = time.time() - t1
    log.info(f"scoring all {args.eval_samples} eval samples")
    auc = full_eval_auc(model)
    gap = (auc - 0.5) / (data.bayes_auc - 0.5)
    png, csv = save_learning_curve(
        os.path.join(args.out, "learning_curve.png"),
        model.history,
        reference={"Bayes-optimal AUC": data.bayes_auc},
        title="numbactr DLRM on planted-signal data",
    )
    print(
        f"numbactr: trained {iters} iterations x {args.batch} in {train_s:.1f}s "
        f"({iters * args.batch / train_s:,.0f} samples/s)"
    )
    print(
        f"numbactr: final eval AUC {auc:.4f}  Bayes-optimal AUC {data.bayes_auc:.4f}  "
        f"gap closed {100 * gap:.1f}%  learning curve: {png} (history: {csv})"
    )
    return 0 if np.isfinite(auc) else 1


def main(argv=None) -> int:
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
