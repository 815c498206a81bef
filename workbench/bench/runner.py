"""Running a scenario's runs: each fit once, its record appended to `results.jsonl` as it ends.

A record holds what the leaderboard needs (final and best test accuracy, the hold-out score,
rounds, bytes, fit time, the learning curve) and the run's key (its data and method settings in
full): a rerun skips every key already recorded as done, so an interrupted bench resumes where
it stopped and a changed setting reruns only its runs. A run that raises is recorded as failed
with its error and the others go on (`--retry_failed` runs the failed ones again); one stopped by
the round's check for non-finite uploads is recorded as diverged, a grid point's outcome that is
never chosen and not run again. Each run also
leaves a run folder (`config.yaml`, `metrics.csv`) that `workbench compare` reads.

A method whose grid varies only settings its server's last solve reads (`MethodSpec.shares_fit`)
runs a cell's points as one job: the first point fits, the others solve that fit again.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
import traceback
import warnings
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import yaml

from workbench.bench.scenario import Run, Scenario, setting_label, short
from workbench.files import write_text_atomically
from workbench.sweep import error_summary

DATA_CLASS = "workbench.data.FederatedDataModule"
#: Lightning's notices that say nothing about a bench run (one round per epoch, no optimizer, ...)
QUIET = (".*configure_optimizers.* returned `None`", ".*does not have many workers", ".*LeafSpec.*",
         ".*GPU available.*", ".*TPU available.*", ".*Total length of .* across ranks is zero",
         ".*Experiment logs directory .* exists.*")


def slug(text: str) -> str:
    """A folder name for a label: `K=100 dirichlet α=0.1` -> `K=100_dirichlet_α=0.1`."""
    return "".join(c if c.isalnum() or c in "=.-+α" else "_" for c in text).strip("_") or "default"


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a results file, in order (a line cut short by a crash is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def latest(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each key's last record (a retried run's outcome replaces the failed one)."""
    return {record["key"]: record for record in records}


class DataModules:
    """The set-up data modules of one process, one per (setting, seed): features read once."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.modules: dict[tuple[str, int], Any] = {}

    def get(self, run: Run):
        from workbench.sweep import build_part

        key = (json.dumps(run.setting, sort_keys=True), run.seed)
        if key not in self.modules:
            self.modules.clear()  # runs come cell by cell: keep one cell's data in memory
            config = {"class_path": DATA_CLASS, "init_args": self.scenario.data_settings(run.setting, run.seed)}
            data = build_part("data", config)
            data.setup()
            self.modules[key] = data
        return self.modules[key]


def fit_method(scenario: Scenario, run: Run, data, folder: Path, systems=None) -> dict[str, Any]:
    """One method's fit and test in process, logged to `folder`: the record's numbers; under
    `systems` (`workbench.federation.systems.Systems`) also its simulated clock's."""
    engine = fit_engine(scenario, run, data, folder, systems)
    return scored(scenario, run, engine, data, folder, engine.trainer)


def bench_trainer(folder: Path):
    """A Trainer that logs to `folder` (`metrics.csv`) and says nothing else."""
    from lightning import Trainer
    from lightning.pytorch.loggers import CSVLogger

    return Trainer(logger=CSVLogger(folder.parent, name="", version=folder.name),
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, log_every_n_steps=1, accelerator="cpu", devices=1)


def fit_engine(scenario: Scenario, run: Run, data, folder: Path, systems=None):
    """The fitted LightningEngine of one run (the stopping rule on the hold-outs)."""
    from workbench.engines import LightningEngine
    from workbench.engines.stopping import Stopping
    from workbench.sweep import build_part

    quiet()  # (after Lightning's import, which sets its loggers' levels)
    init_args = run.method.settings(run.point, run.seed, scenario.budget.rounds)
    method = build_part("model", {"class_path": run.method.class_path, "init_args": init_args})
    budget = scenario.budget
    engine = LightningEngine(method, stopping=Stopping(patience=budget.patience, min_delta=budget.min_delta),
                             systems=systems)
    bench_trainer(folder).fit(engine, datamodule=data)
    return engine


def resolved(scenario: Scenario, run: Run, engine, data, folder: Path) -> dict[str, Any]:
    """The record of a grid point of server settings only, from an earlier point's fitted engine:
    its method solved again at `run.point` (`FederatedMethod.resolve`, what a fit at the point gives)
    and tested. Its `fit_s` is the fit's (the solve's cost does not depend on the value), its
    `solve_s` what solving again took; its folder logs the fit's numbers with the new scores."""
    start = time.perf_counter()
    engine.resolve(**run.point)
    solve_s = time.perf_counter() - start
    trainer = bench_trainer(folder)
    trainer.logger.log_metrics(dict(engine.fit_metrics), step=0)
    return {**scored(scenario, run, engine, data, folder, trainer), "solve_s": solve_s}


