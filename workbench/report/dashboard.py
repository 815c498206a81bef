"""What the comparison page shows, as data: the table's rows and columns, the runs' curves, the
groups of comparable runs with their Pareto fronts, the lines over α, the unfinished runs and
the re-evaluations. `page.py` writes it into the page as JSON; the page's script only draws it.

Runs are comparable when they learned the same task from the same inputs under the same
protocol: same dataset (with its own settings, e.g. the synthetic blobs'), inputs (backbone and
layers, or raw images and architecture), protocol, partition (with its skew) and K. Every figure
shows one such group at a time, and a front never crosses groups. A run's score is the
protocol's: `test/acc` under the global protocol, `test/acc_local_mean` (each client's own model
on its own test split) under the personalized one, where `test/acc` is only the global branch.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from workbench.report.runs import (
    BOOKKEEPING,
    SEED_KEYS,
    Run,
    differences,
    flatten,
    label_value,
    mean_std,
    repeats,
    short_key,
)

#: what tells a run's experiment apart, in the table's order (a column each)
IDENTITY = ("method", "engine", "protocol", "dataset", "inputs", "partition", "K")
#: what the page filters by
FILTERS = ("method", "dataset", "protocol", "partition", "engine")
#: what comparable runs share: a group of them is what one figure, one front, draws
COMPARABLE = ("dataset", "inputs", "protocol", "partition", "K")
#: config keys (short form) the identity columns already show
AS_IDENTITY = {"model.class_path", "data.class_path", "data.dataset", "data.inputs", "data.backbone",
               "data.feature_layers", "data.personalized", "data.partition", "data.alpha",
               "data.num_clients", "engine", "trainer.strategy"}
#: the x axes of the final-score figure, each with its own Pareto front
COSTS = ("comm/bytes_up_per_client", "comm/bytes_down_per_client", "comm/rounds", "time/fit_s",
         "time/wall_s", "latency/total_s")


@dataclass(frozen=True)
class Metric:
    """A numeric column: the logged key (or a curve's summary), its header and its unit."""

    key: str
    header: str
    kind: str  # accuracy, count, bytes or seconds: how the page prints it


METRICS = (
    Metric("test/acc", "test/acc", "accuracy"),
    Metric("test/acc_local_mean", "local mean", "accuracy"),
    Metric("test/acc_local_min", "local min", "accuracy"),
    Metric("curve/best", "best", "accuracy"),  # the learning curve's best point
    Metric("curve/best_round", "at round", "count"),
    Metric("comm/rounds", "rounds", "count"),
    Metric("comm/bytes_up_per_client", "up / client", "bytes"),
    Metric("comm/bytes_down_per_client", "down / client", "bytes"),
    Metric("comm/bytes_up", "up, all clients", "bytes"),
    Metric("time/fit_s", "fit s", "seconds"),
    Metric("time/wall_s", "wall s", "seconds"),
    Metric("latency/total_s", "simulated s", "seconds"),  # the clients' links (systems profiles)
)
#: shown before any toggle (with the metric compared, and the personalized score where it exists)
SHOWN_METRICS = ("curve/best", "curve/best_round", "comm/rounds", "comm/bytes_up_per_client", "time/fit_s",
                 "time/wall_s")


def score_metric(protocol: str, metric: str = "test/acc") -> str:
    """What a run is ranked by: `metric`, except that under the personalized protocol the global
    model's `test/acc` (AnaPFL's global branch) gives way to the clients' own models' score."""
    return "test/acc_local_mean" if protocol == "personalized" and metric == "test/acc" else metric


def curve_metric(protocol: str) -> str:
    return "round/test_acc_local_mean" if protocol == "personalized" else "round/test_acc"


def _number(value: Any) -> float | None:
    """A JSON number: None for NaN, infinities and what is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _value(value: Any) -> Any:
    """A config value as the page shows it: numbers stay numbers, the rest becomes text."""
    if value is None:
        return None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple, str)):
        return label_value(value)
    if isinstance(value, (int, float)):
        return _number(value)
    return json.dumps(value, sort_keys=True, default=str)


def config_values(run: Run) -> dict[str, Any]:
    """The run's settings by short key, without seeds, bookkeeping and what the identity columns show."""
    return {short_key(key): _value(value) for key, value in flatten(run.config).items()
            if key not in BOOKKEEPING and key.rsplit(".", 1)[-1] not in SEED_KEYS
            and short_key(key) not in AS_IDENTITY}


def identity(run: Run) -> dict[str, Any]:
    return {"method": run.method, "engine": run.engine, "protocol": run.protocol, "dataset": run.dataset,
            "inputs": run.inputs, "partition": run.partition_label, "K": _number(run.num_clients)}


def comparable_key(run: Run) -> tuple:
    """What a run must share with another to be compared with it: the COMPARABLE fields, and
    the dataset's own settings (two synthetic datasets of other blobs are other tasks)."""
    own = tuple(sorted((key, repr(value)) for key, value in flatten(run.config).items()
                       if key.startswith(("data.init_args.synthetic.", "data.init_args.hf."))))
    fields = identity(run)
    return (*(fields[name] for name in COMPARABLE), own)


def family_key(key: tuple) -> tuple:
    """A `comparable_key` without its partition: the settings the α figure draws as one line
    across partitions."""
    partition = COMPARABLE.index("partition")
    return key[:partition] + key[partition + 1:]


def best_round(run: Run) -> tuple[float, float]:
    """(best accuracy of the learning curve, the first round that reached it); NaNs without a curve."""
    curve = run.curve(curve_metric(run.protocol))
    if curve is None:
        return math.nan, math.nan
    best = max(curve["acc"])
    return best, curve["round"][curve["acc"].index(best)]


def run_metrics(run: Run, heads: list[str]) -> dict[str, float | None]:
    values = {metric.key: run.final(metric.key) for metric in METRICS if not metric.key.startswith("curve/")}
    values["time/wall_s"] = run.wall_seconds
    values["curve/best"], values["curve/best_round"] = best_round(run)
    values.update({head: run.final(head) for head in heads})
    return {key: _number(value) for key, value in values.items()}


def pareto_front(points: list[tuple[float, float, str]]) -> list[str]:
    """The ids of the points (cost, score, id) that no other point beats on both counts (costs
    no more and scores higher, or costs less and scores as well), cheapest first; points that tie
    exactly are all on it."""
    front: list[tuple[float, float, str]] = []
    for cost, score, name in sorted(points, key=lambda point: (point[0], -point[1])):
        if not front or score > front[-1][1] or (cost, score) == front[-1][:2]:
            front.append((cost, score, name))
    return [name for _, _, name in front]


def told_apart(base: list[str], settings: list[tuple]) -> list[str]:
    """The names `base`, with what differs in their `settings` ((key, repr) pairs) appended where
    two share a name."""
    names = list(base)
    for name in set(base):
        same = [i for i, other in enumerate(base) if other == name]
        if len(same) > 1:
            extras = differences([settings[i] for i in same])
            for i, extra in zip(same, extras, strict=True):
                names[i] = f"{name}, {extra}" if extra else f"{name}, #{same.index(i) + 1}"
    return names


def group_label(key: tuple) -> str:
    """`mnist5k · efficientnet_lite0 features · global · dirichlet α=0.1 · K=10`."""
    *parts, clients, _ = key
    return " · ".join([*map(label_value, parts), f"K={label_value(clients)}"])


def build(runs: list[Run], metric: str = "test/acc", group_by: str = "method") -> dict[str, Any]:
    """Everything the page draws (JSON-ready: NaN is None)."""
    done = [run for run in runs if run.status == "done"]
    reevaluations = [run for run in runs if run.status == "re-evaluation"]
    unfinished = [run for run in runs if run.status not in ("done", "re-evaluation")]
    heads = sorted({key for run in done for row in run.rows for key in row if key.startswith("test/acc/")})
    settings = repeats(done)
    groups, group_of = comparable_groups(settings, metric)
    setting_of = {id(run): f"s{i}" for i, same in enumerate(settings) for run in same}
    records = [run_record(f"r{i}", run, metric, heads) for i, run in enumerate(done)]
    members: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record, run in zip(records, done, strict=True):
        record["setting"] = setting_of[id(run)]
        record["group"] = record["values"]["group"] = group_of[record["setting"]]
        members[record["setting"]].append(record)
    columns, constant = table_columns(records, metric, heads, several_groups=len(groups) > 1)
    shown_keys = {column["key"] for column in columns}
    for record in records:  # the page needs the values that tell runs apart, not every default
        record["values"] = {key: value for key, value in record["values"].items() if key in shown_keys}
    rows = [table_row(f"s{i}", members[f"s{i}"], same[0].protocol, columns) for i, same in enumerate(settings)]
    for group in groups:
        group["fronts"] = fronts(group, {row["id"]: row for row in rows})
    return {
        "metric": metric, "group_by": group_by, "columns": columns, "constant": constant,
        "filters": {name: sorted({label_value(identity(run)[name]) for run in done}) for name in FILTERS},
        "runs": records, "rows": rows, "groups": groups,
        "alpha_lines": alpha_lines(done, metric, {g["family_key"]: g["family"] for g in groups}, group_by),
        "unfinished": [{"name": run.name, "path": str(run.path), "status": run.status,
                        "method": run.method if run.config else "—", "error": run.error} for run in unfinished],
        "reevaluations": reevaluated(reevaluations, done, metric),
        "counts": {"runs": len(done), "settings": len(settings), "unfinished": len(unfinished),
                   "reevaluations": len(reevaluations)},
    }


def run_record(run_id: str, run: Run, metric: str, heads: list[str]) -> dict[str, Any]:
    """One finished run: its values by column key, its score, its curves."""
    def numbers(curve: dict[str, list[float]] | None) -> dict[str, list[float | None]] | None:
        return None if curve is None else {key: [_number(v) for v in values] for key, values in curve.items()}

    values = {**identity(run), **config_values(run), **run_metrics(run, heads)}
    return {"id": run_id, "name": run.name, "path": str(run.path), "wandb": run.wandb_id, "values": values,
            "score_metric": score_metric(run.protocol, metric),
            "score": values.get(score_metric(run.protocol, metric)),
            "curve": numbers(run.curve(curve_metric(run.protocol))), "depth": numbers(run.depth_curve()),
            "per_client": run.per_client_acc}


def comparable_groups(settings: list[list[Run]], metric: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The groups of comparable runs, most runs first (G1, G2, ...), and each setting's group."""
    by_key: dict[tuple, list[int]] = defaultdict(list)
    for i, same in enumerate(settings):
        by_key[comparable_key(same[0])].append(i)
    keys = sorted(by_key, key=lambda key: (-sum(len(settings[i]) for i in by_key[key]), repr(key)))
    names = told_apart([group_label(key) for key in keys], [key[-1] for key in keys])
    families: dict[tuple, str] = {}
    groups, group_of = [], {}
    for g, key in enumerate(keys):
        members = by_key[key]
        family = family_key(key)
        families.setdefault(family, f"F{len(families) + 1}")
        groups.append({"id": f"G{g + 1}", "label": names[g], "fields": dict(zip(COMPARABLE, key[:-1], strict=True)),
                       "score": score_metric(settings[members[0]][0].protocol, metric),
                       "family": families[family], "family_key": family,
                       "settings": [f"s{i}" for i in members], "runs": sum(len(settings[i]) for i in members)})
        group_of.update({f"s{i}": f"G{g + 1}" for i in members})
    return groups, group_of


def table_columns(records: list[dict[str, Any]], metric: str, heads: list[str],
                  several_groups: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The table's columns (key, header, kind, whether it varies, whether shown before any
    toggle) and the values every run shares. Shown: what varies, the comparable group rather
    than the fields it is made of, the metric compared, and the rounds, bytes and times."""
    def varies(key: str) -> bool:
        """Two runs that have the key disagree on it (a key only some methods have does not
        vary by being absent from the others)."""
        values = {json.dumps(record["values"][key]) for record in records if record["values"].get(key) is not None}
        return len(values) > 1

    def present(key: str) -> bool:
        return any(record["values"].get(key) is not None for record in records)

    config_keys = sorted({key for record in records for key in record["values"]}
                         - {*IDENTITY, "group", *(m.key for m in METRICS), *heads})
    metrics = [*METRICS[:3], *(Metric(head, head.removeprefix("test/"), "accuracy") for head in heads), *METRICS[3:]]
    if metric not in {m.key for m in metrics}:
        metrics.insert(0, Metric(metric, metric, "accuracy"))
    personalized = any(record["values"]["protocol"] == "personalized" for record in records)
    # an identity field that varies is shown: the group's id alone does not say what differs between
    # two rows (the table keeps each group's rows together; its id is a toggle away)
    identity = [{"key": key, "header": key, "kind": "count" if key == "K" else "text", "varies": varies(key),
                 "shown": varies(key)} for key in IDENTITY]
    columns: list[dict[str, Any]] = [*identity[:2], {"key": "group", "header": "group", "kind": "text",
                                                     "varies": several_groups, "shown": False}, *identity[2:]]
    columns += [{"key": key, "header": key, "kind": "config", "varies": True, "shown": True}
                for key in config_keys if varies(key)]
    columns += [{"key": m.key, "header": m.header, "kind": m.kind, "varies": varies(m.key),
                 "shown": present(m.key) and (m.key in (metric, *SHOWN_METRICS)
                                              or (m.key == "test/acc_local_mean" and personalized))}
                for m in metrics if present(m.key) or m.key == metric]
    for column in columns:  # how many runs have it: a key one run alone has is not "the same in every run"
        column["runs"] = len(records) if column["key"] == "group" else \
            sum(record["values"].get(column["key"]) is not None for record in records)
    constant = {key: next(r["values"][key] for r in records if r["values"].get(key) is not None)
                for key in [*IDENTITY, *config_keys] if not varies(key) and present(key)}
    return columns, constant


def table_row(row_id: str, members: list[dict[str, Any]], protocol: str,
              columns: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per set of repeats: text where its runs agree (else their values joined), numbers
    as [mean, sample std, n]."""
    cells: dict[str, Any] = {}
    for column in columns:
        values = [record["values"].get(column["key"]) for record in members]
        if column["kind"] in ("text", "config") and not all(isinstance(v, float) or v is None for v in values):
            cells[column["key"]] = " / ".join(sorted({label_value(v) for v in values}))
        else:
            mean, std, n = mean_std([math.nan if v is None else v for v in values])
            cells[column["key"]] = [_number(mean), _number(std), n]
    return {"id": row_id, "runs": [record["id"] for record in members], "protocol": protocol,
            "group": members[0]["group"], "cells": cells}


def fronts(group: dict[str, Any], rows: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """The group's Pareto front (its settings' mean score against each cost) per cost that a run
    of the page logged (a simulated clock's, `latency/total_s`, only under systems profiles)."""
    out = {}
    for cost in COSTS:
        if not any(cost in rows[setting]["cells"] for setting in group["settings"]):
            continue
        points = []
        for setting in group["settings"]:
            cells = rows[setting]["cells"]
            x, y = cells.get(cost, [None])[0], cells.get(group["score"], [None])[0]
            if x is not None and y is not None:
                points.append((x, y, setting))
        out[cost] = pareto_front(points)
    return out


def alpha_lines(done: list[Run], metric: str, families: dict[tuple, str], group_by: str) -> list[dict[str, Any]]:
    """The invariance picture: for each setting but its Dirichlet α run at two or more α, the
    score (mean ± std over seeds) against α; its family (the comparable fields but the
    partition) says which group's figure draws it."""
    lines: dict[tuple, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    first: dict[tuple, Run] = {}
    for run in done:
        if run.partition == "dirichlet" and math.isfinite(run.alpha):
            key = run.setting(without=("data.init_args.alpha",))
            lines[key][run.alpha].append(run.final(score_metric(run.protocol, metric)))
            first.setdefault(key, run)
    drawn = [key for key in lines if len(lines[key]) >= 2]
    values = [label_value(first[key].value_of(group_by)) for key in drawn]
    out = []
    for key, name, value in zip(drawn, told_apart(values, drawn), values, strict=True):
        family = families.get(family_key(comparable_key(first[key])))
        points = []
        for alpha in sorted(lines[key]):
            mean, std, n = mean_std(lines[key][alpha])
            points.append({"alpha": alpha, "mean": _number(mean), "std": _number(std), "n": n})
        out.append({"family": family, "label": name, "group_value": value, "points": points})
    return out


def reevaluated(reevaluations: list[Run], done: list[Run], metric: str) -> list[dict[str, Any]]:
    """Each `test --ckpt_path` run beside the fit it re-scored (by the checkpoint's folder):
    its score and the fit's, which should agree."""
    fits = {run.path.resolve(): run for run in done}
    out = []
    for run in reevaluations:
        folder = run.evaluated.resolve() if run.evaluated is not None else None
        fit = fits.get(folder) if folder is not None else None
        key = score_metric(run.protocol, metric)
        out.append({"name": run.name, "of": fit.name if fit is not None else str(folder),
                    "found": fit is not None, "metric": key, "value": _number(run.final(key)),
                    "fit_value": _number(fit.final(key)) if fit is not None else None})
    return out
