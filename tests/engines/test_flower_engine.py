"""The Flower engine: the same method over Flower gives the in-process model and bytes.

The pure parts (codec, spec, a node's kept state, the ClientApp's handlers called directly) are
fast; the tests marked `flower` start a Ray simulation (tens of seconds: Ray's start and the
client processes' imports). All skip where the `flower` extra is not installed.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

pytest.importorskip("flwr", reason="the Flower engine needs the `flower` extra: pip install -e '.[flower]'")
pytest.importorskip("ray", reason="Flower simulations need Ray: pip install -e '.[flower]'")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from tests.engines.conformance import METHODS, protocol_of
from tests.engines.conformance import data as conformance_data
from tests.engines.conftest import COMM, TOPK, assert_same_state, fedavg, over_both, three_clients
from workbench.engines.flower import client_app, server_app
from workbench.engines.flower.loopback import LoopbackGrid
from workbench.engines.flower.spec import RunSpec, from_record, half_state, record_views, restore_half, to_record
from workbench.federation import codec
from workbench.federation.client_step import client_step
from workbench.federation.local_training import LocalTraining
from workbench.federation.secure_aggregation import SecureAggregator
from workbench.federation.stages import Pipeline
from workbench.methods import AFL, FedAvg
from workbench.methods.base import Problem

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- pure parts ----------------------------------------------------------------------------------
def test_symmetric_uploads_travel_as_upper_triangles_through_a_record():
    x = torch.randn(50, 6, dtype=torch.float64)
    uploads = {"gram": x.T @ x, "cross": torch.randn(6, 3, dtype=torch.float64), "count": torch.tensor(3)}
    packed = codec.pack(uploads, frozenset({"gram"}))
    assert packed["gram"].shape == (21,)
    record = to_record(packed)
    assert record.count_bytes() > codec.upload_bytes(uploads, AFL.uploads | {"count": FedAvg.uploads["update"]})
    restored = codec.unpack(from_record(record), frozenset({"gram"}))
    for name, value in uploads.items():
        assert torch.equal(restored[name], value), name


def test_a_record_holds_the_bytes_flower_writes_and_gives_writable_tensors():
    tensors = {"matrix": torch.randn(5, 3, dtype=torch.float64), "transposed": torch.randn(3, 4).T,
               "scalar": torch.tensor(7), "flags": torch.tensor([True, False]), "empty": torch.zeros(0, 2)}
    record, flowers = to_record(tensors), ArrayRecord({name: value.contiguous() for name, value in tensors.items()})
    assert list(record) == list(tensors)
    for name in tensors:
        assert record[name].data == flowers[name].data and record[name].shape == flowers[name].shape, name
    for name, value in from_record(record).items():
        assert torch.equal(value, tensors[name]), name
        value.add_(1) if value.dtype != torch.bool else value.logical_not_()  # writable, its own memory
    assert torch.equal(from_record(record)["matrix"], tensors["matrix"])
    views = record_views(flowers)  # over the bytes, as Flower's own Arrays hold them
    assert all(torch.equal(views[name], value) for name, value in tensors.items())


def test_a_client_rebuilds_the_same_method_and_data_from_the_spec():
    method, data = fedavg(local=LocalTraining(lr=0.1, batch_size=32)), three_clients()
    spec = RunSpec.from_record(RunSpec.of(method, data).to_record())
    rebuilt, rebuilt_data = spec.build_method(), spec.build_data()
    assert type(rebuilt) is FedAvg and dict(rebuilt.hparams_initial) == dict(method.hparams_initial)
    assert rebuilt_data.synthetic == data.synthetic  # a dataclass argument survives the JSON
    share = client_app.client_data(spec, 1, 3)
    data.setup("fit")
    assert share.client == 1
    assert torch.equal(share.share.train.features, data.train_features[data.train_client_ids == 1])
    with pytest.raises(ValueError, match=r"num-partitions = 4 .* has 3 clients"):
        client_app.client_data(spec, 1, 4)
    with pytest.raises(ValueError, match="unknown method 'Trainer'"):
        RunSpec("Trainer", "{}", spec.data, spec.data_args).build_method()


def test_a_half_keeps_every_buffer_and_parameter_through_a_record():
    method = fedavg()
    method.setup(Problem((12,), 4, 3))
    half = method.client_half()
    half.setup_clients(torch.tensor([1]), 10)
    for value in half_state(half).values():
        value.add_(1) if value.is_floating_point() else None
    half.register_buffer("cache", torch.ones(4), persistent=False)  # one a later round allocated
    record = to_record(half_state(half))
    fresh = method.client_half()
    fresh.setup_clients(torch.tensor([1]), 10)
    restore_half(fresh, record_views(record))
    for name, value in half_state(half).items():
        assert torch.equal(half_state(fresh)[name], value), name
    fresh.cache.add_(1)  # the restored half owns its tensors: the record's bytes stay as saved
    assert torch.equal(record_views(record)["cache"], torch.ones(4))


def fake_context(client: int, num_clients: int = 3) -> Context:
    return Context(run_id=1, node_id=100 + client, node_config={"partition-id": client, "num-partitions": num_clients},
                   state=RecordDict(), run_config={})


def introduced(spec: RunSpec, client: int, session: str = "s") -> Context:
    """A node's context after the fit's first message (the only one with the spec)."""
    context = fake_context(client)
    content = RecordDict({"spec": spec.to_record(), "round": ConfigRecord({"session": session, "spec": spec.digest})})
    reply = client_app.introduce(Message(content, dst_node_id=context.node_id, message_type="query"), context)
    assert reply.content["report"]["client_id"] == client
    return context


def train_message(spec: RunSpec, round_index: int, broadcast: dict, secure: str = "", lost: bool = False,
                  session: str = "s") -> Message:
    content = RecordDict({"broadcast": to_record(broadcast), "round": ConfigRecord(
        {"session": session, "spec": spec.digest, "round": round_index, "lost": lost, "secure": secure,
         "clip_norm": -1.0})})
    return Message(content, dst_node_id=101, message_type="train")


def test_the_client_app_replies_with_the_client_update_of_its_own_rows(as_server):
    method, data = AFL(gamma=0.5), three_clients()
    spec = RunSpec.of(method, data)
    data.setup("fit")
    method.setup(Problem((12,), data.num_classes, 3))
    expected, _ = method.client_half().client_update(0, {}, client_app.NodeData(
        data.population().client(1), method.problem, 128).cohort())

    reply = client_app.train(train_message(spec, 0, {}), introduced(spec, 1))
    uploads = codec.unpack(from_record(reply.content["uploads"]), codec.symmetric_names(AFL.uploads))
    assert uploads.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(uploads[name], value, rtol=0, atol=1e-10)
    assert tuple(reply.content["uploads"]["gram"].shape) == (12 * 13 // 2,)  # the upper triangle travelled

    # under secure aggregation the client masks its own upload
    options = {"participants": [0, 1, 2], "seed": 5, "bits": 32, "symmetric": ["gram"]}
    reply = client_app.train(train_message(spec, 0, {}, secure=json.dumps(options)), introduced(spec, 1))
    aggregator = SecureAggregator([0, 1, 2], seed=5, round_index=0, symmetric=["gram"])
    assert torch.equal(from_record(reply.content["masked"])["masked"], aggregator.masked_upload(1, expected))
    layout = json.loads(reply.content["layout"]["json"])
    assert layout == {"names": ["gram", "cross"], "shapes": [[12, 12], [12, data.num_classes]],
                      "dtypes": ["float64", "float64"]}
    # a dropped client computes but sends nothing
    reply = client_app.train(train_message(spec, 0, {}, lost=True), introduced(spec, 1))
    assert not reply.content.array_records


@pytest.mark.parametrize("processes", [1, 2])
def test_a_node_keeps_its_clients_state_between_messages(as_server, monkeypatch, processes):
    """One process keeps the node's client; with two taking turns (a Ray simulation's actors),
    each message finds the state the other saved in the node's context."""
    method, data = fedavg(), three_clients()  # top-k with error feedback: each client keeps a residual
    spec = RunSpec.of(method, data, Pipeline.of(TOPK).node_settings())
    context = introduced(spec, 2)
    data.setup("fit")
    method.setup(Problem((12,), data.num_classes, 3))
    kept_by: list[dict] = [{} for _ in range(processes)]  # each process's copies of its nodes
    events = []
    for round_index in range(3):
        monkeypatch.setattr(client_app, "_nodes", kept_by[round_index % processes])
        report = client_app.train(train_message(spec, round_index, method.broadcast()), context).content["report"]
        events.append((report["built"], report["restored"]))
        method.rounds_done += 1
    # one process builds once and keeps the state; two build once each and restore what the other saved
    assert events == ([(1, 0), (0, 0), (0, 0)] if processes == 1 else [(1, 0), (1, 1), (0, 1)])
    state = from_record(context.state[client_app.STATE_KEY])
    kept = "protocol_state.compress.update_residuals.residuals"  # the compress stage's, held by the half
    residual = state[f"{kept}.rows"]
    assert state[f"{kept}.ids"].tolist() == [2] and residual.abs().sum() > 0  # its client's row, non-zero

    # the same rounds of one in-process half under the same protocol give the same residual
    half, pipeline = method.client_half(), Pipeline.of(TOPK)
    half.setup_clients(torch.tensor([2]), int((data.train_client_ids == 2).sum()))
    pipeline.keep_state(half, method.uploads)
    method.rounds_done.zero_()
    cohort = client_app.NodeData(data.population().client(2), method.problem, 128).cohort()
    for round_index in range(3):
        client_step(half, method.uploads, round_index, method.broadcast(), cohort, pipeline=pipeline)
        method.rounds_done += 1
    torch.testing.assert_close(residual, half.protocol_state.compress.update_residuals.residual(torch.tensor([2])),
                               rtol=0, atol=1e-6)


