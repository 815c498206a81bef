"""How fast the command line answers, and how fast it refuses a wrong input. Median wall time of
fresh processes (`python -m workbench ...`), with a bare `python -c pass` and `import torch` as
references measured in the same run:

- `--help` (the list of commands) and `fit --help` (a run's keys and where each list is), no torch
  or Lightning imported; `list` (imports the registries, hence torch and Lightning) and
  `fit --help=full` (Lightning's parser);
- each user error the light check (`workbench.command_line`) catches before Lightning is
  imported: a missing or broken `--config`, an unknown method (flag or config, a case-only typo),
  a bad `--engine`/`--wandb` choice, a missing `--ckpt_path`; each also with the light check
  bypassed (the full parser alone, as before it), which must print the very same lines;
- an error only the full parser catches (an unknown model setting), for comparison.

    python benchmarks/cli_start.py [--repeats 3] [--no_full]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, machine_line, write_report

ROOT = Path(__file__).resolve().parents[1]
WORKBENCH = [sys.executable, "-m", "workbench"]
#: the same command line, the light check bypassed: the full parser alone, as before the check
FULL_PARSER = [sys.executable, "-c", "import sys, workbench.__main__ as m; m.check = lambda args: None; "
                                     "sys.exit(m.main(sys.argv[1:]))"]
TINY = ["--config", "configs/synthetic_afl.yaml"]
CONFIGS = {"broken.yaml": "model:\n  class_path: AFL\n  init_args: {gamma: [1,\n",
           "string.yaml": "model: Scaffold\n",
           "engine.yaml": "engine: flwr\n"}


def cases(tmp: Path) -> list[tuple[str, list[str], str]]:
    """(case, the arguments after `python -m workbench`, which path refuses it: light, full or
    help)."""
    out = ["--run_dir", str(tmp / "runs"), "--wandb=disabled"]
    return [
        ("`python -m workbench --help`", ["--help"], "help"),
        ("`python -m workbench list`", ["list"], "help"),
        ("`python -m workbench fit --help`", ["fit", "--help"], "help"),
        ("`python -m workbench fit --help=full`", ["fit", "--help=full"], "help"),
        ("missing --config", ["fit", "--config", str(tmp / "nope.yaml")], "light"),
        ("--config not YAML", ["fit", "--config", str(tmp / "broken.yaml")], "light"),
        ("unknown --model (case only)", ["fit", *TINY, "--model=Scaffold", *out], "light"),
        ("unknown --model (next word)", ["fit", *TINY, "--model", "AFLL", *out], "light"),
        ("unknown `model:` in a config", ["fit", *TINY, "--config", str(tmp / "string.yaml"), *out], "light"),
        ("bad --engine", ["fit", *TINY, "--engine=flwr", *out], "light"),
        ("bad --wandb", ["fit", *TINY, *out, "--wandb=on"], "light"),
        ("bad `engine:` in a config", ["fit", *TINY, "--config", str(tmp / "engine.yaml"), *out], "light"),
        ("missing --ckpt_path", ["test", *TINY, f"--ckpt_path={tmp / 'nothere.ckpt'}", *out], "light"),
        ("unknown model setting (full parser only)", ["fit", *TINY, "--model.num_round=3", *out], "full"),
    ]


def timed(argv: list[str]) -> tuple[float, int, str]:
    """(wall seconds, exit status, what it printed: stdout then stderr)."""
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    return time.perf_counter() - start, done.returncode, done.stdout + done.stderr


def median_of(argv: list[str], repeats: int) -> tuple[float, int, str]:
    """The median wall seconds of `repeats` runs after one warm-up run (the file cache), with the
    last run's status and output."""
    timed(argv)
    runs = [timed(argv) for _ in range(repeats)]
    return statistics.median(t for t, _, _ in runs), runs[-1][1], runs[-1][2]


def shown(args: list[str], tmp: Path) -> str:
    return " ".join(args).replace(str(tmp), "<tmp>").replace(" --run_dir <tmp>/runs --wandb=disabled", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no_full", action="store_true", help="skip the light-path cases' full-parser runs")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cli_start.md"))
    args = parser.parse_args()
    load = load_average()
    rows, light, full_only = [], [], []
    for name, argv in {"`python -c pass`": [sys.executable, "-c", "pass"],
                       "`python -c 'import torch'`": [sys.executable, "-c", "import torch"]}.items():
        seconds, status, printed = median_of(argv, args.repeats)
        rows.append(f"| {name} | reference | {status} | {len(printed.splitlines())} | {seconds:.2f} | | |")
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        for file, text in CONFIGS.items():
            (tmp / file).write_text(text)
        for name, case, path in cases(tmp):
            seconds, status, printed = median_of([*WORKBENCH, *case], args.repeats)
            before, same = "", ""
            if path == "light":
                light.append(seconds)
                if not args.no_full:
                    full_s, full_status, full_printed = median_of([*FULL_PARSER, *case], args.repeats)
                    before = f"{full_s:.2f}"
                    same = "yes" if (full_status, full_printed) == (status, printed) else "**no**"
            elif path == "full":
                full_only.append(seconds)
            label = name if path == "help" else f"{name}: `{shown(case, tmp)}`"
            rows.append(f"| {label} | {path} | {status} | {len(printed.splitlines())} | {seconds:.2f} | {before} | "
                        f"{same} |")
    write_report([
        "# Command line start-up and user errors", "",
        f"Wall seconds of a fresh `python -m workbench ...` process, median of {args.repeats} after one warm-up "
        "run. *path*: who answers — `help` (the command list, or a parser's help), `light` (the light check, "
        "`workbench.command_line`: the standard library and PyYAML, no torch, Lightning or jsonargparse), `full` "
        "(Lightning's parser, after importing torch, Lightning and jsonargparse). *full parser s*: the same "
        "command line with the light check bypassed, as every user error was answered before it; *same lines*: "
        "whether it printed exactly what the light check printed. Lines: stdout and stderr.", "",
        "| case | path | exit | lines | median s | full parser s | same lines |",
        "|---|---|---|---|---|---|---|", *rows, "",
        f"Every light-path case answers in at most {max(light):.2f} s; the error only the full parser catches "
        f"(an unknown model setting, which needs the method's signature) still waits for the imports: "
        f"{max(full_only):.2f} s. The goal, at most 3 s for a user error, holds for the light-path cases only.",
        "",
        machine_line("benchmarks/cli_start.py", load_at_start=load)], args.out)


if __name__ == "__main__":
    main()
