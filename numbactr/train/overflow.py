"""Mixed-precision overflow and non-finite losses: is a step's overflow gated on the device or read on the
host, the gate, the skipped steps' accounting, and the non-finite loss checks with their error message.

Functions take the Model and keep their state on it (_skipped, _skips_dev, _skips_seen, _nonfinite_flag;
precision.Gate reads _skips_seen from it). Why the device-side gate and flag: a GPU step then reads nothing
back; the host learns of skips and non-finite losses at the check points (Model.check_deferred, every
Model.NONFINITE_CHECK_EVERY steps), naming the step where they began.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from numbactr.autograd import Tape
from numbactr.embedding.engine import Optim, Precision
from numbactr.embedding.sparse_embedding import HashEmbedding, OneHotEmbedding
from numbactr.enums import Optimizer_t
from numbactr.runtime import device, step_values
from numbactr.runtime import precision

#: HugeCTR's sparse optimizers, whose gated updates the engine skips exactly (Adam's step-dependent
#: scalars computed on the device for the steps that update)
GATED_SPARSE = ("HUGECTR_SGD", "HUGECTR_MOMENTUM_SGD", "HUGECTR_NESTEROV", "HUGECTR_ADAGRAD", "HUGECTR_ADAM")


def overflow_on_device(model) -> bool:
    """Mixed precision: is an overflowed step skipped on the device (a gate the update kernels read,
    gate) rather than after a host read of the flag (grads_finite)? On the kernels' devices (gpu, sim)
    with hash or one-hot SparseEmbeddings on the embedding engine's kernels (on any number of ranks: the
    ranks agree on the gate, gate), no stochastic rounding (its salts count every step) and HugeCTR's
    optimizers: their updates are all the step changes, so a shut gate leaves the model as a skipped
    step does (Adam's t is then counted on the device: precision.Gate). The host learns of skips at the
    check points (check_deferred, skipped_steps)."""
    if model.half is None or not device.uses_kernels() or model.collections:
        return False
    gated = {Optim[k] for k in GATED_SPARSE}
    for e in model.embeddings:
        eng = getattr(e, "engine", None)
        # (a tiered table's engine has no gate: it reads the flag)
        if type(e) not in (HashEmbedding, OneHotEmbedding) or getattr(eng, "impl", None) != "kernels":
            return False
        if eng.optimizer.kind not in gated or (
            eng.weights_precision == Precision.FP16 and eng.stochastic_rounding
        ):  # its salts count the steps
            return False
    return True


def gate(model, tape: Tape):
    """This step's gate (precision.Gate): go, (1,) int64 on the device, 1 when every gradient stayed
    finite, else 0; the device count of skipped steps grows by 1 - go. No host read.

    Several ranks agree on go: a step is skipped on every rank when any rank's gradients overflowed (a
    rank's flag sees only its own gradients, but its dense gradients were summed with the others' and
    its embedding rows are updated from every rank's). The ranks sum their 1 - go on the device (NCCL
    between GPUs; staged through the host by MPI otherwise, as the dense gradients are)."""
    xp = device.xp()
    if model._skips_dev is None:  # (made by an eager step: never inside a CUDA graph capture)
        model._skips_dev = xp.zeros(1, np.int64)
    ok = tape.finite_flag()
    if ok is None and model.ranks == 1:  # no gradient was watched: nothing can have overflowed
        return None
    go = xp.ones(1, np.int64) if ok is None else xp.asarray(ok).reshape(1).astype(np.int64)
    if model.ranks > 1:  # every rank takes part, watched gradients or not
        bad = model.comm.allreduce_sum(1 - go)
        go = (bad == 0).astype(np.int64)
    model._skips_dev += 1 - go
    return precision.Gate(go, model._skips_dev, model)


def sync_skips(model) -> None:
    """Read the device count of skipped steps (one host read, at a check point) and account for the
    new ones as skip_step does: counted, the embedding engines' step counters back to the steps that
    updated, one GradientOverflowWarning."""
    if model._skips_dev is None:
        return
    total = int(device.to_host(model._skips_dev)[0])
    new, model._skips_seen = total - model._skips_seen, total
    if new <= 0:
        return
    model._skipped += new
    for e in model.embeddings:
        e.engine.step -= new
    if model.dense_optimizer.opt.optimizer_type == Optimizer_t.Adam:
        model.dense_optimizer.t -= new
    warnings.warn(
        f"mixed precision: the gradients of {new} step(s) up to iteration {model.step} overflowed "
        f"{model.half.name} at scaler={model.solver.scaler:g}; their updates were skipped "
        f"({model._skipped} skipped so far). A smaller scaler avoids this",
        precision.GradientOverflowWarning,
        stacklevel=3,
    )


def grads_finite(model, tape: Tape) -> bool:
    """Mixed precision: did every gradient of this step stay finite, on every rank? (The ranks agree,
    so a skipped step skips the model-parallel embedding updates everywhere.)"""
    ok = tape.grads_finite()
    if model.ranks > 1:
        ok = bool(model.comm.allreduce_sum(np.array([0.0 if ok else 1.0]))[0] == 0.0)
    return ok


def skip_step(model) -> None:
    """Drop this step's dense and sparse gradients without touching weights or optimizer states,
    count the skip and warn (numbactr/runtime/precision.py: HugeCTR would apply the inf/NaN gradients)."""
    for e in (*model.embeddings, *model.collections):
        for held in ("_pending", "_saved"):  # the gradients kept for update()
            if hasattr(e, held):
                setattr(e, held, None)
    model.wgrads[...] = 0
    model._skipped += 1
    model.step += 1
    warnings.warn(
        f"mixed precision: iteration {model.step}'s gradients overflowed {model.half.name} at "
        f"scaler={model.solver.scaler:g}; its update was skipped ({model._skipped} skipped "
        f"so far). A smaller scaler avoids this",
        precision.GradientOverflowWarning,
        stacklevel=3,
    )


# how many steps a GPU run goes between reads of its non-finite flag (when no loss is read per step)
NONFINITE_CHECK_EVERY = 64


def check_finite_loss(model, t: dict) -> None:
    """FloatingPointError when this step's loss is non-finite, naming the step, the loss layer and
    the first layer whose output went non-finite (found only then).

    A loss value the step already read to the host (gen_loss_summary=True on cpu) is checked.
    Otherwise no value is read each step on a GPU (the loss is kept on the device, step.keep_loss, or
    not summarized at all): a device-side flag keeps the first
    non-finite step and is read every NONFINITE_CHECK_EVERY steps, so training stops up to that many
    steps late but names the step where it began (cpu/sim arrays are host memory: checked every
    step). fit() also stops at a display whose loss is NaN."""
    step = model.step + 1  # 1-based, as fit() counts iterations
    if model.solver.gen_loss_summary and model._pending_loss is None:  # the value was read already
        if not math.isfinite(model.current_loss):
            raise nonfinite_loss(model, t, step, step)
        return
    losses = model._pending_loss[0] if model._pending_loss is not None else losses_array(model, t)
    if _host_memory(losses):
        if not np.isfinite(losses).all():
            raise nonfinite_loss(model, t, step, step)
        return
    note_nonfinite_loss(model, losses, step)
    if step % model.NONFINITE_CHECK_EVERY == 0:
        read_nonfinite_flag(model, t, step)


def losses_array(model, t: dict):
    xp = device.xp()
    return xp.concatenate([t[layer.cfg.top_names[0]].data.reshape(1) for layer, _ in model.losses])


def note_nonfinite_loss(model, losses, step: int) -> None:
    """The device flag keeps the first step (1-based) whose loss was non-finite; the step number comes
    from device memory (numbactr.runtime.step_values), so the same operation serves every step of a graph."""
    xp = device.xp()
    flag = getattr(model, "_nonfinite_flag", None)
    if flag is None:
        flag = model._nonfinite_flag = xp.full((1,), -1, np.int64)
    sv = step_values.held(model, "_step_value", 1, np.int64)
    flag[...] = xp.where((flag < 0) & ~xp.isfinite(losses).all(), sv.put(step), flag)
    step_values.on_replay(("nonfinite", id(model)), lambda run: sv.put(run["step"] + 1))


def read_nonfinite_flag(model, t: dict, step: int) -> None:
    flag = getattr(model, "_nonfinite_flag", None)
    if flag is None:
        return
    first = int(device.to_host(flag)[0])
    if first >= 0:
        raise nonfinite_loss(model, t, first, step)


def nonfinite_loss(model, t: dict, step: int, now: int) -> FloatingPointError:
    """The error for a non-finite loss that appeared at `step` (detected at step `now`)."""

    def finite(a):
        return bool(np.isfinite(device.to_host(a)).all())

    values = [(layer, t[layer.cfg.top_names[0]].data) for layer, _ in model.losses]
    bad = [
        f"{layer.type_name} {layer.cfg.top_names[0]!r} = {float(device.to_host(v)[0])}"
        for layer, v in values
        if not finite(v)
    ]
    what = ", ".join(bad) if bad else "the regularizer term (non-finite weights)"
    first = "no layer output is non-finite"
    for e in model.embeddings:
        if not finite(t[e.name].data):
            first = f"the first non-finite output is embedding {e.name!r}" + (
                "" if finite(e.weight.data) else " (its table holds non-finite values)"
            )
            break
    else:
        for layer in model.layers:
            tops = [n for n in layer.cfg.top_names if not finite(t[n].data)]
            if tops:
                weights = "" if all(finite(p.data) for p in layer.params) else " (its weights are non-finite)"
                first = f"the first non-finite output is {layer.type_name} {tops[0]!r}{weights}"
                break
    if now == step:
        where = f"at iteration {step}: {what}; {first}. Training stopped before this iteration's update"
    else:
        why = (
            "keeping the loss on the device, a GPU run"
            if model.solver.gen_loss_summary
            else "with gen_loss_summary=False a GPU run"
        )
        where = (
            f"first at iteration {step}, found at iteration {now} ({why} "
            f"checks every {model.NONFINITE_CHECK_EVERY} iterations): now {what}; {first}"
        )
    return FloatingPointError(f"non-finite training loss {where} (check the lr, the data, the initialization)")


def _host_memory(a) -> bool:
    """True when reading `a` costs no device-to-host copy (cpu and sim arrays are NumPy's)."""
    return device.is_host_array(a)
