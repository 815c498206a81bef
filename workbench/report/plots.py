"""The dashboard's figures as PNG files, one colour and marker per group (e.g. per method).

Drawn on bare `matplotlib.figure.Figure`s (the Agg canvas, no pyplot state, no display needed).
Each function returns the PNG it wrote, or None when no run has what the figure shows.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from workbench.report.runs import Run, differences, mean_std, repeats

ALPHA_KEYS = ("data.init_args.alpha",)  # a line over α joins runs that differ only there

COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
           "tab:pink", "tab:gray", "tab:olive", "tab:cyan")
MARKERS = "os^Dv<>PX*"
LINESTYLES = ("-", "--", ":", "-.")


def label(value: Any) -> str:
    """A group value as text: 10.0 -> '10', None -> '—'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return "+".join(map(str, value))
    return str(value)


def group_styles(runs: list[Run], group_by: str) -> dict[str, dict[str, str]]:
    """Group label -> matplotlib style (colour, marker), in sorted order of the labels."""
    groups = sorted({label(run.value_of(group_by)) for run in runs})
    return {group: {"color": COLOURS[i % len(COLOURS)], "marker": MARKERS[i % len(MARKERS)]}
            for i, group in enumerate(groups)}


def _finite(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def _sortable(value: float) -> float:
    return math.inf if math.isnan(value) else value


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both counts (fewer bytes, higher accuracy), by bytes."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda point: (point[0], -point[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


def _aggregated(runs: list[Run], x_of: Callable[[Run], float], metric: str,
                group_by: str) -> dict[str, list[tuple[float, float, float, int]]]:
    """Group label -> (x mean, metric mean, metric std, n) per set of repeats with finite values."""
    by_group: dict[str, list] = defaultdict(list)
    for same in repeats(runs):
        x, _, _ = mean_std([x_of(run) for run in same])
        y, std, n = mean_std([run.final(metric) for run in same])
        if n and math.isfinite(x) and x > 0:
            by_group[label(same[0].value_of(group_by))].append((x, y, std, n))
    return by_group


def _scatter(ax, points, style, name) -> None:
    xs, ys, stds, _ = zip(*points, strict=True)
    ax.errorbar(xs, ys, yerr=stds, linestyle="none", markersize=6, capsize=3, alpha=0.85,
                label=name, **style)


def accuracy_vs_bytes(runs: list[Run], metric: str, group_by: str, path: Path) -> Path | None:
    """Final metric (mean ± std over seeds) against bytes uploaded per client, log x axis, with
    the Pareto front (fewest bytes for the accuracy) drawn through the points it keeps."""
    by_group = _aggregated(runs, lambda run: run.final("comm/bytes_up_per_client"), metric, group_by)
    if not by_group:
        return None
    styles = group_styles(runs, group_by)
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for group, points in sorted(by_group.items()):
        _scatter(ax, points, styles[group], group)
    front = pareto_front([(x, y) for points in by_group.values() for x, y, _, _ in points])
    ax.plot(*zip(*front, strict=True), color="black", linestyle="--", drawstyle="steps-post", linewidth=1,
            marker="o", markerfacecolor="none", markersize=11, label="Pareto front")
    ax.set(xscale="log", xlabel="bytes uploaded per client (log scale)", ylabel=metric,
           title=f"{metric} against communication")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title=group_by, fontsize="small")
    return _save(fig, path)


def accuracy_vs_time(runs: list[Run], metric: str, group_by: str, path: Path) -> Path | None:
    """Final metric against end-to-end wall time (imports, extraction, engine start) and,
    beside it, the fit's own time; log x axes."""
    panels = [("wall time, end to end (s)", lambda run: run.wall_seconds),
              ("fit time (s)", lambda run: run.final("time/fit_s"))]
    drawn = [(name, _aggregated(runs, x_of, metric, group_by)) for name, x_of in panels]
    if not any(by_group for _, by_group in drawn):
        return None
    styles = group_styles(runs, group_by)
    fig = Figure(figsize=(12.8, 4.2))
    for ax, (name, by_group) in zip(fig.subplots(1, 2), drawn, strict=True):
        for group, points in sorted(by_group.items()):
            _scatter(ax, points, styles[group], group)
        ax.set(xscale="log", xlabel=f"{name}, log scale", ylabel=metric, title=f"{metric} against {name}")
        ax.grid(True, which="both", alpha=0.3)
        if by_group:
            ax.legend(title=group_by, fontsize="small")
    return _save(fig, path)


