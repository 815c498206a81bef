"""The workbench on a GPU: each measure beside the device's own bare throughput for the same work.

Needs no network and no dataset: images are random uint8 (32 × 32 RGB, CIFAR-sized, resized by the
workbench's preprocessing), features are Gaussian class blobs (`dataset: synthetic`), the
EfficientNet-Lite0 weights ship in a package and ResNet-18 is a random init (timm, no download).

1. Extraction images/s, `workbench.data.features.extract_features` (channels_last, float32 and
   bf16 autocast) for EfficientNet-Lite0 at 64 and 224 px and ResNet-18 at 224 px; bare: the
   model's forward alone on batches already preprocessed and on the device, same layout and
   precision. Ratio = ours / bare images/s (≤ 1; the gap is preprocessing and copies).
2. AFL, K = 1000 Dirichlet(0.5) clients, n × d = 60000 × 1280; bare: one float64 XᵀX and one
   Cholesky solve on the device. Ratio = the engine's fit time / bare (≥ 1).
3. DeepAFL, T = 20, h = f = 1024 (float64, fused schedule); bare: T × the four n·h·f products of
   a layer (as benchmarks/deepafl_speed.py). Ratio = fit time / bare.
4. FedAvg, K = 1000 clients, all in every round, MLP head (hidden 256), one local epoch, B = 64;
   bare: one epoch's forward and backward GEMMs of the same rows as batched products, each batch
   with weights of its own (what the clients' vmapped steps compute). Ratio = round time / bare.

"fit" times are the engine's `time/fit_s` (rounds and server solves); the fit call with
Lightning's setup is shown beside it. Bare times are medians over `--repeats`, synchronized. "host
syncs / round": the synchronizing CUDA calls of one more fit (torch's sync debug mode), per round.

    python benchmarks/gpu.py                          # on the GPU (cuda), writes results/gpu.md
    python benchmarks/gpu.py --device cpu --smoke     # every part at tiny sizes (a check, seconds)
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

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fit_engine, load_average, machine_line, write_report
from workbench.backbones import build_backbone
from workbench.data import FederatedDataModule
from workbench.data.datamodule import SyntheticBlobs
from workbench.data.features import autocast, extract_features, preprocess
from workbench.federation.local_training import LocalTraining
from workbench.linalg import class_sums
from workbench.methods import AFL, DeepAFL, FedAvg

FULL = {"images": 4096, "batch": 256,
        "backbones": (("efficientnet_lite0", 64, True), ("efficientnet_lite0", 224, True), ("resnet18", 224, False)),
        "clients": 1000, "train": 60000, "dim": 1280, "layers": 20, "hidden": 1024, "fedavg_rounds": 5,
        "mlp_hidden": 256}
SMOKE = {"images": 8, "batch": 4,
         "backbones": (("efficientnet_lite0", 32, True), ("efficientnet_lite0", 64, True), ("resnet18", 64, False)),
         "clients": 20, "train": 2000, "dim": 64, "layers": 2, "hidden": 32, "fedavg_rounds": 2, "mlp_hidden": 16}


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: str, repeats: int) -> float:
    """Median wall time of `fn()` with the device's queue drained before and after."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def native_bf16(device: str) -> bool:
    """Whether bf16 runs natively on `device`: CUDA, or a CPU with AVX512-BF16 or AMX instructions
    (elsewhere the CPU emulates it: 23.9 s per 32-px image was measured on a 2-core AMD EPYC)."""
    if torch.device(device).type != "cpu":
        return True
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def extraction_rows(cfg: dict, device: str, repeats: int,
                    precisions: tuple[str, ...] = ("float32", "bf16")) -> list[str]:
    images = torch.randint(0, 256, (cfg["images"], 32, 32, 3), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    rows = []
    for name, size, pretrained in cfg["backbones"]:
        backbone = build_backbone(name, pretrained=pretrained, input_size=size)
        for precision in precisions:
            ours_s, bare_s = extraction_seconds(backbone, images, cfg["batch"], precision, device, repeats)
            n = len(images)
            rows.append(f"| {name}{'' if pretrained else ' (random init)'} | {size} | {precision} | "
                        f"{n / ours_s:.0f} | {n / bare_s:.0f} | {bare_s / ours_s:.2f} |")
            print(rows[-1], flush=True)
    return rows


def extraction_seconds(backbone, images: torch.Tensor, batch_size: int, precision: str, device: str,
                       repeats: int) -> tuple[float, float]:
    """-> (extract_features' seconds, the bare forward's seconds) over `images`."""
    model = backbone.model.to(device, memory_format=torch.channels_last).eval()
    ready = [preprocess(images[lo:lo + batch_size], backbone.input_size, backbone.mean, backbone.std)
             .to(device, memory_format=torch.channels_last) for lo in range(0, len(images), batch_size)]

    @torch.inference_mode()
    def bare():
        with autocast(precision, device):
            for batch in ready:
                model(batch)

    def ours():
        extract_features(backbone, images, batch_size, device, desc=backbone.name, precision=precision)

    bare()  # warm-up: kernels chosen, memory allocated
    return median_seconds(ours, device, repeats), median_seconds(bare, device, repeats)


def blobs(cfg: dict, num_clients: int) -> FederatedDataModule:
    dm = FederatedDataModule(dataset="synthetic", num_clients=num_clients, partition="dirichlet", alpha=0.5,
                             min_partition_size=1, batch_size=8192,
                             synthetic=SyntheticBlobs(dim=cfg["dim"], train_size=cfg["train"], test_size=1000))
    dm.setup()
    return dm


def fit(method, dm: FederatedDataModule, device: str) -> tuple[float, float]:
    """-> (the engine's fit seconds, the whole fit call's seconds) on `device`."""
    accelerator = "gpu" if torch.device(device).type == "cuda" else torch.device(device).type
    synchronize(device)
    start = time.perf_counter()
    engine, _ = fit_engine(method, dm, test=False, accelerator=accelerator, devices=1)
    synchronize(device)
    return engine.fit_metrics["time/fit_s"], time.perf_counter() - start


def syncs_per_round(build, dm: FederatedDataModule, device: str) -> str:
    """Calls that made the host wait for the GPU in one more fit (setup, rounds, the final broadcast,
    Lightning's own calls included), as torch's sync debug mode reports them, per round; "—" off
    CUDA (tests/engines/test_device.py counts them per round on a recording stand-in device)."""
    if torch.device(device).type != "cuda":
        return "—"
    method = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fit(method, dm, device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(warning.message) for warning in caught)
    return f"{syncs / max(method.num_rounds, 1):.0f}"


def afl_row(cfg: dict, device: str, repeats: int) -> str:
    dm = blobs(cfg, cfg["clients"])
    x = dm.train_features.to(device, torch.float64)
    y = dm.train_labels.to(device)

    def bare():
        gram = x.T @ x
        gram.diagonal().add_(1.0)
        torch.cholesky_solve(class_sums(x, y, dm.num_classes), torch.linalg.cholesky(gram))

    bare()
    fit(AFL(gamma=1.0, gamma_out=1.0), dm, device)  # warm-up (CUDA context, kernels)
    runs = [fit(AFL(gamma=1.0, gamma_out=1.0), dm, device) for _ in range(repeats)]
    fit_s, whole_s = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    bare_s = median_seconds(bare, device, repeats)
    syncs = syncs_per_round(lambda: AFL(gamma=1.0, gamma_out=1.0), dm, device)
    return (f"| AFL, K = {cfg['clients']}, n × d = {len(x)} × {x.shape[1]} | {fit_s:.3f} | {whole_s:.2f} | "
            f"{bare_s:.4f} (XᵀX + Cholesky, float64) | {fit_s / bare_s:.1f} | {syncs} |")


def deepafl_row(cfg: dict, device: str, repeats: int) -> str:
    dm = blobs(cfg, 10)
    n, h, layers = len(dm.train_labels), cfg["hidden"], cfg["layers"]
    gen = torch.Generator().manual_seed(0)
    phi = torch.randn(n, h, generator=gen, dtype=torch.float64).to(device)
    weight = (torch.randn(h, h, generator=gen, dtype=torch.float64) / h ** 0.5).to(device)
    omega = (torch.randn(h, h, generator=gen, dtype=torch.float64) / h ** 0.5).to(device)

    def bare():  # one layer's four n·h·f products
        hidden = phi @ weight
        _ = phi + hidden @ omega
        _ = hidden.T @ hidden
        _ = phi.T @ hidden

    bare()
    bare_s = median_seconds(bare, device, repeats) * layers
    fit_s, whole_s = fit(DeepAFL(num_layers=layers, hidden_dim=h, block_dim=h), dm, device)
    syncs = syncs_per_round(lambda: DeepAFL(num_layers=layers, hidden_dim=h, block_dim=h), dm, device)
    return (f"| DeepAFL fused, T = {layers}, h = f = {h}, n = {n} | {fit_s:.3f} | {whole_s:.2f} | "
            f"{bare_s:.4f} (T × 4 n·h·f products, float64) | {fit_s / bare_s:.1f} | {syncs} |")


def fedavg_row(cfg: dict, device: str, repeats: int) -> str:
    dm = blobs(cfg, cfg["clients"])
    n, d, c, hidden, batch = len(dm.train_labels), cfg["dim"], dm.num_classes, cfg["mlp_hidden"], 64
    chunks = -(-n // batch)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(chunks, batch, d, generator=gen).to(device)
    w1 = (torch.randn(chunks, d, hidden, generator=gen) / d ** 0.5).to(device)
    w2 = (torch.randn(chunks, hidden, c, generator=gen) / hidden ** 0.5).to(device)
    target = torch.randn(chunks, batch, c, generator=gen).to(device)

    def bare():  # one epoch: forward, backward to both weights, SGD step; every batch its own weights
        a = torch.relu(x @ w1)
        grad_out = (a @ w2) - target
        grad_w2 = a.mT @ grad_out
        grad_w1 = x.mT @ ((grad_out @ w2.mT) * (a > 0))
        w1.sub_(grad_w1, alpha=1e-3)
        w2.sub_(grad_w2, alpha=1e-3)

    bare()
    bare_s = median_seconds(bare, device, repeats)
    rounds = cfg["fedavg_rounds"]
    def build() -> FedAvg:
        return FedAvg(num_rounds=rounds, hidden_dim=hidden, local=LocalTraining(batch_size=batch))

    fit_s, whole_s = fit(build(), dm, device)
    syncs = syncs_per_round(build, dm, device)
    return (f"| FedAvg, K = {cfg['clients']}, MLP {d}-{hidden}-{c}, 1 epoch, B = {batch}, per round "
            f"({rounds} rounds) | {fit_s / rounds:.3f} | {whole_s:.2f} | {bare_s:.4f} (one epoch's "
            f"batched GEMMs, float32) | {fit_s / rounds / bare_s:.1f} | {syncs} |")


def main(argv: list[str] | None = None) -> list[str]:
    """Runs the parts asked for; returns the report's lines."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda, cuda:1, cpu, …")
    parser.add_argument("--smoke", action="store_true", help="every part at tiny sizes (a check that it runs)")
    parser.add_argument("--parts", default="extraction,afl,deepafl,fedavg")
    parser.add_argument("--repeats", type=int, default=None, help="median over this many (default 5; smoke 1)")
    parser.add_argument("--out", default=None, help="default benchmarks/results/gpu.md (smoke: printed only)")
    args = parser.parse_args(argv)
    device = args.device
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: torch {torch.__version__} sees no CUDA device "
                     "(pass --device cpu, with --smoke for a quick check)")
    cfg, repeats = (SMOKE, args.repeats or 1) if args.smoke else (FULL, args.repeats or 5)
    parts = set(args.parts.split(","))
    unknown = parts - {"extraction", "afl", "deepafl", "fedavg"}
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from extraction,afl,deepafl,fedavg")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # one Trainer per fit: no banners
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products stay float32, as on the CPU
    load_at_start = load_average()
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "CPU"
    lines = [f"# The workbench on {name}" + (" (smoke sizes)" if args.smoke else ""), ""]
    if "extraction" in parts:
        # the smoke checks that every part runs: emulated bf16 would make it minutes, not seconds
        emulated = args.smoke and not native_bf16(device)
        precisions = ("float32",) if emulated else ("float32", "bf16")
        lines += [(f"Extraction of {cfg['images']} random 32 × 32 RGB uint8 images, batch {cfg['batch']}, "
                   "channels_last; bare = the forward alone on preprocessed batches already on the device."
                   + (" bf16 left out: this CPU has no AVX512-BF16 or AMX (bf16 is emulated)." if emulated else "")),
                  "", "| backbone | px | precision | ours img/s | bare img/s | ours / bare |",
                  "|---|---|---|---|---|---|", *extraction_rows(cfg, device, repeats, precisions), ""]
    methods = [(part, row) for part, row in (("afl", afl_row), ("deepafl", deepafl_row), ("fedavg", fedavg_row))
               if part in parts]
    if methods:
        lines += ["Methods on Gaussian blobs in feature space (`dataset: synthetic`), Dirichlet(0.5) clients.", "",
                  "| run | fit s | whole fit call s | bare s | fit / bare | host syncs / round |",
                  "|---|---|---|---|---|---|"]
        for _, row in methods:
            lines.append(row(cfg, device, repeats))
            print(lines[-1], flush=True)
        lines.append("")
    gpu = (f"{name}, torch CUDA {torch.version.cuda}" if torch.device(device).type == "cuda" else "on the CPU")
    lines.append(machine_line(f"device {device} ({gpu}); medians of {repeats}", load_at_start))
    if args.smoke and not args.out:
        print("\n".join(lines))
    else:
        write_report(lines, args.out or Path(__file__).resolve().parent / "results" / "gpu.md")
    return lines


if __name__ == "__main__":
    main()
