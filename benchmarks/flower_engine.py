"""Flower engine against the in-process engine: wall time, the same model, the same bytes.

For AFL and DeepAFL (T = 2) with K = 10 and K = 100 clients, each repeat fits the method twice
in this one process, in process (Lightning's loop) and over a Flower simulation (Ray, one
SuperNode per client, one CPU per ClientApp), and reports medians over the repeats:

- whole: the whole fit call; for Flower, Ray's start and stop and the clients' first imports
  included (what a user waits for);
- rounds: `time/fit_s`, from the first round's start to the last server step;
- the largest difference between the two fitted models' tensors (float64, relative to each
  tensor's largest entry when that exceeds 1), and whether the method's byte counts
  (`comm/bytes_up`, `comm/bytes_down`) agree, beside what Flower carried.

    python benchmarks/flower_engine.py                          # synthetic blobs, d = 64
    python benchmarks/flower_engine.py --dataset mnist5k        # cached EfficientNet-Lite0 features
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

from lightning import Trainer  # noqa: E402

from benchmarks.common import load_average, machine_line, write_report  # noqa: E402
from workbench.data import FederatedDataModule, SyntheticBlobs  # noqa: E402
from workbench.federation import flower  # noqa: E402
from workbench.methods import AFL, DeepAFL  # noqa: E402

METHODS = {
    "AFL": lambda hidden: AFL(gamma=1.0, gamma_out=1.0),
    "DeepAFL T=2": lambda hidden: DeepAFL(num_layers=2, hidden_dim=hidden, block_dim=hidden),
}


def trainer_for(method, root: str) -> Trainer:
    return Trainer(max_epochs=method.num_rounds, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                   default_root_dir=root)


def fit_once(make, datamodule, engine: str) -> tuple[float, object, flower.FlowerTraffic | None]:
    """-> (whole seconds, the fitted method, Flower's traffic or None)."""
    method = make()
    with tempfile.TemporaryDirectory(prefix="flower-bench-") as root:
        trainer = trainer_for(method, root)
        start = time.perf_counter()
        if engine == "flower":
            traffic = flower.fit(trainer, method, datamodule)
        else:
            trainer.fit(method, datamodule=datamodule)
            traffic = None
        return time.perf_counter() - start, method, traffic


def largest_difference(method, reference) -> float:
    """max over tensors of max |method − reference| / max(1, max |reference|)."""
    state = method.state_dict()
    return max(float((state[name].double() - value.double()).abs().max())
               / max(1.0, float(value.double().abs().max())) for name, value in reference.state_dict().items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="synthetic")
    parser.add_argument("--dim", type=int, default=64, help="feature dimension of the synthetic data")
    parser.add_argument("--train_size", type=int, default=20000, help="training samples of the synthetic data")
    parser.add_argument("--hidden", type=int, default=64, help="DeepAFL's h = f")
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/flower_engine.md")
    args = parser.parse_args()

    load_before = load_average()
    bench_start = time.perf_counter()
    rows = []
    for num_clients in args.clients:
        data = FederatedDataModule(dataset=args.dataset, num_clients=num_clients, partition="dirichlet", alpha=0.5,
                                   synthetic=SyntheticBlobs(dim=args.dim, train_size=args.train_size),
                                   input_size=64 if args.dataset != "synthetic" else None)
        data.setup("fit")
        for name, build in METHODS.items():
            make = lambda: build(args.hidden)  # noqa: E731
            runs = {"lightning": [], "flower": []}
            for _ in range(args.repeats):  # interleaved, so load changes hit both engines
                for engine in runs:
                    runs[engine].append(fit_once(make, data, engine))
                    print(f"{name} K={num_clients} {engine}: {runs[engine][-1][0]:.1f} s", flush=True)
            whole = {engine: statistics.median(r[0] for r in done) for engine, done in runs.items()}
            rounds = {engine: statistics.median(r[1].fit_metrics["time/fit_s"] for r in done)
                      for engine, done in runs.items()}
            reference, over_flower = runs["lightning"][-1][1], runs["flower"][-1][1]
            traffic = runs["flower"][-1][2]
            same_bytes = all(reference.fit_metrics[key] == over_flower.fit_metrics[key]
                             for key in ("comm/bytes_up", "comm/bytes_up_per_client", "comm/bytes_down"))
            rows.append((name, num_clients, reference.round, whole, rounds,
                         max(largest_difference(r[1], reference) for r in runs["flower"]),
                         same_bytes, reference.fit_metrics, traffic))

    n, d = len(data.train_labels), data.feature_dim
    source = (f"synthetic Gaussian blobs, d = {d}" if args.dataset == "synthetic"
              else f"{args.dataset} features (efficientnet_lite0 at 64 px), d = {d}")
    lines = [
        f"Data: {source}, {n} training samples, Dirichlet α = 0.5; DeepAFL h = f = {args.hidden}; float64.",
        machine_line(f"flwr {version('flwr')}, ray {version('ray')}; median of {args.repeats} repeats; "
                     f"whole benchmark {(time.perf_counter() - bench_start) / 60:.1f} min", load_before),
        "Flower: `run_simulation` on Ray, one SuperNode per client, 1 CPU per ClientApp "
        f"({min(os.cpu_count() or 1, max(args.clients))} at once).",
        "whole = the fit call (for Flower: Ray's start and stop, the SuperNodes' handshake and the clients' "
        "first imports included); rounds = `time/fit_s`, from the first round's start to the last server "
        "step; ratios are Flower / in process. Max diff: the largest difference between the two fitted "
        "models' tensors, relative to each tensor's largest entry when that exceeds 1.",
        "",
        "| method | K | rounds | in process: whole / rounds (s) | Flower: whole / rounds (s) | whole ratio | rounds ratio "
        "| max diff of the models | comm/* bytes agree | comm/bytes_up (MB) | Flower carried up / down (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, k, num_rounds, whole, rounds, diff, same_bytes, fit_metrics, traffic in rows:
        lines.append(
            f"| {name} | {k} | {num_rounds} | {whole['lightning']:.2f} / {rounds['lightning']:.3f} "
            f"| {whole['flower']:.1f} / {rounds['flower']:.2f} | {whole['flower'] / whole['lightning']:.0f}× "
            f"| {rounds['flower'] / rounds['lightning']:.0f}× | {diff:.1e} | {'yes' if same_bytes else 'NO'} "
            f"| {fit_metrics['comm/bytes_up'] / 1e6:.3f} | {traffic.bytes_up / 1e6:.3f} / {traffic.bytes_down / 1e6:.3f} |")
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
