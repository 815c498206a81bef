"""What the engines' tests share: fits in two processes from the command line, fits over Flower
beside the same fit in process, and Flower's messages built as a server would."""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, fit
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.engines import LightningEngine
from workbench.engines.local import LocalClients
from workbench.engines.round import Replies, RoundRequest
from workbench.federation import Federation
from workbench.federation.compression import Compression
from workbench.federation.local_training import LocalTraining
from workbench.methods import FedAvg

TINY = ["--config", str(ROOT / "configs/synthetic_afl.yaml"), "--trainer.enable_progress_bar=false",
        "--wandb=disabled"]


TWO_PROCESSES = ["--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.accelerator=cpu"]


def fit_in_processes(run_dir: Path, *args: str, limit_s: float = 300) -> subprocess.CompletedProcess:
    """`python -m workbench fit` launched as a command: Lightning starts the second process itself.
    Both run in a session of their own: a fit that has not ended after `limit_s` (about 10 s
    unloaded) fails the test with what it printed, and neither process outlives it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    command = [sys.executable, "-m", "workbench", "fit", *TINY, *TWO_PROCESSES, f"--run_dir={run_dir}",
               "--run_name=ddp", *args]
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as launcher:
        try:
            stdout, stderr = launcher.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and the process it started
            stdout, stderr = launcher.communicate()
            ended = f"the two-process fit had not ended after {limit_s:.0f} s:\n{stdout}\n{stderr}"
            raise AssertionError(ended) from None
        finally:
            try:
                os.killpg(launcher.pid, signal.SIGKILL)  # a second process left behind, once the launcher is done
            except ProcessLookupError:
                pass
    return subprocess.CompletedProcess(command, launcher.returncode, stdout, stderr)


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
                     **options})


#: FedAvg's updates top-k compressed with error feedback: each client keeps a residual (client state)
TOPK = Federation(compression=Compression("topk", topk_fraction=0.2))


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


class DroppingClients(LocalClients):
    """In-process clients whose replies in given rounds never come (`dropped[r]`: client ids), as
    a remote transport reports lost nodes: the reference fit with those clients dropped there
    (they do no work in those rounds) and back, on their own node, in the round after."""

    dropped: dict[int, list[int]]
    away: set[int]

    def update(self, request: RoundRequest) -> Replies:
        gone = [c for c in self.dropped.get(request.round_index, []) if c in request.survivors.tolist()]
        kept = request.survivors[~torch.isin(request.survivors, torch.tensor(gone, dtype=torch.long))]
        replies = super().update(dataclasses.replace(request, survivors=kept))
        replies.missing = dict.fromkeys(gone, "dropped here")
        return replies

    def rejoined(self) -> dict[int, bool]:
        """Those dropped in the last round that are not in the next (`Rejoins`): back, state kept."""
        next_round = self.method.round
        back = self.away - set(self.dropped.get(next_round, []))
        self.away = set(self.dropped.get(next_round, []))
        return dict.fromkeys(sorted(back), False)


@contextlib.contextmanager
def dropping_clients(dropped: dict[int, list[int]]) -> Iterator[None]:
    """In-process fits in the block run their clients as `DroppingClients` losing `dropped`."""
    own = LightningEngine._local_clients

    def local_clients(engine, data) -> DroppingClients:
        clients = DroppingClients(engine.method, data.train.features, data.train.labels, data.client_ids,
                                  data.clients, data.batch_size, engine.federation, engine.stages)
        clients.dropped, clients.away = dropped, set()
        return clients

    LightningEngine._local_clients = local_clients  # type: ignore[method-assign]
    try:
        yield
    finally:
        LightningEngine._local_clients = own  # type: ignore[method-assign]


@pytest.fixture
def as_server(monkeypatch):
    """Lets a test build instruction Messages outside a ServerApp (Flower reads the sender's ids);
    the ClientApp's kept nodes start empty and are put back after the test (a grid swaps them)."""
    from flwr.supercore.task_identity import TaskIdentity

    from workbench.engines.flower import client_app

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value, raising=False)
    monkeypatch.setattr(client_app, "_nodes", {})
