"""A tape-based autograd: Tensor, Context, Function, Tape.

Forward: every ``Function.apply`` runs ``forward(ctx, *arrays)`` and appends one entry to the tape.
Backward: the tape is replayed in reverse; each entry's ``backward(ctx, *grads)`` returns one gradient
per input (or None). A tensor read by several functions receives the SUM of their gradients — this
replaces HugeCTR's automatically inserted Slice copies (spec §4.2).

Mixed precision (``autocast``): inside an ``autocast(np.float16)`` scope every ``Function.apply``
upcasts its half-precision input arrays to float32, runs the op in float32 and rounds its floating
outputs to the half dtype. The tape remembers the scope per entry, so the backward replay does the
same for gradients: incoming output gradients are upcast to float32, and each input's gradient is
rounded to that input's own dtype. So activations and activation gradients are STORED in half
precision between layers while every op computes in float32 (as tensor cores accumulate in float32),
and float32 tensors (the master weights, labels) get float32 gradients. A loss layer runs under
``autocast(half, keep_outputs=True)``: float32 math and a float32 loss, but the gradient it hands its
half-precision logits is rounded to half (where the loss scale matters). ``Tape.watch_finite``
makes the replay record whether every gradient stayed finite (``Tape.grads_finite``), the test that
skips a step whose scaled half-precision gradients overflowed.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np


class _Policy:
    """The current autocast scope: ``half`` (None = plain float32) and whether outputs stay float32."""

    half = None
    keep_outputs = False


_POLICY = _Policy()


class _Recorder:
    """Who is told of every op call (numbactr.train.plan traces a step through it); None: nobody."""

    fn = None


_RECORDER = _Recorder()


class recording:  # noqa: N801 (a context manager, like autocast)
    """``with recording(fn):`` every ``Function.apply`` inside also calls ``fn(cls, params, inputs, result,
    ctx)`` once its forward has run (result: what apply returns, a Tensor or a tuple of them; whether or not
    a tape took the call). The previous recorder is restored on exit."""

    def __init__(self, fn):
        self.fn = fn

    def __enter__(self):
        self._prev, _RECORDER.fn = _RECORDER.fn, self.fn
        return self

    def __exit__(self, *exc):
        _RECORDER.fn = self._prev
        return False


class autocast:  # noqa: N801 (a context manager, named like torch's)
    """``with autocast(np.float16):`` ops store half-precision outputs (see the module docstring).
    ``half=None`` is plain float32 (no casts at all); ``keep_outputs=True`` keeps float32 outputs
    (losses). Scopes nest; the previous one is restored on exit."""

    def __init__(self, half=None, keep_outputs: bool = False):
        self.half = None if half is None else np.dtype(half)
        self.keep_outputs = keep_outputs

    def __enter__(self):
        self._prev = (_POLICY.half, _POLICY.keep_outputs)
        _POLICY.half, _POLICY.keep_outputs = self.half, self.keep_outputs
        return self

    def __exit__(self, *exc):
        _POLICY.half, _POLICY.keep_outputs = self._prev
        return False


def _native_half(half) -> bool:
    """Whether half_native ops take half tensors directly: float16 on the gpu and sim devices (their
    kernels take float16), unless NUMBACTR_HALF_KERNELS=0."""
    from numbactr.runtime import device

    if half != np.float16 or not device.uses_kernels():
        return False
    raw = os.environ.get("NUMBACTR_HALF_KERNELS", "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"NUMBACTR_HALF_KERNELS={raw!r}: expected 1 (float16 kernels, the default) or 0")
    return raw == "1"


def native_inputs(ctx: "Context", *arrays) -> tuple:
    """The arrays as float16 when the op runs its float16 kernels (``ctx.native_half``: a half_native
    Function on gpu/sim under mixed precision), else unchanged."""
    if not ctx.native_half:
        return arrays
    return tuple(a.astype(np.float16, copy=False) for a in arrays)


def native_dtype(ctx: "Context"):
    """The dtype an op's kernels write: float16 under its float16 kernels, else float32."""
    return np.float16 if ctx.native_half else np.float32


def _up(a, half):
    """float32 view of a half-precision array (anything else unchanged)."""
    return a.astype(np.float32) if getattr(a, "dtype", None) == half else a


