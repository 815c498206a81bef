"""Fed3R: federated recursive ridge regression (Fanì et al., ICML 2024), a closed-form ridge
classifier on the frozen features in one round; optionally on random Fourier features (Fed3R-RF).

The design row of a sample x (a row of d features) is

    φ(x) = x                              random_features = 0
    φ(x) = √(2/D) cos(xΩ + b)             random_features = D (Fed3R-RF)

with Ω (d, D) ~ N(0, σ⁻²) entrywise and b (D,) ~ U[0, 2π), drawn on the CPU from `seed`
(`random_fourier_map`), so that φ(x)ᵀφ(y) ≈ exp(−‖x − y‖² / 2σ²) (Rahimi & Recht, 2007); then,
with `bias`, a constant 1 appended (as the official code does). Client k sends, for its rows Φ_k
(n_k, p), p = (D or d) + bias, and one-hot labels Y_k (n_k, C),

    A_k = Φ_kᵀΦ_k     (p, p), symmetric: its upper triangle, p(p+1)/2 numbers
    B_k = Φ_kᵀY_k     (p, C)

and the server keeps A = Σ_k A_k, B = Σ_k B_k and solves

    W = (A + λI)⁻¹ B      (p, C);    logits φ(x) W.

The paper's "recursive" form folds the clients in one at a time, A ← A + A_k, B ← B + B_k: the
same sums, so any order of the clients and any partition of the rows give the same W, ridge
regression with λ on the pooled data (tested to 1e-8 in float64: iid, Dirichlet and shard
partitions, clients in several orders, with and without random features). λ regularizes every
row of W, the bias row too (the official code's A₀ = λI).

This is AFL (`workbench.methods.afl`) with no regularization intermediary (γ = 0: A_k is the
client's plain Gram matrix) and λ as AFL's γ_out: the statistics, the solve, the bytes, the
pooled buffers and `add_clients` / `remove_clients` (clients folded into or out of the fitted
model, exactly as a refit) are AFL's. What Fed3R adds is the design map φ.

σ (`rf_sigma`): None takes σ = √d, under which two samples of features with unit variance per
coordinate (E‖x − y‖² = 2d) are typically exp(−1) alike: the bandwidth of standardized features
(`data.standardize: true`). For features of another scale, set σ near their typical distance apart.

Messages: with random features the round's broadcast is the seed of (Ω, b), 8 bytes a client;
each client rebuilds the map from the seed it receives (`Fed3RClient`), never the d × D matrix,
and the server keeps its copy as non-persistent buffers (regenerated from the seed, not saved).
After the round every client receives W (and the seed again where rounds sample cohorts, for the
clients that missed it).

Privacy (`federation.dp_sigma`): random features need no clipping, ‖φ(x)‖² = (2/D) Σ_j cos²(·) ≤ 2,
so one sample's row has norm ≤ √(2 + bias) whatever x; without them the rows are clipped to
`feature_clip` B, norm ≤ √(B² + bias) (`statistics_sensitivity`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import Tensor

from workbench.federation.privacy import ridge_sensitivity
from workbench.linalg import stream_generator
from workbench.methods.afl import AFL, AFLClient
from workbench.methods.base import GRAM, SUMMED, Cohort, Metrics, Problem, Uploads

RANDOM_FEATURES_STREAM = 0  # the stream of `seed` that (Ω, b) are drawn from


def bandwidth(rf_sigma: float | None, feature_dim: int) -> float:
    """σ of the random features: the setting, or √d when it is None."""
    return math.sqrt(feature_dim) if rf_sigma is None else float(rf_sigma)


def random_fourier_map(seed: int, feature_dim: int, num_features: int, sigma: float,
                       dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Ω (d, D) ~ N(0, σ⁻²) and b (D,) ~ U[0, 2π) of `seed`, drawn on the CPU: the same on every
    machine. Drawn in float64 and cast to `dtype`, so a float32 map is the float64 one rounded
    (not another random map)."""
    generator = stream_generator(seed, RANDOM_FEATURES_STREAM)
    omega = torch.randn(feature_dim, num_features, generator=generator, dtype=torch.float64) / sigma
    phase = torch.rand(num_features, generator=generator, dtype=torch.float64) * (2 * math.pi)
    return omega.to(dtype), phase.to(dtype)


