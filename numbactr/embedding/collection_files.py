"""EmbeddingCollection's embedding_dump / embedding_load: HugeCTR's file layout, committed atomically.

Layout (HugeCTR v23.08 embedding_storage/weight_io), per collection c (its place among the model's
collections) in ``path/embedding_collection_<c>/``:
    meta_data     int32 [table count, key type (0 uint32, 1 int64: the solver's i64_input_key), value type
                  0 (float32), 0, 0], then the int32 table ids, uint64 key counts, int32 ev_sizes
    key<j>        128-byte head (int32 1, table id j, zeros), the keys ascending
    weight<j>     128-byte head (int32 2, table id j, zeros), the float32 vectors in the keys' order
j is the table's place in its collection (the order of first lookup). The files go through
numbactr.files.checkpoint's atomic commit (staged, fsync'd, manifest ``path/embedding_collection_0.manifest.json``
with each file's size and sha256, which HugeCTR ignores). load checks every file (against the manifest when
there is one, and against meta_data) before it changes any table, and still reads numbactr's earlier layout
(``path/<table name>/key`` and ``emb_vector``). Optimizer states are not dumped (nor are they by HugeCTR
v23.08). Why HugeCTR's layout: dumps then move between HugeCTR and numbactr (as HugeCTR's source reads them;
no HugeCTR ran here).
"""

from __future__ import annotations

import os

import numpy as np

from numbactr.data.errors import DataFormatError
from numbactr.embedding.collection_config import CollectionError
from numbactr.files import snapshot

DUMP_BASE = "embedding_collection"  # the manifest's name in a dump folder: {DUMP_BASE}_0.manifest.json
# HugeCTR's layout (v23.08, embedding_storage/weight_io/parameter_IO.cpp and data_info.hpp)
FILE_HEAD_BYTES = 128  # FileHeadNbytes: int32 file type (1 key, 2 weight), int32 table id, 0s
META_HEAD_INTS = 5  # MetaDataHeadLength / 4: n tables, key type, value type, 0, 0
KEY_TYPES = {0: "<u4", 1: "<i8"}  # meta_data's key type: uint32 (i64_input_key=False) or int64
FILE_KEY, FILE_WEIGHT = 1, 2


def _selected(collections, table_names, what: str) -> list:
    """[(collection index, table index, _Table)] named by table_names ([] = all), in the model's order. The
    indices are HugeCTR's: a collection's place among the model's collections, a table's place in its
    collection (the order of the tables' first embedding_lookup)."""
    everything = [(c, j, t) for c, coll in enumerate(collections) for j, t in enumerate(coll.tables)]
    if not everything:
        raise CollectionError(f"{what}: the model has no EmbeddingCollection")
    names = list(table_names or [])
    known = {t.name for _, _, t in everything}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise CollectionError(f"{what}: no table named {unknown} in the model; tables: {sorted(known)}")
    return [(c, j, t) for c, j, t in everything if not names or t.name in names]


