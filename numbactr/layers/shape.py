"""Shape layers: ReduceSum, ReduceMean, Slice, Select, Gather, FusedReshapeConcat,
FusedReshapeConcatGeneral, SequenceMask, and ReshapeSelected (Reshape with ``selected=True``).

Contract: none has weights; each layer checks its config and bottoms and runs an op of numbactr.ops.shape
(the formulas are there), which reaches the numba.cuda kernels on gpu/sim and the NumPy references on cpu
through numbactr.ops.dispatch.

Differences from HugeCTR (spec §6.2): Select / Gather / Reshape(selected) backward zero-fills the
entries that were not selected and ADDS the gradients of duplicate indices (HugeCTR writes with `=`,
leaving unselected input gradients stale and racing on duplicates); Slice backward sums overlapping
pieces exactly as HugeCTR does.
"""

from __future__ import annotations

import numbers

from numbactr.enums import Layer_t
from numbactr.layers.base import Layer, op_fn
from numbactr.ops.shape import (
    FusedReshapeConcatFn,
    FusedReshapeConcatGeneralFn,
    Index,
    ReduceAxis,
    SelectFn,
    SequenceMaskFn,
    SliceFn,
)

MAX_SLICES = 5  # HugeCTR's Slice has at most 5 tops


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


# ---- layers ----------------------------------------------------------------------------------
class ReduceSum(Layer):
    """Sum over ``axis`` of a rank 1..3 input; the output keeps the axis with size 1."""

    type_name = "ReduceSum"
    mean = False

    def infer(self):
        self.expect_counts(1)
        (shape,) = self.in_shapes
        name = self.cfg.bottom_names[0]
        if not 1 <= len(shape) <= 3:
            self.fail(f"input {name!r} must have rank 1..3, got shape {shape}")
        if any(d <= 0 for d in shape):
            self.fail(f"input {name!r} {shape} has an empty dim")
        axis = self.cfg.axis
        if not _is_int(axis) or not 0 <= axis < len(shape):
            self.fail(f"axis must be an int in 0..{len(shape) - 1} for input {name!r} {shape}, got {axis!r}")
        self.axis = int(axis)
        out = list(shape)
        out[self.axis] = 1
        return [tuple(out)]

    def forward(self, tape, xs, run):
        return [ReduceAxis.apply(tape, xs[0], axis=self.axis, mean=self.mean, name=self.cfg.top_names[0])]

    def inference_fn(self):
        return op_fn(ReduceAxis, axis=self.axis, mean=self.mean)

    def json_params(self):
        return {"axis": self.axis}


class ReduceMean(ReduceSum):
    """Mean over ``axis``; dX = dY / dim_size broadcast."""

    type_name = "ReduceMean"
    mean = True


class Slice(Layer):
    """Column ranges [a, b) of the last dim -> one top per range (1..5); overlaps allowed.

    Ranges are validated as HugeCTR does: a < b, both >= 0, starts and ends non-decreasing in order,
    within the input width. Backward: dX = 0, then dX[..., a:b] += dY_i for each top.
    """

    type_name = "Slice"

    def infer(self):
        c = self.cfg
        self.expect_counts(1, len(c.top_names))  # one bottom; tops are checked against ranges below
        ranges = list(c.ranges)
        if not ranges:
            self.fail("ranges must not be empty")
        if len(ranges) > MAX_SLICES:
            self.fail(f"at most {MAX_SLICES} ranges are allowed, got {len(ranges)}")
        (shape,) = self.in_shapes
        name = c.bottom_names[0]
        if len(shape) < 2:
            self.fail(f"input {name!r} must have rank >= 2, got shape {shape}")
        width = shape[-1]
        prev_a, prev_b = -1, 0
        for r in ranges:
            if not (isinstance(r, (tuple, list)) and len(r) == 2 and all(_is_int(v) for v in r)):
                self.fail(f"each range must be a pair of ints (a, b), got {r!r}")
            a, b = int(r[0]), int(r[1])
            if a >= b:
                self.fail(f"range {r!r} is reversed or empty (needs a < b)")
            if a < 0:
                self.fail(f"range {r!r} is negative")
            if not (prev_a <= a and prev_b <= b):
                self.fail(
                    f"range {r!r} is out of order or included in the previous range "
                    f"({prev_a}, {prev_b}); ranges must be sorted by start and end"
                )
            if b > width:
                self.fail(f"range {r!r} exceeds the width {width} of input {name!r} {shape}")
            prev_a, prev_b = a, b
        self.ranges = tuple((int(a), int(b)) for a, b in ranges)
        if len(c.top_names) != len(ranges):
            self.fail(f"expects {len(ranges)} top tensors (one per range), got {len(c.top_names)}")
        return [shape[:-1] + (b - a,) for a, b in self.ranges]

    def forward(self, tape, xs, run):
        return list(SliceFn.apply(tape, xs[0], ranges=self.ranges, name=self.cfg.top_names[0]))

    def inference_fn(self):
        return op_fn(SliceFn, ranges=self.ranges)

    def json_params(self):
        return {"ranges": [[a, b] for a, b in self.ranges]}


