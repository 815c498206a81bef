"""Choosing γ_out on the clients' hold-outs: each candidate is centralized ridge on the kept rows,
the choice is the best pooled hold-out accuracy, and the final model is ridge on every row."""
from __future__ import annotations

import pytest
import torch

from tests.methods.conftest import fit_rounds
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.engines import LightningEngine
from workbench.engines.local import LocalClients
from workbench.methods import AFL, Problem, SAFLe
from workbench.methods.ridge_selection import (
    checked_grid,
    choose_gamma,
    client_holdout,
    holdout_correct,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# few rows per dimension, so that γ_out matters
BLOBS = SyntheticBlobs(num_classes=6, dim=40, train_size=400, test_size=100, seed=5, separation=1.0)
GRID = [1e-3, 1.0, 30.0, 1000.0]


def data(**partition) -> FederatedDataModule:
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, batch_size=128, min_partition_size=1, **partition)
    dm.setup()
    return dm


def ridge(x: torch.Tensor, y: torch.Tensor, value: float, classes: int) -> torch.Tensor:
    onehot = torch.nn.functional.one_hot(y, classes).double()
    return torch.linalg.solve(x.T @ x + value * torch.eye(x.shape[1], dtype=x.dtype), x.T @ onehot)


def test_afl_candidates_choice_and_final_fit_are_the_centralized_ones(fit_method):
    dm = data(partition="dirichlet", alpha=0.3, num_clients=8)
    method = AFL(gamma=1.0, gamma_grid=GRID)
    engine = fit_method(method, dm)
    x, y, classes = dm.train_features.double(), dm.train_labels, dm.num_classes
    held = client_holdout(y, dm.train_client_ids, torch.unique(dm.train_client_ids), 0.1, 0)
    scores = [float(((x[held] @ ridge(x[~held], y[~held], value, classes)).argmax(1) == y[held]).double().mean())
              for value in GRID]
    assert len(set(scores)) > 1  # the grid matters here
    chosen = GRID[max(range(len(GRID)), key=lambda i: (scores[i], -i))]  # ties: the smaller γ
    assert float(method.selected_gamma_out) == chosen == engine.fit_metrics["afl/gamma"]
    assert engine.fit_metrics["afl/holdout_acc"] == pytest.approx(max(scores))
    assert torch.linalg.norm(method.weight - ridge(x, y, chosen, classes)) <= 1e-8 * torch.linalg.norm(method.weight)


