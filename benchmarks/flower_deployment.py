"""The Flower engine deployed: a round's time on a SuperLink and SuperNodes on this machine's
loopback (`LocalDeployment`, K SuperNodes), by Flower's isolation mode, beside a bare Flower app
deployed the same way and the same fit simulated.

- bare Flower, `--isolation subprocess` (Flower's default): `bare_flower_app.py` (our own ServerApp
  averaging a flat weight vector, ClientApps taking the same local SGD with torch.optim.SGD; the
  ClientApp process imports Flower, torch and numpy) as a deployed Flower App: what Flower itself
  costs a round;
- the workbench, `--isolation subprocess`: each message a new ClientApp process (Flower's), which
  imports the workbench, reads the node's rows and builds the client again;
- the workbench, `--isolation process` with its long-lived ClientApp
  (`python -m workbench.engines.flower.node`): imports, rows and client kept across messages;
- the workbench simulated (`--engine flower`, Ray): the same fit on one machine without SuperNodes.

Every run is FedAvg of an MLP head (h) on synthetic blobs (d, n samples, K clients, Dirichlet 0.5),
R rounds, 1 local epoch, batch 64, lr 0.05. A round is the server's: the bare server's own timing,
the workbench's `time/client_s` per round (its wait for the clients' replies, which the rest of
its round barely adds to). Clients' compute: the ClientApp handlers' seconds, summed per round.

    python benchmarks/flower_deployment.py                          # K = 3, R = 8
    python benchmarks/flower_deployment.py --rounds 3 --train_size 3000   # a smoke run
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from benchmarks.bare_flower_app import write_partitions  # noqa: E402
from benchmarks.common import load_average, machine_line, write_report  # noqa: E402
from workbench.engines.flower.local_deployment import LocalDeployment  # noqa: E402

BARE_APP = """[project]
name = "bare-flower"
version = "0.1.0"
dependencies = []

[tool.flwr.app]
publisher = "benchmarks"

[tool.flwr.app.components]
serverapp = "benchmarks.bare_flower_app:bare_server"
clientapp = "benchmarks.bare_flower_app:bare_client"

