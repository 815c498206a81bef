"""Every method once on Fashion-MNIST, K = 100 clients, Dirichlet α = 0.1, cached features.

Fashion-MNIST (60k/10k) through EfficientNet-Lite0 at 64 px (d = 1280, the cached features),
partition seed 0. The one-round and analytic methods run with the settings of their
configs/*_fashion.yaml (set once, not tuned on the test set); where there is no config, the
setting of the benchmark that measured it (LocalOnly: benchmarks/personalized.py).

The gradient methods (FedAvg and its compressed variants, FedProx, SCAFFOLD, OS-FED, Ditto) run
the fair protocol: each client keeps 10 % of its share (stratified by class) as its hold-out and
trains on the rest; every learning rate of LR_GRID runs to the stopping rule — no gain above 0.1
point of hold-out accuracy in PATIENCE rounds, at most BUDGET rounds — and the rate with the best
hold-out accuracy is kept (the compressed FedAvgs take FedAvg's; OS-FED, whose rounds cost
about 18 times FedAvg's here, its config's rate and a budget of OSFED_BUDGET rounds). The test split
is never looked at to choose. Each kept run reports its final and best test accuracy, the round
of the best, and the rounds and bytes to reach AFL's accuracy and the best one-round analytic
head's of this run (or "not reached"); AFL on the same 90 % shares is a row too.

Protocols: `global` methods are scored on the 10k test set; `personalized` ones (AnaPFL, Ditto,
LocalOnly) run the personalized protocol of configs/anapfl_fashion.yaml (25% of each client's
share, stratified by class, is its local test data): "personal" is the mean over clients of their
own model's accuracy on their local test data, "global" their global model on the 10k test set
(AnaPFL: its global branch; Ditto: its FedAvg model; LocalOnly has none).

Tables: test accuracy, rounds, megabytes (10⁶ B) up and down per client (all rounds, the final
broadcast included, over all K clients), and the method's fit seconds (`time/fit_s`: clients and
server, wall clock); then the gradient methods' learning rates and curves. GH-OFL's heads (FedCGS
is one of them) come from one fit and one row each. Measured on the shared 2-core machine: about
14 minutes with the features cached (2 to 3 more to extract them), DeepAFL (T = 20 in float64)
a quarter of it, the gradient methods' grids most of the rest.

    python benchmarks/suite.py                                   # everything
    python benchmarks/suite.py --methods AFL GH-OFL --out /tmp/suite.md
    python benchmarks/suite.py --methods AFL FedAvg --lrs 0.1 --budget 10   # a quick look
    python benchmarks/suite.py --methods DeepAFL Ditto --profile 8 --out benchmarks/results/suite_profile.md

`--profile N` runs each method under cProfile and lists under the tables its N functions with the
most own time (cProfile's overhead included in that run's times: time the suite without it).
"""
from __future__ import annotations

import argparse
import cProfile
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fit_engine, hot_functions, load_average, machine_line, write_report
from workbench.data import FederatedDataModule
from workbench.engines.stopping import Stopping
from workbench.federation import Federation
from workbench.federation.compression import Compression, ErrorFeedback
from workbench.federation.local_training import LocalTraining
from workbench.methods import (
    AFL,
    GHOFL,
    OSFED,
    SCAFFOLD,
    AnaPFL,
    DeepAFL,
    Ditto,
    FedAvg,
    FedProx,
    LocalOnly,
    SAFLe,
)
from workbench.methods.osfed import Snapshot

DATA = {"dataset": "fashion_mnist", "backbone": "efficientnet_lite0", "input_size": 64,
        "num_clients": 100, "partition": "dirichlet", "alpha": 0.1, "seed": 0}
# The global methods' data; batch_size (rows per chunk of a client's statistics and per test
# batch) is SAFLe's config's: every chunk of SAFLe sums a dense 6400 × 6400 Gram.
GLOBAL_DATA = {"batch_size": 20000}
PERSONALIZED_DATA = {"personalized": True, "local_test_fraction": 0.25}  # configs/anapfl_fashion.yaml
HOLDOUT = {"val_fraction": 0.1, "val_split": "clients"}  # each client's own hold-out
DATA_OF = {("global", False): GLOBAL_DATA, ("personalized", False): PERSONALIZED_DATA,
           ("global", True): {**GLOBAL_DATA, **HOLDOUT}, ("personalized", True): {**PERSONALIZED_DATA, **HOLDOUT}}
