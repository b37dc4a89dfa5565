"""Tensors <-> arrays of numbactr's device, sharing memory (imports torch; the torch faces use it).

On the cpu and sim devices a CPU tensor and a NumPy array share one buffer (torch.from_numpy / .numpy());
on the gpu device a CUDA tensor and a CuPy array share device memory through DLPack. Nothing is copied,
except a non-contiguous tensor, which is made contiguous first.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["as_array", "as_tensor"]


def as_array(t):
    """A tensor as an array of numbactr's device sharing its memory (NumPy on cpu, CuPy on cuda);
    anything else (arrays, lists, None) as it is."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach().contiguous()
    if t.is_cuda:
        import cupy

        return cupy.from_dlpack(t)
    return t.numpy()


def as_tensor(a):
    """An array of numbactr's device as a tensor sharing its memory (None stays None)."""
    if a is None:
        return None
    if hasattr(a, "__cuda_array_interface__"):
        return torch.from_dlpack(a)
    return torch.from_numpy(np.asarray(a))
