"""Every method's rounds on a device other than the host (`fake_device`: a recording stand-in for a
GPU): no host tensor mixes into the device's work, the model is bit for bit the host's, and the
host waits for the device a fixed number of times a round: not once per client, per chunk of rows
or per local step."""
from __future__ import annotations

import copy
import functools
from collections import Counter
from dataclasses import dataclass, replace

import pytest
import torch

from tests.conftest import FakeBackbone
from tests.engines.conformance import METHODS, data, protocol_of
from tests.engines.fake_device import DEVICE, Transfers, fake_device
from workbench.data import FederatedDataModule, features
from workbench.data.features import extract_features, extract_text_features
from workbench.engines.local import LocalClients
from workbench.engines.round import FitProtocol, run_final, run_round
from workbench.federation import Federation
from workbench.methods.base import Problem
from workbench.methods.gradient import GradientMethod

HOST = torch.device("cpu")


def fit(name: str, dm: FederatedDataModule, device: torch.device, record: Transfers | None = None,
        local_epochs: int | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[Transfers]]:
    """The engine's rounds (`run_round`: plan, the clients' vectorized step, the server's update;
    then `run_final`: the final broadcast and the clients' local work) on `device`, without
    Lightning: (the method's state on the host, its logits of the test split (each local test row
    under its own client's model for personalized methods), what each round transferred)."""
    method = METHODS[name][0]()
    if local_epochs is not None:
        method.local = replace(method.local, epochs=local_epochs)
    method.setup(Problem.of(dm.population()))
    ids = dm.train_client_ids.to(device)
    federation = protocol_of(name) or Federation()
    clients = LocalClients(method, dm.train_features.to(device), dm.train_labels.to(device), ids,
                           torch.unique(ids), dm.hparams.batch_size, federation)
    method.to(device), clients.half.to(device)  # as Lightning moves the engine after its setup
    available = torch.unique(ids)
    protocol = FitProtocol.start(method, federation, len(available))
    rounds = []
    for _ in range(method.num_rounds):
        if record is not None:
            record.clear()
        run_round(method, clients, protocol, available)
        if record is not None:
            rounds.append(record.copy())
    test_features = (dm.local_test_features if method.personalized else dm.test_features).to(device)
    test_ids = dm.local_test_client_ids.to(device) if method.personalized else None
    if record is not None:
        record.clear()
    run_final(method, clients)
    logits = clients.predict(test_features, test_ids) if method.personalized else method.logits(test_features)
    if record is not None:
        rounds.append(record.copy())  # the final broadcast's local work and the predictions
    state = {key: value.cpu() for key, value in method.state_dict().items()}
    return state, logits.cpu(), rounds


@pytest.fixture(scope="module")
def small():
    """A row's small data (`small(name)`: with the row's own data settings), made once per row."""
    return functools.cache(lambda name: data(num_clients=3, name=name))


@pytest.fixture(scope="module")
def larger():
    """Twice the clients, a quarter of the rows per chunk (`batch_size`)."""
    def make(name: str) -> FederatedDataModule:
        dm = data(num_clients=6, name=name)
        dm.hparams.batch_size = 16
        return dm
    return functools.cache(make)


