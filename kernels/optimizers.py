"""Optimizer updates: dense SGD / Adam over a flat weight vector, sparse SGD / Adam over table rows.

Every gradient is first divided by the Solver's loss `scaler`: g = grad / scaler.

Dense (w, m, v, g: (P,) float32):
    SGD   w -= lr * g
    Adam  alpha_t = lr * sqrt(1 - b2^t) / (1 - b1^t)          (t = 1 on the first update; host float64)
          m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  w -= alpha_t m / (sqrt(v) + eps)
          (eps is NOT bias corrected: TensorFlow style)

Sparse (table, m, v: (V, D); rows (U,) int64 unique rows touched by the batch; grads (U, D)):
    SGD          table[rows[u]] -= lr * g[u]
    Adam Local   the dense Adam update on the hot rows only
    Adam Global  the dense Adam update on EVERY row each step, cold rows having g = 0. Done as HugeCTR
                 does, in two passes:
                   hot rows:        m += (1 - b1) g / b1;  v += (1 - b2) g^2 / b2
                   all n_rows rows: m *= b1;  v *= b2;  w -= alpha_t m / (sqrt(v) + eps)
                 (requires b1, b2 > 0), so cold rows keep drifting on their decaying momentum.

HugeCTR: HugeCTR/src/optimizers/sgd_optimizer.cu, adam_optimizer.cu and sparse_optimizer.cu
(adam_update_kernel_global / the Local and Global update_type branches).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from .launch import launch_1d


def _alpha_t64(lr: float, beta1: float, beta2: float, t: int) -> float:
    if t < 1:
        raise ValueError(f"Adam step t starts at 1, got {t}")
    return lr * math.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t)


def adam_alpha_t(lr: float, beta1: float, beta2: float, t: int) -> np.float32:
    """Bias-corrected step size lr * sqrt(1 - b2^t) / (1 - b1^t), in float64, returned as float32."""
    return np.float32(_alpha_t64(lr, beta1, beta2, t))


# ---- NumPy reference ---------------------------------------------------------------------------
# Computed in float64 from the scalars the kernels receive: for float32 state, lr/betas/eps/scaler/
# alpha_t are rounded to float32 first (as the launch wrappers and HugeCTR's float arguments do),
# because 1 - float32(0.999) already differs from 1 - 0.999 by 1e-5 relative. Results come back in
# the state's dtype; float64 state keeps every scalar exact (used by the equivalence tests).
def _scalars(dtype, *values) -> list[float]:
    return [float(np.float32(x)) if dtype == np.float32 else float(x) for x in values]


def _f64(*arrays) -> list[np.ndarray]:
    return [np.array(a, dtype=np.float64) for a in arrays]          # copies


def _adam_math(w, m, v, g, alpha_t, beta1, beta2, eps):
    """One Adam step on matching arrays (g already divided by scaler); returns new (w, m, v)."""
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    return w - alpha_t * m / (np.sqrt(v) + eps), m, v


def _check_unique_rows(rows: np.ndarray, n_rows: int) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.int64)
    # The kernels update each row without atomics: a duplicated row would race.
    assert np.unique(rows).size == rows.size, "sparse optimizer rows must be unique"
    assert rows.size == 0 or (rows.min() >= 0 and rows.max() < n_rows), "row out of range"
    return rows


def sgd_update_ref(w, g, lr, scaler):
    """New w (P,)."""
    lr, scaler = _scalars(w.dtype, lr, scaler)
    w64, g64 = _f64(w, g)
    return (w64 - lr * (g64 / scaler)).astype(w.dtype)


def adam_update_ref(w, m, v, g, lr, beta1, beta2, eps, t, scaler):
    """New (w, m, v), each (P,)."""
    alpha_t, beta1, beta2, eps, scaler = _scalars(w.dtype, _alpha_t64(lr, beta1, beta2, t),
                                                  beta1, beta2, eps, scaler)
    w64, m64, v64, g64 = _f64(w, m, v, g)
    out = _adam_math(w64, m64, v64, g64 / scaler, alpha_t, beta1, beta2, eps)
    return tuple(a.astype(w.dtype) for a in out)


def sparse_sgd_update_ref(table, rows, grads, lr, scaler):
    """New table (V, D): hot rows moved by -lr * g."""
    rows = _check_unique_rows(rows, table.shape[0])
    lr, scaler = _scalars(table.dtype, lr, scaler)
    w64, g64 = _f64(table, grads)
    w64[rows] -= lr * (g64 / scaler)
    return w64.astype(table.dtype)


def sparse_adam_local_update_ref(table, m, v, rows, grads, lr, beta1, beta2, eps, t, scaler):
    """New (table, m, v), each (V, D): Adam on the hot rows only."""
    rows = _check_unique_rows(rows, table.shape[0])
    alpha_t, beta1, beta2, eps, scaler = _scalars(table.dtype, _alpha_t64(lr, beta1, beta2, t),
                                                  beta1, beta2, eps, scaler)
    w64, m64, v64, g64 = _f64(table, m, v, grads)
    w64[rows], m64[rows], v64[rows] = _adam_math(w64[rows], m64[rows], v64[rows], g64 / scaler,
                                                 alpha_t, beta1, beta2, eps)
    return tuple(a.astype(table.dtype) for a in (w64, m64, v64))


def sparse_adam_global_hot_ref(m, v, rows, grads, beta1, beta2, scaler):
    """New (m, v), each (V, D): hot rows pre-divided by b1, b2 so that the all-rows pass is uniform."""
    rows = _check_unique_rows(rows, m.shape[0])
    beta1, beta2, scaler = _scalars(m.dtype, beta1, beta2, scaler)
    m64, v64, g64 = _f64(m, v, grads)
    g64 /= scaler
    m64[rows] += (1.0 - beta1) * g64 / beta1
    v64[rows] += (1.0 - beta2) * g64 * g64 / beta2
    return m64.astype(m.dtype), v64.astype(v.dtype)


def sparse_adam_global_all_ref(table, m, v, n_rows, lr, beta1, beta2, eps, t):
    """New (table, m, v), each (V, D): rows [0, n_rows) decay their moments and step."""
    assert 0 <= n_rows <= table.shape[0]
    alpha_t, beta1, beta2, eps = _scalars(table.dtype, _alpha_t64(lr, beta1, beta2, t),
                                          beta1, beta2, eps)
    w64, m64, v64 = _f64(table, m, v)
    live = slice(0, n_rows)
    m64[live] *= beta1
    v64[live] *= beta2
    w64[live] -= alpha_t * m64[live] / (np.sqrt(v64[live]) + eps)
    return tuple(a.astype(table.dtype) for a in (w64, m64, v64))


# ---- kernels (grid-stride; dense over P elements, sparse over U*D or n_rows*D elements) ------
@cuda.jit
def sgd_update_kernel(w, g, lr, scaler):
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        w[i] -= lr * (g[i] / scaler)


@cuda.jit
def adam_update_kernel(w, m, v, g, alpha_t, beta1, beta2, eps, scaler):
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        gi = g[i] / scaler
        mi = beta1 * m[i] + (float32(1.0) - beta1) * gi
        vi = beta2 * v[i] + (float32(1.0) - beta2) * gi * gi
        m[i] = mi
        v[i] = vi
        w[i] -= alpha_t * mi / (math.sqrt(vi) + eps)


@cuda.jit
def sparse_sgd_update_kernel(table, rows, grads, lr, scaler):
    d_size = table.shape[1]
    for i in range(cuda.grid(1), rows.shape[0] * d_size, cuda.gridsize(1)):
        u = i // d_size
        d = i - u * d_size
        table[rows[u], d] -= lr * (grads[u, d] / scaler)


@cuda.jit
def sparse_adam_local_update_kernel(table, m, v, rows, grads, alpha_t, beta1, beta2, eps, scaler):
    d_size = table.shape[1]
    for i in range(cuda.grid(1), rows.shape[0] * d_size, cuda.gridsize(1)):
        u = i // d_size
        d = i - u * d_size
        r = rows[u]
        gi = grads[u, d] / scaler
        mi = beta1 * m[r, d] + (float32(1.0) - beta1) * gi
        vi = beta2 * v[r, d] + (float32(1.0) - beta2) * gi * gi
        m[r, d] = mi
        v[r, d] = vi
        table[r, d] -= alpha_t * mi / (math.sqrt(vi) + eps)


@cuda.jit
def sparse_adam_global_hot_kernel(m, v, rows, grads, beta1, beta2, scaler):
    d_size = m.shape[1]
    for i in range(cuda.grid(1), rows.shape[0] * d_size, cuda.gridsize(1)):
        u = i // d_size
        d = i - u * d_size
        r = rows[u]
        gi = grads[u, d] / scaler
        # divided by b1 (b2) here because the all-rows pass multiplies every row by b1 (b2) next
        m[r, d] += (float32(1.0) - beta1) * gi / beta1
        v[r, d] += (float32(1.0) - beta2) * gi * gi / beta2


@cuda.jit
def sparse_adam_global_all_kernel(table, m, v, n_rows, alpha_t, beta1, beta2, eps):
    d_size = table.shape[1]
    for i in range(cuda.grid(1), n_rows * d_size, cuda.gridsize(1)):
        r = i // d_size
        d = i - r * d_size
        mi = beta1 * m[r, d]
        vi = beta2 * v[r, d]
        m[r, d] = mi
        v[r, d] = vi
        table[r, d] -= alpha_t * mi / (math.sqrt(vi) + eps)


# ---- launch wrappers (in place; allocate nothing; scalars passed to kernels as float32) -------
def sgd_update(w, g, lr, scaler) -> None:
    launch_1d(sgd_update_kernel, w.shape[0], w, g, np.float32(lr), np.float32(scaler))


def adam_update(w, m, v, g, lr, beta1, beta2, eps, t, scaler) -> None:
    launch_1d(adam_update_kernel, w.shape[0], w, m, v, g, adam_alpha_t(lr, beta1, beta2, t),
              np.float32(beta1), np.float32(beta2), np.float32(eps), np.float32(scaler))


def sparse_sgd_update(table, rows, grads, lr, scaler) -> None:
    launch_1d(sparse_sgd_update_kernel, rows.shape[0] * table.shape[1], table, rows, grads,
              np.float32(lr), np.float32(scaler))


def sparse_adam_local_update(table, m, v, rows, grads, lr, beta1, beta2, eps, t, scaler) -> None:
    launch_1d(sparse_adam_local_update_kernel, rows.shape[0] * table.shape[1], table, m, v, rows,
              grads, adam_alpha_t(lr, beta1, beta2, t), np.float32(beta1), np.float32(beta2),
              np.float32(eps), np.float32(scaler))


def sparse_adam_global_hot(m, v, rows, grads, beta1, beta2, scaler) -> None:
    launch_1d(sparse_adam_global_hot_kernel, rows.shape[0] * m.shape[1], m, v, rows, grads,
              np.float32(beta1), np.float32(beta2), np.float32(scaler))


def sparse_adam_global_all(table, m, v, n_rows, lr, beta1, beta2, eps, t) -> None:
    if not 0 <= n_rows <= table.shape[0]:
        raise ValueError(f"n_rows={n_rows} outside the table's {table.shape[0]} rows")
    launch_1d(sparse_adam_global_all_kernel, n_rows * table.shape[1], table, m, v, np.int64(n_rows),
              adam_alpha_t(lr, beta1, beta2, t), np.float32(beta1), np.float32(beta2),
              np.float32(eps))


_F1 = "float32[::1]"
_F2 = "float32[:, ::1]"
_I1 = "int64[::1]"
PTX_CHECKS = [
    (sgd_update_kernel, f"void({_F1}, {_F1}, float32, float32)"),
    (adam_update_kernel, f"void({_F1}, {_F1}, {_F1}, {_F1}, float32, float32, float32, float32, float32)"),
    (sparse_sgd_update_kernel, f"void({_F2}, {_I1}, {_F2}, float32, float32)"),
    (sparse_adam_local_update_kernel,
     f"void({_F2}, {_F2}, {_F2}, {_I1}, {_F2}, float32, float32, float32, float32, float32)"),
    (sparse_adam_global_hot_kernel, f"void({_F2}, {_F2}, {_I1}, {_F2}, float32, float32, float32)"),
    (sparse_adam_global_all_kernel, f"void({_F2}, {_F2}, {_F2}, int64, float32, float32, float32, float32)"),
]
