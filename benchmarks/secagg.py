"""What secure aggregation costs AFL as the number of clients grows: SecAgg+ against all pairs.

For each K, the same AFL fit (in process, one round, 5 % of the clients dropping out) three ways:
plain (no masking), SecAgg+ (`secure_aggregation_graph: sparse`, k and t chosen by the rule of
`workbench.federation.secure_aggregation` for γ = 0.05 and the dropout) and all pairs (`complete`).
Fit time: median of `--repeats`, the three variants interleaved within each repeat so that the
machine's load hits them alike; the ratios are to the plain fit of the same run. All pairs is
skipped where its time, extrapolated as K² from the largest K it ran at, would exceed
`--complete_budget_s`. Also: the mask streams and share bytes each client pays (the engine's
`comm/secagg_*` metrics), the server's unmasking time (Shamir reconstruction and its mask streams)
and the distance of the masked model from the plain one (only the fixed-point rounding differs).

Features: synthetic class blobs (`SyntheticBlobs`, d = `--dim`, 10 classes, `--per_client` rows per
client, iid), so the upload is d(d+1)/2 + 10d ring elements. One torch thread: the per-client
steps are tiny, and on a shared machine a thread pool's wake-ups would dominate them.

    python benchmarks/secagg.py                       # K = 10, 100, 1000
    python benchmarks/secagg.py --clients 10 100 --repeats 1   # quick
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fit_engine, load_average, machine_line, write_report
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.federation import Federation
from workbench.methods import AFL

VARIANTS = ("plain", "sparse", "complete")


def federation(variant: str, dropout: float) -> Federation:
    if variant == "plain":
        return Federation(dropout=dropout, seed=1)
    return Federation(dropout=dropout, seed=1, secure_aggregation=True, secure_aggregation_graph=variant)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--per_client", type=int, default=50, help="training rows per client")
    parser.add_argument("--dropout", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--complete_budget_s", type=float, default=60.0,
                        help="skip all pairs where its extrapolated fit time exceeds this")
    parser.add_argument("--out", default="benchmarks/results/secagg.md")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # one Trainer per fit: no banners
    torch.set_num_threads(1)
    load_at_start, run_start = load_average(), time.perf_counter()

    rows, complete_at = [], None  # (K, seconds) of the largest all-pairs fit
    for num_clients in args.clients:
        blobs = SyntheticBlobs(num_classes=10, dim=args.dim, train_size=args.per_client * num_clients,
                               test_size=200, seed=0)
        dm = FederatedDataModule(dataset="synthetic", synthetic=blobs, num_clients=num_clients, partition="iid")
        dm.setup()
        variants = list(VARIANTS)
        if complete_at is not None:
            predicted = complete_at[1] * (num_clients / complete_at[0]) ** 2
            if predicted > args.complete_budget_s:
                variants.remove("complete")
        times = {v: [] for v in variants}
        metrics, models = {}, {}
        for _ in range(args.repeats):
            for variant in variants:
                engine, _ = fit_engine(AFL(gamma=1.0, gamma_out=0.1), dm, federation(variant, args.dropout), test=False)
                times[variant].append(engine.fit_metrics["time/fit_s"])
                metrics[variant], models[variant] = engine.fit_metrics, engine.method
        fit_s = {v: statistics.median(t) for v, t in times.items()}
        if "complete" in fit_s:
            complete_at = (num_clients, fit_s["complete"])
        plain = models["plain"].weight
        distance = float(torch.linalg.norm(models["sparse"].weight - plain) / torch.linalg.norm(plain))
        sparse = metrics["sparse"]
        complete = metrics.get("complete")
        rows.append(
            f"| {num_clients} | {fit_s['plain']:.2f} s | {fit_s['sparse']:.2f} s | "
            f"**{fit_s['sparse'] / fit_s['plain']:.2f}** | "
            + (f"{fit_s['complete']:.2f} s | {fit_s['complete'] / fit_s['plain']:.2f} | " if complete else
               f"skipped (≈ {complete_at[1] * (num_clients / complete_at[0]) ** 2:.0f} s by K²) | – | ")
            + f"{int(sparse['comm/secagg_degree'])} / {int(sparse['comm/secagg_threshold'])} | "
            f"{sparse['comm/secagg_mask_streams_per_client']:.1f} | "
            + (f"{complete['comm/secagg_mask_streams_per_client']:.1f} | " if complete else "– | ")
            + f"{sparse['comm/secagg_share_bytes_per_client'] / 1e3:.1f} kB | "
            f"{sparse['comm/bytes_up_per_client'] / 1e3:.1f} kB | {sparse['time/secure_aggregation_s']:.2f} s | "
            f"{distance:.1e} |")
        print(rows[-1], flush=True)

    upload = args.dim * (args.dim + 1) // 2 + 10 * args.dim
    lines = [
        "# Secure aggregation at scale: SecAgg+ (sparse graph) against all pairs, AFL",
        "",
        f"Synthetic blobs, d = {args.dim}, 10 classes, {args.per_client} rows per client (iid); upload "
        f"{upload} ring elements (8 bytes each); dropout {args.dropout:g}; AFL γ = 1, γ_out = 0.1; in-process "
        f"engine, one torch thread. Fit time: median of {args.repeats}, the variants interleaved; ratios to the "
        "plain fit of this run (the machine is shared: compare within the table only).",
        machine_line(f"whole run {time.perf_counter() - run_start:.0f} s", load_at_start),
        "",
        "SecAgg+: k and t from the rule (γ = 0.05 corrupt, δ = the dropout, σ = 40, η = 30; k = n − 1 where no "
        "smaller k meets the bounds). Streams / client and share bytes / client: the engine's "
        "`comm/secagg_mask_streams_per_client` and `comm/secagg_share_bytes_per_client` (fit totals / K: "
        "survivors draw k + 1 streams, all pairs n − 1; every participant deals 2k shares, survivors reveal k, "
        "16 bytes each). Unmask: the server's time (`time/secure_aggregation_s`: Shamir reconstruction and its "
        "mask streams). Distance: ‖W_SecAgg+ − W_plain‖ / ‖W_plain‖.",
        "",
        "| K | fit, plain | fit, SecAgg+ | ratio | fit, all pairs | ratio | k / t | streams / client, SecAgg+ "
        "| streams / client, all pairs | shares / client | upload / client | unmask, SecAgg+ | distance |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
