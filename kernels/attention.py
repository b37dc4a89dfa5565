"""Attention data movement (head split / merge) and the matrix-product references.

    split_heads:  y[b, h, l, c] = x[b, l, h*d + c]      # x (B, L, H*d) -> y (B, H, L, d)
    merge_heads:  y[b, l, h*d + c] = x[b, h, l, c]      # x (B, H, L, d) -> y (B, L, H*d)

Each is the other's backward. The products of MatrixMultiply and MultiHeadAttention go to the array
library (cuBLAS through cupy on a GPU, BLAS on the host); their references below are written with
``@`` and ``swapaxes`` only, so they run unchanged on numpy and cupy arrays:

    matmul:        Y = A @ B (batched over leading dims)       dA = dY @ Bᵀ,  dB = Aᵀ @ dY
    scaled_qk:     S = (Q @ Kᵀ) * a, a = 1/sqrt(d)             dQ = a dS @ K, dK = a dSᵀ @ Q
                   Q (.., Lf, d), K (.., Lt, d) -> S (.., Lf, Lt)

CPU versions (the cpu device; NumPy views and BLAS, no compiled loop: numba's loops lost to BLAS on these
products, 0.41 ms against 0.31 ms for BST's Q Kᵀ) are the references without their copies: the heads are
split by a view (BLAS takes the (L, d) matrices with a row stride of H*d at no cost), and the products
are arranged around what numpy's batched matmul is slow at. On BST's shapes (B 256, 4 heads of 8, L 10,
one thread) a product whose right operand is a transposed view (Q Kᵀ) took 0.32 ms against 0.06 ms for
row-major operands, so that operand is first copied row-major (0.05 ms); a transposed left operand costs
2x, about what its copy would, and is left as it is (a copy is one more large temporary, and on this
sandbox each fresh page of one costs a page fault). A gradient is written in its input's memory layout
(matmul's ``out``, as fast), so the merge of a split view's gradient is a view as well. Same math, in
float32 BLAS; the bits may differ from the references' in the last place (another GEMM kernel).

HugeCTR: HugeCTR/src/layers/multi_head_attention_layer.cu (transpose_QKV / transpose_V_back
kernels, cublasGemmStridedBatchedEx with alpha = 1/sqrt(d)) and matrix_multiply_layer.cu.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from .launch import launch_1d


# ---- references (numpy or cupy arrays) -------------------------------------------------------
def split_heads_ref(x, heads: int):
    """(B, L, H*d) -> (B, H, L, d), a contiguous copy."""
    b, l, hd = x.shape
    return x.reshape(b, l, heads, hd // heads).swapaxes(1, 2).copy()


def merge_heads_ref(x):
    """(B, H, L, d) -> (B, L, H*d), a contiguous copy."""
    b, h, l, d = x.shape
    return x.swapaxes(1, 2).reshape(b, l, h * d).copy()


def matmul_forward_ref(a, b):
    return a @ b


def matmul_backward_ref(a, b, dy):
    """(dA, dB) of Y = A @ B for same-rank operands (batched over the leading dims)."""
    return dy @ b.swapaxes(-1, -2), a.swapaxes(-1, -2) @ dy


def scaled_qk_forward_ref(q, k, scale: float):
    return (q @ k.swapaxes(-1, -2)) * q.dtype.type(scale)


def scaled_qk_backward_ref(q, k, ds, scale: float):
    s = ds.dtype.type(scale)
    return (ds @ k) * s, (ds.swapaxes(-1, -2) @ q) * s


# ---- CPU versions (numpy arrays; the cpu device) ---------------------------------------------------
def split_heads_cpu(x, heads: int):
    """(B, L, H*d) -> (B, H, L, d), a view of x (a copy only when x itself cannot be reshaped)."""
    b, l, hd = x.shape
    return x.reshape(b, l, heads, hd // heads).swapaxes(1, 2)


def merge_heads_cpu(x):
    """(B, H, L, d) -> (B, L, H*d): a view when x is laid out as split_heads_cpu's views are (a (B, L, H, d)
    array seen through swapaxes), else a contiguous copy."""
    b, h, l, d = x.shape
    return x.swapaxes(1, 2).reshape(b, l, h * d)


def matmul_cpu(a, b, scale: float = 1.0, like=None):
    """(a @ b) * scale (batched over same-shaped leading dims), a transposed right operand (its last axis
    strided) copied row-major first. like: an array of the product's shape (the input whose gradient the
    product is) whose memory layout the product takes; ignored when the shapes differ."""
    if b.strides[-1] != b.itemsize:
        b = np.ascontiguousarray(b)
    if like is not None and a.shape[:-2] == b.shape[:-2] and like.shape == a.shape[:-1] + b.shape[-1:]:
        y = np.empty_like(like, dtype=np.result_type(a, b))
        np.matmul(a, b, out=y)
    else:
        y = a @ b
    if scale != 1.0:
        y *= y.dtype.type(scale)
    return y


def scaled_qk_forward_cpu(q, k, scale: float):
    """scaled_qk_forward_ref without its slow transposed product: Kᵀ is copied row-major."""
    return matmul_cpu(q, k.swapaxes(-1, -2), scale)


def scaled_qk_backward_cpu(q, k, ds, scale: float):
    """(dQ, dK) of scaled_qk_forward_cpu, each in its input's layout."""
    return matmul_cpu(ds, k, scale, like=q), matmul_cpu(ds.swapaxes(-1, -2), q, scale, like=k)


