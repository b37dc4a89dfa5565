"""The models of ``numbactr bench zoo``, built through the HugeCTR API as HugeCTR's samples build them.

Each ``Spec`` names a model of HugeCTR's sample zoo, the shape of its input (dense width, sparse inputs with
their slot sizes), its embeddings and a ``layers(add, L)`` function that adds the dense graph with
``add(DenseLayer(...))``. ``build`` makes the Model (Adam, Update_t.Global, lr 1e-3, as the samples train)
and ``make_batches`` the synthetic batches of the spec's shape that both numbactr and the PyTorch twin
(numbactr/bench/zoo_twins.py) train on. The twins list their parameters in the order in which numbactr's
layers hold theirs (``model.layers``, add order), so weights copy one to one.

Widths are the samples' structure at sizes a 2-core cpu runs in seconds (the MLPs 400 wide, as the issue's
DeepFM on Frappe); no Dropout (HugeCTR's W&D and DCN samples have 0.5: left out so that the twin's loss
can equal numbactr's bit for bit in the test). Shapes: B batch, S slots, D embedding width.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from numbactr.data.batch import Batch

CRITEO = [2000, 3000, 500, 40, 1500, 400, 2000, 300, 100, 2500, 1000, 2000, 30, 700] + [1000] * 12  # 26 slots
FRAPPE = [957, 4082, 7, 7, 2, 3, 2, 80, 233, 9]  # Frappe's 10 fields (BARS frappe_x1), 5,382 ids
MOVIELENS = [943, 1682]  # MovieLens-100K: users, items
CENSUS = [9, 52, 47, 17, 3, 24, 15, 5, 10, 2, 3, 6, 8, 6, 51, 38]  # 16 census-income-like categorical fields
HIDDEN = (400, 400)


@dataclass
class Spec:
    """One zoo model: its name, input shape, embeddings and dense graph (module docstring)."""

    name: str
    sample: str  # what HugeCTR's sample is and what differs here
    dense: int  # dense features
    inputs: list  # [(sparse input name, [slot sizes])]
    embeddings: list  # [(embedding name, sparse input name, D)]
    layers: object  # layers(add, L): the dense graph after the embeddings, up to the loss
    kw: dict = field(default_factory=dict)  # the widths the twin needs too
    heads: list = field(default_factory=lambda: [("logit", "label", 1.0)])  # [(logit top, label, loss weight)]
    dense_fn: object = None  # dense_fn(rng, B) -> (B, dense) float32; None: N(0, 1)

    def slots(self, name: str) -> list:
        return dict(self.inputs)[name]


def fc_relu(add, L, bottom: str, widths, prefix: str) -> str:
    """InnerProduct + ReLU per width; returns the last top."""
    for k, w in enumerate(widths):
        add(L.InnerProduct, [bottom], [f"{prefix}{k}"], num_output=w)
        add(L.ReLU, [f"{prefix}{k}"], [f"{prefix}relu{k}"])
        bottom = f"{prefix}relu{k}"
    return bottom


def _wdl(add, L, s):
    """HugeCTR samples/wdl: wide = sum of the wide slots' 1-wide vectors; deep = MLP on [embeddings | dense]."""
    wide, deep = len(s.slots("wide")), len(s.slots("deep"))
    add(L.Reshape, ["wide_emb"], ["wide_flat"], leading_dim=wide)
    add(L.ReduceSum, ["wide_flat"], ["wide_sum"], axis=1)
    add(L.Reshape, ["deep_emb"], ["deep_flat"], leading_dim=deep * s.kw["D"])
    add(L.Concat, ["deep_flat", "dense"], ["concat"])
    top = fc_relu(add, L, "concat", s.kw["hidden"], "fc")
    add(L.InnerProduct, [top], ["deep_out"], num_output=1)
    add(L.Add, ["deep_out", "wide_sum"], ["logit"])


