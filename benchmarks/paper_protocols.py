"""Methods at their papers' protocols: `osfed` (OS-FED against FedAvg and compressors) or `safle`.

    python benchmarks/paper_protocols.py osfed                 # the OS-FED protocol (see --rounds)
    python benchmarks/paper_protocols.py osfed --smoke --out /tmp/osfed.md   # a minute
    python benchmarks/paper_protocols.py safle ...             # benchmarks/safle_protocol.py

`osfed`: the OS-FED paper's protocol on mnist5k (4k/1k raw 28×28 digits, the small CNN):
10 clients, Dirichlet α = 0.5, all clients every round, 5 local epochs of SGD at lr 0.01 with
cosine decay over the run's rounds (to 0), no momentum or weight decay. Rows: FedAvg (dense
float32); OS-FED M = 2 with cells at the digits' own resolution (a 56×56 map, 12.7 kB) with the
paper's error feedback, with the residual bounded by ‖e_k‖ ≤ ‖Δw_k‖, and without; top-k with
error feedback at OS-FED's bytes; 4-bit min-max quantization and scaled sign (1 bit), both with
error feedback. After every round the global model is scored on the test split (reported, never
used to choose anything; every setting here was fixed before the run). Reports accuracy against
cumulative upload, the round (and upload) at which each method first reaches FedAvg's final
accuracy − 3 points, and OS-FED's per-round diagnostics (osfed/* of workbench/methods/osfed.py):
the Markdown table, a CSV of every method's curve and a PNG.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import load_average, machine_line, write_report
from benchmarks.communication import compressed, markdown, run
from workbench.data import FederatedDataModule
from workbench.federation import Federation
from workbench.federation.compression import FLOAT_BYTES, ErrorFeedback, index_bytes
from workbench.federation.local_training import LocalTraining, scheduled_lr
from workbench.methods import OSFED, FedAvg
from workbench.methods.osfed import Snapshot

DIAGNOSTICS = {  # column: logged metric
    "match loss (EF target)": "osfed/match_loss",
    "match loss (fresh Δw)": "osfed/match_loss_fresh",
    "‖e‖/‖Δw‖": "osfed/residual_ratio",
    "‖ĝ − mean Δw‖/‖mean Δw‖": "osfed/update_rel_error",
    "cos(ĝ, mean Δw)": "osfed/update_cosine",
    "‖ĝ‖/‖mean Δw‖": "osfed/update_norm_ratio",
}
PAPER_OSFED = "OS-FED M=2, EF (paper)"


def osfed_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="paper_protocols.py osfed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=100, help="rounds (the paper's 100; cosine over these)")
    parser.add_argument("--local_epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lbfgs_steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 avoids the thread-pool stalls of a shared 2-core machine")
    parser.add_argument("--out", default="benchmarks/results/paper_protocols_osfed.md")
    parser.add_argument("--smoke", action="store_true", help="2 rounds, 1 local epoch, 3 L-BFGS iterations")
    parser.add_argument("--from_csv", help="rewrite the report from a run's CSV (pass the run's other options too)")
    args = parser.parse_args(argv)
    args.command = " ".join(["python benchmarks/paper_protocols.py osfed",
                             *(arg for arg in argv if not arg.startswith("--from_csv") and arg != args.from_csv)])
    if args.from_csv:
        rerender(args)
        return
    if args.smoke:
        args.rounds, args.local_epochs, args.lbfgs_steps = 2, 1, 3
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", module="lightning")  # no optimizer, no val loader: by design
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    load_at_start, start = load_average(), time.perf_counter()

    datamodule = FederatedDataModule(dataset="mnist5k", inputs="images", num_clients=10, partition="dirichlet",
                                     alpha=0.5, seed=0)
    datamodule.setup()
    local = LocalTraining(epochs=args.local_epochs, lr=args.lr, lr_schedule="cosine", batch_size=args.batch_size)
    common = dict(num_rounds=args.rounds, architecture="cnn", seed=0, local=local)
    osfed = dict(snapshot=Snapshot(grid_size=2, lbfgs_steps=args.lbfgs_steps), diagnostics=True, **common)
    out = Path(args.out)
    runs: dict[str, list[dict[str, float]]] = {}

    def record(name: str, method, federation: Federation | None = None) -> None:
        begun = time.perf_counter()
        runs[name] = run(method, datamodule, federation)
        print(f"{name}: final acc {100 * runs[name][-1]['acc']:.2f} ({(time.perf_counter() - begun) / 60:.1f} min)",
              flush=True)
        report(runs, args, out, load_at_start, time.perf_counter() - start)  # partial results survive a stop

    record("FedAvg", FedAvg(**common))
    record(PAPER_OSFED, OSFED(**osfed))
    params = round(runs["FedAvg"][-1]["bytes_per_client"] / FLOAT_BYTES)
    snapshot_bytes = runs[PAPER_OSFED][-1]["bytes_per_client"]
    k = max(1, math.floor(snapshot_bytes / (FLOAT_BYTES + index_bytes(params))))  # top-k at ≤ OS-FED's bytes
    record(f"top-k {100 * k / params:.1f}% + EF", FedAvg(**common),
           compressed(kind="topk", topk_fraction=(k - 0.5) / params))
    record("4-bit + EF", FedAvg(**common), compressed(kind="quantize", quantize_bits=4))
    record("OS-FED M=2, EF bounded ‖e‖ ≤ ‖Δw‖", OSFED(**osfed, error_feedback=ErrorFeedback(bound=1.0)))
    record("OS-FED M=2, no EF", OSFED(**osfed, error_feedback=ErrorFeedback(enabled=False)))
    record("scaled sign + EF", FedAvg(**common), compressed(kind="sign"))


def rerender(args) -> None:
    """The report again from the CSV a run wrote, with that run's machine line (kept from --out)."""
    runs: dict[str, list[dict[str, float]]] = {}
    with open(args.from_csv) as handle:
        for row in csv.DictReader(handle):
            runs.setdefault(row.pop("method"), []).append({key: float(value) for key, value in row.items() if value})
    out = Path(args.out)
    old = out.read_text().splitlines() if out.exists() else []
    machine = next((line for line in old if line.startswith("Machine:")), None)
    report(runs, args, out, None, 0.0, machine=machine)


