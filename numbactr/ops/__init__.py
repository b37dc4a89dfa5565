"""The ops layer: one autograd Function per kernel op, below the layers (numbactr.layers call ops; ops
import no layer, model, train or embedding module).

Contract: every op takes and returns raw arrays of the current device and has a hand-written backward.
How it reaches its implementation on each device is decided in one place, numbactr.ops.dispatch.pick:
the numba.cuda kernel launch (gpu, sim), the op's compiled CPU version (cpu,
numbactr.runtime.device.compiled_cpu()) or its NumPy reference (cpu under
numbactr.runtime.device.reference_ops() / NUMBACTR_CPU_REFERENCE=1). Matrix products use the array
library (cuBLAS via cupy on gpu, BLAS on cpu/sim, on contiguous operands or their transposed views:
no copies); everything else goes through numbactr.kernels.

One module per kernel family: dense (Linear, FcBiasAct, MultiCross), elementwise, interaction, shape,
attention, normalization, recurrent, losses, regularizer, embedding_bag; fused (two ops in one pass, made by
the planned step's fusions). buffers: how an op writes into arrays the planned step hands it.

Shape glossary: B batch, S slots, N keys, D embedding width, K/N_out layer widths.

Why a layer of its own: a layer (numbactr.layers) is HugeCTR's configuration (shapes, parameters, checks);
an op is the math on arrays; keeping them apart lets tests, the inference session and the benchmarks run an
op without a model.
"""

from __future__ import annotations

from numbactr.ops.dense import (
    FcBiasAct,
    Linear,
    MultiCrossV1,
    MultiCrossV2,
    _half_mm,
    fuse_bias_relu,
)
from numbactr.ops.elementwise import ReLU
from numbactr.ops.embedding_bag import embedding_bag_forward
from numbactr.ops.interaction import Interaction
from numbactr.ops.losses import BinaryCrossEntropy, scale_by_seed, sigmoid
from numbactr.ops.shape import Concat, Reshape

__all__ = [
    "BinaryCrossEntropy",
    "Concat",
    "FcBiasAct",
    "Interaction",
    "Linear",
    "MultiCrossV1",
    "MultiCrossV2",
    "ReLU",
    "Reshape",
    "_half_mm",
    "embedding_bag_forward",
    "fuse_bias_relu",
    "scale_by_seed",
    "sigmoid",
]
