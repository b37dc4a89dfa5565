"""``numbactr bench dlrm --model mlperf``: the MLPerf DLRM shape, numbactr beside an equivalent PyTorch DLRM.

The model (MLPerf's DLRM on Criteo, as HugeCTR's samples build it): 13 dense features, 26 one-hot slots,
bottom MLP 13-512-256-D, dot interaction of the 27 vectors, top MLP 1024-1024-512-256-1, BCE; D = 128
(MLPerf's) or 16. Built through the HugeCTR API (``build_mlperf_dlrm``) and trained with SGD or Adam
(Update_t.Global). On a GPU the batch is 64K (65536) and the tables hold --rows rows in all; on cpu (or
sim) the batch is 2048 and the tables small, so that CI can smoke-test the command.

Reported per (implementation, optimizer):

* **step ms, samples/s**: the median clean step (no timers inside; batches in memory). With CUDA graphs
  asked for (``NUMBACTR_CUDA_GRAPHS=1``) these are the replayed steps' figures, and the ``graphs`` column
  says whether they really were: ``replayed (r/n steps)``, or ``not replayed: <why>`` (a failed capture,
  an ineligible step: numbactr.train.cuda_graphs' ``StepGraphs.disabled`` or numbactr.train.step's ``ineligible``), in which case the
  figures are eager steps'; ``partly replayed`` when only some steps were. ``off`` when not asked for.
* **eager ms** and its **breakdown**, which always comes from eager steps (graphs switched off for them:
  a replayed step runs none of the Python the phase timers wrap). The four parts add up to eager ms:

  - *embedding*: the SparseEmbedding's lookup, its gradient hand-over and its fused backward + update
    (with Update_t.Global and Adam, the all-rows pass too);
  - *GEMMs*: the fully connected layers' forward and backward (ops.Linear, layers.dense.FcBiasAct) less
    the bias / bias+ReLU kernels inside them: the layers' matrix products, with the few copies and casts
    that feed them (fp16 weight casts under --amp). The interaction's products are not in it;
  - *rest*: everything else of the step (the bias/ReLU kernels, interaction, loss, the dense optimizer,
    the input hand-over, Python between the phases);
  - *host gaps*: on a GPU, the eager step's wall time (its clean median) minus the time the device is busy
    with the step. The busy time is measured by enqueuing a whole step behind a gate (a one-thread kernel
    that holds the compute stream until the host has queued the step, then is released from a second
    stream): the device then runs the step back to back, and CUDA events recorded on the compute stream
    at the step's ends and at each phase's ends give the busy time and the phases' device times (rest =
    busy - embedding - GEMMs; the ~70 event records cost the device well under 0.1 ms). A step that makes
    the host wait for the device (a host read) cannot be enqueued behind the gate: the gate then times
    out (after 0.2-1 s), the step is discarded, and after two such steps the breakdown falls back to
    host-clock phases with a device synchronization at each phase's ends, host gaps ``-`` (unmeasured).
    On cpu (and sim) every operation runs when the host calls it, so the device is never left idle by
    the host: host gaps are 0 by definition, the phases are host-clock times of the same timed steps and
    eager ms is those steps' own wall time (Python between operations counts in the phase it runs in).

The embedding's bytes: FBGEMM's count for the rows the batch touches (bench embedding): forward reads
B*26*D*4 and writes as much, backward + update twice that; plus, where the optimizer has HugeCTR's
all-rows pass (Update_t.Global with Adam; MomentumSGD, Nesterov), that pass's traffic: every row in use
read and written with its optimizer states (rows in use x D x (weight bytes + state bytes) x 2; Adam on
float32: 24 bytes an element). SGD has no such pass. The touched rows' optimizer states are not counted
(FBGEMM's convention): the figure is a lower bound. GB/s is those bytes over the embedding phase's time,
and on a GPU also a share of the measured device-to-device copy bandwidth. PyTorch (when installed): the
same widths with one nn.EmbeddingBag per slot, torch.optim.SGD/Adam, on CUDA when numbactr runs on a GPU
(there also its whole step captured as one CUDA graph, the "+graph" row, unless --amp); ``--tf32``
allows TF32 matrix products (numbactr: enable_tf32_compute) and ``--amp`` runs torch under autocast
float16 with a GradScaler (numbactr: use_mixed_precision). No breakdown is measured for torch.

``bench_mlperf`` also leaves the raw figures (seconds, bytes, the graph status) as ``table.records``, one
dict per numbactr row.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import tempfile
import time

import numpy as np
from numba import cuda

SLOTS, DENSE = 26, 13
BOTTOM = (512, 256)  # then D
TOP = (1024, 1024, 512, 256, 1)
#: per device kind: batch, total embedding rows
SIZES = {
    "gpu": dict(batch=65536, rows=8_000_000),
    "cpu": dict(batch=2048, rows=20_000),
    "sim": dict(batch=64, rows=2_000),
}
COLUMNS = [
    "impl",
    "threads",
    "optimizer",
    "D",
    "batch",
    "rows",
    "graphs",
    "step ms",
    "samples/s",
    "eager ms",
    "embedding ms",
    "GEMMs ms",
    "rest ms",
    "host gaps ms",
    "embedding GB/s",
]
#: the gate's polling rounds (an atomic read and a ~1 µs sleep each: 0.2-1 s in all): how long a gated step may take to enqueue
GATE_ROUNDS = 1 << 19
#: gated steps that may time out before the breakdown falls back to synchronized host-clock phases
GATE_FAILURES = 2


def build_mlperf_dlrm(
    hugectr,
    train_list: str,
    eval_list: str,
    *,
    batch: int,
    dim: int = 128,
    optimizer: str = "sgd",
    lr: float = 0.01,
    workspace_mb: int = 64,
    bottom=BOTTOM,
    top=TOP,
    tf32: bool = False,
    amp: bool = False,
    seed: int = 0,
    dropout: float = 0.0,
    embedding_type: str = "DistributedSlotSparseEmbeddingHash",
):
    """The MLPerf DLRM through the HugeCTR API (module docstring); compiled. dropout > 0 adds a Dropout after
    each ReLU of the top MLP (MLPerf's model has none; the tests use it); embedding_type names the
    hugectr.Embedding_t of its one table (the tests also train a slot-owned Localized one)."""
    opt = optimizer.lower()
    if opt not in ("sgd", "adam"):
        raise ValueError(f"bench mlperf: optimizer must be sgd or adam, got {optimizer!r}")
    kw = dict(enable_tf32_compute=True) if tf32 else {}
    if amp:
        kw["use_mixed_precision"] = True
    solver = hugectr.CreateSolver(
        max_eval_batches=1,
        batchsize_eval=batch,
        batchsize=batch,
        lr=lr,
        vvgpu=[[0]],
        repeat_dataset=True,
        i64_input_key=True,
        seed=seed,
        **kw,
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=[train_list],
        eval_source=eval_list,
        check_type=hugectr.Check_t.Sum,
    )
    otype = hugectr.Optimizer_t.Adam if opt == "adam" else hugectr.Optimizer_t.SGD
    optimizer_params = hugectr.CreateOptimizer(
        optimizer_type=otype,
        update_type=hugectr.Update_t.Global,
        **(dict(beta1=0.9, beta2=0.999, epsilon=1e-7) if opt == "adam" else {}),
    )
    model = hugectr.Model(solver, reader, optimizer_params)
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=DENSE,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, SLOTS)],
        )
    )
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=getattr(hugectr.Embedding_t, embedding_type),
            workspace_size_per_gpu_in_mb=workspace_mb,
            embedding_vec_size=dim,
            combiner="sum",
            sparse_embedding_name="sparse_embedding1",
            bottom_name="data1",
            optimizer=optimizer_params,
        )
    )
    L = hugectr.Layer_t
    below = "dense"
    for i, width in enumerate(tuple(bottom) + (dim,), start=1):
        model.add(hugectr.DenseLayer(L.InnerProduct, [below], [f"fc{i}"], num_output=width))
        model.add(hugectr.DenseLayer(L.ReLU, [f"fc{i}"], [f"relu{i}"]))
        below = f"relu{i}"
    model.add(hugectr.DenseLayer(L.Interaction, [below, "sparse_embedding1"], ["interaction1"]))
    below = "interaction1"
    n = len(bottom) + 2
    for i, width in enumerate(top, start=n):
        model.add(hugectr.DenseLayer(L.InnerProduct, [below], [f"fc{i}"], num_output=width))
        if i < n + len(top) - 1:
            model.add(hugectr.DenseLayer(L.ReLU, [f"fc{i}"], [f"relu{i}"]))
            below = f"relu{i}"
            if dropout:
                model.add(hugectr.DenseLayer(L.Dropout, [below], [f"dropout{i}"], dropout_rate=dropout))
                below = f"dropout{i}"
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, [f"fc{n + len(top) - 1}", "label"], ["loss"]))
    model.compile()
    return model


class WallClock:
    """Marks for PhaseTimer on cpu and sim (and a GPU whose gated steps failed): a device synchronization,
    then the host clock."""

    events = False

    def __init__(self, sync=None):
        self.sync = sync or (lambda: None)

    def mark(self):
        self.sync()
        return time.perf_counter()

    @staticmethod
    def seconds(a, b) -> float:
        return b - a


class EventClock:
    """Marks for PhaseTimer on a GPU: a CUDA event recorded on the compute stream (no synchronization; the
    seconds between two marks are read once the device has passed both)."""

    events = True

    def mark(self):
        import cupy

        ev = cupy.cuda.Event()
        ev.record(cupy.cuda.get_current_stream())
        return ev

    @staticmethod
    def seconds(a, b) -> float:
        import cupy

        return cupy.cuda.get_elapsed_time(a, b) / 1e3


class PhaseTimer:
    """The embedding and GEMM phases of numbactr steps (module docstring), timed by marks of ``clock`` (a
    WallClock, EventClock, or a sync function: a WallClock of it) around the phases' entry points, which
    are wrapped for the ``with`` block: the SparseEmbeddings' lookup, hold_gradient and update
    ("embedding"), ops.Linear's and layers.dense.FcBiasAct's forward and backward ("gemm") and, inside a
    gemm phase only, the bias and fused bias+activation kernels ("other": taken out of the gemm phase,
    left to the rest). A phase inside itself counts once; another phase inside one is taken out of it.
    ``seconds()`` sums each phase's own time over the marked calls since ``reset()``."""

    PHASES = ("embedding", "gemm", "other")
    #: the kernels' entry points a dense layer calls besides its matrix products (kernels.bias, kernels.fused_bias_act)
    OTHER = {
        "bias": ("bias_add", "bias_add_cpu", "bias_add_ref", "bias_grad", "bias_grad_cpu", "bias_grad_ref"),
        "fused_bias_act": (
            "bias_act_forward",
            "bias_act_forward_cpu",
            "bias_act_forward_ref",
            "bias_act_backward",
            "bias_act_backward_cpu",
            "bias_act_backward_ref",
        ),
    }

    def __init__(self, model, clock):
        from numbactr import ops
        from numbactr.kernels import bias, fused_bias_act
        from numbactr.layers import dense

        self.clock = clock if hasattr(clock, "mark") else WallClock(clock)
        self.intervals = []  # (phase, mark0, mark1, [(child mark0, child mark1)])
        self._stack = []  # open frames: [phase, mark0, children]
        self._patches = []  # (owner, attribute, original, how: "instance" | "static" | "module", phase)
        for emb in model.embeddings:
            for name in ("lookup", "hold_gradient", "update"):
                self._patches.append((emb, name, getattr(emb, name), "instance", "embedding"))
        for cls in (ops.Linear, dense.FcBiasAct):
            for name in ("forward", "backward"):
                self._patches.append((cls, name, cls.__dict__[name], "static", "gemm"))
        for mod in (bias, fused_bias_act):
            for name in self.OTHER[mod.__name__.rsplit(".", 1)[-1]]:
                self._patches.append((mod, name, getattr(mod, name), "module", "other"))

    def reset(self) -> None:
        self.intervals.clear()

    def seconds(self) -> dict:
        """{phase: seconds of its own} over the calls marked since reset() (for an EventClock: once the
        device has passed the marks)."""
        out = dict.fromkeys(self.PHASES, 0.0)
        s = self.clock.seconds
        for phase, m0, m1, children in self.intervals:
            out[phase] += s(m0, m1) - sum(s(c0, c1) for c0, c1 in children)
        return out

    def _timed(self, fn, phase):
        def run(*a, **k):
            top = self._stack[-1][0] if self._stack else None
            if top == phase or (phase == "other" and top != "gemm"):
                return fn(*a, **k)  # counted by the phase around it (or, outside a gemm phase, the rest)
            m0 = self.clock.mark()
            frame = [phase, m0, []]
            self._stack.append(frame)
            try:
                return fn(*a, **k)
            finally:
                m1 = self.clock.mark()
                self._stack.pop()
                self.intervals.append((phase, m0, m1, frame[2]))
                if self._stack:
                    self._stack[-1][2].append((m0, m1))

        return run

    def __enter__(self):
        for owner, name, orig, how, phase in self._patches:
            if how == "static":
                setattr(owner, name, staticmethod(self._timed(orig.__func__, phase)))
            else:
                setattr(owner, name, self._timed(orig, phase))
        return self

    def __exit__(self, *exc):
        for owner, name, orig, how, _ in reversed(self._patches):
            if how == "instance":
                delattr(owner, name)  # the instance attribute goes; the class's method shows again
            else:
                setattr(owner, name, orig)
        self._stack.clear()


def _gate_kernel(flag, rounds, timed_out):
    """Hold the stream until flag[0] != 0 (set from another stream), polling with an atomic read (never
    hoisted out of the loop) every ~1 µs, at most ``rounds`` times; timed_out[0] = 1 when it gave up."""
    for _ in range(rounds):
        if cuda.atomic.add(flag, 0, 0) != 0:
            timed_out[0] = 0
            return
        cuda.nanosleep(1000)
    timed_out[0] = 1


_GATE_KERNEL = []  # the compiled gate, made by the first StreamGate of the process


class StreamGate:
    """GPU: ``close()`` queues _gate_kernel on the compute stream, so that what the host queues next waits
    behind it; ``open()`` releases it from a second, non-blocking stream (a memset of its flag);
    ``timed_out()`` (after a synchronization) says whether the kernel gave up waiting instead, which it does
    when the host itself waited for the device in between (the work queued behind the gate then ran with
    the host's gaps in it)."""

    def __init__(self, rounds: int = GATE_ROUNDS):
        import cupy
        from numbactr.kernels import launch

        if not _GATE_KERNEL:
            _GATE_KERNEL.append(cuda.jit(_gate_kernel))
        self.kernel = _GATE_KERNEL[0]
        self.rounds = np.int64(rounds)
        self.stream = launch.current_stream()  # numbactr's kernels' stream (0: the default one)
        self.flag = cupy.zeros(1, np.int64)
        self.out = cupy.zeros(1, np.int64)
        self.side = cupy.cuda.Stream(non_blocking=True)
        self.reset_done = cupy.cuda.Event(disable_timing=True)
        self.close()  # compiled and loaded now, not inside a gated step
        self.open()
        cupy.cuda.runtime.deviceSynchronize()

    def close(self) -> None:
        import cupy

        self.flag.fill(0)
        self.reset_done.record(cupy.cuda.get_current_stream())  # before the gate: open() waits for this only
        self.kernel[1, 1, self.stream](self.flag, self.rounds, self.out)

    def open(self) -> None:
        import cupy

        self.side.wait_event(self.reset_done)
        cupy.cuda.runtime.memsetAsync(self.flag.data.ptr, 1, self.flag.nbytes, self.side.ptr)

    def timed_out(self) -> bool:
        return bool(int(self.out.get()[0]))

    @contextlib.contextmanager
    def held(self):
        """What is queued inside waits behind the gate, released on leaving; numba's deallocations (each a
        device synchronization) are deferred inside."""
        with cuda.defer_cleanup():
            self.close()
            try:
                yield
            finally:
                self.open()


def global_pass_bytes(engine) -> int:
    """Bytes a step's HugeCTR all-rows pass moves in an embedding engine (0 when its optimizer has none:
    SGD, or a LOCAL update): every element of every row in use read and written with its per-element
    optimizer states (kernels.tbe.make_global_kernel), rows in use x D x (weight + state bytes) x 2."""
    from numbactr.kernels import tbe

    opt = engine.optimizer
    if not tbe.has_global_pass(opt.kind, opt.update_type):
        return 0
    states = [s for s in engine._state_buffers()[:2] if s is not None]
    per_element = engine.weights.dtype.itemsize + sum(s.dtype.itemsize for s in states)
    elements = sum(int(engine.live_rows(t)) * int(engine.dims[t]) for t in range(len(engine.tables)))
    return 2 * elements * per_element


def embedding_step_bytes(batch: int, dim: int, global_bytes: int = 0) -> int:
    """The embedding's bytes in one step (module docstring): FBGEMM's count of the touched rows, forward
    + backward/update (3 x (B*26*D*4 read + B*26*D*4 written)), plus the all-rows pass's global_bytes."""
    from numbactr.bench.embedding import embedding_bytes

    return 3 * embedding_bytes(batch * SLOTS, 1, dim) + int(global_bytes)


def graph_status(wanted: bool, graphs, steps: int, replays: int, reasons=()) -> tuple:
    """(the graphs cell, whether every measured step was a replayed graph). graphs: the model's StepGraphs
    (or None); steps, replays: the measured steps and how many of them replayed a graph; reasons: what
    numbactr.train.step.ineligible said of them (None where a step was eligible)."""
    if not wanted:
        return "off", False
    why = (
        getattr(graphs, "disabled", None)
        or next((r for r in reversed(list(reasons)) if r), None)
        or "no step was captured"
    )
    if replays <= 0:
        return f"not replayed: {why}", False
    if replays < steps:
        return f"partly replayed ({replays}/{steps} steps; {why})", False
    captures = getattr(graphs, "captures", 0)
    return f"replayed ({replays}/{steps} steps, {captures} capture{'s' if captures != 1 else ''})", True


@contextlib.contextmanager
def _graph_reasons():
    """What numbactr.train.step.ineligible says of each step inside (a list, None for an eligible step)."""
    from numbactr.train import step

    orig, seen = step.ineligible, []

    def recorded(batch, **facts):
        why = orig(batch, **facts)
        seen.append(why)
        return why

    step.ineligible = recorded
    try:
        yield seen
    finally:
        step.ineligible = orig


@contextlib.contextmanager
def _graphs_off():
    """Eager steps inside, whatever NUMBACTR_CUDA_GRAPHS says (a step with graphs off drops the model's
    captured ones; they are captured again after the warm-up steps, should graphs come back on)."""
    from numbactr.train.cuda_graphs import ENV

    before = os.environ.get(ENV)
    os.environ[ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before


def breakdown(model, env, steps: int, eager_step: float, gate=None, clock=None) -> dict:
    """The eager step's breakdown over ``steps`` timed steps (module docstring): seconds per step of
    embedding, gemm, rest, host_gap (None where unmeasured) and eager (what the four add up to), with
    busy (the device's busy time: gated steps only), method ("gated events" or "host clock") and why (the
    reason the gated method was given up, or ""). On a GPU (or given a ``gate``: a StreamGate-like object
    with held() and timed_out(), and its ``clock``) each step is queued whole behind the gate."""
    why = ""
    if gate is not None or env.kind == "gpu":
        gate = gate or StreamGate()
        clock = clock or EventClock()
        timer = PhaseTimer(model, clock)
        busy, phases, good, failed = 0.0, dict.fromkeys(PhaseTimer.PHASES, 0.0), 0, 0
        with timer:
            while good < steps and failed < GATE_FAILURES:
                env.sync()
                timer.reset()
                with gate.held():
                    start = clock.mark()
                    try:
                        model.train()
                    finally:
                        end = clock.mark()
                env.sync()
                if gate.timed_out():
                    failed += 1
                    continue
                good += 1
                busy += clock.seconds(start, end)
                for k, v in timer.seconds().items():
                    phases[k] += v
        if good == steps:
            busy /= steps
            emb, gemm = phases["embedding"] / steps, phases["gemm"] / steps
            return dict(
                embedding=emb,
                gemm=gemm,
                rest=max(busy - emb - gemm, 0.0),
                host_gap=max(eager_step - busy, 0.0),
                eager=max(eager_step, busy),
                busy=busy,
                method="gated events",
                why="",
            )
        why = (
            f"{failed} gated step(s) timed out: the step made the host wait for the device (a host read or "
            f"a synchronizing copy), so its device time could not be told from the host's; host gaps "
            f"unmeasured"
        )
    timer = PhaseTimer(model, WallClock(env.sync))
    env.sync()
    total = 0.0
    with timer:
        for _ in range(steps):
            t0 = time.perf_counter()
            model.train()
            env.sync()
            total += time.perf_counter() - t0
    ph = timer.seconds()
    total, emb, gemm = total / steps, ph["embedding"] / steps, ph["gemm"] / steps
    return dict(
        embedding=emb,
        gemm=gemm,
        rest=max(total - emb - gemm, 0.0),
        host_gap=None if why else 0.0,
        eager=total,
        busy=None,
        method="host clock",
        why=why,
    )


def _prepare_torch(torch, dev, host_batches, slot_offsets):
    """Per batch: dense, per-slot indices (slot-local rows), per-slot offsets, labels as torch tensors."""
    out = []
    for b in host_batches:
        keys, offsets = b.sparse[0]  # bag j = sample * S + slot, one key per bag
        keys = np.asarray(keys, dtype=np.int64)
        if (np.diff(offsets) != 1).any():
            raise AssertionError("bench mlperf: the generated data must be one-hot")
        per_slot = keys[offsets[:-1]].reshape(b.batch_size, SLOTS)
        idx = [torch.from_numpy(np.ascontiguousarray(per_slot[:, s] - slot_offsets[s])).to(dev) for s in range(SLOTS)]
        offs = torch.arange(b.batch_size, dtype=torch.int64, device=dev)
        out.append((torch.from_numpy(b.dense).to(dev), idx, offs, torch.from_numpy(b.label).to(dev)))
    return out


def torch_mlperf_dlrm(torch, slot_sizes, dim: int, bottom=BOTTOM, top=TOP):
    """The same DLRM in plain PyTorch: nn.EmbeddingBag per slot, HugeCTR's interaction output layout
    [bottom output | strict lower triangle of the 27x27 dot products | one zero pad]."""
    nn = torch.nn
    n = len(slot_sizes) + 1
    width = dim + n * (n - 1) // 2 + 1

    def mlp(widths, last_relu):
        layers = []
        for i in range(1, len(widths)):
            layers.append(nn.Linear(widths[i - 1], widths[i]))
            if i < len(widths) - 1 or last_relu:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.ModuleList(nn.EmbeddingBag(int(v), dim, mode="sum") for v in slot_sizes)
            self.bottom = mlp((DENSE,) + tuple(bottom) + (dim,), True)
            self.top = mlp((width,) + tuple(top), False)
            self.register_buffer("tril", torch.tril_indices(n, n, offset=-1))

        def forward(self, dense, idx, offsets):
            x = self.bottom(dense)
            z = torch.stack([x] + [e(i, offsets) for e, i in zip(self.emb, idx)], 1)
            m = torch.bmm(z, z.transpose(1, 2))
            pairs = m[:, self.tril[0], self.tril[1]]
            pad = torch.zeros(x.shape[0], 1, dtype=x.dtype, device=x.device)
            return self.top(torch.cat([x, pairs, pad], 1))

    return DLRM()


def _torch_model_and_optimizer(env, sizes, dim, optimizer, lr, seed, tf32, capturable=False):
    torch, dev = env.torch, env.torch_dev
    torch.manual_seed(seed)
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
        torch.backends.cudnn.allow_tf32 = bool(tf32)
    model = torch_mlperf_dlrm(torch, sizes, dim).to(dev)
    extra = {"capturable": True} if capturable else {}
    opt = (
        torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-7, **extra)
        if optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=lr)
    )
    return model, opt


