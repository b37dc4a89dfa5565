"""Elementwise ops on same-shape tensors: Add, Sub, ElementwiseMultiply, ELU, Sigmoid.

All tensors have one common shape of M elements (any rank); kernels see flat (M,) views, and the
N-ary ops see their K inputs stacked into one (K, M) array.

    Add (K >= 2):       y = sum_k x_k                     dx_k = dy
    Sub:                y = a - b                         da = dy, db = -dy
    Multiply (K >= 2):  y = prod_k x_k
        correct:        dx_k = dy * prod_{j != k} x_j     (product rule; fine where some x_j == 0)
        HugeCTR exact:  dx_k = 0 if y == 0 else dy * (y / x_k)
    ELU (alpha):        y = x if x >= 0 else alpha * (exp(x) - 1)
                        dx = dy if x >= 0 else alpha * exp(x) * dy
    Sigmoid:            y = 1 / (1 + exp(-x))             dx = dy * y * (1 - y)

The HugeCTR multiply gradient returns 0 for EVERY input wherever the product is 0, even for the
input whose partner caused the zero (x_0 = 0, x_1 = 3: the true dx_0 is 3*dy); numbactr uses the
product rule unless the caller asks for the exact quotient form.

Sigmoid is evaluated as exp(-|x|) based branches so that no exp overflows; the backward reads the
saved output y (HugeCTR recomputes y from x; the value is the same).

HugeCTR: HugeCTR/src/layers/add_layer.cu, sub_layer.cu, elementwise_multiply_layer.cu, elu_layer.cu,
sigmoid_layer.cu.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from .launch import launch_1d


# ---- NumPy references ------------------------------------------------------------------------
def add_forward_ref(xs) -> np.ndarray:
    """Sum of K same-shape arrays, in input order."""
    y = xs[0] + xs[1]
    for x in xs[2:]:
        y = y + x
    return y


def add_backward_ref(dy: np.ndarray, k: int) -> list[np.ndarray]:
    return [dy.copy() for _ in range(k)]


def sub_forward_ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a - b


def sub_backward_ref(dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return dy.copy(), -dy


def multiply_forward_ref(xs) -> np.ndarray:
    """Product of K same-shape arrays, in input order."""
    y = xs[0] * xs[1]
    for x in xs[2:]:
        y = y * x
    return y


def multiply_backward_ref(xs, dy: np.ndarray, exact: bool = False, y: np.ndarray | None = None):
    """Gradient of each input. exact=True: HugeCTR's dy * (y / x_k), 0 where y == 0."""
    if exact:
        y = multiply_forward_ref(xs) if y is None else y
        zero = y == 0
        with np.errstate(divide="ignore", invalid="ignore"):
            return [np.where(zero, dy.dtype.type(0), dy * (y / x)) for x in xs]
    out = []
    for k in range(len(xs)):
        g = dy
        for j, x in enumerate(xs):
            if j != k:
                g = g * x
        out.append(g)
    return out


def elu_forward_ref(x: np.ndarray, alpha: float) -> np.ndarray:
    a = x.dtype.type(alpha)
    return np.where(x >= 0, x, a * np.expm1(np.minimum(x, 0)))


def elu_backward_ref(x: np.ndarray, dy: np.ndarray, alpha: float) -> np.ndarray:
    a = x.dtype.type(alpha)
    return np.where(x >= 0, dy, a * np.exp(np.minimum(x, 0)) * dy)


def sigmoid_forward_ref(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))                              # in (0, 1]: never overflows
    one = x.dtype.type(1)
    return np.where(x >= 0, one / (one + e), e / (one + e))


def sigmoid_backward_ref(y: np.ndarray, dy: np.ndarray) -> np.ndarray:
    return dy * y * (y.dtype.type(1) - y)


# ---- kernels (flat views; one thread per element, grid-stride) -------------------------------
@cuda.jit
def stack_row_kernel(x, out, k):
    # out (K, M): out[k, :] = x (M,)
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        out[k, i] = x[i]


