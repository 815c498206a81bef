"""SAFLe on cached backbone features: Gram construction speed and test accuracy beside AFL.

(a) ΦᵀΦ from the E active rows per sample (`multi_hot_gram`, pair counts) / the dense one-hot
    matmul `ΦᵀΦ` (Φ already built, float64), at E·V = 4096 on `--gram_samples` training
    samples; both results are checked equal.                                  goal ≥ 10
(b) test accuracy, upload per client, rounds and fit time of AFL and several SAFLe settings,
    all through the Lightning engine (`fit_engine`) on K = `--clients` iid clients (the
    analytic solution does not depend on the partition).

Times are medians over `--repeats`, at `--threads` torch threads for everything.

    python benchmarks/safle.py                                   # Fashion-MNIST 60k/10k, 64 px
    python benchmarks/safle.py --dataset mnist5k --gram_samples 4000   # quick
"""
from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fit_engine, machine_line, write_report
from workbench.data import FederatedDataModule
from workbench.linalg import multi_hot_gram
from workbench.methods import AFL, SAFLe
from workbench.methods.base import Problem

GRAM_SETTINGS = [dict(experts=64, group_size=6, levels=8), dict(experts=128, group_size=5, levels=8)]
ACCURACY_SETTINGS = [
    ("AFL", dict(gamma=1.0, gamma_out=1.0)),
    ("SAFLe", dict()),  # the defaults: binary_overlap, L=8, G=6, E=64, fixed
    ("SAFLe", dict(thresholds="calibrated")),
    ("SAFLe", dict(experts=128)),
    ("SAFLe", dict(bucketing="onehot")),
    ("SAFLe", dict(bucketing="integer", group_size=2)),  # V = 8² = 64 like the two above
    ("SAFLe", dict(levels=1, group_size=4, experts=320)),  # every bit of the 1280 features once
    ("SAFLe", dict(levels=1, group_size=4, experts=320, thresholds="calibrated")),
    ("SAFLe", dict(levels=1, group_size=4, experts=320, raw_features=True)),
]


def median_time(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def gram_speed(features: torch.Tensor, setting: dict, repeats: int) -> tuple[str, float, float]:
    """-> (setting label, sparse seconds, dense seconds)."""
    method = SAFLe(**setting)
    method.setup(Problem(input_shape=(features.shape[1],), num_classes=1, num_clients=1))
    active = method.expert_indices(features)
    rows = method.embedding_rows
    sparse_s, sparse = median_time(lambda: multi_hot_gram(active, rows), repeats)
    phi = torch.zeros(len(active), rows, dtype=torch.float64).scatter_(1, active, 1.0)
    dense_s, dense = median_time(lambda: phi.T @ phi, repeats)
    if not torch.equal(sparse, dense):
        raise AssertionError("the sparse Gram differs from the dense one")
    label = f"E={method.experts} G={method.group_size} V={method.vocab} (E·V={rows})"
    return label, sparse_s, dense_s


def fit(name: str, setting: dict, datamodule: FederatedDataModule) -> dict[str, float]:
    method = (AFL if name == "AFL" else SAFLe)(**setting)
    engine, tested = fit_engine(method, datamodule)
    fitted = engine.fit_metrics
    return {"acc": tested["test/acc"], "up_mb": fitted["comm/bytes_up_per_client"] / 1e6,
            "rounds": fitted["comm/rounds"], "fit_s": fitted["time/fit_s"],
            "rows": getattr(method, "embedding_rows", 0)}


def describe(name: str, setting: dict) -> str:
    if name == "AFL":
        return "AFL γ=1 γ_out=1"
    full = {key: value.default for key, value in inspect.signature(SAFLe).parameters.items()} | setting
    text = (f"SAFLe {full['bucketing']} L={full['levels']} G={full['group_size']} E={full['experts']} "
            f"{full['thresholds']}")
    return text + (" + raw x" if full["raw_features"] else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--backbone", default="efficientnet_lite0")
    parser.add_argument("--input_size", type=int, default=64)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--gram_samples", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--skip_accuracy", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/safle.md")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    datamodule = FederatedDataModule(dataset=args.dataset, backbone=args.backbone, input_size=args.input_size,
                                     num_clients=args.clients, partition="iid", batch_size=20000)
    datamodule.setup()
    n, d = datamodule.train_features.shape
    features = datamodule.train_features[: args.gram_samples]

    gram_rows = [gram_speed(features, setting, args.repeats) for setting in GRAM_SETTINGS]
    lines = [
        f"Dataset {args.dataset} ({n} train / {len(datamodule.test_labels)} test samples), backbone "
        f"{args.backbone} at {args.input_size} px, d = {d}.",
        machine_line(f"median of {args.repeats} repeats"),
        "",
        f"(a) Gram ΦᵀΦ on {len(features)} samples, float64 (binary_overlap L=8, fixed thresholds):",
        "",
        "| setting | pair counts (s) | dense one-hot matmul (s) | speed-up | goal |",
        "|---|---|---|---|---|",
        *[f"| {label} | {sparse:.3f} | {dense:.3f} | {dense / sparse:.1f}× | ≥ 10× |"
          for label, sparse, dense in gram_rows],
    ]
    if not args.skip_accuracy:
        results = [(describe(name, setting), fit(name, setting, datamodule))
                   for name, setting in ACCURACY_SETTINGS]
        lines += [
            "",
            f"(b) Test accuracy, K = {args.clients} iid clients, γ = 1, γ_out = 1 (one fit each):",
            "",
            "| method | E·V | test acc | upload / client (MB) | rounds | fit (s) |",
            "|---|---|---|---|---|---|",
            *[f"| {label} | {r['rows'] or '–'} | {100 * r['acc']:.2f} % | {r['up_mb']:.1f} "
              f"| {r['rounds']:.0f} | {r['fit_s']:.1f} |" for label, r in results],
        ]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
