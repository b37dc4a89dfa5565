"""DeepFM on a libFM file (Frappe and the other BARS/FuxiCTR files): AUC and log loss.

    python examples/deepfm_libfm.py --data frappe/train.libfm --eval-data frappe/valid.libfm --seeds 3

Input: ``label field:feature:value ...`` lines, converted by numbactr.data.convert.convert_libfm (fields
given; per-field ids 1..K, id 0 for a rare feature or an empty field; without --eval-data the last 10% of
the lines are the eval set). The graph is HugeCTR's samples/deepfm/deepfm_parquet.py without its dense
branch (libFM files hold no dense features): one DistributedSlotSparseEmbeddingHash of width dim + 1,
Reshape and Slice into the dim-wide factors and the first-order weight of every slot; FmOrder2 + ReduceSum
(second order), ReduceSum of the weights (first order), an MLP on the factors (deep part); Add of the three
into BinaryCrossEntropyLoss. No dropout here (HugeCTR's sample has 0.5).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

import numbactr as hugectr  # noqa: E402
from numbactr.data.convert import convert_libfm  # noqa: E402
from numbactr.metrics import log_loss, roc_auc  # noqa: E402

PUBLISHED = {
    "AUC": (0.98, "Frappe: about 0.98, BARS frappe_x1 DeepFM (Zhu et al. 2022, BARS leaderboard)"),
    "LogLoss": (None, "-"),
}
L = hugectr.Layer_t


def build(args, res, seed):
    S, D = res.slot_num, args.dim
    solver = hugectr.CreateSolver(
        batchsize=args.batch,
        batchsize_eval=1000,
        max_eval_batches=10**6,
        lr=args.lr,
        vvgpu=[[0]],
        seed=seed,
        i64_input_key=True,
        repeat_dataset=False,
        metrics_spec={hugectr.MetricsType.AUC: 1.0, hugectr.MetricsType.LogLoss: 1.0},
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Parquet,
        source=[res.train_source],
        eval_source=res.eval_source,
        check_type=hugectr.Check_t.Non,
        slot_size_array=res.slot_size_array,
    )
    optimizer = hugectr.CreateOptimizer(
        optimizer_type=hugectr.Optimizer_t.Adam, update_type=hugectr.Update_t.Global, beta1=0.9, beta2=0.999,
        epsilon=1e-7,
    )  # fmt: skip
    model = hugectr.Model(solver, reader, optimizer)
    nnz = max(res.max_nnz_per_slot)
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=0,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", nnz, nnz == 1, S)],
        )
    )
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
            workspace_size_per_gpu_in_mb=max(1, sum(res.slot_size_array) * (D + 1) * 4 * 3 // 2**20 + 1),
            embedding_vec_size=D + 1,
            combiner="sum",
            sparse_embedding_name="sparse_embedding1",
            bottom_name="data1",
            optimizer=optimizer,
        )
    )
    model.add(hugectr.DenseLayer(L.Reshape, ["sparse_embedding1"], ["reshape1"], leading_dim=D + 1))
    model.add(hugectr.DenseLayer(L.Slice, ["reshape1"], ["slice11", "slice12"], ranges=[(0, D), (D, D + 1)]))
    model.add(hugectr.DenseLayer(L.Reshape, ["slice11"], ["reshape2"], leading_dim=S * D))
    model.add(hugectr.DenseLayer(L.Reshape, ["slice12"], ["reshape3"], leading_dim=S))
    bottom = "reshape2"
    for k, width in enumerate(args.hidden):
        model.add(hugectr.DenseLayer(L.InnerProduct, [bottom], [f"fc{k}"], num_output=width))
        model.add(hugectr.DenseLayer(L.ReLU, [f"fc{k}"], [f"relu{k}"]))
        bottom = f"relu{k}"
    model.add(hugectr.DenseLayer(L.InnerProduct, [bottom], ["deep_out"], num_output=1))
    model.add(hugectr.DenseLayer(L.FmOrder2, ["reshape2"], ["fmorder2"], out_dim=D))
    model.add(hugectr.DenseLayer(L.ReduceSum, ["fmorder2"], ["reducesum1"], axis=1))
    model.add(hugectr.DenseLayer(L.ReduceSum, ["reshape3"], ["reducesum2"], axis=1))
    model.add(hugectr.DenseLayer(L.Add, ["deep_out", "reducesum1", "reducesum2"], ["add"]))
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["add", "label"], ["loss"]))
    model.compile()
    return model


def main(argv=None):
    ap = _common.parser(__doc__, epochs=5, batch=1024, lr=0.001)
    ap.add_argument("--data", required=True, help="a libFM file (Frappe: train.libfm)")
    ap.add_argument("--eval-data", default=None, help="its eval file (Frappe: valid.libfm or test.libfm)")
    ap.add_argument("--dim", type=int, default=10, help="factor width (default %(default)s)")
    ap.add_argument("--hidden", type=int, nargs="+", default=[400, 400, 400], help="deep MLP widths")
    args = ap.parse_args(argv)
    res = convert_libfm(
        args.data, _common.out_dir(args), eval_source=args.eval_data, seed=args.data_seed, verbose=False
    )
    print(f"{res.num_train} training rows, {res.num_eval} eval rows, {res.slot_num} fields {res.slot_size_array}")
    one_hot = max(res.max_nnz_per_slot) == 1

    def with_numbactr(seed):
        m = _common.fit_and_eval(build(args, res, seed), args.epochs)
        return {k: m[k] for k in ("AUC", "LogLoss")}

    def with_torch(seed):
        import torch

        import torch_twins

        torch.manual_seed(seed)
        train, ev = _common.read_split(res, "train"), _common.read_split(res, "eval")
        net = torch_twins.DeepFM(res.slot_size_array, args.dim, args.hidden)
        torch_twins.train(net, train, args.epochs, args.batch, args.lr)
        p = torch_twins.predict(net, ev)
        return {"AUC": roc_auc(ev["label"], p), "LogLoss": log_loss(ev["label"], p)}

    if not one_hot:
        print("multi-hot fields: the PyTorch twin reads one-hot fields only; numbactr only")
    twin = with_torch if one_hot else None
    return _common.run(args, f"DeepFM on {os.path.basename(args.data)}", with_numbactr, twin, PUBLISHED)


if __name__ == "__main__":
    main()