def scored(scenario: Scenario, run: Run, engine, data, folder: Path, trainer) -> dict[str, Any]:
    """A fitted engine's record: tested by `trainer` (whose logger writes `folder`), its curve and
    the fit's numbers; the run's config written beside its metrics."""
    tested = trainer.test(engine, datamodule=data, verbose=False)[0]
    init_args = run.method.settings(run.point, run.seed, scenario.budget.rounds)
    fit, curve = engine.fit_metrics, engine.curve
    write_text_atomically(folder / "config.yaml", yaml.safe_dump(
        {"model": {"class_path": run.method.class_path, "init_args": json.loads(json.dumps(init_args, default=str))},
         "data": {"class_path": DATA_CLASS, "init_args": scenario.data_settings(run.setting, run.seed)},
         "engine": "lightning"}, sort_keys=False))
    tested_points = [point for point in curve if "round/test_acc" in point]
    best: dict[str, Any] = max(tested_points, key=lambda point: point["round/test_acc"], default={})
    if scenario.protocol == "personalized":  # chosen as scored: each client's own model on its own hold-out
        holdout = engine.personal_accuracy("val")
    else:
        held = [point for point in curve if "round/val_acc" in point]
        holdout = held[-1]["round/val_acc"] if held else math.nan
    clocked, clock = {}, engine.protocol.clock
    if clock is not None:  # the simulated seconds by then, at each scored round
        clocked = {"latency_s": fit["latency/total_s"], "stragglers": int(fit["latency/stragglers_total"]),
                   "row_s": clock.row_s,
                   "latency_curve": [[point["round"], point["round/test_acc"], point["round/latency_s"]]
                                     for point in tested_points]}
    return {**clocked, "test_acc": tested.get("test/acc", math.nan),
            "personal_acc": tested.get("test/acc_local_mean", math.nan), "holdout_acc": holdout,
            "best_test_acc": best.get("round/test_acc", math.nan), "best_round": best.get("round", math.nan),
            "rounds": int(fit["comm/rounds"]), "up_mb": fit["comm/bytes_up"] / data.num_clients / 1e6,
            "down_mb": fit["comm/bytes_down"] / data.num_clients / 1e6, "fit_s": fit["time/fit_s"],
            "curve": [[point["round"], point["round/test_acc"], point["round/bytes_up_per_client"] / 1e6]
                      for point in tested_points]}


def fit_reference(scenario: Scenario, run: Run, data) -> dict[str, Any]:
    from workbench.bench import references
    from workbench.data.population import population_of

    budget, settings = scenario.budget, scenario.references
    population = population_of(data)
    if run.method.init_args["kind"] == "logistic":
        result = references.logistic_regression(population, l2=run.point["l2"])
    else:
        result = references.pooled_mlp(population, lr=run.point["lr"], hidden_dim=settings.hidden_dim,
                                       batch_size=settings.batch_size, seed=run.seed, epochs=budget.rounds,
                                       patience=budget.patience, min_delta=budget.min_delta)
    curve = result.pop("curve")
    best: dict[str, Any] = max(curve, key=lambda point: point["test_acc"], default={})
    return {**result, "personal_acc": math.nan, "best_test_acc": best.get("test_acc", result["test_acc"]),
            "best_round": best.get("round", 0), "up_mb": math.nan, "down_mb": math.nan,
            "curve": [[point["round"], point["test_acc"], math.nan] for point in curve]}


def jobs(runs: list[Run]) -> list[list[Run]]:
    """The runs in jobs of one fit: a run each, but the points of one method in one cell whose grid
    varies server settings only (`MethodSpec.shares_fit`) together, in their order."""
    grouped: dict[Any, list[Run]] = {}
    for run in runs:
        shared = (json.dumps(run.setting, sort_keys=True), run.seed, run.method.name)
        grouped.setdefault(shared if run.method.shares_fit else id(run), []).append(run)
    return list(grouped.values())


def run_job(scenario: Scenario, job: list[Run], modules: DataModules, run_dir: Path) -> list[dict[str, Any]]:
    """The records of a job's runs: the first point fits, each further one solves that fit again
    (after a failed fit, the next point fits)."""
    records, fitted = [], None
    for run in job:
        record, fitted = run_one(scenario, run, modules, run_dir, fitted)
        records.append(record)
    return records


