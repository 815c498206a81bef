"""Secure aggregation: a masked upload hides its client, the sum of the masked uploads is exact."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import relative_error
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.federation import Federation
from workbench.federation.local_training import LocalTraining
from workbench.federation.secure_aggregation import (
    RING_MASK,
    SecureAggregator,
    decode,
    encode,
    ring_add,
    ring_sub,
    ring_sum,
)
from workbench.methods import AFL, OSFED, Cohort, DeepAFL, FedAvg, Problem

pytestmark = pytest.mark.usefixtures("one_thread")

BLOBS = SyntheticBlobs(num_classes=5, dim=12, train_size=1200, test_size=300, seed=1)


def data(num_clients: int = 8) -> FederatedDataModule:
    # chunks of 128 rows cut clients in two: a client's upload must stay whole
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, num_clients=num_clients, partition="dirichlet",
                             alpha=0.5, min_partition_size=5, batch_size=128)
    dm.setup()
    return dm


def each_clients_upload(method: AFL, dm: FederatedDataModule) -> list[dict[str, torch.Tensor]]:
    method.setup(Problem((dm.feature_dim,), dm.num_classes, dm.num_clients))
    uploads = []
    for k in range(dm.num_clients):
        mine = dm.train_client_ids == k
        half = method.client_half()
        half.setup_clients(torch.tensor([k]), int(mine.sum()))
        uploads.append(half.client_update(0, {}, Cohort(dm.train_features[mine], dm.train_labels[mine],
                                                        dm.train_client_ids[mine], torch.tensor([k]),
                                                        torch.arange(int(mine.sum()))))[0])
    return uploads


def test_ring_arithmetic_is_exact_modulo_2_62():
    top = torch.tensor([RING_MASK, RING_MASK - 5, 3])
    assert torch.equal(ring_add(top, top), torch.tensor([RING_MASK - 1, RING_MASK - 11, 6]))
    assert torch.equal(ring_sub(torch.tensor([2]), torch.tensor([5])), torch.tensor([RING_MASK - 2]))
    values = torch.tensor([-3.25, 0.0, 1e6 + 2 ** -20, -(2.0 ** 20)], dtype=torch.float64)
    assert torch.equal(decode(encode(values, 32, 10), 32, torch.float64), values)  # exact in 2^-32 steps
    counts = torch.tensor([-7, 0, 2 ** 40])
    assert torch.equal(decode(encode(counts, 32, 10), 32, torch.int64), counts)  # integers as they are


def test_a_masked_upload_is_far_from_the_real_one_and_the_masked_sum_is_exact():
    dm = data()
    uploads = each_clients_upload(AFL(gamma=1.0), dm)
    aggregator = SecureAggregator(range(dm.num_clients), seed=3, round_index=0, symmetric={"gram"})
    masked = [aggregator.masked_upload(k, upload) for k, upload in enumerate(uploads)]
    layout = aggregator.layout
    encoded = [layout.flatten(upload, 32, dm.num_clients) for upload in uploads]

    for k in range(dm.num_clients):
        seen = layout.unflatten(masked[k], 32)["gram"]  # what the server would read from one message
        assert relative_error(seen, uploads[k]["gram"]) > 1e4  # ±2^29 noise against entries of 1e3
        spread = masked[k].double() / 2.0 ** 62  # uniform on the ring: mean 1/2, std 1/√12
        assert abs(float(spread.mean()) - 0.5) < 5 * (12 * len(spread)) ** -0.5  # 5 standard errors
        assert abs(float(spread.std()) - 12 ** -0.5) < 0.06
    assert torch.equal(ring_sum(masked), ring_sum(encoded))  # the masks cancel exactly

    total = aggregator.unmask(ring_sum(masked), uploaded=range(dm.num_clients))
    for name in ("gram", "cross"):
        plain = sum(upload[name] for upload in uploads)
        rounding = dm.num_clients * 2.0 ** -33  # at most 2^-(b+1) per client, b = 32
        assert float((total[name] - plain).abs().max()) <= rounding + 1e-12 * float(plain.abs().max())
    assert torch.equal(total["gram"], total["gram"].T)  # sent as its upper triangle, rebuilt symmetric


def test_dropped_clients_masks_are_removed_from_the_survivors_sum():
    dm = data()
    uploads = each_clients_upload(AFL(gamma=1.0), dm)
    aggregator = SecureAggregator(range(dm.num_clients), seed=5, round_index=2, symmetric={"gram"})
    survivors = [0, 1, 3, 4, 6, 7]  # clients 2 and 5 never upload
    total = ring_sum(aggregator.masked_upload(k, uploads[k]) for k in survivors)
    plain = sum(uploads[k]["gram"] for k in survivors)
    recovered = aggregator.unmask(total, uploaded=survivors)["gram"]
    assert relative_error(recovered, plain) <= 1e-12
    assert relative_error(aggregator.unmask(total, uploaded=range(dm.num_clients))["gram"], plain) > 1e4


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_a_masked_fit_gives_the_unmasked_model(fit_method, dropout):
    dm = data()
    plain, masked = AFL(gamma=1.0, gamma_out=0.1), AFL(gamma=1.0, gamma_out=0.1)
    plain_run = fit_method(plain, dm, Federation(dropout=dropout, seed=2))
    masked_run = fit_method(masked, dm, Federation(dropout=dropout, seed=2, secure_aggregation=True))
    assert relative_error(masked.weight, plain.weight) <= 1e-8
    assert relative_error(masked(dm.test_features), plain(dm.test_features)) <= 1e-8
    assert masked_run.fit_metrics["comm/clients_in_round"] == plain_run.fit_metrics["comm/clients_in_round"]
    assert masked_run.fit_metrics["comm/bytes_up"] == plain_run.fit_metrics["comm/bytes_up"]  # float64 = int64 ring
    assert masked_run.fit_metrics["time/secure_aggregation_s"] > 0


def test_gradient_updates_under_secure_aggregation_give_the_plain_model(fit_method):
    """FedAvg's summed Δw is masked like any sum: the model equals the plain one up to the
    fixed-point rounding (2^-33 per number and client)."""
    dm = data()
    weights = []
    for secure in (False, True):
        method = FedAvg(num_rounds=3, architecture="linear", sample_fraction=0.5, seed=1, local=LocalTraining(lr=0.1))
        fit_method(method, dm, Federation(secure_aggregation=secure, dropout=0.25, seed=4))
        weights.append(method.flat_parameters())
    assert relative_error(weights[1], weights[0]) <= 1e-6


def test_a_multi_round_method_under_secure_aggregation(fit_method):
    dm = data()
    models = []
    for secure in (False, True):
        method = DeepAFL(num_layers=2, hidden_dim=16, block_dim=16)
        fit_method(method, dm, Federation(secure_aggregation=secure))
        models.append(method.classifier[-1])
    assert relative_error(models[1], models[0]) <= 1e-8


def test_an_upload_too_large_for_the_ring_names_the_fix():
    with pytest.raises(ValueError, match="fixed_point_bits to at most 21"):
        encode(torch.tensor([1e12], dtype=torch.float64), 32, 1)  # 2^61 / 1e12 ≈ 2^21.1
    with pytest.raises(ValueError, match="not finite"):
        encode(torch.tensor([float("nan")], dtype=torch.float64), 32, 1)


def test_methods_without_per_client_sums_are_refused(fit_method):
    method = OSFED(num_rounds=1, architecture="linear")  # its snapshots are stacked, never summed
    with pytest.raises(ValueError, match="secure_aggregation=false"):
        fit_method(method, data(), Federation(secure_aggregation=True))
