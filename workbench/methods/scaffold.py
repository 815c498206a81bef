"""SCAFFOLD: local SGD corrected by control variates against client drift.

Karimireddy, Kale, Mohri, Reddi, Stich & Suresh, "SCAFFOLD: Stochastic Controlled Averaging
for Federated Learning" (ICML 2020), Algorithm 1 with option II. The server keeps the global
model x and the server control variate c (both P parameters, c₀ = 0); each client i keeps its
own control variate c_i (c_i = 0 until it first takes part). Round t:

1. The server samples clients S as FedAvg does (`sample_fraction`, seeded by (seed, t)) and
   sends them x and c (round 0: the seed of x₀; c₀ = 0 does not travel).
2. Each sampled client i takes K_i = local_epochs · ceil(n_i / B) minibatch steps from y = x:

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

import torch
from torch import Tensor

from workbench.federation.compression import as_sent
from workbench.federation.client_state import ClientTable
from workbench.federation.local_training import local_steps
from workbench.federation.privacy import WITHIN_CLIP, clip_client_updates
from workbench.methods.base import SUMMED, Cohort, Problem, RoundPlan
from workbench.methods.fedavg import FedAvg, FedAvgClient


class ScaffoldClient(FedAvgClient):
    """SCAFFOLD's clients: corrected local SGD; each keeps its control variate c_i (`control`)."""

    def setup_state(self) -> None:
        # c_i for the clients that have taken part; c_i = 0 for the others
        self.control = ClientTable(torch.zeros(self.flat.vector().numel(), dtype=self.dtype))

    def client_update(self, round_index, broadcast, cohort: Cohort):
        self.receive(broadcast)
        if len(cohort.clients) == 0:
            return {}, {}
        s = self.settings
        x = self.flat.vector()
        c = broadcast["control"].to(x) if "control" in broadcast else torch.zeros_like(x)  # c₀ = 0
        c_i = self.control.read(cohort.clients)  # (m, P)
        y = self.flat.flatten(self.local_sgd(round_index, cohort, correction=self.flat.unflatten(c - c_i)))
        steps = local_steps(cohort.client_ids, cohort.clients, epochs=s["local_epochs"],
                            batch_size=s["local_batch_size"]).to(x)
        # option II: c_i⁺ = c_i − c + (x − y) / (K_i η_l), η_l this round's step; a client without a step keeps c_i
        trained = steps > 0
        lr = self.round_lr(round_index)
        new_c_i = torch.where(trained[:, None], c_i - c + (x - y) / (steps.clamp_min(1)[:, None] * lr), c_i)
        # what crosses the wire; under client-level DP (Δy, Δc) clipped as one vector per client
        sent, count = clip_client_updates({"delta_y": as_sent(y - x), "delta_c": as_sent(new_c_i - c_i)}, broadcast)
        self.control.write(cohort.clients[trained], new_c_i[trained])
        return {name: value.sum(0) for name, value in sent.items()} | count, {}


class SCAFFOLD(FedAvg):
    """FedAvg with control variates (option II) that correct each client's local steps.

    Args:
        num_rounds, architecture, hidden_dim, local_epochs, lr (η_l), local_batch_size,
            sample_fraction, server_lr (η_g), seed: as in FedAvg. Uploads are dense float32
            (no compression: the control variates are not compressed).
        lr_schedule, lr_final_fraction, lr_step_rounds, lr_gamma: η_l across rounds, as in FedAvg
            (option II divides by the round's η_l). No momentum: option II assumes plain steps.
    """

    uploads = {"delta_y": SUMMED, "delta_c": SUMMED, WITHIN_CLIP: SUMMED}  # the count only under client-level DP
    client_class = ScaffoldClient

    def __init__(self, num_rounds: int = 20, architecture="mlp", hidden_dim: int = 256, local_epochs: int = 1,
                 lr: float = 0.05, local_batch_size: int = 64, sample_fraction: float = 1.0,
                 server_lr: float = 1.0, seed: int = 0, lr_schedule: str = "constant",
                 lr_final_fraction: float = 0.0, lr_step_rounds: int = 1, lr_gamma: float = 0.1) -> None:
        super().__init__(num_rounds=num_rounds, architecture=architecture, hidden_dim=hidden_dim,
                         local_epochs=local_epochs, lr=lr, local_batch_size=local_batch_size,
                         sample_fraction=sample_fraction, server_lr=server_lr, seed=seed, lr_schedule=lr_schedule,
                         lr_final_fraction=lr_final_fraction, lr_step_rounds=lr_step_rounds, lr_gamma=lr_gamma)
        self.save_hyperparameters()  # SCAFFOLD's own (FedAvg's compression ones do not apply)
        for key in ("compression", "topk_fraction", "quantize_bits", "error_feedback"):  # FedAvg's, not this method's: a fresh build from hparams must work
            self._hparams.pop(key, None)
            self._hparams_initial.pop(key, None)

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

    def upload_bytes_per_client(self, upload: Mapping[str, Tensor]) -> int:
        return 2 * self.compressor.bytes_per_client() + self.count_bytes()  # Δy and Δc, float32 each

    def server_update(self, uploads: dict[str, Tensor], num_clients: int) -> dict[str, float]:
        """x ← x + η_g · ΣΔy / |S|;  c ← c + ΣΔc / N  (= (|S|/N) · mean Δc)."""
        self.flat.load(self.flat_parameters() + self.server_lr * uploads["delta_y"].to(self.control) / num_clients)
        self.control += uploads["delta_c"].to(self.control) / self.num_with_data
        return {"scaffold/control_norm": float(self.control.norm())}
