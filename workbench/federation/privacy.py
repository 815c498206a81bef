"""Differential privacy: Gaussian noise on aggregated statistics, and client-level DP for rounds of updates.

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
so Δ = √(B⁴ + B²) (`ridge_sensitivity`); B holds by construction with `federation.feature_clip`
= B (each client clips its rows, `clip_rows`). It protects what the server releases (the model); the
server itself is trusted with the sum, which secure aggregation keeps it from seeing per client.

Indefiniteness. A noisy Gram matrix G + E may have negative eigenvalues: the smallest
eigenvalue of a d × d symmetric Gaussian E is about −2σ√d. A ridge γ_out ≥ `safe_ridge(σ, d)`
= σ(2√d + 8) keeps G + E + γ_out I positive definite for any G ⪰ 0, except with probability
below 1e-6 (see `safe_ridge`).

Client-level DP (DP-FedAvg: McMahan et al., ICLR 2018; adaptive clipping: Andrew et al.,
NeurIPS 2021), for methods whose clients upload model updates (`FederatedMethod.clips_updates`).
Each round, with the cohort drawn by `Federation.sampled_clients` (rate q of the N clients):

1. the server sends the clip norm C with the round (the protocol's part of the message, beside
   the method's broadcast);
2. each client clips its update, all its model-update uploads (`Upload(model_update=True)`) as one
   vector u_i, to u_i · min(1, C/‖u_i‖) (`clip_client_updates`, applied by the protocol's client
   step `workbench.federation.client_step`, outside the method) and, with it, uploads
   b_i = 1[‖u_i‖ ≤ C] (`WITHIN_CLIP`): so clipping composes with secure aggregation, the server
   never sees a u_i;
3. the server adds N(0, (zC)²) to every coordinate of the clipped sum and, under adaptive
   clipping, N(0, σ_b²) to Σ b_i, and moves C ← C · exp(−η_C (b̃ − γ)), b̃ = noised Σ b_i / E[m]
   (`ClientLevelDP.privatize`); with Poisson sampling the method averages by the fixed E[m] = qN.

Removing one client changes the clipped sum by ≤ C and the count by ≤ 1, so a round releases
Gaussian mechanisms of noise multipliers z and σ_b on the same data, together one Gaussian of
multiplier (z⁻² + σ_b⁻²)^(−1/2). `dp-accounting`'s RDP accountant composes the rounds of that
subsampled Gaussian: Poisson sampling under add/remove-one (full participation is rate 1);
fixed-size sampling as sampling without replacement, which it accounts under replace-one, where
the sum moves by ≤ 2C (so z/2).
"""
from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Collection, Mapping

import torch
from torch import Tensor

from workbench.federation import codec
from workbench.federation.protocol import NOISE_STREAM, Federation

CLIP_NORM_BYTES = 8  # C travels with the round as one float64
WITHIN_CLIP = "within_clip"  # the upload Σ b_i: clients whose update was within C


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
        if high > 700:  # e^ε overflows a float beyond ~709
            return math.inf
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if gaussian_delta(middle, sigma, sensitivity) > delta else (low, middle)
    return high


# ---- client-level DP -----------------------------------------------------------------------------
def clip_rows(rows: Tensor, clip_norm: float) -> tuple[Tensor, Tensor]:
    """Each row scaled to L2 norm ≤ C: (m, P) -> (m, P) rows · min(1, C/‖row‖), and (m,) bool ‖row‖ ≤ C."""
    norms = rows.norm(dim=1, keepdim=True)
    scale = (clip_norm / norms.clamp_min(torch.finfo(rows.dtype).tiny)).clamp(max=1)
    return rows * scale, norms.squeeze(1) <= clip_norm


def clip_features(features: Tensor, feature_norm: float) -> Tensor:
    """Every sample (n, *input_shape) scaled to L2 norm ≤ B (`federation.feature_clip`), same shape."""
    return clip_rows(features.reshape(len(features), -1), feature_norm)[0].reshape(features.shape)


def clip_client_updates(updates: Mapping[str, Tensor], clip_norm: float) -> tuple[dict[str, Tensor], Tensor]:
    """The clients' updates {name: (m, ...)} clipped jointly (one vector per client) to norm ≤ C, and
    the count Σ b_i of those within C as the float32 `WITHIN_CLIP` upload: (), float32."""
    clipped, within = clip_rows(codec.update_rows(updates), clip_norm)
    out = codec.split_rows(clipped, updates)
    return out, within.sum().to(torch.float32)


def _accountant(relation: str):
    """dp-accounting's RDP accountant under a neighbouring relation (a core dependency; the import
    is deferred so that `workbench` starts without it)."""
    try:
        import dp_accounting
        from dp_accounting.rdp import rdp_privacy_accountant
    except ImportError as error:  # pragma: no cover - a broken install
        raise ImportError("client-level DP accounting needs dp-accounting: pip install dp-accounting") from error
    # Its RDP bound at fractional orders near 1 sometimes does not converge; it drops those orders
    # and warns each round (the ε stays valid).
    logging.getLogger("absl").setLevel(logging.ERROR)
    return dp_accounting, rdp_privacy_accountant.RdpAccountant(
        neighboring_relation=getattr(dp_accounting.NeighboringRelation, relation))


