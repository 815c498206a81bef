"""What every benchmark script shares: the machine it ran on, writing its report, and where a
profiled run spent its time."""
from __future__ import annotations

import cProfile
import os
import platform
import pstats
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


def write_report(lines: list[str], out: str | Path) -> Path:
    """Prints the report and writes it (Markdown) to `out`, creating its folder."""
    report = "\n".join(lines)
    print(report)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report + "\n")
    return out


def hot_functions(profile: cProfile.Profile, count: int) -> list[str]:
    """The `count` functions of a profile with the most own time (cProfile's tottime: in the function
    itself, the tensor operators it applies included, not in the Python functions it calls), as
    the rows of a Markdown table; paths relative to the repository or to site-packages."""
    functions = pstats.Stats(profile).get_stats_profile().func_profiles
    ranked = sorted(functions.items(), key=lambda item: -item[1].tottime)
    top = [(name, function) for name, function in ranked if "_lsprof" not in name][:count]  # not the profiler's own
    root = str(Path(__file__).resolve().parents[1]) + os.sep
    rows = ["| function | calls | own s | with its callees s |", "|---|---|---|---|"]
    for name, function in top:
        where = function.file_name.removeprefix(root).split("site-packages" + os.sep)[-1]
        place = f"`{where}:{function.line_number}` {name}" if function.line_number else name  # a built-in: no file
        rows.append(f"| {place.replace('|', '/')} | {function.ncalls} | {function.tottime:.2f} | "
                    f"{function.cumtime:.2f} |")
    return rows


def fit_engine(method, datamodule, federation=None, test: bool = True, stopping=None, eval_every: int = 1,
               **trainer_options):
    """Fits `method` in process (the Lightning engine, a quiet Trainer) and, with `test`, tests it:
    returns (engine, the test metrics or {}); `engine.fit_metrics` holds `comm/*` and `time/*`,
    `engine.curve` the learning curve. `stopping`, `eval_every`: the engine's. `trainer_options`
    go to the Trainer (e.g. accelerator="cpu")."""
    from lightning import Trainer

    from workbench.engines import LightningEngine

    engine = LightningEngine(method, federation, stopping=stopping, eval_every=eval_every)
    trainer = Trainer(max_epochs=max(method.num_rounds, 1), logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      **trainer_options)
    trainer.fit(engine, datamodule=datamodule)
    tested = trainer.test(engine, datamodule=datamodule, verbose=False)[0] if test else {}
    return engine, tested
