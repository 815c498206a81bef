"""A real Flower deployment on loopback: a SuperLink, three SuperNodes started with `--isolation
process`, each beside the workbench's long-lived ClientApp (`python -m workbench.engines.flower.node`),
fits submitted with `server_app submit` (tier `deployment`, in `.ci/run`; a few minutes).

- A SuperNode killed by its process id mid-fit: the fit finishes; its client is dropped from the
  rounds it missed (`client_events.csv`) and serves again once its SuperNode is restarted; the
  model is the in-process fit's with that client dropped in exactly those rounds; the killed
  node's ClientApp process leaves with it.
- Every SuperNode killed: the fit cannot go on; `submit` exits 1 naming the lost clients and the
  checkpoint; the fit resumed from it on restarted nodes is the in-process fit that never stopped.
"""
from __future__ import annotations

import csv
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr", reason="a Flower deployment needs the `flower` extra: pip install -e '.[flower]'")

from tests.conftest import ROOT
from tests.engines.conftest import dropping_clients
from workbench.engines.flower.local_deployment import BIN, LocalDeployment
from workbench.experiment import run

pytestmark = pytest.mark.deployment
CLIENTS = 3
FIT = ["--config", str(ROOT / "configs/method/fedavg.yaml"), "--config", str(ROOT / "configs/data/synthetic.yaml"),
       f"--data.num_clients={CLIENTS}", "--wandb=disabled", "--trainer.enable_progress_bar=false",
       "--flower.deadline_s=20"]  # a deployed round takes 3-5 s (the SuperNodes poll every 3 s)


def wait_until(condition, limit_s: float, what: str, every_s: float = 0.5):
    deadline = time.monotonic() + limit_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {limit_s:.0f} s")
        time.sleep(every_s)
    return value


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    if shutil.which("flower-superlink", path=str(BIN)) is None:
        pytest.skip("flower-superlink is not in this venv: pip install -e '.[flower]'")
    federation = LocalDeployment(tmp_path_factory.mktemp("flower"), CLIENTS, isolation="process",
                                 env={"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"})
    try:
        yield federation
    finally:
        stayed = federation.stop()
        print("\n".join(f"---- {log.name}\n{log.read_text()[-3000:]}" for log in sorted(federation.logs.iterdir())))
    assert not stayed, f"outlived their SuperNodes: {stayed}"


def submit(federation: LocalDeployment, *args: str) -> subprocess.Popen:
    return federation.submit([*FIT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rounds_done(folder: Path) -> int:
    metrics = folder / "metrics.csv"
    if not metrics.exists():
        return 0
    return max((int(float(row["comm/rounds"])) for row in csv.DictReader(metrics.open()) if row.get("comm/rounds")),
               default=0)


def events(folder: Path) -> list[dict]:
    path = folder / "client_events.csv"
    return list(csv.DictReader(path.open())) if path.exists() else []


def in_process(tmp_path: Path, args: list[str], dropped: dict[int, list[int]]) -> dict[str, torch.Tensor]:
    with dropping_clients(dropped):
        cli = run(["fit", *FIT, f"--run_dir={tmp_path / 'here'}", *args])
    return cli.method.state_dict()


def assert_same_model(saved: Path, reference: dict[str, torch.Tensor]) -> None:
    state = torch.load(saved, weights_only=False)["state_dict"]
    for name, value in reference.items():
        assert torch.allclose(state[f"method.{name}"].double(), value.double(), atol=1e-6, rtol=0), name


def test_a_supernode_killed_mid_fit_is_dropped_and_the_fit_finishes_as_in_process(deployment, tmp_path):
    args = ["--model.num_rounds=16", f"--run_dir={tmp_path}", "--run_name=lost"]
    submitted = submit(deployment, *args)
    folder = tmp_path / "lost" / "version_0"
    wait_until(lambda: rounds_done(folder) >= 2, 300, "two rounds over the deployment")
    client_app = deployment.kill_node(1)
    client_app.wait(timeout=10)  # the killed node's ClientApp process leaves with it
    wait_until(lambda: any(e["client"] == "1" for e in events(folder)), 60, "client 1 missing")
    deployment.start_node(1)  # restarted: a new SuperNode holding partition 1
    _out, err = submitted.communicate(timeout=600)
    assert submitted.returncode == 0, err[-3000:]
    happened = events(folder)
    missing = sorted(int(e["round"]) for e in happened if e["event"] == "missing")
    assert missing and all(e["client"] == "1" for e in happened), happened
    assert missing == list(range(missing[0], missing[-1] + 1))  # away until it rejoined
    assert [e for e in happened if e["event"] == "rejoined"], happened  # back before the last round
    reference = in_process(tmp_path, args, {r: [1] for r in missing})
    assert_same_model(folder / "model.ckpt", reference)


def test_a_fit_that_cannot_go_on_fails_naming_its_clients_and_resumes_from_its_checkpoint(deployment, tmp_path):
    args = ["--model.num_rounds=6", f"--run_dir={tmp_path}", "--run_name=stopped"]
    submitted = submit(deployment, *args)
    folder = tmp_path / "stopped" / "version_0"
    wait_until(lambda: rounds_done(folder) >= 1, 300, "a round over the deployment")
    client_apps = [deployment.kill_node(partition) for partition in range(CLIENTS)]
    _, err = submitted.communicate(timeout=300)
    assert submitted.returncode == 1, err[-3000:]
    assert "no client's reply reached the server (client 0" in err and "client 2" in err, err[-3000:]
    assert f"{folder / 'last.ckpt'}: resume with the same workbench-args and --ckpt_path last" in err
    for client_app in client_apps:
        client_app.wait(timeout=10)
    for partition in range(CLIENTS):
        deployment.start_node(partition)
    resumed = submit(deployment, *args, "--ckpt_path=last")
    _out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert_same_model(tmp_path / "stopped" / "version_1" / "model.ckpt", in_process(tmp_path, args, {}))
