"""The comparison dashboard: `python -m workbench compare RUN_DIR... --out report/`.

Reads finished runs from their folders (`metrics.csv`, `config.yaml`, `per_client_acc.csv`;
never the W&B server) and writes `report/index.html`, one self-contained page with a sortable
table and the figures, beside the figures' PNG files:
accuracy against upload bytes, accuracy against the Dirichlet α (the invariance picture),
accuracy by depth or round, and per-client accuracy of personalized runs.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from workbench.report.runs import Run, find_runs, last_value, read_metrics

__all__ = ["Run", "find_runs", "last_value", "main", "read_metrics"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workbench compare",
        description="Compare finished runs: one HTML page (sortable table, figures) plus PNGs.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a run folder (<run_dir>/<run_name>/version_N) or any folder above "
                             "run folders; searched recursively for metrics.csv")
    parser.add_argument("--out", default="report",
                        help="folder for index.html and the PNGs (default: report)")
    parser.add_argument("--group_by", default="method",
                        help="colour/marker groups: method, dataset, backbone, partition, alpha, "
                             "K, or a config key such as model.num_layers (default: method)")
    parser.add_argument("--metric", default="test/acc",
                        help="the accuracy column and y axis, e.g. test/acc_local_mean "
                             "(default: test/acc)")
    args = parser.parse_args(argv)
    try:
        runs = find_runs(args.run_dirs)
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    logged = {key for run in runs for row in run.rows for key in row}
    if args.metric not in logged:
        parser.error(f"no run logged {args.metric!r}; choose --metric among "
                     f"{', '.join(sorted(k for k in logged if k not in ('epoch', 'step')))}")
    from workbench.report.page import write_report  # matplotlib is imported only here

    page = write_report(runs, Path(args.out), metric=args.metric, group_by=args.group_by)
    missing = sum(math.isnan(run.final(args.metric)) for run in runs)
    print(f"compared {len(runs)} runs -> {page}" +
          (f" ({missing} without {args.metric})" if missing else ""))
    return 0
