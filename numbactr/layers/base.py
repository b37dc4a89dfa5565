"""The Layer base class. One subclass per Layer_t lives in a module of this package.

A layer gets its DenseLayer config and the FULL shapes of its bottoms (dim 0 = per-rank batch B),
checks them, and declares ``out_shapes`` and ``param_shapes``. The model hands it parameter Tensors
(views into one flat weight buffer, in HugeCTR's file order) before training.
"""

from __future__ import annotations

from dataclasses import dataclass

from numbactr.autograd import Context, Tape, Tensor


def op_fn(op, *params: Tensor, tops: int = 1, **kw):
    """Layer.inference_fn of a layer whose forward is ``[op.apply(tape, *xs, *params, **kw)] * tops``: the
    params are read (``.data``) at each call, so weights loaded or refreshed later are the ones used; an op
    returning a tuple gives its arrays as the tops."""

    def fn(xs):
        out = op.forward(Context(), *xs, *[p.data for p in params], **kw)
        return list(out) if isinstance(out, tuple) else [out] * tops

    return fn


class LayerError(ValueError):
    """A layer's configuration or input shapes are wrong; the message names layer and tensors."""


@dataclass
class RunInfo:
    training: bool
    valid: int  # valid rows of this rank's batch (a partial batch is padded)
    ranks: int = 1
    scaler: float = 1.0
    seed: int = 0  # Solver seed: seeded layers (Dropout) derive their random streams from it
    step: int = 0  # training iteration (0-based), so each step draws a fresh dropout mask


class Layer:
    type_name = ""
    is_loss = False

    def __init__(self, cfg, in_shapes: list[tuple]):
        self.cfg = cfg
        self.in_shapes = [tuple(s) for s in in_shapes]
        self.params: list[Tensor] = []
        self.out_shapes = self.infer()

    # -- to override --
    def infer(self) -> list[tuple]:
        raise NotImplementedError

    def param_shapes(self) -> list[tuple]:
        return []

    def init_params(self, rng) -> list:
        return []

    def forward(self, tape: Tape, xs: list[Tensor], run: RunInfo) -> list[Tensor]:
        raise NotImplementedError

    def json_params(self) -> dict:
        return {}

    def step_params(self, run) -> dict:
        """The op parameters of this layer's training forward that change from step to step (a planned step,
        numbactr.train.plan, replays the recorded ones with these on top). Default: none."""
        return {}

    def inference_fn(self):
        """``fn(bottom arrays) -> [top arrays]``: this layer's forward without training, as the inference
        session's plan runs it (no tape, no Tensors, no RunInfo: on a one-sample request those cost more
        than the op); the same op forward with the same arguments as forward(), so the same numbers. None
        (the default): the session calls forward()."""
        return None

    # -- helpers --
    def fail(self, msg: str) -> None:
        raise LayerError(f"{self.type_name} layer (bottom {self.cfg.bottom_names} -> top {self.cfg.top_names}): {msg}")

    def expect_counts(self, bottoms: int | tuple, tops: int = 1) -> None:
        ok = self.cfg.bottom_names.__len__() in (bottoms if isinstance(bottoms, tuple) else (bottoms,))
        if not ok:
            self.fail(f"expects {bottoms} bottom tensor(s), got {len(self.cfg.bottom_names)}")
        if len(self.cfg.top_names) != tops:
            self.fail(f"expects {tops} top tensor(s), got {len(self.cfg.top_names)}")
