"""Backbones on this CPU: float32 against bfloat16 autocast, then analytic heads on email features.

(1) Throughput of the feature extraction (`extract_features` / `extract_text_features`, the code
    the data module runs) for every backbone, in float32 and with `precision="bf16"`, on the same
    inputs in this one process: the two precisions alternate within each repeat, so load on the
    machine hits both alike; times are medians over `--repeats` after one warm-up of each. Beside
    it, how close the bf16 features are to the float32 ones (min cosine similarity, max relative
    L2 error over the inputs).
    - images: the first `--images` mnist5k training digits at `--input_size` px (the demo's 64;
      vit_base_patch16_224.mae only takes 224).
    - texts: the first `--texts` spam_assassin training emails, cut to `--max_length` tokens.
    - efficientnet_lite0 and all_minilm_l6_v2 with their packaged weights; resnet18 and
      vit_base_patch16_224.mae with random weights (their hub weights are not reachable offline;
      speed does not depend on the weights' values); gpt2 is GPT-2 small's architecture (124M)
      with random weights, fed all-MiniLM-L6-v2's WordPiece tokens of the same emails because
      GPT-2's own tokenizer ships with its weights.
(2) AFL, SAFLe and GH-OFL's LDA head on the email task: spam_assassin through all_minilm_l6_v2
    (`--max_length` tokens, the same features as configs/afl_spam.yaml), K clients, Dirichlet α.

    python benchmarks/backbones.py                          # writes benchmarks/results/backbones.md
    python benchmarks/backbones.py --images 2 --texts 2 --repeats 1    # quick look

On a CPU without native bfloat16 the bf16 passes are many times slower than float32, which is
why the defaults time only a few inputs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never wait on the hub
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fit_engine, load_average, machine_line, write_report
from workbench.backbones import build_backbone
from workbench.backbones.base import seeded
from workbench.backbones.text import FrozenTextEncoder, TextBackbone
from workbench.data import FederatedDataModule
from workbench.data.datasets import load_dataset
from workbench.data.features import extract_features, extract_text_features
from workbench.methods import AFL, GHOFL, SAFLe


def bf16_support() -> str:
    """The CPU's vector capability and whether it has native bfloat16 instructions."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    native_bf16 = any(f in flags for f in ("avx512_bf16", "amx_bf16"))
    return (f"{torch.backends.cpu.get_cpu_capability()}, "
            f"{'with' if native_bf16 else 'no'} native bfloat16 instructions")


def gpt2_small_random(tokenizer_source: TextBackbone, max_length: int) -> TextBackbone:
    """GPT-2 small (12 layers, 768 wide) with seeded random weights, on another model's tokens."""
    from transformers import GPT2Config, GPT2Model

    with seeded(0):
        net = GPT2Model(GPT2Config()).eval()
    return TextBackbone(name="gpt2", model=FrozenTextEncoder(net, "mean", normalize=False),
                        tokenizer=tokenizer_source.tokenizer, feature_dim=768, max_length=max_length,
                        pooling="mean", normalize=False, weights_id="random-init:seed=0",
                        tokenizer_id=tokenizer_source.tokenizer_id)


def throughput(backbone, inputs, extract, repeats: int, batch_size: int) -> dict:
    """Median seconds per precision (alternating), and bf16's closeness to float32."""
    times = {"float32": [], "bf16": []}
    features = {}
    for repeat in range(repeats + 1):  # repeat 0 is the warm-up
        for precision in times:
            start = time.perf_counter()
            out = extract(backbone, inputs, batch_size, "cpu", desc=backbone.name, precision=precision)
            if repeat:
                times[precision].append(time.perf_counter() - start)
            features[precision] = out
    f32, bf16 = features["float32"], features["bf16"]
    cosine = torch.nn.functional.cosine_similarity(f32, bf16, dim=1).min().item()
    rel_err = ((bf16 - f32).norm(dim=1) / f32.norm(dim=1).clamp_min(1e-12)).max().item()
    rate = {p: len(inputs) / statistics.median(t) for p, t in times.items()}
    return {"rate": rate, "cosine": cosine, "rel_err": rel_err}


def table_row(name: str, weights: str, dim: int, size: str, unit: str, r: dict) -> str:
    return (f"| {name} | {weights} | {dim} | {size} | {r['rate']['float32']:.3g} {unit} | "
            f"{r['rate']['bf16']:.3g} {unit} | {r['rate']['bf16'] / r['rate']['float32']:.2f} | "
            f"{r['cosine']:.6f} | {r['rel_err']:.3f} |")


