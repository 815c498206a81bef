"""A leaderboard scenario: the data, the settings it crosses, the seeds, the budget, the methods
and each method's grid, read from one YAML file (benchmarks/scenarios/*.yaml).

    name: mnist5k                      # the results' folder and the table's title
    title: MNIST 5k ...                # one line under the title (optional)
    protocol: global                   # or personalized (each client also scored on its own test rows)
    data: {dataset: mnist5k, backbone: efficientnet_lite0, input_size: 64}
    holdout: 0.1                       # each client's hold-out share: every choice is made on it
    settings:                          # the cells: every combination of these data settings
      num_clients: [10]                # (a list of such mappings: each one's combinations, in turn)
      partition: [{partition: dirichlet, alpha: 0.1}, {partition: iid}]
    seeds: [0, 1, 2]                   # the partition's seed and each method's own
    budget: {rounds: 50, patience: 5, min_delta: 0.001}   # the gradient methods' (and the references')
    references: {hidden_dim: 64, lrs: [0.03, 0.1, 0.3], l2: [1.0e-4, 1.0e-3, 1.0e-2, 1.0e-1]}
    methods:
      AFL: {class_path: AFL, grid: {gamma_out: [0.1, 1, 10]}}
      FedAvg:
        class_path: FedAvg
        init_args: {architecture: mlp, hidden_dim: 64, local: {epochs: 1, batch_size: 64}}
        grid: {local.lr: [0.03, 0.1, 0.3]}

A grid's keys are the method's settings in dotted form (`local.lr` sets init_args.local.lr); its
points are every combination. Every fit is a *run*: one setting × seed × method × grid point.
"""
from __future__ import annotations

import hashlib
import inspect
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

PROTOCOLS = ("global", "personalized")
#: the data settings a cell may vary (the rest of FederatedDataModule's come from `data`)
CELL_KEYS = ("num_clients", "partition", "alpha", "min_partition_size", "num_shards_per_partition",
             "num_classes_per_partition")
#: the scenario's own data settings: the harness sets these
HARNESS_DATA_KEYS = ("seed", "val_fraction", "val_split", "personalized")
REFERENCE = "reference"  # the class_path of the centralized rows


class ScenarioError(ValueError):
    """A scenario file that cannot run, with the fix named."""


def dotted_set(tree: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A copy of a nested dict with `a.b.c` set to `value`."""
    head, _, rest = key.partition(".")
    copy = dict(tree)
    copy[head] = dotted_set(dict(copy.get(head) or {}), rest, value) if rest else value
    return copy


def short(value: Any) -> str:
    """A value as a label: 0.1 -> '0.1', 1.0 -> '1', [a, b] -> 'a+b'."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "+".join(map(short, value))
    return str(value)


def setting_label(setting: dict[str, Any]) -> str:
    """`K=100 dirichlet α=0.1`, `K=10 iid`."""
    words = [f"K={setting['num_clients']}", str(setting.get("partition", "dirichlet"))]
    for key, name in (("alpha", "α="), ("min_partition_size", "n_k≥"), ("num_shards_per_partition", "shards="),
                      ("num_classes_per_partition", "classes=")):
        if key in setting:
            words.append(f"{name}{short(setting[key])}")
    return " ".join(words)


@dataclass(frozen=True)
class MethodSpec:
    """One leaderboard row: a method class, its fixed settings and its grid."""

    name: str
    class_path: str
    init_args: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def is_reference(self) -> bool:
        """A centralized reference row (`workbench.bench.references`), not a federated method."""
        return self.class_path == REFERENCE

    @property
    def shares_fit(self) -> bool:
        """Its grid varies only settings the server's last solve reads (the method class's
        `server_settings`, e.g. AFL's gamma_out): a cell's points are one fit, solved again at each."""
        if self.is_reference or not self.grid:
            return False
        solved_again = getattr(method_class(self.class_path), "server_settings", ())
        return {key.split(".")[0] for key in self.grid} <= set(solved_again)

    def points(self) -> list[dict[str, Any]]:
        """Every combination of the grid's values ({} for no grid), the first key varying slowest."""
        keys = list(self.grid)
        return [dict(zip(keys, values, strict=True)) for values in itertools.product(*self.grid.values())]

    def settings(self, point: dict[str, Any], seed: int, rounds: int) -> dict[str, Any]:
        """The init_args of one run: the fixed settings, the grid point, the seed, the budget
        (each only where the method takes it)."""
        args = dict(self.init_args)
        for key, value in point.items():
            args = dotted_set(args, key, value)
        if self.is_reference:
            return args
        accepted = method_parameters(self.class_path)
        if "seed" in accepted and "seed" not in self.init_args:
            args["seed"] = seed
        if "num_rounds" in accepted and "num_rounds" not in self.init_args:
            args["num_rounds"] = rounds
        return args


def method_class(class_path: str) -> type:
    import workbench.methods as methods

    cls = getattr(methods, class_path.rsplit(".", 1)[-1], None)
    if not isinstance(cls, type):
        from workbench.catalog import method_classes

        names = ", ".join(c.__name__ for c in method_classes())
        raise ScenarioError(f"unknown method class {class_path!r}; choose one of: {names}")
    return cls


def method_parameters(class_path: str) -> set[str]:
    """The constructor arguments of a method class and of its bases (their `**kwargs`)."""
    names: set[str] = set()
    for cls in method_class(class_path).__mro__:
        if "__init__" in vars(cls):
            names |= {p for p in inspect.signature(vars(cls)["__init__"]).parameters if p not in ("self", "kwargs")}
    return names


@dataclass(frozen=True)
class Budget:
    """rounds: at most; patience, min_delta: the stopping rule on the hold-outs (engines.stopping)."""

    rounds: int = 50
    patience: int = 5
    min_delta: float = 0.001


@dataclass(frozen=True)
class References:
    """The centralized rows: logistic regression (ridge `l2` grid) and the gradient methods' MLP
    (`hidden_dim`, SGD in batches of `batch_size` at `lrs`, epochs up to the budget's rounds) on
    the pooled training rows, each chosen on the pooled hold-outs. `enabled: false`: no rows."""

    enabled: bool = True
    hidden_dim: int = 64
    batch_size: int = 64
    lrs: tuple[float, ...] = (0.03, 0.1, 0.3)
    l2: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 1e-1)

    def deciding(self, kind: str) -> dict[str, Any]:
        """What decides one run of the `kind` row besides its grid point (its run key's share):
        the logistic regression depends on no budget, the MLP on its width, batch and budget."""
        if kind == "logistic":
            return {"budget": None, "references": "logistic"}
        return {"references": {"hidden_dim": self.hidden_dim, "batch_size": self.batch_size}}