def _dcn(add, L, s):
    """HugeCTR samples/dcn: [embeddings | dense] sliced into two copies, a MultiCross (projection_dim 0: DCN
    v1, > 0: DCN v2) beside an MLP, both concatenated into the logit."""
    width = len(s.slots("data")) * s.kw["D"] + s.dense
    add(L.Reshape, ["emb"], ["flat"], leading_dim=width - s.dense)
    add(L.Concat, ["flat", "dense"], ["concat"])
    add(L.Slice, ["concat"], ["cross_in", "deep_in"], ranges=[(0, width), (0, width)])
    add(L.MultiCross, ["cross_in"], ["cross"], num_layers=s.kw["cross"], projection_dim=s.kw["proj"])
    top = fc_relu(add, L, "deep_in", s.kw["hidden"], "fc")
    add(L.Concat, ["cross", top], ["both"])
    add(L.InnerProduct, ["both"], ["logit"], num_output=1)


def _deepfm(add, L, s):
    """HugeCTR samples/deepfm without its dense branch (a libFM input has none): one (D + 1)-wide vector per
    slot split into D factors and a first-order weight; logit = MLP(factors) + FM order 2 + sum of weights."""
    S, D = len(s.slots("data")), s.kw["D"]
    add(L.Reshape, ["emb"], ["r1"], leading_dim=D + 1)
    add(L.Slice, ["r1"], ["factors3", "weights3"], ranges=[(0, D), (D, D + 1)])
    add(L.Reshape, ["factors3"], ["factors"], leading_dim=S * D)
    add(L.Reshape, ["weights3"], ["weights"], leading_dim=S)
    top = fc_relu(add, L, "factors", s.kw["hidden"], "fc")
    add(L.InnerProduct, [top], ["deep_out"], num_output=1)
    add(L.FmOrder2, ["factors"], ["fm"], out_dim=D)
    add(L.ReduceSum, ["fm"], ["fm_sum"], axis=1)
    add(L.ReduceSum, ["weights"], ["first"], axis=1)
    add(L.Add, ["deep_out", "fm_sum", "first"], ["logit"])


def _dlrm(add, L, s):
    """HugeCTR samples/dlrm (numbactr.demo.build_dlrm's widths): bottom MLP to D, dot Interaction, top MLP."""
    bottom = fc_relu(add, L, "dense", s.kw["bottom"], "b")
    add(L.Interaction, [bottom, "emb"], ["interaction"])
    top = fc_relu(add, L, "interaction", s.kw["top"], "t")
    add(L.InnerProduct, [top], ["logit"], num_output=1)


def _ncf(add, L, s):
    """HugeCTR samples/ncf (gmf.py, ncf.py, neumf.py): one (mlp + gmf)-wide vector per user and item;
    GMF = user_gmf * item_gmf, the MLP tower on [user_mlp | item_mlp], concatenated into the logit."""
    gmf, mlp = s.kw["gmf"], s.kw["mlp"]
    vec = gmf + mlp
    add(L.Reshape, ["emb"], ["flat"], leading_dim=2 * vec)
    cut = {"user_mlp": (0, mlp), "user_gmf": (mlp, vec), "item_mlp": (vec, vec + mlp), "item_gmf": (vec + mlp, 2 * vec)}
    names = [n for n in cut if (mlp if n.endswith("mlp") else gmf)]
    add(L.Slice, ["flat"], names, ranges=[cut[n] for n in names])
    tops = []
    if gmf:
        add(L.ElementwiseMultiply, ["user_gmf", "item_gmf"], ["gmf"])
        tops.append("gmf")
    if mlp:
        add(L.Concat, ["user_mlp", "item_mlp"], ["mlp_in"])
        tops.append(fc_relu(add, L, "mlp_in", s.kw["tower"], "fc"))
    if len(tops) > 1:
        add(L.Concat, tops, ["concat"])
        tops = ["concat"]
    add(L.InnerProduct, tops, ["logit"], num_output=1)


