"""Loss layers CrossEntropyLoss and MultiCrossEntropyLoss, and the L1/L2 regularizer (spec §6.3).

Loss layers follow BinaryCrossEntropyLoss (core.py): bottoms [logits, label], forward returns
[loss (1,)] (mean over the valid rows) and saves dX, computed in the same fused kernel; the tape seeds
it and ``backward`` hands on dX times the seed: the model seeds each loss with its weight (compile's
loss_weights or Input label_weights), so a weighted loss has the weighted gradient; under
numbactr.hugectr_exact.hugectr_exact() the model seeds 1, HugeCTR's loss-only weighting (spec §4.5). The loss name that
``compile(loss_names)`` refers to is the LABEL tensor's name (``label_name``).

Regularizer. A loss with ``use_regularizer=True`` exposes ``self.regularizer = (Regularizer_t, lambda)``
(else None). The model, not the loss, applies it each training step, over the flat dense weight
vector w of the layers before the loss, with b = the per-rank batch size of the full tensor (B, not
the valid rows; HugeCTR passes the logit tensor's dim 0):

    loss_value += regularizer_term(w, kind, lam, B)        # L2: lam/(2B)·Σw², L1: lam/B·Σ|w|
    regularizer_grad(w, kind, lam, B, wgrad)               # wgrad := L2 (lam/B)·w, L1 (lam/B)·sign(w)
    ... then layers ACCUMULATE their weight gradients into wgrad

`RegularizedLoss` is the mixin that reads and validates the regularizer settings; BinaryCrossEntropyLoss
can take it too (``class BinaryCrossEntropyLoss(RegularizedLoss, Layer)`` + ``self.setup_regularizer()``
in ``infer`` + ``self.regularizer_json()`` in ``json_params``).

CrossEntropyLoss label. HugeCTR's kernel reads ``label[i]`` for row i: the first B floats of the label
buffer, whatever its width. numbactr reads column 0 of each row (the same floats for a (B, 1) label;
for a (B, 2) label HugeCTR instead reads row i//2, column i%2); ``numbactr.hugectr_exact.hugectr_exact()``
restores HugeCTR's read. The label may be (B, 1) (a class index per row, as HugeCTR's own unit test
feeds it) or (B, 2) (the logits' shape).

The ops (the fused loss kernels, the regularizer's term and gradient, the eval activations) live in
numbactr.ops.losses and numbactr.ops.regularizer; this module keeps the layers and their configuration.

HugeCTR: HugeCTR/src/loss.cu, src/regularizers/*.cu, src/pybind/add_dense_layer.cpp.
"""

from __future__ import annotations

import math

import numpy as np

from numbactr import hugectr_exact
from numbactr.enums import Layer_t, Regularizer_t
from numbactr.layers.base import Layer
from numbactr.ops.losses import CrossEntropy, MultiCrossEntropy, sigmoid, softmax2

# re-exported: numbactr.model imports the regularizer from here (numbactr.inference.session sigmoid and softmax2)
from numbactr.ops.regularizer import (  # noqa: F401
    regularizer_grad,
    regularizer_term,
    regularizer_term_on_device,
)
from numbactr.runtime import device


class RegularizedLoss:
    """Mixin for loss layers: the use_regularizer / regularizer_type / lambda settings.

    ``setup_regularizer()`` (call from ``infer``) validates them and sets ``self.regularizer`` to
    ``(Regularizer_t, lambda)`` or None; ``regularizer_json()`` gives the graph-JSON keys.
    """

    regularizer = None

    def setup_regularizer(self) -> None:
        cfg = self.cfg
        self.regularizer = None
        if not cfg.use_regularizer:
            return
        kind, lam = cfg.regularizer_type, cfg.lambda_
        if not isinstance(kind, Regularizer_t):
            self.fail(f"regularizer_type must be Regularizer_t.L1 or Regularizer_t.L2, got {kind!r}")
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 0:
            self.fail(f"lambda must be a finite number >= 0, got {lam!r}")
        self.regularizer = (kind, float(lam))

    def regularizer_json(self) -> dict:
        if self.regularizer is None:
            return {}
        kind, lam = self.regularizer
        return {"regularizer": kind.name, "lambda": lam}

    @property
    def label_name(self) -> str:
        """The name compile(loss_names) uses for this loss: the label tensor's."""
        return self.cfg.bottom_names[1]