def fit_and_test(method, datamodule) -> tuple[float, float, float]:
    """-> (test accuracy, upload bytes per client, engine fit seconds)."""
    engine, tested = fit_engine(method, datamodule)
    fitted = engine.fit_metrics
    return tested["test/acc"], fitted["comm/bytes_up_per_client"], fitted["time/fit_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=4, help="images timed per image backbone")
    parser.add_argument("--texts", type=int, default=4, help="emails timed per text backbone")
    parser.add_argument("--input_size", type=int, default=64, help="image side (not for the ViT)")
    parser.add_argument("--max_length", type=int, default=128, help="tokens per email")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num_clients", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--out", default="benchmarks/results/backbones.md")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    load_start = load_average()
    started = time.perf_counter()

    images = load_dataset("mnist5k").train.images[: args.images]
    emails = load_dataset("spam_assassin").train.texts[: args.texts]
    minilm = build_backbone("all_minilm_l6_v2", max_length=args.max_length)
    candidates = [
        ("efficientnet_lite0", "packaged ImageNet",
         lambda: build_backbone("efficientnet_lite0", input_size=args.input_size)),
        ("resnet18", "random init",
         lambda: build_backbone("resnet18", pretrained=False, input_size=args.input_size)),
        ("vit_base_patch16_224.mae", "random init",
         lambda: build_backbone("vit_base_patch16_224.mae", pretrained=False)),
        ("all_minilm_l6_v2", "packaged", lambda: minilm),
        ("gpt2", "random init, GPT-2 small shape", lambda: gpt2_small_random(minilm, args.max_length)),
    ]
    rows = []
    for name, weights, build in candidates:
        backbone = build()
        text = isinstance(backbone, TextBackbone)
        inputs = emails if text else images
        result = throughput(backbone, inputs, extract_text_features if text else extract_features,
                            args.repeats, batch_size=len(inputs))
        size = f"{args.max_length} tokens" if text else f"{backbone.input_size} px"
        rows.append((name, weights, backbone.feature_dim, size, "texts/s" if text else "images/s", result))
        print(rows[-1], flush=True)

    data = FederatedDataModule(dataset="spam_assassin", backbone="all_minilm_l6_v2",
                               max_length=args.max_length, extract_batch_size=64,
                               num_clients=args.num_clients, partition="dirichlet", alpha=args.alpha)
    data.setup()
    majority = data.test_labels.bincount().max().item() / len(data.test_labels)
    clients = torch.bincount(data.train_client_ids, minlength=args.num_clients)
    methods = [
        ("AFL (γ = 1, γ_out = 1)", AFL(gamma=1.0, gamma_out=1.0)),
        ("SAFLe (binary_overlap, L = 8, E = 64, G = 6; γ = γ_out = 1)", SAFLe()),
        ("GH-OFL, LDA head (shrinkage 0.05)", GHOFL(heads=["lda"])),
    ]
    heads = [(label, *fit_and_test(method, data)) for label, method in methods]
    whole_s = time.perf_counter() - started

    lines = [
        f"(1) Feature extraction throughput, float32 against bfloat16 autocast (`precision: bf16`): "
        f"{args.images} mnist5k images / {args.texts} spam_assassin emails per backbone, one batch.",
        machine_line(f"{bf16_support()}; median of {args.repeats} repeats; whole run {whole_s:.0f} s", load_start),
        "",
        "| backbone | weights | d | input | float32 | bf16 | bf16 / float32 | bf16 min cosine | bf16 max rel. error |",
        "|---|---|---|---|---|---|---|---|---|",
        *[table_row(*row) for row in rows],
        "",
        f"(2) Email task: spam_assassin ({len(data.train_labels)} train / {len(data.test_labels)} test "
        f"emails, ham/spam) through all_minilm_l6_v2 at {args.max_length} tokens (d = "
        f"{data.feature_dim}), K = {args.num_clients} clients, Dirichlet α = {args.alpha} (client sizes "
        f"{clients.min().item()}–{clients.max().item()}); majority-class test accuracy {majority:.4f}. "
        f"One fit each; the features come from the cache.",
        "",
        "| method | test accuracy | upload / client | fit time |",
        "|---|---|---|---|",
        *[f"| {label} | {acc:.4f} | {up / 1e6:.3f} MB | {fit_s:.2f} s |" for label, acc, up, fit_s in heads],
    ]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
