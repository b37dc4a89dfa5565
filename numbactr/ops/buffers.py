"""Where an op writes its results: arrays the planned step hands it (numbactr.train.plan_buffers), or new ones.

Contract. A Context may carry ``out`` (one array per forward output) and ``grad_into`` ({input index: array}
for the backward's input gradients). An op that honours them writes its result into the array given and
returns that very array (so the plan sees the same buffer step after step); without them it allocates, as
always. The same arithmetic runs either way, so the bits are the same: a product goes to BLAS with ``out=``,
a compiled pass writes in place, and a NumPy reference's result is copied in.

Why the Context and not an ``out=`` argument: an op's parameters are what the layer recorded; the buffers
are the plan's business, handed per call like ``grad_into`` (a weight's view of the flat gradient buffer).
"""

from __future__ import annotations

import numpy as np

from numbactr.runtime.device import xp as _xp


def out_of(ctx, index: int = 0):
    """The array forward output ``index`` goes into, or None (allocate)."""
    out = ctx.out
    return out[index] if out else None


def grad_of(ctx, index: int):
    """The array the gradient of input ``index`` goes into, or None (allocate)."""
    return ctx.grad_into.get(index)


def mm(a, b, buf=None):
    """a @ b, written into ``buf`` (a C-contiguous array of the product's shape) when given.

    A product of 2-D host arrays over an inner dimension of 1 (the gradient that reaches the input of a
    one-output layer: every zoo model's logit, DIN's attention score) is an outer product: each element is
    one product, so NumPy's broadcast multiply computes the same values. OpenBLAS's GEMM takes 3x its time
    for it (measured 2026-12-07, one thread: 0.36 against 0.11 ms for 4,096 x 80, 1.86 against 0.67 ms for
    DIN's 40,960 x 40); only the sign of a zero may differ (GEMM's 0 + a*b is +0.0 where a*b is -0.0)."""
    if a.ndim == 2 and b.ndim == 2 and a.shape[1] == 1 and isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return np.multiply(a, b, out=buf)
    if buf is None:
        return a @ b
    return _xp().matmul(a, b, out=buf)


def into(buf, value):
    """``value`` (a result computed elsewhere, e.g. a NumPy reference's) copied into ``buf`` when one is given;
    returns what the op returns: ``buf`` or, without one, ``value``."""
    if buf is None or value is buf:
        return value
    buf.reshape(value.shape)[...] = value
    return buf
