"""The seed papers' headline tables, run here: our numbers beside the papers'.

    python benchmarks/paper_tables.py                              # every table
    python benchmarks/paper_tables.py --tables ghofl anapfl        # some (safle, ghofl, anapfl, osfed)
    python benchmarks/paper_tables.py --data_dir /data --download  # fetch the datasets that are missing
    python benchmarks/paper_tables.py --set trainer.accelerator=cpu --set data.extract_batch_size=64
    python benchmarks/paper_tables.py --dry_run --out /tmp/paper_tables.md   # every run on tiny stand-ins

The tables, their rows, the papers' numbers (each row naming its source table) and where every
protocol setting comes from are in benchmarks/paper_numbers.yaml; each row's config is a file
under configs/paper/ (its method's configs/method file + its dataset's configs/data file + the
row's keys). Each distinct config runs once, through the CLI in this process — the run of
`python -m workbench fit --config <config>` with the options' flags — into
<run_dir>/<table>/<config's name>/; rows that share a config (GH-OFL's heads) share its run. A
row marked `tune: lr` (FedAvg in the SAFLe table) runs every learning rate of
sweeps/gradient_lr.yaml's grid under its config's stopping rule and keeps the rate with the best
hold-out accuracy (`stop/best_val_acc`, the clients' own hold-outs; the test split chooses
nothing). A finished config leaves `result.json` in its folder and is not run again unless
`--rerun`, so an interrupted table goes on where it stopped.

The report (`--out`, Markdown, and a CSV beside it), rewritten after every config: per table its
protocol (setting, value, stated or not stated in the paper) and per row the paper's number,
ours, the difference (ours − paper, in points), the rounds, the upload per client, the fit time
(clients and server) and the wall time (the run's whole CLI call: the first run on a dataset
includes loading it and extracting its features).

`--dry_run`: every config of the chosen tables composes, parses, builds its method and data
module and fits, in seconds each, on stand-ins: each dataset replaced by a registered stand-in of
the same modality and class count (`standin_<dataset>`: a few seeded random images per class at
the dataset's native size), the backbone by a tiny random-init timm model of the same family
(test_resnet at 32 px; test_vit, at its 160 px, for a ViT), K scaled down to at most DRY_CLIENTS (with
min_partition_size 1), the methods cut to FAST's settings, and the lr grid to its first two
rates; runs and caches go to a temporary folder. Its numbers measure nothing: it checks that the
tables can be run and written.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

os.environ.setdefault("WANDB_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import load_average, machine_line, write_report  # noqa: E402

NUMBERS = ROOT / "benchmarks/paper_numbers.yaml"
LR_SWEEP = ROOT / "sweeps/gradient_lr.yaml"
DEFAULT_OUT = ROOT / "benchmarks/results/paper_tables.md"

# --dry_run: the stand-ins. The real datasets' class counts and native image sides (the loaders'
# own, workbench/data/paper_datasets.py), so a stand-in has the modality and classes of its dataset.
STANDIN_SHAPES = {"cifar10": (10, 32), "cifar100": (100, 32), "svhn": (10, 32), "tiny_imagenet": (200, 64)}
STANDIN_TRAIN_PER_CLASS, STANDIN_TEST_PER_CLASS = 10, 2
DRY_CLIENTS = 4
# The backbone stand-ins: timm's tiny random-init test models, by family, at the smallest size each takes.
DRY_BACKBONES = {"resnet": ("test_resnet", 32), "vit": ("test_vit", 160)}  # test_vit's position embedding: 160 px
# Each method cut to seconds; everything else (the config's solver, schedule, heads, γ grid,
# stopping rule, local protocol) stays the config's.
FAST = {
    "AFL": [],
    "DeepAFL": ["--model.num_layers=2", "--model.hidden_dim=32", "--model.block_dim=32"],
    "SAFLe": ["--model.experts=16", "--model.group_size=3"],
    "FedAvg": ["--model.num_rounds=1", "--model.local.epochs=1"],
    "GHOFL": ["--model.synthesis.per_class=16", "--model.synthesis.max_dim=16", "--model.fishermix.epochs=1",
              "--model.proto_hyper.epochs=1", "--model.proto_hyper.rank=8"],
    "AnaPFL": ["--model.hidden_dim=32"],
    "OSFED": ["--model.num_rounds=1", "--model.local.epochs=1", "--model.snapshot.lbfgs_steps=2"],
}


# --------------------------------------------------------------------------- the tables


@dataclass
class Row:
    table: str
    row: str
    config: str
    metric: str
    paper: float
    source: str
    paper_rounds: int | None = None
    paper_mb: float | None = None
    tune: str | None = None


@dataclass
class Table:
    name: str
    title: str
    sweep: str
    protocol: list[dict[str, str]]
    rows: list[Row] = field(default_factory=list)

    @property
    def configs(self) -> list[str]:
        """The distinct configs of the rows, in order: one run each."""
        return list(dict.fromkeys(row.config for row in self.rows))


def load_tables(path: Path = NUMBERS) -> dict[str, Table]:
    """benchmarks/paper_numbers.yaml as Tables, by name."""
    spec = yaml.safe_load(path.read_text())
    tables = {}
    for name, table in spec["tables"].items():
        rows = [Row(table=name, **row) for row in table["rows"]]
        tables[name] = Table(name, table["title"], table["sweep"], table["protocol"], rows)
    return tables


def lr_grid() -> list[float]:
    """The learning rates of sweeps/gradient_lr.yaml, the workbench's fair protocol's grid."""
    return list(yaml.safe_load(LR_SWEEP.read_text())["parameters"]["model.local.lr"]["values"])


def read_config(config: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / config).read_text())


def method_name(config: str) -> str:
    return read_config(config)["model"]["class_path"].rsplit(".", 1)[-1]


# --------------------------------------------------------------------------- --dry_run


def standin_loader(dataset: str):
    """A loader of `standin_<dataset>`: seeded random RGB images with a per-class colour offset
    (so the classes are told apart a little), the dataset's class count and image side."""
    from workbench.data.datasets import ImageDataset, ImageSplit

    num_classes, side = STANDIN_SHAPES[dataset]

    def load(data_dir: Path, download: bool) -> ImageDataset:
        import torch

        generator = torch.Generator().manual_seed(0)
        colours = torch.randint(0, 256, (num_classes, 1, 1, 3), generator=generator)

        def split(per_class: int) -> ImageSplit:
            labels = torch.arange(num_classes).repeat(per_class)
            noise = torch.randint(-40, 41, (len(labels), side, side, 3), generator=generator)
            images = (colours[labels] + noise).clamp(0, 255).to(torch.uint8)
            return ImageSplit(images.contiguous(), labels)

        return ImageDataset(f"standin_{dataset}", split(STANDIN_TRAIN_PER_CLASS), split(STANDIN_TEST_PER_CLASS),
                            tuple(f"class_{c}" for c in range(num_classes)), f"standin:{dataset}")

    return load


