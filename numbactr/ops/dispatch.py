"""Which implementation of an op runs on the current device, decided here and nowhere else.

Contract. Every op of numbactr.ops has up to three implementations of the same math, each a function
taking the same arguments and returning the same result:

    kernel   numba.cuda kernel launches              device gpu (real CUDA) and sim (numba's simulator)
    cpu      the op's compiled CPU version           device cpu, while numbactr.runtime.device.compiled_cpu()
    ref      the op's NumPy reference                device cpu otherwise (reference_ops(),
                                                     NUMBACTR_CPU_REFERENCE=1, or an op without a cpu version)

An op names its three in one call, ``pick(kernel=..., cpu=..., ref=...)(args)``, and that is the whole
device choice:

    y = pick(kernel=_relu_kernel, cpu=_relu_cpu, ref=relu.relu_forward_ref)(x)

Why one helper: the choice used to be written out as an if/else in every op (about 80 of them); here a
reader sees in one place how an op reaches its kernel on each device, and an op's body holds only its math.
The table is passed at call time (not built at import), so a kernel entry point replaced on its module
(numbactr.bench.step_breakdown times them that way) is the one called.
"""

from __future__ import annotations

from numbactr.runtime import device


def pick(kernel, cpu=None, ref=None):
    """The implementation for the current device: ``kernel`` on gpu/sim; on cpu ``cpu`` when the op has a
    compiled version and compiled ops are on, else ``ref``."""
    if device.uses_kernels():
        return kernel
    if cpu is not None and device.compiled_cpu():
        return cpu
    return ref


def kernels() -> bool:
    """True on the kernel devices (gpu, sim): for a choice that is a policy, not an implementation (e.g.
    whether to fuse two layers' kernels, numbactr.ops.dense.fuse_bias_relu)."""
    return device.uses_kernels()
