"""Local-only: every client fits a ridge head on its own features, and nothing is sent.

The personalized baseline without any federation. Client k, with features X_k (n_k × d) and
one-hot labels Y_k, solves alone

    W_k = (X_kᵀX_k + γI)⁻¹ X_kᵀY_k  =  X_kᵀ(X_kX_kᵀ + γI)⁻¹ Y_k,

the second (dual) form for clients with n_k < d, where it is an n_k × n_k solve instead of a
d × d one (`workbench.linalg.grouped_ridge`, vectorized over the clients of a cohort). Client k
predicts with its own head, X W_k (`LocalOnlyClient.predict`).

The heads are client state (`LocalOnlyClient.heads`, one per served client); the server holds
no model at all (`global_model = False`): there is no global test accuracy (`test/acc`) any
more. (The method once reported the mean of the client heads' logits on the global test split,
an ensemble that only a party holding every head could form; with the heads on the clients that
party does not exist, so the number is gone.)

Zero bytes and zero communication rounds: `num_rounds` is 0, so a fit is only the final step,
in which the clients fit their heads (`finish`, after the empty final broadcast).
"""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as nnf
from torch import Tensor

from workbench.linalg import grouped_matmul, grouped_ridge, statistics_dtype
from workbench.methods.base import ClientHalf, Cohort, FederatedMethod, Metrics, Problem


class LocalOnlyClient(ClientHalf):
    """The clients' own ridge heads. State: `heads` (num_served, d, C), W_k of each served client
    (zero until it has fitted)."""

    heads: Tensor  # (num_served, d, C)

    def __init__(self, problem: Problem, method: LocalOnly) -> None:
        super().__init__(problem)
        self.gamma, self.stat_dtype = method.gamma, method.stat_dtype

    def setup_state(self) -> None:
        self.register_buffer("heads", torch.zeros(self.num_served, self.problem.feature_dim, self.num_classes,
                                                  dtype=self.stat_dtype, device=self.served.device))

    @torch.no_grad()
    def finish(self, broadcast: Mapping[str, Tensor], cohort: Cohort) -> Metrics:
        """Every client of the cohort solves its W_k on its own rows."""
        x = cohort.features.flatten(1).to(self.stat_dtype)
        targets = nnf.one_hot(cohort.labels, self.num_classes).to(self.stat_dtype)
        position = torch.searchsorted(cohort.clients, cohort.client_ids)  # within the cohort
        heads = grouped_ridge(x, targets, position, len(cohort.clients), self.gamma)
        self.heads[self.client_slots(cohort.clients)] = heads.to(self.heads)
        return {}

    def predict(self, features: Tensor, client_ids: Tensor) -> Tensor:
        """Each sample under its own client's head, x W_k: (n, d), (n,) -> (n, C); a client this
        half does not serve (no training data) predicts zeros."""
        x = features.flatten(1).to(self.stat_dtype)
        slots, known = self.served_slots(client_ids)
        return grouped_matmul(x, self.heads, slots) * known[:, None]


class LocalOnly(FederatedMethod):
    """Each client's own ridge head on its own backbone features; no communication, no global model.

    Args:
        gamma: γ > 0, each client's ridge regularization.
        dtype: dtype of the solves and the heads (`float64` or `float32`).

    The server half holds nothing; the heads are the clients' (`LocalOnlyClient.heads`).
    """

    personalized = True
    global_model = False
    uploads = MappingProxyType({})

    def __init__(self, gamma: float = 1.0, dtype: str = "float64") -> None:
        super().__init__()
        if not gamma > 0:
            raise ValueError(f"gamma must be > 0 (each client's ridge must be solvable on few samples), got {gamma}")
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
        self.save_hyperparameters()
        self.gamma = gamma
        self.stat_dtype = statistics_dtype(dtype)

    @property
    def num_rounds(self) -> int:
        return 0  # no communication: the clients only fit their heads, in `finish`

    def client_half(self) -> LocalOnlyClient:
        if self.problem is None:
            raise RuntimeError("LocalOnly builds its clients once set up for a problem (`setup`)")
        return LocalOnlyClient(self.problem, self)

    def forward(self, features: Tensor) -> Tensor:
        raise NotImplementedError("LocalOnly has no global model: each client predicts with its own head "
                                  "(LocalOnlyClient.predict)")
