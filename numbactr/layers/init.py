"""Weight initializers with HugeCTR's distributions (spec §6.1). Drawn on the host (NumPy) from the
model's seeded generator; curand streams are not reproducible, distributions are.

HugeCTR picks a "simulator" per weight index through a layer's getters: Uniform, XavierUniform,
XavierNorm and Default each call ``get_<kind>_initializer(index)`` and Zero always gives zeros. A
layer overrides only some getters; the others fall back to the layer's Default, and the base-class
Default is zeros. `draw` is that dispatch; `weight` is the fan-in/fan-out pattern shared by
InnerProduct and WeightMultiply; the per-family helpers below give each trainable layer its getters.

Which Initializer_t a weight gets: weight index 0 uses weight_init_type (gamma_init_type for norms),
index 1 bias_init_type (beta_init_type); multi-weight blocks cycle ``types[i % len(types)]``
(`cycled`).

HugeCTR: HugeCTR/include/data_simulator.hpp, src/data_simulator.cu, src/layer.cpp (init_params) and
each layer's get_*_initializer (fully_connected_layer.cu, mlp_layer.cu, multi_cross_layer.cu,
weight_multiply_layer.cu, batch_norm_layer.cu, layer_norm_layer.cu, gru_layer.cu).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from numbactr.enums import Initializer_t

TRUNC_STD_FIX = 0.87962566103423978  # HugeCTR inflates the 'truncated' normal's sigma, never truncates

Shape = tuple
Sampler = Callable[[object, Shape], np.ndarray]  # (rng, shape) -> float64 array


# ---- primitive distributions ------------------------------------------------------------------
def zeros(shape: Shape) -> np.ndarray:
    return np.zeros(shape)


def constant(shape: Shape, value: float) -> np.ndarray:
    return np.full(shape, float(value))


def uniform(rng, shape: Shape, limit: float) -> np.ndarray:
    """U(-limit, limit) (HugeCTR's UniformDataSimulator(-limit, limit))."""
    return rng.uniform(-limit, limit, shape)


def gaussian(rng, shape: Shape, std: float, mean: float = 0.0) -> np.ndarray:
    """N(mean, std), untruncated: HugeCTR's GaussianDataSimulator ignores its min/max arguments."""
    return rng.normal(mean, std, shape)


def variance_scale(fan_in: float, fan_out: float, mode: str = "fan_avg", scale: float = 1.0) -> float:
    """The variance s of VarianceScalingSimulator: scale / max(1, fan) for fan_in, fan_out or their mean."""
    if mode == "fan_in":
        fan = fan_in
    elif mode == "fan_out":
        fan = fan_out
    elif mode == "fan_avg":
        fan = (fan_in + fan_out) / 2.0
    else:
        raise ValueError(f"variance scaling mode must be fan_in, fan_out or fan_avg, got {mode!r}")
    return scale / max(1.0, fan)


def variance_scaling(
    rng,
    shape: Shape,
    fan_in: float,
    fan_out: float,
    *,
    mode: str = "fan_avg",
    distribution: str = "uniform",
    truncated: bool = True,
    scale: float = 1.0,
) -> np.ndarray:
    """HugeCTR's VarianceScalingSimulator: uniform -> U(+-sqrt(3s)); norm -> N(0, sqrt(s)), its sigma
    divided by 0.8796 when ``truncated`` (the default), though nothing is actually truncated."""
    s = variance_scale(fan_in, fan_out, mode, scale)
    if distribution == "uniform":
        return uniform(rng, shape, math.sqrt(3.0 * s))
    if distribution == "norm":
        std = math.sqrt(s) / TRUNC_STD_FIX if truncated else math.sqrt(s)
        return gaussian(rng, shape, std)
    raise ValueError(f"variance scaling distribution must be uniform or norm, got {distribution!r}")


def xavier_uniform(rng, shape: Shape, fan_in: float, fan_out: float) -> np.ndarray:
    """U(+-sqrt(6/(in+out))) when in+out >= 2 (VarianceScaling fan_avg, uniform)."""
    return variance_scaling(rng, shape, fan_in, fan_out, distribution="uniform")


def xavier_norm(rng, shape: Shape, fan_in: float, fan_out: float) -> np.ndarray:
    """N(0, sqrt(2/(in+out))/0.8796) when in+out >= 2 (VarianceScaling fan_avg, 'truncated' norm)."""
    return variance_scaling(rng, shape, fan_in, fan_out, distribution="norm", truncated=True)


# ---- HugeCTR's getter dispatch ----------------------------------------------------------------
def draw(
    rng,
    shape: Shape,
    kind,
    *,
    default: Sampler,
    uniform: Sampler | None = None,
    xavier_uniform: Sampler | None = None,
    xavier_norm: Sampler | None = None,
) -> np.ndarray:
    """One weight of ``shape`` for Initializer_t ``kind``: Zero -> zeros; a getter the layer does not
    override (None) falls back to ``default``, as in HugeCTR's Layer base class."""
    if not isinstance(kind, Initializer_t):
        raise ValueError(f"initializer must be an Initializer_t, got {kind!r}")
    if kind == Initializer_t.Zero:
        return zeros(shape)
    getter = {
        Initializer_t.Uniform: uniform,
        Initializer_t.XavierUniform: xavier_uniform,
        Initializer_t.XavierNorm: xavier_norm,
    }.get(kind)
    return (getter or default)(rng, shape)


def cycled(types: Sequence, index: int):
    """The Initializer_t of weight ``index`` when a layer has more weights than init types."""
    return types[index % len(types)]


def weight(rng, shape: Shape, kind, fan_in: float, fan_out: float, default: Sampler | None = None) -> np.ndarray:
    """The fan-in/fan-out getters of InnerProduct and WeightMultiply.

    Uniform U(+-1/(in+out)); XavierUniform / XavierNorm VarianceScaling fan_avg (uniform / truncated
    norm); Zero 0; Default ``default`` (XavierNorm when None). A bias passes fan_in = 0, as HugeCTR does.
    """
    return draw(
        rng,
        shape,
        kind,
        default=default or (lambda r, s: xavier_norm(r, s, fan_in, fan_out)),
        uniform=lambda r, s: uniform(r, s, 1.0 / (fan_in + fan_out)),
        xavier_uniform=lambda r, s: xavier_uniform(r, s, fan_in, fan_out),
        xavier_norm=lambda r, s: xavier_norm(r, s, fan_in, fan_out),
    )


# ---- InnerProduct / FusedInnerProduct ---------------------------------------------------------
def inner_product_weight(rng, fan_in: int, fan_out: int, kind) -> np.ndarray:
    """W (fan_in, fan_out) of an InnerProduct. Default = XavierNorm = N(0, sqrt(2/(in+out))/0.8796)."""
    return weight(rng, (fan_in, fan_out), kind, fan_in, fan_out)


def inner_product_bias(rng, fan_out: int, kind) -> np.ndarray:
    """b (fan_out,) of an InnerProduct: Default N(0, sqrt(1/out)); the others with fan_in = 0."""
    return weight(rng, (fan_out,), kind, 0, fan_out, default=lambda r, s: gaussian(r, s, math.sqrt(1.0 / fan_out)))


# ---- MLP --------------------------------------------------------------------------------------
def mlp_param(
    rng,
    shape: Shape,
    kind,
    fan_in: int,
    fan_out: int,
    sub_layer: int = 0,
    is_bias: bool = False,
    hugectr_exact: bool = False,
) -> np.ndarray:
    """A kernel (fan_in, fan_out) or bias (fan_out,) of MLP sub-layer ``sub_layer``.

    Default = Uniform = U(+-sqrt(1/fan_in)) for kernel AND bias. XavierUniform / XavierNorm use
    VarianceScaling (uniform / truncated norm) with fan_avg for a kernel and fan_out for a bias.
    HugeCTR's getter picks the mode by the parity of the SUB-LAYER instead (kernel and bias of even
    sub-layers fan_avg, of odd ones fan_out, ``i % 2`` with i = index / 2): ``hugectr_exact=True``
    reproduces that.
    """

    def lecun_uniform(r, s):
        return uniform(r, s, math.sqrt(1.0 / fan_in))

    odd = (sub_layer % 2 == 1) if hugectr_exact else is_bias
    mode = "fan_out" if odd else "fan_avg"
    return draw(
        rng,
        shape,
        kind,
        default=lecun_uniform,
        uniform=lecun_uniform,
        xavier_uniform=lambda r, s: variance_scaling(r, s, fan_in, fan_out, mode=mode),
        xavier_norm=lambda r, s: variance_scaling(r, s, fan_in, fan_out, mode=mode, distribution="norm"),
    )


# ---- MultiCross -------------------------------------------------------------------------------
def multicross_kernel(rng, shape: Shape, kind, vec: int, projection_dim: int = 0) -> np.ndarray:
    """A MultiCross weight other than a bias; every init type but Zero maps to Default.

    DCNv1 (projection_dim 0): w_l (1, D) ~ N(0, sqrt(1/D)), untruncated.
    DCNv2: U_l (D, P) and V_l (P, D) ~ N(0, sqrt(2/(D+P))), untruncated.
    """
    if projection_dim > 0:
        std = math.sqrt(2.0 / (vec + projection_dim))
    else:
        std = math.sqrt(1.0 / vec)
    return draw(rng, shape, kind, default=lambda r, s: gaussian(r, s, std))


def multicross_bias(rng, shape: Shape, kind) -> np.ndarray:
    """A MultiCross bias b_l (1, D): zeros whatever the init type."""
    return draw(rng, shape, kind, default=lambda r, s: zeros(s))


# ---- WeightMultiply ---------------------------------------------------------------------------
def weight_multiply_weight(rng, slot_num: int, vec: int, kind) -> np.ndarray:
    """W (S, V) with fan_in = S, fan_out = S*V: Default = XavierUniform; Uniform U(+-1/(S + S*V))."""
    fan_in, fan_out = slot_num, slot_num * vec
    return weight(
        rng, (slot_num, vec), kind, fan_in, fan_out, default=lambda r, s: xavier_uniform(r, s, fan_in, fan_out)
    )


# ---- BatchNorm / LayerNorm ---------------------------------------------------------------------
def norm_gamma(rng, shape: Shape, kind) -> np.ndarray:
    """gamma: 1 for every init type except Zero (HugeCTR overrides only the Default getter)."""
    return draw(rng, shape, kind, default=lambda r, s: constant(s, 1.0))


def norm_beta(rng, shape: Shape, kind) -> np.ndarray:
    """beta: 0 whatever the init type."""
    return draw(rng, shape, kind, default=lambda r, s: zeros(s))


# ---- GRU ---------------------------------------------------------------------------------------
def gru_param(rng, shape: Shape, kind) -> np.ndarray:
    """GRU weight space and initial hidden state: zeros (the Layer base-class Default) for every type."""
    return draw(rng, shape, kind, default=lambda r, s: zeros(s))
