"""Runs read back from their folders: `metrics.csv`, `config.yaml`, `per_client_acc.csv`, and
a `status.json` (failed, running or stopped runs, with their errors): the sweep runner's, beside a
sweep run's version folders, or the command line's own, inside the version folder of a run that
ended in an error.

A run folder is what `fit` writes, `<run_dir>/<run_name>/version_N/`. Only local files are read
(never the W&B server), and nothing here imports torch or Lightning, so reading is quick.
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
import socket
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from workbench.files import _alive

VERSION = re.compile(r"version_\d+")  # the folders `fit` claims, one per run
#: fields of a run that --group_by takes besides config keys
FIELDS = ("method", "engine", "protocol", "dataset", "inputs", "backbone", "partition", "alpha", "K")
#: a metric under this prefix is logged last by a finished fit (its test), or by `validate`
FINISHED = ("test/", "val/")
#: config leaves that only choose a random stream: runs differing in them alone are repeats
SEED_KEYS = {"seed", "seed_everything"}
#: config keys that say where or how a run was written, not what it computed
BOOKKEEPING = {"run_dir", "run_name", "wandb", "wandb_project", "ckpt_path", "config",
               "checkpoint_every_round", "eval_every", "print_config", "trainer.enable_progress_bar",
               "trainer.logger", "trainer.default_root_dir", "data.init_args.cache_dir",
               "data.init_args.data_dir", "data.init_args.device"}


#: how a partition's skew is named: scheme -> (its parameter, how the label writes it)
SKEW = {"dirichlet": ("alpha", "α={}"), "shard": ("num_shards_per_partition", "{} shards/client"),
        "pathological": ("num_classes_per_partition", "{} classes/client")}
#: what is read fast: the C loader when PyYAML was built with libyaml
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted key: leaf value}."""
    if not isinstance(config, dict) or not config:
        return {prefix: config} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in config.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def short_key(key: str) -> str:
    """The CLI's short form of a config key: `model.init_args.gamma` -> `model.gamma`."""
    return key.replace(".init_args.", ".")


