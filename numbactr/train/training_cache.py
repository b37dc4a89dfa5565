"""HugeCTR's Embedding Training Cache (ETC, v3.2-v23.08; removed after): ``CreateETC``, ``CreateHMemCache``,
``TrainPSType_t``, ``Model(solver, reader, optimizer, etc)`` and the model methods that go with it.

What HugeCTR's ETC is for: tables larger than the GPUs' memory. Training data comes as several file lists,
each with a *keyset file* (the keys that list uses); before a list is trained, ``update(keyset)`` loads those
keys' rows from a parameter server (PS) into the GPU table and writes the evicted ones back. The PS is
``Staged`` (the whole table in host memory) or ``Cached`` (a host cache in front of files on a local SSD).
Each embedding's table lives in a *sparse model* folder (``key``, ``emb_vector``): trained further when the
folder exists, created by ``save_params_to_files`` otherwise.

numbactr keeps the API and its contract, and maps the two parameter servers onto its own storage:

* ``Staged``: the embedding's whole table in memory, as every numbactr table is (host memory on cpu/sim).
* ``Cached``: the embedding as a tiered table (numbactr.embedding.tiered): a cache in memory in front of a
  memory-mapped backing file in a scratch folder under ``local_paths[rank]``, removed at exit. A sharded
  tiered table is not built: with several ranks a Cached PS runs as Staged, with a warning.
  Rows enter the cache on demand at each batch rather than in one pass per keyset.

``update(keyset)`` reads and checks the keyset file(s) (32-bit unsigned keys, or 64-bit with
``i64_input_key``; one file for all embeddings or one per embedding) and records them for
``get_incremental_model``. The sparse models named in ``CreateETC`` are loaded at ``compile()`` when they
exist, and ``save_params_to_files`` writes each embedding's table to its sparse model folder (atomically:
a new folder is renamed into place) and the dense files under its prefix, as HugeCTR does.
``get_incremental_model()`` returns, per embedding, the keys of the keyset files used since the last call
that the table holds, with their current vectors: [(keys (n,) int64, vectors (n, D) float32), ...].
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np

from numbactr.enums import TrainPSType_t

__all__ = [
    "CreateETC",
    "CreateHMemCache",
    "EmbeddingTrainingCache",
    "EmbeddingTrainingCacheParams",
    "HMemCacheConfig",
    "TrainPSType_t",
]


class ETCError(ValueError):
    pass


@dataclass(frozen=True)
class HMemCacheConfig:
    """``CreateHMemCache(num_blocks, target_hit_rate, max_num_evict)``: HugeCTR's Cached-PS host cache
    (blocks of the host cache, the hit rate below which it evicts, how many blocks it evicts at most).
    numbactr's tiered table sizes its cache with CacheConfig instead; these are checked and kept."""

    num_blocks: int
    target_hit_rate: float
    max_num_evict: int


