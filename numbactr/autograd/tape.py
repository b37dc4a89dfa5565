"""A tape-based autograd: Tensor, Context, Function, Tape.

Forward: every ``Function.apply`` runs ``forward(ctx, *arrays)`` and appends one entry to the tape.
Backward: the tape is replayed in reverse; each entry's ``backward(ctx, *grads)`` returns one gradient
per input (or None). A tensor read by several functions receives the SUM of their gradients — this
replaces HugeCTR's automatically inserted Slice copies (spec §4.2).
"""
from __future__ import annotations

from typing import Any


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
    """Per-call scratch space: forward stores what backward needs as attributes."""

    def __init__(self):
        self.needs_input_grad: tuple[bool, ...] = ()


class Function:
    """One differentiable op. Subclasses define static ``forward`` and ``backward`` on raw arrays."""

    @staticmethod
    def forward(ctx: Context, *args: Any, **params: Any):  # -> array or tuple of arrays
        raise NotImplementedError

    @staticmethod
    def backward(ctx: Context, *grads: Any):  # -> one grad (or None) per tensor input
        raise NotImplementedError

    @classmethod
    def apply(cls, tape: "Tape | None", *inputs: Tensor, name: str = "", **params: Any):
        ctx = Context()
        ctx.needs_input_grad = tuple(t.requires_grad for t in inputs)
        out = cls.forward(ctx, *(t.data for t in inputs), **params)
        outs = out if isinstance(out, tuple) else (out,)
        grad_needed = any(ctx.needs_input_grad)
        tensors = tuple(Tensor(o, name=name if len(outs) == 1 else f"{name}[{i}]",
                               requires_grad=grad_needed) for i, o in enumerate(outs))
        if tape is not None and grad_needed:
            tape.entries.append((cls, ctx, inputs, tensors))
        return tensors if isinstance(out, tuple) else tensors[0]


class Tape:
    """A flat list of (function, ctx, inputs, outputs) in execution order."""

    def __init__(self):
        self.entries: list[tuple] = []

    def backward(self, seeds: dict[int, tuple[Tensor, Any]]) -> None:
        """Replay in reverse from ``seeds`` = {id(tensor): (tensor, dL/dtensor)}.

        Tensors with ``requires_grad`` that no function produced (parameters, leaves) end with
        ``.grad`` set to their summed gradient.
        """
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
            in_grads = fn.backward(ctx, *out_grads)
            if not isinstance(in_grads, tuple):
                in_grads = (in_grads,)
            if len(in_grads) != len(inputs):
                raise RuntimeError(f"{fn.__name__}.backward returned {len(in_grads)} gradients "
                                   f"for {len(inputs)} inputs")
            for t, g in zip(inputs, in_grads):
                if g is None or not t.requires_grad:
                    continue
                prev = grads.get(id(t))
                grads[id(t)] = g if prev is None else prev + g   # read twice: gradients add
                by_id[id(t)] = t
        for key, g in grads.items():               # what is left: leaves (parameters, inputs)
            if key not in produced:
                t = by_id[key]
                t.grad = g if t.grad is None else t.grad + g
        self.entries.clear()
