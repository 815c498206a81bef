"""How fast the command line answers: `--help` (the list of commands, no torch or Lightning
imported), `list` (imports the registries, hence torch and Lightning) and `fit --help` (Lightning's
parser over the Trainer's, the method's and the data's signatures). Median wall time of fresh
processes, with a bare `python -c pass` and `import torch` as references measured in the same run.

    python benchmarks/cli_start.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, machine_line, write_report

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "python -m workbench --help": [sys.executable, "-m", "workbench", "--help"],
    "python -m workbench list": [sys.executable, "-m", "workbench", "list"],
    "python -m workbench fit --help": [sys.executable, "-m", "workbench", "fit", "--help"],
}


def wall_seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cli_start.md"))
    args = parser.parse_args()
    load = load_average()
    rows = []
    for name, argv in COMMANDS.items():
        wall_seconds(argv)  # once to warm the file cache
        times = [wall_seconds(argv) for _ in range(args.repeats)]
        rows.append(f"| `{name}` | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} |")
    write_report(["# Command line start-up", "",
                  f"Wall seconds of a fresh process, median (min, max) of {args.repeats} after one warm-up run.", "",
                  "| command | median s | min s | max s |", "|---|---|---|---|", *rows, "",
                  machine_line("benchmarks/cli_start.py", load_at_start=load)], args.out)


if __name__ == "__main__":
    main()
