"""The personalized protocol: every client's share split into its own train and local test."""
from __future__ import annotations

import csv

import pytest
import torch

from workbench.cli import main
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.data.partition import stratified_holdout
from workbench.methods import AnaPFL, LocalOnly

BLOBS = SyntheticBlobs(num_classes=5, dim=8, train_size=3000, test_size=300, seed=1)


def personalized(**kw) -> FederatedDataModule:
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, personalized=True, num_clients=20,
                             partition="dirichlet", alpha=0.3, min_partition_size=5, **kw)
    dm.setup()
    return dm


def test_each_client_share_is_split_by_class():
    dm = personalized()
    for k in range(dm.num_clients):
        train = dm.train_labels[dm.train_client_ids == k]
        local = dm.local_test_labels[dm.local_test_client_ids == k]
        for c in range(BLOBS.num_classes):
            share = int((train == c).sum() + (local == c).sum())
            assert int((local == c).sum()) == round(0.25 * share)
    pooled = len(dm.train_labels) + len(dm.local_test_labels)
    assert pooled == BLOBS.train_size  # nothing lost, nothing twice
    assert len(dm.test_labels) == BLOBS.test_size  # the global test split is untouched


def test_split_is_disjoint_and_deterministic():
    a, b = personalized(), personalized()
    assert torch.equal(a.local_test_features, b.local_test_features)
    train_rows = {tuple(r.tolist()) for r in a.train_features}
    assert not any(tuple(r.tolist()) in train_rows for r in a.local_test_features)
    assert not torch.equal(personalized(seed=5).local_test_labels, a.local_test_labels)


def test_stratified_holdout_counts_per_stratum():
    labels = torch.tensor([0] * 10 + [1] * 3 + [2] * 1)
    groups = torch.tensor([0] * 5 + [1] * 5 + [0] * 3 + [1])
    mask = stratified_holdout(labels, 0.4, seed=0, groups=groups)
    assert mask[:5].sum() == 2 and mask[5:10].sum() == 2 and mask[10:13].sum() == 1 and mask[13:].sum() == 0


def test_global_method_is_scored_on_every_clients_local_test(tmp_path):
    cli = main(["fit", "--model=AFL", "--data=FederatedDataModule", "--data.dataset=synthetic",
                "--data.personalized=true", "--data.num_clients=8", "--data.alpha=0.3",
                "--trainer.enable_progress_bar=false", f"--run_dir={tmp_path}"])
    logged = cli.trainer.callback_metrics
    assert {"test/acc", "test/acc_local_mean", "test/acc_local_std", "test/acc_local_min"} <= set(logged)
    rows = list(csv.DictReader(open(next(tmp_path.rglob("per_client_acc.csv")))))
    assert [int(r["client"]) for r in rows] == list(range(8))
    accuracy = torch.tensor([float(r["acc"]) for r in rows])
    assert abs(float(logged["test/acc_local_mean"]) - float(accuracy.mean())) < 1e-6
    assert abs(float(logged["test/acc_local_min"]) - float(accuracy.min())) < 1e-6


@pytest.mark.parametrize("make", [lambda: LocalOnly(), lambda: AnaPFL(hidden_dim=32, lambdas=[0.0, 0.5, 1.0])],
                         ids=["LocalOnly", "AnaPFL"])
def test_personalized_method_is_scored_with_each_clients_own_model(fit_method, make):
    dm = personalized()
    method = make()
    engine = fit_method(method, dm)
    result = engine.trainer.test(engine, datamodule=dm, verbose=False)[0]
    assert ("test/acc" in result) == method.global_model  # LocalOnly has no global model
    x, labels, ids = dm.local_test_features, dm.local_test_labels, dm.local_test_client_ids
    correct = engine.client_half.predict(x, ids).argmax(1).eq(labels).double()
    accuracy = torch.zeros(dm.num_clients, dtype=torch.float64).index_add_(0, ids, correct) / torch.bincount(ids)
    assert engine.local_accuracy["client"] == list(range(dm.num_clients))
    assert torch.allclose(torch.tensor(engine.local_accuracy["acc"], dtype=torch.float64), accuracy, atol=1e-12)
    assert abs(result["test/acc_local_mean"] - float(accuracy.mean())) < 1e-6
    assert abs(result["test/acc_local_min"] - float(accuracy.min())) < 1e-6
