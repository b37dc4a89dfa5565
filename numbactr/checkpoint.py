"""Model files in HugeCTR's layouts (spec §7.1-§7.3).

    {prefix}_dense_{iter}.model            float32 weights, layer order (the flat weight vector)
    {prefix}_opt_dense_{iter}.model        dense optimizer states, each P floats, HugeCTR's order
    {prefix}_dense_{iter}.model.ntp.json   BatchNorm running mean/var (only with BatchNorm layers)
    {prefix}{i}_sparse_{iter}.model/       folder per embedding i: `key` (int64) + `emb_vector` (float32 x D),
                                           keys in row (insertion) order, ranks concatenated
    {prefix}{i}_opt_sparse_{iter}.model    sparse optimizer states, full [max_rows, D] buffer per state
                                           indexed by row, ranks concatenated
With several ranks, rank 0 writes everything; loading re-inserts every key on its owner in file order.
"""
from __future__ import annotations

import json
import os

import numpy as np

from . import device
from .distributed.sharding import key_owner


def _host(a) -> np.ndarray:
    return np.ascontiguousarray(device.to_host(a))


def _read(path: str, dtype: str, what: str, count: int | None = None, multiple: int = 1) -> np.ndarray:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what}: file {path!r} does not exist")
    size = os.path.getsize(path)
    item = np.dtype(dtype).itemsize
    if count is not None and size != item * count:
        raise ValueError(f"{what} file {path!r} holds {size} bytes; this model needs exactly {item * count} "
                         f"({count} {np.dtype(dtype).name} values)")
    if size % (item * multiple):
        raise ValueError(f"{what} file {path!r}: {size} bytes is not a whole number of "
                         f"{multiple}-value {np.dtype(dtype).name} records")
    return np.fromfile(path, dtype=dtype)


def norm_layers(model) -> list:
    return [layer for layer in model.layers if hasattr(layer, "running_mean")]


def save(model, prefix: str, it: int) -> None:
    comm = model.comm
    sparse = []
    for e in model.embeddings:                      # collectives: every rank takes part
        keys, vecs = e.dump()
        states = [_host(s) for s in e.optimizer.states]
        keys, vecs = comm.allgather_rows(keys), comm.allgather_rows(vecs)
        states = [comm.allgather_rows(s) for s in states]
        sparse.append((keys, vecs, states))
    if comm.rank != 0:
        return
    _host(model.weights).astype("<f4").tofile(f"{prefix}_dense_{it}.model")
    states = [_host(s) for s in model.dense_optimizer.states]
    (np.concatenate(states) if states else np.zeros(0, np.float32)).astype("<f4").tofile(
        f"{prefix}_opt_dense_{it}.model")
    bns = norm_layers(model)
    if bns:
        with open(f"{prefix}_dense_{it}.model.ntp.json", "w") as f:
            json.dump({"layers": [{"type": "BatchNorm", "mean": [float(x) for x in _host(b.running_mean)],
                                   "var": [float(x) for x in _host(b.running_var)]} for b in bns]}, f, indent=2)
    for i, (keys, vecs, states) in enumerate(sparse):
        folder = f"{prefix}{i}_sparse_{it}.model"
        os.makedirs(folder, exist_ok=True)
        keys.astype("<i8").tofile(os.path.join(folder, "key"))
        vecs.astype("<f4").tofile(os.path.join(folder, "emb_vector"))
        (np.concatenate([s.reshape(-1) for s in states]) if states else np.zeros(0, np.float32)).astype(
            "<f4").tofile(f"{prefix}{i}_opt_sparse_{it}.model")


def load_dense_weights(model, path: str) -> None:
    model.weights[...] = device.xp().asarray(_read(path, "<f4", "dense model", model.n_params))
    ntp = path + ".ntp.json"
    bns = norm_layers(model)
    if bns and os.path.exists(ntp):
        with open(ntp) as f:
            entries = json.load(f).get("layers", [])
        if len(entries) != len(bns):
            raise ValueError(f"{ntp!r} lists {len(entries)} BatchNorm layers; the model has {len(bns)}")
        xp = device.xp()
        for b, d in zip(bns, entries):
            b.running_mean[...] = xp.asarray(np.asarray(d["mean"], np.float32))
            b.running_var[...] = xp.asarray(np.asarray(d["var"], np.float32))


def load_dense_optimizer_states(model, path: str) -> None:
    states = model.dense_optimizer.states
    data = _read(path, "<f4", "dense optimizer states", model.n_params * len(states))
    xp = device.xp()
    for k, s in enumerate(states):
        s[...] = xp.asarray(data[k * model.n_params:(k + 1) * model.n_params])


def _per_embedding(model, files, what: str) -> list:
    names = [e.name for e in model.embeddings]
    if isinstance(files, dict):
        unknown = sorted(set(files) - set(names))
        if unknown:
            raise ValueError(f"{what}: no embedding named {unknown}; embeddings: {names}")
        return [(e, files[e.name]) for e in model.embeddings if e.name in files]
    files = list(files)
    if len(files) != len(names):
        raise ValueError(f"{what}: {len(files)} files for {len(names)} embeddings {names}")
    return list(zip(model.embeddings, files))


def load_sparse_weights(model, files) -> None:
    for e, folder in _per_embedding(model, files, "load_sparse_weights"):
        keys = _read(os.path.join(folder, "key"), "<i8", f"embedding {e.name!r} keys")
        vecs = _read(os.path.join(folder, "emb_vector"), "<f4", f"embedding {e.name!r} vectors", keys.size * e.vec)
        e.load(keys.astype(np.uint64), vecs.reshape(keys.size, e.vec))


def load_sparse_optimizer_states(model, files) -> None:
    for e, path in _per_embedding(model, files, "load_sparse_optimizer_states"):
        states = e.optimizer.states
        per = e.max_rows * e.vec
        data = _read(path, "<f4", f"embedding {e.name!r} optimizer states", per * len(states) * model.ranks)
        xp = device.xp()
        blocks = data.reshape(len(states), model.ranks, e.max_rows, e.vec) if states else data
        for k, s in enumerate(states):       # states were written rank-concatenated per state
            s[...] = xp.asarray(blocks[k, model.comm.rank])


def owned(keys: np.ndarray, e, ranks: int) -> np.ndarray:
    """Mask of the keys this rank owns (Localized needs slots, which the files do not carry: keys then
    go by key % R, as for Distributed)."""
    return key_owner(keys, np.zeros_like(keys, dtype=np.int64), ranks, by_slot=False) == e.comm.rank
