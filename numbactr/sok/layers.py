"""SOK's embedding layers and variables as torch modules on numbactr's engine (imports torch).

Each module holds one numbactr.sok.table.SokTable and one empty parameter, ``placeholder`` (FBGEMM's
placeholder_autograd_tensor idea): it is what model.parameters() hands to an optimizer, it marks the table
for numbactr.sok.OptimizerWrapper, and it makes the lookup's output require grad. A lookup is a
torch.autograd.Function whose backward hands dLoss/dout to the table, which holds it until the optimizer's
step() applies the engine's fused backward + optimizer (SOK's apply_gradients); the table never gets a
dense (V, D) gradient. Tensors and the engine's arrays share memory (numbactr.runtime.torch_bridge).

Checkpoints: a module's state_dict() holds the rows this rank holds, "<prefix>keys" (n,) int64 and
"<prefix>values" (n, D) float32 (sok.export's pair), and load_state_dict() puts them back (a keyed table
then holds exactly those keys). Each rank saves and loads its own: a checkpoint is loaded by as many
ranks as saved it (a key on the wrong rank is an error). The tables' optimizer states are in
OptimizerWrapper.state_dict().

Inputs (PyTorch forms of SOK's TensorFlow inputs; keys are int32/int64 tensors, shapes B batch, S slots):
  All2AllDenseEmbedding   a dense (B, S, nnz_per_slot) tensor -> (B, S, nnz_per_slot, D) (no pooling: the
                          drop-in for nn.Embedding); dynamic_input=True: a 1-D (N,) tensor -> (N, D).
  DistributedEmbedding    the ids of B*S bags, bag b*S + s = slot s of sample b (SOK's SparseTensor of
                          dense_shape [B * slot_num, max_nnz]) -> (B, S, D) pooled (F.embedding_bag's role).
  lookup_sparse           per variable, the ids of B bags -> (B, D).
  all2all_dense_embedding a variable and a tensor of keys of any shape -> (*shape, D), no pooling.
  Bags may be given as
    * (values, offsets): values (N,), offsets (bags + 1,) with offsets[-1] = N (CSR; F.embedding_bag's
      include_last_offset=True form);
    * a torch sparse COO or CSR tensor of shape (bags, max_nnz): the entries of row j are bag j's keys in
      column order (SOK's tf.SparseTensor);
    * a dense 2-D tensor (bags, nnz): every entry a key (bags of equal length); DistributedEmbedding also
      takes (B, S, nnz).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from numbactr.runtime import device
from numbactr.distributed.comm import world
from numbactr.embedding.engine import Pooling, UpdateType
from numbactr.embedding.sharded import owner_offsets
from numbactr.runtime.torch_bridge import as_array, as_tensor
from numbactr.sok.hybrid import HYBRID_DEFAULTS, HybridTable
from numbactr.sok.table import DISTRIBUTED, SETTINGS, SokTable, init_range
from numbactr.sok.inputs import (
    COMBINERS as COMBINERS,
    _bags,
    _check_key_dtype,
    _check_value_dtype,
    _combiner,
    _keys,
    _mode,
    _normalized,
    _warn_ignored,
)

__all__ = [
    "All2AllDenseEmbedding",
    "DistributedEmbedding",
    "Variable",
    "DynamicVariable",
    "lookup_sparse",
    "all2all_dense_embedding",
    "export",
    "assign",
]

#: keys a DynamicVariable holds per rank unless init_capacity / max_capacity say otherwise (SOK's hash
#: tables grow; the engine's keyed tables have a fixed capacity)
DYNAMIC_CAPACITY = 1 << 20


class _Lookup(torch.autograd.Function):
    """out = the table's lookup; backward hands dLoss/dout to the table (no gradient to any input)."""

    @staticmethod
    def forward(ctx, table, keys, offsets, weights, training, pooling, placeholder):
        out, ctx.lookup = table.lookup(keys, offsets, training, weights, pooling)
        ctx.table = table
        return as_tensor(out)

    @staticmethod
    def backward(ctx, dy):
        ctx.table.hold(ctx.lookup, as_array(dy))
        return (None,) * 7


