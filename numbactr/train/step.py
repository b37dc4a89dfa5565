"""One training step of a Model: the forward, the backward into the flat gradients, the updates, the
loss kept on the device, the input staging, and whether the step runs as a replayed CUDA graph.

Functions take the Model and read and write its state in place (weights, wgrads, step, _pending_loss,
_last_tensors, _stager, _graphs, ...). Why the step is split into an eager path (train) and a device half
(device_step) with its host half (after_device_step): a CUDA graph can capture only device work, so
everything the step does on the host is either done after the graph's launch or registered to run before
each replay (numbactr.runtime.step_values.on_replay).
"""

from __future__ import annotations

import functools

import numpy as np

from numbactr import ops
from numbactr.autograd import Tape
from numbactr.autograd.tape import autocast, recording
from numbactr.data import staging
from numbactr.embedding import sharded
from numbactr.embedding.sparse_embedding import HashEmbedding, OneHotEmbedding
from numbactr.layers import RunInfo
from numbactr.runtime import device, step_values
from numbactr.train import cuda_graphs, graph, overflow, plan
from numbactr.runtime import precision


def forward(model, batch, training: bool, tape: Tape | None, trace=None) -> dict:
    """Run the graph on one batch; returns every tensor by name. ``trace`` (numbactr.train.plan.Tracer) is
    told whose forward runs next while its recorder listens."""
    dense = batch.dense
    if model.half is not None and dense.dtype != model.half:  # HugeCTR's reader hands fp16 dense input
        precision.check_dense_input(dense, model.half)
        dense = np.asarray(dense).astype(model.half)
    t = plan.input_tensors(model, batch, dense)
    rows = batch.batch_size
    half = model.half
    with autocast(half):  # embedding outputs in half precision
        for emb in model.embeddings:
            if trace is not None:
                trace.owner = emb
            keys, offsets = batch.sparse[model.sparse_inputs[emb.cfg.bottom_name]]
            t[emb.name] = emb.forward(tape, keys, offsets, rows, training)
        for c in model.collections:
            t.update(c.forward(tape, {b: batch.sparse[model.sparse_inputs[b]] for b in c.bottoms}, training))
    run = RunInfo(
        training=training,
        valid=batch.size,
        ranks=model.ranks,
        scaler=model.solver.scaler,
        seed=model.solver.seed,
        step=model.step,
    )
    for layer in model.layers:
        if trace is not None:
            trace.owner = layer
        with autocast(half, keep_outputs=layer.is_loss):  # losses: float32 math and value
            outs = layer.forward(tape, [t[b] for b in layer.cfg.bottom_names], run)
        for name, o in zip(layer.cfg.top_names, outs):
            t[name] = o
    model._last_tensors[training] = t  # check_out_tensor reads them
    model._last_fused[training] = bool(model._fused_tops) and ops.fuse_bias_relu()
    return t


def loss_value(model, t: dict, valid: int, rank_rows: int | None = None) -> float:
    """Σ_i weight_i · loss_i (+ regularizer terms), averaged over ranks, as HugeCTR reports it.

    rank_rows (eval): this rank's valid rows; the ranks' losses (each a mean over its valid rows) are
    then weighted by them, giving the mean over the global batch's valid rows, not HugeCTR's plain
    mean of the ranks' means (which differ when a partial last batch fills the ranks unevenly)."""
    total = 0.0
    for layer, w in model.losses:
        total += w * float(device.to_host(t[layer.cfg.top_names[0]].data)[0])
    if model.ranks > 1 and rank_rows is not None:
        summed = model.comm.allreduce_sum(np.array([total * rank_rows, rank_rows], dtype=np.float64))
        total = float(summed[0] / summed[1]) if summed[1] > 0 else 0.0
    elif model.ranks > 1:
        total = float(model.comm.allreduce_sum(np.array([total]))[0]) / model.ranks
    for layer, _ in model.losses:
        total += regularizer(model, layer, valid, grad=False)
    return total


def read_loss(model) -> float:
    """The last training step's reported loss; a loss kept on the device is read here, once."""
    if model._pending_loss is not None:
        losses, weights, ranks = model._pending_loss
        host = device.to_host(losses)
        total = 0.0
        for i, w in enumerate(weights):  # the order and float math of loss_value
            total += w * float(host[i])
        if ranks > 1:  # host[i]: loss i summed over the ranks (keep_loss)
            total /= ranks
        for term in host[len(weights) :]:  # the regularizer terms, in loss-layer order
            total += float(term)
        model._pending_loss = None
        model._current_loss = total
    return model._current_loss


