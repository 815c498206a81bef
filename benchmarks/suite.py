"""Every method once on Fashion-MNIST, K = 100 clients, Dirichlet α = 0.1, cached features.

Fashion-MNIST (60k/10k) through EfficientNet-Lite0 at 64 px (d = 1280, the cached features),
partition seed 0. Each method runs with the settings of its configs/*_fashion.yaml (set once,
not tuned on the test set); where there is no config the setting of the benchmark that measured
it (LocalOnly: benchmarks/personalized.py). The gradient methods (FedAvg and its compressed
variants, FedProx, SCAFFOLD, OS-FED, Ditto) run `--rounds` rounds (default 5; their configs
say 20) towards the 10-minute budget; the table says so. Measured on the shared 2-core machine:
15 to 45 minutes by load, most of it OS-FED (its L-BFGS snapshot fits grow with K), DeepAFL
(T = 20 in float64) and SAFLe (a 6400 × 6400 Gram); benchmarks/results/suite.md.

Protocols: `global` methods train on every client's whole share and are scored on the 10k test
set; `personalized` ones (AnaPFL, Ditto, LocalOnly) run the personalized protocol of
configs/anapfl_fashion.yaml (25% of each client's share, stratified by class, is its local test
data): "personal" is the mean over clients of their own model's accuracy on their local test
data, "global" their global model on the 10k test set (AnaPFL: its global branch; Ditto: its
FedAvg model; LocalOnly has none).

One table: test accuracy, rounds, megabytes (10⁶ B) up and down per client (all rounds, the
final broadcast included, over all K clients), and the method's fit seconds (`time/fit_s`:
clients and server, wall clock). GH-OFL's heads (FedCGS is one of them) come from one fit and
one row each.

    python benchmarks/suite.py                                   # everything (goal: < 10 min on 2 cores)
    python benchmarks/suite.py --methods AFL GH-OFL --out /tmp/suite.md
    python benchmarks/suite.py --rounds 20 --note "the configs' 20 rounds"
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fit_engine, load_average, machine_line, write_report
from workbench.data import FederatedDataModule
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
# The MLP head and local SGD of configs/{fedavg,fedprox,scaffold,osfed,ditto}_fashion.yaml
MLP = {"architecture": "mlp", "hidden_dim": 64, "local": LocalTraining(epochs=1, lr=0.05, batch_size=64),
       "sample_fraction": 1.0, "seed": 0}
GH_HEADS = ["nb_diag", "lda", "qda", "fishermix", "proto_hyper", "fedcgs"]  # configs/ghofl_fashion.yaml

# (name, protocol, setting shown in the table, factory(args) -> a fresh method)
METHODS = [
    ("AFL", "global", "γ = 1, γ_out = 1",
     lambda a: AFL(gamma=1.0, gamma_out=1.0)),
    ("DeepAFL", "global", "T = 20, h = f = 1024, gelu, γ = 1, γ_s = 0.05, fused, float64",
     lambda a: DeepAFL(num_layers=20, hidden_dim=1024, block_dim=1024, activation="gelu", gamma=1.0,
                       gamma_s=0.05, seed=0)),
    ("SAFLe", "global", "binary_overlap L = 1, E = 320, G = 4, raw x, γ = γ_out = 1",
     lambda a: SAFLe(bucketing="binary_overlap", levels=1, thresholds="fixed", experts=320, group_size=4,
                     raw_features=True, gamma=1.0, gamma_out=1.0)),
    ("GH-OFL", "global", "all six heads, shrinkage 0.05, no sketch, FisherMix / Proto-Hyper defaults",
     lambda a: GHOFL(heads=GH_HEADS, primary_head="lda", shrinkage=0.05, sketch_dim=None)),
    ("FedAvg", "global", "MLP 64, 1 epoch, lr 0.05, B 64; {rounds} rounds",
     lambda a: FedAvg(num_rounds=a.rounds, **MLP, compression=Compression(kind="none"))),
    ("FedAvg top-k", "global", "top-k 1% + EF; {rounds} rounds",
     lambda a: FedAvg(num_rounds=a.rounds, **MLP, compression=Compression(kind="topk", topk_fraction=0.01))),
    ("FedAvg quantize", "global", "8-bit + EF; {rounds} rounds",
     lambda a: FedAvg(num_rounds=a.rounds, **MLP, compression=Compression(kind="quantize", quantize_bits=8))),
    ("FedProx", "global", "μ = 0.01; {rounds} rounds",
     lambda a: FedProx(mu=0.01, num_rounds=a.rounds, **MLP)),
    ("SCAFFOLD", "global", "option II, η_g = 1; {rounds} rounds",
     lambda a: SCAFFOLD(num_rounds=a.rounds, server_lr=1.0, **MLP)),
    ("OS-FED", "global", "2×2 grid, 30 L-BFGS steps, EF; {rounds} rounds",
     lambda a: OSFED(num_rounds=a.rounds, **MLP, snapshot=Snapshot(grid_size=2, lbfgs_steps=30, lbfgs_history=10),
                     error_feedback=ErrorFeedback(enabled=True))),
    ("AnaPFL", "personalized", "h = 1024, γ = γ_out = 0.01, β = 1, λ on a 10% hold-out",
     lambda a: AnaPFL(hidden_dim=1024, gamma=1e-2, gamma_out=1e-2, beta=1.0, holdout_fraction=0.1, seed=0,
                      local_seed=1)),
    ("LocalOnly", "personalized", "γ = 1 (benchmarks/personalized.py)",
     lambda a: LocalOnly(gamma=1.0)),
    ("Ditto", "personalized", "λ = 0.1, MLP 64; {rounds} rounds",
     lambda a: Ditto(lam=0.1, num_rounds=a.rounds, **MLP)),
]
NAMES = [name for name, *_ in METHODS]


def percent(value: float | None) -> str:
    return "—" if value is None or math.isnan(value) else f"{100 * value:.2f}"


def run(name: str, protocol: str, setting: str, method, data: FederatedDataModule) -> list[dict]:
    """Fit and test one method -> its table rows (GH-OFL: one per head, from the same fit)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    engine, tested = fit_engine(method, data)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    fit = engine.fit_metrics
    row = {"method": name, "protocol": protocol, "setting": setting,
           "acc": tested.get("test/acc"), "personal": tested.get("test/acc_local_mean"),
           "rounds": int(fit["comm/rounds"]), "up": fit["comm/bytes_up"] / data.num_clients,
           "down": fit["comm/bytes_down"] / data.num_clients, "fit_s": fit["time/fit_s"], "wall_s": wall,
           "cpu_s": cpu}
    if "anapfl/lambda" in fit:
        row["setting"] += f" (chose λ = {fit['anapfl/lambda']:.1f})"
    heads = [key.removeprefix("test/acc/") for key in tested if key.startswith("test/acc/")]
    if not heads:
        return [row]
    primary = method.primary_head  # GH-OFL: its primary head first, then the others of the same fit
    rows = []
    for head in sorted(heads, key=lambda h: (h != primary, GH_HEADS.index(h))):
        rows.append({**row, "acc": tested[f"test/acc/{head}"],
                     "method": "FedCGS (GH-OFL's fit)" if head == "fedcgs" else f"{name} {head}",
                     "setting": f"{row['setting']}; primary head" if head == primary else "same fit as above",
                     "wall_s": wall if head == primary else None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=NAMES, choices=NAMES, metavar="NAME",
                        help=f"a subset of {NAMES}")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of the gradient methods (their configs: 20)")
    parser.add_argument("--out", default="benchmarks/results/suite.md")
    parser.add_argument("--note", default="", help="a line added under the table (e.g. what else ran)")
    args = parser.parse_args()
    for notice in (".*configure_optimizers.* returned `None`", ".*does not have many workers",
                   ".*Total length of .* across ranks is zero", ".*LeafSpec.*", ".*GPU available.*",
                   ".*TPU available.*", ".*`max_epochs` was not set.*"):
        warnings.filterwarnings("ignore", message=notice)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    load_start, start = load_average(), time.perf_counter()
    modules: dict[str, FederatedDataModule] = {}
    rows = []
    chosen = [entry for entry in METHODS if entry[0] in args.methods]
    for done, (name, protocol, setting, factory) in enumerate(chosen, 1):
        if protocol not in modules:
            modules[protocol] = FederatedDataModule(**DATA, **(GLOBAL_DATA if protocol == "global"
                                                               else PERSONALIZED_DATA))
            modules[protocol].setup()
        for row in run(name, protocol, setting.format(rounds=args.rounds), factory(args), modules[protocol]):
            rows.append(row)
            print(f"{row['method']:<28} acc {percent(row['acc']):>6}  personal {percent(row['personal']):>6}  "
                  f"rounds {row['rounds']:>2}  up {row['up'] / 1e6:9.3f} MB  fit {row['fit_s']:6.1f} s  "
                  f"({time.perf_counter() - start:.0f} s so far)", flush=True)
        # after every method: a long run that fails keeps what it did
        finished = "" if done == len(chosen) else f", partial: {done} of {len(chosen)} methods"
        how = f"one fit each; whole suite {time.perf_counter() - start:.0f} s{finished}"
        write_report(report_lines(rows, args, machine_line(how, load_start)), args.out)


def report_lines(rows: list[dict], args: argparse.Namespace, machine: str) -> list[str]:
    lines = [
        "# Every method once: Fashion-MNIST, K = 100, Dirichlet α = 0.1",
        "",
        ("Fashion-MNIST (60k train / 10k test) through EfficientNet-Lite0 at 64 px (d = 1280, cached "
        "features), 100 clients, Dirichlet α = 0.1 (partition seed 0, at least 10 samples per client). "
        "Settings: the configs' (configs/*_fashion.yaml), not tuned on the test set; the gradient methods "
        f"run {args.rounds} rounds (configs: 20). `global`: trained on the whole training set, scored on the "
        "10k test set; `personalized`: 25% of each client's share is its local test data, `personal` = mean "
        "over clients of their own model's accuracy there, `accuracy` = the global model (AnaPFL: global "
        "branch, Ditto: FedAvg model) on the 10k test set. MB = 10⁶ bytes per client over the whole fit "
        "(down: every broadcast and the final model). Fit s: the method's wall clock (clients + server, "
        "`time/fit_s`)."),
        "",
        ("| method | protocol | accuracy % | personal accuracy % | rounds | MB up / client | MB down / client "
        "| fit s | setting |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['method']} | {r['protocol']} | {percent(r['acc'])} | {percent(r['personal'])} | "
                     f"{r['rounds']} | {r['up'] / 1e6:.3f} | {r['down'] / 1e6:.3f} | {r['fit_s']:.1f} | "
                     f"{r['setting']} |")
    fits = [r for r in rows if r["wall_s"] is not None]
    lines += ["", "Where the time goes, per fit: wall seconds of fit + test + Lightning's setup (CPU seconds of "
              "this process, all threads): " + ", ".join(f"{r['method']} {r['wall_s']:.0f} ({r['cpu_s']:.0f})"
                                                        for r in sorted(fits, key=lambda r: -r["wall_s"])) + ".", ""]
    if args.note:
        lines += [args.note, ""]
    lines.append(machine)
    return lines


if __name__ == "__main__":
    main()
