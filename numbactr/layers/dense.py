"""Fully connected blocks: MLP, FusedInnerProduct, MultiCross (spec §6.2): shapes, parameters, HugeCTR's
configuration.

Contract: each layer checks its config and bottoms, declares its tops and weights, and runs ops of
numbactr.ops.dense: MLP and FusedInnerProduct chain FcBiasAct, y = act(x W + b); MultiCross runs
MultiCrossV1 (x_{l+1} = x0 (x_l · w_l) + x_l + b_l) or MultiCrossV2 (x_{l+1} = x0 (x_l U_l V_l + b_l) + x_l).

Why FcBiasAct (not Linear then ReLU): the bias add and ReLU after each matmul are ONE fused epilogue
kernel, and the backward's ReLU mask and bias gradient another (numbactr.kernels.fused_bias_act).
"""

from __future__ import annotations

import numpy as np

from numbactr import hugectr_exact
from numbactr.autograd import Tensor
from numbactr.enums import Activation_t, FcPosition_t, Initializer_t, Layer_t
from numbactr.layers import init
from numbactr.layers.base import Layer, op_fn
from numbactr.ops.dense import FcBiasAct, MultiCrossV1, MultiCrossV2
from numbactr.runtime.device import xp as _xp


# ---- helpers ---------------------------------------------------------------------------------
def _act_name(act) -> str:
    return "Relu" if act == Activation_t.Relu else "None"


def _is_pos_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0


# ---- Layers ----------------------------------------------------------------------------------
class MLP(Layer):
    """(B, K) -> (B, num_outputs[-1]): a chain of act(X·W_i + b_i).

    Weights per sub-layer i: W_i (in_i, out_i), b_i (out_i,), ALWAYS both (HugeCTR allocates the bias
    even when that sub-layer has no bias; it then stays at its initial value, gradient 0).
    activations (per sub-layer) overrides act_type (all sub-layers); biases overrides use_bias.
    A second bottom (HugeCTR's mixed-precision form: the two-top Interaction's gradient buffer) is
    accepted and not read: it is the same tensor as the first (layers.core.Interaction), and the
    gradient flows through the first bottom."""

    type_name = "MLP"

    def infer(self):
        c = self.cfg
        self.expect_counts((1, 2))
        shape = self.in_shapes[0]
        if len(self.in_shapes) == 2 and self.in_shapes[1] != shape:
            self.fail(
                f"the second bottom {c.bottom_names[1]!r} {self.in_shapes[1]} must have the first's "
                f"shape {shape} (it is the two-top Interaction's gradient buffer)"
            )
        if len(shape) != 2:
            self.fail(f"input {c.bottom_names[0]!r} must be 2-D (B, K), got shape {shape}")
        outs = list(c.num_outputs)
        if not outs or not all(_is_pos_int(n) for n in outs):
            self.fail(f"num_outputs must be a non-empty list of positive ints, got {c.num_outputs!r}")
        n = len(outs)
        acts = list(c.activations) if c.activations else [c.act_type] * n
        if len(acts) != n:
            self.fail(
                f"activations has {len(acts)} entries for {n} layers (num_outputs {outs}); the "
                "number of activations should be equal to the number of layers"
            )
        if not all(a in (Activation_t.Relu, Activation_t.Non) for a in acts):
            self.fail(f"activations must be Activation_t.Relu or Activation_t.Non, got {acts!r}")
        biases = [bool(b) for b in c.biases] if c.biases else [bool(c.use_bias)] * n
        if len(biases) != n:
            self.fail(
                f"biases has {len(biases)} entries for {n} layers (num_outputs {outs}); the number "
                "of biases should be equal to the number of layers"
            )
        self.dims = [shape[1]] + outs
        self.acts, self.biases = acts, biases
        return [(shape[0], outs[-1])]

    def param_shapes(self):
        shapes = []
        for i in range(len(self.dims) - 1):
            shapes += [(self.dims[i], self.dims[i + 1]), (self.dims[i + 1],)]
        return shapes

    def init_params(self, rng):
        # Default = Uniform = U(+-sqrt(1/fan_in)) for kernel and bias (numbactr.layers.init.mlp_param;
        # its Xavier fan mode follows HugeCTR's sub-layer-parity quirk under hugectr_exact.hugectr_exact())
        out, exact = [], hugectr_exact.hugectr_exact()
        for i in range(len(self.dims) - 1):
            k, n = self.dims[i], self.dims[i + 1]
            out.append(
                init.mlp_param(
                    rng, (k, n), self.cfg.weight_init_type, k, n, sub_layer=i, is_bias=False, hugectr_exact=exact
                )
            )
            out.append(
                init.mlp_param(rng, (n,), self.cfg.bias_init_type, k, n, sub_layer=i, is_bias=True, hugectr_exact=exact)
            )
        return out

    def forward(self, tape, xs, run):
        x = xs[0]
        last = len(self.dims) - 2
        for i in range(last + 1):
            w, b = self.params[2 * i], self.params[2 * i + 1]
            ins = (x, w, b) if self.biases[i] else (x, w)
            name = self.cfg.top_names[0] if i == last else f"{self.cfg.top_names[0]}.fc{i}"
            x = FcBiasAct.apply(tape, *ins, relu=self.acts[i] == Activation_t.Relu, name=name)
        return [x]

    def json_params(self):
        c = self.cfg
        p = {"num_output": c.num_output, "num_outputs": [int(n) for n in c.num_outputs]}
        if c.biases:
            p["biases"] = [bool(b) for b in c.biases]
        else:
            p["use_bias"] = bool(c.use_bias)
        if c.activations:
            p["activations"] = [_act_name(a) for a in c.activations]
        else:
            p["activation"] = _act_name(c.act_type)
        if c.weight_init_type != Initializer_t.Default:
            p["weight_init"] = c.weight_init_type.name
        if c.bias_init_type != Initializer_t.Default:
            p["bias_init"] = c.bias_init_type.name
        return {"mlp_param": p}


