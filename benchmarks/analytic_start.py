"""FedAvg from scratch against FedAvg started from an analytic head (AFL+FT, Fed3R+FT, FedNCM+FT).

Fashion-MNIST (60k/10k) through EfficientNet-Lite0 at 64 px (d = 1280, the cached features),
K = 100 clients, Dirichlet α = 0.1 (partition seed 0), the suite's data (benchmarks/suite.py).
Every run takes the suite's fair gradient protocol: each client keeps 10 % of its share as its
hold-out and trains on the rest; every learning rate of the grid runs to the stopping rule (no
gain above 0.1 point of hold-out accuracy in `--patience` rounds, at most `--budget` of the
method's own rounds) and the rate with the best hold-out accuracy is kept. The test split is
never looked at to choose: it is only reported.

Models: `head` is the linear head on the features (the start fits it exactly); `mlp` is the
suite's 1280 → 64 → 10 MLP, whose start fits its last layer on the hidden activations at w₀ (the
first layer stays as seeded until the gradient rounds train it); `tail` (opt in: `--runs tail/...`,
about 30 s a round on 2 CPU cores) trains EfficientNet-Lite0's last stage and the head on the
cached maps at its input (`data.trainable_tail: 1`), its start the head on the pooled features.
The starts take the settings of configs/{afl,fed3r,fedncm}_fashion.yaml and choose their
temperature on the same hold-outs (`workbench.methods.analytic_start`); their start rounds are
counted in the rounds and bytes. Two more runs of each model when named: `AFL+FT-fixed` (the AFL
start with the last layer kept fixed while the layers below it train, `fixed_head`) and `central`,
the reference of what the model reaches with this training: FedAvg with one client holding every
client's training rows (minibatch SGD, a round an epoch, the same rates, hold-out and rule).

Reported per run: the test accuracy after the start (round S, before any gradient step), final
and best test accuracy, the rounds of the fit (start included), MB up per client, and the rounds
(and MB) each run takes to reach FedAvg-from-scratch's final accuracy on the same model (its last
round's on the learning curve; the first round whose test accuracy is at least it), with the
speed-up in rounds.

    python benchmarks/analytic_start.py                       # everything (about half an hour here)
    python benchmarks/analytic_start.py --runs head/FedAvg head/AFL+FT --lrs 0.1 --budget 5
    python benchmarks/analytic_start.py --dry_run --out /tmp/analytic_start.md   # synthetic blobs, seconds
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import load_average, machine_line, write_report
from benchmarks.suite import DATA, GLOBAL_DATA, HOLDOUT, MIN_DELTA, Entry, percent, tuned
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.federation.local_training import LocalTraining
from workbench.methods import FedAvg
from workbench.methods.analytic_start import AnalyticStart

LR_GRID = (0.01, 0.03, 0.1, 0.3)
BUDGET, PATIENCE = 50, 5  # the suite's
#: the starts' settings: those of configs/{afl,fed3r,fedncm}_fashion.yaml
AFL_START = {"method": "AFL", "settings": {"gamma_out": 1.0}}
STARTS = {"FedAvg": None, "AFL+FT": AFL_START,
          "Fed3R+FT": {"method": "Fed3R", "settings": {"ridge": 0.01, "bias": True}},
          "FedNCM+FT": {"method": "FedNCM", "settings": {"temperature": 1.0}},
          "AFL+FT-fixed": {**AFL_START, "fixed_head": True}, "central": None}
OPT_IN = ("AFL+FT-fixed", "central")  # run when named (--runs)
CENTRAL = {"num_clients": 1, "partition": "iid"}  # `central`'s data: one client holds every training row
MODELS = {"head": {"architecture": "linear"}, "mlp": {"architecture": "mlp", "hidden_dim": 64},
          "tail": {"architecture": "tail"}}
#: the data settings of a model beside the suite's: `tail` trains EfficientNet-Lite0's last stage
#: on the cached maps at its input (about 30 s a round on 2 CPU cores: opt in with --runs)
MODEL_DATA = {"tail": {"trainable_tail": 1}}
RUNS = [f"{model}/{start}" for model in MODELS for start in STARTS
        if (model, start) != ("head", "AFL+FT-fixed")]  # a fixed head would leave the linear model nothing to train
DEFAULT_RUNS = [run for run in RUNS if not run.startswith("tail/") and run.split("/")[1] not in OPT_IN]
#: --dry_run: every run on synthetic blobs, 10 clients, 2 of FedAvg's rounds, one rate
DRY_DATA = {"dataset": "synthetic", "synthetic": SyntheticBlobs(num_classes=10, dim=32, train_size=2000,
                                                                 test_size=500, seed=0),
            "num_clients": 10, "partition": "dirichlet", "alpha": 0.5, "seed": 0}


def entry(name: str) -> Entry:
    model, start = name.split("/")
    init = AnalyticStart(**STARTS[start] or {})

    def make(lr: float, rounds: int) -> FedAvg:
        return FedAvg(num_rounds=rounds, **MODELS[model], local=LocalTraining(epochs=1, lr=lr, batch_size=64),
                      sample_fraction=1.0, seed=0, init_from=init)

    start_from = STARTS[start]
    setting = ("one client holding every training row: centralized SGD" if start == "central" else
               "from the seeded w₀" if start_from is None else
               f"last layer from {start_from['method']}" + (", kept fixed" if start_from.get("fixed_head") else ""))
    return Entry(name, "global", setting, make, tune="grid")


def first_reaching(row: dict, accuracy: float) -> tuple[int, float] | None:
    """The first round whose test accuracy is ≥ `accuracy`, and the MB up per client by then (the
    curve's and the test's accuracies are the same count of hits, summed in another order)."""
    for point in row["curve"]:
        if point.get("round/test_acc", -1.0) >= accuracy - 1e-9:
            return int(point["round"]), point["round/bytes_up_per_client"] / 1e6
    return None


def after_start(row: dict, start_rounds: int) -> float | None:
    """The test accuracy once the start's rounds are done (before any gradient step)."""
    for point in row["curve"]:
        if int(point["round"]) == start_rounds:
            return point.get("round/test_acc")
    return None


