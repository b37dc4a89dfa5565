"""Mixed precision and TF32: the Solver's ``use_mixed_precision``, ``scaler`` and ``enable_tf32_compute``.

Mixed precision (HugeCTR ``use_mixed_precision=True``; spec §1, §3):

* Activations, activation gradients and embedding outputs are STORED in half precision (float16, or
  bfloat16 with the numbactr-only Solver option ``mixed_precision_dtype="bfloat16"``); every op upcasts
  its inputs to float32, computes in float32 and rounds its outputs to half (numbactr.autograd.tape's
  ``autocast``; the model runs each layer and embedding lookup in such a scope). This is what tensor
  cores do in HugeCTR's fp16 GEMMs (fp16 operands, fp32 accumulation); HugeCTR's fp16 elementwise
  kernels compute in fp16, so numbactr's rounding happens at fewer places than HugeCTR's.
* The master weights (dense and embedding) stay float32, and weight gradients are float32.
* The dense input is float16 (HugeCTR's reader converts it); labels stay float32; losses, metrics and
  BatchNorm statistics compute in float32.
* The loss gradient is multiplied by ``scaler`` in the loss layer and every optimizer divides by it
  (as in fp32 mode); without the scale, gradients below float16's smallest subnormal (~6e-8) flush to 0.
* Overflow: HugeCTR uses the static scale and applies whatever the gradients hold (an inf/NaN gradient
  poisons the weights). numbactr checks every gradient of the step; if any is non-finite the step's
  dense AND embedding updates are skipped (weights and optimizer states unchanged), the skip is counted
  (``Model.skipped_steps``) and a ``GradientOverflowWarning`` names the step. The scale itself stays
  static (unlike torch's GradScaler, which also shrinks it). A non-finite LOSS still raises
  FloatingPointError as in fp32 mode.
* Where the skip is decided: on the cpu device the flag is host memory and is read every step (several
  ranks agree through a host collective). On the kernels' devices (gpu, sim), on any number of ranks
  (hash or one-hot SparseEmbeddings, HugeCTR's optimizers, no stochastic rounding), it is decided on the
  device (several ranks sum their flags there, so all skip when one overflowed): the flag becomes a gate (``Gate``) that every update kernel reads
  (``kernels.optimizers.step_values``, ``kernels.tbe_math.KI_GO``), so the step reads nothing back and can
  be a CUDA graph. Adam's step t (dense alpha_t; the embedding's bias corrections and KI_STEP) must count
  only the steps that updated: one-thread kernels compute those values from the host's count less the
  skips the host has not read yet (``kernels.optimizers.adam_gate_kernel``,
  ``kernels.tbe.gate_scalars_kernel``). The skips are counted on the device and reported at the next check
  point (``Model.check_deferred``: display, evaluation, snapshots, loads, every 64 steps; or reading
  ``Model.skipped_steps``), one warning for the steps skipped since the last; the host's counters are then
  corrected.

TF32 (``enable_tf32_compute=True``): on a GPU, float32 matrix products through CuPy (cuBLAS) use TF32
tensor cores: CuPy decides a dtype's cuBLAS compute type at its first product, reading the
``CUPY_TF32`` environment variable then, and ``cupy._core._routines_linalg.set_compute_type`` changes
it afterwards; ``enable_tf32`` does both. cpu and sim have no TF32: the flag has no effect there.
"""

from __future__ import annotations

import os
import warnings

import numpy as np


class GradientOverflowWarning(RuntimeWarning):
    """A mixed-precision step's scaled gradients overflowed the half dtype: its update was skipped."""


class Gate:
    """A mixed-precision step's overflow gate, decided on the device (numbactr.train.overflow.gate): ``go``
    (1,) int64, 1 when every gradient stayed finite; ``skips`` (1,) int64, the device count of skipped
    steps; ``seen``, the part of that count the host has accounted for (its step counters already exclude
    those). An update whose values depend on its step t (Adam) computes t on the device as the host's
    count less ``skips - seen``."""

    def __init__(self, go, skips, owner):
        self.go, self.skips, self._owner = go, skips, owner

    @property
    def seen(self) -> int:
        return self._owner._skips_seen


HALF_DTYPES = ("float16", "bfloat16")


