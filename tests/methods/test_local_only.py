"""Local-only: each client's own ridge head, nothing sent, no global model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as nnf

from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.engines.local import LocalClients
from workbench.linalg import grouped_ridge
from workbench.methods import LocalOnly, Problem

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
    engine = fit_method(LocalOnly(gamma=0.3), dm)
    heads = engine.client_half.heads
    assert torch.equal(engine.client_half.served, torch.arange(dm.num_clients))  # every client has data
    x = dm.train_features.double()
    for k in range(dm.num_clients):
        mine = dm.train_client_ids == k
        alone = own_ridge(x[mine], dm.train_labels[mine], dm.num_classes, 0.3)
        assert torch.linalg.norm(heads[k] - alone) <= 1e-8 * torch.linalg.norm(alone)


def test_one_cohort_call_equals_each_client_alone():
    """`finish` over every client at once gives each client the head it fits alone."""
    dm = data(num_clients=15)
    method = LocalOnly(gamma=0.5)
    method.setup(Problem((dm.feature_dim,), dm.num_classes, dm.num_clients))
    clients = LocalClients(method, dm.train_features, dm.train_labels, dm.train_client_ids,
                           torch.unique(dm.train_client_ids), batch_size=100)
    clients.half.finish({}, clients.data)
    together = clients.half.heads.clone()
    alone = method.client_half()  # a fresh half, as on another machine, one client at a time
    alone.setup_clients(clients.served, len(dm.train_labels))
    for k in clients.served:
        alone.finish({}, clients.cohort(k[None]))
    assert torch.linalg.norm(alone.heads - together) <= 1e-8 * torch.linalg.norm(together)


def test_chunked_solve_equals_one_chunk():
    dm = data()
    x = dm.train_features.double()
    y = nnf.one_hot(dm.train_labels, dm.num_classes).double()
    whole = grouped_ridge(x, y, dm.train_client_ids, dm.num_clients, 1.0)
    one_client_per_chunk = grouped_ridge(x, y, dm.train_client_ids, dm.num_clients, 1.0, max_chunk_bytes=1)
    assert torch.allclose(whole, one_client_per_chunk, rtol=0, atol=1e-12)


def test_nothing_is_sent(fit_method):
    method = LocalOnly()
    engine = fit_method(method, data())
    metrics = engine.fit_metrics
    assert metrics["comm/bytes_up"] == metrics["comm/bytes_down"] == metrics["comm/rounds"] == 0
    assert metrics["time/local_s"] > 0
    assert method.num_rounds == 0 and method.fitted and engine.trainer.current_epoch == 1  # one local pass


def test_each_client_predicts_with_its_own_head_and_there_is_no_global_model(fit_method):
    dm = data(num_clients=10)
    method = LocalOnly()
    engine = fit_method(method, dm)
    heads = engine.client_half.heads
    x, ids = dm.local_test_features, dm.local_test_client_ids
    expected = torch.einsum("nd,ndc->nc", x.double(), heads[ids])
    assert torch.allclose(engine.client_half.predict(x, ids), expected, rtol=0, atol=1e-12)
    assert not method.global_model and method.personalized
    with pytest.raises(NotImplementedError, match="no global model"):
        method(x)
    result = engine.trainer.test(engine, datamodule=dm, verbose=False)[0]
    assert result["test/acc_local_mean"] > 0.8
    assert "test/acc" not in result  # no global model to score on the global test split


def test_testing_an_unfitted_model_is_a_clear_error():
    from lightning import Trainer

    from workbench.engines import LightningEngine
    with pytest.raises(RuntimeError, match="not fitted"):
        Trainer(logger=False, enable_progress_bar=False).test(LightningEngine(LocalOnly()), datamodule=data(5),
                                                              verbose=False)


def test_nonpositive_gamma_is_rejected():
    with pytest.raises(ValueError, match="gamma"):
        LocalOnly(gamma=0.0)