GRADIENT = {name for name, (build, _) in METHODS.items() if isinstance(build(), GradientMethod)}
# where a larger round may wait for the device more often, by design: L-BFGS's line search stops
# as soon as every problem has its step (a read a backtrack; OS-FED), and a client table takes its
# first rows for clients it has not seen (Ditto, SCAFFOLD, error feedback)
MAY_GROW = ("(lbfgs)", "client_state.py")
READS = {  # what a method reads from the device beyond a few numbers a round, in bytes
    # λ's round: each client draws its hold-out on the host with its own generator, from its labels
    "AnaPFL": lambda dm: 8 * len(dm.train_labels),
    # the analytic start's rounds: each client draws its hold-out on the host, as AnaPFL's
    "AFL+FedAvg": lambda dm: 8 * len(dm.train_labels),
    # the class sizes of every chunk of rows (to split a chunk by class for the per-class Gram matrices)
    "GHOFL": lambda dm: 8 * dm.num_classes * -(-len(dm.train_labels) // dm.hparams.batch_size),
}


def syncs_by_line(transfers: Transfers) -> Counter:
    return Counter(where for _, where in transfers.syncs)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_method_runs_on_the_device_as_on_the_host(name, small, larger):
    small, larger = small(name), larger(name)
    state, logits, _ = fit(name, small, HOST)
    with fake_device() as record:
        device_state, device_logits, rounds = fit(name, small, DEVICE, record)
        # and four times the local steps
        *_, larger_rounds = fit(name, larger, DEVICE, record, local_epochs=4 if name in GRADIENT else None)
    assert device_state.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(device_state[key], value), key
    assert torch.equal(device_logits, logits)
    assert len(rounds) == len(larger_rounds) == METHODS[name][0]().num_rounds + 1
    for round_index, (transfers, larger_transfers) in enumerate(zip(rounds, larger_rounds, strict=True)):
        where = f"{name}, round {round_index} (the last: the final broadcast):\n{larger_transfers.summary()}"
        # the same reads, line by line, however many clients, chunks and local steps
        grown = {line: count for line, count in (syncs_by_line(larger_transfers) - syncs_by_line(transfers)).items()
                 if not any(allowed in line for allowed in MAY_GROW)}
        assert not grown, f"{grown}\n{where}"
        # and what crosses is never the data or the model
        assert larger_transfers.bytes_to_host <= 256 + READS.get(name, lambda dm: 0)(larger), where


def test_images_go_to_the_device_as_bytes_and_features_come_back_in_one_piece(monkeypatch):
    """Images travel as uint8 and are preprocessed on the device; features are gathered there and
    copied back once (per `GATHER_BYTES`): four times the batches wait for the device no more."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    images = torch.randint(0, 256, (40, 12, 12, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    on_host = extract_features(FakeBackbone(copy.deepcopy(model)), images, batch_size=16)
    records = {}
    for batch_size in (16, 4):
        with fake_device() as records[batch_size]:  # (a fresh copy of the weights, on the host, each time)
            on_device = extract_features(FakeBackbone(copy.deepcopy(model)), images, batch_size, str(DEVICE))
        assert torch.equal(on_device, on_host)
    few, many = records[16], records[4]
    assert syncs_by_line(many) == syncs_by_line(few), many.summary()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    normalization = 2 * 3 * 4  # the mean and std, 3 floats each
    assert many.bytes_to_device == images.numel() + weights + normalization, many.summary()  # a byte a pixel
    assert many.bytes_to_host == on_host.numel() * 4
    assert [where for direction, _, where in many.copies if direction == "to_host"] == [
        where for direction, _, where in few.copies if direction == "to_host"]  # one piece
    monkeypatch.setattr(features, "GATHER_BYTES", 3 * 8 * 4)  # a piece every 3 rows
    with fake_device():
        assert torch.equal(extract_features(FakeBackbone(model), images, batch_size=4, device=str(DEVICE)), on_host)


class WordBag(torch.nn.Module):
    """A stand-in text encoder: the mean embedding of a text's tokens, (B, L) ids and mask -> (B, 4)."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(50, 4)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask[..., None].float()
        return (self.embedding(input_ids) * mask).sum(1) / mask.sum(1)


@dataclass
class WordBagBackbone:
    model: torch.nn.Module
    feature_dim: int = 4

    def tokenize(self, texts):
        ids = [[1 + sum(map(ord, word)) % 49 for word in text.split()] for text in texts]
        width = max(map(len, ids))
        return {"input_ids": torch.tensor([row + [0] * (width - len(row)) for row in ids]),
                "attention_mask": torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])}


def test_texts_come_back_in_their_order_from_the_device(monkeypatch):
    texts = [" ".join(f"w{i * j % 7}" for j in range(1 + i % 5)) for i in range(23)]
    backbone = WordBagBackbone(WordBag())
    on_host = extract_text_features(backbone, texts, batch_size=8)
    monkeypatch.setattr(features, "GATHER_BYTES", 5 * 4 * 4)  # several pieces, each to its own rows
    with fake_device() as record:
        assert torch.equal(extract_text_features(backbone, texts, batch_size=4, device=str(DEVICE)), on_host)
    assert record.bytes_to_host == on_host.numel() * 4