@contextlib.contextmanager
def threads(count: int):
    """torch's intra-op threads set to `count` for the block."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def standins(datasets: set[str]):
    """The stand-in datasets, registered for the block only."""
    from workbench.data.registry import DATASETS

    with contextlib.ExitStack() as stack:
        for dataset in sorted(datasets):
            stack.enter_context(DATASETS.temporarily(f"standin_{dataset}", standin_loader(dataset), "image"))
        yield


def dry_flags(config: str) -> list[str]:
    """The flags that put `config` on its stand-ins (data, backbone, K) and cut its method to FAST."""
    data = read_config(config)["data"]["init_args"]
    backbone, size = DRY_BACKBONES["vit" if "vit" in str(data.get("backbone", "")) else "resnet"]
    return [f"--data.dataset=standin_{data['dataset']}", f"--data.backbone={backbone}", "--data.pretrained=false",
            f"--data.input_size={size}", f"--data.num_clients={min(data['num_clients'], DRY_CLIENTS)}",
            "--data.min_partition_size=1", "--data.device=cpu", "--trainer.accelerator=cpu",
            "--checkpoint_every_round=false",
            *FAST[method_name(config)]]


# --------------------------------------------------------------------------- running


def fit(config: str, flags: list[str], run_dir: Path, name: str) -> dict[str, Any]:
    """One CLI fit of `config` with `flags` in this process: its metrics, rounds and wall time."""
    from workbench.cli import main as workbench_main

    argv = ["fit", "--config", str(ROOT / config), "--wandb=disabled", "--trainer.enable_progress_bar=false",
            *flags, f"--run_dir={run_dir}", f"--run_name={name}"]
    start = time.perf_counter()
    cli = workbench_main(argv)
    wall_s = time.perf_counter() - start
    metrics = {**cli.model.fit_metrics, **{key: float(value) for key, value in cli.trainer.callback_metrics.items()}}
    return {"metrics": {key: float(value) for key, value in metrics.items()}, "rounds": int(cli.method.round),
            "wall_s": wall_s, "log_dir": str(cli.trainer.log_dir)}


def run_config(table: Table, config: str, args, flags: list[str]) -> dict[str, Any]:
    """The result of `config` (run now, or read from its result.json): with `tune: lr` the best
    rate's run on the hold-outs, each rate's hold-out accuracy listed."""
    folder = Path(args.run_dir) / table.name / Path(config).stem
    saved = folder / "result.json"
    if saved.exists() and not args.rerun:
        return json.loads(saved.read_text())
    tuned = any(row.tune == "lr" for row in table.rows if row.config == config)
    if not tuned:
        result = fit(config, flags, folder, "run")
    else:
        grid = lr_grid()[:2] if args.dry_run else lr_grid()
        tried = {}
        for lr in grid:
            tried[lr] = fit(config, [*flags, f"--model.local.lr={lr}"], folder, f"lr={lr:g}")
        best = max(grid, key=lambda lr: tried[lr]["metrics"].get("stop/best_val_acc", -math.inf))
        result = {**tried[best], "lr": best,
                  "lr_holdout_acc": {f"{lr:g}": tried[lr]["metrics"].get("stop/best_val_acc") for lr in grid}}
    folder.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(result, indent=2) + "\n")
    return result


def row_line(row: Row, result: dict[str, Any] | None, error: str | None) -> dict[str, Any]:
    """A row of the report as plain values: the paper's number beside ours."""
    line: dict[str, Any] = {"table": row.table, "row": row.row, "config": row.config, "metric": row.metric,
                            "paper": row.paper, "paper_rounds": row.paper_rounds, "paper_mb": row.paper_mb,
                            "source": row.source}
    if result is None:
        return {**line, "status": f"failed: {error}" if error else "not run"}
    metrics = result["metrics"]
    ours = 100 * metrics[row.metric] if row.metric in metrics else None
    return {**line, "status": "done" if ours is not None else f"no {row.metric} logged",
            "ours": ours, "delta": None if ours is None else ours - row.paper, "rounds": result["rounds"],
            "mb_up_per_client": metrics.get("comm/bytes_up_per_client", 0.0) / 1e6,
            "fit_s": metrics.get("time/fit_s"), "wall_s": result["wall_s"], "lr": result.get("lr"),
            "lr_holdout_acc": result.get("lr_holdout_acc")}


