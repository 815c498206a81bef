"""SAFLe: sparse analytic federated learning with nonlinear embeddings (CVPR 2026).

A deterministic nonlinear head that is linear in its weights, so AFL's one-round closed form
still applies:

1. Bucketing. Each feature dimension is standardized to z and cut at standard-normal
   quantiles τ_1 < … < τ_T; `r(z) = #{t : τ_t < z}` is its region. The digits of one dimension:
   - `binary_overlap` (thermometer): L bits `[r > l]` = `[z > τ_{l+1}]`, l = 0..L−1, T = L, base k = 2;
   - `onehot`:  L bits `[r = l]` (L bins, T = L−1), base k = 2;
   - `integer`: one digit r ∈ 0..L−1 (L bins, T = L−1), base k = L.
   The d features give d_q digits (d·L, or d for `integer`). τ_t is the standard-normal
   quantile at t / (T+1), so the T+1 regions are equally likely for a standard-normal z.
   z comes from `thresholds: fixed` (each sample standardized over its own d features: data-free,
   one round) or `calibrated` (each dimension standardized by the mean and variance of the pooled
   data, from one extra round in which clients upload Σx, Σx² (d each) and their sample count;
   the broadcast of the next round carries the d means and d standard deviations the server
   computed from them).
2. Shuffle and group. A permutation of the d_q digits drawn from `seed` is cut into E groups of
   G digits. If E·G > d_q, further seeded permutations are appended; the E·G digits used are the
   first E·G of that sequence (E·G < d_q leaves the rest unused).
3. Sparse embedding sum. Group j's digits g_{j,1..G} form `idx_j = Σ_i g_{j,i} k^{i−1}` < V = k^G,
   and `ŷ = Σ_j W_j[idx_j]`. Stacking the E tables, `ŷ = Φ(x)ᵀ W` with W: (E·V) × C and
   Φ(x) ∈ {0,1}^{E·V} the multi-hot vector with one 1 at row `j·V + idx_j` of every block j.

W is AFL on Φ (optionally on `[x, Φ(x)]` with `raw_features`): client k uploads
`Φ_kᵀΦ_k + γI` (packed: (E·V)(E·V+1)/2 numbers) and `Φ_kᵀY_k` (E·V × C); the server solves

    W = (Σ_k (Φ_kᵀΦ_k + γI) − Kγ I + γ_out I)⁻¹ Σ_k Φ_kᵀY_k,

ridge regression with γ_out on the pooled Φ, whatever the partition. `ΦᵀΦ` is counted from the
E active rows of each sample (O(n·E²)), never from a dense one-hot matrix (O(n·(E·V)²)); its
E diagonal V×V blocks are diagonal, since a sample activates one row per block.

The client half (`SAFLeClient`) rebuilds τ and the digit groups from the settings (the seed) and
takes the calibration from the broadcast it receives; it keeps no state across rounds. After
the last round every client receives W (`final_broadcast`).
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from workbench.linalg import class_sums, multi_hot_cross, multi_hot_gram, solve_spd
from workbench.methods.base import SUMMED, SYMMETRIC, ClientHalf, Cohort, FederatedMethod, Problem

BUCKETINGS = ("binary_overlap", "onehot", "integer")
THRESHOLDS = ("fixed", "calibrated")
MAX_EMBEDDING_ROWS = 1 << 16  # E·V: the dense (E·V)² Gram is then 32 GiB in float64
CONSTANT_VARIANCE = 1e-12  # variance below this fraction of E[x²] is rounding: the feature is constant


def standard_deviation(mean: Tensor, second_moment: Tensor) -> Tensor:
    """`sqrt(E[x²] − mean²)` from the first two moments (any shape); +inf where the feature is
    constant, so that its standardized value `(x − mean) / std` is 0."""
    variance = second_moment - mean.square()
    constant = variance <= CONSTANT_VARIANCE * second_moment
    return variance.clamp_min(0).sqrt().masked_fill(constant, math.inf)


EMBEDDING_SETTINGS = ("bucketing", "levels", "threshold_mode", "experts", "group_size", "raw_features",
                      "seed", "stat_dtype", "digits_per_dim", "base", "vocab", "embedding_rows")


class SparseEmbedding:
    """Φ(x), shared by the server half (its forward) and the client half (its uploads): needs the
    settings `EMBEDDING_SETTINGS` and the buffers of `register_embedding` (`cut_points`,
    `digit_groups`, and `feature_mean`, `feature_std` when calibrated)."""

    def register_embedding(self, feature_dim: int, persistent: bool) -> None:
        """τ (T,), the digit groups (E, G), and the calibration (d each, until set: mean 0, std 1)."""
        num_digits = feature_dim * self.digits_per_dim  # d_q
        if self.group_size > num_digits:
            raise ValueError(f"group_size G = {self.group_size} exceeds the d_q = {num_digits} digits "
                             f"of {feature_dim} features; lower group_size")
        regions = self.levels + 1 if self.bucketing == "binary_overlap" else self.levels
        quantiles = torch.arange(1, regions, dtype=torch.float64) / regions
        self.register_buffer("cut_points", torch.special.ndtri(quantiles).to(self.stat_dtype),  # τ: (T,)
                             persistent=persistent)
        self.register_buffer("digit_groups", self.draw_groups(num_digits), persistent=persistent)  # (E, G)
        if self.threshold_mode == "calibrated":
            self.register_buffer("feature_mean", torch.zeros(feature_dim, dtype=self.stat_dtype),
                                 persistent=persistent)
            self.register_buffer("feature_std", torch.ones(feature_dim, dtype=self.stat_dtype),
                                 persistent=persistent)

    def draw_groups(self, num_digits: int) -> Tensor:
        """Seeded permutations of the d_q digits, concatenated and cut into E groups: (E, G) int64."""
        generator = torch.Generator().manual_seed(self.seed)
        needed = self.experts * self.group_size
        permutations = [torch.randperm(num_digits, generator=generator)
                        for _ in range(-(-needed // num_digits))]
        return torch.cat(permutations)[:needed].view(self.experts, self.group_size)

    def standardize(self, features: Tensor) -> Tensor:
        """(n, d) -> z (n, d) in the statistics dtype."""
        x = features.to(self.stat_dtype)
        if self.threshold_mode == "calibrated":
            return (x - self.feature_mean) / self.feature_std
        mean = x.mean(1, keepdim=True)
        return (x - mean) / standard_deviation(mean, x.square().mean(1, keepdim=True))

    def digit(self, region: Tensor, level: Tensor) -> Tensor:
        """Digit `level` of a dimension in `region` (broadcast int64 tensors) -> int64 in [0, k)."""
        if self.bucketing == "binary_overlap":
            return (region > level).long()
        if self.bucketing == "onehot":
            return (region == level).long()
        return region

    def digit_code(self, features: Tensor) -> Tensor:
        """All d_q digits: (n, d) -> (n, d_q) int64; digit `p` is level `p % L` of dimension `p // L`."""
        regions = torch.bucketize(self.standardize(features), self.cut_points)
        levels = torch.arange(self.digits_per_dim, device=regions.device)
        return self.digit(regions[:, :, None], levels).flatten(1)

    def expert_indices(self, features: Tensor) -> Tensor:
        """Active rows of the stacked tables: (n, d) -> (n, E) int64, column j in [j·V, (j+1)·V)."""
        regions = torch.bucketize(self.standardize(features), self.cut_points)  # (n, d)
        # only the E·G digits that are used are computed
        digits = self.digit(regions[:, self.digit_groups // self.digits_per_dim],
                            self.digit_groups % self.digits_per_dim)  # (n, E, G)
        place_values = self.base ** torch.arange(self.group_size, device=digits.device)
        table_offsets = self.vocab * torch.arange(self.experts, device=digits.device)
        return (digits * place_values).sum(2) + table_offsets


class SAFLeClient(SparseEmbedding, ClientHalf):
    """The clients: the moments of their features (calibration round), then `Φ_kᵀΦ_k + γI` and
    `Φ_kᵀY_k` (the solve round). τ and the groups come from the settings, the calibration from
    the round's broadcast; no state is kept across rounds."""

    def __init__(self, problem: Problem, method: SAFLe) -> None:
        super().__init__(problem)
        for name in EMBEDDING_SETTINGS:
            setattr(self, name, getattr(method, name))
        self.gamma, self.num_rounds = method.gamma, method.num_rounds
        self.register_embedding(problem.feature_dim, persistent=False)  # rebuilt from the settings

    def client_update(self, round_index, broadcast, cohort: Cohort):
        if round_index < self.num_rounds - 1:  # the calibration round
            return self._moments(cohort), {}
        if self.threshold_mode == "calibrated":  # the server's calibration, in this round's broadcast
            self.feature_mean.copy_(broadcast["feature_mean"])
            self.feature_std.copy_(broadcast["feature_std"])
        rows, classes, d = self.embedding_rows, self.num_classes, self.problem.feature_dim
        side = rows + (d if self.raw_features else 0)
        gram = torch.zeros(side, side, dtype=self.stat_dtype, device=self.cut_points.device)
        cross = gram.new_zeros(side, classes)
        for part in cohort.batches():
            active = self.expert_indices(part.features)
            phi_gram = multi_hot_gram(active, rows, dtype=self.stat_dtype)  # ΦᵀΦ: (E·V, E·V)
            # ΦᵀY counts (row, class) pairs
            phi_cross = torch.bincount((active * classes + part.labels[:, None]).flatten(),
                                       minlength=rows * classes).view(rows, classes).to(self.stat_dtype)
            if self.raw_features:  # the design [x, Φ]: Gram [[XᵀX, XᵀΦ], [ΦᵀX, ΦᵀΦ]]
                x = part.features.to(self.stat_dtype)
                phi_x = multi_hot_cross(active, x, rows)  # ΦᵀX: (E·V, d)
                gram[:d, :d] += x.T @ x
                gram[:d, d:] += phi_x.T
                gram[d:, :d] += phi_x
                cross[:d] += class_sums(x, part.labels, classes)
            gram[side - rows:, side - rows:] += phi_gram
            cross[side - rows:] += phi_cross
        gram.diagonal().add_(self.gamma * len(cohort.clients))  # each client adds γI once
        return {"gram": gram, "cross": cross}, {}

    def _moments(self, cohort: Cohort) -> dict[str, Tensor]:
        """Σx, Σx² (d each) and the sample count of the cohort (1,)."""
        x = cohort.features[:0].to(self.stat_dtype)
        total, squares, count = x.new_zeros(x.shape[1]), x.new_zeros(x.shape[1]), x.new_zeros(1)
        for part in cohort.batches():
            x = part.features.to(self.stat_dtype)
            total += x.sum(0)
            squares += x.square().sum(0)
            count += len(x)
        return {"feature_sum": total, "feature_square_sum": squares, "count": count}


