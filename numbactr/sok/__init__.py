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
  init(comm_tool='horovod', use_legacy_optimizer=True, *, seed=0, gradient_division=True); Init(**kwargs);
  set_comm_tool
  All2AllDenseEmbedding(max_vocabulary_size_per_gpu, embedding_vec_size, slot_num, nnz_per_slot, ...)
  DistributedEmbedding(combiner, max_vocabulary_size_per_gpu, embedding_vec_size, slot_num, max_nnz, ...)
  Variable(initial_value | shape + initializer, mode=None | 'localized:t') -> DistributedVariable |
  LocalizedVariable (global_shape, target_gpu, num_gpus, global_gpu_id, key_map), DynamicVariable(dimension, ...),
  lookup_sparse(params, sp_ids, sp_weights=None, combiners=None), all2all_dense_embedding(param, indices),
  export, assign, dump, load, incremental_model_dump
  OptimizerWrapper(optimizer), SGD(params, lr), Adam(params, learning_rate, beta_1, beta_2, epsilon)
  (= optimizers.Adam), filter_variables / split_embedding_variable_from_others
  average_gradients(model), broadcast_parameters(model): Horovod's part of a SOK script

Training: a table's gradients are held by backward and applied by the step() of the sok.OptimizerWrapper
(or sok.SGD / sok.Adam) that holds it; a plain torch optimizer never updates a SOK table (wrap it:
sok.OptimizerWrapper(torch.optim.Adam(...))). A table may be looked up several times before the step (a
shared embedding, lookup_sparse([v, v], ...)): the step applies the sum of the lookups' gradients once,
as SOK's tape does.

What maps where: layers.py (inputs as tensors: dense ids, CSR (values, offsets), torch sparse COO/CSR),
table.py (ownership over ranks, initial rows, gradients), hybrid.py (DynamicVariable's default 'hybrid'
backend: HierarchicalKV's evicting table), optimizer.py (which engine optimizer runs for which torch
optimizer), dense.py (data parallelism).

Tables that never fill: DynamicVariable(var_type="hybrid"), SOK's default, grows up to max_capacity keys
per rank and then evicts (a new key takes the slot of its bucket's lowest-scored key, evict_strategy kLru
by default; the evicted key's row and optimizer state are reset for it), so a stream of ever new ids
trains without error; sok.sparse_read_and_evict returns the keys an insertion evicted with their rows;
lookup_sparse(..., use_low_frequency_filter=True) admits a new key with probability filter_ratio;
sok.incremental_model_dump returns the keys touched since a time (evicted keys are gone). var_type="hbm"
is a fixed-capacity table: a batch bringing more new keys than it has room for is a VocabularyFullError.

Differences from SOK: each table's lookup runs on its own (SOK fuses several tables into one); a hybrid
table's refused key (filter, or a full bucket under kLfu) reads zeros (HierarchicalKV's find_or_insert hands
it its initial row), its kLru scores are a clock per lookup (HierarchicalKV reads a GPU timer), its
initial rows are a hash of (seed, key) and it keeps all its rows in one memory (no host tier for values);
mixed precision is not implemented; TensorFlow is not supported (numbactr's README says why). sok.dump(path, vars,
optimizer) / sok.load(...) read and write SOK's own weight files (numbactr/sok/dump_load.py).

Reading a folder that real SOK dumped: SOK's file names come from TensorFlow's variable names, which end
in ":0": sok.DynamicVariable(name="emb") is "emb:0" in TensorFlow and SOK writes "emb_0-key",
"emb_0-weight", "emb_0-Adam-m", ... (an unnamed table: "sok_dynamic_Variable_<i>_0-..." or
"sok_static_Variable_<i>_0-..."). numbactr uses the name= argument as given, so name the table as the
files are named: sok.DynamicVariable(dimension=16, name="emb_0") (or name="emb:0"), then
sok.load(path, [table], optimizer).

