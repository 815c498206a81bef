"""Fed3R: the federated solution is centralized ridge regression on the design rows φ(x), whatever
the partition and the order the clients are folded in; Fed3R-RF's random features are one map,
rebuilt from the seed on the server and on every client."""
from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import relative_error
from tests.methods.conftest import fit_rounds
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.engines.local import LocalClients
from workbench.federation import Federation
from workbench.federation.privacy import ridge_sensitivity, safe_ridge
from workbench.methods import Fed3R, Problem
from workbench.methods.fed3r import design_rows, random_fourier_map

pytestmark = pytest.mark.usefixtures("one_thread")

BLOBS = SyntheticBlobs(num_classes=10, dim=12, train_size=2000, test_size=400, seed=3)
D = 48  # random features


def data(**partition) -> FederatedDataModule:
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, batch_size=256, min_partition_size=1,
                             **{"num_clients": 10, **partition})
    dm.setup()
    return dm


def centralized(dm: FederatedDataModule, ridge: float, bias: bool, num_features: int = 0, seed: int = 0,
                sigma: float | None = None) -> torch.Tensor:
    """(ΦᵀΦ + λI)⁻¹ΦᵀY on the pooled training rows, φ computed here from its formula."""
    x = dm.train_features.double()
    if num_features:
        omega, phase = random_fourier_map(seed, x.shape[1], num_features, sigma or math.sqrt(x.shape[1]),
                                          torch.float64)
        x = math.sqrt(2 / num_features) * torch.cos(x @ omega + phase)
    if bias:
        x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    y = torch.nn.functional.one_hot(dm.train_labels, dm.num_classes).double()
    return torch.linalg.solve(x.T @ x + ridge * torch.eye(x.shape[1], dtype=x.dtype), x.T @ y)


PARTITIONS = [
    {"partition": "iid"},
    {"partition": "dirichlet", "alpha": 0.05},
    {"partition": "shard", "num_shards_per_partition": 2},
]
FEATURES = {"plain": {}, "plain-nobias": {"bias": False}, "rf": {"random_features": D},
            "rf-sigma": {"random_features": D, "rf_sigma": 2.0, "seed": 5}}


@pytest.mark.parametrize("partition", PARTITIONS, ids=lambda p: "-".join(map(str, p.values())))
@pytest.mark.parametrize("settings", list(FEATURES.values()), ids=list(FEATURES))
def test_federated_equals_centralized_ridge(fit_method, partition, settings):
    dm = data(**partition)
    method = Fed3R(ridge=0.5, **settings)
    fit_method(method, dm)
    expected = centralized(dm, 0.5, settings.get("bias", True), settings.get("random_features", 0),
                           settings.get("seed", 0), settings.get("rf_sigma"))
    assert method.weight.shape == expected.shape
    assert relative_error(method.weight, expected) <= 1e-8


def one_half_per_client(method: Fed3R, dm: FederatedDataModule) -> list[LocalClients]:
    """Every client with a half of its own, built from a fresh copy of the settings."""
    halves = []
    for k in torch.unique(dm.train_client_ids).tolist():
        fresh = Fed3R(**method.hparams_initial)
        fresh.setup(method.problem)
        mine = dm.train_client_ids == k
        halves.append(LocalClients(fresh, dm.train_features[mine], dm.train_labels[mine], dm.train_client_ids[mine],
                                   torch.tensor([k]), batch_size=64))
    return halves


@pytest.mark.parametrize("num_features", [0, D])
def test_any_order_of_the_clients_gives_centralized_ridge(num_features):
    dm = data(partition="dirichlet", alpha=0.1, num_clients=12)
    expected = centralized(dm, 0.1, True, num_features)
    weights = []
    for order_seed in range(3):
        method = Fed3R(ridge=0.1, random_features=num_features)
        method.setup(Problem((dm.feature_dim,), dm.num_classes, dm.num_clients))
        halves = one_half_per_client(method, dm)
        order = torch.randperm(len(halves), generator=torch.Generator().manual_seed(order_seed)).tolist()
        fit_rounds(method, [halves[i] for i in order], len(halves))
        assert relative_error(method.weight, expected) <= 1e-8
        weights.append(method.weight)
    assert relative_error(weights[1], weights[0]) <= 1e-8 and relative_error(weights[2], weights[0]) <= 1e-8


@pytest.mark.parametrize("num_features", [0, D])
def test_folding_the_clients_in_one_at_a_time_is_the_recursive_form(num_features):
    """Fit on one client, then add the others one by one in a shuffled order (A ← A + A_k, B ← B + B_k)."""
    dm = data(partition="shard", num_shards_per_partition=2)
    method = Fed3R(ridge=0.2, random_features=num_features)
    method.setup(Problem((dm.feature_dim,), dm.num_classes, dm.num_clients))
    first, *rest = one_half_per_client(method, dm)
    fit_rounds(method, [first], 1)
    method.mark_fitted()
    broadcast = method.broadcast()
    for i in torch.randperm(len(rest), generator=torch.Generator().manual_seed(1)).tolist():
        upload, _ = rest[i].half.client_update(0, broadcast, rest[i].data)
        method.add_clients(upload, 1)
    assert int(method.pooled_clients) == len(rest) + 1
    assert relative_error(method.weight, centralized(dm, 0.2, True, num_features)) <= 1e-8


