"""One round of a federated method as a plain function: no Lightning, no process group.

    result = run_round(method, transport, protocol, available)

0. **rejoin**: a remote transport's clients served again since the last round (`rejoined()`):
   on a new node (a restarted SuperNode) they start afresh, on their own node they missed the
   broadcasts of the rounds they were away: the method forgets what it assumed they hold
   (`FederatedMethod.forget_clients`), so what they need comes again;
The protocol around the method is the fit's pipeline of stages (`workbench.federation.stages`,
`FitProtocol.pipeline`): its server hooks run here, its client hooks in the clients' step.

1. **plan**: the server half plans round t on the protocol's cohort of the `available` clients
   (`Pipeline.cohort`, then `FederatedMethod.plan_round`): who takes part, and the broadcast;
2. **drop**: the protocol's dropouts of the round (`Pipeline.lost`): those clients
   get the broadcast and compute, but their uploads never arrive; with systems profiles
   (`workbench.federation.systems`), so do the stragglers a deadline or over-selection leaves out;
3. **mask**: under secure aggregation, the round's `SecureAggregator` over the cohort;
4. **move**: the transport runs the clients' step (`Transport.update`: in this process, over
   several processes, over Flower) and returns what reached the server from the survivors; a
   remote transport may name survivors whose replies never came (`Replies.missing`: a node that
   died or missed the round's deadline), which then count as dropped;
5. **combine**: the exact sum unmasked; then the stages' `combine` hooks in order (under the
   screen each client's statistics checked and the rejected dropped from the round, or a robust
   center of the model updates; the server's noise; stages of one's own), the aggregate checked
   finite, and the server half's update (`FederatedMethod.finish_round`);
6. **count**: bytes up as each client's message costs on the wire (`codec`, secure aggregation's
   ring elements), bytes down as the broadcast (and client-level DP's clip norm) to every client of
   the cohort; the clients' and the server's seconds; with systems profiles, the round's simulated
   seconds on the clients' links (`SimulatedClock`).

`run_final` sends the final broadcast to every client and runs their local work. The engines
(`LightningEngine` in process and over Flower, `FederatedDDPStrategy` across processes) call
these two and log what they return.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from workbench.federation import Federation, codec, messages_bytes
from workbench.federation.privacy import CLIP_NORM_BYTES, FitPrivacy
from workbench.federation.protocol import ProtocolView
from workbench.federation.secure_aggregation import SecureAggregator, UploadLayout, secure_aggregator
from workbench.federation.stages import NO_PROTOCOL, Incoming, Pipeline, Setting, Stage
from workbench.federation.systems import EveryClientLate, SimulatedClock, Systems, check_systems
from workbench.methods.base import FederatedMethod, Metrics


@dataclass(frozen=True)
class RoundRequest:
    """What the server sends the round's clients.

    round_index: t; broadcast: the method's message to every client of the cohort;
    survivors, lost: (m,) sorted ids: the clients whose uploads count, and those that compute but
        whose uploads never arrive (dropped);
    spec: the uploads on the wire (the method's, and the protocol's: `Pipeline.wire`);
    secure: the round's secure aggregation (each client masks its own message), or None;
    clip_norm: client-level DP's C (the clients clip their model updates to it), or None;
    pipeline: the fit's protocol, whose client hooks in-process clients run (they check they were
        built under it); a remote node knows of it only what the message carries.
    """

    round_index: int
    broadcast: Mapping[str, Tensor]
    survivors: Tensor
    lost: Tensor
    spec: codec.Spec
    secure: SecureAggregator | None = None
    clip_norm: float | None = None
    pipeline: Pipeline = NO_PROTOCOL


@dataclass
class Replies:
    """What reached the server from one round's surviving clients (of this process, until combined).

    uploads: their combined plain uploads (summed / stacked in client order), or None when masked;
    masked: the ring sum of their masked messages under secure aggregation, else None;
    layout: one client's upload layout (names, shapes, dtypes, as tensors without data), which
        secure aggregation unmasks with;
    metric_sums: the clients' metrics summed over them; client_s: the clients' compute seconds (or
        the server's wait for remote clients); bytes_up: their messages' bytes on the wire;
    missing: survivors whose replies never reached the server (remote transports: the node died,
        stalled past the deadline or is known to be gone), by client id, with why: they are
        dropped from the round, as if they had dropped out after being asked; not_sent: how many of
        the round's clients were not even sent the broadcast (known to be away).
    """

    uploads: dict[str, Tensor] | None = None
    masked: Tensor | None = None
    layout: dict[str, Tensor] | None = None
    metric_sums: dict[str, float] = field(default_factory=dict)
    client_s: float = 0.0
    bytes_up: int = 0
    missing: dict[int, str] = field(default_factory=dict)
    not_sent: int = 0


def layout_of(upload: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An upload's layout: its names, shapes and dtypes (tensors on the meta device, no data)."""
    return {name: torch.empty(value.shape, dtype=value.dtype, device="meta") for name, value in upload.items()}


def add_metrics(total: dict[str, float], metrics: Mapping[str, float]) -> dict[str, float]:
    """`total` += `metrics`, name by name."""
    for name, value in metrics.items():
        total[name] = total.get(name, 0.0) + float(value)
    return total


class Transport(Protocol):
    """Who runs the client halves and carries their messages: `LocalClients` (this process),
    `ProcessClients` (several processes), `FlowerClients` (Flower SuperNodes)."""

    def update(self, request: RoundRequest) -> Replies:
        """Runs the round's client step on the survivors and the lost clients; what reached the
        server from the survivors."""
        ...

    def finish(self, broadcast: Mapping[str, Tensor]) -> tuple[dict[str, float], float]:
        """Every client receives the final broadcast and does its local work: (metric sums over
        the clients, seconds; 0 when no client had work)."""
        ...

    def predict(self, features: Tensor, client_ids: Tensor) -> Tensor:
        """Logits of each sample under its own client's model (personalized methods)."""
        ...


@dataclass(frozen=True)
class Calibration:
    """One client's step of a round, run apart to time it (`Calibrates`): its upload's layout
    (names, shapes, dtypes), its message's bytes on the wire (plain), seconds, training rows."""

    layout: dict[str, Tensor]
    bytes_up: int
    seconds: float
    rows: int


@runtime_checkable
class Calibrates(Protocol):
    """A transport that can time one client's step apart, its clients' state untouched (in-process
    clients): what the simulated clock measures the client step with."""

    def calibrate(self, request: RoundRequest, client: int, repeats: int = 5) -> Calibration:
        ...


@runtime_checkable
class Rejoins(Protocol):
    """A transport whose clients can go missing and come back (Flower's)."""

    def rejoined(self) -> dict[int, bool]:
        """The clients served again since the last call -> whether on a new node (their state
        afresh) rather than their own (its state as it was when they went away)."""
        ...


@dataclass
class RoundResult:
    """What one round did.

    cohort, survivors, lost: (m,) sorted client ids (`lost`: the protocol's dropouts and the
        missing); missing: the survivors whose replies never came, with why (`Replies.missing`);
    uploads: the aggregate the server updated from;
    metrics: the server's, the clients' means over the survivors, the protocol's (`privacy/*`,
        `comm/secagg_*`, `comm/clients_*`);
    client_time_sums: the clients' `time/*` metrics summed over them (totals, not means);
    secagg_costs: secure aggregation's mask streams and share bytes (`SecureAggregator.costs`);
    latency_s: the round's simulated seconds (`SimulatedClock`), None without systems profiles;
    screened_out: the clients the screen rejected for the first time this round (left out from now on).
    """

    round_index: int
    cohort: Tensor
    survivors: Tensor
    lost: Tensor
    uploads: dict[str, Tensor]
    metrics: Metrics
    bytes_up: int
    bytes_down: int
    client_s: float
    server_s: float
    secure_s: float = 0.0
    client_time_sums: dict[str, float] = field(default_factory=dict)
    secagg_costs: dict[str, int] = field(default_factory=dict)
    missing: dict[int, str] = field(default_factory=dict)
    rejoined: dict[int, bool] = field(default_factory=dict)
    latency_s: float | None = None
    screened_out: list[int] = field(default_factory=list)


@dataclass
class FitProtocol:
    """The protocol of one fit: the federation's settings as a pipeline of stages
    (`workbench.federation.stages`), what it was checked against (`setting`), and what it keeps
    across rounds (client-level DP's clip norm, the ε accounting: `FitPrivacy`; the simulated
    clock, if the clients have systems profiles: `SimulatedClock`; the clients the screen rejected)."""

    privacy: FitPrivacy
    pipeline: Pipeline
    setting: Setting
    clock: SimulatedClock | None = None
    #: the clients the screen has rejected in this fit, left out of every later round
    rejected: set[int] = field(default_factory=set)

    @property
    def federation(self) -> Federation:
        """The settings the pipeline was built from."""
        return self.pipeline.federation

    @classmethod
    def start(cls, method: FederatedMethod, federation: Federation, population: int,
              clip_norm: float | None = None, clock: SimulatedClock | None = None,
              in_process: bool = True, remote: bool = False, rejected: Iterable[int] = (),
              stages: Sequence[Stage] = ()) -> FitProtocol:
        """A fit's protocol over `population` clients with data, with the `stages` of one's own
        (the config's `stages:`), once `check` passes; `clip_norm`: a resumed fit's adaptive clip
        norm, `rejected`: the clients its screen had rejected. Refuses a fit over its privacy budget."""
        pipeline, setting = cls.check(method, federation, population, clock.systems if clock is not None else None,
                                      in_process, remote, stages)
        return cls(FitPrivacy(method, federation, population, clip_norm), pipeline, setting, clock, set(rejected))

    @staticmethod
    def check(method: FederatedMethod, federation: Federation, population: int, systems: Systems | None = None,
              in_process: bool = True, remote: bool = False, stages: Sequence[Stage] = ()) -> tuple[Pipeline, Setting]:
        """Refuses, before any round, what `method` cannot run under `federation` and `stages` over
        `population` clients with data, its clients in this process (`in_process`) or on remote
        nodes running code of their own (`remote`: a Flower transport): the method's own refusals
        (`FederatedMethod.check_protocol`), every stage's of the protocol's pipeline
        (`Pipeline.check`: against the method's uploads, K, the population, where the clients run),
        systems settings it cannot honour (`check_systems`). Gives the method its read-only view of
        the protocol (`ProtocolView`): who takes part may vary beyond `federation`'s cohorts (a
        deadline's stragglers, clients offline, the screen's rejections), clients on remote nodes
        may go missing without notice. Returns the pipeline and what it was checked against."""
        pipeline = Pipeline.of(federation, stages)
        method.run_under(ProtocolView(federation, (systems is not None and systems.decides) or federation.screens,
                                      clients_may_go_missing=remote,
                                      statistics_noise=pipeline.statistics_noise(population)))
        method.check_protocol(federation)
        setting = Setting(type(method).__name__, method.uploads, method.num_clients, population, federation,
                          method.statistics_sensitivity(federation.feature_clip), remote)
        pipeline.check(setting)
        if systems is not None:
            check_systems(systems, federation, in_process)
        asked = max(1, round(federation.sample_rate * population))
        cohort = asked - round(federation.dropout * asked)
        if federation.screens and cohort < 3:
            warnings.warn(f"the screen checks each client's scale against the round's median client, and a round "
                          f"here keeps about {max(cohort, 1)}: with fewer than 3 it sees invalid Grams only (raise "
                          "federation.sample_rate)", stacklevel=2)
        return pipeline, setting


def run_round(method: FederatedMethod, transport: Transport, protocol: FitProtocol, available: Tensor) -> RoundResult:
    """Round `method.round` of `method` over `transport` under `protocol`, among the `available`
    clients (sorted ids of the clients with data); the method ends the round updated and counted."""
    federation, privacy, clock, pipeline = protocol.federation, protocol.privacy, protocol.clock, protocol.pipeline
    round_index = method.round
    start = time.perf_counter()
    rejoined = _rejoin(method, transport, available.device)
    if clock is not None:
        available = clock.online(round_index, available)
    sampled = pipeline.cohort(round_index, available)
    target = None
    if clock is not None and clock.systems.over_select > 0:  # ask more, keep the first `target` replies
        target, asked = len(sampled), clock.asked(len(sampled), len(available))
        sampled = pipeline.under(replace(federation, sample_rate=asked / len(available))).cohort(round_index, available)
    plan = method.plan_round(sampled)
    cohort = plan.clients.to(available.device)
    dropped = pipeline.lost(round_index, cohort, method.num_clients)
    spec = pipeline.wire(method.uploads)
    secure = (secure_aggregator(federation, cohort.tolist(), round_index, codec.symmetric_names(spec))
              if federation.secure_aggregation else None)
    request = RoundRequest(round_index, plan.broadcast, cohort[~dropped], cohort[dropped], spec, secure,
                           privacy.clip_norm, pipeline)
    bytes_down = messages_bytes(plan.broadcast) + (CLIP_NORM_BYTES if privacy.clip_norm is not None else 0)
    decided, calibration_s = None, 0.0
    if clock is not None:
        calibration_s = _calibrate(clock, transport, request, cohort, secure)
        if clock.systems.drops_stragglers:  # late replies drop as stragglers
            decided = clock.decide(cohort, ~dropped, target, bytes_down)
            dropped = dropped | decided.stragglers.to(dropped.device)
            request = replace(request, survivors=cohort[~dropped], lost=cohort[dropped])
    survivors, lost = request.survivors, request.lost
    if len(survivors) == 0:
        if decided is not None and bool(decided.stragglers.any()):
            raise EveryClientLate(f"every client of round {round_index} missed systems.deadline_s = "
                               f"{clock.systems.deadline_s} s (simulated; the first would reply after "  # type: ignore[union-attr]
                               f"{decided.first_s:.3g} s): raise the deadline")
        raise RuntimeError(f"every client dropped out of round {round_index} (federation.dropout = "
                           f"{federation.dropout}, sample_rate = {federation.sample_rate}): lower the dropout "
                           "or raise the sample rate")
    server_s = time.perf_counter() - start - calibration_s

    replies = transport.update(request)
    if replies.missing:  # their uploads never came: dropped after being asked, as the protocol's dropouts
        method.check_missing(round_index)
        missing = torch.tensor(sorted(replies.missing), dtype=survivors.dtype, device=survivors.device)
        survivors, lost = survivors[~torch.isin(survivors, missing)], torch.sort(torch.cat([lost, missing])).values
        if len(survivors) == 0:
            raise RuntimeError(f"round {round_index}: no client's reply reached the server ("
                               f"{_named(replies.missing)}); the fit cannot go on without any")

    start = time.perf_counter()
    secure_s = 0.0
    if secure is not None:  # the exact sum of the survivors' uploads, from the ring sum of their messages
        if secure.layout is None:  # no survivor was masked here (a remote transport, another process's clients)
            if replies.layout is None:
                raise RuntimeError(f"round {round_index}: no masked upload reached the server to unmask")
            secure.layout = UploadLayout(replies.layout, secure.symmetric)
        total = replies.masked if replies.masked is not None else torch.zeros(secure.layout.length, dtype=torch.int64)
        try:
            unmasked = secure.unmask(total, uploaded=survivors.tolist())
        except RuntimeError as error:
            if decided is not None and bool(decided.stragglers.any()):
                raise RuntimeError(f"{error} — {int(decided.stragglers.sum())} of this round's clients were "
                                   f"stragglers past systems.deadline_s = {clock.systems.deadline_s} s "  # type: ignore[union-attr]
                                   "(simulated): raise the deadline, or set secure_aggregation_graph=complete"
                                   ) from None
            if not replies.missing:
                raise
            raise RuntimeError(f"{error}; lost this round: {_named(replies.missing)}") from None
        uploads = {name: value.to(cohort.device) for name, value in unmasked.items()}
        secure_s = time.perf_counter() - start
    else:
        uploads = replies.uploads or {}
    replied = survivors
    combined = pipeline.combine(Incoming(round_index, uploads, spec, method.uploads, survivors, privacy,
                                         protocol.setting, protocol.rejected))  # screened or robust, then noised
    uploads, survivors, rejected = combined.uploads, combined.survivors, combined.rejected
    if rejected is not None:  # the screen's rejected are dropped (from now on)
        lost = torch.sort(torch.cat([lost, rejected])).values
    check_finite_uploads(uploads, round_index, type(method).__name__, survivors)
    server_metrics = method.finish_round(uploads, privacy.denominator(len(survivors)))
    server_s += time.perf_counter() - start - secure_s

    client_means: dict[str, float] = {}
    client_times: dict[str, float] = {}
    for name, value in replies.metric_sums.items():  # means over the clients that replied; times are totals
        (client_times if name.startswith("time/") else client_means)[name] = (
            value if name.startswith("time/") else value / len(replied))
    attack = {}
    if federation.adversary_fraction > 0:  # (the server is not told who lied: numbers for the run's reader)
        adversarial = federation.adversaries(method.num_clients)
        attack["attack/adversaries_in_round"] = float(adversarial[survivors.cpu()].sum())
        if rejected is not None:
            attack["attack/adversaries_rejected"] = float(adversarial[rejected.cpu()].sum())
    metrics = {**server_metrics, **client_means, **combined.metrics, **attack,
               "comm/clients_in_round": float(len(survivors)), "comm/clients_dropped": float(len(lost)),
               "comm/clients_missing": float(len(replies.missing)), "comm/clients_rejoined": float(len(rejoined))}
    costs = {}
    if secure is not None:
        metrics.update({"comm/secagg_degree": float(secure.degree), "comm/secagg_threshold": float(secure.threshold)})
        costs = secure.costs(survivors.tolist())
    latency_s = None
    if clock is not None:
        bytes_up = replies.bytes_up / len(replied)
        clock.upload_bytes = bytes_up
        latency_s = clock.round_seconds(replied, bytes_down, bytes_up, decided, server_s)
        metrics.update({"latency/round_s": latency_s,
                        "latency/stragglers": float(decided.stragglers.sum()) if decided is not None else 0.0})
    return RoundResult(round_index, cohort, survivors, lost, uploads, metrics, bytes_up=replies.bytes_up,
                       bytes_down=bytes_down * (len(cohort) - replies.not_sent), client_s=replies.client_s,
                       server_s=server_s, secure_s=secure_s, client_time_sums=client_times, secagg_costs=costs,
                       missing=dict(replies.missing), rejoined=rejoined, latency_s=latency_s,
                       screened_out=combined.newly_rejected)


def _calibrate(clock: SimulatedClock, transport: Transport, request: RoundRequest, cohort: Tensor,
               secure: SecureAggregator | None) -> float:
    """What the clock has yet to measure: this machine's seconds per row of the client step and
    one client's message size, from the step of the cohort's largest client timed apart (the
    first round of a fit). Returns the seconds it took (the server's time excludes them)."""
    if clock.row_s is not None and (clock.upload_bytes is not None or not clock.systems.drops_stragglers):
        return 0.0
    if not isinstance(transport, Calibrates):
        raise ValueError(f"the simulated clock (systems) times the client step in process; {type(transport).__name__} "
                         "runs it elsewhere (`check_systems`)")
    start = time.perf_counter()
    client = int(cohort[torch.argmax(clock.rows[cohort.cpu()])])
    measured = transport.calibrate(request, client, repeats=5 if clock.row_s is None else 0)
    if clock.row_s is None:
        clock.row_s = measured.seconds / max(measured.rows, 1)
    if clock.upload_bytes is None:
        clock.upload_bytes = float(measured.bytes_up if secure is None
                                   else 8 * UploadLayout(measured.layout, secure.symmetric).length)
    return time.perf_counter() - start


def _rejoin(method: FederatedMethod, transport: Transport, device: torch.device) -> dict[int, bool]:
    """The clients a remote transport serves again since the last round (-> whether on a new
    node); the method forgets what it assumed they hold: a new node holds nothing, and their own
    node missed the broadcasts of the rounds they were away."""
    rejoined = transport.rejoined() if isinstance(transport, Rejoins) else {}
    if rejoined:
        method.forget_clients(torch.tensor(sorted(rejoined), dtype=torch.long, device=device))
    return rejoined


def _named(missing: Mapping[int, str]) -> str:
    """The missing clients and why, for an error: 'client 2 (no reply within 30 s)'."""
    return ", ".join(f"client {client} ({why})" for client, why in sorted(missing.items()))


@dataclass
class FinalResult:
    """The final broadcast's delivery: its bytes to every client, the clients' metric sums and
    seconds, and the clients served again on new nodes since the last round."""

    bytes_down: int
    metric_sums: dict[str, float]
    client_s: float
    rejoined: dict[int, bool] = field(default_factory=dict)


def run_final(method: FederatedMethod, transport: Transport) -> FinalResult:
    """After the last round: every client receives `method.final_broadcast()` and does its local
    work (`ClientHalf.finish`); the method is then fitted."""
    rejoined = _rejoin(method, transport, next(iter(method.buffers())).device)
    final = method.final_broadcast()
    metric_sums, client_s = transport.finish(final)
    method.mark_fitted()
    return FinalResult(messages_bytes(final) * method.num_clients, metric_sums, client_s, rejoined)


def check_finite_uploads(uploads: Mapping[str, Tensor], round_index: int, method: str, clients: Tensor) -> None:
    """An aggregated upload holding NaN/inf is an error before the server solves or steps on it."""
    for name, value in uploads.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            shown: list = clients.tolist()
            shown = shown if len(shown) <= 10 else [*shown[:10], "..."]
            raise FloatingPointError(
                f"round {round_index}: {method}'s aggregated upload '{name}' holds {bad} non-finite "
                f"value{'s' if bad != 1 else ''} (NaN/inf) from clients {shown}; no model was fitted on it: "
                "check those clients' data, or lower the step size / raise the regularization")