@cuda.jit
def add_forward_kernel(xs, y):
    # xs (K, M) -> y (M,)
    for i in range(cuda.grid(1), y.shape[0], cuda.gridsize(1)):
        acc = float32(xs[0, i])
        for k in range(1, xs.shape[0]):
            acc += float32(xs[k, i])
        y[i] = acc


@cuda.jit
def sub_forward_kernel(a, b, y):
    for i in range(cuda.grid(1), y.shape[0], cuda.gridsize(1)):
        y[i] = float32(a[i]) - float32(b[i])


@cuda.jit
def sub_backward_kernel(dy, da, db):
    for i in range(cuda.grid(1), dy.shape[0], cuda.gridsize(1)):
        g = dy[i]
        da[i] = g
        db[i] = -g


@cuda.jit
def multiply_forward_kernel(xs, y):
    # xs (K, M) -> y (M,)
    for i in range(cuda.grid(1), y.shape[0], cuda.gridsize(1)):
        acc = float32(xs[0, i])
        for k in range(1, xs.shape[0]):
            acc *= float32(xs[k, i])
        y[i] = acc


@cuda.jit
def multiply_backward_kernel(xs, dy, dxs):
    # Product rule without division: dxs[k] = dy * (x_0 ... x_{k-1}) * (x_{k+1} ... x_{K-1}).
    # First pass writes the prefix products, second pass multiplies in the suffix products.
    kk = xs.shape[0]
    for i in range(cuda.grid(1), dy.shape[0], cuda.gridsize(1)):
        p = float32(1.0)
        for k in range(kk):
            dxs[k, i] = p
            p *= xs[k, i]
        s = float32(dy[i])
        for k in range(kk - 1, -1, -1):
            dxs[k, i] *= s
            s *= xs[k, i]


@cuda.jit
def multiply_backward_exact_kernel(xs, y, dy, dxs):
    # HugeCTR: dx_k = dy * (y / x_k), and 0 for every k where y == 0.
    for i in range(cuda.grid(1), dy.shape[0], cuda.gridsize(1)):
        v = float32(y[i])
        for k in range(xs.shape[0]):
            if v == float32(0.0):
                dxs[k, i] = float32(0.0)
            else:
                dxs[k, i] = float32(dy[i]) * (v / float32(xs[k, i]))


@cuda.jit
def elu_forward_kernel(x, y, alpha):
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        v = float32(x[i])
        if v >= float32(0.0):
            y[i] = v
        else:
            y[i] = alpha * math.expm1(v)


@cuda.jit
def elu_backward_kernel(x, dy, dx, alpha):
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        v = float32(x[i])
        if v >= float32(0.0):
            dx[i] = dy[i]
        else:
            dx[i] = alpha * math.exp(v) * float32(dy[i])


@cuda.jit
def sigmoid_forward_kernel(x, y):
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        v = float32(x[i])
        e = math.exp(-abs(v))
        if v >= float32(0.0):
            y[i] = float32(1.0) / (float32(1.0) + e)
        else:
            y[i] = e / (float32(1.0) + e)


@cuda.jit
def sigmoid_backward_kernel(y, dy, dx):
    for i in range(cuda.grid(1), y.shape[0], cuda.gridsize(1)):
        v = float32(y[i])
        dx[i] = float32(dy[i]) * v * (float32(1.0) - v)


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def _flat(a):
    return a.reshape(-1)


def stack(xs, out) -> None:
    """out (K, M) = the K same-shape arrays xs, flattened, one per row."""
    if len(xs) != out.shape[0]:
        raise ValueError(f"stack: {len(xs)} arrays for {out.shape[0]} rows")
    for k, x in enumerate(xs):
        if x.size != out.shape[1]:
            raise ValueError(f"stack: input {k} has {x.size} elements, rows hold {out.shape[1]}")
        launch_1d(stack_row_kernel, x.size, _flat(x), out, k)


