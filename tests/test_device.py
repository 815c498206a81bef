"""Every method's rounds on a device other than the host (`fake_device`: a recording stand-in for a
GPU): no host tensor mixes into the device's work, the model is bit for bit the host's, and the
host waits for the device a fixed number of times a round: not once per client, per chunk of rows
or per local step."""
from __future__ import annotations

import pytest
import torch

from tests.fake_device import DEVICE, Transfers, fake_device
from tests.conformance import METHODS, data
from tests.test_features import FakeBackbone
from workbench.data import FederatedDataModule
from workbench.data.features import extract_features
from workbench.engines.local import LocalClients
from workbench.methods.base import Problem

HOST = torch.device("cpu")


def fit(name: str, dm: FederatedDataModule, device: torch.device, record: Transfers | None = None,
        local_epochs: int | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[Transfers]]:
    """The engine's rounds without Lightning (plan; the clients' vectorized update; the server's
    update; the final broadcast and the clients' local work) on `device`: (the method's state on
    the host, its logits of the test split (each local test row under its own client's model for
    personalized methods), what each round transferred)."""
    method = METHODS[name][0]()
    if local_epochs is not None:
        method.local_epochs = local_epochs
    method.setup(Problem(tuple(dm.input_shape), dm.num_classes, dm.num_clients))
    ids = dm.train_client_ids.to(device)
    clients = LocalClients(method, dm.train_features.to(device), dm.train_labels.to(device), ids,
                           torch.unique(ids), dm.hparams.batch_size)
    method.to(device), clients.half.to(device)  # as Lightning moves the engine after its setup
    available, nobody = torch.unique(ids), torch.zeros(0, dtype=torch.long, device=device)
    rounds = []
    for round_index in range(method.num_rounds):
        if record is not None:
            record.clear()
        plan = method.plan_round(available)
        cohort = plan.clients.to(device)
        replies = clients.update(round_index, plan.broadcast, cohort, nobody, None)
        method.server_update(replies.uploads, len(cohort))
        method.rounds_done += 1
        if record is not None:
            rounds.append(record.copy())
    clients.finish(method.final_broadcast())
    method.finished.fill_(True)
    if method.personalized:
        logits = clients.predict(dm.local_test_features.to(device), dm.local_test_client_ids.to(device))
    else:
        logits = method.logits(dm.test_features.to(device))
    state = {key: value.cpu() for key, value in method.state_dict().items()}
    return state, logits.cpu(), rounds


@pytest.fixture(scope="module")
def small():
    return data(num_clients=3)


@pytest.fixture(scope="module")
def larger():
    """Twice the clients, a quarter of the rows per chunk (`batch_size`), twice the local steps."""
    dm = data(num_clients=6)
    dm.hparams.batch_size = 16
    return dm


GRADIENT = {"FedAvg", "FedProx", "Ditto", "OSFED", "SCAFFOLD"}
READS = {  # what a method reads from the device beyond a few numbers a round, in bytes
    # λ's round: each client draws its hold-out on the host with its own generator, from its labels
    "AnaPFL": lambda dm: 8 * len(dm.train_labels),
    # the class sizes of every chunk of rows (to split a chunk by class for the per-class Gram matrices)
    "GHOFL": lambda dm: 8 * dm.num_classes * -(-len(dm.train_labels) // dm.hparams.batch_size),
}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_method_runs_on_the_device_as_on_the_host(name, small, larger):
    state, logits, _ = fit(name, small, HOST)
    with fake_device() as record:
        device_state, device_logits, rounds = fit(name, small, DEVICE, record)
        *_, larger_rounds = fit(name, larger, DEVICE, record, local_epochs=2 if name in GRADIENT else None)
    assert device_state.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(device_state[key], value), key
    assert torch.equal(device_logits, logits)
    for round_index, (transfers, larger_transfers) in enumerate(zip(rounds, larger_rounds)):
        where = f"{name}, round {round_index}:\n{larger_transfers.summary()}"
        # the same few reads a round (cohort sizes, a solver's check, metrics) however large the round
        # (a few more where state grows: a client table's first rows for new clients)
        assert len(larger_transfers.syncs) <= len(transfers.syncs) + 8, where
        assert len(transfers.syncs) <= 40, where
        # and what crosses is never the data or the model
        assert larger_transfers.bytes_to_host <= 256 + READS.get(name, lambda dm: 0)(larger), where



def test_features_are_extracted_on_the_device_with_one_copy_each_way():
    """Images go to the device as uint8 and are preprocessed there; features come back with copies
    that do not wait (into page-locked memory on a GPU): no sync per batch."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    backbone = FakeBackbone(model)
    images = torch.randint(0, 256, (40, 12, 12, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    on_host = extract_features(backbone, images, batch_size=16)
    with fake_device() as record:
        on_device = extract_features(backbone, images, batch_size=16, device=str(DEVICE))
    assert torch.equal(on_device, on_host)
    assert record.syncs == [], record.summary()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    normalization = 2 * 3 * 4  # the mean and std, 3 floats each, once
    # one byte a pixel: preprocessing is the device's work
    assert record.bytes_to_device == images.numel() + weights + normalization, record.summary()
    assert record.bytes_to_host == on_host.numel() * 4
