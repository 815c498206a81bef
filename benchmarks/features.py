"""Last-layer vs multi-depth frozen features: does a one-round head on better features beat
many rounds of deep analytic layers on worse ones?

EfficientNet-Lite0 at 64 px (packaged ImageNet weights). Last layer: its 1280-d pooled vector
(the cache every other benchmark uses). Multi-depth: `data.feature_layers: [all_stages]`, the
global-average-pooled outputs of its seven block stages (16 + 24 + 40 + 80 + 112 + 192 + 320)
before the same 1280-d vector: d = 2064, from one forward pass.

1. Choice on validation, never on the test set: 10% of the training set (stratified, seed 0) is
   held out; closed-form ridge on the other 90% (what AFL computes, exactly) is scored on it for
   each feature set × {raw, standardized} × γ. The best (feature set, standardization, γ) per
   feature set is what the methods then use.
2. The methods on the whole training set, K = 100 clients, Dirichlet α = 0.1 (mnist5k: K = 10,
   α = 0.5; partition seed 0),
   scored on the test set: AFL (the chosen γ), GH-OFL's LDA head and FedCGS (one fit, shrinkage
   0.05), DeepAFL T = 5 and T = 20 (suite settings: h = f = 1024, gelu, γ = 1, γ_s = 0.05),
   SAFLe (suite setting). Bytes per client include the standardization's pre-round
   (8 · (2d + 1) up, 8 · 2d down) where it is on.
3. `--speed`: multi-depth extraction speed relative to a bare forward (same batches, one
   process, alternating passes, medians).

    python benchmarks/features.py --speed
    python benchmarks/features.py --dataset mnist5k
    python benchmarks/features.py --dataset fashion_mnist --methods AFL GH-OFL DeepAFL-5 DeepAFL-20
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import load_average, machine_line, write_report
from benchmarks.suite import percent
from benchmarks.suite import run as run_method
from workbench.data import FederatedDataModule
from workbench.data.features import client_sums, standardization
from workbench.methods import AFL, GHOFL, DeepAFL, SAFLe

DATA = {"backbone": "efficientnet_lite0", "input_size": 64, "partition": "dirichlet", "seed": 0, "batch_size": 20000}
# Fashion-MNIST: the suite's clients; mnist5k (4k train rows) cannot give 100 clients 10 samples each at α = 0.1.
CLIENTS = {"fashion_mnist": {"num_clients": 100, "alpha": 0.1}, "mnist5k": {"num_clients": 10, "alpha": 0.5}}
# name -> (feature_layers, the standardization choices the validation may pick from). The raw
# multi-depth set is the one-round variant: standardization is a pre-round of its own.
FEATURE_SETS = {"last layer": (None, (False, True)), "multi-depth": (["all_stages"], (False, True)),
                "multi-depth raw": (["all_stages"], (False,))}
GAMMAS = [0.01, 0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0]
VAL_FRACTION = 0.1


def deepafl(t: int) -> DeepAFL:
    return DeepAFL(num_layers=t, hidden_dim=1024, block_dim=1024, activation="gelu", gamma=1.0, gamma_s=0.05, seed=0)


# name -> (setting, factory(chosen γ) -> a fresh method)
METHODS = {
    "AFL": ("γ = 1, γ_out = {gamma:g} (the validation choice)", lambda g: AFL(gamma=1.0, gamma_out=g)),
    "GH-OFL": ("heads lda + fedcgs, shrinkage 0.05", lambda g: GHOFL(heads=["lda", "fedcgs"], primary_head="lda",
                                                                     shrinkage=0.05, sketch_dim=None)),
    "DeepAFL-5": ("T = 5, h = f = 1024, gelu, γ = 1, γ_s = 0.05", lambda g: deepafl(5)),
    "DeepAFL-20": ("T = 20, h = f = 1024, gelu, γ = 1, γ_s = 0.05", lambda g: deepafl(20)),
    "SAFLe": ("binary_overlap L = 1, E = 320, G = 4, raw x, γ = γ_out = 1",
              lambda g: SAFLe(bucketing="binary_overlap", levels=1, thresholds="fixed", experts=320, group_size=4,
                              raw_features=True, gamma=1.0, gamma_out=1.0)),
}


def ridge_val_accuracies(dm: FederatedDataModule, gammas: list[float]) -> dict[float, float]:
    """Validation accuracy of centralized ridge (= AFL) on the training rows, per γ: one
    eigendecomposition of the Gram serves every γ."""
    x, y = dm.train_features.double(), dm.train_labels
    targets = torch.nn.functional.one_hot(y, dm.num_classes).double()
    eigenvalues, q = torch.linalg.eigh(x.T @ x)
    projected = q.T @ (x.T @ targets)
    val = dm.val_features.double() @ q
    return {g: float(((val @ (projected / (eigenvalues + g)[:, None])).argmax(1) == dm.val_labels)
                     .double().mean()) for g in gammas}


def choose(dataset: str, names: list[str]) -> tuple[dict, list[str]]:
    """Per feature set: (standardize, γ) with the best validation accuracy; and the table lines."""
    lines = ["| features | d | standardized | " + " | ".join(f"γ = {g:g}" for g in GAMMAS) + " |",
             "|---|---|---|" + "---|" * len(GAMMAS)]
    chosen = {}
    for name in names:
        layers, standardize_choices = FEATURE_SETS[name]
        dm = FederatedDataModule(dataset=dataset, feature_layers=layers, val_fraction=VAL_FRACTION,
                                 **DATA, **CLIENTS[dataset])
        dm.setup()
        best = None
        for standardize in standardize_choices:
            if standardize:  # the federated statistics of the 90% the methods would train on
                mean, std = standardization(*client_sums(dm.train_features, dm.train_client_ids, dm.num_clients))
                for split in ("train_features", "val_features"):
                    setattr(dm, split, ((getattr(dm, split).double() - mean) / std).float())
            accs = ridge_val_accuracies(dm, GAMMAS)
            lines.append(f"| {name} | {dm.feature_dim} | {'yes' if standardize else 'no'} | "
                         + " | ".join(percent(a) for a in accs.values()) + " |")
            for g, a in accs.items():  # ties: the first (smaller γ, raw before standardized)
                if best is None or a > best[0]:
                    best = (a, standardize, g)
        chosen[name] = {"standardize": best[1], "gamma": best[2], "val_acc": best[0]}
        print(f"{dataset} {name}: chose standardize={best[1]} γ={best[2]:g} (val {percent(best[0])})", flush=True)
    return chosen, lines


def speed(num_images: int, repeats: int) -> list[str]:
    """Bare forward vs multi-depth forward on the same batches, alternating, medians."""
    from workbench.backbones import build_backbone
    from workbench.backbones.layers import with_layers
    from workbench.data.features import extract_features
    from workbench.data.registry import load_dataset

    images = load_dataset("fashion_mnist").train.images[:num_images]
    bare = build_backbone("efficientnet_lite0", input_size=64)
    multi = with_layers(build_backbone("efficientnet_lite0", input_size=64), ["all_stages"])
    times = {"bare": [], "multi": []}
    for _ in range(repeats):
        for name, backbone in (("bare", bare), ("multi", multi)):
            start = time.perf_counter()
            extract_features(backbone, images, batch_size=256, desc=name)
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    return [(f"Extraction speed, {num_images} Fashion-MNIST images at 64 px, batches of 256, {repeats} alternating "
            f"passes each: bare forward {num_images / med['bare']:.0f} images/s, multi-depth (all_stages, "
            f"d = {multi.feature_dim}) {num_images / med['multi']:.0f} images/s (medians): multi-depth runs at "
            f"{med['bare'] / med['multi']:.3f}× the bare speed (per-pass seconds bare "
            f"{', '.join(f'{t:.2f}' for t in times['bare'])}; multi {', '.join(f'{t:.2f}' for t in times['multi'])}).")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion_mnist", choices=["fashion_mnist", "mnist5k"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--feature-sets", nargs="+", default=["last layer", "multi-depth"], choices=list(FEATURE_SETS))
    parser.add_argument("--speed", action="store_true", help="only the extraction-speed ratio")
    parser.add_argument("--speed-images", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    for notice in (".*configure_optimizers.* returned `None`", ".*does not have many workers", ".*LeafSpec.*",
                   ".*Total length of .* across ranks is zero", ".*GPU available.*", ".*TPU available.*"):
        warnings.filterwarnings("ignore", message=notice)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    load_start, start = load_average(), time.perf_counter()
    if args.speed:
        lines = speed(args.speed_images, args.repeats)
        write_report([*lines, "", machine_line("one process", load_start)],
                     args.out or "benchmarks/results/features_speed.md")
        return

    out = args.out or f"benchmarks/results/features_{args.dataset}.md"
    chosen, choice_lines = choose(args.dataset, args.feature_sets)
    header = [f"## {args.dataset}: last-layer vs multi-depth EfficientNet-Lite0 features", "",
              (f"Validation choice ({int(VAL_FRACTION * 100)}% of the training set held out, stratified, seed 0; "
               "closed-form ridge = AFL on the other 90%; accuracy % on the hold-out):"), "", *choice_lines, "",
              "Chosen: " + "; ".join(f"{name}: {'standardized' if c['standardize'] else 'raw'}, γ = {c['gamma']:g}"
                                     for name, c in chosen.items()) + ".", "",
              (f"Test set, K = {CLIENTS[args.dataset]['num_clients']}, Dirichlet α = "
               f"{CLIENTS[args.dataset]['alpha']}, whole training set (MB = 10⁶ bytes per client, the "
               "standardization pre-round included; fit s = `time/fit_s`):"), "",
              "| method | features | d | accuracy % | rounds | MB up / client | MB down / client | fit s | setting |",
              "|---|---|---|---|---|---|---|---|---|"]
    rows: list[str] = []
    modules: dict[str, FederatedDataModule] = {}
    for method_name in args.methods:
        for feature_name in args.feature_sets:
            choice = chosen[feature_name]
            if feature_name not in modules:
                modules[feature_name] = FederatedDataModule(dataset=args.dataset,
                                                            feature_layers=FEATURE_SETS[feature_name][0],
                                                            standardize=choice["standardize"], **DATA,
                                                            **CLIENTS[args.dataset])
                modules[feature_name].setup()
            dm = modules[feature_name]
            extra = getattr(dm, "standardization_bytes", {"up_per_client": 0, "down_per_client": 0})
            setting, factory = METHODS[method_name]
            setting = setting.format(gamma=choice["gamma"])
            for row in run_method(method_name, "global", setting, factory(choice["gamma"]), dm):
                up, down = row["up"] + extra["up_per_client"], row["down"] + extra["down_per_client"]
                rounds = row["rounds"] + (1 if choice["standardize"] else 0)
                rows.append(f"| {row['method']} | {feature_name}{' (std)' if choice['standardize'] else ''} | "
                            f"{dm.feature_dim} | {percent(row['acc'])} | {rounds} | {up / 1e6:.3f} | "
                            f"{down / 1e6:.3f} | {row['fit_s']:.1f} | {row['setting']} |")
                print(rows[-1], f"({time.perf_counter() - start:.0f} s so far)", flush=True)
            how = f"one fit each; {time.perf_counter() - start:.0f} s so far"
            write_report(header + rows + ["", "Rounds count the standardization pre-round where it is on.", "",
                                          machine_line(how, load_start)], out)


if __name__ == "__main__":
    main()