# The gradient methods' protocol (see above): the grid, the stopping rule, the budgets.
LR_GRID = (0.01, 0.03, 0.1, 0.3)
BUDGET, PATIENCE, MIN_DELTA, OSFED_BUDGET = 50, 5, 0.001, 10
GH_HEADS = ["nb_diag", "lda", "qda", "fishermix", "proto_hyper", "fedcgs"]  # configs/ghofl_fashion.yaml


def mlp(lr: float) -> dict:
    """The MLP head and local SGD of configs/{fedavg,fedprox,scaffold,osfed,ditto}_fashion.yaml at `lr`."""
    return {"architecture": "mlp", "hidden_dim": 64, "local": LocalTraining(epochs=1, lr=lr, batch_size=64),
            "sample_fraction": 1.0, "seed": 0}


@dataclass(frozen=True)
class Entry:
    """A row of the suite: its name, protocol, the setting shown, and how it is built; a gradient
    method's `tune` says where its learning rate comes from: `grid` (LR_GRID on the hold-outs),
    `FedAvg` (FedAvg's choice) or `config` (0.05), with `budget` rounds at most."""

    name: str
    protocol: str
    setting: str
    make: Callable[..., Any]  # (lr, rounds) -> a fresh method; the one-round ones ignore both
    tune: str | None = None
    budget: int | None = None  # rounds at most; None: the suite's (--budget)
    holdout: bool = False  # trained on the 90 % shares though one-round (AFL, the gradient methods' control)
    federation: Federation | None = None  # the protocol it runs under (the compressed FedAvgs'); None: plain

    @property
    def on_holdouts(self) -> bool:
        """Trained on the 90 % shares: a gradient method's stopping rule watches the hold-outs."""
        return self.holdout or self.tune is not None


METHODS = [
    Entry("AFL", "global", "γ = 1, γ_out = 1", lambda lr, n: AFL(gamma=1.0, gamma_out=1.0)),
    Entry("AFL-90", "global", "γ = 1, γ_out = 1; the gradient methods' data, hold-outs left out",
          lambda lr, n: AFL(gamma=1.0, gamma_out=1.0), holdout=True),
    Entry("DeepAFL", "global", "T = 20, h = f = 1024, gelu, γ = 1, γ_s = 0.05, fused, float64",
          lambda lr, n: DeepAFL(num_layers=20, hidden_dim=1024, block_dim=1024, activation="gelu", gamma=1.0,
                                gamma_s=0.05, seed=0)),
    Entry("SAFLe", "global", "binary_overlap L = 1, E = 320, G = 4, raw x, γ = γ_out = 1",
          lambda lr, n: SAFLe(bucketing="binary_overlap", levels=1, thresholds="fixed", experts=320, group_size=4,
                              raw_features=True, gamma=1.0, gamma_out=1.0)),
    Entry("GH-OFL", "global", "all six heads, shrinkage 0.05, no sketch, FisherMix / Proto-Hyper defaults",
          lambda lr, n: GHOFL(heads=GH_HEADS, primary_head="lda", shrinkage=0.05, sketch_dim=None)),
    Entry("FedAvg", "global", "MLP 64, 1 epoch, B 64", lambda lr, n: FedAvg(num_rounds=n, **mlp(lr)), "grid"),
    Entry("FedAvg top-k", "global", "top-k 1% + EF", lambda lr, n: FedAvg(num_rounds=n, **mlp(lr)), "FedAvg",
          federation=Federation(compression=Compression(kind="topk", topk_fraction=0.01))),
    Entry("FedAvg quantize", "global", "8-bit + EF", lambda lr, n: FedAvg(num_rounds=n, **mlp(lr)), "FedAvg",
          federation=Federation(compression=Compression(kind="quantize", quantize_bits=8))),
    Entry("FedProx", "global", "μ = 0.01", lambda lr, n: FedProx(mu=0.01, num_rounds=n, **mlp(lr)), "grid"),
    Entry("SCAFFOLD", "global", "option II, η_g = 1",
          lambda lr, n: SCAFFOLD(num_rounds=n, server_lr=1.0, **mlp(lr)), "grid"),
    Entry("OS-FED", "global", "2×2 grid, 30 L-BFGS steps, EF",
          lambda lr, n: OSFED(num_rounds=n, **mlp(lr), snapshot=Snapshot(grid_size=2, lbfgs_steps=30, lbfgs_history=10),
                              error_feedback=ErrorFeedback(enabled=True)), "config", OSFED_BUDGET),
    Entry("AnaPFL", "personalized", "h = 1024, γ = γ_out = 0.01, β = 1, λ on a 10% hold-out",
          lambda lr, n: AnaPFL(hidden_dim=1024, gamma=1e-2, gamma_out=1e-2, beta=1.0, holdout_fraction=0.1, seed=0,
                               local_seed=1)),
    Entry("LocalOnly", "personalized", "γ = 1 (benchmarks/personalized.py)", lambda lr, n: LocalOnly(gamma=1.0)),
    Entry("Ditto", "personalized", "λ = 0.1, MLP 64", lambda lr, n: Ditto(lam=0.1, num_rounds=n, **mlp(lr)), "grid"),
]
NAMES = [entry.name for entry in METHODS]


def ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}" if denominator > 0 else "—"


def percent(value: float | None) -> str:
    return "—" if value is None or math.isnan(value) else f"{100 * value:.2f}"


def run(entry: Entry, setting: str, method, data: FederatedDataModule, stopping: Stopping | None = None) -> list[dict]:
    """Fit and test one method -> its table rows (GH-OFL: one per head, from the same fit)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    engine, tested = fit_engine(method, data, entry.federation, stopping=stopping)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    fit = engine.fit_metrics
    row = {"method": entry.name, "protocol": entry.protocol, "setting": setting,
           "acc": tested.get("test/acc"), "personal": tested.get("test/acc_local_mean"),
           "rounds": int(fit["comm/rounds"]), "up": fit["comm/bytes_up"] / data.num_clients,
           "down": fit["comm/bytes_down"] / data.num_clients, "fit_s": fit["time/fit_s"], "wall_s": wall,
           "parts_s": {part: fit[f"time/{part}_s"] for part in ("client", "server", "curve")},
           "cpu_s": cpu, "curve": engine.curve, "best_val": fit.get("stop/best_val_acc")}
    if "anapfl/lambda" in fit:
        row["setting"] += f" (chose λ = {fit['anapfl/lambda']:.1f})"
    heads = [key.removeprefix("test/acc/") for key in tested if key.startswith("test/acc/")]
    if not heads:
        return [row]
    primary = method.primary_head  # GH-OFL: its primary head first, then the others of the same fit
    rows = []
    for head in sorted(heads, key=lambda h: (h != primary, GH_HEADS.index(h))):
        rows.append({**row, "acc": tested[f"test/acc/{head}"],
                     "method": "FedCGS (GH-OFL's fit)" if head == "fedcgs" else f"{entry.name} {head}",
                     "setting": f"{row['setting']}; primary head" if head == primary else "same fit as above",
                     "wall_s": wall if head == primary else None})
    return rows


def tuned(entry: Entry, args: argparse.Namespace, data: FederatedDataModule, chosen: dict[str, float]) -> dict:
    """A gradient method under the fair protocol: each learning rate to the stopping rule, the one
    with the best hold-out accuracy kept (its row, with every rate's hold-out accuracy)."""
    stopping = Stopping(patience=args.patience, min_delta=MIN_DELTA)
    budget = args.budget if entry.budget is None else min(entry.budget, args.budget)
    rates = {"grid": args.lrs, "FedAvg": [chosen.get("FedAvg", 0.05)], "config": [0.05]}[entry.tune]
    tried = {}
    for lr in rates:
        (tried[lr],) = run(entry, "", entry.make(lr, budget), data, stopping)
        print(f"  {entry.name} lr {lr}: hold-out {percent(tried[lr]['best_val'])} at {tried[lr]['rounds']} rounds, "
              f"test {percent(tried[lr]['acc'])}", flush=True)
    lr = max(tried, key=lambda rate: tried[rate]["best_val"])
    chosen[entry.name] = lr
    source = {"grid": "chosen on the hold-outs from " + ", ".join(
        f"{rate:g} ({percent(tried[rate]['best_val'])})" for rate in rates),
        "FedAvg": "FedAvg's", "config": "the config's"}[entry.tune]
    if entry.tune == "grid" and len(rates) > 1 and lr in (min(rates), max(rates)):
        source += "; at the grid's edge: widen it"
    row = tried[lr]
    limit = entry.make(lr, budget).num_rounds  # the budget, and any rounds before the method's own
    ended = (f"all {limit} rounds, no plateau" if row["rounds"] == limit else
             f"the rule stopped it after {row['rounds']} of ≤ {limit} rounds")
    row["setting"] = f"{entry.setting}; lr {lr:g} ({source}); {ended}"
    row["lr"], row["wall_s"] = lr, sum(r["wall_s"] for r in tried.values())
    row["cpu_s"] = sum(r["cpu_s"] for r in tried.values())
    return row


def reached(row: dict, accuracy: float) -> str:
    """The first round (and MB up per client by then) whose test accuracy reached `accuracy`."""
    for point in row["curve"]:
        if point.get("round/test_acc", -1.0) >= accuracy:
            return f"{int(point['round'])} ({point['round/bytes_up_per_client'] / 1e6:.2f} MB)"
    return "not reached"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=NAMES, choices=NAMES, metavar="NAME",
                        help=f"a subset of {NAMES}")
    parser.add_argument("--lrs", nargs="+", type=float, default=list(LR_GRID),
                        help=f"the gradient methods' learning rates to choose from (default {LR_GRID})")
    parser.add_argument("--budget", type=int, default=BUDGET, help=f"rounds at most (default {BUDGET})")
    parser.add_argument("--patience", type=int, default=PATIENCE,
                        help=f"rounds without a gain above 0.1 point of hold-out accuracy before a stop "
                             f"(default {PATIENCE})")
    parser.add_argument("--out", default="benchmarks/results/suite.md")
    parser.add_argument("--note", default="", help="a line added under the table (e.g. what else ran)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile each method (cProfile) and list its N functions with the most own time")
    args = parser.parse_args()
    for notice in (".*configure_optimizers.* returned `None`", ".*does not have many workers",
                   ".*Total length of .* across ranks is zero", ".*LeafSpec.*", ".*GPU available.*",
                   ".*TPU available.*"):
        warnings.filterwarnings("ignore", message=notice)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    load_start, start = load_average(), time.perf_counter()
    data_s = 0.0  # setting up the data modules: reading the feature cache, or filling it
    modules: dict[tuple[str, bool], FederatedDataModule] = {}
    rows: list[dict] = []
    chosen_rates: dict[str, float] = {}
    profiles: dict[str, list[str]] = {}  # method -> the rows of its hot functions (--profile)
    chosen = [entry for entry in METHODS if entry.name in args.methods]
    for done, entry in enumerate(chosen, 1):
        key = (entry.protocol, entry.on_holdouts)
        if key not in modules:
            setup_start = time.perf_counter()
            modules[key] = FederatedDataModule(**DATA, **DATA_OF[key])
            modules[key].setup()
            data_s += time.perf_counter() - setup_start
        profile = cProfile.Profile() if args.profile else None
        if profile:
            profile.enable()
        new = ([tuned(entry, args, modules[key], chosen_rates)] if entry.tune else
               run(entry, entry.setting, entry.make(None, None), modules[key]))
        if profile:
            profile.disable()
            profiles[entry.name] = hot_functions(profile, args.profile)
        for row in new:
            rows.append(row)
            print(f"{row['method']:<28} acc {percent(row['acc']):>6}  personal {percent(row['personal']):>6}  "
                  f"rounds {row['rounds']:>2}  up {row['up'] / 1e6:9.3f} MB  fit {row['fit_s']:6.1f} s  "
                  f"({time.perf_counter() - start:.0f} s so far)", flush=True)
        # after every method: a long run that fails keeps what it did
        finished = "" if done == len(chosen) else f", partial: {done} of {len(chosen)} methods"
        how = (f"whole suite {time.perf_counter() - start:.0f} s, {data_s:.0f} s of it setting up the data "
               f"(the features read from the cache, or extracted into it){finished}")
        write_report(report_lines(rows, args, machine_line(how, load_start), profiles), args.out)


