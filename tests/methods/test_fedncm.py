"""FedNCM: the federated class means, and so the cosine head, are the pooled data's, whatever the
partition; a class no client holds is never predicted."""
from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import relative_error
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.methods import FedNCM

pytestmark = pytest.mark.usefixtures("one_thread")

BLOBS = SyntheticBlobs(num_classes=10, dim=12, train_size=2000, test_size=400, seed=3)


def data(**partition) -> FederatedDataModule:
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, batch_size=256, min_partition_size=1,
                             **{"num_clients": 10, **partition})
    dm.setup()
    return dm


def centralized(dm: FederatedDataModule, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pooled class means (C, d) and the cosine logits of `x` (n, C), each computed from its formula."""
    features, labels = dm.train_features.double(), dm.train_labels
    means = torch.stack([features[labels == c].mean(0) for c in range(dm.num_classes)])
    x = x.double()
    cosine = (x @ means.T) / (x.norm(dim=1, keepdim=True) * means.norm(dim=1))
    return means, cosine


PARTITIONS = [
    {"partition": "iid"},
    {"partition": "dirichlet", "alpha": 0.05},
    {"partition": "dirichlet", "alpha": 0.5, "num_clients": 50},
    {"partition": "shard", "num_shards_per_partition": 2},
]


@pytest.mark.parametrize("partition", PARTITIONS, ids=lambda p: "-".join(map(str, p.values())))
def test_class_means_and_logits_are_the_pooled_datas(fit_method, partition):
    dm = data(**partition)
    method = FedNCM()
    fit_method(method, dm)
    means, cosine = centralized(dm, dm.test_features)
    assert relative_error(method.class_means, means) <= 1e-8
    assert torch.equal(method.class_counts, torch.bincount(dm.train_labels, minlength=dm.num_classes))
    assert relative_error(method.prototypes, means / means.norm(dim=1, keepdim=True)) <= 1e-8
    assert relative_error(method(dm.test_features), cosine) <= 1e-8
    assert bool(method.class_present.all())


def test_the_temperature_scales_the_logits_and_never_the_prediction(fit_method):
    dm = data(partition="dirichlet", alpha=0.1)
    plain, warm = FedNCM(), FedNCM(temperature=16.0)
    fit_method(plain, dm), fit_method(warm, dm)
    x = dm.test_features
    assert relative_error(warm(x), 16.0 * plain(x)) <= 1e-12
    assert torch.equal(warm(x).argmax(1), plain(x).argmax(1))
    engine = fit_method(FedNCM(), dm)
    assert engine.trainer.test(engine, datamodule=dm, verbose=False)[0]["test/acc"] > 0.9  # separable blobs


def test_a_class_no_client_holds_gets_logit_minus_inf_and_is_never_predicted(fit_method):
    dm = data(partition="dirichlet", alpha=0.5)
    kept = dm.train_labels != 3  # class 3 on no client
    dm.train_features, dm.train_labels, dm.train_client_ids = (
        dm.train_features[kept], dm.train_labels[kept], dm.train_client_ids[kept])
    method = FedNCM()
    with pytest.warns(UserWarning, match=r"classes \[3\] have no sample on any client"):
        fit_method(method, dm)
    assert not bool(method.class_present[3]) and int(method.class_present.sum()) == dm.num_classes - 1
    assert int(method.class_counts[3]) == 0
    assert bool((method.class_means[3] == 0).all()) and bool((method.prototypes[3] == 0).all())
    logits = method(dm.test_features)
    assert bool((logits[:, 3] == float("-inf")).all())
    assert bool(torch.isfinite(logits[:, torch.arange(dm.num_classes) != 3]).all())
    assert not bool((logits.argmax(1) == 3).any())
    # every other class keeps the pooled mean of its rows
    others = torch.arange(dm.num_classes) != 3
    pooled = torch.stack([dm.train_features[dm.train_labels == c].double().mean(0)
                          for c in range(dm.num_classes) if c != 3])
    assert relative_error(method.class_means[others], pooled) <= 1e-8


def test_a_zero_feature_row_scores_zero_for_every_class(fit_method):
    dm = data(partition="iid")
    method = FedNCM(temperature=3.0)
    fit_method(method, dm)
    assert torch.equal(method(torch.zeros(2, BLOBS.dim)), torch.zeros(2, BLOBS.num_classes, dtype=torch.float64))


def test_bytes_are_the_analytic_count(fit_method):
    k, classes, d = 10, BLOBS.num_classes, BLOBS.dim
    engine = fit_method(FedNCM(), data(partition="iid", num_clients=k))
    per_client = (classes * d + classes) * 8  # the class sums (float64) and counts (int64)
    assert engine.fit_metrics["comm/bytes_up_per_client"] == per_client
    assert engine.fit_metrics["comm/bytes_up"] == per_client * k
    assert engine.fit_metrics["comm/bytes_down"] == (classes * d * 8 + classes) * k  # prototypes + present
    assert engine.fit_metrics["comm/rounds"] == 1


def test_float32_sends_half_the_sums(fit_method):
    dm = data(partition="iid")
    engine = fit_method(FedNCM(dtype="float32"), dm)
    assert engine.method.prototypes.dtype == torch.float32
    assert engine.fit_metrics["comm/bytes_up_per_client"] == BLOBS.num_classes * (BLOBS.dim * 4 + 8)
    means, _ = centralized(dm, dm.test_features)
    assert relative_error(engine.method.class_means, means) <= 1e-5


def test_the_privacy_sensitivity_is_one_row_and_one_count():
    assert FedNCM().statistics_sensitivity(0.0) is None
    assert FedNCM().statistics_sensitivity(2.0) == math.sqrt(5)


@pytest.mark.parametrize("settings, named", [
    ({"temperature": 0.0}, "temperature"), ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"dtype": "int64"}, "dtype"),
])
def test_bad_settings_are_one_line_errors_naming_the_setting(settings, named):
    with pytest.raises(ValueError, match=rf"^{named} must be") as error:
        FedNCM(**settings)
    assert "\n" not in str(error.value)
