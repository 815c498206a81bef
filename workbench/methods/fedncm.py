"""FedNCM: the nearest-class-mean head of the federated class means (Legate et al., NeurIPS 2023),
a cosine classifier in one round.

Client k sends, for every class c, the sum and the number of its rows of that class,

    s_kc = Σ_{i ∈ k, y_i = c} x_i      `class_sums` (C, d)
    n_kc = |{i ∈ k : y_i = c}|         `class_counts` (C,), int64

both summed over the clients (secure aggregation may hide each client's). The server forms

    μ_c = Σ_k s_kc / Σ_k n_kc,    w_c = μ_c / ‖μ_c‖      (C, d)

and the head is the cosine classifier

    z_c(x) = τ · ⟨x / ‖x‖, w_c⟩         τ = `temperature` (1: the paper's cosine)

Sums do not depend on how the rows are split over the clients, nor on their order, so μ_c and z
are those of the pooled data for any partition (tested to 1e-8 in float64). τ never changes the
prediction, only the scale of the logits (their FedNCM+FT starts a linear head from τ·w_c).

A class no client holds (Σ_k n_kc = 0) has no mean: its rows of `class_means` and `prototypes` are
zero, `class_present` is False, its logit is −∞, so it is never predicted, and the fit warns
naming it (as GH-OFL's heads treat absent classes). A zero feature row has no direction: it scores
0 for every class present.

Messages: the round's broadcast is empty; after it every client receives `prototypes` w (C, d)
and `class_present` (C,) bool, C·d·8 + C bytes in float64. The clients keep no state.

Privacy (`federation.dp_sigma`): one sample adds x (norm ≤ `feature_clip` B) to one class sum and
1 to one count, so Δ = √(B² + 1) (`statistics_sensitivity`; none stated for unclipped rows). With
noised counts w_c still is the direction of the noised sum (a count > 0 only scales it); a class
counts as present when its noised count is > 0.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor

from workbench.linalg import class_sums, counts_of, statistics_dtype
from workbench.methods.base import SUMMED, ClientHalf, Cohort, FederatedMethod, Metrics, Problem, Uploads


class FedNCMClient(ClientHalf):
    """The clients: per-class sums (C, d) and counts (C,) of their features. No state."""

    def __init__(self, problem: Problem, method: FedNCM) -> None:
        super().__init__(problem)
        self.stat_dtype = method.stat_dtype

    def client_update(self, round_index: int, broadcast: Mapping[str, Tensor],
                      cohort: Cohort) -> tuple[Uploads, Metrics]:
        sums = torch.zeros(self.num_classes, self.problem.feature_dim, dtype=self.stat_dtype,
                           device=cohort.features.device)
        for part in cohort.batches():
            sums += class_sums(part.features.flatten(1).to(self.stat_dtype), part.labels, self.num_classes).T
        return {"class_sums": sums, "class_counts": counts_of(cohort.labels, self.num_classes)}, {}


class FedNCM(FederatedMethod):
    """Nearest class mean: a cosine classifier on the federated class means, one round.

    Args:
        temperature: τ > 0, the scale of the cosine logits (1: the plain cosine).
        dtype: dtype of the sums, of what is sent and of the head.

    Buffers: `class_means` μ (C, d), `class_counts` Σ_k n_kc (C,) int64, `prototypes` w = μ_c/‖μ_c‖
    (C, d), `class_present` (C,) bool; an absent class has zero rows and logit −∞.
    """

    uploads = MappingProxyType({"class_sums": SUMMED, "class_counts": SUMMED})

    def __init__(self, temperature: float = 1.0, dtype: str = "float64") -> None:
        super().__init__()
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be a finite number > 0 (τ of τ·cos), got {temperature}")
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
        self.save_hyperparameters()
        self.temperature = float(temperature)
        self.stat_dtype = statistics_dtype(dtype)

    def setup_problem(self, problem: Problem) -> None:
        num_classes, dim = problem.num_classes, problem.feature_dim
        self.register_buffer("class_means", torch.zeros(num_classes, dim, dtype=self.stat_dtype))
        self.register_buffer("class_counts", torch.zeros(num_classes, dtype=torch.long))
        self.register_buffer("prototypes", torch.zeros(num_classes, dim, dtype=self.stat_dtype))
        self.register_buffer("class_present", torch.zeros(num_classes, dtype=torch.bool))

    def client_half(self) -> FedNCMClient:
        if self.problem is None:
            raise RuntimeError("FedNCM builds its clients once set up for a problem (`setup`)")
        return FedNCMClient(self.problem, self)

    def statistics_sensitivity(self, feature_norm: float) -> float | None:
        """One sample adds x (‖x‖ ≤ B) to one class sum and 1 to one count: √(B² + 1); None for
        unclipped rows (B = 0)."""
        return None if feature_norm == 0 else math.sqrt(feature_norm ** 2 + 1)

    def server_update(self, uploads: Uploads, num_clients: float) -> Metrics:
        sums, counts = uploads["class_sums"].to(self.stat_dtype), uploads["class_counts"].to(torch.long)
        present = counts > 0
        means = torch.where(present[:, None], sums / counts.clamp_min(1)[:, None].to(sums), 0.0)
        self.class_means, self.class_counts, self.class_present = means, counts, present
        self.prototypes = F.normalize(means, dim=1)  # a zero row (an absent class) stays zero
        absent = (~present).nonzero().squeeze(1).tolist()
        if absent:
            warnings.warn(f"classes {absent} have no sample on any client: FedNCM gives them logit -inf "
                          "(never predicted)", stacklevel=2)
        return {}

    def final_broadcast(self) -> dict[str, Tensor]:
        """The head every client predicts with: w (C, d) and which classes it scores."""
        return {"prototypes": self.prototypes, "class_present": self.class_present}

    def forward(self, features: Tensor) -> Tensor:
        """Logits τ·⟨x/‖x‖, w_c⟩, −∞ for an absent class: (n, d) -> (n, C)."""
        directions = F.normalize(features.flatten(1).to(self.stat_dtype), dim=1)
        logits = self.temperature * (directions @ self.prototypes.T)
        return logits.masked_fill(~self.class_present, float("-inf"))