[tool.flwr.app.config]
{config}
"""


def fit_config(args) -> dict:
    return {"model": {"class_path": "FedAvg", "init_args": {
                "num_rounds": args.rounds, "architecture": "mlp", "hidden_dim": args.hidden, "seed": 0,
                "local": {"epochs": 1, "lr": 0.05, "batch_size": 64}}},
            "data": {"class_path": "FederatedDataModule", "init_args": {
                "dataset": "synthetic", "num_clients": args.clients, "partition": "dirichlet", "alpha": 0.5,
                "synthetic": {"dim": args.dim, "train_size": args.train_size, "num_classes": 10}}}}


def per_round(folder: Path) -> dict[str, list[float]]:
    """Each round's increments of the fit's running `time/client_s` and `flower/client_compute_s`."""
    rows = [row for row in csv.DictReader((folder / "metrics.csv").open()) if row.get("time/client_s")]
    out: dict[str, list[float]] = {}
    for key in ("time/client_s", "flower/client_compute_s"):
        totals = [float(row[key]) for row in rows]
        out[key] = [b - a for a, b in zip([0.0, *totals], totals, strict=False)]
    return out


def workbench_row(name: str, folder: Path, wall_s: float) -> dict:
    rounds = per_round(folder)
    return {"name": name, "round": statistics.median(rounds["time/client_s"]),
            "compute": statistics.median(rounds["flower/client_compute_s"]), "whole": wall_s}


def deployed(args, root: Path, isolation: str, config: Path) -> dict:
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with LocalDeployment(root / isolation, args.clients, isolation=isolation, env=env) as federation:
        start = time.perf_counter()
        submitted = federation.submit(["--config", str(config), f"--run_dir={root / isolation / 'runs'}",
                                       "--run_name=fit", "--wandb=disabled", "--trainer.enable_progress_bar=false"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _, err = submitted.communicate()
        if submitted.returncode:
            raise RuntimeError(f"the {isolation} deployment's fit failed:\n{err[-3000:]}")
        return workbench_row(f"workbench, --isolation {isolation}" + (" + long-lived ClientApp"
                                                                       if isolation == "process" else ""),
                             root / isolation / "runs" / "fit" / "version_0", time.perf_counter() - start)


def bare_deployed(args, root: Path) -> dict:
    app, out, partitions = root / "bare_app", root / "bare.json", root / "partitions"
    app.mkdir(parents=True)
    write_partitions(partitions, args.dim, args.train_size, args.clients)  # the nodes read their rows
    config = {"dim": args.dim, "train_size": args.train_size, "clients": args.clients, "classes": 10,
              "hidden": args.hidden, "lr": 0.05, "epochs": 1, "batch_size": 64, "rounds": args.rounds,
              "partitions": str(partitions), "out": str(out)}
    (app / "pyproject.toml").write_text(BARE_APP.format(config="\n".join(
        f"{key} = {json.dumps(value)}" for key, value in config.items())))
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with LocalDeployment(root / "bare", args.clients, isolation="subprocess", env=env) as federation:
        start = time.perf_counter()
        done = subprocess.run(["flwr", "run", str(app), "local", "--stream"], env=federation.env,
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"flwr run of the bare app failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        wall_s = time.perf_counter() - start
    if not out.exists():
        raise RuntimeError(f"the bare app's run wrote no {out}: see {root / 'bare' / 'logs'}")
    run = json.loads(out.read_text())
    return {"name": "bare Flower, --isolation subprocess", "round": statistics.median(run["round_s"]),
            "compute": run["client_s"] / len(run["round_s"]), "whole": wall_s}


def simulated(args, root: Path, config: Path) -> dict:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "workbench", "fit", "--config", str(config), "--engine=flower",
                    f"--run_dir={root / 'sim'}", "--run_name=fit", "--wandb=disabled",
                    "--trainer.enable_progress_bar=false"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return workbench_row("workbench simulated (Ray)", root / "sim" / "fit" / "version_0", time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=3, help="K (one SuperNode each)")
    parser.add_argument("--rounds", type=int, default=8, help="R")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--train_size", type=int, default=20000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/flower_deployment.md"))
    args = parser.parse_args()
    load_at_start, start = load_average(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flower-deployment-") as folder:
        root = Path(folder)
        config = root / "fit.yaml"
        config.write_text(yaml.safe_dump(fit_config(args)))
        rows = [bare_deployed(args, root)]
        print(f"{rows[-1]['name']}: {rows[-1]['round']:.2f} s a round", flush=True)
        for isolation in ("subprocess", "process"):
            rows.append(deployed(args, root, isolation, config))
            print(f"{rows[-1]['name']}: {rows[-1]['round']:.2f} s a round", flush=True)
        rows.append(simulated(args, root, config))
        print(f"{rows[-1]['name']}: {rows[-1]['round']:.2f} s a round", flush=True)
    bare, simulation = rows[0]["round"], rows[-1]["round"]
    lines = [
        f"FedAvg, MLP h = {args.hidden}, on synthetic blobs (d = {args.dim}, {args.train_size} samples, "
        f"K = {args.clients}, Dirichlet 0.5), {args.rounds} rounds, 1 local epoch, batch 64.",
        machine_line(f"flwr {version('flwr')}, one torch thread per process; a SuperLink and {args.clients} "
                     "SuperNodes on loopback, insecure; whole benchmark "
                     f"{(time.perf_counter() - start) / 60:.1f} min", load_at_start),
        "",
        "## A round deployed, by isolation mode",
        "",
        "round: the median of the server's per-round wait for its clients' replies (bare: its round); clients' "
        "compute: the ClientApp handlers' seconds in a round (median; bare: mean), all clients; whole: the "
        "submitted run from `flwr run` to its end (the ServerApp's start, the first messages' imports included).",
        "",
        "| how | round (s) | × bare Flower's round | × the simulated round | clients' compute a round (s) "
        "| whole (s) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {row['name']} | {row['round']:.2f} | {row['round'] / bare:.2f}× | {row['round'] / simulation:.1f}× "
              f"| {row['compute']:.3f} | {row['whole']:.0f} |" for row in rows]
    print(f"wrote {write_report(lines, args.out)}")


if __name__ == "__main__":
    main()