def report_lines(rows: list[dict], args: argparse.Namespace, machine: str,
                 profiles: dict[str, list[str]]) -> list[str]:
    lines = [
        "# Every method once: Fashion-MNIST, K = 100, Dirichlet α = 0.1",
        "",
        ("Fashion-MNIST (60k train / 10k test) through EfficientNet-Lite0 at 64 px (d = 1280, cached "
         "features), 100 clients, Dirichlet α = 0.1 (partition seed 0, at least 10 samples per client). "
         "One-round and analytic methods: the configs' settings (configs/*_fashion.yaml), not tuned on the test "
         "set. Gradient methods: each client's 10 % hold-out (stratified by class) chooses the learning rate "
         f"from {', '.join(f'{lr:g}' for lr in args.lrs)} and the stopping round (no gain above 0.1 point of "
         f"hold-out accuracy in {args.patience} rounds, at most {args.budget}); they train on the other 90 %. "
         "`global`: scored on the 10k test set; `personalized`: 25% of each client's share is its local test "
         "data, `personal` = mean over clients of their own model's accuracy there, `accuracy` = the global "
         "model (AnaPFL: global branch, Ditto: FedAvg model) on the 10k test set. MB = 10⁶ bytes per client over "
         "the whole fit (down: every broadcast and the final model). Fit s: the kept run's wall clock (clients + "
         "server, `time/fit_s`)."),
        "",
        ("| method | protocol | accuracy % | personal accuracy % | rounds | MB up / client | MB down / client "
         "| fit s | setting |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['method']} | {r['protocol']} | {percent(r['acc'])} | {percent(r['personal'])} | "
                     f"{r['rounds']} | {r['up'] / 1e6:.3f} | {r['down'] / 1e6:.3f} | {r['fit_s']:.1f} | "
                     f"{r['setting']} |")
    one_round = [r for r in rows if r["rounds"] == 1 and r["protocol"] == "global" and r["acc"] is not None]
    afl = next((r for r in one_round if r["method"] == "AFL"), None)
    best = max(one_round, key=lambda r: r["acc"], default=None)
    gradient = [r for r in rows if "lr" in r and r["protocol"] == "global"]
    if gradient:
        targets = [(f"AFL's {percent(afl['acc'])}", afl["acc"])] if afl else []
        if best is not None and best is not afl:
            targets.append((f"the best one-round head's ({best['method']}) {percent(best['acc'])}", best["acc"]))
        lines += ["", "The gradient methods' learning curves (test accuracy after each round of the kept run; the "
                  "best is read off the curve, not chosen by it):", "",
                  "| method | lr | rounds | final % | best % (round) |" +
                  "".join(f" round (MB up) to reach {name} |" for name, _ in targets),
                  "|---|---|---|---|---|" + "---|" * len(targets)]
        for r in gradient:
            tops = [(point["round/test_acc"], int(point["round"])) for point in r["curve"] if "round/test_acc" in point]
            top, at = max(tops, key=lambda t: (t[0], -t[1]))
            lines.append(f"| {r['method']} | {r['lr']:g} | {r['rounds']} | {percent(r['acc'])} | {percent(top)} "
                         f"({at}) |" + "".join(f" {reached(r, accuracy)} |" for _, accuracy in targets))
    fits = [r for r in rows if r["wall_s"] is not None]
    lines += ["", "The fit's seconds by part (the kept run; `curve`: the learning curve, the test split scored "
              "every round; `rest`: what none of the three holds, Lightning's loop and the round's bookkeeping; "
              "no checkpoints or logs here, which `python -m workbench fit` adds: "
              "benchmarks/results/deepafl_fit_time.md):", "",
              "| method | fit s | clients s | server s | curve s | rest s | fit / (clients + server) | "
              "fit / (clients + server + curve) |", "|---|---|---|---|---|---|---|---|"]
    for r in fits:
        parts = r["parts_s"]
        work = parts["client"] + parts["server"]
        lines.append(f"| {r['method']} | {r['fit_s']:.2f} | {parts['client']:.2f} | {parts['server']:.2f} | "
                     f"{parts['curve']:.2f} | {r['fit_s'] - work - parts['curve']:.2f} | {ratio(r['fit_s'], work)} | "
                     f"{ratio(r['fit_s'], work + parts['curve'])} |")
    lines += ["", "Where the time goes: wall seconds of fit + test + Lightning's setup, every learning rate of a "
              "gradient method's grid together (CPU seconds of this process, all threads): " +
              ", ".join(f"{r['method']} {r['wall_s']:.0f} ({r['cpu_s']:.0f})"
                        for r in sorted(fits, key=lambda r: -r["wall_s"])) + ".", ""]
    if profiles:
        lines += [f"Inside each method, its {args.profile} functions with the most own time (cProfile: time in the "
                  "function itself, the tensor operators it applies included, not in the Python functions it "
                  "calls; under the profiler, so the times above include its overhead):", ""]
        for name, table in profiles.items():
            lines += [f"{name}:", "", *table, ""]
    if args.note:
        lines += [args.note, ""]
    lines.append(machine)
    return lines


if __name__ == "__main__":
    main()
