"""A run folder with runs of every kind the dashboard shows, written by the command line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import ROOT
from workbench.__main__ import main

TINY = ["--config", str(ROOT / "configs/synthetic_afl.yaml"), "--trainer.enable_progress_bar=false",
        "--wandb=disabled"]

#: (run name, flags): global one-round heads over α and K (one on harder blobs, named to sort
#: first by path so that sorting by accuracy has to move it), a repeat over the data seed,
#: gradient methods with a learning curve, DeepAFL's depth curve, GH-OFL's heads, the
#: personalized protocol (a global head, AnaPFL's branches, Ditto's personal models by round),
#: and a CNN on raw pixels; the FedAvg runs on a simulated clock (accuracy against simulated time)
RUNS = (
    ("b_alpha0.5_k10", ["--data.alpha=0.5"]),
    ("c_alpha0.1_k10", ["--data.alpha=0.1"]),
    ("d_alpha0.1_k10_seed1", ["--data.alpha=0.1", "--data.seed=1"]),
    ("a_alpha0.5_k20_hard", ["--data.alpha=0.5", "--data.num_clients=20", "--data.synthetic.separation=1.5"]),
    ("e_fedavg", ["--model=FedAvg", "--model.num_rounds=3", "--systems.preset=wifi"]),
    ("f_fedavg_lr", ["--model=FedAvg", "--model.num_rounds=3", "--model.local.lr=0.3", "--systems.preset=wifi"]),
    ("g_deepafl", ["--model=DeepAFL", "--model.num_layers=2", "--model.hidden_dim=16", "--model.block_dim=16"]),
    ("h_ghofl", ["--model=GHOFL", "--model.heads=[nb_diag,lda]"]),
    ("i_afl_personal", ["--data.personalized=true"]),
    ("j_anapfl", ["--data.personalized=true", "--model=AnaPFL", "--model.hidden_dim=32"]),
    ("k_ditto", ["--data.personalized=true", "--model=Ditto", "--model.num_rounds=2"]),
    ("l_scaffold_cnn", ["--data.dataset=mnist5k", "--data.inputs=images", "--data.num_clients=4",
                        "--data.partition=iid", "--model=SCAFFOLD", "--model.architecture=cnn",
                        "--model.num_rounds=1"]),
)


def write_runs(root: Path) -> Path:
    """RUNS into `root`, and beside them: a re-evaluation of one (`test --ckpt_path`), a copy of
    one run under the Flower engine's config, a fit that failed in its first round (its
    status.json), and what a sweep leaves of runs that did not finish: one refused before it
    started, one whose process died after claiming its version folder."""
    for name, flags in RUNS:
        assert main(["fit", *TINY, *flags, f"--run_dir={root}", f"--run_name={name}"]) == 0, name
    fitted = root / "b_alpha0.5_k10" / "version_0"
    assert main(["test", *TINY, "--data.alpha=0.5", f"--run_dir={root}", "--run_name=b_alpha0.5_k10",
                 f"--ckpt_path={fitted / 'model.ckpt'}"]) == 0
    flower = root / "m_flower" / "version_0"
    shutil.copytree(fitted, flower, ignore=shutil.ignore_patterns("*.ckpt"))
    config = flower / "config.yaml"
    config.write_text(config.read_text().replace("engine: lightning", "engine: flower"))
    # fails once its run folder exists: a step size that diverges in round 0
    assert main(["fit", *TINY, "--model=FedAvg", "--model.local.lr=1e30", f"--run_dir={root}",
                 "--run_name=diverged"]) == 2
    refused = root / "sweep" / "alpha=0"
    refused.mkdir(parents=True)
    (refused / "status.json").write_text(json.dumps({
        "status": "failed", "params": {"data.alpha": 0.0},
        "error": "cannot be built: ValueError: data.alpha must be > 0, got 0.0"}))
    died = root / "sweep" / "k=2000"
    (died / "version_0").mkdir(parents=True)
    (died / "status.json").write_text(json.dumps({
        "status": "failed", "params": {"data.num_clients": 2000},
        "error": "Traceback (most recent call last):\nerror: 2000 clients for 2000 samples"}))
    return root


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    return write_runs(tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="session")
def report(run_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    assert main(["compare", str(run_dir), "--out", str(out)]) == 0
    return out