def label_value(value: Any) -> str:
    """A value as a label: 10.0 -> '10', None -> '—', [a, b] -> 'a+b'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return "+".join(map(str, value))
    return str(value)


def _last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no error recorded"


def _runner_alive(status: dict[str, Any]) -> bool:
    """Whether the sweep runner that wrote a `running` status still runs (True when it ran on
    another machine: only its own host can tell)."""
    runner = status.get("runner") or {}
    if runner.get("host") != socket.gethostname() or not isinstance(runner.get("pid"), int):
        return True
    return _alive(runner["pid"])


def _read_status(run_folder: Path) -> dict[str, Any]:
    """A folder's status.json (the sweep runner's in a sweep run's folder, the command line's own
    in a version folder), or {}."""
    path = run_folder / "status.json"
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except ValueError:  # being rewritten: no status is better than a crash
        return {}


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
    # done, failed, running, stopped, superseded (an earlier attempt of a sweep run, or an interrupted
    # fit resumed in a later version folder), re-evaluation
    # (`test --ckpt_path` of a fitted model: no round ran), or incomplete (no test, no status.json)
    status: str = "done"
    error: str = ""  # the last line of a failed run's error
    sweep_seconds: float = math.nan  # the sweep runner's end-to-end seconds of the run's process
    wandb_id: str = ""
    root: Path | None = None  # what `name` is relative to

    @classmethod
    def load(cls, path: Path) -> Run:
        """A version folder; its status from its metrics and the sweep runner's status.json."""
        path = Path(path)
        config_file, per_client_file = path / "config.yaml", path / "per_client_acc.csv"
        config = yaml.load(config_file.read_text(), Loader=YAML_LOADER) if config_file.exists() else {}
        per_client = None
        if per_client_file.exists():
            with per_client_file.open(newline="") as f:
                per_client = [float(row["acc"]) for row in csv.DictReader(f)]
        metrics = path / "metrics.csv"
        run = cls(path, config or {}, read_metrics(metrics) if metrics.exists() else [], per_client)
        link = path / "wandb.json"
        if link.exists():
            run.wandb_id = str(json.loads(link.read_text()).get("id", ""))
        own, sweep = _read_status(path), _read_status(path.parent)
        if any(key.startswith(FINISHED) for row in run.rows for key in row):
            if sweep.get("version") and Path(sweep["version"]).resolve() == path.resolve():
                run.sweep_seconds = float(sweep.get("seconds", math.nan))
            if run.evaluated is not None:
                run.status = "re-evaluation"
            return run
        if own.get("status") in ("failed", "stopped"):  # the command line's record of how it ended
            run.status, run.error = own["status"], _last_line(own.get("error", ""))
        elif own.get("status") == "continued":  # a resumed fit went on in a later version folder
            run.status = "superseded"
            run.error = f"interrupted; resumed in {Path(own.get('continued_in', '?')).name}"
        elif sweep.get("status") == "done":  # the sweep re-ran it: this is an earlier attempt
            run.status = "superseded"
            run.error = f"an earlier attempt; the sweep's {Path(sweep.get('version', '?')).name} finished"
        elif sweep.get("status") == "running" and not _runner_alive(sweep):
            run.status, run.error = "stopped", "its sweep runner ended before the run did"
        elif sweep.get("status") in ("failed", "running"):
            run.status, run.error = sweep["status"], _last_line(sweep.get("error", ""))
        else:
            run.status = "incomplete"
            stopped = " (last.ckpt: resume with fit --ckpt_path last)" if (path / "last.ckpt").exists() else ""
            run.error = f"no test or validation metric logged: still running, or stopped{stopped}"
        return run

    @classmethod
    def from_status(cls, folder: Path, status: dict[str, Any]) -> Run:
        """A sweep run that left no version folder (refused, failed or stopped before it made one,
        or just starting)."""
        if status.get("status") == "running" and not _runner_alive(status):
            return cls(Path(folder), status="stopped", error="its sweep runner ended before the run did")
        return cls(Path(folder), status=status.get("status", "failed"),
                   error=_last_line(status.get("error", "")))

    # ---- what the run was ---------------------------------------------------------------
    @property
    def name(self) -> str:
        """The run's path below `root` (set by `find_runs`: the folder that holds every run
        found), else `<run_name>/version_N`."""
        if self.root is not None:
            return self.path.relative_to(self.root).as_posix()
        return f"{self.path.parent.name}/{self.path.name}"

    @property
    def evaluated(self) -> Path | None:
        """The version folder of the fitted model that this run only tested (`test --ckpt_path`,
        where no round ran), or None: a re-evaluation is not a run of its own."""
        checkpoint = self.config.get("ckpt_path")
        if not checkpoint or any("comm/rounds" in row for row in self.rows):
            return None  # a fit, resumed from a checkpoint or not, logs its rounds
        return Path(checkpoint).parent

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
        data = self._init_args("data")
        if self.dataset == "synthetic" or data.get("inputs") == "images":  # no backbone ran
            return "none"
        return str(data.get("backbone", "unknown"))

    @property
    def inputs(self) -> str:
        """What the method learned from: `<backbone> features` (with the inner layers it
        concatenates), `synthetic features`, or `images → <architecture>` (raw pixels)."""
        data = self._init_args("data")
        if not data:
            return "unknown"
        if data.get("inputs") == "images":
            return f"images → {self._init_args('model').get('architecture', 'model')}"
        if self.dataset == "synthetic":
            return "synthetic features"
        layers = data.get("feature_layers")
        return f"{self.backbone} features" + (f" [{'+'.join(map(str, layers))}]" if layers else "")

    @property
    def partition(self) -> str:
        return str(self._init_args("data").get("partition", "unknown"))

    @property
    def partition_label(self) -> str:
        """The partition with its skew, as comparisons must match it: `dirichlet α=0.1`, `iid`."""
        data = self._init_args("data")
        if self.partition in SKEW:
            key, text = SKEW[self.partition]
            return f"{self.partition} {text.format(label_value(data.get(key)))}"
        if self.partition == "flower":
            return f"flower {(data.get('flower') or {}).get('partitioner', '?')}"
        return self.partition

    @property
    def alpha(self) -> float:
        """The Dirichlet concentration, NaN for any other partition."""
        if self.partition != "dirichlet":
            return math.nan
        return float(self._init_args("data").get("alpha", math.nan))

    @property
    def num_clients(self) -> float:
        return float(self._init_args("data").get("num_clients", math.nan))

    @property
    def engine(self) -> str:
        """Who ran the rounds: in process, several processes (DDP) or Flower."""
        engine = self.config.get("engine") or "lightning"
        if engine == "flower":
            return "flower"
        strategy = (self.config.get("trainer") or {}).get("strategy")
        return "ddp" if strategy == "ddp" else "in process" if self.config else "—"

    @property
    def protocol(self) -> str:
        """`personalized` (each client also scored on its own test split) or `global`."""
        if not self.config:
            return "—"
        return "personalized" if self._init_args("data").get("personalized") else "global"

    @property
    def wall_seconds(self) -> float:
        """End to end: the run's own `time/wall_s`, else the sweep runner's measure of its process."""
        logged = self.final("time/wall_s")
        return logged if math.isfinite(logged) else self.sweep_seconds

    @cached_property
    def same_as(self) -> tuple:
        """`setting()`: what a run's repeats share (computed once)."""
        return self.setting()

    def setting(self, without: tuple[str, ...] = ()) -> tuple:
        """Everything that defines the experiment except seeds, where it was written and the
        config keys `without`: runs with equal settings are repeats, averaged on the page. A run
        without a config is a setting of its own."""
        if not self.config:
            return (("path", str(self.path)),)
        return tuple(sorted((key, repr(value)) for key, value in flatten(self.config).items()
                            if key.rsplit(".", 1)[-1] not in SEED_KEYS
                            and key not in BOOKKEEPING and key not in without))

    def value_of(self, key: str) -> Any:
        """A field (`method`, `dataset`, `inputs`, `partition` with its skew, `alpha`, `K`...) or a dotted
        config key, in the CLI's long (`model.init_args.num_layers`) or short
        (`model.num_layers`) form; None when the run has no such key."""
        if key == "partition":
            return self.partition_label
        if key in FIELDS and key != "K":
            return getattr(self, key)
        if key in ("K", "num_clients"):
            return self.num_clients
        parts = key.split(".")
        for candidate in (parts, [*parts[:1], "init_args", *parts[1:]]):
            value: Any = self.config
            for part in candidate:
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None:
                return value
        return None

    # ---- what it measured ---------------------------------------------------------------
    def final(self, metric: str) -> float:
        return last_value(self.rows, metric)

    def curve(self, metric: str) -> dict[str, list[float]] | None:
        """The learning curve of `metric` (`round/test_acc`, `round/test_acc_local_mean`): each
        scored round with the bytes each client had sent (`up`) and received (`down`) and the
        simulated seconds (`latency`, NaN without systems profiles) by then, as {round, acc, up,
        down, latency}; None when the run never logged it."""
        points = {row["round/round"]: row for row in self.rows if metric in row and "round/round" in row}
        if not points:
            return None
        rounds = sorted(points)
        return {"round": rounds, "acc": [points[r][metric] for r in rounds],
                "up": [points[r].get("round/bytes_up_per_client", math.nan) for r in rounds],
                "down": [points[r].get("round/bytes_down_per_client", math.nan) for r in rounds],
                "latency": [points[r].get("round/latency_s", math.nan) for r in rounds]}

    def depth_curve(self) -> dict[str, list[float]] | None:
        """DeepAFL's test accuracy by depth (`depth/test_acc` against `depth/depth`, else the
        row's step) as {depth, acc}; None without two depths."""
        points = {row.get("depth/depth", row.get("step", math.nan)): row["depth/test_acc"]
                  for row in self.rows if "depth/test_acc" in row}
        if len(points) < 2:
            return None
        depths = sorted(points)
        return {"depth": depths, "acc": [points[d] for d in depths]}