def add_forward(xs_stacked, y) -> None:
    """y (any shape, M elements) = column sums of xs_stacked (K, M)."""
    launch_1d(add_forward_kernel, y.size, xs_stacked, _flat(y))


def sub_forward(a, b, y) -> None:
    launch_1d(sub_forward_kernel, y.size, _flat(a), _flat(b), _flat(y))


def sub_backward(dy, da, db) -> None:
    launch_1d(sub_backward_kernel, dy.size, _flat(dy), _flat(da), _flat(db))


def multiply_forward(xs_stacked, y) -> None:
    """y (M elements) = column products of xs_stacked (K, M)."""
    launch_1d(multiply_forward_kernel, y.size, xs_stacked, _flat(y))


def multiply_backward(xs_stacked, dy, dxs, exact: bool = False, y=None) -> None:
    """dxs (K, M) = gradient of each input row; exact=True needs the forward output y."""
    if exact:
        if y is None:
            raise ValueError("multiply_backward(exact=True) needs the forward output y")
        launch_1d(multiply_backward_exact_kernel, dy.size, xs_stacked, _flat(y), _flat(dy), dxs)
    else:
        launch_1d(multiply_backward_kernel, dy.size, xs_stacked, _flat(dy), dxs)


def elu_forward(x, y, alpha: float) -> None:
    launch_1d(elu_forward_kernel, x.size, _flat(x), _flat(y), np.float32(alpha))


def elu_backward(x, dy, dx, alpha: float) -> None:
    launch_1d(elu_backward_kernel, x.size, _flat(x), _flat(dy), _flat(dx), np.float32(alpha))


def sigmoid_forward(x, y) -> None:
    launch_1d(sigmoid_forward_kernel, x.size, _flat(x), _flat(y))


def sigmoid_backward(y, dy, dx) -> None:
    launch_1d(sigmoid_backward_kernel, y.size, _flat(y), _flat(dy), _flat(dx))


_V = "float32[::1]"
_H = "float16[::1]"
_M = "float32[:, ::1]"
PTX_CHECKS = [
    (stack_row_kernel, f"void({_V}, {_M}, int64)"),
    (add_forward_kernel, f"void({_M}, {_V})"),
    (sub_forward_kernel, f"void({_V}, {_V}, {_V})"),
    (sub_backward_kernel, f"void({_V}, {_V}, {_V})"),
    (multiply_forward_kernel, f"void({_M}, {_V})"),
    (multiply_backward_kernel, f"void({_M}, {_V}, {_M})"),
    (multiply_backward_exact_kernel, f"void({_M}, {_V}, {_V}, {_M})"),
    (elu_forward_kernel, f"void({_V}, {_V}, float32)"),
    (elu_backward_kernel, f"void({_V}, {_V}, {_V}, float32)"),
    (sigmoid_forward_kernel, f"void({_V}, {_V})"),
    (sigmoid_backward_kernel, f"void({_V}, {_V}, {_V})"),
    # mixed precision on gpu/sim: float16 tensors, float32 arithmetic (the (K, M) stacks stay float32)
    (stack_row_kernel, f"void({_H}, {_M}, int64)"),
    (add_forward_kernel, f"void({_M}, {_H})"),
    (sub_forward_kernel, f"void({_H}, {_H}, {_H})"),
    (sub_backward_kernel, f"void({_H}, {_H}, {_H})"),
    (multiply_forward_kernel, f"void({_M}, {_H})"),
    (multiply_backward_kernel, f"void({_M}, {_H}, {_M})"),
    (multiply_backward_exact_kernel, f"void({_M}, {_H}, {_H}, {_M})"),
    (elu_forward_kernel, f"void({_H}, {_H}, float32)"),
    (elu_backward_kernel, f"void({_H}, {_H}, {_H}, float32)"),
    (sigmoid_forward_kernel, f"void({_H}, {_H})"),
    (sigmoid_backward_kernel, f"void({_H}, {_H}, {_H})"),
]
