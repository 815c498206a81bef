"""Every method on every engine: the same model, the same bytes.

Engines checked here, each against in process (one vectorized client call per round):
- clients one by one, each a half of its own built from a fresh copy of the method's settings:
  the split of any method is exact and its clients never read the server's state;
- Flower's messages without Ray: the Flower transport and the real ClientApp, every node with its
  own `Context.state`, over a loopback grid that delivers each message in this process (fast);
- a Flower simulation on Ray (marked `flower`: tens of seconds a method);
- two CPU processes (Lightning's DDP, gloo).
The protocol's parts (dropouts, secure aggregation, noise) are checked under each engine where a
method supports them.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from tests.conftest import ROOT, quiet_trainer, relative_error
from tests.engines.conformance import METHODS, PROTOCOLS, comparable_state, data, protocol_of, supports
from workbench.engines.local import LocalClients
from workbench.engines.round import Replies, RoundRequest, add_metrics
from workbench.federation import Federation, codec

pytestmark = pytest.mark.usefixtures("one_thread")


class OneByOneClients:
    """A transport that runs every client alone, each with a client half of its own made by a
    fresh copy of the method (built from its init arguments: no learned state)."""

    def __init__(self, method, dm, federation: Federation) -> None:
        self.method, self.nodes = method, {}
        for k in torch.unique(dm.train_client_ids).tolist():
            fresh = type(method)(**{key: value for key, value in method.hparams_initial.items()})
            fresh.setup(method.problem)
            mine = dm.train_client_ids == k
            self.nodes[k] = LocalClients(fresh, dm.train_features[mine], dm.train_labels[mine],
                                         dm.train_client_ids[mine], torch.tensor([k]), dm.hparams.batch_size,
                                         federation)

    def update(self, request: RoundRequest) -> Replies:
        total, parts = Replies(), []
        nobody = torch.tensor([], dtype=torch.long)
        for k in sorted(request.survivors.tolist() + request.lost.tolist()):
            survives = k in request.survivors
            alone = replace(request, survivors=torch.tensor([k]) if survives else nobody,
                            lost=nobody if survives else torch.tensor([k]))
            reply = self.nodes[k].update(alone)
            if not survives:
                continue
            if reply.uploads is not None:  # one client's uploads, combined in client order
                parts.append(reply.uploads)
            total.masked = reply.masked if request.secure is not None else None
            total.layout = reply.layout
            total.bytes_up += reply.bytes_up
            add_metrics(total.metric_sums, reply.metric_sums)
        total.uploads = codec.combine(parts, request.spec) if parts else None
        return total

    def finish(self, broadcast):
        sums = {}
        for node in self.nodes.values():
            add_metrics(sums, node.finish(broadcast)[0])
        return sums, 0.0

    def predict(self, features, client_ids):
        logits = None
        for k, node in self.nodes.items():
            mine = client_ids == k
            if mine.any():
                out = node.predict(features[mine], client_ids[mine])
                logits = out.new_zeros(len(features), out.shape[1]) if logits is None else logits
                logits[mine] = out
        return logits


def fit(name: str, federation: Federation | None = None, one_by_one: bool = False):
    """Row `name`'s fit and test under `federation` (default: the row's own, `protocol_of`)."""
    from workbench.engines import LightningEngine

    federation = federation if federation is not None else protocol_of(name)
    build, _ = METHODS[name]
    method, dm = build(), data(name=name)
    clients = None
    if one_by_one:
        from workbench.methods.base import Problem

        method.setup(Problem.of(dm.population()))
        clients = OneByOneClients(method, dm, federation)
    engine = LightningEngine(method, federation, clients=clients)
    trainer = quiet_trainer()
    trainer.fit(engine, datamodule=dm)
    tested = trainer.test(engine, datamodule=dm, verbose=False)
    return method, engine, tested


def assert_same_run(name, reference, other) -> None:
    (method_a, engine_a, tested_a), (method_b, engine_b, tested_b) = reference, other
    tolerance = METHODS[name][1]
    a, b = comparable_state(method_a), comparable_state(method_b)
    assert a.keys() == b.keys()
    for key in a:
        assert relative_error(b[key], a[key]) <= tolerance, key
    for key in ("comm/bytes_up", "comm/bytes_down", "comm/rounds"):
        assert engine_b.fit_metrics[key] == engine_a.fit_metrics[key], key
    for key, value in tested_a[0].items():
        assert tested_b[0][key] == pytest.approx(value, abs=1e-12), key
    assert_same_curve(engine_a.curve, engine_b.curve)


def assert_same_curve(reference: list[dict], other: list[dict]) -> None:
    """The learning curve: the same rounds scored, the same accuracies, the same bytes so far."""
    assert reference, "no learning curve"
    assert [point.keys() for point in other] == [point.keys() for point in reference]
    for mine, theirs in zip(reference, other, strict=True):
        for key, value in mine.items():
            assert theirs[key] == pytest.approx(value, abs=1e-12), (mine["round"], key)


@pytest.mark.parametrize("name", list(METHODS))
def test_clients_one_by_one_give_the_vectorized_round(name):
    assert_same_run(name, fit(name), fit(name, one_by_one=True))


# every method under every part of the protocol it takes part in (`conformance.supports`)
SUPPORTED = [(name, protocol) for name in METHODS for protocol in PROTOCOLS if supports(name, protocol)]


@pytest.mark.parametrize("name, protocol", SUPPORTED)
def test_the_protocol_applies_alike_to_clients_one_by_one(name, protocol):
    federation = protocol_of(name, protocol)
    assert_same_run(name, fit(name, federation), fit(name, federation, one_by_one=True))


@pytest.mark.subprocess
def test_two_processes_give_every_methods_model(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    script = ROOT / "tests/engines/conformance.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in METHODS:
        method, engine, tested = fit(name)
        saved = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        for key, value in comparable_state(method).items():
            assert relative_error(saved["state"][key], value) <= METHODS[name][1], (name, key)
        for key in ("comm/bytes_up", "comm/bytes_down", "comm/rounds"):
            assert saved["metrics"][key] == engine.fit_metrics[key], (name, key)
        for key, value in tested[0].items():
            assert saved["tested"][0][key] == pytest.approx(value, abs=1e-12), (name, key)
        assert_same_curve(engine.curve, saved["curve"])


# ---- Flower -------------------------------------------------------------------------------------
@pytest.fixture
def loopback(monkeypatch):
    pytest.importorskip("flwr", reason="the Flower engine needs the `flower` extra: pip install -e '.[flower]'")
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):  # a ServerApp's identity
        monkeypatch.setattr(TaskIdentity, name, value, raising=False)


def fit_over_loopback(name: str, federation: Federation | None = None):
    from workbench.engines import LightningEngine
    from workbench.engines.flower.loopback import LoopbackGrid
    from workbench.engines.flower.simulation import fit_over_grid

    build, _ = METHODS[name]
    method, dm = build(), data(name=name)
    engine = LightningEngine(method, federation)
    trainer = quiet_trainer()
    run = fit_over_grid(LoopbackGrid(dm.num_clients), trainer, engine, dm)
    return method, engine, run.test_results


@pytest.mark.parametrize("name, protocol", [(name, None) for name in METHODS] + SUPPORTED)
def test_flowers_messages_give_the_in_process_run(loopback, name, protocol):
    federation = protocol_of(name, protocol)
    assert_same_run(name, fit(name, federation), fit_over_loopback(name, federation))


@pytest.mark.ray
@pytest.mark.parametrize("name", list(METHODS))
def test_a_flower_simulation_gives_the_in_process_run(name, tmp_path):
    pytest.importorskip("ray", reason="Flower simulations need Ray: pip install -e '.[flower]'")
    from workbench.engines.flower.simulation import fit_over_flower

    build, _ = METHODS[name]
    engine = fit_over_flower(build(), data(name=name), protocol_of(name), {"default_root_dir": tmp_path})
    assert_same_run(name, fit(name), (engine.method, engine, engine.flower_run.test_results))
