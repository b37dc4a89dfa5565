"""The inference column of ``numbactr bench zoo``: each zoo model served by numbactr's InferenceSession beside
onnxruntime running the same model exported to ONNX, at batch 1 to 4096.

What a HugeCTR user does, model by model (numbactr/bench/zoo_models.py builds them):

1. train: the model built through the HugeCTR API, its embedding tables filled with every key the requests
   can draw (N(0, 0.05) vectors, so no request meets an unknown key) and trained a few steps on synthetic
   batches, so that the weights are not the initial ones;
2. save: ``model.graph_to_json`` and ``model.save_params_to_files`` into a temporary folder (the graph JSON,
   the dense model, one sparse model folder per embedding);
3. serve: ``CreateInferenceSession(graph, InferenceParams(...))`` on those files (embedding cache on, 100%
   of the tables, filled at start), and the same files converted to ONNX by numbactr.onnx_converter (what
   ``numbactr export-onnx`` writes, kept in memory) in an onnxruntime CPU session with as many intra-op
   threads as the thread column (numbactr.onnx_converter.runtime.OnnxPredictor).

Both answer the same request, HugeCTR's CSR request of one batch of the spec's shape (dense features, the
keys of every table in graph order, the row pointers): ``InferenceSession.predict(dense_feature,
embeddingcolumns, row_ptrs)`` and ``OnnxPredictor.predict_csr`` (the same arguments, padded to the ONNX
model's (B, S, W) key input inside). They are called alternately (numbactr.bench.inference.timed_pair, so
both see the same machine), and each row gives the median call. ratio = numbactr's samples/s over
onnxruntime's (> 1: numbactr faster). Once per model, at the largest batch, the two predictions are
compared (``numpy.allclose`` at rtol 1e-5, atol 1e-6) and the largest absolute difference is reported.

A model that numbactr cannot serve or the exporter cannot convert keeps its rows, with the reason in the
note column (its end) and in full in the table's notes.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile

import numpy as np

from numbactr.bench.common import Env, Table, thread_count

COLUMNS = ["impl", "model", "threads", "batch", "ms", "samples/s", "ratio", "max abs diff", "note"]
FULL_BATCHES = (1, 16, 256, 4096)
QUICK_BATCHES = (1, 64)
RTOL, ATOL = 1e-5, 1e-6
TRAIN_BATCH, TRAIN_STEPS = 64, 3
NOTE_CHARS = 90  # the end of an error message kept in the row (the whole message goes to the notes)


def save_trained(hugectr, spec, folder: str, *, seed: int = 0, steps: int = TRAIN_STEPS) -> dict:
    """Build the spec's model, fill its tables, train ``steps`` steps and save it as a HugeCTR user does:
    {"graph": graph JSON, "dense": dense model file, "sparse": [sparse model folder per embedding]}."""
    from numbactr.bench import zoo_models as Z

    with contextlib.redirect_stdout(io.StringIO()):
        model = Z.build(hugectr, spec, TRAIN_BATCH, seed=seed)
    rng = np.random.default_rng(seed)
    tables = {
        name: rng.normal(0.0, 0.05, (sum(spec.slots(bottom)), vec)).astype(np.float32)
        for name, bottom, vec in spec.embeddings
    }
    Z.load_embeddings(model, spec, tables)
    Z.feed(model, Z.make_batches(spec, TRAIN_BATCH, 2, seed=seed))
    for _ in range(steps):
        model.train()
    os.makedirs(folder, exist_ok=True)
    graph, prefix = os.path.join(folder, "graph.json"), os.path.join(folder, "model")
    with contextlib.redirect_stdout(io.StringIO()):
        model.graph_to_json(graph)
        model.save_params_to_files(prefix, steps)
    return dict(
        graph=graph,
        dense=f"{prefix}_dense_{steps}.model",
        sparse=[f"{prefix}{i}_sparse_{steps}.model" for i in range(len(model.embeddings))],
    )


def csr_request(spec, batch: int, seed: int = 1) -> tuple:
    """HugeCTR's CSR request of one synthetic batch of the spec's shape (zoo_models.make_batches):
    (dense_feature (B * dense,), embeddingcolumns (the keys of every embedding's table, graph order),
    row_ptrs (per table B * S_t + 1 of them, from 0))."""
    from numbactr.bench import zoo_models as Z

    b = Z.make_batches(spec, batch, 1, seed=seed)[0]
    by_input = {name: kv for (name, _), kv in zip(spec.inputs, b.sparse)}
    keys = np.concatenate([by_input[bottom][0] for _, bottom, _ in spec.embeddings])
    ptrs = np.concatenate([by_input[bottom][1] for _, bottom, _ in spec.embeddings])
    return np.ascontiguousarray(b.dense, np.float32).reshape(-1), keys.astype(np.int64), ptrs.astype(np.int64)


def open_session(files: dict, name: str, max_batch: int):
    """numbactr's InferenceSession on the saved files: the RAM embedding cache (the cpu device's) holding
    the whole tables from the start, 64-bit keys."""
    from numbactr.inference.params import InferenceParams
    from numbactr.inference.session import CreateInferenceSession

    params = InferenceParams(
        model_name="zoo_" + (re.sub(r"[^A-Za-z0-9_-]", "", name) or "model"),
        max_batchsize=max_batch,
        hit_rate_threshold=1.0,
        dense_model_file=files["dense"],
        sparse_model_files=files["sparse"],
        use_gpu_embedding_cache=True,
        cache_size_percentage=1.0,
        i64_input_key=True,
        init_ec=True,
        cache_refresh_percentage_per_iteration=0.1,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        return CreateInferenceSession(files["graph"], params)


def export(files: dict):
    """The saved files converted to ONNX (numbactr.onnx_converter, embeddings included), in memory."""
    from numbactr.onnx_converter.export import load_trained_model, model_to_onnx

    with contextlib.redirect_stdout(io.StringIO()):
        return model_to_onnx(load_trained_model(files["graph"], files["dense"], files["sparse"]), True)


def _why(e: Exception) -> str:
    """An exception as one line: its type and message."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _short(text: str) -> str:
    """A reason for a cell: who failed and the cause (numbactr's errors name the place first, then the
    cause after the last "): "), cut to NOTE_CHARS; the notes keep the whole message."""
    if "): " in text:
        text = text.split(": ", 1)[0] + ": " + text.rsplit("): ", 1)[1] + " (notes)"
    return text if len(text) <= NOTE_CHARS else text[: NOTE_CHARS - 3] + "..."