class _SokModule(nn.Module):
    """A module over one SokTable: the placeholder parameter and the views every SOK module shares."""

    def _attach(self, table: SokTable, name) -> None:
        """The module's table and placeholder; ``name`` (SOK's; sok.dump's file names) defaults to the class
        name and the table's creation index (the same in every process that builds the model alike)."""
        kind = getattr(type(self), "default_name", type(self).__name__)
        self.name = str(name) if name else f"{kind}_{table.seed - SETTINGS.seed}"
        self.table = table
        self.placeholder = nn.Parameter(torch.zeros(0, device=_torch_device()), requires_grad=table.trainable)
        self.placeholder._sok_table = table

    @property
    def embedding_variable(self) -> nn.Parameter:
        """What an optimizer takes for this table (SOK's embedding_variable): the placeholder parameter."""
        return self.placeholder

    @property
    def weight(self) -> torch.Tensor:
        """(V_local, D) the rows this rank holds, a view that writes through to the table (keyed tables:
        the rows in use, in order of first insertion; see keys())."""
        return as_tensor(self.table.weights())

    def keys(self) -> torch.Tensor:
        """(V_local,) int64 the key (global row) of each row of weight."""
        return torch.from_numpy(self.table.keys())

    # torch checkpoints: state_dict() holds this rank's rows as "<prefix>keys" (n,) int64 and "<prefix>values"
    # (n, D) float32 (sok.export's pair); load_state_dict() puts them back (numbactr.sok.table.SokTable.load_state)
    _STATE = ("keys", "values")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        keys, values = self.table.state()
        destination[prefix + "keys"] = torch.from_numpy(keys)
        destination[prefix + "values"] = torch.from_numpy(values)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        names = [prefix + n for n in self._STATE]
        for n in names:
            if n in unexpected_keys:
                unexpected_keys.remove(n)
        have = [n in state_dict for n in names]
        if not all(have):
            missing_keys.extend(n for n, h in zip(names, have) if not h)
            return
        try:
            self.table.load_state(
                as_array(state_dict[names[0]].detach().cpu()), as_array(state_dict[names[1]].detach().cpu().float())
            )
        except ValueError as e:
            error_msgs.append(str(e))

    def _lookup(self, keys, offsets, training, weights=None, pooling=None):
        training = self.training if training is None else bool(training)
        return _Lookup.apply(self.table, keys, offsets, weights, training, pooling, self.placeholder)