def number(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def megabytes(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,.3g}" if value < 100 else f"{value:,.0f}"


def markdown(table: list[dict[str, str]]) -> list[str]:
    header = list(table[0])
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(line[h] for h in header) + " |" for line in table]]


def report(tables: list[Table], lines_by_table: dict[str, list[dict[str, Any]]], args, load_at_start,
           seconds: float) -> list[str]:
    """The Markdown report: per table its protocol and our numbers beside the papers'."""
    command = "python benchmarks/paper_tables.py " + " ".join(args.argv)
    out = ["# The papers' headline tables, reproduced", "",
           f"`{command.strip()}` wrote this (benchmarks/paper_tables.py; the papers' numbers and the protocol's "
           "sources: benchmarks/paper_numbers.yaml). Ours: test accuracy % of the row's metric; Δ = ours − paper, "
           "in points; MB up / client: the upload of one client over the whole fit, and per round; paper "
           "rounds and paper MB where the summary gives them (what paper MB measures: the row's source and the "
           "table's protocol); fit s: the method's clients and server; wall s: the whole run, loading the data "
           "and extracting its features included.", ""]
    if args.dry_run:
        out += [f"**Dry run**: tiny stand-ins for the data (a few random images per class, the datasets' class "
                f"counts), random-init test_resnet (32 px) / test_vit (160 px) backbones, K ≤ {DRY_CLIENTS} "
                "clients and cut-down methods (benchmarks/paper_tables.py FAST). The numbers measure nothing.", ""]
    out += [machine_line(f"{seconds / 60:.1f} min", load_at_start), ""]
    for table in tables:
        out += [f"## {table.name}: {table.title}", "", f"Sweep: `python -m workbench sweep {table.sweep}`.", "",
                *markdown([{"setting": p["setting"], "value": p["value"], "from": p["from"]} for p in table.protocol]),
                ""]
        shown = []
        for line in lines_by_table.get(table.name, []):
            rounds, total = line.get("rounds"), line.get("mb_up_per_client")
            row = line["row"] + (f" (lr {line['lr']:g})" if line.get("lr") is not None else "")
            shown.append({"row": row, "paper %": number(line["paper"]), "ours %": number(line.get("ours")),
                          "Δ": number(line.get("delta")), "rounds": "–" if rounds is None else str(rounds),
                          "paper rounds": "–" if line["paper_rounds"] is None else str(line["paper_rounds"]),
                          "MB up / client": megabytes(total),
                          "MB / client / round": megabytes(total / rounds if total is not None and rounds else None),
                          "paper MB": "–" if line["paper_mb"] is None else f"{line['paper_mb']:g}",
                          "fit s": number(line.get("fit_s"), 1), "wall s": number(line.get("wall_s"), 1),
                          "source": line["source"], "config": f"`{line['config']}`",
                          **({"status": line["status"]} if line["status"] != "done" else {})})
        if any("status" in s for s in shown):
            for s in shown:
                s.setdefault("status", "done")
        out += [*(markdown(shown) if shown else ["(not run)"]), ""]
        tuned = [line for line in lines_by_table.get(table.name, []) if line.get("lr_holdout_acc")]
        if tuned:
            out += ["Learning rates (best hold-out accuracy of each, the kept one in the row): " + "; ".join(
                f"{line['row']}: " + ", ".join(f"{lr} → {number(100 * acc if acc is not None else None)}"
                                               for lr, acc in line["lr_holdout_acc"].items())
                for line in tuned), ""]
    return out


