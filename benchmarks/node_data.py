"""What a Flower node's data costs it: peak memory and start-up time of the data for one node,
against the federation's size K, with its partition alone or the whole data set up.

Fashion-MNIST (60,000 training rows) through EfficientNet-Lite0 at 64 px (d = 1280), its features
already in the cache (as on a node that holds them), an iid partition over K = 10, 100 and 1,000
clients (6,000, 600 and 60 rows a client), client 0's node:

- partition: `FederatedDataModule.population(0)`, the node's own rows (what a node does now): the
  labels partitioned as the server does, the node's rows read memory-mapped from the cache;
- whole: `setup()` of the whole data, then client 0's rows (what a node did before).

Each measurement is a fresh process (its peak resident memory, `ru_maxrss`, is its own): the
seconds from the data module's construction to the node's rows, the process's peak memory, and
its memory after the imports alone. Medians over the repeats.

    python benchmarks/node_data.py                   # K = 10, 100, 1000; 3 repeats
    python benchmarks/node_data.py --repeats 1 --clients 10
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine_line, write_report

DATA = {"dataset": "fashion_mnist", "backbone": "efficientnet_lite0", "input_size": 64, "partition": "iid",
        "device": "cpu"}

# one measurement, in a process of its own: the imports, then the node's data, timed
PROBE = """
import json, resource, sys, time
from workbench.data import FederatedDataModule
settings, mode = json.loads(sys.argv[1]), sys.argv[2]
def anonymous_mb():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["RssAnon"].split()[0]) / 1024
imports_mb = anonymous_mb()
start = time.perf_counter()
datamodule = FederatedDataModule(**settings)
if mode == "partition":
    rows = datamodule.population(0).client(0)
else:
    datamodule.setup()
    rows = datamodule.population().client(0)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "anon_mb": anonymous_mb() - imports_mb, "imports_mb": imports_mb, "rows": len(rows.train)}))
"""


def measure(num_clients: int, mode: str) -> dict:
    settings = json.dumps({**DATA, "num_clients": num_clients})
    done = subprocess.run([sys.executable, "-c", PROBE, settings, mode], capture_output=True, text=True, check=True,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
                          timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/node_data.md")
    args = parser.parse_args()
    lines = ["| K | rows of client 0 | mode | start-up s | peak resident MB | anonymous MB its data holds | "
             "anonymous MB after the imports |",
             "|---|---|---|---|---|---|---|"]
    for num_clients in args.clients:
        for mode in ("partition", "whole"):
            runs = [measure(num_clients, mode) for _ in range(args.repeats)]
            median = {key: statistics.median(run[key] for run in runs)
                      for key in ("seconds", "peak_mb", "anon_mb", "imports_mb")}
            lines.append(f"| {num_clients} | {runs[0]['rows']} | {mode} | {median['seconds']:.2f} | "
                         f"{median['peak_mb']:.0f} | {median['anon_mb']:.0f} | {median['imports_mb']:.0f} |")
            print(lines[-1], flush=True)
    report = ["# A Flower node's data against the federation's size", "",
              "Client 0's node, with its partition alone (what a node loads now) or the whole data set up (before): "
              "the seconds from the data module's construction to its rows; the process's peak resident memory "
              "(`ru_maxrss`: the libraries' pages and the cache file's pages the kernel read through the memory "
              "map, which are the page cache's to reclaim, not the process's to hold); the anonymous memory "
              "(`RssAnon`) the data holds once the node's rows are there, over what the imports left (its tensors, "
              "the raw dataset, the backbone). "
              "Fashion-MNIST (60,000 training rows) through EfficientNet-Lite0 at 64 px, the features in the cache, "
              f"an iid partition; each measurement a fresh process, medians of {args.repeats}.", "", *lines, "",
              "A node's own memory follows its rows (1280 float32 numbers a row) over a floor: the raw dataset it "
              "partitions (the loader reads the images with the labels) and the backbone; the whole split's "
              "features (307 MB) and their copy in partition order are no longer held. The dataset is fixed, so a "
              "client's rows shrink as K grows. Where its rows are scattered over the file (an iid partition), the "
              "kernel's read-ahead still maps most of the cache file's pages (the peak resident column).", "",
              machine_line(), ""]
    write_report(report, args.out)


if __name__ == "__main__":
    main()
