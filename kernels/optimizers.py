"""Optimizer updates: the dense optimizers over a flat weight vector, the sparse ones over table rows.

Every gradient is first divided by the Solver's loss `scaler`: g = grad / scaler. `lr` is the Solver's
(scheduled) learning rate; lr = 0 is how HugeCTR freezes weights (the states still update).

Dense (w, g and every state: (P,) float32; states start at 0 unless noted):
    SGD          w -= lr g
    MomentumSGD  m = f m - lr g;  w += m                                       (f = momentum_factor)
    Nesterov     a_new = mu a - lr g;  w += -mu a + (1 + mu) a_new;  a = a_new  (mu = momentum_factor)
    Adam         alpha_t = lr sqrt(1 - b2^t) / (1 - b1^t)                (t = 1 on the first update;
                 m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2          host float64 -> float32)
                 w -= alpha_t m / (sqrt(v) + eps)       (eps NOT bias corrected: TensorFlow style)
    AdaGrad      acc += g^2;  w -= lr g / (sqrt(acc) + eps)
                 acc starts at initial_accu_value, or, HugeCTR-exact, at the float32 whose 4 bytes all
                 equal int(initial_accu_value) & 0xFF (HugeCTR fills it with a byte memset: ~0 always)
    Ftrl         n_new = n + g^2                                                (state order: z, n)
                 z += g + (sqrt(n + E) - sqrt(n_new + E)) w / lr                (E = FLT_EPSILON)
                 w = (l1 sign(z) - z) / (sqrt(n_new + E) / lr + l2')  if |z| > l1  else 0
                 l2' = l2 + beta / lr (float32, on the host, as HugeCTR passes it);  n = n_new
                 lr = 0 (frozen): HugeCTR divides by zero (NaN weights); here w stays, z += g, n = n_new

Sparse (table and states (V, D); rows (U,) int64 UNIQUE rows the batch touched ("hot"); grads (U, D),
each row's gradient already summed over its occurrences; all-rows passes cover rows [0, n_rows)):
    SGD            table[r] -= lr g    (HugeCTR's atomic_update=True adds -lr/scaler * wgrad per
                   occurrence with atomicAdd: the same sum in another order, so one kernel serves both)
    Local          the dense rule of MomentumSGD / Nesterov / Adam / AdaGrad on the hot rows only
    AdaGrad, SGD   Global = Local (HugeCTR)
    Global = "every row updated every step, cold rows with g = 0", done as HugeCTR does in two passes:
      Adam         hot: m += (1 - b1) g / b1;  v += (1 - b2) g^2 / b2
                   all: m *= b1;  v *= b2;  w -= alpha_t m / (sqrt(v) + eps)       (needs b1, b2 > 0)
      MomentumSGD  hot: m -= lr g / f;   all: m *= f;  w += m                       (needs f != 0)
      Nesterov     all: a *= mu;  w += mu a;   hot: a -= lr g;  w -= (1 + mu) (lr g)
    LazyGlobal (Adam only): prev_time (V, D) int64 starts at 1; on a hot element at step t,
                   skipped = t - prev_time;  prev_time = t
                   w -= lr/(1 - b1) * sqrt(1 - b2^prev)/(1 - b1^prev) * (1 - b1^skipped) * m/(sqrt(v) + eps)
                   m = b1^skipped m + (1 - b1) g;  v = b2^skipped v + (1 - b2) g^2
                   (the weight catches up on the OLD m, v: a row hot every step follows plain Adam
                   one step late; lr/(1 - b1) is computed in float32 like HugeCTR)

HugeCTR: HugeCTR/src/optimizers/sgd_optimizer.cu, momentum_sgd_optimizer.cu, nesterov_optimizer.cu,
adam_optimizer.cu, adagrad_optimizer.cu, ftrl_optimizer.cu (dense) and sparse_optimizer.cu
(opt_*_kernel, *_kernel_global, opt_adam_kernel_lazy; EmbeddingOptimizer::update's switch).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from .launch import launch_1d

FLT_EPSILON = np.float32(2.0 ** -23)          # C's FLT_EPSILON, Ftrl's guard inside the square roots


# ---- host-side scalars (HugeCTR computes these on the host) ------------------------------------
def _alpha_t64(lr: float, beta1: float, beta2: float, t: int) -> float:
    if t < 1:
        raise ValueError(f"Adam step t starts at 1, got {t}")
    return lr * math.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t)


def adam_alpha_t(lr: float, beta1: float, beta2: float, t: int) -> np.float32:
    """Bias-corrected step size lr * sqrt(1 - b2^t) / (1 - b1^t), in float64, returned as float32."""
    return np.float32(_alpha_t64(lr, beta1, beta2, t))


def lazy_adam_alpha_common(lr: float, beta1: float) -> np.float32:
    """lr / (1 - b1) in float32 arithmetic (HugeCTR's `alpha_t_common`)."""
    return np.float32(lr) / (np.float32(1.0) - np.float32(beta1))


def ftrl_lambda2(lr: float, beta: float, lambda2: float) -> np.float32:
    """l2' = l2 + beta / lr in float32 arithmetic (HugeCTR's launch argument); 0 when lr = 0 (unused)."""
    if lr == 0:
        return np.float32(0.0)
    return np.float32(lambda2) + np.float32(beta) / np.float32(lr)


def adagrad_initial_accumulator(initial_accu_value: float, hugectr_exact: bool) -> np.float32:
    """AdaGrad's starting accumulator value.

    numbactr: initial_accu_value (what the argument means). HugeCTR-exact: HugeCTR initializes with
    cudaMemset(acc, (int)initial_accu_value, bytes), a BYTE fill: the float32 whose four bytes all
    equal int(initial_accu_value) & 0xFF (0.7 -> 0.0, 1.0 -> 2.37e-38, -1.0 -> NaN).
    """
    if not hugectr_exact:
        return np.float32(initial_accu_value)
    byte = int(initial_accu_value) & 0xFF          # C float->int truncates toward 0, memset keeps a byte
    return np.frombuffer(bytes([byte] * 4), dtype="<f4")[0]


# ---- NumPy reference ---------------------------------------------------------------------------
# Computed in float64 from the scalars the kernels receive: for float32 state, lr/betas/eps/scaler/
# alpha_t are rounded to float32 first (as the launch wrappers and HugeCTR's float arguments do),
# because 1 - float32(0.999) already differs from 1 - 0.999 by 1e-5 relative. Results come back in
# the state's dtype; float64 state keeps every scalar exact (used by the equivalence tests).
def _scalars(dtype, *values) -> list[float]:
    return [float(np.float32(x)) if dtype == np.float32 else float(x) for x in values]


def _f64(*arrays) -> list[np.ndarray]:
    return [np.array(a, dtype=np.float64) for a in arrays]          # copies


def _back(dtype, *arrays) -> tuple:
    return tuple(a.astype(dtype) for a in arrays)


def _check_unique_rows(rows: np.ndarray, n_rows: int) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.int64)
    # The kernels update each row without atomics: a duplicated row would race.
    assert np.unique(rows).size == rows.size, "sparse optimizer rows must be unique"
    assert rows.size == 0 or (rows.min() >= 0 and rows.max() < n_rows), "row out of range"
    return rows