@functools.lru_cache(maxsize=1024)
def subsampled_gaussian_epsilon(noise_multiplier: float, rounds: int, delta: float, population: int,
                                cohort: int | None = None, sample_rate: float | None = None) -> float:
    """ε at δ after `rounds` rounds of a Gaussian of `noise_multiplier` (std / add-remove sensitivity)
    on a sampled cohort, by dp-accounting's RDP accountant: Poisson sampling at `sample_rate`, or a
    fixed `cohort` of the `population` without replacement (replace-one: the multiplier halves).
    inf without noise, 0 after no round."""
    if rounds == 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    if cohort is None:
        dp, accountant = _accountant("ADD_OR_REMOVE_ONE")
        event = dp.PoissonSampledDpEvent(sample_rate, dp.GaussianDpEvent(noise_multiplier))
    else:
        dp, accountant = _accountant("REPLACE_ONE")
        event = dp.SampledWithoutReplacementDpEvent(population, cohort, dp.GaussianDpEvent(noise_multiplier / 2))
    accountant.compose(event, rounds)
    return float(accountant.get_epsilon(delta))


def combined_noise_multiplier(*multipliers: float) -> float:
    """Gaussian mechanisms of noise multipliers z_j on the same data are one of (Σ z_j⁻²)^(−1/2)."""
    return sum(z ** -2 for z in multipliers) ** -0.5


class ClientLevelDP:
    """The server's side of client-level DP over a population of N clients (see the module docstring).

    `clip_norm` is the current C (adaptive clipping moves it; the engine keeps it in checkpoints).
    """

    def __init__(self, protocol: Federation, population: int) -> None:
        self.protocol, self.population = protocol, population
        self.clip_norm = protocol.dp_clip
        p = protocol
        # a fixed cohort below everyone is accounted as sampling without replacement; everyone (q = 1)
        # as Poisson sampling at rate 1, the plain Gaussian under add/remove-one
        fixed = p.sampling == "fixed" and p.sample_rate < 1
        self.cohort = max(1, round(p.sample_rate * population)) if fixed else None
        self.expected_cohort = p.sample_rate * population if self.cohort is None else self.cohort
        self.adaptive = p.dp_clip_quantile is not None
        self.count_stddev = ((p.dp_count_stddev or self.expected_cohort / 20) if self.adaptive else math.inf)

    @property
    def noise_multiplier(self) -> float:
        """The multiplier the accountant sees: the update's z with the count's σ_b folded in."""
        z = self.protocol.dp_noise_multiplier
        if z == 0:
            return 0.0
        if not self.adaptive:
            return z
        count = self.count_stddev if self.cohort is None else 2 * self.count_stddev  # × 2: halved for replace-one
        return combined_noise_multiplier(z, count)

    def epsilon(self, rounds: int) -> float:
        """ε at the protocol's δ after `rounds` rounds."""
        p = self.protocol
        return subsampled_gaussian_epsilon(self.noise_multiplier, rounds, p.dp_delta, self.population,
                                           cohort=self.cohort, sample_rate=None if self.cohort else p.sample_rate)

    def denominator(self, survivors: int) -> float:
        """What the method averages by: E[m] = qN under Poisson sampling (the cohort's size is itself
        private), else the clients that uploaded."""
        return self.expected_cohort if self.protocol.sample_rate < 1 and self.cohort is None else survivors

    def privatize(self, uploads: Mapping[str, Tensor],
                  generator: torch.Generator) -> tuple[dict[str, Tensor], dict[str, float]]:
        """The clipped sum with N(0, (zC)²) noise (without `WITHIN_CLIP`), and this round's metrics;
        moves C under adaptive clipping."""
        uploads = dict(uploads)
        within = float(uploads.pop(WITHIN_CLIP, torch.zeros(())))
        p, clip = self.protocol, self.clip_norm
        noisy = (add_gaussian_noise(uploads, p.dp_noise_multiplier * clip, generator) if p.dp_noise_multiplier
                 else uploads)
        metrics = {"privacy/clip_norm": clip}
        if p.dp_clip_quantile is not None:  # adaptive clipping
            within += float(torch.randn((), generator=generator, dtype=torch.float64)) * self.count_stddev
            fraction = within / self.expected_cohort
            self.clip_norm = clip * math.exp(-p.dp_clip_lr * (fraction - p.dp_clip_quantile))
            metrics["privacy/within_clip_fraction"] = fraction
        return noisy, metrics


def check_budget(epsilon: float, protocol: Federation, what: str) -> None:
    """Refuses a run whose ε after its last round exceeds `target_epsilon`, naming the fix."""
    if protocol.target_epsilon is not None and epsilon > protocol.target_epsilon:
        raise ValueError(f"{what} would spend ε = {epsilon:.3g} at δ = {protocol.dp_delta:g}, over the budget "
                         f"federation.target_epsilon = {protocol.target_epsilon:g}: raise the noise "
                         "(dp_noise_multiplier / dp_sigma), lower sample_rate or the rounds, or raise the budget")