CSV_KEYS = ["table", "row", "status", "paper", "ours", "delta", "rounds", "paper_rounds", "mb_up_per_client",
            "paper_mb", "fit_s", "wall_s", "lr", "metric", "config", "source"]


def write(tables, lines_by_table, args, load_at_start, start) -> None:
    out = Path(args.out)
    write_report(report(tables, lines_by_table, args, load_at_start, time.perf_counter() - start), out)
    with open(out.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, CSV_KEYS, extrasaction="ignore")
        writer.writeheader()
        for lines in lines_by_table.values():
            writer.writerows({key: f"{value:.6g}" if isinstance(value, float) else value for key, value in line.items()}
                             for line in lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    tables = load_tables()
    parser = argparse.ArgumentParser(prog="benchmarks/paper_tables.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", nargs="+", choices=list(tables), default=list(tables),
                        help="the tables to run (default: all)")
    parser.add_argument("--dry_run", action="store_true",
                        help="every config on tiny stand-ins, in seconds each: a check that the tables run")
    parser.add_argument("--out", default=None,
                        help=f"the report (Markdown; a CSV beside it). Default: {DEFAULT_OUT.relative_to(ROOT)}, "
                             "or with --dry_run a temporary file (printed, then removed)")
    parser.add_argument("--run_dir", default=None,
                        help="where the runs go (<run_dir>/<table>/<config>/). Default: runs/paper, or with "
                             "--dry_run a temporary folder")
    parser.add_argument("--data_dir", default=None, help="data.data_dir of every run (where the datasets are)")
    parser.add_argument("--cache_dir", default=None, help="data.cache_dir of every run (the feature cache)")
    parser.add_argument("--download", action="store_true", help="data.download=true: fetch missing datasets")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                        help="a CLI setting for every run, e.g. --set trainer.accelerator=gpu; repeatable")
    parser.add_argument("--rerun", action="store_true", help="run configs again even when result.json is there")
    args = parser.parse_args(argv)
    args.argv = argv
    chosen = [tables[name] for name in args.tables]
    with contextlib.ExitStack() as stack:
        if args.dry_run:
            defaults = {"run_dir": "runs", "out": "paper_tables.md", "data_dir": "data", "cache_dir": "cache"}
            if any(getattr(args, name) is None for name in defaults):  # what is not given lives in a scratch folder
                scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="paper_tables_")))
                for name, default in defaults.items():
                    setattr(args, name, getattr(args, name) or str(scratch / default))
            stack.enter_context(standins({read_config(c)["data"]["init_args"]["dataset"]
                                          for table in chosen for c in table.configs}))
            stack.enter_context(threads(1))  # tiny problems: one thread spares every op the pool's wake-up
        args.run_dir = args.run_dir or str(ROOT / "runs/paper")
        args.out = args.out or str(DEFAULT_OUT)
        return run_tables(chosen, args)