_FC_POS = {
    FcPosition_t.Non: "None",
    FcPosition_t.Head: "Head",
    FcPosition_t.Body: "Body",
    FcPosition_t.Tail: "Tail",
    FcPosition_t.Isolated: "Isolated",
}


class FusedInnerProduct(Layer):
    """Y = act(X·W + b), (B, K) -> (B, num_output); W (K, N), b (N,) as InnerProduct.

    HugeCTR builds this layer only in mixed precision ("FusedInnerProduct support half only");
    numbactr builds it in both modes with the same math (the fused bias+ReLU kernel; in mixed precision
    half-precision storage around float32 math, numbactr/runtime/precision.py). Bottom/top
    counts follow HugeCTR: None/Isolated 1 -> 1; Head 1 (or 2) -> 4; Body 4 -> 4; Tail 4 -> 1;
    act_type Non only at Tail. Of a Head/Body's 4 tops only the first carries data: tops 2 and 3
    (out_mask, out_dRelu: HugeCTR's fused-backward buffers) are the SAME tensor as top 1, and top 4
    (out_db, (1, N)) is zeros; a Head's second bottom and a Body/Tail's bottoms 2-4 are not read, so
    every gradient flows through bottom 1 / top 1 and a GroupFusedInnerProduct-style chain trains
    like the equivalent chain of InnerProduct+ReLU."""

    type_name = "FusedInnerProduct"

    def infer(self):
        c = self.cfg
        pos, act = c.pos_type, c.act_type
        if pos not in _FC_POS:
            self.fail(f"pos_type must be an FcPosition_t, got {pos!r}")
        if act not in (Activation_t.Relu, Activation_t.Non):
            self.fail(f"act_type must be Activation_t.Relu or Activation_t.Non, got {act!r}")
        nb, nt = len(c.bottom_names), len(c.top_names)
        ok = {
            FcPosition_t.Non: ((1,), 1),
            FcPosition_t.Isolated: ((1,), 1),
            FcPosition_t.Head: ((1, 2), 4),
            FcPosition_t.Body: ((4,), 4),
            FcPosition_t.Tail: ((4,), 1),
        }[pos]
        if nb not in ok[0] or nt != ok[1]:
            self.fail(
                f"pos_type {_FC_POS[pos]} needs {' or '.join(map(str, ok[0]))} bottom(s) and {ok[1]} "
                f"top(s), got {nb} and {nt}: the position and dimension of bottom and top layer "
                "aren't compatible"
            )
        if act == Activation_t.Non and pos != FcPosition_t.Tail:
            self.fail(
                "act_type Non is allowed only at pos_type Tail (the layer without activation "
                "function must be the last layer in MLP)"
            )
        shape = self.in_shapes[0]
        if len(shape) != 2:
            self.fail(f"input {c.bottom_names[0]!r} must be 2-D (B, K), got shape {shape}")
        if not _is_pos_int(c.num_output):
            self.fail(f"num_output must be a positive int, got {c.num_output!r}")
        self.k, self.n, self.b = shape[1], int(c.num_output), shape[0]
        out = (shape[0], self.n)
        return [out, out, out, (1, self.n)] if nt == 4 else [out]

    def param_shapes(self):
        return [(self.k, self.n), (self.n,)]

    def init_params(self, rng):
        return [
            init.inner_product_weight(rng, self.k, self.n, self.cfg.weight_init_type),
            init.inner_product_bias(rng, self.n, self.cfg.bias_init_type),
        ]

    def forward(self, tape, xs, run):
        y = FcBiasAct.apply(
            tape, xs[0], *self.params, relu=self.cfg.act_type == Activation_t.Relu, name=self.cfg.top_names[0]
        )
        if len(self.cfg.top_names) == 1:
            return [y]
        db = Tensor(_xp().zeros((1, self.n), np.float32), name=self.cfg.top_names[3])
        return [y, y, y, db]

    def inference_fn(self):
        if len(self.cfg.top_names) != 1:
            return None
        return op_fn(FcBiasAct, *self.params, relu=self.cfg.act_type == Activation_t.Relu)

    def json_params(self):
        c = self.cfg
        p = {"num_output": c.num_output}
        if c.weight_init_type != Initializer_t.Default:
            p["weight_init"] = c.weight_init_type.name
        if c.bias_init_type != Initializer_t.Default:
            p["bias_init"] = c.bias_init_type.name
        return {"position": _FC_POS[c.pos_type], "activation": _act_name(c.act_type), "fc_param": p}