def _down(a, half):
    """``a`` rounded to ``half`` when it is a float32/float64 array (integers, masks, half unchanged)."""
    dt = getattr(a, "dtype", None)
    if dt is not None and dt != half and dt in (np.float32, np.float64):
        return a.astype(half)
    return a


def _as_dtype_of(g, ref):
    """Gradient ``g`` in the dtype of the tensor data ``ref`` it belongs to (floating dtypes only)."""
    dt, want = getattr(g, "dtype", None), getattr(ref, "dtype", None)
    if dt is None or want is None or dt == want or want.kind not in "fV" or dt.kind != "f":
        return g
    return g.astype(want)


class Tensor:
    """An array plus what autograd needs. ``data`` is a numpy (cpu/sim) or cupy (gpu) array."""

    __slots__ = ("data", "grad", "name", "requires_grad")

    def __init__(self, data, name: str = "", requires_grad: bool = False):
        self.data = data
        self.grad = None
        self.name = name
        self.requires_grad = requires_grad

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    def __repr__(self) -> str:
        return f"Tensor({self.name or '?'}, shape={self.shape})"


class Context:
    """Per-call scratch space: forward stores what backward needs as attributes. (The defaults are class
    attributes: a Context is made per op call, and an empty __init__ keeps that cheap.)"""

    needs_input_grad: tuple = ()
    grad_into: dict = {}  # {input index: array}: where backward may write that input's gradient (never mutated)
    out: tuple = ()  # one array per output: where forward may write its outputs (numbactr.train.plan_buffers)
    half = None  # the autocast half dtype this call ran under (None: float32)
    native_half = False  # the op took and gave half tensors itself (Function.half_native)
    #: {input index: the gradient that input already has}, for the inputs of a Function's ``accumulates``
    #: (the planned step hands them; the op returns the input's whole gradient, its own terms added in)
    grad_so_far: dict = {}


class Function:
    """One differentiable op. Subclasses define static ``forward`` and ``backward`` on raw arrays.

    Under mixed precision an op gets float32 copies of its half-precision inputs and its outputs are
    rounded to half afterwards, unless it is ``half_native``: then, on the gpu and sim devices with
    float16, it gets the float16 tensors themselves and returns float16 activations (its kernels load
    float16, compute in float32 and round once on the store, its matrix products run in float16 with
    float32 accumulation, as tensor cores do), and its backward gets float16 gradients. No float32 copy
    of an activation is made. NUMBACTR_HALF_KERNELS=0 turns this off (every op converts, as on cpu)."""

    half_native = False

    @staticmethod
    def forward(ctx: Context, *args: Any, **params: Any):  # -> array or tuple of arrays
        raise NotImplementedError

    @staticmethod
    def backward(ctx: Context, *grads: Any):  # -> one grad (or None) per tensor input
        raise NotImplementedError

    @classmethod
    def apply(cls, tape: "Tape | None", *inputs: Tensor, name: str = "", **params: Any):
        # (list displays, not generators, and one Tensor per output: an op call's own cost matters on small
        # batches, e.g. a one-sample inference request, where it is most of the time)
        ctx = Context()
        ctx.needs_input_grad = needs = tuple([t.requires_grad for t in inputs])
        half = _POLICY.half
        if half is None:
            out = cls.forward(ctx, *[t.data for t in inputs], **params)
        elif cls.half_native and not _POLICY.keep_outputs and _native_half(half):
            ctx.half, ctx.native_half = half, True
            out = cls.forward(ctx, *[t.data for t in inputs], **params)
        else:  # mixed precision: float32 math, half storage
            ctx.half = half
            out = cls.forward(ctx, *[_up(t.data, half) for t in inputs], **params)
            if not _POLICY.keep_outputs:
                out = tuple([_down(o, half) for o in out]) if isinstance(out, tuple) else _down(out, half)
        grad_needed = True in needs
        if isinstance(out, tuple):
            tensors = tuple(
                [Tensor(o, name if len(out) == 1 else f"{name}[{i}]", grad_needed) for i, o in enumerate(out)]
            )
            result = tensors
        else:
            result = Tensor(out, name, grad_needed)
            tensors = (result,)
        if tape is not None and grad_needed:
            tape.entries.append((cls, ctx, inputs, tensors))
        if _RECORDER.fn is not None:
            _RECORDER.fn(cls, params, inputs, result, ctx)
        return result


