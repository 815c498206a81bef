"""The Flower engine against the in-process engine: the same model and bytes, and what Flower costs.

1. FedAvg (R rounds, K clients) fitted in process and over a Flower simulation (Ray, one
   SuperNode per client, one CPU per ClientApp): whole fit time, rounds time (`time/fit_s`), the
   largest difference between the two models, whether `comm/*` agree, and what Flower carried
   (`flower/bytes_up`, `flower/bytes_down`: the serialized arrays; the downlink is the plan's
   broadcast plus its framing, per message).
2. DeepAFL over Flower: the time of each round by depth. Each node keeps its client's Φ cache in
   its own state, so a round costs the same at every depth (flat), instead of rebuilding t
   layers in round t.

    python benchmarks/flower_engine.py                          # FedAvg R = 20, K = 10; DeepAFL T = 10
    python benchmarks/flower_engine.py --rounds 3 --clients 3 --layers 2 --train_size 2000   # a smoke run
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning import Callback

from benchmarks.common import load_average, machine_line, write_report
from workbench import methods
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.engines import LightningEngine
from workbench.engines.flower import simulation


class RoundTimes(Callback):
    """Wall seconds of every round (one Lightning epoch), as the server sees them, and the clients'
    own compute seconds in it (summed over clients; Flower's `client_compute_s`)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.compute: list[float] = []

    def _computed(self, pl_module) -> float:
        traffic = getattr(pl_module.clients, "traffic", None)
        return traffic.client_compute_s if traffic is not None else 0.0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._start, self._computed_before = time.perf_counter(), self._computed(pl_module)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        self.compute.append(self._computed(pl_module) - self._computed_before)


def slope(values: list[float]) -> float:
    """Least-squares slope of values against their index (seconds per round)."""
    mean_x, mean_y = (len(values) - 1) / 2, statistics.fmean(values)
    return (sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
            / sum((x - mean_x) ** 2 for x in range(len(values))))


def fit_once(method, datamodule, engine_name: str) -> tuple[float, LightningEngine, RoundTimes]:
    """-> (whole seconds, the engine after fit and test, its round times)."""
    times = RoundTimes()
    with tempfile.TemporaryDirectory(prefix="flower-bench-") as root:
        trainer = simulation.quiet_trainer(method.num_rounds, default_root_dir=root, callbacks=[times])
        engine = LightningEngine(method)
        start = time.perf_counter()
        if engine_name == "flower":
            engine.flower_run = simulation.fit(trainer, engine, datamodule)
        else:
            trainer.fit(engine, datamodule=datamodule)
            trainer.test(engine, datamodule=datamodule, verbose=False)
        return time.perf_counter() - start, engine, times


def largest_difference(method, reference) -> float:
    """max over tensors of max |method − reference| / max(1, max |reference|)."""
    state = method.state_dict()
    return max((float((state[name].double() - value.double()).abs().max())
                / max(1.0, float(value.double().abs().max())) for name, value in reference.state_dict().items()
                if value.numel()), default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=64, help="feature dimension of the synthetic data")
    parser.add_argument("--train_size", type=int, default=20000, help="training samples of the synthetic data")
    parser.add_argument("--clients", type=int, default=10, help="K")
    parser.add_argument("--rounds", type=int, default=20, help="FedAvg's R")
    parser.add_argument("--layers", type=int, default=10, help="DeepAFL's T (2T + 1 rounds)")
    parser.add_argument("--hidden", type=int, default=256, help="DeepAFL's h = f (and FedAvg's MLP width)")
    parser.add_argument("--out", default="benchmarks/results/flower_engine.md")
    args = parser.parse_args()

    load_before = load_average()
    bench_start = time.perf_counter()
    data = FederatedDataModule(dataset="synthetic", num_clients=args.clients, partition="dirichlet", alpha=0.5,
                               synthetic=SyntheticBlobs(dim=args.dim, train_size=args.train_size))
    data.setup("fit")

    def fedavg():
        return methods.FedAvg(num_rounds=args.rounds, architecture="mlp", hidden_dim=args.hidden)

    runs = {}
    for engine_name in ("lightning", "flower"):
        runs[engine_name] = fit_once(fedavg(), data, engine_name)
        print(f"FedAvg {engine_name}: {runs[engine_name][0]:.1f} s", flush=True)
    (whole_here, here, _), (whole_flower, flower, flower_rounds) = runs["lightning"], runs["flower"]
    same_bytes = all(here.fit_metrics[key] == flower.fit_metrics[key]
                     for key in ("comm/bytes_up", "comm/bytes_up_per_client", "comm/bytes_down"))
    traffic = flower.flower_run.traffic

    depth_rows = []
    if hasattr(methods, "DeepAFL"):
        deep = methods.DeepAFL(num_layers=args.layers, hidden_dim=args.hidden, block_dim=args.hidden)
        whole_deep, _, deep_rounds = fit_once(deep, data, "flower")
        print(f"DeepAFL T={args.layers} flower: {whole_deep:.1f} s", flush=True)
        depth_rows = list(enumerate(zip(deep_rounds.seconds, deep_rounds.compute, strict=True)))
        _, _, deep_here = fit_once(methods.DeepAFL(num_layers=args.layers, hidden_dim=args.hidden,
                                                   block_dim=args.hidden), data, "lightning")

    n, d = len(data.train_labels), data.feature_dim
    lines = [
        f"Data: synthetic Gaussian blobs, d = {d}, {n} training samples, K = {args.clients}, Dirichlet α = 0.5.",
        machine_line(f"flwr {version('flwr')}, ray {version('ray')}; whole benchmark "
                     f"{(time.perf_counter() - bench_start) / 60:.1f} min", load_before),
        "Flower: `run_simulation` on Ray, one SuperNode per client, 1 CPU per ClientApp "
        f"({min(os.cpu_count() or 1, args.clients)} at once); each node keeps its client's state in "
        "its `context.state`.",
        "",
        f"## FedAvg, {args.rounds} rounds, MLP h = {args.hidden}",
        "",
        "whole = fit and test (for Flower: Ray's start and stop, the SuperNodes' handshake and the clients' "
        "first imports included); rounds = `time/fit_s`. Max diff: the largest difference between the two "
        "models' tensors, relative to each tensor's largest entry when that exceeds 1.",
        "",
        "| engine | whole (s) | rounds (s) | median round (s) | max diff | comm/* agree | comm/bytes_up / down (MB) "
        "| Flower carried up / down (MB) |",
        "|---|---|---|---|---|---|---|---|",
        f"| in process | {whole_here:.2f} | {here.fit_metrics['time/fit_s']:.3f} | | | | "
        f"{here.fit_metrics['comm/bytes_up'] / 1e6:.3f} / {here.fit_metrics['comm/bytes_down'] / 1e6:.3f} | |",
        f"| Flower | {whole_flower:.1f} | {flower.fit_metrics['time/fit_s']:.2f} "
        f"| {statistics.median(flower_rounds.seconds):.3f} | {largest_difference(flower.method, here.method):.1e} "
        f"| {'yes' if same_bytes else 'NO'} | {flower.fit_metrics['comm/bytes_up'] / 1e6:.3f} / "
        f"{flower.fit_metrics['comm/bytes_down'] / 1e6:.3f} | {traffic.bytes_up / 1e6:.3f} / "
        f"{traffic.bytes_down / 1e6:.3f} |",
    ]
    if depth_rows:
        compute = [c for _, (_, c) in depth_rows][1:]  # the layer rounds (round 0 solves W₀ only)
        lines += ["", f"## DeepAFL over Flower, T = {args.layers}, h = f = {args.hidden}: round time by round",
                  "", "A node keeps its client's Φ cache between messages, so a round costs one layer of client "
                  "work at every depth: the clients' compute stays flat in depth (a client rebuilding Φ would "
                  "add one layer per depth, i.e. grow by about one round's compute every two rounds). "
                  f"Least-squares slope of the clients' compute over rounds 1–{2 * args.layers}: "
                  f"{slope(compute) * 1e3:+.2f} ms per round, against a median of "
                  f"{statistics.median(compute) * 1e3:.1f} ms per round; the same fit in process takes "
                  f"{statistics.median(deep_here.seconds[1:]) * 1e3:.1f} ms per round (median).",
                  "", "| round | wall seconds (server) | clients' compute (s, summed over clients) |", "|---|---|---|"]
        lines += [f"| {index} | {seconds:.3f} | {computed:.3f} |" for index, (seconds, computed) in depth_rows]
    else:
        lines += ["", "DeepAFL is not exported by workbench.methods in this tree: its depth table is skipped."]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
