"""SCAFFOLD: local SGD corrected by control variates against client drift.

Karimireddy, Kale, Mohri, Reddi, Stich & Suresh, "SCAFFOLD: Stochastic Controlled Averaging
for Federated Learning" (ICML 2020), Algorithm 1 with option II. The server keeps the global
model x and the server control variate c (both P parameters, c₀ = 0); each client i keeps its
own control variate c_i (c_i = 0 until it first takes part). Round t:

1. The server samples clients S as FedAvg does (`sample_fraction`, seeded by (seed, t)) and
   sends them x and c (round 0: the seed of x₀; c₀ = 0 does not travel).
2. Each sampled client i takes K_i = local.epochs · ceil(n_i / B) minibatch steps from y = x:

       y ← y − η_l (g_i(y) − c_i + c),

   g_i the minibatch gradient of its cross-entropy (`local_sgd` with the linear correction
   c − c_i; its minibatches from its own stream, as in FedAvg).
3. Option II: c_i⁺ = c_i − c + (x − y) / (K_i η_l). The client uploads Δy_i = y − x and
   Δc_i = c_i⁺ − c_i (float32, 4·P bytes each: twice FedAvg's upload) and keeps c_i ← c_i⁺.
4. The server, with N the clients that hold data:

       x ← x + η_g · (1/|S|) Σ_{i ∈ S} Δy_i,      c ← c + (|S| / N) · (1/|S|) Σ_{i ∈ S} Δc_i,

   η_g = `server_lr`. Both uploads are sums over the clients, so secure aggregation and noise
   apply as to FedAvg's; client-level DP clips (Δy_i, Δc_i) as one vector to norm ≤ C.

With full participation c stays the mean of the c_i; with one local step (a client's whole data
in one batch) c_i⁺ = g_i(x) and the round is FedAvg's, whatever c and c_i were (tested). The
client half keeps the c_i of the clients that have trained (`control`, a `ClientTable`: a row per
client that has taken part, none for the never-sampled ones); a dropped
client computes and keeps its c_i⁺ although its upload is lost, as a FedAvg client keeps its
error feedback. The broadcast is x and c, twice FedAvg's after round 0; the final broadcast is
x alone (predictions need no c).
"""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import Tensor

from workbench.federation.client_state import ClientTable
from workbench.federation.compression import as_sent
from workbench.federation.local_training import local_steps
from workbench.methods.base import Cohort, Metrics, Problem, RoundPlan, Uploads
from workbench.methods.gradient import UPDATE, GradientClient, GradientMethod


class ScaffoldClient(GradientClient):
    """SCAFFOLD's clients: corrected local SGD; each keeps its control variate c_i (`control`)."""

    def setup_state(self) -> None:
        # c_i for the clients that have taken part; c_i = 0 for the others
        self.control = ClientTable(torch.zeros(self.flat.vector().numel(), dtype=self.dtype))

    def train_round(self, round_index: int, broadcast: Mapping[str, Tensor],
                    cohort: Cohort) -> tuple[Uploads, Metrics]:
        self.receive(broadcast)
        if len(cohort.clients) == 0:
            return {}, {}
        x = self.flat.vector()
        c = broadcast["control"].to(x) if "control" in broadcast else torch.zeros_like(x)  # c₀ = 0
        c_i = self.control.read(cohort.clients)  # (m, P)
        y = self.flat.flatten(self.local_sgd(round_index, cohort, correction=self.flat.unflatten(c - c_i)))
        steps = local_steps(cohort.client_ids, cohort.clients, epochs=self.local.epochs,
                            batch_size=self.local.batch_size).to(x)
        # option II: c_i⁺ = c_i − c + (x − y) / (K_i η_l), η_l this round's step; a client without a step keeps c_i
        trained = steps > 0
        lr = self.round_lr(round_index)
        new_c_i = torch.where(trained[:, None], c_i - c + (x - y) / (steps.clamp_min(1)[:, None] * lr), c_i)
        self.control.write(cohort.clients[trained], new_c_i[trained])
        # one row per client; under client-level DP the protocol clips (Δy, Δc) as one vector
        return {"delta_y": as_sent(y - x), "delta_c": as_sent(new_c_i - c_i)}, {}


class SCAFFOLD(GradientMethod):
    """Local SGD with control variates (option II) that correct each client's local steps.

    Args:
        **kwargs: every gradient method's settings (`GradientMethod`: num_rounds, architecture,
            hidden_dim, local, sample_fraction, server_lr (η_g), seed). `local.lr` is η_l and its
            schedule applies (option II divides by the round's η_l); no momentum (option II
            assumes plain steps). Uploads are dense float32; under the protocol's compression
            (`federation.compression`) Δy and Δc are each compressed, with error feedback of their own.
    """

    uploads = MappingProxyType({"delta_y": UPDATE, "delta_c": UPDATE})
    client_class = ScaffoldClient

    control: Tensor  # (P,) c, a buffer from `setup_problem`

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.local.momentum:
            raise ValueError(f"SCAFFOLD's option II assumes plain local steps: set local.momentum=0, got "
                             f"{self.local.momentum}")
        if self.local.lr == 0:
            raise ValueError("SCAFFOLD's option II divides by the local step size: set local.lr > 0")

    def setup_problem(self, problem: Problem) -> None:
        super().setup_problem(problem)
        self.register_buffer("control", torch.zeros_like(self.flat_parameters()))  # c
        self.num_with_data = problem.num_clients

    def plan_round(self, available: Tensor) -> RoundPlan:
        self.num_with_data = len(available)  # N: the clients that hold data
        return super().plan_round(available)

    def broadcast(self) -> dict[str, Tensor]:
        if self.round == 0:  # x₀ travels as its seed, c₀ = 0 not at all
            return super().broadcast()
        return {"weights": self.flat_parameters(), "control": self.control.clone()}

    def server_update(self, uploads: Uploads, num_clients: float) -> Metrics:
        """x ← x + η_g · ΣΔy / |S|;  c ← c + ΣΔc / N  (= (|S|/N) · mean Δc)."""
        self.flat.load(self.flat_parameters() + self.server_lr * uploads["delta_y"].to(self.control) / num_clients)
        self.control += uploads["delta_c"].to(self.control) / self.num_with_data
        return {"scaffold/control_norm": float(self.control.norm())}
