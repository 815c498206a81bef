"""benchmarks/deepafl_fit_time.py: a fit through the command line timed part by part, round by
round; the parts are the engine's own seconds where it has them and fill each round's wall time."""
from __future__ import annotations

import pytest

from benchmarks import deepafl_fit_time
from tests.conftest import ROOT

TINY = ["--config", str(ROOT / "configs/method/deepafl.yaml"), "--config", str(ROOT / "configs/data/synthetic.yaml"),
        "--model.num_layers=3", "--model.hidden_dim=32", "--model.block_dim=32", "--data.num_clients=3",
        "--eval_every=1", "--wandb=disabled", "--trainer.enable_progress_bar=false"]


def test_the_parts_of_each_round_are_the_engines_seconds_and_fill_its_wall_time(tmp_path):
    run = deepafl_fit_time.workbench_run("float64", str(tmp_path), TINY)
    rounds = run["rounds"]
    assert sorted(rounds) == [0, 1, 2, 3]  # T + 1 fused rounds
    fit = run["fit"]
    assert run["parts"]["clients"] + run["parts"]["server"] + run["parts"]["curve"] <= fit
    for index, parts in rounds.items():
        assert all(parts[part] > 0 for part in ("clients", "server", "curve", "checkpoint", "logging")), index
        assert parts["loop"] >= 0 and parts["wall"] == pytest.approx(
            sum(parts[part] for part in deepafl_fit_time.PARTS)), index
    assert 0 < run["accuracy"] <= 1 and run["checkpoint_mb"] > 0
