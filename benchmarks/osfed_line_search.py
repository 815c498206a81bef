"""OS-FED's snapshot fits: the batched L-BFGS line search before and after it evaluated only the
clients still searching, timed side by side in one run.

K clients' first-round updates (local SGD from w₀, as the engine's first round) on synthetic blobs
of the dimension of configs/osfed_fashion.yaml's cached features (1280-d EfficientNet-Lite0, 10
classes), that config's method (MLP head of 64, 1 local epoch at lr 0.05 in batches of 64, 2×2-grid
snapshots, 30 L-BFGS steps with 10 pairs), all K clients' snapshots fitted at once
(`SnapshotGeometry.fit_snapshots`). `reference` is the old line search (every backtrack evaluates
all K clients, those that already accepted a step where they stand, until the slowest accepts:
`reference_lbfgs` in tests/methods/test_osfed.py, a faithful copy of the old loop, which the test
holds equal to the new); `gathered` the product's `lbfgs`, whose backtracks evaluate only the
clients still searching. The runs alternate, `--repeats` of each; a fit is timed whole (the
correlated start labels, L-BFGS, the final α and g(S*)).

    python benchmarks/osfed_line_search.py                       # K = 100, 3 repeats (a few minutes)
    python benchmarks/osfed_line_search.py --num_clients 20 --repeats 1 --out /tmp/ls.md   # a quick look
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import cast

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workbench.methods.osfed as osfed
from benchmarks.common import load_average, machine_line, write_report
from tests.methods.test_osfed import reference_lbfgs  # the old line search, the test's reference
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.engines.local import LocalClients
from workbench.federation.local_training import LocalTraining, lbfgs
from workbench.methods import OSFED, Problem
from workbench.methods.osfed import OSFEDClient, Snapshot


class Counted:
    """An L-BFGS (`reference_lbfgs` or `lbfgs`) whose objective counts what it evaluates: calls,
    rows, and (the reference's own record) the rows whose value was needed."""

    def __init__(self, lbfgs_function, reference: bool) -> None:
        self.lbfgs_function, self.reference = lbfgs_function, reference
        self.calls = self.rows = self.searching = 0

    def __call__(self, objective, start, **options):
        searching: list[torch.Tensor] = []

        def counted(x, rows):
            self.calls += 1
            self.rows += len(x)
            return objective(x, rows)

        if self.reference:
            options["searching"] = searching
        result = self.lbfgs_function(counted, start, **options)
        self.searching += sum(int(mask.sum()) for mask in searching)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_clients", type=int, default=100, help="K, every one fitted in the one call")
    parser.add_argument("--dim", type=int, default=1280)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--train_size", type=int, default=54000, help="Fashion-MNIST's 60k less 10 %% held out")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30, help="L-BFGS steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "osfed_line_search.md"))
    args = parser.parse_args()
    load_at_start = load_average()

    k = args.num_clients
    dm = FederatedDataModule(dataset="synthetic", num_clients=k, partition="dirichlet", alpha=0.5,
                             synthetic=SyntheticBlobs(num_classes=args.classes, dim=args.dim,
                                                      train_size=args.train_size, test_size=100, seed=0))
    dm.setup()
    method = OSFED(architecture="mlp", hidden_dim=args.hidden, seed=0,
                   local=LocalTraining(epochs=1, lr=0.05, batch_size=64),
                   snapshot=Snapshot(grid_size=2, lbfgs_steps=args.steps, lbfgs_history=10))
    method.setup(Problem(tuple(dm.input_shape), dm.num_classes, k))
    clients = LocalClients(method, dm.train_features, dm.train_labels, dm.train_client_ids,
                           torch.unique(dm.train_client_ids), batch_size=1 << 16)
    half, cohort = cast(OSFEDClient, clients.half), clients.data
    targets = half.flat.vector() - half.flat.flatten(half.local_sgd(0, cohort))  # Δw_k of round 0
    start = half.initial_snapshots(0, cohort)
    half.fit_snapshots(targets, start, steps=1)  # warm-up

    paths = {"reference": (reference_lbfgs, True), "gathered": (lbfgs, False)}
    times: dict[str, list[float]] = {name: [] for name in paths}
    counts, fits = {}, {}
    for _ in range(args.repeats):
        for name, (lbfgs_function, reference) in paths.items():
            counted = Counted(lbfgs_function, reference)
            osfed.lbfgs = counted
            begin = time.perf_counter()
            fits[name] = half.fit_snapshots(targets, start)
            times[name].append(time.perf_counter() - begin)
            counts[name] = counted
            print(name, f"{times[name][-1]:.2f} s", counted.calls, counted.rows, flush=True)
    osfed.lbfgs = lbfgs
    searching = counts["reference"].searching  # the same in both: the same steps (checked below)
    difference = max(float((new - old).abs().max()) for new, old in zip(fits["gathered"], fits["reference"],
                                                                         strict=True))
    loss = fits["gathered"][3]

    rows = []
    for name in paths:
        c = counts[name]
        rows.append(f"| {name} | {statistics.median(times[name]):.2f} | "
                    + ", ".join(f"{t:.2f}" for t in times[name])
                    + f" | {c.calls} | {c.rows} | {searching} | {100 * searching / c.rows:.1f} % |")
    speedup = statistics.median(times["reference"]) / statistics.median(times["gathered"])
    d = args.dim
    lines = [
        "# OS-FED: the snapshot fits' line search on the rows still searching",
        "",
        (f"K = {k} clients' first-round updates (synthetic blobs, d = {d}, {args.classes} classes, "
         f"{len(dm.train_labels)} training rows, Dirichlet α = 0.5), configs/osfed_fashion.yaml's method "
         f"(MLP head {d} → {args.hidden} → {args.classes}, 1 local epoch at lr 0.05, batches of 64; 2×2-grid "
         f"snapshots of {4 * d + 4 * args.classes} numbers, {args.steps} L-BFGS steps, 10 pairs, float32), the "
         f"{k} snapshots fitted in one `fit_snapshots` call. `reference`: the old line search (every backtrack "
         "evaluates all K clients until the slowest accepts; tests/methods/test_osfed.py's `reference_lbfgs`); "
         "`gathered`: the product's, whose backtracks evaluate only the clients still searching. Runs "
         f"alternate, {args.repeats} of each; `rows` = client evaluations (objective values and gradients, one "
         "double backprop each), `searching` = those of clients that had not yet accepted a step (the start "
         "included)."),
        "",
        "| line search | fit s (median) | each | calls | rows | searching | searching / rows |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        (f"Speed-up {speedup:.2f}×. Both paths take the same steps: the largest difference between their "
         f"snapshots, labels, g(S*) and matching losses is {difference:.1e} (float32); the mean matching "
         f"loss at S* is {float(loss.mean()):.3f}."),
        "",
        machine_line("python benchmarks/osfed_line_search.py"
                     + (f" --num_clients {k}" if k != 100 else "")
                     + (f" --repeats {args.repeats}" if args.repeats != 3 else ""), load_at_start),
    ]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
