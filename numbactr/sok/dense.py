"""Data parallelism for the dense part of a PyTorch model around SOK tables (imports torch).

Under ``mpiexec -n R`` every rank runs the same script on its own samples: the SOK tables are model-parallel
(numbactr.sok.table), every other parameter is replicated. These helpers are what Horovod gives a SOK
script (hvd.broadcast_parameters, hvd.DistributedGradientTape), through numbactr.distributed.comm:

    sok.broadcast_parameters(model)      # once: rank 0's dense weights everywhere
    loss.backward()
    sok.average_gradients(model)         # each step: dense gradients averaged over the ranks
    optimizer.step()

With each rank's loss the mean over its own b samples, the averaged dense gradient is the gradient of the
global batch's mean loss, and (with numbactr.sok.init's gradient division) so is the tables' gradient:
R ranks train as one rank on the R*b samples. GPU tensors are staged through host memory.
"""

from __future__ import annotations

import numpy as np
import torch

from numbactr.distributed.comm import world

__all__ = ["average_gradients", "broadcast_parameters"]


def _dense(parameters, trainable: bool = True) -> list:
    params = parameters.parameters() if isinstance(parameters, torch.nn.Module) else parameters
    return [p for p in params if getattr(p, "_sok_table", None) is None and (p.requires_grad or not trainable)]


def average_gradients(parameters, comm=None) -> None:
    """Replace the gradient of every dense parameter (SOK placeholders are skipped) by its mean over the
    ranks: one allreduce per dtype. A parameter without a gradient on some rank counts as zero there and
    gets the mean too; one without a gradient on every rank keeps none. Sparse gradients are an error."""
    comm = comm or world()
    if comm.size == 1:
        return
    by_dtype = {}
    for p in _dense(parameters):
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError(
                f"average_gradients: a parameter of shape {tuple(p.shape)} has a sparse gradient "
                "(nn.Embedding(sparse=True)?); only dense gradients are averaged"
            )
        by_dtype.setdefault(p.dtype, []).append(p)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        params = by_dtype[dtype]
        sizes = [p.numel() for p in params]
        ends = np.cumsum(sizes)
        # (sum sizes + P,): every gradient, then a 1 per parameter that has one
        buf = np.zeros(int(ends[-1]) + len(params), torch.empty(0, dtype=dtype).numpy().dtype)
        for i, (p, end) in enumerate(zip(params, ends)):
            if p.grad is not None:
                buf[end - sizes[i] : end] = p.grad.detach().reshape(-1).cpu().numpy()
                buf[ends[-1] + i] = 1
        comm.allreduce_sum(buf)
        for i, (p, end) in enumerate(zip(params, ends)):
            if buf[ends[-1] + i] == 0:
                continue
            mean = torch.from_numpy(buf[end - sizes[i] : end] / buf.dtype.type(comm.size)).view_as(p).to(p.device)
            if p.grad is None:
                p.grad = mean.clone()
            else:
                p.grad.copy_(mean)


def broadcast_parameters(parameters, root: int = 0, comm=None) -> None:
    """Every dense parameter (and, for a module, every buffer) takes its value on rank ``root``."""
    comm = comm or world()
    if comm.size == 1:
        return
    tensors = _dense(parameters, trainable=False)
    if isinstance(parameters, torch.nn.Module):
        tensors += list(parameters.buffers())
    values = comm.bcast([t.detach().cpu().numpy() for t in tensors] if comm.rank == root else None, root=root)
    with torch.no_grad():
        for t, v in zip(tensors, values):
            t.copy_(torch.from_numpy(v))
