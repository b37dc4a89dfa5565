"""HugeCTR's Sparse Operation Kit (SOK) for PyTorch training loops, on numbactr's embedding engine.

SOK is HugeCTR's embedding plugin for TensorFlow: model-parallel embedding layers that drop into a model
trained by the framework's own loop. This package gives its API to PyTorch (torch is needed here; numbactr
itself does not import it):

    import numbactr.sok as sok
    sok.init()                                             # under mpiexec -n R: R ranks (MPI), threads
    emb = sok.DistributedEmbedding("sum", max_vocabulary_size_per_gpu=100_000, embedding_vec_size=16,
                                   slot_num=26, max_nnz=3)  # a torch.nn.Module: (ids) -> (B, 26, 16)
    model = MyModel(emb, ...)                              # any PyTorch model around it
    opt = sok.OptimizerWrapper(torch.optim.Adam(model.parameters(), lr=1e-3))
    loss = loss_fn(model(ids, dense), labels); loss.backward()
    sok.average_gradients(model)                           # under mpiexec: dense gradients averaged
    opt.step(); opt.zero_grad()                            # dense by torch, tables by the engine

SOK's names (both of its APIs):
  init(comm_tool='horovod', use_legacy_optimizer=True, *, seed=0, gradient_division=True); Init(**kwargs)
  All2AllDenseEmbedding(max_vocabulary_size_per_gpu, embedding_vec_size, slot_num, nnz_per_slot, ...)
  DistributedEmbedding(combiner, max_vocabulary_size_per_gpu, embedding_vec_size, slot_num, max_nnz, ...)
  Variable(initial_value | shape + initializer, mode=None | 'localized:t'), DynamicVariable(dimension, ...),
  lookup_sparse(params, sp_ids, sp_weights=None, combiners=None), export, assign
  OptimizerWrapper(optimizer), SGD(params, lr), Adam(params, learning_rate, beta_1, beta_2, epsilon)
  (= optimizers.Adam), filter_variables / split_embedding_variable_from_others
  average_gradients(model), broadcast_parameters(model): Horovod's part of a SOK script
What maps where: layers.py (inputs as tensors: dense ids, CSR (values, offsets), torch sparse COO/CSR),
table.py (ownership over ranks, initial rows, gradients), optimizer.py (which engine optimizer runs for
which torch optimizer), dense.py (data parallelism). Differences from SOK: each table's lookup runs on its
own (SOK fuses several tables into one); a DynamicVariable has a fixed capacity per rank (max_capacity);
SOK's 'hybrid' backend's N(0, 1) 'random' initializer, mixed precision and the low-frequency filter are
not implemented; TensorFlow is not supported (numbactr's README says why). sok.dump(path, vars, optimizer)
/ sok.load(...) read and write SOK's own weight files (numbactr/sok/dump_load.py). Checkpoints are also
PyTorch's: a module's state_dict() holds this rank's rows (keys, values) and
OptimizerWrapper.state_dict() the tables' optimizer states, so torch.save / torch.load of both resume
training exactly (each rank its own, loaded by as many ranks as saved it).
"""
from __future__ import annotations

try:
    import torch
except ImportError as e:           # the one face of numbactr that needs torch
    raise ImportError("numbactr.sok is SOK's interface for PyTorch and needs torch: pip install torch") from e

from .. import threads
from ..distributed.comm import world
from .dense import average_gradients, broadcast_parameters
from .dump_load import dump, load
from .layers import (All2AllDenseEmbedding, DistributedEmbedding, DynamicVariable, Variable, assign, export,
                     lookup_sparse)
from .optimizer import SGD, Adam, OptimizerWrapper, filter_variables, split_embedding_variable_from_others
from .table import SETTINGS

__all__ = ["init", "Init", "All2AllDenseEmbedding", "DistributedEmbedding", "Variable", "DynamicVariable",
           "lookup_sparse", "export", "assign", "OptimizerWrapper", "SGD", "Adam", "optimizers",
           "filter_variables", "split_embedding_variable_from_others", "average_gradients",
           "broadcast_parameters", "num_gpus", "global_gpu_id", "rank", "num_ranks", "dump", "load"]


class optimizers:                  # noqa: N801 (SOK's module name: sok.optimizers.Adam)
    """SOK's first API spelled the table optimizer sok.optimizers.Adam."""
    Adam = Adam


def init(comm_tool: str = "horovod", use_legacy_optimizer: bool = True, *, seed: int = 0,
         gradient_division: bool = True, set_torch_threads: bool = True):
    """SOK's sok.init: join the job's ranks and fix how tables start and learn. Call it before creating
    tables, with the same arguments on every rank.

    Args:
        comm_tool: 'horovod' (SOK's default) or 'mpi': either way the ranks are those of mpiexec / horovodrun,
            joined through numbactr.distributed.comm (MPI).
        use_legacy_optimizer: TensorFlow's switch; no effect here.
        seed: table i created after this call draws its initial rows from a hash of (seed + i, key).
        gradient_division: under R ranks, divide each rank's table gradient by R (TorchRec's rule: with a
            per-rank mean loss and averaged dense gradients, R ranks train as one on the global batch);
            False sums them as SOK does.
        set_torch_threads: torch's intra-op threads = numbactr.threads' compute threads (the cores this rank
            gets), so that torch and the engine do not oversubscribe the cores.
    Returns: the job's numbactr.distributed.comm.Comm.
    """
    if comm_tool not in ("horovod", "mpi"):
        raise ValueError(f"sok.init: comm_tool must be 'horovod' or 'mpi', got {comm_tool!r}")
    comm = world()
    SETTINGS.seed, SETTINGS.gradient_division, SETTINGS.tables = int(seed), bool(gradient_division), 0
    if set_torch_threads:
        torch.set_num_threads(threads.current().compute)
    return comm


def Init(**kwargs):                # noqa: N802 (SOK's first API)
    """SOK's first API, sok.Init(global_batch_size=..., seed=...): init(); global_batch_size is not needed
    (each rank brings its own samples). Returns 'OK' as SOK does."""
    kwargs.pop("global_batch_size", None)
    init(**kwargs)
    return "OK"


def num_gpus() -> int:
    """Ranks of the job (SOK counts GPUs, one per rank)."""
    return world().size


def global_gpu_id() -> int:
    """This rank."""
    return world().rank


rank, num_ranks = global_gpu_id, num_gpus
