"""The data's settings groups (`workbench.data.settings`): each one's checks, the data module's flat
arguments split among them with none lost, and the rows, identity and labels they give."""
from __future__ import annotations

import inspect
from dataclasses import fields, replace

import numpy as np
import pytest
import torch

from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.data.hf import OwnData
from workbench.data.settings import ClientSplits, FeatureSource, Partitioning

BLOBS = SyntheticBlobs(num_classes=5, dim=4, train_size=400, test_size=20, seed=1)  # 80 rows of each class
GROUPS = (FeatureSource, Partitioning, ClientSplits)


def datamodule(**settings) -> FederatedDataModule:
    return FederatedDataModule(**{"dataset": "synthetic", "synthetic": BLOBS, "num_clients": 4, **settings})


def labels() -> torch.Tensor:
    return BLOBS.generate()[1]


@pytest.mark.parametrize("group, change, message", [
    ("source", {"inputs": "pixels"}, "data.inputs must be 'features' or 'images', got 'pixels'"),
    ("source", {"inputs": "images"}, "the synthetic dataset is drawn in feature space and has no images"),
    ("source", {"precision": "fp16"}, "data.precision must be 'float32' or 'bf16', got 'fp16'"),
    ("source", {"feature_layers": ["blocks.2"]}, "data.feature_layers picks backbone layers"),
    ("source", {"trainable_tail": -1}, "data.trainable_tail must be an integer ≥ 0"),
    ("source", {"trainable_tail": 1, "standardize": True}, "drop data.feature_layers and data.standardize"),
    ("source", {"synthetic": SyntheticBlobs(dim=0)}, "data.synthetic.dim must be ≥ 1, got 0"),
    ("partitioning", {"partition": "nope"}, "unknown partition 'nope'"),
    ("partitioning", {"alpha": 0.0}, "data.alpha must be > 0 for a Dirichlet partition, got 0.0"),
    ("partitioning", {"num_clients": 0}, "data.num_clients must be ≥ 1, got 0"),
    ("partitioning", {"partition": "flower", "flower": {"by": "label"}}, "needs data.flower.partitioner"),
    ("splits", {"local_test_fraction": 1.0}, "data.local_test_fraction must be in (0, 1), got 1.0"),
    ("splits", {"val_fraction": -0.1}, "data.val_fraction must be in [0, 1), got -0.1"),
    ("splits", {"val_split": "server"}, "data.val_split must be pool (held out before partitioning) or clients"),
])
def test_each_group_refuses_its_bad_values_naming_the_setting_as_the_data_module_does(group, change, message):
    settings = replace(getattr(datamodule(), group), **change)
    with pytest.raises(ValueError) as raised:
        settings.check()
    assert message in str(raised.value)
    with pytest.raises(ValueError) as through_the_module:
        datamodule(**change)
    assert str(through_the_module.value) == str(raised.value)


def test_a_partition_by_client_ids_needs_a_source_that_names_them():
    dm = datamodule()
    for partitioning in (replace(dm.partitioning, partition="natural"),
                         replace(dm.partitioning, partition="flower", flower={"partitioner": "x", "by": "client"})):
        partitioning.check()  # its own settings are fine
        with pytest.raises(ValueError, match=f"data.partition={partitioning.partition} partitions by the data's own "
                                             "client ids: use data.dataset=hf and name the column in "
                                             "data.hf.client_column"):
            partitioning.check_source(dm.source)


def test_every_argument_of_the_data_module_belongs_to_exactly_one_group_and_reaches_it(tmp_path):
    arguments = [name for name in inspect.signature(FederatedDataModule.__init__).parameters if name != "self"]
    owners = {name: [group.__name__ for group in GROUPS if name in {field.name for field in fields(group)}]
              for name in arguments}
    assert {name: groups for name, groups in owners.items() if len(groups) != 1} == {"batch_size": []}
    assert sorted(field.name for group in GROUPS for field in fields(group)) == sorted(set(arguments) - {"batch_size"})

    given = dict(dataset="synthetic", data_dir=str(tmp_path / "data"), download=True, inputs="features",
                 backbone="resnet18", pretrained=False, weights_path="weights.pt", input_size=32,
                 mean=(0.1, 0.2, 0.3), std=(0.4, 0.5, 0.6), max_length=16, pooling="cls", precision="bf16",
                 feature_layers=None, trainable_tail=1, standardize=False, cache_dir=str(tmp_path / "cache"),
                 extract_batch_size=8, device="cpu", num_clients=3, partition="shard", alpha=0.3,
                 min_partition_size=2, self_balancing=True, num_shards_per_partition=3, shard_size=4,
                 num_classes_per_partition=3, seed=5, personalized=True, local_test_fraction=0.4, val_fraction=0.1,
                 val_split="clients", batch_size=64, synthetic=SyntheticBlobs(dim=3), hf=OwnData(path="x"),
                 flower={"partitioner": "linear"})
    assert set(given) == set(arguments)
    dm = FederatedDataModule(**given)
    for settings in (dm.source, dm.partitioning, dm.splits):
        assert all(getattr(settings, field.name) is given[field.name] for field in fields(settings))
    assert dm.args.batch_size == 64 and dm.num_clients == 3 and dm.synthetic is given["synthetic"]


