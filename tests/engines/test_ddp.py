"""Several processes (Lightning's DDP on CPU, gloo): clients split across processes, the same model as one."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from tests.conftest import relative_error
from tests.engines.conftest import TINY, fit_in_processes, logged, saved_model
from workbench.cli import main
from workbench.data import FederatedDataModule, datasets
from workbench.engines import LightningEngine
from workbench.engines.ddp import client_shard
from workbench.methods import AFL


@pytest.mark.parametrize("sizes", [[5, 1, 9, 3, 3, 7, 2], [40, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 100, 1, 1]])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_each_process_gets_whole_clients_and_all_of_them(sizes, world_size):
    client_ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    shards = [client_shard(client_ids, rank, world_size) for rank in range(world_size)]
    assert shards[0].start == 0 and shards[-1].stop == len(client_ids)
    assert all(a.stop == b.start for a, b in itertools.pairwise(shards))  # disjoint and complete
    for shard in shards:
        assert shard.stop > shard.start
        inside = client_ids[shard].unique()
        assert int(torch.isin(client_ids, inside).sum()) == shard.stop - shard.start  # no client cut


def test_a_process_without_clients_is_a_clear_error():
    with pytest.raises(ValueError, match=r"process 1 of 2 would get no client.*fewer devices"):
        client_shard(torch.zeros(10, dtype=torch.long), 1, 2)


def test_plain_ddp_names_the_fix():
    engine = LightningEngine(AFL())
    engine._trainer = SimpleNamespace(strategy=DDPStrategy(), world_size=2)
    with pytest.raises(ValueError, match="FederatedDDPStrategy"):
        engine._check_processes()


@pytest.mark.subprocess
def test_two_processes_give_the_same_afl_model_as_one(tmp_path):
    done = fit_in_processes(tmp_path / "two")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("test accuracy") == 1  # one summary, from rank 0
    main(["fit", *TINY, f"--run_dir={tmp_path / 'one'}"])
    two, one = saved_model(tmp_path / "two"), saved_model(tmp_path / "one")
    for name in ("weight", "pooled_gram", "pooled_cross"):  # a client counted twice would double its share
        assert relative_error(two[f"method.{name}"], one[f"method.{name}"]) <= 1e-8
    assert logged(tmp_path / "two")["comm/bytes_up"] == logged(tmp_path / "one")["comm/bytes_up"]
    assert logged(tmp_path / "two")["test/acc"] == logged(tmp_path / "one")["test/acc"]


@pytest.mark.subprocess
def test_two_processes_with_dropouts_and_secure_aggregation(tmp_path):
    protocol = ["--federation.dropout=0.3", "--federation.secure_aggregation=true", "--federation.seed=4"]
    done = fit_in_processes(tmp_path / "two", *protocol)
    assert done.returncode == 0, done.stderr[-3000:]
    main(["fit", *TINY, f"--run_dir={tmp_path / 'one'}", *protocol])
    assert relative_error(saved_model(tmp_path / "two")["method.weight"],
                          saved_model(tmp_path / "one")["method.weight"]) <= 1e-8
    assert logged(tmp_path / "two")["comm/clients_in_round"] == 7


def tiny_images(data_dir, download):
    """120 random 8×8 grayscale images of 3 classes, in the dataset registry's layout."""
    labels = torch.arange(120) % 3
    images = torch.randint(0, 256, (120, 8, 8), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    split = datasets.ImageSplit
    return datasets.ImageDataset("tiny", split(images[:90].contiguous(), labels[:90]),
                                 split(images[90:].contiguous(), labels[90:]), ("a", "b", "c"), "test")


def test_one_process_extracts_the_features_and_every_process_reads_them(add_dataset, tmp_path, capsys):
    """Lightning runs `prepare_data` on one process per node while the others wait, then `setup` on all."""
    add_dataset("tiny_images", tiny_images)
    settings = dict(dataset="tiny_images", pretrained=False, input_size=32, cache_dir=str(tmp_path),
                    num_clients=3, partition="iid", device="cpu")
    alone = FederatedDataModule(**settings)
    alone.trainer = SimpleNamespace(world_size=1)
    alone.prepare_data()  # one process: `setup` extracts, nothing to do ahead of it
    assert not list(tmp_path.rglob("*.pt"))

    first = FederatedDataModule(**settings)
    first.trainer = SimpleNamespace(world_size=2)
    first.prepare_data()
    assert capsys.readouterr().out.count("extracted tiny_images/") == 2  # train and test
    assert len(list(tmp_path.rglob("*.pt"))) == 2
    processes = [FederatedDataModule(**settings) for _ in range(2)]
    for data in processes:
        data.setup()
    assert "extracted" not in capsys.readouterr().out  # every process read the cache
    assert torch.equal(processes[0].train_features, processes[1].train_features)