def _file_head(kind: int, table_id: int) -> np.ndarray:
    head = np.zeros(FILE_HEAD_BYTES // 4, "<i4")
    head[0], head[1] = kind, table_id
    return head.view(np.uint8)


def meta_data_bytes(table_ids, key_counts, ev_sizes, key_type: int) -> np.ndarray:
    """HugeCTR's meta_data file: int32 [n, key type, value type 0 (float32), 0, 0], the n table ids (int32,
    ascending), their key counts (uint64) and embedding vector sizes (int32), little-endian, unpadded."""
    n = len(table_ids)
    head = np.array([n, key_type, 0, 0, 0], "<i4")
    return np.concatenate(
        [
            head.view(np.uint8),
            np.asarray(table_ids, "<i4").view(np.uint8),
            np.asarray(key_counts, "<u8").view(np.uint8),
            np.asarray(ev_sizes, "<i4").view(np.uint8),
        ]
    )


def parse_meta_data(data: bytes, path: str) -> dict:
    """{"key_type": 0|1, "tables": {table id: (key count, ev size)}} of a meta_data file, checked."""
    what = "embedding_dump meta_data"
    if len(data) < 4 * META_HEAD_INTS:
        raise DataFormatError(what, path, None, f"holds {len(data)} bytes; its head alone is {4 * META_HEAD_INTS}")
    head = np.frombuffer(data, "<i4", META_HEAD_INTS)
    n, key_type, value_type = (int(v) for v in head[:3])
    want = 4 * META_HEAD_INTS + n * (4 + 8 + 4)
    if n < 0 or len(data) != want:
        raise DataFormatError(
            what, path, 0, f"says {n} tables, which take {max(want, 0)} bytes; the file holds {len(data)}"
        )
    if key_type not in KEY_TYPES:
        raise DataFormatError(what, path, 4, f"key type {key_type} is neither 0 (uint32) nor 1 (int64)")
    if value_type != 0:
        raise DataFormatError(
            what, path, 8, f"value type {value_type}: only 0 (float32 vectors) is read; 1 (float16) is not supported"
        )
    at = 4 * META_HEAD_INTS
    ids = np.frombuffer(data, "<i4", n, at)
    counts = np.frombuffer(data, "<u8", n, at + 4 * n)
    sizes = np.frombuffer(data, "<i4", n, at + 12 * n)
    if np.unique(ids).size != n or (ids < 0).any() or (sizes <= 0).any():
        raise DataFormatError(
            what, path, at, f"table ids {ids.tolist()} must be distinct and >= 0 and ev sizes {sizes.tolist()} positive"
        )
    return {"key_type": key_type, "tables": {int(i): (int(k), int(d)) for i, k, d in zip(ids, counts, sizes)}}


def dump(collections, comm, path: str, table_names=(), i64_keys: bool = True) -> None:
    """``Model.embedding_dump``: every rank calls it; rank 0 writes (module docstring: layout, atomicity)."""
    chosen = _selected(collections, table_names, "embedding_dump")
    parts = []
    for c, j, t in chosen:  # collectives, every rank in the same order
        keys, vecs = t.local_rows()
        parts.append((c, j, t, comm.gather_rows(keys), comm.gather_rows(np.ascontiguousarray(vecs, np.float32))))

    def write():
        outs, tables = [], []
        for c in sorted({c for c, *_ in parts}):
            mine = [(j, t, keys, vecs) for cc, j, t, keys, vecs in parts if cc == c]
            # HugeCTR's key type is the solver's; keys that do not fit uint32 are written as int64 anyway
            wide = i64_keys or any(k.size and (k.min() < 0 or k.max() > 0xFFFFFFFF) for _, _, k, _ in mine)
            key_type = 1 if wide else 0
            folder = f"{DUMP_BASE}_{c}"
            outs.append(
                (
                    f"{folder}/meta_data",
                    meta_data_bytes(
                        [j for j, *_ in mine], [k.size for _, _, k, _ in mine], [t.dim for _, t, _, _ in mine], key_type
                    ),
                )
            )
            for j, t, keys, vecs in mine:
                order = np.argsort(keys, kind="stable")
                outs += [
                    (
                        f"{folder}/key{j}",
                        np.concatenate([_file_head(FILE_KEY, j), snapshot._raw(keys[order], KEY_TYPES[key_type])]),
                    ),
                    (
                        f"{folder}/weight{j}",
                        np.concatenate([_file_head(FILE_WEIGHT, j), snapshot._raw(vecs[order], "<f4")]),
                    ),
                ]
                tables.append(
                    {
                        "name": t.name,
                        "collection": c,
                        "table_id": j,
                        "ev_size": t.dim,
                        "max_vocabulary_size": t.cfg.max_vocabulary_size,
                        "keys": int(keys.shape[0]),
                    }
                )
        os.makedirs(path, exist_ok=True)
        snapshot._commit(path, DUMP_BASE, 0, outs, {"ranks": comm.size, "embeddings": [], "tables": tables})

    snapshot.on_rank0(comm, write, f"embedding_dump({path!r}): rank 0 could not write the tables")


def _read_hugectr_table(snap, path: str, c: int, j: int, t, metas: dict):
    """(keys (n,) int64, vectors (n, D), the key file, its key size) of table j of collection c from HugeCTR's
    layout, checked against meta_data (table id, ev_size, key count) and the files' heads."""
    folder = os.path.join(path, f"{DUMP_BASE}_{c}")
    mpath = os.path.join(folder, "meta_data")
    if c not in metas:
        metas[c] = parse_meta_data(snap.read(mpath, "embedding_load meta_data"), mpath)
    meta = metas[c]
    what = f"embedding_load table {t.name!r} (collection {c}, table id {j})"
    if j not in meta["tables"]:
        raise DataFormatError(
            "embedding_dump meta_data",
            mpath,
            None,
            f"lists table ids {sorted(meta['tables'])}; {what} is not in this dump",
        )
    n, dim = meta["tables"][j]
    if dim != t.dim:
        raise DataFormatError(
            "embedding_dump meta_data",
            mpath,
            None,
            f"gives table id {j} ev_size {dim}; the model's table {t.name!r} has ev_size {t.dim}",
        )
    kdt = KEY_TYPES[meta["key_type"]]
    arrays = []
    for kind, name, dtype, count in ((FILE_KEY, f"key{j}", kdt, n), (FILE_WEIGHT, f"weight{j}", "<f4", n * dim)):
        fpath = os.path.join(folder, name)
        data = snap.read(fpath, f"{what} {name}")
        if len(data) < FILE_HEAD_BYTES or int(np.frombuffer(data, "<i4", 1)[0]) != kind:
            raise DataFormatError(
                what,
                fpath,
                0,
                f"is not a HugeCTR {('key', 'weight')[kind - 1]} file (its "
                f"{FILE_HEAD_BYTES}-byte head must start with int32 {kind})",
            )
        arrays.append(
            snapshot._array(
                data[FILE_HEAD_BYTES:],
                dtype,
                fpath,
                f"{what} {name}",
                count,
                f": meta_data says {n} keys of ev_size {dim}",
            )
        )
    keys, vecs = arrays
    return keys.astype(np.int64), vecs.reshape(n, dim), os.path.join(folder, f"key{j}"), np.dtype(kdt).itemsize


def load(collections, path: str, table_names=()) -> None:
    """``Model.embedding_load``: read and check every named table's files (verified against the dump's
    manifest when there is one), then write them into the tables; a failed load changes nothing. Reads
    HugeCTR's layout (embedding_collection_<c>/meta_data, key<id>, weight<id>: what HugeCTR and numbactr
    write) and numbactr's earlier one (<table name>/key and emb_vector)."""
    chosen = _selected(collections, table_names, "embedding_load")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"embedding_load: folder {path!r} does not exist")
    mpath = os.path.join(path, f"{DUMP_BASE}_0.manifest.json")
    snap = (
        snapshot._Snapshot(path, mpath, snapshot._read_manifest(mpath))
        if os.path.exists(mpath)
        else snapshot._Snapshot(path)
    )
    loaded, metas = [], {}
    for c, j, t in chosen:
        what = f"embedding_load table {t.name!r}"
        old = os.path.join(path, t.name, "key")
        hugectr = os.path.join(path, f"{DUMP_BASE}_{c}", "meta_data")
        if snap.has(hugectr) or not snap.has(old):
            if not snap.has(hugectr):
                raise FileNotFoundError(
                    f"{what}: {path!r} holds no dump of it: neither HugeCTR's {hugectr!r} "
                    f"nor numbactr's earlier {old!r}"
                )
            keys, vecs, kpath, item = _read_hugectr_table(snap, path, c, j, t, metas)
            base = FILE_HEAD_BYTES
        else:
            kpath, vpath = old, os.path.join(path, t.name, "emb_vector")
            keys = snapshot._array(snap.read(kpath, what + " keys"), "<i8", kpath, what + " keys")
            item, base = 8, 0
            n = keys.shape[0]
            vecs = snapshot._array(
                snap.read(vpath, what + " vectors"),
                "<f4",
                vpath,
                what + " vectors",
                n * t.dim,
                f": {n} keys in {kpath!r} x ev_size {t.dim}",
            ).reshape(n, t.dim)
        n = keys.shape[0]
        uniq, first = np.unique(keys, return_index=True)
        if uniq.shape[0] != n:
            dup = np.setdiff1d(np.arange(n), first)[0]
            raise DataFormatError(what + " keys", kpath, base + item * int(dup), f"key {int(keys[dup])} appears twice")
        if t.cfg.dynamic:
            bad = np.flatnonzero(keys == -1)
            why = "-1 is reserved (it marks empty hash-table slots)"
        else:
            bad = np.flatnonzero((keys < 0) | (keys >= t.cfg.max_vocabulary_size))
            why = f"outside the static table's rows [0, {t.cfg.max_vocabulary_size})"
        if bad.size:
            i = int(bad[0])
            raise DataFormatError(
                what + " keys", kpath, base + item * i, f"key {int(keys[i])} at position {i} is {why}"
            )
        loaded.append((t, keys.copy(), np.array(vecs, np.float32)))
    for t, keys, vecs in loaded:
        t.load_rows(keys, vecs)
