"""The machine a benchmark or leaderboard ran on, in one line: its times compare only within one run."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def cpu_name() -> str:
    """The CPU model (from /proc/cpuinfo where there is one)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def load_average() -> float | None:
    """The 1-minute load average (None where the system has none): how busy the machine was."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def machine_line(how: str = "", load_at_start: float | None = None) -> str:
    """`Machine: <cpu>, <n> cores, load average …, torch … with t threads; <how>.` — one line that
    says where a table's times come from (they only compare within one run). Call it at the end
    of the run; `load_at_start` (from `load_average()`) adds the load when the run began."""
    now = load_average()
    load = "" if now is None else (f", load average {now:.1f} at the end" if load_at_start is None else
                                   f", load average {load_at_start:.1f} at the start and {now:.1f} at the end")
    return (f"Machine: {cpu_name()}, {os.cpu_count()} cores{load}, torch {torch.__version__} with "
            f"{torch.get_num_threads()} threads" + (f"; {how}." if how else "."))