def report(rows: dict[str, dict], args: argparse.Namespace, machine: str) -> list[str]:
    data = ("**Dry run: synthetic blobs (d = 32, 10 classes, 2,000 rows), K = 10, Dirichlet α = 0.5; a check "
            "that it runs, not a result.** " if args.dry_run else "")
    rates = ", ".join(f"{lr:g}" for lr in args.lrs)
    lines = ["# The analytic start: FedAvg from scratch against AFL+FT, Fed3R+FT, FedNCM+FT", "",
             (data + "Fashion-MNIST through EfficientNet-Lite0 at 64 px (d = 1280, cached features), K = 100, "
              "Dirichlet α = 0.1, every client every round, 1 local epoch of batches of 64. The fair protocol: "
              f"learning rate from {rates} chosen on the clients' 10 % hold-outs, each rate "
              f"run until hold-out accuracy gains ≤ 0.1 point in {args.patience} rounds or {args.budget} of "
              "FedAvg's rounds; the test split only reported. `head`: the linear head on the features; `mlp`: "
              "1280 → 64 → 10, its last layer started on the hidden activations at w₀; `tail`: EfficientNet-Lite0's "
              "last stage and a linear head trained on the cached (192, 2, 2) maps at its input, the start's head "
              "fitted on the pooled features. Rounds and MB include "
              "the start's rounds (the statistics, then the temperature's scores)."), "", machine, "",
             f"Ran: `{' '.join(['python benchmarks/analytic_start.py', *args.argv])}`", "",
             "| model | run | setting | after the start | final | best | rounds | MB up / client "
             "| rounds to FedAvg's final (MB) | fewer rounds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        model = name.split("/")[0]
        scratch = rows.get(f"{model}/FedAvg")
        # its final round's accuracy as the curve scored it (the test pass sums its hits in other
        # chunks: a near-tie can flip one of 10,000 predictions)
        target = None if scratch is None or not scratch["curve"] else scratch["curve"][-1].get("round/test_acc")
        hit = None if target is None else first_reaching(row, target)
        base = None if scratch is None or target is None else first_reaching(scratch, target)
        ratio = "—" if hit is None or base is None or row is scratch else f"{base[0] / hit[0]:.1f}×"
        start = name.split("/")[1]
        start_rounds = 0 if STARTS[start] is None else 2
        best = max((p.get("round/test_acc", 0.0) for p in row["curve"]), default=float("nan"))
        reach = "—" if target is None else "not reached" if hit is None else f"{hit[0]} ({hit[1]:.2f})"
        upload = f"{row['up'] / 1e6:.2f}"
        if start == "central":  # epochs of one client: no upload, no federated rounds to compare
            reach, upload, ratio = (f"{hit[0]} epochs" if hit else reach), "—", "—"
        lines.append(f"| {model} | {start} | {row['setting']} | "
                     f"{percent(after_start(row, start_rounds)) if start_rounds else '—'} | {percent(row['acc'])} | "
                     f"{percent(best)} | {row['rounds']} | "
                     f"{upload} | {reach} | {ratio} |")
    lines += ["", "Test accuracy by round (%, the chosen rate's run):", ""]
    longest = max((len(row["curve"]) for row in rows.values()), default=0)
    shown = sorted({r for r in (1, 2, 3, 4, 5, 10, 15, 20, 25, 30, 40, 50) if r <= longest} | {longest} - {0})
    lines += ["| run | " + " | ".join(f"round {r}" for r in shown) + " |", "|---|" + "---|" * len(shown)]
    for name, row in rows.items():
        by_round = {int(p["round"]): p.get("round/test_acc") for p in row["curve"]}
        lines.append(f"| {name} | " + " | ".join(percent(by_round.get(r)) if r in by_round else "" for r in shown)
                     + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=None, choices=RUNS, metavar="RUN",
                        help=f"a subset of {RUNS} (default: all but the tail's; --dry_run: all)")
    parser.add_argument("--lrs", nargs="+", type=float, default=list(LR_GRID))
    parser.add_argument("--budget", type=int, default=BUDGET, help="FedAvg's own rounds at most")
    parser.add_argument("--patience", type=int, default=PATIENCE)
    parser.add_argument("--out", default="benchmarks/results/analytic_start.md")
    parser.add_argument("--dry_run", action="store_true",
                        help="synthetic blobs, 2 rounds, lr 0.1: a check that it runs")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.dry_run:
        args.lrs, args.budget = [0.1], 2
    for notice in (".*does not have many workers", ".*GPU available.*", ".*TPU available.*", ".*LeafSpec.*"):
        warnings.filterwarnings("ignore", message=notice)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    assert MIN_DELTA == 0.001  # the suite's rule: a gain above 0.1 point

    load_start, start = load_average(), time.perf_counter()
    if args.runs is None:
        args.runs = RUNS if args.dry_run else DEFAULT_RUNS
    modules: dict[tuple[str, bool], FederatedDataModule] = {}

    def data_of(model: str, central: bool) -> FederatedDataModule:
        if (model, central) not in modules:
            data = {**(DRY_DATA if args.dry_run else DATA), **(CENTRAL if central else {})}
            modules[model, central] = FederatedDataModule(**data, **GLOBAL_DATA, **HOLDOUT, **MODEL_DATA.get(model, {}))
            modules[model, central].setup()
        return modules[model, central]

    rows: dict[str, dict] = {}
    chosen: dict[str, float] = {}
    for name in args.runs:
        model = name.split("/")[0]
        rows[name] = tuned(entry(name), args, data_of(model, name.endswith("/central")), chosen)
        print(f"{name:<18} test {percent(rows[name]['acc'])} after {rows[name]['rounds']} rounds "
              f"({time.perf_counter() - start:.0f} s so far)", flush=True)
        how = f"whole benchmark {time.perf_counter() - start:.0f} s"
        write_report(report(rows, args, machine_line(how, load_start)), args.out)


if __name__ == "__main__":
    main()