def test_the_random_features_are_the_same_map_on_the_server_and_every_client():
    dm = data(partition="iid", num_clients=3)
    problem = Problem((dm.feature_dim,), dm.num_classes, dm.num_clients)
    method = Fed3R(random_features=D, seed=11)
    method.setup(problem)
    other = Fed3R(random_features=D, seed=11)  # the settings a client rebuilds the method from
    other.setup(problem)
    clients = LocalClients(other, dm.train_features, dm.train_labels, dm.train_client_ids,
                           torch.unique(dm.train_client_ids), batch_size=64)
    assert int(method.broadcast()["seed"]) == 11 and method.broadcast()["seed"].dtype == torch.int64
    clients.half.client_update(0, method.broadcast(), clients.data)
    x = dm.test_features
    assert torch.equal(clients.half.design(x), method.design(x))  # bit for bit
    again = Fed3R(random_features=D, seed=11)
    again.setup(problem)
    assert torch.equal(again.rf_omega, method.rf_omega) and torch.equal(again.rf_phase, method.rf_phase)
    moved = Fed3R(random_features=D, seed=12)
    moved.setup(problem)
    assert not torch.allclose(moved.rf_omega, method.rf_omega)
    assert not torch.allclose(moved.design(x), method.design(x))
    clients.half.client_update(0, moved.broadcast(), clients.data)  # the seed received, not the one built with
    assert torch.equal(clients.half.design(x), moved.design(x))
    assert "rf_omega" not in method.state_dict()  # regenerated from the seed, never saved


def test_the_random_features_approximate_the_gaussian_kernel_of_bandwidth_sigma():
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for sigma in (1.0, 3.0):  # the map alone: a fitted method would hold a 40000² Gram matrix
        phi = design_rows(x, torch.float64, False, random_fourier_map(0, 5, 40000, sigma, torch.float64))
        kernel = torch.exp(-torch.cdist(x, x) ** 2 / (2 * sigma ** 2))
        assert (phi @ phi.T - kernel).abs().max() < 0.03
        assert float(phi.norm(dim=1).max()) <= math.sqrt(2)  # the bound the privacy accounting uses
    method = Fed3R(random_features=3, bias=False)
    method.setup(Problem((16,), 2, 1))
    assert float(method.rf_omega.std()) == pytest.approx(1 / 4, rel=0.5)  # σ = √d = 4 by default


@pytest.mark.parametrize("settings, side", [({}, BLOBS.dim + 1), ({"bias": False}, BLOBS.dim),
                                            ({"random_features": D}, D + 1)])
def test_bytes_are_the_analytic_count(fit_method, settings, side):
    k, classes = 10, BLOBS.num_classes
    engine = fit_method(Fed3R(**settings), data(partition="iid", num_clients=k))
    per_client = (side * (side + 1) // 2 + side * classes) * 8  # packed A_k and B_k, float64
    seed = 8 if settings.get("random_features") else 0  # the broadcast seed of (Ω, b)
    assert engine.fit_metrics["comm/bytes_up_per_client"] == per_client
    assert engine.fit_metrics["comm/bytes_up"] == per_client * k
    assert engine.fit_metrics["comm/bytes_down"] == (seed + side * classes * 8) * k
    assert engine.fit_metrics["comm/rounds"] == 1


def test_float32_is_the_float64_fit_rounded(fit_method):
    dm = data(partition="iid")
    weights = {}
    for dtype in ("float64", "float32"):
        method = Fed3R(ridge=1.0, random_features=D, dtype=dtype)
        fit_method(method, dm)
        weights[dtype] = method.weight
    assert weights["float32"].dtype == torch.float32
    assert relative_error(weights["float32"], weights["float64"]) <= 1e-3


def test_the_privacy_sensitivity_is_bounded_by_the_random_features_alone():
    assert Fed3R(random_features=D).statistics_sensitivity(0.0) == ridge_sensitivity(math.sqrt(3))
    assert Fed3R(random_features=D, bias=False).statistics_sensitivity(7.0) == ridge_sensitivity(math.sqrt(2))
    assert Fed3R().statistics_sensitivity(0.0) is None  # unclipped raw rows: no bound
    assert Fed3R().statistics_sensitivity(2.0) == ridge_sensitivity(math.sqrt(5))


def test_an_indefinite_noisy_gram_names_the_ridge_setting(fit_method):
    dm = data(partition="iid", num_clients=3)
    method = Fed3R(ridge=1e-6)
    with pytest.raises(ValueError, match=r"Fed3R's aggregated Gram matrix is indefinite.*model\.ridge ≥"):
        fit_method(method, dm, Federation(dp_sigma=1e4))
    method = Fed3R(ridge=safe_ridge(1e4, BLOBS.dim + 1))
    fit_method(method, dm, Federation(dp_sigma=1e4))
    assert torch.isfinite(method.weight).all()


@pytest.mark.parametrize("settings, named", [
    ({"ridge": 0.0}, "ridge"), ({"ridge": -1.0}, "ridge"), ({"ridge": float("nan")}, "ridge"),
    ({"random_features": -1}, "random_features"), ({"random_features": 2.5}, "random_features"),
    ({"random_features": True}, "random_features"),
    ({"rf_sigma": 0.0}, "rf_sigma"), ({"rf_sigma": float("inf")}, "rf_sigma"),
    ({"dtype": "float16"}, "dtype"), ({"seed": -1}, "seed"),
])
def test_bad_settings_are_one_line_errors_naming_the_setting(settings, named):
    with pytest.raises(ValueError, match=rf"^{named} must be") as error:
        Fed3R(**settings)
    assert "\n" not in str(error.value)