def _mmoe(add, L, s):
    """HugeCTR samples/mmoe: E experts (InnerProduct + ReLU) on [embeddings | dense], no shared bottom; per
    task a gate (InnerProduct + Softmax over the experts) whose weights, each repeated over the expert width
    (Scale), mix the experts (ElementwiseMultiply, Add) into the task's tower, one logit and BCE per task."""
    E, H = s.kw["experts"], s.kw["expert"]
    add(L.Reshape, ["emb"], ["flat"], leading_dim=len(s.slots("data")) * s.kw["D"])
    add(L.Concat, ["flat", "dense"], ["inputs"])
    for e in range(E):
        fc_relu(add, L, "inputs", [H], f"expert{e}_")
    for task, _, _ in s.heads:
        add(L.InnerProduct, ["inputs"], [f"gate_{task}_fc"], num_output=E)
        add(L.Softmax, [f"gate_{task}_fc"], [f"gate_{task}"])
        add(L.Slice, [f"gate_{task}"], [f"g_{task}{e}" for e in range(E)], ranges=[(e, e + 1) for e in range(E)])
        for e in range(E):
            add(L.Scale, [f"g_{task}{e}"], [f"g_{task}{e}_rep"], axis=0, factor=H)
            add(L.ElementwiseMultiply, [f"g_{task}{e}_rep", f"expert{e}_relu0"], [f"w_{task}{e}"])
        add(L.Add, [f"w_{task}{e}" for e in range(E)], [f"mix_{task}"])
        top = fc_relu(add, L, f"mix_{task}", s.kw["tower"], f"tower_{task}_")
        add(L.InnerProduct, [top], [task], num_output=1)


def _din(add, L, s):
    """HugeCTR samples/din/din_parquet.py (examples/din_taobao.py): the goods' and categories' T + 1 slots
    side by side (FusedReshapeConcat: T history rows, 1 target), the attention unit (target, history, their
    difference and product -> InnerProduct 40 -> 1, Softmax over the history), the attention-weighted
    history summed to one number per sample (the sample's ReduceSum over the flat (B, T*E) product, kept
    as it is), the history's mean, the user and the target into an MLP with PReLU_Dice, one logit."""
    T, E = len(s.slots("GoodID")) - 1, 2 * s.kw["D"]
    add(L.FusedReshapeConcat, ["good_emb", "cate_emb"], ["his", "item"])
    add(L.Scale, ["item"], ["item_rep"], axis=1, factor=T)
    add(L.Sub, ["item_rep", "his"], ["sub_ih"])
    add(L.ElementwiseMultiply, ["item_rep", "his"], ["mul_ih"])
    add(L.Concat, ["item_rep", "his", "sub_ih", "mul_ih"], ["att_in"])
    add(L.InnerProduct, ["att_in"], ["att_fc1"], num_output=s.kw["att"])
    add(L.InnerProduct, ["att_fc1"], ["att_fc2"], num_output=1)
    add(L.Reshape, ["att_fc2"], ["att_score"], leading_dim=T)
    add(L.Softmax, ["att_score"], ["att_w"])
    add(L.Scale, ["att_w"], ["att_w_rep"], axis=0, factor=E)
    add(L.Reshape, ["his"], ["his_flat"], leading_dim=T * E)
    add(L.ElementwiseMultiply, ["att_w_rep", "his_flat"], ["weighted"])
    add(L.ReduceSum, ["weighted"], ["reduce_ih"], axis=1)
    add(L.Reshape, ["his"], ["his3"], leading_dim=E, time_step=T)
    add(L.ReduceMean, ["his3"], ["his_mean3"], axis=1)
    add(L.Reshape, ["his_mean3"], ["his_mean"], leading_dim=E)
    add(L.Reshape, ["user_emb"], ["user"], leading_dim=s.kw["D"])
    add(L.Concat, ["user", "his_mean", "reduce_ih", "item"], ["top_in"])
    bottom = "top_in"
    for k, w in enumerate(s.kw["hidden"]):
        add(L.InnerProduct, [bottom], [f"fc{k}"], num_output=w)
        add(L.PReLU_Dice, [f"fc{k}"], [f"dice{k}"], elu_alpha=s.kw["alpha"], eps=1e-8)
        bottom = f"dice{k}"
    add(L.InnerProduct, [bottom], ["logit"], num_output=1)