def lazy_loss(model) -> bool:
    """Keep the training loss on the device (read lazily)? On gpu and sim, on one rank or several, with
    or without a regularizer (its term is computed on the device from the step's weights, before the
    update, and kept beside the losses); the cpu device's arrays are host memory (nothing to save
    there, and its path stays as it was)."""
    return device.kind() != "cpu"


def keep_loss(model, t: dict, rows: int) -> None:
    """Hold this step's losses as one device array (a copy: the loss tensors' buffers may be reused),
    followed by the loss layers' regularizer terms over ``rows`` (the global batch's rows, as
    loss_value). On several ranks each loss is summed over the ranks on the device, in float64 (NCCL
    between GPUs of their own: enqueued on the stream, nothing read back; host-staged MPI otherwise), and
    current_loss divides by the rank count: the mean of the ranks' losses, as loss_value reports it
    (which weights each rank's losses before the sum: the same value, to the last bit for one loss of
    weight 1). The regularizer terms are not summed (every rank holds the same dense weights)."""
    xp = device.xp()
    losses = xp.concatenate([t[layer.cfg.top_names[0]].data.reshape(1) for layer, _ in model.losses])
    if model.ranks > 1:
        losses = model.comm.allreduce_sum(xp.ascontiguousarray(losses.astype(np.float64)))
    terms = [regularizer(model, layer, rows, grad=False, kept=True) for layer, _ in model.losses]
    terms = [r.astype(losses.dtype) for r in terms if r is not None]
    if terms:
        losses = xp.concatenate([losses, *terms])
    model._pending_loss = (losses, tuple(w for _, w in model.losses), model.ranks)


def regularizer(model, loss_layer, batch_rows: int, grad: bool, kept: bool = False):
    """L1/L2 on every trainable weight of the layers added before ``loss_layer`` (spec §6.3), with
    b = the batch's row count. Those weights are one contiguous slice of the flat weight vector.
    grad=True adds the regularizer gradient into the flat wgrad; returns the loss term, or with
    kept=True (the kernels' devices) the term as a (1,) device array, None for no term, read nothing."""
    reg = getattr(loss_layer, "regularizer", None)
    if not reg:
        return None if kept else 0.0
    from numbactr.layers.losses import regularizer_grad, regularizer_term, regularizer_term_on_device

    kind, lam = reg
    end = sum(p.data.size for layer in model.layers[: model.layers.index(loss_layer)] for p in layer.params)
    if end == 0:
        return None if kept else 0.0
    if grad:
        regularizer_grad(model.weights[:end], kind, lam, batch_rows, model.wgrads[:end], accumulate=True)
        return 0.0
    if kept:
        return regularizer_term_on_device(model.weights[:end], kind, lam, batch_rows)
    return regularizer_term(model.weights[:end], kind, lam, batch_rows)


def start_data_reading(model) -> None:
    graph.require_compiled(model, "start_data_reading")
    if model._train_reader is None:
        # every file list of source in order (with the embedding training cache, fit reads them one by one)
        source = model.reader_params.source if model.etc is None else model.reader_params.source[0]
        model._train_reader = iter(
            graph.make_reader(model, source, model.solver.batchsize, model.solver.repeat_dataset)
        )
    if model._eval_reader is None:
        model._eval_reader = iter(
            graph.make_reader(
                model,
                model.reader_params.eval_source,
                model.solver.batchsize_eval,
                model.solver.repeat_dataset,
                eval=True,
            )
        )


def next_batch(reader):
    """This rank's slice of the next global batch (None at the end of an epoch-mode source)."""
    try:
        batch = next(reader)
    except StopIteration:
        return None
    return batch  # the reader already hands out this rank's rows


def next_train_batch(model):
    """The next training batch: through the device stager on a GPU-style step (the batch after it
    already uploading, numbactr.data.staging), else straight from the reader."""
    stager = stager_for_step(model)
    if stager is None:
        return next_batch(model._train_reader)
    return stager.next(model._train_reader, functools.partial(fetch_for_staging, model))


def fetch_for_staging(model, reader):
    batch = next_batch(reader)
    if batch is not None and model.half is not None:  # checked and converted on the host
        precision.check_dense_input(batch.dense, model.half)
        batch.dense = np.asarray(batch.dense).astype(model.half)
    return batch


