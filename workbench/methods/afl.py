"""AFL: analytic federated learning, a closed-form ridge head in one round.

Client k uploads `G_k + γI` and `H_k` with `G_k = X_kᵀX_k`, `H_k = X_kᵀY_k`; adding γI locally
(the regularization intermediary) makes every local problem solvable on its own. The server
removes the K·γ it received and solves

    W = (Σ_k (G_k + γI) − Kγ I + γ_out I)⁻¹ Σ_k H_k,

which is ridge regression with `γ_out` on the pooled data, whatever the partition.
"""
from __future__ import annotations

import torch
from torch import Tensor

from workbench.linalg import class_sums, identity_like, solve_spd
from workbench.methods.base import ClientBatch, FederatedMethod


class AFL(FederatedMethod):
    """Analytic federated learning (linear closed-form head, one round).

    Args:
        gamma: γ, the regularization each client adds locally (RI); removed by the server.
        gamma_out: γ_out, the ridge regularization of the final solve (0 = least squares).
        bias: append a constant-1 feature.
        dtype: dtype of the statistics and the solve (and so of what is sent).
    """

    symmetric_uploads = frozenset({"gram"})

    def __init__(self, gamma: float = 1.0, gamma_out: float = 0.0, bias: bool = False,
                 dtype: str = "float64") -> None:
        super().__init__()
        if gamma < 0 or gamma_out < 0:
            raise ValueError(f"gamma and gamma_out must be ≥ 0, got {gamma} and {gamma_out}")
        self.save_hyperparameters()
        self.gamma, self.gamma_out, self.bias = gamma, gamma_out, bias
        self.stat_dtype = getattr(torch, dtype)

    def setup_problem(self, feature_dim: int, num_classes: int, num_clients: int) -> None:
        side = feature_dim + int(self.bias)
        self.register_buffer("weight", torch.zeros(side, num_classes, dtype=self.stat_dtype))

    def design(self, features: Tensor) -> Tensor:
        """(n, d) -> (n, d [+1]) in the statistics dtype."""
        x = features.to(self.stat_dtype)
        if self.bias:
            x = torch.cat([x, x.new_ones(len(x), 1)], dim=1)
        return x

    def client_step(self, batch: ClientBatch) -> dict[str, Tensor]:
        x = self.design(batch.features)
        gram = x.T @ x
        gram.diagonal().add_(self.gamma * batch.new_clients)  # each client adds γI once
        return {"gram": gram, "cross": class_sums(x, batch.labels, self.num_classes)}

    def server_step(self, uploads: dict[str, Tensor], num_clients: int) -> dict[str, Tensor]:
        gram = uploads["gram"] + (self.gamma_out - num_clients * self.gamma) * identity_like(uploads["gram"])
        self.weight = solve_spd(gram, uploads["cross"], what="AFL's aggregated Gram matrix")
        return {"weight": self.weight}

    def forward(self, features: Tensor) -> Tensor:
        """Logits: (n, d) -> (n, C)."""
        return self.design(features) @ self.weight