def _on_rows(row_ref, arrays, rows, grads, *args) -> tuple:
    """Apply a dense reference to the gathered hot rows of (table, *states); returns new full arrays."""
    rows = _check_unique_rows(rows, arrays[0].shape[0])
    out = [np.array(a) for a in arrays]                              # copies
    new = row_ref(*[a[rows] for a in out], grads, *args)
    new = new if isinstance(new, tuple) else (new,)
    for a, b in zip(out, new):
        a[rows] = b
    return tuple(out) if len(out) > 1 else out[0]


# dense (any shape: the sparse Local references apply these to gathered rows (U, D))
def sgd_update_ref(w, g, lr, scaler):
    """New w."""
    lr, scaler = _scalars(w.dtype, lr, scaler)
    w64, g64 = _f64(w, g)
    return (w64 - lr * (g64 / scaler)).astype(w.dtype)


def momentum_sgd_update_ref(w, m, g, lr, factor, scaler):
    """New (w, m)."""
    lr, factor, scaler = _scalars(w.dtype, lr, factor, scaler)
    w64, m64, g64 = _f64(w, m, g)
    m64 = factor * m64 - lr * (g64 / scaler)
    return _back(w.dtype, w64 + m64, m64)


def nesterov_update_ref(w, a, g, lr, mu, scaler):
    """New (w, a)."""
    lr, mu, scaler = _scalars(w.dtype, lr, mu, scaler)
    w64, a64, g64 = _f64(w, a, g)
    a_new = mu * a64 - lr * (g64 / scaler)
    return _back(w.dtype, w64 - mu * a64 + (1.0 + mu) * a_new, a_new)


