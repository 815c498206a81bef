"""DeepAFL: deep residual analytic federated learning (ICLR 2026), layer by layer in closed form.

On backbone features X (n × d), with one-hot labels Y (n × C):

    Φ₀ = tanh(X A₀ + a₀)                        A₀: d × h, random
    F_t = σ(Φ_{t−1} B_t + b_t)                  B_t: h × f, random         (t = 1..T)
    Φ_t = Φ_{t−1} + F_t Ω_t                     Ω_t: f × h, learned
    W_t = (Σ_k Φ_tᵀΦ_t + γI)⁻¹ Σ_k Φ_tᵀY         the ridge classifier at depth t

Ω_t solves the sandwiched least squares  min_Ω ‖R − F_t Ω W_{t−1}‖² + γ_s‖Ω‖²  with the residual
R = Y − Φ_{t−1} W_{t−1}. Its normal equation  FᵀF Ω WWᵀ + γ_s Ω = FᵀR Wᵀ  is diagonalised by
FᵀF = V diag(S_F) Vᵀ and WWᵀ = U diag(S_W) Uᵀ:

    Ω = V Ω̂ Uᵀ,   Ω̂_ij = (Vᵀ FᵀR Wᵀ U)_ij / (γ_s + S_F,i · S_W,j).

Rounds (2T + 1): round 0 solves W₀; then for each layer t one round for Ω_t (clients upload
FᵀF packed and FᵀR, f × C) and one for W_t (clients upload ΦᵀΦ packed and ΦᵀY, h × C). Both
statistics are sums over samples, so the server's solves equal the centralized ones for any
partition. No regularization intermediary: a client's ΦᵀΦ is sent as is and the server adds
γI once, which is exactly the formula above (adding γI per client and removing Kγ would send
the same information). The random layers are regenerated on every client from a shared seed,
so only the seed (8 bytes, in the first broadcast) stands for them on the wire. (The official
code uploads W Rᵀ F, h × f; FᵀR carries the same information in C/h of the bytes.)

Clients keep Φ_{t−1} of every training sample between rounds (n × h in `dtype`: 0.5 GB for 60k
samples at h = 1024 in float64), so a round costs one layer per sample, not t; F_t is recomputed
in the W_t round rather than kept, which would double that memory.

Each W_t minimizes the ridge risk J_t = ‖Y − Φ_t W_t‖² + γ‖W_t‖², and Ω = 0 is a feasible choice
for Ω_t, so J_t + γ_s‖Ω_t‖² ≤ J_{t−1}: the training risk never increases with depth.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as nnf
from torch import Tensor

from workbench.linalg import class_sums, identity_like, solve_spd
from workbench.methods.base import ClientBatch, FederatedMethod

ACTIVATIONS = {"gelu": nnf.gelu, "relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def random_layer(seed: int, layer: int, fan_in: int, fan_out: int,
                 dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """The random affine map of `layer` (0: A₀, t: B_t) -> weight (fan_in, fan_out), bias (fan_out,).

    `nn.Linear`'s default initialisation, as in the official code: kaiming-uniform with a = √5
    gives U(−1/√fan_in, 1/√fan_in) for the weight, and the bias uses the same bound. Each layer
    has a generator of its own, seeded from (seed, layer), so any layer is rebuilt alone and
    the same on every machine (drawn on the CPU).
    """
    layer_seed = int(np.random.SeedSequence([seed, layer]).generate_state(1, np.uint64)[0])
    generator = torch.Generator().manual_seed(layer_seed)
    bound = fan_in ** -0.5
    weight = (2 * torch.rand(fan_in, fan_out, generator=generator, dtype=dtype) - 1) * bound
    bias = (2 * torch.rand(fan_out, generator=generator, dtype=dtype) - 1) * bound
    return weight, bias


def solve_omega(hidden_gram: Tensor, hidden_residual: Tensor, classifier: Tensor,
                gamma_s: float) -> Tensor:
    """Ω (f, h) minimizing ‖R − F Ω W‖² + γ_s‖Ω‖², from FᵀF (f, f), FᵀR (f, C), W = W_{t−1} (h, C).

    Eigendecompositions FᵀF = V S_F Vᵀ and WWᵀ = U S_W Uᵀ turn the normal equation
    FᵀF Ω WWᵀ + γ_s Ω = FᵀR Wᵀ into an elementwise division in the (V, U) basis.
    """
    s_f, v = torch.linalg.eigh(hidden_gram)
    s_w, u = torch.linalg.eigh(classifier @ classifier.T)
    rotated = (v.T @ hidden_residual) @ (classifier.T @ u)  # Vᵀ FᵀR Wᵀ U, (f, h)
    return v @ (rotated / (gamma_s + s_f[:, None] * s_w[None, :])) @ u.T


class DeepAFL(FederatedMethod):
    """Deep residual analytic federated learning: T gradient-free residual blocks, 2T + 1 rounds.

    Args:
        num_layers: T, the residual blocks (0 = a ridge classifier on Φ₀ alone, one round).
        hidden_dim: h, the width of Φ_t (the random map A₀ takes d -> h).
        block_dim: f, the width of each block's random features F_t (B_t takes h -> f).
        activation: σ of the blocks, `gelu`, `relu`, `tanh` or `sigmoid` (layer 0 is always tanh).
        gamma: γ, the ridge regularization of every classifier W_t.
        gamma_s: γ_s > 0, the regularization of the sandwiched least squares for Ω_t.
        seed: the shared seed every client rebuilds the random layers from.
        dtype: dtype of the random layers, the per-sample features, the statistics and the
            solves (and so of what is sent).

    After a fit, `depth_accuracy[t]` is the test accuracy of the model of depth t (also logged
    as `depth/test_acc` with step t).
    """

    symmetric_uploads = frozenset({"gram", "hidden_gram"})

    def __init__(self, num_layers: int = 20, hidden_dim: int = 1024, block_dim: int = 1024,
                 activation: str = "gelu", gamma: float = 1.0, gamma_s: float = 0.05, seed: int = 0,
                 dtype: str = "float64") -> None:
        super().__init__()
        if num_layers < 0:
            raise ValueError(f"num_layers (T) must be ≥ 0, got {num_layers}")
        if hidden_dim < 1 or block_dim < 1:
            raise ValueError(f"hidden_dim and block_dim must be ≥ 1, got {hidden_dim}, {block_dim}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
        if gamma < 0:
            raise ValueError(f"gamma must be ≥ 0, got {gamma}")
        if not gamma_s > 0:
            raise ValueError(f"gamma_s must be > 0 (it makes the sandwiched least squares solvable), "
                             f"got {gamma_s}; the official default is 0.05")
        if not 0 <= seed < 2 ** 63:
            raise ValueError(f"seed must be an integer in [0, 2⁶³), got {seed}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.save_hyperparameters()
        self.num_layers, self.hidden_dim, self.block_dim = num_layers, hidden_dim, block_dim
        self.activation = ACTIVATIONS[activation]
        self.gamma, self.gamma_s, self.seed = gamma, gamma_s, seed
        self.stat_dtype = DTYPES[dtype]
        self.depth_accuracy: list[float] = []
        self._train_phi: Tensor | None = None  # Φ of every training sample, see `client_step`
        self._train_phi_depth: int | None = None
        # Φ of evaluation data while fitting, advanced one layer per depth instead of rebuilt:
        # key ("test",) or ("val", batch index) -> (depth, Φ)
        self._eval_phi: dict[tuple, tuple[int, Tensor]] = {}

    @property
    def num_rounds(self) -> int:
        return 2 * self.num_layers + 1

    @property
    def depth(self) -> int:
        """Depth of the latest classifier: W₀ after round 1, W_t after round 2t + 1."""
        return max(self.round - 1, 0) // 2

    def _round_plan(self) -> tuple[int, bool]:
        """(t, whether this round solves Ω_t): round 2t − 1 solves Ω_t, round 2t solves W_t."""
        return (self.round + 1) // 2, self.round % 2 == 1

    def setup_problem(self, feature_dim: int, num_classes: int, num_clients: int) -> None:
        h, f, layers = self.hidden_dim, self.block_dim, self.num_layers
        # Buffers, so that a checkpoint restores the model; the random ones are rebuilt from the
        # seed here and only overwritten by identical values.
        input_weight, input_bias = random_layer(self.seed, 0, feature_dim, h, self.stat_dtype)
        block_weight = torch.empty(layers, h, f, dtype=self.stat_dtype)
        block_bias = torch.empty(layers, f, dtype=self.stat_dtype)
        for t in range(1, layers + 1):
            block_weight[t - 1], block_bias[t - 1] = random_layer(self.seed, t, h, f, self.stat_dtype)
        self.register_buffer("input_weight", input_weight)  # A₀ (d, h)
        self.register_buffer("input_bias", input_bias)      # a₀ (h,)
        self.register_buffer("block_weight", block_weight)  # B_t (T, h, f), t = 1..T
        self.register_buffer("block_bias", block_bias)      # b_t (T, f)
        self.register_buffer("omega", torch.zeros(layers, f, h, dtype=self.stat_dtype))  # Ω_t (T, f, h)
        self.register_buffer("classifier",  # W_t (T + 1, h, C), t = 0..T
                             torch.zeros(layers + 1, h, num_classes, dtype=self.stat_dtype))

    # ---- the network ----------------------------------------------------------------------
    def input_features(self, features: Tensor) -> Tensor:
        """Φ₀ = tanh(X A₀ + a₀): (n, d) -> (n, h)."""
        x = features.to(self.stat_dtype)
        return torch.tanh(torch.addmm(self.input_bias, x, self.input_weight))

    def block_features(self, phi: Tensor, layer: int) -> Tensor:
        """F_t = σ(Φ_{t−1} B_t + b_t) for t = `layer` ≥ 1: (n, h) -> (n, f)."""
        weight, bias = self.block_weight[layer - 1], self.block_bias[layer - 1]
        return self.activation(torch.addmm(bias, phi, weight))

    def next_features(self, phi: Tensor, layer: int) -> Tensor:
        """Φ_t = Φ_{t−1} + F_t Ω_t for t = `layer` ≥ 1: (n, h) -> (n, h)."""
        return torch.addmm(phi, self.block_features(phi, layer), self.omega[layer - 1])

    def features_at_depth(self, features: Tensor, depth: int) -> Tensor:
        """Φ_depth from backbone features: (n, d) -> (n, h)."""
        phi = self.input_features(features)
        for layer in range(1, depth + 1):
            phi = self.next_features(phi, layer)
        return phi

    def forward(self, features: Tensor) -> Tensor:
        """Logits of the latest depth, Φ_t W_t: (n, d) -> (n, C)."""
        return self.features_at_depth(features, self.depth) @ self.classifier[self.depth]

    # ---- clients ----------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        super().on_fit_start()
        # Φ_{t−1} of every training sample (n × h in `dtype`), so that a round costs one layer
        # per sample instead of t: batches are the same in every round (`sample_index`).
        num_samples = len(self.trainer.datamodule.train_labels)
        self._train_phi = torch.empty(num_samples, self.hidden_dim, dtype=self.stat_dtype,
                                      device=self.device)
        self._train_phi_depth = None  # filled by the next round (or rebuilt, on a resumed fit)
        self.depth_accuracy = []

    def on_train_end(self) -> None:
        self._train_phi, self._train_phi_depth = None, None  # only needed while fitting
        self._eval_phi = {}

    def _previous_features(self, batch: ClientBatch, depth: int) -> Tensor:
        """Φ_depth of the batch's samples: from the cache, or rebuilt when a fit was resumed."""
        if self._train_phi_depth == depth:
            return self._train_phi[batch.sample_index]
        phi = self.features_at_depth(batch.features, depth)
        self._train_phi[batch.sample_index] = phi
        return phi

    def client_step(self, batch: ClientBatch) -> dict[str, Tensor]:
        layer, solves_omega = self._round_plan()
        if self.round == 0:
            phi = self.input_features(batch.features)
        else:
            phi_previous = self._previous_features(batch, layer - 1)
            hidden = self.block_features(phi_previous, layer)
            if solves_omega:  # FᵀF and FᵀR with R = Y − Φ_{t−1} W_{t−1}
                predicted = phi_previous @ self.classifier[layer - 1]
                return {"hidden_gram": hidden.T @ hidden,
                        "hidden_residual": class_sums(hidden, batch.labels, self.num_classes)
                        - hidden.T @ predicted}
            phi = torch.addmm(phi_previous, hidden, self.omega[layer - 1])
        self._train_phi[batch.sample_index] = phi
        return {"gram": phi.T @ phi, "cross": class_sums(phi, batch.labels, self.num_classes)}

    # ---- server -----------------------------------------------------------------------------
    def server_step(self, uploads: dict[str, Tensor], num_clients: int) -> dict[str, Tensor]:
        layer, solves_omega = self._round_plan()
        if solves_omega:
            self.omega[layer - 1] = solve_omega(uploads["hidden_gram"], uploads["hidden_residual"],
                                                self.classifier[layer - 1], self.gamma_s)
            self._train_phi_depth = layer - 1
            return {"omega": self.omega[layer - 1]}
        gram = uploads["gram"] + self.gamma * identity_like(uploads["gram"])
        self.classifier[layer] = solve_spd(gram, uploads["cross"],
                                           what=f"DeepAFL's Gram matrix at depth {layer}")
        self._train_phi_depth = layer
        broadcast = {"classifier": self.classifier[layer]}
        if self.round == 0:  # the random layers travel as their seed (SEED_BYTES), once
            broadcast["seed"] = torch.tensor(self.seed, dtype=torch.int64)
        return broadcast

    # ---- accuracy at every depth ------------------------------------------------------------
    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()
        if self.round % 2 == 1:  # a classifier W_t was just solved
            self._log_depth(self.depth)

    def _evaluation_features(self, key: tuple, features: Tensor, depth: int) -> Tensor:
        """Φ_depth of evaluation data (n, d) -> (n, h), one layer on from the previous depth's
        Φ when it is kept under `key`: evaluating every depth costs T layers, not T²/2."""
        kept_depth, phi = self._eval_phi.get(key, (None, None))
        if kept_depth != depth:
            phi = (self.next_features(phi, depth) if depth > 0 and kept_depth == depth - 1
                   else self.features_at_depth(features, depth))
            self._eval_phi[key] = (depth, phi)
        return phi

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        if self.round == 0 or self.trainer.state.fn != "fit":  # `validate` after a fit: no cache
            return super().validation_step(batch, batch_idx)
        phi = self._evaluation_features(("val", batch_idx), batch["features"], self.depth)
        self._evaluate(batch, self.val_acc, "val/acc", logits=phi @ self.classifier[self.depth])

    @torch.no_grad()
    def _log_depth(self, depth: int) -> None:
        """Test accuracy of depth `depth`, advancing the test set's Φ by one layer."""
        data = self.trainer.datamodule
        if getattr(data, "test_features", None) is None:
            return
        phi = self._evaluation_features(("test",), data.test_features.to(self.device), depth)
        predicted = (phi @ self.classifier[depth]).argmax(dim=1)
        accuracy = float((predicted == data.test_labels.to(self.device)).double().mean())
        self.depth_accuracy.append(accuracy)
        metrics = {"depth/test_acc": accuracy, "depth/depth": float(depth),
                   "depth/bytes_up": self.fit_metrics["comm/bytes_up"]}
        for logger in self.loggers:
            logger.log_metrics(metrics, step=depth)
