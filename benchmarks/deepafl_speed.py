"""DeepAFL's two schedules on cached backbone features: the clients' time against the bare matrix
products their math needs, fit time, rounds, bytes and test accuracy by depth.

"bare" times, in this process on the same shapes and dtype, exactly the products the clients of a
fit compute, as plain matrix products: round 0's Φ₀ = XA₀ (n·d·h) and Φ₀ᵀΦ₀ (n·h·h), then per
layer t
    fused      F_t = Φ_{t−1}B_t, F_tᵀF_t, Φ_{t−1}ᵀF_t (3·n·h·f at h = f) and the factored advance
               Φ_t = Φ_{t−1} + (F_t L_t)U_tᵀ (2·n·r·h, r = C);
    two_round  F_t = Φ_{t−1}B_t in each of its two rounds, F_tᵀF_t, Φ_tᵀΦ_t (4·n·h·f) and the
               advance; FᵀR's n·(h + f)·C products are left out.
The ratio `clients / bare` is the clients' seconds (`time/client_s`: their whole step, the
activations, the caches and the class sums included) over those products. `two_round` (2T + 1
rounds) recomputes F_t in the W_t round and forms Φ_tᵀΦ_t; `fused` (T + 1 rounds) computes F_t
once and the server forms ΣΦ_tᵀΦ_t from the uploaded M_t = Φ_{t−1}ᵀF_t.

Accuracy by depth comes from one fit of depth T: the model of depth t < T is the model a fit with
T = t gives (each layer's random map has a seed of its own), so `--depths 5,10,20` costs one fit.

    python benchmarks/deepafl_speed.py                                   # T = 20, h = f = 1024, 60k
    python benchmarks/deepafl_speed.py --layers 20 --hidden 256 --train_size 20000   # reduced
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

from benchmarks.common import fit_engine, load_average, machine_line, median_time, write_report
from workbench.data import FederatedDataModule
from workbench.methods import DeepAFL

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def bare_seconds(n: int, features: int, hidden: int, block: int, classes: int, layers: int, schedule: str,
                 dtype: torch.dtype, repeats: int) -> float:
    """Median seconds of the products a fit's clients need (the module's docstring), timed bare:
    round 0's, plus `layers` times one layer's."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=gen, dtype=dtype)
    phi = torch.randn(n, hidden, generator=gen, dtype=dtype)
    input_weight = torch.randn(features, hidden, generator=gen, dtype=dtype) / features ** 0.5
    weight = torch.randn(hidden, block, generator=gen, dtype=dtype) / hidden ** 0.5
    left = torch.randn(block, classes, generator=gen, dtype=dtype) / block ** 0.5
    right = torch.randn(hidden, classes, generator=gen, dtype=dtype) / classes ** 0.5

    def round_zero() -> None:
        phi_0 = x @ input_weight                                  # Φ₀ = XA₀          n·d·h
        _ = phi_0.T @ phi_0                                       # Φ₀ᵀΦ₀             n·h·h

    def layer() -> None:
        hidden_features = phi @ weight                            # F = ΦB            n·h·f
        _ = hidden_features.T @ hidden_features                   # FᵀF               n·f·f
        advanced = torch.addmm(phi, hidden_features @ left, right.T)  # Φ + (FL)Uᵀ   2·n·r·h
        if schedule == "fused":
            _ = phi.T @ hidden_features                           # M = ΦᵀF           n·h·f
        else:
            _ = phi @ weight                                      # F again (W_t round)  n·h·f
            _ = advanced.T @ advanced                             # Φ_tᵀΦ_t           n·h·h

    return median_time(round_zero, repeats) + layers * median_time(layer, repeats)


