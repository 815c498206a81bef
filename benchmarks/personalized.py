"""Personalized FL on cached Fashion-MNIST features: AnaPFL against the baselines.

The personalized protocol: each client's Dirichlet share is split (stratified, seeded) into its
own training data and its local test data (25%); the score is the mean over clients of the
accuracy on their own local test data. Methods (one fit each per setting):

- AnaPFL: AFL on tanh random features (h = 1024, γ = 1e-2) + each client's residual ridge on
  its own random features (β = 1), λ chosen on a 10% hold-out of each client's training data
  (a second round: the clients' summed hold-out scores).
  "AnaPFL global branch" is the same fit's main branch alone (λ = 0), scored on the local tests.
- AFL: one global ridge head on the backbone features (γ = 1 RI, γ_out = 1), scored on the local tests.
- Local-only: each client's own ridge head on its backbone features (γ = 1), nothing sent, no
  global model (no global test accuracy).
- Ditto: a FedAvg MLP head (global) + each client's personal MLP head pulled towards it (λ = 0.1),
  20 rounds; "Ditto global model" is the same fit's FedAvg model, scored on the local tests.

Reported: mean / min local accuracy, global test accuracy (none for local-only), rounds, bytes
uploaded by all clients, and the method's fit time
(`time/fit_s`, wall clock: client and server work, local solves included; Lightning's loop and
the test excluded) and the CPU seconds of the whole `Trainer.fit` call (all threads; steadier
than the wall clock on a shared machine).

    python benchmarks/personalized.py                              # K ∈ {50, 100}, α ∈ {0.1, 0.5, 1}
    python benchmarks/personalized.py --clients 50 --alphas 0.1    # one setting
    python benchmarks/personalized.py --dataset synthetic --clients 10 --alphas 0.5 \
        --out /tmp/personalized.md                                 # a smoke run, no backbone

Each method runs in `workbench.engines.LightningEngine` (in process); the personal models are
the clients' (`engine.client_half.predict`), the global one the server's (`method(x)`).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning import Trainer

from benchmarks.common import load_average, machine_line, write_report
from workbench.data import FederatedDataModule
from workbench.engines import LightningEngine
from workbench.federation.local_training import LocalTraining
from workbench.methods import AFL, AnaPFL, Ditto, LocalOnly

# The methods compared: name -> a fresh model. A new baseline is one more line here (its rows
# then appear in the table). Ditto's settings are those of benchmarks/communication.py's FedAvg
# (MLP head 1280 → 64 → 10, one local epoch of SGD, lr 0.05, batch 64), 20 rounds, λ = 0.1;
# set once, not tuned per setting.
METHODS = {
    "AnaPFL": lambda: AnaPFL(hidden_dim=1024, gamma=1e-2, gamma_out=1e-2, beta=1.0),
    "AFL": lambda: AFL(gamma=1.0, gamma_out=1.0),
    "Local-only": lambda: LocalOnly(gamma=1.0),
    "Ditto": lambda: Ditto(lam=0.1, num_rounds=20, architecture="mlp", hidden_dim=64,
                           local=LocalTraining(lr=0.05, batch_size=64)),
}


GLOBAL_PART = {"AnaPFL": "global branch", "Ditto": "global model"}  # its model without personalization


def quiet_trainer() -> Trainer:
    return Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0)


def local_mean_accuracy(logits: torch.Tensor, labels: torch.Tensor, client_ids: torch.Tensor,
                        num_clients: int) -> float:
    """Mean over clients (with local test data) of their accuracy: (n, C), (n,), (n,) -> float."""
    correct = torch.zeros(num_clients, dtype=torch.float64).index_add_(0, client_ids,
                                                                       logits.argmax(1).eq(labels).double())
    total = torch.bincount(client_ids, minlength=num_clients)
    return float((correct[total > 0] / total[total > 0]).mean())


def run(name: str, dm: FederatedDataModule) -> list[dict]:
    """Fit and test one method on one setting -> table rows."""
    method = METHODS[name]()
    engine = LightningEngine(method)
    trainer = quiet_trainer()
    cpu_start = time.process_time()
    trainer.fit(engine, datamodule=dm)
    fit_cpu_s = time.process_time() - cpu_start
    result = trainer.test(engine, datamodule=dm, verbose=False)[0]
    fit = engine.fit_metrics
    row = {"method": name, "local_mean": result["test/acc_local_mean"], "local_min": result["test/acc_local_min"],
           "global": result.get("test/acc", float("nan")),  # none without a global model (local-only)
           "rounds": int(fit["comm/rounds"]), "bytes_up": fit["comm/bytes_up"],
           "fit_s": fit["time/fit_s"], "fit_cpu_s": fit_cpu_s, "note": ""}
    rows = [row]
    if "anapfl/lambda" in fit:
        row["note"] = f"λ = {fit['anapfl/lambda']:.1f}"
    if name in GLOBAL_PART:
        with torch.no_grad():  # the same fit's global model alone, on every client's local test
            global_logits = torch.cat([method(x) for x in dm.local_test_features.split(8192)])
        rows.append({**row, "method": f"{name} {GLOBAL_PART[name]}", "note": "same fit",
                     "local_mean": local_mean_accuracy(global_logits, dm.local_test_labels,
                                                       dm.local_test_client_ids, dm.num_clients),
                     "local_min": float("nan")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--backbone", default="efficientnet_lite0")
    parser.add_argument("--input_size", type=int, default=64)
    parser.add_argument("--clients", type=int, nargs="+", default=[50, 100])
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.5, 1.0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--out", default="benchmarks/results/personalized.md")
    args = parser.parse_args()
    for notice in (".*configure_optimizers.* returned `None`", ".*does not have many workers",
                   ".*Total length of .* across ranks is zero", ".*LeafSpec.*"):
        warnings.filterwarnings("ignore", message=notice)

    def percent(value: float) -> str:
        return "–" if math.isnan(value) else f"{100 * value:.2f}"

    load_start = load_average()
    start = time.perf_counter()
    rows, sizes, totals = [], {}, set()
    for num_clients in args.clients:
        for alpha in args.alphas:
            dm = FederatedDataModule(dataset=args.dataset, backbone=args.backbone, input_size=args.input_size,
                                     num_clients=num_clients, partition="dirichlet", alpha=alpha, seed=0,
                                     personalized=True, local_test_fraction=0.25, batch_size=8192)
            dm.setup()
            counts = torch.bincount(dm.train_client_ids, minlength=num_clients)
            sizes[(num_clients, alpha)] = (int(counts.min()), int(counts.median()), int(counts.max()))
            totals.add((len(dm.train_labels), len(dm.local_test_labels)))  # rounding varies by partition
            for name in args.methods:
                for row in run(name, dm):
                    rows.append({"K": num_clients, "alpha": alpha, **row})
                    print(f"K={num_clients} α={alpha} {row['method']}: local {row['local_mean']:.4f} "
                          f"global {percent(row['global'])} fit {row['fit_s']:.1f} s ({row['fit_cpu_s']:.1f} CPU s)",
                          flush=True)

    lines = [
        (f"Dataset {args.dataset}, backbone {args.backbone} at {args.input_size} px (d = {dm.feature_dim}), "
         "personalized protocol: 25% of each client's share of the training images (per class, rounded) is its "
         f"local test data, the rest its training data ({min(t for t, _ in totals)}–{max(t for t, _ in totals)} "
         f"training and {min(n for _, n in totals)}–{max(n for _, n in totals)} local test samples in all, "
         "by setting); Dirichlet partition seed 0."),
        machine_line(f"one fit per cell; whole script {time.perf_counter() - start:.0f} s", load_start),
        "",
        ("Accuracy in %: local = mean over clients of the accuracy on their own local test data "
         "(min = the worst client); global = the global test set (10k) with `forward` "
         "(AnaPFL: its global branch; local-only: none, it has no global model). "
         "Bytes: uploaded by all clients together. Fit s: the method's own wall-clock time; "
         "fit CPU s: CPU seconds of the whole `Trainer.fit` (all threads)."),
        "",
        "| K | α | train samples per client (min/median/max) | method | local mean | local min | global | rounds "
        "| bytes up | fit s | fit CPU s | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        low, mid, high = sizes[(r["K"], r["alpha"])]
        lines.append(f"| {r['K']} | {r['alpha']} | {low}/{mid}/{high} | {r['method']} | {percent(r['local_mean'])} | "
                     f"{percent(r['local_min'])} | {percent(r['global'])} | {r['rounds']} | "
                     f"{r['bytes_up'] / 1e6:.1f} MB | {r['fit_s']:.1f} | {r['fit_cpu_s']:.1f} | {r['note']} |")
    # The claim to check: AnaPFL above every other method's mean local accuracy, by how much.
    lines += ["", "| K | α | AnaPFL − best other method (local mean, points) | best other | "
              "AnaPFL − its global branch (points) | λ |", "|---|---|---|---|---|---|"]
    for num_clients in args.clients:
        for alpha in args.alphas:
            cell = {r["method"]: r for r in rows if r["K"] == num_clients and r["alpha"] == alpha}
            others = [r for name, r in cell.items() if not name.startswith("AnaPFL")]
            if "AnaPFL" in cell and others:
                ours, best = cell["AnaPFL"], max(others, key=lambda r: r["local_mean"])
                refinement = ours["local_mean"] - cell["AnaPFL global branch"]["local_mean"]
                lines.append(f"| {num_clients} | {alpha} | {100 * (ours['local_mean'] - best['local_mean']):+.2f} | "
                             f"{best['method']} | {100 * refinement:+.2f} | {ours['note'].removeprefix('λ = ')} |")
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