class Tape:
    """A flat list of (function, ctx, inputs, outputs) in execution order."""

    def __init__(self, watch_finite: bool = False):
        self.entries: list[tuple] = []
        self.watch_finite = watch_finite  # record whether every gradient of the replay is finite
        self._finite = None  # AND of np.isfinite(g).all() (a device 0-d array on gpu)

    def _note(self, g) -> None:
        if self.watch_finite and g is not None and getattr(g, "dtype", None) is not None:
            ok = np.isfinite(g).all()  # cupy arrays dispatch to cupy: no host read here
            self._finite = ok if self._finite is None else self._finite & ok

    def finite_flag(self):
        """Whether every gradient of the last replay was finite, as the 0-d (device) boolean array it is
        computed in (None when no gradient was watched); reads nothing (needs ``watch_finite``)."""
        if not self.watch_finite:
            raise RuntimeError("Tape.finite_flag needs Tape(watch_finite=True)")
        return self._finite

    def grads_finite(self) -> bool:
        """True when every gradient of the last replay was finite (needs ``watch_finite``; one host
        read on a GPU). Every gradient is checked once: each entry's incoming (summed) output
        gradients and each leaf's final gradient, so an overflow anywhere is seen."""
        if not self.watch_finite:
            raise RuntimeError("Tape.grads_finite needs Tape(watch_finite=True)")
        if self._finite is None:
            return True
        from numbactr.runtime import device  # a counted read (kernels.launch.COUNTS)

        return bool(device.to_host(self._finite))

    def backward(self, seeds: dict[int, tuple[Tensor, Any]]) -> None:
        """Replay in reverse from ``seeds`` = {id(tensor): (tensor, dL/dtensor)}.

        Tensors with ``requires_grad`` that no function produced (parameters, leaves) end with
        ``.grad`` set to their summed gradient. With ``watch_finite`` an overflow is an expected
        outcome that the caller checks (``grads_finite``), so NumPy's overflow warnings are silenced.
        """
        if self.watch_finite:
            with np.errstate(over="ignore", invalid="ignore"):
                return self._replay(seeds)
        return self._replay(seeds)

    def _replay(self, seeds: dict[int, tuple[Tensor, Any]]) -> None:
        # The tape holds every tensor until the replay ends, so id() is a safe key throughout.
        grads: dict[int, Any] = {k: g for k, (_, g) in seeds.items()}
        by_id: dict[int, Tensor] = {k: t for k, (t, _) in seeds.items()}
        produced = set()
        for fn, ctx, inputs, outputs in reversed(self.entries):
            out_grads = [grads.pop(id(o), None) for o in outputs]
            for o in outputs:
                produced.add(id(o))
            if all(g is None for g in out_grads):
                continue
            half = ctx.half
            if half is not None and not ctx.native_half:  # the mirror of apply(): float32 in, own dtype out
                out_grads = [None if g is None else _up(g, half) for g in out_grads]
            for g in out_grads:
                self._note(g)
            in_grads = fn.backward(ctx, *out_grads)
            if not isinstance(in_grads, tuple):
                in_grads = (in_grads,)
            if len(in_grads) != len(inputs):
                raise RuntimeError(
                    f"{fn.__name__}.backward returned {len(in_grads)} gradients for {len(inputs)} inputs"
                )
            if half is not None:
                in_grads = tuple(None if g is None else _as_dtype_of(g, t.data) for g, t in zip(in_grads, inputs))
            for t, g in zip(inputs, in_grads):
                if g is None or not t.requires_grad:
                    continue
                prev = grads.get(id(t))
                grads[id(t)] = g if prev is None else prev + g  # read twice: gradients add
                by_id[id(t)] = t
        for key, g in grads.items():  # what is left: leaves (parameters, inputs)
            if key not in produced:
                self._note(g)
                t = by_id[key]
                t.grad = g if t.grad is None else t.grad + g
        self.entries.clear()
