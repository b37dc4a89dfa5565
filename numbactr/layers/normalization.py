"""Normalization layers: BatchNorm, LayerNorm, PReLU_Dice (spec §6.2).

Contract: each layer checks its config and bottoms, declares its weights (gamma, beta) and runs an op of
numbactr.ops.normalization (formulas there: y = γ (x - μ) / sqrt(σ² + eps) + β, Dice), which reaches the
numba.cuda kernels on gpu/sim and the NumPy references on cpu through numbactr.ops.dispatch.

BatchNorm keeps non-trainable running statistics, ``layer.running_mean`` and ``layer.running_var``
(F,) device arrays, updated by every training forward and used by eval forwards; HugeCTR saves them
in ``<prefix>_dense_<iter>.model.ntp.json`` (spec §7.2): see ``BatchNorm.ntp_entry`` /
``BatchNorm.load_ntp_entry``.
"""

from __future__ import annotations

import math

import numpy as np

from numbactr.enums import Initializer_t, Layer_t
from numbactr.kernels import batch_norm
from numbactr.layers import init
from numbactr.layers.base import Layer
from numbactr.ops.normalization import BatchNormFn, LayerNormFn, PReLUDiceFn
from numbactr.runtime import device
from numbactr.runtime.device import xp as _xp


def _init_name(kind) -> str:
    return kind.name


# ---- Layers ----------------------------------------------------------------------------------
def _check_eps(layer: Layer, lo: float, what: str) -> float:
    eps = layer.cfg.eps
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < lo:
        layer.fail(f"eps must be a number >= {lo:g} ({what}), got {eps!r}")
    return float(eps)


def _norm_json(cfg, extra: dict) -> dict:
    p = dict(extra)
    if cfg.gamma_init_type != Initializer_t.Default:
        p["gamma_init"] = _init_name(cfg.gamma_init_type)
    if cfg.beta_init_type != Initializer_t.Default:
        p["beta_init"] = _init_name(cfg.beta_init_type)
    return p


class BatchNorm(Layer):
    """(B, F) -> (B, F); weights gamma (F,), beta (F,); running stats are layer state, not weights.

    Running stats start at mean 0, var 1 (HugeCTR leaves them uninitialized; with the default
    factor=1.0 the first training step overwrites them either way)."""

    type_name = "BatchNorm"

    def infer(self):
        self.expect_counts(1)
        (shape,) = self.in_shapes
        if len(shape) != 2:
            self.fail(f"input {self.cfg.bottom_names[0]!r} must be 2-D (B, F), got shape {shape}")
        self.eps = _check_eps(self, batch_norm.MIN_EPS, "cuDNN's CUDNN_BN_MIN_EPSILON")
        factor = self.cfg.factor
        if not isinstance(factor, (int, float)) or not 0.0 <= factor <= 1.0:
            self.fail(f"factor (the running-average weight of the new batch) must be in [0, 1], got {factor!r}")
        self.factor = float(factor)
        self.f = shape[1]
        self.running_mean = np.zeros(self.f, np.float32)
        self.running_var = np.ones(self.f, np.float32)
        return [shape]

    def param_shapes(self):
        return [(self.f,), (self.f,)]

    def init_params(self, rng):
        return [
            init.norm_gamma(rng, (self.f,), self.cfg.gamma_init_type),
            init.norm_beta(rng, (self.f,), self.cfg.beta_init_type),
        ]

    def _stats_on_device(self):
        xp = _xp()
        if not isinstance(self.running_mean, xp.ndarray):
            self.running_mean = xp.asarray(self.running_mean, dtype=np.float32)
            self.running_var = xp.asarray(self.running_var, dtype=np.float32)

    def forward(self, tape, xs, run):
        self._stats_on_device()
        return [
            BatchNormFn.apply(tape, xs[0], *self.params, layer=self, training=run.training, name=self.cfg.top_names[0])
        ]

    def json_params(self):
        return {"bn_param": _norm_json(self.cfg, {"factor": self.cfg.factor, "eps": self.cfg.eps})}

    # -- non-trainable state for <dense>.ntp.json (spec §7.2) --
    def ntp_entry(self) -> dict:
        """{"type": "BatchNorm", "mean": [...], "var": [...]} (floats; HugeCTR prints 6 decimals)."""
        return {
            "type": "BatchNorm",
            "mean": [float(v) for v in device.to_host(self.running_mean)],
            "var": [float(v) for v in device.to_host(self.running_var)],
        }

    def load_ntp_entry(self, entry: dict) -> None:
        mean = np.asarray(entry.get("mean", ()), np.float32)
        var = np.asarray(entry.get("var", ()), np.float32)
        if entry.get("type", "BatchNorm") != "BatchNorm" or mean.shape != (self.f,) or var.shape != (self.f,):
            self.fail(
                f"non-trainable params entry does not fit: need 'mean' and 'var' of {self.f} floats, "
                f"got {mean.shape[0]} and {var.shape[0]}"
            )
        self.running_mean, self.running_var = mean, var
        self._stats_on_device()


