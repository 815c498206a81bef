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
   computed from them). `quantile` puts each dimension's τ at its empirical quantiles t / (T+1)
   of the pooled data instead (so its T+1 regions are equally likely whatever its distribution):
   after the moments round, clients upload the counts of their calibrated z in `HISTOGRAM_BINS`
   equal bins of [−8, 8] (the ends catch the tails), d × bins summed; the server reads the
   quantiles off the summed histogram (linear within a bin: to 16/bins standard deviations).
   Three rounds.
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

At the paper's scale (every digit used, E·V in the tens of thousands) the Gram's V×V
co-occurrence blocks fill up and the packed upload is gigabytes, beyond this machine's memory.
`solver: cg` computes the same solution without it: the in-process server keeps the clients'
active rows (n × E indices, a simulation shortcut, never sent) and solves the ridge by
Jacobi-preconditioned conjugate gradients on the sparse design (`linalg.multi_hot_ridge`),
equal to the dense solve to the tolerance. `comm/bytes_up` still counts what the protocol sends,
the packed Gram and ΦᵀY. The engines that run clients elsewhere (Flower, several processes)
never give the server the rows: the solve round then fails with a clear error.

`gamma_grid` chooses γ_out on the clients' own hold-outs (`workbench.methods.ridge_selection`):
the solve round also uploads the hold-out rows' statistics, the server fits one candidate per γ
on the other rows, the clients score them on their hold-outs in one more round, and the server
solves on all the rows with the best γ.

