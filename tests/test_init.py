"""Initializer distributions (spec §6.1): mean / spread / range over large draws."""

import math

import numpy as np
import pytest

from numbactr.enums import Initializer_t as I
from numbactr.layers import init

N = 200_000  # draws per check: std of a sample std ~ sigma/sqrt(2N) = 0.16% of sigma
FIX = init.TRUNC_STD_FIX


def _rng(seed=0):
    return np.random.default_rng(seed)


def assert_normal(a, std, mean=0.0):
    a = np.asarray(a).reshape(-1)
    assert abs(a.mean() - mean) < 5 * std / math.sqrt(a.size)
    assert a.std() == pytest.approx(std, rel=6 / math.sqrt(2 * a.size))
    # a normal, not a uniform: excess kurtosis ~ 0 (a uniform gives -1.2); nothing truncated at 2 sigma
    z = (a - a.mean()) / a.std()
    assert abs((z**4).mean() - 3.0) < 0.1
    assert np.abs(z).max() > 3.0


def assert_uniform(a, limit):
    a = np.asarray(a).reshape(-1)
    assert a.min() >= -limit and a.max() <= limit
    assert a.min() < -0.99 * limit and a.max() > 0.99 * limit
    assert abs(a.mean()) < 5 * limit / math.sqrt(3 * a.size)
    assert a.std() == pytest.approx(limit / math.sqrt(3), rel=0.01)


