"""FedAdagrad, FedAdam, FedYogi: FedAvg's clients, an adaptive optimizer on the server (Reddi et al. 2021)."""
from __future__ import annotations

import pytest
import torch

from tests.methods.conftest import data, fit64, small
from workbench.methods import FedAdagrad, FedAdam, FedAvg, FedYogi, Problem

pytestmark = pytest.mark.usefixtures("one_thread")


def pseudo_gradients(size: int, rounds: int) -> list[torch.Tensor]:
    """A few mean updates of both signs and different scales (float64)."""
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(size, generator=gen, dtype=torch.float64) * (0.1 + t) for t in range(rounds)]


def stepped(method, updates: list[torch.Tensor], num_clients: int = 2) -> torch.Tensor:
    """w after the server has taken each mean update (sent as the sum of `num_clients` equal ones)."""
    for g in updates:
        method.finish_round({"update": num_clients * g}, num_clients=num_clients)
    return method.flat_parameters()


def setup64(method):
    method.setup(Problem((8,), 4, 2))
    return method.double()


def test_fedadagrad_without_momentum_is_torch_adagrad():
    """β₁ = 0: w ← w − η g / (√Σg² + τ), which is torch.optim.Adagrad with eps = τ, an independent reference."""
    method = setup64(FedAdagrad(server_lr=0.05, beta1=0.0, tau=1e-3, num_rounds=4, **small()))
    reference = method.flat_parameters().clone().requires_grad_(True)
    optimizer = torch.optim.Adagrad([reference], lr=0.05, eps=1e-3)
    updates = pseudo_gradients(len(reference), 4)
    for g in updates:
        reference.grad = g.clone()
        optimizer.step()
    torch.testing.assert_close(stepped(method, updates), reference.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("cls", "second_moment"), [
    (FedAdam, lambda v, g2, b2: b2 * v + (1 - b2) * g2),
    (FedYogi, lambda v, g2, b2: v - (1 - b2) * g2 * torch.sign(v - g2)),
    (FedAdagrad, lambda v, g2, b2: v + g2),
])
def test_the_server_follows_the_papers_updates(cls, second_moment):
    """Algorithm 2 of the paper, written out: m, v from zero, no bias correction, x ← x + η m/(√v + τ)
    with the paper's Δ = −g."""
    method = setup64(cls(server_lr=0.02, beta1=0.8, beta2=0.95, tau=1e-2, num_rounds=5, **small()))
    x = method.flat_parameters().clone()
    m, v = torch.zeros_like(x), torch.zeros_like(x)
    updates = pseudo_gradients(len(x), 5)
    for g in updates:
        delta = -g
        m = 0.8 * m + 0.2 * delta
        v = second_moment(v, delta**2, 0.95)
        x = x + 0.02 * m / (v.sqrt() + 1e-2)
    torch.testing.assert_close(stepped(method, updates), x, rtol=1e-12, atol=1e-12)
    state = method.state_dict()
    assert {"first_moment", "second_moment"} <= set(state) and method.round == 5  # a checkpoint carries them


def test_the_clients_and_bytes_are_fedavgs():
    """One round from the same start: the same uploads and bytes as FedAvg; only the server's step differs."""
    dm = data(num_clients=4, partition="dirichlet", alpha=0.5)
    fedavg, fedadam = FedAvg(num_rounds=2, seed=1, **small()), FedAdam(num_rounds=2, seed=1, **small())
    fedavg_engine, fedadam_engine = fit64(fedavg, dm), fit64(fedadam, dm)
    for key in ("comm/bytes_up", "comm/bytes_down", "comm/rounds"):
        assert fedadam_engine.fit_metrics[key] == fedavg_engine.fit_metrics[key]
    assert not torch.allclose(fedadam.flat_parameters(), fedavg.flat_parameters())
    assert fedadam_engine.fit_metrics["fedadam/step_norm"] > 0


@pytest.mark.parametrize("setting", [{"beta1": 1.0}, {"beta2": -0.1}, {"tau": 0.0}])
def test_bad_settings_name_the_setting(setting):
    with pytest.raises(ValueError, match=next(iter(setting))):
        FedAdam(**setting)
