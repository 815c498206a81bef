"""Fits survive interruption: a fit stopped by a real signal after round r writes `last.ckpt` and
exits non-zero; `fit --ckpt_path last` continues it to the same model, bit for bit on CPU, with
the same cumulative traffic. Each fit is a `python -m workbench fit` process on tiny data."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from workbench.experiment import SIGNAL_AFTER_ROUND_ENV

pytestmark = pytest.mark.subprocess  # every fit here is a process of its own

DATA = ["--data=FederatedDataModule", "--data.dataset=synthetic", "--data.num_clients=4",
        "--data.partition=iid", "--data.synthetic.train_size=240", "--data.synthetic.test_size=60",
        "--data.synthetic.dim=8", "--data.synthetic.num_classes=3"]
COMMON = ["--trainer.enable_progress_bar=false", "--wandb=disabled", "--run_name=run", *DATA]
# method: (its settings, rounds of the uninterrupted fit, rounds of the interrupted one, signal, stop after)
METHODS = {
    "fedavg_linear": (["--model=FedAvg", "--model.architecture=linear", "--model.local.epochs=1"], 4, 3, "TERM", 2),
    "fedavg_mlp": (["--model=FedAvg", "--model.architecture=mlp", "--model.hidden_dim=8"], 3, 3, "INT", 1),
    "deepafl": (["--model=DeepAFL", "--model.num_layers=2", "--model.hidden_dim=16", "--model.block_dim=16"],
                None, None, "TERM", 2),
    "osfed": (["--model=OSFED", "--model.hidden_dim=8", "--model.snapshot.lbfgs_steps=5"], 3, 3, "TERM", 1),
    # a deadline (client 2's link is the slowest): the resumed fit drops the same stragglers, with the
    # clock's measurements from the checkpoint
    "fedavg_deadline": (["--model=FedAvg", "--model.architecture=linear", "--systems.preset=cellular",
                         "--systems.row_s=1e-4", "--systems.deadline_s=0.1"], 4, 4, "TERM", 2),
    # sampled clients: the checkpoint's table of control variates holds only those that took part
    "scaffold_sampled": (["--model=SCAFFOLD", "--model.architecture=linear", "--model.sample_fraction=0.5"],
                         4, 4, "TERM", 1),
    # the compress stage's error feedback: each client's residual, held by the client half, checkpointed
    "fedavg_topk": (["--model=FedAvg", "--model.architecture=linear", "--federation.compression.kind=topk",
                     "--federation.compression.topk_fraction=0.3"], 4, 4, "TERM", 2),
}
KEEPS = "osfed"  # its resume keeps the interrupted fit's last.ckpt (--keep_resumed_checkpoint)


def start(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if k != SIGNAL_AFTER_ROUND_ENV}
    env = {**base, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "workbench", "fit", *COMMON, f"--run_dir={run_dir}", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> tuple[int, str]:
    out, _ = process.communicate(timeout=600)
    return process.returncode, out


def rounds(count: int | None) -> list[str]:
    return [] if count is None else [f"--model.num_rounds={count}"]


def state(version: Path) -> dict[str, torch.Tensor]:
    return torch.load(version / "model.ckpt", weights_only=False)["state_dict"]


def last_logged(version: Path, metric: str) -> float:
    values = [float(row[metric]) for row in csv.DictReader((version / "metrics.csv").open()) if row.get(metric)]
    return values[-1]


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """For every method: an uninterrupted fit, and one stopped by a signal then resumed."""
    root = tmp_path_factory.mktemp("resume")
    whole, stopped = {}, {}
    for name, (settings, total, first, sig, after) in METHODS.items():
        whole[name] = start(root / name / "whole", *settings, *rounds(total))
        stopped[name] = start(root / name / "parts", *settings, *rounds(first),
                              env={SIGNAL_AFTER_ROUND_ENV: f"{after}:SIG{sig}"})
    results = {name: {"whole": finish(p)} for name, p in whole.items()}
    for name, process in stopped.items():
        results[name]["stopped"] = finish(process)
        interrupted = root / name / "parts" / "run" / "version_0" / "last.ckpt"
        if interrupted.exists():  # (the resume below retires it)
            saved = torch.load(interrupted, weights_only=False)
            results[name]["stopped_after"] = int(saved["state_dict"]["method.rounds_done"])
    resumed = {name: start(root / name / "parts", *settings, *rounds(total), "--ckpt_path=last",
                           *(["--keep_resumed_checkpoint=true"] if name == KEEPS else []))
               for name, (settings, total, *_) in METHODS.items()}
    for name, process in resumed.items():
        results[name]["resumed"] = finish(process)
    return root, results


@pytest.mark.parametrize("name", list(METHODS))
def test_an_interrupted_fit_resumed_gives_the_same_model_and_traffic(fits, name):
    root, results = fits
    *_, sig, after = METHODS[name]
    code, out = results[name]["whole"]
    assert code == 0, out
    code, out = results[name]["stopped"]
    assert code == 128 + getattr(signal, f"SIG{sig}"), out
    assert f"stopped after round {after}" in out and "--ckpt_path last" in out
    interrupted = root / name / "parts" / "run" / "version_0"
    assert results[name]["stopped_after"] == after and not (interrupted / "model.ckpt").exists()
    assert not [p for p in interrupted.iterdir() if p.name.endswith(".tmp")]  # written by rename only
    code, out = results[name]["resumed"]
    assert code == 0, out
    assert f"resuming from {interrupted / 'last.ckpt'}" in out
    whole = root / name / "whole" / "run" / "version_0"
    resumed = root / name / "parts" / "run" / "version_1"
    # the resumed fit's own checkpoints retire the one it came from (unless asked to keep it), and
    # the interrupted folder says where the fit went on
    assert (interrupted / "last.ckpt").exists() == (name == KEEPS)
    status = json.loads((interrupted / "status.json").read_text())
    assert status["status"] == ("stopped" if name == KEEPS else "continued"), status
    if name != KEEPS:
        assert status["continued_in"] == str(resumed) and status["command"]  # (the stop's own record kept)
    expected, got = state(whole), state(resumed)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    for metric in ("comm/bytes_up", "comm/bytes_down", "comm/rounds"):
        assert last_logged(resumed, metric) == last_logged(whole, metric), metric
    if "--systems.deadline_s=0.1" in METHODS[name][0]:  # the clock goes on: one straggler a round
        assert last_logged(resumed, "latency/stragglers_total") == last_logged(whole, "latency/stragglers_total") == 4
        # the simulated seconds are the links' and the clients' (the same) plus the server's own, measured
        links = [last_logged(run, "latency/total_s") - last_logged(run, "time/server_s") for run in (resumed, whole)]
        assert links[0] == pytest.approx(links[1], rel=1e-5, abs=1e-6)
    # the interrupted run logged its rounds; the resumed one starts at the next
    assert last_logged(interrupted, "comm/rounds") == after
    rows = [row for row in csv.DictReader((resumed / "metrics.csv").open()) if row.get("comm/rounds")]
    assert float(rows[0]["comm/rounds"]) == after + 1


def test_resuming_a_finished_fit_or_with_no_checkpoint_says_what_to_do(fits, tmp_path):
    root, _ = fits
    settings, total, *_ = METHODS["fedavg_linear"]
    code, out = finish(start(tmp_path, *settings, "--ckpt_path=last"))
    assert code != 0 and "no last.ckpt under" in out
    done = root / "fedavg_linear" / "whole" / "run" / "version_0" / "last.ckpt"
    code, out = finish(start(tmp_path, *settings, *rounds(total + 2), f"--ckpt_path={done}"))  # "run longer"
    assert code == 2 and "error: this checkpoint is of a finished fit" in out and "Traceback" not in out


def test_without_checkpoint_every_round_only_a_stop_writes_last(tmp_path):
    settings = METHODS["fedavg_linear"][0]
    code, out = finish(start(tmp_path / "plain", *settings, *rounds(2), "--checkpoint_every_round=false"))
    assert code == 0, out
    assert not (tmp_path / "plain" / "run" / "version_0" / "last.ckpt").exists()


def test_concurrent_runs_claim_version_folders_of_their_own(tmp_path):
    settings = METHODS["fedavg_linear"][0]
    processes = [start(tmp_path, *settings, *rounds(1), f"--model.local.lr={lr}") for lr in (0.1, 0.2, 0.3)]
    for process in processes:
        code, out = finish(process)
        assert code == 0, out
    versions = sorted((tmp_path / "run").glob("version_*"))
    assert [v.name for v in versions] == ["version_0", "version_1", "version_2"]
    lrs = set()
    for version in versions:
        assert (version / "model.ckpt").exists() and (version / "metrics.csv").exists()
        config = (version / "config.yaml").read_text()
        lrs |= {lr for lr in ("0.1", "0.2", "0.3") if f"lr: {lr}" in config}
        saved = torch.load(version / "model.ckpt", weights_only=False)["workbench"]["settings"]
        assert f"lr: {saved['local']['lr']}" in config  # each folder's model is the one its config made
    assert lrs == {"0.1", "0.2", "0.3"}
