"""FedAvg and FedProx: local SGD on the sampled clients, the server averages their updates.

Round t, global model w_t (P parameters), K clients:

1. The server samples m = max(1, round(q·K')) of the K' clients with data uniformly without
   replacement (q = `sample_fraction`; the draw is seeded by (seed, t), so a run is
   reproducible) and sends them w_t (w₀ travels as its seed).
2. Each sampled client k runs `local_epochs` epochs of minibatch SGD (batch B, step η_t)
   from w_t on its own data, minimizing the cross-entropy, plus μ/2 ‖w − w_t‖² for FedProx,
   and gets Δw_k = w_t − w_k. η_t = `lr` by default; `lr_schedule` decays it over the rounds
   (cosine or step, `workbench.federation.local_training.scheduled_lr`: a function of t and R
   only, so every client, in process or on a Flower node, uses the same). `momentum` and
   `weight_decay` act as in `torch.optim.SGD`, the momentum buffer local to the round.
3. It uploads Δw_k (float32, 4·P bytes), or a compressed version (`compression`: `topk`,
   `quantize` or `sign`, see workbench/federation/compression.py) with error feedback:
   g_k = Δw_k + e_k, sent_k = C(g_k), e_k ← g_k − sent_k (optionally bounded or decayed:
   `error_feedback_bound`, `error_feedback_decay`).
4. The server: w_{t+1} = w_t − η_s · (1/m) Σ_k sent_k  (η_s = `server_lr`; 1 is FedAvg).

Under client-level DP (`federation.dp_clip`, workbench/federation/privacy.py) each client clips
sent_k to the broadcast norm C (what is clipped off stays in its error feedback) and sends the
bit ‖sent_k‖ ≤ C; the engine noises the sum, and with Poisson cohorts (`federation.sample_rate`)
the server averages by the fixed E[m] = qK'. The protocol's cohort sampling replaces
`sample_fraction` there (the accountant knows only the protocol's).

Clients are averaged with equal weights, the 1/m Σ_k of OS-FED's recovery, so that every
method here aggregates the same way (weighting by n_k would also send n_k). The m clients
train at once in process, vectorized (`workbench.federation.local_training.local_sgd`), each
client shuffling with a stream of its own (the same alone on a Flower node). The client half
keeps each client's error-feedback residual. With one client, full participation and η_s = 1,
FedAvg is centralized minibatch SGD (tested).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor, nn

from workbench.federation.compression import COMPRESSIONS, ErrorFeedback, build_compressor, check_feedback_guard
from workbench.federation.local_training import check_schedule, local_sgd, scheduled_lr
from workbench.federation.privacy import CLIP_NORM, WITHIN_CLIP, clip_client_updates
from workbench.methods.base import SUMMED, ClientHalf, Cohort, FederatedMethod, Problem, RoundPlan
from workbench.methods.heads import Architecture, build_model

Compression = Literal["none", "topk", "quantize", "sign"]
Schedule = Literal["constant", "cosine", "step"]
SAMPLING, MINIBATCHES, SNAPSHOTS, PERSONAL = 0, 1, 2, 3  # the random streams of a round


def round_generator(seed: int, round_index: int, stream: int) -> torch.Generator:
    """The CPU generator of one random stream of one round (a run is reproducible and resumable)."""
    return torch.Generator().manual_seed(round_seed(seed, round_index, stream))


def round_seed(seed: int, round_index: int, stream: int) -> int:
    """The seed of one random stream of one round."""
    return (seed * 1_000_003 + round_index) * 8 + stream


class Flat:
    """A model's parameters as one flat vector, and back."""

    def __init__(self, net: nn.Module) -> None:
        self.net = net

    def vector(self) -> Tensor:
        """w: (P,)."""
        return torch.cat([p.detach().reshape(-1) for p in self.net.parameters()])

    def load(self, weights: Tensor) -> None:
        """w ← weights (P,)."""
        params = list(self.net.parameters())
        with torch.no_grad():  # in place: the parameters keep their storage (never alias `weights`)
            for p, part in zip(params, weights.split([p.numel() for p in params])):
                p.copy_(part.view_as(p))

    def flatten(self, params: Mapping[str, Tensor]) -> Tensor:
        """Per-client parameter dict {name: (m, *shape)} -> (m, P), in the model's order."""
        return torch.cat([params[name].reshape(len(params[name]), -1)
                          for name, _ in self.net.named_parameters()], 1)

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """(m, P) -> per-client parameter dict {name: (m, *shape)}, views of `flat`."""
        params, start = {}, 0
        for name, p in self.net.named_parameters():
            params[name] = flat[:, start:start + p.numel()].view(len(flat), *p.shape)
            start += p.numel()
        return params


