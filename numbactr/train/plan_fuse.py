"""Fusions of the planned step: two adjacent ops rewritten into one op that does both in one pass.

Which pairs: the recorded plans of the zoo (W&D, DCN, DCNv2, DeepFM, DLRM, NCF, GMF, NeuMF, MMoE, DIN, BST at
batch 64) hold 50 Linear and 28 ReLU calls. Counting each op with the op that alone reads its output, the
commonest pairs are a Linear into its ReLU (28), a ReLU into a Linear (20: not fusable past a GEMM), a lookup
into a Reshape (11: a view, no pass to save), a Scale into a Multiply (9: MMoE's gates) and a Multiply into an
Add (8). Four rewrites:

* Linear then ReLU becomes FcBiasAct(relu=True), the op HugeCTR's FusedInnerProduct and MLP layers run: its
  compiled epilogue adds the bias and applies the ReLU in one pass over the GEMM's output, and its backward
  masks the gradient and sums the bias gradient in one pass (kernels/fused_bias_act.py). The gpu and sim
  devices already do this at the layer level (numbactr.train.graph.fuse_bias_relu); here the cpu's planned
  step gets it too (on cpu only: there the ReLU keeps a NaN as the fused pass does, where the gpu's ReLU
  kernel makes it 0, so on gpu and sim the two would differ on a NaN). Same bits: the GEMMs are the same calls on the same arrays (the Linear's input is 2-D
  and contiguous, so FcBiasAct's ``contig`` copies nothing); max(y + b, 0) is computed as the two passes
  compute it (a NaN stays NaN, -0.0 stays -0.0); the mask reads the ReLU's output as the ReLU's backward
  does, and the column sums add the rows in the same chunks and order as kernels/bias.py's.
* Scale (axis 0) then the two-input Multiply that reads it becomes ScaleMultiplyFn (numbactr.ops.fused,
  kernels/scale_multiply.py): the repeated array is never made, one launch each way instead of two. Same
  bits: each element is the same one float32 product, in the Multiply's input order, and the gate's
  gradient is the Scale's own backward. On the kernel devices only: on the cpu it measured no faster than
  NumPy's two vectorized passes (kernels/scale_multiply.py).

* a Slice whose ranges tile its input's last dim in order, read only by the Concat of all its pieces in
  order (NCF: the user and item vectors cut apart and joined again), becomes WholeSliceFn
  (numbactr.ops.fused): the Concat's output is the Slice's input, handed on; the backward is one pass
  0 + dy, the Slice's own arithmetic. On every device (it is NumPy's or CuPy's add).
* DIN's activation-unit input: a Scale that repeats the target over the history (axis 1), the Sub and the
  Multiply of the repeat and the history, and the Concat of the four, four ops in a row, become one
  ActivationUnitInputFn (numbactr.ops.fused, kernels/activation_unit.py): the repeat, the difference and the
  product are never made, one compiled pass each way (DIN at batch 4096, one thread: 75 -> 60 ms a step).
  Same bits: the same float32 operations in the same order; the history's gradient, which its later
  readers have already added to, is handed to the fused op, which adds its three terms after them as the
  three layers did (``accumulates``, numbactr.train.plan). On the cpu only (no CUDA kernel).

A fused op's first output is not kept: ``Model.check_out_tensor`` says so (the model's fused tops, as on a
gpu). NUMBACTR_PLAN_FUSE=0 turns the planned step's fusions off; NUMBACTR_FUSE_BIAS_RELU=0 the first (as it
turns off the layer-level one). tests/test_step_plan_buffers.py compares each fused op with its pair.
"""

from __future__ import annotations

import os

from numbactr.ops.dense import FcBiasAct, Linear
from numbactr.ops.dispatch import kernels
from numbactr.ops.elementwise import MultiplyFn, ReLU, ScaleFn, SubFn
from numbactr.ops.fused import ActivationUnitInputFn, ScaleMultiplyFn, WholeSliceFn
from numbactr.ops.shape import Concat, SliceFn


def _flag(name: str) -> bool:
    flag = os.environ.get(name, "1")
    if flag not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {flag!r}")
    return flag == "1"


def switches() -> tuple:
    """(NUMBACTR_PLAN_FUSE, NUMBACTR_FUSE_BIAS_RELU), each 1 (the default) or 0."""
    return _flag("NUMBACTR_PLAN_FUSE"), _flag("NUMBACTR_FUSE_BIAS_RELU")


