"""CUDA graphs of the training step (the device half of a step captured once and replayed every step) and of
the inference forward (ForwardGraphs).

A DLRM step on a GPU is ~40 numba launches, a few CuPy operations and cuBLAS GEMMs, each costing 5-50 µs of
Python to enqueue; at batch 64K that host time is a large part of the step. A CUDA graph enqueues the whole
step with one call. ``NUMBACTR_CUDA_GRAPHS=1`` turns it on (``0``, the default, keeps eager steps);
HugeCTR's own switches, ``CreateSolver(use_cuda_graph=False)`` and ``InferenceParams(use_cuda_graph=False)``,
turn it off for one model.

The default stays off until a GPU run has compared replayed and eager training. What the design rests on,
each tested without a GPU:

* Every launch of a step has the same arguments every step: the values that change (learning rate, Adam's
  t and bias corrections, stochastic-rounding salts, the dropout step, the step number of the non-finite
  flag) are read from device arrays (numbactr.runtime.step_values), and every launch goes to the stream that
  ``kernels.launch.on_stream`` names. ``tests/test_step_counts.py`` records the simulator's launches of
  three steps and checks they are identical while the learning rate changes.
* What a step does on the host is registered while it is captured (``step_values.on_replay``) and run
  before each replay (Adam's t, the engines' step counters and learning rates, this step's device values,
  the kept loss). ``tests/test_cuda_graphs.py`` records a step on the simulator and checks that the
  registered host halves alone bring the next step's device values and counters to what an eager step
  brings them to.
* No host read inside the step (``tests/test_step_counts.py``: 0 reads).

How a step runs (``StepGraphs.step``): the first ``WARMUP`` eligible steps run eagerly (first-call
allocations, uploads and JIT compilation happen there, never inside a capture). Then, per key (the input
arrays' addresses and shapes: the stager alternates between two buffer sets, so there are two graphs), one
step is captured on its own stream with its own CuPy memory pool (the graph's temporaries stay reserved
for it), its host values uploaded, and the graph launched; later steps with that key run their host halves
and launch the graph. A third key after the graphs have replayed (frozen layers, a new scaler, a new source's
buffers) drops them and is warmed up and captured in turn; a third key before any replay turns graphs off for
the run (keys that never repeat). Any step that is not eligible (numbactr.train.step.ineligible: a partial
batch, another key count, a loss read every step, frozen flags changed, mixed precision whose overflow is read
on the host, ...) runs eagerly and drops the graphs: eager work may reallocate buffers that a graph points to.

Several ranks: a graph then holds the step's NCCL calls (the dense gradients' and the loss's sums, the
sharded tables' exchanges), so every rank must capture and replay the same steps, and every transfer must
have the same size in every replay. ``numbactr.train.step.agree_on_step`` makes the decision a collective: one MPI
allgather per step of each rank's verdict and of its tables' fixed exchange keys, and a step is a graph on
every rank or on none. The exchanges' sizes are fixed: in a slot-owned table
(LocalizedSlotSparseEmbeddingHash/OneHot) whose bags hold one key each the owners follow from the bag count,
and numbactr.embedding.sharded keeps the exchange plan (grouping and receive counts) from the first step; a
key-owned table (DistributedSlotSparseEmbeddingHash), whose owners depend on the keys, takes the gathered
exchange instead (allgather of the keys, lookup of the owned ones, reduce-scatter of the vectors: HugeCTR's
own wires for it, fixed in size) when every rank has as many keys, so a planned step enqueues device work
and NCCL calls only. Multi-hot bags of a slot-owned table, key counts that differ between ranks, and ranks
that exchange through host memory (no NCCL) stay eager. The sizes are checked on the
simulator (tests/test_step_counts.py: the ranks agree, capture and replay together, and every planned step
launches the same kernels and the same collectives with the same row counts); NCCL inside a captured graph is
not yet run on GPUs. A capture that fails (an operation that cannot be captured) is logged once and turns
graphs off for the run; the step it was in runs eagerly.
"""