@dataclass(frozen=True)
class Run:
    """One fit: a setting × seed × method × grid point."""

    setting: dict[str, Any]
    seed: int
    method: MethodSpec
    point: dict[str, Any]

    @property
    def point_label(self) -> str:
        return ", ".join(f"{key}={short(value)}" for key, value in self.point.items()) or "—"

    def key(self, scenario: Scenario) -> str:
        """What makes a run the same run: its data and method settings in full (a changed config reruns it)."""
        what: dict[str, Any] = {"data": scenario.data_settings(self.setting, self.seed), "method": self.method.name,
                                "class_path": self.method.class_path,
                                "init_args": self.method.settings(self.point, self.seed, scenario.budget.rounds),
                                "budget": vars(scenario.budget), "references": None}
        if self.method.is_reference:  # only what decides this row: a widened grid keeps the runs it had
            what.update(scenario.references.deciding(self.method.init_args["kind"]))
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    protocol: str
    data: dict[str, Any]
    holdout: float
    settings: list[dict[str, Any]]
    seeds: list[int]
    budget: Budget
    references: References
    methods: list[MethodSpec]
    path: Path | None = None

    def data_settings(self, setting: dict[str, Any], seed: int) -> dict[str, Any]:
        """FederatedDataModule's arguments for one setting and seed: each client holds out its share."""
        return {**self.data, **setting, "seed": seed, "val_fraction": self.holdout, "val_split": "clients",
                "personalized": self.protocol == "personalized"}

    def rows(self) -> list[MethodSpec]:
        """The methods, and the two centralized references (global protocol) first."""
        if not self.references.enabled or self.protocol != "global":
            return list(self.methods)
        return [MethodSpec("Centralized logistic regression", REFERENCE, {"kind": "logistic"},
                           {"l2": list(self.references.l2)}),
                MethodSpec("Centralized MLP", REFERENCE, {"kind": "mlp"}, {"lr": list(self.references.lrs)}),
                *self.methods]

    def runs(self) -> list[Run]:
        """Every run, setting by setting and seed by seed (a cell's runs together)."""
        return [Run(setting, seed, method, point) for setting in self.settings for seed in self.seeds
                for method in self.rows() for point in method.points()]


