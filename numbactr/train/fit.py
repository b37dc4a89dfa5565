"""The loops over a Model's data: fit() and its evaluations, one evaluation batch, the whole eval source,
what an evaluation leaves to read (export_predictions, check_out_tensor), and the sources the loops read
(set_source, the embedding training cache's passes, ReaderHandle).

Functions take the Model; the steps themselves are numbactr.train.step's. Why the loops call the Model's
public train()/eval() rather than the step functions: each step then runs in the Model's TF32 and
device-choice scope, exactly as a script's own loop of train() calls does.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from numbactr import hugectr_exact
from numbactr.autograd import Tensor
from numbactr.validate import number as _number, warn_ignored
from numbactr.enums import MetricsType, Tensor_t
from numbactr.metrics import row_group_keys
from numbactr.runtime import device
from numbactr import log
from numbactr.data.source import source_names
from numbactr.files import snapshot as snapshot_files
from numbactr.train import graph, step
from numbactr.train.graph import ModelError


def fit(
    model, num_epochs: int, max_iter: int, display: int, eval_interval: int, snapshot: int, snapshot_prefix: str
) -> None:
    """Model.fit: its arguments checked, then fit_loop; the readers paused at the end."""
    graph.require_compiled(model, "fit")
    for name, v in (
        ("num_epochs", num_epochs),
        ("max_iter", max_iter),
        ("display", display),
        ("eval_interval", eval_interval),
        ("snapshot", snapshot),
    ):
        _number("fit", name, v, integer=True)
    s = model.solver
    if s.repeat_dataset and max_iter <= 0:
        raise ModelError("fit: max_iter must be > 0 when repeat_dataset=True")
    if not s.repeat_dataset and num_epochs <= 0 and model.etc is None:
        raise ModelError("fit: num_epochs must be > 0 when repeat_dataset=False (epoch mode)")
    if s.repeat_dataset and num_epochs:
        warn_ignored(
            "Model.fit",
            "num_epochs",
            num_epochs,
            "with repeat_dataset=True fit runs max_iter iterations (epochs need CreateSolver(repeat_dataset=False))",
            stacklevel=3,
        )
    if not s.repeat_dataset and max_iter != 2000:
        warn_ignored(
            "Model.fit",
            "max_iter",
            max_iter,
            "in epoch mode (repeat_dataset=False) fit runs num_epochs passes over the source",
            stacklevel=3,
        )
    check_snapshot_prefix(model, snapshot, max_iter, snapshot_prefix)
    try:
        fit_loop(model, num_epochs, max_iter, display, eval_interval, snapshot, snapshot_prefix)
        model.check_deferred()
    finally:
        # the readers' prefetch threads stop and are joined here (also on an error); each reader keeps
        # its place, so a later train()/eval()/fit() continues its stream as HugeCTR's readers do
        for reader in (model._train_reader, model._eval_reader):
            pause = getattr(reader, "pause", None)  # (a benchmark's batch cycle has no workers)
            if pause is not None:
                pause()


def check_snapshot_prefix(model, snapshot: int, max_iter: int, prefix) -> None:
    """fit's snapshots go to files named ``{prefix}...`` in the prefix's folder: that folder must exist and be
    writable, checked before the first step, so that a bad prefix fails at once and not at the first
    snapshot, after the training it was meant to keep. Nothing is checked when this fit takes no snapshot
    (snapshot <= 0, or max_iter <= snapshot with repeat_dataset). Rank 0 writes snapshots, so rank 0 checks
    and every rank raises (a collective)."""
    if snapshot <= 0 or (model.solver.repeat_dataset and max_iter <= snapshot):
        return
    prefix = str(prefix)
    folder = os.path.dirname(prefix) or "."

    def check():
        where = f"fit: snapshot_prefix {prefix!r}: its folder {os.path.abspath(folder)!r}"
        why = f"(a snapshot every {snapshot} iterations is written there)"
        if not os.path.isdir(folder):
            state = "is not a folder" if os.path.exists(folder) else "does not exist"
            raise ModelError(f"{where} {state} {why}; create it first, or change snapshot_prefix")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ModelError(f"{where} is not writable {why}")

    snapshot_files.on_rank0(model.comm, check, f"fit: snapshot_prefix {prefix!r}")


def fit_loop(
    model, num_epochs: int, max_iter: int, display: int, eval_interval: int, snapshot: int, snapshot_prefix: str
) -> None:
    """fit's loop, after its argument checks."""
    s = model.solver
    log.info("Training source file: " + ", ".join(model.reader_params.source))
    log.info("Evaluation source file: " + model.reader_params.eval_source)
    # HugeCTR calls the training callbacks in iteration mode only (numbactr.config.TrainingCallback)
    callbacks = tuple(s.training_callbacks) if s.repeat_dataset else ()
    for cb in callbacks:
        cb.on_training_start()
    step.start_data_reading(model)
    t_display = time.time()
    it = 0
    epochs = 1 if s.repeat_dataset else num_epochs
    passes = [(list(model.reader_params.source), None)]  # every file list, in order, as one data set
    if model.etc is not None:  # every file list in turn, its keyset first (HugeCTR's ETC mode)
        epochs = max(1, num_epochs)
        passes = list(zip(model.reader_params.source, model.reader_params.keyset))
        log.info(
            f"Use embedding training cache mode with number of training sources: {len(passes)}, "
            f"number of epochs: {epochs}"
        )
    for epoch, (source, keyset) in ((e, p) for e in range(epochs) for p in passes):
        if not s.repeat_dataset:
            model._train_reader = iter(graph.make_reader(model, source, model.solver.batchsize, False))
            if keyset is not None:
                model._etc_cache.update(keyset)
                log.info(f"Training source file: {source}, keyset file: {keyset}")
            log.info(f"-----------------------------------Epoch {epoch}-----------------------------------")
        first = True
        while True:
            if s.repeat_dataset and it >= max_iter:
                for cb in callbacks:
                    cb.on_training_end(max_iter - 1)
                return
            lr = model.lr_scheduler.get_next()
            model.set_learning_rate(lr)
            if not model.train():
                if first and not s.repeat_dataset:
                    dropped = getattr(model, "_dropped_rows", 0)
                    if not dropped:
                        raise ModelError(
                            f"fit: epoch {epoch} trained nothing: the training source "
                            f"{source!r} holds no samples (its files have 0 records)"
                        )
                    # HugeCTR trains nothing here too: legitimate, but worth saying
                    log.warn(
                        f"fit: epoch {epoch} trained nothing: the training source {source!r} holds "
                        f"{dropped} samples, fewer than one batch ({model.solver.batchsize}), and "
                        "drop_incomplete_batch=True drops a partial batch"
                    )
                break
            first = False
            if display > 0 and (it + 1) % display == 0:
                loss = model.get_current_loss()
                if math.isnan(loss):
                    raise FloatingPointError(f"Train loss is NaN at iteration {it + 1}")
                log.info(
                    f"Iter: {it + 1} Time({display} iters): {time.time() - t_display:.6f}s Loss: {loss:.6f} lr:{lr:.6f}"
                )
                model.history["iter"].append(it + 1)
                model.history["loss"].append(loss)
                model.history["lr"].append(lr)
                t_display = time.time()
            if eval_interval > 0 and (it + 1) % eval_interval == 0:
                if evaluate(model, it + 1, callbacks):
                    return
            if snapshot > 0 and it % snapshot == 0 and it != 0:
                model.save_params_to_files(snapshot_prefix, it)
            it += 1


