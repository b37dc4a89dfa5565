"""The dense optimizer updates compiled for the CPU (numba.njit, parallel over chunks of the flat vector).

The same rules as kernels/optimizers.py's dense kernels (formulas in its docstring; NumPy references there
are the oracle), for the ``cpu`` device: SGD, MomentumSGD, Nesterov, Adam and AdaGrad over the flat weight
vector w (P,) and its states. Their element rules are HugeCTR's sparse Local rules on one element, which
the embedding engine already compiles (kernels/tbe_math.elem_update, njit in kernels/tbe_cpu.py), so the
float32 arithmetic is written once. Ftrl has no compiled version (the cpu device runs its reference).
Each element is independent: the chunks (kernels/parallel_cpu.py) only spread the work, the thread count
never changes a bit.

The wrappers take the kernel wrappers' arguments (float32 scalars, in place, allocate nothing).
"""
from __future__ import annotations

import numpy as np
from numba import float32, njit, prange

from . import tbe_math as M
from .optimizers import adam_alpha_t
from .parallel_cpu import FLAT_CHUNK, PARALLEL_MIN, pjit
from .tbe_cpu import elem_state_count, elem_update

_LOCAL = int(M.UpdateType.LOCAL)
_H_SGD, _H_MOM, _H_NES = int(M.Optim.HUGECTR_SGD), int(M.Optim.HUGECTR_MOMENTUM_SGD), int(M.Optim.HUGECTR_NESTEROV)
_H_ADAM, _H_ADAGRAD = int(M.Optim.HUGECTR_ADAM), int(M.Optim.HUGECTR_ADAGRAD)
_NO_STATE = np.zeros(0, np.float32)      # stands in for an absent state (never indexed)


@njit(cache=True, inline="always", error_model="numpy")
def _update_loop(kind, states, w, a, b, g, lr, eps, b1, b2, mom, scaler, alpha):
    zero, one = float32(0.0), float32(1.0)
    for i in range(w.shape[0]):
        ai = a[i] if states >= 1 else zero
        bi = b[i] if states == 2 else zero
        wi, ai, bi, _ = elem_update(kind, _LOCAL, g[i], w[i], ai, bi, zero, zero, zero, lr, eps, b1, b2,
                                    zero, mom, scaler, one, one, alpha)
        w[i] = wi
        if states >= 1:
            a[i] = ai
        if states == 2:
            b[i] = bi


@njit(cache=True, inline="always", error_model="numpy")
def _update_span(kind, states, w, a, b, g, lr, eps, b1, b2, mom, scaler, alpha):
    # one loop per rule, each with its kind a constant: the compiler drops elem_update's other branches and
    # the loop runs straight (a loop testing the kind per element: 370k Adam elements in 1.2 ms; this: 0.16)
    if kind == _H_ADAM:
        _update_loop(_H_ADAM, 2, w, a, b, g, lr, eps, b1, b2, mom, scaler, alpha)
    elif kind == _H_SGD:
        _update_loop(_H_SGD, 0, w, a, b, g, lr, eps, b1, b2, mom, scaler, alpha)
    elif kind == _H_MOM:
        _update_loop(_H_MOM, 1, w, a, b, g, lr, eps, b1, b2, mom, scaler, alpha)
    elif kind == _H_NES:
        _update_loop(_H_NES, 1, w, a, b, g, lr, eps, b1, b2, mom, scaler, alpha)
    elif kind == _H_ADAGRAD:
        _update_loop(_H_ADAGRAD, 1, w, a, b, g, lr, eps, b1, b2, mom, scaler, alpha)
    else:
        _update_loop(kind, states, w, a, b, g, lr, eps, b1, b2, mom, scaler, alpha)


@pjit(cache=True, error_model="numpy")  # x / 0 is inf / nan, as in the kernels (and no test per division)
def _dense_update(kind, w, a, b, g, lr, eps, b1, b2, mom, scaler, alpha):
    """w, a, b (states by elem_state_count(kind)), g: (P,) float32; scalars float32."""
    n = w.shape[0]
    states = elem_state_count(kind)
    if n < PARALLEL_MIN:
        _update_span(kind, states, w, a, b, g, lr, eps, b1, b2, mom, scaler, alpha)
    else:
        for c in prange((n + FLAT_CHUNK - 1) // FLAT_CHUNK):
            lo, hi = c * FLAT_CHUNK, (c + 1) * FLAT_CHUNK
            _update_span(kind, states, w[lo:hi], a[lo:hi] if states >= 1 else a, b[lo:hi] if states == 2 else b,
                         g[lo:hi], lr, eps, b1, b2, mom, scaler, alpha)


_f = np.float32


def _run(kind, w, a, b, g, lr=0.0, eps=0.0, b1=0.0, b2=0.0, mom=0.0, scaler=1.0, alpha=0.0) -> None:
    _dense_update(int(kind), w, a, b, g, _f(lr), _f(eps), _f(b1), _f(b2), _f(mom), _f(scaler), _f(alpha))


def sgd_update(w, g, lr, scaler) -> None:
    _run(M.Optim.HUGECTR_SGD, w, _NO_STATE, _NO_STATE, g, lr=lr, scaler=scaler)


def momentum_sgd_update(w, m, g, lr, factor, scaler) -> None:
    _run(M.Optim.HUGECTR_MOMENTUM_SGD, w, m, _NO_STATE, g, lr=lr, mom=factor, scaler=scaler)


def nesterov_update(w, a, g, lr, mu, scaler) -> None:
    _run(M.Optim.HUGECTR_NESTEROV, w, a, _NO_STATE, g, lr=lr, mom=mu, scaler=scaler)


def adam_update(w, m, v, g, lr, beta1, beta2, eps, t, scaler) -> None:
    _run(M.Optim.HUGECTR_ADAM, w, m, v, g, eps=eps, b1=beta1, b2=beta2, scaler=scaler,
         alpha=adam_alpha_t(lr, beta1, beta2, t))


def adagrad_update(w, acc, g, lr, eps, scaler) -> None:
    _run(M.Optim.HUGECTR_ADAGRAD, w, acc, _NO_STATE, g, lr=lr, eps=eps, scaler=scaler)


#: no kernels here (compiled CPU code only)
PTX_CHECKS = []
