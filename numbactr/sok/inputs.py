"""How SOK's PyTorch layers take their arguments: keys, bags and weights as arrays of this device, combiners,
modes and dtypes checked (the forms numbactr/sok/layers.py's docstring lists).

Apart from layers.py so that the module holding the layers and variables stays about them; no torch module
state here, only tensors turned into arrays (shared memory, numbactr.runtime.torch_bridge) and errors.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from numbactr.runtime import device
from numbactr.validate import IgnoredArgumentWarning
from numbactr.embedding.engine import Pooling
from numbactr.runtime.torch_bridge import as_array
from numbactr.sok.table import DISTRIBUTED

COMBINERS = {"sum": Pooling.SUM, "mean": Pooling.MEAN}


def _keys(t, who: str):
    """A tensor of integer keys as a flat array of this device (shared memory)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{who}: inputs must be a torch tensor of keys, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{who}: keys must be an integer tensor, got {t.dtype}")
    return as_array(t).reshape(-1)


def _bags(sp, who: str, values: str = "int"):
    """(values (N,), offsets (bags + 1,) int64) arrays of this device from the forms the module docstring
    lists; values are integer keys, or float weights when values='float'."""
    xp = device.xp()
    if isinstance(sp, (tuple, list)) and len(sp) == 2:
        vals, offsets = sp
        vals = _keys(vals, who) if values == "int" else _floats(vals, who)
        offsets = xp.asarray(as_array(offsets)).astype(np.int64).reshape(-1)
        n = vals.shape[0]
        if (
            offsets.shape[0] < 1
            or int(offsets[0]) != 0
            or int(offsets[-1]) != n
            or bool((offsets[1:] < offsets[:-1]).any())
        ):
            raise ValueError(
                f"{who}: offsets must be (bags + 1,) non-decreasing from 0 to len(values) = {n} "
                "(F.embedding_bag's include_last_offset=True form)"
            )
        return vals, offsets
    if not isinstance(sp, torch.Tensor):
        raise TypeError(f"{who}: expected (values, offsets), a sparse tensor or a 2-D tensor, got {type(sp).__name__}")
    if sp.dim() != 2:
        raise ValueError(f"{who}: ids must be 2-D (bags, max_nnz), got shape {tuple(sp.shape)}")
    convert = _keys if values == "int" else _floats
    rows = sp.shape[0]
    if sp.layout == torch.sparse_csr:
        return convert(sp.values(), who), xp.asarray(as_array(sp.crow_indices())).astype(np.int64)
    if sp.layout == torch.sparse_coo:
        idx = as_array(sp._indices()).astype(np.int64)  # (2, N), coalesced or not
        vals = convert(sp._values(), who)
        order = xp.lexsort(xp.stack([idx[1], idx[0]]))  # by row, then column
        r, c = idx[0][order], idx[1][order]
        if r.shape[0] > 1 and bool(((r[1:] == r[:-1]) & (c[1:] == c[:-1])).any()):
            raise ValueError(f"{who}: the sparse ids hold an entry twice (a key per (row, column))")
        counts = xp.bincount(r, minlength=rows)
        return vals[order], xp.concatenate([xp.zeros(1, np.int64), xp.cumsum(counts)]).astype(np.int64)
    if sp.layout != torch.strided:
        raise TypeError(f"{who}: unsupported tensor layout {sp.layout}")
    return convert(sp, who), xp.arange(rows + 1, dtype=np.int64) * sp.shape[1]


def _floats(t, who: str):
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{who}: weights must be a float tensor")
    return device.xp().asarray(as_array(t.to(torch.float32))).reshape(-1)


def _normalized(w, offsets):
    """w_k / (sum of the weights of k's bag), 0 in bags whose weights sum to 0 (on the host: (N,) floats)."""
    w_h, off = device.to_host(w), device.to_host(offsets)
    bag = np.repeat(np.arange(off.shape[0] - 1), np.diff(off))
    denom = np.bincount(bag, weights=w_h, minlength=off.shape[0] - 1)[bag].astype(np.float32)  # (N,)
    out = np.zeros_like(w_h)
    np.divide(w_h, denom, out=out, where=denom != 0)
    return device.xp().asarray(out)


def _combiner(name, who: str) -> str:
    low = str(name).lower()
    if low not in COMBINERS:
        raise ValueError(f"{who}: combiner must be 'sum' or 'mean', got {name!r}")
    return low


def _mode(mode, who: str):
    """(mode, target rank): None / 'distributed' -> DISTRIBUTED; 'localized:t' -> t."""
    if mode is None or mode == "distributed":
        return "distributed", DISTRIBUTED
    if isinstance(mode, str) and mode.startswith("localized:"):
        try:
            return mode, int(mode.split(":", 1)[1])
        except ValueError:
            pass
    raise ValueError(f"{who}: mode must be 'distributed' or 'localized:<rank>', got {mode!r}")


def _check_key_dtype(dtype, who: str) -> None:
    if dtype not in (None, torch.int64, torch.int32, np.int64, np.int32, "int64", "int32"):
        raise ValueError(f"{who}: key dtype must be int64 or int32, got {dtype}")


def _check_value_dtype(dtype, who: str) -> None:
    if dtype not in (None, torch.float32, np.float32, "float32"):
        raise NotImplementedError(f"{who}: only float32 tables are implemented, got dtype {dtype}")


def _warn_ignored(kwargs: dict, who: str) -> None:
    for name, value in kwargs.items():
        warnings.warn(f"{who}: {name}={value!r} is ignored by numbactr", IgnoredArgumentWarning, stacklevel=3)