class Served:
    """One model's two servers, made once per model: ``session`` (or None, ``session_why``), ``onnx`` (the
    ModelProto, or None, ``onnx_why``) and the agreement of their predictions (``check``)."""

    def __init__(self, spec, folder: str, max_batch: int, seed: int):
        import numbactr as hugectr

        self.spec, self.diff, self.agree = spec, None, None
        self.session = self.onnx = None
        self.session_why = self.onnx_why = ""
        try:
            files = save_trained(hugectr, spec, folder, seed=seed)
        except Exception as e:  # noqa: BLE001 (the benchmark goes on; the row says why)
            self.session_why = self.onnx_why = f"not trained/saved: {_why(e)}"
            return
        try:
            self.session = open_session(files, spec.name, max_batch)
        except Exception as e:  # noqa: BLE001
            self.session_why = f"InferenceSession: {_why(e)}"
        try:
            self.onnx = export(files)
        except Exception as e:  # noqa: BLE001
            self.onnx_why = f"ONNX export: {_why(e)}"

    def predictor(self, n_threads: int):
        """An OnnxPredictor with ``n_threads`` intra-op threads, or None (``onnx_why`` says why)."""
        if self.onnx is None:
            return None
        from numbactr.onnx_converter.runtime import OnnxPredictor

        try:
            return OnnxPredictor(self.onnx, n_threads)
        except Exception as e:  # noqa: BLE001 (no onnxruntime, or it refuses the model)
            self.onnx_why, self.onnx = f"onnxruntime: {_why(e)}", None
            return None

    def check(self, ort, request, n: int) -> None:
        """Compare both predictions of ``request`` (``n`` samples) once: diff (max abs difference) and
        agree (allclose)."""
        if self.diff is not None or self.session is None or ort is None:
            return
        ours = np.asarray(self.session.predict(*request), np.float64).reshape(n, -1)
        theirs = np.asarray(ort.predict_csr(*request), np.float64)
        self.diff = float(np.abs(ours - theirs).max()) if ours.shape == theirs.shape else float("inf")
        self.agree = ours.shape == theirs.shape and bool(np.allclose(ours, theirs, rtol=RTOL, atol=ATOL))

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def times(served: Served, ort, request, min_time: float) -> tuple:
    """(numbactr's, onnxruntime's) median seconds of one request, called alternately; None for a side that
    cannot serve the model."""
    from numbactr.bench.inference import timed, timed_pair

    if served.session is not None and ort is not None:
        ours, theirs = timed_pair(served.session.predict, ort.predict_csr, [request], min_time)
        return float(np.median(ours)), float(np.median(theirs))
    if served.session is not None:
        return float(np.median(timed(served.session.predict, [request], min_time))), None
    if ort is not None:
        return None, float(np.median(timed(ort.predict_csr, [request], min_time)))
    return None, None


