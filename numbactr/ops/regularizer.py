"""The L1/L2 regularizer of a loss, over the flat dense weight vector w (P,) (spec §6.3); the model calls it.

Contract: ``regularizer_term`` (a float), ``regularizer_term_on_device`` ((1,) float32, nothing read back)
and ``regularizer_grad`` (written into ``out``), through numbactr.ops.dispatch.pick: the numba.cuda
kernels of numbactr.kernels.regularizer on gpu/sim (float32 block reduction), NumPy on cpu (float64 sum).

Formulas, b the per-rank batch size (the full tensor's B, not the valid rows: HugeCTR passes the logit
tensor's dim 0):
    term  L2 lam/(2b)·Σw²,  L1 lam/b·Σ|w|
    grad  L2 (lam/b)·w,     L1 (lam/b)·sign(w) with sign(0) = -1

Why the gradient initializes the weight-gradient buffer: the layers then ACCUMULATE their weight
gradients into it, so the regularizer costs no extra pass (``accumulate=True`` adds instead).
"""

from __future__ import annotations

import numpy as np

from numbactr.enums import Regularizer_t
from numbactr.kernels import regularizer
from numbactr.ops.dispatch import pick
from numbactr.runtime import device
from numbactr.runtime.device import contig as _contig


def _kind_name(kind) -> str:
    if isinstance(kind, Regularizer_t):
        return kind.name
    if kind in ("L1", "L2"):
        return kind
    raise ValueError(f"regularizer kind must be Regularizer_t.L1/L2 (or 'L1'/'L2'), got {kind!r}")


def _term_kernel(w, kind, lam, b):
    return float(device.to_host(regularizer_term_on_device(w, kind, lam, b))[0])


def _term_ref(w, kind, lam, b):
    return regularizer.regularizer_term_ref(device.to_host(w), _kind_name(kind), lam, b)


def regularizer_term(w, kind, lam: float, b: int) -> float:
    """rterm over the flat weight vector w (P,): L2 lam/(2b)·Σw², L1 lam/b·Σ|w|; 0.0 when kind is None.

    Kernel (block reduction, float32) on gpu/sim, NumPy (float64 sum) on cpu.
    """
    if kind is None:
        return 0.0
    return pick(kernel=_term_kernel, ref=_term_ref)(w, kind, lam, b)


def regularizer_term_on_device(w, kind, lam: float, b: int):
    """regularizer_term as a (1,) float32 device array, nothing read back (gpu/sim: the kernel's block
    reduction; a training step keeps it beside its loss, numbactr.train.step.keep_loss)."""
    out = device.xp().zeros((1,), np.float32)
    regularizer.regularizer_term_add(_contig(w), out, _kind_name(kind), lam, b)
    return out


def _grad_kernel(w, name, lam, b, out, accumulate):
    regularizer.regularizer_grad_init(_contig(w), out, name, lam, b, accumulate=accumulate)


def _grad_ref(w, name, lam, b, out, accumulate):
    g = regularizer.regularizer_grad_ref(w, name, lam, b).reshape(out.shape)
    if accumulate:
        out += g
    else:
        out[...] = g


def regularizer_grad(w, kind, lam: float, b: int, out, accumulate: bool = False) -> None:
    """out := wgrad_init(w) (same size as w): L2 (lam/b)·w, L1 (lam/b)·sign(w) with sign(0) = -1;
    zeros when kind is None. ``accumulate=True`` ADDS it to out instead (for a model that has already
    written the layers' gradients into out). ``out`` must be contiguous (it is written in place)."""
    if kind is None:
        if not accumulate:
            out[...] = 0
        return
    pick(kernel=_grad_kernel, ref=_grad_ref)(w, _kind_name(kind), lam, b, out, accumulate)
