"""Robust aggregation: the server combines the clients' model updates by a robust center instead
of their mean — each center by hand, the round's aggregate from the clients' own rows, and a fit
under a scaling attack that the mean loses and the median survives."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import fit
from tests.federation.test_adversaries import one_round
from tests.federation.test_systems import data
from workbench.federation import Federation
from workbench.federation.client_step import client_step
from workbench.federation.robust import center
from workbench.federation.stages import Pipeline
from workbench.methods import AFL, FedAvg, Problem
from workbench.methods.base import Cohort

pytestmark = pytest.mark.usefixtures("one_thread")


def test_each_center_by_hand():
    rows = torch.tensor([[1.0, -4.0], [2.0, 0.0], [3.0, 1.0], [100.0, 2.0]])
    assert torch.equal(center(rows, "median"), torch.tensor([2.5, 0.5]))  # the two middle values' mean
    assert torch.equal(center(rows[:3], "median"), torch.tensor([2.0, 0.0]))
    assert torch.equal(center(rows, "trimmed_mean", trim=0.25), torch.tensor([2.5, 0.5]))  # one cut each end
    assert torch.equal(center(rows, "trimmed_mean", trim=0.0), rows.mean(0))
    cluster = torch.tensor([[0.0, 0.0], [0.1, 0.0], [-0.1, 0.0], [0.0, 0.1], [50.0, 50.0]])
    assert torch.equal(center(cluster, "krum", trim=0.2), cluster[0])  # f = 1: its 2 nearest at 0.01 each
    assert torch.allclose(center(cluster, "multi_krum", trim=0.2), cluster[:4].mean(0))  # the m − f best
    bounded = center(torch.tensor([[3.0, 4.0], [0.3, 0.4]]), "norm_bound", norm=1.0)
    assert torch.allclose(bounded, torch.tensor([(0.6 + 0.3) / 2, (0.8 + 0.4) / 2]))
    with pytest.raises(RuntimeError, match="Krum needs more than 2f \\+ 2 updates"):
        center(cluster[:3], "krum", trim=0.34)


def test_a_rounds_aggregate_is_m_times_the_center_of_the_clients_own_updates():
    dm = data(7)
    federation = Federation(aggregation="median")
    result = one_round(FedAvg(num_rounds=1, architecture="linear", seed=0), dm, federation)
    method = FedAvg(num_rounds=1, architecture="linear", seed=0)
    method.setup(Problem.of(dm.population()))
    half, clients = method.client_half(), torch.arange(7)
    half.setup_clients(clients, len(dm.train_labels))
    rows_at = torch.arange(len(dm.train_labels))
    cohort = Cohort(dm.train_features, dm.train_labels, dm.train_client_ids, clients, rows_at)
    broadcast = method.plan_round(clients).broadcast
    rows = client_step(half, method.uploads, 0, broadcast, cohort, pipeline=Pipeline.of(federation)).uploads
    assert rows["update"].shape[0] == 7  # one row per client on the wire
    assert torch.allclose(result.uploads["update"], 7 * rows["update"].median(0).values, rtol=1e-6, atol=1e-7)
    plain = one_round(FedAvg(num_rounds=1, architecture="linear", seed=0), dm, Federation())
    assert result.bytes_up == plain.bytes_up  # a row each, as many bytes as before
    loose = one_round(FedAvg(num_rounds=1, architecture="linear", seed=0), dm,
                      Federation(aggregation="norm_bound", aggregation_norm=1e9))
    assert torch.allclose(loose.uploads["update"], plain.uploads["update"], rtol=1e-5, atol=1e-6)  # no bound bites


def test_the_median_survives_a_scaled_sign_flip_the_mean_does_not():
    dm = data(10)
    attack = {"adversary_fraction": 0.2, "attack": "scale", "attack_scale": -20.0, "seed": 1}
    accuracy = {}
    for name, federation in {"honest": Federation(), "mean": Federation(**attack),
                             "median": Federation(**attack, aggregation="median")}.items():
        engine = fit(FedAvg(num_rounds=5, architecture="linear", seed=0), dm, federation)
        accuracy[name] = engine.curve[-1]["round/test_acc"]
    assert accuracy["mean"] < 0.3 < 0.5 < accuracy["median"], accuracy  # 4 classes: chance is 0.25
    assert accuracy["honest"] > 0.5, accuracy


@pytest.mark.parametrize("settings, message", [
    ({"aggregation": "geometric"}, "aggregation must be mean, median"),
    ({"aggregation": "median", "secure_aggregation": True}, "secure aggregation shows the server only their sum"),
    ({"aggregation": "krum", "dp_clip": 1.0}, "client-level DP noises their sum"),
    ({"aggregation_trim": 0.5}, r"aggregation_trim must be in \[0, 0.5\)"),
])
def test_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        Federation(**settings)


def test_a_method_that_sends_statistics_is_refused_robust_aggregation():
    with pytest.raises(ValueError, match="AFL sends statistics, which are summed"):
        fit(AFL(), data(4), Federation(aggregation="median"))
