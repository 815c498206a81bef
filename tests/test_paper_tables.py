"""The papers' headline tables: benchmarks/paper_numbers.yaml, the configs under configs/paper/,
the sweeps that run them and benchmarks/paper_tables.py.

The data file names every paper config and each row's source; each table's sweep runs exactly its
table's configs, and composed as the sweep composes them (its command's data config, then the
row's file as `--config=<file>`) each resolves to the file alone. The dry run builds and fits
every config of every table on stand-ins (tiny data of each dataset's class count, a random-init
test_resnet / test_vit, K ≤ 4, cut-down methods) and writes the report with our numbers beside the
papers'. (Each paper config alone, and as its method and data files composed with its keys:
test_configs.py.)"""
from __future__ import annotations

import csv
import functools
import time
from pathlib import Path

import pytest
import torch
import yaml

from benchmarks import paper_tables
from tests.conftest import ROOT
from workbench.data.registry import DATASETS
from workbench.sweep import cli_arguments, command_argv, expand_runs, load_sweep, parse_config

TABLES = paper_tables.load_tables()
PAPER_CONFIGS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs/paper").glob("*/*.yaml"))


@functools.cache
def resolved(*arguments: str) -> str:
    config, error = parse_config(["fit", *arguments])
    assert error is None, f"{' '.join(arguments)}: {error}"
    return yaml.safe_dump(config)


def test_every_paper_config_is_a_row_and_every_row_names_its_source():
    rows = [row for table in TABLES.values() for row in table.rows]
    assert sorted({row.config for row in rows}) == PAPER_CONFIGS  # no config without a row, no row without a file
    for row in rows:
        assert row.source and 0 < row.paper < 100, row
        metric_ok = row.metric in ("test/acc", "test/acc_local_mean") or row.metric.startswith("test/acc/")
        assert metric_ok, row
    names = [(row.table, row.row) for row in rows]
    assert len(names) == len(set(names))
    for table in TABLES.values():
        assert table.protocol and all(p["from"] for p in table.protocol), table.name
    # the headline numbers of the seeds' README are all here
    numbers = {(row.table, row.row): row.paper for row in rows}
    assert numbers["safle", "SAFLe, CIFAR-10"] == 90.73 and numbers["safle", "FedAvg, CIFAR-100 α = 0.01"] == 32.99
    assert numbers["ghofl", "FedCGS, SVHN"] == 57.77 and numbers["anapfl", "AnaPFL, CIFAR-100 K = 50 α = 0.1"] == 80.64
    assert numbers["osfed", "OS-FED 4×4, features + MLP head"] == 44.9


@pytest.mark.parametrize("name", sorted(TABLES))
def test_a_tables_sweep_runs_its_configs_each_as_the_file_alone_resolves(name, monkeypatch):
    table = TABLES[name]
    monkeypatch.chdir(ROOT)  # the sweep names its files relative to the repository, as agents run it
    sweep = load_sweep(ROOT / table.sweep)
    runs = expand_runs(sweep)
    assert sorted(values["config"] for values in runs) == sorted(table.configs)  # each config once
    for config in table.configs:
        argv = cli_arguments(command_argv(sweep, [f"--config={config}"], ROOT / "unused"))
        composed = [token for token in argv[1:] if not token.startswith(("--run_dir", "--run_name"))]
        assert resolved(*composed) == resolved("--config", config), config


def test_the_deepafl_sweep_runs_the_tables_deepafl_rows_over_depth(monkeypatch):
    monkeypatch.chdir(ROOT)
    sweep = load_sweep(ROOT / "sweeps/paper_deepafl.yaml")
    deepafl = [row.config for row in TABLES["safle"].rows if row.row.startswith("DeepAFL")]
    runs = expand_runs(sweep)
    assert {values["config"] for values in runs} == set(deepafl)
    assert {values["model.num_layers"] for values in runs} == {5, 20, 50}  # 20: the table's rows


@pytest.mark.parametrize("chosen", [
    pytest.param(["ghofl", "anapfl"], id="two-tables"),  # the fast tier: 3 datasets, 2 backbones, 5 configs
    pytest.param(list(TABLES), id="every-table", marks=pytest.mark.slow),  # all 25 configs, about a minute
])
def test_the_dry_run_fits_the_tables_and_writes_ours_beside_the_papers(chosen, tmp_path, capsys):
    import timm

    if not {"test_resnet", "test_vit"} <= set(timm.list_models("test_*")):  # timm's stand-ins came after 1.0.3
        pytest.skip(f"timm {timm.__version__} has no test_resnet/test_vit stand-ins: pip install -U timm")
    out = tmp_path / "tables.md"
    threads = torch.get_num_threads()
    start = time.perf_counter()
    code = paper_tables.main(["--dry_run", "--tables", *chosen, "--out", str(out), "--run_dir", str(tmp_path / "runs"),
                              "--data_dir", str(tmp_path / "data"), "--cache_dir", str(tmp_path / "cache")])
    seconds = time.perf_counter() - start
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    report = out.read_text()
    with open(out.with_suffix(".csv")) as handle:
        lines = list(csv.DictReader(handle))
    tables = [table for name, table in TABLES.items() if name in chosen]
    rows = [row for table in tables for row in table.rows]
    assert [(line["table"], line["row"]) for line in lines] == [(row.table, row.row) for row in rows]
    for line, row in zip(lines, rows, strict=True):
        assert line["status"] == "done", line
        assert float(line["paper"]) == row.paper and 0 <= float(line["ours"]) <= 100
        assert float(line["delta"]) == pytest.approx(float(line["ours"]) - row.paper, abs=1e-3)
        assert int(line["rounds"]) >= 1 and float(line["mb_up_per_client"]) > 0 and float(line["wall_s"]) > 0
    assert "Dry run" in report and all(row.row in report for row in rows)
    if "safle" in chosen:
        assert "| FedAvg, CIFAR-10 (lr " in report  # the tuned row names the rate the hold-outs chose
    for table in tables:
        assert f"## {table.name}: {table.title}" in report and "not stated in the paper" in report
    # one result.json per config (GH-OFL's heads share one run), the stand-ins gone, the threads back
    configs = [path for path in PAPER_CONFIGS if Path(path).parent.name in chosen]
    assert len(list((tmp_path / "runs").glob("*/*/result.json"))) == len(configs)
    assert not DATASETS.names("standin_*") and torch.get_num_threads() == threads
    print(f"dry run of {len(configs)} configs: {seconds:.1f} s")
