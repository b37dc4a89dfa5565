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


def build_dlrm(hugectr, train_list: str, eval_list: str, *, batch: int, batch_eval: int, eval_batches: int,
               lr: float, workspace_mb: int, vec: int = 16, slots: int = 26, dense: int = 13, seed: int = 0):
    solver = hugectr.CreateSolver(max_eval_batches=eval_batches, batchsize_eval=batch_eval, batchsize=batch,
                                  lr=lr, vvgpu=[[0]], repeat_dataset=True, i64_input_key=True, seed=seed,
                                  metrics_spec={hugectr.MetricsType.AUC: 1.0})
    reader = hugectr.DataReaderParams(data_reader_type=hugectr.DataReaderType_t.Norm, source=[train_list],
                                      eval_source=eval_list, check_type=hugectr.Check_t.Sum)
    optimizer = hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.Adam,
                                        update_type=hugectr.Update_t.Global, beta1=0.9, beta2=0.999,
                                        epsilon=1e-7)
    model = hugectr.Model(solver, reader, optimizer)
    model.add(hugectr.Input(label_dim=1, label_name="label", dense_dim=dense, dense_name="dense",
                            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, slots)]))
    model.add(hugectr.SparseEmbedding(embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
                                      workspace_size_per_gpu_in_mb=workspace_mb, embedding_vec_size=vec,
                                      combiner="sum", sparse_embedding_name="sparse_embedding1",
                                      bottom_name="data1", optimizer=optimizer))
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="numbactr demo", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/demo", help="folder for data, logs and the learning curve")
    ap.add_argument("--train-samples", type=int, default=800_000)
    ap.add_argument("--eval-samples", type=int, default=50_000)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=0, help="training iterations (default: one epoch)")
    ap.add_argument("--lr", type=float, default=0.002)
    ap.add_argument("--rows", type=int, default=200_000, help="total embedding rows over the 26 slots")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    import numbactr as hugectr
    from numbactr.data.synthetic import criteo_like_slot_sizes, make_planted_dataset
    from numbactr.plot import save_learning_curve

    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    data = make_planted_dataset(os.path.join(args.out, "data"), num_train=args.train_samples,
                                num_eval=args.eval_samples, slot_sizes=criteo_like_slot_sizes(26, args.rows),
                                seed=args.seed)
    print(f"numbactr: planted-signal data: {args.train_samples} train / {args.eval_samples} eval samples, "
          f"26 slots ({sum(data.slot_size_array)} keys), Bayes-optimal eval AUC {data.bayes_auc:.4f} "
          f"({time.time() - t0:.1f}s)", flush=True)
    iters = args.iters or args.train_samples // args.batch
    eval_interval = max(iters // 8, 1)
    model = build_dlrm(hugectr, data.train_list, data.eval_list, batch=args.batch, batch_eval=4096,
                       eval_batches=3, lr=args.lr, workspace_mb=max(1, (3 * 4 * 16 * sum(data.slot_size_array)) // 2 ** 20 + 1),
                       seed=args.seed)
    model.summary()
    t1 = time.time()
    model.fit(max_iter=iters, display=max(iters // 20, 1), eval_interval=eval_interval, snapshot=0)
    train_s = time.time() - t1
    auc = full_eval_auc(model)
    gap = (auc - 0.5) / (data.bayes_auc - 0.5)
    png = os.path.join(args.out, "learning_curve.png")
    h = model.history
    save_learning_curve(png, {"train loss": (h["iter"], h["loss"]), "eval AUC": (h["eval_iter"], h["auc"]) },
                        title="numbactr DLRM on planted-signal data", xlabel="iteration", ylabel="loss / AUC",
                        hlines={"Bayes-optimal AUC": data.bayes_auc})
    print(f"numbactr: trained {iters} iterations x {args.batch} in {train_s:.1f}s "
          f"({iters * args.batch / train_s:,.0f} samples/s)")
    print(f"numbactr: final eval AUC {auc:.4f}  Bayes-optimal AUC {data.bayes_auc:.4f}  "
          f"gap closed {100 * gap:.1f}%  learning curve: {png}")
    return 0 if np.isfinite(auc) else 1
