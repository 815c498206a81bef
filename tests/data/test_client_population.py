"""A node's data (`FederatedDataModule.population(client)`): one client's rows of every split, the
same rows as the whole data's, with backbone features read or extracted for those rows only."""
from __future__ import annotations

import pytest
import torch

import workbench.data.features as features_module
from tests.methods.conftest import fake_images
from workbench.data import FederatedDataModule, SyntheticBlobs


def tiny(cache_dir, **settings) -> FederatedDataModule:
    """The 90 training images of `fake_images` through a seeded EfficientNet-Lite0 at 32 px."""
    return FederatedDataModule(**{"dataset": "tiny_images", "backbone": "efficientnet_lite0", "pretrained": False,
                                  "input_size": 32, "cache_dir": str(cache_dir), "device": "cpu", "num_clients": 3,
                                  "partition": "dirichlet", "alpha": 1.0, "min_partition_size": 5,
                                  "val_fraction": 0.2, "val_split": "clients", "personalized": True, **settings})


def extracted_rows(monkeypatch) -> list[int]:
    """The number of images each backbone extraction takes from now on."""
    calls: list[int] = []
    extract = features_module.extract_features

    def counting(backbone, images, *args, **kwargs):
        calls.append(len(images))
        return extract(backbone, images, *args, **kwargs)

    monkeypatch.setattr(features_module, "extract_features", counting)
    return calls


def assert_same_share(node, whole, client: int, tolerance: float = 0.0) -> None:
    expected = whole.population().client(client)
    for split in ("train", "holdout", "local_test"):
        mine, theirs = getattr(node.client(client), split), getattr(expected, split)
        if theirs is None:  # (a pooled hold-out: no client's)
            assert mine is None, split
            continue
        assert torch.equal(mine.labels, theirs.labels) and torch.equal(mine.client_ids, theirs.client_ids), split
        torch.testing.assert_close(mine.features, theirs.features, rtol=tolerance, atol=tolerance)


def test_a_node_reads_only_its_clients_rows_from_the_cache(add_dataset, tmp_path, monkeypatch):
    add_dataset("tiny_images", fake_images)
    whole = tiny(tmp_path)
    whole.setup()  # extracts both splits and caches them
    calls = extracted_rows(monkeypatch)
    for client in range(3):
        node = tiny(tmp_path).population(client)
        assert_same_share(node, whole, client)  # bit for bit: the cached rows themselves
        assert len(node.test) == 0 and node.holdout is not None
        assert (node.num_clients, node.num_classes, node.input_shape) == (3, 3, whole.input_shape)
    assert calls == []  # nothing extracted


def test_a_node_without_the_cache_extracts_its_rows_alone(add_dataset, tmp_path, monkeypatch):
    add_dataset("tiny_images", fake_images)
    calls = extracted_rows(monkeypatch)
    node = tiny(tmp_path / "empty").population(1)
    share = node.client(1)
    rows = len(share.train) + len(share.holdout) + len(share.local_test)
    assert calls == [rows] and rows < 90  # its rows, no test split, nothing else
    assert not any((tmp_path / "empty").rglob("*.pt"))  # a cache file holds a whole split: none written
    whole = tiny(tmp_path / "whole")
    whole.setup()
    assert_same_share(node, whole, 1, tolerance=1e-5)  # other batches: the last bits may differ


def test_a_damaged_cache_gives_a_warning_and_the_rows_extracted(add_dataset, tmp_path, monkeypatch):
    add_dataset("tiny_images", fake_images)
    whole = tiny(tmp_path)
    whole.setup()
    for cached in tmp_path.rglob("train-*.pt"):
        cached.write_bytes(cached.read_bytes()[:100])
    calls = extracted_rows(monkeypatch)
    with pytest.warns(UserWarning, match="cannot give these rows"):
        node = tiny(tmp_path).population(0)
    assert len(calls) == 1
    assert_same_share(node, whole, 0, tolerance=1e-5)


def test_data_that_is_its_own_inputs_is_set_up_whole_and_sliced():
    blobs = SyntheticBlobs(num_classes=3, dim=5, train_size=120, test_size=30)
    dm = FederatedDataModule(dataset="synthetic", synthetic=blobs, num_clients=4, partition="iid", val_fraction=0.25,
                             val_split="pool")
    node = dm.population(2)
    assert node.holdout is None  # a pooled hold-out belongs to no client
    assert_same_share(node, dm, 2)
    with pytest.raises(ValueError, match=r"client 4 is outside"):
        dm.population(4)


def test_a_flower_node_serves_its_partition_from_its_own_rows(add_dataset, tmp_path, monkeypatch):
    pytest.importorskip("flwr", reason="the Flower engine needs the `flower` extra: pip install -e '.[flower]'")
    from workbench.engines.flower import client_app
    from workbench.engines.flower.spec import RunSpec
    from workbench.methods import AFL

    add_dataset("tiny_images", fake_images)
    spec = RunSpec.of(AFL(), tiny(tmp_path))
    calls = extracted_rows(monkeypatch)
    monkeypatch.setattr(client_app, "_datamodules", {})
    node = client_app.client_data(spec, 2, 3)
    assert node.client == 2 and len(calls) == 1 and calls[0] < 90
    assert node.problem.num_classes == 3 and node.problem.input_shape == (1280,)


def test_a_process_serving_several_nodes_loads_the_data_once_more_at_most(add_dataset, tmp_path, monkeypatch):
    add_dataset("tiny_images", fake_images)
    tiny(tmp_path).setup()  # the cache
    loads = []
    raw_data = FederatedDataModule._raw_data
    monkeypatch.setattr(FederatedDataModule, "_raw_data", lambda self: loads.append(1) or raw_data(self))
    dm = tiny(tmp_path)
    first = dm.population(0)
    assert dm.population(0) is first and len(loads) == 1  # a node asks twice: one load
    for client in (1, 2, 1):
        assert_same_share(dm.population(client), dm, client)
    assert len(loads) == 2  # the second client: the whole data, once, for every client after
