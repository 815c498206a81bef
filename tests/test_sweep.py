"""Sweep files and the offline sweep runner."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from workbench.__main__ import main
from workbench.report import find_runs, last_value, read_metrics
from workbench.sweep import (
    agent_flags,
    check_runs,
    command_argv,
    error_summary,
    expand_runs,
    load_sweep,
    run_name,
    with_overrides,
)

SWEEPS = sorted((ROOT / "sweeps").glob("*.yaml"))
SYNTHETIC = str(ROOT / "configs/synthetic_afl.yaml")
COMMAND = ["${env}", "python", "-m", "workbench", "fit", "--config"]


def write_sweep(path: Path, parameters: dict, method: str = "grid", config: str = SYNTHETIC,
                **extra) -> Path:
    spec = {"method": method, "parameters": parameters, **extra,
            "command": [*COMMAND, config, "${args}"]}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.mark.parametrize("path", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_sweep_file_follows_the_conventions_and_the_cli_accepts_every_value(path, tmp_path,
                                                                           monkeypatch):
    sweep = load_sweep(path)  # structure, `${args}` after --config, no number written as text
    raw = yaml.safe_load(path.read_text())
    assert raw["program"] and raw["metric"]["goal"] in ("maximize", "minimize")
    assert sweep.command[:len(COMMAND)] == COMMAND and sweep.command[-1] == "${args}"
    assert sweep.command[len(COMMAND) - 1:-1:2] == ["--config"] * len(sweep.configs)  # composed
    for spec in sweep.parameters.values():  # W&B's grid and the CLI both see exact values
        assert spec["distribution"] in ("constant", "categorical", "int_uniform", "q_uniform",
                                        "uniform", "log_uniform_values")
    monkeypatch.chdir(ROOT)  # configs are named relative to the repository, where agents run
    assert sweep.configs and all(Path(config).exists() for config in sweep.configs)
    runs = expand_runs(sweep, count=8 if sweep.method == "random" else None)
    assert len({run_name(values) for values in runs}) == len(runs)
    error, failures = check_runs(sweep, runs, tmp_path)
    assert error is None, f"the CLI rejects a flag of {path.name}:\n{error}"
    assert not failures, {run_name(runs[i]): why for i, why in failures.items()}


def test_the_check_rejects_unknown_keys_wrong_types_and_values_a_constructor_refuses(tmp_path):
    unknown = load_sweep(write_sweep(tmp_path / "unknown.yaml",
                                     {"data.num_clientz": {"values": [5]}}))
    assert "num_clientz" in check_runs(unknown, expand_runs(unknown), tmp_path)[0]
    mistyped = load_sweep(write_sweep(tmp_path / "mistyped.yaml", {
        "data.alpha": {"values": [0.5, 1.0]}, "data.num_clients": {"values": [5, "many"]}}))
    assert "many" in check_runs(mistyped, expand_runs(mistyped), tmp_path)[0]
    refused = load_sweep(write_sweep(tmp_path / "refused.yaml", {
        "data.alpha": {"values": [0.5, 0.0]}, "model.gamma_out": {"values": [1.0, -1.0]}}))
    error, failures = check_runs(refused, expand_runs(refused), tmp_path)
    assert error is None and sorted(failures) == [1, 2, 3]  # all but (α = 0.5, γ_out = 1)
    assert "alpha must be > 0" in failures[2] and "gamma_out must be ≥ 0" in failures[1]


def test_grid_is_the_product_in_file_order_and_names_follow_the_values(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path / "g.yaml", {
        "data.alpha": {"values": [0.1, 1.0]}, "data.num_clients": {"min": 2, "max": 4},
        "model.gamma_out": {"value": 1.0e-4},
        "data.synthetic.seed": {"distribution": "q_uniform", "min": 0, "max": 10, "q": 5}}))
    runs = expand_runs(sweep)
    assert len(runs) == 2 * 3 * 1 * 3
    assert runs[0] == {"data.alpha": 0.1, "data.num_clients": 2, "model.gamma_out": 1.0e-4,
                       "data.synthetic.seed": 0}
    assert [r["data.synthetic.seed"] for r in runs[:3]] == [0, 5, 10]
    assert runs[-1]["data.alpha"] == 1.0 and expand_runs(sweep, count=4) == runs[:4]
    assert agent_flags(runs[0]) == ["--data.alpha=0.1", "--data.num_clients=2",
                                    "--model.gamma_out=0.0001", "--data.synthetic.seed=0"]
    assert run_name(runs[0]) == "alpha=0.1,num_clients=2,gamma_out=0.0001,seed=0"
    assert run_name({"model.seed": 1, "data.seed": 2}) == "model.seed=1,data.seed=2"  # same leaf


def test_the_command_is_the_agents_with_this_python_and_the_run_folder(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path / "c.yaml", {"data.alpha": {"values": [0.5]}}))
    argv = command_argv(sweep, ["--data.alpha=0.5"], tmp_path / "runs" / "c" / "alpha=0.5")
    assert argv[1:] == ["-m", "workbench", "fit", "--config", SYNTHETIC, "--data.alpha=0.5",
                        f"--run_dir={tmp_path / 'runs' / 'c'}", "--run_name=alpha=0.5"]


def test_random_draws_are_seeded_typed_and_in_range(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path / "r.yaml", method="random", parameters={
        "model.gamma": {"distribution": "log_uniform_values", "min": 1.0e-4, "max": 1.0e+2},
        "data.num_clients": {"distribution": "int_uniform", "min": 2, "max": 50},
        "data.alpha": {"min": 0.05, "max": 1.0},
        "data.partition": {"values": ["iid", "dirichlet"], "probabilities": [0.0, 1.0]}}))
    runs = expand_runs(sweep, count=200, seed=3)
    assert runs == expand_runs(sweep, count=200, seed=3) != expand_runs(sweep, count=200, seed=4)
    gammas = [r["model.gamma"] for r in runs]
    assert all(1.0e-4 <= g <= 1.0e+2 for g in gammas)
    assert sum(g < 1.0e-1 for g in gammas) > 50  # log-uniform: half the draws below 10^-1
    clients = [r["data.num_clients"] for r in runs]
    assert all(isinstance(k, int) for k in clients) and min(clients) >= 2 and max(clients) <= 50
    assert all(0.05 <= r["data.alpha"] <= 1.0 for r in runs)
    assert {r["data.partition"] for r in runs} == {"dirichlet"}
    with pytest.raises(ValueError, match="--count"):
        expand_runs(sweep)


@pytest.mark.parametrize("parameters, method, message", [
    ({"data.alpha": {"values": [0.1]}}, "bayes", "W&B server"),
    ({"data.alpha": {"min": 0.1, "max": 1.0}}, "grid", "method: random"),
    ({"model.gamma": {"values": ["1e-4"]}}, "grid", "1.0e-4"),
    ({"data": {"parameters": {"alpha": {"values": [0.1]}}}}, "grid", "dotted name"),
    ({"data.alpha": {"distribution": "beta"}}, "random", "not supported offline"),
])
def test_what_cannot_run_offline_is_a_clear_error(tmp_path, parameters, method, message):
    with pytest.raises(ValueError, match=message):
        sweep = load_sweep(write_sweep(tmp_path / "x.yaml", parameters, method=method))
        expand_runs(sweep, count=2)


def test_args_before_the_config_would_be_overridden_by_it(tmp_path):
    path = tmp_path / "late.yaml"
    path.write_text(yaml.safe_dump({
        "method": "grid", "parameters": {"data.alpha": {"values": [0.1]}},
        "command": ["python", "-m", "workbench", "fit", "${args}", "--config", "c.yaml"]}))
    with pytest.raises(ValueError, match="after --config"):
        load_sweep(path)


def test_error_summary_keeps_the_reason_a_config_error_lists():
    log = ["Traceback (most recent call last):",
           "ValueError: Does not validate against any of the Union subtypes", "Errors:",
           "  - data.alpha must be > 0 for a Dirichlet partition, got 0.0",
           "  - Expected NoneType", "Given value: Namespace(...)"]
    assert error_summary(log) == ("ValueError: Does not validate against any of the Union subtypes"
                                  " — data.alpha must be > 0 for a Dirichlet partition, got 0.0")


@pytest.mark.subprocess
def test_local_sweep_records_a_failure_goes_on_and_skips_complete_runs(tmp_path, capsys):
    """α = 0 is impossible for a Dirichlet partition, which the constructor says: that run is
    recorded as failed without being started. 2000 clients for 2000 samples fail only once the
    data is partitioned: that run starts, fails and the sweep goes on; a second pass finds the
    finished run and starts nothing. (Two subprocesses: each imports Lightning, most of a tiny
    run's time.)"""
    path = write_sweep(tmp_path / "tiny.yaml", {"data.alpha": {"values": [0.0, 0.5]},
                                                "data.num_clients": {"values": [2000, 5]}},
                       metric={"name": "test/acc"})
    run_dir = tmp_path / "runs"
    assert main(["sweep", str(path), "--run_dir", str(run_dir), "--dry_run"]) == 2
    out = capsys.readouterr().out  # the dry run already knows α = 0 cannot be built
    assert "the CLI accepts the flags of all 4 runs; 2 cannot be built" in out
    assert "alpha must be > 0" in out
    assert not run_dir.exists()  # a dry run starts nothing

    assert main(["sweep", str(path), "--run_dir", str(run_dir)]) == 1  # runs failed
    out = capsys.readouterr().out
    assert "[1/4] alpha=0 num_clients=2000 ... FAILED, not started: cannot be built: " in out
    assert "alpha must be > 0" in out
    assert "[3/4] alpha=0.5 num_clients=2000 ... FAILED" in out
    assert "[4/4] alpha=0.5 num_clients=5 ... done test/acc=" in out
    assert "1 done, 0 skipped (already complete), 3 failed" in out
    folder = run_dir / "tiny"
    refused = json.loads((folder / "alpha=0,num_clients=5" / "status.json").read_text())
    assert refused["status"] == "failed" and refused["returncode"] is None
    assert "alpha must be > 0" in refused["error"]
    failed = json.loads((folder / "alpha=0.5,num_clients=2000" / "status.json").read_text())
    assert failed["status"] == "failed" and failed["returncode"] == 2  # a user error: exit 2, no traceback
    assert failed["error"].startswith("error: ") and failed["error_tail"]
    assert not any("Traceback" in line for line in failed["error_tail"])
    done = json.loads((folder / "alpha=0.5,num_clients=5" / "status.json").read_text())
    assert done["status"] == "done" and done["params"] == {"data.alpha": 0.5, "data.num_clients": 5}
    assert done["command"][-2:] == [f"--run_dir={folder}", "--run_name=alpha=0.5,num_clients=5"]
    version = Path(done["version"])
    assert version == folder / "alpha=0.5,num_clients=5" / "version_0"
    config = yaml.safe_load((version / "config.yaml").read_text())
    assert config["data"]["init_args"]["num_clients"] == 5  # the sweep's values reached the run
    logged = read_metrics(version / "metrics.csv")
    assert done["value"] == pytest.approx(last_value(logged, "test/acc"))

    write_sweep(path, {"data.alpha": {"values": [0.5]}, "data.num_clients": {"values": [5]}})
    assert main(["sweep", str(path), "--run_dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "[1/1] alpha=0.5 num_clients=5 ... skipped, complete: test/acc=" in out
    assert "0 done, 1 skipped" in out and not list(folder.glob("*/version_1"))


def test_a_malformed_sweep_file_is_one_line_naming_where(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("method: grid\nparameters:\n  data.alpha: {values: [0.1, 0.5]\ncommand: [x]\n")
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path} is not valid YAML" in err and "line 4" in err and "Traceback" not in err


def test_a_flag_the_cli_rejects_stops_the_sweep_before_any_run(tmp_path, capsys):
    path = write_sweep(tmp_path / "typo.yaml", {"data.num_clientz": {"values": [3, 5]}})
    run_dir = tmp_path / "runs"
    assert main(["sweep", str(path), "--run_dir", str(run_dir)]) == 2
    captured = capsys.readouterr()
    assert "nothing was run" in captured.err and "num_clientz" in captured.err
    assert not run_dir.exists()


def test_overrides_replace_the_config_and_fix_settings_before_the_swept_values(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path / "o.yaml", {"data.alpha": {"values": [0.5]}}))
    composed = with_overrides(sweep, ["configs/method/afl.yaml", "configs/data/mnist5k.yaml"],
                              ["data.num_clients=5", "--model.gamma=2.0"])
    assert composed.command[5:] == ["--config", "configs/method/afl.yaml", "--config",
                                    "configs/data/mnist5k.yaml", "--data.num_clients=5",
                                    "--model.gamma=2.0", "${args}"]
    assert composed.configs == ["configs/method/afl.yaml", "configs/data/mnist5k.yaml"]
    assert composed.name == "o+afl,mnist5k,num_clients=5,gamma=2.0" and sweep.name == "o"
    with pytest.raises(ValueError, match=r"the sweep varies data.alpha"):
        with_overrides(sweep, None, ["data.alpha=0.1"])
    with pytest.raises(ValueError, match="key=value"):
        with_overrides(sweep, None, ["data.alpha"])


@pytest.mark.subprocess
def test_a_failed_run_is_not_retried_unless_asked_and_runs_go_in_parallel(tmp_path, capsys):
    """Two workers; 2000 clients for 2000 samples fails once the data is partitioned, and a
    second pass does not start it again (it would fail alike) unless --retry_failed."""
    path = write_sweep(tmp_path / "par.yaml", {"data.num_clients": {"values": [2000, 5]}})
    run_dir = tmp_path / "runs"
    args = ["sweep", str(path), "--run_dir", str(run_dir), "--workers", "2",
            "--set", "trainer.enable_progress_bar=false", "--set", "wandb=disabled"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert ", 2 at a time" in out and "1 done, 0 skipped (already complete), 1 failed" in out
    name = "par+enable_progress_bar=false,wandb=disabled"
    status = json.loads((run_dir / name / "num_clients=5" / "status.json").read_text())
    assert status["sweep"] == name and "--trainer.enable_progress_bar=false" in status["command"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "[1/2] num_clients=2000 ... FAILED before, not retried (--retry_failed" in out
    assert "0 done, 1 skipped" in out
    assert main([*args, "--retry_failed", "--count", "1"]) == 1
    assert "[1/1] num_clients=2000 ... FAILED (" in capsys.readouterr().out  # started again


@pytest.mark.subprocess
def test_the_demo_sweep_runs_end_to_end_and_is_compared_on_the_dashboard(tmp_path, monkeypatch, capsys):
    """sweeps/demo_analytic.yaml on mnist5k (features extracted into this test's folder): its first two
    runs (α = 0.1, partition seeds 0 and 1), side by side, W&B offline; then the page holds them
    as one row, mean ± std over the seeds."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "runs"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the runs' default feature cache: ~/.cache/workbench
    assert main(["sweep", "sweeps/demo_analytic.yaml", "--run_dir", str(run_dir), "--workers", "2",
                 "--count", "2"]) == 0
    assert "2 runs: 2 done" in capsys.readouterr().out
    runs = find_runs([run_dir / "demo_analytic"])
    assert sorted(run.name for run in runs) == ["alpha=0.1,seed=0/version_0", "alpha=0.1,seed=1/version_0"]
    for run in runs:
        assert run.status == "done" and run.dataset == "mnist5k" and run.wandb_id
        assert run.wall_seconds > run.final("time/fit_s") > 0
        assert json.loads((run.path / "wandb.json").read_text())["mode"] == "offline"
    out = tmp_path / "report"
    assert main(["compare", str(run_dir / "demo_analytic"), "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    assert "(n=2)" in page and all(run.name in page for run in runs)
    assert 'id="fig-final"' in page and 'id="fig-alpha"' in page and "Plotly.react" in page  # drawn in the page