def _time_torch_graph(env, prepared, sizes, dim, optimizer, lr, min_time, seed, tf32) -> float:
    """PyTorch's step captured whole as one CUDA graph (forward, backward and the optimizer step; Adam
    with capturable=True), replayed on static input tensors that each step's batch is copied into: the
    recipe of torch.cuda.graphs' "whole network capture", as NVIDIA's MLPerf DLRM runs. float32/TF32
    only (GradScaler's unscale and skip read the host)."""
    from numbactr.bench.common import measure

    torch = env.torch
    model, opt = _torch_model_and_optimizer(env, sizes, dim, optimizer, lr, seed, tf32, capturable=True)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    dense, idx, offs, label = (t.clone() if not isinstance(t, list) else [i.clone() for i in t] for t in prepared[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(dense, idx, offs), label).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = loss_fn(model(dense, idx, offs), label)
        static_loss.backward()
        opt.step()
    it = itertools.cycle(prepared)

    def step():
        d, i, o, y = next(it)
        dense.copy_(d, non_blocking=True)
        for a, b in zip(idx, i):
            a.copy_(b, non_blocking=True)
        offs.copy_(o, non_blocking=True)
        label.copy_(y, non_blocking=True)
        graph.replay()

    t = measure(step, sync=env.torch_sync, min_time=min_time)
    if not torch.isfinite(static_loss).item():
        raise AssertionError("bench mlperf: torch (CUDA graph) loss is not finite")
    return t


def _time_torch(env, prepared, sizes, dim, optimizer, lr, min_time, seed, tf32, amp) -> float:
    from numbactr.bench.common import measure

    torch, dev = env.torch, env.torch_dev
    model, opt = _torch_model_and_optimizer(env, sizes, dim, optimizer, lr, seed, tf32)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    use_amp = bool(amp) and dev == "cuda"
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    it = itertools.cycle(prepared)
    last = {}

    def step():
        dense, idx, offs, label = next(it)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=dev, dtype=torch.float16, enabled=use_amp):
            loss = loss_fn(model(dense, idx, offs).float(), label)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        last["loss"] = loss

    t = measure(step, sync=env.torch_sync, min_time=min_time)
    if not torch.isfinite(last["loss"]).item():
        raise AssertionError("bench mlperf: torch loss is not finite")
    return t


