"""FedAvg and FedProx: local SGD on the sampled clients, the server averages their updates.

Round t, global model w_t (P parameters), K clients:

1. The server samples m = max(1, round(q·K)) clients uniformly without replacement
   (q = `sample_fraction`; the draw is seeded by (seed, t), so a run is reproducible).
2. Each sampled client k runs `local_epochs` epochs of minibatch SGD (batch B, step `lr`)
   from w_t on its own data, minimizing the cross-entropy, plus μ/2 ‖w − w_t‖² for FedProx,
   and gets Δw_k = w_t − w_k.
3. It uploads Δw_k (float32, 4·P bytes), or a compressed version (`compression`: `topk` or
   `quantize`, see workbench/federation/compression.py) with error feedback:
   g_k = Δw_k + e_k, sent_k = C(g_k), e_k ← g_k − sent_k.
4. The server: w_{t+1} = w_t − η_s · (1/m) Σ_k sent_k  (η_s = `server_lr`; 1 is FedAvg).

Clients are averaged with equal weights, the 1/m Σ_k of OS-FED's recovery, so that every
method here aggregates the same way (weighting by n_k would also send n_k). The m clients
train at once, vectorized (`workbench.federation.local_training.local_sgd`), inside the one
Lightning step of the round: `whole_round_batch` makes the data module yield all samples in
one batch. With one client, full participation and η_s = 1, FedAvg is centralized
minibatch SGD (tested).
"""

from __future__ import annotations

import time
from typing import Literal

import torch
from torch import Tensor

from workbench.federation.compression import ErrorFeedback, build_compressor
from workbench.federation.local_training import local_sgd
from workbench.methods.base import ClientBatch, FederatedMethod
from workbench.methods.heads import Architecture, build_model

Compression = Literal["none", "topk", "quantize"]
SAMPLING, MINIBATCHES, SNAPSHOTS, PERSONAL = 0, 1, 2, 3  # the random streams of a round