from __future__ import annotations

import os

from numbactr.runtime import device, step_values
from numbactr.runtime.device import CUPY_NOSYNC_SORT, cupy_sort_synchronizes  # noqa: F401 (patched here by tests)
from numbactr import log

ENV = "NUMBACTR_CUDA_GRAPHS"


def graphs_wanted() -> bool:
    flag = os.environ.get(ENV, "0").strip()
    if flag not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {flag!r}")
    return flag == "1"


def unavailable(use_cuda_graph: bool) -> str | None:
    """Why no step can be captured here at all (None: steps may be): not asked for (NUMBACTR_CUDA_GRAPHS,
    the solver's ``use_cuda_graph``), not on a GPU, or a CuPy whose sorts synchronize."""
    if not graphs_wanted():
        return f"{ENV}=0"
    if not use_cuda_graph:
        return "CreateSolver(use_cuda_graph=False)"
    if device.kind() != "gpu":
        return "not on a GPU"
    if cupy_sort_synchronizes():
        return (
            f"CuPy < {CUPY_NOSYNC_SORT} synchronizes at the end of every sort (the embedding's backward "
            f"sorts): install cupy-cuda12x/13x >= {CUPY_NOSYNC_SORT}"
        )
    return None


def may_capture(use_cuda_graph: bool) -> bool:
    """Can a model's steps be graphs at all: asked for (NUMBACTR_CUDA_GRAPHS=1, and the solver's
    ``use_cuda_graph``) and on a GPU? (numbactr.train.step.agree_on_step gives key-owned tables their
    gathered exchange only then.)"""
    return graphs_wanted() and use_cuda_graph and device.kind() == "gpu"


def _array_key(a) -> tuple:
    ptr = a.data.ptr if hasattr(a, "data") and hasattr(a.data, "ptr") else a.__array_interface__["data"][0]
    return int(ptr), tuple(a.shape), str(a.dtype)


def batch_key(model, batch) -> tuple:
    """What a graph is specific to: the input arrays (address, shape, dtype), the frozen flags, the loss
    scaler (a launch argument), each embedding engine's optimizer kind and weight-decay mode (the update
    kernel a step launches is compiled for them: kernels.tbe.make_update_kernel) and, on several ranks,
    each sharded table's fixed exchange key (the sizes of the NCCL transfers a step enqueues)."""
    arrays = [batch.label, batch.dense] + [x for kv in batch.sparse for x in kv]
    frozen = (model.dense_frozen,) + tuple(bool(getattr(e, "frozen", False)) for e in model.embeddings)
    kinds = tuple(
        (int(o.kind), int(o.weight_decay_mode))
        for o in (getattr(getattr(e, "engine", None), "optimizer", None) for e in model.embeddings)
        if o is not None
    )
    plans = tuple(getattr(getattr(e, "_sharded", None), "fixed_key", None) for e in model.embeddings)
    return tuple(_array_key(a) for a in arrays), frozen, float(model.solver.scaler), kinds, plans


class _Graph:
    def __init__(self, graph, pool, rec, stream):
        self.graph, self.pool, self.rec, self.stream = graph, pool, rec, stream


