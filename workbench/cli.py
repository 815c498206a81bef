"""Command line: `python -m workbench fit|validate|test --config configs/X.yaml`.

(`sweep` and `compare` are dispatched before this module is imported: see `__main__.py`; the
config's parsing and the run live in `workbench.experiment`.)
"""
from __future__ import annotations

from workbench.experiment import WorkbenchCLI, run


def main(args: list[str] | None = None) -> WorkbenchCLI:
    """Runs `fit|validate|test` with `args` (default: the command line); returns the finished CLI."""
    return run(args)


if __name__ == "__main__":
    main()
