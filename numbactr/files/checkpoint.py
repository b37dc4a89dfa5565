"""Snapshots in HugeCTR's file layouts (spec §7.1-§7.3): save_params_to_files and the four loaders.

Files of ``save_params_to_files(prefix, it)``, HugeCTR's names and little-endian byte layouts:

    {prefix}_dense_{it}.model            float32 (P,): the flat weight vector, layer order
    {prefix}_opt_dense_{it}.model        float32 (K*P,): the K dense optimizer states, HugeCTR's order
    {prefix}_dense_{it}.model.ntp.json   BatchNorm running mean/var, one entry per BatchNorm layer
    {prefix}{i}_sparse_{it}.model/       one folder per embedding i (add order):
        key                              int64 (n,): each rank's keys in row (insertion) order, ranks
                                         concatenated
        emb_vector                       float32 (n, D), same order
        slot_id                          uint64 (n,), the slot of each key; Localized and OneHot only, as
                                         HugeCTR writes it (2**64-1: not known, see below)
    {prefix}{i}_opt_sparse_{it}.model    float32 (K, R, V, D): per state, per rank, HugeCTR's full per-rank
                                         buffer, row j = the state of that rank's j-th key in `key`
    {prefix}_{it}.manifest.json          numbactr's extra file (HugeCTR never reads it): the name, size and
                                         sha256 of every file above, the rank count, per embedding its name,
                                         optimizer and the rows each rank wrote, and for the dense files
                                         ("dense") each dense layer's parameter shapes (layer order, with
                                         its name and type) and the dense optimizer's type and state count;
                                         its own sha256 covers the rest of it

V is HugeCTR's per-rank pool: floor(workspace_MB * 2^20 / ((1 + K) * 4 * D)) rows, or for slot-sized
tables the largest share of slot_size_array over the ranks. The files are committed atomically and
read back verified by numbactr.files.snapshot (its docstring: the commit protocol, what a kill leaves).

Loading verifies, beyond each file's size and sha256: what the manifest says of the model that wrote
it must fit the model loading it: the dense layers' parameter shapes (not just their total count: the
first layer whose shapes differ is named, with both shapes), the dense and sparse optimizer types, and
each sparse folder's or state file's embedding name (a folder given for another embedding, e.g. a list
in the wrong order, is an error naming both). Manifests written before these were recorded are checked
for what they record. Then everything is parsed and checked on the host (sizes, widths, key
counts against each rank's table, duplicate and reserved keys, slot ids, .ntp.json structure and widths,
optimizer-state layout) and only then assigned, so a failed load leaves the model exactly as it was.
Without a manifest some damage cannot be seen: a changed bit inside a float, key or slot id of the
right file size, or a changed digit in the .ntp.json reads as another valid value; wrong sizes,
truncation, insertion, malformed JSON, duplicate/reserved/out-of-range keys and slots are still errors.

Ranks: keys are placed by their owner on the loading rank count R' (Distributed: key % R'; Localized:
slot % R', from slot_id; OneHot: the slot whose block holds the key), so a save on R ranks reloads
exactly on R'. A Localized key whose slot is not known (files without slot_id) loads on one rank only.
A key used in several slots of a Localized table has a row on every rank holding one of those slots
(HugeCTR's semantics; one-rank tables keep one row, its slot the first seen): such rows reload where
they land on different ranks, and two on one rank are a duplicate-key error. load_sparse_weights keeps
the optimizer state of every key the live table already held (new keys start from the initial state);
load_sparse_optimizer_states gives each key its state: row j of rank r's block belongs to rank r's j-th
key, from the manifest's rows per rank, or for HugeCTR files from the rank counts whose ownership rule
groups the key file by rank in order, provided they all give each key the same row (else a clear error).
"""

from __future__ import annotations

import json
import operator
import os
import re
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from numbactr.runtime import device
from numbactr.data.errors import DataFormatError
from numbactr.distributed.sharding import key_owner
from numbactr.config import max_vocabulary_size_per_gpu, workspace_mb_for

