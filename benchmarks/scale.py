"""Cross-device scale: fit time and peak memory at K = 100, 1,000, 10,000 clients; FedAvg's round
against its bare work and a per-client loop; accuracy against ε under client-level DP.

Data: Fashion-MNIST (60k/10k) through EfficientNet-Lite0 at 64 px (1280-d features, cached in
~/.cache/workbench/features), 2 classes per client (`pathological`) at every K: Dirichlet α = 0.1
finds no draw that leaves each client a sample beyond a few hundred clients of 60k samples (at
K = 1,000 none in 100 tries; at K = 10,000 a client holds 6 samples on average).

(a) fit: AFL, DeepAFL (T = 5) and FedAvg (MLP head, `--fedavg_rounds` rounds, a cohort of 100
    drawn by `federation.sample_rate` = 100/K). Each fit runs in a fresh process: "peak" is its
    peak resident memory during the fit (VmHWM, reset after loading the data), "over the loaded
    data" that peak less the process's memory before the fit (torch, Lightning, the features).
(b) FedAvg's round at K clients with full participation (the engine's client + server time)
    against the bare vectorized local SGD of the same clients on the same batches
    (`local_training.local_sgd` alone), and against a loop that trains one client per call.
(c) DP-FedAvg (linear head, `--dp_rounds` rounds, Poisson cohorts of rate 0.1 of 1,000 clients,
    adaptive clipping at the median, Andrew et al.): test accuracy against ε at δ = 1e-5 from
    dp-accounting's RDP accountant, for a few noise multipliers z.

    python benchmarks/scale.py                                  # everything
    python benchmarks/scale.py --parts fit --clients 100 1000   # a subset
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fit_engine, load_average, machine_line, write_report
from workbench.data import FederatedDataModule
from workbench.federation import Federation
from workbench.federation.local_training import local_sgd
from workbench.methods import AFL, DeepAFL, FedAvg

COHORT = 100


def datamodule(num_clients: int) -> FederatedDataModule:
    dm = FederatedDataModule(dataset="fashion_mnist", backbone="efficientnet_lite0", input_size=64,
                             num_clients=num_clients, partition="pathological", num_classes_per_partition=2,
                             seed=0, batch_size=8192)
    dm.setup()
    return dm


def memory_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (the peak since `reset_peak`) of this process, MB."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", status).group(1)) / 1024  # kB


def reset_peak() -> None:
    """Start VmHWM afresh (Linux): the fit's peak, not loading the data's."""
    Path("/proc/self/clear_refs").write_text("5")


def build(name: str, num_clients: int, rounds: int):
    """(method, federation) of one row of (a)."""
    if name == "AFL":
        return AFL(gamma=1.0, gamma_out=1.0), Federation()
    if name == "DeepAFL":
        return DeepAFL(num_layers=5), Federation()
    return FedAvg(num_rounds=rounds), Federation(sample_rate=min(1.0, COHORT / num_clients), seed=0)


def fit_child(name: str, num_clients: int, rounds: int) -> dict:
    """One fit of (a) in this (fresh) process."""
    dm = datamodule(num_clients)
    gc.collect()
    reset_peak()
    base = memory_mb("VmRSS")
    method, federation = build(name, num_clients, rounds)
    engine, _ = fit_engine(method, dm, federation, test=False)
    peak = memory_mb("VmHWM")
    accuracy = float((method(dm.test_features).argmax(1) == dm.test_labels).double().mean())
    return {"fit_s": engine.fit_metrics["time/fit_s"], "peak_mb": peak, "base_mb": base, "acc": accuracy}


def part_fit(args) -> list[str]:
    lines = ["## (a) Fit time and peak memory", "",
             f"FedAvg: {args.fedavg_rounds} rounds, cohort {COHORT}. Each fit in a fresh process.", "",
             "| method | K | fit (s) | peak RSS in the fit (MB) | over the loaded data (MB) | test acc |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in args.methods:
        for k in args.clients:
            done = subprocess.run([sys.executable, __file__, "--child", name, str(k), str(args.fedavg_rounds)],
                                  capture_output=True, text=True)
            if done.returncode:
                lines.append(f"| {name} | {k:,} | failed: {done.stderr.strip().splitlines()[-1][:80]} | | | |")
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            lines.append(f"| {name} | {k:,} | {r['fit_s']:.2f} | {r['peak_mb']:.0f} | "
                         f"{r['peak_mb'] - r['base_mb']:.0f} | {r['acc']:.4f} |")
            print(lines[-1], flush=True)
    return lines


def part_speed(args) -> list[str]:
    lines = ["", "## (b) FedAvg's round against its bare work and a per-client loop", "",
             "Full participation, MLP head (1280-256-10), 1 local epoch, batch 64; medians of "
             f"{args.repeats}.", "",
             "| K | engine round (s) | bare vectorized local SGD (s) | per-client loop (s) | round / bare | "
             "loop / round |", "|---:|---:|---:|---:|---:|---:|"]
    for k in args.speed_clients:
        dm = datamodule(k)
        clients = torch.unique(dm.train_client_ids)
        method = FedAvg(num_rounds=1)
        rounds = []
        for _ in range(args.repeats):
            engine, _ = fit_engine(FedAvg(num_rounds=1), dm, test=False)
            rounds.append(engine.fit_metrics["time/client_s"] + engine.fit_metrics["time/server_s"])
        net = method.build_net(engine.method.problem)
        x, y, ids = dm.train_features, dm.train_labels, dm.train_client_ids
        options = dict(epochs=1, lr=method.local.lr, batch_size=method.local.batch_size, seed=0)

        def timed(fn) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        def vectorized(net=net, x=x, y=y, ids=ids, clients=clients, options=options) -> None:
            local_sgd(net, x, y, ids, clients, **options)

        bare = statistics.median(timed(vectorized) for _ in range(args.repeats))
        starts = torch.searchsorted(ids, clients)
        ends = torch.searchsorted(ids, clients, right=True)

        def loop(net=net, x=x, y=y, ids=ids, clients=clients, starts=starts, ends=ends, options=options) -> None:
            for client, start, end in zip(clients.tolist(), starts.tolist(), ends.tolist(), strict=True):
                local_sgd(net, x[start:end], y[start:end], ids[start:end], torch.tensor([client]), **options)

        looped = timed(loop)  # once: the slow reference
        rnd = statistics.median(rounds)
        lines.append(f"| {k:,} | {rnd:.2f} | {bare:.2f} | {looped:.2f} | {rnd / bare:.2f} | {looped / rnd:.1f} |")
        print(lines[-1], flush=True)
    return lines


def part_dp(args) -> list[str]:
    k = 1000
    lines = ["", f"## (c) DP-FedAvg: accuracy against ε (δ = 1e-5), K = {k:,}", "",
             f"Linear head, {args.dp_rounds} rounds, Poisson cohorts of rate 0.1 (E[m] = 100), adaptive "
             "clipping towards the median update norm (initial C = 1, η_C = 0.2, σ_b = E[m]/20), the server "
             "averaging by the fixed E[m]; lr 0.05, 1 local epoch, batch 64.", "",
             "| noise multiplier z | ε at δ = 1e-5 | test acc | final clip norm C |", "|---:|---:|---:|---:|"]
    dm = datamodule(k)
    settings = [("no DP (no clipping, no noise)", None),
                *((f"{z:g}" + (" (clipping only)" if z == 0 else ""), z) for z in args.dp_multipliers)]
    for label, z in settings:
        method = FedAvg(num_rounds=args.dp_rounds, architecture="linear")
        protocol = (Federation(sample_rate=0.1, sampling="poisson", seed=0) if z is None else
                    Federation(sample_rate=0.1, sampling="poisson", dp_clip=1.0, dp_noise_multiplier=z,
                               dp_clip_quantile=0.5, seed=0))
        engine, tested = fit_engine(method, dm, protocol)
        metrics = engine.fit_metrics
        epsilon = metrics.get("privacy/epsilon")
        lines.append(f"| {label} | {'—' if epsilon is None else f'{epsilon:.2f}'} | {tested['test/acc']:.4f} | "
                     f"{metrics['privacy/clip_norm']:.3g} |" if z is not None else
                     f"| {label} | ∞ | {tested['test/acc']:.4f} | — |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["fit", "speed", "dp"], choices=["fit", "speed", "dp"])
    parser.add_argument("--clients", nargs="+", type=int, default=[100, 1000, 10000])
    parser.add_argument("--methods", nargs="+", default=["AFL", "DeepAFL", "FedAvg"],
                        choices=["AFL", "DeepAFL", "FedAvg"], help="the methods of (a)")
    parser.add_argument("--speed_clients", nargs="+", type=int, default=[100, 1000])
    parser.add_argument("--fedavg_rounds", type=int, default=20)
    parser.add_argument("--dp_rounds", type=int, default=50)
    parser.add_argument("--dp_multipliers", nargs="+", type=float, default=[0.0, 0.5, 1.0, 2.0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--note", default="", help="a line on reduced settings, printed under the title")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "scale.md"))
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "K", "ROUNDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(fit_child(args.child[0], int(args.child[1]), int(args.child[2]))))
        return
    load = load_average()
    lines = ["# Cross-device scale and client-level DP", "", "`python benchmarks/scale.py "
             + " ".join(sys.argv[1:]) + "`", ""] + ([args.note, ""] if args.note else [])
    parts = {"fit": part_fit, "speed": part_speed, "dp": part_dp}
    for part in args.parts:
        lines += parts[part](args)
    lines += ["", machine_line("times compare within this run only", load_at_start=load)]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
