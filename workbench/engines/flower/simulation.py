"""Fit (and test) over Flower: on the deployed ServerApp's grid, or in a local Ray simulation.

The clients' state lives on their nodes only while the Flower run lives, so `fit` runs the test
inside the run too (personalized methods score their local test splits on the clients).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from lightning import Trainer

from workbench.engines.flower import INSTALL_HINT
from workbench.engines.flower.client_app import app as client_app
from workbench.engines.flower.client_app import quiet_flower
from workbench.engines.flower.transport import DEPLOYED_GRID, FlowerClients, FlowerTraffic, LogTraffic
from workbench.engines.flower_settings import FlowerSettings
from workbench.engines.lightning import LightningEngine


@dataclasses.dataclass
class FlowerRun:
    """What `fit` leaves: Flower's traffic (`bytes_up`, `bytes_down`, `client_compute_s`,
    `wall_s`) and the test's results (Lightning's list of metric dicts; empty without a test)."""

    traffic: FlowerTraffic
    test_results: list = dataclasses.field(default_factory=list)

    def __getattr__(self, name: str):  # run.bytes_up, run.wall_s: the traffic's
        if name == "traffic":
            raise AttributeError(name)
        return getattr(self.traffic, name)


def fit_over_grid(grid: Grid, trainer: Trainer, engine: LightningEngine, datamodule, *, test: bool = True,
                  settings: FlowerSettings | None = None, **fit_args) -> FlowerRun:
    """`trainer.fit(engine, **fit_args)` (and `trainer.test`) with every client's work on the
    SuperNodes of `grid` (`fit_args`: Lightning's, e.g. `ckpt_path` to resume a fit: its clients
    start afresh on their nodes)."""
    if trainer.world_size > 1:
        raise ValueError("the Flower engine runs the server in one process: set trainer.devices=1")
    clients = FlowerClients(grid, engine.method, datamodule, settings, engine.pipeline)
    engine.remote_clients, engine.clients = clients, None  # the engine's clients for this run: the nodes
    if datamodule.learns_from_nodes:  # cross-silo sites: the method and protocol checked against what they told
        engine.check_data(datamodule, fitting=True)
    log_traffic = LogTraffic(clients.traffic)
    trainer.callbacks.append(log_traffic)  # type: ignore[attr-defined]  # Lightning sets it at run time
    run = FlowerRun(clients.traffic)
    try:
        trainer.fit(engine, datamodule=datamodule, **fit_args)
        if test and not trainer.interrupted and engine.method.fitted:
            run.test_results = trainer.test(engine, datamodule=datamodule, verbose=False)
    finally:
        trainer.callbacks.remove(log_traffic)  # type: ignore[attr-defined]
        clients.close()
    return run


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Environment variables set for the block only."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _short_link(target: Path) -> Iterator[Path]:
    """A short symlink to `target` in the system temp folder, for the block only.

    Ray puts Unix sockets under RAY_TMPDIR and a socket path may not exceed 107 bytes, which a
    run folder is usually too deep for; through the link, Ray's files still land in `target`.
    """
    link = Path(tempfile.mkdtemp(prefix="wb-ray-"))
    link.rmdir()
    link.symlink_to(target.resolve(), target_is_directory=True)
    try:
        yield link
    finally:
        link.unlink()


def fit(trainer: Trainer, engine: LightningEngine, datamodule, *, test: bool = True,
        settings: FlowerSettings | None = None, ray_init_args: dict | None = None, **fit_args) -> FlowerRun:
    """`trainer.fit(engine, datamodule)` and, with `test`, `trainer.test` over Flower; the method
    ends fitted and the run's metrics are logged as in process, plus `flower/*`.

    Inside a deployed ServerApp (`server_app`) the rounds go over its SuperNodes. Otherwise a
    Flower simulation runs one SuperNode per client on Ray: `settings.client_cpus` CPUs per
    ClientApp (so at most cores / client_cpus of them at once), `ray_init_args` added to
    `ray.init`'s; Ray's temporary files (RAY_TMPDIR) and FLWR_HOME go to `<trainer.log_dir>/flower`.
    `settings` (`FlowerSettings`) also hold the deadlines for the SuperNodes' replies; `fit_args`
    go to `trainer.fit` (`ckpt_path`: resume).
    """
    if not isinstance(engine, LightningEngine):
        raise TypeError(f"the Flower engine runs a LightningEngine, got {type(engine).__name__}")
    start = time.perf_counter()
    datamodule.setup("fit")  # before any client: fills the feature cache the clients then read
    settings = settings or FlowerSettings()
    grid = DEPLOYED_GRID.get()
    if grid is None and datamodule.learns_from_nodes:
        raise ValueError("the sites' files are on their own SuperNodes (data SiteData without data.sites), and a "
                         "simulation starts nodes without files: fit on a deployment (docs/engines.md, "
                         "cross-silo), or list the files in data.sites to simulate the sites")
    if grid is not None:
        run = fit_over_grid(grid, trainer, engine, datamodule, test=test, settings=settings, **fit_args)
    else:
        run = _simulate(trainer, engine, datamodule, test, settings, ray_init_args or {}, fit_args)
    run.traffic.wall_s = time.perf_counter() - start
    return run


def _simulate(trainer, engine, datamodule, test: bool, settings: FlowerSettings, ray_init_args: dict,
              fit_args: dict) -> FlowerRun:
    if importlib.util.find_spec("ray") is None:
        raise ImportError(INSTALL_HINT)
    from flwr.simulation import run_simulation

    quiet_flower()
    outcome: dict[str, FlowerRun] = {}
    server = ServerApp()

    @server.main()
    def _rounds(grid: Grid, context: Context) -> None:
        outcome["run"] = fit_over_grid(grid, trainer, engine, datamodule, test=test, settings=settings, **fit_args)

    num_clients = datamodule.num_clients
    cpus = max(1, min(os.cpu_count() or 1, math.ceil(num_clients * settings.client_cpus)))  # no idle Ray workers
    backend = {"client_resources": {"num_cpus": settings.client_cpus, "num_gpus": 0.0},
               "init_args": {"include_dashboard": False, "num_cpus": cpus, **ray_init_args}}
    run_dir = Path(trainer.log_dir or trainer.default_root_dir) / "flower"
    (run_dir / "ray").mkdir(parents=True, exist_ok=True)
    with _short_link(run_dir / "ray") as ray_dir, _environment(
            RAY_TMPDIR=str(ray_dir), FLWR_HOME=str(run_dir.resolve()),
            RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0"):  # no GPUs involved; silences Ray's notice
        run_simulation(server_app=server, client_app=client_app, num_supernodes=num_clients,
                       backend_config=backend)
    if "run" not in outcome:  # (a fit stopped by a signal ends its run, unfitted, with its checkpoint)
        raise RuntimeError("the Flower simulation ended before the last round; its log above says why")
    return outcome["run"]


def quiet_trainer(**settings) -> Trainer:
    """A Trainer for a method's full fit (the engine sets its epochs from the rounds) with no logs,
    bars or checkpoints (settings override)."""
    return Trainer(**{"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                      "enable_model_summary": False, "num_sanity_val_steps": 0, **settings})


def fit_over_flower(method, datamodule, federation=None, trainer_kwargs: dict | None = None, *,
                    test: bool = True, **options) -> LightningEngine:
    """A method's full fit (and test) over a Flower simulation, as `LightningEngine` runs it in
    process: returns the engine (`engine.fit_metrics`, `engine.trainer.callback_metrics`,
    `engine.local_accuracy`, `engine.flower_run`). `options` go to `fit` (settings, ray_init_args)."""
    engine = LightningEngine(method, federation)
    trainer = quiet_trainer(**(trainer_kwargs or {}))
    engine.flower_run = fit(trainer, engine, datamodule, test=test, **options)  # type: ignore[assignment]  # for the caller
    return engine