def evaluate(model, it: int, callbacks=()) -> bool:
    """Run max_eval_batches eval batches after `it` steps, log metrics; True when training should stop
    (the AUC target is hit, or a training callback's on_eval_end asked to stop)."""
    for cb in callbacks:
        cb.on_eval_start(it - 1)
    t0 = time.time()
    n, fresh = 0, False
    while n < model.solver.max_eval_batches:
        if not model.eval():
            if fresh:  # a reader just made gave no batch: the source holds no samples
                raise ModelError(
                    f"evaluation: the eval source {model.reader_params.eval_source!r} holds no "
                    "samples (its files have 0 records)"
                )
            model._eval_reader = iter(
                graph.make_reader(model, model.reader_params.eval_source, model.solver.batchsize_eval, False, eval=True)
            )
            if n > 0:
                break
            fresh = True
            continue
        n, fresh = n + 1, False
    target = model.solver.metrics_spec.get(MetricsType.AUC)
    hit = False
    metrics = model.get_eval_metrics()  # read once: reading them resets the accumulators
    if callbacks:
        results = {name: float(value) for name, value in metrics}
        stop = False
        for cb in callbacks:
            stop = bool(cb.on_eval_end(it - 1, results)) or stop
        if stop:
            log.info(f"A training callback stopped training at iteration {it}")
            for cb in callbacks:
                cb.on_training_end(it - 1)
            return True
    for name, value in metrics:
        log.info(f"Evaluation, {name}: {value:.6f}")
        if name == "AUC":
            model.history["eval_iter"].append(it)
            model.history["auc"].append(value)
            if target is not None and value > target:
                log.info(f"Hit target accuracy AUC {target} at {it}/{it} iterations")
                hit = True
    log.info(f"Eval Time for {n} iters: {time.time() - t0:.6f}s")
    return hit


