"""Entry point of `python -m workbench` and of the `workbench` command.

Each command imports only what it needs: the list of commands answers without torch or
Lightning, `sweep`, `compare` and `list` have parsers of their own, and `fit|validate|test`
start Lightning's, once `workbench.command_line` has checked what it can without it (a missing or
broken config, an unknown method or choice, a missing checkpoint: refused in a fraction of a
second). A wrong input (a setting, a file, a missing extra) ends in a few lines naming
the fix and exit status 2; `--debug` shows its traceback instead.
"""
from __future__ import annotations

import os
import sys
from importlib import import_module

from workbench.command_line import check, short_help
from workbench.console import COMMANDS, DEBUG_ENV, DEBUG_FLAG, print_user_error, usage, user_error

# Subcommands with parsers of their own; Lightning is not imported for them.
TOOLS = {"bench": "workbench.bench", "sweep": "workbench.sweep", "compare": "workbench.report",
         "list": "workbench.catalog", "sync": "workbench.sync"}


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    if DEBUG_FLAG in args:
        args.remove(DEBUG_FLAG)
        os.environ[DEBUG_ENV] = "1"
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    command = args[0]
    if command not in COMMANDS:
        print(f"{usage()}\nerror: unknown command {command!r}", file=sys.stderr)
        return 2
    if any(arg in ("-h", "--help") for arg in args[1:]) and command not in TOOLS:
        print(short_help(command, COMMANDS[command]))
        return 0
    args = [("--help" if arg == "--help=full" else arg) for arg in args]  # Lightning's parser in full
    try:
        if command in TOOLS:
            return import_module(TOOLS[command]).main(args[1:])
        refused = check(args)  # a user error seen without importing Lightning: its lines now
        if refused is not None:
            print(refused, file=sys.stderr)
            return 2
        from workbench.cli import main as lightning_main

        lightning_main(args)
        return 0
    except SystemExit as stop:  # a parser's error or --help, or a fit stopped by a signal
        return stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except Exception as error:
        found = None if os.environ.get(DEBUG_ENV) else user_error(error)
        if found is None:
            raise
        print_user_error(found)
        return 2


if __name__ == "__main__":
    sys.argv[0] = "python -m workbench"  # argparse's prog: every usage line reads as the command typed
    sys.exit(main())
