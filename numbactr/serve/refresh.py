"""Live embedding refresh: a served model's embedding rows replaced from a newer training snapshot or an
incremental dump, between two batches, without a version reload and without dropping a request.

What HugeCTR does: the HPS takes new rows from its update source (a Kafka stream of the training job's
incremental dumps) into the database tiers, and ``refresh_embedding_cache`` reads the cached vectors
again. Triton has no route for it. numbactr has no Kafka; the same update arrives over HTTP::

    POST /v2/repository/models/{m}/refresh   {"dump": "PATH.npz"}
    POST /v2/repository/models/{m}/refresh   {"sparse_files": ["FOLDER", ...]}

``dump``: an incremental dump, one ``.npz`` (numpy.savez, written by write_dump) holding per table of
the model ``<table>.keys`` (n,) integers, ``<table>.values`` (n, D) float32 and optionally
``<table>.evicted`` (e,) integers, where ``<table>`` is the table's name in the parameter server (the
network JSON's sparse embedding name, e.g. ``sparse_embedding1``) and the three arrays are what
``SparseEmbedding.incremental_dump()`` returns (SOK's ``incremental_model_dump`` gives keys and values).
Tables the file does not name are unchanged.

``sparse_files``: a newer snapshot's sparse model folders (``<prefix><t>_sparse_<iter>.model``), one per
table in the model's order, as the HPS JSON's ``sparse_files``: every key of each folder takes its row.
A key that the new snapshot no longer holds keeps its old row (a snapshot does not say which keys left;
an incremental dump's ``evicted`` does).

The route is there when the repository is under model control (``--model-control-mode poll`` or
``explicit``), as the load route is. Paths are relative to the model's folder ``<repo>/<m>/`` (absolute ones are taken as given) and must
lie inside the model repository: the route reads no other file of the server's machine.

Every file is read and checked first (tables known, widths equal to the table's
embedding_vec_size, keys integers, no key both updated and evicted, the files whole); a refresh that
fails a check answers 400 naming the file and the fault, writes an ``embeddings_refresh_failed`` log
line and changes nothing. A checked refresh is applied by ``ParameterServer.update``
(numbactr.inference.hps_update: rows into every database tier and the embedding cache, evicted keys
erased) on the compute thread (numbactr.serve.batcher), so it lands between two batches: a request
runs wholly on the old rows or wholly on the new ones. It refreshes the version being served; a version
loaded later starts from its own files again.
"""

from __future__ import annotations

import json
import os
import zipfile

import numpy as np

from numbactr.files.checkpoint import read_sparse_model
from numbactr.serve.protocol import RequestError

__all__ = ["RefreshError", "Update", "read_request", "apply", "write_dump"]

#: the arrays a dump holds per table (evicted is optional)
MEMBERS = ("keys", "values", "evicted")


class RefreshError(RequestError):
    """A refresh that cannot be applied (HTTP 400): the message names the file and the fault."""


class Update:
    """One table's checked rows: (table index t, its name, keys (n,) uint64, values (n, D) float32,
    evicted (e,) uint64)."""

    __slots__ = ("t", "table", "keys", "values", "evicted")

    def __init__(self, t, table, keys, values, evicted):
        self.t, self.table, self.keys, self.values, self.evicted = t, table, keys, values, evicted


def write_dump(path: str, tables: dict) -> None:
    """Write an incremental dump (module docstring): tables maps a table's name to (keys, values[,
    evicted]), e.g. ``{"sparse_embedding1": emb.incremental_dump()}``."""
    arrays = {}
    for name, parts in tables.items():
        for member, a in zip(MEMBERS, parts):
            arrays[f"{name}.{member}"] = np.asarray(a)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _inside(repo: str, mdir: str, given, what: str) -> str:
    if not isinstance(given, str) or not given:
        raise RefreshError(f"refresh: {what} must be a path (a non-empty string), got {given!r}")
    path = os.path.realpath(os.path.join(mdir, given))
    root = os.path.realpath(repo)
    if os.path.commonpath([path, root]) != root:
        raise RefreshError(f"refresh: {what} {given!r} is outside the model repository {repo!r}")
    if not os.path.exists(path):
        raise RefreshError(f"refresh: {what} {given!r}: no such file or folder (looked at {path})")
    return path


def _ints(a: np.ndarray, where: str) -> np.ndarray:
    if a.dtype.kind not in "iu" or a.ndim != 1:
        raise RefreshError(f"refresh: {where} must be a 1-D integer array, got {a.dtype} {list(a.shape)}")
    if a.dtype.kind == "i" and a.size and a.min() < 0:
        raise RefreshError(f"refresh: {where} holds a negative key {int(a.min())}")
    return a.astype(np.uint64)


