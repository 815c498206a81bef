"""Vectorized client-side optimization equals running every client alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workbench.federation.local_training import lbfgs, local_sgd, local_steps, minibatch_schedule
from workbench.methods.heads import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def toy_clients(n: int = 400, d: int = 6, num_classes: int = 4, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(n, d, generator=gen, dtype=dtype)
    labels = torch.randint(0, num_classes, (n,), generator=gen)
    client_ids = torch.randint(0, 5, (n,), generator=gen)
    client_ids[client_ids == 3] = 2  # client 3 holds no data
    client_ids[:7] = 4  # a scattered, unsorted order
    return features, labels, client_ids


def reference_sgd(model, features, labels, schedule, row, *, lr, prox_mu=0.0, init=None, momentum=0.0,
                  weight_decay=0.0):
    """One client alone: torch.optim.SGD over its rows of the same schedule."""
    if init is not None:
        with torch.no_grad():
            for p, start in zip(model.parameters(), init, strict=True):
                p.copy_(start)
    center = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    steps = 0
    for index, mask in schedule:
        mine = index[row][mask[row]]
        if len(mine) == 0:
            continue
        steps += 1
        optimizer.zero_grad()
        loss = F.cross_entropy(model(features[mine]), labels[mine])
        loss = loss + 0.5 * prox_mu * sum(
            ((p - c) ** 2).sum() for p, c in zip(model.parameters(), center, strict=True)
        )
        loss.backward()
        optimizer.step()
    return dict(model.named_parameters()), steps


@pytest.mark.parametrize("prox_mu, momentum, weight_decay", [(0.0, 0.0, 0.0), (0.7, 0.0, 0.0), (0.0, 0.9, 0.0),
                                                            (0.7, 0.5, 0.01)])
def test_vectorized_local_sgd_equals_a_loop_over_clients(prox_mu, momentum, weight_decay):
    """Also with momentum and weight decay: each client's buffer is its own, as in torch.optim.SGD
    (and waits, untouched, while the client has no batch left in the epoch)."""
    features, labels, client_ids = toy_clients()
    clients = torch.tensor([4, 0, 3, 2])  # any order, one client without data
    model = build_model("mlp", (6,), 4, hidden_dim=8, seed=1).double()
    trained = local_sgd(
        model,
        features,
        labels,
        client_ids,
        clients,
        epochs=2,
        lr=0.1,
        batch_size=16,
        seed=5,
        prox_mu=prox_mu,
        momentum=momentum,
        weight_decay=weight_decay,
    )
    schedule = list(
        minibatch_schedule(
            client_ids, clients, epochs=2, batch_size=16, seed=5
        )
    )
    for row, client in enumerate(clients.tolist()):
        alone, steps = reference_sgd(
            build_model("mlp", (6,), 4, hidden_dim=8, seed=1).double(),
            features,
            labels,
            schedule,
            row,
            lr=0.1,
            prox_mu=prox_mu,
            momentum=momentum,
            weight_decay=weight_decay,
        )
        n_k = int((client_ids == client).sum())
        assert steps == 2 * -(-n_k // 16)  # epochs · ceil(n_k / B)
        for name, value in alone.items():
            torch.testing.assert_close(trained[name][row], value.detach(), rtol=1e-12, atol=1e-12)
    assert torch.equal(trained["1.weight"][2], model[1].weight.detach())  # no data: untouched


def test_per_client_starting_points():
    features, labels, client_ids = toy_clients()
    clients = torch.tensor([0, 1])
    model = build_model("linear", (6,), 4, seed=0).double()
    init = {
        name: torch.randn(2, *p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(3))
        for name, p in model.named_parameters()
    }
    trained = local_sgd(
        model,
        features,
        labels,
        client_ids,
        clients,
        epochs=1,
        lr=0.2,
        batch_size=32,
        seed=0,
        init=init,
    )
    schedule = list(
        minibatch_schedule(
            client_ids, clients, epochs=1, batch_size=32, seed=0
        )
    )
    for row in range(2):
        alone, _ = reference_sgd(
            build_model("linear", (6,), 4, seed=0).double(),
            features,
            labels,
            schedule,
            row,
            lr=0.2,
            init=[init[name][row] for name, _ in model.named_parameters()],
        )
        for name, value in alone.items():
            torch.testing.assert_close(trained[name][row], value.detach(), rtol=1e-12, atol=1e-12)


def test_cnn_clients_train_vectorized_like_alone():
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(90, 1, 8, 8, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 3, (90,), generator=gen)
    client_ids = torch.arange(90) % 3
    clients = torch.tensor([2, 0])
    model = build_model("cnn", (1, 8, 8), 3, seed=0).double()
    trained = local_sgd(
        model,
        images,
        labels,
        client_ids,
        clients,
        epochs=1,
        lr=0.1,
        batch_size=8,
        seed=1,
    )
    schedule = list(
        minibatch_schedule(
            client_ids, clients, epochs=1, batch_size=8, seed=1
        )
    )
    for row in range(2):
        alone, _ = reference_sgd(
            build_model("cnn", (1, 8, 8), 3, seed=0).double(), images, labels, schedule, row, lr=0.1
        )
        for name, value in alone.items():
            torch.testing.assert_close(trained[name][row], value.detach(), rtol=1e-10, atol=1e-12)


def test_each_epoch_visits_every_sample_of_a_client_once():
    _, _, client_ids = toy_clients()
    clients = torch.tensor([0, 1, 2, 4])
    steps = list(
        minibatch_schedule(
            client_ids, clients, epochs=3, batch_size=10, seed=0
        )
    )
    per_epoch = len(steps) // 3
    for epoch in range(3):
        for row, client in enumerate(clients.tolist()):
            seen = torch.cat(
                [
                    index[row][mask[row]]
                    for index, mask in steps[epoch * per_epoch : (epoch + 1) * per_epoch]
                ]
            )
            assert torch.equal(seen.sort().values, (client_ids == client).nonzero().squeeze(1))
    first = torch.cat([i[0][m[0]] for i, m in steps[:per_epoch]])
    second = torch.cat([i[0][m[0]] for i, m in steps[per_epoch : 2 * per_epoch]])
    assert not torch.equal(first, second)  # reshuffled every epoch


def test_a_clients_draws_do_not_depend_on_the_other_clients():
    _, _, client_ids = toy_clients()

    def batches_of_client_1(clients):
        row = clients.tolist().index(1)
        schedule = minibatch_schedule(
            client_ids, clients, epochs=2, batch_size=7, seed=9
        )
        return [index[row][mask[row]] for index, mask in schedule if mask[row].any()]

    alone = batches_of_client_1(torch.tensor([1]))
    together = batches_of_client_1(torch.tensor([4, 1, 0]))
    assert len(alone) == len(together) and all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))


def test_bad_arguments_are_rejected():
    features, labels, client_ids = toy_clients()
    model = build_model("linear", (6,), 4).double()
    with pytest.raises(ValueError, match="lr"):
        local_sgd(
            model,
            features,
            labels,
            client_ids,
            torch.tensor([0]),
            epochs=1,
            lr=-0.1,
            batch_size=8,
            seed=0,
        )
    with pytest.raises(ValueError, match="prox_center"):
        local_sgd(
            model,
            features,
            labels,
            client_ids,
            torch.tensor([0]),
            epochs=1,
            lr=0.1,
            batch_size=8,
            seed=0,
            prox_mu=1.0,
            prox_center={"1.weight": torch.zeros(3, 3)},
        )


# ---- batched L-BFGS --------------------------------------------------------------------------


def rosenbrock_family(x: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Problem k: a Rosenbrock valley of its own steepness (100·(k+1)), of the problems `rows`
    (None: x's rows are problems 0, 1, ...); separable across rows."""
    x = x.detach().requires_grad_()
    rows = torch.arange(len(x)) if rows is None else rows
    steep = 100.0 * (rows + 1).to(x.dtype)
    value = (steep[:, None] * (x[:, 1:] - x[:, :-1] ** 2) ** 2 + (1 - x[:, :-1]) ** 2).sum(1)
    (gradient,) = torch.autograd.grad(value.sum(), x)
    return value.detach(), gradient


