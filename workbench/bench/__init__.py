"""`python -m workbench bench benchmarks/scenarios/X.yaml`: a scenario's leaderboard.

Runs every setting × seed × method × grid point of the scenario (`workbench.bench.scenario`)
that is not recorded yet, then writes, in `--out` (default
`benchmarks/results/leaderboard/<name>/`):

    results.jsonl    every run's record, appended as it ends (what a rerun resumes from)
    results.csv      the tidy table: a row per run, the runs chosen on the hold-outs marked
    leaderboard.md   a table per setting: mean ± std over seeds, 95 % intervals, paired best

and, under `--run_dir` (default `runs/bench/<name>/`), each fit's run folder for
`python -m workbench compare`. Options:

    --workers N        N processes at a time, each with its share of the cores
    --methods A B      only these rows (the others' records are kept)
    --seeds 0 1        only these seeds
    --retry_failed     run the failed runs again (not the diverged: their outcome is recorded)
    --dry_run          list what would run, run nothing
    --render           only rewrite results.csv and leaderboard.md from results.jsonl
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

from workbench.bench.scenario import ScenarioError, load_scenario, setting_label


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workbench bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", help="a scenario file, e.g. benchmarks/scenarios/mnist5k.yaml")
    p.add_argument("--out", help="where results.jsonl, results.csv and leaderboard.md go "
                                 "(default benchmarks/results/leaderboard/<name>)")
    p.add_argument("--run_dir", help="where each fit's run folder goes (default runs/bench/<name>)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--methods", nargs="+", metavar="NAME")
    p.add_argument("--seeds", nargs="+", type=int, metavar="SEED")
    p.add_argument("--retry_failed", action="store_true")
    p.add_argument("--dry_run", action="store_true")
    p.add_argument("--render", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.workers < 1:
        print(f"error: --workers must be ≥ 1, got {args.workers}", file=sys.stderr)
        return 2
    names = [spec.name for spec in scenario.rows()]
    if unknown := set(args.methods or []) - set(names):
        print(f"error: --methods {sorted(unknown)} are not in {args.scenario}; it has {', '.join(names)}",
              file=sys.stderr)
        return 2
    os.environ.setdefault("WANDB_MODE", "disabled")
    from workbench.bench.leaderboard import render, tidy_csv
    from workbench.bench.runner import describe, latest, read_records, run_all
    from workbench.files import write_text_atomically

    out = Path(args.out or Path("benchmarks/results/leaderboard") / scenario.name)
    run_dir = Path(args.run_dir or Path("runs/bench") / scenario.name)
    results = out / "results.jsonl"
    recorded = latest(read_records(results))
    runs = [run for run in scenario.runs()
            if (args.methods is None or run.method.name in args.methods)
            and (args.seeds is None or run.seed in args.seeds)]
    # a run never recorded, or a failed one when asked (done and diverged runs are outcomes)
    rerun = {None, "failed"} if args.retry_failed else {None}
    pending = [run for run in runs if recorded.get(run.key(scenario), {}).get("status") in rerun]
    print(f"{scenario.name}: {len(runs)} runs, {len(runs) - len(pending)} recorded, {len(pending)} to run "
          f"({len(scenario.settings)} settings × {len(scenario.seeds)} seeds × {len(names)} rows with their grids)")
    if args.dry_run:
        for run in pending:
            print(f"  {run.method.name} [{run.point_label}] {setting_label(run.setting)} seed {run.seed}")
        return 0
    if not args.render and pending:
        from tqdm import tqdm

        start, outcomes = time.perf_counter(), Counter[str]()
        with tqdm(total=len(pending), unit="run", file=sys.stderr, dynamic_ncols=True) as bar:
            for record in run_all(scenario, pending, results, run_dir, workers=args.workers):
                outcomes[record["status"]] += 1
                bar.write(describe(record))
                bar.update()
        print(f"ran {len(pending)} runs in {time.perf_counter() - start:.0f} s ({outcomes['failed']} failed, "
              f"{outcomes['diverged']} diverged)")
    # the scenario's runs as they stand: each current key's last record (an edited scenario's old keys drop out)
    keys = {run.key(scenario) for run in scenario.runs()}
    current = [record for key, record in latest(read_records(results)).items() if key in keys]
    write_text_atomically(out / "results.csv", tidy_csv(current))
    write_text_atomically(out / "leaderboard.md", render(scenario, current))
    print(f"wrote {out / 'leaderboard.md'} and {out / 'results.csv'}; run folders in {run_dir}")
    return 1 if any(record["status"] == "failed" for record in current) else 0