def fuse(ops_: list, arrays: dict, readers: dict, keep: set) -> tuple:
    """(ops, {slot no longer made: slot of the fused op's output}) after the rewrites the switches allow.
    ``arrays``: the traced input arrays by slot; ``readers``: {slot: how many op inputs read it}; ``keep``:
    slots that must stay (the losses)."""
    plan_fuse, bias_relu = switches()
    gone: dict = {}
    if not plan_fuse:
        return ops_, gone
    out, k = [], 0
    while k < len(ops_):
        unit = None if kernels() else _activation_unit(ops_[k : k + 4], arrays, readers, keep)
        if unit is not None:
            out.append(unit)
            for op in ops_[k : k + 3]:
                gone[op.outs[0]] = unit.outs[0]
            k += 4
            continue
        whole = _whole_slice(ops_[k : k + 2], arrays, readers, keep)
        if whole is not None:
            out.append(whole)
            for s in ops_[k].outs:
                gone[s] = whole.outs[0]
            k += 2
            continue
        op, nxt = ops_[k], (ops_[k + 1] if k + 1 < len(ops_) else None)
        sole = nxt is not None and readers.get(op.outs[0]) == 1 and op.outs[0] not in keep and len(op.outs) == 1
        sole = sole and op.fresh is None and nxt.fresh is None
        fused = None
        if sole and bias_relu and not kernels() and op.fn is Linear and nxt.fn is ReLU:
            fused = _linear_relu(op, nxt, arrays)
        elif sole and kernels() and op.fn is ScaleFn and nxt.fn is MultiplyFn:
            fused = _scale_multiply(op, nxt, arrays)
        if fused is None:
            out.append(op)
            k += 1
            continue
        out.append(fused)
        gone[op.outs[0]] = nxt.outs[0]
        k += 2
    return out, gone


def _plain(a) -> bool:
    return a is not None and a.ndim == 2 and a.flags.c_contiguous and a.dtype.name == "float32"


def _linear_relu(lin, relu, arrays):
    """FcBiasAct(x, w, b, relu=True) for a Linear on a 2-D contiguous input read only by the ReLU after it."""
    if relu.ins != lin.outs or lin.params or len(lin.ins) != 3 or not _plain(arrays.get(lin.ins[0])):
        return None
    return type(lin)(FcBiasAct, lin.ins, relu.outs, {"relu": True}, lin.needs, lin.owner, False)


def _scale_multiply(sc, mul, arrays):
    """ScaleMultiplyFn(g, x) for a Scale along axis 0 read only by the two-input Multiply after it."""
    p = sc.params
    if p.get("axis", 0) != 0 or p.get("first_only", False) or mul.params.get("exact", False) or len(mul.ins) != 2:
        return None
    if mul.ins.count(sc.outs[0]) != 1 or not _plain(arrays.get(sc.ins[0])):
        return None
    at = mul.ins.index(sc.outs[0])
    other = mul.ins[1 - at]
    if not _plain(arrays.get(other)):
        return None
    params = {"factor": p.get("factor", 1), "g_first": at == 0}
    needs = (sc.needs[0], mul.needs[1 - at])
    return type(sc)(ScaleMultiplyFn, (sc.ins[0], other), mul.outs, params, needs, mul.owner, False)


def _activation_unit(four, arrays, readers, keep):
    """ActivationUnitInputFn(x, h) for DIN's four ops in a row: r = Scale(x, axis 1, f), Sub(r, h),
    Multiply(r, h), Concat(r, h, r - h, r * h) on axis 1, where only these ops read r, the difference and the
    product, every input gradient is wanted, and x (B, N), h (B*f, N) are 2-D float32."""
    if len(four) < 4:
        return None
    sc, sub, mul, cat = four
    if (sc.fn, sub.fn, mul.fn, cat.fn) != (ScaleFn, SubFn, MultiplyFn, Concat):
        return None
    if any(op.fresh is not None or not all(op.needs) for op in four):
        return None
    p = sc.params
    if p.get("axis", 0) != 1 or p.get("first_only", False) or mul.params.get("exact", False):
        return None
    (r,) = sc.outs
    h = sub.ins[1] if len(sub.ins) == 2 else None
    if sub.ins != (r, h) or mul.ins != (r, h) or cat.ins != (r, h, sub.outs[0], mul.outs[0]):
        return None
    if cat.params.get("axis", 1) != 1 or readers.get(r) != 3 or {r, sub.outs[0], mul.outs[0]} & keep:
        return None
    if readers.get(sub.outs[0]) != 1 or readers.get(mul.outs[0]) != 1:
        return None
    x, hv, f = arrays.get(sc.ins[0]), arrays.get(h), p.get("factor", 1)
    if not (_plain(x) and _plain(hv)) or hv.shape != (x.shape[0] * f, x.shape[1]):
        return None
    return type(sc)(ActivationUnitInputFn, (sc.ins[0], h), cat.outs, {"factor": f}, (True, True), cat.owner, False)


def _whole_slice(two, arrays, readers, keep):
    """WholeSliceFn(x) for a Slice whose ranges tile x's last dim in order, read only by the Concat after it
    of all its pieces in order (on the last dim)."""
    if len(two) < 2 or (two[0].fn, two[1].fn) != (SliceFn, Concat):
        return None
    sl, cat = two
    x = arrays.get(sl.ins[0])
    ranges = sl.params.get("ranges", ())
    if x is None or x.ndim != 2 or cat.params.get("axis", 1) != 1 or cat.ins != sl.outs:
        return None
    if sl.fresh is not None or cat.fresh is not None or set(sl.outs) & keep:
        return None
    if any(readers.get(s) != 1 for s in sl.outs) or not ranges:
        return None
    edges = [0, *(e for r in ranges for e in r), x.shape[1]]
    if any(a != b for a, b in zip(edges[::2], edges[1::2])):  # each range starts where the last one ended
        return None
    return type(sl)(WholeSliceFn, sl.ins, cat.outs, {}, sl.needs, cat.owner, False)
