"""DeepAFL's downlink: the bytes the server broadcasts, measured by the engine (`comm/bytes_down`).

Ω_t (f × h) has rank ≤ C, so the server broadcasts its factors L_t (f × r) and U_t (h × r),
r = min(h, C), whenever r(f + h) < f·h; the fused schedule's clients do not read W_{t−1}, so its
rounds no longer carry it. Per client, over a fit of T layers, in the model's itemsize b:

    dense (before):  8 + ((T + 1)·h·C + T·f·h)·b               both schedules
    fused:           8 + (h·C + T·r(f + h))·b                  W_T and the factors of every Ω_t
    two_round:       8 + ((T + 1)·h·C + T·r(f + h))·b          W_{t−1} in each Ω round, W_T

Each row is a real fit on small synthetic data at the paper's shape (h = f = 1024, C = 10,
T = 20), in process; bytes do not depend on the data's size. `cohort q` rows sample a cohort
each round, so a client that missed rounds receives the Ω_t it lacks (more bytes).
`--save` keeps every row's bytes and classifiers W_0..W_T; `--before` reads such a file written
by the same script on an earlier commit and adds the measured bytes and the model's distance to it.

    python benchmarks/deepafl_downlink.py                          # about 3 min on 2 cores
    python benchmarks/deepafl_downlink.py --save /tmp/after.pt --before /tmp/before.pt
    python benchmarks/deepafl_downlink.py --layers 3 --hidden 64 --out /tmp/downlink.md   # a quick look
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fit_engine, load_average, machine_line, write_report
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.federation import Federation
from workbench.federation.messages import SEED_BYTES
from workbench.methods import DeepAFL


def dense_bytes(layers: int, hidden: int, block: int, classes: int, itemsize: int) -> int:
    """Per client, every Ω_t dense and every W_t once: the broadcast before the factored Ω."""
    return SEED_BYTES + ((layers + 1) * hidden * classes + layers * block * hidden) * itemsize


def factored_bytes(schedule: str, layers: int, hidden: int, block: int, classes: int, itemsize: int) -> int:
    """Per client, full participation: the factors of Ω_t where smaller; fused sends W_T only."""
    rank = min(hidden, classes)
    omega = min(rank * (block + hidden), block * hidden)
    classifiers = 1 if schedule == "fused" else layers + 1
    return SEED_BYTES + (classifiers * hidden * classes + layers * omega) * itemsize


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=20, help="T")
    parser.add_argument("--hidden", type=int, default=1024, help="h = f")
    parser.add_argument("--classes", type=int, default=10, help="C")
    parser.add_argument("--num_clients", type=int, default=10)
    parser.add_argument("--train_size", type=int, default=500)
    parser.add_argument("--sample_rate", type=float, default=0.5, help="the cohort rows' q")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--save", help="write every row's bytes and W_t here (torch.save)")
    parser.add_argument("--before", help="a --save file of an earlier commit: its bytes and model beside ours")
    parser.add_argument("--note", default="", help="appended to the machine line")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "deepafl_downlink.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_at_start = load_average()
    start = time.perf_counter()
    T, h, C, K = args.layers, args.hidden, args.classes, args.num_clients
    blobs = SyntheticBlobs(num_classes=C, dim=16, train_size=args.train_size, test_size=200,
                           separation=3.0, seed=0)
    dm = FederatedDataModule(dataset="synthetic", synthetic=blobs, num_clients=K, partition="iid",
                             min_partition_size=1)
    dm.setup()
    before = torch.load(args.before, weights_only=False) if args.before else None

    saved, rows = {}, []
    for schedule in ("fused", "two_round"):
        for federation in (None, Federation(sample_rate=args.sample_rate, seed=0)):
            name = f"{schedule}, " + ("all clients" if federation is None else f"cohort q = {args.sample_rate:g}")
            method = DeepAFL(num_layers=T, hidden_dim=h, block_dim=h, schedule=schedule)
            engine, tested = fit_engine(method, dm, federation)
            metrics = engine.fit_metrics
            down = metrics["comm/bytes_down"] / K  # every client receives the final broadcast
            saved[name] = {"bytes_down": down, "classifier": method.classifier.detach().cpu().clone()}
            row = [name, f"{int(metrics['comm/rounds'])}", f"{down / 1e6:,.3f}"]
            if federation is None:
                expected = factored_bytes(schedule, T, h, h, C, 8)
                dense = dense_bytes(T, h, h, C, 8)
                row += [f"{expected / 1e6:,.3f}" + ("" if down == expected else " (differs)"),
                        f"{dense / 1e6:,.3f}", f"{dense / down:.1f}"]
            else:
                row += ["–", "–", "–"]
            if before is not None:
                old = before[name]
                row += [f"{old['bytes_down'] / 1e6:,.3f}", f"{old['bytes_down'] / down:.1f}",
                        f"{relative_distance(method.classifier, old['classifier']):.1e}"]
            row += [f"{metrics['comm/bytes_up_per_client'] / 1e6:,.1f}", f"{100 * tested['test/acc']:.2f}"]
            rows.append("| " + " | ".join(row) + " |")
            print(rows[-1], flush=True)
    if args.save:
        torch.save(saved, args.save)

    header = ["schedule, cohort", "rounds", "MB down / client", "formula", "dense (before) formula", "× less"]
    if before is not None:
        header += ["before, measured", "× less than measured", "W_0..W_T vs before"]
    header += ["MB up / client", f"test acc at t = {T} (%)"]
    lines = [
        "# DeepAFL: downlink with Ω_t as its rank-C factors",
        "",
        f"DeepAFL T = {T}, h = f = {h}, C = {C}, float64, gelu, γ = 1, γ_s = 0.05; synthetic blobs "
        f"({args.train_size} training rows, d = 16), K = {K} IID clients, in process (Lightning engine). "
        "MB = 10⁶ bytes per client over the whole fit, the final broadcast included (`comm/bytes_down` / K). "
        "`formula`: the module's count for full participation; `dense (before)`: every Ω_t sent as f × h "
        "and every W_t once. A cohort row's clients catch up on the Ω_t they missed, so they receive more."
        + (" `before, measured` and `W_0..W_T vs before` (‖ΔW‖/‖W‖ over every depth): the same script on "
           "the commit before the change (`--before`)." if before is not None else ""),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *rows,
        "",
        machine_line(f"whole run {time.perf_counter() - start:.0f} s" + (f"; {args.note}" if args.note else ""),
                     load_at_start),
    ]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