class StepGraphs:
    """The captured steps of one model (see the module docstring)."""

    WARMUP = 2

    #: graphs kept at once: one per buffer set of the input stager
    MAX_GRAPHS = 2

    def __init__(self):
        self.graphs: dict = {}
        self.eager = 0  # eligible steps run eagerly since the graphs were last dropped
        self.disabled = None  # why graphs are off for this run (a failed capture, changing shapes)
        self.shapes = None  # the input shapes of the captured steps
        self.captures = self.replays = 0
        self.replayed = False  # has a graph replayed since the graphs were last dropped?

    def drop(self, why: str = "") -> None:
        if self.graphs:
            log.info_once(
                ("cuda graphs dropped", why),
                f"CUDA graphs: an eager step ({why}); captured steps dropped, captured again after {self.WARMUP} steps",
            )
        self.graphs.clear()
        self.eager = 0
        self.replayed = False

    def step(self, batch, key, body, run: dict, snapshot) -> None:
        """One training step's device half ``body(batch)``: replayed, captured, or (warming up) eager.
        ``snapshot()`` saves the host state a step changes and returns its restore function (used when a
        capture fails: the step then runs eagerly from where it started)."""
        g = self.graphs.get(key)
        if g is not None:
            g.rec.replay(run)  # host halves: counters, this step's device values
            self._launch(g)
            self.replays += 1
            self.replayed = True
            return
        shapes = tuple(a[1:] for a in key[0])  # (shape, dtype) of each input array
        if self.eager < self.WARMUP:
            self.eager += 1
            self.shapes = shapes
            body(batch)
            return
        churn = len(self.graphs) >= self.MAX_GRAPHS and not self.replayed
        if shapes != self.shapes or churn:
            # another key count (multi-hot inputs), or a new key before any graph replayed (more buffer sets
            # than the stager's): a capture per batch would cost more than it saves, and buffers sized for
            # other shapes may move
            self.disabled = (
                "the step's input shapes change from batch to batch (multi-hot inputs?)"
                if shapes != self.shapes
                else "the step's key (input buffers, frozen flags, scaler, optimizer modes) changes "
                "before its graphs replay"
            )
            log.info(f"CUDA graphs: {self.disabled}; training goes on with eager steps")
            self.graphs.clear()
            body(batch)
            return
        if len(self.graphs) >= self.MAX_GRAPHS:
            # a new key after the graphs served (frozen layers, a new scaler, a new source's buffers): the old
            # graphs go, and the new key is warmed up and captured like the first
            self.drop("the step's key changed: input buffers, frozen flags, scaler or optimizer modes")
            self.eager += 1
            body(batch)
            return
        restore = snapshot()
        try:
            g = self._capture(batch, body)
        except Exception as e:  # noqa: BLE001 - any failure: eager from now on, said once
            self.disabled = f"capture failed ({type(e).__name__}: {e})"
            self.graphs.clear()
            log.warn(f"CUDA graphs: {self.disabled}; training goes on with eager steps ({ENV}=0 silences this)")
            restore()
            body(batch)
            return
        self.graphs[key] = g
        self.captures += 1
        for sv, values in g.rec.uploads:  # the captured step's own values, before its first launch
            sv.put(values)
        self._launch(g)

    def _launch(self, g: _Graph) -> None:
        import cupy

        g.graph.launch(stream=cupy.cuda.get_current_stream())

    def _capture(self, batch, body) -> _Graph:
        rec = step_values.Recording(defer=True)
        with step_values.recording(rec):
            g, _ = capture(lambda: body(batch))
        g.rec = rec
        return g


def bucket_rows(n: int, most: int, least: int = 64) -> int:
    """The rows a forward of n samples runs on: the next power of two, at least ``least``, at most ``most``."""
    return min(most, max(least, 1 << max(n - 1, 0).bit_length()))


class _Forward:
    """One row bucket of ForwardGraphs: its input buffers, how many of their rows may hold old samples,
    its eager runs so far, and (once captured) its graph and output arrays."""

    def __init__(self, buffers):
        self.buffers, self.dirty, self.eager, self.graph, self.out = buffers, 0, 0, None, None


