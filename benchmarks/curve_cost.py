"""What a learning curve costs: FedAvg's fit with the test split scored every round, every fifth
round, and never, on the cached Fashion-MNIST features (K = 100, Dirichlet α = 0.1).

A curve point is the global model on the 10k test rows (and, with a validation split, on it):
one forward pass of the MLP head over cached features, beside a round of 100 clients' local SGD.
The three settings run in turn, `--repeats` times each; the table gives the median fit seconds
(`time/fit_s`) and the ratio to no curve, measured in the same process.

    python benchmarks/curve_cost.py                      # writes benchmarks/results/curve_cost.md
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fit_engine, load_average, machine_line, write_report
from workbench.data import FederatedDataModule
from workbench.federation.local_training import LocalTraining
from workbench.methods import FedAvg

DATA = {"dataset": "fashion_mnist", "backbone": "efficientnet_lite0", "input_size": 64, "num_clients": 100,
        "partition": "dirichlet", "alpha": 0.1, "seed": 0}
EVERY = (0, 5, 1)  # never, every fifth round, every round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/curve_cost.md")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*(configure_optimizers|does not have many workers|GPU available"
                                              "|TPU available|max_epochs).*")
    load_start = load_average()
    data = FederatedDataModule(**DATA)
    data.setup()
    seconds: dict[int, list[float]] = {every: [] for every in EVERY}
    points: dict[int, int] = {}
    for _ in range(args.repeats):
        for every in EVERY:  # in turn: a slower minute of the machine falls on all three
            method = FedAvg(num_rounds=args.rounds, architecture="mlp", hidden_dim=64, seed=0,
                            local=LocalTraining(epochs=1, lr=0.03, batch_size=64))
            engine, _ = fit_engine(method, data, test=False, eval_every=every)
            seconds[every].append(engine.fit_metrics["time/fit_s"])
            points[every] = sum("round/test_acc" in point for point in engine.curve)
    base = statistics.median(seconds[0])
    lines = ["# What a learning curve costs", "",
             f"FedAvg (MLP 64, 1 local epoch, B 64, lr 0.03), {args.rounds} rounds, Fashion-MNIST features "
             f"(EfficientNet-Lite0 64 px, d = 1280), K = 100, Dirichlet α = 0.1; median of {args.repeats} fits each, "
             "run in turn in one process. A curve point scores the global model on the 10k test rows.", "",
             "| eval_every | curve points | fit s (median) | × no curve |", "|---|---|---|---|"]
    for every in EVERY:
        median = statistics.median(seconds[every])
        lines.append(f"| {every}{' (never)' if every == 0 else ''} | {points[every]} | {median:.2f} | "
                     f"{median / base:.3f} |")
    lines += ["", machine_line(f"{args.repeats} × {len(EVERY)} fits", load_start)]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
