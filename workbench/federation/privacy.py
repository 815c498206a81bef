"""Server-side Gaussian differential privacy on aggregated statistics.

The server adds noise to each statistic it aggregated before it solves:

    S̃ = Σ_k S_k + E,     E ~ N(0, σ²) entrywise,

and symmetric noise for symmetric statistics (Gram matrices): the upper triangle, diagonal
included, is drawn i.i.d. and mirrored, so G̃ stays symmetric and every entry has variance σ²
(the released upper triangle is the Gaussian mechanism on the upper triangle). Integer statistics
(counts) get the noise rounded to integers, which is post-processing and keeps the guarantee.

Guarantee. The Gaussian mechanism with standard deviation σ on a statistic whose L2 sensitivity
is Δ (the most one sample can move it, all released statistics together) is (ε, δ)-DP for the ε
of `gaussian_epsilon`. For AFL's (XᵀX, XᵀY) with one-hot labels and every sample's features of
norm ≤ B, adding or removing a sample moves XᵀX by xxᵀ (‖·‖_F ≤ B²) and XᵀY by x e_yᵀ (‖·‖ ≤ B),
so Δ = √(B⁴ + B²) (`ridge_sensitivity`); B must hold by construction (e.g. normalized
features), the runtime does not clip. It protects what the server releases (the model); the
server itself is trusted with the sum, which secure aggregation keeps it from seeing per client.

Indefiniteness. A noisy Gram matrix G + E may have negative eigenvalues: the smallest
eigenvalue of a d × d symmetric Gaussian E is about −2σ√d. A ridge γ_out ≥ `safe_ridge(σ, d)`
= σ(2√d + 8) keeps G + E + γ_out I positive definite for any G ⪰ 0, except with probability
below 1e-6 (see `safe_ridge`).
"""
from __future__ import annotations

import math
from collections.abc import Collection, Mapping

import torch
from torch import Tensor


def symmetric_gaussian(shape: tuple[int, ...], sigma: float, generator: torch.Generator,
                       dtype: torch.dtype = torch.float64) -> Tensor:
    """Symmetric noise (..., d, d): entries i ≤ j i.i.d. N(0, σ²), mirrored below the diagonal."""
    side = shape[-1]
    rows, cols = torch.triu_indices(side, side)
    upper = torch.randn(*shape[:-2], len(rows), generator=generator, dtype=torch.float64) * sigma
    noise = torch.zeros(shape, dtype=torch.float64)
    noise[..., rows, cols] = upper
    noise[..., cols, rows] = upper
    return noise.to(dtype)


def add_gaussian_noise(uploads: Mapping[str, Tensor], sigma: float, generator: torch.Generator,
                       symmetric: Collection[str] = ()) -> dict[str, Tensor]:
    """New statistics with N(0, σ²) noise added: symmetric for names in `symmetric`, rounded for integers.

    Noise is drawn on the CPU from `generator` (so every process draws the same), name by name in
    sorted order, then moved to each statistic's device.
    """
    noisy = dict(uploads)
    for name in sorted(uploads):
        value = uploads[name]
        if name in symmetric:
            noise = symmetric_gaussian(tuple(value.shape), sigma, generator)
        else:
            noise = torch.randn(value.shape, generator=generator, dtype=torch.float64) * sigma
        if not value.is_floating_point():
            noise = torch.round(noise)
        noisy[name] = value + noise.to(value.dtype).to(value.device)
    return noisy


def safe_ridge(sigma: float, side: int) -> float:
    """A ridge γ that keeps G + E + γI positive definite for G ⪰ 0 and symmetric noise E of entry std σ (d = side).

    σ(2√d + 8): E[λ_min(E)] ≥ −2σ√d (Sudakov-Fernique comparison with the GOE, whose diagonal
    variance is twice ours), and λ_min is a √2σ-Lipschitz function of the i.i.d. entries, so
    P(λ_min(E) < −2σ√d − 8σ) ≤ exp(−8²/4) < 1e-6.
    """
    return sigma * (2 * math.sqrt(side) + 8)


def ridge_sensitivity(feature_norm: float) -> float:
    """L2 sensitivity of (XᵀX, XᵀY), one-hot Y, to one sample of feature norm ≤ B: √(B⁴ + B²)."""
    return math.sqrt(feature_norm ** 4 + feature_norm ** 2)


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def gaussian_delta(epsilon: float, sigma: float, sensitivity: float) -> float:
    """The smallest δ for which N(0, σ²) noise on an L2-sensitivity-Δ statistic is (ε, δ)-DP.

    The exact curve of the Gaussian mechanism (Balle & Wang, ICML 2018, Theorem 8):
    δ = Φ(Δ/2σ − εσ/Δ) − e^ε Φ(−Δ/2σ − εσ/Δ).
    """
    a, b = sensitivity / (2 * sigma), epsilon * sigma / sensitivity
    return _normal_cdf(a - b) - math.exp(epsilon) * _normal_cdf(-a - b)


def gaussian_epsilon(sigma: float, sensitivity: float, delta: float = 1e-5) -> float:
    """The ε at which N(0, σ²) noise on an L2-sensitivity-Δ statistic is (ε, δ)-DP (inf for σ = 0).

    Bisection on the exact curve `gaussian_delta`, which decreases in ε.
    """
    if sigma <= 0:
        return math.inf
    low, high = 0.0, 1.0
    while gaussian_delta(high, sigma, sensitivity) > delta:
        low, high = high, 2 * high
        if high > 1e4:
            return math.inf
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if gaussian_delta(middle, sigma, sensitivity) > delta else (low, middle)
    return high