def run_tables(tables: list[Table], args) -> int:
    common = [f"--data.data_dir={args.data_dir}"] if args.data_dir else []
    common += [f"--data.cache_dir={args.cache_dir}"] if args.cache_dir else []
    common += ["--data.download=true"] if args.download else []
    for setting in args.settings:
        key, equals, value = setting.partition("=")
        if not equals:
            raise SystemExit(f"--set {setting!r}: write key=value, e.g. --set trainer.accelerator=gpu")
        common.append(f"--{key.removeprefix('--')}={value}")
    load_at_start, start = load_average(), time.perf_counter()
    lines_by_table: dict[str, list[dict[str, Any]]] = {table.name: [] for table in tables}
    failed = 0
    for table in tables:
        results: dict[str, tuple[dict | None, str | None]] = {}
        for config in table.configs:
            flags = [*(dry_flags(config) if args.dry_run else []), *common]
            begun = time.perf_counter()
            try:
                results[config] = (run_config(table, config, args, flags), None)
                print(f"[{table.name}] {config}: done in {time.perf_counter() - begun:.1f} s", flush=True)
            except (Exception, SystemExit) as error:  # one config's failure is its rows' status, not the table's end
                failed += 1
                message = f"{type(error).__name__}: {error}".splitlines()[0][:300]
                print(f"[{table.name}] {config}: FAILED {message}\n{traceback.format_exc()}", file=sys.stderr,
                      flush=True)
                results[config] = (None, message)
            lines_by_table[table.name] = [row_line(row, *results[row.config])
                                          for row in table.rows if row.config in results]
            write(tables, lines_by_table, args, load_at_start, start)  # partial results survive a stop
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
