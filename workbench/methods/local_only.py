"""Local-only: every client fits a ridge head on its own features, and nothing is sent.

The personalized baseline without any federation. Client k, with features X_k (n_k × d) and
one-hot labels Y_k, solves alone

    W_k = (X_kᵀX_k + γI)⁻¹ X_kᵀY_k  =  X_kᵀ(X_kX_kᵀ + γI)⁻¹ Y_k,

the second (dual) form for clients with n_k < d, where it is an n_k × n_k solve instead of a
d × d one (`workbench.linalg.grouped_ridge`, vectorized over clients). Client k predicts with
its own head, X W_k. There is no global model: `forward` (the global test split, `test/acc`)
gives the mean of the client heads' logits, X · mean_k W_k, an ensemble of the local models that
no party holds — a reference number for how local models do on the whole distribution.
Zero bytes, zero communication rounds (the one Lightning epoch is the clients' local pass).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as nnf
from torch import Tensor

from workbench.linalg import grouped_matmul, grouped_ridge
from workbench.methods.base import ClientBatch, FederatedMethod


def solve_on_clients(method: FederatedMethod,
                     solve: Callable[[Tensor, Tensor, Tensor], dict[str, float]]) -> None:
    """Run `solve(features, labels, client_ids)` on the clients' own training data, after a round.

    For local solves that need each client's whole share, which the round's batches (that mix
    clients and may cut one in two) do not give. The time counts as client time (and is logged
    alone as `time/local_s`); the numbers `solve` returns join the round's logged metrics.
    """
    data = method.trainer.datamodule
    start = time.perf_counter()
    metrics = solve(data.train_features.to(method.device), data.train_labels.to(method.device),
                    data.train_client_ids.to(method.device))
    seconds = time.perf_counter() - start
    method._totals["client_s"] += seconds
    method.fit_metrics["time/client_s"] += seconds
    if "time/fit_s" in method.fit_metrics:
        method.fit_metrics["time/fit_s"] += seconds
    method.fit_metrics.update({"time/local_s": seconds, **metrics})


class LocalOnly(FederatedMethod):
    """Each client's own ridge head on its own backbone features; no communication.

    Args:
        gamma: γ > 0, each client's ridge regularization.
        dtype: dtype of the solves and the heads (`float64` or `float32`).

    Buffers: `heads` (K, d, C), client k's W_k; `mean_head` (d, C), the mean over the clients
    that have training data (what `forward` uses). A client without training data has W_k = 0.
    """

    def __init__(self, gamma: float = 1.0, dtype: str = "float64") -> None:
        super().__init__()
        if not gamma > 0:
            raise ValueError(f"gamma must be > 0 (each client's ridge must be solvable on few samples), got {gamma}")
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
        self.save_hyperparameters()
        self.gamma = gamma
        self.stat_dtype = getattr(torch, dtype)

    def setup_problem(self, feature_dim: int, num_classes: int, num_clients: int) -> None:
        self.register_buffer("heads", torch.zeros(num_clients, feature_dim, num_classes, dtype=self.stat_dtype))
        self.register_buffer("mean_head", torch.zeros(feature_dim, num_classes, dtype=self.stat_dtype))

    def client_step(self, batch: ClientBatch) -> dict[str, Tensor]:
        return {}  # nothing is sent; each client solves on its whole share after the pass

    def server_step(self, uploads: dict[str, Tensor], num_clients: int) -> dict[str, Tensor]:
        return {}

    def after_broadcast(self) -> None:
        super().after_broadcast()
        solve_on_clients(self, self.fit_heads)
        self.fit_metrics["comm/rounds"] = 0.0  # the pass over the data was local work only

    @torch.no_grad()
    def fit_heads(self, features: Tensor, labels: Tensor, client_ids: Tensor) -> dict[str, float]:
        """Solve every client's W_k on its rows: (n, d), (n,), (n,) -> metrics to log (none)."""
        x = features.to(self.stat_dtype)
        targets = nnf.one_hot(labels, self.num_classes).to(self.stat_dtype)
        self.heads = grouped_ridge(x, targets, client_ids, self.num_clients, self.gamma)
        trained = torch.bincount(client_ids, minlength=self.num_clients) > 0
        self.mean_head = self.heads[trained].mean(0)
        return {}

    def forward(self, features: Tensor) -> Tensor:
        """Mean of the client heads' logits, X · mean_k W_k: (n, d) -> (n, C)."""
        return features.to(self.stat_dtype) @ self.mean_head

    def predict_clients(self, features: Tensor, client_ids: Tensor) -> Tensor:
        """Each sample under its own client's head, x W_k: (n, d), (n,) -> (n, C)."""
        return grouped_matmul(features.to(self.stat_dtype), self.heads, client_ids)