def eval_batch(model) -> bool:
    """One evaluation batch (Model.eval, inside its TF32 and device-choice scope)."""
    graph.require_compiled(model, "eval")
    step.drop_graphs(model, "evaluation")
    model.check_deferred()
    step.start_data_reading(model)
    batch = step.next_batch(model._eval_reader)
    if batch is None or batch.global_size == 0:
        return False
    t = step.forward(model, batch, False, None)
    n = batch.size
    preds, labels, outputs = [], [], []
    for layer, _ in model.losses:
        logits = getattr(layer, "logits", None)
        if model.half is not None and logits is not None and logits.data.dtype != np.float32:
            # mixed precision: the metric's sigmoid/softmax runs in float32 on the half logits
            layer.logits = Tensor(logits.data.astype(np.float32), name=logits.name)
        p = device.to_host(layer.predictions()).reshape(batch.batch_size, -1)[:n]
        y = device.to_host(t[layer.cfg.bottom_names[1]].data).reshape(batch.batch_size, -1)[:n]
        outputs.append(p)
        if p.shape[1] == 2 and y.shape[1] == 1:  # CrossEntropy with class labels: P(class 1)
            p = p[:, 1:]
        preds.append(p)
        labels.append(y)
    preds, labels = np.concatenate(preds, axis=1), np.concatenate(labels, axis=1)
    outputs = np.concatenate(outputs, axis=1)
    loss = step.loss_value(model, t, batch.batch_size * model.ranks, None if hugectr_exact.hugectr_exact() else n)
    groups = None
    if model.metrics.wants_group_keys:  # each valid row's group (user): the key of CreateSolver's eval_group_slot
        slots = [sp.slot_num for sp in model.input.sparse]
        who = f"eval_group_slot={model.solver.eval_group_slot} (eval source {model.reader_params.eval_source!r})"
        groups = row_group_keys(batch.sparse, slots, model.solver.eval_group_slot, n, who, device.to_host)
    if model.ranks > 1:  # every rank scores the whole global eval batch
        preds, labels = model.comm.allgather_rows(preds), model.comm.allgather_rows(labels)
        outputs = model.comm.allgather_rows(outputs)
        groups = None if groups is None else model.comm.allgather_rows(groups)
    model.metrics.add(preds, labels, loss, groups)
    model._last_eval = (outputs, labels)
    return True


