"""`python -m workbench sweep sweeps/X.yaml`: run a W&B sweep file here, without W&B.

The sweep files are in W&B's format, so where W&B is reachable `wandb sweep sweeps/X.yaml` and
`wandb agent <sweep id>` run them unchanged. Offline, this runner expands the parameters itself
(`grid`: every combination, the first parameter varying slowest; `random`: `--count` draws from a
seeded generator) and runs each combination as the agent would: the sweep's `command` with
`${args}` replaced by the agent's `--key=value` flags, plus `--run_dir` and a `--run_name` made
from the values. Every run is a subprocess of its own, so a crash ends that run only.

    <run_dir>/<sweep>/<run name>/version_N/    the run: metrics.csv, config.yaml, model.ckpt
    <run_dir>/<sweep>/<run name>/status.json   done or failed, the flags, seconds, the error's tail
    <run_dir>/<sweep>/<run name>/output.log    everything the run printed

A run whose metrics.csv holds the sweep's metric is complete (the final test row is the last
thing a fit writes) and a second pass skips it; a run that failed is not started again (it would
fail alike) unless `--retry_failed`, except one stopped by a signal. `--config` runs the sweep on
other (composed) configs, `--set key=value` fixes a setting for every run, `--workers N` runs N at
a time; each run is tagged with the sweep's name (`WORKBENCH_SWEEP`, read by `workbench.runlog`).
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import io
import itertools
import json
import math
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from workbench.console import SWEEP_ENV
from workbench.files import write_text_atomically
from workbench.report.runs import last_value, read_metrics

# A string that YAML would have read as a number had it been written `1.0e-4`: PyYAML reads
# `1e-4` as text, and W&B would then sweep over the text.
NUMBER_AS_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _quantized(value: float, q: float) -> float | int:
    """W&B's q_* rule: round to a multiple of q, an int when q is an int."""
    value = round(value / q) * q
    return int(value) if isinstance(q, int) else value


# W&B's distributions that can be drawn without the server: name -> draw(rng, spec).
def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _normal(rng: random.Random, p: dict) -> float:
    return rng.gauss(p.get("mu", 0.0), p.get("sigma", 1.0))


SAMPLERS: dict[str, Callable[[random.Random, dict], Any]] = {
    "constant": lambda rng, p: p["value"],
    "categorical": lambda rng, p: rng.choices(p["values"], weights=p.get("probabilities"))[0],
    "int_uniform": lambda rng, p: rng.randint(p["min"], p["max"]),
    "uniform": lambda rng, p: rng.uniform(p["min"], p["max"]),
    "q_uniform": lambda rng, p: _quantized(rng.uniform(p["min"], p["max"]), p.get("q", 1)),
    "log_uniform": lambda rng, p: math.exp(rng.uniform(p["min"], p["max"])),  # min, max: exponents
    "log_uniform_values": lambda rng, p: _log_uniform(rng, p["min"], p["max"]),
    "q_log_uniform_values": lambda rng, p: _quantized(_log_uniform(rng, p["min"], p["max"]),
                                                      p.get("q", 1)),
    "normal": _normal,
    "q_normal": lambda rng, p: _quantized(_normal(rng, p), p.get("q", 1)),
    "log_normal": lambda rng, p: math.exp(_normal(rng, p)),
}


@dataclass
class Sweep:
    """A parsed sweep file; each parameter's spec has its `distribution` filled in."""

    path: Path
    method: str
    parameters: dict[str, dict[str, Any]]
    command: list[str]
    metric: str
    variant: str = ""  # what `with_overrides` changed, e.g. `dataset=mnist5k`

    @property
    def name(self) -> str:
        """The file's name, plus its overrides: the runs of another variant are other runs."""
        return f"{self.path.stem}+{self.variant}" if self.variant else self.path.stem

    @property
    def configs(self) -> list[str]:
        """The config files the command passes with `--config`, in order."""
        found = []
        for i, token in enumerate(self.command):
            if token == "--config" and i + 1 < len(self.command):
                found.append(self.command[i + 1])
            elif token.startswith("--config="):
                found.append(token.split("=", 1)[1])
        return found

    @property
    def config(self) -> str | None:
        """The config files the command passes, joined with `+`, or None."""
        return " + ".join(self.configs) or None