def summary(name: str, rows: list[dict[str, float]], reference: float, target: float) -> dict[str, str]:
    reached = next((row for row in rows if row["acc"] >= target), None)
    best = max(rows, key=lambda row: row["acc"])
    seconds = sum(row["train_s"] + row["time/compress_s"] + row["time/server_s"] for row in rows)
    line = {
        "method": name,
        "kB / client / round": f"{rows[-1]['bytes_per_client'] / 1e3:,.1f}",
        "× fewer than FedAvg": f"{reference / rows[-1]['bytes_per_client']:,.1f}",
        "final acc": f"{100 * rows[-1]['acc']:.2f}",
        "best acc (round)": f"{100 * best['acc']:.2f} ({int(best['round'])})",
        "total upload": f"{rows[-1]['bytes_up'] / 1e6:,.2f} MB",
        f"round (upload) to {100 * target:.1f} %": "not reached" if reached is None
        else f"{int(reached['round'])} ({reached['bytes_up'] / 1e6:,.2f} MB)",
        "s / round": f"{seconds / len(rows):.1f}",
    }
    line["‖e‖/‖Δw‖ median (max)"] = line["rounds farther than sending nothing"] = ""
    if "osfed/update_rel_error" in rows[-1]:
        worse = [int(row["round"]) for row in rows if row["osfed/update_rel_error"] > 1]
        line["‖e‖/‖Δw‖ median (max)"] = (
            f"{float(torch.tensor([r['osfed/residual_ratio'] for r in rows]).median()):.2f} "
            f"({max(r['osfed/residual_ratio'] for r in rows):.2f})")
        line["rounds farther than sending nothing"] = f"{len(worse)} of {len(rows)}"
    return line