def export_predictions(model, output_prediction_file_name: str, output_label_file_name: str) -> None:
    """HugeCTR's export: the predictions and labels of the last evaluated batch (its valid rows),
    appended to the two text files as HugeCTR writes them: every value in C++'s default float
    format (6 significant digits, ``%g``) followed by one space, row-major, no newline.

    Predictions are what the inference API returns for the same samples: each loss layer's
    activation (sigmoid for BinaryCrossEntropy and MultiCrossEntropy, the (B, 2) softmax for
    CrossEntropy), loss layers side by side in graph order; labels the loss layers' label columns in
    the same order. HugeCTR refuses models with several labels; numbactr writes them (a superset).
    Only rank 0 writes; every rank holds the whole global batch (eval gathers it)."""
    graph.require_compiled(model, "export_predictions")
    if model._last_eval is None:
        raise ModelError(
            "Model.export_predictions: no evaluation batch yet; it exports the last batch that "
            "eval() (or fit's evaluation) scored"
        )
    preds, labels = model._last_eval
    if model.comm.rank != 0:
        return
    for path, values in ((output_prediction_file_name, preds), (output_label_file_name, labels)):
        try:
            with open(path, "a") as f:
                f.write("".join(f"{v:g} " for v in np.asarray(values, np.float32).reshape(-1).tolist()))
        except OSError as e:
            raise ModelError(f"Model.export_predictions: cannot open output file {path!r} ({e})") from None


def check_out_tensor(model, tensor_name: str, tensor_type) -> np.ndarray:
    """A host float32 copy of tensor ``tensor_name`` as the last training step (Tensor_t.Train) or
    evaluation batch (Tensor_t.Evaluate) computed it, HugeCTR's shape with dim 0 over all ranks
    (every rank gets the whole tensor). Any tensor a layer, an embedding or the Input made, labels
    and dense included (not sparse inputs or loss values, as in HugeCTR). HugeCTR's backward
    overwrites many train tensors with their gradients in place; numbactr returns the forward
    values."""
    graph.require_compiled(model, "check_out_tensor")
    if not isinstance(tensor_type, Tensor_t):
        raise ModelError(f"Model.check_out_tensor: tensor_type must be a Tensor_t, got {tensor_type!r}")
    losses = {layer.cfg.top_names[0] for layer, _ in model.losses}
    if tensor_name not in model.shapes or tensor_name in model.sparse_inputs or tensor_name in losses:
        known = sorted(n for n in model.shapes if n not in model.sparse_inputs and n not in losses)
        raise ModelError(f"Model.check_out_tensor: cannot find tensor with name {tensor_name!r}; tensors: {known}")
    training = tensor_type == Tensor_t.Train
    if tensor_name in model._fused_tops and model._last_fused.get(training):
        raise ModelError(
            f"Model.check_out_tensor: {tensor_name!r} is not kept on this device: the op that makes it "
            f"runs fused with the one after it (which gives {model._fused_tops[tensor_name]!r}); "
            "set NUMBACTR_FUSE_BIAS_RELU=0 (NUMBACTR_PLAN_FUSE=0 for a planned step's fusions) to keep it"
        )
    t = model._last_tensors.get(training)
    if t is None:
        raise ModelError(
            f"Model.check_out_tensor: no {'training step' if training else 'evaluation batch'} "
            f"has run yet, so {tensor_name!r} holds nothing"
        )
    a = np.asarray(device.to_host(t[tensor_name].data), np.float32).reshape((-1,) + model.shapes[tensor_name][1:])
    return model.comm.allgather_rows(a) if model.ranks > 1 else a.copy()


def eval_whole_source(model) -> list[tuple[str, float]]:
    """numbactr extra: evaluate every sample of the eval source exactly once; returns the metrics."""
    graph.require_compiled(model, "eval_whole_source")
    model.metrics.reset()
    model._eval_reader = iter(
        graph.make_reader(model, model.reader_params.eval_source, model.solver.batchsize_eval, False, eval=True)
    )
    with log.progress(desc="eval, whole source", unit="batch") as bar:
        while model.eval():
            bar.update(1)
    model._eval_reader = None
    return model.get_eval_metrics()