def round_generator(seed: int, round_index: int, stream: int) -> torch.Generator:
    """The CPU generator of one random stream of one round (a run is reproducible and resumable)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + round_index) * 8 + stream)


class FedAvg(FederatedMethod):
    """Federated averaging of local SGD updates, optionally compressed.

    Args:
        num_rounds: R, communication rounds (one Lightning epoch each).
        architecture: `linear` or `mlp` head on features, `cnn` on images (`data.inputs: images`).
        hidden_dim: hidden width of the `mlp` head.
        local_epochs: passes of each sampled client over its data per round.
        lr: local SGD step size; local_batch_size: local minibatch size B.
        sample_fraction: q, share of the clients sampled each round.
        server_lr: η_s, the step the server takes along the averaged update.
        compression: `none` (float32 Δw), `topk` or `quantize`.
        topk_fraction: share of the P entries `topk` keeps; quantize_bits: bits per entry.
        error_feedback: carry each client's compression error to its next upload.
        seed: model initialization, client sampling and minibatch order.
    """

    whole_round_batch = True

    def __init__(
        self,
        num_rounds: int = 20,
        architecture: Architecture = "mlp",
        hidden_dim: int = 256,
        local_epochs: int = 1,
        lr: float = 0.05,
        local_batch_size: int = 64,
        sample_fraction: float = 1.0,
        server_lr: float = 1.0,
        compression: Compression = "none",
        topk_fraction: float = 0.01,
        quantize_bits: int = 8,
        error_feedback: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if num_rounds < 1 or local_epochs < 1 or local_batch_size < 1 or hidden_dim < 1:
            raise ValueError(
                "num_rounds, local_epochs, local_batch_size and hidden_dim must be ≥ 1, got "
                f"{num_rounds}, {local_epochs}, {local_batch_size}, {hidden_dim}"
            )
        if not (lr > 0 and server_lr > 0):
            raise ValueError(f"lr and server_lr must be > 0, got {lr} and {server_lr}")
        if not 0 < sample_fraction <= 1:
            raise ValueError(f"sample_fraction must be in (0, 1], got {sample_fraction}")
        if architecture not in ("linear", "mlp", "cnn"):
            raise ValueError(f"unknown architecture {architecture!r}; choose linear, mlp or cnn")
        if compression not in ("none", "topk", "quantize"):
            raise ValueError(f"unknown compression {compression!r}; choose none, topk or quantize")
        if not 0 < topk_fraction <= 1 or not 1 <= quantize_bits <= 16:
            raise ValueError(
                f"topk_fraction must be in (0, 1] and quantize_bits in 1..16, got "
                f"{topk_fraction} and {quantize_bits}"
            )
        self.save_hyperparameters()
        self.rounds, self.architecture, self.hidden_dim = num_rounds, architecture, hidden_dim
        self.local_epochs, self.lr, self.local_batch_size = local_epochs, lr, local_batch_size
        self.sample_fraction, self.server_lr, self.seed = sample_fraction, server_lr, seed
        self.compression, self.topk_fraction = compression, topk_fraction
        self.quantize_bits = quantize_bits
        self.use_error_feedback = error_feedback
        self.prox_mu = 0.0  # FedProx sets μ
        self.round_metrics: dict[str, float] = {}
        self._compress_s = 0.0

    @property
    def num_rounds(self) -> int:
        return self.rounds

    def setup_problem(self, feature_dim: int, num_classes: int, num_clients: int) -> None:
        # the runtime sets input_shape from the data; called directly, the input is a vector
        self.input_shape = self.input_shape or (feature_dim,)
        self.net = build_model(
            self.architecture,
            self.input_shape,
            num_classes,
            hidden_dim=self.hidden_dim,
            seed=self.seed,
        )
        sizes = [p.numel() for p in self.net.parameters()]
        self.compressor = build_compressor(
            self.compression,
            sizes,
            topk_fraction=self.topk_fraction,
            quantize_bits=self.quantize_bits,
        )
        lossy = self.compression != "none" and self.use_error_feedback
        self.feedback = ErrorFeedback(num_clients, sum(sizes)) if lossy else None

    # ---- parameters as one flat vector ------------------------------------------------------
    def flat_parameters(self) -> Tensor:
        """w_t: (P,)."""
        return torch.cat([p.detach().reshape(-1) for p in self.net.parameters()])

    def flatten(self, params: dict[str, Tensor]) -> Tensor:
        """Per-client parameter dict {name: (m, *shape)} -> (m, P), in the model's order."""
        return torch.cat(
            [
                params[name].reshape(len(params[name]), -1)
                for name, _ in self.net.named_parameters()
            ],
            1,
        )

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """(m, P) -> per-client parameter dict {name: (m, *shape)}, views of `flat`."""
        params, start = {}, 0
        for name, p in self.net.named_parameters():
            params[name] = flat[:, start:start + p.numel()].view(len(flat), *p.shape)
            start += p.numel()
        return params

    def apply_update(self, update: Tensor) -> None:
        """w ← w − η_s · update, update (P,)."""
        with torch.no_grad():
            weights = self.flat_parameters() - self.server_lr * update
            torch.nn.utils.vector_to_parameters(weights, self.net.parameters())

    # ---- one round ----------------------------------------------------------------------------
    def sample_clients(self) -> Tensor:
        """(m,) sorted ids of this round's clients: the sampled ones that did not drop out."""
        m = max(1, round(self.sample_fraction * self.num_clients))
        chosen = torch.randperm(
            self.num_clients, generator=round_generator(self.seed, self.round, SAMPLING)
        )[:m].sort().values.to(self.device)
        chosen = chosen[~self.dropped_clients[chosen]]  # `federation.dropout`: they never upload
        if len(chosen) == 0:
            raise RuntimeError(
                f"every client sampled in round {self.round} dropped out: lower federation.dropout "
                "or raise sample_fraction")
        return chosen

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        if self.trainer.num_training_batches != 1:
            raise RuntimeError(
                f"{type(self).__name__} trains every client's local epochs in one step and needs "
                "the whole training set as one batch: use FederatedDataModule, which yields it "
                "for methods with whole_round_batch = True"
            )

    def client_step(self, batch: ClientBatch) -> dict[str, Tensor]:
        clients = self.sample_clients()
        trained = local_sgd(
            self.net,
            batch.features,
            batch.labels,
            batch.client_ids,
            clients,
            epochs=self.local_epochs,
            lr=self.lr,
            batch_size=self.local_batch_size,
            generator=round_generator(self.seed, self.round, MINIBATCHES),
            prox_mu=self.prox_mu,
        )
        updates = self.flat_parameters() - self.flatten(trained)  # Δw_k = w_t − w_k: (m, P)
        self._uploaders = len(clients)
        start = time.perf_counter()
        uploads = self.encode_updates(clients, updates, batch)
        self._compress_s += time.perf_counter() - start
        self.round_metrics["time/compress_s"] = self._compress_s
        return uploads

    def encode_updates(
        self, clients: Tensor, updates: Tensor, batch: ClientBatch
    ) -> dict[str, Tensor]:
        """The clients' messages, summed: compressed Δw with error feedback -> {"update": (P,)}."""
        target = self.feedback.target(clients, updates) if self.feedback is not None else updates
        sent = self.compressor(target)
        if self.feedback is not None:
            self.feedback.keep(clients, target, sent)
        return {"update": sent.sum(0)}

    def upload_bytes_per_client(self, uploads: dict[str, Tensor]) -> int:
        return self.compressor.bytes_per_client()

    def uploading_clients(self) -> int:
        return self._uploaders

    def server_step(self, uploads: dict[str, Tensor], num_clients: int) -> dict[str, Tensor]:
        self.apply_update(uploads["update"] / num_clients)
        return {"weights": self.flat_parameters()}

    def on_train_epoch_end(self) -> None:
        self.fit_metrics.update(self.round_metrics)
        super().on_train_epoch_end()

    def forward(self, features: Tensor) -> Tensor:
        """Logits: (n, *input_shape) -> (n, C)."""
        return self.net(features)


class FedProx(FedAvg):
    """FedAvg whose clients minimize CE + μ/2 ‖w − w_t‖² (a proximal pull to the global model).

    Args:
        mu: μ ≥ 0 (0 is FedAvg). Plain SGD on the proximal term is stable only for lr · μ < 2.
        **kwargs: FedAvg's arguments.
    """

    def __init__(self, mu: float = 0.01, **kwargs) -> None:
        super().__init__(**kwargs)
        lr = self.lr
        if not 0 <= mu < 2 / lr:
            raise ValueError(
                f"FedProx needs 0 ≤ mu < 2 / lr = {2 / lr:g} (local SGD diverges on the proximal "
                f"term beyond), got mu = {mu}: lower mu or lr"
            )
        self.prox_mu = mu
