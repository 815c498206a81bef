"""AFL: analytic federated learning, a closed-form ridge head in one round.

Client k uploads `G_k + γI` and `H_k` with `G_k = X_kᵀX_k`, `H_k = X_kᵀY_k`; adding γI locally
(the regularization intermediary) makes every local problem solvable on its own. The server
removes the K·γ it received and solves

    W = (Σ_k (G_k + γI) − Kγ I + γ_out I)⁻¹ Σ_k H_k,

which is ridge regression with `γ_out` on the pooled data, whatever the partition.

The fitted model keeps the pooled statistics G = Σ_k G_k and H = Σ_k H_k (buffers `pooled_gram`,
`pooled_cross`, with the number of clients in `pooled_clients`), so clients can join a finished
model or leave it exactly, without a new round:

    afl.add_clients(uploads, num_clients)      G += Σ_j (G_j + γI) − mγI,  H += Σ_j H_j, re-solve
    afl.remove_clients(uploads, num_clients)   G −= ...,                  H −= ...,       re-solve

`uploads` is what those m clients upload (`AFLClient.client_update` on their data, summed over
them: its "gram" includes each client's γI once, as in the round). Both equal a refit from scratch on the
resulting set of clients. A server can only remove a client whose statistics it is given (e.g.
kept by the client): the round's sum does not reveal them.

With `gamma_grid` (more than one value), γ_out is chosen on the clients' own hold-outs
(`workbench.methods.ridge_selection`): round 0 also uploads the hold-out rows' `G_h`, `H_h`; the
server fits one candidate `(G − G_h + γ I)⁻¹ (H − H_h)` per γ and broadcasts them; in round 1 the
clients upload how many hold-out rows each gets right; the server keeps the best γ as γ_out
(buffer `selected_gamma_out`) and solves on all the rows. Two rounds.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from workbench.federation.privacy import ridge_sensitivity, safe_ridge
from workbench.federation.secure_aggregation import check_in_ring
from workbench.linalg import class_sums, identity_like, solve_spd, statistics_dtype
from workbench.methods.base import GRAM, SUMMED, ClientHalf, Cohort, FederatedMethod, Metrics, Problem, Uploads
from workbench.methods.ridge_selection import (
    SELECTION_UPLOADS,
    check_holdout_rows,
    checked_grid,
    choose_gamma,
    client_holdout,
    holdout_correct,
)

if TYPE_CHECKING:
    from workbench.data.population import Population


def check_regularizer_in_ring(method, data: Population) -> None:
    """Under secure aggregation every client's Gram carries its γ on the diagonal: a γ whose sum over
    the K clients would wrap around the ring is refused before the fit, not in round 0."""
    federation = method.federation
    if federation.secure_aggregation and method.gamma > 0:
        check_in_ring(method.gamma, federation.fixed_point_bits, len(data.clients))


class AFLClient(ClientHalf):
    """Client k: `G_k + γI` and `H_k` of its features (AnaPFL's main branch: of its random features)."""

    def __init__(self, problem: Problem, method: AFL) -> None:
        super().__init__(problem)
        self.gamma, self.design = method.gamma, method.design  # design: a fixed map of the settings
        self.gamma_grid = getattr(method, "gamma_grid", [])
        self.holdout_fraction, self.holdout_seed = getattr(method, "holdout_fraction", 0.1), getattr(method, "seed", 0)

    def client_update(self, round_index: int, broadcast: Mapping[str, Tensor],
                      cohort: Cohort) -> tuple[Uploads, Metrics]:
        if "candidates" in broadcast:  # γ's scoring round: each candidate's hits on the hold-out rows
            held = self._holdout(cohort)
            x = self.design(cohort.features[held])
            return holdout_correct(x @ broadcast["candidates"].to(x), cohort.labels[held]), {}
        gram, cross = self._statistics(cohort.features, cohort.labels, cohort.batch_size)
        gram.diagonal().add_(self.gamma * len(cohort.clients))  # each client adds γI once
        uploads = {"gram": gram, "cross": cross}
        if len(self.gamma_grid) > 1:  # the hold-out rows' own statistics, for the candidates
            held = self._holdout(cohort)
            uploads["holdout_gram"], uploads["holdout_cross"] = self._statistics(
                cohort.features[held], cohort.labels[held], cohort.batch_size)
        return uploads, {}

    def _statistics(self, features: Tensor, labels: Tensor, batch_size: int) -> tuple[Tensor, Tensor]:
        """`XᵀX` and `XᵀY` of the design of `features`, in chunks of `batch_size` rows."""
        empty = self.design(features[:0])
        gram = empty.new_zeros(empty.shape[1], empty.shape[1])
        cross = empty.new_zeros(empty.shape[1], self.num_classes)
        for start in range(0, len(labels), batch_size):
            x = self.design(features[start:start + batch_size])
            gram += x.T @ x
            cross += class_sums(x, labels[start:start + batch_size], self.num_classes)
        return gram, cross

    def _holdout(self, cohort: Cohort) -> Tensor:
        return client_holdout(cohort.labels, cohort.client_ids, cohort.clients, self.holdout_fraction,
                              self.holdout_seed)


class AFL(FederatedMethod):
    """Analytic federated learning (linear closed-form head, one round).

    Args:
        gamma: γ, the regularization each client adds locally (RI); removed by the server.
        gamma_out: γ_out, the ridge regularization of the final solve (0 = least squares).
        bias: append a constant-1 feature.
        dtype: dtype of the statistics and the solve (and so of what is sent).
        gamma_grid: candidate γ_out values (> 0) chosen from on the clients' hold-outs (one extra
            round); None (or one value) keeps `gamma_out` (or that value) with no hold-out.
        holdout_fraction: the share of each client's rows (per class) held out to choose γ_out.
        seed: seeds the clients' hold-out draws.

    Buffers: `weight` W (d [+1], C); `pooled_gram` Σ_k G_k (d [+1], d [+1]) and `pooled_cross`
    Σ_k H_k (d [+1], C), without any γ; `pooled_clients`, the number of clients in them;
    `selected_gamma_out`, the γ_out of the solve.
    """

    uploads = MappingProxyType({"gram": GRAM, "cross": SUMMED, **SELECTION_UPLOADS})
    ridge_setting = "gamma_out"  # the setting of the final solve's ridge, named in its errors
    server_settings: tuple[str, ...] = ("gamma_out",)  # a fitted model re-solves at another γ_out from G and H

    # buffers from `setup_problem`
    weight: Tensor  # (d [+1], C)
    pooled_gram: Tensor  # (d [+1], d [+1])
    pooled_cross: Tensor  # (d [+1], C)
    pooled_clients: Tensor  # () int64
    selected_gamma_out: Tensor  # ()
    candidates: Tensor  # (Γ, d [+1], C), with a gamma_grid

    def __init__(self, gamma: float = 1.0, gamma_out: float = 0.0, bias: bool = False,
                 dtype: str = "float64", gamma_grid: Sequence[float] | None = None, holdout_fraction: float = 0.1,
                 seed: int = 0) -> None:
        super().__init__()
        if gamma < 0 or gamma_out < 0:
            raise ValueError(f"gamma and gamma_out must be ≥ 0, got {gamma} and {gamma_out}")
        if not 0 < holdout_fraction < 1:
            raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
        if type(self) is AFL:  # a subclass records its own arguments (Lightning merges, never drops, them)
            self.save_hyperparameters()
        self.gamma_grid = checked_grid(gamma_grid)
        if len(self.gamma_grid) == 1:  # one value: that γ_out, no hold-out round
            gamma_out = self.gamma_grid[0]
        self.gamma, self.gamma_out, self.bias = gamma, gamma_out, bias
        self.holdout_fraction, self.seed = holdout_fraction, seed
        self.stat_dtype = statistics_dtype(dtype)

    def setup_problem(self, problem: Problem) -> None:
        side = self.design_dim(problem)
        num_classes = problem.num_classes
        self.register_buffer("weight", torch.zeros(side, num_classes, dtype=self.stat_dtype))
        # the pooled statistics, kept so that clients can join or leave the fitted model
        self.register_buffer("pooled_gram", torch.zeros(side, side, dtype=self.stat_dtype))
        self.register_buffer("pooled_cross", torch.zeros(side, num_classes, dtype=self.stat_dtype))
        self.register_buffer("pooled_clients", torch.zeros((), dtype=torch.long))
        self.register_buffer("selected_gamma_out", torch.tensor(float(self.gamma_out), dtype=self.stat_dtype))
        if len(self.gamma_grid) > 1:  # round 0's candidate W per γ, scored in round 1 (a resumed fit keeps them)
            self.register_buffer("candidates", torch.zeros(len(self.gamma_grid), side, num_classes,
                                                           dtype=self.stat_dtype))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + "candidates" in missing_keys:  # a model saved before they were kept: read by round 1 only
            missing_keys.remove(prefix + "candidates")

    @property
    def num_rounds(self) -> int:
        return 2 if len(self.gamma_grid) > 1 else 1  # the second: the hold-out scores of γ_out

    def design_dim(self, problem: Problem) -> int:
        """Width of the design matrix: d [+1]."""
        return problem.feature_dim + int(self.bias)

    def client_half(self) -> AFLClient:
        if self.problem is None:
            raise RuntimeError(f"{type(self).__name__} builds its clients once set up for a problem (`setup`)")
        return AFLClient(self.problem, self)

    def check_data(self, data: Population) -> None:
        check_holdout_rows(self, data)
        check_regularizer_in_ring(self, data)

    def statistics_sensitivity(self, feature_norm: float) -> float | None:
        """One sample's design row [x (, 1)] has norm ≤ √(B² + bias): Δ of (XᵀX, XᵀY) as
        `privacy.ridge_sensitivity`; None for a subclass whose design maps the features further."""
        if type(self).design is not AFL.design or feature_norm == 0:  # a subclass's design; unclipped rows
            return None
        return ridge_sensitivity(math.sqrt(feature_norm ** 2 + int(self.bias)))

    def design(self, features: Tensor) -> Tensor:
        """(n, d) -> (n, d [+1]) in the statistics dtype."""
        x = features.to(self.stat_dtype)
        if self.bias:
            x = torch.cat([x, x.new_ones(len(x), 1)], dim=1)
        return x

    def broadcast(self) -> dict[str, Tensor]:
        """γ's scoring round carries one candidate W per γ of the grid: (Γ, d [+1], C)."""
        return {"candidates": self.candidates} if self.round == 1 and len(self.gamma_grid) > 1 else {}

    def server_update(self, uploads: Uploads, num_clients: float) -> Metrics:
        if self.round == 1 and len(self.gamma_grid) > 1:  # the hold-out scores: keep the best γ_out
            chosen, metrics = choose_gamma(self.gamma_grid, uploads, "afl")
            self.selected_gamma_out.fill_(chosen)
            self.weight = self.solve()
            return metrics
        self.pooled_gram = uploads["gram"] - num_clients * self.gamma * identity_like(uploads["gram"])
        self.pooled_cross = uploads["cross"].clone()
        self.pooled_clients.fill_(num_clients)
        if len(self.gamma_grid) > 1:  # one candidate per γ on the rows the clients did not hold out
            kept_gram = self.pooled_gram - uploads["holdout_gram"]
            kept_cross = self.pooled_cross - uploads["holdout_cross"]
            self.candidates = torch.stack([
                solve_spd(kept_gram + value * identity_like(kept_gram), kept_cross,
                          what="AFL's Gram matrix without the hold-out rows") for value in self.gamma_grid])
            return {}
        self.weight = self.solve()
        return {}

    def final_broadcast(self) -> dict[str, Tensor]:
        return {"weight": self.weight}

    def solve(self) -> Tensor:
        """W = (G + γ_out I)⁻¹ H from the pooled statistics: (d [+1], C)."""
        gram = self.pooled_gram + float(self.selected_gamma_out) * identity_like(self.pooled_gram)
        sigma, name = self.protocol.statistics_noise, type(self).__name__
        if sigma > 0 and int(torch.linalg.cholesky_ex(gram).info) != 0:
            raise ValueError(
                f"{name}'s aggregated Gram matrix is indefinite after the differential-privacy noise "
                f"(σ = {sigma:g} on the sum: federation.dp_sigma, and the clients' own where they noise "
                f"theirs): set model.{self.ridge_setting} ≥ "
                f"{safe_ridge(sigma, len(gram)):.4g} (σ(2√d + 8), above the noise's most negative eigenvalue), "
                "which keeps it positive definite")
        return solve_spd(gram, self.pooled_cross, what=f"{name}'s aggregated Gram matrix")

    def solve_again(self, settings: Mapping[str, float]) -> None:
        """W at another γ_out from the kept G and H (equals a fit at it)."""
        if len(self.gamma_grid) > 1:
            raise ValueError(f"{type(self).__name__}'s γ_out was chosen on the clients' hold-outs (gamma_grid): "
                             "fit without gamma_grid to resolve it at values of your own")
        value = float(settings[self.ridge_setting])
        if not value >= 0:
            raise ValueError(f"{self.ridge_setting} must be ≥ 0, got {value}")
        self.gamma_out = value
        setattr(self, self.ridge_setting, value)  # (Fed3R's ridge)
        self.selected_gamma_out.fill_(value)
        self.weight = self.solve()

    def add_clients(self, uploads: dict[str, Tensor], num_clients: int) -> None:
        """Add m = `num_clients` clients to the fitted model and re-solve (equals a refit with them).

        uploads: their uploads summed over them, as `AFLClient.client_update` returns them: "gram"
            Σ_j (G_j + γI) (d [+1], d [+1]) and "cross" Σ_j H_j (d [+1], C).
        """
        self._update_pool(uploads, num_clients, sign=1)

    def remove_clients(self, uploads: dict[str, Tensor], num_clients: int) -> None:
        """Remove m = `num_clients` clients from the fitted model and re-solve (equals a refit without them).

        uploads: the uploads they contributed, summed over them (as in `add_clients`).
        """
        self.require_fitted()
        if num_clients > int(self.pooled_clients):
            raise ValueError(f"cannot remove {num_clients} clients from a model of {int(self.pooled_clients)}")
        self._update_pool(uploads, num_clients, sign=-1)

    def _update_pool(self, uploads: dict[str, Tensor], num_clients: int, sign: int) -> None:
        self.require_fitted()
        side, classes = self.pooled_cross.shape
        if not {"gram", "cross"} <= set(uploads) or uploads["gram"].shape != (side, side) \
                or uploads["cross"].shape != (side, classes):
            raise ValueError(f"uploads must hold 'gram' ({side}, {side}) and 'cross' ({side}, {classes}) as "
                             f"the client half returns them, got { {k: tuple(v.shape) for k, v in uploads.items()} }")
        if num_clients < 1:
            raise ValueError(f"num_clients must be ≥ 1 (the clients the uploads sum over), got {num_clients}")
        gram = uploads["gram"].to(self.pooled_gram) - num_clients * self.gamma * identity_like(self.pooled_gram)
        self.pooled_gram = self.pooled_gram + sign * gram
        self.pooled_cross = self.pooled_cross + sign * uploads["cross"].to(self.pooled_cross)
        self.pooled_clients += sign * num_clients
        self.weight = self.solve()

    def forward(self, features: Tensor) -> Tensor:
        """Logits: (n, d) -> (n, C)."""
        return self.design(features) @ self.weight