# ---- layers ------------------------------------------------------------------------------------
class CrossEntropyLoss(RegularizedLoss, Layer):
    """bottoms [logits (B, 2), label (B, 1) or (B, 2)] -> loss (1,); softmax fused. Class of row i:
    0 if its label < 0.5 else 1 (column 0; HugeCTR's buffer read under hugectr_exact.hugectr_exact())."""

    type_name = "CrossEntropyLoss"
    is_loss = True
    # labels in [0, 1], checked by the reader; the class is label >= 0.5, as HugeCTR's kernel reads it (its
    # DataGenerator writes float labels: a 0/1-only rule refused HugeCTR's own cross_entropy_loss.py data)
    label_kind = "unit"

    def infer(self):
        self.expect_counts(2)
        x, y = self.in_shapes
        xn, yn = self.cfg.bottom_names
        if len(x) != 2 or x[1] != 2:
            self.fail(f"logits {xn!r} must be (B, 2) (two classes), got shape {x}")
        if len(y) != 2 or y[0] != x[0] or y[1] not in (1, 2):
            self.fail(
                f"label {yn!r} {y} does not match logits {xn!r} {x}: need label (B, 2) like the "
                f"logits, or (B, 1) class labels, with the same B"
            )
        self.setup_regularizer()
        return [(1,)]

    def forward(self, tape, xs, run):
        grad_scale = run.scaler / (run.valid * run.ranks) if run.valid else 0.0
        loss = CrossEntropy.apply(
            tape,
            xs[0],
            xs[1],
            valid=run.valid,
            grad_scale=grad_scale,
            hugectr_label=hugectr_exact.hugectr_exact(),
            name=self.cfg.top_names[0],
        )
        self.logits = xs[0]
        return [loss]

    def predictions(self):
        """softmax of the last forward's logits, (B, 2); column 1 is P(class 1)."""
        return softmax2(self.logits.data)

    def json_params(self):
        return self.regularizer_json()


class MultiCrossEntropyLoss(RegularizedLoss, Layer):
    """bottoms [logits (B, T), label (B, T)] -> loss (1,); per-target weights target_weight_vec (T,);
    labels < -0.5 are ignored (no loss, no gradient) but still count in the b·T normalization."""

    type_name = "MultiCrossEntropyLoss"
    is_loss = True
    label_kind = "unit_or_ignore"  # labels in [0, 1] or < -0.5 ("no label"), checked by the reader

    def infer(self):
        self.expect_counts(2)
        x, y = self.in_shapes
        xn, yn = self.cfg.bottom_names
        if len(x) != 2:
            self.fail(f"logits {xn!r} must be 2-D (B, T), got shape {x}")
        if y != x:
            self.fail(f"label {yn!r} {y} must have the shape of logits {xn!r} {x}")
        tw = self.cfg.target_weight_vec
        targets = x[1]
        if tw is None or len(tw) == 0:
            self.fail(f"target_weight_vec is required: one weight per target, {targets} for logits {xn!r} {x}")
        if len(tw) != targets:
            self.fail(f"target_weight_vec has {len(tw)} weights, but logits {xn!r} {x} have {targets} targets")
        try:
            weights = [float(v) for v in tw]
        except (TypeError, ValueError):
            self.fail(f"target_weight_vec must hold numbers, got {list(tw)!r}")
        if not all(math.isfinite(v) and v >= 0 for v in weights):
            self.fail(f"target_weight_vec must be finite and >= 0, got {weights}")
        self.target_weights = weights
        self._tw_dev = None
        self.setup_regularizer()
        return [(1,)]

    def _tw(self):
        """target weights on the current device, (T,) float32 (cached per array module)."""
        xp = device.xp()
        if self._tw_dev is None or self._tw_dev[0] is not xp:
            self._tw_dev = (xp, xp.asarray(np.asarray(self.target_weights, np.float32)))
        return self._tw_dev[1]

    def forward(self, tape, xs, run):
        targets = self.in_shapes[0][1]
        grad_scale = run.scaler / (run.valid * targets * run.ranks) if run.valid else 0.0
        loss = MultiCrossEntropy.apply(
            tape, xs[0], xs[1], tw=self._tw(), valid=run.valid, grad_scale=grad_scale, name=self.cfg.top_names[0]
        )
        self.logits = xs[0]
        return [loss]

    def predictions(self):
        """sigmoid of the last forward's logits, (B, T)."""
        return sigmoid(self.logits.data)

    def json_params(self):
        return {"target_weight": list(self.target_weights), **self.regularizer_json()}


LAYERS = {
    Layer_t.CrossEntropyLoss: CrossEntropyLoss,
    Layer_t.MultiCrossEntropyLoss: MultiCrossEntropyLoss,
}
