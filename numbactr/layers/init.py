"""Weight initializers with HugeCTR's distributions (spec §6.1). Drawn on the host (NumPy) from the
model's seeded generator; curand streams are not reproducible, distributions are."""
from __future__ import annotations

import math

import numpy as np

from ..enums import Initializer_t

TRUNC_STD_FIX = 0.87962566103423978   # HugeCTR inflates the 'truncated' normal's sigma, never truncates


def inner_product_weight(rng, fan_in: int, fan_out: int, kind) -> np.ndarray:
    """W (fan_in, fan_out) of an InnerProduct."""
    shape = (fan_in, fan_out)
    if kind in (Initializer_t.Default, Initializer_t.XavierNorm):
        return rng.normal(0.0, math.sqrt(2.0 / (fan_in + fan_out)) / TRUNC_STD_FIX, shape)
    if kind == Initializer_t.Uniform:
        a = 1.0 / (fan_in + fan_out)
        return rng.uniform(-a, a, shape)
    if kind == Initializer_t.XavierUniform:
        a = math.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-a, a, shape)
    if kind == Initializer_t.Zero:
        return np.zeros(shape)
    raise ValueError(f"unknown weight initializer {kind!r}")


def inner_product_bias(rng, fan_out: int, kind) -> np.ndarray:
    """b (fan_out,) of an InnerProduct."""
    shape = (fan_out,)
    if kind == Initializer_t.Default:
        return rng.normal(0.0, math.sqrt(1.0 / fan_out), shape)
    if kind == Initializer_t.XavierNorm:
        return rng.normal(0.0, math.sqrt(2.0 / fan_out) / TRUNC_STD_FIX, shape)
    if kind == Initializer_t.Uniform:
        return rng.uniform(-1.0 / fan_out, 1.0 / fan_out, shape)
    if kind == Initializer_t.XavierUniform:
        a = math.sqrt(6.0 / fan_out)
        return rng.uniform(-a, a, shape)
    if kind == Initializer_t.Zero:
        return np.zeros(shape)
    raise ValueError(f"unknown bias initializer {kind!r}")
