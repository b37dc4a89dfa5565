"""numbactr.runtime.atomic: the file appears whole under its name or not at all; a failed write leaves
the old content and no temporary behind."""

import os

import pytest

from numbactr.runtime import atomic


def test_atomic_write_replaces_whole_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"old")
    with atomic.atomic_write(p) as f:
        f.write(b"new")
        assert p.read_bytes() == b"old"  # not visible before the rename
    assert p.read_bytes() == b"new" and os.listdir(tmp_path) == ["f.bin"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    p = tmp_path / "f.csv"
    p.write_text("old\n")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic.atomic_write(p, "w", newline="") as f:
            f.write("half")
            raise RuntimeError("boom")
    assert p.read_text() == "old\n" and os.listdir(tmp_path) == ["f.csv"]


def test_atomic_path_names_the_temporary_and_syncs_the_folder(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(atomic, "_fsync_folder", synced.append)
    p = tmp_path / "out.txt"
    with atomic.atomic_path(p, tmp=str(p) + ".partial", fsync_dir=True) as tmp:
        assert tmp == str(p) + ".partial"
        with open(tmp, "w") as f:
            f.write("x")
    assert p.read_text() == "x" and synced == [str(tmp_path)]
    with pytest.raises(OSError):
        with atomic.atomic_path(p) as tmp:
            open(tmp, "w").close()
            raise OSError("disk full")
    assert p.read_text() == "x" and os.listdir(tmp_path) == ["out.txt"]


def test_a_mode_that_does_not_create_is_refused(tmp_path):
    with pytest.raises(ValueError, match="does not create"):
        with atomic.atomic_write(tmp_path / "f", "rb"):
            pass