def find_runs(paths: list[str | Path]) -> list[Run]:
    """Every run at or below the given paths, each once: each `version_N` folder (finished,
    failed, running or stopped) and each sweep run folder whose status.json says it failed or
    is running without having made a version folder."""
    folders: set[Path] = set()
    statuses: dict[Path, dict[str, Any]] = {}
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"no such run folder: {path}")
        candidates = [path, *path.rglob("*")] if path.is_dir() else []
        for candidate in candidates:
            if not candidate.is_dir():
                continue
            if (candidate / "metrics.csv").exists() or (
                    VERSION.fullmatch(candidate.name) and "wandb" not in candidate.parts):
                folders.add(candidate.resolve())
            elif (candidate / "status.json").exists() and not any(candidate.glob("version_*")):
                statuses[candidate.resolve()] = _read_status(candidate)
    if not folders and not statuses:
        raise ValueError(f"no runs (folders with a metrics.csv) in {', '.join(map(str, paths))}; "
                         "make some with `python -m workbench fit --config configs/X.yaml` or "
                         "`python -m workbench sweep sweeps/X.yaml`")
    runs = [Run.load(folder) for folder in sorted(folders)]
    runs += [Run.from_status(folder, status) for folder, status in sorted(statuses.items())
             if status.get("status") in ("failed", "running")]
    # Named below the deepest folder that holds every run's <run_name>/version_N (or sweep run
    # folder), so that runs of two sweeps with equal values keep distinct names.
    root = Path(os.path.commonpath([run.path.parent.parent if VERSION.fullmatch(run.path.name)
                                    else run.path.parent for run in runs]))
    for run in runs:
        run.root = root
    return runs


def repeats(runs: list[Run]) -> list[list[Run]]:
    """Runs grouped into repeats (equal settings but for seeds), in order of first appearance."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.same_as, []).append(run)
    return list(groups.values())


def mean_std(values: list[float]) -> tuple[float, float, int]:
    """(mean, sample standard deviation, n) of the finite values; (nan, nan, 0) when none."""
    finite = [value for value in values if math.isfinite(value)]
    if not finite:
        return math.nan, math.nan, 0
    mean = sum(finite) / len(finite)
    if len(finite) == 1:
        return mean, 0.0, 1
    return mean, math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1)), len(finite)


def differences(settings: list[tuple]) -> list[str]:
    """For each setting, `leaf=value` of the keys whose values differ among them (what tells
    apart lines that would otherwise share a label); '' where nothing differs."""
    as_dicts = [dict(setting) for setting in settings]
    keys = sorted({key for d in as_dicts for key in d})
    varying = [key for key in keys if len({d.get(key) for d in as_dicts}) > 1]
    def text(value: str) -> str:  # settings hold reprs: 'none' is shown as none
        return value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value

    return [", ".join(f"{short_key(key).rsplit('.', 1)[-1]}={text(d.get(key, '—'))}" for key in varying)
            for d in as_dicts]
