"""FedAvgM: FedAvg with momentum on the server.

Hsu, Qi & Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
Classification" (2019). The clients are FedAvg's (local SGD, the same uploads and bytes, compressed
where the protocol compresses); the server keeps a velocity v (P numbers, v₀ = 0, kept in
checkpoints) and steps along it instead of the round's mean update:

    v ← β v + (1/m) Σ_k Δw_k,        w_{t+1} = w_t − η_s v,

β = `server_momentum` (β = 0 is FedAvg). With a constant mean update Δ, v → Δ / (1 − β): the
server's step grows by up to 1 / (1 − β), so η_s often comes down as β goes up.
"""
from __future__ import annotations

import torch
from torch import Tensor

from workbench.methods.base import Metrics, Problem, Uploads
from workbench.methods.fedavg import FedAvg


class FedAvgM(FedAvg):
    """FedAvg whose server steps with momentum β along the clients' mean update.

    Args:
        server_momentum: β in [0, 1).
        **kwargs: FedAvg's arguments (`local`, `server_lr`, ...).
    """

    velocity: Tensor  # (P,) v, a buffer from `setup_problem`

    def __init__(self, server_momentum: float = 0.9, **kwargs) -> None:
        super().__init__(**kwargs)
        if not 0 <= server_momentum < 1:
            raise ValueError(f"server_momentum must be in [0, 1), got {server_momentum}")
        self.server_momentum = server_momentum

    def setup_problem(self, problem: Problem) -> None:
        super().setup_problem(problem)
        self.register_buffer("velocity", torch.zeros_like(self.flat_parameters()))

    def server_update(self, uploads: Uploads, num_clients: float) -> Metrics:
        """v ← β v + ΣΔw / m;  w ← w − η_s v."""
        self.velocity.mul_(self.server_momentum).add_(uploads["update"].to(self.velocity) / num_clients)
        self.apply_update(self.velocity)
        return {"fedavgm/velocity_norm": float(self.velocity.norm())}
