"""Float64 central-difference gradient check for NumPy reference backward passes."""

from __future__ import annotations

import numpy as np


def numeric_grad(f, x: np.ndarray, dy: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d/dx of sum(f(x) * dy) by central differences, in float64. f must not modify x."""
    x = np.array(x, dtype=np.float64)
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        plus = np.sum(f(x) * dy)
        flat[i] = old - eps
        minus = np.sum(f(x) * dy)
        flat[i] = old
        gflat[i] = (plus - minus) / (2 * eps)
    return g


def assert_grad_close(analytic, f, x, dy, rtol=1e-5, atol=1e-7, eps=1e-6):
    num = numeric_grad(f, x, dy, eps)
    np.testing.assert_allclose(analytic, num, rtol=rtol, atol=atol)
