"""DLRM on Criteo click logs (TSV: label, I1..I13, C1..C26): AUC and log loss.

    python examples/dlrm_criteo.py                                  # datasets/criteo/tiny_criteo.tsv
    python examples/dlrm_criteo.py --data day_0.tsv --epochs 1 --batch 4096 --seeds 3

The default input is the repository's 600-line fixture: synthetic rows in Criteo's layout (not real
Criteo data; 540 train and 60 eval rows), so its metrics only show the whole path works; give a real
day file (or Kaggle's train.txt) for figures comparable with the published ones. Conversion:
numbactr.data.criteo.preprocess_criteo (log(1 + x) dense values, categories seen fewer than --min-count
times share id 0, the last 10% of rows for eval). The graph is DLRM's (Naumov et al. 2019; HugeCTR's
samples/dlrm with InnerProduct + ReLU for its fused MLP layer): a bottom MLP on the 13 dense values to the
embedding width, the 26 slots through a DistributedSlotSparseEmbeddingHash, the dot Interaction (the
bottom output, the pairwise dot products and one zero pad), a top MLP to the logit.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

import numbactr as hugectr  # noqa: E402
from numbactr.data.criteo import preprocess_criteo  # noqa: E402
from numbactr.metrics import log_loss, roc_auc  # noqa: E402

TINY = os.path.join(_common.HERE, os.pardir, "datasets", "criteo", "tiny_criteo.tsv")
PUBLISHED = {
    "AUC": (0.8025, "MLPerf DLRM target on Criteo 1TB; Kaggle Criteo: about 0.80 (Naumov et al. 2019)"),
    "LogLoss": (None, "Kaggle Criteo: about 0.44 (BARS criteo_x1 leaderboard)"),
}
L = hugectr.Layer_t


def build(args, res, seed):
    solver = hugectr.CreateSolver(
        batchsize=args.batch,
        batchsize_eval=args.batch,
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
        source=[res.train_list],
        eval_source=res.eval_list,
        check_type=hugectr.Check_t.Non,
        slot_size_array=res.slot_size_array,
    )
    optimizer = hugectr.CreateOptimizer(
        optimizer_type=hugectr.Optimizer_t.Adam, update_type=hugectr.Update_t.Global, beta1=0.9, beta2=0.999,
        epsilon=1e-7,
    )  # fmt: skip
    model = hugectr.Model(solver, reader, optimizer)
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=res.dense_dim,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data", 1, True, res.slot_num)],
        )
    )
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
            workspace_size_per_gpu_in_mb=max(1, sum(res.slot_size_array) * args.dim * 4 * 3 // 2**20 + 1),
            embedding_vec_size=args.dim,
            combiner="sum",
            sparse_embedding_name="sparse_embedding1",
            bottom_name="data",
            optimizer=optimizer,
        )
    )
    bottom = "dense"
    for k, width in enumerate([*args.bottom, args.dim]):
        model.add(hugectr.DenseLayer(L.InnerProduct, [bottom], [f"bfc{k}"], num_output=width))
        model.add(hugectr.DenseLayer(L.ReLU, [f"bfc{k}"], [f"brelu{k}"]))
        bottom = f"brelu{k}"
    model.add(hugectr.DenseLayer(L.Interaction, [bottom, "sparse_embedding1"], ["interaction1"]))
    bottom = "interaction1"
    for k, width in enumerate(args.top):
        model.add(hugectr.DenseLayer(L.InnerProduct, [bottom], [f"tfc{k}"], num_output=width))
        model.add(hugectr.DenseLayer(L.ReLU, [f"tfc{k}"], [f"trelu{k}"]))
        bottom = f"trelu{k}"
    model.add(hugectr.DenseLayer(L.InnerProduct, [bottom], ["out"], num_output=1))
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["out", "label"], ["loss"]))
    model.compile()
    return model


def main(argv=None):
    ap = _common.parser(__doc__, epochs=5, batch=64, lr=0.001)
    ap.add_argument("--data", default=TINY, help="a Criteo TSV file (default: the 600-line fixture)")
    ap.add_argument("--min-count", type=int, default=2, help="rarer categories share id 0 (default %(default)s)")
    ap.add_argument("--dim", type=int, default=16, help="embedding width (default %(default)s)")
    ap.add_argument("--bottom", type=int, nargs="+", default=[64], help="bottom MLP widths before --dim")
    ap.add_argument("--top", type=int, nargs="+", default=[64, 32], help="top MLP widths before the logit")
    args = ap.parse_args(argv)
    res = preprocess_criteo(args.data, _common.out_dir(args), fmt="parquet", min_count=args.min_count, verbose=False)
    print(f"{res.num_train} training rows, {res.num_eval} eval rows, slot_size_array {res.slot_size_array}")

    def with_numbactr(seed):
        m = _common.fit_and_eval(build(args, res, seed), args.epochs)
        return {k: m[k] for k in ("AUC", "LogLoss")}

    def with_torch(seed):
        import torch

        import torch_twins

        torch.manual_seed(seed)
        train, ev = _common.read_split(res, "train"), _common.read_split(res, "eval")
        net = torch_twins.DLRM(res.slot_size_array, res.dense_dim, args.dim, args.bottom, args.top)
        torch_twins.train(net, train, args.epochs, args.batch, args.lr)
        p = torch_twins.predict(net, ev)
        return {"AUC": roc_auc(ev["label"], p), "LogLoss": log_loss(ev["label"], p)}

    return _common.run(args, f"DLRM on {os.path.basename(args.data)}", with_numbactr, with_torch, PUBLISHED)


if __name__ == "__main__":
    main()
