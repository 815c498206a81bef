"""Time to accuracy on the clients' links: every method of a leaderboard cell, at the settings its
hold-outs chose there, refitted under each systems preset with and without a round deadline.

The simulated clock (`workbench.federation.systems`) gives every client a link and a device drawn
from the preset; a round lasts until its slowest client has downloaded, computed and uploaded (or
until the deadline, past which late clients are dropped as stragglers). For each method and
preset the table gives the final accuracy, the simulated time to reach AFL's accuracy (AFL's own,
under the same preset and deadline, same seed) and the whole fit's simulated time; the figure
draws accuracy against simulated time.

    python benchmarks/time_to_accuracy.py                        # mnist5k, K = 10, α = 0.5, 3 seeds
    python benchmarks/time_to_accuracy.py --seeds 0 --workers 1  # one seed
    python benchmarks/time_to_accuracy.py --smoke --out /tmp/tta.md   # synthetic data, a minute

The chosen settings are the scenario's committed leaderboard's (benchmarks/results/leaderboard/
<scenario>/results.csv, its `chosen` column); the deadlines are this script's (`--deadline`), the
same for every method.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import load_average, machine_line, write_report
from workbench.bench.runner import DataModules, fit_method, quiet
from workbench.bench.scenario import Run, Scenario, load_scenario, setting_label
from workbench.federation.systems import PRESETS, EveryClientLate, Systems

ROOT = Path(__file__).resolve().parents[1]
#: simulated seconds a round may last under each preset (an order of magnitude above a light
#: round's median: FedAvg's 0.3 MB on a median cellular link takes 0.3 s, AFL's 6.7 MB 5 s)
DEADLINES = {"cellular": 10.0, "wifi": 2.0, "datacenter": 0.5}


def chosen_runs(scenario: Scenario, setting: str, seeds: list[int], table: Path) -> list[Run]:
    """The runs the hold-outs chose in the committed leaderboard: one per method and seed."""
    with table.open() as rows:
        chosen = {(row["method"], int(row["seed"])): row["point_label"] for row in csv.DictReader(rows)
                  if row["setting"] == setting and row["chosen"] == "True"}
    runs = {(run.method.name, run.seed): run for run in scenario.runs()
            if setting_label(run.setting) == setting and run.seed in seeds and not run.method.is_reference
            and chosen.get((run.method.name, run.seed)) == run.point_label}
    missing = [(method.name, seed) for method in scenario.methods for seed in seeds if (method.name, seed) not in runs]
    if missing:
        raise SystemExit(f"{table} holds no chosen run of {missing} at {setting!r}: run "
                         f"`python -m workbench bench {scenario.path}` first")
    return [runs[method.name, seed] for method in scenario.methods for seed in seeds]


_WORKER: dict[str, Any] = {}


def _start(scenario: Scenario, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    quiet()
    _WORKER.update(scenario=scenario, modules=DataModules(scenario), folder=Path(tempfile.mkdtemp()))


def _fit(job: tuple[Run, str, float | None]) -> dict[str, Any]:
    run, preset, deadline = job
    scenario = _WORKER["scenario"]
    folder = _WORKER["folder"] / f"{run.method.name}-{run.seed}-{preset}-{deadline}"
    start = time.perf_counter()
    what = {"method": run.method.name, "seed": run.seed, "point": run.point_label, "preset": preset,
            "deadline_s": deadline}
    try:
        record = fit_method(scenario, run, _WORKER["modules"].get(run), folder,
                            systems=Systems(preset=preset, deadline_s=deadline, seed=run.seed))
    except EveryClientLate as late:  # an outcome: no client can send this method's message in time
        return {**what, "late": str(late), "wall_s": time.perf_counter() - start}
    return {**what, "wall_s": time.perf_counter() - start,
            **{key: record[key] for key in ("test_acc", "rounds", "up_mb", "latency_s", "stragglers", "row_s",
                                            "latency_curve")}}


def run_all(scenario: Scenario, runs: list[Run], presets: list[str], deadlines: dict[str, float],
            workers: int) -> list[dict[str, Any]]:
    jobs = [(run, preset, deadline) for preset in presets for deadline in (None, deadlines[preset]) for run in runs]
    threads = max(1, (os.cpu_count() or 1) // workers)
    records = []
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
                             initargs=(scenario, threads)) as pool:
        for record in pool.map(_fit, jobs):
            records.append(record)
            if "late" in record:
                print(f"{record['method']:10s} seed {record['seed']} {record['preset']:10s} deadline "
                      f"{record['deadline_s']}: {record['late']}", flush=True)
                continue
            print(f"{record['method']:10s} seed {record['seed']} {record['preset']:10s} deadline "
                  f"{record['deadline_s']}: {100 * record['test_acc']:.2f} %, {record['latency_s']:,.1f} s simulated, "
                  f"{record['stragglers']} stragglers ({record['wall_s']:.1f} s)", flush=True)
    return records


def time_to(curve: list[list[float]], accuracy: float) -> float:
    """The simulated seconds at the first scored round whose test accuracy reaches `accuracy`."""
    return next((seconds for _, acc, seconds in curve if acc >= accuracy - 1e-12), math.inf)


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (preset, deadline, method): means over the seeds that finished; time to AFL's
    accuracy of the same seed and protocol (its median over the seeds that reached it, and how
    many did); `late`: the seeds where no client could reply before the deadline."""
    # AFL's accuracy as its curve scored it (the test step's float32 mean may differ in the last digit)
    afl = {(r["preset"], r["deadline_s"], r["seed"]): r["latency_curve"][-1][1] for r in records
           if r["method"] == "AFL" and "late" not in r}
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["preset"], record["deadline_s"], record["method"]), []).append(record)
    rows = []
    for (preset, deadline, method), members in groups.items():
        done = [r for r in members if "late" not in r]
        reach = [time_to(r["latency_curve"], afl.get((preset, deadline, r["seed"]), math.inf)) for r in done]
        reached = [seconds for seconds in reach if math.isfinite(seconds)]
        row = {"preset": preset, "deadline_s": deadline, "method": method, "seeds": len(members),
               "late": len(members) - len(done), "reached": len(reached),
               "to_afl_s": statistics.median(reached) if reached else math.inf}
        if done:
            accuracies = [r["test_acc"] for r in done]
            row.update(acc=statistics.mean(accuracies),
                       acc_std=statistics.stdev(accuracies) if len(done) > 1 else 0.0,
                       rounds=statistics.mean(r["rounds"] for r in done),
                       up_mb=statistics.mean(r["up_mb"] for r in done),
                       latency_s=statistics.median(r["latency_s"] for r in done),
                       stragglers=sum(r["stragglers"] for r in done),
                       row_us=1e6 * statistics.median(r["row_s"] for r in done))
        rows.append(row)
    return rows


