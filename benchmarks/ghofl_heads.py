"""GH-OFL on cached backbone features: test accuracy and server time of every head.

One fit of `GHOFL` with all six heads (nb_diag, lda, qda, fishermix, proto_hyper, fedcgs),
then one test pass. The server time of a head is its own share of the server step
(`time/server_s/<head>`); the parts the heads share are listed on their own rows: the
Gaussian moments (all heads) and the Fisher subspace + synthesis (fishermix, proto_hyper).

    python benchmarks/ghofl_heads.py                   # Fashion-MNIST, K = 10, Dirichlet α = 0.5
    python benchmarks/ghofl_heads.py --sketch_dim 256  # heads in a 256-d public sketch
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import warnings
from pathlib import Path

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning import Trainer  # noqa: E402

from workbench.data import FederatedDataModule  # noqa: E402
from workbench.methods import GHOFL  # noqa: E402
from workbench.methods.ghofl import HEADS  # noqa: E402


def fit_and_test(datamodule: FederatedDataModule,
                 sketch_dim: int | None) -> tuple[dict[str, float], dict[str, float]]:
    """-> (the method's fit metrics, the test metrics)."""
    method = GHOFL(heads=HEADS, sketch_dim=sketch_dim)
    trainer = Trainer(max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(method, datamodule=datamodule)
    tested = trainer.test(method, datamodule=datamodule, verbose=False)[0]
    return method.fit_metrics, tested


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--backbone", default="efficientnet_lite0")
    parser.add_argument("--input_size", type=int, default=64)
    parser.add_argument("--num_clients", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--sketch_dim", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/ghofl_heads.md")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(configure_optimizers|LeafSpec|Total length).*")

    datamodule = FederatedDataModule(dataset=args.dataset, backbone=args.backbone,
                                     input_size=args.input_size, num_clients=args.num_clients,
                                     partition="dirichlet", alpha=args.alpha, batch_size=8192)
    datamodule.setup()
    runs = [fit_and_test(datamodule, args.sketch_dim) for _ in range(args.repeats)]
    fit, tested = runs[0]

    def seconds(part: str) -> str:
        return f"{statistics.median(r[0][f'time/server_s/{part}'] for r in runs):.3f}"

    rows = [f"| {head} | {tested[f'test/acc/{head}']:.4f} | {seconds(head)} |" for head in HEADS]
    rows += [f"| (shared) Gaussian moments | – | {seconds('moments')} |",
             f"| (shared) Fisher subspace + synthesis | – | {seconds('fisher_synthesis')} |"]
    cpuinfo = Path("/proc/cpuinfo")
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")), None) if cpuinfo.exists() else None
    n, d = datamodule.train_features.shape
    sketch = f", sketched to k = {args.sketch_dim}" if args.sketch_dim else ""
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    setup = (f"GH-OFL heads on {args.dataset} ({n} train samples), {args.backbone} at "
             f"{args.input_size} px, d = {d}{sketch}; K = {args.num_clients} clients, Dirichlet "
             f"α = {args.alpha}; default hyperparameters (shrinkage 0.05, 4000 synthetic samples "
             "per class, FisherMix 60 epochs, Proto-Hyper 20 epochs).")
    machine = (f"Machine: {cpu or platform.processor()}, {os.cpu_count()} cores{load}, torch "
               f"{torch.__version__} with {torch.get_num_threads()} threads; server times are the "
               f"median of {args.repeats} fit(s).")
    cost = (f"Upload per client {fit['comm/bytes_up_per_client'] / 1e6:.3f} MB (qda needs the "
            f"per-class second moments); client time {fit['time/client_s']:.2f} s, server time "
            f"{fit['time/server_s']:.2f} s in all.")
    lines = [
        setup,
        machine,
        cost,
        "",
        "| head | test accuracy | server time (s) |",
        "|---|---|---|",
        *rows,
    ]
    report = "\n".join(lines)
    print(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