class ForwardGraphs:
    """Captured forwards (the inference session's dense network, HugeCTR's ``use_cuda_graph``).

    A request of n samples runs on ``bucket_rows(n)`` rows: its inputs are copied into that bucket's
    buffers (fixed addresses, rows n.. zeroed), so every request of a bucket launches the same kernels with
    the same arguments, and the bucket's first ``WARMUP`` forwards run eagerly, the next is captured and
    the later ones replay it. The rows are independent in a forward without training (no batch
    statistics), so the padding changes nothing in rows :n. ``run`` returns the forward's output arrays,
    padded (the caller reads rows :n); a replay returns the captured ones, overwritten by each replay. A
    capture that fails turns graphs off for the session (one warning); the forwards are eager from then on.
    """

    WARMUP = 1

    #: the smallest bucket (requests of fewer samples run on this many rows)
    LEAST_ROWS = 64

    def __init__(self, most_rows: int):
        self.most = int(most_rows)
        self.buckets: dict = {}
        self.disabled = None
        self.captures = self.replays = 0

    def run(self, n: int, inputs: list, body) -> dict:
        """``body(buffers)`` -> {name: device array}: the forward of the bucket's input buffers, one per
        input array (n rows each) of ``inputs``."""
        xp = device.xp()
        rows = bucket_rows(n, self.most, self.LEAST_ROWS)
        b = self.buckets.get(rows)
        if b is None:
            b = self.buckets[rows] = _Forward([xp.zeros((rows,) + tuple(a.shape[1:]), a.dtype) for a in inputs])
        for buf, a in zip(b.buffers, inputs):
            if tuple(a.shape[1:]) != tuple(buf.shape[1:]) or a.shape[0] != n or a.dtype != buf.dtype:
                raise ValueError(
                    f"ForwardGraphs: an input of shape {a.shape} ({a.dtype}) for {n} samples does "
                    f"not fit its buffer {buf.shape} ({buf.dtype})"
                )
            buf[:n] = a
            if b.dirty > n:
                buf[n : b.dirty] = 0  # rows an earlier, larger request left there
        b.dirty = n
        if b.graph is not None:
            self._launch(b.graph)
            self.replays += 1
            return b.out
        if self.disabled or b.eager < self.WARMUP:
            b.eager += 1
            return body(b.buffers)
        try:
            graph, out = self._capture(lambda: body(b.buffers))
        except Exception as e:  # noqa: BLE001 - any failure: eager from now on, said once
            self.disabled = f"capture failed ({type(e).__name__}: {e})"
            log.warn(
                f"CUDA graphs of the inference forward: {self.disabled}; forwards go on eagerly "
                f"(use_cuda_graph=False silences this)"
            )
            return body(b.buffers)
        b.graph, b.out = graph, out
        self.captures += 1
        self._launch(graph)
        return out

    def _capture(self, fn):
        with step_values.recording(step_values.Recording(defer=True)):
            return capture(fn)

    def _launch(self, g: _Graph) -> None:
        import cupy

        g.graph.launch(stream=cupy.cuda.get_current_stream())


def capture(fn):
    """Capture ``fn()`` into a CUDA graph: (the _Graph, what fn returned). It runs on its own non-blocking
    stream (behind what the current stream has queued) with its own CuPy memory pool, which keeps the
    graph's temporaries reserved for its replays; numba launches go to that stream too
    (``kernels.launch.on_stream``). Nothing runs until the graph is launched."""
    import cupy
    from numba import cuda

    from numbactr.kernels import launch

    main = cupy.cuda.get_current_stream()
    stream = cupy.cuda.Stream(non_blocking=True)
    ready = cupy.cuda.Event(disable_timing=True)
    ready.record(main)  # the capture stream starts behind what main has queued
    stream.wait_event(ready)
    pool = cupy.cuda.MemoryPool()  # the graph's temporaries: reserved for its replays
    with cupy.cuda.using_allocator(pool.malloc), stream, launch.on_stream(cuda.external_stream(stream.ptr)):
        stream.begin_capture()
        try:
            out = fn()
        except BaseException:
            try:
                stream.end_capture()
            except Exception:  # noqa: BLE001 - fn's error is the one to report
                pass
            raise
        graph = stream.end_capture()
    return _Graph(graph, pool, None, stream), out