class SAFLe(SparseEmbedding, FederatedMethod):
    """Sparse analytic FL: bucketing, seeded grouping and a sum of E embeddings, solved like AFL.

    The defaults follow the paper's guidance: thermometer bits at L = 8 levels, V = 2^6 = 64 rows
    per table (V in [32, 64]), E = 64 tables, so E·V = 4096 and a client uploads 67 MB in float64
    (the paper: 60-70 MB); γ = γ_out = 1.

    Args:
        bucketing: `binary_overlap` (thermometer bits), `onehot` (one bit per bin) or `integer`
            (one base-L digit per dimension).
        levels: L. Thresholds per dimension for `binary_overlap` (L bits, L+1 regions); bins per
            dimension for `onehot` and `integer` (L ≥ 2).
        thresholds: `fixed` (per-sample standardization, one round) or `calibrated` (per-dimension
            standardization from an extra statistics round: two rounds).
        experts: E, the number of embedding tables.
        group_size: G, the digits per table; each table has V = k^G rows (k = 2, or L for `integer`).
        raw_features: solve on `[x, Φ(x)]` (the raw features beside the embeddings) in one ridge.
        gamma: γ, the regularization each client adds locally (RI); removed by the server.
        gamma_out: γ_out, the ridge regularization of the final solve. ΦᵀΦ is always singular (the
            V one-hot columns of each table sum to the same all-ones column), so keep it > 0.
        seed: seed of the digit permutation (shared by every client, 8 bytes).
        dtype: dtype of the statistics and the solve (and so of what is sent).
    """

    uploads = {"gram": SYMMETRIC, "cross": SUMMED,  # the solve round
               "feature_sum": SUMMED, "feature_square_sum": SUMMED, "count": SUMMED}  # the calibration round

    def __init__(self, bucketing: Literal["binary_overlap", "onehot", "integer"] = "binary_overlap",
                 levels: int = 8, thresholds: Literal["fixed", "calibrated"] = "fixed", experts: int = 64,
                 group_size: int = 6, raw_features: bool = False, gamma: float = 1.0, gamma_out: float = 1.0,
                 seed: int = 0, dtype: str = "float64") -> None:
        super().__init__()
        if bucketing not in BUCKETINGS:
            raise ValueError(f"unknown bucketing {bucketing!r}; choose one of {BUCKETINGS}")
        if thresholds not in THRESHOLDS:
            raise ValueError(f"unknown thresholds {thresholds!r}; choose one of {THRESHOLDS}")
        min_levels = 1 if bucketing == "binary_overlap" else 2
        if levels < min_levels:
            raise ValueError(f"levels must be ≥ {min_levels} for {bucketing} bucketing, got {levels}")
        if experts < 1 or group_size < 1:
            raise ValueError(f"experts and group_size must be ≥ 1, got {experts} and {group_size}")
        if gamma < 0 or gamma_out < 0:
            raise ValueError(f"gamma and gamma_out must be ≥ 0, got {gamma} and {gamma_out}")
        stat_dtype = getattr(torch, dtype, None)
        if not isinstance(stat_dtype, torch.dtype) or not stat_dtype.is_floating_point:
            raise ValueError(f"dtype must name a torch floating dtype such as 'float64', got {dtype!r}")
        self.digits_per_dim = 1 if bucketing == "integer" else levels
        self.base = levels if bucketing == "integer" else 2  # k
        self.vocab = self.base ** group_size  # V
        self.embedding_rows = experts * self.vocab  # E·V
        if self.embedding_rows > MAX_EMBEDDING_ROWS:
            raise ValueError(
                f"E·V = {experts}·{self.base}^{group_size} = {self.embedding_rows} embedding rows exceeds "
                f"{MAX_EMBEDDING_ROWS} (the Gram would take "
                f"{self.embedding_rows ** 2 * 8 / 2 ** 30:.0f} GiB in float64); lower experts or group_size")
        self.save_hyperparameters()
        self.bucketing, self.levels, self.threshold_mode = bucketing, levels, thresholds
        self.experts, self.group_size, self.raw_features = experts, group_size, raw_features
        self.gamma, self.gamma_out, self.seed = gamma, gamma_out, seed
        self.stat_dtype = stat_dtype

    @property
    def num_rounds(self) -> int:
        return 2 if self.threshold_mode == "calibrated" else 1

    @property
    def has_model(self) -> bool:
        return self.round == self.num_rounds  # the calibration round gives no model yet

    def setup_problem(self, problem: Problem) -> None:
        feature_dim, num_classes = problem.feature_dim, problem.num_classes
        self.register_embedding(feature_dim, persistent=True)
        self.register_buffer("embedding",
                             torch.zeros(self.embedding_rows, num_classes, dtype=self.stat_dtype))
        if self.raw_features:
            self.register_buffer("raw_weight", torch.zeros(feature_dim, num_classes, dtype=self.stat_dtype))

    def client_half(self) -> SAFLeClient:
        return SAFLeClient(self.problem, self)

    # ---- rounds ------------------------------------------------------------------------------
    def broadcast(self) -> dict[str, Tensor]:
        """The solve round after a calibration round carries the server's calibration (2d numbers)."""
        if self.threshold_mode == "calibrated" and self.round == self.num_rounds - 1:
            return {"feature_mean": self.feature_mean, "feature_std": self.feature_std}
        return {}

    def server_update(self, uploads: dict[str, Tensor], num_clients: int) -> dict[str, float]:
        if self.round < self.num_rounds - 1:
            count = uploads["count"]
            self.feature_mean = uploads["feature_sum"] / count
            self.feature_std = standard_deviation(self.feature_mean, uploads["feature_square_sum"] / count)
            return {}
        gram = uploads["gram"]  # the round's sum, used once: shifted in place, no second (E·V)² matrix
        gram.diagonal().add_(self.gamma_out - num_clients * self.gamma)
        weight = solve_spd(gram, uploads["cross"], what="SAFLe's aggregated Gram matrix")
        raw_dim = self.feature_dim if self.raw_features else 0
        self.embedding = weight[raw_dim:]
        if self.raw_features:
            self.raw_weight = weight[:raw_dim]
        return {}

    def final_broadcast(self) -> dict[str, Tensor]:
        """W: the embedding tables (and the raw features' weight)."""
        message = {"embedding": self.embedding}
        if self.raw_features:
            message["raw_weight"] = self.raw_weight
        return message

    def forward(self, features: Tensor) -> Tensor:
        """Logits: (n, d) -> (n, C), the sum of the E selected embedding rows (+ x·W_raw)."""
        logits = self.embedding[self.expert_indices(features)].sum(1)
        if self.raw_features:
            logits = logits + features.to(self.stat_dtype) @ self.raw_weight
        return logits
