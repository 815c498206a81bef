"""Finished runs read back from their folders: `metrics.csv`, `config.yaml`, `per_client_acc.csv`.

A run folder is what `fit` writes, `<run_dir>/<run_name>/version_N/`. Only local files are read
(never the W&B server), and nothing here imports torch or Lightning, so reading is quick.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# Per-step accuracy curves, most specific first: (metric, what its x axis counts).
CURVES = (("depth/test_acc", "depth"), ("round/test_acc", "round"), ("val/acc", "round"))


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The rows of a CSVLogger `metrics.csv`, each with only its non-empty numeric cells."""
    rows = []
    with Path(path).open(newline="") as f:
        for row in csv.DictReader(f):
            cells = {}
            for key, text in row.items():
                try:
                    cells[key] = float(text)
                except (TypeError, ValueError):
                    continue  # an empty cell: the metric was logged on another row
            rows.append(cells)
    return rows


def last_value(rows: list[dict[str, float]], key: str) -> float:
    """The latest value logged under `key` (NaN when never logged)."""
    for row in reversed(rows):
        if key in row:
            return row[key]
    return math.nan


@dataclass
class Run:
    """One run folder: its resolved config, its logged rows and, if any, per-client accuracies."""

    path: Path
    config: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, float]] = field(default_factory=list)
    per_client_acc: list[float] | None = None

    @classmethod
    def load(cls, path: Path) -> Run:
        path = Path(path)
        config_file, per_client_file = path / "config.yaml", path / "per_client_acc.csv"
        config = yaml.safe_load(config_file.read_text()) if config_file.exists() else {}
        per_client = None
        if per_client_file.exists():
            with per_client_file.open(newline="") as f:
                per_client = [float(row["acc"]) for row in csv.DictReader(f)]
        return cls(path, config or {}, read_metrics(path / "metrics.csv"), per_client)

    # ---- what the run was ---------------------------------------------------------------
    @property
    def name(self) -> str:
        """`<run_name>/version_N`: unique within one run_dir."""
        return f"{self.path.parent.name}/{self.path.name}"

    def _init_args(self, part: str) -> dict[str, Any]:
        return (self.config.get(part) or {}).get("init_args") or {}

    @property
    def method(self) -> str:
        class_path = (self.config.get("model") or {}).get("class_path", "unknown")
        return class_path.rsplit(".", 1)[-1]

    @property
    def dataset(self) -> str:
        return str(self._init_args("data").get("dataset", "unknown"))

    @property
    def backbone(self) -> str:
        if self.dataset == "synthetic":  # drawn in feature space: no backbone ran
            return "none"
        return str(self._init_args("data").get("backbone", "unknown"))

    @property
    def partition(self) -> str:
        return str(self._init_args("data").get("partition", "unknown"))

    @property
    def alpha(self) -> float:
        """The Dirichlet concentration, NaN for any other partition."""
        if self.partition != "dirichlet":
            return math.nan
        return float(self._init_args("data").get("alpha", math.nan))

    @property
    def num_clients(self) -> float:
        return float(self._init_args("data").get("num_clients", math.nan))

    def value_of(self, key: str) -> Any:
        """A table field (`method`, `dataset`, `backbone`, `partition`, `alpha`, `K`) or a dotted
        config key, in the CLI's long (`model.init_args.num_layers`) or short
        (`model.num_layers`) form; None when the run has no such key."""
        if key in ("method", "dataset", "backbone", "partition", "alpha"):
            return getattr(self, key)
        if key in ("K", "num_clients"):
            return self.num_clients
        parts = key.split(".")
        for candidate in (parts, parts[:1] + ["init_args"] + parts[1:]):
            value: Any = self.config
            for part in candidate:
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None:
                return value
        return None

    # ---- what it measured ---------------------------------------------------------------
    def final(self, metric: str) -> float:
        return last_value(self.rows, metric)

    def curve(self) -> tuple[str, str, list[float], list[float]] | None:
        """(metric, x-axis name, xs, ys) of the first per-step accuracy with ≥ 2 points, or None.

        Depth rows are logged with step = depth (`depth/depth` when present); round rows carry
        Lightning's 0-based `epoch`, shown as round epoch + 1.
        """
        for metric, axis in CURVES:
            points = {}
            for row in self.rows:
                if metric not in row:
                    continue
                if axis == "depth":
                    x = row.get("depth/depth", row.get("step", math.nan))
                else:
                    x = row["epoch"] + 1 if "epoch" in row else row.get("step", math.nan)
                points[x] = row[metric]  # a re-logged x keeps its latest value
            if len(points) >= 2:
                xs = sorted(points)
                return metric, axis, xs, [points[x] for x in xs]
        return None


def find_runs(paths: list[str | Path]) -> list[Run]:
    """Every run folder (one holding `metrics.csv`) at or below the given paths, each once."""
    folders: set[Path] = set()
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"no such run folder: {path}")
        own = path / "metrics.csv"
        found = [own] if own.exists() else path.rglob("metrics.csv")
        folders.update(p.parent.resolve() for p in found)
    if not folders:
        raise ValueError(f"no runs (folders with a metrics.csv) in {', '.join(map(str, paths))}; "
                         "make some with `python -m workbench fit --config configs/X.yaml` or "
                         "`python -m workbench sweep sweeps/X.yaml`")
    return [Run.load(folder) for folder in sorted(folders)]
