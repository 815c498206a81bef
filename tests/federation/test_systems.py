"""Device and network profiles and the simulated clock: a round's latency is its slowest client's
download + compute + upload on its own link and device, a deadline drops exactly the clients that
would reply after it, and profiles that decide nothing change no model and no byte."""
from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import quiet_trainer
from tests.engines.conformance import comparable_state
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.engines import LightningEngine
from workbench.engines.local import LocalClients
from workbench.engines.round import FitProtocol, run_round
from workbench.federation import Federation
from workbench.federation.systems import PRESETS, ClientProfiles, SimulatedClock, Systems, check_systems
from workbench.methods import AFL, DeepAFL, FedAvg, Problem

pytestmark = pytest.mark.usefixtures("one_thread")

BLOBS = SyntheticBlobs(num_classes=4, dim=6, train_size=400, test_size=100, seed=3)


def data(num_clients: int) -> FederatedDataModule:
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, num_clients=num_clients, partition="dirichlet",
                             alpha=0.5, min_partition_size=5, batch_size=64)
    dm.setup()
    return dm


def rounds(method, dm, systems: Systems | None, federation: Federation | None = None, count: int = 1):
    """`count` rounds of `method` by `run_round` under `federation` and `systems` (None: no
    clock): (results, clock)."""
    federation = federation or Federation()
    method.setup(Problem.of(dm.population()))
    available = torch.unique(dm.train_client_ids)
    clients = LocalClients(method, dm.train_features, dm.train_labels, dm.train_client_ids, available,
                           dm.hparams.batch_size, federation)
    rows = torch.bincount(dm.train_client_ids, minlength=method.num_clients)
    clock = SimulatedClock(systems, rows) if systems is not None else None
    protocol = FitProtocol.start(method, federation, len(available), clock=clock)
    return [run_round(method, clients, protocol, available) for _ in range(count)], protocol.clock


def rows_of(dm) -> torch.Tensor:
    return torch.bincount(dm.train_client_ids, minlength=dm.hparams.num_clients).double()


# every client alike: 8 Mbit/s down, 4 up, 100 ms, half this machine's speed, 1 ms a row here
ALIKE = Systems(down_mbps=8.0, up_mbps=4.0, rtt_ms=100.0, speed=0.5, spread=0.0, row_s=1e-3)