def subsample(dm: FederatedDataModule, train_size: int, seed: int = 0) -> None:
    """Keep `train_size` random training rows (still ordered by client)."""
    n = len(dm.train_labels)
    if train_size >= n:
        return
    keep = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:train_size].sort().values
    dm.train_features, dm.train_labels, dm.train_client_ids = (
        dm.train_features[keep], dm.train_labels[keep], dm.train_client_ids[keep])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=20, help="T")
    parser.add_argument("--hidden", type=int, default=1024, help="h = f")
    parser.add_argument("--train_size", type=int, default=60000, help="training rows kept (random subset)")
    parser.add_argument("--dtypes", default="float64,float32")
    parser.add_argument("--schedules", default="two_round,fused")
    parser.add_argument("--depths", default="5,10,20", help="depths whose test accuracy the table shows")
    parser.add_argument("--num_clients", type=int, default=10)
    parser.add_argument("--bare_repeats", type=int, default=3)
    parser.add_argument("--note", default="", help="appended to the machine line (e.g. why a reduced setting)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "deepafl_speed.md"))
    args = parser.parse_args()
    load_at_start = load_average()

    dm = FederatedDataModule(dataset="fashion_mnist", backbone="efficientnet_lite0", input_size=64,
                             num_clients=args.num_clients, partition="iid")
    dm.setup()
    subsample(dm, args.train_size)
    n, d = dm.train_features.shape
    h = f = args.hidden
    depths = [t for t in (int(x) for x in args.depths.split(",")) if t <= args.layers]
    if args.layers not in depths:
        depths.append(args.layers)

    rows, accuracy_rows = [], []
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        for schedule in args.schedules.split(","):
            bare = bare_seconds(n, d, h, f, dm.num_classes, args.layers, schedule, dtype, args.bare_repeats)
            method = DeepAFL(num_layers=args.layers, hidden_dim=h, block_dim=f, dtype=dtype_name, schedule=schedule)
            start = time.perf_counter()
            engine, _ = fit_engine(method, dm, test=False)
            whole = time.perf_counter() - start
            m = engine.fit_metrics
            rows.append(f"| {dtype_name} | {schedule} | {int(m['comm/rounds'])} | {m['time/fit_s']:.1f} | "
                        f"{m['time/client_s']:.1f} | {m['time/server_s']:.1f} | {m['time/curve_s']:.1f} | "
                        f"{whole:.1f} | {bare:.1f} | {m['time/client_s'] / bare:.2f} | {m['time/fit_s'] / bare:.2f} | "
                        f"{m['comm/bytes_up_per_client'] / 2**20:.1f} | "
                        f"{m['comm/bytes_down'] / method.num_clients / 2**20:.1f} |")
            accuracy_rows.append(f"| {dtype_name} | {schedule} | "
                                 + " | ".join(f"{100 * method.depth_accuracy[t]:.2f}" for t in [0, *depths]) + " |")
            print(rows[-1], accuracy_rows[-1], flush=True)

    lines = [
        "# DeepAFL: fused vs two-round schedule",
        "",
        (f"Fashion-MNIST, EfficientNet-Lite0 features at 64 px (d = {d}), n = {n} training rows, "
        f"{args.num_clients} IID clients, T = {args.layers}, h = f = {h}, γ = 1, γ_s = 0.05, gelu; "
        "in process (Lightning engine). `bare` = the products the clients' math needs (round 0's "
        "XA₀ and Φ₀ᵀΦ₀; per layer fused F = ΦB, FᵀF, ΦᵀF and the factored advance, two-round F = ΦB twice, "
        "FᵀF, Φ_tᵀΦ_t and the advance), timed bare in this process on the same shapes and dtype. "
        "`fit` is the engine's `time/fit_s`; `client`, `server` and `curve` (the learning curve: the test "
        "split scored at every depth) its parts; `whole` the fit call with Lightning's setup."),
        "",
        ("| dtype | schedule | rounds | fit s | client s | server s | curve s | whole s | bare s | client / bare | "
         "fit / bare | MiB up / client | MiB down / client |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Test accuracy (%) by depth (one fit of depth T; depth t is the model a T = t fit gives):",
        "",
        "| dtype | schedule | " + " | ".join(f"t = {t}" for t in [0, *depths]) + " |",
        "|---|---|" + "---|" * (len(depths) + 1),
        *accuracy_rows,
        "",
        machine_line(args.note, load_at_start),
    ]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