def report(runs: dict[str, list[dict[str, float]]], args, out: Path, load_at_start, seconds: float,
           machine: str | None = None) -> None:
    fedavg = runs["FedAvg"]
    target = fedavg[-1]["acc"] - 0.03
    lines = [
        "OS-FED at its paper's protocol on mnist5k (4000/1000 raw 28×28 digits, small CNN, 116 kB of "
        f"parameters): 10 clients, Dirichlet α = 0.5, every client every round, {args.local_epochs} local "
        f"epochs of SGD (batch {args.batch_size}) at lr {args.lr:g} with cosine decay to 0 over "
        f"{args.rounds} rounds, no momentum or weight decay; OS-FED M = 2 with cells at the digits' own "
        f"resolution (56×56 map), {args.lbfgs_steps} L-BFGS iterations per fit. Test accuracy after every "
        "round (reported only; no setting was chosen on it). Rounds to target: first round at FedAvg's final "
        "accuracy − 3 points. ‖e‖/‖Δw‖: mean over clients of the error-feedback residual after the round over "
        "the round's update. Rounds farther than sending nothing: ‖ĝ − mean Δw‖ > ‖mean Δw‖ for the update "
        f"ĝ the server applied. `{args.command}` reproduces it ({'; '.join(runs)} done).",
        machine or machine_line(f"{seconds / 60:.1f} min so far", load_at_start),
        "",
        *markdown([summary(name, rows, fedavg[-1]["bytes_per_client"], target) for name, rows in runs.items()]),
        "",
    ]
    for name, rows in runs.items():
        if "osfed/update_rel_error" not in rows[-1]:
            continue
        lines += [f"#### Per-round diagnostics: {name}", "",
                  *markdown([{"round": str(int(row["round"])),
                              "lr": f"{scheduled_lr(args.lr, int(row['round']) - 1, args.rounds, 'cosine'):.4f}",
                              "test acc": f"{100 * row['acc']:.2f}",
                              **{column: f"{row[key]:.3f}" for column, key in DIAGNOSTICS.items()}}
                             for row in rows]), ""]
    write_report(lines, out)
    if args.from_csv and Path(args.from_csv).resolve() == out.with_suffix(".csv").resolve():
        plot(runs, out.with_suffix(".png"))
        return
    with open(out.with_suffix(".csv"), "w", newline="") as handle:  # every method's curve
        keys = ["method", "round", "acc", "bytes_up", "bytes_per_client", "train_s", "time/compress_s",
                "time/server_s", *DIAGNOSTICS.values(), "osfed/residual_norm"]
        writer = csv.DictWriter(handle, keys, extrasaction="ignore")
        writer.writeheader()
        for name, rows in runs.items():
            writer.writerows({"method": name, **row} for row in rows)
    plot(runs, out.with_suffix(".png"))


def plot(runs: dict[str, list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curve, diagnostics) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, rows in runs.items():
        curve.plot([r["bytes_up"] for r in rows], [100 * r["acc"] for r in rows], marker="o", ms=2, label=name)
        if "osfed/update_rel_error" in rows[-1]:
            line, = diagnostics.plot([r["round"] for r in rows], [r["osfed/update_rel_error"] for r in rows],
                                     label=f"{name}: ‖ĝ − mean Δw‖/‖mean Δw‖")
            diagnostics.plot([r["round"] for r in rows], [r["osfed/residual_ratio"] for r in rows], ls="--",
                             color=line.get_color(), label=f"{name}: ‖e‖/‖Δw‖")
    curve.set(xscale="log", xlabel="cumulative upload, all clients (bytes)", ylabel="test accuracy (%)")
    diagnostics.axhline(1, color="gray", lw=0.8)
    diagnostics.set(yscale="log", xlabel="round", title="OS-FED diagnostics (1 = sending nothing)")
    for ax in (curve, diagnostics):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("osfed", "safle"):
        raise SystemExit("usage: python benchmarks/paper_protocols.py {osfed,safle} [options]  (--help after the part)")
    part, rest = argv[0], argv[1:]
    if part == "safle":
        from benchmarks import safle_protocol  # the SAFLe protocol lives in its own module

        safle_protocol.main(rest)
    else:
        osfed_main(rest)


if __name__ == "__main__":
    main()
