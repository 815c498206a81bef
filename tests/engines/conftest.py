"""What the engines' tests share: fits in two processes from the command line, and fits over
Flower beside the same fit in process."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.conftest import ROOT, fit
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.federation import Federation
from workbench.federation.compression import Compression
from workbench.federation.local_training import LocalTraining
from workbench.methods import FedAvg

TINY = ["--config", str(ROOT / "configs/synthetic_afl.yaml"), "--trainer.enable_progress_bar=false",
        "--wandb=disabled"]


TWO_PROCESSES = ["--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.accelerator=cpu"]


def fit_in_processes(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m workbench fit` launched as a command: Lightning starts the second process itself."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "workbench", "fit", *TINY, *TWO_PROCESSES, f"--run_dir={run_dir}",
                           "--run_name=ddp", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def saved_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(next(run_dir.glob("*/version_0/model.ckpt")), weights_only=False)["state_dict"]


def logged(run_dir: Path) -> dict[str, float]:
    merged = {}
    for row in csv.DictReader(next(run_dir.glob("*/version_0/metrics.csv")).open()):
        merged.update({k: float(v) for k, v in row.items() if v})
    return merged


COMM = ("comm/rounds", "comm/bytes_up", "comm/bytes_up_per_client", "comm/bytes_down", "comm/clients_in_round")


def three_clients(**options) -> FederatedDataModule:
    # batch_size 128 < the clients' shares: a client computes in chunks
    settings = {"dataset": "synthetic", "num_clients": 3, "partition": "dirichlet", "alpha": 0.5,
                "synthetic": SyntheticBlobs(dim=12, train_size=600, test_size=150), "batch_size": 128, **options}
    return FederatedDataModule(**settings)


def fedavg(**options) -> FedAvg:
    return FedAvg(**{"num_rounds": 3, "architecture": "mlp", "hidden_dim": 16, "local": LocalTraining(batch_size=32),
                     "compression": Compression("topk", topk_fraction=0.2), **options})


def assert_same_state(method, reference, tolerance: float) -> None:
    state, expected = method.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert value.dtype == state[name].dtype, name
        scale = max(1.0, float(value.double().abs().max())) if value.numel() else 1.0
        difference = (state[name].double() - value.double()).abs()
        assert (float(difference.max()) if difference.numel() else 0.0) <= tolerance * scale, name


def over_both(make, data_options: dict, federation: Federation | None, tmp_path):
    """The method `make()` builds, fitted over a Flower simulation and in process (then tested):
    (the Flower run's engine, the in-process engine)."""
    from workbench.engines.flower import simulation  # the `flower` extra

    reference = make()
    engine_here = fit(reference, three_clients(**data_options), federation)
    engine_here.trainer.test(engine_here, datamodule=engine_here.trainer.datamodule, verbose=False)
    method = make()
    engine = simulation.fit_over_flower(method, three_clients(**data_options), federation,
                                        {"default_root_dir": tmp_path})
    return engine, engine_here
