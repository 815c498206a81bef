"""The deployed ServerApp: the experiment of the run config's `workbench-args`, over its grid.

A SuperLink runs `app` (this module) and the SuperNodes run `client_app:app`; `write_app` writes
the Flower App (`pyproject.toml`) that `flwr run` submits. The ServerApp runs the experiment
(`workbench.experiment.run(["fit", *args, "--engine=flower"])`): its `fit` finds this grid and
sends the rounds over it. The run folder, `model.ckpt` and the logs are written where the
ServerApp runs.

    python -m workbench.engines.flower.server_app app <folder>    # write the Flower App
"""
from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

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


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m workbench.engines.flower.server_app app <folder>`: write the Flower App."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m workbench.engines.flower.server_app", description=main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("app", help="write the Flower App (a pyproject.toml) that flwr run submits")
    command.add_argument("folder")
    args = parser.parse_args(argv)
    print(f"wrote {write_app(args.folder)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