def test_batched_lbfgs_is_independent_lbfgs_runs():
    start = torch.tensor(
        [[-1.2, 1.0, 0.5, -0.3], [0.0, 0.0, 0.0, 0.0], [2.0, -1.5, 1.0, 1.0]], dtype=torch.float64
    )
    together, values = lbfgs(rosenbrock_family, start, steps=25, history=5)
    for k in range(len(start)):
        # alone, row k keeps its own steepness: problem k of the family
        def alone_objective(x, rows, k=k):
            return rosenbrock_family(x, torch.full((len(x),), k))

        alone, value = lbfgs(alone_objective, start[k : k + 1], steps=25, history=5)
        torch.testing.assert_close(together[k], alone[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(values[k], value[0], rtol=1e-10, atol=1e-14)


def test_lbfgs_never_increases_the_loss_and_solves_a_quadratic():
    gen = torch.Generator().manual_seed(0)
    basis = torch.randn(3, 8, 8, generator=gen, dtype=torch.float64)
    hessians = basis @ basis.transpose(1, 2) + 0.1 * torch.eye(8, dtype=torch.float64)
    optimum = torch.randn(3, 8, generator=gen, dtype=torch.float64)

    def quadratic(x, rows):
        gap = x - (optimum if rows is None else optimum[rows])
        gradient = ((hessians if rows is None else hessians[rows]) @ gap[:, :, None]).squeeze(2)
        return 0.5 * (gap * gradient).sum(1), gradient

    start = torch.zeros(3, 8, dtype=torch.float64)
    previous = quadratic(start, None)[0]
    for steps in (1, 3, 10):
        _, value = lbfgs(quadratic, start, steps=steps)
        assert (value <= previous + 1e-12).all()
        previous = value
    x, _ = lbfgs(quadratic, start, steps=60)
    torch.testing.assert_close(x, optimum, rtol=1e-6, atol=1e-6)


def test_a_clients_training_is_the_same_on_its_rows_alone_or_among_others():
    """A Flower node holds only its client's rows: its minibatches (as samples) and its trained
    model must be those it gets among every other client's rows in process."""
    features, labels, client_ids = toy_clients()
    model = build_model("mlp", (6,), 4, hidden_dim=8, seed=1).double()
    everyone = torch.tensor([0, 1, 2, 4])
    options = dict(epochs=2, lr=0.1, batch_size=7, seed=3, prox_mu=0.3)
    together = local_sgd(model, features, labels, client_ids, everyone, **options)
    for row, client in enumerate(everyone.tolist()):
        mine = (client_ids == client).nonzero().squeeze(1)  # its rows, in their order
        schedule = minibatch_schedule(client_ids, everyone, epochs=2, batch_size=7, seed=3)
        among = [index[row][mask[row]] for index, mask in schedule if mask[row].any()]
        schedule = minibatch_schedule(client_ids[mine], torch.tensor([client]), epochs=2, batch_size=7, seed=3)
        alone = [mine[index[0][mask[0]]] for index, mask in schedule if mask[0].any()]  # back to positions
        assert len(alone) == len(among) and all(torch.equal(a, b) for a, b in zip(alone, among, strict=True))
        by_itself = local_sgd(model, features[mine], labels[mine], client_ids[mine], torch.tensor([client]),
                              **options)
        for name, value in by_itself.items():
            torch.testing.assert_close(together[name][row], value[0], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("per_client", [False, True])
def test_the_correction_is_added_to_every_steps_gradient(per_client):
    """SCAFFOLD's corrected step w ← w − lr (g(w) + r) equals SGD on CE + ⟨r, w⟩."""
    features, labels, client_ids = toy_clients()
    clients = torch.tensor([2, 0])
    model = build_model("linear", (6,), 4, seed=0).double()
    gen = torch.Generator().manual_seed(4)
    shape = lambda p: (2, *p.shape) if per_client else p.shape  # noqa: E731
    correction = {name: torch.randn(shape(p), generator=gen, dtype=p.dtype) for name, p in model.named_parameters()}
    trained = local_sgd(model, features, labels, client_ids, clients, epochs=2, lr=0.1, batch_size=16,
                        seed=2, correction=correction)
    schedule = list(minibatch_schedule(client_ids, clients, epochs=2, batch_size=16, seed=2))
    for row in range(2):
        alone = build_model("linear", (6,), 4, seed=0).double()
        optimizer = torch.optim.SGD(alone.parameters(), lr=0.1)
        for index, mask in schedule:
            mine = index[row][mask[row]]
            if len(mine) == 0:
                continue
            optimizer.zero_grad()
            loss = F.cross_entropy(alone(features[mine]), labels[mine])
            loss = loss + sum(((correction[name][row] if per_client else correction[name]) * p).sum()
                              for name, p in alone.named_parameters())
            loss.backward()
            optimizer.step()
        for name, value in alone.named_parameters():
            torch.testing.assert_close(trained[name][row], value.detach(), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="correction"):
        local_sgd(model, features, labels, client_ids, clients, epochs=1, lr=0.1, batch_size=16, seed=2,
                  correction={"weight": torch.zeros(3, 6, 4)})


def test_local_steps_count_each_clients_minibatches():
    _, _, client_ids = toy_clients()
    clients = torch.tensor([0, 2, 3, 4])
    steps = local_steps(client_ids, clients, epochs=3, batch_size=10)
    schedule = list(minibatch_schedule(client_ids, clients, epochs=3, batch_size=10, seed=0))
    counted = torch.stack([mask.any(1) for _, mask in schedule]).sum(0)
    assert torch.equal(steps, counted) and steps[2] == 0  # client 3 holds no data


def test_frozen_parameters_keep_their_value_and_the_rest_train_as_with_them_as_constants():
    """`frozen`: those parameters come back as they went in; the others equal torch.optim.SGD
    on the same model with the frozen ones out of the optimization (requires_grad off)."""
    import copy

    features, labels, client_ids = toy_clients()
    model = build_model("mlp", (6,), 4, hidden_dim=5, seed=2).double()
    clients = torch.tensor([0, 2, 4])
    options = dict(epochs=2, lr=0.1, batch_size=8, seed=3)
    trained = local_sgd(model, features, labels, client_ids, clients, frozen=("3.weight", "3.bias"), **options)
    assert list(trained) == [name for name, _ in model.named_parameters()]
    schedule = list(minibatch_schedule(client_ids, clients, epochs=2, batch_size=8, seed=3))
    for row in range(len(clients)):
        reference = copy.deepcopy(model)
        reference[3].requires_grad_(False)
        params, _ = reference_sgd(reference, features, labels, schedule, row, lr=0.1)
        for name, value in params.items():
            torch.testing.assert_close(trained[name][row], value.detach(), rtol=1e-12, atol=1e-12)
        assert torch.equal(trained["3.weight"][row], model[3].weight.detach())
    # lr 0: nothing moves
    still = local_sgd(model, features, labels, client_ids, clients, **{**options, "lr": 0.0})
    for name, p in model.named_parameters():
        assert torch.equal(still[name], p.detach().expand_as(still[name]))
    with pytest.raises(ValueError, match="frozen names"):
        local_sgd(model, features, labels, client_ids, clients, frozen=("9.weight",), **options)