def test_afl_selection_rounds_and_bytes_are_the_analytic_count(fit_method):
    dm = data(partition="iid", num_clients=5)
    engine = fit_method(AFL(gamma=1.0, gamma_grid=GRID), dm)
    d, classes, k, grid = BLOBS.dim, BLOBS.num_classes, 5, len(GRID)
    solve_round = 2 * (d * (d + 1) // 2 + d * classes)  # the Gram and ΦᵀY of all rows and of the hold-out
    assert engine.fit_metrics["comm/rounds"] == 2
    assert engine.fit_metrics["comm/bytes_up_per_client"] == (solve_round + grid + 1) * 8
    assert engine.fit_metrics["comm/bytes_down"] == (grid * d * classes + d * classes) * 8 * k  # candidates, W


def test_afl_selection_one_client_at_a_time_equals_the_vectorized_clients():
    """Each client's hold-out is its own (seeded by its id): computing the clients alone, as on
    Flower nodes, gives the same uploads every round and the same γ."""
    dm = data(partition="dirichlet", alpha=0.5, num_clients=6)
    problem = Problem((dm.feature_dim,), dm.num_classes, dm.num_clients)
    fitted = []
    for alone in (False, True):
        method = AFL(gamma=1.0, gamma_grid=GRID)
        method.setup(problem)
        ids = torch.unique(dm.train_client_ids).tolist()
        groups = [[k] for k in ids] if alone else [ids]
        clients = [LocalClients(method, dm.train_features[mine], dm.train_labels[mine], dm.train_client_ids[mine],
                                torch.tensor(group), 64)
                   for group in groups for mine in [torch.isin(dm.train_client_ids, torch.tensor(group))]]
        fit_rounds(method, clients, len(ids))
        fitted.append(method)
    assert float(fitted[0].selected_gamma_out) == float(fitted[1].selected_gamma_out)
    assert torch.allclose(fitted[0].weight, fitted[1].weight, rtol=1e-10, atol=1e-12)


def test_the_choice_depends_only_on_the_held_out_rows():
    """The scores are counts summed over clients: any grouping of the same hold-out rows into
    clients gives the same sums, so the same γ."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 90, 5, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 5, (90,), generator=generator)
    pooled = holdout_correct(logits, labels)
    for cuts in ([30, 60], [10, 20, 85]):
        parts = [holdout_correct(logits[:, a:b], labels[a:b]) for a, b in zip([0, *cuts], [*cuts, 90], strict=True)]
        summed = {name: sum(part[name] for part in parts) for name in pooled}
        assert all(torch.equal(summed[name], pooled[name]) for name in pooled)
        assert choose_gamma(GRID, summed, "x") == choose_gamma(GRID, pooled, "x")


def test_ties_go_to_the_smaller_gamma_and_an_empty_holdout_is_a_clear_error():
    uploads = {"holdout_correct": torch.tensor([3.0, 5.0, 5.0, 1.0]), "holdout_count": torch.tensor(10.0)}
    assert choose_gamma(GRID, uploads, "afl") == (1.0, {"afl/gamma": 1.0, "afl/holdout_acc": 0.5})
    with pytest.raises(ValueError, match="holdout_fraction"):
        choose_gamma(GRID, {**uploads, "holdout_count": torch.tensor(0.0)}, "afl")


def test_a_single_value_is_a_fixed_gamma_out_in_one_round(fit_method):
    dm = data(partition="iid", num_clients=3)
    method = AFL(gamma=1.0, gamma_grid=[30.0])
    engine = fit_method(method, dm)
    assert method.num_rounds == 1 and engine.fit_metrics["comm/rounds"] == 1
    assert float(method.selected_gamma_out) == 30.0
    x = dm.train_features.double()
    assert torch.allclose(method.weight, ridge(x, dm.train_labels, 30.0, dm.num_classes), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("grid", [[], [1.0, -1.0], [0.0, 1.0]])
def test_bad_grids_are_rejected(grid):
    with pytest.raises(ValueError, match="gamma_grid"):
        AFL(gamma_grid=grid)
    with pytest.raises(ValueError, match="gamma_grid"):
        checked_grid(grid)


def test_bad_holdout_fraction_is_rejected():
    with pytest.raises(ValueError, match="holdout_fraction"):
        AFL(gamma_grid=GRID, holdout_fraction=0.0)


@pytest.mark.parametrize("make", [lambda grid: AFL(gamma_grid=grid), lambda grid: SAFLe(gamma_grid=grid)],
                         ids=["AFL", "SAFLe"])
def test_data_with_no_holdout_row_is_refused_before_the_fit(make):
    """Too few rows of each class on every client to hold one out: refused by the engine's check
    (before a run folder exists), not half-way through the fit; the count is the draw's own."""
    tiny = FederatedDataModule(dataset="synthetic", min_partition_size=1, partition="iid", num_clients=4,
                               synthetic=SyntheticBlobs(num_classes=6, dim=8, train_size=24, test_size=12, seed=0))
    tiny.setup()
    with pytest.raises(ValueError, match="no client holds out a row"):
        LightningEngine(make(GRID)).check_data(tiny, fitting=True)
    LightningEngine(make([1.0])).check_data(tiny, fitting=True)  # one γ_out: no hold-out needed
    big = data(partition="iid", num_clients=4)
    LightningEngine(make(GRID)).check_data(big, fitting=True)
    assert client_holdout(big.train_labels, big.train_client_ids, torch.unique(big.train_client_ids), 0.1, 0).any()


def test_a_fit_saved_between_afls_rounds_resumes_to_the_same_model():
    """The candidates of round 0 are state (a checkpoint keeps them): a method restored from it
    scores the same candidates in round 1 (a resumed fit sent none before)."""
    dm = data(partition="dirichlet", alpha=0.5, num_clients=6)
    problem = Problem((dm.feature_dim,), dm.num_classes, dm.num_clients)
    method = AFL(gamma=1.0, gamma_grid=GRID)
    method.setup(problem)
    clients = [LocalClients(method, dm.train_features, dm.train_labels, dm.train_client_ids,
                            torch.unique(dm.train_client_ids), 64)]
    broadcast = method.broadcast()
    upload, _ = clients[0].half.client_update(0, broadcast, clients[0].data)
    method.finish_round(upload, 6)  # round 0, then "interrupted"
    resumed = AFL(gamma=1.0, gamma_grid=GRID)
    resumed.setup(problem)
    resumed.load_state_dict(method.state_dict())
    assert torch.equal(resumed.broadcast()["candidates"], method.broadcast()["candidates"])
    fit_rounds(method, clients, 6)
    fit_rounds(resumed, clients, 6)
    assert float(resumed.selected_gamma_out) == float(method.selected_gamma_out)
    assert torch.equal(resumed.weight, method.weight)
    older = {name: value for name, value in method.state_dict().items() if name != "candidates"}
    fresh = AFL(gamma=1.0, gamma_grid=GRID)  # a model saved before the candidates were kept loads
    fresh.setup(problem)
    fresh.load_state_dict(older)
    assert torch.equal(fresh.weight, method.weight)
