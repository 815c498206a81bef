"""AnaPFL: analytic personalized federated learning (ECCV 2026): AFL on random features, then
each client's residual fit.

Two random tanh feature maps of the backbone features X (n × d), both h = 1024 wide:

    Hg = tanh(X P_g)       main branch, P_g shared by every client (a seed, never the matrix)
    Hl = tanh(X P_l)       refinement branch, P_l another projection
    P ~ N(0, 1/d) entrywise, so a pre-activation is of the order of the features' RMS (tanh
    stays out of saturation).

Global branch: AFL (regularization intermediary + aggregation, `workbench.methods.afl`) on Hg.
Round 0 broadcasts the seed of P_g (8 bytes); client k uploads `Hg_kᵀHg_k + γI` (packed) and
`Hg_kᵀY_k`; the server solves

    W_g = (Σ_k Hg_kᵀHg_k + γ_out I)⁻¹ Σ_k Hg_kᵀY_k,

ridge on the pooled data whatever the partition, and sends W_g to the clients.

Local branch, on each client once it holds W_g: client k fits the residual of the global branch
on its own refinement features,

    R_k = Y_k − Hg_k W_g,      W_l,k = (Hl_kᵀHl_k + βI)⁻¹ Hl_kᵀR_k = Hl_kᵀ(Hl_kHl_kᵀ + βI)⁻¹R_k,

in the dual form when n_k < h (exact, n_k × n_k instead of h × h; `grouped_ridge`).
Client k predicts `Hg W_g + λ · Hl W_l,k` (`AnaPFLClient.predict`); the server's `forward`
(the global test split, `test/acc`) is `Hg W_g` alone.

λ, one per run (as in the paper), is chosen from the grid `lambdas` by the mean over clients of
the accuracy on a 10% stratified hold-out of each client's training data, with W_l,k fitted on
the other 90%. The hold-out scores are the clients' own and the choice needs all of them, so with
more than one λ it is an **extra communication round**, counted in `comm/rounds` and the bytes:

    round 0   server -> clients: the seed of P_g;     clients -> server: AFL's statistics on Hg
    round 1   server -> clients: W_g;                 clients -> server: Σ_k acc_k(λ) for every λ
              (L numbers) and the number of clients with a hold-out, both summed (secure
              aggregation may hide each client's); the server takes λ = the grid value of the
              best mean Σ_k acc_k(λ) / #clients (ties: the smaller λ)
    final     server -> clients: λ; each client refits W_l,k on all its training data (`finish`).

With a single λ there is nothing to choose: one round, the final broadcast carries W_g and the
clients fit W_l,k on all their data in `finish`. Each client draws its hold-out alone, from the
seed and its own id (`holdout_seed`), so a cohort's hold-outs are its clients' own. W_g is fitted
once, on all the training data, and is the same W_g the final model uses: λ does not enter it,
and a W_g without the hold-out would cost the clients a second upload of the statistics. (So the
hold-out samples are in W_g's training data; with h ≪ N their leverage on W_g is small.)

P_l is one projection the clients draw from a seed of their own (`local_seed`, a setting). It
never needs to agree across clients — each client's model has the same distribution whichever
P_l it draws — so it is neither sent nor counted, and sharing it makes the refinement features
one matmul for every client of a cohort.

Client state (`AnaPFLClient`): the received seed of P_g and W_g, λ, and W_l,k of every served
client. The server keeps W_g (AFL's buffers), λ (`refinement_scale`) and the hold-out scores of
the last fit (`holdout_accuracy`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch
import torch.nn.functional as nnf
from torch import Tensor

from workbench.linalg import grouped_matmul, grouped_ridge, stream_generator
from workbench.methods.afl import AFL, AFLClient
from workbench.methods.base import GRAM, SUMMED, Cohort, Metrics, Problem, Uploads
from workbench.methods.ridge_selection import client_holdout, holdout_seed  # noqa: F401 (holdout_seed: re-exported)

DEFAULT_LAMBDAS = tuple(i / 10 for i in range(11))  # 0, 0.1, ..., 1.0


def gaussian_projection(seed: int, stream: int, fan_in: int, fan_out: int, dtype: torch.dtype) -> Tensor:
    """A seeded N(0, 1/fan_in) matrix (fan_in, fan_out), drawn on the CPU: the same on every machine.

    `stream` separates the projections drawn from one seed (0: P_g, 1: P_l).
    """
    return torch.randn(fan_in, fan_out, generator=stream_generator(seed, stream), dtype=dtype) / fan_in ** 0.5


class AnaPFLClient(AFLClient):
    """Client k of AnaPFL: AFL's statistics of Hg in round 0, the hold-out scores of the λ grid in
    round 1 (more than one λ), its residual branch W_l,k in `finish`; predicts Hg W_g + λ Hl W_l,k.

    State: `main_seed` (the received seed of P_g), `global_weight` W_g (received), `refinement_scale`
    λ, `local_weight` (num_served, h, C) W_l of the served clients.
    """

    main_seed: Tensor  # () int64, −1 until received
    global_weight: Tensor  # (h, C) W_g
    refinement_scale: Tensor  # () λ
    local_weight: Tensor  # (num_served, h, C) W_l

    def __init__(self, problem: Problem, method: AnaPFL) -> None:
        super().__init__(problem, method)
        self.design = self.main_features  # AFL's statistics on Hg, from the received seed
        self.hidden_dim, self.beta, self.stat_dtype = method.hidden_dim, method.beta, method.stat_dtype
        self.lambdas, self.holdout_fraction = list(method.lambdas), method.holdout_fraction
        self.seed, self.local_seed = method.seed, method.local_seed  # the hold-out's and P_l's seeds
        self._projections: dict[tuple, Tensor] = {}
        self._main_seed_host: int | None = None  # `main_seed` as read on the host

    def setup_state(self) -> None:
        device = self.served.device
        self.register_buffer("main_seed", torch.full((), -1, dtype=torch.int64, device=device))
        self._main_seed_host = None
        self.register_buffer("global_weight", torch.zeros(self.hidden_dim, self.num_classes, dtype=self.stat_dtype,
                                                          device=device))
        self.register_buffer("refinement_scale", torch.zeros((), dtype=self.stat_dtype, device=device))
        self.register_buffer("local_weight", torch.zeros(self.num_served, self.hidden_dim, self.num_classes,
                                                         dtype=self.stat_dtype, device=device))

    # ---- the two feature maps ----------------------------------------------------------------
    def _projection(self, seed: int, stream: int, device: torch.device) -> Tensor:
        key = (seed, stream, device)
        if key not in self._projections:  # regenerated from the seed: never saved
            self._projections[key] = gaussian_projection(seed, stream, self.problem.feature_dim, self.hidden_dim,
                                                         self.stat_dtype).to(device)
        return self._projections[key]

    def main_features(self, features: Tensor) -> Tensor:
        """Hg = tanh(X P_g), P_g from the seed the server sent: (n, d) -> (n, h)."""
        if self._main_seed_host is None:  # read from the buffer (on the device) once, not once a chunk
            self._main_seed_host = int(self.main_seed)
        if self._main_seed_host < 0:
            raise RuntimeError("AnaPFL's client has not received the seed of P_g (round 0's broadcast)")
        x = features.flatten(1).to(self.stat_dtype)
        return torch.tanh(x @ self._projection(self._main_seed_host, 0, x.device))

    def _receive_seed(self, broadcast) -> None:
        if "seed" in broadcast:
            self._main_seed_host = int(broadcast["seed"])
            self.main_seed.fill_(self._main_seed_host)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._main_seed_host = None  # a restored `main_seed`: read it again

    def local_features(self, features: Tensor) -> Tensor:
        """Hl = tanh(X P_l), P_l from the clients' own seed: (n, d) -> (n, h)."""
        x = features.flatten(1).to(self.stat_dtype)
        return torch.tanh(x @ self._projection(self.local_seed, 1, x.device))

    # ---- the rounds ----------------------------------------------------------------------------
    def client_update(self, round_index: int, broadcast: Mapping[str, Tensor],
                      cohort: Cohort) -> tuple[Uploads, Metrics]:
        self._receive_seed(broadcast)
        if "weight" in broadcast:
            self.global_weight.copy_(broadcast["weight"])
        if round_index == 0:
            return super().client_update(round_index, broadcast, cohort)
        return self.holdout_scores(cohort), {}

    @torch.no_grad()
    def holdout_scores(self, cohort: Cohort) -> dict[str, Tensor]:
        """Σ over the cohort's clients with a hold-out of their hold-out accuracy under every λ
        (W_l,k fitted on the rest), and how many such clients: {"holdout_accuracy": (L,),
        "holdout_clients": ()}."""
        refinement, residual, position = self._residual_problem(cohort)
        held_out = client_holdout(cohort.labels, cohort.client_ids, cohort.clients, self.holdout_fraction, self.seed)
        kept, m = ~held_out, len(cohort.clients)
        weights = grouped_ridge(refinement[kept], residual[kept], position[kept], m, self.beta)
        labels, where = cohort.labels[held_out], position[held_out]
        global_logits = (nnf.one_hot(cohort.labels, self.num_classes).to(residual) - residual)[held_out]  # Hg W_g
        local_logits = grouped_matmul(refinement[held_out], weights, where)
        scales = torch.tensor(self.lambdas, dtype=residual.dtype, device=residual.device)
        predicted = (global_logits + scales[:, None, None] * local_logits).argmax(dim=2)  # (L, m_held)
        correct = predicted.eq(labels).to(residual.dtype)
        held = torch.bincount(where, minlength=m)
        per_client = correct.new_zeros(len(scales), m).index_add_(1, where, correct)
        accuracy = (per_client[:, held > 0] / held[held > 0]).sum(dim=1)
        return {"holdout_accuracy": accuracy, "holdout_clients": (held > 0).sum().to(residual.dtype)}

    @torch.no_grad()
    def finish(self, broadcast: Mapping[str, Tensor], cohort: Cohort) -> Metrics:
        """W_l,k of every client of the cohort on all its rows, with the final W_g and λ."""
        self._receive_seed(broadcast)
        if "weight" in broadcast:
            self.global_weight.copy_(broadcast["weight"])
        scale = broadcast["lambda"] if "lambda" in broadcast else self.lambdas[0]  # one λ: the setting
        self.refinement_scale.fill_(float(scale))
        refinement, residual, position = self._residual_problem(cohort)
        weights = grouped_ridge(refinement, residual, position, len(cohort.clients), self.beta)
        self.local_weight[self.client_slots(cohort.clients)] = weights.to(self.local_weight)
        return {}

    def _residual_problem(self, cohort: Cohort) -> tuple[Tensor, Tensor, Tensor]:
        """Hl (n, h), R = Y − Hg W_g (n, C), each row's client position in the cohort (n,)."""
        targets = nnf.one_hot(cohort.labels, self.num_classes).to(self.stat_dtype)
        main = torch.cat([self.main_features(chunk) @ self.global_weight
                          for chunk in cohort.features.split(8192)]) if len(cohort) else targets
        return (self.local_features(cohort.features), targets - main,
                torch.searchsorted(cohort.clients, cohort.client_ids))

    def predict(self, features: Tensor, client_ids: Tensor) -> Tensor:
        """Client k's model, Hg W_g + λ · Hl W_l,k: (n, d), (n,) -> (n, C) (a client this half does
        not serve predicts with the global branch)."""
        slots, known = self.served_slots(client_ids)
        local = grouped_matmul(self.local_features(features), self.local_weight, slots) * known[:, None]
        return self.main_features(features) @ self.global_weight + self.refinement_scale * local