def test_a_two_client_round_lasts_its_slowest_clients_download_compute_and_upload():
    dm = data(2)
    (result,), _ = rounds(AFL(gamma=1.0), dm, ALIKE)
    d, c = 6, 4
    upload = (d * (d + 1) // 2 + d * c) * 8  # AFL's packed Gram and XᵀY in float64, by hand
    assert result.bytes_up == 2 * upload and result.bytes_down == 0  # AFL broadcasts nothing before its round
    rows = rows_of(dm)
    latency = [0.1 + 0.0 + float(r) * 1e-3 / 0.5 + 8 * upload / 4e6 for r in rows]
    assert result.metrics["latency/round_s"] == pytest.approx(max(latency) + result.server_s, rel=1e-12)
    assert result.latency_s == result.metrics["latency/round_s"] and result.metrics["latency/stragglers"] == 0

    # a broadcast too: FedAvg's second round sends the model down, its update up
    (_, second), _ = rounds(FedAvg(num_rounds=2, architecture="linear", seed=0), dm, ALIKE, count=2)
    down, up = second.bytes_down / 2, second.bytes_up / 2
    assert down == (d * c + c) * 4 and up == (d * c + c) * 4  # the float32 model and its update
    latency = [0.1 + 8 * down / 8e6 + float(r) * 1e-3 / 0.5 + 8 * up / 4e6 for r in rows]
    assert second.metrics["latency/round_s"] == pytest.approx(max(latency) + second.server_s, rel=1e-12)


def test_the_same_seed_draws_the_same_profiles_and_spread_zero_draws_the_medians():
    systems = Systems(preset="cellular", seed=5)
    a, b = ClientProfiles.draw(systems, 50), ClientProfiles.draw(systems, 50)
    other = ClientProfiles.draw(Systems(preset="cellular", seed=6), 50)
    assert all(torch.equal(getattr(a, name), getattr(b, name)) for name in ("down_bps", "up_bps", "rtt_s", "speed"))
    assert not torch.equal(a.up_bps, other.up_bps) and not torch.equal(a.speed, other.speed)
    median = PRESETS["cellular"]
    assert float(a.up_bps.median()) == pytest.approx(median.up_mbps * 1e6, rel=0.5)  # log-normal around it
    assert torch.allclose(a.down_bps / a.up_bps, torch.full((50,), median.down_mbps / median.up_mbps,
                                                                 dtype=torch.float64))  # one link, both ways
    flat = ClientProfiles.draw(Systems(preset="wifi", spread=0.0), 7)
    assert torch.equal(flat.up_bps, torch.full((7,), 46e6, dtype=torch.float64))
    assert torch.equal(flat.speed, torch.full((7,), 0.5, dtype=torch.float64))


def test_a_deadline_drops_exactly_the_clients_that_would_reply_after_it():
    dm = data(10)
    systems = Systems(preset="cellular", rtt_ms=100.0, row_s=2e-4, seed=1)
    profiles, rows = ClientProfiles.draw(systems, 10), rows_of(dm)
    upload = (6 * 7 // 2 + 6 * 4) * 8
    latency = profiles.rtt_s + rows * 2e-4 / profiles.speed + 8 * upload / profiles.up_bps  # nothing down
    deadline = float(latency.median())
    late = latency > deadline
    assert 0 < int(late.sum()) < 10
    (result,), _ = rounds(AFL(gamma=1.0), dm, Systems(preset="cellular", rtt_ms=100.0, row_s=2e-4, seed=1,
                                                     deadline_s=deadline))
    assert torch.equal(result.lost, torch.nonzero(late).flatten())
    assert torch.equal(result.survivors, torch.nonzero(~late).flatten())
    assert result.metrics["latency/stragglers"] == int(late.sum())
    assert result.metrics["latency/round_s"] == pytest.approx(deadline + result.server_s, rel=1e-12)  # it waited

    # the stragglers' uploads never arrive: AFL's solution is that of the clients on time
    on_time = torch.isin(dm.train_client_ids, result.survivors)
    x = dm.train_features[on_time].double()
    regularized = x.T @ x + len(result.survivors) * torch.eye(6, dtype=torch.float64)  # each adds γI once
    assert torch.allclose(result.uploads["gram"], regularized, rtol=1e-12, atol=1e-9)
    assert result.metrics["comm/clients_in_round"] == len(result.survivors)


def test_a_deadline_no_client_meets_is_one_error_naming_it():
    with pytest.raises(RuntimeError, match=r"every client of round 0 missed systems.deadline_s = 0.01 s"):
        rounds(AFL(gamma=1.0), data(4), Systems(preset="cellular", deadline_s=0.01, row_s=0.0))


def test_over_selection_asks_more_and_keeps_the_first_replies():
    dm = data(10)
    systems = Systems(preset="cellular", over_select=0.5, row_s=1e-4, seed=2)
    federation = Federation(sample_rate=0.4, seed=3)
    (result,), clock = rounds(AFL(gamma=1.0), dm, systems, federation)
    assert len(result.cohort) == 6 and len(result.survivors) == 4 and len(result.lost) == 2  # ⌈4·1.5⌉ asked
    assert set(federation.sampled_clients(0, torch.arange(10)).tolist()) <= set(result.cohort.tolist())
    upload = (6 * 7 // 2 + 6 * 4) * 8
    latency = clock.latencies(result.cohort, 0, upload)
    fastest = result.cohort[torch.argsort(latency, stable=True)[:4]]
    assert torch.equal(result.survivors, fastest.sort().values)
    assert result.metrics["latency/round_s"] == pytest.approx(float(latency.sort().values[3]) + result.server_s,
                                                              rel=1e-12)  # closed on the 4th reply


def test_clients_offline_are_not_asked():
    clock = SimulatedClock(Systems(preset="wifi", availability=0.5, seed=4), torch.full((40,), 10))
    everyone = torch.arange(40)
    online = clock.online(3, everyone)
    assert 8 < len(online) < 32 and torch.equal(online, clock.online(3, everyone))
    assert not torch.equal(online, clock.online(4, everyone))
    (result,), _ = rounds(FedAvg(num_rounds=1, architecture="linear", seed=0), data(10),
                          Systems(preset="wifi", availability=0.5, seed=4))
    offline = set(range(10)) - set(SimulatedClock(Systems(preset="wifi", availability=0.5, seed=4),
                                                  torch.full((10,), 1)).online(0, torch.arange(10)).tolist())
    assert offline and not offline & set(result.cohort.tolist())


def fit(method, dm, systems: Systems | None):
    engine = LightningEngine(method, Federation(dropout=0.2, seed=1), systems=systems)
    quiet_trainer().fit(engine, datamodule=dm)
    return engine


def test_profiles_that_decide_nothing_change_no_model_and_no_byte():
    dm = data(8)
    plain = fit(FedAvg(num_rounds=3, architecture="linear", seed=0), dm, None)
    clocked = fit(FedAvg(num_rounds=3, architecture="linear", seed=0), dm, Systems(preset="cellular"))
    ours, theirs = comparable_state(clocked.method), comparable_state(plain.method)
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)
    for key in ("comm/bytes_up", "comm/bytes_down", "comm/clients_in_round"):
        assert clocked.fit_metrics[key] == plain.fit_metrics[key]
    assert "latency/total_s" not in plain.fit_metrics
    curve = [point["round/latency_s"] for point in clocked.curve]
    assert len(curve) == 3 and curve == sorted(curve) and curve[-1] == clocked.fit_metrics["latency/total_s"] > 0
    assert math.isfinite(clocked.protocol.clock.row_s) and clocked.protocol.clock.row_s > 0  # measured here


def test_who_takes_part_varying_makes_deepafl_restate_and_stay_exact():
    """Clients offline or late: DeepAFL asks for its statistics again each round, as under
    dropouts, so the fit is that of `restate=true` (without it the fused recursion would reuse sums
    of the last round's clients)."""
    dm = data(8)
    systems = Systems(preset="cellular", availability=0.7, row_s=1e-4, seed=3)
    settings = {"num_layers": 3, "hidden_dim": 16, "block_dim": 16}
    told = LightningEngine(DeepAFL(**settings), systems=systems)
    quiet_trainer().fit(told, datamodule=dm)
    restated = LightningEngine(DeepAFL(**settings, restate=True), systems=systems)
    quiet_trainer().fit(restated, datamodule=dm)
    assert told.method.participation_varies and told.method.restates
    ours, theirs = comparable_state(told.method), comparable_state(restated.method)
    assert all(torch.allclose(ours[key], theirs[key], rtol=1e-10, atol=1e-12) for key in ours)
    with pytest.raises(ValueError, match=r"restate=false.*systems deadline"):
        quiet_trainer().fit(LightningEngine(DeepAFL(**settings, restate=False), systems=systems), datamodule=dm)


def test_a_round_with_nobody_online_is_one_line():
    from workbench.console import USER_ERROR_TYPES
    from workbench.federation.systems import EveryClientOffline

    clock = SimulatedClock(Systems(preset="wifi", availability=0.01, seed=0), torch.full((3,), 10))
    with pytest.raises(EveryClientOffline, match="no client is online") as raised:
        clock.online(0, torch.arange(3))
    assert isinstance(raised.value, USER_ERROR_TYPES)  # the command line prints it in one line


@pytest.mark.parametrize("settings, federation, message", [
    ({"preset": "5g"}, {}, "systems.preset must be one of"),
    ({"deadline_s": 10.0}, {}, "deadline_s acts on the clients' profiles, and there are none: set systems.preset"),
    ({"speed": 0.5, "row_s": 1e-4}, {}, "speed, row_s acts on the clients' profiles"),
    ({"down_mbps": 10.0}, {}, "set up_mbps, rtt_ms"),
    ({"preset": "wifi", "availability": 0.0}, {}, r"availability must be in \(0, 1\]"),
    ({"preset": "wifi", "deadline_s": -1.0}, {}, "deadline_s must be > 0"),
    ({"preset": "wifi", "over_select": 0.3}, {}, "set federation.sample_rate < 1 with sampling=fixed"),
    ({"preset": "wifi", "over_select": 0.3}, {"sample_rate": 0.5, "dp_clip": 1.0},
     "breaks the uniform sampling"),
])
def test_settings_the_protocol_cannot_honour_are_refused_before_any_round(settings, federation, message):
    with pytest.raises(ValueError, match=message):
        check_systems(Systems(**settings), Federation(**federation))


def test_a_clock_over_remote_clients_needs_row_s_and_no_deadline():
    with pytest.raises(ValueError, match=r"set systems\.row_s"):
        check_systems(Systems(preset="wifi"), Federation(), in_process=False)
    with pytest.raises(ValueError, match="leave deadline_s and over_select unset"):
        check_systems(Systems(preset="wifi", row_s=1e-4, deadline_s=5.0), Federation(), in_process=False)
    check_systems(Systems(preset="wifi", row_s=1e-4), Federation(), in_process=False)