# the transaction's names, used here and (through this module) by embedding_dump, the training cache and tests
from numbactr.files.snapshot import (
    FORMAT as FORMAT,
    _Snapshot,
    _array,
    _commit,
    _fsync_dir as _fsync_dir,
    _manifest_bytes,  # noqa: F401
    _raw,
    _read_manifest as _read_manifest,
    _write_durable as _write_durable,
    on_rank0,
)

UNKNOWN_SLOT = np.uint64(0xFFFFFFFFFFFFFFFF)  # slot_id of a key whose slot is not known
RESERVED_KEY = np.uint64(0xFFFFFFFFFFFFFFFF)  # int64 -1: marks empty hash-table slots


# ---- saving ------------------------------------------------------------------------------------
def save(model, prefix: str, it: int, with_sparse: bool = True) -> None:
    """Write the snapshot of ``model`` (every rank calls this; rank 0 writes, see the module doc); without
    with_sparse only the dense files (the embedding training cache writes the tables elsewhere)."""
    it = _iteration(it)
    comm = model.comm
    d, base = os.path.split(str(prefix))
    sparse = [_gather_embedding(e, comm) for e in model.embeddings] if with_sparse else None  # collectives

    def write():
        outs, records, dense = _snapshot_files(model, base, it, sparse)
        _commit(d or ".", base, it, outs, {"ranks": model.ranks, "embeddings": records, "dense": dense})

    on_rank0(comm, write, f"save_params_to_files({str(prefix)!r}, {it}): rank 0 could not write the snapshot")


def _iteration(it) -> int:
    """``it`` as the int it is (numpy integers too); a float, even 2.0, a bool or a string is refused, as
    HugeCTR's size_t argument refuses them (int() would silently turn 2.5 into 2)."""
    if isinstance(it, (bool, np.bool_)):
        raise TypeError(f"save_params_to_files: iter must be an integer, got {it!r}")
    try:
        value = operator.index(it)
    except TypeError:
        raise TypeError(
            f"save_params_to_files: iter must be an integer (it names the files), got {it!r} ({type(it).__name__})"
        ) from None
    if value < 0:
        raise ValueError(f"save_params_to_files: iter must be >= 0, got {value}")
    return value


def _gather_embedding(e, comm):
    """(rows per rank (R,), keys (n,), vectors (n, D), slots (n,) or None, states [(R*V, D)]) on rank 0
    (None elsewhere), every rank's part in rank order; each rank's state block padded to V rows."""
    keys, vecs = e.dump()
    slots = e.dump_slots()
    block = _block_rows(e, comm.size)
    states = [
        s if s.shape[0] == block else np.concatenate([s, np.zeros((block - s.shape[0], e.vec), np.float32)])
        for s in e.dump_states()
    ]
    g = comm.gather_rows
    return (
        g(np.array([keys.shape[0]], np.int64)),
        g(keys),
        g(vecs),
        None if slots is None else g(slots),
        [g(s) for s in states],
    )


def _block_rows(e, ranks: int) -> int:
    """V: rows of one rank's block in the sparse optimizer-state file, i.e. HugeCTR's per-rank pool size
    (from the workspace, or for slot-sized tables the largest share of slot_size_array over ranks; numbactr's
    evicting tables: max_capacity)."""
    if getattr(e.cfg, "evicting", False):
        return e.max_rows
    sizes = list(e.cfg.slot_size_array) if e.by_slot else []
    if not sizes:
        return max_vocabulary_size_per_gpu(e.cfg.workspace_size_per_gpu_in_mb, e.vec, e.n_states)
    return max(sum(sizes[r::ranks]) for r in range(ranks))