def CreateHMemCache(num_blocks, target_hit_rate, max_num_evict) -> HMemCacheConfig:  # noqa: N802 (HugeCTR's name)
    for name, v in (("num_blocks", num_blocks), ("max_num_evict", max_num_evict)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ETCError(f"CreateHMemCache: {name} must be an integer >= 0, got {v!r}")
    if (
        isinstance(target_hit_rate, bool)
        or not isinstance(target_hit_rate, (int, float))
        or not 0.0 <= float(target_hit_rate) <= 1.0
    ):
        raise ETCError(f"CreateHMemCache: target_hit_rate must be in [0, 1], got {target_hit_rate!r}")
    return HMemCacheConfig(int(num_blocks), float(target_hit_rate), int(max_num_evict))


@dataclass
class EmbeddingTrainingCacheParams:
    """What ``CreateETC`` returns; ``Model`` takes it as its fourth argument."""

    ps_types: list
    sparse_models: list
    local_paths: list = field(default_factory=list)
    hmem_cache_configs: list = field(default_factory=list)  # one per embedding (None for Staged)
    use_embedding_training_cache: bool = True


def _check_sparse_model(path: str) -> bool:
    """HugeCTR's check: an existing non-empty folder must hold non-empty key and emb_vector files (True:
    use it); a missing or empty folder will be written after training (False); a file of that name is an
    error."""
    if os.path.isdir(path) and os.listdir(path):
        for f in ("key", "emb_vector"):
            p = os.path.join(path, f)
            if not os.path.isfile(p):
                raise ETCError(
                    f"CreateETC: sparse model {path!r} exists but has no {f!r} file (a sparse model "
                    "folder holds key and emb_vector)"
                )
            if os.path.getsize(p) == 0:
                raise ETCError(f"CreateETC: sparse model {path!r}: {f!r} is empty")
        return True
    if os.path.exists(path) and not os.path.isdir(path):
        raise ETCError(f"CreateETC: sparse model {path!r} is a file; it must be a folder (or not exist yet)")
    return False


def CreateETC(ps_types, sparse_models=(), local_paths=(), hmem_cache_configs=()):  # noqa: N802
    """``hugectr.CreateETC(ps_types, sparse_models, local_paths=[], hmem_cache_configs=[])``: one PS type
    and one sparse model folder per embedding (add order); ``local_paths`` (one per rank) and the host-cache
    configs (one for every Cached PS, or a single one they share) are needed when any PS is Cached."""
    ps_types = list(ps_types)
    sparse_models = [os.fspath(p) for p in sparse_models]
    local_paths = [os.fspath(p) for p in local_paths]
    configs = list(hmem_cache_configs)
    if not ps_types or not all(isinstance(t, TrainPSType_t) for t in ps_types):
        raise ETCError(
            f"CreateETC: ps_types must be a non-empty list of TrainPSType_t (Staged, Cached), got {ps_types!r}"
        )
    if not sparse_models:
        raise ETCError(
            "CreateETC: sparse_models is required: for training from scratch the folders the trained "
            "tables are written to, for incremental training the existing sparse models"
        )
    if len(sparse_models) != len(ps_types):
        raise ETCError(
            f"CreateETC: {len(ps_types)} ps_types but {len(sparse_models)} sparse_models; give one "
            "of each per embedding"
        )
    for p in sparse_models:
        _check_sparse_model(p)
    if not all(isinstance(c, HMemCacheConfig) for c in configs):
        raise ETCError("CreateETC: hmem_cache_configs must come from CreateHMemCache()")
    cached = [i for i, t in enumerate(ps_types) if t == TrainPSType_t.Cached]
    per_table = [None] * len(ps_types)
    if cached:
        if not local_paths:
            raise ETCError("CreateETC: a Cached PS needs local_paths (one folder on a local disk per rank)")
        if len(configs) == 1:
            for i in cached:
                per_table[i] = configs[0]
        elif len(configs) == len(cached):  # one per Cached PS, in order (HugeCTR's rule)
            for i, c in zip(cached, configs):
                per_table[i] = c
        else:
            raise ETCError(
                f"CreateETC: {len(configs)} hmem_cache_configs for {len(cached)} Cached PS; give one "
                "shared by all, or one per Cached PS"
            )
    return EmbeddingTrainingCacheParams(ps_types, sparse_models, local_paths, per_table)


def read_keyset(path: str, i64: bool) -> np.ndarray:
    """A keyset file's keys as int64: raw little-endian uint32 (or int64 with i64_input_key)."""
    dtype = np.dtype("<i8") if i64 else np.dtype("<u4")
    try:
        size = os.path.getsize(path)
    except OSError:
        raise FileNotFoundError(f"keyset file {path!r} does not exist") from None
    if size % dtype.itemsize:
        raise ETCError(
            f"keyset file {path!r}: {size} bytes is not a whole number of {dtype.itemsize}-byte keys "
            f"(i64_input_key={i64})"
        )
    return np.fromfile(path, dtype=dtype).astype(np.int64)


class EmbeddingTrainingCache:
    """What ``Model.get_embedding_training_cache()`` returns."""

    def __init__(self, model):
        self.model = model
        self.updates = 0

    def update(self, keyset_file=None, *, keyset_file_list=None):
        """Before training a file list: its keyset file (one for all embeddings) or one file per embedding
        (HugeCTR's keyword for the list: keyset_file_list). numbactr's tables hold every row already (see the
        module doc): the files are read and checked."""
        if (keyset_file is None) == (keyset_file_list is None):
            raise ETCError("EmbeddingTrainingCache.update: give keyset_file or keyset_file_list")
        keyset_file = keyset_file if keyset_file is not None else keyset_file_list
        n = len(self.model.embeddings)
        files = (
            [os.fspath(keyset_file)]
            if isinstance(keyset_file, (str, os.PathLike))
            else [os.fspath(f) for f in keyset_file]
        )
        if len(files) not in (1, n):
            raise ETCError(
                f"EmbeddingTrainingCache.update: {len(files)} keyset files for {n} embeddings; give one "
                "file for all or one per embedding"
            )
        for f in files:
            read_keyset(f, self.model.solver.i64_input_key)  # exists and is whole keys
        self.updates += 1

    def incremental(self, files: list) -> list:
        """Per embedding, this rank's (keys, vectors) of the keys in the keyset files that the table holds."""
        m = self.model
        keys = (
            np.unique(np.concatenate([read_keyset(f, m.solver.i64_input_key) for f in files]))
            if files
            else np.zeros(0, np.int64)
        )
        out = []
        for e in m.embeddings:
            all_keys, vecs = e.dump()
            hit = np.isin(all_keys.astype(np.int64), keys)
            out.append((all_keys[hit].astype(np.int64), np.asarray(vecs[hit], np.float32)))
        return out


def check_model(model, etc: EmbeddingTrainingCacheParams) -> None:
    """Model(...) with ETC: epoch mode and one keyset per training source (HugeCTR's checks)."""
    if not isinstance(etc, EmbeddingTrainingCacheParams):
        raise ETCError(f"Model: the fourth argument must come from CreateETC(), got {etc!r}")
    if model.solver.repeat_dataset:
        raise ETCError(
            "Model: the embedding training cache runs in epoch mode only; use CreateSolver(repeat_dataset=False)"
        )
    keyset = model.reader_params.keyset
    keyset = [keyset] if isinstance(keyset, str) else list(keyset or [])
    keyset = [k for k in keyset if k]
    if len(keyset) != len(model.reader_params.source):
        raise ETCError(
            f"Model: with the embedding training cache give one keyset file per training source: "
            f"DataReaderParams has {len(model.reader_params.source)} source(s) and {len(keyset)} "
            "keyset file(s)"
        )
    model.reader_params.keyset = keyset


def tier_for(etc: EmbeddingTrainingCacheParams, index: int, rank: int, ranks: int):
    """The TierSpec of the index-th embedding for a Cached PS (None for Staged)."""
    if index >= len(etc.ps_types) or etc.ps_types[index] != TrainPSType_t.Cached:
        return None
    from numbactr.config import TierSpec

    if ranks > 1:  # same training results, only the storage differs: run it as Staged and say so
        from numbactr.config import warn_ignored

        warn_ignored(
            "CreateETC",
            f"ps_types[{index}]",
            TrainPSType_t.Cached,
            "numbactr's tiered tables run on one "
            "rank, so on several ranks this embedding's table is held in memory (as Staged)",
            stacklevel=4,
        )
        return None
    local = etc.local_paths[rank % len(etc.local_paths)]
    os.makedirs(local, exist_ok=True)
    path = tempfile.mkdtemp(prefix=f"numbactr_etc_{index}_", dir=local)  # scratch: removed at exit, as the
    atexit.register(shutil.rmtree, path, True)  # table lives on in its sparse model
    return TierSpec(backing="memmap", path=path)


def check_embeddings(model, etc: EmbeddingTrainingCacheParams) -> None:
    n = len(model.embeddings)
    if model.collections:
        raise ETCError(
            "Model: the embedding training cache works with SparseEmbedding layers, not an EmbeddingCollection"
        )
    if len(etc.ps_types) != n:
        raise ETCError(
            f"CreateETC: {len(etc.ps_types)} ps_types/sparse_models for the model's {n} embeddings "
            f"{[e.name for e in model.embeddings]}"
        )


def load_existing(model, etc: EmbeddingTrainingCacheParams) -> None:
    """compile(): the sparse models that exist become the tables (incremental training)."""
    from numbactr.files import checkpoint

    files = {e.name: p for e, p in zip(model.embeddings, etc.sparse_models) if _check_sparse_model(p)}
    if files:
        checkpoint.load_sparse_weights(model, files)


def save_sparse_models(model, etc: EmbeddingTrainingCacheParams) -> None:
    """Each embedding's table into its sparse model folder: written beside it, then renamed into place."""
    from numbactr.files.checkpoint import _gather_embedding, _raw, _write_durable, on_rank0

    comm = model.comm
    gathered = [_gather_embedding(e, comm) for e in model.embeddings]  # collectives

    def write():
        for (_, keys, vecs, slots, _), folder in zip(gathered, etc.sparse_models):
            folder = os.path.abspath(folder)
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            token = secrets.token_hex(4)
            tmp = f"{folder}.tmp-{token}"
            os.makedirs(tmp)
            _write_durable(os.path.join(tmp, "key"), _raw(keys, "<i8"))
            _write_durable(os.path.join(tmp, "emb_vector"), _raw(vecs, "<f4"))
            if slots is not None:
                _write_durable(os.path.join(tmp, "slot_id"), _raw(slots, "<u8"))
            old = None
            if os.path.exists(folder):
                old = f"{folder}.old-{token}"
                os.replace(folder, old)
            os.replace(tmp, folder)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)

    on_rank0(comm, write, "save_params_to_files: rank 0 could not write the ETC sparse models")
