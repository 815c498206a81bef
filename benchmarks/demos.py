"""How long each demo config takes: every `configs/*demo*.yaml` fitted as a user runs it,
`python -m workbench fit --config <config>`, each in a fresh process and a fresh working folder
(its runs/ folder), with the feature cache as a user has it after the first run (the first config
warms it; its wall time with an empty cache is the README's first-run figure, not this table's).

For each config: the fit's own clock (`time/fit_s`: the rounds, clients and server), the whole
command's wall time (imports, the data module, the test pass and the run folder included), the test
accuracy and the rounds, from the run's metrics.csv. Goal: every demo fits in ≤ 2 minutes here.

    python benchmarks/demos.py [--repeats 1] [--configs configs/demo.yaml ...]
"""
from __future__ import annotations

import argparse
import csv
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
GOAL_S = 120.0


def demo_configs() -> list[Path]:
    """Every demo config of the repository, `configs/demo.yaml` first."""
    return sorted(ROOT.glob("configs/*demo*.yaml"), key=lambda path: (path.name != "demo.yaml", path.name))


def last_values(metrics_csv: Path) -> dict[str, str]:
    """The last non-empty value of each column of a run's metrics.csv."""
    last: dict[str, str] = {}
    with metrics_csv.open() as file:
        for row in csv.DictReader(file):
            last.update({key: value for key, value in row.items() if value not in ("", None)})
    return last


def fit_once(config: Path, workdir: Path) -> dict[str, float]:
    """One fit of `config` in a fresh process under `workdir`: fit s, wall s, accuracy, rounds."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "workbench", "fit", "--config", str(config)], cwd=workdir,
                          capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "offline"})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{config.name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    metrics = sorted(workdir.glob("runs/*/version_*/metrics.csv"), key=lambda path: path.stat().st_mtime)[-1]
    values = last_values(metrics)
    accuracy = values.get("test/acc", values.get("test/personal_acc", "nan"))
    return {"fit_s": float(values["time/fit_s"]), "wall_s": wall, "accuracy": float(accuracy),
            "rounds": float(values.get("comm/rounds", "nan"))}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="*", type=Path, default=None, help="default: every configs/*demo*.yaml")
    parser.add_argument("--repeats", type=int, default=1, help="fits per config (medians reported)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/demos.md"))
    args = parser.parse_args(argv)
    configs = [path.resolve() for path in args.configs] if args.configs else demo_configs()
    load_at_start = load_average()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            fits = []
            for repeat in range(args.repeats):
                workdir = Path(tmp, f"{config.stem}-{repeat}")
                workdir.mkdir()
                fits.append(fit_once(config, workdir))
            median = {key: statistics.median(fit[key] for fit in fits) for key in fits[0]}
            rows.append((config, median))
            print(f"{config.name}: fit {median['fit_s']:.1f} s, wall {median['wall_s']:.1f} s", flush=True)
    lines = ["# The demo configs: time to fit", "",
             "Each config fitted as a user runs it (`python -m workbench fit --config <config>`), a fresh process "
             "and working folder each, features from the cache (the first config filled it when it was empty). "
             f"fit s: the run's `time/fit_s` (rounds, clients and server); wall s: the whole command (imports, "
             f"data module, test pass, run folder); medians of {args.repeats} fit(s). Goal: fit ≤ {GOAL_S:.0f} s.",
             "", "| config | method | rounds | test accuracy % | fit s | wall s | fit ≤ 2 min |",
             "|---|---|---|---|---|---|---|"]
    for config, median in rows:
        method = next((line.split(":", 1)[1].strip() for line in config.read_text().splitlines()
                       if line.strip().startswith("class_path:")), "?")
        met = "yes" if median["fit_s"] <= GOAL_S else "no"
        lines.append(f"| `configs/{config.name}` | {method} | {median['rounds']:.0f} | "
                     f"{100 * median['accuracy']:.2f} | {median['fit_s']:.2f} | {median['wall_s']:.1f} | {met} |")
    lines += ["", machine_line("python benchmarks/demos.py", load_at_start)]
    return write_report(lines, args.out)


if __name__ == "__main__":
    main()