def _snapshot_files(model, base: str, it: int, sparse) -> tuple[list, list, dict]:
    """[(name relative to the snapshot folder, bytes)] in HugeCTR's layouts, one manifest record per
    embedding and the manifest's record of the dense files (on rank 0)."""
    dense = f"{base}_dense_{it}.model"
    opt_dense = f"{base}_opt_dense_{it}.model"
    states = [device.to_host(s) for s in model.dense_optimizer.states]
    outs = [
        (dense, _raw(model.weights, "<f4")),
        (opt_dense, _raw(np.concatenate(states) if states else np.zeros(0), "<f4")),
    ]
    dense_record = {
        "file": dense,
        "layers": _dense_layers(model),
        "opt_file": opt_dense,
        "optimizer": model.dense_optimizer.opt.optimizer_type.name,
        "states": len(states),
    }
    bns = norm_layers(model)
    if bns:
        doc = {"layers": [b.ntp_entry() for b in bns]}
        outs.append((dense + ".ntp.json", json.dumps(doc, indent=2).encode()))
    records = []
    for i, (e, (counts, keys, vecs, slots, blocks)) in enumerate(zip(model.embeddings, sparse or [])):
        folder, opt = f"{base}{i}_sparse_{it}.model", f"{base}{i}_opt_sparse_{it}.model"
        outs += [(folder + "/key", _raw(keys, "<i8")), (folder + "/emb_vector", _raw(vecs, "<f4"))]
        if slots is not None:
            outs.append((folder + "/slot_id", _raw(slots, "<u8")))
        # blocks[k] is (R*V, D), rank-major: the file is state-major, then rank, then row
        outs.append((opt, _raw(np.concatenate(blocks) if blocks else np.zeros(0), "<f4")))
        records.append(
            {
                "name": e.name,
                "folder": folder,
                "opt_file": opt,
                "vec": e.vec,
                "states": len(blocks),
                "optimizer": e.opt.optimizer_type.name,
                "block_rows": _block_rows(e, model.ranks),
                "rows_per_rank": [int(c) for c in counts],
            }
        )
    return outs, records, dense_record


def _dense_layers(model) -> list:
    """The manifest's record of the flat weight vector: per dense layer with parameters, in file order,
    {"name": its (first) top name, "type": its type, "shapes": its parameters' shapes, in order}."""
    return [
        {
            "name": layer.cfg.top_names[0],
            "type": layer.type_name,
            "shapes": [[int(n) for n in shape] for shape in layer.param_shapes()],
        }
        for layer in model.layers
        if layer.param_shapes()
    ]


# ---- dense -------------------------------------------------------------------------------------
def norm_layers(model) -> list:
    """The layers with non-trainable statistics in the .ntp.json (BatchNorm), in layer order."""
    return [layer for layer in model.layers if hasattr(layer, "ntp_entry")]


def load_dense_weights(model, path: str, allow_missing_ntp: bool = False, ntp_path: str | None = None) -> None:
    """The flat weight vector and the BatchNorm running statistics (``ntp_path``, by default
    ``path + ".ntp.json"``, where save() writes them; another path is verified against its own snapshot)."""
    snap = _Snapshot.of(path)
    dense = snap.dense_record(path, "file", "dense model")
    if dense is not None:  # the layers' shapes, not just their total count
        _check_dense_layers(model, dense["layers"], path, snap.path)
    weights = _array(snap.read(path, "dense model"), "<f4", path, "dense model", model.n_params)
    if ntp_path is None:
        stats = _read_ntp(model, path + ".ntp.json", snap, allow_missing_ntp)
    else:
        stats = _read_ntp(model, ntp_path, _Snapshot.of(ntp_path), allow_missing_ntp)
    model.weights[...] = device.xp().asarray(weights)  # everything checked: assign
    for b, (mean, var) in zip(norm_layers(model), stats):
        b.load_ntp_entry({"mean": mean, "var": var})


def _check_dense_layers(model, saved: list, path: str, manifest: str, what: str = "dense model") -> None:
    """The manifest's dense layer shapes (in file order) against the model's: the same value count can
    hold other layers' weights, which would load as nonsense."""
    mine = _dense_layers(model)

    def show(r):
        return f"{r['type']} {r['name']!r} with parameter shapes {[tuple(s) for s in r['shapes']]}"

    for j, (a, b) in enumerate(zip(saved, mine)):
        if a["shapes"] != b["shapes"]:
            raise DataFormatError(
                what,
                path,
                None,
                f"was saved by another model: its manifest {manifest!r} "
                f"records the weights of layer {j} (counting layers with weights) as {show(a)}; "
                f"this model's layer {j} is {show(b)}",
            )
    if len(saved) != len(mine):
        extra, who = (
            (saved[len(mine)], "the snapshot has") if len(saved) > len(mine) else (mine[len(saved)], "this model has")
        )
        raise DataFormatError(
            what,
            path,
            None,
            f"was saved by another model: its manifest {manifest!r} "
            f"records {len(saved)} layers with weights, this model has {len(mine)}; {who} "
            f"layer {min(len(saved), len(mine))}, {show(extra)}, that the other lacks",
        )


