"""Would a grid's learning rates trained together (one vmapped pass per step for every rate) make
the leaderboard's gradient rows faster? One round of local SGD on the Fashion-MNIST leaderboard's
K = 100, α = 0.1 cell (seed 0, the cached EfficientNet-Lite0 features, the rows' MLP: d = 1280,
64 hidden, batches of 64, one epoch), R rates:

- one by one: R calls of `local_sgd`, as the harness runs a grid today;
- together: one call over R·K clients, each client's rows R times (the shapes, steps and
  products of R rates stacked along the client axis, the stacked rows built before the timing;
  each copy shuffles with a stream of its own, which does not change the cost).

Beside them: the round's arithmetic (4·n·d·h multiply-adds and the small layer's, forward and
the weights' gradients) at the rate the same batched products reach alone (`torch.bmm`, the K
clients' (64 × d)·(d × h) forward and its weight gradient), and what the committed leaderboard's
gradient rows train in a cell (their rounds, summed over every grid point) at the measured round.
Alternating repeats in one process; medians.

    python benchmarks/grid_rates.py                       # R = 3 and 5, 3 repeats
    python benchmarks/grid_rates.py --rates 3 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import machine_line, write_report
from workbench.bench.runner import DataModules
from workbench.bench.scenario import load_scenario
from workbench.federation.local_training import local_sgd
from workbench.methods.heads import build_model

SCENARIO = Path("benchmarks/scenarios/fashion_mnist.yaml")
RESULTS = Path("benchmarks/results/leaderboard/fashion_mnist/results.jsonl")
GRADIENT = ("FedAvg", "FedProx", "SCAFFOLD", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad")
HIDDEN, BATCH = 64, 64


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def gradient_rounds_per_cell() -> float:
    """The rounds the committed leaderboard's gradient rows train in one cell (setting × seed),
    every grid point counted, averaged over the cells."""
    cells: dict[tuple[str, int], int] = {}
    for line in RESULTS.read_text().splitlines():
        record = json.loads(line)
        if record["method"] in GRADIENT and record.get("status") == "done":
            cell = (record["setting"], record["seed"])
            cells[cell] = cells.get(cell, 0) + int(record["rounds"])
    return statistics.mean(cells.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=int, nargs="+", default=[3, 5])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/grid_rates.md")
    args = p.parse_args()

    scenario = load_scenario(SCENARIO)
    run = next(r for r in scenario.runs() if r.setting.get("alpha") == 0.1 and r.setting["num_clients"] == 100)
    data = DataModules(scenario).get(run)
    x, y, ids = data.train_features.float(), data.train_labels, data.train_client_ids
    n, d = x.shape
    clients = torch.unique(ids)
    k = len(clients)
    net = build_model("mlp", (d,), data.num_classes, hidden_dim=HIDDEN, seed=0)

    def one_by_one(rates: int) -> None:
        for r in range(rates):
            local_sgd(net, x, y, ids, clients, epochs=1, lr=0.01 * (r + 1), batch_size=BATCH, seed=1)

    # the stacked rows built once, outside the timing: what a grid trained together would hold
    stacked_inputs = {rates: (x.repeat(rates, 1), y.repeat(rates), torch.cat([ids + k * r for r in range(rates)]),
                              torch.cat([clients + k * r for r in range(rates)])) for rates in args.rates}

    def together(rates: int) -> None:
        local_sgd(net, *stacked_inputs[rates], epochs=1, lr=0.01, batch_size=BATCH, seed=1)

    # the products' own rate: the K clients' forward and weight gradient as two batched products
    rows = torch.randn(k, BATCH, d)
    weights, errors = torch.randn(k, d, HIDDEN), torch.randn(k, BATCH, HIDDEN)

    def products() -> None:
        torch.bmm(rows, weights)
        torch.bmm(rows.transpose(1, 2), errors)

    # a round's multiply-adds: both layers' forward and weight gradients, the small layer's input gradient
    macs_round = n * (2 * d * HIDDEN + 3 * HIDDEN * data.num_classes)
    one_by_one(1), products()  # warm up
    bmm_s = statistics.median(timed(products, max(args.repeats, 5)))
    bmm_rate = 2 * k * BATCH * d * HIDDEN * 2 / bmm_s  # FLOP/s
    rows_out = ["| R rates | one by one s | together s | together / one by one | one rate's round s | "
                "its GFLOP/s | the products alone GFLOP/s |", "|---|---|---|---|---|---|---|"]
    single = []
    for rates in args.rates:
        alone, stacked = [], []
        for _ in range(args.repeats):  # alternating
            alone += timed(partial(one_by_one, rates), 1)
            stacked += timed(partial(together, rates), 1)
        a, s = statistics.median(alone), statistics.median(stacked)
        single.append(a / rates)
        rows_out.append(f"| {rates} | {a:.2f} | {s:.2f} | {s / a:.2f} | {a / rates:.3f} | "
                        f"{2 * macs_round / (a / rates) / 1e9:.0f} | {bmm_rate / 1e9:.0f} |")
    round_s = statistics.median(single)
    cell_rounds = gradient_rounds_per_cell()
    floor_s = cell_rounds * 2 * macs_round / bmm_rate
    lines = [
        "# A grid's learning rates trained together", "",
        f"One round of local SGD, Fashion-MNIST K = {k}, Dirichlet α = 0.1, seed 0: n = {n} rows, d = {d}, "
        f"an MLP with {HIDDEN} hidden units, batches of {BATCH}, one epoch ({2 * macs_round / 1e9:.1f} GFLOP a round "
        f"for one rate). Medians of {args.repeats} alternating repeats.", "",
        *rows_out, "",
        f"The committed leaderboard's gradient rows ({', '.join(GRADIENT)}, every grid point) train "
        f"{cell_rounds:.0f} rounds a cell on average: {cell_rounds * round_s:.0f} s of local SGD at the measured "
        f"round, and {floor_s:.0f} s at the products' own rate (the arithmetic's floor on this machine, evaluation "
        "and the server's steps not counted).", "",
        machine_line(), ""]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