# ---- kernels (one thread per element, grid-stride) -------------------------------------------
@cuda.jit
def split_heads_kernel(x, y):
    # x (B, L, H*d) -> y (B, H, L, d)
    h, l, d = y.shape[1], y.shape[2], y.shape[3]
    for e in range(cuda.grid(1), y.shape[0] * h * l * d, cuda.gridsize(1)):
        c = e % d
        r = e // d                      # ((b*H + hh)*L + ll)
        ll = r % l
        bh = r // l
        hh = bh % h
        b = bh // h
        y[b, hh, ll, c] = x[b, ll, hh * d + c]


@cuda.jit
def merge_heads_kernel(x, y):
    # x (B, H, L, d) -> y (B, L, H*d)
    h, l, d = x.shape[1], x.shape[2], x.shape[3]
    for e in range(cuda.grid(1), x.shape[0] * h * l * d, cuda.gridsize(1)):
        c = e % d
        r = e // d
        ll = r % l
        bh = r // l
        hh = bh % h
        b = bh // h
        y[b, ll, hh * d + c] = x[b, hh, ll, c]


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def split_heads(x, y, threads: int | None = None) -> None:
    """y (B, H, L, d) <- x (B, L, H*d); overwrites y."""
    b, h, l, d = y.shape
    if x.shape != (b, l, h * d):
        raise ValueError(f"split_heads: x {x.shape} does not fit y {y.shape}")
    launch_1d(split_heads_kernel, y.size, x, y, threads=threads)


def merge_heads(x, y, threads: int | None = None) -> None:
    """y (B, L, H*d) <- x (B, H, L, d); overwrites y."""
    b, h, l, d = x.shape
    if y.shape != (b, l, h * d):
        raise ValueError(f"merge_heads: y {y.shape} does not fit x {x.shape}")
    launch_1d(merge_heads_kernel, x.size, x, y, threads=threads)


PTX_CHECKS = [
    (split_heads_kernel, "void(float32[:, :, ::1], float32[:, :, :, ::1])"),
    (merge_heads_kernel, "void(float32[:, :, :, ::1], float32[:, :, ::1])"),
    (split_heads_kernel, "void(float16[:, :, ::1], float16[:, :, :, ::1])"),       # mixed precision on gpu/sim
    (merge_heads_kernel, "void(float16[:, :, :, ::1], float16[:, :, ::1])"),
]
