"""Atomic writes: whole files or none, usual permissions, no temporaries left for ever."""
from __future__ import annotations

import os
import subprocess

import pytest

from workbench.files import (
    _HOST,
    remove_orphaned_temporaries,
    replaced_atomically,
    write_text_atomically,
)


def dead_pid() -> int:
    """The id of a process that has ended."""
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_a_write_replaces_the_file_with_the_umask_permissions(tmp_path):
    target = tmp_path / "deep" / "file.txt"
    previous = os.umask(0o022)
    try:
        write_text_atomically(target, "one")
        write_text_atomically(target, "two")
    finally:
        os.umask(previous)
    assert target.read_text() == "two"
    assert target.stat().st_mode & 0o777 == 0o644  # readable by a group sharing the cache
    assert [p.name for p in target.parent.iterdir()] == ["file.txt"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "file.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with replaced_atomically(target) as temporary:
            temporary.write_text("half")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old" and sorted(tmp_path.iterdir()) == [target]


def test_temporaries_of_dead_writers_are_removed_by_the_next_writer(tmp_path):
    orphan = tmp_path / f".features.pt.{_HOST}.{dead_pid()}.tmp"
    alive = tmp_path / f".features.pt.{_HOST}.{os.getppid()}.tmp"  # a live process's write in progress
    elsewhere = tmp_path / f".features.pt.otherhost.{dead_pid()}.tmp"  # a pid of another machine
    for path in (orphan, alive, elsewhere):
        path.write_bytes(b"partial")
    write_text_atomically(tmp_path / "other.txt", "x")
    assert not orphan.exists() and alive.exists() and elsewhere.exists()
    assert remove_orphaned_temporaries(tmp_path) == []