class FedAvgClient(ClientHalf):
    """Clients of FedAvg: local SGD from the broadcast w_t, Δw compressed with error feedback.

    State: the model as last received (`net`), each served client's residual e_k (`feedback`).
    """

    def __init__(self, problem: Problem, method: FedAvg) -> None:
        super().__init__(problem)
        self.settings = method.settings()
        self.net = method.build_net(problem)  # w₀, rebuilt from the seed
        self.flat = Flat(self.net)
        sizes = [p.numel() for p in self.net.parameters()]
        s = self.settings
        self.compressor = build_compressor(s["compression"], sizes, topk_fraction=s["topk_fraction"],
                                           quantize_bits=s["quantize_bits"],
                                           quantize_symmetric=s["quantize_symmetric"])
        self.lossy = s["compression"] != "none" and s["error_feedback"]
        self.clip: dict[str, Tensor] = {}  # the round's clip norm under client-level DP (`receive`)

    def setup_state(self) -> None:
        self.feedback = self.error_feedback() if self.lossy else None

    def error_feedback(self) -> ErrorFeedback:
        """Residuals of the clients that have uploaded, with the method's guard (bound, decay)."""
        s = self.settings
        return ErrorFeedback(self.flat.vector().numel(), bound=s["error_feedback_bound"],
                             decay=s["error_feedback_decay"])

    def round_lr(self, round_index: int, lr: float | None = None) -> float:
        """η_t: `lr` (default the method's) under the schedule at round t."""
        s = self.settings
        return scheduled_lr(s["lr"] if lr is None else lr, round_index, s["num_rounds"], s["lr_schedule"],
                            final_fraction=s["lr_final_fraction"], step_rounds=s["lr_step_rounds"],
                            gamma=s["lr_gamma"])

    def receive(self, broadcast: Mapping[str, Tensor]) -> None:
        if "weights" in broadcast:
            self.flat.load(broadcast["weights"])
        self.clip = {CLIP_NORM: broadcast[CLIP_NORM]} if CLIP_NORM in broadcast else {}  # client-level DP's C

    def local_sgd(self, round_index: int, cohort: Cohort, stream: int = MINIBATCHES, **options) -> dict[str, Tensor]:
        """Local SGD of every cohort client from the received model: {name: (m, *shape)}; the
        step size (`lr`, default the method's) follows the schedule at this round."""
        s = self.settings
        options = {"epochs": s["local_epochs"], "prox_mu": s["prox_mu"], "momentum": s["momentum"],
                   "weight_decay": s["weight_decay"], **options, "lr": self.round_lr(round_index, options.get("lr"))}
        features = cohort.features.to(self.dtype)  # the data as stored, the model's precision
        return local_sgd(self.net, features, cohort.labels, cohort.client_ids, cohort.clients,
                         batch_size=s["local_batch_size"], seed=round_seed(s["seed"], round_index, stream),
                         **options)

    @property
    def dtype(self) -> torch.dtype:
        """The precision the clients train in (the model's)."""
        return next(self.net.parameters()).dtype

    def client_update(self, round_index, broadcast, cohort: Cohort):
        self.receive(broadcast)
        if len(cohort.clients) == 0:
            return {}, {}
        updates = self.flat.vector() - self.flat.flatten(self.local_sgd(round_index, cohort))  # Δw_k: (m, P)
        start = time.perf_counter()
        uploads, metrics = self.encode(round_index, cohort, updates)
        return uploads, {**metrics, "time/compress_s": time.perf_counter() - start}

    def encode(self, round_index: int, cohort: Cohort, updates: Tensor) -> tuple[dict[str, Tensor], dict]:
        """The clients' messages, summed: compressed Δw with error feedback -> {"update": (P,)};
        under client-level DP each client's message clipped to the broadcast norm, and the count of
        those within it (what is clipped off stays in the error feedback)."""
        slots = self.client_slots(cohort.clients)
        target = self.feedback.target(slots, updates) if self.feedback is not None else updates
        clipped, count = clip_client_updates({"update": self.compressor(target)}, self.clip)
        sent = clipped["update"]
        if self.feedback is not None:
            self.feedback.keep(slots, target, sent, updates)
        return {"update": sent.sum(0), **count}, {}


