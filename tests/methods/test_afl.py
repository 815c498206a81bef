"""AFL: the federated solution is centralized ridge regression, whatever the partition."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import centralized_ridge, relative_error
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.engines.local import LocalClients
from workbench.methods import AFL, Problem

# 20 classes so that a Dirichlet(0.05) draw can give each of 100 clients some samples
BLOBS = SyntheticBlobs(num_classes=20, dim=24, train_size=6000, test_size=600, seed=3)


def data(**partition) -> FederatedDataModule:
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, batch_size=512,
                             min_partition_size=1, **partition)
    dm.setup()
    return dm


PARTITIONS = [
    {"partition": "iid"},
    {"partition": "dirichlet", "alpha": 0.05},
    {"partition": "dirichlet", "alpha": 0.5},
    {"partition": "shard", "num_shards_per_partition": 2},
]


@pytest.mark.parametrize("num_clients", [1, 10, 100])
@pytest.mark.parametrize("partition", PARTITIONS, ids=lambda p: "-".join(map(str, p.values())))
@pytest.mark.parametrize("gamma_out", [0.0, 0.5])
def test_federated_equals_centralized(fit_method, num_clients, partition, gamma_out):
    dm = data(num_clients=num_clients, **partition)
    method = AFL(gamma=1.0, gamma_out=gamma_out)
    fit_method(method, dm)
    assert relative_error(method.weight, centralized_ridge(dm, gamma_out)) <= 1e-8


def test_bias_feature_is_centralized_ridge_with_a_constant_column(fit_method):
    dm = data(num_clients=10, partition="dirichlet", alpha=0.1)
    method = AFL(gamma=3.0, gamma_out=0.1, bias=True)
    fit_method(method, dm)
    assert method.weight.shape == (BLOBS.dim + 1, BLOBS.num_classes)
    assert relative_error(method.weight, centralized_ridge(dm, 0.1, bias=True)) <= 1e-8


def test_two_partitions_give_the_same_model(fit_method):
    weights = []
    for partition in ({"partition": "iid", "num_clients": 7},
                      {"partition": "dirichlet", "alpha": 0.05, "num_clients": 50, "seed": 9}):
        method = AFL()
        fit_method(method, data(**partition))
        weights.append(method.weight)
    assert relative_error(weights[0], weights[1]) <= 1e-8


def test_one_cohort_call_is_the_sum_of_each_clients_own_upload():
    """The client half vectorized over every client equals the clients computing alone."""
    dm = data(num_clients=13, partition="dirichlet", alpha=0.3)
    method = AFL(gamma=2.0)
    method.setup(Problem((dm.feature_dim,), dm.num_classes, dm.num_clients))
    clients = LocalClients(method, dm.train_features, dm.train_labels, dm.train_client_ids,
                           torch.unique(dm.train_client_ids), batch_size=100)
    together, _ = clients.half.client_update(0, {}, clients.cohort(clients.served))
    alone = {"gram": 0, "cross": 0}
    for k in clients.served:
        upload, _ = clients.half.client_update(0, {}, clients.cohort(k[None]))
        assert torch.allclose(upload["gram"], upload["gram"].T)  # each client's G_k + γI
        alone = {name: alone[name] + upload[name] for name in alone}
    for name in alone:
        assert relative_error(together[name], alone[name]) <= 1e-12


@pytest.mark.parametrize("bias", [False, True])
def test_bytes_are_the_analytic_count(fit_method, bias):
    dm = data(num_clients=10, partition="iid")
    engine = fit_method(AFL(bias=bias), dm)
    d, classes, k = BLOBS.dim + int(bias), BLOBS.num_classes, 10
    per_client = (d * (d + 1) // 2 + d * classes) * 8  # packed G_k + γI and H_k, float64
    assert engine.fit_metrics["comm/bytes_up_per_client"] == per_client
    assert engine.fit_metrics["comm/bytes_up"] == per_client * k
    assert engine.fit_metrics["comm/bytes_down"] == d * classes * 8 * k
    assert engine.fit_metrics["comm/rounds"] == 1


def test_singular_gram_falls_back_to_least_squares_with_a_warning(fit_method):
    """Duplicated feature columns make XᵀX singular; γ_out = 0 then means the pseudo-inverse."""
    blobs = SyntheticBlobs(num_classes=3, dim=4, train_size=300, test_size=30)
    dm = FederatedDataModule(dataset="synthetic", synthetic=blobs, num_clients=3, partition="iid")
    dm.setup()
    dm.train_features = torch.cat([dm.train_features, dm.train_features[:, :2]], 1)
    dm.test_features = torch.cat([dm.test_features, dm.test_features[:, :2]], 1)
    method = AFL(gamma=1.0, gamma_out=0.0)
    with pytest.warns(UserWarning, match="singular"):
        fit_method(method, dm)
    x = dm.train_features.double()
    y = torch.nn.functional.one_hot(dm.train_labels, 3).double()
    assert relative_error(method.weight, torch.linalg.pinv(x) @ y) <= 1e-6


def test_accuracy_on_separable_blobs(fit_method):
    dm = data(num_clients=10, partition="dirichlet", alpha=0.1)
    engine = fit_method(AFL(), dm)
    result = engine.trainer.test(engine, datamodule=dm, verbose=False)[0]
    assert result["test/acc"] > 0.95


def test_testing_an_unfitted_model_is_a_clear_error():
    from lightning import Trainer

    from workbench.engines import LightningEngine
    dm = data(num_clients=2, partition="iid")
    with pytest.raises(RuntimeError, match="not fitted"):
        Trainer(logger=False, enable_progress_bar=False).test(LightningEngine(AFL()), datamodule=dm, verbose=False)


def test_negative_regularization_is_rejected():
    with pytest.raises(ValueError, match="gamma"):
        AFL(gamma=-1.0)