def _cells(settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The settings' combinations: each key a value or a list; a list of dicts merges its dict."""
    axes = []
    for key, values in settings.items():
        values = values if isinstance(values, list) else [values]
        axes.append([value if isinstance(value, dict) else {key: value} for value in values])
    cells = []
    for combination in itertools.product(*axes):
        cell: dict[str, Any] = {}
        for part in combination:
            cell.update(part)
        unknown = set(cell) - set(CELL_KEYS)
        if unknown:
            raise ScenarioError(f"settings: {sorted(unknown)} cannot vary per cell; put fixed data settings under "
                                f"`data:`, vary only {', '.join(CELL_KEYS)}")
        cells.append(cell)
    return cells


def load_scenario(path: str | Path) -> Scenario:
    """The scenario of a YAML file, checked: every error names the key and the fix."""
    path = Path(path)
    if not path.is_file():
        raise ScenarioError(f"no scenario file {path}; the shipped ones are in benchmarks/scenarios/")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ScenarioError(f"{path} is not valid YAML: {str(error).splitlines()[0]}") from error
    known = {"name", "title", "protocol", "data", "holdout", "settings", "seeds", "budget", "references", "methods"}
    if unknown := set(raw) - known:
        raise ScenarioError(f"{path}: unknown keys {sorted(unknown)}; a scenario has {sorted(known)}")
    protocol = raw.get("protocol", "global")
    if protocol not in PROTOCOLS:
        raise ScenarioError(f"{path}: protocol must be one of {PROTOCOLS}, got {protocol!r}")
    data = dict(raw.get("data") or {})
    if fixed := set(data) & set(HARNESS_DATA_KEYS):
        raise ScenarioError(f"{path}: data.{sorted(fixed)[0]} is the harness's (seeds, holdout, protocol set it)")
    seeds = raw.get("seeds", [0, 1, 2])
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) for s in seeds)):
        raise ScenarioError(f"{path}: seeds must be a non-empty list of integers, got {seeds!r}")
    holdout = raw.get("holdout", 0.1)
    if not (isinstance(holdout, (int, float)) and 0 < holdout < 1):
        raise ScenarioError(f"{path}: holdout (each client's hold-out share) must be in (0, 1), got {holdout!r}")
    try:
        budget = Budget(**(raw.get("budget") or {}))
        reference_settings: dict[str, Any] = {key: tuple(value) if isinstance(value, list) else value
                                              for key, value in (raw.get("references") or {}).items()}
        references = References(**reference_settings)
    except TypeError as error:
        raise ScenarioError(f"{path}: {error} (budget: rounds, patience, min_delta; references: enabled, "
                            f"hidden_dim, batch_size, lrs, l2)") from error
    methods = []
    for name, spec in (raw.get("methods") or {}).items():
        if not isinstance(spec, dict) or "class_path" not in spec:
            raise ScenarioError(f"{path}: methods.{name} needs a class_path (e.g. FedAvg)")
        if unknown := set(spec) - {"class_path", "init_args", "grid"}:
            raise ScenarioError(f"{path}: methods.{name}: unknown keys {sorted(unknown)} (class_path, init_args, grid)")
        try:
            accepted = method_parameters(spec["class_path"])
        except ScenarioError as error:
            raise ScenarioError(f"{path}: methods.{name}: {error}") from None
        grid = spec.get("grid") or {}
        for key, values in grid.items():
            if not (isinstance(values, list) and values):
                raise ScenarioError(f"{path}: methods.{name}.grid.{key} must be a non-empty list, got {values!r}")
            if key.split(".")[0] not in accepted:
                raise ScenarioError(f"{path}: methods.{name}.grid.{key}: {spec['class_path']} has no setting "
                                    f"{key.split('.')[0]!r}; it takes {', '.join(sorted(accepted))}")
        methods.append(MethodSpec(str(name), spec["class_path"], dict(spec.get("init_args") or {}),
                                  {key: list(values) for key, values in grid.items()}))
    if not methods:
        raise ScenarioError(f"{path}: methods is empty; name at least one (e.g. AFL: {{class_path: AFL}})")
    declared = raw.get("settings") or {"num_clients": data.pop("num_clients", 10)}
    if not isinstance(declared, (dict, list)):
        raise ScenarioError(f"{path}: settings must be a mapping (every combination) or a list of them")
    settings = [cell for part in (declared if isinstance(declared, list) else [declared]) for cell in _cells(part)]
    if any("num_clients" not in cell for cell in settings):
        raise ScenarioError(f"{path}: settings.num_clients (K) is needed, e.g. num_clients: [10, 100]")
    return Scenario(str(raw.get("name") or path.stem), str(raw.get("title") or ""), protocol, data, float(holdout),
                    settings, seeds, budget, references, methods, path)
