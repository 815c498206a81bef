"""The data boundary: a set-up data module's `Population` and each client's `ClientData`."""
from __future__ import annotations

import pytest
import torch

from workbench.data import ClientData, FederatedDataModule, Population, SyntheticBlobs
from workbench.data.population import population_of
from workbench.engines import LightningEngine
from workbench.methods import AFL, Problem

BLOBS = SyntheticBlobs(num_classes=4, dim=6, train_size=300, test_size=60, seed=2)


def datamodule(**settings) -> FederatedDataModule:
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, num_clients=5, partition="dirichlet", alpha=0.5,
                             min_partition_size=5, batch_size=32, **settings)
    dm.setup()
    return dm


def test_the_population_holds_the_data_modules_own_tensors_and_shape():
    dm = datamodule(val_fraction=0.2, val_split="clients", personalized=True)
    population = dm.population()
    assert population.train.features.data_ptr() == dm.train_features.data_ptr()  # no copy
    assert torch.equal(population.client_ids, dm.train_client_ids)
    assert torch.equal(population.test.labels, dm.test_labels)
    assert population.holdout is not None and torch.equal(population.holdout.client_ids, dm.val_client_ids)
    assert population.local_test is not None and torch.equal(population.local_test.labels, dm.local_test_labels)
    assert (population.num_clients, population.num_classes, population.input_shape) == (5, 4, (6,))
    assert population.batch_size == 32 and dict(population.identity) == dm.identity()
    assert population.names == dm.describe()
    assert torch.equal(population.rows_per_client(), torch.bincount(dm.train_client_ids, minlength=5))
    assert Problem.of(population) == Problem((6,), 4, 5)


def test_each_clients_share_is_its_rows_of_every_split():
    dm = datamodule(val_fraction=0.2, val_split="clients", personalized=True)
    population = dm.population()
    shares = [population.client(k) for k in range(population.num_clients)]
    assert all(isinstance(share, ClientData) and share.client == k for k, share in enumerate(shares))
    for split, whole, ids in (("train", dm.train_features, dm.train_client_ids),
                              ("holdout", dm.val_features, dm.val_client_ids),
                              ("local_test", dm.local_test_features, dm.local_test_client_ids)):
        for k, share in enumerate(shares):
            rows = getattr(share, split)
            assert torch.equal(rows.features, whole[ids == k]) and bool((rows.client_ids == k).all()), (split, k)
        assert sum(len(getattr(share, split)) for share in shares) == len(whole)
    with pytest.raises(ValueError, match=r"client 5 is outside the federation's \[0, 5\)"):
        population.client(5)


def test_a_pooled_holdout_belongs_to_no_client_and_absent_splits_are_none():
    population = datamodule(val_fraction=0.2, val_split="pool").population()
    assert population.holdout is not None and population.holdout.client_ids is None
    assert population.client(0).holdout is None and population.local_test is None
    plain = datamodule().population()
    assert plain.holdout is None and plain.split("holdout") is None
    with pytest.raises(ValueError, match="no split 'val'"):
        plain.split("val")


def test_the_engine_and_methods_take_a_population_and_other_objects_are_refused():
    dm = datamodule()
    engine = LightningEngine(AFL())
    engine.check_data(dm.population(), fitting=True)  # as from the data module itself
    assert engine.method.problem == Problem.of(population_of(dm))
    assert population_of(dm.population()) is not None
    with pytest.raises(TypeError, match="a Population or a FederatedDataModule"):
        population_of({"train_features": dm.train_features})
    with pytest.raises(RuntimeError, match="setup"):
        FederatedDataModule(dataset="synthetic").population()


def test_a_population_is_frozen():
    population = datamodule().population()
    assert isinstance(population, Population)
    with pytest.raises(AttributeError):
        population.num_clients = 3  # type: ignore[misc]