def _adam_math(w, m, v, g, alpha_t, beta1, beta2, eps):
    """One Adam step on matching arrays (g already divided by scaler); returns new (w, m, v)."""
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    return w - alpha_t * m / (np.sqrt(v) + eps), m, v


def adam_update_ref(w, m, v, g, lr, beta1, beta2, eps, t, scaler):
    """New (w, m, v)."""
    alpha_t, beta1, beta2, eps, scaler = _scalars(w.dtype, _alpha_t64(lr, beta1, beta2, t),
                                                  beta1, beta2, eps, scaler)
    w64, m64, v64, g64 = _f64(w, m, v, g)
    return _back(w.dtype, *_adam_math(w64, m64, v64, g64 / scaler, alpha_t, beta1, beta2, eps))


def adagrad_update_ref(w, acc, g, lr, eps, scaler):
    """New (w, acc)."""
    lr, eps, scaler = _scalars(w.dtype, lr, eps, scaler)
    w64, acc64, g64 = _f64(w, acc, g)
    g64 /= scaler
    acc64 += g64 * g64
    return _back(w.dtype, w64 - lr * g64 / (np.sqrt(acc64) + eps), acc64)


def ftrl_update_ref(w, z, n, g, lr, beta, lambda1, lambda2, scaler):
    """New (w, z, n). float32 state takes HugeCTR's float32 l2' = l2 + beta/lr; float64 state the exact one."""
    if w.dtype == np.float32:
        l2p = float(ftrl_lambda2(lr, beta, lambda2))
    else:
        l2p = lambda2 + beta / lr if lr != 0 else 0.0
    lr, lambda1, scaler, eps = _scalars(w.dtype, lr, lambda1, scaler, FLT_EPSILON)
    w64, z64, n64, g64 = _f64(w, z, n, g)
    g64 /= scaler
    n_new = n64 + g64 * g64
    if lr == 0:                                   # frozen: w stays, the sums still take g
        return _back(w.dtype, w64, z64 + g64, n_new)
    z64 = z64 + g64 + (np.sqrt(n64 + eps) - np.sqrt(n_new + eps)) * w64 / lr
    sign = np.where(np.signbit(z64), -1.0, 1.0)
    w_new = (lambda1 * sign - z64) / (np.sqrt(n_new + eps) / lr + l2p)
    return _back(w.dtype, np.where(np.abs(z64) > lambda1, w_new, 0.0), z64, n_new)


def adam_lazy_update_ref(w, m, v, prev_time, g, lr, beta1, beta2, eps, t, scaler):
    """LazyGlobal Adam on gathered hot elements (all arrays the same shape); new (w, m, v, prev_time)."""
    if w.dtype == np.float32:
        alpha_common = float(lazy_adam_alpha_common(lr, beta1))
    else:
        alpha_common = lr / (1.0 - beta1)
    beta1, beta2, eps, scaler = _scalars(w.dtype, beta1, beta2, eps, scaler)
    w64, m64, v64, g64 = _f64(w, m, v, g)
    prev = np.asarray(prev_time, np.int64)
    skipped = (t - prev).astype(np.float64)
    b1_skip = beta1 ** skipped
    alpha = alpha_common * np.sqrt(1.0 - beta2 ** prev) / (1.0 - beta1 ** prev) * (1.0 - b1_skip)
    w64 = w64 - alpha * m64 / (np.sqrt(v64) + eps)                # catch-up on the old moments
    g64 /= scaler
    m64 = b1_skip * m64 + (1.0 - beta1) * g64
    v64 = beta2 ** skipped * v64 + (1.0 - beta2) * g64 * g64
    return (*_back(w.dtype, w64, m64, v64), np.full(prev.shape, t, np.int64))