class All2AllDenseEmbedding(_SokModule):
    """SOK's All2AllDenseEmbedding: every key's own vector, no pooling (a drop-in for nn.Embedding).

    Args (SOK's):
        max_vocabulary_size_per_gpu: rows each rank holds (keyed: the keys it can hold; unkeyed: keys are
            rows in [0, max_vocabulary_size_per_gpu * ranks)).
        embedding_vec_size: D.
        slot_num: S, the feature fields of an input.
        nnz_per_slot: keys per slot (every slot has exactly this many).
        dynamic_input: inputs are (N,) keys (e.g. from torch.unique) -> (N, D).
        use_hashtable: keys of any int64 value through a hash table (SOK's default), else rows.
        key_dtype: torch.int64 or torch.int32 (inputs of either are accepted).
        embedding_initializer: None / 'random_uniform' (U(-0.05, 0.05)), 'zeros', 'ones', a number, (lo, hi).
        name: for messages. Keys distribute over ranks as key % R.
    """

    def __init__(
        self,
        max_vocabulary_size_per_gpu,
        embedding_vec_size,
        slot_num,
        nnz_per_slot,
        dynamic_input=False,
        use_hashtable=True,
        key_dtype=None,
        embedding_initializer=None,
        *,
        name: str = "all2all_dense_embedding",
        **kwargs,
    ):
        super().__init__()
        _warn_ignored(kwargs, f"All2AllDenseEmbedding {name!r}")
        who = f"All2AllDenseEmbedding {name!r}"
        _check_key_dtype(key_dtype, who)
        self.max_vocabulary_size_per_gpu, self.embedding_vec_size = (
            int(max_vocabulary_size_per_gpu),
            int(embedding_vec_size),
        )
        self.slot_num, self.nnz_per_slot = int(slot_num), int(nnz_per_slot)
        self.dynamic_input, self.use_hashtable = bool(dynamic_input), bool(use_hashtable)
        if self.nnz_per_slot < 1:
            raise ValueError(f"{who}: nnz_per_slot must be >= 1, got {nnz_per_slot}")
        self._attach(
            _vocabulary_table(
                who,
                self.max_vocabulary_size_per_gpu,
                self.embedding_vec_size,
                self.slot_num,
                Pooling.NONE,
                self.use_hashtable,
                embedding_initializer,
            ),
            name,
        )

    def forward(self, inputs, training=None):
        """(B, slot_num, nnz_per_slot, D) vectors of inputs (B, slot_num, nnz_per_slot); with dynamic_input,
        (N, D) of inputs (N,). training (default: the module's mode) inserts new keys."""
        keys = _keys(inputs, self.table.who)
        shape = tuple(inputs.shape)
        if self.dynamic_input:
            if len(shape) != 1:
                raise ValueError(f"{self.table.who}: dynamic_input=True takes 1-D keys (N,), got shape {shape}")
            offsets = owner_offsets(keys.shape[0], self.slot_num)
        else:
            if len(shape) != 3 or shape[1:] != (self.slot_num, self.nnz_per_slot):
                raise ValueError(
                    f"{self.table.who}: inputs must have shape (batch, slot_num={self.slot_num}, "
                    f"nnz_per_slot={self.nnz_per_slot}), got {shape}"
                )
            offsets = device.xp().arange(shape[0] * self.slot_num + 1, dtype=np.int64) * self.nnz_per_slot
        out = self._lookup(keys, offsets, training)
        return out.view(*shape, self.embedding_vec_size)


