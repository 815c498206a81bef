"""Ditto: a FedAvg global model plus one personal model per client, pulled towards it.

Li, Hu, Beirami & Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization" (ICML 2021). Round t, global model w_t, sampled clients k:

1. Global part, exactly FedAvg: k runs local SGD from w_t on the cross-entropy and uploads
   Δw_k (optionally compressed); the server averages.
2. Personal part, never sent: k keeps its own model v_k across rounds and takes
   `personal_epochs` epochs of SGD on

       h_k(v_k) = CE_k(v_k) + λ/2 ‖v_k − w_t‖²,

   the pull towards the global model it just received (λ = 0: local-only training from w₀;
   λ → ∞: v_k → w_t). Every v_k starts at w₀, the initial global model.

A client predicts with its own v_k (`predict_clients`, the personalized protocol's local
tests); `forward` is the global model w. Upload bytes and rounds are FedAvg's: v_k stays on
the client. The personal models are one (K, P) buffer, so a checkpoint holds them; the sampled
clients' personal steps run vectorized like the global ones.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.func import functional_call

from workbench.federation.local_training import local_sgd
from workbench.methods.base import ClientBatch
from workbench.methods.fedavg import PERSONAL, FedAvg, round_generator


class Ditto(FedAvg):
    """FedAvg's global model + a personal model per client with a proximal pull λ.

    Args:
        lam: λ ≥ 0, the pull of each personal model towards the global one. Plain SGD on the
            proximal term is stable only for personal_lr · λ < 2.
        personal_epochs: local epochs on the personal objective per round (default: local_epochs).
        personal_lr: step size of the personal SGD (default: lr).
        **kwargs: FedAvg's arguments (rounds, head, local epochs, sampling, compression, seed).
    """

    def __init__(self, lam: float = 0.1, personal_epochs: int | None = None,
                 personal_lr: float | None = None, **kwargs) -> None:
        super().__init__(**kwargs)  # its save_hyperparameters() also records lam and the rest
        self.lam = lam
        self.personal_epochs = self.local_epochs if personal_epochs is None else personal_epochs
        self.personal_lr = self.lr if personal_lr is None else personal_lr
        if self.personal_epochs < 1 or not self.personal_lr > 0:
            raise ValueError(f"personal_epochs must be ≥ 1 and personal_lr > 0, got "
                             f"{self.personal_epochs} and {self.personal_lr}")
        if not 0 <= lam < 2 / self.personal_lr:
            raise ValueError(
                f"Ditto needs 0 ≤ lam < 2 / personal_lr = {2 / self.personal_lr:g} (personal SGD "
                f"diverges on the proximal term beyond), got lam = {lam}: lower lam or personal_lr")

    def setup_problem(self, feature_dim: int, num_classes: int, num_clients: int) -> None:
        super().setup_problem(feature_dim, num_classes, num_clients)
        # v_k of every client, flat: (K, P), all starting at w₀
        self.register_buffer("personal", self.flat_parameters().repeat(num_clients, 1))

    def client_step(self, batch: ClientBatch) -> dict[str, Tensor]:
        clients = self.sample_clients()
        # The personal step first: its proximal centre is w_t, the model the clients received.
        trained = local_sgd(
            self.net, batch.features, batch.labels, batch.client_ids, clients,
            epochs=self.personal_epochs, lr=self.personal_lr, batch_size=self.local_batch_size,
            generator=round_generator(self.seed, self.round, PERSONAL),
            prox_mu=self.lam, init=self.unflatten(self.personal[clients]),
        )
        self.personal[clients] = self.flatten(trained)
        return super().client_step(batch)  # FedAvg's global step (draws the same clients)

    @torch.no_grad()
    def predict_clients(self, features: Tensor, client_ids: Tensor) -> Tensor:
        """Each sample under its client's personal model v_k: (n, d), (n,) -> (n, C)."""
        logits = None
        for client in torch.unique(client_ids).tolist():
            mine = client_ids == client
            params = {name: value[0] for name, value in self.unflatten(self.personal[client:client + 1]).items()}
            out = functional_call(self.net, params, (features[mine],))
            if logits is None:
                logits = out.new_empty(len(features), out.shape[1])
            logits[mine] = out
        return logits