class AnaPFL(AFL):
    """Analytic personalized FL: an AFL main branch on random features plus each client's residual fit.

    Args:
        hidden_dim: h, the width of both random feature maps.
        gamma: γ, the regularization each client adds locally to its Gram (RI), removed by the server.
        gamma_out: γ_out, the ridge regularization of the global branch's pooled solve.
        beta: β > 0, the ridge regularization of each client's refinement.
        lambdas: the grid λ is chosen from (values ≥ 0; one value = fixed λ, no hold-out round).
        holdout_fraction: the share of each client's training data (per class) held out to choose λ.
        seed: the shared seed of P_g (sent, 8 bytes); also seeds the clients' hold-out draws.
        local_seed: the seed of P_l (never sent).
        dtype: dtype of the features, statistics and solves (and so of what is sent).

    Buffers: `weight` W_g (h, C) and AFL's pooled statistics; `refinement_scale` λ (a scalar).
    After a fit with more than one λ, `holdout_accuracy[i]` is the mean over clients of the
    hold-out accuracy of `lambdas[i]` (sorted). The personal models are the clients'
    (`AnaPFLClient`).
    """

    personalized = True
    server_settings = ()  # each client's refinement is fit on the global branch: γ_out reaches the clients
    uploads = MappingProxyType({"gram": GRAM, "cross": SUMMED, "holdout_accuracy": SUMMED,
                                "holdout_clients": SUMMED})

    global_projection: Tensor  # (d, h) P_g, from the seed (not saved)
    refinement_scale: Tensor  # () λ

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
        self.save_hyperparameters()
        self.hidden_dim, self.beta, self.holdout_fraction = hidden_dim, beta, holdout_fraction
        self.lambdas = sorted(float(value) for value in lambdas)  # ties go to the smaller λ
        self.seed, self.local_seed = seed, local_seed
        self.holdout_accuracy: Tensor | None = None

    @property
    def num_rounds(self) -> int:
        return 1 if len(self.lambdas) == 1 else 2  # the second: the clients' hold-out scores for λ

    def setup_problem(self, problem: Problem) -> None:
        super().setup_problem(problem)  # W_g: (h, C)
        # regenerated from the seed: neither saved nor sent (the server's copy, for `forward`)
        projection = gaussian_projection(self.seed, 0, problem.feature_dim, self.hidden_dim, self.stat_dtype)
        self.register_buffer("global_projection", projection, persistent=False)
        self.register_buffer("refinement_scale", torch.zeros((), dtype=self.stat_dtype))

    def design_dim(self, problem: Problem) -> int:
        return self.hidden_dim

    def client_half(self) -> AnaPFLClient:
        if self.problem is None:
            raise RuntimeError("AnaPFL builds its clients once set up for a problem (`setup`)")
        return AnaPFLClient(self.problem, self)

    def design(self, features: Tensor) -> Tensor:
        """The main branch's features Hg = tanh(X P_g): (n, d) -> (n, h). AFL fits W_g on them."""
        x = features.flatten(1).to(self.stat_dtype)
        return torch.tanh(x @ self.global_projection)

    # ---- the rounds --------------------------------------------------------------------------
    def broadcast(self) -> dict[str, Tensor]:
        seed = {"seed": torch.tensor(self.seed, dtype=torch.int64)}  # P_g as its seed
        if self.round == 0:
            return seed
        # round 1: W_g, for the clients' hold-out scores (and P_g's seed for a sampled client
        # that missed round 0)
        return {"weight": self.weight, **(seed if self.clients_missed_broadcasts else {})}

    def server_update(self, uploads: Uploads, num_clients: float) -> Metrics:
        if self.round == 0:
            super().server_update(uploads, num_clients)
            if len(self.lambdas) > 1:
                return {}
            self.refinement_scale.fill_(self.lambdas[0])
            return {"anapfl/lambda": self.lambdas[0]}
        clients = float(uploads["holdout_clients"])
        if not clients >= 0.5:
            raise ValueError(
                f"no client has enough data to hold out {self.holdout_fraction:.0%} of a class for choosing "
                "λ; raise holdout_fraction or give lambdas a single value")
        self.holdout_accuracy = (uploads["holdout_accuracy"] / round(clients)).to(self.stat_dtype)
        best = int(self.holdout_accuracy.argmax())  # the first maximum: the smallest such λ
        self.refinement_scale.fill_(self.lambdas[best])
        return {"anapfl/lambda": self.lambdas[best], "anapfl/holdout_acc": float(self.holdout_accuracy[best])}

    def final_broadcast(self) -> dict[str, Tensor]:
        if len(self.lambdas) == 1:
            message = {"weight": self.weight}  # λ is the setting
        else:
            message = {"lambda": self.refinement_scale}  # the clients hold W_g from round 1 ...
        if self.clients_missed_broadcasts:  # ... unless they missed it: W_g and P_g's seed again
            message.update(weight=self.weight, seed=torch.tensor(self.seed, dtype=torch.int64))
        return message

    # forward (AFL's): the global branch Hg W_g, for the global test split.
