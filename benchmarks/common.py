"""What every benchmark script shares: the machine it ran on, writing its report, and where a
profiled run spent its time."""
from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from workbench.bench.machine import cpu_name, load_average, machine_line

__all__ = ["cpu_name", "fit_engine", "hot_functions", "load_average", "machine_line", "write_report"]


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """The median wall seconds of `repeats` calls of `fn`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
    trainer = Trainer(logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      **trainer_options)
    trainer.fit(engine, datamodule=datamodule)
    tested = trainer.test(engine, datamodule=datamodule, verbose=False)[0] if test else {}
    return engine, tested
