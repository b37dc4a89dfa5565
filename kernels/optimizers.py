"""Optimizer updates: the dense optimizers over a flat weight vector; HugeCTR's sparse rules over table rows.

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
each row's gradient already summed over its occurrences; all-rows passes cover rows [0, n_rows)). These
are NumPy references only: the embedding engine runs them as fused optimizers (kernels/tbe.py: its
reference calls the ones below on the rows it touched, its compiled paths use kernels/tbe_math.py):
    SGD            table[r] -= lr g    (HugeCTR's atomic_update=True adds -lr/scaler * wgrad per
                   occurrence with atomicAdd: the same sum in another order, so one rule serves both)
    Local          the dense rule of MomentumSGD / Nesterov / Adam / AdaGrad on the hot rows only
    AdaGrad, SGD   Global = Local (HugeCTR)
    Global = "every row updated every step, cold rows with g = 0", done as HugeCTR does in two passes:
      Adam         hot: m += (1 - b1) g / b1;  v += (1 - b2) g^2 / b2
                   all: m *= b1;  v *= b2;  w -= alpha_t m / (sqrt(v) + eps)       (needs b1, b2 > 0)
      MomentumSGD  hot: m -= lr g / f;   all: m *= f;  w += m                       (needs f != 0)
      Nesterov     all: a *= mu;  w += mu a;   hot: a -= lr g;  w -= (1 + mu) (lr g)
    LazyGlobal (Adam only): prev_time (int64, per element here, per row in the engine) starts at 1;
                   on a hot element at step t,
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
from numba import cuda, float32, float64

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
    # each touched row is updated once, from its summed gradient: a repeated row is a caller's bug
    assert np.unique(rows).size == rows.size, "sparse optimizer rows must be unique"
    assert rows.size == 0 or (rows.min() >= 0 and rows.max() < n_rows), "row out of range"
    return rows


# dense (any shape: the engine's reference applies them to the gathered hot rows (U, D))
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
def sgd_update_kernel(w, g, hp, scaler):
    if hp[hp.shape[0] - 1] == float32(0.0):              # the step's gate is shut: skipped
        return
    lr = hp[0]
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        w[i] -= lr * (g[i] / scaler)


@cuda.jit
def momentum_sgd_update_kernel(w, m, g, hp, factor, scaler):
    if hp[hp.shape[0] - 1] == float32(0.0):              # the step's gate is shut: skipped
        return
    lr = hp[0]
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        mi = factor * m[i] - lr * (g[i] / scaler)
        m[i] = mi
        w[i] += mi


@cuda.jit
def nesterov_update_kernel(w, a, g, hp, mu, scaler):
    if hp[hp.shape[0] - 1] == float32(0.0):              # the step's gate is shut: skipped
        return
    lr = hp[0]
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        a_old = a[i]
        a_new = mu * a_old - lr * (g[i] / scaler)
        a[i] = a_new
        w[i] += -mu * a_old + (float32(1.0) + mu) * a_new


@cuda.jit
def adam_update_kernel(w, m, v, g, hp, beta1, beta2, eps, scaler):
    if hp[hp.shape[0] - 1] == float32(0.0):              # the step's gate is shut: skipped
        return
    alpha_t = hp[0]
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        gi = g[i] / scaler
        mi = beta1 * m[i] + (float32(1.0) - beta1) * gi
        vi = beta2 * v[i] + (float32(1.0) - beta2) * gi * gi
        m[i] = mi
        v[i] = vi
        w[i] -= alpha_t * mi / (math.sqrt(vi) + eps)


@cuda.jit
def adagrad_update_kernel(w, acc, g, hp, eps, scaler):
    if hp[hp.shape[0] - 1] == float32(0.0):              # the step's gate is shut: skipped
        return
    lr = hp[0]
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        gi = g[i] / scaler
        ai = acc[i] + gi * gi
        acc[i] = ai
        w[i] -= lr * gi / (math.sqrt(ai) + eps)


@cuda.jit
def ftrl_update_kernel(w, z, n, g, hp, lambda1, scaler):
    if hp[hp.shape[0] - 1] == float32(0.0):              # the step's gate is shut: skipped
        return
    lr, lambda2p = hp[0], hp[1]
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


# ---- launch wrappers (in place; allocate nothing) ------------------------------------------------------
# The values that change from step to step (lr, Adam's alpha_t, Ftrl's l2') reach the kernels in a small
# float32 device array ``hp`` (``step_values`` below), never as launch arguments: a CUDA graph replays a
# launch's arguments as captured. The model hands in its per-step array (numbactr.runtime.step_values.StepValues);
# without one (a direct call) the wrapper uploads the values itself (a host-to-device copy).
_f = np.float32


def step_values(kind: str, lr, beta1=0.9, beta2=0.999, t=1, beta=0.0, lambda2=0.0) -> np.ndarray:
    """The per-step float32 values (``hp``) of a dense update: [lr] (SGD, MomentumSGD, Nesterov, AdaGrad),
    [alpha_t] (Adam, t >= 1), [lr, l2'] (Ftrl), each followed by the step's gate, 1.0 here. A kernel whose
    gate is 0 changes nothing: mixed precision shuts it on the device when a gradient overflowed
    (numbactr.model, Model._gate_updates), so the skip needs no host read."""
    if kind == "adam":
        return np.array([adam_alpha_t(lr, beta1, beta2, t), 1.0], np.float32)
    if kind == "ftrl":
        return np.array([lr, ftrl_lambda2(lr, beta, lambda2), 1.0], np.float32)
    return np.array([lr, 1.0], np.float32)


@cuda.jit
def adam_gate_kernel(hp, go, skips, tv, fv):
    """A gated Adam step's values on the device (one thread): the gate into hp's last value and, when it is
    open, alpha_t for t = the host's step count tv[0] less the skips the host has not seen yet (skips[0] -
    tv[1]), from fv = (lr, beta1, beta2) in float64 exactly as adam_alpha_t computes it on the host."""
    if cuda.grid(1) != 0:
        return
    hp[hp.shape[0] - 1] = float32(go[0])
    if go[0] == 0:
        return
    t = float64(tv[0] - (skips[0] - tv[1]))
    hp[0] = float32(fv[0] * math.sqrt(1.0 - math.pow(fv[2], t)) / (1.0 - math.pow(fv[1], t)))


def adam_gate(hp, go, skips, tv, fv) -> None:
    launch_1d(adam_gate_kernel, 1, hp, go, skips, tv, fv)


def _hp(hp, values):
    return cuda.to_device(values) if hp is None else hp


def sgd_update(w, g, lr, scaler, hp=None) -> None:
    launch_1d(sgd_update_kernel, w.shape[0], w, g, _hp(hp, step_values("sgd", lr)), _f(scaler))


def momentum_sgd_update(w, m, g, lr, factor, scaler, hp=None) -> None:
    launch_1d(momentum_sgd_update_kernel, w.shape[0], w, m, g, _hp(hp, step_values("sgd", lr)), _f(factor),
              _f(scaler))


def nesterov_update(w, a, g, lr, mu, scaler, hp=None) -> None:
    launch_1d(nesterov_update_kernel, w.shape[0], w, a, g, _hp(hp, step_values("sgd", lr)), _f(mu), _f(scaler))


def adam_update(w, m, v, g, lr, beta1, beta2, eps, t, scaler, hp=None) -> None:
    launch_1d(adam_update_kernel, w.shape[0], w, m, v, g, _hp(hp, step_values("adam", lr, beta1, beta2, t)),
              _f(beta1), _f(beta2), _f(eps), _f(scaler))


def adagrad_update(w, acc, g, lr, eps, scaler, hp=None) -> None:
    launch_1d(adagrad_update_kernel, w.shape[0], w, acc, g, _hp(hp, step_values("sgd", lr)), _f(eps), _f(scaler))


def ftrl_update(w, z, n, g, lr, beta, lambda1, lambda2, scaler, hp=None) -> None:
    launch_1d(ftrl_update_kernel, w.shape[0], w, z, n, g,
              _hp(hp, step_values("ftrl", lr, beta=beta, lambda2=lambda2)), _f(lambda1), _f(scaler))


_F1 = "float32[::1]"
PTX_CHECKS = [
    (sgd_update_kernel, f"void({_F1}, {_F1}, {_F1}, float32)"),
    (momentum_sgd_update_kernel, f"void({_F1}, {_F1}, {_F1}, {_F1}, float32, float32)"),
    (nesterov_update_kernel, f"void({_F1}, {_F1}, {_F1}, {_F1}, float32, float32)"),
    (adam_update_kernel, f"void({_F1}, {_F1}, {_F1}, {_F1}, {_F1}, float32, float32, float32, float32)"),
    (adagrad_update_kernel, f"void({_F1}, {_F1}, {_F1}, {_F1}, float32, float32)"),
    (ftrl_update_kernel, f"void({_F1}, {_F1}, {_F1}, {_F1}, {_F1}, float32, float32)"),
    (adam_gate_kernel, f"void({_F1}, int64[::1], int64[::1], int64[::1], float64[::1])"),
]
