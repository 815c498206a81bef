"""What the gradient methods share: a model trained by local SGD on the sampled clients.

FedAvg, FedProx, FedAvgM, Ditto, SCAFFOLD and OS-FED all run round t the same way up to their
upload and their server step:

1. The server samples m = max(1, round(q·K')) of the K' clients with data uniformly without
   replacement (q = `sample_fraction`; the draw is seeded by (seed, t), so a run is
   reproducible) and sends them w_t (w₀ travels as its seed).
2. Each sampled client k trains from w_t on its own data by local minibatch SGD (`local`: a
   `workbench.federation.local_training.LocalTraining`; FedProx adds its proximal pull), all m at
   once in process, vectorized (`local_sgd`), each client shuffling with a stream of its own (the
   same alone on a Flower node).
3. The method's own upload and server step (`client_update`, `server_update`).

The settings: `num_rounds`, `architecture` and `hidden_dim` (the model, `workbench.methods.heads`),
`local` (local training, nested keys on the command line: `--model.local.lr=0.1`),
`sample_fraction`, `server_lr` (η_s, the server's step along the averaged update), `seed`, and
`init_from` (`workbench.methods.analytic_start`: the last layer fitted in closed form, AFL, Fed3R,
FedNCM or LDA, in rounds of its own before these: `--model.init_from.method=AFL`).
A method stores each setting once; its client half reads them from the method (its settings,
never its learned state).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

import torch
from torch import Tensor, nn

from workbench.federation.codec import FLOAT32
from workbench.federation.compression import as_sent
from workbench.federation.local_training import LocalTraining, local_sgd
from workbench.federation.protocol import Federation
from workbench.methods.analytic_start import NO_START, START_UPLOADS, AnalyticStart, activations, head_names, load_head
from workbench.methods.base import ClientHalf, Cohort, FederatedMethod, Metrics, Problem, RoundPlan, Upload, Uploads
from workbench.methods.heads import Architecture, build_model

SAMPLING, MINIBATCHES, SNAPSHOTS, PERSONAL = 0, 1, 2, 3  # the random streams of a round
#: a client's model update, one row per client, sent as float32 whatever the compute dtype (the
#: protocol may compress it: `federation.compression`)
UPDATE = Upload(model_update=True, encoding=FLOAT32)

#: flat settings of workbench 0.2 and where they live now (the command line names the new key)
MOVED_SETTINGS = {
    "local_epochs": "local.epochs", "lr": "local.lr", "local_batch_size": "local.batch_size",
    "lr_schedule": "local.lr_schedule", "lr_final_fraction": "local.lr_final_fraction",
    "lr_step_rounds": "local.lr_step_rounds", "lr_gamma": "local.lr_gamma", "momentum": "local.momentum",
    "weight_decay": "local.weight_decay",
    "grid_size": "snapshot.grid_size", "snapshot_resolution": "snapshot.resolution",
    "cell_scale": "snapshot.cell_scale", "lbfgs_steps": "snapshot.lbfgs_steps",
    "lbfgs_history": "snapshot.lbfgs_history", "match_eps": "snapshot.match_eps",
}
#: the update's compression, a method setting until workbench 0.3, is the protocol's
#: (`federation.compression`, `federation.error_feedback`: the compress stage); OS-FED keeps an
#: error feedback of its own, for its snapshots
MOVED_TO_PROTOCOL = {
    "compression": "federation.compression", "topk_fraction": "federation.compression.topk_fraction",
    "quantize_bits": "federation.compression.quantize_bits",
    "quantize_symmetric": "federation.compression.quantize_symmetric",
    "error_feedback": "federation.error_feedback", "error_feedback_bound": "federation.error_feedback.bound",
    "error_feedback_decay": "federation.error_feedback.decay",
}


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
            for p, part in zip(params, weights.split([p.numel() for p in params]), strict=True):
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


class GradientClient(ClientHalf):
    """The clients of a gradient method: the model as last received (`net`), local SGD from it."""

    def __init__(self, problem: Problem, method: GradientMethod) -> None:
        super().__init__(problem)
        self.local: LocalTraining = method.local
        self.num_rounds, self.seed, self.prox_mu = method.rounds, method.seed, method.prox_mu
        self.start: AnalyticStart = method.init_from
        self.net = method.build_net(problem)  # w₀, rebuilt from the seed
        self.flat = Flat(self.net)
        self.frozen = head_names(self.net) if self.start.fixed_head else ()

    def round_lr(self, round_index: int, lr: float | None = None) -> float:
        """η_t: `lr` (default the local training's) under the schedule at round t."""
        return self.local.round_lr(round_index, self.num_rounds, lr)

    def receive(self, broadcast: Mapping[str, Tensor]) -> None:
        if "weights" in broadcast:
            self.flat.load(broadcast["weights"])

    def local_sgd(self, round_index: int, cohort: Cohort, stream: int = MINIBATCHES, **options) -> dict[str, Tensor]:
        """Local SGD of every cohort client from the received model: {name: (m, *shape)}; the
        step size (`lr`, default the local training's) follows the schedule at this round."""
        local = self.local
        options = {"epochs": local.epochs, "prox_mu": self.prox_mu, "momentum": local.momentum,
                   "weight_decay": local.weight_decay, "frozen": self.frozen, **options,
                   "lr": self.round_lr(round_index, options.get("lr"))}
        features = cohort.features.to(self.dtype)  # the data as stored, the model's precision
        return local_sgd(self.net, features, cohort.labels, cohort.client_ids, cohort.clients,
                         batch_size=local.batch_size, seed=round_seed(self.seed, round_index, stream), **options)

    def client_update(self, round_index: int, broadcast: Mapping[str, Tensor],
                      cohort: Cohort) -> tuple[Uploads, Metrics]:
        """The analytic start's rounds (round index < S), then the method's round index − S."""
        start_rounds = self.start.rounds
        if round_index >= start_rounds:
            return self.train_round(round_index - start_rounds, broadcast, cohort)
        if len(cohort.clients) == 0:
            return {}, {}
        # the net is still w₀ here: the start rounds train nothing
        return self.start.client_update(round_index, self.net, broadcast, cohort, self.num_classes, self.seed), {}

    def train_round(self, round_index: int, broadcast: Mapping[str, Tensor],
                    cohort: Cohort) -> tuple[Uploads, Metrics]:
        """The method's round `round_index`: local SGD from the received w_t, then the method's
        message of each Δw_k (`encode`)."""
        self.receive(broadcast)
        if len(cohort.clients) == 0:
            return {}, {}
        updates = self.flat.vector() - self.flat.flatten(self.local_sgd(round_index, cohort))  # Δw_k: (m, P)
        return self.encode(round_index, cohort, updates)

    def encode(self, round_index: int, cohort: Cohort, updates: Tensor) -> tuple[Uploads, Metrics]:
        """The cohort's messages of their updates Δw (m, P): the updates themselves as they cross
        the wire (float32), one row per client, which the protocol compresses and clips; or a message
        of the method's own."""
        return {"update": as_sent(updates)}, {}

    @property
    def dtype(self) -> torch.dtype:
        """The precision the clients train in (the model's)."""
        return next(self.net.parameters()).dtype


class GradientMethod(FederatedMethod):
    """The server half every gradient method shares (see the module docstring).

    Args:
        num_rounds: R, communication rounds (one Lightning epoch each).
        architecture: `linear` or `mlp` head on features, `cnn` on images (`data.inputs: images`),
            `tail`: the backbone's last stage(s) and a linear head (`data.trainable_tail`).
        hidden_dim: hidden width of the `mlp` head.
        local: local training (`LocalTraining`: epochs, lr, batch_size, lr_schedule, momentum, ...).
        sample_fraction: q, share of the clients sampled each round.
        server_lr: η_s, the step the server takes along the averaged update.
        seed: model initialization, client sampling and minibatch order.
        init_from: the analytic start of the last layer (`AnalyticStart`: method, settings,
            temperatures, holdout_fraction, fixed_head); method `none`: the seeded w₀.
    """

    client_class: type[GradientClient] = GradientClient
    needs_feature_vectors = False  # a cnn trains on images
    prox_mu = 0.0  # FedProx's μ: a proximal pull of local SGD towards w_t
    # the command line names the new key of a setting given the old way
    moved_settings = MappingProxyType({**MOVED_SETTINGS, **MOVED_TO_PROTOCOL})

    # the analytic start's heads, buffers from `setup_problem` where `init_from` is enabled
    start_weight: Tensor  # (width, C)
    start_bias: Tensor  # (C,)
    start_candidate_weight: Tensor  # (width, C)
    start_candidate_bias: Tensor  # (C,)
    start_temperature: Tensor  # ()

    def __init__(self, *, num_rounds: int = 20, architecture: Architecture = "mlp", hidden_dim: int = 256,
                 local: LocalTraining = LocalTraining(), sample_fraction: float = 1.0, server_lr: float = 1.0,
                 seed: int = 0, init_from: AnalyticStart = NO_START) -> None:
        super().__init__()
        if num_rounds < 1 or hidden_dim < 1:
            raise ValueError(f"num_rounds and hidden_dim must be ≥ 1, got {num_rounds} and {hidden_dim}")
        if not isinstance(local, LocalTraining):
            raise TypeError(f"local must be a LocalTraining (epochs, lr, batch_size, ...), got {type(local).__name__}")
        if not server_lr > 0:
            raise ValueError(f"server_lr must be > 0, got {server_lr}")
        if not 0 < sample_fraction <= 1:
            raise ValueError(f"sample_fraction must be in (0, 1], got {sample_fraction}")
        if architecture not in ("linear", "mlp", "cnn", "tail"):
            raise ValueError(f"unknown architecture {architecture!r}; choose linear, mlp, cnn or tail")
        if not isinstance(init_from, AnalyticStart):
            raise TypeError(f"init_from must be an AnalyticStart (method, settings, ...), got "
                            f"{type(init_from).__name__}")
        if init_from.fixed_head and architecture == "linear":
            raise ValueError("init_from.fixed_head keeps the last layer, and a linear model has no other: use "
                             "architecture mlp or cnn, or init_from.fixed_head=false")
        self.save_hyperparameters()  # every constructor argument down the subclass's chain
        self.rounds, self.architecture, self.hidden_dim, self.local = num_rounds, architecture, hidden_dim, local
        self.sample_fraction, self.server_lr, self.seed = sample_fraction, server_lr, seed
        self.init_from = init_from

    @property
    def num_rounds(self) -> int:
        """S + R: the analytic start's rounds, then the method's own."""
        return self.init_from.rounds + self.rounds

    @property
    def gradient_round(self) -> int:
        """The method's own round index: the fit's round less the start's S."""
        return self.round - self.init_from.rounds

    def build_net(self, problem: Problem) -> nn.Module:
        """w₀: the model initialized from the seed (the same on the server and every client)."""
        return build_model(self.architecture, problem.input_shape, problem.num_classes,
                           hidden_dim=self.hidden_dim, seed=self.seed, tail=problem.tail)

    def setup_problem(self, problem: Problem) -> None:
        self.net = self.build_net(problem)
        self.flat = Flat(self.net)
        # the updates' parameter tensors, for a compressor's per-tensor scales
        sizes = tuple(parameter.numel() for parameter in self.net.parameters())
        self.uploads = {name: replace(upload, sizes=sizes) if upload.model_update else upload
                        for name, upload in self.uploads.items()}
        if self.init_from.enabled:  # the start's heads, kept between its rounds (resumable)
            width = activations(self.net, torch.zeros(1, *problem.input_shape), 1).shape[1]
            dtype = self.init_from.stat_dtype
            for name, shape in {"start_weight": (width, problem.num_classes), "start_bias": (problem.num_classes,),
                                "start_candidate_weight": (width, problem.num_classes),
                                "start_candidate_bias": (problem.num_classes,)}.items():
                self.register_buffer(name, torch.zeros(shape, dtype=dtype))
            self.register_buffer("start_temperature", torch.tensor(self.init_from.temperatures[0], dtype=dtype))

    def setup(self, problem: Problem) -> bool:
        new = super().setup(problem)
        if new and self.init_from.enabled:  # the start rounds' uploads beside the method's own
            self.uploads = {**self.uploads, **START_UPLOADS}
        return new

    def client_half(self) -> GradientClient:
        if self.problem is None:
            raise RuntimeError(f"{type(self).__name__} builds its clients once set up for a problem (`setup`)")
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
        order = torch.randperm(len(available), generator=round_generator(self.seed, self.gradient_round, SAMPLING))
        return available[order[:m].to(available.device)].sort().values

    def plan_round(self, available: Tensor) -> RoundPlan:
        if self.round < self.init_from.rounds:  # the start: every client with data
            return RoundPlan(available, self.start_broadcast())
        return RoundPlan(self.sample_clients(available), self.broadcast())

    def check_protocol(self, federation: Federation) -> None:
        if self.sample_fraction < 1 and federation.sample_rate < 1:
            raise ValueError(f"{type(self).__name__}'s sample_fraction and federation.sample_rate would both sample "
                             "clients: set the model's sample_fraction=1 and sample with federation.sample_rate (the "
                             "one the privacy accountant credits)")
        if self.init_from.enabled and (federation.dp_sigma > 0 or federation.client_level_dp):
            raise ValueError("the analytic start's statistics have no differential-privacy accounting yet: set "
                             "model.init_from.method=none, or federation.dp_sigma=0 and federation.dp_clip=0")

    def start_broadcast(self) -> dict[str, Tensor]:
        """Start round 0: w₀ as its seed; round 1: the candidate head whose τ the clients score."""
        if self.round == 0:
            return self.seed_message()
        return {"start_weight": self.start_candidate_weight, "start_bias": self.start_candidate_bias}

    def finish_round(self, uploads: Uploads, num_clients: float) -> Metrics:
        if self.round >= self.init_from.rounds:
            return super().finish_round(uploads, num_clients)
        metrics = self.start_update(uploads)
        self.rounds_done += 1
        return metrics

    def start_update(self, uploads: Uploads) -> Metrics:
        """Start round 0: the head (and the candidate) from the pooled sums; round 1: τ. The last
        layer takes the head / τ after each (the curve scores the analytic head from round 0 on)."""
        assert self.problem is not None  # (set up before any round)
        start, classes, clients = self.init_from, self.problem.num_classes, self.problem.num_clients
        metrics: Metrics = {}
        if self.round == 0:
            self.start_weight, self.start_bias = start.solve(uploads, classes, clients)
            if start.calibrates:
                self.start_candidate_weight, self.start_candidate_bias = start.solve(uploads, classes, clients,
                                                                                      kept=True)
        else:
            temperature, metrics = start.choose_temperature(uploads)
            self.start_temperature.fill_(temperature)
        load_head(self.net, self.start_weight, self.start_bias, float(self.start_temperature))
        return metrics

    def broadcast(self) -> dict[str, Tensor]:
        if self.round == 0:  # w₀ travels as its seed
            return self.seed_message()
        return {"weights": self.flat_parameters()}

    def seed_message(self) -> dict[str, Tensor]:
        """w₀ as its seed (8 bytes): every client rebuilds it."""
        return {"seed": torch.tensor(self.seed, dtype=torch.int64)}

    def final_broadcast(self) -> dict[str, Tensor]:
        return {"weights": self.flat_parameters()}

    def forward(self, features: Tensor) -> Tensor:
        """Logits: (n, *input_shape) -> (n, C)."""
        return self.net(features)
