"""Server-side Gaussian noise on the aggregated statistics: its shape, its seed, its guarantee, its cost."""
from __future__ import annotations

import math

import pytest
import torch

from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.federation import Federation
from workbench.federation.privacy import (
    add_gaussian_noise,
    gaussian_delta,
    gaussian_epsilon,
    ridge_sensitivity,
    safe_ridge,
    symmetric_gaussian,
)
from workbench.federation.protocol import NOISE_STREAM
from workbench.linalg import class_sums
from workbench.methods import AFL

pytestmark = pytest.mark.usefixtures("one_thread")

BLOBS = SyntheticBlobs(num_classes=4, dim=16, train_size=1000, test_size=400, seed=2)


def data() -> FederatedDataModule:
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, num_clients=6, partition="iid", batch_size=256)
    dm.setup()
    return dm


def test_symmetric_noise_is_symmetric_with_every_entry_of_std_sigma():
    noise = symmetric_gaussian((300, 300), 0.5, torch.Generator().manual_seed(0))
    assert torch.equal(noise, noise.T)
    upper = noise[tuple(torch.triu_indices(300, 300, offset=1))]
    assert abs(float(upper.std()) - 0.5) < 0.01 and abs(float(upper.mean())) < 0.01
    assert abs(float(noise.diagonal().std()) - 0.5) < 0.07  # 300 draws


def test_noise_is_seeded_per_round_and_integers_stay_integers():
    protocol = Federation(dp_sigma=2.0, seed=1)
    stats = {"gram": torch.zeros(5, 5, dtype=torch.float64), "counts": torch.zeros(4, dtype=torch.long)}
    first = add_gaussian_noise(stats, 2.0, protocol.generator(0, NOISE_STREAM), symmetric={"gram"})
    again = add_gaussian_noise(stats, 2.0, protocol.generator(0, NOISE_STREAM), symmetric={"gram"})
    later = add_gaussian_noise(stats, 2.0, protocol.generator(1, NOISE_STREAM), symmetric={"gram"})
    assert all(torch.equal(first[name], again[name]) for name in stats)
    assert not torch.equal(first["gram"], later["gram"])
    assert first["counts"].dtype == torch.long and first["counts"].abs().sum() > 0


def test_the_server_solves_the_noisy_statistics(fit_method):
    dm, sigma = data(), 3.0
    method = AFL(gamma=1.0, gamma_out=safe_ridge(sigma, BLOBS.dim))
    fit_method(method, dm, Federation(dp_sigma=sigma, seed=7))
    x = dm.train_features.double()
    exact = {"gram": x.T @ x, "cross": class_sums(x, dm.train_labels, dm.num_classes)}
    expected = add_gaussian_noise({name: torch.zeros_like(value) for name, value in exact.items()}, sigma,
                                  method.federation.generator(0, NOISE_STREAM), symmetric={"gram"})
    for name, pooled in (("gram", method.pooled_gram), ("cross", method.pooled_cross)):
        noise = pooled - exact[name]
        assert torch.allclose(noise, expected[name], atol=1e-9)  # the documented draw, nothing else
    noise = method.pooled_gram - exact["gram"]
    assert torch.allclose(noise, noise.T, atol=1e-9)
    ridge = method.pooled_gram + method.gamma_out * torch.eye(BLOBS.dim, dtype=torch.float64)
    assert torch.allclose(method.weight, torch.linalg.solve(ridge, method.pooled_cross), rtol=1e-9, atol=1e-12)


def test_an_indefinite_noisy_gram_names_the_ridge_that_fixes_it(fit_method):
    dm, sigma = data(), 1e4  # far above the data's eigenvalues (≈ 1e3)
    method = AFL(gamma=1.0, gamma_out=0.0)
    with pytest.raises(ValueError, match=r"indefinite.*gamma_out ≥ 1\.6e\+05"):
        fit_method(method, dm, Federation(dp_sigma=sigma))
    method = AFL(gamma=1.0, gamma_out=safe_ridge(sigma, BLOBS.dim))
    fit_method(method, dm, Federation(dp_sigma=sigma))
    assert torch.isfinite(method.weight).all()


def test_safe_ridge_bounds_the_noises_smallest_eigenvalue_without_being_loose():
    side, sigma = 200, 1.5
    smallest = [float(torch.linalg.eigvalsh(symmetric_gaussian((side, side), sigma,
                                                               torch.Generator().manual_seed(seed)))[0])
                for seed in range(10)]
    assert all(-safe_ridge(sigma, side) < value < -0.5 * safe_ridge(sigma, side) for value in smallest)


def test_small_noise_keeps_the_accuracy_and_large_noise_costs_some(fit_method):
    dm = data()
    accuracy = {}
    for sigma in (0.0, 1e-3, 300.0):
        method = AFL(gamma=1.0, gamma_out=max(1.0, safe_ridge(sigma, BLOBS.dim)))
        fit_method(method, dm, Federation(dp_sigma=sigma))
        accuracy[sigma] = float((method(dm.test_features).argmax(1) == dm.test_labels).double().mean())
    assert accuracy[1e-3] == accuracy[0.0] > 0.9
    assert accuracy[300.0] < accuracy[0.0]


def test_epsilon_of_the_gaussian_mechanism():
    delta, sensitivity = 1e-5, ridge_sensitivity(1.0)
    assert sensitivity == pytest.approx(math.sqrt(2))
    classic = sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / 0.5  # sufficient for ε = 0.5
    assert gaussian_epsilon(classic, sensitivity, delta) <= 0.5
    for sigma in (0.5, 2.0, 20.0):
        epsilon = gaussian_epsilon(sigma, sensitivity, delta)
        assert gaussian_delta(epsilon, sigma, sensitivity) == pytest.approx(delta, rel=1e-6)
    assert gaussian_epsilon(20.0, sensitivity) < gaussian_epsilon(2.0, sensitivity)
    assert gaussian_epsilon(0.0, sensitivity) == math.inf


def test_per_client_uploads_cannot_be_noised(fit_method):
    from workbench.methods import OSFED

    method = OSFED(num_rounds=1, architecture="linear")
    with pytest.raises(ValueError, match="dp_sigma=0"):
        fit_method(method, data(), Federation(dp_sigma=1.0))
