"""The method contract: a server half, a client half, and the uploads between them.

A federated method is two pieces of code that only talk through messages:

- the **server half**, `FederatedMethod` (a plain `nn.Module`, its buffers the global model):
  `plan_round` decides who takes part in the round and what they receive (the broadcast);
  `server_update` turns the round's aggregated uploads into the next global model;
  `final_broadcast` is what every client receives once the last round is done (the model it
  predicts with); `forward` gives the global model's logits.
- the **client half**, a `ClientHalf` made by `method.client_half()` from the method's settings
  (never from its learned state): `client_update(round, broadcast, cohort)` computes the
  cohort's uploads from the broadcast, the cohort's own data and the clients' **own state kept
  across rounds** (the half's buffers: DeepAFL's Φ, Ditto's personal heads, error feedback,
  SCAFFOLD's control variates). `finish` is local work after the final broadcast (AnaPFL's
  residual branch); `predict` scores samples under each client's own model (personalized methods).
- the **upload spec**, `method.uploads` (`workbench.federation.codec.Upload`): for each named
  upload whether the clients' copies are summed or stacked (one row per client, in client order),
  whether it is a symmetric matrix sent as its upper triangle, whether it is the clients' model
  update (one row per client from the half; the protocol clips it under client-level DP, then sums
  it), and how one client's copy is encoded on the wire. The protocol layer (`workbench.federation`)
  reads it to count bytes, pack messages for a transport, clip, mask and noise: a method declares,
  the protocol applies.

A cohort is one or many **whole** clients; `client_update` must return exactly the sum (or the
client-ordered stack, or for model updates the client-ordered rows) of what one-client calls
return: in process one call runs every client of a round, vectorized; under Flower each ClientApp
calls it for its own client; with several processes each process calls it for its clients. The
engines (`workbench.engines`) move the messages, the protocol (`workbench.federation`: dropouts,
clipping, secure aggregation, noise) acts on them, and a method never imports an engine.

Client state lives in the client half's buffers, one slot per client it serves
(`client_slots`): in process one half serves every client, under Flower each node's half serves
one. Per-sample state is indexed by `cohort.sample_index`, positions in the data the half serves.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from lightning.pytorch.core.mixins import HyperparametersMixin
from torch import Tensor, nn

from workbench.federation.codec import GRAM, MODEL_UPDATE, STACKED, SUMMED, SYMMETRIC, Upload
from workbench.federation.protocol import Federation, ProtocolView

if TYPE_CHECKING:
    from workbench.data.population import Population

__all__ = ["GRAM", "MODEL_UPDATE", "STACKED", "SUMMED", "SYMMETRIC", "ClientHalf", "Cohort", "FederatedMethod",
           "Problem", "RoundPlan", "Upload"]


EVAL_ROWS = 1 << 14  # rows a global model scores at once (`FederatedMethod.accuracy`)


@dataclass(frozen=True)
class Problem:
    """The shape of a federated problem: one input's shape, classes, clients.

    tail: the pretrained layers the inputs still pass through before they are features
    (`data.trainable_tail`: the backbone's last stages, (n, C, H, W) -> (n, d)), which the
    gradient methods' `architecture: tail` trains; None for inputs that are features already. The
    data module's own module (one object, compared by identity): models copy it.
    """

    input_shape: tuple[int, ...]
    num_classes: int
    num_clients: int
    tail: nn.Module | None = None

    @classmethod
    def of(cls, data: Population) -> Problem:
        """The problem of a population: its input shape, classes, clients and tail."""
        return cls(data.input_shape, data.num_classes, data.num_clients, data.tail)

    @property
    def feature_dim(self) -> int:
        return int(torch.Size(self.input_shape).numel())


@dataclass(frozen=True)
class Cohort:
    """The training data of one or more whole clients.

    features: (n, *input_shape); labels: (n,) int64; client_ids: (n,) int64, ordered by client;
    clients: (m,) sorted ids of the cohort's clients (a client may hold no rows);
    sample_index: (n,) positions of the rows in the data the client half serves (per-sample state);
    batch_size: rows per chunk where a client computes in chunks to bound its memory.
    """

    features: Tensor
    labels: Tensor
    client_ids: Tensor
    clients: Tensor
    sample_index: Tensor
    batch_size: int = 1 << 14

    def __len__(self) -> int:
        return len(self.labels)

    def batches(self) -> Iterator[Cohort]:
        """The rows in chunks of `batch_size` (a client may span two chunks: for sums only)."""
        for start in range(0, len(self), self.batch_size):
            rows = slice(start, start + self.batch_size)
            yield replace(self, features=self.features[rows], labels=self.labels[rows],
                          client_ids=self.client_ids[rows], sample_index=self.sample_index[rows])

    def holds_per_batch(self, *conditions: Tensor) -> list[tuple[bool, ...]]:
        """For each chunk of `batches()`, whether each of `conditions` (one bool per row) holds on
        all its rows: read from the device at once (one wait a call, not one a chunk)."""
        if not len(self):
            return []
        table = torch.stack([torch.stack([part.all() for part in condition.split(self.batch_size)])
                             for condition in conditions], 1)
        return [tuple(row) for row in table.tolist()]

    def of(self, clients: Tensor) -> Cohort:
        """The sub-cohort of `clients` (sorted ids among this cohort's)."""
        rows = torch.isin(self.client_ids, clients)
        return replace(self, features=self.features[rows], labels=self.labels[rows],
                       client_ids=self.client_ids[rows], clients=clients, sample_index=self.sample_index[rows])


@dataclass
class RoundPlan:
    """The server's decision for one round: who is asked to take part, and what they receive.

    clients: (m,) sorted ids; broadcast: named tensors every one of them receives.
    """

    clients: Tensor
    broadcast: dict[str, Tensor] = field(default_factory=dict)


Uploads = dict[str, Tensor]
Metrics = dict[str, float]


class ClientHalf(nn.Module):
    """The clients' code and their state. One object serves a set of clients (`setup_clients`).

    Subclasses implement `client_update` and, where clients keep state, allocate it in
    `setup_state` with a leading axis of `num_served` clients (index it with `client_slots`) or of
    `num_samples` rows (index it with `cohort.sample_index`).
    """

    def __init__(self, problem: Problem) -> None:
        super().__init__()
        self.problem = problem
        self.num_classes, self.num_clients = problem.num_classes, problem.num_clients
        self.input_shape = problem.input_shape
        self.register_buffer("served", torch.zeros(0, dtype=torch.long), persistent=False)
        # what the protocol's stages keep per client (the compressor's error feedback), by stage:
        # set by the transport (`Pipeline.keep_state`), checkpointed and kept by a node like the rest
        self.protocol_state = nn.ModuleDict()

    def setup_clients(self, served: Tensor, num_samples: int) -> None:
        """Serve the clients `served` (sorted ids) holding `num_samples` training rows in all."""
        self.served = served.to(torch.long)
        self.num_served, self.num_samples = len(served), num_samples
        self.setup_state()

    def setup_state(self) -> None:
        """Allocate the clients' state (buffers) for `num_served` clients / `num_samples` rows."""

    def client_slots(self, clients: Tensor) -> Tensor:
        """Slots (positions among the served clients) of `clients` (m,) -> (m,)."""
        return torch.searchsorted(self.served.to(clients.device), clients)

    def served_slots(self, client_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Slots of `client_ids` (n,) that may name clients this half does not serve (another
        process's, or one without training data), and whether each is served: (n,), (n,) bool;
        an unserved id gets slot 0 and False."""
        if self.num_served == 0:
            return torch.zeros_like(client_ids), torch.zeros_like(client_ids, dtype=torch.bool)
        slots = self.client_slots(client_ids).clamp(max=self.num_served - 1)
        return slots, self.served.to(client_ids.device)[slots] == client_ids

    def client_update(self, round_index: int, broadcast: Mapping[str, Tensor],
                      cohort: Cohort) -> tuple[Uploads, Metrics]:
        """The cohort's uploads (summed / stacked over its clients, as `uploads` says) and metric
        sums over its clients (the engine reports their mean over the round's clients)."""
        raise NotImplementedError

    def finish(self, broadcast: Mapping[str, Tensor], cohort: Cohort) -> Metrics:
        """Local work of every client after the final broadcast, sending nothing; metric sums."""
        return {}

    def predict(self, features: Tensor, client_ids: Tensor) -> Tensor:
        """Logits of each sample under its own client's model: (n, *input_shape), (n,) -> (n, C).
        Only personalized methods implement it."""
        raise NotImplementedError(f"{type(self).__name__} keeps no personal model")


class FederatedMethod(HyperparametersMixin, nn.Module):
    """The server half of a federated method: the global model and its round logic.

    Subclasses set `uploads`, implement `setup_problem`, `client_half`, `server_update`,
    `forward` and, where they differ from the defaults, `num_rounds`, `plan_round`/`broadcast`
    and `final_broadcast`. `rounds_done` counts the finished rounds (a buffer: checkpoints and
    resumed fits keep it), advanced by `finish_round`; `finished` is set by `mark_fitted` once the
    final broadcast went out (`fitted`). The engines call those two, never write the buffers.
    A method with `num_rounds = 0` (local-only training) only has the final step.
    """

    uploads: Mapping[str, Upload] = MappingProxyType({})
    #: clients predict with models of their own (`ClientHalf.predict`); `test/acc_local_*`
    personalized: bool = False
    #: the personal models exist after every round, not only after the final broadcast
    #: (`ClientHalf.finish`): the learning curve scores them along the rounds (Ditto's)
    personal_every_round: bool = False
    #: the server holds a model of the whole population (`forward`, `test/acc`)
    global_model: bool = True
    #: fits on feature vectors (n, d) only, as the analytic methods' statistics are of rows
    needs_feature_vectors: bool = True
    #: settings only the server's solve after the last round reads (the clients never do): a fitted
    #: model takes other values of them by `resolve`, so a grid over them costs one fit
    server_settings: tuple[str, ...] = ()
    _forgot_clients: bool = False  # some clients came back afresh (`forget_clients`)

    rounds_done: Tensor  # () int64
    finished: Tensor  # () bool

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rounds_done", torch.zeros((), dtype=torch.long))
        self.register_buffer("finished", torch.zeros((), dtype=torch.bool))  # rounds and final broadcast done
        self.problem: Problem | None = None
        self._protocol = ProtocolView()  # what it knows of the protocol it runs under (`run_under`)

    # ---- the protocol it runs under ---------------------------------------------------------
    def run_under(self, protocol: ProtocolView) -> None:
        """The protocol's read-only view for this fit, given by the protocol once it has checked
        the fit (`FitProtocol.check`); the method reads it, never changes it."""
        if not isinstance(protocol, ProtocolView):
            raise TypeError(f"a method runs under a workbench.federation.ProtocolView, got {type(protocol).__name__}")
        self._protocol = protocol

    @property
    def protocol(self) -> ProtocolView:
        """What it knows of the protocol it runs under (default: none of the protocol's parts)."""
        return self._protocol

    @property
    def federation(self) -> Federation:
        """The federation's settings (read-only: e.g. dp_sigma, to explain a failed solve)."""
        return self._protocol.federation

    @property
    def clients_may_go_missing(self) -> bool:
        """Its clients can miss a round without notice (a lost Flower node): a method whose server
        keeps sums across rounds asks for them again (DeepAFL's `restate`)."""
        return self._protocol.clients_may_go_missing

    @property
    def participation_varies(self) -> bool:
        """More than `federation` decides who takes part each round (systems profiles: a deadline's
        stragglers, over-selection, clients offline; the screen's rejections): as under cohorts, the
        clients of one round are not those of the last, and a client may have missed broadcasts."""
        return self._protocol.participation_varies

    # ---- to implement ---------------------------------------------------------------------
    @property
    def num_rounds(self) -> int:
        """Communication rounds of a full fit."""
        return 1

    def setup_problem(self, problem: Problem) -> None:
        """Allocate the global model once the data's shape is known (before any checkpoint restore)."""

    def client_half(self) -> ClientHalf:
        """A fresh client half built from this method's settings (not its learned state)."""
        raise NotImplementedError

    def plan_round(self, available: Tensor) -> RoundPlan:
        """Round `self.round`'s participants among `available` (sorted ids of the clients with
        training data) and their broadcast. Default: every available client, `broadcast()`."""
        return RoundPlan(available, self.broadcast())

    def broadcast(self) -> dict[str, Tensor]:
        """What the clients need for round `self.round` (default nothing)."""
        return {}

    def server_update(self, uploads: Uploads, num_clients: float) -> Metrics:
        """Solve or step from the round's aggregated uploads (from `num_clients` clients: the
        expected cohort, not a count, under client-level DP with Poisson sampling); returns metrics
        to log with the round."""
        raise NotImplementedError

    def final_broadcast(self) -> dict[str, Tensor]:
        """What every client receives after the last round: the model it uses."""
        return {}

    def forward(self, features: Tensor) -> Tensor:
        raise NotImplementedError

    # ---- optional ---------------------------------------------------------------------------
    def check_protocol(self, federation: Federation) -> None:
        """Refuse, in one error naming the fix, a protocol this method cannot run (checked before
        the run folder exists); the engine checks what holds for every method."""

    def check_data(self, data: Population) -> None:
        """Refuse, in one error naming the fix, training data this method cannot fit (checked
        before the run folder exists)."""

    def statistics_sensitivity(self, feature_norm: float) -> float | None:
        """The L2 sensitivity of one round's summed statistics to one sample whose feature row has
        norm ≤ B (`federation.feature_clip`; 0: rows not clipped), for `privacy/epsilon` under
        `dp_sigma`; None: not stated."""
        return None

    def resolve(self, **settings: float) -> None:
        """This fitted model as a fit with other values of some `server_settings` gives it: the server
        solves again from the statistics it kept, no client takes part (the settings are recorded
        in the hyperparameters)."""
        if unknown := sorted(set(settings) - set(self.server_settings)):
            allowed = ", ".join(self.server_settings) or "none"
            raise ValueError(f"{type(self).__name__} cannot resolve {unknown}: the clients read them, or the fit "
                             f"depends on them beyond the last solve (settings it resolves: {allowed})")
        self.require_fitted()
        self.solve_again(settings)
        for name, value in settings.items():
            if name in self.hparams:
                self.hparams[name] = value

    def solve_again(self, settings: Mapping[str, float]) -> None:
        """Set `settings` (checked by `resolve`) and solve again from the kept statistics."""
        raise NotImplementedError

    def head_logits(self, features: Tensor) -> dict[str, Tensor]:
        """Logits of further heads to score at test time as `test/acc/<name>` (default none)."""
        return {}

    def step_metrics(self, test_features: Tensor | None, test_labels: Tensor | None,
                     fit_metrics: Metrics) -> list[tuple[int, Metrics]]:
        """After a round: metrics to log against a step of the method's own, as (step, metrics)
        pairs — DeepAFL's accuracy by depth, GH-OFL's heads' loss by training epoch. Gets the
        global test split (None where the data has none) and the fit's running `comm/*` numbers."""
        return []

    def logits(self, features: Tensor, cache_key: tuple | None = None) -> Tensor:
        """The global model's logits of evaluation data; `cache_key` names the data (e.g. a
        validation batch, or ("test_batch", i) in the test pass) for methods that advance a kept
        representation, or keep what their fit computed, instead of recomputing."""
        return self(features)

    @torch.no_grad()
    def accuracy(self, features: Tensor, labels: Tensor, name: str = "test") -> float:
        """The global model's accuracy on (n, *input_shape), (n,), in chunks of `EVAL_ROWS` rows
        (chunk i of the data `name` is `logits`' cache_key (name, i): a method that keeps a
        representation across rounds advances it instead of recomputing it)."""
        correct = sum(int((self.logits(part, cache_key=(name, i)).argmax(dim=1) == part_labels).sum())
                      for i, (part, part_labels) in enumerate(zip(features.split(EVAL_ROWS),
                                                                  labels.split(EVAL_ROWS), strict=True)))
        return correct / max(len(labels), 1)

    def before_restore(self, state: Mapping[str, Tensor]) -> None:
        """Reshape buffers whose shapes a fit finds (e.g. GH-OFL's Fisher subspace) to `state`'s."""

    def check_missing(self, round_index: int) -> None:
        """Raise, naming the fix, when round `round_index` cannot be solved exactly without clients
        that were asked and never replied (lost nodes); default: it can, on those that replied."""

    def forget_clients(self, clients: Tensor) -> None:
        """`clients` (m,) are back after missing rounds, on new nodes (their client state the
        initial one) or their own (as it was when they went away): what the server assumed they
        kept from its broadcasts may be gone or stale. From then on `clients_missed_broadcasts`
        holds (what they need comes again); a method that tracks what each client holds forgets
        theirs (DeepAFL's Ω_t)."""
        self._forgot_clients = True

    @property
    def clients_missed_broadcasts(self) -> bool:
        """Whether a client may lack what earlier broadcasts carried: under cohorts, or back afresh
        on a new node (`forget_clients`); a broadcast then carries it again."""
        return self.samples_cohorts or self._forgot_clients

    @property
    def samples_cohorts(self) -> bool:
        """Whether rounds take cohorts (`federation.sample_rate` < 1, or systems profiles deciding who
        takes part): a client may then have missed earlier broadcasts, so what it needs from them must
        come again."""
        return self.federation.sample_rate < 1 or self.participation_varies

    # ---- state ------------------------------------------------------------------------------
    @property
    def clips_updates(self) -> bool:
        """Whether its clients upload a model update (`Upload(model_update=True)`), which client-level
        DP (`federation.dp_clip`) clips."""
        return any(upload.model_update for upload in self.uploads.values())

    def finish_round(self, uploads: Uploads, num_clients: float) -> Metrics:
        """`server_update` on the round's aggregate, then the round counted."""
        metrics = self.server_update(uploads, num_clients)
        self.rounds_done += 1
        return metrics

    def mark_fitted(self) -> None:
        """Every round done and the final broadcast delivered."""
        self.finished.fill_(True)

    @property
    def round(self) -> int:
        """Index of the current round, 0-based."""
        return int(self.rounds_done)

    @property
    def has_model(self) -> bool:
        """Whether the rounds done so far give a model to score (validation during a fit)."""
        return self.round > 0

    @property
    def rounds_left(self) -> bool:
        return self.round < self.num_rounds

    @property
    def fitted(self) -> bool:
        """Every round done and the final model delivered to the clients."""
        return bool(self.finished)

    def setup(self, problem: Problem) -> bool:
        """Set up for `problem` unless already set up for it (a fitted model stays); True if new."""
        if problem == self.problem:
            return False
        if self.needs_feature_vectors and problem.tail is not None:
            raise ValueError(f"{type(self).__name__} fits on feature vectors, and the data holds the input maps of "
                             f"the backbone's trainable tail {problem.input_shape} (data.trainable_tail): set "
                             "data.trainable_tail=0 for its pooled features, or train the tail with a gradient "
                             "method (architecture: tail)")
        if self.needs_feature_vectors and len(problem.input_shape) != 1:
            raise ValueError(f"{type(self).__name__} fits on feature vectors, and the data holds inputs of shape "
                             f"{problem.input_shape}: use data.inputs=features (a backbone's features)")
        self.problem = problem
        self.input_shape, self.num_classes = problem.input_shape, problem.num_classes
        self.num_clients, self.feature_dim = problem.num_clients, problem.feature_dim
        self.setup_problem(problem)
        return True

    def require_fitted(self) -> None:
        if not self.fitted:
            raise RuntimeError(
                "the model is not fitted: run `fit` first, or pass `--ckpt_path` of a fitted run "
                "to `validate`/`test`")
