"""Files written whole or not at all.

A file is written to a temporary beside it and renamed over it, so a reader, a crash or a second
run never sees half of one. The temporary is named after the host and process that write it
(`.<name>.<host>.<pid>.tmp`), so the next writer of the same folder removes what a killed
process left behind; it is created with the usual permissions (the umask), so a cache folder
shared by a group stays readable to the group.

A full disk is one error naming the folder, the bytes needed and those free (`NoRoom`), checked
before a large write where its size is known (`check_room`) and recognized after a failed one
(`out_of_room`: the operating system's ENOSPC, or torch's writer saying it in its own words).
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_orphaned_temporaries(folder: Path) -> list[Path]:
    """Deletes the temporaries in `folder` whose writer, a process of this host, has died; returns them."""
    removed = []
    for path in folder.glob(".*.tmp"):
        match = _TEMPORARY.fullmatch(path.name)
        if match and match["host"] == _HOST and not _alive(int(match["pid"])):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


class NoRoom(OSError):
    """A write that the file system holding `folder` has no room for."""

    def __init__(self, what: str, folder: Path, needed: int | None, fix: str) -> None:
        free = shutil.disk_usage(existing_parent(folder)).free
        size = f"{needed / 1e6:,.1f} MB needed, " if needed is not None else ""
        super().__init__(errno.ENOSPC, f"no room for {what} in {folder} ({size}{free / 1e6:,.1f} MB free): {fix}")

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 28]"
        return str(self.strerror)


def existing_parent(path: Path) -> Path:
    """`path` itself, or the nearest of its parents that exists."""
    return next(p for p in (path, *path.parents) if p.exists())


def out_of_room(error: BaseException) -> bool:
    """Whether a write failed because its file system is full."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(error, RuntimeError) and any(  # torch's archive writer
        words in str(error) for words in ("file write failed", "unexpected pos", "No space left"))


def check_room(folder: Path, needed: int, what: str, fix: str) -> None:
    """NoRoom unless the file system holding `folder` has `needed` bytes free."""
    if shutil.disk_usage(existing_parent(folder)).free < needed:
        raise NoRoom(what, folder, needed, fix)


@contextmanager
def replaced_atomically(path: str | Path) -> Iterator[Path]:
    """Yields the temporary path to write; when the block ends normally the temporary (if it was
    written) replaces `path`, when it raises the temporary is removed.

        with replaced_atomically(target) as temporary:
            torch.save(blob, temporary)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_orphaned_temporaries(path.parent)
    temporary = path.with_name(f".{path.name}.{_HOST}.{os.getpid()}.tmp")
    try:
        yield temporary
        if temporary.exists():
            os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_text_atomically(path: str | Path, text: str) -> None:
    with replaced_atomically(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