def _profiled_step(model, env) -> None:
    """With NUMBACTR_PROFILE_STEP=1 on a GPU: one more step between cudaProfilerStart and Stop, so that a
    profiler started with its capture off (``ncu --profile-from-start off``, ``nsys profile
    --capture-range=cudaProfilerApi``) records exactly one warm step of each configuration (.ci/gpu
    profile)."""
    if env.kind != "gpu" or os.environ.get("NUMBACTR_PROFILE_STEP", "0") in ("", "0"):
        return
    import cupy

    env.sync()
    cupy.cuda.profiler.start()
    try:
        model.train()
        env.sync()
    finally:
        cupy.cuda.profiler.stop()


def bench_mlperf(
    env,
    *,
    batch: int | None = None,
    rows: int | None = None,
    dims=(128,),
    optimizers=("sgd", "adam"),
    batches: int = 2,
    min_time: float = 1.0,
    breakdown_steps: int = 3,
    tf32: bool = False,
    amp: bool = False,
    seed: int = 0,
    lr: float | None = None,
    threads=None,
    **_,
):
    """One Table: numbactr's MLPerf DLRM step (and PyTorch's) for each D and optimizer (module docstring).
    On the cpu device each row runs with numbactr's compute threads and torch's set to the same count:
    each of ``threads``, or numbactr's current compute threads (a GPU run leaves both as they are). The
    table's ``records`` hold each numbactr row's raw figures (seconds, bytes, graph status)."""
    from numbactr.bench import common
    from numbactr.train import cuda_graphs
    from numbactr.runtime import threads as T
    from numbactr.data.synthetic import criteo_like_slot_sizes, make_planted_dataset
    from numbactr.config import workspace_mb_for

    size = SIZES.get(env.kind, SIZES["cpu"])
    batch = batch or size["batch"]
    rows = rows or size["rows"]
    for name, v in (("batch", batch), ("rows", rows), ("batches", batches), ("breakdown_steps", breakdown_steps)):
        if v < 1:
            raise ValueError(f"bench mlperf: {name} must be >= 1, got {v}")
    if rows < SLOTS:
        raise ValueError(f"bench mlperf: rows must be >= {SLOTS} (one per slot at least), got {rows}")
    wanted = cuda_graphs.graphs_wanted()
    tab = common.Table(f"MLPerf DLRM training step ({env.kind})", COLUMNS)
    tab.records = []
    if env.kind == "gpu":
        eager_note = (
            f"eager ms = the median clean eager step (= step ms unless graphs replayed; then measured "
            f"apart with graphs off); its breakdown from {breakdown_steps} eager step(s), each queued "
            "whole behind a gate kernel so that the device runs it back to back: CUDA events at the "
            "phases' ends give their device times, host gaps = eager ms - the device's busy time"
        )
    else:
        eager_note = (
            f"eager ms = the wall time of {breakdown_steps} further timed step(s), their phases by the "
            f"host clock; host gaps 0 by definition on {env.kind} (every operation runs when called)"
        )
    tab.notes = env.header() + [
        f"model: 13 dense -> {'-'.join(map(str, BOTTOM))}-D, {SLOTS} one-hot slots of width D (hash embedding, "
        f"{rows:,} rows in all), dot interaction, top {'-'.join(map(str, TOP))}, BCE; Update_t.Global",
        "precision: "
        + ("TF32 allowed" if tf32 else "float32")
        + (", mixed precision (torch: autocast fp16)" if amp else ""),
        "step ms, samples/s: median clean step (forward + backward + update; batches in memory)"
        + (
            ", CUDA graphs asked for (NUMBACTR_CUDA_GRAPHS=1): the graphs column says whether they replayed"
            if wanted
            else "; graphs: off (NUMBACTR_CUDA_GRAPHS=1 asks for CUDA graphs)"
        ),
        "eager ms = embedding + GEMMs + rest + host gaps: embedding = lookup + gradient hand-over + fused "
        "backward/update (+ Adam's all-rows pass); GEMMs = the fully connected layers' forward and backward "
        "less their bias/ReLU kernels; rest = the other work (bias/ReLU, interaction, loss, dense optimizer, "
        "Python between phases)",
        eager_note,
        "embedding GB/s: FBGEMM's count of the touched rows, 3 x (B*26*D*4 read + B*26*D*4 written), plus "
        "the all-rows pass of Global Adam (rows in use x D x (weight + 2 states) x 4 B x read+write), over "
        "the embedding phase",
    ]
    if env.peak_gbs:
        tab.notes.append(f"memory bandwidth (the % column): {env.peak_gbs:.0f} GB/s ({env.peak_src})")
    sizes = criteo_like_slot_sizes(SLOTS, rows)
    with tempfile.TemporaryDirectory(prefix="numbactr-mlperf-") as tmp:
        data = make_planted_dataset(
            os.path.join(tmp, "data"),
            num_train=batch * batches,
            num_eval=batch,
            dense_dim=DENSE,
            slot_sizes=sizes,
            seed=seed,
            files=(1, 1),
            calibration_samples=min(50_000, max(2_000, batch * batches)),
        )
        import numbactr as hugectr

        counts = (None,) if env.kind == "gpu" else tuple(threads or (T.current().compute,))
        for dim, opt, n in itertools.product(dims, optimizers, counts):
            with common.thread_count(env, n):
                step_lr = lr if lr is not None else (0.001 if opt == "adam" else 0.01)
                with contextlib.redirect_stdout(io.StringIO()):
                    model = build_mlperf_dlrm(
                        hugectr,
                        data.train_list,
                        data.eval_list,
                        batch=batch,
                        dim=dim,
                        optimizer=opt,
                        lr=step_lr,
                        workspace_mb=workspace_mb_for(rows, dim, 1 if opt == "sgd" else 2) + 1,
                        tf32=tf32,
                        amp=amp,
                        seed=seed,
                    )
                reader = iter(model._make_reader(data.train_list, batch, True))
                host_batches = [next(reader) for _ in range(batches)]
                model.start_data_reading()
                model._train_reader = itertools.cycle(host_batches)
                rec = _time_numbactr(model, env, wanted, min_time, breakdown_steps)
                _profiled_step(model, env)
                if not np.isfinite(model.get_current_loss()):
                    raise AssertionError("bench mlperf: numbactr loss is not finite")
                global_bytes = sum(global_pass_bytes(e.engine) for e in model.embeddings)
                nbytes = embedding_step_bytes(batch, dim, global_bytes)
                emb = rec["embedding"]
                gbs = nbytes / emb / 1e9 if emb > 0 else float("nan")
                gb_cell = f"{gbs:.1f}" + (f" ({100 * gbs / env.peak_gbs:.0f}% of measured)" if env.peak_gbs else "")
                rec.update(
                    impl="numbactr",
                    threads=n,
                    optimizer=opt,
                    D=dim,
                    batch=batch,
                    rows=rows,
                    embedding_bytes=nbytes,
                    global_pass_bytes=global_bytes,
                    embedding_gbs=gbs,
                )
                tab.records.append(rec)
                gap = rec["host_gap"]
                tab.add(
                    "numbactr",
                    n or "-",
                    opt,
                    dim,
                    batch,
                    rows,
                    rec["graphs"],
                    1e3 * rec["step"],
                    batch / rec["step"],
                    1e3 * rec["eager"],
                    1e3 * emb,
                    1e3 * rec["gemm"],
                    1e3 * rec["rest"],
                    None if gap is None else 1e3 * gap,
                    gb_cell,
                )
                if rec["why"]:
                    tab.notes.append(f"numbactr ({opt}, D={dim}) breakdown by {rec['method']}: {rec['why']}")
                elif rec["host_gap"] is not None and rec["busy"] is not None and rec["busy"] > rec["eager_step"]:
                    tab.notes.append(
                        f"numbactr ({opt}, D={dim}): the gated steps' device time exceeded the clean "
                        "eager step (noise between runs); host gaps shown as 0"
                    )
                del model
                if env.torch is not None:
                    prepared = _prepare_torch(env.torch, env.torch_dev, host_batches, data.slot_offsets)
                    tt = _time_torch(env, prepared, sizes, dim, opt, step_lr, min_time, seed, tf32, amp)
                    label = (
                        env.torch_label
                        + ("+tf32" if tf32 else "")
                        + ("+amp" if amp and env.torch_dev == "cuda" else "")
                    )
                    tab.add(
                        label,
                        n or "-",
                        opt,
                        dim,
                        batch,
                        rows,
                        "off",
                        1e3 * tt,
                        batch / tt,
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                    )
                    if env.torch_dev == "cuda" and not amp:  # torch's step as one CUDA graph too
                        try:
                            tg = _time_torch_graph(env, prepared, sizes, dim, opt, step_lr, min_time, seed, tf32)
                        except Exception as e:  # noqa: BLE001 (a baseline that cannot capture is noted, not fatal)
                            tab.notes.append(f"torch CUDA graph ({opt}, D={dim}) not measured: {type(e).__name__}: {e}")
                        else:
                            tab.add(
                                label + "+graph",
                                n or "-",
                                opt,
                                dim,
                                batch,
                                rows,
                                "whole step",
                                1e3 * tg,
                                batch / tg,
                                "-",
                                "-",
                                "-",
                                "-",
                                "-",
                                "-",
                            )
    return tab


