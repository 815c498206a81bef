"""The protocol as a pipeline of stages: composed from the federation's settings in round order,
with stages of one's own placed where they say (from Python and from a config), each stage's hooks
run where its part of the round runs, its refusals before any work; methods see the protocol
through a read-only view the engines never write into."""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from tests.conftest import fit
from tests.federation.test_adversaries import statistics
from tests.federation.test_systems import data
from workbench.engines import LightningEngine
from workbench.engines.lightning import check_checkpoint_matches
from workbench.engines.local import LocalClients
from workbench.engines.round import FitProtocol, run_round
from workbench.federation import Federation, ProtocolView
from workbench.federation.local_noise import LocalNoise
from workbench.federation.stages import ClientRows, Clip, Incoming, Outgoing, Pipeline, Sample, Stage
from workbench.methods import AFL, DeepAFL, FedAvg, Problem

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class EvenRows(Stage):
    """The clients keep the even-numbered rows only (a client hook, once per fit)."""

    after = "clip"

    def client_rows(self, rows: ClientRows) -> ClientRows:
        keep = torch.arange(len(rows.labels)) % 2 == 0
        return replace(rows, features=rows.features[keep], labels=rows.labels[keep], client_ids=rows.client_ids[keep])


@dataclass(frozen=True)
class Record(Stage):
    """Keeps what reached the server each round (a server hook)."""

    seen: list

    def describe(self) -> str:
        return "record"

    def combine(self, incoming: Incoming) -> Incoming:
        uploads = {name: value.clone() for name, value in incoming.uploads.items()}
        self.seen.append((incoming.survivors.tolist(), uploads))
        return incoming


def run(method, dm, federation: Federation, stages=(), count: int = 1):
    """`count` rounds by `run_round` alone (no engine), with `stages` of one's own."""
    method.setup(Problem.of(dm.population()))
    available = torch.unique(dm.train_client_ids)
    clients = LocalClients(method, dm.train_features, dm.train_labels, dm.train_client_ids, available,
                           dm.hparams.batch_size, federation, stages)
    protocol = FitProtocol.start(method, federation, len(available), stages=stages)
    return [run_round(method, clients, protocol, available) for _ in range(count)]


def test_the_pipeline_is_the_federations_stages_in_round_order_with_ones_own_where_they_say():
    federation = Federation(sample_rate=0.5, dropout=0.1, feature_clip=1.0, dp_sigma=1.0, adversary_fraction=0.1)
    assert Pipeline.of(federation).names() == ["sample", "drop", "clip", "lie", "noise"]
    robust = Federation(dp_clip=0.0, adversary_fraction=0.1, aggregation="median")
    assert Pipeline.of(robust).names() == ["lie", "aggregate"]
    masked = Federation(dropout=0.1, secure_aggregation=True, dp_sigma=1.0, feature_clip=1.0)
    record, second = Record([]), Record([])
    pipeline = Pipeline.of(masked, [record, LocalNoise(0.1), EvenRows(), second])
    names = [type(stage).__name__ for stage in pipeline.stages]
    assert names == ["Drop", "Clip", "EvenRows", "LocalNoise", "Mask", "Noise", "Record", "Record"]
    assert Pipeline.of(masked, [record, second]).stages[-2:] == (record, second)  # the list's order kept
    assert Pipeline.of(masked).describe() == ["0.1 of the clients drop out", "clip rows to norm 1",
                                              "secure aggregation masks", "noise σ = 1 on the statistics"]
    assert Pipeline.of(Federation()).stages == ()
    assert Pipeline.of(Federation(dp_clip=1.0)).describe() == ["clip updates to norm 1"]  # z = 0: no noise named


def test_a_stage_list_holds_only_stages_of_ones_own_placed_after_a_stage_that_exists():
    with pytest.raises(TypeError, match=r"Sample is built in and comes from the federation's settings"):
        Pipeline.of(Federation(), [Sample(Federation(sample_rate=0.5))])
    with pytest.raises(TypeError, match=r"Stage subclasses\), got str"):
        Pipeline.of(Federation(), ["LocalNoise"])  # type: ignore[list-item]

    @dataclass(frozen=True)
    class Nowhere(Stage):
        after = "shuffle"

    with pytest.raises(ValueError, match=r"Nowhere.after = 'shuffle' names no stage: one of sample, drop, compress"):
        LightningEngine(AFL(), stages=[Nowhere()])

    class Unrecorded(Stage):  # its settings would be recorded as a memory address
        def __init__(self, sigma: float) -> None:
            self.sigma = sigma

    with pytest.raises(TypeError, match=r"Unrecorded must be a dataclass of its settings"):
        Pipeline.of(Federation(), [Unrecorded(0.5)])


def test_a_client_hook_of_ones_own_runs_on_the_clients_rows_and_the_fit_stays_exact():
    dm = data(8)
    method = AFL(gamma=1.0, gamma_out=0.5)
    run(method, dm, Federation(), [EvenRows()])
    keep = torch.arange(len(dm.train_labels)) % 2 == 0
    reference = AFL(gamma=1.0, gamma_out=0.5)
    run(reference, dm, Federation())
    x, y = dm.train_features[keep].double(), dm.train_labels[keep]
    expected = torch.linalg.solve(x.T @ x + 0.5 * torch.eye(x.shape[1], dtype=x.dtype),
                                  x.T @ torch.nn.functional.one_hot(y, dm.num_classes).double())
    assert torch.allclose(method.weight, expected, rtol=1e-9, atol=1e-12)
    assert not torch.allclose(reference.weight, expected, rtol=1e-3)