# sparse, full tables in and out
def sparse_sgd_update_ref(table, rows, grads, lr, scaler):
    """New table (V, D): hot rows moved by -lr * g."""
    return _on_rows(sgd_update_ref, (table,), rows, grads, lr, scaler)


def sparse_momentum_sgd_local_update_ref(table, m, rows, grads, lr, factor, scaler):
    """New (table, m): MomentumSGD on the hot rows only."""
    return _on_rows(momentum_sgd_update_ref, (table, m), rows, grads, lr, factor, scaler)


def sparse_nesterov_local_update_ref(table, a, rows, grads, lr, mu, scaler):
    """New (table, a): Nesterov on the hot rows only."""
    return _on_rows(nesterov_update_ref, (table, a), rows, grads, lr, mu, scaler)


def sparse_adam_local_update_ref(table, m, v, rows, grads, lr, beta1, beta2, eps, t, scaler):
    """New (table, m, v): Adam on the hot rows only."""
    return _on_rows(adam_update_ref, (table, m, v), rows, grads, lr, beta1, beta2, eps, t, scaler)


def sparse_adagrad_update_ref(table, acc, rows, grads, lr, eps, scaler):
    """New (table, acc): AdaGrad on the hot rows (Local and Global alike)."""
    return _on_rows(adagrad_update_ref, (table, acc), rows, grads, lr, eps, scaler)


def sparse_adam_lazy_update_ref(table, m, v, prev_time, rows, grads, lr, beta1, beta2, eps, t, scaler):
    """New (table, m, v, prev_time): LazyGlobal Adam on the hot rows."""
    return _on_rows(adam_lazy_update_ref, (table, m, v, prev_time), rows, grads, lr, beta1, beta2, eps,
                    t, scaler)


def sparse_adam_global_hot_ref(m, v, rows, grads, beta1, beta2, scaler):
    """New (m, v): hot rows pre-divided by b1, b2 so that the all-rows pass is uniform."""
    rows = _check_unique_rows(rows, m.shape[0])
    beta1, beta2, scaler = _scalars(m.dtype, beta1, beta2, scaler)
    m64, v64, g64 = _f64(m, v, grads)
    g64 /= scaler
    m64[rows] += (1.0 - beta1) * g64 / beta1
    v64[rows] += (1.0 - beta2) * g64 * g64 / beta2
    return _back(m.dtype, m64, v64)


def sparse_adam_global_all_ref(table, m, v, n_rows, lr, beta1, beta2, eps, t):
    """New (table, m, v): rows [0, n_rows) decay their moments and step."""
    assert 0 <= n_rows <= table.shape[0]
    alpha_t, beta1, beta2, eps = _scalars(table.dtype, _alpha_t64(lr, beta1, beta2, t),
                                          beta1, beta2, eps)
    w64, m64, v64 = _f64(table, m, v)
    live = slice(0, n_rows)
    m64[live] *= beta1
    v64[live] *= beta2
    w64[live] -= alpha_t * m64[live] / (np.sqrt(v64[live]) + eps)
    return _back(table.dtype, w64, m64, v64)


def sparse_momentum_sgd_global_hot_ref(m, rows, grads, lr, factor, scaler):
    """New m (V, D): hot rows m -= lr g / f (the all-rows pass multiplies by f next)."""
    rows = _check_unique_rows(rows, m.shape[0])
    lr, factor, scaler = _scalars(m.dtype, lr, factor, scaler)
    m64, g64 = _f64(m, grads)
    m64[rows] -= lr * (g64 / scaler) / factor
    return m64.astype(m.dtype)