def test_a_node_builds_its_client_once_per_fit_and_settings(as_server, monkeypatch):
    builds = []
    build_method = RunSpec.build_method
    monkeypatch.setattr(RunSpec, "build_method", lambda spec: builds.append(spec.digest) or build_method(spec))
    monkeypatch.setattr(client_app, "_nodes", {})
    method, data = fedavg(), three_clients()
    spec = RunSpec.of(method, data)
    data.setup("fit")
    method.setup(Problem((12,), data.num_classes, 3))
    context = introduced(spec, 1)
    for round_index in range(3):
        reply = client_app.train(train_message(spec, round_index, method.broadcast()), context)
        assert reply.content["report"]["client_s"] > 0  # the handler timed itself
        method.rounds_done += 1
    assert builds == [spec.digest]  # built at the first round, kept for the others

    changed = RunSpec.of(fedavg(num_rounds=4), data)  # other settings: a new fit, rebuilt
    context = introduced(changed, 1, session="t")
    client_app.train(train_message(changed, 0, method.broadcast(), session="t"), context)
    assert builds == [spec.digest, changed.digest] and len(client_app._nodes) == 1  # the old fit's copy let go

    # a message of a fit the node was never introduced to is refused, not run on stale settings
    with pytest.raises(RuntimeError, match="not introduced"):
        client_app.train(train_message(spec, 1, method.broadcast(), session="t"), context)