class LayerNorm(Layer):
    """(..., H) -> (..., H) normalized over the last dim; weights gamma (H,), beta (H,)."""

    type_name = "LayerNorm"

    def infer(self):
        self.expect_counts(1)
        (shape,) = self.in_shapes
        if len(shape) < 2 or shape[-1] < 1:
            self.fail(
                f"input {self.cfg.bottom_names[0]!r} must be at least 2-D with a last dim >= 1, got shape {shape}"
            )
        eps = self.cfg.eps
        if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
            self.fail(f"eps must be a positive number, got {eps!r}")
        self.eps = float(eps)
        self.h = shape[-1]
        return [shape]

    def param_shapes(self):
        return [(self.h,), (self.h,)]

    def init_params(self, rng):
        return [
            init.norm_gamma(rng, (self.h,), self.cfg.gamma_init_type),
            init.norm_beta(rng, (self.h,), self.cfg.beta_init_type),
        ]

    def forward(self, tape, xs, run):
        return [LayerNormFn.apply(tape, xs[0], *self.params, eps=self.eps, name=self.cfg.top_names[0])]

    def json_params(self):
        return {"ln_param": _norm_json(self.cfg, {"eps": self.cfg.eps})}


class PReLU_Dice(Layer):  # noqa: N801 (HugeCTR's name)
    """Dice: (B, ...) -> same shape, statistics per feature over the batch; no weights.

    Parameters: elu_alpha (the negative-side slope alpha), eps. The backward is the full derivative
    through the batch statistics; numbactr.hugectr_exact.hugectr_exact() selects HugeCTR's diagonal-only
    formula (see numbactr/kernels/prelu_dice.py)."""

    type_name = "PReLU_Dice"

    def infer(self):
        self.expect_counts(1)
        (shape,) = self.in_shapes
        if len(shape) < 2:
            self.fail(f"input {self.cfg.bottom_names[0]!r} must be at least 2-D (B, F), got shape {shape}")
        alpha = self.cfg.elu_alpha
        if not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            self.fail(f"elu_alpha must be a finite number, got {alpha!r}")
        eps = self.cfg.eps
        if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            self.fail(f"eps must be a number >= 0, got {eps!r}")
        self.alpha, self.eps = float(alpha), float(eps)
        return [shape]

    def forward(self, tape, xs, run):
        return [PReLUDiceFn.apply(tape, xs[0], alpha=self.alpha, eps=self.eps, name=self.cfg.top_names[0])]

    def json_params(self):
        return {"prelu_dice_param": {"alpha": self.cfg.elu_alpha, "eps": self.cfg.eps}}


LAYERS = {
    Layer_t.BatchNorm: BatchNorm,
    Layer_t.LayerNorm: LayerNorm,
    Layer_t.PReLU_Dice: PReLU_Dice,
}