def _read_ntp(model, ntp: str, snap: _Snapshot, allow_missing: bool) -> list:
    """[(mean (F,), var (F,))] per BatchNorm layer; [] for a model without BatchNorm, or when the file
    is absent and ``allow_missing`` keeps the model's current statistics."""
    bns = norm_layers(model)
    if not bns:
        return []
    what = "BatchNorm statistics (.ntp.json)"
    if not snap.has(ntp):
        if allow_missing:
            return []
        absent = "does not exist" if snap.body is None else f"is not part of the snapshot of {snap.path!r}"
        raise FileNotFoundError(
            f"{what}: file {ntp!r} {absent}, and the model has {len(bns)} BatchNorm "
            "layer(s) whose running mean/var it holds; pass allow_missing_ntp=True to keep "
            "the model's current running statistics instead"
        )
    try:
        doc = json.loads(snap.read(ntp, what))
    except ValueError as e:
        raise DataFormatError(what, ntp, None, f"is not valid JSON ({e})") from None
    entries = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise DataFormatError(what, ntp, None, 'needs an object {"layers": [...]}, one entry per BatchNorm')
    if len(entries) != len(bns):
        raise DataFormatError(what, ntp, None, f"lists {len(entries)} BatchNorm layers; the model has {len(bns)}")
    out = []
    for j, (b, entry) in enumerate(zip(bns, entries)):
        where = f"layers[{j}] (BatchNorm {b.cfg.top_names[0]!r})"
        if not isinstance(entry, dict) or entry.get("type", "BatchNorm") != "BatchNorm":
            raise DataFormatError(what, ntp, None, f"{where} is not a BatchNorm entry")
        width, pair = b.running_mean.shape[0], []
        for key in ("mean", "var"):
            v = entry.get(key)
            if (
                not isinstance(v, list)
                or len(v) != width
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
            ):
                got = f"{len(v)} values" if isinstance(v, list) else type(v).__name__
                raise DataFormatError(
                    what, ntp, None, f"{where}.{key} must be a list of {width} numbers (the layer's width); got {got}"
                )
            a = np.asarray(v, np.float64)
            if not np.all(np.abs(a) <= np.finfo(np.float32).max):
                raise DataFormatError(what, ntp, None, f"{where}.{key} holds a value that is not a finite float32")
            pair.append(a.astype(np.float32))
        if (pair[1] < 0).any():
            raise DataFormatError(what, ntp, None, f"{where}.var holds a negative variance")
        out.append(tuple(pair))
    return out


def load_dense_optimizer_states(model, path: str) -> None:
    snap = _Snapshot.of(path)
    states = model.dense_optimizer.states
    what = "dense optimizer states"
    dense = snap.dense_record(path, "opt_file", what)
    if dense is not None:
        mine = model.dense_optimizer.opt.optimizer_type.name
        if dense["optimizer"] != mine or dense["states"] != len(states):
            raise DataFormatError(
                what,
                path,
                None,
                f"holds {dense['optimizer']} optimizer states "
                f"({dense['states']} state arrays, manifest {snap.path!r}); this model's dense "
                f"optimizer is {mine} ({len(states)} state arrays)",
            )
        _check_dense_layers(model, dense["layers"], path, snap.path, what)
    data = _array(
        snap.read(path, what),
        "<f4",
        path,
        what,
        model.n_params * len(states),
        f": {len(states)} state arrays of {model.n_params} weights",
    )
    xp = device.xp()
    for k, s in enumerate(states):
        s[...] = xp.asarray(data[k * model.n_params : (k + 1) * model.n_params])


