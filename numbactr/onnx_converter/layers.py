"""Every numbactr dense layer as ONNX operators: one emitter per Layer_t, the layer's eval forward.

An emitter ``emit(g, layer, xs, ws, tops)`` gets the graph (numbactr.onnx_converter.graph.OnnxGraph), the
built numbactr layer (its config, inferred shapes and settings), the names of its bottom tensors ``xs``,
its weights ``ws`` as host arrays in HugeCTR's order, and the names of its tops, which its last nodes
must define. Shapes: dim 0 of every tensor is the batch (or a multiple of it, after Scale axis 1,
Reshape or FusedReshapeConcat), left symbolic as -1 in reshapes; the other dims are the layer's.

The formulas are the layers' own (numbactr/layers/*.py and their kernels' NumPy references, the oracle
of tests/test_onnx_converter.py), in the same order of float operations where ONNX allows it:
  InnerProduct, MLP, FusedInnerProduct   act(X W + b)                         MatMul, Add, Relu
  MultiCross v1 / v2                     x0 * (x_l w_l) + x_l + b_l / x0 * (x_l U V + b_l) + x_l
  Interaction                            [dense, strict lower triangle of Z Zᵀ (row-major), 0]
  LayerNorm, PReLU_Dice                  two-pass mean and variance, as the references
  BatchNorm                              the running statistics (eval)
  Softmax                                over the last dim; masked: x*factor - (1-mask)*10000,
                                         max subtracted, +1e-6 in the denominator
  Dropout, Cast                          identity (eval; numbactr computes fp32)
  GRU                                    ONNX GRU, linear_before_reset=1 (cuDNN's single input
                                         bias), h0 = the trained hx (numbactr's layout, or HugeCTR's
                                         seq-major one with h0 = 0 under hugectr_exact.hugectr_exact())
"""

from __future__ import annotations

import math

import numpy as np

from numbactr import hugectr_exact
from numbactr.enums import Activation_t
from numbactr.kernels import prelu_dice as dice_k
from numbactr.kernels import softmax as softmax_k


def _chain(g, x: str, steps: list, out: str) -> None:
    """Apply ``steps`` [(op, extra input or None, attrs)] to x in turn; the last one defines ``out``."""
    for i, (op, arg, attrs) in enumerate(steps):
        x = g.op(
            op,
            [x] + ([arg] if arg is not None else []),
            f"{out}/{op.lower()}",
            out=out if i == len(steps) - 1 else None,
            **attrs,
        )


def _fc(g, x: str, w, b, relu: bool, out: str) -> None:
    """out = act(x W + b) on the last dim (b None: no bias)."""
    steps = [("MatMul", g.const(w, f"{out}/W"), {})]
    if b is not None:
        steps.append(("Add", g.const(b, f"{out}/b"), {}))
    if relu:
        steps.append(("Relu", None, {}))
    _chain(g, x, steps, out)


def _reshape(g, x: str, tail, out: str | None, hint: str) -> str:
    """x viewed as (-1, *tail)."""
    return g.op("Reshape", [x, g.ints([-1, *tail], f"{hint}/shape")], hint, out=out)


def _reduce(g, op: str, x: str, axis: int, keep: bool, hint: str, out: str | None = None) -> str:
    """ReduceSum (axes as an input since opset 13) or ReduceMean/ReduceMax (an attribute until 18)."""
    if op == "ReduceSum":
        return g.op(op, [x, g.ints([axis], f"{hint}/axes")], hint, out=out, keepdims=int(keep))
    return g.op(op, [x], hint, out=out, axes=[axis], keepdims=int(keep))


# ---- core ------------------------------------------------------------------------------------
def inner_product(g, layer, xs, ws, tops):
    _fc(g, xs[0], ws[0], ws[1], False, tops[0])


def relu(g, layer, xs, ws, tops):
    g.op("Relu", xs, tops[0], out=tops[0])


def concat(g, layer, xs, ws, tops):
    g.op("Concat", xs, tops[0], out=tops[0], axis=layer.axis)