def test_an_iid_plan_gives_each_client_its_flower_iid_rows():
    dm = datamodule(partition="iid", num_clients=9, seed=7)
    plan = dm._plan(labels())
    n = BLOBS.train_size
    expected = np.empty(n, dtype=np.int64)  # Flower's IidPartitioner: a seeded shuffle cut into near-equal runs
    expected[np.random.default_rng(7).permutation(n)] = np.repeat(np.arange(9), [45] * 4 + [44] * 5)
    assert torch.equal(torch.sort(plan.train).values, torch.arange(n))  # every row, once
    assert torch.equal(plan.train_client_ids, torch.from_numpy(expected)[plan.train])
    assert torch.equal(torch.bincount(plan.train_client_ids), torch.tensor([45] * 4 + [44] * 5))
    assert plan.holdout is None and plan.local_test is None


def test_a_pooled_holdout_takes_its_share_of_every_class_before_the_partition():
    plan = datamodule(partition="iid", val_fraction=0.2, val_split="pool").splits.plan(
        labels(), datamodule(partition="iid").partitioning)
    assert plan.holdout is not None and plan.holdout_client_ids is None
    assert torch.equal(torch.bincount(labels()[plan.holdout]), torch.tensor([16] * 5))  # round(0.2 · 80) a class
    assert torch.equal(torch.sort(torch.cat([plan.train, plan.holdout])).values, torch.arange(BLOBS.train_size))
    assert torch.equal(torch.bincount(plan.train_client_ids), torch.tensor([80] * 4))


def test_personalized_local_tests_are_rows_of_the_clients_the_partition_gave_them():
    dm = datamodule(partition="dirichlet", alpha=0.3, min_partition_size=20, personalized=True,
                    local_test_fraction=0.25)
    y = labels()
    plan = dm._plan(y)
    clients = dm.partitioning.assign(y)  # no pooled hold-out: the partition sees every row
    assert plan.local_test is not None and plan.local_test_client_ids is not None
    assert torch.equal(plan.train_client_ids, clients[plan.train])
    assert torch.equal(plan.local_test_client_ids, clients[plan.local_test])
    assert torch.equal(torch.sort(torch.cat([plan.train, plan.local_test])).values, torch.arange(BLOBS.train_size))
    for k in range(4):  # a quarter of each of the client's classes
        own = y[clients == k]
        assert torch.equal(torch.bincount(y[plan.local_test[plan.local_test_client_ids == k]], minlength=5),
                           torch.round(0.25 * torch.bincount(own, minlength=5)).long())


def test_identity_and_labels_hold_the_settings_that_decide_the_rows():
    blobs = {f"synthetic.{name}": value for name, value in
             dict(num_classes=5, dim=4, train_size=400, test_size=20, separation=6.0, seed=1).items()}
    backbone = dict(inputs="features", backbone="efficientnet_lite0", pretrained=True, input_size=None, mean=None,
                    std=None, max_length=None, pooling=None, precision="float32", feature_layers=None,
                    trainable_tail=0, standardize=False)
    plain = datamodule(partition="iid", batch_size=16, cache_dir="elsewhere")
    assert plain.identity() == {"dataset": "synthetic", **backbone, **blobs, "num_clients": 4, "partition": "iid",
                                "seed": 0, "personalized": False, "val_fraction": 0.0}
    assert plain.describe() == {"dataset": "synthetic", "backbone": "none", "partition": "iid", "num_clients": "4"}

    skewed = datamodule(alpha=0.1, personalized=True, val_fraction=0.1, val_split="clients")
    assert skewed.identity() == {"dataset": "synthetic", **backbone, **blobs, "num_clients": 4,
                                 "partition": "dirichlet", "alpha": 0.1, "min_partition_size": 10,
                                 "self_balancing": False, "seed": 0, "personalized": True, "local_test_fraction": 0.25,
                                 "val_fraction": 0.1, "val_split": "clients"}
    assert skewed.describe()["partition"] == "dirichlet(alpha=0.1)"
    assert datamodule(partition="shard", shard_size=20).describe()["partition"] == "shard(num_shards_per_partition=2)"