class DistributedEmbedding(_SokModule):
    """SOK's DistributedEmbedding: each slot's keys pooled by the combiner (a drop-in for F.embedding_bag).

    Args (SOK's): combiner ('sum' or 'mean'; a missing key of evaluation adds nothing but counts in the
    mean), max_vocabulary_size_per_gpu, embedding_vec_size, slot_num, max_nnz (most keys in one slot),
    max_feature_num (most keys in one sample; <= 1: slot_num * max_nnz), use_hashtable, key_dtype,
    embedding_initializer, as All2AllDenseEmbedding. Keys distribute over ranks as key % R.
    """

    def __init__(
        self,
        combiner,
        max_vocabulary_size_per_gpu,
        embedding_vec_size,
        slot_num,
        max_nnz,
        max_feature_num=1,
        use_hashtable=True,
        key_dtype=None,
        embedding_initializer=None,
        *,
        name: str = "distributed_embedding",
        **kwargs,
    ):
        super().__init__()
        who = f"DistributedEmbedding {name!r}"
        _warn_ignored(kwargs, who)
        _check_key_dtype(key_dtype, who)
        self.combiner = _combiner(combiner, who)
        self.max_vocabulary_size_per_gpu, self.embedding_vec_size = (
            int(max_vocabulary_size_per_gpu),
            int(embedding_vec_size),
        )
        self.slot_num, self.max_nnz = int(slot_num), int(max_nnz)
        if self.max_nnz < 1:
            raise ValueError(f"{who}: max_nnz must be >= 1, got {max_nnz}")
        self.max_feature_num = int(max_feature_num) if int(max_feature_num) > 1 else self.slot_num * self.max_nnz
        self.use_hashtable = bool(use_hashtable)
        self._attach(
            _vocabulary_table(
                who,
                self.max_vocabulary_size_per_gpu,
                self.embedding_vec_size,
                self.slot_num,
                COMBINERS[self.combiner],
                self.use_hashtable,
                embedding_initializer,
            ),
            name,
        )

    def forward(self, inputs, training=None):
        """(B, slot_num, D) pooled vectors of the ids of B * slot_num bags (module docstring)."""
        who = self.table.who
        if isinstance(inputs, torch.Tensor) and inputs.layout == torch.strided and inputs.dim() == 3:
            if inputs.shape[1] != self.slot_num:
                raise ValueError(
                    f"{who}: dense inputs must have shape (batch, slot_num={self.slot_num}, nnz), "
                    f"got {tuple(inputs.shape)}"
                )
            inputs = inputs.reshape(-1, inputs.shape[2])
        keys, offsets = _bags(inputs, who)
        n_bags = offsets.shape[0] - 1
        if n_bags % self.slot_num:
            raise ValueError(
                f"{who}: the inputs hold {n_bags} bags, not batch * slot_num (slot_num="
                f"{self.slot_num}); row b * slot_num + s is slot s of sample b"
            )
        lengths = np.diff(device.to_host(offsets))
        if lengths.size and int(lengths.max()) > self.max_nnz:
            j = int(np.argmax(lengths))
            raise ValueError(
                f"{who}: slot {j % self.slot_num} of sample {j // self.slot_num} holds {int(lengths[j])} "
                f"keys, more than max_nnz={self.max_nnz}"
            )
        per_sample = lengths.reshape(-1, self.slot_num).sum(axis=1)
        if per_sample.size and int(per_sample.max()) > self.max_feature_num:
            b = int(np.argmax(per_sample))
            raise ValueError(
                f"{who}: sample {b} holds {int(per_sample[b])} keys, more than max_feature_num={self.max_feature_num}"
            )
        out = self._lookup(keys, offsets, training)
        return out.view(n_bags // self.slot_num, self.slot_num, self.embedding_vec_size)


class Variable(_SokModule):
    """SOK's sok.Variable: a static table (V, D), model-parallel (``mode=None`` or 'distributed': global row
    k on rank k % R as its local row k // R) or on one rank (``mode='localized:t'``: all rows on rank t).

    Args: initial_value ((V, D) or (D,) = one row; array, tensor or list: the same on every rank), or
    shape=(V, D) with initializer: a torch.nn.init function applied to the global (V, D) tensor (same on
    every rank under the same torch seed), or a name / number (init_range: 'random' draws row k from a
    hash of (seed, k)); default 'random'. dtype: float32 only. trainable, name as tf.Variable.
    Lookups: lookup_sparse. ``shape`` is this rank's (V_local, D), ``global_shape`` (V, D).
    """

    default_name = "Variable"  # unnamed tables: Variable_<i>, whichever class sok.Variable returned

    def __new__(cls, *args, **kwargs):
        # SOK's sok.Variable is a function returning a DistributedVariable or a LocalizedVariable by mode
        if cls is Variable:
            mode = kwargs.get("mode")
            cls = LocalizedVariable if isinstance(mode, str) and mode.startswith("localized") else DistributedVariable
        return super().__new__(cls)

    def __init__(
        self,
        initial_value=None,
        trainable=True,
        name=None,
        dtype=None,
        shape=None,
        initializer=None,
        mode=None,
        **kwargs,
    ):
        super().__init__()
        who = f"sok.Variable {name or ''!r}"
        _warn_ignored(kwargs, who)
        _check_value_dtype(dtype, who)
        self.mode, target = _mode(mode, who)
        init = init_range(None, who)
        if initial_value is not None:
            if isinstance(initial_value, torch.Tensor):
                initial_value = initial_value.detach().cpu().numpy()
            initial = np.asarray(initial_value, np.float32)
            initial = initial.reshape(1, -1) if initial.ndim == 1 else initial
            if initial.ndim != 2 or 0 in initial.shape:
                raise ValueError(f"{who}: initial_value must be (V, D) or (D,), got shape {initial.shape}")
        elif shape is not None:
            if len(tuple(shape)) != 2:
                raise ValueError(f"{who}: shape must be (V, D), got {shape}")
            initial = None
            if callable(initializer):
                full = torch.zeros(tuple(int(s) for s in shape))
                with torch.no_grad():
                    initializer(full)
                initial = full.numpy()
            else:
                init = init_range(initializer, who)
        else:
            raise ValueError(f"{who}: give initial_value, or shape (V, D) with an initializer")
        self.global_shape = tuple(int(s) for s in (initial.shape if initial is not None else shape))
        # a wrapped torch.optim.Adam runs Keras' Adam, which moves every row of a tf.Variable (optimizer.py)
        table = SokTable(
            who,
            self.global_shape[1],
            keyed=False,
            global_rows=self.global_shape[0],
            pooling=Pooling.MEAN,
            target=target,
            init=init,
            initial=initial,
            trainable=trainable,
            adam_update=UpdateType.GLOBAL,
        )
        self._attach(table, name)

    @property
    def shape(self) -> tuple:
        return (int(self.table.weights().shape[0]), self.global_shape[1])

    @property
    def target_gpu(self) -> int:
        return self.table.target

    @property
    def num_gpus(self) -> int:
        return self.table.comm.size

    @property
    def global_gpu_id(self) -> int:
        return self.table.comm.rank

    def key_map(self, indices):
        """Global rows -> this rank's rows, as SOK's variables map them: k // R when distributed, k when
        localized."""
        return indices // self.num_gpus if self.target_gpu == -1 else indices


class DistributedVariable(Variable):
    """SOK's DistributedVariable: what sok.Variable(mode=None or 'distributed') returns (row k on rank k % R).
    SOK's constructor, positional order included; tf.Variable's graph arguments (collections, validate_shape,
    caching_device, variable_def, import_scope, constraint, distribute_strategy, synchronization,
    aggregation) are accepted and have no effect. global_gpu_id and num_gpus must name this rank and the
    job's ranks if given."""

    def __init__(
        self,
        initial_value=None,
        trainable=None,
        collections=None,
        validate_shape=True,
        caching_device=None,
        name=None,
        dtype=None,
        variable_def=None,
        import_scope=None,
        constraint=None,
        distribute_strategy=None,
        synchronization=None,
        aggregation=None,
        shape=None,
        initializer=None,
        global_gpu_id=None,
        num_gpus=None,
        *,
        mode=None,
        **kwargs,
    ):
        _check_collections(collections, name)
        super().__init__(
            initial_value,
            trainable if trainable is not None else True,
            name,
            dtype,
            shape,
            initializer,
            mode=mode if mode is not None else "distributed",
            **kwargs,
        )
        if self.target_gpu != -1:
            raise ValueError(f"sok.DistributedVariable {name!r}: mode {mode!r} is not distributed")
        _check_placement(self, global_gpu_id, num_gpus)


class LocalizedVariable(Variable):
    """SOK's LocalizedVariable: what sok.Variable(mode='localized:t') returns (every row on rank t);
    LocalizedVariable(..., target_gpu=t) directly. SOK's constructor, positional order included (the graph
    arguments as DistributedVariable's)."""

    def __init__(
        self,
        initial_value=None,
        trainable=None,
        collections=None,
        validate_shape=True,
        caching_device=None,
        name=None,
        dtype=None,
        variable_def=None,
        import_scope=None,
        constraint=None,
        distribute_strategy=None,
        synchronization=None,
        aggregation=None,
        shape=None,
        initializer=None,
        global_gpu_id=None,
        target_gpu=None,
        *,
        mode=None,
        **kwargs,
    ):
        _check_collections(collections, name)
        if mode is None:
            if target_gpu is None:
                raise ValueError(f"sok.LocalizedVariable {name!r}: give target_gpu (the rank that holds the table)")
            mode = f"localized:{int(target_gpu)}"
        super().__init__(
            initial_value,
            trainable if trainable is not None else True,
            name,
            dtype,
            shape,
            initializer,
            mode=mode,
            **kwargs,
        )
        if target_gpu is not None and int(target_gpu) != self.target_gpu:
            raise ValueError(f"sok.LocalizedVariable {name!r}: target_gpu={target_gpu} disagrees with mode {mode!r}")
        _check_placement(self, global_gpu_id, None)


def _check_collections(collections, name) -> None:
    # tf.Variable's rule; it also catches an older positional call Variable(value, trainable, name)
    if collections is not None and not isinstance(collections, (list, tuple, set)):
        raise ValueError(
            f"sok variable {name!r}: collections (the third positional argument, as in SOK) must be "
            f"a list, tuple or set, got {collections!r}; pass name= by keyword"
        )


def _check_placement(var, global_gpu_id, num_gpus) -> None:
    if global_gpu_id is not None and int(global_gpu_id) != var.global_gpu_id:
        raise ValueError(f"sok variable: global_gpu_id={global_gpu_id} but this process is rank {var.global_gpu_id}")
    if num_gpus is not None and int(num_gpus) != var.num_gpus:
        raise ValueError(f"sok variable: num_gpus={num_gpus} but the job has {var.num_gpus} rank(s)")


class DynamicVariable(_SokModule):
    """SOK's sok.DynamicVariable: a keyed table whose rows appear as keys come (any int64 key but -1),
    key k on rank k % R (or all on rank t with ``mode='localized:t'``).

    Args (SOK's): dimension (D); initializer; var_type ``"hybrid"`` (the default, as in SOK: HierarchicalKV's
    evicting table, numbactr.sok.hybrid) or ``"hbm"`` (a fixed-capacity keyed table of the engine); key_type
    torch.int64 or torch.int32; dtype float32; mode.

    var_type "hybrid": kwargs init_capacity, max_capacity (keys per rank, default 2**20), max_load_factor
    (0.5), max_bucket_size (128), evict_strategy ("kLru", "kLfu", "kEpochLru", "kEpochLfu"; "kCustomized"
    needs scores, which lookups do not give), filter_ratio (the low-frequency filter's admission
    probability, 1.0). A lookup never fails for a full table: a new key takes the slot of its bucket's
    lowest-scored key (whose row and optimizer state are reset for it) or is refused and reads zeros.
    initializer: "random" / "normal" / None N(0, 1) (SOK's hybrid default), "uniform" U(-1, 1), "zeros",
    "ones", a number or numeric string, or (lo, hi). Keeps each key's last insertion / update time for
    sok.incremental_model_dump; sok.sparse_read_and_evict returns the keys an insertion evicts. ``weight``
    is a copy of the rows held, in slot order.

    var_type "hbm": initializer 'random' = U(-0.05, 0.05) as SOK's 'hbm' backend, 'zeros', 'ones', a number or
    numeric string; init_capacity / max_capacity: the keys each rank can hold (default max_capacity, else
    init_capacity, else 2**20: the table does not grow; a batch bringing more new keys than it has room for
    is a VocabularyFullError).

    Every lookup inserts the keys it has not seen with the initializer, in evaluation too (module.eval()):
    SOK's lookups of a DynamicVariable always insert (its hash table's lookup is find-or-insert), so a new
    key reads its initial vector and a 'mean' combiner counts it as such.
    """

    def __init__(
        self,
        dimension,
        initializer=None,
        var_type=None,
        name=None,
        constraint=None,
        trainable=True,
        key_type=None,
        dtype=None,
        mode=None,
        **kwargs,
    ):
        super().__init__()
        who = f"sok.DynamicVariable {name or ''!r}"
        if var_type not in (None, "hbm", "hybrid"):
            raise ValueError(f"{who}: var_type must be 'hbm' or 'hybrid', got {var_type!r}")
        if constraint is not None:
            raise NotImplementedError(f"{who}: constraint is not supported by numbactr")
        _check_key_dtype(key_type, who)
        _check_value_dtype(dtype, who)
        self.mode, target = _mode(mode, who)
        self.dimension, self.backend_type = int(dimension), var_type or "hybrid"
        self.key_type = key_type or torch.int64
        if self.backend_type == "hybrid":
            opts = {k: kwargs.pop(k) for k in HYBRID_DEFAULTS if k in kwargs}
            _warn_ignored(kwargs, who)
            table = HybridTable(
                who, self.dimension, initializer=initializer, target=target, trainable=trainable, **opts
            )
        else:
            capacity = kwargs.pop("max_capacity", None) or kwargs.pop("init_capacity", None) or DYNAMIC_CAPACITY
            kwargs.pop("init_capacity", None)
            _warn_ignored(kwargs, who)
            table = SokTable(
                who,
                self.dimension,
                keyed=True,
                capacity=int(capacity),
                option="max_capacity (keys per rank)",
                pooling=Pooling.MEAN,
                target=target,
                init=init_range(initializer, who),
                trainable=trainable,
            )
        self._attach(table, name)

    def _lookup(self, keys, offsets, training, weights=None, pooling=None):
        # SOK's DynamicVariable inserts new keys in every lookup (class docstring)
        return super()._lookup(keys, offsets, True, weights, pooling)

    @property
    def size(self) -> int:
        """Keys this rank holds."""
        return int(self.table.keys().shape[0])

    @property
    def target_gpu(self) -> int:
        return self.table.target

    @property
    def num_gpus(self) -> int:
        return self.table.comm.size


def export(var):
    """SOK's sok.export: (keys (n,) int64, values (n, D) float32) tensors of the rows this rank holds
    (copies)."""
    return torch.from_numpy(var.table.keys().copy()), torch.from_numpy(np.array(device.to_host(var.table.weights())))


def assign(var, indices, values) -> None:
    """SOK's sok.assign for a DynamicVariable: keys ``indices`` (n,) take ``values`` (n, D) on this rank, which
    must own them (key % R == rank, or the localized rank); new keys are inserted. Optimizer states of new
    keys start from their initial values."""
    table = var.table
    if not table.keyed:
        raise TypeError(f"{table.who}: assign() is for DynamicVariable (a sok.Variable's rows are its weight)")
    keys = np.asarray(device.to_host(as_array(indices))).astype(np.int64).reshape(-1)
    vals = np.asarray(device.to_host(as_array(values)), np.float32).reshape(keys.shape[0], -1)
    if vals.shape[1] != table.dim:
        raise ValueError(f"{table.who}: values must be (n, {table.dim}), got {vals.shape}")
    comm = table.comm
    owner = (
        keys.astype(np.uint64) % np.uint64(comm.size)
        if table.target == DISTRIBUTED
        else np.full(keys.shape, table.target, np.uint64)
    )
    foreign = np.flatnonzero(owner != comm.rank)
    if foreign.size:
        raise ValueError(
            f"{table.who}: key {keys[foreign[0]]} (position {foreign[0]}) belongs to rank "
            f"{int(owner[foreign[0]])}, not rank {comm.rank}"
        )
    table._check_keys(keys)
    table.put_rows(keys, vals)


def all2all_dense_embedding(param, indices):
    """SOK's sok.all2all_dense_embedding(param, indices): the vector of every key of ``indices`` (an integer
    tensor of any shape) in ``param`` (a Variable or DynamicVariable), no pooling: (*indices.shape, D), the
    model-parallel tf.nn.embedding_lookup (each key looked up on the rank that owns it). A DynamicVariable
    inserts new keys. The gradient of every occurrence reaches its row; the optimizer's step applies them."""
    if not isinstance(param, (Variable, DynamicVariable)):
        raise TypeError(
            f"sok.all2all_dense_embedding: param must be a sok.Variable or sok.DynamicVariable, got "
            f"{type(param).__name__}"
        )
    who = param.table.who
    keys = _keys(indices, who)
    out = param._lookup(keys, owner_offsets(keys.shape[0], param.table.features), None, None, Pooling.NONE)
    return out.view(*tuple(indices.shape), param.table.dim)


def lookup_sparse(params, sp_ids, sp_weights=None, combiners=None, use_low_frequency_filter=False):
    """SOK's sok.lookup_sparse: pooled lookups of several variables at once.

    Args:
        params: a Variable / DynamicVariable, or a list of them.
        sp_ids: the ids of the variable's B bags (module docstring), or a list of them, one per variable,
            when params is a list (a (values, offsets) pair is one variable's ids).
        sp_weights: None, or per variable the weights of its ids, in the same form and bags as the ids:
            'sum' gives sum_k w_k e_k and 'mean' sum_k w_k e_k / sum_k w_k (tf.nn.embedding_lookup_sparse's
            rule; a bag whose weights sum to 0 gives 0). The weights get no gradient (as in SOK).
        combiners: 'sum' or 'mean' per variable (default: 'mean' for all, SOK's default).
        use_low_frequency_filter: a key not yet in a hybrid DynamicVariable is admitted with probability its
            filter_ratio, else it adds zero to its bag and is not stored (numbactr.sok.hybrid); every param
            must then be a hybrid DynamicVariable.
    Returns: (B, D) tensors, a list when params is a list, else one tensor.
    """
    as_list = isinstance(params, (list, tuple))
    params = list(params) if as_list else [params]
    ids = list(sp_ids) if as_list else [sp_ids]
    weights = [None] * len(ids) if sp_weights is None else (list(sp_weights) if as_list else [sp_weights])
    combiners = (
        ["mean"] * len(params)
        if combiners is None
        else (list(combiners) if isinstance(combiners, (list, tuple)) else [combiners])
    )
    if not len(params) == len(ids) == len(weights) == len(combiners):
        raise ValueError(
            f"sok.lookup_sparse: {len(params)} params, {len(ids)} sp_ids, {len(weights)} sp_weights "
            f"and {len(combiners)} combiners; give one of each per variable"
        )
    out = []
    for param, ids_i, w_i, comb in zip(params, ids, weights, combiners):
        if not isinstance(param, (Variable, DynamicVariable)):
            raise TypeError(
                f"sok.lookup_sparse: params must be sok.Variable or sok.DynamicVariable, got {type(param).__name__}"
            )
        who = param.table.who
        pooling = COMBINERS[_combiner(comb, who)]
        keys, offsets = _bags(ids_i, who)
        psw = None
        if w_i is not None:
            psw, w_offsets = _bags(w_i, who + " sp_weights", values="float")
            if w_offsets.shape != offsets.shape or bool((w_offsets != offsets).any()):
                raise ValueError(f"{who}: sp_weights must have the same bags as sp_ids")
            if pooling == Pooling.MEAN:  # sum_k w_k e_k / sum_k w_k: SUM of normalized weights
                psw, pooling = _normalized(psw, offsets), Pooling.SUM
        if not use_low_frequency_filter:
            out.append(param._lookup(keys, offsets, None, psw, pooling))
            continue
        if not isinstance(param.table, HybridTable):
            raise ValueError(
                f"sok.lookup_sparse: {who}: use_low_frequency_filter needs a DynamicVariable of var_type 'hybrid'"
            )
        param.table.filter_now = True
        try:
            out.append(param._lookup(keys, offsets, None, psw, pooling))
        finally:
            param.table.filter_now = False
    return out if as_list else out[0]


# ---- helpers ------------------------------------------------------------------------------------------
def _torch_device() -> str:
    return "cuda" if device.kind() == "gpu" else "cpu"


def _vocabulary_table(who, per_rank, dim, slots, pooling, keyed, initializer) -> SokTable:
    """A v1 layer's table: per_rank keys (keyed) or rows per rank (unkeyed: keys in [0, per_rank * R))."""
    ranks = world().size
    return SokTable(
        who,
        dim,
        keyed=keyed,
        capacity=per_rank,
        option="max_vocabulary_size_per_gpu",
        global_rows=per_rank * ranks,
        features=slots,
        pooling=pooling,
        init=init_range(initializer, who),
    )
