"""From a scenario's records to its leaderboard: the choice on the hold-outs, the statistics over
seeds, the tidy results table and the Markdown page.

- **The choice.** For each setting, seed and method, the grid point with the best hold-out
  accuracy (the clients' own held-out rows, scored on the model the fit ended with; ties: the
  grid's first) is that method's run; the test split is only reported. A choice at the end of a
  numeric grid axis is flagged: the grid may be too narrow.
- **Over seeds.** Mean ± sample standard deviation of the chosen runs' test accuracy, and the
  95 % Student-t interval of the mean.
- **Best.** The method with the highest mean is marked best only where a one-sided paired t-test
  over the seeds (the same partitions) puts it above every other method at p < 0.05; the methods
  it cannot be separated from are marked `≈`, and so is it then. The centralized references are ceilings, never best.
- **Reaching the one-round methods.** For each target (a method whose runs take at most two
  rounds, AFL first), the rounds and megabytes up per client a method's learning curve needed to
  reach the target's accuracy on the same seed, averaged over the seeds where it did.
"""
from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from typing import Any

from scipy import stats

from workbench.bench.scenario import REFERENCE, Scenario, setting_label, short
from workbench.report.runs import flatten

SIGNIFICANCE = 0.05
TIDY_COLUMNS = ("scenario", "setting", "seed", "method", "point_label", "status", "chosen", "holdout_acc",
                "test_acc", "best_test_acc", "best_round", "personal_acc", "rounds", "up_mb", "down_mb", "fit_s",
                "wall_s", "error")


def metric_of(scenario: Scenario) -> str:
    """What the leaderboard ranks: the global model's test accuracy, or the mean of the clients'
    own models on their own test rows (personalized)."""
    return "personal_acc" if scenario.protocol == "personalized" else "test_acc"


def choose(records: list[dict[str, Any]]) -> dict[tuple[str, int, str], dict[str, Any]]:
    """(setting, seed, method) -> the chosen record: the best hold-out accuracy, ties to the first."""
    chosen: dict[tuple[str, int, str], dict[str, Any]] = {}
    for record in records:
        if record["status"] != "done":
            continue
        key = (record["setting"], record["seed"], record["method"])
        score = record["holdout_acc"] if math.isfinite(record["holdout_acc"]) else -math.inf
        kept = chosen.get(key)
        if kept is None or score > (kept["holdout_acc"] if math.isfinite(kept["holdout_acc"]) else -math.inf):
            chosen[key] = record
    return chosen


def summary(values: list[float]) -> tuple[float, float, float]:
    """(mean, sample std, half-width of the 95 % t-interval); std and interval NaN for one value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan, math.nan
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, std, float(stats.t.ppf(0.975, n - 1)) * std / math.sqrt(n)


def paired_p(top: list[float], other: list[float]) -> float:
    """One-sided p-value that `top` beats `other` over paired seeds (1 where it cannot be told)."""
    differences = [a - b for a, b in zip(top, other, strict=True)]
    if len(differences) < 2:
        return 1.0
    mean = sum(differences) / len(differences)
    spread = math.sqrt(sum((d - mean) ** 2 for d in differences) / (len(differences) - 1))
    if spread == 0:
        return 0.0 if mean > 0 else 1.0
    t = mean / (spread / math.sqrt(len(differences)))
    return float(stats.t.sf(t, len(differences) - 1))


def edges(scenario: Scenario, method: str, point: dict[str, Any]) -> list[str]:
    """The grid keys whose chosen value is the smallest or largest of a numeric axis of ≥ 2 values
    (but a smallest of 0: no regularizer lies below none)."""
    spec = next((m for m in scenario.rows() if m.name == method), None)
    if spec is None:
        return []
    flagged = []
    for key, values in spec.grid.items():
        numeric = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numeric) == len(values) >= 2 and point.get(key) in {min(numeric), max(numeric)} - {0}:
            flagged.append(key)
    return flagged


def reached(record: dict[str, Any], accuracy: float) -> tuple[float, float] | None:
    """(round, MB up per client) where a run's test curve first reached `accuracy`, or None."""
    for round_index, test_acc, up_mb in record.get("curve") or []:
        if test_acc >= accuracy:
            return round_index, up_mb
    return None