def test_a_server_hook_of_ones_own_sees_what_arrived_each_round_after_the_screen():
    dm = data(6)
    seen: list = []
    federation = Federation(adversary_fraction=0.2, attack="sign_flip", aggregation="screen", seed=1)
    liars = torch.nonzero(federation.adversaries(6)).flatten().tolist()
    results = run(AFL(gamma=1.0), dm, federation, [Record(seen)])
    honest = [k for k in range(6) if k not in liars]
    assert len(seen) == 1 and seen[0][0] == honest == results[0].survivors.tolist()
    assert torch.allclose(seen[0][1]["gram"], statistics(dm, honest)["gram"], rtol=1e-12, atol=1e-9)


def test_each_stage_refuses_before_any_work_wherever_the_round_runs_from():
    method = AFL()
    method.setup(Problem((6,), 4, 5))
    with pytest.raises(ValueError, match=r"dp_clip clips clients' model updates, which AFL does not send"):
        FitProtocol.start(method, Federation(dp_clip=1.0), 5)
    with pytest.raises(ValueError, match=r"EvenRows runs on the clients, and a remote transport's nodes run their "
                                         r"own code: drop it from stages: there"):
        FitProtocol.check(method, Federation(), 5, remote=True, stages=[EvenRows()])
    FitProtocol.check(method, Federation(), 5, remote=True, stages=[Record([])])  # a server hook runs anywhere
    fedavg = FedAvg(architecture="linear")
    fedavg.setup(Problem((6,), 4, 5))
    with pytest.raises(ValueError, match=r"dp_clip \(client-level DP\) and dp_sigma"):
        FitProtocol.check(fedavg, Federation(dp_clip=1.0, dp_sigma=1.0), 5)
    with pytest.raises(ValueError, match=r"feature_clip clips the rows of in-process clients"):
        FitProtocol.check(method, Federation(feature_clip=1.0), 5, remote=True)
    assert Clip(Federation(feature_clip=1.0)).describe() == "clip rows to norm 1"


def test_methods_see_the_protocol_read_only_and_engines_write_nothing_into_them():
    method = DeepAFL(num_layers=1, hidden_dim=8, block_dim=8)
    with pytest.raises(AttributeError):
        method.federation = Federation(dropout=0.2)  # type: ignore[misc]
    with pytest.raises(TypeError, match="ProtocolView"):
        method.run_under(Federation())  # type: ignore[arg-type]
    before = method.protocol
    engine = LightningEngine(method, Federation(dropout=0.2))
    assert method.protocol is before and method.federation == Federation()  # building an engine changes nothing
    fit(engine.method, data(6), Federation(dropout=0.2, aggregation="screen"))
    assert method.protocol == ProtocolView(Federation(dropout=0.2, aggregation="screen"), participation_varies=True)
    assert method.restates  # the screen's rejections vary who takes part: DeepAFL restates its sums
    with pytest.raises(AttributeError):
        method.protocol.federation = Federation()  # type: ignore[misc]


def test_a_resumed_fit_with_other_stages_is_refused_with_both_named():
    engine = LightningEngine(AFL(), stages=[LocalNoise(0.5)])
    other = LightningEngine(AFL(), stages=[LocalNoise(0.25)])
    assert engine.pipeline.identity() == [{"stage": "workbench.federation.local_noise.LocalNoise",
                                           "settings": {"sigma": 0.5, "seed": None}}]
    saved = {"method": "AFL", "settings": {}, "federation": {}, "stages": engine.pipeline.identity()}
    configured = {**saved, "engine": "lightning", "data": None, "problem": None,
                  "stages": other.pipeline.identity()}
    with pytest.raises(ValueError, match=r"stages: checkpoint .*'sigma': 0.5.*config .*'sigma': 0.25"):
        check_checkpoint_matches(saved, configured, resuming=True)
    check_checkpoint_matches(saved, configured, resuming=False)  # tested under other stages: allowed


def test_clients_built_under_another_protocol_than_the_fits_are_refused_not_silently_unclipped():
    dm = data(4)
    method = AFL(gamma=1.0)
    method.setup(Problem.of(dm.population()))
    available = torch.unique(dm.train_client_ids)
    clients = LocalClients(method, dm.train_features, dm.train_labels, dm.train_client_ids, available, 64)
    protocol = FitProtocol.start(method, Federation(feature_clip=1.0), len(available), stages=[LocalNoise(0.5)])
    with pytest.raises(ValueError, match=r"built under another protocol \(none of its parts\) than the fit's "
                                         r"\(clip rows to norm 1 → each client noises its statistics, σ = 0.5\)"):
        run_round(method, clients, protocol, available)
    with pytest.raises(ValueError, match=r"has no clip stage: build the clients with the fit's federation"):
        Pipeline.of(Federation()).client_message(Outgoing({}, {}, 0, torch.arange(2), clip_norm=1.0))


def test_the_stages_of_ones_own_are_checked_after_the_built_in_ones_and_kept_under_other_settings():
    afl = AFL()
    afl.setup(Problem((6,), 4, 5))
    with pytest.raises(ValueError, match=r"aggregation=median combines clients' model updates; AFL sends statistics"):
        FitProtocol.check(afl, Federation(aggregation="median"), 5, stages=[LocalNoise(0.5)])
    pipeline = Pipeline.of(Federation(sample_rate=0.5), [Record([])])
    wider = pipeline.under(Federation(sample_rate=0.8))
    assert wider.own() == pipeline.own() and wider.get(Sample).federation.sample_rate == 0.8  # type: ignore[union-attr]