def _bst(add, L, s):
    """BST (Behavior Sequence Transformer) as HugeCTR v23.06's layers build it (tests/sample_graphs.py's
    BST-like graph at larger widths): Q, K, V InnerProducts on the T history vectors, MultiHeadAttention
    scores, Softmax masked by SequenceMask (the dense input is each sample's history length; keys at or past
    it are dropped), the attention, a residual InnerProduct, LayerNorm, the mean over the history, the
    user vector, an MLP with ReLU, one logit."""
    T, W = len(s.slots("hist")), s.kw["width"]
    add(L.SequenceMask, ["dense"], ["mask"], max_sequence_len=T)  # (B, 1, 1, T)
    for name in ("q", "k", "v"):
        add(L.InnerProduct, ["hist_emb"], [name], num_output=W)  # (B, T, W)
    add(L.MultiHeadAttention, ["q", "k", "v"], ["scores", "v4"], num_attention_heads=s.kw["heads"])
    add(L.Softmax, ["scores", "mask"], ["probs"])
    add(L.MultiHeadAttention, ["probs", "v4"], ["att"], num_attention_heads=s.kw["heads"])  # (B, T, W)
    add(L.InnerProduct, ["hist_emb"], ["res"], num_output=W)
    add(L.Add, ["att", "res"], ["att_res"])
    add(L.LayerNorm, ["att_res"], ["ln"])
    add(L.ReduceMean, ["ln"], ["pooled3"], axis=1)  # (B, 1, W)
    add(L.Reshape, ["pooled3"], ["pooled"], leading_dim=W)
    add(L.Reshape, ["user_emb"], ["user_vec"], leading_dim=s.kw["D"])
    add(L.Concat, ["pooled", "user_vec"], ["top_in"])
    top = fc_relu(add, L, "top_in", s.kw["hidden"], "fc")
    add(L.InnerProduct, [top], ["logit"], num_output=1)


def _lengths(rng, batch: int, T: int = 10) -> np.ndarray:
    """BST's dense input: each sample's history length, 1..T as floats (B, 1)."""
    return rng.integers(1, T + 1, (batch, 1)).astype(np.float32)


def _ncf_spec(name: str, gmf: int, mlp: int) -> Spec:
    return Spec(
        name,
        f"HugeCTR samples/ncf {name.lower()}.py on MovieLens-100K's shape (943 users, 1,682 items); "
        f"GMF width {gmf}, MLP width {mlp}" + (", tower 64-32-16" if mlp else ""),
        0,
        [("data", MOVIELENS)],
        [("emb", "data", gmf + mlp)],
        _ncf,
        dict(gmf=gmf, mlp=mlp, tower=(64, 32, 16) if mlp else ()),
    )


