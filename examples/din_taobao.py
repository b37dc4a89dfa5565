"""DIN on Taobao user behaviour sequences (Tianchi's UserBehavior.csv): AUC, group AUC and log loss.

    python examples/din_taobao.py --data UserBehavior.csv --seeds 3

Conversion: numbactr.data.convert.convert_taobao (per user the clicks in time order; eval: each user's
last click and a sampled negative, train: the click before it and its negative; histories of --max-len
items and categories). The graph is HugeCTR's samples/din/din_parquet.py with its sizes tied to
--max-len and --dim: UserID, GoodID and CateID inputs through three DistributedSlotSparseEmbeddingHash,
FusedReshapeConcat into the history and the target (item and category vectors side by side), the
attention unit (target, history, their difference and product -> InnerProduct 40 -> 1, Softmax over the
history), the attention-weighted sum and the mean of the history, the user vector and the target into an
MLP (200, 80) with PReLU_Dice, InnerProduct(1), BinaryCrossEntropyLoss. Group AUC is over users
(CreateSolver eval_group_slot=0, the user slot). There is no PyTorch twin of this model yet: numbactr only.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

import numbactr as hugectr  # noqa: E402
from numbactr.data.convert import convert_taobao  # noqa: E402

PUBLISHED = {
    "AUC": (None, "-"),
    "GroupAUC": (
        None,
        "DIN paper (Zhou et al. 2018) reports gAUC on its own Alibaba/Amazon/MovieLens data, not this one",
    ),
    "LogLoss": (None, "-"),
}
L = hugectr.Layer_t


def build(args, res, seed):
    T, V = res.history_length, args.dim
    E = 2 * V  # an item vector and its category's, side by side
    solver = hugectr.CreateSolver(
        batchsize=args.batch,
        batchsize_eval=1000,
        max_eval_batches=10**6,
        lr=args.lr,
        vvgpu=[[0]],
        seed=seed,
        i64_input_key=True,
        repeat_dataset=False,
        metrics_spec={
            hugectr.MetricsType.AUC: 1.0,
            hugectr.MetricsType.GroupAUC: 1.0,
            hugectr.MetricsType.LogLoss: 1.0,
        },
        eval_group_slot=0,
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
        epsilon=1e-9,
    )  # fmt: skip
    model = hugectr.Model(solver, reader, optimizer)
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=0,
            dense_name="dense",
            data_reader_sparse_param_array=[
                hugectr.DataReaderSparseParam("UserID", 1, True, 1),
                hugectr.DataReaderSparseParam("GoodID", 1, True, T + 1),
                hugectr.DataReaderSparseParam("CateID", 1, True, T + 1),
            ],
        )
    )
    for name, bottom in (("user", "UserID"), ("good", "GoodID"), ("cate", "CateID")):
        model.add(
            hugectr.SparseEmbedding(
                embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
                workspace_size_per_gpu_in_mb=max(1, sum(res.slot_size_array) * V * 4 * 3 // 2**20 + 1),
                embedding_vec_size=V,
                combiner="sum",
                sparse_embedding_name=f"sparse_embedding_{name}",
                bottom_name=bottom,
                optimizer=optimizer,
            )
        )
    add = model.add

    def layer(kind, bottoms, tops, **kw):
        add(hugectr.DenseLayer(kind, bottoms, tops, **kw))

    layer(L.FusedReshapeConcat, ["sparse_embedding_good", "sparse_embedding_cate"], ["his", "item"])
    layer(L.Scale, ["item"], ["Scale_item"], axis=1, factor=T)
    layer(L.Sub, ["Scale_item", "his"], ["sub_ih"])
    layer(L.ElementwiseMultiply, ["Scale_item", "his"], ["ElementwiseMul_i"])
    layer(L.Concat, ["Scale_item", "his", "sub_ih", "ElementwiseMul_i"], ["concat_i_h"])
    layer(L.InnerProduct, ["concat_i_h"], ["fc_att_i2"], num_output=40)
    layer(L.InnerProduct, ["fc_att_i2"], ["fc_att_i3"], num_output=1)
    layer(L.Reshape, ["fc_att_i3"], ["reshape_score"], leading_dim=T)
    layer(L.Softmax, ["reshape_score"], ["softmax_att_i"])
    layer(L.Scale, ["softmax_att_i"], ["Scale_i"], axis=0, factor=E)
    layer(L.Reshape, ["his"], ["reshape_item_his"], leading_dim=T * E)
    layer(L.ElementwiseMultiply, ["Scale_i", "reshape_item_his"], ["ElementwiseMul_ih"])
    layer(L.ReduceSum, ["ElementwiseMul_ih"], ["reduce_ih"], axis=1)
    layer(L.Reshape, ["his"], ["reshape_his"], leading_dim=E, time_step=T)
    layer(L.ReduceMean, ["reshape_his"], ["reduce_item_his"], axis=1)
    layer(L.Reshape, ["reduce_item_his"], ["reshape_reduce_item_his"], leading_dim=E)
    layer(L.Reshape, ["sparse_embedding_user"], ["reshape_user"], leading_dim=V)
    layer(L.Concat, ["reshape_user", "reshape_reduce_item_his", "reduce_ih", "item"], ["concat_din_i"])
    layer(L.InnerProduct, ["concat_din_i"], ["fc_din_i1"], num_output=200)
    layer(L.PReLU_Dice, ["fc_din_i1"], ["dice_1"], elu_alpha=0.2, eps=1e-8)
    layer(L.InnerProduct, ["dice_1"], ["fc_din_i2"], num_output=80)
    layer(L.PReLU_Dice, ["fc_din_i2"], ["dice_2"], elu_alpha=0.2, eps=1e-8)
    layer(L.InnerProduct, ["dice_2"], ["fc3"], num_output=1)
    layer(L.BinaryCrossEntropyLoss, ["fc3", "label"], ["loss"])
    model.compile()
    return model


def main(argv=None):
    ap = _common.parser(__doc__, epochs=3, batch=64, lr=0.001)
    ap.add_argument("--data", required=True, help="UserBehavior.csv: user,item,category,behavior,timestamp")
    ap.add_argument("--max-len", type=int, default=10, help="history length (HugeCTR's DIN: 10)")
    ap.add_argument("--dim", type=int, default=18, help="embedding width (HugeCTR's DIN: 18)")
    ap.add_argument("--train-targets", choices=["last", "all"], default="all", help="training targets per user")
    args = ap.parse_args(argv)
    res = convert_taobao(
        args.data, _common.out_dir(args), max_len=args.max_len, train_targets=args.train_targets,
        seed=args.data_seed, verbose=False,
    )  # fmt: skip
    print(f"{res.num_train} training rows, {res.num_eval} eval rows ({res.num_users} users, {res.num_items} items)")

    def with_numbactr(seed):
        m = _common.fit_and_eval(build(args, res, seed), args.epochs)
        return {k: m[k] for k in ("AUC", "GroupAUC", "LogLoss")}

    return _common.run(args, f"DIN on {os.path.basename(args.data)}", with_numbactr, None, PUBLISHED)


if __name__ == "__main__":
    main()