def with_overrides(sweep: Sweep, configs: list[str] | None = None,
                   settings: list[str] | None = None) -> Sweep:
    """The sweep with its command's `--config` files replaced by `configs` (composed in order)
    and `--key=value` for each `key=value` of `settings` before `${args}`, named after them
    (`afl_invariance+dataset=mnist5k`) so that its runs go to a folder of their own. A setting
    of a swept key is an error: the swept value would override it."""
    command = list(sweep.command)
    if configs:
        kept, skip = [], False
        for token in command:
            if skip:
                skip = False
            elif token == "--config":
                skip = True
            elif not token.startswith("--config="):
                kept.append(token)
        at = kept.index("${args}")
        command = [*kept[:at], *(t for c in configs for t in ("--config", c)), *kept[at:]]
    flags, labels = [], [Path(config).stem for config in configs or []]
    for setting in settings or []:
        key, equals, value = setting.partition("=")
        key = key.removeprefix("--")
        if not equals or not key:
            raise ValueError(f"--set {setting!r}: write key=value, e.g. --set data.dataset=mnist5k")
        if key in sweep.parameters:
            raise ValueError(f"--set {key}: the sweep varies {key}; change its values in "
                             f"{sweep.path} instead")
        flags.append(f"--{key}={value}")
        labels.append(f"{key.rsplit('.', 1)[-1]}={value}")
    at = command.index("${args}")
    variant = re.sub(r"[^A-Za-z0-9_.=,+-]+", "_", ",".join(labels))
    return Sweep(sweep.path, sweep.method, sweep.parameters, [*command[:at], *flags, *command[at:]],
                 sweep.metric, variant)


def _check_not_text_number(where: str, value: Any) -> None:
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, str) and NUMBER_AS_TEXT.fullmatch(item):
            raise ValueError(f"{where}: {item!r} is read as text, not a number; write floats with "
                             "a dot and a signed exponent, e.g. 1.0e-4")


