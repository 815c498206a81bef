"""Where a gradient method overtakes a one-round head: the learning-rate sweep's kept run, read
from its run folders, and the first round (and upload per client by then) at which its test
accuracy reaches a target — by default AFL's 86.39 % on the same features
(`benchmarks/results/suite.md`; AFL's solution does not depend on the partition or K).

The kept run is the one with the best hold-out accuracy (`stop/best_val_acc`), as the sweep's
metric says: the test split chooses nothing. Every run of the sweep is listed.

    python -m workbench sweep sweeps/gradient_lr.yaml --workers 2
    python benchmarks/overtake.py runs/sweeps/gradient_lr      # writes benchmarks/results/overtake.md
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine_line, write_report
from workbench.report.runs import find_runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", help="the sweep's run folder (runs/sweeps/gradient_lr)")
    parser.add_argument("--target", type=float, default=0.8639, help="test accuracy to reach (default AFL's 0.8639)")
    parser.add_argument("--out", default="benchmarks/results/overtake.md")
    args = parser.parse_args()
    runs = [run for run in find_runs([args.sweep]) if run.status == "done"]
    if not runs:
        parser.error(f"no finished run under {args.sweep}: run the sweep first")
    kept = max(runs, key=lambda run: run.final("stop/best_val_acc"))
    first = runs[0]
    lines = ["# Where a gradient method overtakes a one-round head", "",
             f"{first.method} on {first.dataset}, {first.inputs}, K = {first.num_clients:g}, {first.partition_label}; "
             f"runs of `{args.sweep}`, the kept one (best hold-out accuracy) in bold; target: "
             f"{100 * args.target:.2f} % test accuracy.", "",
             "| lr | hold-out % (best) | rounds (stopped) | test % | round (MB up / client) reaching the target |",
             "|---|---|---|---|---|"]
    for run in sorted(runs, key=lambda run: float(run.value_of("model.local.lr"))):
        curve = run.curve("round/test_acc") or {"round": [], "acc": [], "up": []}
        reached = next((f"{int(r)} ({up / 1e6:.2f} MB)" for r, acc, up in zip(curve["round"], curve["acc"], curve["up"],
                                                                           strict=True) if acc >= args.target),
                       "not reached")
        cells = [f"{float(run.value_of('model.local.lr')):g}", f"{100 * run.final('stop/best_val_acc'):.2f}",
                 f"{run.final('comm/rounds'):.0f}", f"{100 * run.final('test/acc'):.2f}", reached]
        if run is kept:
            cells = [f"**{cell}**" for cell in cells]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", machine_line("read from the run folders")]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