def bfloat16_dtype():
    """numpy's bfloat16 from ml_dtypes, or None when ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def half_dtype(solver):
    """The storage dtype of activations for ``solver`` (None when it trains in float32)."""
    if not solver.use_mixed_precision:
        return None
    name = getattr(solver, "mixed_precision_dtype", "float16")
    if name == "float16":
        return np.dtype(np.float16)
    bf16 = bfloat16_dtype()
    if bf16 is None:
        raise ValueError(
            "CreateSolver: mixed_precision_dtype='bfloat16' needs the ml_dtypes package "
            "(NumPy has no bfloat16): pip install ml_dtypes, or use 'float16'"
        )
    return bf16


def check_dense_input(dense: np.ndarray, half) -> None:
    """ValueError when the host dense input holds finite values the half dtype cannot hold (HugeCTR
    would silently train on inf): names the largest value and the dtype's range."""
    if half is None or dense.size == 0:
        return
    top = float(np.abs(dense).max())
    limit = float(np.finfo(np.float16).max) if half == np.float16 else 3.3895e38
    if np.isfinite(top) and top > limit:
        raise ValueError(
            f"mixed precision: the dense input holds |x| = {top:g}, beyond {half.name}'s range "
            f"(max {limit:g}); scale or log-transform the dense features"
        )


#: TF32 as enable_tf32 left it: on (by numbactr, for a model that asked), and CUPY_TF32 before that
_TF32 = {"on": False, "env": None}


def enable_tf32() -> str:
    """Make float32 matrix products on the GPU use TF32; returns a line saying what was done. CuPy's compute
    type is the process's: a later model that does not ask for TF32 puts it back (disable_tf32)."""
    if not _TF32["on"]:
        _TF32["env"] = os.environ.get("CUPY_TF32")
    _TF32["on"] = True
    os.environ["CUPY_TF32"] = "1"  # read by CuPy at its first float32 product
    try:
        import cupy
        from cupy._core import _routines_linalg as linalg
    except ImportError:
        return "enable_tf32_compute: no CuPy, so no TF32 (the numba device arrays' products stay float32)"
    cap = int(cupy.cuda.Device().compute_capability)
    if cap < 80:
        return f"enable_tf32_compute: this GPU (compute capability {cap}) has no TF32; products stay float32"
    tf32 = getattr(linalg, "COMPUTE_TYPE_TF32", None)
    if tf32 is None or not hasattr(linalg, "set_compute_type"):
        return (
            "enable_tf32_compute: this CuPy has no set_compute_type; CUPY_TF32=1 is set, which CuPy reads "
            "at its first float32 product"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linalg.set_compute_type(np.float32, tf32)
    return "enable_tf32_compute: float32 matrix products use TF32 tensor cores (cuBLAS through CuPy)"


def set_tf32(on: bool) -> str:
    """TF32 for float32 products on (enable_tf32) or off (disable_tf32) unless it already is; what was done
    ("" when nothing). A GPU model calls it before each of its steps, so that TF32 follows the model that
    runs (CuPy's compute type is one for the process, and CuPy reads it when it enqueues a product, so a
    captured step keeps the mode it was captured with)."""
    if bool(on) == _TF32["on"]:
        return ""
    return enable_tf32() if on else disable_tf32()


def disable_tf32() -> str:
    """Undo enable_tf32 for a model that does not ask for TF32 (CuPy's float32 compute type is global to
    the process): CUPY_TF32 as it was before and CuPy's float32 compute type undecided again, so CuPy
    takes it from CUPY_TF32 at the next product. Returns what was done ("" when TF32 was not numbactr's)."""
    if not _TF32["on"]:
        return ""
    _TF32["on"] = False
    if _TF32["env"] is None:
        os.environ.pop("CUPY_TF32", None)
    else:
        os.environ["CUPY_TF32"] = _TF32["env"]
    try:
        from cupy._core import _routines_linalg as linalg
    except ImportError:
        return ""
    if hasattr(linalg, "set_compute_type"):
        linalg.set_compute_type(np.float32, getattr(linalg, "COMPUTE_TYPE_TBD", 0))
    return (
        "enable_tf32_compute=False: float32 matrix products no longer use TF32 (an earlier model of this "
        "process had turned it on)"
    )