def accuracy_vs_alpha(runs: list[Run], metric: str, group_by: str, path: Path) -> Path | None:
    """Final metric (mean ± std over seeds) against the Dirichlet α, one line per setting but α:
    flat lines = invariance to the partition."""
    lines: dict[tuple, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    first: dict[tuple, Run] = {}
    for run in runs:
        score = run.final(metric)
        if _finite(run.alpha, score):
            key = run.setting(without=ALPHA_KEYS)
            lines[key][run.alpha].append(score)
            first.setdefault(key, run)
    if not lines:
        return None
    styles = group_styles(runs, group_by)
    several_datasets = len({run.dataset for run in first.values()}) > 1
    names = {key: f"{label(run.value_of(group_by))}, K={label(run.num_clients)}"
                  + (f", {run.dataset}" if several_datasets else "") for key, run in first.items()}
    for name in set(names.values()):  # lines that share a name are told apart by what differs
        same = [key for key in lines if names[key] == name]
        if len(same) > 1:
            for key, extra in zip(same, differences(same), strict=True):
                names[key] = f"{name}, {extra}"
    sizes = sorted({run.num_clients for run in first.values()}, key=_sortable)
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for key in sorted(lines, key=lambda key: names[key]):
        alphas = sorted(lines[key])
        stats = [mean_std(lines[key][alpha]) for alpha in alphas]
        run = first[key]
        linestyle = LINESTYLES[sizes.index(run.num_clients) % len(LINESTYLES)]
        ax.errorbar(alphas, [m for m, _, _ in stats], yerr=[s for _, s, _ in stats], capsize=3,
                    label=names[key], linestyle=linestyle, **styles[label(run.value_of(group_by))])
    ax.set(xscale="log", xlabel="Dirichlet α (log scale; small = strong label skew)", ylabel=metric,
           title=f"{metric} against the partition's skew")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def line_names(runs: list[Run], group_by: str) -> dict[int, tuple[str, str]]:
    """id(run) -> (its group, its line's name): the group, plus what tells it apart from the other
    runs of its group (`FedAvg, compression=quantize`), so that each line can be named."""
    by_group: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_group[label(run.value_of(group_by))].append(run)
    names = {}
    for group, members in by_group.items():
        extras = differences([run.setting() for run in members]) if len(members) > 1 else [""]
        for run, extra in zip(members, extras, strict=True):
            names[id(run)] = (group, f"{group}, {extra}" if extra else group)
    return names


def _draw_lines(ax, curves: list[tuple[Run, list[float], list[float]]], names, styles) -> None:
    """One line per run: its group's colour and marker, a line style per run of the group."""
    seen: dict[str, int] = defaultdict(int)
    for run, xs, ys in curves:
        group, name = names[id(run)]
        ax.plot(xs, ys, markersize=4, alpha=0.85, label=name,
                linestyle=LINESTYLES[seen[group] % len(LINESTYLES)], **styles[group])
        seen[group] += 1


def round_accuracy_vs_bytes(runs: list[Run], group_by: str, path: Path) -> Path | None:
    """Per-round accuracy against the bytes each client had uploaded by that round, one line
    per multi-round run: the view that weighs rounds against compression."""
    curves, metrics = [], set()
    for run in runs:
        points = run.round_points()
        if points is not None:
            metric, xs, ys = points
            curves.append((run, xs, ys))
            metrics.add(metric)
    if not curves:
        return None
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    drawn = [run for run, _, _ in curves]
    _draw_lines(ax, curves, line_names(drawn, group_by), group_styles(runs, group_by))
    ax.set(xscale="log", xlabel="bytes uploaded per client so far (log scale)",
           ylabel=" / ".join(sorted(metrics)), title="accuracy by round against cumulative upload")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title=group_by, fontsize="small")
    return _save(fig, path)


def accuracy_curves(runs: list[Run], group_by: str, path: Path) -> Path | None:
    """Per-depth or per-round accuracy, one panel per kind of x axis, one line per run."""
    panels = defaultdict(list)
    for run in runs:
        curve = run.curve()
        if curve is not None:
            metric, axis, xs, ys = curve
            panels[(axis, metric)].append((run, xs, ys))
    if not panels:
        return None
    styles = group_styles(runs, group_by)
    fig = Figure(figsize=(6.4 * len(panels), 4.2))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, ((axis, metric), curves) in zip(axes, sorted(panels.items()), strict=True):
        _draw_lines(ax, curves, line_names([run for run, _, _ in curves], group_by), styles)
        ax.set(xlabel=axis, ylabel=metric, title=f"{metric} by {axis}")
        ax.grid(True, alpha=0.3)
        ax.legend(title=group_by, fontsize="small")
    return _save(fig, path)


def per_client_accuracy(runs: list[Run], path: Path) -> Path | None:
    """Box plots of each personalized run's per-client accuracies."""
    personalized = [run for run in runs if run.per_client_acc]
    if not personalized:
        return None
    fig = Figure(figsize=(max(6.4, 0.9 * len(personalized) + 2), 4.2))
    ax = fig.subplots()
    ax.boxplot([run.per_client_acc for run in personalized])
    ax.set_xticks(range(1, len(personalized) + 1),
                  [f"{run.method}\n{run.name}" for run in personalized], rotation=20, ha="right",
                  fontsize="small")
    ax.set(ylabel="accuracy on the client's own test split", title="per-client accuracy")
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)