def reshape(g, layer, xs, ws, tops):
    if layer.cfg.selected:  # layers.shape.ReshapeSelected: slots of (B, S, V)
        sel = g.op(
            "Gather", [xs[0], g.const(layer.index.host, f"{tops[0]}/slots", np.int64)], f"{tops[0]}/slots", axis=1
        )
        _reshape(g, sel, layer.out_shapes[0][1:], tops[0], tops[0])
    else:
        _reshape(g, xs[0], layer.out_shapes[0][1:], tops[0], tops[0])


def interaction(g, layer, xs, ws, tops):
    dense, emb = xs
    t = tops[0]
    n = layer.in_shapes[1][1] + 1  # S + 1 vectors
    z = g.op("Concat", [g.op("Unsqueeze", [dense, g.ints([1], f"{t}/ax")], f"{t}/dense3"), emb], f"{t}/z", axis=1)
    zz = g.op("MatMul", [z, g.op("Transpose", [z], f"{t}/zT", perm=[0, 2, 1])], f"{t}/zzT")  # (B, n, n)
    rows, cols = np.tril_indices(n, k=-1)  # row-major strict lower
    pairs = g.op(
        "Gather",
        [_reshape(g, zz, [n * n], None, f"{t}/flat"), g.const(rows * n + cols, f"{t}/pairs", np.int64)],
        f"{t}/pairs",
        axis=1,
    )
    cat = g.op("Concat", [dense, pairs], f"{t}/cat", axis=1)
    g.op("Pad", [cat, g.ints([0, 0, 0, 1], f"{t}/pad")], t, out=t)  # HugeCTR's zero column


# ---- elementwise -----------------------------------------------------------------------------
def _unary(op_type: str, **attrs):
    def emit(g, layer, xs, ws, tops):
        g.op(op_type, xs[:1], tops[0], out=tops[0], **attrs)

    return emit


def elu(g, layer, xs, ws, tops):
    g.op("Elu", xs, tops[0], out=tops[0], alpha=layer.alpha)


def add(g, layer, xs, ws, tops):
    _binary_chain(g, "Add", xs, tops[0])


def sub(g, layer, xs, ws, tops):
    g.op("Sub", xs, tops[0], out=tops[0])


def multiply(g, layer, xs, ws, tops):
    _binary_chain(g, "Mul", xs, tops[0])


def _binary_chain(g, op: str, xs, out: str) -> None:
    """((x0 op x1) op x2) ...: the references' order."""
    _chain(g, xs[0], [(op, x, {}) for x in xs[1:]], out)


def scale(g, layer, xs, ws, tops):
    t, f = tops[0], layer.f
    n = layer.in_shapes[0][1]
    if layer.axis == 0:  # (B, N) -> (B, N, f) -> (B, N*f): elements repeated
        x3 = g.op("Unsqueeze", [xs[0], g.ints([2], f"{t}/ax")], f"{t}/x3")
        rep = g.op("Expand", [x3, g.ints([1, 1, f], f"{t}/rep")], f"{t}/rep")
        _reshape(g, rep, [n * f], t, t)
    else:  # (B, N) -> (B, f, N) -> (B*f, N): rows repeated
        x3 = g.op("Unsqueeze", [xs[0], g.ints([1], f"{t}/ax")], f"{t}/x3")
        rep = g.op("Expand", [x3, g.ints([1, f, 1], f"{t}/rep")], f"{t}/rep")
        _reshape(g, rep, [n], t, t)


def weight_multiply(g, layer, xs, ws, tops):
    t = tops[0]
    x3 = g.op("Unsqueeze", [xs[0], g.ints([2], f"{t}/ax")], f"{t}/x3")  # (B, S, 1)
    y = g.op("Mul", [x3, g.const(ws[0], f"{t}/W")], f"{t}/xW")  # (B, S, V)
    _reshape(g, y, [layer.s * layer.v], t, t)