# ---- sparse ------------------------------------------------------------------------------------
def _per_embedding(model, files, what: str) -> list:
    names = [e.name for e in model.embeddings]
    if isinstance(files, (str, bytes, os.PathLike)):
        kind = "optimizer-state files" if "optimizer" in what else "model folders"
        raise TypeError(
            f"{what}: expects a list of sparse {kind}, one per embedding {names} in add order (or a "
            f"dict {{sparse_embedding_name: path}}), got the single path {files!r}; write [{files!r}]"
        )
    if isinstance(files, dict):
        unknown = sorted(set(files) - set(names))
        if unknown:
            raise ValueError(f"{what}: no embedding named {unknown}; embeddings: {names}")
        return [(e, files[e.name], frozenset()) for e in model.embeddings if e.name in files]
    files = list(files)
    if len(files) != len(names):
        raise ValueError(f"{what}: {len(files)} files for {len(names)} embeddings {names}")
    return [(e, f, frozenset(names) - {e.name}) for e, f in zip(model.embeddings, files)]


def _refuse_other_embeddings(what: str, path: str, manifest: str, saved, e, others, holds: str) -> None:
    """A file matched to embedding e by position whose manifest says it was saved from another embedding of
    this same model (``others``: the model's other embeddings' names; empty for a dict, which names its
    target): the list is in the wrong order. A name this model does not have is a renamed embedding, which
    HugeCTR loads by position, so it loads."""
    if saved is not None and saved != e.name and saved in others:
        raise DataFormatError(
            what,
            path,
            None,
            f"{holds} embedding {saved!r} (manifest {manifest!r}), another "
            f"embedding of this model, not of {e.name!r}, the embedding it is being loaded "
            "into: files in the wrong order? (a dict {sparse_embedding_name: path} matches "
            "by name)",
        )


@dataclass
class _SparseModel:
    """One embedding's sparse model folder, parsed and checked."""

    folder: str
    keys: np.ndarray  # (n,) uint64, file order
    vectors: np.ndarray | None  # (n, D) float32 (None: not read)
    slots: np.ndarray | None  # (n,) int64 slot of each key (-1: not known), None without slot_id


def _read_sparse(e, folder: str, with_vectors: bool = True, others=frozenset()) -> _SparseModel:
    snap = _Snapshot.of(folder)
    kpath, vpath, spath = (os.path.join(folder, f) for f in ("key", "emb_vector", "slot_id"))
    what = f"embedding {e.name!r}"
    if others:
        _refuse_other_embeddings(what, folder, snap.path, snap.sparse_name(folder), e, others, "is the sparse model of")
    keys = _array(snap.read(kpath, what + " keys"), "<i8", kpath, what + " keys").astype(np.uint64)
    n = keys.shape[0]
    vectors = None
    if with_vectors:
        vectors = _array(
            snap.read(vpath, what + " vectors"),
            "<f4",
            vpath,
            what + " vectors",
            n * e.vec,
            f": {n} keys in {kpath!r} x embedding_vec_size {e.vec}",
        ).reshape(n, e.vec)
    slots = None
    if snap.has(spath):
        raw = _array(
            snap.read(spath, what + " slot ids"), "<u8", spath, what + " slot ids", n, f": one per key in {kpath!r}"
        )
        bad = np.nonzero((raw >= e.slots) & (raw != UNKNOWN_SLOT))[0]
        if bad.size:
            i = int(bad[0])
            raise DataFormatError(
                what + " slot ids",
                spath,
                8 * i,
                f"slot_id[{i}] = {int(raw[i])} (key {int(keys[i])}) is outside the embedding's {e.slots} slots",
            )
        slots = np.where(raw == UNKNOWN_SLOT, -1, raw.astype(np.int64))
    if e.table is None:  # OneHot: the key is the row, its slot follows from it
        out = np.nonzero(keys >= np.uint64(e.max_rows))[0]
        if out.size:
            i = int(out[0])
            raise DataFormatError(
                what + " keys",
                kpath,
                8 * i,
                f"key {keys.view(np.int64)[i]} at position {i} is "
                f"outside the one-hot table [0, {e.max_rows}) that slot_size_array gives",
            )
        implied = e.slot_of_keys(keys)
        wrong = np.nonzero((slots != implied) & (slots >= 0))[0] if slots is not None else []
        if len(wrong):
            i = int(wrong[0])
            raise DataFormatError(
                what + " slot ids",
                spath,
                8 * i,
                f"slot_id[{i}] = {slots[i]} but slot_size_array puts key {int(keys[i])} in slot {implied[i]}",
            )
        slots = implied
    else:
        reserved = np.nonzero(keys == RESERVED_KEY)[0]
        if reserved.size:
            i = int(reserved[0])
            raise DataFormatError(
                what + " keys", kpath, 8 * i, f"key -1 at position {i} is reserved (it marks empty hash-table slots)"
            )
    return _SparseModel(folder, keys, vectors, slots)


