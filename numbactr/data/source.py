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

from ..enums import FileSystemType_t

__all__ = ["DataSourceParams", "remote_uri", "local_copy", "is_remote"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_ALIASES = {"S3": "s3", "GS": "gs"}          # HugeCTR's upper-case spellings (get_path_scheme)


class DataSourceParams:
    """``hugectr.data.DataSourceParams(source, server, port)``; default-constructed = (Local, "localhost",
    9000) as HugeCTR's default constructor (its Python binding requires all three).

    Args:
        source: FileSystemType_t (Local, HDFS, S3, GCS, Other).
        server: HDFS namenode host, or the AWS region for S3.
        port: HDFS namenode port.
    """

    def __init__(self, source=FileSystemType_t.Local, server: str = "localhost", port: int = 9000):
        if not isinstance(source, FileSystemType_t):
            raise ValueError(f"DataSourceParams: source must be a FileSystemType_t (Local, HDFS, S3, GCS, Other), "
                             f"got {source!r}")
        if not isinstance(server, str):
            raise ValueError(f"DataSourceParams: server must be a string, got {server!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"DataSourceParams: port must be an integer in [0, 65535], got {port!r}")
        self.source, self.server, self.port = source, server, port

    def is_local(self) -> bool:
        return self.source == FileSystemType_t.Local

    def __repr__(self):
        return f"DataSourceParams(source={self.source!r}, server={self.server!r}, port={self.port})"

    def __eq__(self, other):
        return isinstance(other, DataSourceParams) and vars(self) == vars(other)


def remote_uri(path: str, params: DataSourceParams | None = None) -> str | None:
    """The fsspec URI a data path is read from, or None for a local file (see the module docstring)."""
    path = os.fspath(path)
    m = _SCHEME.match(path)
    if m:
        scheme = m.group(1)
        return _ALIASES.get(scheme, scheme) + path[len(scheme):]
    if params is None or params.is_local():
        return None
    t = params.source
    rel = posixpath.normpath(path).lstrip("/")            # "./a/b" and "/a/b" name the same remote path
    if t == FileSystemType_t.HDFS:
        return f"hdfs://{params.server}:{params.port}/{rel}"
    if t == FileSystemType_t.S3:
        return "s3://" + rel
    if t == FileSystemType_t.GCS:
        return "gs://" + rel
    raise ValueError(f"data path {path!r}: DataSourceParams(source=FileSystemType_t.{t.name}) is not a "
                     f"supported filesystem (HugeCTR: 'Unsupported filesystem'); use Local, HDFS, S3 or GCS, or "
                     f"give the path with its scheme (e.g. hdfs://host:port/path)")


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
        raise ValueError(f"data path {uri!r}: unknown filesystem scheme {protocol + '://'!r} (fsspec knows "
                         f"hdfs, s3, gs, file, memory, http, ...)")
    options = {}
    if protocol == "s3" and params is not None and params.source == FileSystemType_t.S3 and params.server:
        options["client_kwargs"] = {"region_name": params.server}
    try:
        return fsspec.core.url_to_fs(uri, **options)
    except ImportError as e:            # fsspec names the backend package to install
        raise ImportError(f"reading {uri!r}: the {protocol}:// filesystem is not installed ({e})") from None
    except Exception as e:              # noqa: BLE001 (a backend that cannot connect: libhdfs, credentials)
        raise OSError(f"reading {uri!r}: cannot open the {protocol}:// filesystem ({type(e).__name__}: {e})") from None


_CACHE = {"dir": None}
_FETCHED: dict = {}             # local copy -> (size, modification stamp) of the remote file it holds
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
            tmp = f"{dest}.part{threading.get_ident()}"
            fs.get_file(rpath, tmp)
            os.replace(tmp, dest)
            _FETCHED[dest] = version
    return dest