def test_write_app_names_the_components(tmp_path):
    text = server_app.write_app(tmp_path / "app").read_text()
    assert 'serverapp = "workbench.engines.flower.server_app:app"' in text
    assert 'clientapp = "workbench.engines.flower.client_app:app"' in text


@pytest.mark.ray
def test_afl_over_flower_equals_in_process(tmp_path):
    engine, reference = over_both(lambda: AFL(gamma=1.0), {}, None, tmp_path)
    assert_same_state(engine.method, reference.method, 1e-8)
    for key in COMM:
        assert engine.fit_metrics[key] == reference.fit_metrics[key], key
    packed_gram_and_cross = 12 * 13 // 2 + 12 * engine.method.num_classes  # float64 numbers
    assert engine.fit_metrics["comm/bytes_up"] == 3 * packed_gram_and_cross * 8
    logged = engine.trainer.callback_metrics
    assert float(logged["test/acc"]) == float(reference.trainer.callback_metrics["test/acc"])
    arrays = 3 * 2  # clients × uploads: Flower carried the packed uploads plus a header per array
    flower = engine.fit_metrics  # logged with the round's metrics
    assert 0 < flower["flower/bytes_up"] - flower["comm/bytes_up"] <= arrays * 256
    assert flower["flower/bytes_up"] == engine.flower_run.bytes_up and flower["flower/client_compute_s"] > 0
    assert (tmp_path / "flower" / "ray").is_dir()