def sparse_momentum_sgd_global_all_ref(table, m, n_rows, factor):
    """New (table, m): rows [0, n_rows) do m *= f; w += m."""
    assert 0 <= n_rows <= table.shape[0]
    (factor,) = _scalars(table.dtype, factor)
    w64, m64 = _f64(table, m)
    m64[:n_rows] *= factor
    w64[:n_rows] += m64[:n_rows]
    return _back(table.dtype, w64, m64)


def sparse_nesterov_global_all_ref(table, a, n_rows, mu):
    """New (table, a): rows [0, n_rows) do a *= mu; w += mu a."""
    assert 0 <= n_rows <= table.shape[0]
    (mu,) = _scalars(table.dtype, mu)
    w64, a64 = _f64(table, a)
    a64[:n_rows] *= mu
    w64[:n_rows] += mu * a64[:n_rows]
    return _back(table.dtype, w64, a64)


def sparse_nesterov_global_hot_ref(table, a, rows, grads, lr, mu, scaler):
    """New (table, a): hot rows a -= lr g; w -= (1 + mu) lr g (after the all-rows pass)."""
    rows = _check_unique_rows(rows, table.shape[0])
    lr, mu, scaler = _scalars(table.dtype, lr, mu, scaler)
    w64, a64, g64 = _f64(table, a, grads)
    step = lr * (g64 / scaler)
    a64[rows] -= step
    w64[rows] -= (1.0 + mu) * step
    return _back(table.dtype, w64, a64)


# ---- kernels: dense over P elements (grid-stride) ---------------------------------------------
@cuda.jit
def sgd_update_kernel(w, g, lr, scaler):
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        w[i] -= lr * (g[i] / scaler)


@cuda.jit
def momentum_sgd_update_kernel(w, m, g, lr, factor, scaler):
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        mi = factor * m[i] - lr * (g[i] / scaler)
        m[i] = mi
        w[i] += mi


@cuda.jit
def nesterov_update_kernel(w, a, g, lr, mu, scaler):
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        a_old = a[i]
        a_new = mu * a_old - lr * (g[i] / scaler)
        a[i] = a_new
        w[i] += -mu * a_old + (float32(1.0) + mu) * a_new


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
def adagrad_update_kernel(w, acc, g, lr, eps, scaler):
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        gi = g[i] / scaler
        ai = acc[i] + gi * gi
        acc[i] = ai
        w[i] -= lr * gi / (math.sqrt(ai) + eps)


@cuda.jit
def ftrl_update_kernel(w, z, n, g, lr, lambda1, lambda2p, scaler):
    eps = float32(1.1920928955078125e-07)                  # FLT_EPSILON
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        gi = g[i] / scaler
        ni = n[i]
        n_new = ni + gi * gi
        n[i] = n_new
        if lr == float32(0.0):                             # frozen: HugeCTR would divide by 0
            z[i] += gi
        else:
            zi = z[i] + gi + (math.sqrt(ni + eps) - math.sqrt(n_new + eps)) * w[i] / lr
            z[i] = zi
            if abs(zi) > lambda1:
                x = lambda1 * math.copysign(float32(1.0), zi) - zi
                w[i] = x / (math.sqrt(n_new + eps) / lr + lambda2p)
            else:
                w[i] = float32(0.0)


# ---- kernels: sparse over the U*D hot elements or the n_rows*D live elements ----------------
@cuda.jit
def sparse_sgd_update_kernel(table, rows, grads, lr, scaler):
    d_size = table.shape[1]
    for i in range(cuda.grid(1), rows.shape[0] * d_size, cuda.gridsize(1)):
        u = i // d_size
        d = i - u * d_size
        table[rows[u], d] -= lr * (grads[u, d] / scaler)


@cuda.jit
def sparse_momentum_sgd_local_update_kernel(table, m, rows, grads, lr, factor, scaler):
    d_size = table.shape[1]
    for i in range(cuda.grid(1), rows.shape[0] * d_size, cuda.gridsize(1)):
        u = i // d_size
        d = i - u * d_size
        r = rows[u]
        mi = factor * m[r, d] - lr * (grads[u, d] / scaler)
        m[r, d] = mi
        table[r, d] += mi


