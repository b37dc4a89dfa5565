"""``hugectr.data.DataSourceParams``: where the data files live (spec §2.1), and reading them through fsspec.

    DataSourceParams(source=FileSystemType_t.Local, server="localhost", port=9000)

HugeCTR (io/filesystem.cpp) builds a filesystem from DataSourceParams for the data files (not the file list,
which it reads from the local disk) or from a path's scheme. numbactr resolves each data path the same way:

* a path with a scheme (``hdfs://host:port/p``, ``s3://bucket/key``, ``gs://bucket/key``, and any other
  protocol fsspec knows, e.g. ``memory://`` or ``file://``) is read through that fsspec filesystem, whatever
  DataSourceParams says (HugeCTR's build_by_path); ``S3://`` and ``GS://`` are accepted as HugeCTR does;
* a path without a scheme is local for FileSystemType_t.Local, and otherwise a path on the filesystem
  DataSourceParams names: HDFS -> ``hdfs://server:port/path``, S3 -> ``s3://path`` (server is the AWS region,
  passed to s3fs as client_kwargs region_name; port unused, as in HugeCTR), GCS -> ``gs://path``;
  FileSystemType_t.Other is HugeCTR's "Unsupported filesystem" (ValueError).

The readers memory-map and pread local files, so a remote file is copied once into a private cache folder
(removed at exit) and read from there; a later pass reuses the copy only while the remote file's size and
modification stamp (mtime, LastModified, updated or created, whichever the filesystem reports) are unchanged,
and fetches it again otherwise (also when the filesystem reports no stamp). A
file list given as a URI is fetched the same way. Missing pieces are clear errors: no fsspec ("pip install
fsspec"), no backend for the protocol (fsspec's own message names the package, e.g. s3fs, gcsfs, or pyarrow's
libhdfs), an unknown protocol, and a remote file that does not exist.
HugeCTR: HugeCTR/include/io/filesystem.hpp, src/io/filesystem.cpp, include/pybind/data_source_wrapper.hpp.
"""

from __future__ import annotations

import atexit
import os
import posixpath
import re
import shutil
import tempfile
import threading

from numbactr.runtime import atomic
from numbactr.enums import FileSystemType_t

