"""numbactr's snapshot transaction: files committed atomically under a manifest, and read back verified.

    _commit(folder, base, it, [(rel, bytes)], extra)   rank 0: stage, journal (the commit point), move
    on_rank0(comm, write, failed)                      run write() on rank 0, every rank hears the outcome
    _Snapshot.of(path).read(path, what)                a file's bytes, checked against its manifest

The file layouts (HugeCTR's dense and sparse model files) are numbactr.files.checkpoint's; the embedding
collection's embedding_dump commits its tables through the same transaction. This module knows nothing of
models or embeddings: it moves named bytes.

Commit protocol (rank 0 writes; every rank returns once rank 0 has committed or failed):
  1. every file is written into a staging folder ``.{prefix}_{it}.staging-{token}`` beside the snapshot,
     flushed and fsync'd, then the staging folders are fsync'd;
  2. the manifest is written as a journal ``{prefix}_{it}.manifest.pending.json`` (temporary name, fsync,
     os.replace, fsync of the folder). This rename is the commit point;
  3. the staged files are os.replace'd to their final names, the folders fsync'd, and the journal is
     renamed to ``{prefix}_{it}.manifest.json``; the staging folder is removed.
A save killed before 2 leaves every file of the previous snapshot (same or other iteration) untouched:
it still loads, and the new names do not exist yet. Killed after 2, the journal names the new snapshot,
complete between its final names and the staging folder: loaders read each file from whichever of the
two matches the journal, so the snapshot loads completely new; never a mix. The next save of the same
prefix finishes such a journal (step 3) and deletes staging folders no journal refers to. One writer
per prefix at a time; other tools that read the files during step 3 (HugeCTR itself) may see a mix.

Manifest ``{prefix}_{it}.manifest.json`` (HugeCTR never reads it): {"format": FORMAT, "version": 1,
"prefix", "iter", "ranks", "staging", "files": {rel: {"size", "sha256"}}, "embeddings": [...], "dense":
{...} (optional)} and "manifest_sha256", the sha256 of the rest (sorted keys, no spaces). Reading: a
file's snapshot is the manifest (or journal, which wins) named after a (prefix, iter) its name can come
from and that lists it; every file read is checked against its size and sha256, and the error names the
file and which of the two differs. A file no manifest lists (HugeCTR's own snapshots) is read as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil

import numpy as np

from numbactr.runtime import atomic, device
from numbactr.data.errors import DataFormatError

FORMAT = "numbactr snapshot manifest"
_SAFE_REL = re.compile(r"[^/\\]+(/[^/\\]+)?")  # "file" or "folder/file", nothing else
_STAGING = re.compile(r"\.[^/\\]*\.staging-\d+-[0-9a-f]+")


def on_rank0(comm, write, failed: str) -> None:
    """Run write() on rank 0 only; every rank returns after it and raises if it failed (rank 0 its own
    error, the others RuntimeError(f"{failed}: <error>")), so no rank goes on as if the files were there.
    The broadcast of the outcome is the barrier."""
    error = None
    if comm.rank == 0:
        try:
            write()
        except Exception as e:  # noqa: BLE001 (every rank must hear of it)
            error = e
    told = comm.bcast(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if told is not None:
        raise RuntimeError(f"{failed}: {told}")


def _raw(a, dtype) -> np.ndarray:
    """The bytes of array ``a`` as ``dtype`` (uint8 view, no copy when already so laid out)."""
    return np.ascontiguousarray(device.to_host(a)).astype(dtype, copy=False).reshape(-1).view(np.uint8)


def _commit(d: str, base: str, it: int, outs: list, extra: dict) -> None:
    """Stage every file, write the journal (the commit point), then move the files into place."""
    if not os.path.isdir(d):
        raise FileNotFoundError(f"save_params_to_files: folder {d!r} of the prefix does not exist")
    _recover(d, base)
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    staging = f".{base}_{it}.staging-{token}"
    files = {}
    for rel, data in outs:
        path = os.path.join(d, staging, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write_durable(path, data)
        files[rel] = {"size": memoryview(data).nbytes, "sha256": hashlib.sha256(data).hexdigest()}
    for folder in {os.path.dirname(os.path.join(d, staging, rel)) for rel, _ in outs} | {os.path.join(d, staging)}:
        _fsync_dir(folder)
    body = {"format": FORMAT, "version": 1, "prefix": base, "iter": it, **extra, "staging": staging, "files": files}
    journal = os.path.join(d, _journal_name(base, it))
    with atomic.atomic_path(
        journal, tmp=os.path.join(d, f".{_journal_name(base, it)}.tmp-{token}"), fsync=False
    ) as tmp:  # _write_durable fsyncs it
        _write_durable(tmp, _manifest_bytes(body))
    _fsync_dir(d)  # committed
    _roll_forward(d, journal)


def _roll_forward(d: str, journal: str) -> None:
    """Finish a committed save: move its staged files to their names, then the journal to the manifest."""
    body = _read_manifest(journal)
    staging = os.path.join(d, body["staging"])
    touched = {d}
    for rel in body["files"]:
        src, dst = os.path.join(staging, rel), os.path.join(d, rel)
        if os.path.exists(src):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(src, dst)
            touched.add(os.path.dirname(dst))
        elif not os.path.exists(dst):
            raise FileNotFoundError(
                f"cannot finish the interrupted save recorded in {journal!r}: {rel!r} is "
                f"neither staged in {staging!r} nor in place"
            )
    for folder in touched:
        _fsync_dir(folder)
    os.replace(journal, os.path.join(d, _manifest_name(body["prefix"], body["iter"])))
    _fsync_dir(d)
    shutil.rmtree(staging, ignore_errors=True)


def _recover(d: str, base: str) -> None:
    """Before a save of ``base``: finish its committed but interrupted saves, delete uncommitted leftovers."""
    b = re.escape(base)
    for name in sorted(os.listdir(d)):
        if re.fullmatch(b + r"_\d+\.manifest\.pending\.json", name):
            _roll_forward(d, os.path.join(d, name))
    for name in os.listdir(d):  # no journal refers to these any more: a save killed before its commit
        path = os.path.join(d, name)
        if re.fullmatch(r"\." + b + r"_\d+\.staging-\d+-[0-9a-f]+", name):
            shutil.rmtree(path, ignore_errors=True)
        elif re.fullmatch(r"\." + b + r"_\d+\.manifest\.pending\.json\.tmp-\d+-[0-9a-f]+", name):
            os.remove(path)


# module attributes, looked up at call time, so the kill and power-loss tests can hook each file boundary
_write_durable = atomic.write_durable
_fsync_dir = atomic.fsync_dir


# ---- manifests ---------------------------------------------------------------------------------
def _manifest_name(base: str, it: int) -> str:
    return f"{base}_{it}.manifest.json"


def _journal_name(base: str, it: int) -> str:
    return f"{base}_{it}.manifest.pending.json"


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _manifest_bytes(body: dict) -> bytes:
    return json.dumps({**body, "manifest_sha256": hashlib.sha256(_canonical(body)).hexdigest()}, indent=1).encode()


def _read_manifest(path: str) -> dict:
    """The manifest's content, checked against its own sha256 and for the structure loading relies on."""
    what = "snapshot manifest"
    with open(path, "rb") as f:
        raw = f.read()
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise DataFormatError(what, path, None, f"is not valid JSON ({e})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise DataFormatError(what, path, None, f'is not a numbactr snapshot manifest (no "format": {FORMAT!r})')
    stored = body.pop("manifest_sha256", None)
    if stored != hashlib.sha256(_canonical(body)).hexdigest():
        raise DataFormatError(
            what,
            path,
            None,
            "its own sha256 does not match its content: the manifest was "
            "damaged or edited, so it cannot vouch for the snapshot",
        )
    files, embeddings = body.get("files"), body.get("embeddings")
    ok = (
        body.get("version") == 1
        and isinstance(body.get("prefix"), str)
        and _is_int(body.get("iter"))
        and _is_int(body.get("ranks"))
        and isinstance(body.get("staging"), str)
        and _STAGING.fullmatch(body["staging"]) is not None
        and isinstance(files, dict)
        and all(
            isinstance(rel, str)
            and _SAFE_REL.fullmatch(rel)
            and ".." not in rel.split("/")
            and isinstance(f, dict)
            and _is_int(f.get("size"))
            and isinstance(f.get("sha256"), str)
            for rel, f in files.items()
        )
        and isinstance(embeddings, list)
        and all(
            isinstance(r, dict)
            and r.get("folder") in {p.split("/")[0] for p in files}
            and r.get("opt_file") in files
            and all(_is_int(r.get(k)) for k in ("vec", "states", "block_rows"))
            and isinstance(r.get("rows_per_rank"), list)
            and len(r["rows_per_rank"]) == body["ranks"]
            and all(_is_int(c) for c in r["rows_per_rank"])
            for r in embeddings
        )
    )
    ok = (
        ok
        and all(isinstance(r.get("name", ""), str) and isinstance(r.get("optimizer", ""), str) for r in embeddings)
        and _dense_record_ok(body.get("dense"), files)
    )
    if not ok:
        raise DataFormatError(
            what,
            path,
            None,
            "has the right checksum but not the structure of a version-1 manifest (written by a newer numbactr?)",
        )
    return body


def _dense_record_ok(dense, files: dict) -> bool:
    """Whether the manifest's "dense" record (absent in older manifests and in embedding_dump's) has the
    structure _snapshot_files writes."""
    if dense is None:
        return True
    return (
        isinstance(dense, dict)
        and dense.get("file") in files
        and dense.get("opt_file") in files
        and isinstance(dense.get("optimizer"), str)
        and _is_int(dense.get("states"))
        and isinstance(dense.get("layers"), list)
        and all(
            isinstance(r, dict)
            and isinstance(r.get("name"), str)
            and isinstance(r.get("type"), str)
            and isinstance(r.get("shapes"), list)
            and all(isinstance(sh, list) and all(_is_int(n) for n in sh) for sh in r["shapes"])
            for r in dense["layers"]
        )
    )


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _name_candidates(name: str) -> list[tuple[str, int]]:
    """Every (prefix, iter) whose snapshot can have a file or folder of this name (HugeCTR's names are
    ambiguous: `{prefix}{i}_sparse_` may split prefix and index at any trailing digit)."""
    out = []
    for pattern, indexed in (
        (r"(.*)_opt_dense_(\d+)\.model", False),
        (r"(.*)_dense_(\d+)\.model", False),
        (r"(.*?)(\d+)_opt_sparse_(\d+)\.model", True),
        (r"(.*?)(\d+)_sparse_(\d+)\.model", True),
    ):
        m = re.fullmatch(pattern, name)
        if m is None:
            continue
        if not indexed:
            out.append((m.group(1), int(m.group(2))))
            continue
        head, digits, it = m.group(1), m.group(2), int(m.group(3))
        for k in range(1, len(digits) + 1):  # index = the last k digits, written without leading 0
            index = digits[-k:]
            if index == "0" or not index.startswith("0"):
                out.append((head + digits[:-k], it))
    return out


class _Snapshot:
    """The files of one snapshot, read verified against its manifest, or as they are when none lists them."""

    def __init__(self, folder: str, path: str | None = None, body: dict | None = None):
        self.dir, self.path, self.body = folder, path, body

    @classmethod
    def of(cls, path: str) -> "_Snapshot":
        """The snapshot of a dense or optimizer-state file or a sparse folder (module doc: which manifest)."""
        folder, name = os.path.split(os.path.abspath(path))
        found = []
        for base, it in _name_candidates(name):
            for mname in (_journal_name(base, it), _manifest_name(base, it)):  # a journal supersedes
                mpath = os.path.join(folder, mname)
                if os.path.exists(mpath):
                    body = _read_manifest(mpath)
                    if any(rel == name or rel.startswith(name + "/") for rel in body["files"]):
                        found.append((mpath, body))
                    break
        if len(found) > 1:
            raise DataFormatError(
                "snapshot manifest",
                found[0][0],
                None,
                f"lists {name!r}, and so does {found[1][0]!r}: the two snapshots' file names "
                "collide (HugeCTR's names join prefix and embedding index); save them in "
                "separate folders",
            )
        return cls(folder, *found[0]) if found else cls(folder)

    def _rel(self, path: str) -> str:
        return os.path.relpath(os.path.abspath(path), self.dir).replace(os.sep, "/")

    def has(self, path: str) -> bool:
        """Whether the snapshot holds this file (the manifest lists it; without one, it exists)."""
        return os.path.exists(path) if self.body is None else self._rel(path) in self.body["files"]

    def record(self, opt_path: str) -> dict | None:
        """The manifest's record of the embedding whose optimizer-state file this is (None: no manifest)."""
        if self.body is None:
            return None
        rel = self._rel(opt_path)
        found = [r for r in self.body["embeddings"] if r["opt_file"] == rel]
        if not found:
            raise DataFormatError(
                "sparse optimizer states",
                opt_path,
                None,
                f"is listed by the manifest {self.path!r}, but not as an embedding's optimizer-state file",
            )
        return found[0]

    def dense_record(self, path: str, role: str, what: str) -> dict | None:
        """The manifest's record of the dense files when ``path`` is its ``role`` ("file": the dense model,
        "opt_file": the dense optimizer states); None without a manifest or a manifest that predates the
        record. A path that is the snapshot's other dense file is an error."""
        dense = None if self.body is None else self.body.get("dense")
        if dense is None:
            return None
        rel = self._rel(path)
        if dense[role] != rel:
            other = {
                "file": "dense model (load_dense_weights)",
                "opt_file": "dense optimizer states (load_dense_optimizer_states)",
            }
            actual = next((other[k] for k in other if dense[k] == rel), "another file")
            raise DataFormatError(
                what,
                path,
                None,
                f"is the snapshot's {actual} according to its manifest "
                f"{self.path!r}, not its {other[role].split(' (')[0]}",
            )
        return dense

    def sparse_name(self, folder: str) -> str | None:
        """The embedding name the manifest records for a sparse model folder (None: not recorded)."""
        if self.body is None:
            return None
        rel = self._rel(folder)
        return next((r.get("name") for r in self.body["embeddings"] if r["folder"] == rel), None)

    def read(self, path: str, what: str) -> bytes:
        """The file's bytes; with a manifest, only if size and sha256 match it (an interrupted but
        committed save: from the final name or the staging folder, whichever matches)."""
        if self.body is None:
            try:
                with open(path, "rb") as f:
                    return f.read()
            except FileNotFoundError:
                raise FileNotFoundError(f"{what}: file {path!r} does not exist") from None
        rel = self._rel(path)
        entry = self.body["files"].get(rel)
        if entry is None:
            raise DataFormatError(what, path, None, f"is not part of the snapshot of manifest {self.path!r}")
        places = [path]
        if self.path.endswith(".pending.json"):
            places.append(os.path.join(self.dir, self.body["staging"], rel))
        problems = []
        for place in places:
            if not os.path.exists(place):
                continue
            with open(place, "rb") as f:
                data = f.read()
            if len(data) != entry["size"]:
                problems.append(
                    f"{place!r} holds {len(data)} bytes; the manifest {self.path!r} records "
                    f"{entry['size']} (size differs)"
                )
            elif hashlib.sha256(data).hexdigest() != entry["sha256"]:
                problems.append(
                    f"{place!r}: its sha256 differs from the one the manifest {self.path!r} "
                    "records (checksum differs: damaged or changed after the snapshot was written)"
                )
            else:
                return data
        if not problems:
            raise FileNotFoundError(
                f"{what}: file {path!r} does not exist (the snapshot manifest {self.path!r} lists it)"
            )
        raise DataFormatError(what, path, None, "does not match its manifest: " + "; ".join(problems))


def _array(data: bytes, dtype: str, path: str, what: str, count: int | None = None, why: str = "") -> np.ndarray:
    """The values of a raw little-endian file: exactly ``count`` of them when given (``why`` says where
    that count comes from), else any whole number of them."""
    item = np.dtype(dtype).itemsize
    name = np.dtype(dtype).name
    if count is not None and len(data) != item * count:
        raise DataFormatError(
            what,
            path,
            None,
            f"holds {len(data)} bytes; this model needs exactly {item * count} ({count} {name} values{why})",
        )
    if len(data) % item:
        raise DataFormatError(what, path, None, f"{len(data)} bytes is not a whole number of {name} values")
    return np.frombuffer(data, dtype=dtype)