def tidy_csv(records: list[dict[str, Any]]) -> str:
    """A row per run (setting × seed × method × grid point), the chosen ones marked."""
    chosen = {id(record) for record in choose(records).values()}
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=[*TIDY_COLUMNS, "point"], extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for record in records:
        writer.writerow({**record, "chosen": id(record) in chosen,
                         "point": ";".join(f"{k}={short(v)}" for k, v in record["point"].items())})
    return out.getvalue()


def percent(value: float) -> str:
    return "—" if not math.isfinite(value) else f"{100 * value:.2f}"


def number(value: float, digits: int = 1) -> str:
    return "—" if not math.isfinite(value) else f"{value:.{digits}f}"


def mean_of(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def targets_of(scenario: Scenario, chosen: dict[tuple[str, int, str], dict[str, Any]], setting: str) -> list[str]:
    """The one-round methods of a setting (at most two rounds on every seed), AFL first; none where
    no method takes more (there is no curve to reach them on)."""
    rounds: dict[str, list[int]] = defaultdict(list)
    for (where, _, method), record in chosen.items():
        if where == setting and record["class_path"] != REFERENCE:
            rounds[method].append(record["rounds"])
    one_round = [method for method, counts in rounds.items() if max(counts) <= 2]
    if len(one_round) == len(rounds):
        return []
    return sorted(one_round, key=lambda m: (m != "AFL", [s.name for s in scenario.methods].index(m)))[:2]


def setting_table(scenario: Scenario, records: list[dict[str, Any]], setting: str) -> list[str]:
    """One setting's leaderboard: a row per method, over its seeds."""
    chosen = choose(records)
    metric = metric_of(scenario)
    seeds = sorted({seed for (where, seed, _) in chosen if where == setting})
    rows = [spec for spec in scenario.rows() if any((setting, s, spec.name) in chosen for s in seeds)]
    per_method = {spec.name: [chosen[(setting, s, spec.name)] for s in seeds if (setting, s, spec.name) in chosen]
                  for spec in rows}
    # (rounds to a one-round method's accuracy: of the global model's test accuracy, global protocol only)
    targets = targets_of(scenario, chosen, setting) if metric == "test_acc" else []
    # best: the top federated method, if a paired test over the shared seeds separates it from each other
    federated = [m for m in per_method if per_method[m][0]["class_path"] != REFERENCE
                 and all(math.isfinite(r[metric]) for r in per_method[m])]
    means = {m: mean_of([r[metric] for r in per_method[m]]) for m in federated}
    top = max(means, key=means.__getitem__) if means else None
    ties: set[str] = set()
    if top is not None:
        for other in federated:
            if other == top:
                continue
            shared = [s for s in seeds if (setting, s, top) in chosen and (setting, s, other) in chosen]
            p = paired_p([chosen[(setting, s, top)][metric] for s in shared],
                         [chosen[(setting, s, other)][metric] for s in shared])
            if p >= SIGNIFICANCE:
                ties.add(other)
    title = "personal accuracy %" if metric == "personal_acc" else "test accuracy %"
    header = ["method", f"{title} (mean ± std)", "95 % interval", "seeds", "rounds", "MB up / client",
              "MB down / client", "fit s", *[f"rounds (MB up) to {t}'s" for t in targets], "chosen on the hold-outs"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, runs in per_method.items():
        values = [r[metric] for r in runs]
        mean, std, half = summary(values)
        mark = ("≈ " if ties else "**best** ") if method == top else ("≈ " if method in ties else "")
        # (an accuracy's interval ends at 0 and 100 %)
        interval = ("—" if not math.isfinite(half) else
                    f"{100 * max(mean - half, 0.0):.2f} – {100 * min(mean + half, 1.0):.2f}")
        cells = [f"{mark}{method}", f"{percent(mean)} ± {percent(std)}" if math.isfinite(std) else percent(mean),
                 interval, str(len(runs)), number(mean_of([r["rounds"] for r in runs]), 1),
                 number(mean_of([r["up_mb"] for r in runs]), 2), number(mean_of([r["down_mb"] for r in runs]), 2),
                 number(mean_of([r["fit_s"] for r in runs]), 1)]
        for target in targets:
            if method == target or runs[0]["class_path"] == REFERENCE:
                cells.append("—")
                continue
            hits = [reached(r, chosen[(setting, r["seed"], target)]["test_acc"]) for r in runs
                    if (setting, r["seed"], target) in chosen]
            found = [hit for hit in hits if hit is not None]
            cells.append("not reached" if not found else
                         f"{mean_of([h[0] for h in found]):.0f} ({mean_of([h[1] for h in found]):.2f}) "
                         f"on {len(found)}/{len(hits)}")
        picks: dict[str, int] = defaultdict(int)
        has_grid = any(len(spec.points()) > 1 for spec in scenario.rows() if spec.name == method)
        for r in runs:
            flagged = edges(scenario, method, r["point"])
            unscored = has_grid and not math.isfinite(r["holdout_acc"])
            picks[r["point_label"] + (f" (edge: {', '.join(flagged)})" if flagged else "")
                  + (" (no hold-out score: the grid's first)" if unscored else "")] += 1
        cells.append("; ".join(f"{label} ×{count}" if len(runs) > 1 else label for label, count in picks.items()))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def error_lines(records: list[dict[str, Any]]) -> list[str]:
    """One line per setting and error (a setting whose data cannot be built fails every run alike)."""
    by_error: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_error[(r["setting"], r["error"])].append(r)
    lines = []
    for (setting, error), runs in by_error.items():
        if len(runs) == 1:
            what = f"{runs[0]['method']} [{runs[0]['point_label']}] seed {runs[0]['seed']}"
        else:
            seeds = ", ".join(str(seed) for seed in sorted({r["seed"] for r in runs}))
            what = f"{len(runs)} runs ({', '.join(dict.fromkeys(r['method'] for r in runs))}; seeds {seeds})"
        lines.append(f"- {setting}, {what}: {error}")
    return [*lines, ""]


def render(scenario: Scenario, records: list[dict[str, Any]]) -> str:
    """The scenario's Markdown page."""
    done = [r for r in records if r["status"] == "done"]
    failed = [r for r in records if r["status"] == "failed"]
    diverged = [r for r in records if r["status"] == "diverged"]
    lines = [f"# Leaderboard: {scenario.name}", ""]
    if scenario.title:
        lines += [scenario.title, ""]
    data = ", ".join(f"{key} {short(value)}" for key, value in flatten(scenario.data).items())
    lines += [f"Data: {data}; each client holds out {100 * scenario.holdout:g} % of its share (stratified), "
              f"the hold-outs every choice is made on; seeds {', '.join(map(str, scenario.seeds))} (the partition's "
              f"and each method's). Budget: at most {scenario.budget.rounds} rounds, stopped after "
              f"{scenario.budget.patience} rounds without a gain of {100 * scenario.budget.min_delta:g} point of "
              f"hold-out accuracy. Protocol: {scenario.protocol}.", ""]
    lines += ["Grids (every combination; the chosen point per seed is in the last column):", ""]
    solved_again = {record["method"] for record in done if record.get("solved_from")}
    for spec in scenario.rows():
        grid = "; ".join(f"{key} ∈ {{{', '.join(map(short, values))}}}" for key, values in spec.grid.items())
        if spec.name in solved_again:  # (`MethodSpec.shares_fit`)
            grid += " (one fit a cell, solved again at the other points)"
        fixed = ", ".join(f"{key} {short(value)}" for key, value in flatten(spec.init_args).items() if key != "kind")
        lines.append(f"- {spec.name} (`{spec.class_path}`): {grid or 'no grid'}" + (f"; {fixed}" if fixed else ""))
    lines.append("")
    by_setting: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in done:
        by_setting[record["setting"]].append(record)
    for setting in [setting_label(s) for s in scenario.settings]:
        if setting not in by_setting:
            continue
        cell_seconds: dict[Any, float] = defaultdict(float)
        for record in by_setting[setting]:
            cell_seconds[record["seed"]] += record["wall_s"]
        per_cell = sum(cell_seconds.values()) / len(cell_seconds)
        lines += [f"## {setting}", "",
                  f"{len(cell_seconds)} seeds; one cell (every method with its grid, one seed) took {per_cell:.0f} s "
                  f"on average ({max(cell_seconds.values()):.0f} s at most):", ""]
        lines += setting_table(scenario, by_setting[setting], setting)
        lines.append("")
    if diverged:
        lines += ["## Diverged runs", "",
                  "Stopped by the round's check for non-finite uploads; a grid point that diverges is never chosen.",
                  ""]
        lines += error_lines(diverged)
    if failed:
        lines += ["## Failed runs", ""]
        lines += error_lines(failed)
    machines = sorted({r["machine"] for r in done if "machine" in r})
    lines += [f"Machine: {machine}." for machine in machines] + [""]
    return "\n".join(lines)
