"""What checking the feature cache's digests costs on a cache hit: a 60,000 × 2,064 float32 cache
(MNIST-sized, multi-depth EfficientNet-Lite0 features), written by `cached_features` and read back.
Median of `--repeats` of: `torch.load` alone (what a hit cost before digests, less its other
checks), the digests of the features and labels (xxh3-128, what a hit now adds), a whole
hit through `cached_features` (load, every check, the digests), and, for the choice of hash,
blake2b and CRC-32 from the standard library over the same bytes. The file is in the page cache
(it was just written), so the load is as fast as it gets and the digest's share as large.

    python benchmarks/cache_digest.py [--rows 60000] [--dim 2064] [--repeats 5]
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, machine_line, write_report

from workbench.data.features import cached_features, payload_digest


@dataclass(frozen=True)
class StandInBackbone:
    """Any (B, 3, S, S) -> (B, dim) network will do: the bytes of the cache are what is timed."""

    model: torch.nn.Module
    feature_dim: int
    name: str = "stand-in"
    input_size: int = 4
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.25, 0.25, 0.25)
    weights_id: str = "random-init:seed=0"


class Pooled(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.mean(dim=(2, 3)))


def seconds(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=60_000)
    parser.add_argument("--dim", type=int, default=2_064)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cache_digest.md"))
    args = parser.parse_args()
    load = load_average()
    torch.manual_seed(0)
    backbone = StandInBackbone(Pooled(args.dim), args.dim)
    images = torch.randint(0, 256, (args.rows, 4, 4), dtype=torch.uint8)
    labels = torch.arange(args.rows) % 10
    with tempfile.TemporaryDirectory() as cache_dir:
        def hit():
            return cached_features(backbone, images, labels, cache_dir=cache_dir, dataset="bench", split="train",
                                   source="benchmarks/cache_digest.py", batch_size=4096)

        features = hit()  # writes the file
        (path,) = Path(cache_dir).rglob("*.pt")
        size_mb = path.stat().st_size / 1e6
        payload = features.numpy().data.cast("B")
        timed = {
            "torch.load (the load)": lambda: torch.load(path, map_location="cpu", weights_only=True),
            "xxh3-128 digests (the check)": lambda: [payload_digest(t) for t in (features, labels)],
            "a whole hit (load, checks, digests)": hit,
            "blake2b over the features": lambda: hashlib.blake2b(payload, digest_size=16).hexdigest(),
            "CRC-32 over the features": lambda: zlib.crc32(payload),
        }
        times: dict[str, list[float]] = {name: [] for name in timed}
        for _ in range(args.repeats):  # interleaved, so that a busy moment falls on every row alike
            for name, work in timed.items():
                times[name].append(seconds(work))
    median = {name: statistics.median(values) for name, values in times.items()}
    base = median["torch.load (the load)"]
    rows = [f"| {name} | {1e3 * median[name]:.0f} | {1e3 * min(times[name]):.0f} | {1e3 * max(times[name]):.0f} | "
            + (f"{100 * median[name] / base:.1f} %" if name != "torch.load (the load)" else "100 %") + " |"
            for name in timed]
    check = median["xxh3-128 digests (the check)"]
    write_report([
        "# The feature cache's digests on a cache hit", "",
        f"A cache of {args.rows:,} × {args.dim:,} float32 features and their int64 labels ({size_mb:.0f} MB), "
        f"read from the page cache. Milliseconds, median (min, max) of {args.repeats}, interleaved; the last column "
        "is the share of the load.", "",
        "| step | median ms | min ms | max ms | of the load |", "|---|---|---|---|---|", *rows, "",
        f"Checking the digests adds {1e3 * check:.0f} ms to a {1e3 * base:.0f} ms load: {100 * check / base:.1f} % "
        f"(the goal: at most 10 %), {100 * check / median['a whole hit (load, checks, digests)']:.1f} % of a whole "
        f"hit. blake2b would add {100 * median['blake2b over the features'] / base:.0f} %, "
        f"CRC-32 {100 * median['CRC-32 over the features'] / base:.0f} %.", "",
        machine_line("benchmarks/cache_digest.py", load_at_start=load)], args.out)


if __name__ == "__main__":
    main()
