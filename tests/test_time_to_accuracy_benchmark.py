"""benchmarks/time_to_accuracy.py: the simulated time to AFL's accuracy is read off each curve at
its first round that reaches it, a method no client can run under the deadline is an outcome in
the table, and the script runs end to end."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from benchmarks import time_to_accuracy
from tests.conftest import ROOT


def record(method: str, seed: int, curve: list[list[float]], deadline: float | None = None) -> dict:
    return {"method": method, "seed": seed, "preset": "wifi", "deadline_s": deadline, "test_acc": curve[-1][1],
            "rounds": curve[-1][0], "up_mb": 1.0, "latency_s": curve[-1][2], "stragglers": 0, "row_s": 1e-5,
            "latency_curve": curve, "wall_s": 1.0}


def test_the_time_to_an_accuracy_is_the_first_round_that_reaches_it():
    curve = [[1, 0.5, 10.0], [2, 0.8, 20.0], [3, 0.79, 30.0], [4, 0.9, 40.0]]
    assert time_to_accuracy.time_to(curve, 0.8) == 20.0
    assert time_to_accuracy.time_to(curve, 0.85) == 40.0
    assert time_to_accuracy.time_to(curve, 0.95) == math.inf


def test_each_seed_is_measured_against_afl_of_the_same_seed_and_late_fits_are_counted():
    records = [record("AFL", 0, [[1, 0.90, 5.0]]), record("AFL", 1, [[1, 0.80, 7.0]]),
               record("FedAvg", 0, [[1, 0.7, 1.0], [2, 0.91, 2.0]]),  # reaches seed 0's 90 % at 2 s
               record("FedAvg", 1, [[1, 0.7, 1.0], [2, 0.79, 2.0]]),  # never seed 1's 80 %
               {"method": "SAFLe", "seed": 0, "preset": "wifi", "deadline_s": None, "late": "every client…"},
               record("SAFLe", 1, [[1, 0.85, 60.0]])]
    rows = {row["method"]: row for row in time_to_accuracy.summarize(records)}
    assert rows["AFL"]["reached"] == 2 and rows["AFL"]["to_afl_s"] == 6.0  # median of 5 and 7
    assert rows["FedAvg"]["reached"] == 1 and rows["FedAvg"]["to_afl_s"] == 2.0
    assert rows["FedAvg"]["acc"] == pytest.approx(0.85)
    assert rows["SAFLe"]["late"] == 1 and rows["SAFLe"]["seeds"] == 2 and rows["SAFLe"]["acc"] == 0.85
    assert rows["SAFLe"]["to_afl_s"] == 60.0  # seed 1: 85 % ≥ AFL's 80 %


@pytest.mark.subprocess
def test_the_script_runs_end_to_end_and_rerenders_from_its_records(tmp_path):
    out = tmp_path / "tta.md"
    command = [sys.executable, str(ROOT / "benchmarks/time_to_accuracy.py"), "--smoke", "--workers", "1",
               "--presets", "wifi", "--out", str(out), "--figure", str(tmp_path / "tta.png")]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    text = out.read_text()
    assert "## wifi: 86/46 Mbit/s" in text and "deadline 2 s" in text and (tmp_path / "tta.png").stat().st_size
    saved = json.loads((tmp_path / "tta.json").read_text())
    assert {r["method"] for r in saved["records"]} == {"AFL", "FedAvg"} and len(saved["records"]) == 4
    subprocess.run([*command[:-4], "--out", str(tmp_path / "again.md"), "--figure", str(tmp_path / "again.png"),
                    "--records", str(tmp_path / "tta.json")], check=True, capture_output=True, timeout=600)
    assert (tmp_path / "again.md").read_text().replace("again.png", "tta.png") == text
