"""What the gradient methods' tests share: tiny blobs, the small MLP head and its local training,
float64 fits, a centralized SGD reference, a tiny image dataset."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.conftest import quiet_trainer
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.data import datasets as dataset_registry
from workbench.engines import LightningEngine
from workbench.engines.local import LocalClients
from workbench.federation.local_training import LocalTraining, minibatch_schedule
from workbench.methods.gradient import MINIBATCHES, round_seed
from workbench.methods.heads import build_model

BLOBS = SyntheticBlobs(num_classes=4, dim=8, train_size=600, test_size=200, seed=0)


SMALL = dict(architecture="mlp", hidden_dim=8)  # an 8 → 8 → 4 MLP


def small(**local) -> dict:
    """SMALL's model trained locally at lr 0.1 in batches of 32 (`local` changes or adds settings)."""
    return {**SMALL, "local": LocalTraining(**{"lr": 0.1, "batch_size": 32, **local})}


P = 8 * 8 + 8 + 8 * 4 + 4  # parameters of the 8 → 8 → 4 MLP


def data(num_clients: int = 5, partition: str = "iid", **kw) -> FederatedDataModule:
    dm = FederatedDataModule(
        dataset="synthetic",
        synthetic=BLOBS,
        num_clients=num_clients,
        partition=partition,
        min_partition_size=1,
        **kw,
    )
    dm.setup()
    return dm


def fit64(method, dm, federation=None) -> LightningEngine:
    """A full fit in float64 in process; returns the engine."""
    engine = LightningEngine(method, federation)
    quiet_trainer(precision="64-true").fit(engine, datamodule=dm)
    return engine


def centralized_sgd(dm, rounds: int, lr_of_round, momentum: float = 0.0, weight_decay: float = 0.0) -> torch.Tensor:
    """One client's MLP head (seed 4) after `rounds` rounds of torch.optim.SGD on the minibatches
    FedAvg draws for it (2 epochs of batches of 32 per round), a fresh optimizer (and momentum
    buffer) each round at the step `lr_of_round(t)`: the flat parameters, float64."""
    model = build_model("mlp", (8,), 4, hidden_dim=8, seed=4).double()
    features, labels = dm.train_features.double(), dm.train_labels
    for round_index in range(rounds):
        optimizer = torch.optim.SGD(model.parameters(), lr=lr_of_round(round_index), momentum=momentum,
                                    weight_decay=weight_decay)
        for index, mask in minibatch_schedule(dm.train_client_ids, torch.tensor([0]), epochs=2, batch_size=32,
                                              seed=round_seed(4, round_index, MINIBATCHES)):
            batch = index[0][mask[0]]
            optimizer.zero_grad()
            F.cross_entropy(model(features[batch]), labels[batch]).backward()
            optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def fake_images(data_dir, download):
    """A tiny grayscale image dataset in the registry's layout: class c lights rows 3c, 3c+1."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(120) % 3
    images = torch.randint(0, 100, (120, 8, 8), generator=gen)
    for c in range(3):
        images[labels == c, 3 * c : 3 * c + 2] += 150
    images = images.to(torch.uint8)
    split = dataset_registry.ImageSplit
    return dataset_registry.ImageDataset(
        "tiny",
        split(images[:90].contiguous(), labels[:90]),
        split(images[90:].contiguous(), labels[90:]),
        ("a", "b", "c"),
        "test",
    )


# ---- the paper's scale: the cg solver, quantile thresholds, γ from the hold-outs ------------------
def fit_rounds(method, clients: list[LocalClients], num_clients: int) -> dict[str, float]:
    """Every round by hand, summing the uploads of `clients` (client halves, e.g. one per client)."""
    metrics = {}
    while method.rounds_left:
        broadcast = method.broadcast()
        summed = {}
        for served in clients:
            upload, _ = served.half.client_update(method.round, broadcast, served.data)
            summed = {name: summed.get(name, 0) + value for name, value in upload.items()}
        metrics.update(method.finish_round(summed, num_clients))
    return metrics