def gaussian_statistics_epsilon(method, protocol: Federation, rounds: int) -> float | None:
    """ε at δ of `rounds` releases of statistics noised with `dp_sigma` under `feature_clip` B, each of
    the method's stated sensitivity Δ(B) (`FederatedMethod.statistics_sensitivity`); None where no
    such guarantee is configured or stated (B = 0: rows unclipped, which some methods' own layers
    bound). T Gaussian mechanisms of multiplier σ/Δ compose exactly into one of multiplier σ/(Δ√T)
    (Gaussian DP; dp-accounting's PLD accountant agrees, tested); a Δ that bounds every round's
    bounds their composition; cohort sampling would only lower it."""
    if protocol.dp_sigma == 0:
        return None
    return composed_statistics_epsilon(method.statistics_sensitivity(protocol.feature_clip), protocol, rounds)


def composed_statistics_epsilon(sensitivity: float | None, protocol: Federation, rounds: int) -> float | None:
    """`gaussian_statistics_epsilon` from the stated Δ (None: no claim), for a caller that asks each
    round and states Δ once."""
    if sensitivity is None or protocol.dp_sigma == 0:
        return None
    if rounds == 0:
        return 0.0
    return gaussian_epsilon(protocol.dp_sigma / math.sqrt(rounds), sensitivity, protocol.dp_delta)


class FitPrivacy:
    """The server's side of a fit's differential privacy, kept across its rounds.

    Under `dp_sigma` every round's aggregated statistics get N(0, σ²) (symmetric for symmetric
    uploads); under client-level DP (`dp_clip`) the clients clip to the current C (`clip_norm`, which
    adaptive clipping moves; None without client-level DP) and the clipped sum gets N(0, (zC)²).
    `epsilon_after(r)` is the ε spent after r rounds (the method's sensitivity is stated once per
    fit); a fit whose configured rounds would spend more than `target_epsilon` is refused here,
    before its first round.

    Args:
        method: the server half (its `num_rounds` and `statistics_sensitivity`).
        protocol: the federation's settings.
        population: N, the clients with data (client-level DP's accounting).
        clip_norm: the clip norm to continue from (a resumed fit's), default `dp_clip`.
    """

    def __init__(self, method, protocol: Federation, population: int, clip_norm: float | None = None) -> None:
        self.protocol = protocol
        self.client_level = ClientLevelDP(protocol, population) if protocol.client_level_dp else None
        self._epsilon: Callable[[int], float | None]
        if self.client_level is not None:
            if clip_norm is not None:
                self.client_level.clip_norm = clip_norm
            self._epsilon = self.client_level.epsilon
        else:
            sensitivity = method.statistics_sensitivity(protocol.feature_clip) if protocol.dp_sigma > 0 else None
            self._epsilon = functools.partial(composed_statistics_epsilon, sensitivity, protocol)
        name = type(method).__name__
        epsilon = self.epsilon_after(method.num_rounds)
        if protocol.target_epsilon is not None and epsilon is None:
            raise ValueError(f"federation.target_epsilon needs a stated sensitivity: {name}'s statistics have "
                             "none under feature_clip (or feature_clip is 0)")
        if epsilon is not None:
            check_budget(epsilon, protocol, f"{name} over {method.num_rounds} rounds")

    @property
    def clip_norm(self) -> float | None:
        """Client-level DP's C for the next round (None: the clients do not clip)."""
        return None if self.client_level is None else self.client_level.clip_norm

    def epsilon_after(self, rounds: int) -> float | None:
        """ε at `dp_delta` after `rounds` rounds; None where no guarantee is configured or stated."""
        return self._epsilon(rounds)

    def denominator(self, survivors: int) -> float:
        """What the method averages the round's sum by (client-level DP under Poisson sampling:
        the expected cohort; otherwise the clients that uploaded)."""
        return survivors if self.client_level is None else self.client_level.denominator(survivors)

    def noised(self, uploads: Mapping[str, Tensor], round_index: int,
               symmetric: Collection[str]) -> tuple[dict[str, Tensor], dict[str, float]]:
        """The round's aggregate as the server solves on it (with its noise, without `WITHIN_CLIP`),
        and the round's privacy metrics (`privacy/*`)."""
        protocol = self.protocol
        metrics: dict[str, float] = {}
        uploads = dict(uploads)
        if protocol.dp_sigma > 0:
            uploads = add_gaussian_noise(uploads, protocol.dp_sigma, protocol.generator(round_index, NOISE_STREAM),
                                         symmetric=symmetric)
        if self.client_level is not None:
            uploads, metrics = self.client_level.privatize(uploads, protocol.generator(round_index, NOISE_STREAM))
        epsilon = self.epsilon_after(round_index + 1)
        if epsilon is not None:
            metrics["privacy/epsilon"] = epsilon
        return uploads, metrics
