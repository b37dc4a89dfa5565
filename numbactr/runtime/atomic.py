"""Atomic file writes: a file appears under its name whole, or not at all.

    with atomic_write(path) as f:            # mode "wb" (bytes) or "w" (text, with open()'s keywords)
        f.write(data)
    with atomic_path(path) as tmp:           # for writers that take a path: savefig, np.savetxt, onnx
        fig.savefig(tmp, format="png")

Protocol: the content goes to a temporary name in the same folder (``tmp``, by default ``path + ".tmp"``),
is flushed and fsync'd (fsync=True), then ``os.replace``'d onto ``path`` (atomic on POSIX within one
filesystem); with fsync_dir=True the folder is fsync'd after the rename, so the new name itself survives
a power loss. If the body raises, the temporary is removed and ``path`` keeps its old content (or stays
absent). Why: whoever reads the file meanwhile (a viewer polling a chart, a loader after a crash or a
kill -9) sees the old file or the new one, never a half-written one.

This module imports nothing of numbactr (it sits below data/ and files/, which both use it).
``os.replace`` and ``os.fsync`` are looked up at call time, so a test can hook them.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["atomic_write", "atomic_path", "write_durable", "fsync_dir"]


def fsync_dir(path: str) -> None:
    """Make the names in a folder durable (a rename is only safe once its folder is fsync'd)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str, data) -> None:
    """Write ``data`` (bytes-like) to ``path`` in place, flushed and fsync'd before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(tmp: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)


@contextlib.contextmanager
def atomic_path(path, tmp: str | None = None, fsync: bool = True, fsync_dir: bool = False):
    """Yield the temporary path to write; on success it is fsync'd (fsync=True) and renamed to ``path``
    (then the folder fsync'd with fsync_dir=True); on an exception it is removed and the error goes on."""
    path = os.fspath(path)
    tmp = path + ".tmp" if tmp is None else os.fspath(tmp)
    try:
        yield tmp
        if fsync:
            _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise
    if fsync_dir:
        _fsync_folder(os.path.dirname(os.path.abspath(path)))


_fsync_folder = fsync_dir  # the keyword of atomic_path / atomic_write shadows the function's name


@contextlib.contextmanager
def atomic_write(
    path, mode: str = "wb", tmp: str | None = None, fsync: bool = True, fsync_dir: bool = False, **open_kwargs
):
    """Yield a file object open on the temporary (``mode``: "w"/"wb" and their "x"/"+" variants; keywords
    such as newline= go to open()); on success it is flushed, fsync'd and renamed to ``path`` as in
    atomic_path; on an exception it is closed and removed."""
    if not mode.startswith(("w", "x")):
        raise ValueError(f"atomic_write: mode {mode!r} does not create a file; use 'w' or 'wb'")
    with atomic_path(path, tmp, fsync=False, fsync_dir=fsync_dir) as t:
        with open(t, mode, **open_kwargs) as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