def run_one(scenario: Scenario, run: Run, modules: DataModules, run_dir: Path,
            fitted: tuple[Any, Run] | None = None) -> tuple[dict[str, Any], tuple[Any, Run] | None]:
    """One run's record, done or failed (never raises but for an interrupt), and its fitted engine
    with the run that fitted it (None for a reference or a failure); `fitted`: such a pair of
    another point of this run's server settings, solved again instead of a new fit."""
    record = {"key": run.key(scenario), "scenario": scenario.name, "setting": setting_label(run.setting),
              **{f"data.{key}": value for key, value in run.setting.items()}, "seed": run.seed,
              "method": run.method.name, "class_path": run.method.class_path, "point": run.point,
              "point_label": run.point_label}
    start, fit = time.perf_counter(), None
    try:
        data = modules.get(run)
        if run.method.is_reference:
            record.update(fit_reference(scenario, run, data))
        else:
            folder = (run_dir / slug(record["setting"]) / slug(run.method.name) / slug(run.point_label)
                      / f"seed_{run.seed}")
            if fitted is None:
                engine = fit_engine(scenario, run, data, folder)
                record.update(scored(scenario, run, engine, data, folder, engine.trainer))
                fit = engine, run
            else:
                record.update(resolved(scenario, run, fitted[0], data, folder), solved_from=fitted[1].point_label)
                fit = fitted
            record["run_folder"] = str(folder)
        record["status"] = "done"
    except Exception as error:
        # the round's guard against non-finite uploads: a grid point whose steps blew up is an
        # outcome (never chosen, not retried), not a fault of the harness or the data
        status = "diverged" if isinstance(error, FloatingPointError) else "failed"
        # jsonargparse puts a config error's reason on the lines under its first
        record.update(status=status, error=error_summary(f"{type(error).__name__}: {error}".splitlines())[:500],
                      traceback=traceback.format_exc()[-4000:])
    record["wall_s"] = time.perf_counter() - start
    record["machine"] = machine()
    return record, fit if record["status"] == "done" else None


def machine() -> str:
    """Where a run ran (its times compare with others of the same machine only)."""
    import torch

    from workbench.bench.machine import cpu_name

    threads = torch.get_num_threads()
    return (f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__} with {threads} "
            f"thread{'s' * (threads != 1)}")


def quiet() -> None:
    for notice in QUIET:
        warnings.filterwarnings("ignore", message=notice)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)


_WORKER: dict[str, Any] = {}


def _worker_start(scenario: Scenario, run_dir: Path, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    os.environ.setdefault("WANDB_MODE", "disabled")
    quiet()
    _WORKER.update(scenario=scenario, run_dir=run_dir, modules=DataModules(scenario))


def _worker_run(job: list[Run]) -> list[dict[str, Any]]:
    return run_job(_WORKER["scenario"], job, _WORKER["modules"], _WORKER["run_dir"])


def run_all(scenario: Scenario, runs: list[Run], results: Path, run_dir: Path, workers: int = 1,
            ) -> Iterator[dict[str, Any]]:
    """Runs `runs` (in order; with `workers` > 1 that many processes, each with its share of the
    cores), appending each record to `results` as it ends and yielding it."""
    results.parent.mkdir(parents=True, exist_ok=True)

    def keep(record: dict[str, Any]) -> dict[str, Any]:
        with results.open("a") as out:  # one line per record, flushed: a crash loses at most the run in flight
            out.write(json.dumps(record, default=float) + "\n")
        return record

    if workers <= 1:
        quiet()
        modules = DataModules(scenario)
        for job in jobs(runs):
            for record in run_job(scenario, job, modules, run_dir):
                yield keep(record)
        return
    import multiprocessing

    threads = max(1, (os.cpu_count() or 1) // workers)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_start,
                             initargs=(scenario, run_dir, threads)) as pool:
        # a cell's runs to one worker in a row would keep its data warm; the pool takes them in order
        for future in as_completed([pool.submit(_worker_run, job) for job in jobs(runs)]):
            for record in future.result():
                yield keep(record)


def describe(record: dict[str, Any]) -> str:
    """One line of progress: the run and what it reached."""
    what = f"{record['method']} [{record['point_label']}] {record['setting']} seed {record['seed']}"
    if record["status"] != "done":
        return f"{what}: {record['status'].upper()} {record['error']}"
    rounds = f", {record['rounds']} rounds" if record.get("rounds") else ""
    return (f"{what}: test {100 * record['test_acc']:.2f} %, hold-out {100 * record['holdout_acc']:.2f} %"
            f"{rounds}, {short(round(record['wall_s'], 1))} s")