def serve_model(env: Env, spec, batches, threads, min_time: float, seed: int) -> tuple:
    """(rows, notes) of one model: per thread count and batch a numbactr row and an onnxruntime row
    [impl, model, threads, batch, ms, samples/s, ratio, max abs diff, note], and its failures in full."""
    rows = []
    requests = {b: csr_request(spec, b, seed + 1) for b in batches}
    with tempfile.TemporaryDirectory(prefix="numbactr-zoo-infer-") as folder:
        served = Served(spec, folder, max(batches), seed)
        try:
            for n in threads:
                with thread_count(env, n):
                    ort = served.predictor(n or _compute_threads())
                    served.check(ort, requests[max(batches)], max(batches))
                    for b in batches:
                        t, tt = times(served, ort, requests[b], min_time)
                        ratio = tt / t if t is not None and tt is not None else None
                        differ = (
                            "" if served.agree is not False else f"predictions differ (rtol {RTOL:g}, atol {ATOL:g})"
                        )
                        for impl, sec, why in (
                            ("numbactr", t, served.session_why),
                            ("onnxruntime", tt, served.onnx_why),
                        ):
                            ms, rate = (None, None) if sec is None else (1e3 * sec, b / sec)
                            rows.append([impl, spec.name, n, b, ms, rate, ratio, served.diff, _short(why) or differ])
        finally:
            served.close()
    return rows, [f"{spec.name}: {why}" for why in (served.session_why, served.onnx_why) if why]


def _compute_threads() -> int:
    from numbactr.runtime import threads

    return threads.current().compute


def bench_zoo_infer(
    env: Env, names, *, batches=FULL_BATCHES, threads=(1, 2), min_time: float = 0.5, seed: int = 0, out=None
) -> Table:
    """The Table "Zoo inference (device)": every model of ``names`` (zoo_models.SPECS) served by numbactr and
    onnxruntime at each of ``threads`` and ``batches`` (module docstring)."""
    import sys

    from numbactr.bench import zoo_models as Z

    out = out or sys.stdout
    tab = Table(f"Zoo inference ({env.kind})", COLUMNS)
    tab.notes = [
        "each model trained 3 steps (batch 64, tables filled with N(0, 0.05) vectors for every id), saved with "
        "graph_to_json + save_params_to_files, served by numbactr's InferenceSession (RAM embedding cache, 100% "
        "of the tables, filled at start) and by onnxruntime (CPUExecutionProvider) on the same files converted "
        "with numbactr.onnx_converter (embeddings included)",
        "both answer HugeCTR's CSR request of one synthetic batch (InferenceSession.predict and "
        "OnnxPredictor.predict_csr: dense features, the tables' keys, row pointers), called alternately; "
        f"ms = the median call (>= {min_time} s of calls each); ratio = numbactr samples/s / onnxruntime "
        "samples/s (> 1: numbactr faster)",
        "threads: numbactr's compute threads (BLAS, numba) and onnxruntime's intra_op_num_threads (one inter-op "
        "thread) set to the column's value",
        f"max abs diff: the two predictions of the batch-{max(batches)} request compared once per model "
        f"(numpy.allclose at rtol {RTOL:g}, atol {ATOL:g}; a mismatch is named in the note column)",
    ]
    for name in names:
        rows, notes = serve_model(env, Z.SPECS[name], tuple(batches), tuple(threads), min_time, seed)
        for r in rows:
            tab.add(*r)
        tab.notes += notes
        ratios = [r[6] for r in rows if r[0] == "numbactr" and r[6] is not None]
        said = f"ratio {min(ratios):.2f}-{max(ratios):.2f}" if ratios else "; ".join(notes) or "no figures"
        print(f"zoo inference {name}: {said}", file=out, flush=True)
    return tab
