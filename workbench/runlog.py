"""Where a run's numbers go: a CSV log always, Weights & Biases when wanted, a summary on screen."""
from __future__ import annotations

import csv
import os
import re
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, Logger


def _wandb_mode(requested: str) -> str:
    """`--wandb` wins; `auto` follows `WANDB_MODE` when it is set, else goes online only when an
    API key is configured, so a fresh machine never prompts."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (
        netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore"))
    return "online" if has_key else "offline"


def default_run_name(method, datamodule) -> str:
    info = datamodule.describe()
    name = f"{type(method).__name__}-{info['dataset']}-{info['partition']}-K{info['num_clients']}"
    return re.sub(r"[^A-Za-z0-9_.=,-]+", "_", name.lower())


VERSION_ENV = "WORKBENCH_RUN_VERSION"  # the version rank 0 claimed, for the other processes of a fit


def claim_version(root: Path) -> int:
    """Creates the next `root/version_N` exclusively and returns N: concurrent runs into one
    folder each get a folder of their own (the other processes of one fit share rank 0's)."""
    rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) or 0)
    if rank > 0 and os.environ.get(VERSION_ENV):
        return int(os.environ[VERSION_ENV])
    root.mkdir(parents=True, exist_ok=True)
    while True:
        taken = [int(m.group(1)) for p in root.iterdir() if (m := re.fullmatch(r"version_(\d+)", p.name))]
        version = max(taken, default=-1) + 1
        try:
            os.mkdir(root / f"version_{version}")
        except FileExistsError:  # another run took it first: look again
            continue
        os.environ[VERSION_ENV] = str(version)  # inherited by the processes a DDP fit starts
        return version


def make_loggers(method, datamodule, *, run_dir: str, run_name: str | None, wandb_mode: str,
                 wandb_project: str) -> list[Logger]:
    """CSV first (its folder, claimed here, is the run's folder), then W&B unless disabled."""
    name = run_name or default_run_name(method, datamodule)
    version = claim_version(Path(run_dir) / name)
    loggers: list[Logger] = [CSVLogger(save_dir=run_dir, name=name, version=version)]
    mode = _wandb_mode(wandb_mode)
    if mode != "disabled":
        from lightning.pytorch.loggers import WandbLogger

        os.environ["WANDB_MODE"] = mode  # W&B reads the variable too, and would let it win

        info = datamodule.describe()
        loggers.append(WandbLogger(
            # Beside the versions, not inside one: the CSV logger wants its version folder empty.
            project=wandb_project, name=name, save_dir=str(Path(run_dir) / name), mode=mode,
            group=type(method).__name__,
            tags=[info["dataset"], info["backbone"], info["partition"], f"K={info['num_clients']}"]))
        # Lightning passes anonymous=None, which W&B now warns has no effect on every run.
        getattr(loggers[-1], "_wandb_init", {}).pop("anonymous", None)
    return loggers


def log_hparams(trainer, engine, datamodule) -> None:
    """Logs the method's, the data's and the protocol's settings as `model.*`, `data.*`, `federation.*`.

    Lightning would merge both into one flat dict and refuse keys they share with different
    values (`model.seed` ≠ `data.seed` is a normal experiment), so its merge is turned off.
    """
    method = engine.method
    engine._log_hyperparams = datamodule._log_hyperparams = False
    def public(hparams) -> dict:  # without the CLI's `_class_path`/`_instantiator` entries
        return {key: value for key, value in hparams.items() if not key.startswith("_")}

    hparams = {"model": {"class": type(method).__name__, **public(method.hparams_initial)},
               "data": public(datamodule.hparams_initial),
               "federation": vars(engine.federation)}  # dropouts, secure aggregation, noise
    for logger in trainer.loggers:
        logger.log_hyperparams(hparams)


def save_per_client_table(table: dict[str, list], trainer) -> None:
    """Per-client accuracies: `per_client_acc.csv` in the run folder and a W&B table."""
    columns = list(table)
    rows = list(zip(*table.values()))
    if trainer.log_dir is not None and trainer.loggers:
        path = Path(trainer.log_dir) / "per_client_acc.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(columns)
            writer.writerows(rows)
    for logger in trainer.loggers:
        if hasattr(logger, "log_table"):  # WandbLogger
            logger.log_table(key="test/per_client_acc", columns=columns, data=[list(r) for r in rows])


def _megabytes(value: float) -> str:
    return f"{value / 1e6:,.3f} MB"


def print_summary(trainer, engine, checkpoint: Path | None = None) -> None:
    """One screen: accuracy, rounds, bytes, time and where the logs are."""
    method = engine.method
    metrics = {**engine.fit_metrics,
               **{k: float(v) for k, v in trainer.callback_metrics.items()}}
    lines = [
        f"method            {type(method).__name__}",
        f"test accuracy     {metrics.get('test/acc', float('nan')):.4f}",
        *([f"local accuracy    {metrics['test/acc_local_mean']:.4f} mean over clients, "
           f"{metrics['test/acc_local_min']:.4f} worst"] if "test/acc_local_mean" in metrics else []),
        f"rounds            {method.round}",
        f"bytes up          {_megabytes(metrics.get('comm/bytes_up', 0))} in all, "
        f"{_megabytes(metrics.get('comm/bytes_up_per_client', 0))} per client",
        f"bytes down        {_megabytes(metrics.get('comm/bytes_down', 0))}",
        f"time              fit {metrics.get('time/fit_s', float('nan')):.2f} s "
        f"(clients {metrics.get('time/client_s', float('nan')):.2f} s, "
        f"server {metrics.get('time/server_s', float('nan')):.2f} s)",
        f"logs              {trainer.log_dir}",
    ]
    if checkpoint is not None:
        lines.append(f"fitted model      {checkpoint}")
    width = max(map(len, lines))
    print("\n".join(["─" * width, *lines, "─" * width]))
