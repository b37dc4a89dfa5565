"""The planned step's buffers: every output of the ops that can write into a given array, allocated once and
reused step after step; the backward's activation gradients share buffers where their values are dead.

Which ops: those whose Function says ``writes_into = True`` (numbactr.ops: Linear, FcBiasAct, ReLU, Concat, Slice, Add,
Multiply, Scale, Interaction, ScaleMultiply). Such an op
writes forward output ``i`` into ``ctx.out[i]`` and the gradient of input ``j`` into ``ctx.grad_into[j]``
when it is given one, and returns that very array (numbactr.ops.buffers); the arithmetic is the same, so the
bits are too.

Forward outputs get one buffer each, never shared within a step: an activation is read again by the backward
(the ops keep their inputs and outputs in their Context) and after the step (``Model.check_out_tensor`` reads
the last step's tensors). Step ``t + 1`` writes over step ``t``'s values, as HugeCTR's layers do.

Activation gradients are another matter: each is needed from the backward that writes it to the backward that
reads it, and a chain of N layers needs two or three gradient arrays, not N. The first planned step (the
"sizing" step) runs with no buffers and watches every gradient array: which op wrote it (a candidate: an op
that can write into a given one, for an input that is not a weight), and when each candidate's memory is last
read, through the arrays that alias it too (a Reshape's or a Concat's backward hands on a view of the
gradient it got; an Add hands the same array to both inputs). The gradient an embedding's lookup receives
is kept by the embedding for its update after the backward, so it is live to the end. Then ``assign`` gives
the candidates buffers by their live intervals: a buffer is shared by values of one shape and dtype whose
intervals do not overlap, a value written at backward step t taking only a buffer last read before t (an op
never writes the array it reads).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from numbactr.layers.base import Layer
from numbactr.ops.embedding_bag import LookupFn
from numbactr.runtime import device

#: the time of "after the backward" (the flat gradient copy, the embeddings' updates)
END = 1 << 30


@dataclass
class Value:
    """A candidate gradient of the sizing step: written at backward step ``born``, its memory last read at
    ``dies`` (END: after the backward); ``op`` (index in the plan) wrote it for input ``pos``."""

    op: int
    pos: int
    shape: tuple
    dtype: object
    born: int
    dies: int


def root(a):
    """The array that owns ``a``'s memory (``a`` itself unless it is a view)."""
    while getattr(a, "base", None) is not None and hasattr(a.base, "shape"):
        a = a.base
    return a


def assign(values: list) -> list:
    """A buffer number for each Value: values of one shape and dtype share a buffer when the earlier one's
    memory is dead (``dies < born``) before the later one is written. Greedy by birth (interval colouring):
    as few buffers as the most values alive at once of each shape."""
    order = sorted(range(len(values)), key=lambda i: (values[i].born, i))
    free_at: list = []  # buffer -> (shape, dtype, last read time)
    out = [0] * len(values)
    for i in order:
        v = values[i]
        pick = None
        for b, (shape, dtype, dies) in enumerate(free_at):
            if shape == v.shape and dtype == v.dtype and dies < v.born:
                pick = b
                break
        if pick is None:
            free_at.append(None)
            pick = len(free_at) - 1
        free_at[pick] = (v.shape, v.dtype, v.dies)
        out[i] = pick
    return out


class Sizing:
    """What the sizing step sees of its backward (``StepPlan.run`` calls it): every candidate gradient and
    every read of gradient memory, by owner array."""

    def __init__(self):
        self.values: list = []
        self.by_root: dict = {}  # id(root array) -> Value index (the arrays are kept: ids stay unique)
        self.keep: list = []

    def read(self, arrays, t: int) -> None:
        """``arrays`` (gradients, or None) are read at backward step ``t``: their memory lives to then."""
        for a in arrays:
            if a is None:
                continue
            i = self.by_root.get(id(root(a)))
            if i is not None and self.values[i].dies < t:
                self.values[i].dies = t

    def wrote(self, k: int, op, in_grads, t: int) -> None:
        """Op ``k``'s backward (at step ``t``) returned ``in_grads``: note its candidates."""
        writes = getattr(op.fn, "writes_into", False)
        for pos, g in enumerate(in_grads):
            if g is None:
                continue
            r = root(g)
            if id(r) in self.by_root:  # a view of a gradient it was given: read on by whoever reads this
                continue
            if writes and pos not in op.grad_into and op.needs[pos] and r.flags.c_contiguous and r.size == g.size:
                self.by_root[id(r)] = len(self.values)
                self.values.append(Value(k, pos, tuple(g.shape), g.dtype, t, t))
                self.keep.append(r)

    @staticmethod
    def held_by(op) -> bool:
        """Whether ``op`` may keep the gradients it is given past its backward (an embedding's lookup, or any
        op a layer did not call)."""
        return op.fn is LookupFn or not isinstance(op.owner, Layer)

    def finish(self, plan) -> None:
        """Give the plan its buffers: one per forward output of a ``writes_into`` op (shapes as this step's
        values), and the shared gradient buffers (``assign``)."""
        xp = device.xp()
        numbers = assign(self.values)
        shared: dict = {}
        for v, n in zip(self.values, numbers):
            if n not in shared:
                shared[n] = xp.empty(v.shape, v.dtype)
            plan.ops[v.op].grad_bufs[v.pos] = shared[n]
        plan.grad_buffers = len(shared)


def forward_buffers(plan, vals: list) -> None:
    """One buffer per output of each ``writes_into`` op, shaped as the sizing step's value (a C-contiguous
    float array of the op's own making)."""
    xp = device.xp()
    for op in plan.ops:
        if getattr(op.fn, "writes_into", False):
            outs = [vals[s] for s in op.outs]
            if all(o is not None and o.flags.c_contiguous for o in outs):
                op.out = tuple(xp.empty(o.shape, o.dtype) for o in outs)


ENV = "NUMBACTR_PLAN_BUFFERS"


def wanted() -> bool:
    """NUMBACTR_PLAN_BUFFERS=1 (the default) gives a plan its buffers after its first step; 0: every op
    allocates its outputs each step (the comparison the benchmark and the tests make)."""
    flag = os.environ.get(ENV, "1").strip()
    if flag not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {flag!r}")
    return flag == "1"