def parameter_spec(name: str, spec: Any) -> dict[str, Any]:
    """A parameter's spec with its distribution made explicit by W&B's rules (`value`: constant,
    `values`: categorical, int `min`/`max`: int_uniform, float ones: uniform)."""
    where = f"parameter {name!r}"
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected a mapping such as {{values: [1, 2]}}, got {spec!r}")
    if "parameters" in spec:
        raise ValueError(f"{where}: nested parameters reach the CLI as one dict-valued flag; "
                         f"write each nested key as a dotted name instead, e.g. {name}.alpha")
    for key in ("value", "values", "min", "max"):
        if key in spec:
            _check_not_text_number(f"{where} {key}", spec[key])
    if "distribution" in spec:
        distribution = spec["distribution"]
    elif "value" in spec:
        distribution = "constant"
    elif "values" in spec:
        distribution = "categorical"
    elif "min" in spec and "max" in spec:
        bounds = (spec["min"], spec["max"])
        integers = all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
        distribution = "int_uniform" if integers else "uniform"
    else:
        raise ValueError(f"{where}: give `value`, `values`, `min`/`max` or a `distribution`")
    if distribution == "categorical_w_probabilities":
        distribution = "categorical"
    if distribution not in SAMPLERS:
        raise ValueError(f"{where}: distribution {distribution!r} is not supported offline; "
                         f"use one of {', '.join(SAMPLERS)}")
    values = spec.get("values")
    if distribution == "categorical" and not (isinstance(values, list) and values):
        raise ValueError(f"{where}: `values` must be a non-empty list")
    return {**spec, "distribution": distribution}


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file; ValueError naming the fix for anything this runner or the
    W&B agent would trip on."""
    path = Path(path)
    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"{path} is not valid YAML: {problem}{where}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: a sweep file is a mapping with method, parameters and command")
    method = spec.get("method")
    if method not in ("grid", "random", "bayes"):
        raise ValueError(f"{path}: method must be grid, random or bayes, got {method!r}")
    parameters = spec.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        raise ValueError(f"{path}: `parameters` must map CLI keys (data.alpha) to their values")
    command = spec.get("command")
    if not (isinstance(command, list) and all(isinstance(t, str) for t in command) and "${args}" in command):
        raise ValueError(f"{path}: `command` must be a list of strings, one token each, with "
                         "${args}: [${env}, python, -m, workbench, fit, --config, X.yaml, ${args}]")
    if "workbench" not in command:
        raise ValueError(f"{path}: the command must run the CLI: python -m workbench fit ...")
    config_at = [i for i, t in enumerate(command) if t == "--config" or t.startswith("--config=")]
    if config_at and config_at[-1] > command.index("${args}"):
        raise ValueError(f"{path}: put ${{args}} after --config, or the config overrides them")
    metric = (spec.get("metric") or {}).get("name", "test/acc")
    specs = {name: parameter_spec(name, p) for name, p in parameters.items()}
    return Sweep(path, method, specs, command, metric)


def grid_values(name: str, spec: dict[str, Any]) -> list[Any]:
    """The values a grid takes for one parameter (the ones W&B's grid can enumerate)."""
    distribution = spec["distribution"]
    if distribution == "constant":
        return [spec["value"]]
    if distribution == "categorical":
        return list(spec["values"])
    if distribution == "int_uniform":
        return list(range(spec["min"], spec["max"] + 1))
    if distribution == "q_uniform":
        q = spec.get("q", 1)
        steps = math.floor((spec["max"] - spec["min"]) / q + 1e-9)
        return [_quantized(spec["min"] + i * q, q) for i in range(steps + 1)]
    raise ValueError(f"parameter {name!r}: a grid enumerates values, and {distribution} has none; "
                     "give `values`, or use method: random with --count")


def expand_runs(sweep: Sweep, count: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """The parameter values of every run: a grid's product (its first `count` if given), or
    `count` seeded random draws."""
    if count is not None and count < 1:
        raise ValueError(f"--count must be ≥ 1, got {count}")
    if sweep.method == "grid":
        names = list(sweep.parameters)
        product = itertools.product(*(grid_values(n, sweep.parameters[n]) for n in names))
        return [dict(zip(names, values, strict=True)) for values in itertools.islice(product, count)]
    if sweep.method == "random":
        if count is None:
            raise ValueError("a random sweep draws until stopped: give the number of runs, --count")
        rng = random.Random(seed)
        draw = {name: SAMPLERS[spec["distribution"]] for name, spec in sweep.parameters.items()}
        return [{name: draw[name](rng, spec) for name, spec in sweep.parameters.items()}
                for _ in range(count)]
    raise ValueError(f"method {sweep.method!r} chooses each run from the results so far, which "
                     f"needs the W&B server: run `wandb sweep {sweep.path}`, then "
                     "`wandb agent <sweep id>`; or switch the file to method: grid or random")


def agent_flags(values: dict[str, Any]) -> list[str]:
    """The flags `wandb agent` puts in place of ${args}: `--key=value`, value as Python's str."""
    return [f"--{key}={value}" for key, value in values.items()]


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.10g}"
    if isinstance(value, (list, tuple)):
        return "+".join(map(_text, value))
    return str(value)


def value_labels(values: dict[str, Any]) -> list[str]:
    """`leaf=value` per parameter (`alpha=0.1`), the full key where two leaves coincide."""
    leaves = [key.rsplit(".", 1)[-1] for key in values]
    return [f"{leaf if leaves.count(leaf) == 1 else key}={_text(value)}"
            for (key, value), leaf in zip(values.items(), leaves, strict=True)]


def run_name(values: dict[str, Any]) -> str:
    """A folder name that is a function of the values alone, so a re-run finds its run again."""
    name = re.sub(r"[^A-Za-z0-9_.=,+-]+", "_", ",".join(value_labels(values)))
    if len(name) > 120:  # keep paths short; the hash keeps long names distinct
        name = f"{name[:110]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return name


def command_argv(sweep: Sweep, flags: list[str], run_folder: Path) -> list[str]:
    """The agent's command with these flags for ${args}, run by this Python, into `run_folder`."""
    argv = []
    for token in sweep.command:
        if token == "${env}":
            continue
        if token in ("python", "python3", "${interpreter}"):
            argv.append(sys.executable)
        elif token == "${args}":
            argv.extend(flags)
        elif token.startswith("${"):
            raise ValueError(f"{sweep.path}: the offline runner cannot expand {token} in `command`")
        else:
            argv.append(token)
    return [*argv, f"--run_dir={run_folder.parent}", f"--run_name={run_folder.name}"]


def cli_arguments(argv: list[str]) -> list[str]:
    """What follows `workbench` in a command: the CLI's own arguments (`fit --config ...`)."""
    return argv[argv.index("workbench") + 1:]


def parse_config(arguments: list[str]) -> tuple[dict[str, Any] | None, str | None]:
    """Parse CLI arguments the way a run would, building nothing: (the resolved config, None),
    or (None, the CLI's message). `--print_config` prints the checked config and exits 0."""
    from workbench.cli import main as workbench_main

    printed, errors = io.StringIO(), io.StringIO()
    with redirect_stdout(printed), redirect_stderr(errors), warnings.catch_warnings():
        # LightningCLI warns when given args while sys.argv holds others (`sweep ... --dry_run`).
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        try:
            workbench_main([*arguments, "--print_config"])
        except SystemExit as done:
            if done.code in (0, None):
                return yaml.safe_load(printed.getvalue()), None
            return None, errors.getvalue().strip() or f"exit status {done.code}"
    return None, "the CLI did not stop after printing its config"


@functools.cache
def _part_parser(part: str):
    """A parser of `model` (a FederatedMethod) or `data` (a FederatedDataModule) alone."""
    from jsonargparse import ArgumentParser

    from workbench.data import FederatedDataModule
    from workbench.methods import FederatedMethod

    parser = ArgumentParser(exit_on_error=False)
    base_class = {"model": FederatedMethod, "data": FederatedDataModule}[part]
    parser.add_subclass_arguments(base_class, part, required=True)
    return parser


def build_part(part: str, config: dict[str, Any], flags: Sequence[str] = ()) -> Any:
    """The method (`part` = model) or data module (data) of a config ({class_path, init_args}) and
    flags, built as the command line builds it (nested settings become their classes)."""
    parser = _part_parser(part)
    parsed = parser.parse_args([f"--{part}={json.dumps(config)}", *flags])
    # `instantiate_classes` became `instantiate` in jsonargparse 4.49
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    return instantiate(parsed)[part]


def construction_error(part: str, config: dict[str, Any], flags: list[str]) -> str | None:
    """Build a run's method (`part` = model) or data module (data) from its resolved config and
    the run's flags: the constructor checks the hyperparameters, and nothing is loaded, set up or
    fitted. None, or why it cannot be built."""
    try:
        build_part(part, config, flags)
    except Exception as error:  # whatever a constructor raises is the answer
        return error_summary(f"{type(error).__name__}: {error}".splitlines())
    return None


def check_runs(sweep: Sweep, runs: list[dict[str, Any]],
               run_dir: Path) -> tuple[str | None, dict[int, str]]:
    """(the CLI's message if it rejects a flag, else None; {run index: why its method or data
    module cannot be built}).

    The flags: every flag is type-checked as it is read and a later one overrides an earlier one,
    so one parse of all the runs' flags in turn checks each value of each key. A parameter that
    switches a class (`model`, `data`, `*.class_path`) changes which keys exist: then each run is
    parsed. Then the method's and the data module's constructors run on that resolved config plus
    the run's flags, once per distinct set of their flags (they do not depend on each other).
    """
    folder = run_dir / sweep.name
    switches_class = any("." not in key or key.endswith("class_path") for key in sweep.parameters)
    if switches_class:
        flag_lists = [agent_flags(values) for values in runs]
    else:
        flag_lists = [list(dict.fromkeys(flag for values in runs for flag in agent_flags(values)))]
    configs = []
    for flags in flag_lists:
        config, error = parse_config(cli_arguments(command_argv(sweep, flags, folder / "check")))
        if error is not None:
            return error, {}
        assert config is not None  # parse_config gives one or the other
        configs.append(config)
    failures: dict[int, str] = {}
    for part in ("model", "data"):
        errors: dict[tuple, str | None] = {}
        for i, values in enumerate(runs):
            config_index = i if switches_class else 0
            own = tuple(flag for flag in agent_flags(values) if re.match(rf"--{part}[.=]", flag))
            key = (config_index, own)
            if key not in errors:
                errors[key] = construction_error(part, configs[config_index][part], list(own))
            found = errors[key]
            if found is not None:
                failures.setdefault(i, found)
    return None, failures


# ---- running -------------------------------------------------------------------------------
def completed_version(run_folder: Path, metric: str) -> Path | None:
    """The newest version folder of a run whose metrics.csv holds `metric`, or None."""
    def number(metrics: Path) -> int:
        digits = metrics.parent.name.removeprefix("version_")
        return int(digits) if digits.isdigit() else -1

    for metrics in sorted(run_folder.glob("version_*/metrics.csv"), key=number, reverse=True):
        if math.isfinite(last_value(read_metrics(metrics), metric)):
            return metrics.parent
    return None


EXCEPTION_LINE = re.compile(r"^(([A-Za-z_][\w.]*)?(Error|Exception|Interrupt)\b|error: )")


def error_summary(lines: list[str]) -> str:
    """The last exception line of a log, with the first reason jsonargparse lists under it
    (`  - data.alpha must be > 0 ...`), which is where a config error's message ends up."""
    for i in range(len(lines) - 1, -1, -1):
        if EXCEPTION_LINE.match(lines[i]):
            reasons = [line.strip()[2:] for line in lines[i + 1:] if line.strip().startswith("- ")]
            return f"{lines[i]} — {reasons[0]}" if reasons else lines[i]
    return lines[-1] if lines else "no output"


def _write_status(run_folder: Path, status: dict[str, Any]) -> None:
    write_text_atomically(run_folder / "status.json", json.dumps(status, indent=2, default=str) + "\n")


def run_one(sweep: Sweep, values: dict[str, Any], run_folder: Path) -> dict[str, Any]:
    """Run one combination in a subprocess; its status (also written to status.json)."""
    run_folder.mkdir(parents=True, exist_ok=True)
    argv = command_argv(sweep, agent_flags(values), run_folder)
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
           "WANDB_SILENT": os.environ.get("WANDB_SILENT", "true"),
           SWEEP_ENV: sweep.name}  # the run tags itself with the sweep's name
    _write_status(run_folder, {"params": values, "command": argv, "status": "running",
                               "sweep": sweep.name, "metric": sweep.metric,
                               "runner": {"host": socket.gethostname(), "pid": os.getpid()}})
    start = time.perf_counter()
    with (run_folder / "output.log").open("w") as log:
        returncode = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    status = {"params": values, "command": argv, "returncode": returncode, "sweep": sweep.name,
              "seconds": round(time.perf_counter() - start, 2), "metric": sweep.metric}
    version = completed_version(run_folder, sweep.metric) if returncode == 0 else None
    if version is not None:
        status.update(status="done", version=str(version),
                      value=last_value(read_metrics(version / "metrics.csv"), sweep.metric))
    else:
        log_lines = (run_folder / "output.log").read_text(errors="replace").strip().splitlines()
        tail = [line[:500] for line in log_lines[-30:]]  # a config dump can be one huge line
        error = error_summary(tail) if returncode else f"exited 0 but logged no {sweep.metric}"
        status.update(status="failed", error=error, error_tail=tail)
    _write_status(run_folder, status)
    return status