__all__ = ["DataSource", "DataSourceParams", "remote_uri", "local_copy", "is_remote", "source_names"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_ALIASES = {"S3": "s3", "GS": "gs"}  # HugeCTR's upper-case spellings (get_path_scheme)


def source_names(source) -> list[str]:
    """A reader's source as a list of names: one path (str or os.PathLike), or a non-empty list or tuple of
    them (DataReaderParams.source, read in order as one data set). ValueError for anything else."""
    if isinstance(source, (str, os.PathLike)):
        names = [os.fspath(source)]
    elif isinstance(source, (list, tuple)):
        names = [os.fspath(s) if isinstance(s, (str, os.PathLike)) else s for s in source]
    else:
        raise ValueError(f"source must be a path or a list of paths, got {source!r}")
    bad = [s for s in names if not isinstance(s, str) or not s]
    if not names or bad:
        raise ValueError(f"source must be a non-empty path or list of non-empty paths, got {source!r}")
    return names


_PATH_ARGS = (
    "hdfs_train_source",
    "hdfs_train_filelist",
    "hdfs_eval_source",
    "hdfs_eval_filelist",
    "hdfs_dense_model",
    "hdfs_dense_opt_states",
    "local_train_source",
    "local_train_filelist",
    "local_eval_source",
    "local_eval_filelist",
    "local_dense_model",
    "local_dense_opt_states",
    "hdfs_model_home",
    "local_model_home",
)
_LIST_ARGS = ("hdfs_sparse_model", "hdfs_sparse_opt_states", "local_sparse_model", "local_sparse_opt_states")


class DataSourceParams:
    """``hugectr.data.DataSourceParams(source, server, port)``; default-constructed = (Local, "localhost",
    9000) as HugeCTR's default constructor (its Python binding requires all three).

    Args:
        source: FileSystemType_t (Local, HDFS, S3, GCS, Other).
        server: HDFS namenode host, or the AWS region for S3.
        port: HDFS namenode port.

    HugeCTR's older forms are accepted too, for scripts written against them: v3.5-v3.7's
    ``DataSourceParams(use_hdfs=False, namenode="localhost", port=9000)`` (``use_hdfs=True`` is
    ``source=FileSystemType_t.HDFS``, ``namenode`` is ``server``; both stay readable and writable as
    attributes), and v3.4's paths for :class:`DataSource.move_to_local` (``hdfs_train_source``,
    ``local_train_source``, ``hdfs_sparse_model`` [a list], ...; each a read-write attribute, "" or [] by default).
    """

    def __init__(
        self,
        source=FileSystemType_t.Local,
        server: str = "localhost",
        port: int = 9000,
        *,
        use_hdfs=None,
        namenode=None,
        **paths,
    ):
        if isinstance(source, bool):  # v3.5-v3.7 positional form: (use_hdfs, namenode, port)
            use_hdfs, source = source, FileSystemType_t.Local
        if use_hdfs is not None:
            if not isinstance(use_hdfs, bool):
                raise ValueError(f"DataSourceParams: use_hdfs must be True or False, got {use_hdfs!r}")
            source = FileSystemType_t.HDFS if use_hdfs else FileSystemType_t.Local
        if namenode is not None:
            server = namenode
        if not isinstance(source, FileSystemType_t):
            raise ValueError(
                f"DataSourceParams: source must be a FileSystemType_t (Local, HDFS, S3, GCS, Other), got {source!r}"
            )
        if not isinstance(server, str):
            raise ValueError(f"DataSourceParams: server must be a string, got {server!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"DataSourceParams: port must be an integer in [0, 65535], got {port!r}")
        self.source, self.server, self.port = source, server, port
        unknown = sorted(set(paths) - set(_PATH_ARGS) - set(_LIST_ARGS))
        if unknown:
            raise TypeError(
                f"DataSourceParams: unexpected argument(s) {unknown}; it takes source, server, port "
                f"(or use_hdfs, namenode, port) and the paths {list(_PATH_ARGS + _LIST_ARGS)}"
            )
        for name in _PATH_ARGS:
            v = paths.get(name, "")
            if not isinstance(v, str):
                raise ValueError(f"DataSourceParams: {name} must be a string, got {v!r}")
            setattr(self, name, v)
        for name in _LIST_ARGS:
            v = paths.get(name, [])
            if isinstance(v, str) or not all(isinstance(x, str) for x in v):
                raise ValueError(f"DataSourceParams: {name} must be a list of strings, got {v!r}")
            setattr(self, name, list(v))

    @property
    def use_hdfs(self) -> bool:
        return self.source == FileSystemType_t.HDFS

    @use_hdfs.setter
    def use_hdfs(self, value: bool) -> None:
        self.source = FileSystemType_t.HDFS if value else FileSystemType_t.Local

    @property
    def namenode(self) -> str:
        return self.server

    @namenode.setter
    def namenode(self, value: str) -> None:
        self.server = value

    def is_local(self) -> bool:
        return self.source == FileSystemType_t.Local

    def __repr__(self):
        return f"DataSourceParams(source={self.source!r}, server={self.server!r}, port={self.port})"

    def __eq__(self, other):
        return isinstance(other, DataSourceParams) and vars(self) == vars(other)


class DataSource:
    """``hugectr.data.DataSource(data_source_params)`` of HugeCTR v3.4-v3.7: copies files from HDFS to the
    local disk before training (later HugeCTR versions read remote paths directly, as numbactr's readers do).

    ``move_to_local()`` copies every pair the params name (v3.4): the train and eval source folders (their
    files, not sub-folders) and file lists, the dense model and its optimizer states, each sparse model
    folder and sparse optimizer-state file, to the matching ``local_*`` path; a pair whose HDFS path is empty is
    skipped. ``move_to_local(hdfs_path, local_path)`` copies one file (v3.7's form). A path without a scheme is
    on ``hdfs://namenode:port``; one with a scheme (``hdfs://``, ``s3://``, ``file://``, ``memory://``, ...) is
    read through that fsspec filesystem. A local path that is a folder, or ends with "/", receives the file
    under its own name. Missing remote files and mismatched list lengths are errors (HugeCTR exits).
    """

    def __init__(self, data_source_params: DataSourceParams):
        if not isinstance(data_source_params, DataSourceParams):
            raise ValueError(
                f"DataSource: data_source_params must be a hugectr.data.DataSourceParams, got {data_source_params!r}"
            )
        self.data_source_params = data_source_params

    def _uri(self, path: str) -> str:
        p = self.data_source_params
        if _SCHEME.match(path):
            return remote_uri(path)
        return f"hdfs://{p.server}:{p.port}/" + posixpath.normpath(path).lstrip("/")

    def _copy_file(self, remote: str, local: str) -> str:
        uri = self._uri(remote)
        fs, rpath = _filesystem(uri, None)
        if not fs.exists(rpath):
            raise FileNotFoundError(f"DataSource.move_to_local: {uri!r} does not exist")
        if fs.isdir(rpath):
            raise IsADirectoryError(f"DataSource.move_to_local: {uri!r} is a folder; name a file")
        if os.path.isdir(local) or local.endswith(("/", os.sep)):
            os.makedirs(local, exist_ok=True)
            local = os.path.join(local, posixpath.basename(rpath.rstrip("/")))
        os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
        _fetch(fs, rpath, local)
        return local

    def _copy_folder(self, remote: str, local: str) -> list:
        uri = self._uri(remote)
        fs, rpath = _filesystem(uri, None)
        if not fs.exists(rpath):
            raise FileNotFoundError(f"DataSource.move_to_local: {uri!r} does not exist")
        if not fs.isdir(rpath):
            raise NotADirectoryError(f"DataSource.move_to_local: {uri!r} is a file, not a folder")
        os.makedirs(local, exist_ok=True)
        out = []
        for entry in fs.ls(rpath, detail=True):
            if entry.get("type") == "file":
                name = posixpath.basename(entry["name"].rstrip("/"))
                dest = os.path.join(local, name)
                _fetch(fs, entry["name"], dest)
                out.append(dest)
        return out

    def move_to_local(self, hdfs_path: str | None = None, local_path: str | None = None) -> list:
        """Copy to the local disk; returns the local paths written."""
        if hdfs_path is not None or local_path is not None:
            if not (isinstance(hdfs_path, str) and hdfs_path and isinstance(local_path, str) and local_path):
                raise ValueError(
                    "DataSource.move_to_local(hdfs_path, local_path): give both paths, or neither to "
                    "copy every path the DataSourceParams names"
                )
            return [self._copy_file(hdfs_path, local_path)]
        p = self.data_source_params
        out = []
        for kind, h, loc in (
            ("folder", p.hdfs_train_source, p.local_train_source),
            ("file", p.hdfs_train_filelist, p.local_train_filelist),
            ("folder", p.hdfs_eval_source, p.local_eval_source),
            ("file", p.hdfs_eval_filelist, p.local_eval_filelist),
            ("file", p.hdfs_dense_model, p.local_dense_model),
            ("file", p.hdfs_dense_opt_states, p.local_dense_opt_states),
        ):
            if h:
                if not loc:
                    raise ValueError(f"DataSource.move_to_local: {h!r} has no local path to copy to")
                out += self._copy_folder(h, loc) if kind == "folder" else [self._copy_file(h, loc)]
        for kind, hs, ls in (
            ("folder", p.hdfs_sparse_model, p.local_sparse_model),
            ("file", p.hdfs_sparse_opt_states, p.local_sparse_opt_states),
        ):
            if hs and ls:
                if len(hs) != len(ls):
                    raise ValueError(
                        f"DataSource.move_to_local: {len(hs)} HDFS and {len(ls)} local "
                        f"{'sparse models' if kind == 'folder' else 'sparse optimizer states'}; "
                        "give one local path per HDFS path"
                    )
                for h, loc in zip(hs, ls):
                    out += self._copy_folder(h, loc) if kind == "folder" else [self._copy_file(h, loc)]
        return out


def remote_uri(path: str, params: DataSourceParams | None = None) -> str | None:
    """The fsspec URI a data path is read from, or None for a local file (see the module docstring)."""
    path = os.fspath(path)
    m = _SCHEME.match(path)
    if m:
        scheme = m.group(1)
        return _ALIASES.get(scheme, scheme) + path[len(scheme) :]
    if params is None or params.is_local():
        return None
    t = params.source
    rel = posixpath.normpath(path).lstrip("/")  # "./a/b" and "/a/b" name the same remote path
    if t == FileSystemType_t.HDFS:
        return f"hdfs://{params.server}:{params.port}/{rel}"
    if t == FileSystemType_t.S3:
        return "s3://" + rel
    if t == FileSystemType_t.GCS:
        return "gs://" + rel
    raise ValueError(
        f"data path {path!r}: DataSourceParams(source=FileSystemType_t.{t.name}) is not a "
        f"supported filesystem (HugeCTR: 'Unsupported filesystem'); use Local, HDFS, S3 or GCS, or "
        f"give the path with its scheme (e.g. hdfs://host:port/path)"
    )


def is_remote(path: str, params: DataSourceParams | None = None) -> bool:
    return remote_uri(path, params) is not None


def _filesystem(uri: str, params: DataSourceParams | None):
    """(fsspec filesystem, path inside it) for uri, with clear errors for what is missing."""
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ImportError:
        raise ImportError(f"reading {uri!r} needs the fsspec package (pip install fsspec)") from None
    protocol = uri.split("://", 1)[0]
    if protocol not in known_implementations and protocol not in fsspec.available_protocols():
        raise ValueError(
            f"data path {uri!r}: unknown filesystem scheme {protocol + '://'!r} (fsspec knows "
            f"hdfs, s3, gs, file, memory, http, ...)"
        )
    options = {}
    if protocol == "s3" and params is not None and params.source == FileSystemType_t.S3 and params.server:
        options["client_kwargs"] = {"region_name": params.server}
    try:
        return fsspec.core.url_to_fs(uri, **options)
    except ImportError as e:  # fsspec names the backend package to install
        raise ImportError(f"reading {uri!r}: the {protocol}:// filesystem is not installed ({e})") from None
    except Exception as e:  # noqa: BLE001 (a backend that cannot connect: libhdfs, credentials)
        raise OSError(f"reading {uri!r}: cannot open the {protocol}:// filesystem ({type(e).__name__}: {e})") from None


def _fetch(fs, rpath: str, dest: str) -> None:
    """Copy remote rpath to dest through a temporary name beside it: dest is whole or absent."""
    # no fsync: the cache is a temporary folder removed at exit, so a power loss takes it anyway
    with atomic.atomic_path(dest, tmp=f"{dest}.part{os.getpid()}-{threading.get_ident()}", fsync=False) as tmp:
        fs.get_file(rpath, tmp)


_CACHE = {"dir": None}
_FETCHED: dict = {}  # local copy -> (size, modification stamp) of the remote file it holds
_LOCK = threading.Lock()
_STAMPS = ("mtime", "LastModified", "last_modified", "updated", "created")


def _cache_dir() -> str:
    with _LOCK:
        if _CACHE["dir"] is None:
            d = tempfile.mkdtemp(prefix="numbactr-remote-")
            atexit.register(shutil.rmtree, d, True)
            _CACHE["dir"] = d
        return _CACHE["dir"]


def local_copy(path: str, params: DataSourceParams | None = None) -> str:
    """A local path holding the data of `path`: path itself when local, else a cached copy of the remote file.

    The copy sits at <cache>/<protocol>/<host>/<path>, so files that are neighbours remotely (a Parquet file and
    its _metadata.json) are neighbours in the cache too.
    """
    uri = remote_uri(path, params)
    if uri is None:
        return os.fspath(path)
    fs, rpath = _filesystem(uri, params)
    try:
        info = fs.info(rpath)
    except FileNotFoundError:
        raise FileNotFoundError(f"data file {uri!r} does not exist") from None
    stamp = next((info[k] for k in _STAMPS if info.get(k) is not None), None)
    version = (info.get("size"), stamp)
    protocol, rest = uri.split("://", 1)
    dest = os.path.join(_cache_dir(), protocol, *[p for p in rest.split("/") if p not in ("", ".", "..")])
    with _LOCK:
        if stamp is None or _FETCHED.get(dest) != version or not os.path.isfile(dest):
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            _fetch(fs, rpath, dest)
            _FETCHED[dest] = version
    return dest