Checkpoints are also PyTorch's: a module's state_dict() holds this rank's rows (keys, values) and
OptimizerWrapper.state_dict() the tables' optimizer states and its step count, so torch.save /
torch.load of both resume training exactly (each rank its own, loaded by as many ranks as saved it).
"""

from __future__ import annotations

try:
    import torch
except ImportError as e:  # the one face of numbactr that needs torch
    raise ImportError("numbactr.sok is SOK's interface for PyTorch and needs torch: pip install torch") from e

from numbactr.runtime import threads
from numbactr.distributed.comm import world
from numbactr.sok.dense import average_gradients, broadcast_parameters
from numbactr.sok.dump_load import dump, incremental_model_dump, load
from numbactr.sok.layers import (
    All2AllDenseEmbedding,
    DistributedEmbedding,
    DistributedVariable,
    DynamicVariable,
    LocalizedVariable,
    Variable,
    all2all_dense_embedding,
    assign,
    export,
    lookup_sparse,
)
from numbactr.sok.optimizer import SGD, Adam, OptimizerWrapper, filter_variables, split_embedding_variable_from_others
from numbactr.sok.table import SETTINGS

__all__ = [
    "init",
    "Init",
    "All2AllDenseEmbedding",
    "DistributedEmbedding",
    "Variable",
    "DynamicVariable",
    "DistributedVariable",
    "LocalizedVariable",
    "set_comm_tool",
    "sparse_read_and_evict",
    "lookup_sparse",
    "all2all_dense_embedding",
    "export",
    "assign",
    "OptimizerWrapper",
    "SGD",
    "Adam",
    "optimizers",
    "filter_variables",
    "split_embedding_variable_from_others",
    "average_gradients",
    "broadcast_parameters",
    "num_gpus",
    "global_gpu_id",
    "rank",
    "num_ranks",
    "dump",
    "load",
    "incremental_model_dump",
]


class optimizers:  # noqa: N801 (SOK's module name: sok.optimizers.Adam)
    """SOK's first API spelled the table optimizer sok.optimizers.Adam."""

    Adam = Adam


def init(
    comm_tool: str = "horovod",
    use_legacy_optimizer: bool = True,
    *,
    seed: int = 0,
    gradient_division: bool = True,
    set_torch_threads: bool = True,
):
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
        set_torch_threads: torch's intra-op threads = numbactr.runtime.threads' compute threads (the cores this rank
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


def set_comm_tool(tool: str) -> None:
    """SOK's set_comm_tool: 'horovod' (SOK's only tool) or 'mpi'; both are the job's MPI ranks here."""
    if tool not in ("horovod", "mpi"):
        raise ValueError(f"sok.set_comm_tool: tool must be 'horovod' or 'mpi', got {tool!r}")


def sparse_read_and_evict(var, indices, name=None):
    """SOK's sok.sparse_read_and_evict(var, indices): the rows of keys ``indices`` (any integer tensor) in a
    hybrid DynamicVariable, inserting the new ones as a lookup does, and what that insertion pushed out of
    the table: (embeddings (*indices.shape, D), evicted_keys (E,) int64, evicted_values (E, D) float32)
    tensors, the evicted rows as they were (to keep them elsewhere; they are no longer in the table).
    No gradient flows. Under R ranks each rank reads the keys it owns (key % R, or the localized rank)."""
    import numpy as np

    from numbactr.runtime import device
    from numbactr.runtime.torch_bridge import as_array, as_tensor
    from numbactr.sok.hybrid import HybridTable

    table = getattr(var, "table", None)
    if not isinstance(table, HybridTable):
        raise TypeError(
            f"sok.sparse_read_and_evict: var must be a sok.DynamicVariable of var_type 'hybrid', got "
            f"{type(var).__name__}{'' if table is None else ' of another kind'}"
        )
    keys = as_array(indices) if isinstance(indices, torch.Tensor) else device.xp().asarray(indices)
    flat = keys.reshape(-1)
    table._check_keys(flat)
    host = np.asarray(device.to_host(flat)).astype(np.int64)
    foreign = np.flatnonzero(table.owners(host) != table.comm.rank)
    if foreign.size:
        raise ValueError(
            f"sok.sparse_read_and_evict: {table.who}: key {host[foreign[0]]} (position {foreign[0]}) belongs to "
            f"rank {int(table.owners(host[foreign[:1]])[0])}, not rank {table.comm.rank}"
        )
    rows, ev_keys, ev_values = table.read_and_evict(flat)
    emb = as_tensor(rows).reshape(*tuple(indices.shape), table.dim).clone()
    return emb, torch.from_numpy(ev_keys.copy()), torch.from_numpy(ev_values)


def Init(**kwargs):  # noqa: N802 (SOK's first API)
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
