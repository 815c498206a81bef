"""`python -m workbench sync [runs/]`: upload every offline W&B run under a folder.

Each run keeps its W&B files beside its versions, `runs/<name>/wandb/offline-run-*/` (sweeps:
`runs/sweeps/<sweep>/<run>/wandb/...`), so `wandb sync` at the repository root finds nothing;
this finds them all and hands them to `wandb sync`. Runs W&B marked as uploaded
(`*.wandb.synced`) are skipped unless `--all`. Needs W&B credentials (`wandb login`, or
`WANDB_API_KEY` and, for a self-hosted server, `WANDB_BASE_URL`).
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path


def wandb_configured() -> bool:
    """W&B credentials are set up: an API key, a self-hosted `WANDB_BASE_URL`, or the `~/.netrc`
    entry `wandb login` writes for its host (api.wandb.ai, or the `base_url` of W&B's settings
    file)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_BASE_URL"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.exists() and any(host in netrc.read_text(errors="ignore") for host in _wandb_hosts())


def _wandb_hosts() -> list[str]:
    """api.wandb.ai, and the host `wandb login --host` saved in W&B's settings file."""
    from configparser import ConfigParser, Error
    from urllib.parse import urlparse

    folder = Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb")
    settings = ConfigParser()
    try:
        settings.read(folder / "settings")
    except Error:  # a malformed file configures nothing
        return ["api.wandb.ai"]
    base_url = settings.get("default", "base_url", fallback="")
    host = urlparse(base_url).hostname
    return ["api.wandb.ai", *([host] if host else [])]


def offline_runs(folders: list[str | Path], include_synced: bool = False) -> list[Path]:
    """The `offline-run-*` folders under `folders`, oldest first (their names start with the time)."""
    found = []
    for folder in map(Path, folders):
        if not folder.exists():
            raise FileNotFoundError(f"no such folder: {folder}")
        for run in folder.rglob("offline-run-*"):
            synced = any(run.glob("*.wandb.synced"))
            if run.is_dir() and any(run.glob("*.wandb")) and (include_synced or not synced):
                found.append(run)
    return sorted(found, key=lambda run: run.name)


def sync_command(runs: list[Path]) -> list[str]:
    return [sys.executable, "-m", "wandb", "sync", *map(str, runs)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workbench sync",
        description="Upload every offline W&B run under the given folders (default: runs) with "
                    "`wandb sync`; already uploaded runs are skipped.")
    parser.add_argument("folders", nargs="*", default=["runs"], metavar="FOLDER")
    parser.add_argument("--all", action="store_true", help="upload runs marked as synced too")
    parser.add_argument("--dry_run", action="store_true", help="list the runs and the command only")
    args = parser.parse_args(argv)
    if not (args.dry_run or wandb_configured()):
        parser.error("no W&B credentials here: run `wandb login` (or set WANDB_API_KEY, and WANDB_BASE_URL for a "
                     "self-hosted server), then sync again; --dry_run lists the runs without them")
    try:
        runs = offline_runs(args.folders, include_synced=args.all)
    except FileNotFoundError as error:
        parser.error(str(error))
    if not runs:
        print(f"no offline W&B runs to upload under {', '.join(args.folders)}")
        return 0
    command = sync_command(runs)
    print(f"{len(runs)} offline runs: {shlex.join(['wandb', 'sync', *command[4:]])}")
    if args.dry_run:
        return 0
    return subprocess.run(command, check=False).returncode  # wandb sync says what failed
