"""AFL, DeepAFL and SAFLe on cached backbone features, across partitions.

For every partition (Dirichlet α and iid, K clients): test accuracy, rounds, upload bytes per
client and fit time of
- AFL (γ = 1, γ_out = 1),
- DeepAFL at depths T = 5, 10, 20 — one fit to the deepest T: layer t of DeepAFL does not
  depend on T, so the model after 2t+1 rounds of that fit *is* the depth-t model; its
  accuracy, cumulative bytes and cumulative time are read at each depth,
- SAFLe in three bucketing modes × two (E, G) settings.
The analytic methods are exactly invariant to the partition (the tests check it to 1e-8);
this benchmark shows what that means for the numbers.

    python benchmarks/analytic_heads.py                               # the full grid (hours on 2 cores)
    python benchmarks/analytic_heads.py --deepafl_on iid:10 dirichlet0.1:100   # DeepAFL on two of them
    python benchmarks/analytic_heads.py --partitions iid:10 dirichlet0.01:10 --depths 5 10 --hidden 512
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning import Callback, Trainer

from benchmarks.common import fit_engine, machine_line, write_report
from workbench.data import FederatedDataModule
from workbench.engines import LightningEngine
from workbench.methods import AFL, DeepAFL, SAFLe

# α = 0.01 over 100 clients leaves clients empty with 10 classes (no Dirichlet draw gives every
# client a sample), so α = 0.01 runs at K = 10 only.
DEFAULT_PARTITIONS = ["iid:10", "iid:100", *(f"dirichlet{a}:{k}" for a in (0.5, 0.1) for k in (10, 100)),
                      "dirichlet0.01:10"]
SAFLE_SETTINGS = [  # (bucketing, levels L, experts E, group size G); V = k^G with k = 2, or k = L for integer
    ("binary_overlap", 8, 64, 6), ("binary_overlap", 8, 128, 5),  # E·V = 4096
    ("onehot", 8, 64, 6), ("onehot", 8, 128, 5),                  # E·V = 4096
    ("integer", 8, 64, 2), ("integer", 8, 128, 2),                # E·V = 4096, 8192
]


class RoundClock(Callback):
    """Seconds from the start of the fit to the end of each round."""

    def on_fit_start(self, trainer, module):
        self.start, self.ends = time.perf_counter(), []

    def on_train_epoch_end(self, trainer, module):
        self.ends.append(time.perf_counter() - self.start)


def fit(method, datamodule) -> tuple[float, dict[str, float]]:
    """Fit `method` and test it: -> (test accuracy, the engine's fit metrics `comm/*`, `time/*`)."""
    engine, tested = fit_engine(method, datamodule)
    return tested["test/acc"], engine.fit_metrics


def fit_clocked(method, datamodule, clock: RoundClock) -> None:
    """Fit `method` with `clock` timing its rounds (`fit_engine` takes no callbacks); no test:
    DeepAFL's accuracy at every depth comes from the fit (`depth_accuracy`)."""
    trainer = Trainer(logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[clock])
    trainer.fit(LightningEngine(method), datamodule=datamodule)


def parse_partition(text: str) -> dict:
    scheme, clients = text.split(":")
    if scheme == "iid":
        return {"partition": "iid", "num_clients": int(clients)}
    return {"partition": "dirichlet", "alpha": float(scheme.removeprefix("dirichlet")),
            "num_clients": int(clients), "min_partition_size": 1}


def deepafl_bytes_per_client(hidden: int, block: int, classes: int, depth: int) -> int:
    """Upload of one client through depth t: t+1 W rounds and t Ω rounds, packed Grams, float64."""
    return 8 * ((depth + 1) * (hidden * (hidden + 1) // 2 + hidden * classes)
                + depth * (block * (block + 1) // 2 + block * classes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--input_size", type=int, default=64)
    parser.add_argument("--partitions", nargs="+", default=DEFAULT_PARTITIONS,
                        help="iid:K or dirichletALPHA:K")
    parser.add_argument("--depths", type=int, nargs="+", default=[5, 10, 20])
    parser.add_argument("--deepafl_on", nargs="*", default=None,
                        help="partitions DeepAFL runs on (default: all; its model is the same on every "
                             "partition, so a subset shows the fit time and the invariance at less cost)")
    parser.add_argument("--hidden", type=int, default=1024, help="DeepAFL h = f")
    parser.add_argument("--safle", nargs="*", type=int, default=list(range(len(SAFLE_SETTINGS))),
                        help=f"indices into {SAFLE_SETTINGS}")
    parser.add_argument("--out", default="benchmarks/results/analytic_heads.md")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    rows = []
    for text in args.partitions:
        data = FederatedDataModule(dataset=args.dataset, input_size=args.input_size, batch_size=8192,
                                   **parse_partition(text))
        data.setup()
        classes = data.num_classes

        afl = AFL(gamma=1.0, gamma_out=1.0)
        accuracy, metrics = fit(afl, data)
        rows.append((text, "AFL", accuracy, afl.round, metrics["comm/bytes_up_per_client"],
                     metrics["time/fit_s"]))
        print(f"{text:>16}  AFL  {accuracy:.4f}", flush=True)

        if args.deepafl_on is None or text in args.deepafl_on:
            deepafl, clock = DeepAFL(num_layers=max(args.depths), hidden_dim=args.hidden,
                                     block_dim=args.hidden), RoundClock()
            fit_clocked(deepafl, data, clock)
            for depth in sorted(args.depths):
                # uploads are identical for every client, so per-client bytes are analytic
                rows.append((text, f"DeepAFL T={depth}", deepafl.depth_accuracy[depth], 2 * depth + 1,
                             deepafl_bytes_per_client(args.hidden, args.hidden, classes, depth),
                             clock.ends[2 * depth]))
                print(f"{text:>16}  DeepAFL T={depth}  {deepafl.depth_accuracy[depth]:.4f}", flush=True)

        for index in args.safle:
            bucketing, levels, experts, group = SAFLE_SETTINGS[index]
            safle = SAFLe(bucketing=bucketing, levels=levels, experts=experts, group_size=group,
                          gamma=1.0, gamma_out=1.0)
            accuracy, metrics = fit(safle, data)
            name = f"SAFLe {bucketing} L={levels} E={experts} G={group} (E·V={safle.embedding_rows})"
            rows.append((text, name, accuracy, safle.round, metrics["comm/bytes_up_per_client"],
                         metrics["time/fit_s"]))
            print(f"{text:>16}  {name}  {accuracy:.4f}", flush=True)

        write_report(report_lines(rows, args), args.out)  # after every partition: a long run keeps what it did


def report_lines(rows: list[tuple], args: argparse.Namespace) -> list[str]:
    """The Markdown tables of the rows (partition, method, accuracy, rounds, bytes/client, fit s)."""
    methods = list(dict.fromkeys(r[1] for r in rows))
    partitions = list(dict.fromkeys(r[0] for r in rows))
    by_key = {(r[0], r[1]): r for r in rows}
    first = {m: next(r for r in rows if r[1] == m) for m in methods}
    lines = [
        f"Dataset {args.dataset}, efficientnet_lite0 at {args.input_size} px; DeepAFL h = f = {args.hidden}; "
        "γ = 1 (and γ_out = 1 for AFL/SAFLe).",
        machine_line("one fit each"),
        "",
        "Test accuracy (%) per partition (partition = scheme:K):",
        "",
        "| method | rounds | upload / client (MB) | " + " | ".join(partitions) + " | max − min |",
        "|---|---|---|" + "---|" * len(partitions) + "---|",
    ]
    for m in methods:
        accs = [by_key[(p, m)][2] for p in partitions if (p, m) in by_key]
        lines.append(f"| {m} | {first[m][3]} | {first[m][4] / 1e6:.1f} | "
                     + " | ".join(f"{100 * by_key[(p, m)][2]:.2f}" if (p, m) in by_key else "–" for p in partitions)
                     + f" | {100 * (max(accs) - min(accs)):.2f} |")
    lines += ["", "Fit time (s; DeepAFL: cumulative at that depth):", "",
              "| method | " + " | ".join(partitions) + " |", "|---|" + "---|" * len(partitions)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(f"{by_key[(p, m)][5]:.1f}" if (p, m) in by_key else "–"
                                               for p in partitions) + " |")
    if args.deepafl_on is not None:
        lines += ["", f"DeepAFL ran on {', '.join(args.deepafl_on)} only (`--deepafl_on`): its model is "
                  "the same for every partition (tested to 1e-8), so the other cells are not rerun (–)."]
    return lines


if __name__ == "__main__":
    main()
