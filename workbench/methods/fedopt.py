"""FedAdagrad, FedAdam and FedYogi: FedAvg's clients, an adaptive optimizer on the server.

Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar & McMahan, "Adaptive Federated
Optimization" (ICLR 2021). The clients are FedAvg's (local SGD, the same uploads and bytes,
compressed where the protocol compresses). The server treats the negated mean update as a
pseudo-gradient, g = (1/m) Σ_k Δw_k (Δw_k = w_t − w_k here, so the paper's Δ is −g), and keeps
two moments of it (P numbers each, zero at the start, kept in checkpoints):

    m ← β₁ m + (1 − β₁) g
    FedAdagrad:  v ← v + g²
    FedYogi:     v ← v − (1 − β₂) g² sign(v − g²)
    FedAdam:     v ← β₂ v + (1 − β₂) g²
    w_{t+1} = w_t − η_s m / (√v + τ),

η_s = `server_lr`, β₁ = `beta1`, β₂ = `beta2`, τ = `tau` (the adaptivity: the smallest step
denominator). The paper's defaults: β₁ = 0.9, β₂ = 0.99, τ = 1e-3, no bias correction; η_s and the
clients' η_l are tuned on a grid of powers of √10 (their CIFAR-100 best: η_l = 0.1, η_s = 0.01).
Where |g| ≫ τ each coordinate steps by about η_s whatever the update's scale: η_s is a step
length here, not a multiple of the update as in FedAvg and FedAvgM.
"""
from __future__ import annotations

import torch
from torch import Tensor

from workbench.methods.base import Metrics, Problem, Uploads
from workbench.methods.fedavg import FedAvg


class ServerOptimizer(FedAvg):
    """FedAvg whose server steps with an adaptive optimizer along the mean update; a subclass
    says how the second moment v moves (`second_moment`).

    Args:
        server_lr: η_s (default 0.01, the paper's CIFAR-100 choice).
        beta1: β₁ in [0, 1), the first moment's decay.
        beta2: β₂ in [0, 1), the second moment's (FedAdam, FedYogi; FedAdagrad sums).
        tau: τ > 0, added to √v.
        **kwargs: FedAvg's arguments (`local`, `num_rounds`, ...).
    """

    first_moment: Tensor   # m, buffers from `setup_problem`
    second_moment: Tensor  # v

    def __init__(self, server_lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3,
                 **kwargs) -> None:
        super().__init__(server_lr=server_lr, **kwargs)
        for name, beta in (("beta1", beta1), ("beta2", beta2)):
            if not 0 <= beta < 1:
                raise ValueError(f"{name} must be in [0, 1), got {beta}")
        if not tau > 0:
            raise ValueError(f"tau must be > 0 (it keeps the step finite where v = 0), got {tau}")
        self.beta1, self.beta2, self.tau = beta1, beta2, tau

    def setup_problem(self, problem: Problem) -> None:
        super().setup_problem(problem)
        weights = self.flat_parameters()
        self.register_buffer("first_moment", torch.zeros_like(weights))
        self.register_buffer("second_moment", torch.zeros_like(weights))

    def next_second_moment(self, v: Tensor, g2: Tensor) -> Tensor:
        """v_{t+1} from v_t and the squared pseudo-gradient g²."""
        raise NotImplementedError

    def server_update(self, uploads: Uploads, num_clients: float) -> Metrics:
        """g = ΣΔw / m;  m ← β₁ m + (1 − β₁) g;  v ← (the optimizer's);  w ← w − η_s m / (√v + τ)."""
        g = uploads["update"].to(self.first_moment) / num_clients
        self.first_moment.mul_(self.beta1).add_(g, alpha=1 - self.beta1)
        self.second_moment.copy_(self.next_second_moment(self.second_moment, g * g))
        step = self.first_moment / (self.second_moment.sqrt() + self.tau)
        self.apply_update(step)
        return {f"{type(self).__name__.lower()}/step_norm": float(self.server_lr * step.norm())}


class FedAdagrad(ServerOptimizer):
    """The server's v sums the squared pseudo-gradients: v ← v + g²."""

    def next_second_moment(self, v: Tensor, g2: Tensor) -> Tensor:
        return v + g2


class FedAdam(ServerOptimizer):
    """The server's v is an exponential average: v ← β₂ v + (1 − β₂) g²."""

    def next_second_moment(self, v: Tensor, g2: Tensor) -> Tensor:
        return self.beta2 * v + (1 - self.beta2) * g2


class FedYogi(ServerOptimizer):
    """The server's v moves towards g² by (1 − β₂) g² at most: v ← v − (1 − β₂) g² sign(v − g²)."""

    def next_second_moment(self, v: Tensor, g2: Tensor) -> Tensor:
        return v - (1 - self.beta2) * g2 * torch.sign(v - g2)
