"""How often each method's rounds make the host wait for the device, on the recording stand-in
device of tests/engines/fake_device.py (no GPU needed): per round, on the conformance matrix's data and on
a larger run (twice the clients, four times the chunks of rows, four times the local steps).

A round that waits a fixed number of times gives the same numbers on both; a read per client,
chunk or step grows with the run. Counts, not times: they do not depend on the machine.

    python benchmarks/device_syncs.py        # writes benchmarks/results/device_syncs.md
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_report
from tests.engines.conformance import METHODS, data
from tests.engines.fake_device import DEVICE, fake_device
from tests.engines.test_device import GRADIENT, fit


def main() -> list[str]:
    small, larger = data(num_clients=3), data(num_clients=6)
    larger.hparams.batch_size = 16
    lines = ["# Waits for the device per round", "",
             "How often each round makes the host wait for the device (a value read, a copy to the host, a blocking "
             "copy to the device, an output sized by values) on the stand-in device of tests/engines/fake_device.py, "
             "round by round (the final broadcast left out): the "
             "conformance matrix's data (3 clients), and a larger run (6 clients, 4× the chunks, gradient methods "
             "4× the local epochs).", "",
             "| method | waits a round | the larger run's |", "|---|---|---|"]
    for name in sorted(METHODS):
        with fake_device() as record:
            *_, rounds = fit(name, small, DEVICE, record)
            *_, larger_rounds = fit(name, larger, DEVICE, record, local_epochs=4 if name in GRADIENT else None)
        counts = [", ".join(str(len(r.syncs)) for r in run[:-1]) or "–" for run in (rounds, larger_rounds)]
        lines.append(f"| {name} | {counts[0]} | {counts[1]} |")
    write_report(lines, "benchmarks/results/device_syncs.md")
    return lines


if __name__ == "__main__":
    main()