def design_rows(features: Tensor, dtype: torch.dtype, bias: bool,
                fourier: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """φ(x) [, 1] of every row: (n, d) -> (n, p), p = (D or d) + bias, in `dtype`; `fourier` is
    (Ω, b) for random features, None for φ(x) = x. The one formula of the server and the clients."""
    x = features.flatten(1).to(dtype)
    if fourier is not None:
        omega, phase = fourier
        x = torch.addmm(phase, x, omega).cos_().mul_(math.sqrt(2 / omega.shape[1]))
    if bias:
        x = torch.cat([x, x.new_ones(len(x), 1)], dim=1)
    return x


class Fed3RClient(AFLClient):
    """Client k: A_k = Φ_kᵀΦ_k and B_k = Φ_kᵀY_k of its design rows (AFL's statistics with γ = 0),
    the random features rebuilt from the seed of the round's broadcast. Keeps no state."""

    def __init__(self, problem: Problem, method: Fed3R) -> None:
        super().__init__(problem, method)
        self.design = self.design_rows  # AFL's statistics of φ(x), from the received seed
        self.num_features, self.bias, self.stat_dtype = method.random_features, method.bias, method.stat_dtype
        self.sigma = bandwidth(method.rf_sigma, problem.feature_dim)
        self._seed: int | None = None
        self._maps: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}  # regenerated: never saved

    def client_update(self, round_index: int, broadcast: Mapping[str, Tensor],
                      cohort: Cohort) -> tuple[Uploads, Metrics]:
        if "seed" in broadcast:
            self._seed = int(broadcast["seed"])
        return super().client_update(round_index, broadcast, cohort)

    def design_rows(self, features: Tensor) -> Tensor:
        """φ(x) [, 1]: (n, d) -> (n, p), (Ω, b) from the received seed."""
        fourier = None
        if self.num_features:
            if self._seed is None:
                raise RuntimeError("Fed3R's client has not received the seed of its random features "
                                   "(the round's broadcast)")
            key = (self._seed, features.device)
            if key not in self._maps:
                omega, phase = random_fourier_map(self._seed, self.problem.feature_dim, self.num_features,
                                                  self.sigma, self.stat_dtype)
                self._maps[key] = (omega.to(features.device), phase.to(features.device))
            fourier = self._maps[key]
        return design_rows(features, self.stat_dtype, self.bias, fourier)


def check_ridge(ridge: float) -> None:
    if not ridge > 0:
        raise ValueError(f"ridge must be > 0 (λ of W = (A + λI)⁻¹B, e.g. 0.01), got {ridge}")