@cuda.jit
def sparse_momentum_sgd_global_hot_kernel(m, rows, grads, lr, factor, scaler):
    d_size = m.shape[1]
    for i in range(cuda.grid(1), rows.shape[0] * d_size, cuda.gridsize(1)):
        u = i // d_size
        d = i - u * d_size
        # divided by f here because the all-rows pass multiplies every row by f next
        m[rows[u], d] -= lr * (grads[u, d] / scaler) / factor


@cuda.jit
def sparse_momentum_sgd_global_all_kernel(table, m, n_rows, factor):
    d_size = table.shape[1]
    for i in range(cuda.grid(1), n_rows * d_size, cuda.gridsize(1)):
        r = i // d_size
        d = i - r * d_size
        mi = factor * m[r, d]
        m[r, d] = mi
        table[r, d] += mi


@cuda.jit
def sparse_nesterov_local_update_kernel(table, a, rows, grads, lr, mu, scaler):
    d_size = table.shape[1]
    for i in range(cuda.grid(1), rows.shape[0] * d_size, cuda.gridsize(1)):
        u = i // d_size
        d = i - u * d_size
        r = rows[u]
        a_old = a[r, d]
        a_new = mu * a_old - lr * (grads[u, d] / scaler)
        a[r, d] = a_new
        table[r, d] += -mu * a_old + (float32(1.0) + mu) * a_new


@cuda.jit
def sparse_nesterov_global_all_kernel(table, a, n_rows, mu):
    d_size = table.shape[1]
    for i in range(cuda.grid(1), n_rows * d_size, cuda.gridsize(1)):
        r = i // d_size
        d = i - r * d_size
        ai = mu * a[r, d]
        a[r, d] = ai
        table[r, d] += mu * ai


@cuda.jit
def sparse_nesterov_global_hot_kernel(table, a, rows, grads, lr, mu, scaler):
    d_size = table.shape[1]
    for i in range(cuda.grid(1), rows.shape[0] * d_size, cuda.gridsize(1)):
        u = i // d_size
        d = i - u * d_size
        r = rows[u]
        step = lr * (grads[u, d] / scaler)
        a[r, d] -= step
        table[r, d] -= (float32(1.0) + mu) * step


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


@cuda.jit
def sparse_adam_lazy_update_kernel(table, m, v, prev_time, rows, grads, alpha_common, beta1, beta2, eps,
                                   t, scaler):
    d_size = table.shape[1]
    one = float32(1.0)
    for i in range(cuda.grid(1), rows.shape[0] * d_size, cuda.gridsize(1)):
        u = i // d_size
        d = i - u * d_size
        r = rows[u]
        prev = prev_time[r, d]
        prev_time[r, d] = t
        skipped = float32(t - prev)
        prev_f = float32(prev)
        b1_skip = math.pow(beta1, skipped)
        alpha = (alpha_common * math.sqrt(one - math.pow(beta2, prev_f)) / (one - math.pow(beta1, prev_f))
                 * (one - b1_skip))
        mi = m[r, d]
        vi = v[r, d]
        table[r, d] -= alpha * mi / (math.sqrt(vi) + eps)        # catch-up on the old moments
        gi = grads[u, d] / scaler
        m[r, d] = b1_skip * mi + (one - beta1) * gi
        v[r, d] = math.pow(beta2, skipped) * vi + (one - beta2) * gi * gi


@cuda.jit
def sparse_adagrad_update_kernel(table, acc, rows, grads, lr, eps, scaler):
    d_size = table.shape[1]
    for i in range(cuda.grid(1), rows.shape[0] * d_size, cuda.gridsize(1)):
        u = i // d_size
        d = i - u * d_size
        r = rows[u]
        gi = grads[u, d] / scaler
        ai = acc[r, d] + gi * gi
        acc[r, d] = ai
        table[r, d] -= lr * gi / (math.sqrt(ai) + eps)