def _check_indices(layer: Layer, what: str, values, size: int, where: str) -> list:
    values = list(values)
    if not values:
        layer.fail(f"{what} must not be empty")
    for v in values:
        if not _is_int(v) or not 0 <= v < size:
            layer.fail(f"{what} entry {v!r} is out of range 0..{size - 1} of {where}")
    return [int(v) for v in values]


class Select(Layer):
    """Entries ``index`` of dim ``dim`` (>= 1): the output has len(index) there; duplicates allowed.

    Backward scatter-adds dY back; entries not selected get 0.
    """

    type_name = "Select"

    def infer(self):
        self.expect_counts(1)
        (shape,) = self.in_shapes
        name = self.cfg.bottom_names[0]
        dim = self.cfg.dim
        if not _is_int(dim) or not 1 <= dim < len(shape):
            self.fail(
                f"dim must be an int in 1..{len(shape) - 1} for input {name!r} {shape} "
                f"(dim 0 is the batch), got {dim!r}"
            )
        self.dim = int(dim)
        idx = _check_indices(self, "index", self.cfg.index, shape[self.dim], f"dim {self.dim} of {name!r} {shape}")
        self.index = Index(idx)
        out = list(shape)
        out[self.dim] = len(idx)
        return [tuple(out)]

    def forward(self, tape, xs, run):
        return [SelectFn.apply(tape, xs[0], dim=self.dim, index=self.index, name=self.cfg.top_names[0])]

    def json_params(self):
        # HugeCTR's graph_to_json drops these (spec §10.16); written as extra keys readers ignore
        return {"dim": self.dim, "index": self.index.host.tolist()}


class Gather(Layer):
    """Rows ``indices`` of a 2-D input: (B, K) -> (len(indices), K). Backward scatter-adds."""

    type_name = "Gather"

    def infer(self):
        self.expect_counts(1)
        (shape,) = self.in_shapes
        name = self.cfg.bottom_names[0]
        if len(shape) != 2:
            self.fail(f"input {name!r} must be 2-D (B, K), got shape {shape}")
        idx = _check_indices(self, "indices", self.cfg.indices, shape[0], f"the rows of {name!r} {shape}")
        self.index = Index(idx)
        return [(len(idx), shape[1])]

    def forward(self, tape, xs, run):
        return [SelectFn.apply(tape, xs[0], dim=0, index=self.index, name=self.cfg.top_names[0])]

    def json_params(self):
        return {"indices": self.index.host.tolist()}


def _check_3d_same_bs(layer: Layer) -> tuple[int, int, int]:
    """(B, S, W) of k >= 1 inputs (B, S, w_i) sharing B and S."""
    names, shapes = layer.cfg.bottom_names, layer.in_shapes
    for n, s in zip(names, shapes):
        if len(s) != 3:
            layer.fail(f"input {n!r} must be 3-D (B, S, w), got shape {s}")
        if s[:2] != shapes[0][:2]:
            layer.fail(f"input {n!r} {s} does not share (B, S) with {names[0]!r} {shapes[0]}")
    b, s = shapes[0][:2]
    return b, s, sum(sh[2] for sh in shapes)


class FusedReshapeConcat(Layer):
    """Inputs (B, S, w_i) -> tops item (B*(S-1), W) (slots 0..S-2) and ad (B, W) (last slot)."""

    type_name = "FusedReshapeConcat"

    def infer(self):
        if len(self.cfg.top_names) != 2:
            self.fail(f"expects 2 top tensors (item, ad), got {len(self.cfg.top_names)}")
        b, s, w = _check_3d_same_bs(self)
        if s < 2:
            self.fail(f"inputs need at least 2 slots (S-1 item slots + 1 ad slot), got S = {s}")
        return [(b * (s - 1), w), (b, w)]

    def forward(self, tape, xs, run):
        return list(FusedReshapeConcatFn.apply(tape, *xs, name=self.cfg.top_names[0]))


