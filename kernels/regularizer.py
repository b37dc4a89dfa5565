"""L1 / L2 weight regularizers over the flat dense weight vector.

    w (P,) every trainable dense weight, b the per-rank batch size, lam = lambda
    L2: rterm = lam/(2b) * sum_p w_p^2        wgrad_init_p = (lam/b) * w_p
    L1: rterm = lam/b    * sum_p |w_p|        wgrad_init_p = (lam/b) * sign(w_p),  sign(0) = -1

rterm is added to the loss value; wgrad_init is what the dense weight gradient starts from before the
layers accumulate into it (a loss without a regularizer starts it from 0). sign(0) = -1 is HugeCTR's
choice (``w > 0 ? lam/b : -lam/b``); any value in [-1, 1] is a valid subgradient of |w| at 0.
Kinds are the strings "L1" / "L2" (this module imports nothing from numbactr).

HugeCTR: HugeCTR/src/regularizers/l1_regularizer.cu, l2_regularizer.cu (cublasSasum / cublasSdot for
the term, transform_array for the gradient).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32

from .launch import check_block_size, launch_1d, REDUCE_THREADS
from .block_reduce import block_sum

KINDS = {"L1": 0, "L2": 1}


def _code(kind: str) -> int:
    if kind not in KINDS:
        raise ValueError(f"regularizer kind must be one of {sorted(KINDS)}, got {kind!r}")
    return KINDS[kind]


def _check_b(b: int) -> None:
    if b <= 0:
        raise ValueError(f"regularizer: batch size b must be > 0, got {b}")


# ---- NumPy reference -------------------------------------------------------------------------
def regularizer_term_ref(w: np.ndarray, kind: str, lam: float, b: int) -> float:
    """rterm (a Python float, summed in float64)."""
    _check_b(b)
    w = np.asarray(w, np.float64).reshape(-1)
    if _code(kind) == 1:
        return float(lam / (2.0 * b) * np.dot(w, w))
    return float(lam / b * np.abs(w).sum())


def regularizer_grad_ref(w: np.ndarray, kind: str, lam: float, b: int) -> np.ndarray:
    """wgrad_init, same shape and dtype as w."""
    _check_b(b)
    alpha = w.dtype.type(lam / b)
    if _code(kind) == 1:
        return alpha * w
    return np.where(w > 0, alpha, -alpha).astype(w.dtype)


# ---- kernels ---------------------------------------------------------------------------------
@cuda.jit
def regularizer_grad_kernel(w, g, kind, alpha, accumulate):
    # w, g flat (P,); kind 0 = L1, 1 = L2; alpha = lam / b; accumulate 1: g += grad, 0: g = grad
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        v = w[i]
        if kind == 1:
            r = alpha * v
        elif v > float32(0.0):
            r = alpha
        else:
            r = -alpha
        if accumulate != 0:
            g[i] += r
        else:
            g[i] = r


@functools.lru_cache(maxsize=None)
def make_regularizer_term_kernel(tpb: int):
    """Block-reduced sum of w^2 (L2) or |w| (L1), scaled by alpha, ADDED to out[0].

    For blocks of exactly ``tpb`` threads (a power of two, <= 1024), any grid size.
    """
    check_block_size(tpb)

    @cuda.jit
    def regularizer_term_kernel(w, out, kind, alpha):
        # w flat (P,); out (1,); alpha = lam/(2b) for L2, lam/b for L1
        partial = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        acc = float32(0.0)
        for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
            v = w[i]
            if kind == 1:
                acc += v * v
            else:
                acc += abs(v)
        partial[t] = acc
        block_sum(partial, t, tpb)
        if t == 0:
            cuda.atomic.add(out, 0, partial[0] * alpha)

    return regularizer_term_kernel


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def regularizer_term_add(w, out, kind: str, lam: float, b: int, threads: int | None = None) -> None:
    """ADD rterm to out[0] (out: (1,) float32); w any shape, read flat. Nothing to add when P == 0."""
    _check_b(b)
    code = _code(kind)
    alpha = lam / (2.0 * b) if code == 1 else lam / b
    tpb = threads or REDUCE_THREADS
    launch_1d(make_regularizer_term_kernel(tpb), w.size, w.reshape(-1), out, np.int64(code),
              np.float32(alpha), threads=tpb)


def regularizer_grad_init(w, out, kind: str, lam: float, b: int, accumulate: bool = False,
                          threads: int | None = None) -> None:
    """out = wgrad_init(w) elementwise, or out += wgrad_init(w) when accumulate (out same size as w)."""
    _check_b(b)
    launch_1d(regularizer_grad_kernel, w.size, w.reshape(-1), out.reshape(-1), np.int64(_code(kind)),
              np.float32(lam / b), np.int64(1 if accumulate else 0), threads=threads)


PTX_CHECKS = [
    (regularizer_grad_kernel, "void(float32[::1], float32[::1], int64, float32, int64)"),
    (make_regularizer_term_kernel(256), "void(float32[::1], float32[::1], int64, float32)"),
]
