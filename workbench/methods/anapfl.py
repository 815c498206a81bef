"""AnaPFL: analytic personalized federated learning (ECCV 2026), one round.

Two random tanh feature maps of the backbone features X (n × d), both h = 1024 wide:

    Hg = tanh(X P_g)       main branch, P_g shared by every client (a seed, never the matrix)
    Hl = tanh(X P_l)       refinement branch, P_l another projection
    P ~ N(0, 1/d) entrywise, so a pre-activation is of the order of the features' RMS (tanh
    stays out of saturation).

Global branch: AFL (regularization intermediary + aggregation, `workbench.methods.afl.AFL`) on
Hg, in one round: client k uploads `Hg_kᵀHg_k + γI` (packed) and `Hg_kᵀY_k`; the server solves

    W_g = (Σ_k Hg_kᵀHg_k + γ_out I)⁻¹ Σ_k Hg_kᵀY_k,

ridge on the pooled data whatever the partition, and broadcasts W_g (and the seed of P_g).

Local branch, after the broadcast and with no communication: client k fits the residual of the
global branch on its own refinement features,

    R_k = Y_k − Hg_k W_g,      W_l,k = (Hl_kᵀHl_k + βI)⁻¹ Hl_kᵀR_k = Hl_kᵀ(Hl_kHl_kᵀ + βI)⁻¹R_k,

in the dual form when n_k < h (exact, n_k × n_k instead of h × h; `grouped_ridge`).
Client k predicts `Hg W_g + λ · Hl W_l,k`; `forward` (the global test split) is `Hg W_g` alone.

λ, one per run (as in the paper), is chosen from the grid `lambdas` by the mean over clients of
the accuracy on a 10% stratified hold-out of each client's training data, with W_l,k fitted on
the other 90%; then W_l,k is refit on all of it. W_g is fitted once, on all the training data,
and is the same W_g the final model uses: λ does not enter it, and a W_g without the hold-out
would cost the clients a second upload. (So the hold-out samples are in W_g's training data; with
h ≪ N their leverage on W_g is small.) A single-value grid skips the hold-out.

P_l is one projection shared by the clients, from a seed of its own. It never needs to agree
across clients — each client's model has the same distribution whichever P_l it draws — so it is
neither sent nor counted, and sharing it makes the refinement features one matmul for all clients.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as nnf
from torch import Tensor

from workbench.data.datamodule import stratified_holdout
from workbench.linalg import grouped_matmul, grouped_ridge
from workbench.methods.afl import AFL
from workbench.methods.local_only import solve_on_clients

DEFAULT_LAMBDAS = tuple(i / 10 for i in range(11))  # 0, 0.1, ..., 1.0


def gaussian_projection(seed: int, stream: int, fan_in: int, fan_out: int, dtype: torch.dtype) -> Tensor:
    """A seeded N(0, 1/fan_in) matrix (fan_in, fan_out), drawn on the CPU: the same on every machine.

    `stream` separates the projections drawn from one seed (0: P_g, 1: P_l).
    """
    state = int(np.random.SeedSequence([seed, stream]).generate_state(1, np.uint64)[0])
    generator = torch.Generator().manual_seed(state)
    return torch.randn(fan_in, fan_out, generator=generator, dtype=dtype) / fan_in ** 0.5


class AnaPFL(AFL):
    """Analytic personalized FL: an AFL main branch on random features plus each client's residual fit.

    Args:
        hidden_dim: h, the width of both random feature maps.
        gamma: γ, the regularization each client adds locally to its Gram (RI), removed by the server.
        gamma_out: γ_out, the ridge regularization of the global branch's pooled solve.
        beta: β > 0, the ridge regularization of each client's refinement.
        lambdas: the grid λ is chosen from (values ≥ 0; one value = fixed λ, no hold-out).
        holdout_fraction: the share of each client's training data (per class) held out to choose λ.
        seed: the shared seed of P_g (sent, 8 bytes); also seeds the hold-out draw.
        local_seed: the seed of P_l (never sent).
        dtype: dtype of the features, statistics and solves (and so of what is sent).

    Buffers: `weight` W_g (h, C); `local_weight` W_l (K, h, C); `refinement_scale` λ (a scalar).
    After a fit, `holdout_accuracy[i]` is the mean hold-out accuracy of `lambdas[i]` (sorted).
    """

    def __init__(self, hidden_dim: int = 1024, gamma: float = 1e-2, gamma_out: float = 1e-2, beta: float = 1.0,
                 lambdas: Sequence[float] = DEFAULT_LAMBDAS, holdout_fraction: float = 0.1, seed: int = 0,
                 local_seed: int = 1, dtype: str = "float64") -> None:
        if hidden_dim < 1:
            raise ValueError(f"hidden_dim must be ≥ 1, got {hidden_dim}")
        if not beta > 0:
            raise ValueError(f"beta must be > 0 (it makes every client's refinement solvable), got {beta}")
        if len(lambdas) == 0 or any(not value >= 0 for value in lambdas):
            raise ValueError(f"lambdas must be a non-empty list of values ≥ 0 (e.g. [0.0, 0.1, ..., 1.0], "
                             f"or [0.5] for a fixed λ), got {list(lambdas)}")
        if not 0 < holdout_fraction < 1:
            raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
        if not (0 <= seed < 2 ** 63 and 0 <= local_seed < 2 ** 63):
            raise ValueError(f"seed and local_seed must be integers in [0, 2⁶³), got {seed} and {local_seed}")
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
        super().__init__(gamma=gamma, gamma_out=gamma_out, bias=False, dtype=dtype)
        self.save_hyperparameters(ignore=["bias"])  # AFL's, not an argument here
        self.hidden_dim, self.beta, self.holdout_fraction = hidden_dim, beta, holdout_fraction
        self.lambdas = sorted(float(value) for value in lambdas)  # ties go to the smaller λ
        self.seed, self.local_seed = seed, local_seed
        self.holdout_accuracy: Tensor | None = None

    def setup_problem(self, feature_dim: int, num_classes: int, num_clients: int) -> None:
        super().setup_problem(self.hidden_dim, num_classes, num_clients)  # W_g: (h, C)
        for name, seed, stream in (("global_projection", self.seed, 0), ("local_projection", self.local_seed, 1)):
            # regenerated from the seeds: neither saved nor sent
            projection = gaussian_projection(seed, stream, feature_dim, self.hidden_dim, self.stat_dtype)
            self.register_buffer(name, projection, persistent=False)
        self.register_buffer("local_weight", torch.zeros(num_clients, self.hidden_dim, num_classes,
                                                         dtype=self.stat_dtype))
        self.register_buffer("refinement_scale", torch.zeros((), dtype=self.stat_dtype))

    # ---- the two feature maps ----------------------------------------------------------------
    def design(self, features: Tensor) -> Tensor:
        """The main branch's features Hg = tanh(X P_g): (n, d) -> (n, h). AFL fits W_g on them."""
        return torch.tanh(features.to(self.stat_dtype) @ self.global_projection)

    def local_features(self, features: Tensor) -> Tensor:
        """The refinement branch's features Hl = tanh(X P_l): (n, d) -> (n, h)."""
        return torch.tanh(features.to(self.stat_dtype) @ self.local_projection)

    # ---- the round: AFL's client and server steps on Hg, then the local fits ---------------------
    def server_step(self, uploads: dict[str, Tensor], num_clients: int) -> dict[str, Tensor]:
        broadcast = super().server_step(uploads, num_clients)
        return {**broadcast, "seed": torch.tensor(self.seed, dtype=torch.int64)}  # P_g as its seed

    def after_broadcast(self) -> None:
        super().after_broadcast()
        solve_on_clients(self, self.fit_local_branch)

    @torch.no_grad()
    def fit_local_branch(self, features: Tensor, labels: Tensor, client_ids: Tensor) -> dict[str, float]:
        """Choose λ on the hold-out, then fit every client's W_l on all its rows, W_g fixed.

        features: (n, d), labels: (n,), client_ids: (n,), every client's training data.
        Returns the numbers to log: `anapfl/lambda` (and `anapfl/holdout_acc`, the chosen λ's score).
        """
        refinement = self.local_features(features)                                     # Hl (n, h)
        targets = nnf.one_hot(labels, self.num_classes).to(self.stat_dtype)
        residual = targets - torch.cat([self(chunk) for chunk in features.split(8192)])  # R (n, C)
        metrics = {}
        if len(self.lambdas) > 1:
            held_out = stratified_holdout(labels.cpu(), self.holdout_fraction, self.seed,
                                          groups=client_ids.cpu()).to(features.device)
            if not held_out.any():
                raise ValueError(
                    f"no client has enough data to hold out {self.holdout_fraction:.0%} of a class for choosing "
                    "λ; raise holdout_fraction or give lambdas a single value")
            kept = ~held_out
            weights = grouped_ridge(refinement[kept], residual[kept], client_ids[kept], self.num_clients, self.beta)
            self.holdout_accuracy = self._holdout_accuracy(
                global_logits=(targets - residual)[held_out],  # Hg W_g, already computed
                local_logits=grouped_matmul(refinement[held_out], weights, client_ids[held_out]),
                labels=labels[held_out], client_ids=client_ids[held_out])
            best = int(self.holdout_accuracy.argmax())  # the first maximum: the smallest such λ
            metrics["anapfl/holdout_acc"] = float(self.holdout_accuracy[best])
        else:
            best = 0
        self.refinement_scale.fill_(self.lambdas[best])
        self.local_weight = grouped_ridge(refinement, residual, client_ids, self.num_clients, self.beta)
        return {"anapfl/lambda": self.lambdas[best], **metrics}

    def _holdout_accuracy(self, global_logits: Tensor, local_logits: Tensor, labels: Tensor,
                          client_ids: Tensor) -> Tensor:
        """Mean over clients of the hold-out accuracy of every λ: (m, C), (m, C), (m,), (m,) -> (L,)."""
        scales = torch.tensor(self.lambdas, dtype=global_logits.dtype, device=global_logits.device)
        predicted = (global_logits + scales[:, None, None] * local_logits).argmax(dim=2)  # (L, m)
        correct = predicted.eq(labels).to(global_logits.dtype)
        held = torch.bincount(client_ids, minlength=self.num_clients)
        per_client = correct.new_zeros(len(scales), self.num_clients).index_add_(1, client_ids, correct)
        return (per_client[:, held > 0] / held[held > 0]).mean(dim=1)

    # ---- prediction ----------------------------------------------------------------------------
    # forward (AFL's): the global branch Hg W_g, for the global test split.
    def predict_clients(self, features: Tensor, client_ids: Tensor) -> Tensor:
        """Client k's model, Hg W_g + λ · Hl W_l,k: (n, d), (n,) -> (n, C)."""
        local = grouped_matmul(self.local_features(features), self.local_weight, client_ids)
        return self(features) + self.refinement_scale * local