def deterministic_failure(run_folder: Path) -> str | None:
    """The error of an earlier attempt that would fail alike again (refused, a user error, a
    crash, no metric), or None: never tried, finished, or stopped by a signal (worth a retry)."""
    path = run_folder / "status.json"
    try:
        status = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        return None
    code = status.get("returncode")
    signalled = isinstance(code, int) and (code < 0 or code >= 128)
    return status.get("error") if status.get("status") == "failed" and not signalled else None


def run_sweep(sweep: Sweep, runs: list[dict[str, Any]], run_dir: Path,
              refused: dict[int, str] | None = None, workers: int = 1,
              retry_failed: bool = False) -> dict[str, int]:
    """Run (or skip) every run, `workers` at a time, with a progress line each; the tally of
    done/skipped/failed. `refused` ({run index: why}, from `refused_runs`) are recorded as failed
    without starting; runs that failed deterministically before are not started again unless
    `retry_failed`."""
    refused = refused or {}
    folder = run_dir / sweep.name
    print(f"sweep {sweep.name}: {len(runs)} {sweep.method} runs of {sweep.config or 'its command'} "
          f"-> {folder}" + (f", {workers} at a time" if workers > 1 else ""), flush=True)
    tally = {"done": 0, "skipped": 0, "failed": 0}
    pending = []
    for i, values in enumerate(runs, 1):
        run_folder = folder / run_name(values)
        start = f"[{i}/{len(runs)}] {' '.join(value_labels(values))} ... "
        if i - 1 in refused:
            status: dict[str, Any] = {"params": values, "status": "failed", "returncode": None, "seconds": 0.0,
                                      "sweep": sweep.name, "metric": sweep.metric,
                                      "error": f"cannot be built: {refused[i - 1]}", "error_tail": []}
            run_folder.mkdir(parents=True, exist_ok=True)
            _write_status(run_folder, status)
            print(f"{start}FAILED, not started: {status['error']}", flush=True)
            tally["failed"] += 1
            continue
        version = completed_version(run_folder, sweep.metric)
        if version is not None:
            value = last_value(read_metrics(version / "metrics.csv"), sweep.metric)
            print(f"{start}skipped, complete: {sweep.metric}={value:.4f}", flush=True)
            tally["skipped"] += 1
            continue
        earlier = None if retry_failed else deterministic_failure(run_folder)
        if earlier is not None:
            print(f"{start}FAILED before, not retried (--retry_failed runs it again): {earlier}",
                  flush=True)
            tally["failed"] += 1
            continue
        pending.append((start, values, run_folder))

    def report(start: str, status: dict[str, Any], run_folder: Path) -> None:
        tally[status["status"]] += 1
        if status["status"] == "done":
            print(f"{start}done {sweep.metric}={status['value']:.4f} ({status['seconds']:.1f} s)",
                  flush=True)
        else:
            print(f"{start}FAILED ({status['seconds']:.1f} s): {status['error']} "
                  f"[{run_folder / 'output.log'}]", flush=True)

    # Each run is a subprocess: threads only wait on them, and print each line when it ends.
    with ThreadPoolExecutor(max_workers=max(workers, 1)) as pool:
        futures = {pool.submit(run_one, sweep, values, run_folder): (start, run_folder)
                   for start, values, run_folder in pending}
        for future in as_completed(futures):
            start, run_folder = futures[future]
            report(start, future.result(), run_folder)
    where = " (each failed run's status.json holds its error)" if tally["failed"] else ""
    print(f"{len(runs)} runs: {tally['done']} done, {tally['skipped']} skipped (already complete), "
          f"{tally['failed']} failed{where}")
    print(f"compare them: python -m workbench compare {folder} --out report/{sweep.name}")
    return tally


