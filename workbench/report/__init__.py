"""The comparison dashboard: `python -m workbench compare RUN_DIR... --out report/`.

Reads runs from their folders (`metrics.csv`, `config.yaml`, `per_client_acc.csv`, the sweep
runner's `status.json`; never the W&B server) and writes `report/index.html`, one
self-contained page beside the figures' PNG files: a sortable table with one row per setting
(repeats over seeds as mean ± std, n shown), the unfinished runs with their errors, and
accuracy against upload bytes (with the Pareto front), against wall and fit time, against the
Dirichlet α (the invariance picture), per round against cumulative bytes, by depth or round,
and per client for personalized runs.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from workbench.report.runs import (
    FIELDS,
    Run,
    find_runs,
    flatten,
    last_value,
    read_metrics,
    short_key,
)

__all__ = ["Run", "find_runs", "group_keys", "last_value", "main", "read_metrics"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workbench compare",
        description="Compare runs: one HTML page (sortable table, figures, the unfinished runs "
                    "with their errors) plus PNGs.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a run folder (<run_dir>/<run_name>/version_N) or any folder above "
                             "run folders; searched recursively for version_N folders and the sweep "
                             "runner's status.json files")
    parser.add_argument("--out", default="report",
                        help="folder for index.html and the PNGs (default: report)")
    parser.add_argument("--group_by", default="method",
                        help=f"colour/marker groups: {', '.join(FIELDS)}, or a config key such as "
                             "model.num_layers (default: method)")
    parser.add_argument("--metric", default="test/acc",
                        help="the accuracy column and y axis, e.g. test/acc_local_mean "
                             "(default: test/acc)")
    args = parser.parse_args(argv)
    try:
        runs = find_runs(args.run_dirs)
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    done = [run for run in runs if run.status == "done"]
    logged = {key for run in done for row in run.rows for key in row}
    if done and args.metric not in logged:
        parser.error(f"no run logged {args.metric!r}; choose --metric among "
                     f"{', '.join(sorted(k for k in logged if k not in ('epoch', 'step')))}")
    keys = group_keys(done)
    if done and short_key(args.group_by) not in keys and args.group_by != "num_clients":
        parser.error(f"no run has {args.group_by!r}; choose --group_by among {', '.join(keys)}")
    from workbench.report.page import write_report  # matplotlib is imported only here

    page = write_report(runs, Path(args.out), metric=args.metric, group_by=args.group_by)
    missing = sum(math.isnan(run.final(args.metric)) for run in done)
    print(f"compared {len(done)} finished runs -> {page}"
          + (f" ({missing} without {args.metric})" if missing else "")
          + (f"; {len(runs) - len(done)} unfinished, listed with their errors" if len(done) < len(runs) else ""))
    return 0


def group_keys(runs: list[Run]) -> list[str]:
    """What --group_by takes: the table's fields, then every config key of these runs in the
    CLI's short form (`model.num_layers`)."""
    config_keys = {short_key(key) for run in runs for key in flatten(run.config)}
    return [*FIELDS, *sorted(config_keys - set(FIELDS))]
