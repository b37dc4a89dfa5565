"""Fusions of the planned step: an InnerProduct's Linear followed by its ReLU becomes one FcBiasAct.

Which pairs: the recorded plans of the zoo (W&D, DCN, DCNv2, DeepFM, DLRM, NCF, GMF, NeuMF, MMoE, DIN, BST at
batch 64) hold 50 Linear and 28 ReLU calls; a Linear whose only reader is the ReLU right after it is the
commonest adjacent pair by far (28 of them; next: a ReLU read by a Linear, 20, which a kernel cannot fuse
past the GEMM, then a lookup read by a Reshape, 11, a view). So the rewrite is that one: the pair becomes the
op HugeCTR's FusedInnerProduct and MLP layers run, FcBiasAct, whose compiled epilogue adds the bias and
applies the ReLU in one pass over the GEMM's output, and whose backward masks the gradient and sums the
bias gradient in one pass (kernels/fused_bias_act.py). That is what the gpu and sim devices already do at
the layer level (numbactr.train.graph.fuse_bias_relu); here the cpu's planned step gets it too.

Same bits: the GEMMs are the same calls on the same arrays (the Linear's input is 2-D and contiguous, so
FcBiasAct's ``contig`` makes no copy); ``max(y + b, 0)`` is computed as the two passes compute it (a NaN
stays NaN, -0.0 stays -0.0); the backward's mask reads the ReLU's output as the ReLU's backward does, and
its column sums add the rows in the same chunks in the same order as the bias gradient's pass
(kernels/bias.py). tests/test_step_plan_buffers.py compares the two on every zoo model.

The pre-activation top is then not kept: ``Model.check_out_tensor`` says so (the model's fused tops, as on
a gpu), and NUMBACTR_FUSE_BIAS_RELU=0 keeps it (and the two ops).
"""

from __future__ import annotations

import os

from numbactr.ops.dense import FcBiasAct, Linear
from numbactr.ops.elementwise import ReLU


def wanted() -> bool:
    """NUMBACTR_FUSE_BIAS_RELU (default 1), the switch of the layer-level fusion, turns this one on or off."""
    flag = os.environ.get("NUMBACTR_FUSE_BIAS_RELU", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"NUMBACTR_FUSE_BIAS_RELU must be 0 or 1, got {flag!r}")
    return flag == "1"


def fuse_linear_relu(ops_: list, arrays: dict, readers: dict, keep: set) -> tuple:
    """(ops, {fused pre-activation slot: ReLU slot}): each Linear whose output only the next op, a ReLU,
    reads (and that no one else needs: ``keep``, the losses' slots) becomes one FcBiasAct(relu=True).
    ``arrays``: the traced arrays by slot (the Linear's input must be 2-D and C-contiguous);
    ``readers``: {slot: how many op inputs read it}."""
    out, fused, k = [], {}, 0
    while k < len(ops_):
        op = ops_[k]
        nxt = ops_[k + 1] if k + 1 < len(ops_) else None
        if (
            op.fn is Linear
            and nxt is not None
            and nxt.fn is ReLU
            and nxt.ins == op.outs
            and readers.get(op.outs[0]) == 1
            and op.outs[0] not in keep
            and not op.params
            and nxt.fresh is None
            and op.fresh is None
            and len(op.ins) == 3
        ):
            x = arrays.get(op.ins[0])
            if x is not None and x.ndim == 2 and x.flags.c_contiguous:
                out.append(
                    type(op)(FcBiasAct, op.ins, nxt.outs, {"relu": True}, op.needs, op.owner, False, None, op.grad_into)
                )
                fused[op.outs[0]] = nxt.outs[0]
                k += 2
                continue
        out.append(op)
        k += 1
    return out, fused
