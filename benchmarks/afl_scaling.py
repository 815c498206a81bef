"""AFL scaling on cached backbone features, every ratio measured in this one process.

(a) AFL fit time / (one XᵀX of the same shape + one Cholesky solve)      goal ≤ 1.5
(b) AFL fit time at K = 1000 clients (`--many_clients`) / at K = 10      goal ≤ 1.5
(c) feature extraction images/s / a bare backbone forward loop on the
    same images, already preprocessed                                      goal ≥ 0.9

Times are medians over `--repeats`. "fit" is the engine's round time (client steps + server
solve, `engine.fit_metrics["time/fit_s"]`); the whole fit call (building the Trainer and
Lightning's loop included, `benchmarks.common.fit_engine` without the test) is reported beside it.

    python benchmarks/afl_scaling.py                       # Fashion-MNIST 60k/10k, 64 px
    python benchmarks/afl_scaling.py --dataset mnist5k --many_clients 100   # quick (4000 samples
        # cannot give 1000 Dirichlet clients a sample each)
    python benchmarks/afl_scaling.py --dataset synthetic --extract_images 0   # 60000 × 1280 Gaussian
        # blobs drawn in feature space (no backbone, no extraction, so no (c)): (a) and (b) at scale
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fit_engine, machine_line, median_time, write_report
from workbench.backbones import build_backbone
from workbench.data import FederatedDataModule
from workbench.data.datamodule import SyntheticBlobs
from workbench.data.datasets import load_dataset
from workbench.data.features import extract_features, preprocess
from workbench.linalg import class_sums
from workbench.methods import AFL


def fit_afl(datamodule: FederatedDataModule) -> tuple[float, float]:
    """-> (engine fit seconds, whole fit-call seconds)."""
    start = time.perf_counter()
    engine, _ = fit_engine(AFL(gamma=1.0, gamma_out=1.0), datamodule, test=False)
    return engine.fit_metrics["time/fit_s"], time.perf_counter() - start


def median_fit(datamodule, repeats: int) -> tuple[float, float]:
    runs = [fit_afl(datamodule) for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def bare_solve(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The reference: float64 XᵀX, one Cholesky, one solve."""
    x = features.double()
    gram = x.T @ x
    gram.diagonal().add_(1.0)
    return torch.cholesky_solve(class_sums(x, labels, num_classes), torch.linalg.cholesky(gram))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--backbone", default="efficientnet_lite0")
    parser.add_argument("--input_size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--extract_images", type=int, default=4000, help="images timed in (c); 0 skips (c)")
    parser.add_argument("--synthetic_train", type=int, default=60000,
                        help="train rows of --dataset synthetic")
    parser.add_argument("--synthetic_dim", type=int, default=1280,
                        help="feature width of --dataset synthetic")
    parser.add_argument("--many_clients", type=int, default=1000, help="K of (b), against K = 10")
    parser.add_argument("--out", default="benchmarks/results/afl_scaling.md")
    args = parser.parse_args()
    synthetic = args.dataset == "synthetic"
    if synthetic and args.extract_images:
        parser.error("the synthetic dataset has no images: pass --extract_images 0")
    common = dict(dataset=args.dataset, backbone=args.backbone, input_size=args.input_size, batch_size=8192,
                  synthetic=SyntheticBlobs(dim=args.synthetic_dim, train_size=args.synthetic_train,
                                           test_size=1000))

    # Features come from the cache (extracted on the first run).
    data = {k: FederatedDataModule(num_clients=k, partition="dirichlet", alpha=0.5, min_partition_size=1, **common)
            for k in (10, args.many_clients)}
    for dm in data.values():
        dm.setup()
    x, y = data[10].train_features, data[10].train_labels
    n, d = x.shape

    reference = median_time(lambda: bare_solve(x, y, data[10].num_classes), args.repeats)
    fit_10, trainer_10 = median_fit(data[10], args.repeats)
    fit_many, trainer_many = median_fit(data[args.many_clients], args.repeats)
    many = args.many_clients

    rows = [
        ("(a) AFL fit / (XᵀX + Cholesky)", f"{fit_10:.3f} s / {reference:.3f} s", fit_10 / reference, "≤ 1.5"),
        ("(a') whole Trainer.fit / (XᵀX + Cholesky)", f"{trainer_10:.3f} s / {reference:.3f} s",
         trainer_10 / reference, "(info)"),
        (f"(b) AFL fit K={many} / K=10", f"{fit_many:.3f} s / {fit_10:.3f} s", fit_many / fit_10, "≤ 1.5"),
        (f"(b') whole Trainer.fit K={many} / K=10", f"{trainer_many:.3f} s / {trainer_10:.3f} s",
         trainer_many / trainer_10, "(info)"),
    ]
    if args.extract_images:
        rows.append(extraction_row(args))
    source = ("synthetic Gaussian blobs drawn in feature space, no backbone" if synthetic
              else f"backbone {args.backbone} at {args.input_size} px")
    lines = [
        f"Dataset {args.dataset} ({n} train samples), {source}, d = {d}; "
        + (f"extraction timed on {args.extract_images} images." if args.extract_images
           else "extraction not timed."),
        machine_line(f"median of {args.repeats} repeats"),
        "",
        "| measure | times | ratio | goal |",
        "|---|---|---|---|",
        *[f"| {name} | {times} | {ratio:.2f} | {goal} |" for name, times, ratio, goal in rows],
    ]
    write_report(lines, args.out)


def extraction_row(args: argparse.Namespace) -> tuple[str, str, float, str]:
    """(c): `extract_features` against a bare forward loop on the same preprocessed images."""
    raw = load_dataset(args.dataset).train.images[: args.extract_images]
    backbone = build_backbone(args.backbone, input_size=args.input_size)
    backbone.model.to(memory_format=torch.channels_last)
    ready = preprocess(raw, backbone.input_size, backbone.mean, backbone.std)
    ready = ready.contiguous(memory_format=torch.channels_last)  # the layout extraction uses

    @torch.inference_mode()
    def bare_forward():
        for lo in range(0, len(ready), 256):
            backbone.model(ready[lo:lo + 256])

    bare_forward()  # warm-up
    ours_s = median_time(lambda: extract_features(backbone, raw, batch_size=256), args.repeats)
    bare_s = median_time(bare_forward, args.repeats)
    return ("(c) extraction img/s / bare forward img/s",
            f"{len(raw) / ours_s:.0f} / {len(raw) / bare_s:.0f}", bare_s / ours_s, "≥ 0.9")


if __name__ == "__main__":
    main()
