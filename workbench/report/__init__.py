"""The comparison dashboard: `python -m workbench compare RUN_DIR... --out report/`.

Reads runs from their folders (`metrics.csv`, `config.yaml`, `per_client_acc.csv`, `status.json`;
never the W&B server) and writes `report/index.html`, one self-contained interactive page
(`page.py`; what it draws is computed in `dashboard.py`): filters, a table of the settings that
vary with one row per set of repeats (mean ± std over seeds, n shown) and columns to toggle,
group-by any varying key, and figures of one group of comparable runs at a time: accuracy by
round and against cumulative upload (one-round methods as points), final accuracy against
bytes, rounds or time with the group's Pareto front, parallel coordinates of the settings,
accuracy against the Dirichlet α, by depth, and per client; then the failed, refused, running
and stopped runs with their errors, and the re-evaluations beside the fits they re-scored.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from workbench.report.dashboard import score_metric
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
        description="Compare runs: one self-contained interactive HTML page (filters, a table of what "
                    "varies, figures of comparable runs, the unfinished runs with their errors).")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a run folder (<run_dir>/<run_name>/version_N) or any folder above "
                             "run folders; searched recursively for version_N folders and the sweep "
                             "runner's status.json files")
    parser.add_argument("--out", default="report",
                        help="folder for index.html (default: report)")
    parser.add_argument("--group_by", default="method",
                        help=f"colour/marker groups to start with (the page can change it): {', '.join(FIELDS)}, "
                             "or a config key such as model.num_layers (default: method)")
    parser.add_argument("--metric", default="test/acc",
                        help="what runs are ranked by, e.g. test/acc/qda (default: test/acc; under the "
                             "personalized protocol that means test/acc_local_mean)")
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
    from workbench.report.page import write_report

    page = write_report(runs, Path(args.out), metric=args.metric, group_by=args.group_by)
    missing = sum(math.isnan(run.final(score_metric(run.protocol, args.metric))) for run in done)
    again = sum(run.status == "re-evaluation" for run in runs)
    unfinished = len(runs) - len(done) - again
    print(f"compared {len(done)} finished runs -> {page} ({page.stat().st_size / 1e6:.1f} MB)"
          + (f" ({missing} without {args.metric})" if missing else "")
          + (f"; {unfinished} unfinished, listed with their errors" if unfinished else "")
          + (f"; {again} re-evaluations, beside their fits" if again else ""))
    return 0


def group_keys(runs: list[Run]) -> list[str]:
    """What --group_by takes: the table's fields, then every config key of these runs in the
    CLI's short form (`model.num_layers`)."""
    config_keys = {short_key(key) for run in runs for key in flatten(run.config)}
    return [*FIELDS, *sorted(config_keys - set(FIELDS))]