class FedAvg(FederatedMethod):
    """Federated averaging of local SGD updates, optionally compressed.

    Args:
        num_rounds: R, communication rounds (one Lightning epoch each).
        architecture: `linear` or `mlp` head on features, `cnn` on images (`data.inputs: images`).
        hidden_dim: hidden width of the `mlp` head.
        local_epochs: passes of each sampled client over its data per round.
        lr: local SGD step size (at round 0); local_batch_size: local minibatch size B.
        lr_schedule: `constant`, `cosine` (lr → lr_final_fraction · lr over num_rounds) or `step`
            (× lr_gamma every lr_step_rounds rounds).
        momentum, weight_decay: of local SGD (the momentum buffer starts at 0 every round).
        sample_fraction: q, share of the clients sampled each round.
        server_lr: η_s, the step the server takes along the averaged update.
        compression: `none` (float32 Δw), `topk`, `quantize` or `sign` (scaled sign, 1 bit).
        topk_fraction: share of the P entries `topk` keeps; quantize_bits: bits per entry;
        quantize_symmetric: levels symmetric about 0 (contractive) instead of min-max.
        error_feedback: carry each client's compression error to its next upload.
        error_feedback_bound: c, keep ‖e_k‖ ≤ c · ‖Δw_k‖ (None: the plain, unbounded form);
        error_feedback_decay: γ ∈ [0, 1], e ← γ e (1: the plain form).
        seed: model initialization, client sampling and minibatch order.
    """

    uploads = {"update": SUMMED, WITHIN_CLIP: SUMMED}  # the count only under client-level DP
    client_class = FedAvgClient
    clips_updates = True

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
        lr_schedule: Schedule = "constant",
        lr_final_fraction: float = 0.0,
        lr_step_rounds: int = 1,
        lr_gamma: float = 0.1,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        error_feedback_bound: float | None = None,
        error_feedback_decay: float = 1.0,
        quantize_symmetric: bool = False,
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
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {compression!r}; choose one of {', '.join(COMPRESSIONS)}")
        if not 0 < topk_fraction <= 1 or not 1 <= quantize_bits <= 16:
            raise ValueError(
                f"topk_fraction must be in (0, 1] and quantize_bits in 1..16, got "
                f"{topk_fraction} and {quantize_bits}"
            )
        if compression == "quantize" and quantize_symmetric and quantize_bits < 2:
            raise ValueError("symmetric quantization needs quantize_bits ≥ 2; for 1 bit use compression='sign'")
        if compression == "quantize" and not quantize_symmetric and quantize_bits < 4 and error_feedback:
            raise ValueError(f"{quantize_bits}-bit min-max quantization is not contractive (no level at 0), so its "
                             "error feedback can grow without bound: set quantize_symmetric=True "
                             "(or compression='sign' for 1 bit), or error_feedback=False")
        check_schedule(lr_schedule, final_fraction=lr_final_fraction, step_rounds=lr_step_rounds, gamma=lr_gamma,
                       momentum=momentum, weight_decay=weight_decay)
        check_feedback_guard(error_feedback_bound, error_feedback_decay)
        self.save_hyperparameters()
        accepted = inspect.signature(type(self).__init__).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            for key in set(self._hparams) - set(accepted):  # a subclass without some of FedAvg's arguments:
                self._hparams.pop(key)  # a fresh build from its hparams must work
                self._hparams_initial.pop(key, None)
        self.lr_schedule, self.lr_final_fraction = lr_schedule, lr_final_fraction
        self.lr_step_rounds, self.lr_gamma = lr_step_rounds, lr_gamma
        self.momentum, self.weight_decay = momentum, weight_decay
        self.error_feedback_bound, self.error_feedback_decay = error_feedback_bound, error_feedback_decay
        self.rounds, self.architecture, self.hidden_dim = num_rounds, architecture, hidden_dim
        self.local_epochs, self.lr, self.local_batch_size = local_epochs, lr, local_batch_size
        self.sample_fraction, self.server_lr, self.seed = sample_fraction, server_lr, seed
        self.compression, self.topk_fraction = compression, topk_fraction
        self.quantize_bits, self.quantize_symmetric = quantize_bits, quantize_symmetric
        self.use_error_feedback = error_feedback
        self.prox_mu = 0.0  # FedProx sets μ

    @property
    def num_rounds(self) -> int:
        return self.rounds

    def settings(self) -> dict:
        """What the clients need to know of the method (hyperparameters, seeds; no learned state)."""
        return {"local_epochs": self.local_epochs, "lr": self.lr, "local_batch_size": self.local_batch_size,
                "prox_mu": self.prox_mu, "seed": self.seed, "compression": self.compression,
                "topk_fraction": self.topk_fraction, "quantize_bits": self.quantize_bits,
                "quantize_symmetric": self.quantize_symmetric,
                "error_feedback": self.use_error_feedback, "num_rounds": self.rounds,
                "lr_schedule": self.lr_schedule, "lr_final_fraction": self.lr_final_fraction,
                "lr_step_rounds": self.lr_step_rounds, "lr_gamma": self.lr_gamma, "momentum": self.momentum,
                "weight_decay": self.weight_decay, "error_feedback_bound": self.error_feedback_bound,
                "error_feedback_decay": self.error_feedback_decay}

    def build_net(self, problem: Problem) -> nn.Module:
        """w₀: the model initialized from the seed (the same on the server and every client)."""
        return build_model(self.architecture, problem.input_shape, problem.num_classes,
                           hidden_dim=self.hidden_dim, seed=self.seed)

    def setup_problem(self, problem: Problem) -> None:
        self.net = self.build_net(problem)
        self.flat = Flat(self.net)
        sizes = [p.numel() for p in self.net.parameters()]
        self.compressor = build_compressor(self.compression, sizes, topk_fraction=self.topk_fraction,
                                           quantize_bits=self.quantize_bits,
                                           quantize_symmetric=self.quantize_symmetric)

    def client_half(self) -> FedAvgClient:
        return self.client_class(self.problem, self)

    # ---- one round ----------------------------------------------------------------------------
    def flat_parameters(self) -> Tensor:
        """w_t: (P,)."""
        return self.flat.vector()

    def apply_update(self, update: Tensor) -> None:
        """w ← w − η_s · update, update (P,)."""
        self.flat.load(self.flat_parameters() - self.server_lr * update)

    def sample_clients(self, available: Tensor) -> Tensor:
        """(m,) sorted ids of this round's clients: m = max(1, round(q · |available|)) of the
        clients with data, drawn uniformly without replacement, seeded by (seed, round)."""
        m = max(1, round(self.sample_fraction * len(available)))
        order = torch.randperm(len(available), generator=round_generator(self.seed, self.round, SAMPLING))
        return available[order[:m].to(available.device)].sort().values

    def plan_round(self, available: Tensor) -> RoundPlan:
        return RoundPlan(self.sample_clients(available), self.broadcast())

    def broadcast(self) -> dict[str, Tensor]:
        if self.round == 0:  # w₀ travels as its seed
            return {"seed": torch.tensor(self.seed, dtype=torch.int64)}
        return {"weights": self.flat_parameters()}

    def final_broadcast(self) -> dict[str, Tensor]:
        return {"weights": self.flat_parameters()}

    def upload_bytes_per_client(self, upload: Mapping[str, Tensor]) -> int:
        return self.compressor.bytes_per_client() + self.count_bytes()

    def count_bytes(self) -> int:
        """The float32 count of client-level DP's adaptive clipping, sent beside the update."""
        return 4 if self.federation.client_level_dp else 0

    def server_update(self, uploads: dict[str, Tensor], num_clients: int) -> dict[str, float]:
        self.apply_update(uploads["update"] / num_clients)
        return {}

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