def stager_for_step(model):
    """A DeviceStager when batches can live on the device for the whole step: the kernels and only
    SparseEmbeddings whose lookups read nothing back (no collection, no hybrid embedding). On several ranks
    the stager keeps each batch's host arrays as mirrors of its device arrays: the sharded embeddings
    route the keys on the host from them, without a device read."""
    if not staging.staging_enabled() or model.collections:
        return None
    if not all(getattr(getattr(e, "engine", None), "defer_checks", False) for e in model.embeddings):
        return None
    mirrors = model.ranks > 1
    if model._stager is None or model._stager.kind != device.kind() or model._stager.host_mirrors != mirrors:
        if model._stager is not None:
            model._stager.close()
        model._stager = staging.DeviceStager(host_mirrors=mirrors)
    return model._stager


def train(model) -> bool:
    """One training iteration (Model.train, inside its TF32 and device-choice scope); False when an
    epoch-mode reader is exhausted."""
    graph.require_compiled(model, "train")
    start_data_reading(model)
    batch = next_train_batch(model)
    model._dropped_rows = 0
    while (
        batch is not None and batch.global_size < batch.batch_size * model.ranks and model.solver.drop_incomplete_batch
    ):
        model._dropped_rows += batch.global_size
        batch = next_train_batch(model)  # HugeCTR skips partial train batches
    if batch is None or batch.global_size == 0:
        return False
    graphs = graphs_for_step(model, batch)
    if graphs is not None:  # the device half captured once, then replayed
        try:
            graphs.step(
                batch,
                cuda_graphs.batch_key(model, batch),
                functools.partial(device_step, model),
                replay_run(model),
                functools.partial(host_snapshot, model),
            )
        finally:
            clear_exchange_keys(model)
        after_device_step(model)
        return True
    tape = Tape(watch_finite=model.half is not None)
    try:
        t = forward_backward(model, batch, tape)
    finally:
        clear_exchange_keys(model)
    # data parallel: dense gradients are summed over ranks (each already carries 1/(b*R))
    if model.ranks > 1:
        # in place: a device array by NCCL (or staged through the host by Comm), a NumPy one by MPI
        model.comm.allreduce_sum(model.wgrads)
    rows = batch.batch_size * model.ranks  # HugeCTR's b: the full (padded) batch
    for layer, _ in model.losses:
        regularizer(model, layer, rows, grad=True)
    # the reported loss uses the weights this step ran with (before the update)
    if not model.solver.gen_loss_summary:
        model.current_loss = 0.0
    elif lazy_loss(model):
        keep_loss(model, t, rows)  # no host read in the step: read when asked for
    else:
        model.current_loss = loss_value(model, t, rows)
    overflow.check_finite_loss(model, t)  # stops before a non-finite step updates any weight
    if (model.step + 1) % model.NONFINITE_CHECK_EVERY == 0:
        model.check_deferred()
    if model.half is not None and overflow.overflow_on_device(model):
        apply_updates(model, overflow.gate(model, tape))  # a skip decided on the device: nothing read
        model.step += 1
        return True
    if model.half is not None and not overflow.grads_finite(model, tape):
        overflow.skip_step(model)
        return True
    apply_updates(model)
    model.step += 1
    return True


def forward_backward(model, batch, tape: Tape) -> dict:
    """Forward, backward from the losses, and every layer's gradient into the flat wgrads; the tensors.
    A full batch runs the model's planned step (numbactr.train.plan) once one is made: the first such
    step runs here with a recorder on, and its record becomes the plan."""
    steps, trace = plan.lookup(model, batch)
    if steps is not None:
        return steps.run(model, batch)
    tracer = plan.Tracer() if trace else None
    with recording(tracer):
        t = forward(model, batch, True, tape, trace=tracer)
    losses = [t[layer.cfg.top_names[0]] for layer, _ in model.losses]
    tape.backward({id(x): (x, g) for x, g in zip(losses, plan.loss_seeds(model, losses))})
    plan.grads_to_flat(model, lambda p: p.grad)
    for layer in model.layers:
        for p in layer.params:
            p.grad = None
    if tracer is not None:
        plan.keep(model, batch, tracer, t)
    return t


