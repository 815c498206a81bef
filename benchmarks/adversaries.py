"""Accuracy against the share of adversarial clients: the analytic methods, which sum every
client's statistics, without and with the screen (`federation.aggregation: screen`), beside
FedAvg with its mean and with robust aggregation.

mnist5k through EfficientNet-Lite0 at 64 px (d = 1280), K = 100 clients, Dirichlet α = 0.5,
partition seed 0; every method at the setting the mnist5k leaderboard chose at K = 50, α = 0.5,
seed 0 (the nearest committed setting): AFL γ_out = 10, GH-OFL's LDA head with shrinkage 0.01,
DeepAFL as in the scenario (20 layers, float32), FedAvg's MLP with local lr 0.03 for 30 rounds.
The adversaries (`federation.adversary_fraction`, drawn from seed 0) flip their labels, flip the
sign of everything they send, or send it times −10 or times 10; the fraction 1 % of 100 clients
is one client. The screen's threshold is its default τ = 4, fixed before any attack was run (from
the honest clients' spread: docs/robustness.md); its decisions are tabled beside the accuracies.
A fit that fails (e.g. a solve on a Gram made indefinite) is an outcome, shown as such.

    python benchmarks/adversaries.py                        # about 15 min on 2 cores
    python benchmarks/adversaries.py --smoke --out /tmp/adversaries.md   # synthetic data, a minute
    python benchmarks/adversaries.py --records benchmarks/results/adversaries.json   # the table again
    python benchmarks/adversaries.py --spread      # the honest clients' spread the screen's τ was set from

`--spread` measures, on honest partitions only (no attack, no test split), how far each client's
trace per training row lies from the median client's — over K = 10, 100, 1,000 clients, Dirichlet
α = 0.05, 0.1, 0.5 and iid, partition seeds 0–2 — and adds it to the records and the table.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fit_engine, load_average, machine_line, write_report

ROOT = Path(__file__).resolve().parents[1]
FRACTIONS = (0.0, 0.01, 0.05, 0.1, 0.2)
ATTACKS = {"labels flipped": {"attack": "label_flip"}, "sign flipped": {"attack": "sign_flip"},
           "sign flipped ×10": {"attack": "scale", "attack_scale": -10.0},
           "scaled ×10": {"attack": "scale", "attack_scale": 10.0}}
#: (method, its settings, the federation's aggregation)
AFL = {"gamma": 1.0, "gamma_out": 10.0}
GHOFL = {"heads": ["lda"], "primary_head": "lda", "shrinkage": 0.01}
DEEPAFL = {"num_layers": 20, "hidden_dim": 1024, "block_dim": 1024, "activation": "gelu", "gamma": 1.0,
           "gamma_s": 0.05, "dtype": "float32"}
ROWS = {
    "AFL": ("AFL", AFL, "mean"),
    "AFL (screen)": ("AFL", AFL, "screen"),
    "GH-OFL (LDA)": ("GHOFL", GHOFL, "mean"),
    "GH-OFL (LDA, screen)": ("GHOFL", GHOFL, "screen"),
    "DeepAFL": ("DeepAFL", DEEPAFL, "mean"),
    "DeepAFL (screen)": ("DeepAFL", DEEPAFL, "screen"),
    "FedAvg (mean)": ("FedAvg", {}, "mean"),
    "FedAvg (median)": ("FedAvg", {}, "median"),
    "FedAvg (trimmed mean, β = 0.2)": ("FedAvg", {}, "trimmed_mean"),
    "FedAvg (Multi-Krum, f = 0.2 m)": ("FedAvg", {}, "multi_krum"),
}
FEDAVG = {"architecture": "mlp", "hidden_dim": 64, "sample_fraction": 1.0, "num_rounds": 30, "seed": 0}


def build(row: str, smoke: bool):
    from workbench.federation.local_training import LocalTraining
    from workbench.methods import AFL, GHOFL, DeepAFL, FedAvg

    name, settings, _ = ROWS[row]
    if name == "FedAvg":
        rounds = {"num_rounds": 3} if smoke else {}
        return FedAvg(**{**FEDAVG, **rounds}, local=LocalTraining(epochs=1, batch_size=64, lr=0.03))
    if name == "DeepAFL" and smoke:
        settings = {**settings, "num_layers": 2, "hidden_dim": 32, "block_dim": 32}
    return {"AFL": AFL, "GHOFL": GHOFL, "DeepAFL": DeepAFL}[name](**settings)


_DATA: dict[str, Any] = {}


def _start(smoke: bool) -> None:
    import torch

    from workbench.data import FederatedDataModule, SyntheticBlobs

    torch.set_num_threads(1)
    if smoke:
        data = FederatedDataModule(dataset="synthetic", synthetic=SyntheticBlobs(num_classes=4, dim=8), num_clients=20,
                                   partition="dirichlet", alpha=0.5, seed=0)
    else:
        data = FederatedDataModule(dataset="mnist5k", backbone="efficientnet_lite0", input_size=64, num_clients=100,
                                   partition="dirichlet", alpha=0.5, seed=0, batch_size=20000)
    data.setup()
    _DATA.update(data=data, smoke=smoke)


def _fit(job: tuple[str, str, float]) -> dict[str, Any]:
    from workbench.federation import Federation

    row, attack, fraction = job
    federation = Federation(adversary_fraction=fraction, aggregation=ROWS[row][2], aggregation_trim=0.2, seed=0,
                            **ATTACKS[attack])
    start = time.perf_counter()
    record = {"row": row, "attack": attack, "fraction": fraction,
              "adversaries": int(federation.adversaries(_DATA["data"].hparams.num_clients).sum())}
    try:
        engine, tested = fit_engine(build(row, _DATA["smoke"]), _DATA["data"], federation, eval_every=0,
                                    accelerator="cpu", devices=1)
        record.update(accuracy=tested["test/acc"], rounds=int(engine.fit_metrics["comm/rounds"]))
        if federation.screens:  # its decisions over the fit's rounds
            record.update(rejected=engine.fit_metrics["screen/rejected_total"],
                          liars_rejected=engine.fit_metrics.get("attack/adversaries_rejected_total", 0.0))
    except Exception as error:  # an outcome of the attack (e.g. an indefinite Gram), not of the script
        record["failed"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    record["wall_s"] = time.perf_counter() - start
    return record


#: (clients, Dirichlet α or None for iid) the honest spread is measured over, with partition seeds 0–2
SPREAD = [(clients, alpha) for clients in (10, 100, 1000) for alpha in (0.05, 0.1, 0.5, None)]
SPREAD_GAMMAS = (0.0, 1.0, 10.0)  # the features' Gram; AFL's, with γI added per client


def honest_spread() -> list[dict[str, Any]]:
    """Each client's trace per training row over the median client's, on honest mnist5k partitions:
    of the features' Gram (Σ‖x‖² / n: Fed3R's, GH-OFL's second moment) and of AFL's at γ = 1 and
    10 ((Σ‖x‖² + γd) / n, its γI added per client). A setting no Dirichlet draw can give every
    client two rows is left out."""
    import torch

    from workbench.data import FederatedDataModule

    rows = []
    for clients, alpha in SPREAD:
        found = []
        for seed in range(3):
            split = {"partition": "dirichlet", "alpha": alpha} if alpha else {"partition": "iid"}
            data = FederatedDataModule(dataset="mnist5k", backbone="efficientnet_lite0", input_size=64,
                                       num_clients=clients, seed=seed, batch_size=20000, min_partition_size=2, **split)
            try:
                data.setup()
            except ValueError:  # no such partition
                continue
            features, ids = data.train_features.double(), data.train_client_ids
            counts = torch.bincount(ids, minlength=clients).double()
            squares = torch.zeros(clients, dtype=torch.float64).index_add_(0, ids, features.square().sum(1))
            ratios = []
            for gamma in SPREAD_GAMMAS:
                energy = (squares + gamma * features.shape[1]) / counts
                ratios.append(energy / energy.median())
            found.append((int(counts.min()), ratios))
        if found:
            rows.append({"clients": clients, "alpha": alpha, "seeds": len(found),
                         "smallest": min(n for n, _ in found),
                         "ranges": [[min(float(r[i].min()) for _, r in found), max(float(r[i].max()) for _, r in found)]
                                    for i in range(len(SPREAD_GAMMAS))]})
    return rows


def spread_table(spread: list[dict[str, Any]]) -> list[str]:
    lines = ["## The screen's threshold: the honest clients' spread", "",
             "Each client's trace per training row over the round's median client's, on honest partitions "
             "(no attack; partition seeds 0–2, the settings where a Dirichlet draw gives every client two rows). "
             "The screen rejects a client outside [1/τ, τ]; τ = 4 was set from this table:", "",
             "| K | α | seeds | smallest client (rows) | features' Gram | AFL's (γ = 1) | AFL's (γ = 10) |",
             "|---:|---|---:|---:|---|---|---|"]
    for row in spread:
        alpha = "iid" if row["alpha"] is None else f"{row['alpha']:g}"
        ranges = " | ".join(f"{low:.2f} – {high:.2f}" for low, high in row["ranges"])
        lines.append(f"| {row['clients']} | {alpha} | {row['seeds']} | {row['smallest']} | {ranges} |")
    return [*lines, ""]


def report(records: list[dict[str, Any]], wall_s: float, machine: str, smoke: bool,
           spread: list[dict[str, Any]] | None = None) -> list[str]:
    lines = ["# Accuracy against the share of adversarial clients", "",
             f"Generated by `python benchmarks/adversaries.py{' --smoke' if smoke else ''}` in {wall_s / 60:.1f} min. "
             "Test accuracy (%) after the fit, by the share of the 100 clients that lie; *fails*: the fit "
             "stopped with an error (below the table).", ""]
    lines += tables(records, list(ROWS), "##", lambda record: "fails" if "failed" in record
                    else f"{100 * record['accuracy']:.2f}")
    failures = [f"- {r['row']}, {r['attack']}, {100 * r['fraction']:g} %: {r['failed']}"
                for r in records if "failed" in r]
    if failures:
        lines += ["Failed fits:", "", *failures, ""]
    return [*lines, *decisions(records), *(spread_table(spread) if spread else []), machine]


def tables(records: list[dict[str, Any]], rows: list[str], level: str, cell) -> list[str]:
    """A table per attack under a `level` heading: a line per row of `rows`, a column per share of
    adversaries, each cell `cell(its record)`."""
    lines = []
    for attack in ATTACKS:
        lines += [f"{level} {attack}", "", "| method | " + " | ".join(f"{100 * f:g} %" for f in FRACTIONS) + " |",
                  "|---|" + "---:|" * len(FRACTIONS)]
        for row in rows:
            cells = [cell(next(r for r in records if (r["row"], r["attack"], r["fraction"]) == (row, attack, fraction)))
                     for fraction in FRACTIONS]
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def decisions(records: list[dict[str, Any]]) -> list[str]:
    """The screen's decisions: honest clients and adversaries it rejected, over the fit's rounds."""
    def cell(record: dict[str, Any]) -> str:
        if "rejected" not in record:
            return "–"
        honest = record["rejected"] - record["liars_rejected"]
        return f"{honest:g} + {record['liars_rejected']:g} of {record['adversaries'] * record['rounds']}"

    return ["## The screen's decisions", "",
            "Clients rejected over the fit's rounds, as *honest* + *adversaries* (of the adversaries × rounds "
            "taking part: one round for AFL and GH-OFL, 21 for DeepAFL).", "",
            *tables(records, [row for row in ROWS if ROWS[row][2] == "screen"], "###", cell)]


def draw(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(ATTACKS), figsize=(4.6 * len(ATTACKS), 4.4), sharey=True)
    for axis, attack in zip(axes, ATTACKS, strict=True):
        for i, row in enumerate(ROWS):
            points = [(100 * r["fraction"], 100 * r["accuracy"]) for r in records
                      if r["row"] == row and r["attack"] == attack and "failed" not in r]
            points.sort()
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=plt.get_cmap("tab10")(i),
                      linestyle={"mean": "-", "screen": "-."}.get(ROWS[row][2], "--"), label=row)
        axis.set_title(attack)
        axis.set_xlabel("adversarial clients (%)")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    axes[0].set_ylim(0, 100)
    axes[0].legend(fontsize=7, loc="lower left")  # where the label flips leave room
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="synthetic data, tiny fits")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/adversaries.md"))
    parser.add_argument("--figure", default=str(ROOT / "docs/images/adversaries.png"))
    parser.add_argument("--records", help="render the table and the figure from an earlier run's records (the .json "
                                          "beside its table) instead of fitting")
    parser.add_argument("--spread", action="store_true", help="measure the honest clients' spread into the records "
                                                              "beside --out (.json) and render again")
    args = parser.parse_args()
    if args.spread:
        saved_at = Path(args.out).with_suffix(".json")
        saved = json.loads(saved_at.read_text())
        saved["spread"] = honest_spread()
        saved_at.write_text(json.dumps(saved, indent=1) + "\n")
        args.records = str(saved_at)
    if args.records:
        saved = json.loads(Path(args.records).read_text())
        draw(saved["records"], Path(args.figure))
        write_report(report(saved["records"], saved["wall_s"], saved["machine"], args.smoke, saved.get("spread")),
                     args.out)
        return
    start, load_at_start = time.perf_counter(), load_average()
    if not args.smoke:
        _start(False)  # the features extracted once, before the workers read the cache
        _DATA.clear()
    jobs = [(row, attack, fraction) for attack in ATTACKS for row in ROWS for fraction in FRACTIONS]
    records = []
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
                             initargs=(args.smoke,)) as pool:
        for record in pool.map(_fit, jobs):
            records.append(record)
            outcome = record.get("failed") or f"{100 * record['accuracy']:.2f} %"
            print(f"{record['row']:32s} {record['attack']:18s} {100 * record['fraction']:4g} %: {outcome} "
                  f"({record['wall_s']:.1f} s)", flush=True)
    machine = machine_line(f"{args.workers} worker processes of 1 thread each", load_at_start)
    figure = Path(args.figure)
    figure.parent.mkdir(parents=True, exist_ok=True)
    draw(records, figure)
    wall_s = time.perf_counter() - start
    Path(args.out).with_suffix(".json").write_text(json.dumps({"wall_s": wall_s, "machine": machine,
                                                               "records": records}, indent=1) + "\n")
    write_report(report(records, wall_s, machine, args.smoke), args.out)


if __name__ == "__main__":
    main()
