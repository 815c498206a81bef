"""The deployed ServerApp: the experiment of the run config's `workbench-args`, over its grid.

A SuperLink runs `app` (this module) and the SuperNodes run `client_app:app`; `write_app` writes
the Flower App (`pyproject.toml`) that `flwr run` submits. The ServerApp runs the experiment
(`workbench.experiment.run(["fit", *args, "--engine=flower"])`): its `fit` finds this grid and
sends the rounds over it. The run folder, `last.ckpt` after every round, `model.ckpt` and the logs
are written where the ServerApp runs; a fit that fails says how to resume it from `last.ckpt`.

    python -m workbench.engines.flower.server_app app <folder>    # write the Flower App
    python -m workbench.engines.flower.server_app submit <folder> <superlink> -- <fit arguments>

`submit` is `flwr run` that ends as the run does: `flwr run --stream` exits 0 however its
ServerApp ended, so `submit` starts the run, streams its log (`flwr log`) and exits 0 only when
Flower lists the run as completed, else 1 with the ServerApp's error.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from workbench import runlog
from workbench.engines.flower.transport import DEPLOYED_GRID

TEMPLATE = Path(__file__).with_name("pyproject.toml")

app = ServerApp()


@app.main()
def serve(grid: Grid, context: Context) -> None:
    """`fit` with the run config's `workbench-args`, its rounds over this grid."""
    from workbench.experiment import run  # lazily: the experiment (and Lightning's CLI) only here

    arguments = shlex.split(str(context.run_config.get("workbench-args", "")))
    if not arguments:
        raise ValueError("the run config has no workbench-args; pass them to flwr run, e.g. "
                         "--run-config \"workbench-args='--config /abs/path/afl.yaml'\"")
    # LightningCLI would echo this process's own arguments (flwr-serverapp's token) in a warning
    own_arguments, sys.argv = sys.argv, sys.argv[:1]
    token = DEPLOYED_GRID.set(grid)
    try:
        run(["fit", *arguments, "--engine=flower"])
    except Exception as error:
        checkpoint = runlog.claimed / "last.ckpt" if runlog.claimed is not None else None
        if checkpoint is None or not checkpoint.exists():
            raise
        # Flower shows the exception's message as the run's status: it says how to go on
        raise type(error)(f"{error}; the rounds done are in {checkpoint}: resume with the same workbench-args and "
                          "--ckpt_path last") from error
    finally:
        DEPLOYED_GRID.reset(token)
        sys.argv = own_arguments


def write_app(directory: str | Path) -> Path:
    """Write the Flower App that `flwr run` submits to a SuperLink (only a pyproject.toml: the
    apps' code is the installed package); returns its path."""
    path = Path(directory) / "pyproject.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TEMPLATE.read_text())
    return path


def submit(app: str | Path, superlink: str, workbench_args: Sequence[str], poll_s: float = 2.0) -> int:
    """Starts the fit of `workbench_args` on the SuperLink connection `superlink` (a name in
    flwr's config.toml), streams its log and returns 0 when Flower lists the run as completed,
    else 1 (the ServerApp's error printed)."""
    value = shlex.join(workbench_args).replace("\\", "\\\\").replace('"', '\\"')  # a TOML basic string
    started = subprocess.run(["flwr", "run", str(app), superlink, "--format", "json",
                              "--run-config", f'workbench-args="{value}"'], capture_output=True, text=True)
    try:
        run_id = str(json.loads(started.stdout)["run-id"])
    except (ValueError, KeyError, TypeError):
        print(f"flwr run did not start the run:\n{started.stdout}{started.stderr}", file=sys.stderr)
        return 1
    print(f"run {run_id} started on {superlink}", file=sys.stderr, flush=True)
    subprocess.run(["flwr", "log", run_id, superlink, "--stream"])  # returns once the run's log is complete
    while True:
        listed = subprocess.run(["flwr", "ls", superlink, "--run-id", run_id, "--format", "json"],
                                capture_output=True, text=True)
        try:
            status = json.loads(listed.stdout)["runs"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            print(f"flwr ls does not list run {run_id}:\n{listed.stdout}{listed.stderr}", file=sys.stderr)
            return 1
        if str(status["status"]).startswith("finished"):
            break
        time.sleep(poll_s)
    if status["status"] != "finished:completed":
        print(f"run {run_id} {status['status']}: {status.get('status-details', '')}", file=sys.stderr)
        return 1
    print(f"run {run_id} {status['status']}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m workbench.engines.flower.server_app app <folder>`: write the Flower App;
    `... submit <folder> <superlink> -- <fit arguments>`: run a fit on a SuperLink and exit as it ended."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m workbench.engines.flower.server_app", description=main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("app", help="write the Flower App (a pyproject.toml) that flwr run submits")
    command.add_argument("folder")
    command = commands.add_parser("submit", help="flwr run of a fit that exits 0 only when the run completed")
    command.add_argument("folder", help="the Flower App's folder (written by `app`)")
    command.add_argument("superlink", help="the SuperLink connection's name in flwr's config.toml")
    command.add_argument("workbench_args", nargs=argparse.REMAINDER,
                         help="after --: the fit's arguments, as for `python -m workbench fit` (absolute paths)")
    args = parser.parse_args(argv)
    if args.command == "app":
        print(f"wrote {write_app(args.folder)}")
        return 0
    fit_args = args.workbench_args[1:] if args.workbench_args[:1] == ["--"] else args.workbench_args
    return submit(args.folder, args.superlink, fit_args)


if __name__ == "__main__":
    raise SystemExit(main())