# ---- launch wrappers (in place; allocate nothing; scalars passed to kernels as float32) -------
_f = np.float32


def _live(table, n_rows: int) -> int:
    if not 0 <= n_rows <= table.shape[0]:
        raise ValueError(f"n_rows={n_rows} outside the table's {table.shape[0]} rows")
    return n_rows * table.shape[1]


def sgd_update(w, g, lr, scaler) -> None:
    launch_1d(sgd_update_kernel, w.shape[0], w, g, _f(lr), _f(scaler))


def momentum_sgd_update(w, m, g, lr, factor, scaler) -> None:
    launch_1d(momentum_sgd_update_kernel, w.shape[0], w, m, g, _f(lr), _f(factor), _f(scaler))


def nesterov_update(w, a, g, lr, mu, scaler) -> None:
    launch_1d(nesterov_update_kernel, w.shape[0], w, a, g, _f(lr), _f(mu), _f(scaler))


def adam_update(w, m, v, g, lr, beta1, beta2, eps, t, scaler) -> None:
    launch_1d(adam_update_kernel, w.shape[0], w, m, v, g, adam_alpha_t(lr, beta1, beta2, t),
              _f(beta1), _f(beta2), _f(eps), _f(scaler))


def adagrad_update(w, acc, g, lr, eps, scaler) -> None:
    launch_1d(adagrad_update_kernel, w.shape[0], w, acc, g, _f(lr), _f(eps), _f(scaler))


def ftrl_update(w, z, n, g, lr, beta, lambda1, lambda2, scaler) -> None:
    launch_1d(ftrl_update_kernel, w.shape[0], w, z, n, g, _f(lr), _f(lambda1),
              ftrl_lambda2(lr, beta, lambda2), _f(scaler))


def sparse_sgd_update(table, rows, grads, lr, scaler) -> None:
    launch_1d(sparse_sgd_update_kernel, rows.shape[0] * table.shape[1], table, rows, grads, _f(lr),
              _f(scaler))


def sparse_momentum_sgd_local_update(table, m, rows, grads, lr, factor, scaler) -> None:
    launch_1d(sparse_momentum_sgd_local_update_kernel, rows.shape[0] * table.shape[1], table, m, rows,
              grads, _f(lr), _f(factor), _f(scaler))


def sparse_momentum_sgd_global_hot(m, rows, grads, lr, factor, scaler) -> None:
    launch_1d(sparse_momentum_sgd_global_hot_kernel, rows.shape[0] * m.shape[1], m, rows, grads, _f(lr),
              _f(factor), _f(scaler))


def sparse_momentum_sgd_global_all(table, m, n_rows, factor) -> None:
    launch_1d(sparse_momentum_sgd_global_all_kernel, _live(table, n_rows), table, m, np.int64(n_rows),
              _f(factor))


def sparse_nesterov_local_update(table, a, rows, grads, lr, mu, scaler) -> None:
    launch_1d(sparse_nesterov_local_update_kernel, rows.shape[0] * table.shape[1], table, a, rows, grads,
              _f(lr), _f(mu), _f(scaler))


def sparse_nesterov_global_all(table, a, n_rows, mu) -> None:
    launch_1d(sparse_nesterov_global_all_kernel, _live(table, n_rows), table, a, np.int64(n_rows), _f(mu))


def sparse_nesterov_global_hot(table, a, rows, grads, lr, mu, scaler) -> None:
    launch_1d(sparse_nesterov_global_hot_kernel, rows.shape[0] * table.shape[1], table, a, rows, grads,
              _f(lr), _f(mu), _f(scaler))


def sparse_adam_local_update(table, m, v, rows, grads, lr, beta1, beta2, eps, t, scaler) -> None:
    launch_1d(sparse_adam_local_update_kernel, rows.shape[0] * table.shape[1], table, m, v, rows,
              grads, adam_alpha_t(lr, beta1, beta2, t), _f(beta1), _f(beta2), _f(eps), _f(scaler))


