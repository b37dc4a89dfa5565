"""The step-time figures of ``numbactr bench dlrm --model mlperf`` (numbactr/bench/mlperf.py) for one numbactr
model: its clean steps, whether CUDA graphs replayed them, and the eager step's breakdown, by phase timers
wrapped around the layers' entry points and, on a GPU, a gate kernel that makes the device run a whole step
back to back. Apart from mlperf.py so that the model and the table stay apart from the timing machinery.

* **step ms, samples/s**: the median clean step (no timers inside; batches in memory). With CUDA graphs
  asked for (``NUMBACTR_CUDA_GRAPHS=1``) these are the replayed steps' figures, and the ``graphs`` column
  says whether they really were: ``replayed (r/n steps)``, or ``not replayed: <why>`` (a failed capture,
  an ineligible step: numbactr.train.cuda_graphs' ``StepGraphs.disabled`` or numbactr.train.step's
  ``ineligible``), in which case the figures are eager steps'; ``partly replayed`` when only some steps
  were. ``off`` when not asked for.
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
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
from numba import cuda

#: the gate's polling rounds (an atomic read and a ~1 µs sleep each: 0.2-1 s in all): how long a gated step may take to enqueue
GATE_ROUNDS = 1 << 19
#: gated steps that may time out before the breakdown falls back to synchronized host-clock phases
GATE_FAILURES = 2


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
