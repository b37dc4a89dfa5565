"""Per-step scalars that kernels read from device memory instead of launch arguments.

A value that changes every step (the learning rate of a schedule, Adam's step t and its bias corrections,
the salt of stochastic rounding) used to travel by value in each kernel launch. That is free on its own,
but a CUDA graph freezes launch arguments at capture: a replayed step would keep the captured step's
learning rate and t. Here each consumer owns a small device array at a fixed address; ``put(values)``
writes the step's values into it in stream order, and the kernels read them from there, so every launch
of a step has the same arguments as the step before (``tests/test_step_values.py`` checks that on the sim
device for the DLRM step).

On a GPU ``put`` copies through a ring of pinned host buffers with an asynchronous copy on the compute
stream: no host synchronization. The ring slot is reused only after its copy has completed (``RING``
steps later; the host waits there only if the GPU lags that many uploads behind). On sim/cpu the device
array is host memory and ``put`` assigns it.

Replaying a captured step (numbactr.train.cuda_graphs) runs no Python of the step, so whatever the step does on
the host must be done again before each replay: a consumer that puts values also registers, with
``on_replay(key, fn)``, the host half of its step, ``fn(run)`` (advance its counters, put its values for
the step described by ``run``: the model's ``step``, ``lr`` and ``scaler``). Registration is a no-op unless
a step is being recorded (``recording``): while capturing, ``put`` only notes the values (the captured
graph reads the device arrays; the runner uploads the values before launching it); while recording on
sim (``defer=False``) it also uploads them, so a test can check that the hooks alone reproduce what the
step's Python did.
"""

from __future__ import annotations

import contextlib
import weakref

import numpy as np

from numbactr.runtime import device


class Recording:
    """What one recorded step registered: its uploads [(StepValues, values)] and its replay hooks."""

    def __init__(self, defer: bool):
        self.defer = defer
        self.uploads: list = []
        self.hooks: dict = {}  # key -> fn(run), in registration order

    def replay(self, run: dict) -> None:
        for fn in self.hooks.values():
            fn(run)


_RECORDING: list = [None]


@contextlib.contextmanager
def recording(rec: Recording):
    """Record the puts and replay hooks of the step run inside (see the module docstring)."""
    prev, _RECORDING[0] = _RECORDING[0], rec
    try:
        yield rec
    finally:
        _RECORDING[0] = prev


def on_replay(key, fn) -> None:
    """Register ``fn(run)``, the host half of a consumer's step, for replays of the step being recorded."""
    rec = _RECORDING[0]
    if rec is not None and key not in rec.hooks:
        rec.hooks[key] = fn


def held(owner, attr: str, n: int, dtype) -> "StepValues":
    """The StepValues ``owner.attr``, made (n values of dtype) the first time it is asked for."""
    sv = getattr(owner, attr, None)
    if sv is None:
        sv = StepValues(n, dtype)
        setattr(owner, attr, sv)
    return sv


_ALL: "weakref.WeakSet" = weakref.WeakSet()


def instances() -> list:
    """The live StepValues (tests compare their contents)."""
    return list(_ALL)


class StepValues:
    """n values of one dtype on the device, rewritten every step by ``put``. ``instances()`` lists the live
    ones (for tests)."""

    RING = 4

    def __init__(self, n: int, dtype):
        rec = _RECORDING[0]
        if rec is not None and rec.defer:
            # its zeroing would be captured into the graph and undo every replay's upload
            raise RuntimeError(
                "a StepValues was made while a step was being captured; the warm-up steps before a capture make them"
            )
        self.dtype = np.dtype(dtype)
        self.n = int(n)
        xp = device.xp()
        self.dev = xp.zeros(self.n, self.dtype)
        self.gpu = device.kind() == "gpu"
        self.uploads = 0  # how many puts (for tests)
        _ALL.add(self)
        if self.gpu:
            import cupy

            self._ring = []
            for _ in range(self.RING):
                mem = cupy.cuda.alloc_pinned_memory(max(self.n * self.dtype.itemsize, 1))
                self._ring.append(np.frombuffer(mem, self.dtype, self.n))
            self._events = [None] * self.RING
            self._turn = 0

    def put(self, values):
        """Write ``values`` ((n,) or a scalar for n == 1) for the launches queued after this call; returns
        the device array (the same object every step)."""
        values = np.asarray(values, self.dtype).reshape(-1)
        if values.shape[0] != self.n:
            raise ValueError(f"StepValues holds {self.n} values, got {values.shape[0]}")
        rec = _RECORDING[0]
        if rec is not None:
            rec.uploads.append((self, values.copy()))
            if rec.defer:  # capturing: uploaded by the runner, outside the graph
                return self.dev
        self.uploads += 1
        if not self.gpu:
            self.dev[...] = values
            return self.dev
        import cupy

        j = self._turn
        self._turn = (j + 1) % self.RING
        if self._events[j] is not None:
            self._events[j].synchronize()  # that slot's copy (RING puts ago) has read it
        host = self._ring[j]
        host[...] = values
        stream = cupy.cuda.get_current_stream()
        self.dev.set(host, stream=stream)
        ev = self._events[j] = cupy.cuda.Event(disable_timing=True)
        ev.record(stream)
        return self.dev