def set_source(model, source, keyset=None, eval_source=None) -> None:
    """Epoch mode: read these file lists from now on (the next train()/eval() start a fresh pass).

    HugeCTR's two forms: ``set_source(source: str, eval_source: str)`` (epoch mode), and with the
    embedding training cache ``set_source(source: list, keyset: list, eval_source: str)``."""
    if model.etc is None and eval_source is None and isinstance(keyset, str):
        keyset, eval_source = None, keyset  # set_source(source, eval_source) positionally
    if model.solver.repeat_dataset:
        raise ModelError("Model.set_source is for epoch mode (CreateSolver(repeat_dataset=False))")
    if eval_source is None:
        raise ModelError("Model.set_source: eval_source is required")
    step.drop_graphs(model, "a new source")
    if model.etc is None:
        if keyset is not None:
            raise ModelError(
                "Model.set_source: keyset files are for the embedding training cache "
                "(Model(..., etc=CreateETC(...))); use set_source(source, eval_source)"
            )
        try:
            lists = source_names(source)  # one file list, or several read in order as one data set
        except ValueError as e:
            raise ModelError(f"Model.set_source: {e}") from None
        model.reader_params.source, model.reader_params.eval_source = lists, str(eval_source)
    else:
        if isinstance(source, str) or isinstance(keyset, str) or keyset is None:
            raise ModelError(
                "Model.set_source with the embedding training cache takes lists: "
                "set_source(source=[file lists], keyset=[keyset files], eval_source=...)"
            )
        source, keyset = [str(x) for x in source], [str(x) for x in keyset]
        if len(source) != len(keyset):
            raise ModelError(
                f"Model.set_source: {len(source)} sources but {len(keyset)} keyset files; "
                "give one keyset file per source"
            )
        etc_take_reader_keysets(model)
        model.reader_params.source, model.reader_params.keyset = source, keyset
        model.reader_params.eval_source = str(eval_source)
        model._etc_inc_files += keyset
    model._train_reader = model._eval_reader = None


def etc_take_reader_keysets(model) -> None:
    if model._etc_reader_keysets_pending:
        model._etc_inc_files += list(model.reader_params.keyset)
        model._etc_reader_keysets_pending = False


def get_incremental_model(model) -> list:
    """ETC: per embedding, (keys (n,) int64, vectors (n, D) float32) of the keys in the keyset files
    of the sources trained since the last call (this rank's part of the table)."""
    graph.require_compiled(model, "get_incremental_model")
    if model.etc is None:
        raise ModelError("Model.get_incremental_model is only supported with the embedding training cache")
    model.check_deferred()
    etc_take_reader_keysets(model)
    files, model._etc_inc_files = model._etc_inc_files, []
    return model._etc_cache.incremental(files)


class ReaderHandle:
    """What ``get_data_reader_train()/get_data_reader_eval()`` return: HugeCTR's reader controls."""

    def __init__(self, model, train: bool):
        self.model, self.train = model, train

    def set_source(self, file_name: str = "") -> None:
        """Restart from the first sample of ``file_name`` ("" = the current source)."""
        m, p = self.model, self.model.reader_params
        if self.train:
            if file_name:
                p.source = [file_name]
            m._train_reader = iter(graph.make_reader(m, p.source[0], m.solver.batchsize, m.solver.repeat_dataset))
        else:
            if file_name:
                p.eval_source = file_name
            m._eval_reader = iter(
                graph.make_reader(m, p.eval_source, m.solver.batchsize_eval, m.solver.repeat_dataset, eval=True)
            )

    def is_started(self) -> bool:
        return (self.model._train_reader if self.train else self.model._eval_reader) is not None
