"""FBGEMM's fused 8-bit rowwise format: the rows of an INT8 embedding table (Precision.INT8).

A row of D values is stored in D + 8 bytes:

    bytes 0 .. D-1      q_d   uint8
    bytes D .. D+3      scale float32 (little-endian)
    bytes D+4 .. D+7    bias  float32
    value               w_d = scale * q_d + bias

Quantizing a float row x (FBGEMM's FloatToFused8BitRowwiseQuantized):

    bias = min_d x_d,   range = max_d x_d - bias,   scale = range / 255
    q_d  = round_half_even((x_d - bias) * 255 / (range + 1e-8))

so the smallest value is exact and every value is within scale / 2 of its row's original. D must be a
multiple of 4 (FBGEMM's rule for every TBE row), so scale and bias sit 4-byte aligned.

The engine (numbactr/embedding/engine.py) reads these rows forward only: it dequantizes the rows a lookup
touches and pools them as float32 rows. Nothing is compiled here: the functions run on NumPy or CuPy arrays.
"""
from __future__ import annotations

import numpy as np

QPARAM_BYTES = 8          # scale + bias, float32 each, after the D quantized bytes
_EPS = np.float32(1e-8)


def quantize_rows_ref(x) -> np.ndarray:
    """(V, D) float rows -> (V, D + 8) uint8 fused rows (host NumPy; the test oracle is FBGEMM's own op)."""
    return quantize_rows(x, np)


def quantize_rows(x, xp=np):
    """quantize_rows_ref on NumPy or CuPy arrays (the same arithmetic, float32 throughout)."""
    x = xp.ascontiguousarray(xp.asarray(x, dtype=np.float32))
    if x.ndim != 2:
        raise ValueError(f"quantize_rows needs (V, D) rows, got shape {x.shape}")
    v, d = x.shape
    out = xp.empty((v, d + QPARAM_BYTES), np.uint8)
    if v == 0:
        return out
    lo = x.min(axis=1) if d else xp.zeros(v, np.float32)
    rng = (x.max(axis=1) - lo) if d else xp.zeros(v, np.float32)
    inv = np.float32(255) / (rng + _EPS)
    out[:, :d] = xp.clip(xp.rint((x - lo[:, None]) * inv[:, None]), 0, 255).astype(np.uint8)
    qp = xp.stack([rng / np.float32(255), lo], axis=1).astype("<f4")            # (V, 2) scale, bias
    out[:, d:] = qp.view(np.uint8).reshape(v, QPARAM_BYTES)
    return out


def dequantize_rows(q, dim: int, xp=np):
    """(m, dim + 8) uint8 fused rows -> (m, dim) float32 values scale * q + bias (NumPy or CuPy)."""
    q = xp.asarray(q)
    if q.ndim != 2 or q.shape[1] != dim + QPARAM_BYTES or q.dtype != np.uint8:
        raise ValueError(f"fused 8-bit rows of width {dim} must be ({dim + QPARAM_BYTES},)-byte uint8 rows, got "
                         f"{q.dtype} {tuple(q.shape)}")
    qp = xp.ascontiguousarray(q[:, dim:]).view(np.float32)                     # (m, 2): scale, bias
    return q[:, :dim].astype(np.float32) * qp[:, :1] + qp[:, 1:]


#: no numba.cuda kernels here (array operations on NumPy / CuPy only)
PTX_CHECKS = []
