"""The planned training step: a model's op calls recorded once, then replayed without the autograd tape.

After ``compile()`` a HugeCTR graph is static: every full training batch calls the same ops, in the same
order, with the same parameters, on arrays of the same shapes. The general step (numbactr.train.step.forward)
still builds it anew each time: a Tensor per value, a Context and a tape entry per op, an autocast scope
and a RunInfo per layer, dictionaries keyed by name and by id(). On a small model at a small batch (NCF at
batch 256, where the math takes well under a millisecond) that Python is a large part of the step.

So the first full-batch step of a model runs the general step with a recorder on
(numbactr.autograd.tape.recording): every ``Function.apply`` reports its Function, its parameters, its input
and output Tensors and the layer or embedding that called it. ``build`` turns that into a StepPlan: every
value gets a slot number, every op call becomes an Op (the Function, the slots it reads and writes, its
fixed parameters and which of its inputs need a gradient). Later steps with the same key (``plan_key``:
the device, the batch size, the loss scaler, the ranks, the switches the layers read) run the plan:

* forward: ``op.fn.forward(ctx, *slot arrays, **params)`` in recorded order, a fresh Context per call;
* backward: the same ops in reverse order, ``fn.backward(ctx, *output gradients)``, a gradient read by
  several ops summed as ``later + earlier``, exactly as the tape's replay sums it;
* the parameters' gradients copied into the flat gradient buffer, as the general step copies them.

The same Functions run on the same arrays with the same arguments in the same order, so a planned step
gives the same bits as the general one (tests/test_step_plan.py trains every zoo model both ways on cpu and
sim and compares every weight and optimizer state). What changes from step to step is refreshed by the op's
owner: an embedding's lookup takes this batch's keys; a layer's ``step_params(run)`` (Dropout: the step
number its mask hashes) overrides recorded parameters.

What falls back to the general step (``why_not``, kept in ``model._plan_why``): a partial batch, mixed
precision (its autocast casts are not recorded), embedding collections, ``NUMBACTR_STEP_PLAN=0``, and any
graph the recorder cannot prove plannable (``build``: a layer whose tops its own ops did not produce, an op
reading a tensor made outside the ops). A plan is made per key, so a changed scaler or batch size re-plans.

Two rewrites make a plan cheaper than the step it was recorded from, both with the same bits:

* fusion (numbactr.train.plan_fuse, at build): a Linear whose only reader is the ReLU after it becomes one
  FcBiasAct, bias and ReLU in one pass each way; a Scale read only by the Multiply after it becomes one
  ScaleMultiplyFn (NUMBACTR_PLAN_FUSE=0: not fused);
* buffers (numbactr.train.plan_buffers, after the first planned step): the ops that can write into a given
  array (``writes_into``: Linear, FcBiasAct, ReLU, Concat, Slice, Add, Multiply, Scale, Interaction,
  ScaleMultiply) get one buffer per output,
  the same arrays every step, and their activation gradients share buffers by liveness over the backward
  (NUMBACTR_PLAN_BUFFERS=0: every op allocates, as in the general step).

On a GPU the planned step is what a CUDA graph captures (numbactr.train.cuda_graphs replays it unchanged).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from numbactr import hugectr_exact, ops
from numbactr.autograd import Context, Tensor
from numbactr.layers import RunInfo
from numbactr.layers.base import Layer
from numbactr.ops.embedding_bag import LookupFn
from numbactr.runtime import device
from numbactr.train import plan_buffers, plan_fuse

ENV = "NUMBACTR_STEP_PLAN"
#: plans kept per model (one per key: a model rarely sees more than two)
MAX_PLANS = 4


def wanted() -> bool:
    """NUMBACTR_STEP_PLAN=1 (the default) plans full-batch training steps; 0 keeps the general step."""
    flag = os.environ.get(ENV, "1").strip()
    if flag not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {flag!r}")
    return flag == "1"


def why_not(model, batch) -> str | None:
    """Why a training step on ``batch`` cannot use or make a plan (None: it can)."""
    if not wanted():
        return f"{ENV}=0"
    if model.half is not None:
        return "mixed precision (autocast's casts are not recorded)"
    if model.collections:
        return "an embedding collection"
    if batch.size != batch.batch_size:
        return "a partial batch"
    return None


def plan_key(model, batch) -> tuple:
    """What a plan is valid for: everything the recorded parameters and shapes depend on."""
    return (
        device.kind(),
        batch.batch_size,
        model.ranks,
        float(model.solver.scaler),
        ops.fuse_bias_relu(),
        plan_fuse.switches(),
        plan_buffers.wanted(),
        hugectr_exact.hugectr_exact(),
    )


def input_tensors(model, batch, dense=None) -> dict:
    """The step's dense input (``dense``, default the batch's) and label Tensors by name (shared with the
    general step's forward)."""
    xp = device.xp()
    t = {model.input.dense_name: Tensor(xp.asarray(batch.dense if dense is None else dense))}
    for name, (c0, c1) in model.label_columns.items():  # (host arrays, or device ones: staged)
        t[name] = Tensor(xp.ascontiguousarray(xp.asarray(batch.label)[:, c0:c1]))
    return t


def loss_seeds(model, losses: list) -> list:
    """dLoss/dloss_i for each loss value, in model.losses order: HugeCTR lets loss weights scale only the
    reported loss (spec §10.3); numbactr's gradient is the gradient of the reported loss unless HugeCTR's
    exact behaviour is asked for."""
    xp = device.xp()
    exact = hugectr_exact.hugectr_exact()
    return [xp.full((1,), 1.0 if exact else w, "float32") for (_, w) in model.losses]


def grads_to_flat(model, grad_of) -> None:
    """Every layer parameter's gradient (``grad_of(p)``, None: no gradient reached it) into its view of
    the flat gradient buffer the dense optimizer reads (zeros where none reached it)."""
    for layer in model.layers:
        for p, gview in zip(layer.params, layer.grad_views):
            g = grad_of(p)
            if g is None:
                gview[...] = 0
            elif g is not gview:  # (a planned step's GEMM may have written it in place: Op.grad_into)
                gview[...] = g


@dataclass
class Op:
    """One recorded op call: ``fn`` (a Function) reads slots ``ins`` and writes slots ``outs``."""

    fn: type
    ins: tuple
    outs: tuple
    params: dict
    needs: tuple  # needs_input_grad, as recorded
    owner: object  # the layer or embedding whose forward called it
    multi: bool  # forward returns a tuple
    fresh: object = None  # fresh(model, batch, run) -> parameters for this step (None: params as recorded)
    grad_into: dict = field(default_factory=dict)  # {input index: a weight's view of the flat gradient buffer}
    out: tuple = ()  # the forward outputs' buffers (numbactr.train.plan_buffers; empty: the op allocates)
    grad_bufs: dict = field(default_factory=dict)  # {input index: buffer} of activation gradients (same)
    into: dict = field(default_factory=dict)  # grad_into and grad_bufs together: what the Context gets


@dataclass
class StepPlan:
    """A recorded training step (module docstring). Slots 0..n-1 hold this step's arrays."""

    slots: int
    ops: list
    inputs: list  # [(slot, name)]: the step's dense input and labels
    leaves: list  # [(slot, Tensor)]: parameters and other tensors read as they are each step (.data)
    names: dict  # {tensor name: slot}: what the general forward's dict names
    losses: list  # slots of the loss values, in model.losses order
    params: dict = field(default_factory=dict)  # {id(parameter Tensor): slot}
    fused: dict = field(default_factory=dict)  # {top a fusion no longer makes: the fused op's top} (plan_fuse)
    sized: bool = False  # the buffers are made (after the first planned step: plan_buffers)
    grad_buffers: int = 0  # how many shared activation-gradient buffers the backward uses

    def run(self, model, batch) -> dict:
        """One planned forward and backward on ``batch``; the parameters' gradients land in the flat buffer.
        Returns the step's named Tensors, as the general forward does."""
        vals = [None] * self.slots
        given = input_tensors(model, batch)
        for slot, name in self.inputs:
            vals[slot] = given[name].data
        for slot, tensor in self.leaves:
            vals[slot] = tensor.data
        run = RunInfo(
            training=True,
            valid=batch.size,
            ranks=model.ranks,
            scaler=model.solver.scaler,
            seed=model.solver.seed,
            step=model.step,
        )
        sizing = None if self.sized or not plan_buffers.wanted() else plan_buffers.Sizing()
        ctxs = []
        for op in self.ops:
            ctx = Context()
            ctx.needs_input_grad = op.needs
            if op.into:
                ctx.grad_into = op.into
            if op.out:
                ctx.out = op.out
            params = op.params if op.fresh is None else op.fresh(model, batch, run)
            out = op.fn.forward(ctx, *[vals[i] for i in op.ins], **params)
            if op.multi:
                for slot, o in zip(op.outs, out):
                    vals[slot] = o
            else:
                vals[op.outs[0]] = out
            ctxs.append(ctx)
        grads = [None] * self.slots
        for slot, seed in zip(self.losses, loss_seeds(model, self.losses)):
            grads[slot] = seed
        last = len(self.ops) - 1
        for t, (op, ctx) in enumerate(zip(reversed(self.ops), reversed(ctxs))):
            out_grads = [grads[s] for s in op.outs]
            for s in op.outs:
                grads[s] = None
            if all(g is None for g in out_grads):
                continue
            if sizing is not None:
                sizing.read(out_grads, plan_buffers.END if sizing.held_by(op) else t)
            whole = getattr(op.fn, "accumulates", ())  # inputs whose whole gradient the op returns
            if whole:
                ctx.grad_so_far = {pos: grads[op.ins[pos]] for pos in whole if grads[op.ins[pos]] is not None}
                if sizing is not None:
                    sizing.read(ctx.grad_so_far.values(), t)
            in_grads = op.fn.backward(ctx, *out_grads)
            if not isinstance(in_grads, tuple):
                in_grads = (in_grads,)
            if sizing is not None:
                sizing.wrote(last - t, op, in_grads, t)
            for pos, (slot, g, needed) in enumerate(zip(op.ins, in_grads, op.needs)):
                if g is None or not needed:
                    continue
                prev = grads[slot]
                if pos in whole:
                    grads[slot] = g  # (prev is in it)
                    continue
                if prev is not None and sizing is not None:
                    sizing.read((prev, g), t)
                grads[slot] = g if prev is None else prev + g  # as the tape: the later reader's first
        if sizing is not None:
            sizing.read(grads, plan_buffers.END)  # (the parameters' gradients, read by grads_to_flat)
            self.size(sizing, vals)
        grads_to_flat(model, lambda p: grads[self.params[id(p)]] if id(p) in self.params else None)
        model._last_fused[True] = (bool(model._fused_tops) and ops.fuse_bias_relu()) or bool(self.fused)
        t = {name: Tensor(vals[slot], name) for name, slot in self.names.items()}
        model._last_tensors[True] = t
        return t

    def size(self, sizing, vals: list) -> None:
        """After the sizing step: every op's buffers (numbactr.train.plan_buffers), and the dict its Context
        gets as ``grad_into``."""
        plan_buffers.forward_buffers(self, vals)
        sizing.finish(self)
        for op in self.ops:
            op.into = {**op.grad_into, **op.grad_bufs}
        self.sized = True


class Tracer:
    """The recorder of one general step (numbactr.autograd.tape.recording calls it per op). The general
    forward sets ``owner`` to the layer or embedding whose forward runs next."""

    def __init__(self):
        self.owner = None
        self.calls = []  # (cls, params, inputs, outputs, needs, owner)

    def __call__(self, cls, params, inputs, result, ctx) -> None:
        multi = isinstance(result, tuple)  # forward returned a tuple (apply then returns one too)
        outs = result if multi else (result,)
        self.calls.append((cls, dict(params), tuple(inputs), outs, multi, ctx.needs_input_grad, self.owner))


def _lookup_params(emb):
    """An embedding lookup's parameters for this step: this batch's keys and bags (what
    SparseEmbedding.forward hands LookupFn); the held gradient of the last step is dropped, as there."""

    def fresh(model, batch, run):
        keys, offsets = batch.sparse[model.sparse_inputs[emb.cfg.bottom_name]]
        emb._pending = None
        return dict(emb=emb, keys=keys, offsets=offsets, training=True, shape=emb.output_shape(batch.batch_size))

    return fresh


def _layer_params(layer, recorded: dict):
    def fresh(model, batch, run):
        return {**recorded, **layer.step_params(run)}

    return fresh


def build(model, tracer: Tracer, t: dict) -> tuple:
    """(StepPlan, None) from a traced general step whose named Tensors are ``t``, or (None, why not)."""
    slot_of: dict = {}
    leaves, inputs, ops_ = [], [], []
    params = {id(p): p for layer in model.layers for p in layer.params}
    weights = {id(e.weight) for e in model.embeddings}
    produced_by: dict = {}  # id(tensor) -> owner

    def slot(tensor) -> int:
        key = id(tensor)
        if key not in slot_of:
            slot_of[key] = len(slot_of)
        return slot_of[key]

    for name, x in input_tensors_names(model, t):  # every input, read by an op or not
        inputs.append((slot(x), name))
    for cls, prm, ins, outs, multi, needs, owner in tracer.calls:
        if owner is None:
            return None, f"{cls.__name__} was called outside a layer's or embedding's forward"
        in_slots = []
        for x in ins:
            if id(x) not in slot_of:
                if id(x) in params or id(x) in weights:
                    leaves.append((slot(x), x))
                else:
                    return None, f"{type(owner).__name__} {owner_name(owner)!r} reads a tensor made outside its ops"
            in_slots.append(slot(x))
        fresh = None
        if cls is LookupFn:
            fresh = _lookup_params(prm["emb"])
        elif isinstance(owner, Layer) and type(owner).step_params is not Layer.step_params:
            fresh = _layer_params(owner, prm)
        for o in outs:
            produced_by[id(o)] = owner
        ops_.append(Op(cls, tuple(in_slots), tuple(slot(o) for o in outs), prm, needs, owner, multi, fresh))
    for layer in model.layers:  # every top: made by the layer's own ops, or one of its bottoms passed on
        bottoms = {id(t[b]) for b in layer.cfg.bottom_names}
        for top in layer.cfg.top_names:
            x = t[top]
            if produced_by.get(id(x)) is not layer and id(x) not in bottoms:
                return None, f"layer {type(layer).__name__} ({top!r}) makes a top outside its ops"
    missing = [name for name, x in t.items() if id(x) not in slot_of]
    if missing:
        return None, f"tensors no op touched: {missing[:3]}"
    losses = [slot_of[id(t[layer.cfg.top_names[0]])] for layer, _ in model.losses]
    names = {name: slot_of[id(x)] for name, x in t.items()}
    fused = {}
    if plan_fuse.switches()[0]:
        arrays = {slot_of[id(x)]: x.data for call in tracer.calls for x in call[2]}
        readers: dict = {}
        for op in ops_:
            for s in op.ins:
                readers[s] = readers.get(s, 0) + 1
        ops_, gone = plan_fuse.fuse(ops_, arrays, readers, set(losses))
        for name, s in list(names.items()):
            if s in gone:  # the pre-activation top is not kept (Model.check_out_tensor says so)
                fused[name] = next(n for n, s2 in names.items() if s2 == gone[s])
                del names[name]
        for pre, post in fused.items():
            model._fused_tops.setdefault(pre, post)
    hand_over_weight_grads(model, ops_, slot_of)
    for op in ops_:
        op.into = dict(op.grad_into)
    param_slots = {k: slot_of[k] for k in params if k in slot_of}
    return StepPlan(len(slot_of), ops_, inputs, leaves, names, losses, param_slots, fused), None


def hand_over_weight_grads(model, ops_: list, slot_of: dict) -> None:
    """A weight read by exactly one op gets its gradient written by that op's backward straight into its view
    of the flat gradient buffer (Op.grad_into; ops that take it: numbactr.ops.dense's GEMMs): the copy the
    general step makes after the backward is left out. A weight read twice keeps the sum of two gradients."""
    readers: dict = {}
    for k, op in enumerate(ops_):
        for pos, s in enumerate(op.ins):
            readers.setdefault(s, []).append((k, pos))
    for layer in model.layers:
        for p, gview in zip(layer.params, layer.grad_views):
            where = readers.get(slot_of.get(id(p)), [])
            if len(where) == 1 and gview.flags.c_contiguous and gview.shape == p.data.shape:
                k, pos = where[0]
                ops_[k].grad_into[pos] = gview


def input_tensors_names(model, t: dict):
    """(name, Tensor) of the step's dense input and labels in the traced step's tensors."""
    yield model.input.dense_name, t[model.input.dense_name]
    for name in model.label_columns:
        yield name, t[name]


def owner_name(owner) -> str:
    cfg = getattr(owner, "cfg", None)
    return getattr(owner, "name", None) or (cfg.top_names[0] if cfg is not None and hasattr(cfg, "top_names") else "?")


def lookup(model, batch) -> tuple:
    """(this step's StepPlan or None, whether to trace the general step to make one)."""
    why = why_not(model, batch)
    if why is not None:
        model._plan_why = why
        return None, False
    key = plan_key(model, batch)
    if key not in model._plans:
        return None, True
    steps = model._plans[key]
    if steps is not None:
        model._plan_why = None
    return steps, False


def keep(model, batch, tracer: Tracer, t: dict) -> None:
    """Make and keep the plan of the step just traced (or say why not in model._plan_why)."""
    plan, why = build(model, tracer, t)
    model._plan_why = why
    if plan is None:
        model._plans[plan_key(model, batch)] = None  # not plannable: do not trace again for this key
        return
    if len(model._plans) >= MAX_PLANS:
        model._plans.clear()
    model._plans[plan_key(model, batch)] = plan