The client half (`SAFLeClient`) rebuilds τ and the digit groups from the settings (the seed) and
takes the calibration from the broadcast it receives; it keeps no state across rounds. After
the last round every client receives W (`final_broadcast`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor, nn

from workbench.federation.codec import WireSize
from workbench.linalg import (
    MultiHotDesign,
    class_sums,
    counts_of,
    multi_hot_cross,
    multi_hot_gram,
    multi_hot_ridge,
    packed_symmetric_numel,
    solve_spd,
    statistics_dtype,
)
from workbench.methods.afl import check_regularizer_in_ring
from workbench.methods.base import (
    GRAM,
    SUMMED,
    ClientHalf,
    Cohort,
    FederatedMethod,
    Metrics,
    Problem,
    Upload,
    Uploads,
)
from workbench.methods.ridge_selection import (
    SELECTION_UPLOADS,
    check_holdout_rows,
    checked_grid,
    choose_gamma,
    client_holdout,
    holdout_correct,
)

BUCKETINGS = ("binary_overlap", "onehot", "integer")
THRESHOLDS = ("fixed", "calibrated", "quantile")
SOLVERS = ("dense", "cg")
MAX_EMBEDDING_ROWS = 1 << 16  # E·V of the dense solver: the (E·V)² Gram is then 32 GiB in float64
HISTOGRAM_BINS, HISTOGRAM_RANGE = 512, 8.0  # the quantile round: bins of z in [−8, 8]
GATHER_ELEMENTS = 1 << 24  # rows × E × C gathered at once by the forward and the hold-out scores
CONSTANT_VARIANCE = 1e-12  # variance below this fraction of E[x²] is rounding: the feature is constant


def standard_deviation(mean: Tensor, second_moment: Tensor) -> Tensor:
    """`sqrt(E[x²] − mean²)` from the first two moments (any shape); +inf where the feature is
    constant, so that its standardized value `(x − mean) / std` is 0."""
    variance = second_moment - mean.square()
    constant = variance <= CONSTANT_VARIANCE * second_moment
    return variance.clamp_min(0).sqrt().masked_fill(constant, math.inf)


EMBEDDING_SETTINGS = ("bucketing", "levels", "threshold_mode", "experts", "group_size", "raw_features",
                      "seed", "stat_dtype", "digits_per_dim", "base", "vocab", "embedding_rows", "gamma_grid")


if TYPE_CHECKING:  # a mixin of modules: typed as one, a plain class at run time
    from workbench.data.population import Population

    _ModuleMixin = nn.Module
else:
    _ModuleMixin = object


class SparseEmbedding(_ModuleMixin):
    """Φ(x), shared by the server half (its forward) and the client half (its uploads): needs the
    settings `EMBEDDING_SETTINGS` and the buffers of `register_embedding` (`cut_points`,
    `digit_groups`, and `feature_mean`, `feature_std` when calibrated)."""

    # the settings (EMBEDDING_SETTINGS)
    bucketing: str
    levels: int  # L
    threshold_mode: str
    experts: int  # E
    group_size: int  # G
    raw_features: bool
    seed: int
    stat_dtype: torch.dtype
    digits_per_dim: int
    base: int  # k
    vocab: int  # V
    embedding_rows: int  # E·V
    gamma_grid: list[float]
    # buffers of `register_embedding`; `feature_mean`, `feature_std` unless fixed, `feature_cuts` if quantile
    cut_points: Tensor  # τ (T,)
    digit_groups: Tensor  # (E, G) int64
    feature_mean: Tensor  # (d,)
    feature_std: Tensor  # (d,)
    feature_cuts: Tensor  # (d, T), in z

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
        if self.threshold_mode != "fixed":
            self.register_buffer("feature_mean", torch.zeros(feature_dim, dtype=self.stat_dtype),
                                 persistent=persistent)
            self.register_buffer("feature_std", torch.ones(feature_dim, dtype=self.stat_dtype),
                                 persistent=persistent)
        if self.threshold_mode == "quantile":  # each dimension's own τ (in z), until set: the Gaussian ones
            self.register_buffer("feature_cuts", self.cut_points.expand(feature_dim, -1).clone(),
                                 persistent=persistent)

    @property
    def round_kinds(self) -> tuple[str, ...]:
        """What each round does: [moments [, histogram]], solve [, select]."""
        calibration = {"fixed": (), "calibrated": ("moments",), "quantile": ("moments", "histogram")}
        return calibration[self.threshold_mode] + ("solve",) + (("select",) if len(self.gamma_grid) > 1 else ())

    def calibration(self) -> dict[str, Tensor]:
        """The server's calibration, as a broadcast carries it."""
        message = {}
        if self.threshold_mode != "fixed":
            message = {"feature_mean": self.feature_mean, "feature_std": self.feature_std}
        if self.threshold_mode == "quantile":
            message["feature_cuts"] = self.feature_cuts
        return message

    def take_calibration(self, broadcast) -> None:
        for name in ("feature_mean", "feature_std", "feature_cuts"):
            if name in broadcast:
                getattr(self, name).copy_(broadcast[name])

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
        if self.threshold_mode != "fixed":
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

    def regions(self, features: Tensor) -> Tensor:
        """r = #{t : τ_t < z} of every dimension: (n, d) -> (n, d) int64."""
        z = self.standardize(features)
        if self.threshold_mode == "quantile":  # each dimension's own τ
            return torch.searchsorted(self.feature_cuts, z.T.contiguous()).T
        return torch.bucketize(z, self.cut_points)

    def digit_code(self, features: Tensor) -> Tensor:
        """All d_q digits: (n, d) -> (n, d_q) int64; digit `p` is level `p % L` of dimension `p // L`."""
        regions = self.regions(features)
        levels = torch.arange(self.digits_per_dim, device=regions.device)
        return self.digit(regions[:, :, None], levels).flatten(1)

    def expert_indices(self, features: Tensor) -> Tensor:
        """Active rows of the stacked tables: (n, d) -> (n, E) int64, column j in [j·V, (j+1)·V)."""
        place_values = self.base ** torch.arange(self.group_size, device=features.device)
        table_offsets = self.vocab * torch.arange(self.experts, device=features.device)
        dims, levels = self.digit_groups // self.digits_per_dim, self.digit_groups % self.digits_per_dim
        rows = max(1, GATHER_ELEMENTS // (self.experts * self.group_size))  # bounds the (rows, E, G) digits
        parts = []
        for chunk in features.split(rows):
            digits = self.digit(self.regions(chunk)[:, dims], levels)  # only the E·G digits used: (rows, E, G)
            parts.append((digits * place_values).sum(2) + table_offsets)
        return torch.cat(parts) if parts else features.new_zeros(0, self.experts, dtype=torch.long)


class SAFLeClient(SparseEmbedding, ClientHalf):
    """The clients: the moments of their features (calibration round), the histogram of their
    calibrated z (quantile round), `Φ_kᵀΦ_k + γI` and `Φ_kᵀY_k` (the solve round), the hold-out
    scores of the γ candidates (select round). τ and the groups come from the settings, the
    calibration from the round's broadcast; no state is kept across rounds."""

    def __init__(self, problem: Problem, method: SAFLe) -> None:
        super().__init__(problem)
        for name in EMBEDDING_SETTINGS:
            setattr(self, name, getattr(method, name))
        self.gamma, self.solver, self.holdout_fraction = method.gamma, method.solver, method.holdout_fraction
        self.row_ledger = method.row_ledger  # solver "cg": the in-process server's view of the rows
        self.register_embedding(problem.feature_dim, persistent=False)  # rebuilt from the settings

    def client_update(self, round_index: int, broadcast: Mapping[str, Tensor],
                      cohort: Cohort) -> tuple[Uploads, Metrics]:
        self.take_calibration(broadcast)  # the server's calibration, in this round's broadcast
        kind = self.round_kinds[round_index]
        if kind == "moments":
            return self._moments(cohort), {}
        if kind == "histogram":
            return self._histogram(cohort), {}
        held = (client_holdout(cohort.labels, cohort.client_ids, cohort.clients, self.holdout_fraction, self.seed)
                if len(self.gamma_grid) > 1 else None)
        if kind == "select":
            assert held is not None  # (a select round only with a γ grid)
            return self._holdout_scores(cohort, held, broadcast["candidates"]), {}
        if self.solver == "cg":
            return self._rows(cohort, held), {}
        gram, cross = self._statistics(cohort.features, cohort.labels, cohort.batch_size)
        gram.diagonal().add_(self.gamma * len(cohort.clients))  # each client adds γI once
        uploads = {"gram": gram, "cross": cross}
        if held is not None:  # the hold-out rows' own statistics, for the γ candidates
            uploads["holdout_gram"], uploads["holdout_cross"] = self._statistics(
                cohort.features[held], cohort.labels[held], cohort.batch_size)
        return uploads, {}

    def _statistics(self, features: Tensor, labels: Tensor, batch_size: int) -> tuple[Tensor, Tensor]:
        """ΦᵀΦ and ΦᵀY of the design (Φ, or [x, Φ]) of the rows, in chunks of `batch_size`."""
        rows, classes, d = self.embedding_rows, self.num_classes, self.problem.feature_dim
        side = rows + (d if self.raw_features else 0)
        gram = torch.zeros(side, side, dtype=self.stat_dtype, device=self.cut_points.device)
        cross = gram.new_zeros(side, classes)
        for start in range(0, len(labels), batch_size):
            part_features, part_labels = features[start:start + batch_size], labels[start:start + batch_size]
            active = self.expert_indices(part_features)
            phi_gram = multi_hot_gram(active, rows, dtype=self.stat_dtype)  # ΦᵀΦ: (E·V, E·V)
            if self.raw_features:  # the design [x, Φ]: Gram [[XᵀX, XᵀΦ], [ΦᵀX, ΦᵀΦ]]
                x = part_features.to(self.stat_dtype)
                phi_x = multi_hot_cross(active, x, rows)  # ΦᵀX: (E·V, d)
                gram[:d, :d] += x.T @ x
                gram[:d, d:] += phi_x.T
                gram[d:, :d] += phi_x
                cross[:d] += class_sums(x, part_labels, classes)
            gram[side - rows:, side - rows:] += phi_gram
            cross[side - rows:] += self._phi_cross(active, part_labels)
        return gram, cross

    def _phi_cross(self, active: Tensor, labels: Tensor) -> Tensor:
        """ΦᵀY counts (row, class) pairs: (n, E), (n,) -> (E·V, C)."""
        classes = self.num_classes
        pairs = (active * classes + labels[:, None]).flatten()
        return counts_of(pairs, self.embedding_rows * classes, self.stat_dtype).view(-1, classes)

    def _rows(self, cohort: Cohort, held: Tensor | None) -> dict[str, Tensor]:
        """Solver "cg": ΦᵀY (and the hold-out's) and the row count are uploaded; the active rows go
        to the in-process server's ledger instead of the Gram they determine."""
        cross = torch.zeros(self.embedding_rows, self.num_classes, dtype=self.stat_dtype,
                            device=self.cut_points.device)
        held_cross = cross.clone()
        for start in range(0, len(cohort), cohort.batch_size):
            rows = slice(start, start + cohort.batch_size)
            active, labels = self.expert_indices(cohort.features[rows]), cohort.labels[rows]
            cross += self._phi_cross(active, labels)
            part_held = held[rows] if held is not None else torch.zeros_like(labels, dtype=torch.bool)
            if held is not None:
                held_cross += self._phi_cross(active[part_held], labels[part_held])
            self.row_ledger.append((active.to(torch.int32), part_held))
        uploads = {"cross": cross, "ledger_rows": cross.new_tensor([float(len(cohort))])}
        if held is not None:
            uploads["holdout_cross"] = held_cross
        return uploads

    def _holdout_scores(self, cohort: Cohort, held: Tensor, candidates: Tensor) -> dict[str, Tensor]:
        """Each candidate's hits on the hold-out rows: {"holdout_correct": (Γ,), "holdout_count": ()}."""
        features = cohort.features[held]
        tables = candidates[:, features.shape[1]:] if self.raw_features else candidates
        rows = max(1, GATHER_ELEMENTS // (len(candidates) * self.experts * self.num_classes))
        logits = torch.cat([tables[:, self.expert_indices(chunk)].sum(2) for chunk in features.split(rows)], dim=1) \
            if len(features) else tables.new_zeros(len(candidates), 0, self.num_classes)
        if self.raw_features:
            logits = logits + features.to(self.stat_dtype) @ candidates[:, :features.shape[1]]
        return holdout_correct(logits, cohort.labels[held])

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

    def _histogram(self, cohort: Cohort) -> dict[str, Tensor]:
        """Counts of the calibrated z of every dimension in the fixed bins: (d, HISTOGRAM_BINS)."""
        d = self.problem.feature_dim
        counts = torch.zeros(d * HISTOGRAM_BINS, dtype=self.stat_dtype, device=self.cut_points.device)
        offsets = HISTOGRAM_BINS * torch.arange(d, device=counts.device)
        for part in cohort.batches():
            z = self.standardize(part.features)
            bins = ((z + HISTOGRAM_RANGE) * (HISTOGRAM_BINS / (2 * HISTOGRAM_RANGE))).floor()
            bins = bins.clamp(0, HISTOGRAM_BINS - 1).long() + offsets  # the end bins catch the tails
            counts += counts_of(bins, d * HISTOGRAM_BINS, counts.dtype)
        return {"histogram": counts.view(d, HISTOGRAM_BINS)}


def histogram_quantiles(counts: Tensor, quantiles: Tensor) -> Tensor:
    """The quantiles of every row's distribution from its histogram on the fixed bins of [−8, 8],
    linear within a bin: (d, B), (T,) -> (d, T)."""
    cumulative = counts.cumsum(1)
    target = quantiles.to(counts)[None] * cumulative[:, -1:]  # (d, T)
    bins = torch.searchsorted(cumulative, target).clamp(max=counts.shape[1] - 1)  # first bin reaching it
    below = torch.where(bins > 0, cumulative.gather(1, (bins - 1).clamp(min=0)), torch.zeros_like(target))
    inside = counts.gather(1, bins)
    fraction = torch.where(inside > 0, (target - below) / inside, torch.zeros_like(target)).clamp(0, 1)
    width = 2 * HISTOGRAM_RANGE / counts.shape[1]
    return -HISTOGRAM_RANGE + (bins + fraction) * width


@dataclass(frozen=True)
class WithPackedGram:
    """Solver "cg"'s encoding of ΦᵀY: its dense bytes plus those of the packed (E·V)² Gram it
    travels with in the protocol (the simulation never forms that Gram)."""

    side: int
    dtype: torch.dtype

    def wire_bytes(self, value: Tensor) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return value.numel() * value.element_size() + packed_symmetric_numel(self.side) * element


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
        thresholds: `fixed` (per-sample standardization, one round), `calibrated` (per-dimension
            standardization from an extra statistics round: two rounds) or `quantile` (each
            dimension's τ at its pooled empirical quantiles, from a histogram round: three rounds).
        experts: E, the number of embedding tables.
        group_size: G, the digits per table; each table has V = k^G rows (k = 2, or L for `integer`).
        raw_features: solve on `[x, Φ(x)]` (the raw features beside the embeddings) in one ridge.
        gamma: γ, the regularization each client adds locally (RI); removed by the server.
        gamma_out: γ_out, the ridge regularization of the final solve. ΦᵀΦ is always singular (the
            V one-hot columns of each table sum to the same all-ones column), so keep it > 0.
        seed: seed of the digit permutation (shared by every client, 8 bytes).
        dtype: dtype of the statistics and the solve (and so of what is sent).
        solver: `dense` (Cholesky of the aggregated Gram; any engine; E·V ≤ 65,536) or `cg`
            (the same solution by conjugate gradients on the sparse design, never forming the
            Gram: E·V in the hundreds of thousands; in-process engine only, no raw_features).
        cg_tolerance: the relative residual the `cg` solver stops at.
        gamma_grid: candidate γ_out values (> 0) chosen from on the clients' hold-outs (one extra
            round); None (or one value) keeps `gamma_out` (or that value).
        holdout_fraction: the share of each client's rows (per class) held out to choose γ_out.
    """

    uploads: Mapping[str, Upload] = MappingProxyType({"gram": GRAM, "cross": SUMMED,  # the solve round
               "feature_sum": SUMMED, "feature_square_sum": SUMMED, "count": SUMMED,  # the calibration round
               "histogram": SUMMED, **SELECTION_UPLOADS})  # the quantile round; choosing γ_out

    # buffers from `setup_problem` (and SparseEmbedding's); `raw_weight` with raw_features only
    embedding: Tensor  # W's E tables (E·V, C)
    selected_gamma_out: Tensor  # ()
    raw_weight: Tensor  # (d, C)

    def __init__(self, bucketing: Literal["binary_overlap", "onehot", "integer"] = "binary_overlap",
                 levels: int = 8, thresholds: Literal["fixed", "calibrated", "quantile"] = "fixed",
                 experts: int = 64, group_size: int = 6, raw_features: bool = False, gamma: float = 1.0,
                 gamma_out: float = 1.0, seed: int = 0, dtype: str = "float64",
                 solver: Literal["dense", "cg"] = "dense", cg_tolerance: float = 1e-10,
                 gamma_grid: Sequence[float] | None = None, holdout_fraction: float = 0.1) -> None:
        super().__init__()
        if solver not in SOLVERS:
            raise ValueError(f"unknown solver {solver!r}; choose one of {SOLVERS}")
        if solver == "cg" and raw_features:
            raise ValueError("solver 'cg' solves on Φ alone: set raw_features false or solver 'dense'")
        if not 0 < cg_tolerance < 1:
            raise ValueError(f"cg_tolerance must be in (0, 1), got {cg_tolerance}")
        if not 0 < holdout_fraction < 1:
            raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
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
        stat_dtype = statistics_dtype(dtype)
        self.digits_per_dim = 1 if bucketing == "integer" else levels
        self.base = levels if bucketing == "integer" else 2  # k
        self.vocab = self.base ** group_size  # V
        self.embedding_rows = experts * self.vocab  # E·V
        if solver == "dense" and self.embedding_rows > MAX_EMBEDDING_ROWS:
            raise ValueError(
                f"E·V = {experts}·{self.base}^{group_size} = {self.embedding_rows} embedding rows exceeds "
                f"{MAX_EMBEDDING_ROWS} (the Gram would take "
                f"{self.embedding_rows ** 2 * 8 / 2 ** 30:.0f} GiB in float64); lower experts or group_size, "
                f"or set solver 'cg'")
        self.save_hyperparameters()
        self.bucketing, self.levels, self.threshold_mode = bucketing, levels, thresholds
        self.experts, self.group_size, self.raw_features = experts, group_size, raw_features
        self.gamma_grid = checked_grid(gamma_grid)
        if len(self.gamma_grid) == 1:  # one value: that γ_out, no hold-out round
            gamma_out = self.gamma_grid[0]
        if solver == "cg" and not gamma_out > 0 and len(self.gamma_grid) < 2:
            raise ValueError("solver 'cg' needs gamma_out > 0 (ΦᵀΦ is singular)")
        self.gamma, self.gamma_out, self.seed = gamma, gamma_out, seed
        self.solver, self.cg_tolerance, self.holdout_fraction = solver, cg_tolerance, holdout_fraction
        self.stat_dtype = stat_dtype
        self.row_ledger: list[tuple[Tensor, Tensor]] = []  # solver "cg": the in-process clients' active rows
        if solver == "cg":  # the protocol sends the packed Gram beside ΦᵀY (and the hold-out's beside its
            # ΦᵀY); the simulation keeps the rows in process instead and checks their count
            with_gram = Upload(encoding=WithPackedGram(self.embedding_rows, stat_dtype))
            self.uploads = {**type(self).uploads, "cross": with_gram, "holdout_cross": with_gram,
                            "ledger_rows": Upload(encoding=WireSize(0))}
        self._pending: dict | None = None  # between the solve and the select round
        self.holdout_accuracy: Tensor | None = None

    def check_data(self, data: Population) -> None:
        check_holdout_rows(self, data)
        check_regularizer_in_ring(self, data)

    @property
    def num_rounds(self) -> int:
        return len(self.round_kinds)

    @property
    def has_model(self) -> bool:
        return self.round == self.num_rounds  # the calibration and candidate rounds give no model yet

    def setup_problem(self, problem: Problem) -> None:
        feature_dim, num_classes = problem.feature_dim, problem.num_classes
        self.register_embedding(feature_dim, persistent=True)
        self.register_buffer("embedding",
                             torch.zeros(self.embedding_rows, num_classes, dtype=self.stat_dtype))
        self.register_buffer("selected_gamma_out", torch.tensor(float(self.gamma_out), dtype=self.stat_dtype))
        if self.raw_features:
            self.register_buffer("raw_weight", torch.zeros(feature_dim, num_classes, dtype=self.stat_dtype))

    def client_half(self) -> SAFLeClient:
        if self.problem is None:
            raise RuntimeError("SAFLe builds its clients once set up for a problem (`setup`)")
        return SAFLeClient(self.problem, self)

    # ---- rounds ------------------------------------------------------------------------------
    def broadcast(self) -> dict[str, Tensor]:
        """The server's calibration (2d numbers, and the d × T quantile τ), once it has one; the
        select round adds the γ candidates (Γ, E·V, C)."""
        kind = self.round_kinds[self.round]
        message = self.calibration() if kind != "histogram" else {
            "feature_mean": self.feature_mean, "feature_std": self.feature_std}
        if kind == "moments":
            return {}
        if kind == "select":
            if self._pending is None:  # (a buffer would double the memory of the largest statistic)
                raise RuntimeError("SAFLe's fit was resumed between its solve and select rounds: the solve round's "
                                   "statistics ((E·V)² numbers) are not kept in checkpoints, so its γ candidates "
                                   "are gone: fit afresh, or give one gamma_out (no select round)")
            message["candidates"] = self._pending["candidates"]
        return message

    def server_update(self, uploads: Uploads, num_clients: float) -> Metrics:
        kind = self.round_kinds[self.round]
        if kind == "moments":
            count = uploads["count"]
            self.feature_mean = uploads["feature_sum"] / count
            self.feature_std = standard_deviation(self.feature_mean, uploads["feature_square_sum"] / count)
            return {}
        if kind == "histogram":
            regions = self.cut_points.shape[0] + 1
            quantiles = torch.arange(1, regions, dtype=torch.float64) / regions
            self.feature_cuts = histogram_quantiles(uploads["histogram"].double(), quantiles).to(self.stat_dtype)
            return {}
        if kind == "select":
            chosen, metrics = choose_gamma(self.gamma_grid, uploads, "safle")
            self.holdout_accuracy = uploads["holdout_correct"] / uploads["holdout_count"]
            self.selected_gamma_out.fill_(chosen)
            pending, self._pending = self._pending, None
            assert pending is not None  # (set by the solve round)
            index = self.gamma_grid.index(chosen)
            return {**metrics, **self._solve(pending, chosen, pending["candidates"][index])}
        pending = self._gather_solve_round(uploads, num_clients)
        if len(self.gamma_grid) > 1:  # one candidate per γ on the rows the clients did not hold out
            pending["candidates"], metrics = self._candidates(pending)
            self._pending = pending
            return metrics
        return self._solve(pending, self.gamma_out)

    def _gather_solve_round(self, uploads: dict[str, Tensor], num_clients: float) -> dict:
        """The round's statistics: the pooled Gram without any γ (dense) or the pooled rows (cg)."""
        pending = {"cross": uploads["cross"], "holdout_cross": uploads.get("holdout_cross")}
        if self.solver == "dense":
            gram = uploads["gram"]  # the round's sum, used once: shifted in place, no second (E·V)² matrix
            gram.diagonal().sub_(num_clients * self.gamma)
            return {**pending, "gram": gram, "holdout_gram": uploads.get("holdout_gram")}
        ledger, self.row_ledger[:] = list(self.row_ledger), []
        rows = sum(len(active) for active, _ in ledger)
        if rows != round(float(uploads["ledger_rows"])):
            raise ValueError(
                f"SAFLe's solver 'cg' sees {rows} of the round's {round(float(uploads['ledger_rows']))} training rows: "
                "it needs every client in this process (the in-process engine, one process); set solver 'dense' "
                "for Flower or several processes")
        active = torch.cat([part for part, _ in ledger]) if ledger else torch.zeros(0, self.experts, dtype=torch.int32)
        held = torch.cat([part for _, part in ledger]) if ledger else torch.zeros(0, dtype=torch.bool)
        return {**pending, "active": active, "held": held}

    def _candidates(self, pending: dict) -> tuple[Tensor, dict[str, float]]:
        """W_γ on the rows not held out, for every γ of the grid: (Γ, side, C)."""
        grid = torch.tensor(self.gamma_grid, dtype=self.stat_dtype)
        cross = pending["cross"] - pending["holdout_cross"]
        if self.solver == "dense":
            kept = pending["gram"] - pending["holdout_gram"]
            pending["holdout_gram"] = None
            candidates = []
            for value in self.gamma_grid:
                kept.diagonal().add_(value)
                candidates.append(solve_spd(kept, cross, what="SAFLe's Gram matrix without the hold-out rows"))
                kept.diagonal().sub_(value)
            return torch.stack(candidates), {}
        design = MultiHotDesign(pending["active"][~pending["held"]], self.embedding_rows, dtype=self.stat_dtype)
        classes = cross.shape[1]
        solution, iterations = multi_hot_ridge(design, cross.repeat(1, len(grid)), grid.repeat_interleave(classes),
                                               tolerance=self.cg_tolerance)
        stacked = solution.view(-1, len(grid), classes).transpose(0, 1).contiguous()
        return stacked, {"safle/cg_iterations_holdout": iterations}

    def _solve(self, pending: dict, gamma_out: float, initial: Tensor | None = None) -> dict[str, float]:
        """W on all the rows with γ_out."""
        metrics: dict[str, float] = {}
        if self.solver == "dense":
            gram = pending["gram"]
            gram.diagonal().add_(gamma_out)
            weight = solve_spd(gram, pending["cross"], what="SAFLe's aggregated Gram matrix")
        else:
            design = MultiHotDesign(pending["active"], self.embedding_rows, dtype=self.stat_dtype)
            shifts = torch.full((pending["cross"].shape[1],), gamma_out, dtype=self.stat_dtype)
            weight, iterations = multi_hot_ridge(design, pending["cross"], shifts, tolerance=self.cg_tolerance,
                                                 initial=initial)
            metrics["safle/cg_iterations"] = iterations
        raw_dim = self.feature_dim if self.raw_features else 0
        self.embedding = weight[raw_dim:]
        if self.raw_features:
            self.raw_weight = weight[:raw_dim]
        return metrics

    def final_broadcast(self) -> dict[str, Tensor]:
        """W: the embedding tables (and the raw features' weight)."""
        message = {"embedding": self.embedding}
        if self.raw_features:
            message["raw_weight"] = self.raw_weight
        return message

    def forward(self, features: Tensor) -> Tensor:
        """Logits: (n, d) -> (n, C), the sum of the E selected embedding rows (+ x·W_raw)."""
        rows = max(1, GATHER_ELEMENTS // (self.experts * self.num_classes))  # bounds the (rows, E, C) gather
        logits = torch.cat([self.embedding[self.expert_indices(chunk)].sum(1) for chunk in features.split(rows)]) \
            if len(features) else self.embedding.new_zeros(0, self.num_classes)
        if self.raw_features:
            logits = logits + features.to(self.stat_dtype) @ self.raw_weight
        return logits