def apply_updates(model, gate=None) -> None:
    """The step's dense and sparse updates; with a gate (overflow.gate), every update kernel reads it and
    changes nothing where it is 0."""
    lr = 0.0 if model.dense_frozen else model.lr
    holders = [model.dense_optimizer] + [e.engine for e in model.embeddings]
    for h in holders:
        h.gate = gate
    try:
        model.dense_optimizer.step(model.weights, model.wgrads, lr, model.solver.scaler)
        for emb in model.embeddings:
            emb.update(model.lr, model.solver.scaler)
        for c in model.collections:
            c.update(model.lr, model.solver.scaler)
    finally:
        for h in holders:
            h.gate = None


def graphs_for_step(model, batch):
    """The StepGraphs runner when this step can be a replayed CUDA graph, else None (an eager step, for
    the reason ineligible gives; captured graphs are dropped, since eager work may move their buffers)."""
    why = ineligible(batch, **graph_facts(model))
    if model.ranks > 1:
        why = agree_on_step(model, batch, why)
    if why is not None:
        if model._graphs is not None:
            model._graphs.drop(why)
        return None
    if model._graphs is None:
        model._graphs = cuda_graphs.StepGraphs()
    return model._graphs


def graph_facts(model) -> dict:
    """What ineligible judges a model's steps by, read from the model."""
    graphs = model._graphs
    return dict(
        solver=model.solver,
        embeddings=model.embeddings,
        collections=model.collections,
        ranks=model.ranks,
        comm=model.comm,
        half=model.half,
        gated_on_device=overflow.overflow_on_device(model),
        lazy_loss=lazy_loss(model),
        staged=model._stager is not None,
        disabled=graphs.disabled if graphs is not None else None,
    )


def ineligible(
    batch,
    *,
    solver,
    embeddings,
    collections,
    ranks: int,
    comm,
    half,
    gated_on_device: bool,
    lazy_loss: bool,
    staged: bool,
    disabled: str | None,
) -> str | None:
    """Why a training step on ``batch`` cannot be a CUDA graph (None: it can). The model's parts: its
    solver, embeddings, collections, ranks and comm, its half dtype (None in float32); gated_on_device:
    an overflow is skipped on the device (overflow.overflow_on_device); lazy_loss: the loss is kept on the
    device; staged: the inputs are staged on the device; disabled: why the model's StepGraphs are off."""
    why = cuda_graphs.unavailable(solver.use_cuda_graph)
    if why is not None:
        return why
    if disabled:
        return disabled
    if half is not None and not gated_on_device:
        return (
            "mixed precision reads its overflow flag every step (stochastic rounding, or an update the "
            "device-side gate does not cover)"
        )
    if collections:
        return "an embedding collection"
    if solver.gen_loss_summary and not lazy_loss:
        return "the loss is read every step"
    if not all(type(e) in (HashEmbedding, OneHotEmbedding) for e in embeddings):
        return "an embedding other than a hash or one-hot SparseEmbedding"
    if ranks > 1 and not sharded.exchange_on_device(comm):
        return "several ranks exchanging through host memory (MPI), not NCCL between GPUs of their own"
    if not staged:
        return "the inputs are not staged on the device"
    if batch.size != batch.batch_size:
        return "a partial batch"
    return None


def agree_on_step(model, batch, why: str | None) -> str | None:
    """Several ranks, before a training step: one host collective (no device read) in which every rank
    says whether its step can be a CUDA graph (``why`` is None) and, for each sharded SparseEmbedding,
    its part of the step's fixed exchange key (HashEmbedding.exchange_key_part). A table whose parts
    are all known gets the joined key for this step's lookup (numbactr.embedding.sharded: its input_dist
    counts are then exchanged once per key, not every step). Returns why the step cannot be a graph
    on every rank (None: it can, on all of them): a graph replays NCCL calls, so the ranks capture and
    replay together, and only with every exchange's sizes fixed by a plan already made."""
    tables = [(e, e._sharded) for e in model.embeddings if getattr(e, "_sharded", None) is not None]
    plannable = any(
        getattr(e, "exchange_key_part", None) is not None and getattr(e, "by_slot", False) for e, _ in tables
    )
    capturable = cuda_graphs.may_capture(model.solver.use_cuda_graph)
    if not plannable and not capturable:
        return why  # no plan to make, no graph on any rank: no collective needed
    parts = [0 if why is None else 1]
    for emb, _ in tables:
        keys, offsets = batch.sparse[model.sparse_inputs[emb.cfg.bottom_name]]
        part = getattr(emb, "exchange_key_part", None)
        parts.append(part(keys, offsets) if part is not None else -1)
    every = model.comm.allgather_rows(np.array([parts], np.int64))  # (R, 1 + tables)
    planned = True
    graph_step = capturable and not every[:, 0].any()  # every rank's step may be a graph
    for t, (_, table) in enumerate(tables):
        key = table.step_key(every[:, 1 + t])
        if key is not None and key[0] == table.GATHERED and not graph_step:
            key = None  # (the gathered exchange moves R times the bytes: for graph steps only)
        table.fixed_key = key
        planned = planned and table.ready(key)
    if why is not None:
        return why
    if every[:, 0].any():
        return "another rank's step cannot be a graph"
    if not planned:
        return (
            "a sharded embedding's exchange sizes are not fixed (multi-hot bags, or ranks with batches of "
            "different sizes), or its plan is made in this step"
        )
    return None