def read_sparse_model(folder: str, name: str, vec: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys (n,) uint64, vectors (n, D) float32) of a sparse model folder without a model to load it into
    (the inference parameter server), with load_sparse_weights' checks: manifest, sizes, reserved key."""
    table = SimpleNamespace(name=name, vec=int(vec), slots=2**63, table=True)  # any slot id is known
    sm = _read_sparse(table, folder)  # an inference graph may name its tables otherwise
    return sm.keys, sm.vectors


def _owners(e, sm: _SparseModel, ranks: int) -> np.ndarray:
    """(n,) rank of ``ranks`` that holds each key of the file: key % R, or slot % R for Localized/OneHot."""
    if ranks == 1:
        return np.zeros(sm.keys.shape[0], np.int64)
    if e.by_slot and (sm.slots is None or (sm.slots < 0).any()):
        i = 0 if sm.slots is None else int(np.argmax(sm.slots < 0))
        raise DataFormatError(
            f"embedding {e.name!r} keys",
            os.path.join(sm.folder, "key"),
            8 * i,
            f"a LocalizedSlot key goes to rank slot % {ranks}, and this snapshot does not "
            f"record the slot of key {int(sm.keys[i])} (no slot_id, or slot unknown); it can "
            "be loaded on one rank only",
        )
    return key_owner(sm.keys, sm.slots, ranks, e.by_slot)


def _check_placement(e, sm: _SparseModel, owner: np.ndarray, ranks: int) -> None:
    """No key twice on one rank, no rank over its table's capacity: checked for every rank on every rank,
    so all ranks reach the same verdict."""
    kpath = os.path.join(sm.folder, "key")
    what = f"embedding {e.name!r} keys"
    order = np.lexsort((sm.keys, owner))
    ks, own = sm.keys[order], owner[order]  # sorted by rank, then key
    dup = np.nonzero((ks[1:] == ks[:-1]) & (own[1:] == own[:-1]))[0]
    if dup.size:
        i, j = sorted((int(order[dup[0]]), int(order[dup[0] + 1])))
        where = (
            f" (slots {sm.slots[i]} and {sm.slots[j]}, both on rank {owner[i]} of {ranks})"
            if e.by_slot and ranks > 1
            else ""
        )
        raise DataFormatError(what, kpath, 8 * j, f"key {int(sm.keys[i])} appears at positions {i} and {j}{where}")
    if e.table is not None:
        counts = np.bincount(owner, minlength=ranks)
        r = int(np.argmax(counts))
        if counts[r] > e.max_rows:
            on = f" of them belong to rank {r} of {ranks}, whose" if ranks > 1 else ", and the"
            raise DataFormatError(
                what,
                kpath,
                None,
                f"holds {sm.keys.shape[0]} keys{on} table holds "
                f"{e.max_rows} rows (workspace_size_per_gpu_in_mb="
                f"{e.cfg.workspace_size_per_gpu_in_mb}); set it to at least "
                f"{workspace_mb_for(int(counts[r]), e.vec, e.n_states)}",
            )


def load_sparse_weights(model, files) -> None:
    """Each embedding's table becomes the keys (and vectors, slots) its rank owns, in file order."""
    todo = []
    for e, folder, others in _per_embedding(model, files, "load_sparse_weights"):
        sm = _read_sparse(e, folder, others=others)
        owner = _owners(e, sm, model.ranks)
        _check_placement(e, sm, owner, model.ranks)
        mine = owner == model.comm.rank
        todo.append((e, sm.keys[mine], sm.vectors[mine], None if sm.slots is None else sm.slots[mine]))
    for e, keys, vectors, slots in todo:  # everything checked: assign
        e.load(keys, vectors, slots)


