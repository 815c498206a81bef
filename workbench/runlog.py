"""Where a run's numbers go: a CSV log always, Weights & Biases when wanted, a summary on screen."""
from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import re
import shutil
import signal
import time
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, Logger

from workbench.console import SWEEP_ENV
from workbench.files import NoRoom, out_of_room, write_text_atomically
from workbench.settings import init_arguments, plain
from workbench.sync import wandb_configured


def _wandb_mode(requested: str) -> str:
    """`--wandb` wins; `auto` follows `WANDB_MODE` when it is set, else goes online only when
    W&B is configured — an API key, a self-hosted `WANDB_BASE_URL`, or the `~/.netrc` entry
    `wandb login` writes for its host (api.wandb.ai, or the `base_url` of W&B's settings file) —
    so a fresh machine never prompts."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if wandb_configured() else "offline"


def sweep_name() -> str | None:
    """The sweep this run belongs to: the offline runner's name, or a W&B agent's sweep id."""
    return os.environ.get(SWEEP_ENV) or os.environ.get("WANDB_SWEEP_ID")


PARAMS_ENV = "WORKBENCH_SWEEP_PARAM_PATH"  # the agent's file, kept for a DDP fit's other processes


def agent_values() -> dict:
    """The values a W&B sweep agent chose for this run ({key: value}, in the sweep file's
    order), read from its `WANDB_SWEEP_PARAM_PATH` file; {} outside an agent."""
    path = os.environ.get("WANDB_SWEEP_PARAM_PATH") or os.environ.get(PARAMS_ENV)
    if not path or not Path(path).exists():
        return {}
    import yaml

    params = yaml.safe_load(Path(path).read_text()) or {}
    return {key: spec.get("value") if isinstance(spec, dict) else spec
            for key, spec in params.items() if not key.startswith("_")}


def _value_text(value) -> str:
    return f"{value:.10g}" if isinstance(value, float) else str(value)


def default_run_name(method, datamodule) -> str:
    """`<method>-<dataset>-<partition>-K<K>`, plus `leaf=value` of each value a sweep agent chose
    (runs of one sweep would otherwise share a name and a folder)."""
    info = datamodule.describe()
    name = f"{type(method).__name__}-{info['dataset']}-{info['partition']}-K{info['num_clients']}"
    swept = [f"{key.rsplit('.', 1)[-1]}={_value_text(value)}" for key, value in agent_values().items()]
    name = ",".join([name, *swept])
    name = re.sub(r"[^A-Za-z0-9_.=,-]+", "_", name.lower())  # dirichlet(alpha=0.5) -> dirichlet_alpha=0.5_
    return re.sub(r"_+(?=[-,]|$)", "", name)  # ... and no "_" left before a separator or at the end


VERSION_ENV = "WORKBENCH_RUN_VERSION"  # the version rank 0 claimed, for the other processes of a fit


#: the version folder this process claimed (rank 0 of a fit), where `record_ending` writes
claimed: Path | None = None


def claim_version(root: Path) -> int:
    """Creates the next `root/version_N` exclusively and returns N: concurrent runs into one
    folder each get a folder of their own (the other processes of one fit share rank 0's)."""
    global claimed
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
        claimed = root / f"version_{version}"
        return version


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def record_ending(error: BaseException, argv: list[str]) -> None:
    """A run that ends in an error, or stopped by a signal, says so in its version folder's
    `status.json` (`compare` lists it with the error's last line, sweep or not); nothing is
    written before a folder was claimed (the input was refused: nothing ran) or for a clean exit."""
    if claimed is None or not claimed.is_dir():
        return
    if out_of_room(error) and not any(claimed.glob("*.ckpt")):  # a full disk before a checkpoint: nothing to keep
        shutil.rmtree(claimed, ignore_errors=True)  # (a status.json could not be written either)
        with contextlib.suppress(OSError):  # the run name's folder, when this run made it
            claimed.parent.rmdir()
        return
    if isinstance(error, SystemExit):
        code = error.code if isinstance(error.code, int) else int(error.code is not None)
        if code == 0:
            return
        stopped = code > 128  # 128 + the signal: a clean stop at a round's end
        status = {"status": "stopped" if stopped else "failed", "returncode": code,
                  "error": f"stopped by {_signal_name(code - 128)}; resume with fit --ckpt_path last" if stopped
                           else f"exited with status {code}"}
    elif isinstance(error, KeyboardInterrupt):
        status = {"status": "stopped", "error": "interrupted (Ctrl-C); resume with fit --ckpt_path last"}
    else:
        lines = [line for line in str(error).splitlines() if line.strip()]
        status = {"status": "failed", "error": f"{type(error).__name__}: {lines[-1] if lines else ''}".strip()}
    try:
        write_text_atomically(claimed / "status.json", json.dumps({**status, "command": argv}, indent=2) + "\n")
    except OSError as full:
        if not out_of_room(full):
            raise


def make_loggers(method, datamodule, *, run_dir: str, run_name: str | None, wandb_mode: str,
                 wandb_project: str, engine: str = "lightning") -> list[Logger]:
    """CSV first (its folder, claimed here, is the run's folder), then W&B unless disabled."""
    name = run_name or default_run_name(method, datamodule)
    version = claim_version(Path(run_dir) / name)
    loggers: list[Logger] = [CSVLogger(save_dir=run_dir, name=name, version=version)]
    mode = _wandb_mode(wandb_mode)
    if mode != "disabled":
        from lightning.pytorch.loggers import WandbLogger

        os.environ["WANDB_MODE"] = mode  # W&B reads the variable too, and would let it win
        # Under a sweep agent W&B would copy each swept value into the config as a flat
        # `data.alpha` key beside the nested one `log_hparams` writes: it is read here instead
        # (for the run's name) and W&B does not see the file.
        if "WANDB_SWEEP_PARAM_PATH" in os.environ:
            os.environ[PARAMS_ENV] = os.environ.pop("WANDB_SWEEP_PARAM_PATH")

        info = datamodule.describe()
        sweep = sweep_name()
        loggers.append(WandbLogger(
            # Beside the versions, not inside one: the CSV logger wants its version folder empty.
            project=wandb_project, name=name, save_dir=str(Path(run_dir) / name), mode=mode,
            group=type(method).__name__,
            tags=[info["dataset"], info["backbone"], info["partition"], f"K={info['num_clients']}",
                  f"engine={engine}", *([f"sweep={sweep}"] if sweep else [])]))
        # Lightning passes anonymous=None, which W&B now warns has no effect on every run.
        getattr(loggers[-1], "_wandb_init", {}).pop("anonymous", None)
    return loggers


def log_hparams(trainer, engine, datamodule, engine_name: str = "lightning") -> None:
    """Logs the method's, the data's and the protocol's settings as `model.*`, `data.*`,
    `federation.*` (and the protocol's stages in round order, `protocol`, with those of one's own,
    `stages`), with `engine`, the sweep's name and the run's folder; the folder gets
    `wandb.json` (the W&B run's id, project, mode and files), so each names the other.

    Lightning would merge both into one flat dict and refuse keys they share with different
    values (`model.seed` ≠ `data.seed` is a normal experiment), so its merge is turned off.
    """
    method = engine.method
    engine._log_hyperparams = datamodule._log_hyperparams = False
    log_dir = trainer.log_dir  # read by every process: under DDP it is a broadcast
    hparams = {"model": {"class": type(method).__name__, **plain(init_arguments(method))},  # groups as dicts
               "data": plain(init_arguments(datamodule)),
               "federation": plain(engine.federation),  # dropouts, secure aggregation, noise
               "protocol": engine.pipeline.describe(),  # its stages in round order, stages of one's own included
               "stages": engine.pipeline.identity(),
               "engine": engine_name, "processes": trainer.world_size,
               "sweep": sweep_name(),
               "run_folder": str(Path(log_dir).resolve()) if log_dir else None}
    for logger in trainer.loggers:
        try:
            logger.log_hyperparams(hparams)
        except OSError as error:  # Lightning's writer leaves what it wrote of hparams.yaml
            if not out_of_room(error) or log_dir is None:
                raise
            (Path(log_dir) / "hparams.yaml").unlink(missing_ok=True)
            raise NoRoom("hparams.yaml", Path(log_dir), None, "free some space, or choose another --run_dir") from None
    run = _wandb_run(trainer)
    if run is not None and trainer.is_global_zero and log_dir is not None:
        link = {"id": run.id, "name": run.name, "project": run.project,
                "mode": os.environ.get("WANDB_MODE", "online"),  # set by make_loggers
                "files": str(Path(run.dir).parent), "url": run.url}
        write_text_atomically(Path(log_dir) / "wandb.json", json.dumps(link, indent=2) + "\n")


def _wandb_run(trainer):
    """The W&B run of this fit, or None (W&B disabled)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            return logger.experiment
    return None


#: per-step accuracies whose best value (and where it was reached) goes into the W&B summary
STEP_ACCURACIES = {"depth/test_acc": "depth", "round/test_acc": "round", "val/acc": "round"}


_IMPORTED = time.monotonic()


def process_seconds() -> float:
    """Seconds since this process started: imports, feature extraction and an engine's start
    included (Linux's /proc; elsewhere since this module was imported)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def finish_run(trainer) -> float:
    """After a fit and its test: logs `time/wall_s` (the process's seconds so far) to every
    logger and puts final and best per-step accuracies in the W&B summary; returns the seconds."""
    wall_s = process_seconds()
    log_dir = trainer.log_dir  # read by every process: under DDP it is a broadcast
    for logger in trainer.loggers:
        logger.log_metrics({"time/wall_s": wall_s}, step=trainer.global_step + 1)
        logger.save()
    run = _wandb_run(trainer)
    if run is not None and trainer.is_global_zero and log_dir is not None:
        from workbench.report.runs import read_metrics  # no torch: a CSV reader

        rows = read_metrics(Path(log_dir) / "metrics.csv")
        for key, axis in STEP_ACCURACIES.items():
            points = [(row[key], row.get("depth/depth", row.get("step")) if axis == "depth"
                       else row.get("epoch", math.nan) + 1)  # Lightning's epochs count from 0
                      for row in rows if key in row]
            if len(points) > 1:
                best, at = max(points, key=lambda point: point[0])
                run.summary.update({f"{key}.best": best, f"{key}.final": points[-1][0],
                                    f"{key}.best_{axis}": at})
        run.summary["time/wall_s"] = wall_s
    return wall_s


def save_per_client_table(table: dict[str, list], trainer) -> None:
    """Per-client accuracies: `per_client_acc.csv` in the run folder and a W&B table."""
    columns = list(table)
    rows = list(zip(*table.values(), strict=True))
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


def save_client_events(rows: list[list], trainer) -> None:
    """Clients whose replies never came and clients that came back on a new node, by round
    (`client_events.csv`: round, client, event (`missing`, `rejoined`), why; rewritten whole
    after each round with an event) and a W&B table."""
    columns = ["round", "client", "event", "why"]
    if trainer.log_dir is not None and trainer.loggers and trainer.is_global_zero:
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(columns)
        writer.writerows(rows)
        write_text_atomically(Path(trainer.log_dir) / "client_events.csv", buffer.getvalue())
    for logger in trainer.loggers:
        if hasattr(logger, "log_table"):  # WandbLogger
            logger.log_table(key="comm/client_events", columns=columns, data=[list(r) for r in rows])


def _simulated_time(metrics: dict, systems: str) -> str:
    """The summary's line of the simulated clock: its seconds, the profiles, the stragglers it
    dropped and this machine's seconds per row it timed the clients' compute with."""
    stragglers = int(metrics.get("latency/stragglers_total", 0))
    parts = [systems, *([f"{stragglers} straggler{'s' * (stragglers != 1)} dropped"] if stragglers else []),
             *([f"compute {1e6 * metrics['latency/row_s']:.3g} µs a row here"] if "latency/row_s" in metrics else [])]
    return f"simulated time    {metrics['latency/total_s']:.3g} s on the clients' links ({'; '.join(parts)})"


def _megabytes(value: float) -> str:
    return f"{value / 1e6:,.3f} MB"


def print_summary(trainer, engine, checkpoint: Path | None = None,
                  wall_s: float | None = None) -> None:
    """One screen: accuracy, rounds, bytes, time and where the logs are."""
    method = engine.method
    metrics = {**engine.fit_metrics,
               **{k: float(v) for k, v in trainer.callback_metrics.items()}}
    lines = [
        f"method            {type(method).__name__}",
        f"test accuracy     {metrics['test/acc']:.4f}" if "test/acc" in metrics else
        "test accuracy     —",
        *([f"local accuracy    {metrics['test/acc_local_mean']:.4f} mean over clients, "
           f"{metrics['test/acc_local_min']:.4f} worst"] if "test/acc_local_mean" in metrics else []),
        f"rounds            {method.round}",
        f"bytes up          {_megabytes(metrics.get('comm/bytes_up', 0))} in all, "
        f"{_megabytes(metrics.get('comm/bytes_up_per_client', 0))} per client",
        f"bytes down        {_megabytes(metrics.get('comm/bytes_down', 0))}",
        *([f"protocol          {line}"] if (line := engine.pipeline.line()) else []),
        *([f"screen            {int(metrics['screen/rejected_total'])} uploads rejected, from "
           f"{int(metrics['screen/clients_rejected'])} clients (each left out from its first rejection on)"]
          if "screen/rejected_total" in metrics else []),
        *([f"privacy           ε = {metrics['privacy/epsilon']:.3g} at δ = {engine.federation.dp_delta:g}"]
          if "privacy/epsilon" in metrics else []),
        *([f"local privacy     ε = {metrics['privacy/local_epsilon']:.3g} at δ = {engine.federation.dp_delta:g} for "
           "each client's own uploads (against the server too)"] if "privacy/local_epsilon" in metrics else []),
        f"time              fit {metrics.get('time/fit_s', float('nan')):.2f} s "
        f"(clients {metrics.get('time/client_s', float('nan')):.2f} s, "
        f"server {metrics.get('time/server_s', float('nan')):.2f} s, "
        f"learning curve {metrics.get('time/curve_s', float('nan')):.2f} s)",
        *([_simulated_time(metrics, engine.systems.describe())] if "latency/total_s" in metrics else []),
        f"logs              {trainer.log_dir}",
    ]
    if wall_s is not None:  # beside fit time: imports, extraction and the engine's start too
        lines.insert(-1, f"wall time         {wall_s:.1f} s end to end")
    if checkpoint is not None:
        lines.append(f"fitted model      {checkpoint}")
    width = max(map(len, lines))
    print("\n".join(["─" * width, *lines, "─" * width]))
