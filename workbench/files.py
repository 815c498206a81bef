"""Files written whole or not at all.

A file is written to a temporary beside it and renamed over it, so a reader, a crash or a second
run never sees half of one. The temporary is named after the host and process that write it
(`.<name>.<host>.<pid>.tmp`), so the next writer of the same folder removes what a killed
process left behind; it is created with the usual permissions (the umask), so a cache folder
shared by a group stays readable to the group.
"""
from __future__ import annotations

import os
import re
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