def load_sparse_optimizer_states(model, files) -> None:
    """Each key's states go to the row that holds the key now (load the sparse weights first)."""
    todo = [
        (e, *_read_sparse_states(model, e, path, others))
        for e, path, others in _per_embedding(model, files, "load_sparse_optimizer_states")
    ]
    xp = device.xp()
    for e, rows, states in todo:  # everything checked: assign
        r = xp.asarray(rows)
        for s, v in zip(e.states, states):
            if device.is_host_array(s):  # a tiered table's states live in its host backing tier, also on a GPU
                s[rows] = v
            else:
                s[r] = xp.asarray(v)


def _read_sparse_states(model, e, path: str, others=frozenset()) -> tuple[np.ndarray, np.ndarray]:
    """(rows (m,) of this rank's table, states (K, m, D)) for the keys of the matching sparse model."""
    what = f"embedding {e.name!r} optimizer states"
    snap = _Snapshot.of(path)
    data = snap.read(path, what)
    n_states, width = len(e.states), e.vec
    if n_states == 0:
        _array(data, "<f4", path, what, 0, f": {e.opt.optimizer_type.name} keeps no state")
        return np.zeros(0, np.int64), np.zeros((0, 0, width), np.float32)
    rec = snap.record(path)
    if rec:
        _refuse_other_embeddings(what, path, snap.path, rec.get("name"), e, others, "holds the optimizer states of")
        kind = rec.get("optimizer")
        if kind is not None and kind != e.opt.optimizer_type.name:
            raise DataFormatError(
                what,
                path,
                None,
                f"holds {kind} optimizer states (manifest "
                f"{snap.path!r}); embedding {e.name!r} is trained with "
                f"{e.opt.optimizer_type.name}",
            )
    folder = os.path.join(snap.dir, rec["folder"]) if rec else _sibling_folder(path)
    if folder is None or not (rec or os.path.isdir(folder)):  # (a manifest's folder may still be staged)
        raise FileNotFoundError(
            f"{what}: the rows of {path!r} belong to the keys of its sparse model folder "
            f"({folder!r}, HugeCTR's name {{prefix}}{{i}}_sparse_{{iter}}.model beside it), "
            "which is needed to give every key its state and does not exist"
        )
    sm = _read_sparse(e, folder, with_vectors=False)  # the keys (and slots) say whose each row is
    n = sm.keys.shape[0]
    if rec:
        ranks, block, counts = snap.body["ranks"], rec["block_rows"], rec["rows_per_rank"]
        if rec["states"] != n_states or rec["vec"] != width:
            raise DataFormatError(
                what,
                path,
                None,
                f"was saved with {rec['states']} state arrays of width "
                f"{rec['vec']}; this embedding's optimizer keeps {n_states} of width {width}",
            )
        if sum(counts) != n or max(counts, default=0) > block:
            raise DataFormatError(
                what,
                path,
                None,
                f"its manifest {snap.path!r} gives {counts} rows per rank "
                f"(at most {block}) for the {n} keys of {folder!r}",
            )
        saved = np.repeat(np.arange(ranks), counts)
    else:
        ranks, block, saved = _infer_layout(e, sm, len(data), n_states, path)
    blocks = _array(
        data,
        "<f4",
        path,
        what,
        n_states * ranks * block * width,
        f": {n_states} states x {ranks} rank(s) x {block} rows x {width}",
    ).reshape(n_states, ranks, block, width)
    starts = np.concatenate([[0], np.cumsum(np.bincount(saved, minlength=ranks))[:-1]])
    per_key = blocks[:, saved, np.arange(n) - starts[saved]]  # (K, n, D)
    owner = _owners(e, sm, model.ranks)
    _check_placement(e, sm, owner, model.ranks)
    mine = np.nonzero(owner == model.comm.rank)[0]
    rows = e.rows_of(sm.keys[mine])
    missing = np.nonzero(rows < 0)[0]
    where = f" on rank {model.comm.rank}" if model.ranks > 1 else ""
    if missing.size:
        i = int(mine[missing[0]])
        raise DataFormatError(
            what,
            path,
            None,
            f"key {int(sm.keys[i])} (position {i} of {folder!r}) is not in "
            f"the model's table{where}: load the sparse weights of this snapshot first, the "
            "states follow the keys",
        )
    if e.table is not None and e.table.size != mine.size:
        raise DataFormatError(
            what,
            path,
            None,
            f"the model's table{where} holds {e.table.size} keys, but "
            f"{folder!r} gives it {mine.size}: load the sparse weights of this snapshot first",
        )
    return rows, per_key[:, mine]