class Fed3R(AFL):
    """Federated recursive ridge regression: a closed-form ridge head in one round, optionally on
    random Fourier features (Fed3R-RF).

    Args:
        ridge: λ > 0 of W = (A + λI)⁻¹B (the official code's 0.01).
        random_features: D ≥ 0, the width of the random Fourier features; 0: φ(x) = x.
        rf_sigma: σ > 0, the bandwidth of the Gaussian kernel they approximate (Ω ~ N(0, σ⁻²));
            None: √d, the bandwidth of standardized features.
        bias: append a constant-1 feature (as the official code does); λ regularizes its row too.
        dtype: dtype of the design rows, the statistics and the solve (and so of what is sent).
        seed: the shared seed of (Ω, b), sent to the clients (8 bytes).

    Buffers: AFL's — `weight` W (p, C), `pooled_gram` A (p, p), `pooled_cross` B (p, C),
    `pooled_clients`, `selected_gamma_out` λ; with random features `rf_omega` Ω (d, D) and
    `rf_phase` b (D,), regenerated from the seed (not saved).
    """

    uploads = MappingProxyType({"gram": GRAM, "cross": SUMMED})
    ridge_setting = "ridge"
    server_settings = ("ridge",)
    rf_omega: Tensor  # (d, D), with random features
    rf_phase: Tensor  # (D,)

    def __init__(self, ridge: float = 0.01, random_features: int = 0, rf_sigma: float | None = None,
                 bias: bool = True, dtype: str = "float64", seed: int = 0) -> None:
        check_ridge(ridge)
        if isinstance(random_features, bool) or not isinstance(random_features, int) or random_features < 0:
            raise ValueError(f"random_features must be an integer ≥ 0 (D; 0: φ(x) = x), got {random_features!r}")
        if rf_sigma is not None and not (rf_sigma > 0 and math.isfinite(rf_sigma)):
            raise ValueError(f"rf_sigma must be > 0 (the kernel's bandwidth σ), or null for √d, got {rf_sigma}")
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
        if not 0 <= seed < 2 ** 63:
            raise ValueError(f"seed must be an integer in [0, 2⁶³), got {seed}")
        super().__init__(gamma=0.0, gamma_out=ridge, bias=bias, dtype=dtype, seed=seed)
        self.save_hyperparameters()
        self.ridge, self.random_features, self.rf_sigma = ridge, random_features, rf_sigma

    def setup_problem(self, problem: Problem) -> None:
        super().setup_problem(problem)  # AFL's W, A, B: (p, C), (p, p), (p, C)
        if self.random_features:  # the server's copy of (Ω, b), for `forward`: regenerated, neither saved nor sent
            omega, phase = random_fourier_map(self.seed, problem.feature_dim, self.random_features,
                                              bandwidth(self.rf_sigma, problem.feature_dim), self.stat_dtype)
            self.register_buffer("rf_omega", omega, persistent=False)
            self.register_buffer("rf_phase", phase, persistent=False)

    def design_dim(self, problem: Problem) -> int:
        """p = (D or d) + bias."""
        return (self.random_features or problem.feature_dim) + int(self.bias)

    def design(self, features: Tensor) -> Tensor:
        """φ(x) [, 1]: (n, d) -> (n, p) in the statistics dtype. AFL fits W on these rows."""
        fourier = (self.rf_omega, self.rf_phase) if self.random_features else None
        return design_rows(features, self.stat_dtype, self.bias, fourier)

    def solve_again(self, settings: Mapping[str, float]) -> None:
        """W at another λ (> 0, as a fit takes it) from the kept A and B."""
        check_ridge(settings["ridge"])
        super().solve_again(settings)

    def client_half(self) -> Fed3RClient:
        if self.problem is None:
            raise RuntimeError("Fed3R builds its clients once set up for a problem (`setup`)")
        return Fed3RClient(self.problem, self)

    def statistics_sensitivity(self, feature_norm: float) -> float | None:
        """Δ of (A, B) to one sample, `privacy.ridge_sensitivity` of its row's norm bound: √(2 + bias)
        with random features (whatever x), √(B² + bias) without (None for unclipped rows, B = 0)."""
        if self.random_features:
            return ridge_sensitivity(math.sqrt(2 + int(self.bias)))
        if feature_norm == 0:
            return None
        return ridge_sensitivity(math.sqrt(feature_norm ** 2 + int(self.bias)))

    def _seed_message(self) -> dict[str, Tensor]:
        return {"seed": torch.tensor(self.seed, dtype=torch.int64)} if self.random_features else {}

    def broadcast(self) -> dict[str, Tensor]:
        """The seed of (Ω, b) with random features (8 bytes), else nothing."""
        return self._seed_message()

    def final_broadcast(self) -> dict[str, Tensor]:
        """W, and the seed again for the clients a sampled round missed."""
        return {"weight": self.weight, **(self._seed_message() if self.clients_missed_broadcasts else {})}
