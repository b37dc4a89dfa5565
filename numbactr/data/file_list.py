"""HugeCTR file lists (Norm and Parquet sources), spec §2.2.

Text format: the first line is an integer N (> 0), then N lines, each a data file path used verbatim
(relative paths resolve against the current working directory, as in HugeCTR).
HugeCTR: HugeCTR/include/data_readers/file_list.hpp
"""

from __future__ import annotations

import os


def read_file_list(path: str, check_exists: bool = True) -> list[str]:
    """Parse a file list; returns the N paths in order.

    Blank lines are ignored (HugeCTR reads with `>>`, which skips whitespace). Raises ValueError naming
    the list file and the 1-based line number for: an unreadable count, N <= 0, fewer or more than N
    paths, and (with check_exists) a listed file that does not exist.
    """
    try:
        with open(path, "r") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"file list {path!r}: cannot be read ({e})") from e
    entries = [(i + 1, ln.strip()) for i, ln in enumerate(lines) if ln.strip()]
    if not entries:
        raise ValueError(f"file list {path!r}, line 1: empty file list (expected the file count N)")
    count_line, first = entries[0]
    try:
        n = int(first)
    except ValueError:
        raise ValueError(f"file list {path!r}, line {count_line}: expected the file count N, got {first!r}") from None
    if n <= 0:
        raise ValueError(f"file list {path!r}, line {count_line}: file count must be > 0, got {n}")
    paths = entries[1:]
    if len(paths) != n:
        where = paths[n][0] if len(paths) > n else (paths[-1][0] + 1 if paths else count_line + 1)
        raise ValueError(f"file list {path!r}, line {where}: header says {n} files but the list has {len(paths)} paths")
    if check_exists:
        for line_no, p in paths:
            if not os.path.isfile(p):
                raise ValueError(
                    f"file list {path!r}, line {line_no}: data file {p!r} does not exist "
                    f"(paths are used verbatim, relative to the working directory "
                    f"{os.getcwd()!r})"
                )
    return [p for _, p in paths]


def write_file_list(path: str, files: list[str]) -> None:
    """Write a file list: N, then one path per line (written verbatim). Creates the parent folder."""
    files = [str(f) for f in files]
    if not files:
        raise ValueError(f"file list {path!r}: refusing to write an empty file list (HugeCTR needs N > 0)")
    for f in files:
        if "\n" in f or f != f.strip():
            raise ValueError(f"file list {path!r}: path {f!r} has surrounding whitespace or a newline")
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        f.write(f"{len(files)}\n")
        for p in files:
            f.write(p + "\n")