class MultiCross(Layer):
    """DCN cross network, (B, D) -> (B, D) (spec §6.2).

    projection_dim = 0 (DCNv1): per layer w_l (1, D), b_l (1, D), file order [w0, b0, w1, b1, ...];
    x_{l+1} = x0 * (x_l · w_l) + x_l + b_l. projection_dim = P > 0 (DCNv2): per layer U_l (D, P),
    V_l (P, D), b_l (1, D), order [U0, V0, b0, ...]; x_{l+1} = x0 * (x_l U_l V_l + b_l) + x_l.
    Init (numbactr.layers.init: every Initializer_t but Zero maps to Default, as HugeCTR): v1 w ~
    N(0, sqrt(1/D)); v2 U ~ N(0, sqrt(2/(D+P))), V ~ N(0, sqrt(2/(P+D))); biases 0."""

    type_name = "MultiCross"

    def infer(self):
        self.expect_counts(1)
        c = self.cfg
        (shape,) = self.in_shapes
        if len(shape) != 2:
            self.fail(f"input {c.bottom_names[0]!r} must be 2-D (B, D), got shape {shape}")
        if not _is_pos_int(c.num_layers):
            self.fail(f"num_layers must be a positive int, got {c.num_layers!r}")
        p = c.projection_dim
        if not isinstance(p, (int, np.integer)) or isinstance(p, bool) or p < 0:
            self.fail(f"projection_dim must be an int >= 0 (0 = DCNv1), got {p!r}")
        self.d, self.layers, self.p = shape[1], int(c.num_layers), int(p)
        return [shape]

    def param_shapes(self):
        d, p = self.d, self.p
        per = [(1, d), (1, d)] if p == 0 else [(d, p), (p, d), (1, d)]
        return per * self.layers

    def init_params(self, rng):
        d, p = self.d, self.p
        wk, bk = self.cfg.weight_init_type, self.cfg.bias_init_type
        out = []
        for _ in range(self.layers):
            if p == 0:
                out += [init.multicross_kernel(rng, (1, d), wk, d), init.multicross_bias(rng, (1, d), bk)]
            else:
                out += [
                    init.multicross_kernel(rng, (d, p), wk, d, p),
                    init.multicross_kernel(rng, (p, d), wk, d, p),
                    init.multicross_bias(rng, (1, d), bk),
                ]
        return out

    def forward(self, tape, xs, run):
        fn = MultiCrossV1 if self.p == 0 else MultiCrossV2
        return [fn.apply(tape, xs[0], *self.params, name=self.cfg.top_names[0])]

    def inference_fn(self):
        return op_fn(MultiCrossV1 if self.p == 0 else MultiCrossV2, *self.params)

    def json_params(self):
        c = self.cfg
        p = {"num_layers": c.num_layers}
        if c.weight_init_type != Initializer_t.Default:
            p["weight_init"] = c.weight_init_type.name
        if c.bias_init_type != Initializer_t.Default:
            p["bias_init"] = c.bias_init_type.name
        if self.p > 0:
            p["projection_dim"] = self.p  # HugeCTR drops it (spec §10.16); an extra key here
        return {"mc_param": p}


LAYERS = {
    Layer_t.MLP: MLP,
    Layer_t.FusedInnerProduct: FusedInnerProduct,
    Layer_t.MultiCross: MultiCross,
}