def fm_order2(g, layer, xs, ws, tops):
    t, v = tops[0], layer.v
    e = _reshape(g, xs[0], [layer.in_shapes[0][1] // v, v], None, f"{t}/e")  # (B, S, V)
    s = _reduce(g, "ReduceSum", e, 1, False, f"{t}/sum")  # (B, V)
    sq = _reduce(g, "ReduceSum", g.op("Mul", [e, e], f"{t}/e2"), 1, False, f"{t}/sumsq")
    d = g.op("Sub", [g.op("Mul", [s, s], f"{t}/s2"), sq], f"{t}/diff")
    g.op("Mul", [g.const(0.5, f"{t}/half"), d], t, out=t)


# ---- shape -----------------------------------------------------------------------------------
def reduce_axis(g, layer, xs, ws, tops):
    _reduce(g, "ReduceMean" if layer.mean else "ReduceSum", xs[0], layer.axis, True, tops[0], out=tops[0])


def slice_(g, layer, xs, ws, tops):
    for (a, b), t in zip(layer.ranges, tops):
        g.op("Slice", [xs[0], g.ints([a], f"{t}/start"), g.ints([b], f"{t}/end"), g.ints([-1], f"{t}/axis")], t, out=t)


def select(g, layer, xs, ws, tops):
    g.op(
        "Gather", [xs[0], g.const(layer.index.host, f"{tops[0]}/index", np.int64)], tops[0], out=tops[0], axis=layer.dim
    )


def gather(g, layer, xs, ws, tops):
    g.op("Gather", [xs[0], g.const(layer.index.host, f"{tops[0]}/rows", np.int64)], tops[0], out=tops[0], axis=0)


def fused_reshape_concat(g, layer, xs, ws, tops):
    t = tops[0]
    s = layer.in_shapes[0][1]
    w = sum(shape[2] for shape in layer.in_shapes)
    z = g.op("Concat", xs, f"{t}/z", axis=2)  # (B, S, W)
    if len(tops) == 1:  # ...General: (B*S, W)
        _reshape(g, z, [w], t, t)
        return
    for (a, b), top in (((0, s - 1), tops[0]), ((s - 1, s), tops[1])):  # items, then the ad slot
        part = g.op(
            "Slice",
            [z, g.ints([a], f"{top}/start"), g.ints([b], f"{top}/end"), g.ints([1], f"{top}/axis")],
            f"{top}/slots",
        )
        _reshape(g, part, [w], top, top)


def sequence_mask(g, layer, xs, ws, tops):
    # i < trunc(len) <=> i + 1 <= len for the integers i >= 0 (the reference truncates the float length)
    # v23.06's one-bottom form: lengths (B, 1) -> (B, 1, 1, L), the "to" mask alone (every from-length is 1)
    t = tops[0]
    pairs = (
        [(xs[0], layer.lt, [-1, 1, 1, layer.lt], "to")]
        if layer.one_bottom
        else [(xs[0], layer.lf, [-1, 1, layer.lf, 1], "from"), (xs[1], layer.lt, [-1, 1, 1, layer.lt], "to")]
    )
    masks = []
    for x, count, shape, what in pairs:
        steps = g.const(np.arange(1, count + 1).reshape(shape[1:]), f"{t}/{what}_steps")
        lens = g.op("Reshape", [x, g.ints([-1, 1, 1, 1], f"{t}/{what}_shape")], f"{t}/{what}_len")
        masks.append(g.op("LessOrEqual", [steps, lens], f"{t}/{what}_mask"))
    both = masks[0] if len(masks) == 1 else g.op("And", masks, f"{t}/both")
    g.op("Cast", [both], t, out=t, to=g.onnx.TensorProto.FLOAT)


# ---- attention -------------------------------------------------------------------------------
def softmax(g, layer, xs, ws, tops):
    t = tops[0]
    if not layer.masked:
        g.op("Softmax", xs, t, out=t, axis=-1)
        return
    _masked_softmax(g, xs[0], xs[1], layer.factor, t, t)


def _masked_softmax(g, x: str, mask: str, factor: float, out: str | None, t: str) -> str:
    """softmax(x*factor - (1 - mask)*10000) over the last dim, +1e-6 in the sum (kernels/softmax.py)."""
    z = g.op("Mul", [x, g.const(factor, f"{t}/factor")], f"{t}/scaled")
    off = g.op(
        "Mul",
        [
            g.op("Sub", [g.const(1.0, f"{t}/one"), mask], f"{t}/masked_out"),
            g.const(softmax_k.MASK_PENALTY, f"{t}/penalty"),
        ],
        f"{t}/penalty",
    )
    z = g.op("Sub", [z, off], f"{t}/logits")
    e = g.op("Exp", [g.op("Sub", [z, _reduce(g, "ReduceMax", z, -1, True, f"{t}/max")], f"{t}/shifted")], f"{t}/exp")
    den = g.op(
        "Add", [_reduce(g, "ReduceSum", e, -1, True, f"{t}/sum"), g.const(softmax_k.MASKED_EPS, f"{t}/eps")], f"{t}/den"
    )
    return g.op("Div", [e, den], t, out=out)


def matrix_multiply(g, layer, xs, ws, tops):
    a, b = layer.in_shapes
    t = tops[0]
    if (len(a), len(b)) == (2, 3):  # (m, n) x (n, g, h): the rhs as (n, g*h)
        y = g.op("MatMul", [xs[0], g.op("Flatten", [xs[1]], f"{t}/rhs", axis=1)], f"{t}/mm")
        _reshape(g, y, b[1:], t, t)
    else:
        g.op("MatMul", xs, t, out=t)


def _heads(g, x: str, length: int, heads: int, d: int, out: str | None, hint: str) -> str:
    """(B, L, H*d) -> (B, H, L, d)."""
    x4 = _reshape(g, x, [length, heads, d], None, f"{hint}/4d")
    return g.op("Transpose", [x4], hint, out=out, perm=[0, 2, 1, 3])


def multi_head_attention(g, layer, xs, ws, tops):
    t = tops[0]
    if layer.mode == "attention":  # v23.12: Q (B, Lf, H*d), K, V (B, Lt, H*d)[, mask] -> (B, Lf, H*d)
        lf, lt = layer.in_shapes[0][1], layer.in_shapes[1][1]
        q, k, v = (
            _heads(g, x, n, layer.heads, layer.d, None, f"{t}/{c}") for x, n, c in zip(xs[:3], (lf, lt, lt), "qkv")
        )
        kt = g.op("Transpose", [k], f"{t}/kT", perm=[0, 1, 3, 2])
        s = g.op(
            "Mul", [g.op("MatMul", [q, kt], f"{t}/qkT"), g.const(1.0 / math.sqrt(layer.d), f"{t}/scale")], f"{t}/scores"
        )
        p = (
            _masked_softmax(g, s, xs[3], 1.0, None, f"{t}/softmax")
            if layer.masked
            else g.op("Softmax", [s], f"{t}/softmax", axis=-1)
        )
        xs = [p, v]
    if layer.mode in ("sv", "attention"):  # scores (B, H, Lf, Lt) x V (B, H, Lt, d) -> (B, Lf, H*d)
        o = g.op("MatMul", xs, f"{t}/heads")
        merged = g.op("Transpose", [o], f"{t}/merge", perm=[0, 2, 1, 3])
        _reshape(g, merged, [layer.out_shapes[0][1], layer.heads * layer.d], t, t)
        return
    if layer.mode == "qkv":  # Q, K, V (B, L, H*d): split heads; V's heads are top 2
        length = layer.in_shapes[0][1]
        q, k = (_heads(g, x, length, layer.heads, layer.d, None, f"{t}/{n}") for x, n in zip(xs[:2], "qk"))
        _heads(g, xs[2], length, layer.heads, layer.d, tops[1], tops[1])
    else:  # qk: Q (B, H, Lf, d), K (B, H, Lt, d)
        q, k = xs
    kt = g.op("Transpose", [k], f"{t}/kT", perm=[0, 1, 3, 2])
    g.op("Mul", [g.op("MatMul", [q, kt], f"{t}/qkT"), g.const(1.0 / math.sqrt(layer.d), f"{t}/scale")], t, out=t)


# ---- normalization ---------------------------------------------------------------------------
def batch_norm(g, layer, xs, ws, tops):
    from numbactr.runtime import device

    t = tops[0]
    stats = [
        g.const(device.to_host(s), f"{t}/{n}") for s, n in ((layer.running_mean, "mean"), (layer.running_var, "var"))
    ]
    g.op(
        "BatchNormalization",
        [xs[0], g.const(ws[0], f"{t}/gamma"), g.const(ws[1], f"{t}/beta"), *stats],
        t,
        out=t,
        epsilon=layer.eps,
    )


def _centered(g, x: str, axis: int, hint: str) -> tuple[str, str]:
    """(x - mean, mean((x - mean)^2)) over ``axis``, kept: the references' two-pass variance."""
    d = g.op("Sub", [x, _reduce(g, "ReduceMean", x, axis, True, f"{hint}/mean")], f"{hint}/centered")
    return d, _reduce(g, "ReduceMean", g.op("Mul", [d, d], f"{hint}/sq"), axis, True, f"{hint}/var")


def layer_norm(g, layer, xs, ws, tops):
    t = tops[0]
    d, var = _centered(g, xs[0], -1, t)
    inv = g.op(
        "Reciprocal",
        [g.op("Sqrt", [g.op("Add", [var, g.const(layer.eps, f"{t}/eps")], f"{t}/ve")], f"{t}/std")],
        f"{t}/inv",
    )
    y = g.op("Mul", [g.op("Mul", [g.const(ws[0], f"{t}/gamma"), d], f"{t}/gd"), inv], f"{t}/scaled")
    g.op("Add", [y, g.const(ws[1], f"{t}/beta")], t, out=t)


def prelu_dice(g, layer, xs, ws, tops):
    t = tops[0]
    x2 = g.op("Flatten", xs, f"{t}/x2", axis=1)  # (B, F)
    d, var = _centered(g, x2, 0, t)
    ve = g.op("Add", [var, g.const(layer.eps, f"{t}/eps")], f"{t}/ve")
    tiny = g.const(dice_k.TINY, f"{t}/tiny")
    inv = g.op(
        "Where",
        [
            g.op("Less", [ve, tiny], f"{t}/degenerate"),
            g.const(0.0, f"{t}/zero"),
            g.op("Reciprocal", [g.op("Sqrt", [g.op("Max", [ve, tiny], f"{t}/vmax")], f"{t}/std")], f"{t}/recip"),
        ],
        f"{t}/inv",
    )
    p = g.op("Sigmoid", [g.op("Mul", [d, inv], f"{t}/norm")], f"{t}/p")
    gate = g.op(
        "Add",
        [
            g.const(layer.alpha, f"{t}/alpha"),
            g.op("Mul", [g.const(1.0 - layer.alpha, f"{t}/one_minus_alpha"), p], f"{t}/gp"),
        ],
        f"{t}/gate",
    )
    y = g.op("Mul", [x2, gate], f"{t}/y2")
    g.op("Reshape", [y, g.op("Shape", xs, f"{t}/shape")], t, out=t)


# ---- fully connected blocks ------------------------------------------------------------------
def mlp(g, layer, xs, ws, tops):
    x = xs[0]
    last = len(layer.dims) - 2
    for i in range(last + 1):
        out = tops[0] if i == last else g.fresh(f"{tops[0]}/fc{i}")
        _fc(g, x, ws[2 * i], ws[2 * i + 1] if layer.biases[i] else None, layer.acts[i] == Activation_t.Relu, out)
        x = out


def fused_inner_product(g, layer, xs, ws, tops):
    _fc(g, xs[0], ws[0], ws[1], layer.cfg.act_type == Activation_t.Relu, tops[0])
    if len(tops) == 4:  # Head/Body: tops 2, 3 are top 1; top 4 (1, N) zeros
        for top in tops[1:3]:
            g.op("Identity", [tops[0]], top, out=top)
        g.op("Identity", [g.const(np.zeros((1, layer.n)), f"{tops[3]}/zeros")], tops[3], out=tops[3])


def multi_cross(g, layer, xs, ws, tops):
    x0, t = xs[0], tops[0]
    x = x0
    per = 2 if layer.p == 0 else 3
    for i in range(layer.layers):
        out = t if i == layer.layers - 1 else g.fresh(f"{t}/x{i + 1}")
        h = f"{t}/l{i}"
        if layer.p == 0:  # x0 * (x_l . w_l) + x_l + b_l
            w, b = ws[per * i : per * i + 2]
            s = g.op("MatMul", [x, g.const(w.reshape(-1, 1), f"{h}/w")], f"{h}/xw")  # (B, 1)
            y = g.op("Add", [g.op("Mul", [x0, s], f"{h}/x0s"), x], f"{h}/sum")
            g.op("Add", [y, g.const(b.reshape(-1), f"{h}/b")], h, out=out)
        else:  # x0 * (x_l U V + b_l) + x_l
            u, v, b = ws[per * i : per * i + 3]
            z = g.op("MatMul", [g.op("MatMul", [x, g.const(u, f"{h}/U")], f"{h}/xu"), g.const(v, f"{h}/V")], f"{h}/z")
            zb = g.op("Add", [z, g.const(b.reshape(-1), f"{h}/b")], f"{h}/zb")
            g.op("Add", [g.op("Mul", [x0, zb], f"{h}/x0z"), x], h, out=out)
        x = out


def gru(g, layer, xs, ws, tops):
    from numbactr.layers.recurrent import split_gru_weights

    t = tops[0]
    hid, steps, vec = layer.h, layer.steps, layer.vec
    w, u, b = split_gru_weights(ws[0], hid, vec)  # gates r, z, n; ONNX orders them z, r, n

    def zrn(a):
        return np.concatenate([a[hid : 2 * hid], a[:hid], a[2 * hid :]])

    args = [
        g.const(zrn(w)[None], f"{t}/W"),
        g.const(zrn(u)[None], f"{t}/R"),
        g.const(np.concatenate([zrn(b), np.zeros(3 * hid, np.float32)])[None], f"{t}/B"),
    ]
    if hugectr_exact.hugectr_exact():  # cuDNN's seq-major buffer [T][B][V], h0 = 0
        x = g.op("Reshape", [xs[0], g.ints([steps, -1, vec], f"{t}/shape")], f"{t}/x")
        y = g.op("GRU", [x, *args], f"{t}/y", hidden_size=hid, linear_before_reset=1)  # (T, 1, B, H)
    else:  # batch-major [B][T][V], h0 = the first B rows of hx
        xb = g.op("Reshape", [xs[0], g.ints([-1, steps, vec], f"{t}/shape")], f"{t}/xb")
        rows = g.op("Shape", [xb], f"{t}/rows", start=0, end=1)
        hx = g.const(ws[1].reshape(-1, hid), f"{t}/hx")  # (B_cfg, H)
        h0 = g.op("Slice", [hx, g.ints([0], f"{t}/h0_start"), rows], f"{t}/h0_rows")
        h0 = g.op("Unsqueeze", [h0, g.ints([0], f"{t}/h0_ax")], f"{t}/h0")  # (1, B, H)
        # onnxruntime runs only the seq-major layout: (B, T, V) -> (T, B, V), and the steps back after
        x = g.op("Transpose", [xb], f"{t}/x", perm=[1, 0, 2])
        y = g.op("GRU", [x, *args, "", h0], f"{t}/y_seq", hidden_size=hid, linear_before_reset=1)  # (T, 1, B, H)
        y = g.op("Transpose", [y], f"{t}/y", perm=[2, 0, 1, 3])  # (B, T, 1, H)
    _reshape(g, y, layer.out_shapes[0][1:], t, t)


EMITTERS = {
    "InnerProduct": inner_product,
    "ReLU": relu,
    "ReLUHalf": relu,
    "Concat": concat,
    "Reshape": reshape,
    "Interaction": interaction,
    "Add": add,
    "Sub": sub,
    "ElementwiseMultiply": multiply,
    "ELU": elu,
    "Sigmoid": _unary("Sigmoid"),
    "Cast": _unary("Identity"),
    "Dropout": _unary("Identity"),
    "Scale": scale,
    "WeightMultiply": weight_multiply,
    "FmOrder2": fm_order2,
    "ReduceSum": reduce_axis,
    "ReduceMean": reduce_axis,
    "Slice": slice_,
    "Select": select,
    "Gather": gather,
    "FusedReshapeConcat": fused_reshape_concat,
    "FusedReshapeConcatGeneral": fused_reshape_concat,
    "SequenceMask": sequence_mask,
    "Softmax": softmax,
    "MatrixMultiply": matrix_multiply,
    "MultiHeadAttention": multi_head_attention,
    "BatchNorm": batch_norm,
    "LayerNorm": layer_norm,
    "PReLU_Dice": prelu_dice,
    "MLP": mlp,
    "FusedInnerProduct": fused_inner_product,
    "MultiCross": multi_cross,
    "GRU": gru,
}

# loss layer -> the activation HugeCTR's inference puts in its place (spec §7.5)
PREDICTIONS = {
    "BinaryCrossEntropyLoss": ("Sigmoid", {}),
    "MultiCrossEntropyLoss": ("Sigmoid", {}),
    "CrossEntropyLoss": ("Softmax", {"axis": -1}),
}