SPECS = {
    s.name: s
    for s in [
        Spec(
            "W&D",
            "HugeCTR samples/wdl: 13 dense, 26 deep slots (D 16), 2 wide slots (D 1), MLP 400-400 (sample: "
            "1024-1024 with Dropout)",
            13,
            [("deep", CRITEO), ("wide", [5000, 5000])],
            [("wide_emb", "wide", 1), ("deep_emb", "deep", 16)],
            _wdl,
            dict(D=16, hidden=HIDDEN),
        ),
        Spec(
            "DCN",
            "HugeCTR samples/dcn: 13 dense, 26 slots (D 16), MultiCross 3 layers (DCN v1), MLP 400-400 "
            "(sample: 6 cross layers, 1024-1024 with Dropout)",
            13,
            [("data", CRITEO)],
            [("emb", "data", 16)],
            _dcn,
            dict(D=16, cross=3, proj=0, hidden=HIDDEN),
        ),
        Spec(
            "DCNv2",
            "DCN with MultiCross projection_dim 64 (DCN v2's low-rank cross; numbactr's extension of HugeCTR's "
            "MultiCross)",
            13,
            [("data", CRITEO)],
            [("emb", "data", 16)],
            _dcn,
            dict(D=16, cross=3, proj=64, hidden=HIDDEN),
        ),
        Spec(
            "DeepFM",
            "HugeCTR samples/deepfm on Frappe's shape (10 fields, 5,382 ids, no dense), D 10, MLP 400-400-400",
            0,
            [("data", FRAPPE)],
            [("emb", "data", 11)],
            _deepfm,
            dict(D=10, hidden=(400, 400, 400)),
        ),
        Spec(
            "DLRM",
            "HugeCTR samples/dlrm at numbactr.demo.build_dlrm's widths: 13 dense -> 64-32-16, 26 slots (D 16), "
            "dot interaction, 128-64-1",
            13,
            [("data", CRITEO)],
            [("emb", "data", 16)],
            _dlrm,
            dict(D=16, bottom=(64, 32, 16), top=(128, 64)),
        ),
        _ncf_spec("NeuMF", 16, 32),
        _ncf_spec("GMF", 16, 0),
        _ncf_spec("NCF", 0, 32),
        Spec(
            "MMoE",
            "HugeCTR samples/mmoe's structure (two tasks, income and marital status, as on census income): "
            "6 dense, 16 slots (D 16), 4 experts 64 wide, softmax gates, towers 32-1, loss weights 0.5 and 0.5",
            6,
            [("data", CENSUS)],
            [("emb", "data", 16)],
            _mmoe,
            dict(D=16, experts=4, expert=64, tower=(32,)),
            [("logit_income", "income", 0.5), ("logit_married", "married", 0.5)],
        ),
        Spec(
            "DIN",
            "HugeCTR samples/din (din_parquet.py) at its sizes: history 10, D 18 per user, good and category, "
            "attention 40-1, MLP 200-80 with PReLU_Dice; synthetic ids (1,000 users, 400 goods and 50 "
            "categories per slot), no dense",
            0,
            [("UserID", [1000]), ("GoodID", [400] * 11), ("CateID", [50] * 11)],
            [("user_emb", "UserID", 18), ("good_emb", "GoodID", 18), ("cate_emb", "CateID", 18)],
            _din,
            dict(D=18, att=40, hidden=(200, 80), alpha=0.2),
        ),
        Spec(
            "BST",
            "BST-like (HugeCTR v23.06's SequenceMask, MultiHeadAttention, masked Softmax, LayerNorm): history "
            "10 (400 ids per slot), lengths 1-10 as the dense input, D 16, attention 32 wide with 4 heads, "
            "residual, LayerNorm, mean pooling, user vector (1,000 users), MLP 200-80",
            1,
            [("hist", [400] * 10), ("user", [1000])],
            [("hist_emb", "hist", 16), ("user_emb", "user", 16)],
            _bst,
            dict(D=16, width=32, heads=4, hidden=(200, 80)),
            dense_fn=_lengths,
        ),
    ]
}