def test_variance_scaling_modes_and_floor():
    assert init.variance_scale(10, 30) == pytest.approx(1 / 20)
    assert init.variance_scale(10, 30, "fan_in") == pytest.approx(1 / 10)
    assert init.variance_scale(10, 30, "fan_out") == pytest.approx(1 / 30)
    assert init.variance_scale(0, 1) == 1.0  # max(1, 0.5)
    assert init.variance_scale(4, 4, scale=2.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        init.variance_scale(1, 1, "fan_max")
    assert_uniform(init.variance_scaling(_rng(), (N,), 10, 30), math.sqrt(3 / 20))
    assert_normal(init.variance_scaling(_rng(), (N,), 10, 30, distribution="norm"), math.sqrt(1 / 20) / FIX)
    assert_normal(init.variance_scaling(_rng(), (N,), 10, 30, distribution="norm", truncated=False), math.sqrt(1 / 20))
    with pytest.raises(ValueError):
        init.variance_scaling(_rng(), (3,), 1, 1, distribution="cauchy")


@pytest.mark.parametrize(
    "kind,check",
    [
        (I.Default, lambda a, k, n: assert_normal(a, math.sqrt(2 / (k + n)) / FIX)),
        (I.XavierNorm, lambda a, k, n: assert_normal(a, math.sqrt(2 / (k + n)) / FIX)),
        (I.XavierUniform, lambda a, k, n: assert_uniform(a, math.sqrt(6 / (k + n)))),
        (I.Uniform, lambda a, k, n: assert_uniform(a, 1 / (k + n))),
    ],
)
def test_inner_product_weight(kind, check):
    k, n = 400, 500
    w = init.inner_product_weight(_rng(), k, n, kind)
    assert w.shape == (k, n)
    check(w, k, n)


@pytest.mark.parametrize(
    "kind,check",
    [
        (I.Default, lambda a, n: assert_normal(a, math.sqrt(1 / n))),
        (I.XavierNorm, lambda a, n: assert_normal(a, math.sqrt(2 / n) / FIX)),
        (I.XavierUniform, lambda a, n: assert_uniform(a, math.sqrt(6 / n))),
        (I.Uniform, lambda a, n: assert_uniform(a, 1 / n)),
    ],
)
def test_inner_product_bias(kind, check):
    b = init.inner_product_bias(_rng(), N, kind)
    assert b.shape == (N,)
    check(b, N)


def test_inner_product_bias_of_one_output_uses_the_variance_floor():
    # fan_in = 0, fan_out = 1: s = 1 / max(1, 0.5) = 1 (HugeCTR's VarianceScalingSimulator)
    a = np.concatenate([init.inner_product_bias(_rng(i), 1, I.XavierUniform) for i in range(4000)])
    assert np.abs(a).max() <= math.sqrt(3) and np.abs(a).max() > 1.6


def test_zero_everywhere():
    rng = _rng()
    for a in (
        init.inner_product_weight(rng, 3, 4, I.Zero),
        init.inner_product_bias(rng, 4, I.Zero),
        init.mlp_param(rng, (3, 4), I.Zero, 3, 4),
        init.multicross_kernel(rng, (1, 5), I.Zero, 5),
        init.weight_multiply_weight(rng, 3, 4, I.Zero),
        init.norm_gamma(rng, (6,), I.Zero),
        init.gru_param(rng, (7,), I.Zero),
    ):
        assert not a.any()


def test_draw_dispatch_falls_back_to_default():
    calls = []

    def default(rng, shape):
        calls.append("default")
        return np.full(shape, 7.0)

    def uni(rng, shape):
        calls.append("uniform")
        return np.full(shape, 1.0)

    for kind in (I.Default, I.XavierNorm, I.XavierUniform):
        assert (init.draw(_rng(), (2,), kind, default=default, uniform=uni) == 7.0).all()
    assert (init.draw(_rng(), (2,), I.Uniform, default=default, uniform=uni) == 1.0).all()
    assert calls == ["default"] * 3 + ["uniform"]
    with pytest.raises(ValueError, match="Initializer_t"):
        init.draw(_rng(), (2,), "Default", default=default)
    assert init.cycled([I.Uniform, I.Zero], 0) == I.Uniform
    assert init.cycled([I.Uniform, I.Zero], 5) == I.Zero


def test_generic_weight_default_argument():
    a = init.weight(_rng(), (N,), I.Default, 10, 30)  # XavierNorm when None
    assert_normal(a, math.sqrt(2 / 40) / FIX)
    b = init.weight(_rng(), (N,), I.Default, 10, 30, default=lambda r, s: np.zeros(s))
    assert not b.any()


@pytest.mark.parametrize("kind", [I.Default, I.Uniform])
@pytest.mark.parametrize("is_bias", [False, True])
def test_mlp_default_and_uniform_are_lecun_uniform(kind, is_bias):
    fan_in, fan_out = 50, 400
    shape = (fan_out * 500,) if is_bias else (fan_in * 10, fan_out)
    a = init.mlp_param(_rng(), shape, kind, fan_in, fan_out, sub_layer=1, is_bias=is_bias)
    assert_uniform(a, math.sqrt(1 / fan_in))


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("sub_layer", [0, 1])
@pytest.mark.parametrize("is_bias", [False, True])
def test_mlp_xavier_fan_modes(exact, sub_layer, is_bias):
    fan_in, fan_out = 30, 90
    # numbactr: kernel fan_avg, bias fan_out; HugeCTR: by sub-layer parity
    uses_fan_out = (sub_layer % 2 == 1) if exact else is_bias
    s = 1 / fan_out if uses_fan_out else 1 / ((fan_in + fan_out) / 2)
    u = init.mlp_param(_rng(), (N,), I.XavierUniform, fan_in, fan_out, sub_layer, is_bias, hugectr_exact=exact)
    assert_uniform(u, math.sqrt(3 * s))
    n = init.mlp_param(_rng(), (N,), I.XavierNorm, fan_in, fan_out, sub_layer, is_bias, hugectr_exact=exact)
    assert_normal(n, math.sqrt(s) / FIX)


@pytest.mark.parametrize("kind", [I.Default, I.Uniform, I.XavierNorm, I.XavierUniform])
def test_multicross(kind):
    d, p = 16, 8
    w = init.multicross_kernel(_rng(), (N // d, d), kind, d)  # v1: N(0, sqrt(1/D)) untruncated
    assert_normal(w, math.sqrt(1 / d))
    u = init.multicross_kernel(_rng(), (N // p, p), kind, d, projection_dim=p)  # v2 U / V
    assert_normal(u, math.sqrt(2 / (d + p)))
    assert not init.multicross_bias(_rng(), (1, d), kind).any()


@pytest.mark.parametrize(
    "kind,check",
    [
        (I.Default, lambda a, s, v: assert_uniform(a, math.sqrt(6 / (s + s * v)))),
        (I.XavierUniform, lambda a, s, v: assert_uniform(a, math.sqrt(6 / (s + s * v)))),
        (I.XavierNorm, lambda a, s, v: assert_normal(a, math.sqrt(2 / (s + s * v)) / FIX)),
        (I.Uniform, lambda a, s, v: assert_uniform(a, 1 / (s + s * v))),
    ],
)
def test_weight_multiply(kind, check):
    s, v = 400, 500
    w = init.weight_multiply_weight(_rng(), s, v, kind)
    assert w.shape == (s, v)
    check(w, s, v)


@pytest.mark.parametrize("kind", [I.Default, I.Uniform, I.XavierNorm, I.XavierUniform])
def test_norm_gamma_beta_and_gru(kind):
    assert (init.norm_gamma(_rng(), (5,), kind) == 1.0).all()
    assert not init.norm_beta(_rng(), (5,), kind).any()
    assert not init.gru_param(_rng(), (1, 9), kind).any()


def test_inner_product_draws_are_seeded_and_unchanged():
    # the model's seeded generator gives the same weights every time (cpu and sim runs agree)
    a = init.inner_product_weight(_rng(7), 3, 4, I.Default)
    b = init.inner_product_weight(_rng(7), 3, 4, I.Default)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, _rng(7).normal(0.0, math.sqrt(2 / 7) / FIX, (3, 4)))
