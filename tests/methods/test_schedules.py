"""Local-training schedules: the step size across rounds, momentum and weight decay."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from tests.methods.conftest import centralized_sgd, data, fit64, small
from workbench.federation.local_training import LocalTraining, scheduled_lr
from workbench.methods import OSFED, FedAvg, FedProx, Problem
from workbench.methods.heads import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_cosine_and_step_schedules_are_the_formulas():
    rounds = 10
    cosine = [scheduled_lr(0.2, t, rounds, "cosine") for t in range(rounds)]
    assert cosine[0] == 0.2 and math.isclose(cosine[5], 0.1)  # half way: half the step
    assert all(later < earlier for earlier, later in itertools.pairwise(cosine))
    assert cosine[-1] > 0  # the last round still trains (t = R − 1 < R)
    floor = scheduled_lr(0.2, rounds, rounds, "cosine", final_fraction=0.1)
    assert math.isclose(floor, 0.02)
    step = [scheduled_lr(1.0, t, rounds, "step", step_rounds=3, gamma=0.5) for t in range(7)]
    assert step == [1, 1, 1, 0.5, 0.5, 0.5, 0.25]
    assert scheduled_lr(0.3, 7, rounds) == 0.3  # constant: today's behaviour


@pytest.mark.parametrize("schedule, momentum, weight_decay", [("cosine", 0.0, 0.0), ("cosine", 0.9, 0.01),
                                                               ("step", 0.5, 0.0)])
def test_one_client_fedavg_is_torch_sgd_with_the_schedule_and_a_fresh_momentum_buffer_each_round(
        schedule, momentum, weight_decay):
    dm = data(num_clients=1)
    method = FedAvg(num_rounds=3, seed=4, **small(epochs=2, lr_schedule=schedule, lr_step_rounds=2, lr_gamma=0.3,
                                                  momentum=momentum, weight_decay=weight_decay))
    fit64(method, dm)
    ours = method.flat_parameters()
    reference = centralized_sgd(dm, 3, lambda round_index: scheduled_lr(0.1, round_index, 3, schedule,
                                                                        step_rounds=2, gamma=0.3),
                                momentum=momentum, weight_decay=weight_decay)
    assert (ours - reference).norm() <= 1e-6 * reference.norm()  # Δw crosses the wire as float32
    constant = FedAvg(num_rounds=3, seed=4, **small(epochs=2, momentum=momentum, weight_decay=weight_decay))
    fit64(constant, dm)
    assert (constant.flat_parameters() - reference).norm() > 1e-4 * reference.norm()  # the schedule matters


def test_the_schedule_reaches_osfed_and_fedprox_clients():
    for method in (OSFED(num_rounds=4, **small(lr_schedule="cosine")),
                   FedProx(mu=0.1, num_rounds=4, **small(lr_schedule="step"))):
        method.setup(Problem((8,), 4, 2))
        half = method.client_half()
        assert half.local is method.local and half.num_rounds == 4  # the one settings object, read
        assert half.round_lr(3) == method.local.round_lr(3, 4) < method.local.lr


def test_bad_schedule_settings_name_the_fix():
    with pytest.raises(ValueError, match="lr_schedule"):
        FedAvg(local=LocalTraining(lr_schedule="linear"))
    with pytest.raises(ValueError, match="momentum"):
        FedAvg(local=LocalTraining(momentum=1.0))
    with pytest.raises(ValueError, match="weight_decay"):
        FedAvg(local=LocalTraining(weight_decay=-1e-4))
    with pytest.raises(ValueError, match="lr_gamma"):
        FedAvg(local=LocalTraining(lr_schedule="step", lr_gamma=0.0))
    with pytest.raises(ValueError, match="lr_final_fraction"):
        OSFED(local=LocalTraining(lr_schedule="cosine", lr_final_fraction=2.0))


def test_scaffold_divides_by_the_rounds_own_step_size():
    """One local step (a client's data in one batch) from c = c_i = 0 at round t: c_i⁺ = (x − y)/η_t
    is the client's full-batch gradient at x only if it divides by the round's scheduled η_t."""
    from workbench.engines.local import LocalClients
    from workbench.methods import SCAFFOLD, Problem

    dm = data(num_clients=4, partition="dirichlet", alpha=0.5)
    method = SCAFFOLD(num_rounds=4, seed=3, **small(batch_size=600, lr_schedule="cosine"))
    method.setup(Problem((8,), 4, 4))
    clients = LocalClients(method, dm.train_features.double(), dm.train_labels, dm.train_client_ids,
                           torch.unique(dm.train_client_ids), batch_size=64)
    half = clients.half.double()
    x = method.flat_parameters().double() + 0.05
    half.client_update(2, {"weights": x, "control": torch.zeros_like(x)}, clients.cohort(torch.arange(4)))
    model = build_model("mlp", (8,), 4, hidden_dim=8, seed=3).double()
    torch.nn.utils.vector_to_parameters(x, model.parameters())
    for client in range(4):
        mine = dm.train_client_ids == client
        model.zero_grad()
        F.cross_entropy(model(dm.train_features.double()[mine]), dm.train_labels[mine]).backward()
        gradient = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(half.control.read(torch.tensor([client]))[0], gradient, rtol=1e-10, atol=1e-12)


def test_ditto_schedules_both_its_personal_and_its_global_steps(monkeypatch):
    from workbench.engines.local import LocalClients
    from workbench.methods import Ditto, Problem, gradient

    dm = data(num_clients=3)
    method = Ditto(lam=0.1, personal_lr=0.2, num_rounds=5,
                   **small(lr_schedule="step", lr_step_rounds=2, lr_gamma=0.5, momentum=0.9))
    method.setup(Problem((8,), 4, 3))
    clients = LocalClients(method, dm.train_features, dm.train_labels, dm.train_client_ids,
                           torch.unique(dm.train_client_ids), batch_size=64)
    seen = []
    original = gradient.local_sgd
    def recorded(*args, **options):
        seen.append((options["lr"], options["momentum"]))
        return original(*args, **options)

    monkeypatch.setattr(gradient, "local_sgd", recorded)
    clients.half.client_update(3, {"weights": method.flat_parameters()}, clients.cohort(torch.arange(3)))
    assert seen == [(0.2 * 0.5, 0.9), (0.1 * 0.5, 0.9)]  # round 3: one halving; personal, then global