def refused_runs(sweep: Sweep, runs: list[dict[str, Any]], run_dir: Path) -> dict[int, str] | None:
    """Checks every run before any starts (`check_runs`): None, after printing the CLI's message,
    when it rejects a flag (every run would fail alike); else {run index: why it cannot be built}."""
    error, failures = check_runs(sweep, runs, run_dir)
    if error is not None:
        print(f"the CLI rejects the flags of this sweep; nothing was run:\n{error}", file=sys.stderr)
        return None
    return failures


def dry_run(sweep: Sweep, runs: list[dict[str, Any]], run_dir: Path) -> int:
    """Print each run's command, check the CLI accepts the flags and that each run's method and
    data module can be built from them; runs nothing."""
    folder = run_dir / sweep.name
    failures = refused_runs(sweep, runs, run_dir)
    for i, values in enumerate(runs):
        argv = command_argv(sweep, agent_flags(values), folder / run_name(values))
        print(f"[{i + 1}/{len(runs)}] {shlex.join(['python', *argv[1:]])}")
        if failures and i in failures:
            print(f"    cannot be built: {failures[i]}")
    if failures is None:
        return 2
    built = f"{len(failures)} cannot be built (above)" if failures else "each one can be built"
    print(f"the CLI accepts the flags of all {len(runs)} runs; {built}")
    return 2 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workbench sweep",
        description="Run a W&B sweep file locally, without W&B: grid or seeded random search, "
                    "one subprocess per run, complete runs skipped on a re-run.")
    parser.add_argument("sweep_file", help="a sweep file, e.g. sweeps/afl_invariance.yaml")
    parser.add_argument("--run_dir", default="runs/sweeps",
                        help="runs go to <run_dir>/<sweep name>/<run name>/ (default: runs/sweeps)")
    parser.add_argument("--count", type=int, default=None,
                        help="number of runs: required for random, the first N of a grid otherwise")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random draws (default: 0)")
    parser.add_argument("--dry_run", action="store_true",
                        help="print each run's command, check the CLI accepts it; run nothing")
    parser.add_argument("--config", action="append", metavar="FILE",
                        help="run the sweep on this config instead of its command's; repeat to "
                             "compose (configs/method/afl.yaml, then configs/data/mnist5k.yaml)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", dest="settings",
                        help="a setting for every run, e.g. --set data.dataset=mnist5k; repeatable")
    parser.add_argument("--workers", type=int, default=1,
                        help="runs at a time, each its own process (default: 1)")
    parser.add_argument("--retry_failed", action="store_true",
                        help="start again runs that failed before (by default only runs stopped "
                             "by a signal are started again)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be ≥ 1, got {args.workers}")
    try:
        sweep = with_overrides(load_sweep(args.sweep_file), args.config, args.settings)
        runs = expand_runs(sweep, args.count, args.seed)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    for config in sweep.configs:
        if not Path(config).exists():
            parser.error(f"{sweep.path} runs --config {config}, which does not exist here "
                         "(the command's paths are relative to the folder you run from, as with "
                         "wandb agent)")
    if args.dry_run:
        return dry_run(sweep, runs, Path(args.run_dir))
    refused = refused_runs(sweep, runs, Path(args.run_dir))
    if refused is None:
        return 2
    tally = run_sweep(sweep, runs, Path(args.run_dir), refused, workers=args.workers,
                      retry_failed=args.retry_failed)
    return 1 if tally["failed"] else 0