def _sibling_folder(opt_path: str) -> str | None:
    """HugeCTR's sparse model folder beside ``{prefix}{i}_opt_sparse_{iter}.model``."""
    folder, name = os.path.split(opt_path)
    m = re.fullmatch(r"(.*)_opt_sparse_(\d+)\.model", name)
    return os.path.join(folder, f"{m.group(1)}_sparse_{m.group(2)}.model") if m else None


def _infer_layout(e, sm: _SparseModel, nbytes: int, n_states: int, path: str):
    """(ranks R, rows per block V, saving rank of each key) of a state file without a manifest: the one
    rank count whose blocks fill the file and whose ownership rule groups the keys by rank in order."""
    what = f"embedding {e.name!r} optimizer states"
    unit = 4 * n_states * e.vec
    if nbytes % unit:
        raise DataFormatError(
            what, path, None, f"{nbytes} bytes is not a whole number of rows of {n_states} states x {e.vec} float32"
        )
    rows = nbytes // unit
    sizes = list(e.cfg.slot_size_array) if e.by_slot else []
    tried = range(1, len(sizes) + 1) if sizes else []
    cands = [r for r in tried if r * _block_rows(e, r) == rows]
    widest = max(sizes) if sizes else _block_rows(e, 1)  # V once every rank holds at most one slot
    if rows % widest == 0 and rows // widest > len(sizes):
        cands.append(rows // widest)
    fits, why = [], []
    for ranks in cands:
        block = _block_rows(e, ranks)
        try:
            owner = _owners(e, sm, ranks)
        except DataFormatError as err:
            why.append(f"{ranks} ranks: {err.detail}")
            continue
        counts = np.bincount(owner, minlength=ranks)
        if (np.diff(owner) >= 0).all() and counts.max(initial=0) <= block:
            fits.append((ranks, block, owner))
        else:
            why.append(f"{ranks} ranks: the keys are not grouped by their rank in order")
    # several rank counts may fit; fine as long as they give every key the same row of the file
    flat = [block * owner + np.arange(owner.shape[0]) - np.searchsorted(owner, owner) for _, block, owner in fits]
    if fits and all(np.array_equal(f, flat[0]) for f in flat):
        return fits[0]
    if fits:
        raise DataFormatError(
            what,
            path,
            None,
            f"could come from {[f[0] for f in fits]} ranks alike, which put the "
            "keys' states in different rows (no manifest records which); its rows cannot be "
            "matched to keys unambiguously",
        )
    raise DataFormatError(
        what,
        path,
        None,
        f"{nbytes} bytes match no rank count of this embedding's layout "
        f"({n_states} states x R ranks x per-rank rows x {e.vec}; tried {cands}"
        + (f": {'; '.join(why)}" if why else "")
        + ")",
    )


def sparse_models_beside(graph_config: str, dense_model: str, who: str) -> list[str]:
    """HugeCTR's sparse model folders of the snapshot ``dense_model`` belongs to, one per embedding layer
    of ``graph_config`` (export-onnx and predict read them when none are given). who: the caller, for errors."""
    from numbactr.enums import Embedding_t

    m = re.fullmatch(r"(.*)_dense_(\d+)\.model", os.path.basename(dense_model))
    if m is None:
        raise ValueError(
            f"{who}: {dense_model!r} is not named <prefix>_dense_<iter>.model, so its sparse "
            "models cannot be found: give them on the command line"
        )
    try:
        with open(graph_config, "rb") as f:
            layers = json.loads(f.read().decode("utf-8"))["layers"]
        count = sum(1 for d in layers if isinstance(d, dict) and d.get("type") in Embedding_t.__members__)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{who}: graph JSON {graph_config!r} cannot be read ({e})") from None
    folder = os.path.dirname(dense_model)
    return [os.path.join(folder, f"{m.group(1)}{i}_sparse_{m.group(2)}.model") for i in range(count)]
