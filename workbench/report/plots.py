"""The dashboard's figures as PNG files, one colour and marker per group (e.g. per method).

Drawn on bare `matplotlib.figure.Figure`s (the Agg canvas, no pyplot state, no display needed).
Each function returns the PNG it wrote, or None when no run has what the figure shows.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from workbench.report.runs import Run

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


def accuracy_vs_bytes(runs: list[Run], metric: str, group_by: str, path: Path) -> Path | None:
    """Final metric against bytes uploaded per client, log x axis."""
    styles, by_group = group_styles(runs, group_by), defaultdict(list)
    for run in runs:
        sent, score = run.final("comm/bytes_up_per_client"), run.final(metric)
        if _finite(sent, score) and sent > 0:
            by_group[label(run.value_of(group_by))].append((sent, score))
    if not by_group:
        return None
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for group, points in sorted(by_group.items()):
        xs, ys = zip(*points)
        ax.scatter(xs, ys, s=42, alpha=0.85, label=group, **styles[group])
    ax.set(xscale="log", xlabel="bytes uploaded per client (log scale)", ylabel=metric,
           title=f"{metric} against communication")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title=group_by, fontsize="small")
    return _save(fig, path)


def accuracy_vs_alpha(runs: list[Run], metric: str, group_by: str, path: Path) -> Path | None:
    """Final metric against the Dirichlet α, one line per (group, K, dataset): flat lines =
    invariance to the partition."""
    styles, lines = group_styles(runs, group_by), defaultdict(dict)
    for run in runs:
        score = run.final(metric)
        if _finite(run.alpha, score):
            lines[(label(run.value_of(group_by)), run.num_clients, run.dataset)][run.alpha] = score
    if not lines:
        return None
    several_datasets = len({dataset for _, _, dataset in lines}) > 1
    by_size = sorted(lines, key=lambda key: (key[0], key[2], _sortable(key[1])))
    sizes = list(dict.fromkeys(label(k) for k in sorted((k for _, k, _ in lines), key=_sortable)))
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for group, clients, dataset in by_size:
        points = lines[(group, clients, dataset)]
        alphas = sorted(points)
        name = f"{group}, K={label(clients)}" + (f", {dataset}" if several_datasets else "")
        linestyle = LINESTYLES[sizes.index(label(clients)) % len(LINESTYLES)]
        ax.plot(alphas, [points[a] for a in alphas], label=name, linestyle=linestyle,
                **styles[group])
    ax.set(xscale="log", xlabel="Dirichlet α (log scale; small = strong label skew)", ylabel=metric,
           title=f"{metric} against the partition's skew")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def accuracy_curves(runs: list[Run], group_by: str, path: Path) -> Path | None:
    """Per-depth or per-round accuracy, one panel per kind of x axis, one line per run."""
    styles, panels = group_styles(runs, group_by), defaultdict(list)
    for run in runs:
        curve = run.curve()
        if curve is not None:
            metric, axis, xs, ys = curve
            panels[(axis, metric)].append((label(run.value_of(group_by)), xs, ys))
    if not panels:
        return None
    fig = Figure(figsize=(6.4 * len(panels), 4.2))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, ((axis, metric), curves) in zip(axes, sorted(panels.items())):
        labelled = set()
        for group, xs, ys in curves:
            ax.plot(xs, ys, markersize=4, alpha=0.85, label=None if group in labelled else group,
                    **styles[group])
            labelled.add(group)
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
