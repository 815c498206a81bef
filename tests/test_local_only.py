"""Local-only: each client's own ridge head, nothing sent."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as nnf

from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.linalg import grouped_ridge
from workbench.methods import LocalOnly

BLOBS = SyntheticBlobs(num_classes=5, dim=16, train_size=2000, test_size=200, separation=4.0, seed=6)


def data(num_clients: int = 40) -> FederatedDataModule:
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, personalized=True, num_clients=num_clients,
                             partition="dirichlet", alpha=0.2, min_partition_size=2, batch_size=300)
    dm.setup()
    return dm


def own_ridge(x: torch.Tensor, labels: torch.Tensor, num_classes: int, gamma: float) -> torch.Tensor:
    y = nnf.one_hot(labels, num_classes).double()
    return torch.linalg.solve(x.T @ x + gamma * torch.eye(x.shape[1], dtype=x.dtype), x.T @ y)


def test_each_head_is_the_clients_own_ridge_solution(fit_method):
    dm = data()
    sizes = torch.bincount(dm.train_client_ids, minlength=dm.num_clients)
    assert (sizes < BLOBS.dim).any() and (sizes >= BLOBS.dim).any()  # dual and primal solves
    method = LocalOnly(gamma=0.3)
    fit_method(method, dm)
    x = dm.train_features.double()
    for k in range(dm.num_clients):
        mine = dm.train_client_ids == k
        alone = own_ridge(x[mine], dm.train_labels[mine], dm.num_classes, 0.3)
        assert torch.linalg.norm(method.heads[k] - alone) <= 1e-8 * torch.linalg.norm(alone)


def test_chunked_solve_equals_one_chunk():
    dm = data()
    x = dm.train_features.double()
    y = nnf.one_hot(dm.train_labels, dm.num_classes).double()
    whole = grouped_ridge(x, y, dm.train_client_ids, dm.num_clients, 1.0)
    one_client_per_chunk = grouped_ridge(x, y, dm.train_client_ids, dm.num_clients, 1.0, max_chunk_bytes=1)
    assert torch.allclose(whole, one_client_per_chunk, rtol=0, atol=1e-12)


def test_nothing_is_sent(fit_method):
    method = LocalOnly()
    fit_method(method, data())
    metrics = method.fit_metrics
    assert metrics["comm/bytes_up"] == metrics["comm/bytes_down"] == metrics["comm/rounds"] == 0
    assert metrics["time/local_s"] > 0


def test_each_client_predicts_with_its_own_head_and_forward_averages_them(fit_method):
    dm = data(num_clients=10)
    method = LocalOnly()
    trainer = fit_method(method, dm)
    x, ids = dm.local_test_features, dm.local_test_client_ids
    expected = torch.einsum("nd,ndc->nc", x.double(), method.heads[ids])
    assert torch.allclose(method.predict_clients(x, ids), expected, rtol=0, atol=1e-12)
    assert torch.allclose(method(x), (x.double() @ method.heads).mean(0), rtol=0, atol=1e-12)
    result = trainer.test(method, datamodule=dm, verbose=False)[0]
    assert result["test/acc_local_mean"] > 0.8


def test_nonpositive_gamma_is_rejected():
    with pytest.raises(ValueError, match="gamma"):
        LocalOnly(gamma=0.0)