def clear_exchange_keys(model) -> None:
    """The step's fixed exchange keys are for its own lookups only (an evaluation's are not planned)."""
    for e in model.embeddings:
        table = getattr(e, "_sharded", None)
        if table is not None:
            table.fixed_key = None


def drop_graphs(model, why: str) -> None:
    """Forget the captured steps before work that may reallocate what they point to (an evaluation
    batch can grow the embeddings' scratch; a load can replace arrays): they are captured again after
    the warm-up steps."""
    if model._graphs is not None:
        model._graphs.drop(why)


def replay_run(model) -> dict:
    """What a replayed step's host halves need (numbactr.runtime.step_values.on_replay): this step's number
    (0-based, as RunInfo.step), learning rates and the loss scaler."""
    return {
        "step": model.step,
        "lr": model.lr,
        "dense_lr": 0.0 if model.dense_frozen else model.lr,
        "scaler": model.solver.scaler,
    }


def host_snapshot(model):
    """Save what a graph step's Python changes on the host before its device work (the counters its
    replay hooks advance); returns the function that puts it back (a failed capture)."""
    dense_t = model.dense_optimizer.t
    engines = [(e.engine, e.engine.step) for e in model.embeddings]
    calls = model.comm.calls  # collectives a failed capture entered ran nothing

    def restore():
        model.dense_optimizer.t = dense_t
        model.comm.calls = calls
        for eng, step in engines:
            eng.step = step

    return restore


def device_step(model, batch) -> None:
    """The device half of a graph-eligible step (the loss kept on the device; on several ranks the dense
    gradients' and the loss's sums over NCCL and the embeddings' planned exchanges): what a CUDA graph
    captures. Everything it does on the host is registered for replays."""
    calls = model.comm.calls
    tape = Tape(watch_finite=model.half is not None)
    t = forward_backward(model, batch, tape)
    # a replay's tensors are its capture's (check_out_tensor, the non-finite diagnosis), not those of the
    # graph captured last
    step_values.on_replay(("tensors", id(model)), lambda run: model._last_tensors.__setitem__(True, t))
    if model.ranks > 1:  # NCCL, enqueued on the step's stream (captured with it)
        model.comm.allreduce_sum(model.wgrads)
    rows = batch.batch_size * model.ranks
    for layer, _ in model.losses:
        regularizer(model, layer, rows, grad=True)
    if model.solver.gen_loss_summary:
        keep_loss(model, t, rows)
        kept = model._pending_loss
        step_values.on_replay(("loss", id(model)), lambda run: setattr(model, "_pending_loss", kept))
    else:
        model.current_loss = 0.0
    overflow.note_nonfinite_loss(
        model,
        model._pending_loss[0] if model._pending_loss is not None else overflow.losses_array(model, t),
        model.step + 1,
    )
    apply_updates(model, overflow.gate(model, tape) if model.half is not None else None)
    entered = model.comm.calls - calls
    if entered:  # a replay enters the same collectives (the job guard counts them)
        comm = model.comm
        step_values.on_replay(("collectives", id(model)), lambda run: setattr(comm, "calls", comm.calls + entered))


def after_device_step(model) -> None:
    """The host half of a graph step: the step count and the periodic reads of the device flags (after
    the step's work was queued, where the eager step reads them before its update)."""
    model.step += 1
    if model.step % model.NONFINITE_CHECK_EVERY == 0:
        model.check_deferred()
        overflow.read_nonfinite_flag(model, model._last_tensors.get(True, {}), model.step)
