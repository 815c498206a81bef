"""Entry point of `python -m workbench` and of the `workbench` command."""
from __future__ import annotations

import sys
from importlib import import_module

# Subcommands with parsers of their own. Lightning is not imported for them, so they start fast.
TOOLS = {"sweep": "workbench.sweep", "compare": "workbench.report"}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand: `fit|validate|test` (LightningCLI), `sweep` or `compare`; its exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in TOOLS:
        return import_module(TOOLS[args[0]]).main(args[1:])
    from workbench.cli import main as lightning_main

    lightning_main(argv)  # None: LightningCLI reads sys.argv itself
    return 0


if __name__ == "__main__":
    sys.exit(main())