def _time_numbactr(model, env, wanted: bool, min_time: float, breakdown_steps: int) -> dict:
    """One numbactr configuration: its clean steps (replayed graphs when wanted and possible), the eager
    step and its breakdown (module docstring). Returns the record: seconds per step (step, eager,
    eager_step, embedding, gemm, rest, host_gap, busy), graphs (the cell), replayed (all steps were),
    captures, replays, steps, method, why."""
    from numbactr.bench import common
    from numbactr.train.cuda_graphs import StepGraphs

    count = [0]

    def step():
        count[0] += 1
        model.train()

    if wanted:  # warm-up and capture outside the timed steps
        for _ in range(StepGraphs.WARMUP + 1):
            model.train()
    before = model._graphs.replays if model._graphs is not None else 0
    with _graph_reasons() as reasons:
        t = common.measure(step, sync=env.sync, min_time=min_time)
    graphs = model._graphs
    replays = (graphs.replays if graphs is not None else 0) - before
    cell, replayed = graph_status(wanted, graphs, count[0], replays, reasons)
    with _graphs_off():
        eager_step = common.measure(model.train, sync=env.sync, min_time=min_time) if replays > 0 else t
        parts = breakdown(model, env, breakdown_steps, eager_step)
    return dict(
        step=t,
        eager_step=eager_step,
        graphs=cell,
        replayed=replayed,
        steps=count[0],
        replays=replays,
        captures=getattr(graphs, "captures", 0),
        **parts,
    )