def build(hugectr, spec: Spec, batch: int, *, lr: float = 1e-3, seed: int = 0):
    """The spec's HugeCTR Model, compiled: Adam (beta1 0.9, beta2 0.999, epsilon 1e-7, Update_t.Global) on
    every weight, a BCE loss per head (several: compiled with the heads' loss weights). Its reader is never opened: the benchmark hands it batches in memory
    (``model._train_reader``, as numbactr/bench/dlrm.py does)."""
    solver = hugectr.CreateSolver(
        batchsize=batch, batchsize_eval=batch, max_eval_batches=1, lr=lr, vvgpu=[[0]], seed=seed, i64_input_key=True
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=["in-memory-batches"],
        eval_source="in-memory-batches",
        check_type=hugectr.Check_t.Non,
    )
    opt = hugectr.CreateOptimizer(
        optimizer_type=hugectr.Optimizer_t.Adam, update_type=hugectr.Update_t.Global, beta1=0.9, beta2=0.999,
        epsilon=1e-7,
    )  # fmt: skip
    model = hugectr.Model(solver, reader, opt)
    labels = [label for _, label, _ in spec.heads]
    model.add(
        hugectr.Input(
            label_dims=[1] * len(labels),
            label_names=labels,
            dense_dim=spec.dense,
            dense_name="dense",
            data_reader_sparse_param_array=[
                hugectr.DataReaderSparseParam(name, 1, True, len(sizes)) for name, sizes in spec.inputs
            ],
        )
    )
    for name, bottom, vec in spec.embeddings:
        rows = sum(spec.slots(bottom))
        model.add(
            hugectr.SparseEmbedding(
                embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
                workspace_size_per_gpu_in_mb=rows * vec * 4 * 4 // 2**20 + 1,  # weights + 2 Adam states, headroom
                embedding_vec_size=vec,
                combiner="sum",
                sparse_embedding_name=name,
                bottom_name=bottom,
                optimizer=opt,
            )
        )

    def add(kind, bottoms, tops, **kw):
        model.add(hugectr.DenseLayer(kind, bottoms, tops, **kw))

    spec.layers(add, hugectr.Layer_t, spec)
    for logit, label, _ in spec.heads:
        add(hugectr.Layer_t.BinaryCrossEntropyLoss, [logit, label], [f"loss_{label}"])
    if len(spec.heads) > 1:
        model.compile(loss_names=labels, loss_weights=[w for _, _, w in spec.heads])
    else:
        model.compile()
    return model


def make_batches(spec: Spec, batch: int, count: int, seed: int = 0) -> list:
    """``count`` Batches of the spec's shape: dense N(0, 1), one key per slot drawn uniformly from the slot's
    ids (slot offsets added: the keys of one input are one table's rows), labels (one column per head) 1 with probability 0.3."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        sparse = []
        for _, sizes in spec.inputs:
            offsets = np.r_[0, np.cumsum(sizes)[:-1]]
            keys = (rng.integers(0, sizes, size=(batch, len(sizes))) + offsets).reshape(-1)  # (B*S,)
            sparse.append((keys.astype(np.int64), np.arange(batch * len(sizes) + 1, dtype=np.int64)))
        out.append(
            Batch(
                label=(rng.random((batch, len(spec.heads))) < 0.3).astype(np.float32),
                dense=(
                    spec.dense_fn(rng, batch)
                    if spec.dense_fn
                    else rng.standard_normal((batch, spec.dense)).astype(np.float32)
                ),
                sparse=sparse,
            )
        )
    return out


def feed(model, batches: list) -> None:
    """Hand the model these batches, cycled, as its training and evaluation data (its reader never opens)."""
    model._train_reader = itertools.cycle(batches)
    model._eval_reader = itertools.cycle(batches)


def ids_of(spec: Spec, b: Batch) -> dict:
    """{sparse input name: (B, S) int64 keys} of a Batch (one-hot slots), the twin's input."""
    return {name: b.sparse[i][0].reshape(b.batch_size, len(sizes)) for i, (name, sizes) in enumerate(spec.inputs)}


def dense_params(model) -> list:
    """numbactr's dense parameters in the layers' order (the order the twins list theirs): host arrays."""
    from numbactr.runtime import device

    return [device.to_host(p.data) for layer in model.layers for p in layer.params]


def dense_grads(model) -> list:
    """The last training step's gradients of dense_params(), same order (the layers' views of the flat
    gradient buffer the dense optimizer reads)."""
    from numbactr.runtime import device

    return [device.to_host(g) for layer in model.layers for g in layer.grad_views]


def load_embeddings(model, spec: Spec, tables: dict) -> None:
    """Fill every embedding of the model with all its rows: ``tables`` {embedding name: (V, D) array}, row r
    the vector of key r (the twin's nn.Embedding weights), so both start from the same table."""
    by_name = {e.cfg.sparse_embedding_name: e for e in model.embeddings}
    for name, _, _ in spec.embeddings:
        w = np.asarray(tables[name], np.float32)
        by_name[name].load(np.arange(len(w), dtype=np.uint64), w)