def sparse_adam_global_hot(m, v, rows, grads, beta1, beta2, scaler) -> None:
    launch_1d(sparse_adam_global_hot_kernel, rows.shape[0] * m.shape[1], m, v, rows, grads,
              _f(beta1), _f(beta2), _f(scaler))


def sparse_adam_global_all(table, m, v, n_rows, lr, beta1, beta2, eps, t) -> None:
    launch_1d(sparse_adam_global_all_kernel, _live(table, n_rows), table, m, v, np.int64(n_rows),
              adam_alpha_t(lr, beta1, beta2, t), _f(beta1), _f(beta2), _f(eps))


def sparse_adam_lazy_update(table, m, v, prev_time, rows, grads, lr, beta1, beta2, eps, t, scaler) -> None:
    """prev_time: (V, D) int64, 1 before a row's first update; t: this update's step (>= 1)."""
    if t < 1:
        raise ValueError(f"Adam step t starts at 1, got {t}")
    launch_1d(sparse_adam_lazy_update_kernel, rows.shape[0] * table.shape[1], table, m, v, prev_time, rows,
              grads, lazy_adam_alpha_common(lr, beta1), _f(beta1), _f(beta2), _f(eps), np.int64(t),
              _f(scaler))


def sparse_adagrad_update(table, acc, rows, grads, lr, eps, scaler) -> None:
    launch_1d(sparse_adagrad_update_kernel, rows.shape[0] * table.shape[1], table, acc, rows, grads,
              _f(lr), _f(eps), _f(scaler))


_F1 = "float32[::1]"
_F2 = "float32[:, ::1]"
_I1 = "int64[::1]"
_I2 = "int64[:, ::1]"
PTX_CHECKS = [
    (sgd_update_kernel, f"void({_F1}, {_F1}, float32, float32)"),
    (momentum_sgd_update_kernel, f"void({_F1}, {_F1}, {_F1}, float32, float32, float32)"),
    (nesterov_update_kernel, f"void({_F1}, {_F1}, {_F1}, float32, float32, float32)"),
    (adam_update_kernel, f"void({_F1}, {_F1}, {_F1}, {_F1}, float32, float32, float32, float32, float32)"),
    (adagrad_update_kernel, f"void({_F1}, {_F1}, {_F1}, float32, float32, float32)"),
    (ftrl_update_kernel, f"void({_F1}, {_F1}, {_F1}, {_F1}, float32, float32, float32, float32)"),
    (sparse_sgd_update_kernel, f"void({_F2}, {_I1}, {_F2}, float32, float32)"),
    (sparse_momentum_sgd_local_update_kernel, f"void({_F2}, {_F2}, {_I1}, {_F2}, float32, float32, float32)"),
    (sparse_momentum_sgd_global_hot_kernel, f"void({_F2}, {_I1}, {_F2}, float32, float32, float32)"),
    (sparse_momentum_sgd_global_all_kernel, f"void({_F2}, {_F2}, int64, float32)"),
    (sparse_nesterov_local_update_kernel, f"void({_F2}, {_F2}, {_I1}, {_F2}, float32, float32, float32)"),
    (sparse_nesterov_global_all_kernel, f"void({_F2}, {_F2}, int64, float32)"),
    (sparse_nesterov_global_hot_kernel, f"void({_F2}, {_F2}, {_I1}, {_F2}, float32, float32, float32)"),
    (sparse_adam_local_update_kernel,
     f"void({_F2}, {_F2}, {_F2}, {_I1}, {_F2}, float32, float32, float32, float32, float32)"),
    (sparse_adam_global_hot_kernel, f"void({_F2}, {_F2}, {_I1}, {_F2}, float32, float32, float32)"),
    (sparse_adam_global_all_kernel, f"void({_F2}, {_F2}, {_F2}, int64, float32, float32, float32, float32)"),
    (sparse_adam_lazy_update_kernel,
     f"void({_F2}, {_F2}, {_F2}, {_I2}, {_I1}, {_F2}, float32, float32, float32, float32, int64, float32)"),
    (sparse_adagrad_update_kernel, f"void({_F2}, {_F2}, {_I1}, {_F2}, float32, float32, float32)"),
]