class FusedReshapeConcatGeneral(Layer):
    """Inputs (B, S, w_i) -> (B*S, W)."""

    type_name = "FusedReshapeConcatGeneral"

    def infer(self):
        if len(self.cfg.top_names) != 1:
            self.fail(f"expects 1 top tensor, got {len(self.cfg.top_names)}")
        b, s, w = _check_3d_same_bs(self)
        return [(b * s, w)]

    def forward(self, tape, xs, run):
        return [FusedReshapeConcatGeneralFn.apply(tape, *xs, name=self.cfg.top_names[0])]


class SequenceMask(Layer):
    """Bottoms [len_from (B, 1), len_to (B, 1)] (float lengths) -> mask (B, 1, Lf, Lt); no gradient.

    HugeCTR v23.06's form, one bottom [lengths (B, 1)] with ``max_sequence_len`` L, gives (B, 1, 1, L): 1 where
    the key position is below the length (the two-bottom mask with Lf = 1 and every len_from 1)."""

    type_name = "SequenceMask"

    def infer(self):
        if len(self.cfg.bottom_names) == 1:
            self.expect_counts(1)
            (t,) = self.in_shapes
            if len(t) != 2 or t[1] != 1:
                self.fail(f"bottom {self.cfg.bottom_names[0]!r} must be lengths (B, 1), got {t}")
            L = self.cfg.max_sequence_len
            if not _is_int(L) or L <= 0:
                self.fail(f"max_sequence_len must be a positive int, got {L!r}")
            self.one_bottom, self.lf, self.lt = True, 1, int(L)
            return [(t[0], 1, 1, self.lt)]
        self.one_bottom = False
        self.expect_counts(2)
        names, (f, t) = self.cfg.bottom_names, self.in_shapes
        if len(f) != 2 or f[1] != 1 or t != f:
            self.fail(f"bottoms must both be lengths (B, 1); got {names[0]!r} {f} and {names[1]!r} {t}")
        lf, lt = self.cfg.max_sequence_len_from, self.cfg.max_sequence_len_to
        for key, v in (("max_sequence_len_from", lf), ("max_sequence_len_to", lt)):
            if not _is_int(v) or v <= 0:
                self.fail(f"{key} must be a positive int, got {v!r}")
        self.lf, self.lt = int(lf), int(lt)
        return [(f[0], 1, self.lf, self.lt)]

    def forward(self, tape, xs, run):
        if self.one_bottom:
            return [
                SequenceMaskFn.apply(tape, xs[0], xs[0], lf=1, lt=self.lt, one_from=True, name=self.cfg.top_names[0])
            ]
        return [SequenceMaskFn.apply(tape, xs[0], xs[1], lf=self.lf, lt=self.lt, name=self.cfg.top_names[0])]

    def json_params(self):
        if self.one_bottom:
            return {"max_sequence_len": self.lt}
        return {"max_sequence_len_from": self.lf, "max_sequence_len_to": self.lt}


class ReshapeSelected(Layer):
    """Reshape with ``selected=True``: slots ``selected_slots`` of (B, S, V) -> (B, len(sel)*V).

    Not registered in LAYERS: Layer_t.Reshape belongs to core.Reshape, which hands selected=True here.
    Backward zero-fills the unselected slots (HugeCTR leaves them stale) and adds duplicates.
    """

    type_name = "Reshape"

    def infer(self):
        self.expect_counts(1)
        c = self.cfg
        if not c.selected:
            self.fail("ReshapeSelected handles only selected=True")
        (shape,) = self.in_shapes
        name = c.bottom_names[0]
        if len(shape) != 3:
            self.fail(f"selected=True needs a 3-D input (B, S, V), got {name!r} {shape}")
        b, s, v = shape
        sel = list(c.selected_slots)
        if len(sel) > s:
            self.fail(f"selected_slots has {len(sel)} entries, more than the {s} slots of {name!r} {shape}")
        idx = _check_indices(self, "selected_slots", sel, s, f"the slots of {name!r} {shape}")
        self.index = Index(idx)
        return [(b, len(idx) * v)]

    def forward(self, tape, xs, run):
        x = xs[0]
        out_shape = (x.shape[0], self.index.host.size * x.shape[2])
        return [SelectFn.apply(tape, x, dim=1, index=self.index, out_shape=out_shape, name=self.cfg.top_names[0])]

    def json_params(self):
        return {"selected": self.index.host.tolist()}


LAYERS = {
    Layer_t.ReduceSum: ReduceSum,
    Layer_t.ReduceMean: ReduceMean,
    Layer_t.Slice: Slice,
    Layer_t.Select: Select,
    Layer_t.Gather: Gather,
    Layer_t.FusedReshapeConcat: FusedReshapeConcat,
    Layer_t.FusedReshapeConcatGeneral: FusedReshapeConcatGeneral,
    Layer_t.SequenceMask: SequenceMask,
}
