"""Ditto: a FedAvg global model plus one personal model per client, pulled towards it.

Li, Hu, Beirami & Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization" (ICML 2021). Round t, global model w_t, sampled clients k:

1. Global part, exactly FedAvg: k runs local SGD from w_t on the cross-entropy and uploads
   Δw_k (compressed where the protocol compresses); the server averages.
2. Personal part, never sent: k keeps its own model v_k across rounds and takes
   `personal_epochs` epochs of SGD on

       h_k(v_k) = CE_k(v_k) + λ/2 ‖v_k − w_t‖²,

   the pull towards the global model it just received (λ = 0: local-only training from w₀;
   λ → ∞: v_k → w_t). Every v_k starts at w₀, the initial global model (rebuilt on the client
   from the seed).

The personal models are client state: the client half (`DittoClient`) keeps them in a
`ClientTable` (`personal`: a row for each client that has trained one, w₀ for the others, so a
cohort-sampled run holds the sampled clients' only), a checkpoint holds them and a Flower node
keeps its own; the cohort's personal steps run vectorized like the global ones, each client shuffling with
a stream of its own. A client predicts with its own v_k (`DittoClient.predict`, the personalized
protocol's local tests); `forward` is the global model w. Upload bytes and rounds are FedAvg's:
v_k stays on the client.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor
from torch.func import functional_call

from workbench.federation.client_state import ClientTable
from workbench.methods.base import Cohort, Metrics, Problem, Uploads
from workbench.methods.fedavg import FedAvg
from workbench.methods.gradient import PERSONAL, GradientClient


class DittoClient(GradientClient):
    """FedAvg's clients, each also keeping its personal model v_k (`personal`: a `ClientTable`
    holding the clients that have trained one; the others' is still w₀)."""

    initial: Tensor  # (P,) w₀

    def __init__(self, problem: Problem, method: Ditto) -> None:
        super().__init__(problem, method)
        self.lam, self.personal_epochs, self.personal_lr = method.lam, method.personal_epochs, method.personal_lr
        # w₀ (the net as built from the seed): where every personal model starts
        self.register_buffer("initial", self.flat.vector().clone(), persistent=False)

    def setup_state(self) -> None:
        self.personal = ClientTable(self.initial)

    def train_round(self, round_index: int, broadcast: Mapping[str, Tensor],
                    cohort: Cohort) -> tuple[Uploads, Metrics]:
        self.receive(broadcast)
        if len(cohort.clients):
            # The personal step first: its proximal centre is w_t, the model just received.
            trained = self.local_sgd(round_index, cohort, PERSONAL, epochs=self.personal_epochs,
                                     lr=self.personal_lr, prox_mu=self.lam,
                                     init=self.flat.unflatten(self.personal.read(cohort.clients)))
            self.personal.write(cohort.clients, self.flat.flatten(trained))
        return super().train_round(round_index, broadcast, cohort)  # FedAvg's global step

    @torch.no_grad()
    def predict(self, features: Tensor, client_ids: Tensor) -> Tensor:
        """Each sample under its client's personal model v_k: (n, *input_shape), (n,) -> (n, C);
        a client this half does not serve (another process's, or without training data) predicts
        zeros, as the other personalized methods' (the processes' predictions add up)."""
        dtype = self.initial.dtype
        logits = torch.zeros(len(features), self.num_classes, dtype=dtype, device=features.device)
        _, known = self.served_slots(client_ids)
        ids = torch.where(known, client_ids, -1)
        order = torch.argsort(ids, stable=True)  # the rows by client, those of no served client (−1) first
        clients, sizes = torch.unique_consecutive(ids[order], return_counts=True)
        personal = iter(self.personal.read(clients[clients >= 0]))
        # the personal models read once, not per client
        for client, rows in zip(clients.tolist(), order.split(sizes.tolist()), strict=True):
            if client >= 0:
                params = {name: value[0] for name, value in self.flat.unflatten(next(personal)[None]).items()}
                logits[rows] = functional_call(self.net, params, (features[rows].to(dtype),))
        return logits


class Ditto(FedAvg):
    """FedAvg's global model + a personal model per client with a proximal pull λ.

    Args:
        lam: λ ≥ 0, the pull of each personal model towards the global one. Plain SGD on the
            proximal term is stable only for personal_lr · λ < 2.
        personal_epochs: local epochs on the personal objective per round (default: local.epochs).
        personal_lr: step size of the personal SGD (default: local.lr), under local.lr_schedule
            (local.momentum and local.weight_decay apply to it too).
        **kwargs: FedAvg's arguments (rounds, head, local training, sampling, seed).
    """

    personalized = True
    personal_every_round = True  # v_k after every round: the learning curve scores them along the rounds
    client_class = DittoClient

    def __init__(self, lam: float = 0.1, personal_epochs: int | None = None,
                 personal_lr: float | None = None, **kwargs) -> None:
        super().__init__(**kwargs)  # its save_hyperparameters() also records lam and the rest
        if self.init_from.enabled:  # every v_k starts at w₀, which a client rebuilds from the seed alone
            raise ValueError("Ditto's personal models start from the seeded w₀ and do not take an analytic start: "
                             "use init_from.method=none (or FedAvg / FedProx with init_from)")
        self.lam = lam
        self.personal_epochs = self.local.epochs if personal_epochs is None else personal_epochs
        self.personal_lr = self.local.lr if personal_lr is None else personal_lr
        if self.personal_epochs < 1 or not self.personal_lr > 0:
            raise ValueError(f"personal_epochs must be ≥ 1 and personal_lr > 0, got "
                             f"{self.personal_epochs} and {self.personal_lr}")
        if not 0 <= lam < 2 / self.personal_lr:
            raise ValueError(
                f"Ditto needs 0 ≤ lam < 2 / personal_lr = {2 / self.personal_lr:g} (personal SGD "
                f"diverges on the proximal term beyond), got lam = {lam}: lower lam or personal_lr")
