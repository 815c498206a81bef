"""GH-OFL heads against FedCGS and AFL on cached backbone features, across label skew.

For each Dirichlet α: one `GHOFL` fit with all six heads (nb_diag, lda, qda, fishermix,
proto_hyper, fedcgs) on the raw features, one with the public `--sketch_dim` projection, and
one `AFL(gamma=1, gamma_out=1)` fit; every head is scored on the test set. Reported:

- test accuracy of every head and of AFL, per α, without and with the sketch;
- upload bytes per client (`comm/bytes_up_per_client`) of each configuration. They depend on
  the selected heads: qda needs the per-class second moments S_c (C·d(d+1)/2 numbers), the
  other heads only B = Σ xxᵀ and the per-class Σ x⊙x. The "without qda" bytes come from a real
  fit with heads nb_diag + lda + fedcgs, which sends what every selection without qda sends
  (with the default synthesis covariance "auto");
- server time of each head (`time/server_s/<head>`, one fit each) and of the shared parts; the
  gradient-trained heads (fishermix, proto_hyper) train in a plain AdamW loop on the server
  (`train_on_synthetic`), and the report says whether each took under `--trained_head_budget_s`
  (10 s) in every setting;
- the claims "every GH head beats FedCGS" and "accuracy is constant across α", computed from
  the numbers above.

    python benchmarks/gaussian_heads.py                       # defaults: 3 α, K = 10, k = 256
    python benchmarks/gaussian_heads.py --fishermix_epochs 10 --proto_hyper_epochs 5  # quicker
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fit_engine, load_average, machine_line, write_report
from workbench.data import FederatedDataModule
from workbench.methods import AFL, GHOFL
from workbench.methods.base import FederatedMethod
from workbench.methods.ghofl import (
    DEFAULT_FISHERMIX,
    DEFAULT_PROTO_HYPER,
    DEFAULT_SYNTHESIS,
    HEADS,
)

GH_HEADS = tuple(h for h in HEADS if h != "fedcgs")  # the heads the claims are about
NO_QDA = ("nb_diag", "lda", "fedcgs")  # uploads A, N, B and Σ x⊙x: no S_c
SHARED_PARTS = {"moments": "(shared) Gaussian moments",
                "fisher_synthesis": "(shared) Fisher subspace + synthesis"}


def fit_and_test(method: FederatedMethod, datamodule: FederatedDataModule
                 ) -> tuple[dict[str, float], dict[str, float], float]:
    """-> (the engine's fit metrics, the test metrics, wall seconds of fit + test)."""
    start = time.perf_counter()
    engine, tested = fit_engine(method, datamodule)
    return engine.fit_metrics, tested, time.perf_counter() - start


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:.3f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--backbone", default="efficientnet_lite0")
    parser.add_argument("--input_size", type=int, default=64)
    parser.add_argument("--num_clients", type=int, default=10)
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.05, 0.1, 0.5])
    parser.add_argument("--min_partition_size", type=int, default=10)
    parser.add_argument("--sketch_dim", type=int, default=256)
    parser.add_argument("--fishermix_epochs", type=int, default=DEFAULT_FISHERMIX.epochs)
    parser.add_argument("--proto_hyper_epochs", type=int, default=DEFAULT_PROTO_HYPER.epochs)
    parser.add_argument("--trained_head_budget_s", type=float, default=10.0,
                        help="server seconds the report checks each trained head stays under")
    parser.add_argument("--out", default="benchmarks/results/gaussian_heads.md")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(configure_optimizers|LeafSpec|Total length).*")
    run_start = time.perf_counter()
    load_start = load_average()

    fishermix = replace(DEFAULT_FISHERMIX, epochs=args.fishermix_epochs)
    proto_hyper = replace(DEFAULT_PROTO_HYPER, epochs=args.proto_hyper_epochs)
    sketches = {"no sketch": None, f"k = {args.sketch_dim}": args.sketch_dim}
    acc: dict[tuple[float, str], dict[str, float]] = {}  # (α, sketch) -> row -> accuracy
    server_s: dict[tuple[float, str], dict[str, float]] = {}  # (α, sketch) -> part -> seconds
    up_bytes: dict[tuple[str, str], set[float]] = {}  # (selection, sketch) -> bytes per client
    smallest_client: dict[float, int] = {}
    feature_dim = num_train = 0

    for alpha in args.alphas:
        datamodule = FederatedDataModule(
            dataset=args.dataset, backbone=args.backbone, input_size=args.input_size,
            num_clients=args.num_clients, partition="dirichlet", alpha=alpha,
            min_partition_size=args.min_partition_size, batch_size=8192)
        datamodule.setup()
        num_train, feature_dim = datamodule.train_features.shape
        smallest_client[alpha] = int(torch.bincount(datamodule.train_client_ids).min())
        for sketch_name, sketch_dim in sketches.items():
            method = GHOFL(heads=HEADS, sketch_dim=sketch_dim, fishermix=fishermix,
                           proto_hyper=proto_hyper)
            fit, tested, wall = fit_and_test(method, datamodule)
            acc[alpha, sketch_name] = {h: tested[f"test/acc/{h}"] for h in HEADS}
            server_s[alpha, sketch_name] = {part: seconds for part in (*HEADS, *SHARED_PARTS)
                                            if (seconds := fit.get(f"time/server_s/{part}"))
                                            is not None}
            up_bytes.setdefault(("all", sketch_name), set()).add(fit["comm/bytes_up_per_client"])
            progress(f"[α = {alpha}, {sketch_name}] all heads: {wall:.0f} s, "
                     f"lda {acc[alpha, sketch_name]['lda']:.4f}, "
                     f"fedcgs {acc[alpha, sketch_name]['fedcgs']:.4f}")
            if alpha == args.alphas[0]:  # dense uploads: their bytes do not depend on α
                fit, tested, wall = fit_and_test(GHOFL(heads=NO_QDA, sketch_dim=sketch_dim),
                                                 datamodule)
                up_bytes["no_qda", sketch_name] = {fit["comm/bytes_up_per_client"]}
                progress(f"[α = {alpha}, {sketch_name}] {' + '.join(NO_QDA)}: {wall:.0f} s")
        fit, tested, wall = fit_and_test(AFL(gamma=1.0, gamma_out=1.0), datamodule)
        acc[alpha, "no sketch"]["afl"] = tested["test/acc"]
        up_bytes.setdefault(("afl", "no sketch"), set()).add(fit["comm/bytes_up_per_client"])
        progress(f"[α = {alpha}] AFL: {wall:.0f} s, {tested['test/acc']:.4f}")

    settings = [(alpha, sketch) for alpha in args.alphas for sketch in sketches]
    header = "| | " + " | ".join(f"α = {a}, {s}" for a, s in settings) + " |"
    rule = "|---" * (len(settings) + 1) + "|"

    def cell(table: dict, key: tuple[float, str], row: str, fmt: str) -> str:
        value = table[key].get(row)
        return "–" if value is None else format(value, fmt)

    acc_rows = [f"| {row} | " + " | ".join(cell(acc, k, row, ".4f") for k in settings) + " |"
                for row in (*HEADS, "afl")]
    time_rows = [f"| {SHARED_PARTS.get(part, part)} | "
                 + " | ".join(cell(server_s, k, part, ".3f") for k in settings) + " |"
                 for part in (*HEADS, *SHARED_PARTS)]

    def bytes_cell(selection: str, sketch_name: str) -> str:
        values = up_bytes.get((selection, sketch_name))
        if values is None:
            return "–"
        if len(values) > 1:  # would contradict the dense upload shapes
            raise RuntimeError(f"{selection} bytes differ across α: {sorted(values)}")
        return mb(next(iter(values)))

    bytes_names = {"all": "GH-OFL, all six heads (qda: per-class S_c)",
                   "no_qda": f"GH-OFL without qda ({' + '.join(NO_QDA)}: B and Σ x⊙x, no S_c)",
                   "afl": "AFL (G + γI packed, XᵀY)"}
    bytes_rows = [f"| {bytes_names[s]} | " + " | ".join(bytes_cell(s, k) for k in sketches) + " |"
                  for s in bytes_names]

    # Claims, from the numbers above.
    beaten = {h: [k for k in settings if acc[k][h] > acc[k]["fedcgs"]] for h in GH_HEADS}
    claim_rows = []
    for head in (*HEADS, "afl"):
        spreads = []
        for sketch_name in sketches:
            values = [acc[a, sketch_name].get(head) for a in args.alphas]
            values = [v for v in values if v is not None]
            spreads.append(f"{max(values) - min(values):.4f}" if values else "–")
        wins = f"{len(beaten[head])}/{len(settings)}" if head in beaten else "–"
        claim_rows.append(f"| {head} | " + " | ".join(spreads) + f" | {wins} |")
    every_head = all(len(w) == len(settings) for w in beaten.values())
    losers = sorted({h for h, w in beaten.items() if len(w) < len(settings)})
    all_spreads = [max(acc[a, s][h] for a in args.alphas) - min(acc[a, s][h] for a in args.alphas)
                   for s in sketches for h in HEADS]
    afl_spread = (max(acc[a, "no sketch"]["afl"] for a in args.alphas)
                  - min(acc[a, "no sketch"]["afl"] for a in args.alphas))

    s = DEFAULT_SYNTHESIS
    sizes = ", ".join(f"{smallest_client[a]} at α = {a}" for a in args.alphas)
    setup = (f"GH-OFL heads, FedCGS and AFL on {args.dataset} ({num_train} train samples), "
             f"{args.backbone} at {args.input_size} px, d = {feature_dim}; K = "
             f"{args.num_clients} clients, Dirichlet α ∈ {{{', '.join(map(str, args.alphas))}}} "
             f"with min_partition_size = {args.min_partition_size} (smallest client: {sizes}); "
             f"sketch: public projection to k = {args.sketch_dim}.")
    hyper = (f"GH-OFL settings: shrinkage 0.05, synthesis {s.per_class} samples per class "
             f"(τ = {s.tau}, energy {s.energy}), FisherMix {fishermix.epochs} epochs, Proto-Hyper "
             f"{proto_hyper.epochs} epochs (method defaults: {DEFAULT_FISHERMIX.epochs} and "
             f"{DEFAULT_PROTO_HYPER.epochs}), FedCGS ridge 0; AFL γ = 1, γ_out = 1.")
    machine = machine_line(f"one fit per setting; whole run {time.perf_counter() - run_start:.0f} s",
                           load_at_start=load_start)
    head_claim = f"- Every GH head beats FedCGS in every setting: {'yes' if every_head else 'no'}"
    if not every_head:
        head_claim += f" (not always: {', '.join(losers)})"
    alpha_claim = (f"- Accuracy constant across α: largest spread over the GH-OFL heads and "
                   f"FedCGS {max(all_spreads):.4f}, AFL {afl_spread:.4f}.")
    trained_s = {head: max(server_s[k][head] for k in settings) for head in ("fishermix", "proto_hyper")}
    budget = args.trained_head_budget_s
    fast = all(seconds < budget for seconds in trained_s.values())
    time_claim = (f"- The trained heads take under {budget:g} s of server time in every setting: "
                  f"{'yes' if fast else 'no'} (slowest: "
                  + ", ".join(f"{head} {seconds:.2f} s" for head, seconds in trained_s.items()) + ").")
    lines = [
        setup,
        hyper,
        machine,
        "",
        "Test accuracy (AFL has no sketch):",
        "",
        header, rule, *acc_rows,
        "",
        ("Upload bytes per client (the same for every α: the uploads are dense, whatever classes "
         "a client holds):"),
        "",
        "| selection | " + " | ".join(sketches) + " |",
        "|---" * (len(sketches) + 1) + "|",
        *bytes_rows,
        "",
        ("Server time per head (s); the shared rows are computed once for the heads that use "
         "them (moments: all; Fisher subspace + synthesis: fishermix and proto_hyper):"),
        "",
        header, rule, *time_rows,
        "",
        "Claims:",
        "",
        "| head | " + " | ".join(f"accuracy max − min across α, {k}" for k in sketches)
        + " | settings where it beats FedCGS |",
        "|---|" + "---|" * len(sketches) + "---|",
        *claim_rows,
        "",
        head_claim + ".",
        alpha_claim,
        time_claim,
    ]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
