"""The cost of partitioning: our partitioners against Flower Datasets' namesakes.

60,000 labels of 10 classes (Fashion-MNIST's training-set size, uniform labels) into 1,000
clients, median (min, max) seconds of `--repeats` runs, seeds 0, 1, ... Ours is one call of
`workbench.data.partition.partition`. Flower's is the way its partitioners are used: a Hugging
Face dataset of the labels, shuffled with the seed, handed to the partitioner, then
`load_partition(k)` for every client k (what `partition: flower` does); the first call computes
the whole assignment, so its time is reported on its own too. `natural` (ours) maps 1,000 writer
ids to 1,000 clients. Needs `pip install -e '.[hf]'`.

    python benchmarks/partition.py [--repeats 5] [--num-samples 60000] [--num-clients 1000]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, machine_line, write_report

from workbench.data.partition import partition

SCHEMES = {  # Flower's class, and the arguments both take
    "iid": ("IidPartitioner", {}),
    "dirichlet": ("DirichletPartitioner", {"alpha": 0.5, "min_partition_size": 0}),
    "shard": ("ShardPartitioner", {"num_shards_per_partition": 2}),
    "pathological": ("PathologicalPartitioner", {"num_classes_per_partition": 2}),
}


def flower_seconds(labels: np.ndarray, class_name: str, params: dict, num_clients: int,
                   seed: int) -> tuple[float, float]:
    """(seconds to the first partition, seconds to all partitions) of a Flower partitioner."""
    import datasets
    from flwr_datasets import partitioner as flower_partitioners

    cls = getattr(flower_partitioners, class_name)
    start = time.perf_counter()
    dataset = datasets.Dataset.from_dict({"label": labels, "row": np.arange(labels.size)}).shuffle(seed=seed)
    extra = {"partition_by": "label", "seed": seed} if class_name != "IidPartitioner" else {}
    instance = cls(num_partitions=num_clients, **extra, **params)
    instance.dataset = dataset
    instance.load_partition(0)["row"]
    first = time.perf_counter() - start
    for k in range(1, num_clients):
        instance.load_partition(k)["row"]
    return first, time.perf_counter() - start


def summary(times: list[float]) -> str:
    return f"{statistics.median(times):.4f} ({min(times):.4f}–{max(times):.4f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-samples", type=int, default=60_000)
    parser.add_argument("--num-clients", type=int, default=1_000)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "partition.md"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # Flower warns about unused classes and retries
    load = load_average()
    labels = np.random.default_rng(0).integers(0, 10, args.num_samples)
    writers = np.random.default_rng(1).integers(0, args.num_clients, args.num_samples)
    lines = [f"# Partitioning cost: {args.num_samples:,} labels into {args.num_clients:,} clients", "",
             f"Seconds, median (min–max) of {args.repeats} runs (seeds 0..{args.repeats - 1}).", "",
             "| scheme | ours | Flower, first partition | Flower, all partitions | Flower all / ours |",
             "|---|---|---|---|---|"]
    for scheme, (class_name, params) in SCHEMES.items():
        ours, first, whole = [], [], []
        for seed in range(args.repeats):
            start = time.perf_counter()
            partition(labels, scheme, args.num_clients, seed=seed, **params)
            ours.append(time.perf_counter() - start)
            f, w = flower_seconds(labels, class_name, params, args.num_clients, seed)
            first.append(f)
            whole.append(w)
        ratio = statistics.median(whole) / statistics.median(ours)
        lines.append(f"| {scheme} | {summary(ours)} | {summary(first)} | {summary(whole)} | {ratio:,.0f}× |")
        print(lines[-1], flush=True)
    natural = []
    for seed in range(args.repeats):
        start = time.perf_counter()
        partition(writers, "natural", int(np.unique(writers).size), seed=seed)
        natural.append(time.perf_counter() - start)
    lines.append(f"| natural (ours only) | {summary(natural)} | | | |")
    lines += ["", ("Flower, first partition: building the shuffled Hugging Face dataset of the labels and "
                   "the first `load_partition`, which computes the whole assignment.")]
    lines += ["", machine_line("benchmarks/partition.py", load)]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
