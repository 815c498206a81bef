"""FedAvgM: FedAvg's clients, a server that steps with momentum along their mean update."""
from __future__ import annotations

import pytest
import torch

from tests.methods.conftest import data, fit64, small
from workbench.methods import FedAvg, FedAvgM, Problem

pytestmark = pytest.mark.usefixtures("one_thread")


def test_without_momentum_it_is_fedavg():
    dm = data(num_clients=4, partition="dirichlet", alpha=0.5)
    fedavg = FedAvg(num_rounds=3, seed=1, **small())
    fedavgm = FedAvgM(server_momentum=0.0, num_rounds=3, seed=1, **small())
    fit64(fedavg, dm), fit64(fedavgm, dm)
    torch.testing.assert_close(fedavgm.flat_parameters(), fedavg.flat_parameters(), rtol=1e-12, atol=1e-12)


def test_the_server_steps_along_the_velocity():
    """A constant mean update Δ: after t rounds w moves by η_s Σ_{s<t} (1 + β + … + β^s) Δ."""
    method = FedAvgM(server_momentum=0.5, server_lr=0.1, num_rounds=3, **small())
    method.setup(Problem((8,), 4, 2))
    start = method.flat_parameters().clone()
    delta = torch.linspace(-1, 1, len(start))
    for _ in range(3):
        method.finish_round({"update": 2 * delta}, num_clients=2)  # the sum of two clients' Δ
    moved = 0.1 * (1 + (1 + 0.5) + (1 + 0.5 + 0.25))
    torch.testing.assert_close(method.flat_parameters(), start - moved * delta, rtol=1e-6, atol=1e-7)
    assert "velocity" in method.state_dict() and method.round == 3  # a checkpoint carries it


def test_momentum_outside_zero_to_one_names_the_fix():
    with pytest.raises(ValueError, match="server_momentum"):
        FedAvgM(server_momentum=1.0)