@pytest.mark.ray
def test_fedavg_with_client_state_and_dropouts_over_flower_equals_in_process(tmp_path):
    # one of the three drops each round; each keeps its error feedback (secure aggregation over Ray:
    # tests/engines/test_secagg_plus_engines.py)
    federation = replace(TOPK, dropout=0.34, seed=3)
    engine, reference = over_both(fedavg, {"personalized": True}, federation, tmp_path)
    assert_same_state(engine.method, reference.method, 1e-6)
    for key in (*COMM, "comm/clients_dropped"):
        assert engine.fit_metrics[key] == reference.fit_metrics[key], key
    run = engine.flower_run
    down = engine.fit_metrics["comm/bytes_down"]
    assert 0 < run.bytes_down - down <= (3 * 3 + 3) * 256  # the broadcasts (+ final) and their framing
    assert float(engine.trainer.callback_metrics["test/acc_local_mean"]) == pytest.approx(
        float(reference.trainer.callback_metrics["test/acc_local_mean"]))


@pytest.mark.ray
def test_personalized_clients_score_their_local_test_splits_on_their_nodes(tmp_path):
    from workbench.methods import LocalOnly

    engine, reference = over_both(LocalOnly, {"personalized": True}, None, tmp_path)
    assert engine.local_accuracy == reference.local_accuracy  # each client's own head, kept on its node
    assert float(engine.trainer.callback_metrics["test/acc_local_mean"]) == float(
        reference.trainer.callback_metrics["test/acc_local_mean"])


@pytest.mark.parametrize("name", list(METHODS))
def test_clients_moving_between_processes_give_the_in_process_run(as_server, monkeypatch, name):
    from tests.conftest import quiet_trainer
    from tests.engines.test_conformance import assert_same_run
    from tests.engines.test_conformance import fit as fit_in_process
    from workbench.engines import LightningEngine
    from workbench.engines.flower.simulation import fit_over_grid

    monkeypatch.setattr(client_app, "_nodes", {})  # the grid swaps it; put back after the test
    build, _ = METHODS[name]
    method, dm = build(), conformance_data(name=name)
    engine = LightningEngine(method, protocol_of(name))
    # each node's client moves to the other process with every message, as a Ray simulation's
    # actors take any node's message: every message after a node's first finds its state saved by the other
    grid = LoopbackGrid(dm.num_clients, processes=2, process_of=lambda node, exchange: (exchange + node) % 2)
    run = fit_over_grid(grid, quiet_trainer(), engine, dm)
    assert_same_run(name, fit_in_process(name), (method, engine, run.test_results))
    traffic = run.traffic
    assert traffic.builds <= 2 * dm.num_clients and traffic.restores > 0  # built once per process, then restored


@pytest.mark.ray
@pytest.mark.subprocess
def test_a_flower_fit_from_the_command_line_prints_no_library_notices(tmp_path):
    """Flower's deprecation notice for `run_simulation`, every Ray actor's "Manually terminating",
    and the DeprecationWarnings flwr turns on for Lightning's own calls: none reach the user."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    done = subprocess.run(
        [sys.executable, "-m", "workbench", "fit", "--model=FedAvg", "--model.num_rounds=2",
         "--model.architecture=linear", "--data=FederatedDataModule", "--data.dataset=synthetic",
         "--data.num_clients=3", "--data.partition=iid", "--engine=flower", "--wandb=disabled",
         "--trainer.enable_progress_bar=false", f"--run_dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": ""})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for notice in ("DEPRECATED", "deprecated", "Manually terminating", "Warning", "WARNING"):
        assert notice not in out, out
    assert "Flower carried" in out and "test accuracy" in out