def seconds(value: float) -> str:
    if not math.isfinite(value):
        return "—"
    return f"{value:,.0f} s" if value >= 100 else f"{value:.3g} s"


def report(rows: list[dict[str, Any]], scenario: Scenario, setting: str, seeds: list[int],
           deadlines: dict[str, float], figure: Path | None, wall_s: float, machine: str) -> list[str]:
    lines = [f"# Time to accuracy on the clients' links: {scenario.name}, {setting}", "",
             f"Generated by `python benchmarks/time_to_accuracy.py` in {wall_s / 60:.1f} min. Each method at the "
             "grid point its hold-outs chose in the committed leaderboard "
             f"({scenario.name}, seeds {', '.join(map(str, seeds))}), refitted under each preset of "
             "`workbench.federation.systems` (the profiles drawn per client from the partition seed), without "
             "a deadline and with one. Accuracy: mean ± std over the seeds; times: medians over the seeds; "
             "*to AFL* is the simulated time until the method's learning curve first reaches AFL's final "
             "accuracy under the same preset and deadline (seeds that reached it / all); *compute* is this "
             "machine's seconds per training row of the method's client step, measured once per fit.", ""]
    for preset in PRESETS:
        for deadline in (None, deadlines.get(preset)):
            group = [r for r in rows if r["preset"] == preset and r["deadline_s"] == deadline]
            if not group:
                continue
            p = PRESETS[preset]
            rule = f"deadline {deadline:g} s" if deadline is not None else "no deadline"
            lines += [f"## {preset}: {p.down_mbps:g}/{p.up_mbps:g} Mbit/s, RTT {p.rtt_ms:g} ms, speed {p.speed:g}×, "
                      f"spread {p.spread:g}; {rule}", "",
                      "| method | accuracy | rounds | up MB / client | simulated time | to AFL's accuracy | reached "
                      "| stragglers (client-rounds, all seeds) | compute µs/row |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for r in sorted(group, key=lambda r: (r["to_afl_s"], -r.get("acc", -1.0))):
                if "acc" not in r:
                    lines.append(f"| {r['method']} | no client replies before the deadline | | | | | "
                                 f"0/{r['seeds']} | all | |")
                    continue
                late = f" ({r['late']} of {r['seeds']} seeds: no client in time)" if r["late"] else ""
                lines.append(f"| {r['method']} | {100 * r['acc']:.2f} ± {100 * r['acc_std']:.2f} %{late} | "
                             f"{r['rounds']:.0f} | {r['up_mb']:.3g} | {seconds(r['latency_s'])} | "
                             f"{seconds(r['to_afl_s'])} | "
                             f"{r['reached']}/{r['seeds']} | {r['stragglers']:.0f} | {r['row_us']:.1f} |")
            lines.append("")
    if figure is not None:
        lines += [f"The figure, accuracy against simulated time for seed {min(seeds)}: `{figure.relative_to(ROOT)}`"
                  if figure.is_relative_to(ROOT) else f"The figure: `{figure}`", ""]
    return [*lines, machine]


def draw(records: list[dict[str, Any]], presets: list[str], seed: int, path: Path) -> None:
    """Accuracy against simulated time, a panel per preset (seed `seed`): solid without a
    deadline, dashed with it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(presets), figsize=(5.2 * len(presets), 4.2), sharey=True)
    axes = axes if len(presets) > 1 else [axes]
    methods = list(dict.fromkeys(r["method"] for r in records))  # the scenario's order: analytic ones first
    palette = [*plt.get_cmap("tab10").colors, "black"]
    colors = {method: palette[i % len(palette)] for i, method in enumerate(methods)}
    for axis, preset in zip(axes, presets, strict=True):
        for record in records:
            if record["preset"] != preset or record["seed"] != seed or "late" in record:
                continue
            curve = record["latency_curve"]
            style = "--" if record["deadline_s"] is not None else "-"
            marker = "o" if len(curve) == 1 else None
            axis.plot([c[2] for c in curve], [100 * c[1] for c in curve], style, marker=marker,
                      color=colors[record["method"]], label=record["method"] if record["deadline_s"] is None else None)
        axis.set_xscale("log")
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decades only: no crowded labels
        axis.set_title(preset)
        axis.set_xlabel("simulated seconds (log)")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    low = min(100 * c[1] for r in records if r["seed"] == seed and "late" not in r for c in r["latency_curve"])
    axes[0].set_ylim(max(low, 50), None)
    axes[-1].legend(fontsize=7, loc="lower right")
    figure.suptitle(f"accuracy against simulated time (seed {seed}; dashed: with the deadline)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(ROOT / "benchmarks/scenarios/mnist5k.yaml"))
    parser.add_argument("--setting", default="K=10 dirichlet α=0.5")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--deadline", nargs="+", default=[], metavar="PRESET=SECONDS",
                        help=f"a preset's round deadline (default {DEADLINES})")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="synthetic data and two methods: seconds")
    parser.add_argument("--records", help="render the tables and the figure from an earlier run's records "
                                          "(its .json beside the tables) instead of fitting")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/time_to_accuracy.md"))
    parser.add_argument("--figure", default=str(ROOT / "docs/images/time_to_accuracy.png"),
                        help="where the figure goes (docs/latency.md shows it)")
    args = parser.parse_args()
    deadlines = {**DEADLINES, **{k: float(v) for k, v in (item.split("=") for item in args.deadline)}}
    start, load_at_start = time.perf_counter(), load_average()
    scenario = load_scenario(args.scenario)
    if args.smoke:
        runs = smoke_runs()
        scenario = runs[0][0]
        jobs = [run for _, run in runs]
    else:
        table = ROOT / "benchmarks/results/leaderboard" / scenario.name / "results.csv"
        jobs = chosen_runs(scenario, args.setting, args.seeds, table)
    if args.records:  # as that run wrote them: its records, wall time and machine
        saved = json.loads(Path(args.records).read_text())
        records, wall_s, machine = saved["records"], saved["wall_s"], saved["machine"]
    else:
        records = run_all(scenario, jobs, args.presets, deadlines, args.workers)
        threads = max(1, (os.cpu_count() or 1) // args.workers)
        wall_s = time.perf_counter() - start
        machine = machine_line(f"{args.workers} worker processes of {threads} thread{'s' * (threads > 1)} each",
                               load_at_start)
    out, figure = Path(args.out), Path(args.figure).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.parent.mkdir(parents=True, exist_ok=True)
    draw(records, args.presets, min(r["seed"] for r in records), figure)
    if not args.records:
        out.with_suffix(".json").write_text(json.dumps({"wall_s": wall_s, "machine": machine, "records": records},
                                                       indent=1, default=float) + "\n")
    write_report(report(summarize(records), scenario, setting_label(jobs[0].setting), sorted({r.seed for r in jobs}),
                        deadlines, figure, wall_s, machine), out)


def smoke_runs() -> list[tuple[Scenario, Run]]:
    """A tiny synthetic scenario (AFL and FedAvg, 5 rounds): the script end to end in seconds."""
    import yaml

    text = {"name": "smoke", "data": {"dataset": "synthetic", "synthetic": {"num_classes": 4, "dim": 8,
                                                                           "train_size": 400, "test_size": 100}},
            "settings": {"num_clients": 5, "partition": "iid"}, "seeds": [0], "budget": {"rounds": 5},
            "references": {"enabled": False},
            "methods": {"AFL": {"class_path": "AFL"},
                        "FedAvg": {"class_path": "FedAvg", "init_args": {"architecture": "linear",
                                                                          "local": {"lr": 0.1}}}}}
    path = Path(tempfile.mkdtemp()) / "smoke.yaml"
    path.write_text(yaml.safe_dump(text))
    scenario = load_scenario(path)
    return [(scenario, run) for run in scenario.runs()]


if __name__ == "__main__":
    main()