def _checked(t, table, width, keys, values, evicted, where) -> Update:
    keys, evicted = _ints(keys, f"{where} keys"), _ints(evicted, f"{where} evicted")
    if values.dtype.kind != "f" or values.shape != (keys.shape[0], width):
        raise RefreshError(
            f"refresh: {where} values are {values.dtype} {list(values.shape)}; table {table!r} needs float "
            f"({keys.shape[0]}, {width}): one row of embedding_vec_size {width} per key"
        )
    values = np.ascontiguousarray(values, np.float32)
    if not np.isfinite(values).all():
        raise RefreshError(f"refresh: {where} values hold a non-finite number")
    both = np.intersect1d(keys, evicted)
    if both.size:
        raise RefreshError(f"refresh: {where}: key {int(both[0])} is both updated and evicted")
    return Update(t, table, keys, values, evicted)


def _read_dump(path: str, given: str, names: list, widths: list) -> list:
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise RefreshError(f"refresh: dump {given!r} is not a whole .npz file: {type(e).__name__}: {e}") from None
    tables = {}
    for key in arrays:
        table, _, member = key.rpartition(".")
        if member not in MEMBERS or not table:
            raise RefreshError(
                f"refresh: dump {given!r}: array {key!r} is not <table>.keys, <table>.values or <table>.evicted"
            )
        if table not in names:
            raise RefreshError(f"refresh: dump {given!r}: unknown table {table!r} (the model's tables: {names})")
        tables.setdefault(table, {})[member] = arrays[key]
    if not tables:
        raise RefreshError(f"refresh: dump {given!r} holds no table")
    out = []
    for table, got in tables.items():
        for member in ("keys", "values"):
            if member not in got:
                raise RefreshError(f"refresh: dump {given!r}: table {table!r} has no {table}.{member}")
        t = names.index(table)
        evicted = got.get("evicted", np.zeros(0, np.uint64))
        out.append(_checked(t, table, widths[t], got["keys"], got["values"], evicted, f"dump {given!r} {table}"))
    return out


def _read_snapshot(paths: list, given: list, names: list, widths: list) -> list:
    out = []
    for t, (path, g) in enumerate(zip(paths, given)):
        try:
            keys, values = read_sparse_model(path, names[t], widths[t])
        except (OSError, ValueError) as e:
            raise RefreshError(f"refresh: sparse_files[{t}] {g!r} (table {names[t]!r}): {e}") from None
        out.append(_checked(t, names[t], widths[t], keys, values, np.zeros(0, np.uint64), f"sparse_files[{t}] {g!r}"))
    return out


def read_request(body: bytes, repo: str, model: str, names: list, widths: list) -> list:
    """The checked Updates a refresh request asks for (module docstring); RefreshError when it is bad."""
    try:
        doc = json.loads(body or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise RefreshError(f"refresh: the body is not JSON: {e}") from None
    if not isinstance(doc, dict) or len(doc) != 1 or next(iter(doc)) not in ("dump", "sparse_files"):
        raise RefreshError('refresh: the body must be {"dump": "PATH.npz"} or {"sparse_files": ["FOLDER", ...]}')
    mdir = os.path.join(repo, model)
    if "dump" in doc:
        return _read_dump(_inside(repo, mdir, doc["dump"], "dump"), doc["dump"], names, widths)
    given = doc["sparse_files"]
    if not isinstance(given, list) or len(given) != len(names):
        raise RefreshError(
            f"refresh: sparse_files must list {len(names)} folders, one per table {names}, got {given!r}"
        )
    paths = [_inside(repo, mdir, g, f"sparse_files[{t}]") for t, g in enumerate(given)]
    return _read_snapshot(paths, given, names, widths)


def apply(session, updates: list) -> dict:
    """Apply checked updates to the session's parameter server (on the compute thread); {table: {"updated":
    n, "evicted": e}}."""
    name, volatile = session.params.model_name, session.ps.volatile
    strict = hasattr(volatile, "strict")  # a guarded tier (numbactr.serve.tiers): a failed write is an error
    if strict:
        volatile.strict = True
    try:
        for u in updates:
            session.ps.update(name, u.t, u.keys, u.values, u.evicted)
        if strict:
            volatile.recount()  # the rows it must hold when it comes back from a failure
    finally:
        if strict:
            volatile.strict = False
    return {u.table: {"updated": int(u.keys.size), "evicted": int(u.evicted.size)} for u in updates}
