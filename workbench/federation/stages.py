"""The protocol around a federated method as a pipeline of stages, in the order a round meets them:

    sample → drop → compress → clip → lie → mask → aggregate → noise

`Pipeline.of(federation)` composes the stages a `Federation` turns on, one stage per concern (as
Flower composes mods around a ClientApp and wrappers around a strategy); with none, every client's
upload is summed as sent. Each stage

- checks, before any work, what it cannot run with (`check`: the method's upload spec, the
  clients with data, where the clients run, the other stages); `Pipeline.check` runs every stage's
  from `FitProtocol.check`, wherever a round is run from;
- says what it does, for the run's summary (`describe`);
- acts through hooks, each called where that part of the round runs. On the client:
  `client_rows` (its training rows, once per fit: rows clipped, labels flipped), `wire` (how its
  uploads travel: summed, or one row per client, compressed, and the protocol's own uploads beside
  them), `client_update` (its model updates, one row per client, before they are summed:
  compressed, then clipped), `client_state` (what a stage keeps per client across rounds: the
  compressor's error feedback, held by the client half, so checkpoints and Flower nodes keep it),
  `client_send` (its message as it travels: poisoned by a liar). On the server: `cohort` (who is
  asked), `lost` (whose upload never arrives), `combine` (what the server makes of what arrived:
  the screen or a robust center, then the noise).

Secure aggregation's masks are the one stage whose hooks live in the transports: each client masks
its own message where it runs (in process, on a Flower node) and the server unmasks the ring sum
in `run_round`, where a failed unmasking is explained; here it is checked and described.
"""
from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from workbench.console import RunOutcome
from workbench.federation import codec, robust, screen
from workbench.federation.adversaries import UPLOAD_ATTACKS, flip_labels, poison
from workbench.federation.compression import Compression, Compressor, Residuals
from workbench.federation.privacy import WITHIN_CLIP, clip_client_updates, clip_features
from workbench.federation.protocol import Federation
from workbench.federation.screen import ROWS
from workbench.federation.secure_aggregation import check_secure_aggregation
from workbench.settings import plain

if TYPE_CHECKING:
    from workbench.federation.privacy import FitPrivacy
    from workbench.methods.base import ClientHalf


@dataclass(frozen=True)
class Setting:
    """What a pipeline is checked against before any work: the method (`method`: its name, for the
    errors; `spec`: its uploads; `sensitivity`: the most one training row moves its summed
    statistics, `FederatedMethod.statistics_sensitivity`, None where it states none), K
    (`num_clients`), the clients with data (`population`), the federation's settings, and whether
    the clients run on remote nodes with code of their own (`remote`: Flower)."""

    method: str
    spec: codec.Spec
    num_clients: int
    population: int
    federation: Federation = Federation()
    sensitivity: float | None = None
    remote: bool = False


@dataclass(frozen=True)
class ClientRows:
    """The training rows a transport serves: features (n, *input_shape), labels (n,), client_ids (n,)
    of a federation of `num_clients` clients over `num_classes` classes."""

    features: Tensor
    labels: Tensor
    client_ids: Tensor
    num_classes: int
    num_clients: int


@dataclass(frozen=True)
class Outgoing:
    """What a run of clients sends in one round, as the client hooks shape it.

    uploads: before `client_update`, the client half's (model updates one row per client); after,
        as they travel (`wire`); spec: the method's uploads; round_index: t; clients: (m,) the ids of
        the clients it is from;
    row_count: the clients' training rows; clip_norm: client-level DP's norm this round (None: no
        clipping); liars: every one of these clients lies (the transports run liars apart from the
        honest); generator: the round's stream for a liar's noise; wire: how the uploads travel
        (`Pipeline.wire`), set once they are combined for `client_send`; federation: the protocol's
        settings (set by `Pipeline.client_message`); state: the stages' state kept by these clients'
        half (`Stage.client_state`, by stage); metrics: the stages' own, sums over the clients.
    """

    uploads: dict[str, Tensor]
    spec: codec.Spec
    round_index: int
    clients: Tensor
    row_count: int = 0
    clip_norm: float | None = None
    liars: bool = False
    generator: torch.Generator | None = None
    wire: codec.Spec | None = None
    federation: Federation = Federation()
    state: nn.ModuleDict = field(default_factory=nn.ModuleDict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Incoming:
    """What reached the server in one round, as the server hooks combine it.

    uploads: combined over the survivors (summed, or their rows stacked in client order); wire: how
    they travelled; spec: the method's uploads; survivors: (m,) sorted ids; rejected: (r,) sorted
    ids the screen rejected this round (their uploads not summed); rejected_before: the clients
    rejected in earlier rounds of the fit (the fit's own set, `FitProtocol.rejected`: the screen
    adds this round's to it); newly_rejected: those
    rejected for the first time; privacy: the fit's `FitPrivacy` (the noise and its ε); setting:
    what the fit's pipeline was checked against; metrics: the round's protocol metrics
    (`privacy/*`, `screen/*`).
    """

    round_index: int
    uploads: dict[str, Tensor]
    wire: codec.Spec
    spec: codec.Spec
    survivors: Tensor
    privacy: FitPrivacy
    setting: Setting
    rejected_before: set[int]
    rejected: Tensor | None = None
    newly_rejected: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


class EveryClientRejected(RunOutcome):
    """The screen rejected every client of a round: the fit cannot go on (an outcome of the
    adversaries and the threshold, not a fault)."""


class Stage:
    """One concern of the protocol, with its hooks (each defaults to leaving things as they are).

    The built-in stages (`ProtocolStage`) are composed from the federation's settings; a stage of
    one's own subclasses this as a frozen dataclass of its settings (what a checkpoint and the
    run's hparams record of it), overrides the hooks it needs and goes in the config's `stages:`
    list, like a Flower mod; `after` names the built-in stage it follows (`Pipeline.NAMES`), those
    with the same `after` in the list's order. Its client hooks run where the clients run in
    process (a remote node runs its own code).
    """

    name: ClassVar[str] = ""
    after: ClassVar[str] = "noise"

    def describe(self) -> str:
        """What the stage does, for the run's summary."""
        return type(self).__name__

    def check(self, setting: Setting) -> None:
        """Refuses, in one line naming the fix, what this stage cannot run with."""

    def statistics_variance(self, clients: int) -> float:
        """The variance it adds to each coordinate of a round's summed statistics when `clients`
        clients upload (what a method's failed solve names)."""
        return 0.0

    # ---- client hooks ----------------------------------------------------------------------
    def client_rows(self, rows: ClientRows) -> ClientRows:
        return rows

    def wire(self, spec: codec.Spec) -> codec.Spec:
        return spec

    def client_update(self, outgoing: Outgoing) -> Outgoing:
        return outgoing

    def client_send(self, outgoing: Outgoing) -> Outgoing:
        return outgoing

    def client_state(self, spec: codec.Spec) -> dict[str, nn.Module]:
        """What it keeps per client across rounds for the method's uploads `spec`: modules the
        client half holds (`ClientHalf.protocol_state`), read back as `outgoing.state[stage.key]`
        (a `ModuleDict` of them)."""
        return {}

    @property
    def key(self) -> str:
        """Its name among the client half's protocol state."""
        return self.name or type(self).__name__

    # ---- server hooks ----------------------------------------------------------------------
    def cohort(self, round_index: int, available: Tensor) -> Tensor:
        return available

    def lost(self, round_index: int, cohort: Tensor, num_clients: int) -> Tensor:
        """(m,) bool over `cohort`: whose uploads never arrive."""
        return torch.zeros(len(cohort), dtype=torch.bool, device=cohort.device)

    def combine(self, incoming: Incoming) -> Incoming:
        return incoming

    @property
    def runs_on_clients(self) -> bool:
        """Whether it has a client hook."""
        return any(getattr(type(self), hook) is not getattr(Stage, hook)
                   for hook in ("client_rows", "wire", "client_update", "client_send", "client_state"))


@dataclass(frozen=True)
class ProtocolStage(Stage):
    """A built-in stage: its settings are the federation's (`Pipeline.of` builds it from them)."""

    federation: Federation

    def describe(self) -> str:
        raise NotImplementedError


class Sample(ProtocolStage):
    """Each round asks a cohort of the clients with data (`sample_rate`, `sampling`)."""

    name = "sample"

    def describe(self) -> str:
        return f"sample {self.federation.sample_rate:g} of the clients ({self.federation.sampling})"

    def cohort(self, round_index: int, available: Tensor) -> Tensor:
        return self.federation.sampled_clients(round_index, available)


class Drop(ProtocolStage):
    """Each round, round(dropout · K) clients compute and their uploads never arrive."""

    name = "drop"

    def describe(self) -> str:
        return f"{self.federation.dropout:g} of the clients drop out"

    def lost(self, round_index: int, cohort: Tensor, num_clients: int) -> Tensor:
        return self.federation.dropped_clients(round_index, num_clients).to(cohort.device)[cohort]


@functools.lru_cache(maxsize=64)
def compressor(compression: Compression, upload: codec.Upload) -> Compressor:
    """The compressor of a model update whose flat row holds the parameter tensors `upload.sizes`
    (built once per settings and model)."""
    if not upload.sizes:
        raise ValueError("federation.compression compresses model updates tensor by tensor, and this method's "
                         "update names no parameter tensors (Upload.sizes)")
    return compression.build(upload.sizes)


class Compress(ProtocolStage):
    """Each client compresses its model updates before they leave (`compression`: top-k, b-bit
    quantization or the scaled sign, `workbench.federation.compression`): what the server
    reconstructs is sent, at the compressor's byte count. With `error_feedback` each client carries
    what compression lost into its next round, g_k = Δ_k + e_k, sent_k = C(g_k), e_k ← g_k − sent_k
    (bounded or decayed on request), kept per client by the client half (checkpointed; kept by a
    Flower node). Clipping comes after it, so the residual is the compressor's error only and the
    clipped message is exactly what is sent."""

    name = "compress"

    def describe(self) -> str:
        compression, feedback = self.federation.compression, self.federation.error_feedback
        kind = {"topk": f"top-{compression.topk_fraction:g} of each update",
                "quantize": f"{compression.quantize_bits}-bit "
                            f"{'symmetric' if compression.quantize_symmetric else 'min-max'} quantization",
                "sign": "scaled sign (1 bit an entry)"}[compression.kind]
        return f"compress to {kind}" + (", error feedback" if feedback.enabled else "")

    def check(self, setting: Setting) -> None:
        updates = codec.model_update_names(setting.spec)
        if not updates:
            sends = ("a message of its own per client, compressed its own way" if codec.stacked_names(setting.spec)
                     else "statistics, summed exactly")
            raise ValueError(f"federation.compression compresses clients' model updates, which {setting.method} "
                             f"does not send (it sends {sends}): set federation.compression.kind=none")
        for name in updates:
            compressor(self.federation.compression, setting.spec[name])

    def wire(self, spec: codec.Spec) -> codec.Spec:
        compression = self.federation.compression
        return {name: replace(upload, encoding=compressor(compression, upload)) if upload.model_update else upload
                for name, upload in spec.items()}

    def client_state(self, spec: codec.Spec) -> dict[str, nn.Module]:
        feedback = self.federation.error_feedback
        if not feedback.enabled:
            return {}
        return {self.residuals(name): feedback.residuals(sum(spec[name].sizes))
                for name in codec.model_update_names(spec)}

    @staticmethod
    def residuals(name: str) -> str:
        """The key of upload `name`'s residuals (not the name itself: `update` is a ModuleDict method)."""
        return f"{name}_residuals"

    def client_update(self, outgoing: Outgoing) -> Outgoing:
        names = [name for name in codec.model_update_names(outgoing.spec) if name in outgoing.uploads]
        if not names:
            return outgoing
        start = time.perf_counter()
        kept = outgoing.state[self.key] if self.key in outgoing.state else nn.ModuleDict()
        assert isinstance(kept, nn.ModuleDict)
        uploads = dict(outgoing.uploads)
        for name in names:
            updates = uploads[name].flatten(1)  # (m, P)
            feedback = kept[self.residuals(name)] if self.residuals(name) in kept else None
            if feedback is None and outgoing.federation.error_feedback.enabled:
                raise RuntimeError("these clients' half holds no error feedback for the compress stage: build it "
                                   "under the fit's protocol (Pipeline.keep_state, as LocalClients does)")
            assert feedback is None or isinstance(feedback, Residuals)
            target = feedback.target(outgoing.clients, updates) if feedback is not None else updates
            sent = compressor(outgoing.federation.compression, outgoing.spec[name])(target)
            if feedback is not None:
                feedback.keep(outgoing.clients, target, sent, updates)
            uploads[name] = sent.view_as(uploads[name])
        seconds = time.perf_counter() - start
        return replace(outgoing, uploads=uploads, metrics={**outgoing.metrics, "time/compress_s": seconds})


class Clip(ProtocolStage):
    """Each client bounds its contribution: its feature rows to norm ≤ B (`feature_clip`, for the
    noise on statistics), or its model update to the round's C (`dp_clip`, DP-FedAvg), sending the
    count of clients within C beside it (`privacy.WITHIN_CLIP`)."""

    name = "clip"

    def describe(self) -> str:
        federation = self.federation
        if federation.feature_clip > 0:
            return f"clip rows to norm {federation.feature_clip:g}"
        adaptive = federation.dp_clip_quantile
        return f"clip updates to norm {federation.dp_clip:g}" + (
            f" (adaptive, quantile {adaptive:g})" if adaptive is not None else "")

    def check(self, setting: Setting) -> None:
        federation = self.federation
        if federation.client_level_dp and not codec.model_update_names(setting.spec):
            raise ValueError(f"federation.dp_clip clips clients' model updates, which {setting.method} does not send: "
                             "set federation.dp_clip=0 (analytic methods: dp_sigma with feature_clip)")
        if federation.feature_clip > 0 and setting.remote:
            raise ValueError("federation.feature_clip clips the rows of in-process clients; with a remote "
                             "transport, clip the features where the clients load them and set it to 0")

    def client_rows(self, rows: ClientRows) -> ClientRows:
        if self.federation.feature_clip > 0:  # each client bounds its own rows: the noise's sensitivity holds
            return replace(rows, features=clip_features(rows.features, self.federation.feature_clip))
        return rows

    def wire(self, spec: codec.Spec) -> codec.Spec:
        return {**spec, WITHIN_CLIP: codec.SUMMED} if self.federation.client_level_dp else spec

    def client_update(self, outgoing: Outgoing) -> Outgoing:
        updates = {name: outgoing.uploads[name] for name in codec.model_update_names(outgoing.spec)
                   if name in outgoing.uploads}
        if outgoing.clip_norm is None or not updates:
            return outgoing
        clipped, within = clip_client_updates(updates, outgoing.clip_norm)
        return replace(outgoing, uploads={**outgoing.uploads, **clipped, WITHIN_CLIP: within})


class Lie(ProtocolStage):
    """A seeded share of the clients lies (`adversary_fraction`, `attack`): trains on flipped
    labels, or poisons what it sends (`workbench.federation.adversaries`)."""

    name = "lie"

    def describe(self) -> str:
        federation = self.federation
        scaled = f" × {federation.attack_scale:g}" if federation.attack in ("scale", "noise") else ""
        return f"{federation.adversary_fraction:g} of the clients lie ({federation.attack}{scaled})"

    def check(self, setting: Setting) -> None:
        if self.federation.attack == "noise" and not codec.model_update_names(setting.spec):
            raise ValueError(f"federation.attack=noise noises model updates, which {setting.method} does not send: "
                             "use sign_flip or scale (on its statistics) or label_flip")
        if setting.remote:
            raise ValueError("federation.adversary_fraction makes in-process clients lie; a remote transport's "
                             "clients run their own code: set it to 0 there (or fit in process)")

    def adversaries(self, num_clients: int) -> Tensor:
        """(K,) bool: the liars, the same every round."""
        return self.federation.adversaries(num_clients)

    @property
    def poisons_uploads(self) -> bool:
        return self.federation.attack in UPLOAD_ATTACKS

    def client_rows(self, rows: ClientRows) -> ClientRows:
        liars = self.adversaries(rows.num_clients)
        if self.federation.attack != "label_flip" or not liars.any():
            return rows
        flipped = liars.to(rows.client_ids.device)[rows.client_ids]  # their data is poisoned once
        return replace(rows, labels=torch.where(flipped, flip_labels(rows.labels, rows.num_classes), rows.labels))

    def client_send(self, outgoing: Outgoing) -> Outgoing:
        if not (outgoing.liars and self.poisons_uploads):
            return outgoing
        assert outgoing.generator is not None
        federation = self.federation
        return replace(outgoing, uploads=poison(outgoing.uploads, outgoing.wire or outgoing.spec, federation.attack,
                                                federation.attack_scale, len(outgoing.clients),
                                                outgoing.generator))


class Mask(ProtocolStage):
    """Secure aggregation: each client masks its own message, the server learns only the sum
    (`workbench.federation.secure_aggregation`; its hooks run in the transports)."""

    name = "mask"

    def describe(self) -> str:
        return "SecAgg+ masks" if self.federation.secure_aggregation_graph == "sparse" else "secure aggregation masks"

    def check(self, setting: Setting) -> None:
        stacked = sorted(codec.stacked_names(setting.spec))
        if stacked:
            raise ValueError(f"secure aggregation reveals only a sum, but {setting.method} sends per-client uploads "
                             f"{stacked}: set federation.secure_aggregation=false for it")
        check_secure_aggregation(self.federation, setting.num_clients, setting.population)


class Aggregate(ProtocolStage):
    """How the server combines what arrived otherwise than by the sum: a robust center of the
    model updates (`workbench.federation.robust`), or the screen of each client's statistics
    (`workbench.federation.screen`); both need each client's upload as its own row."""

    name = "aggregate"

    def describe(self) -> str:
        federation = self.federation
        return {"screen": f"screen (τ = {federation.aggregation_threshold:g})",
                "trimmed_mean": f"trimmed mean (β = {federation.aggregation_trim:g})",
                "krum": f"Krum (β = {federation.aggregation_trim:g})",
                "multi_krum": f"Multi-Krum (β = {federation.aggregation_trim:g})",
                "norm_bound": f"norm bound {federation.aggregation_norm:g}"}.get(federation.aggregation,
                                                                                federation.aggregation)

    def check(self, setting: Setting) -> None:
        federation, name = self.federation, setting.method
        updates = codec.model_update_names(setting.spec)
        if federation.robust and not updates:
            raise ValueError(f"federation.aggregation={federation.aggregation} combines clients' model updates; "
                             f"{name} sends statistics, which are summed: set federation.aggregation=mean for it")
        if federation.screens and updates:
            raise ValueError(f"federation.aggregation=screen checks the Grams of an analytic method's statistics; "
                             f"{name} sends model updates: use median, trimmed_mean, krum, multi_krum or "
                             "norm_bound for them")
        if federation.screens and not codec.gram_names(setting.spec):
            raise ValueError(f"federation.aggregation=screen checks the Grams of an analytic method's statistics; "
                             f"{name} sends no Gram to check: set federation.aggregation=mean for it")
        if setting.remote:
            raise ValueError(f"federation.aggregation={federation.aggregation} runs in process (its clients' "
                             "uploads stay one row each); a remote transport's nodes sum theirs: set "
                             "aggregation=mean there")

    def wire(self, spec: codec.Spec) -> codec.Spec:
        if self.federation.screens:  # every upload one row per client, and its count of training rows
            return {**{name: replace(upload, stacked=True) for name, upload in spec.items()}, ROWS: codec.STACKED}
        return {name: replace(upload, stacked=True) if upload.model_update else upload
                for name, upload in spec.items()}

    def client_send(self, outgoing: Outgoing) -> Outgoing:
        if not self.federation.screens:  # (the updates' rows were kept apart by the wire spec)
            return outgoing
        uploads = {name: value if outgoing.spec[name].stacked else value[None]
                   for name, value in outgoing.uploads.items()}
        device = next(iter(uploads.values())).device if uploads else None
        return replace(outgoing, uploads={**uploads, ROWS: torch.tensor([outgoing.row_count], device=device)})

    def combine(self, incoming: Incoming) -> Incoming:
        federation = self.federation
        if federation.robust:  # the model updates' robust center, times m, where the method expects their sum
            return replace(incoming, uploads=robust.aggregate(incoming.uploads, incoming.wire, federation.aggregation,
                                                              federation.aggregation_trim,
                                                              federation.aggregation_norm))
        return self._screen(incoming)

    def _screen(self, incoming: Incoming) -> Incoming:
        """The screen's round: the uploads summed over the clients it keeps; the rejected dropped,
        those rejected for the first time added to the fit's `rejected_before`."""
        threshold, survivors = self.federation.aggregation_threshold, incoming.survivors
        barred = torch.isin(survivors.cpu(), torch.tensor(sorted(incoming.rejected_before), dtype=survivors.dtype))
        uploads, decision = screen.screen(incoming.uploads, incoming.spec, threshold, barred)
        kept = decision.kept.to(survivors.device)
        rejected = survivors[~kept]
        newly = [client for client in rejected.tolist() if client not in incoming.rejected_before]
        incoming.rejected_before.update(newly)
        why = (f"{int(decision.invalid.sum())} sent a Gram that is not positive semidefinite, "
               f"{int(decision.out_of_scale.sum())} one out of scale by more than τ = {threshold:g}, "
               f"{int(decision.barred.sum())} were rejected before")
        if not kept.any():
            raise EveryClientRejected(
                f"round {incoming.round_index}: the screen rejected all {len(survivors)} of its clients ({why}): no "
                "honest client left to sum — ask more clients a round (federation.sample_rate), or raise "
                "federation.aggregation_threshold if honest clients were out of scale")
        if int(decision.out_of_scale.sum()) > len(survivors) / 2:
            warnings.warn(f"round {incoming.round_index}: the screen found most of its clients out of scale ({why}); "
                          "if they are honest, raise federation.aggregation_threshold", stacklevel=5)
        return replace(incoming, uploads=uploads, survivors=survivors[kept], rejected=rejected, newly_rejected=newly,
                       metrics={**incoming.metrics, "screen/rejected": float(len(rejected))})


class Noise(ProtocolStage):
    """The server noises the aggregate before it solves or steps: N(0, σ²) on the statistics
    (`dp_sigma`), or N(0, (zC)²) on the clipped updates' sum and, under adaptive clipping, the count
    within C that moves C (client-level DP; `workbench.federation.privacy`)."""

    name = "noise"

    def describe(self) -> str:
        federation = self.federation
        if federation.dp_sigma > 0:
            return f"noise σ = {federation.dp_sigma:g} on the statistics"
        if federation.dp_noise_multiplier > 0:
            return f"noise z = {federation.dp_noise_multiplier:g} on the updates' sum"
        return ""  # client-level DP with z = 0: the server only counts the clients within C

    def check(self, setting: Setting) -> None:
        if self.federation.client_level_dp and self.federation.dp_sigma > 0:
            raise ValueError("federation.dp_clip (client-level DP) and dp_sigma (noise on statistics) both noise "
                             "the sum: set one of them to 0")
        stacked = sorted(codec.stacked_names(setting.spec))
        if self.federation.dp_sigma > 0 and stacked:
            raise ValueError(f"federation.dp_sigma adds noise to summed statistics; {setting.method} sends per-client "
                             f"uploads {stacked}: set federation.dp_sigma=0 for it")

    def statistics_variance(self, clients: int) -> float:
        return self.federation.dp_sigma ** 2

    def combine(self, incoming: Incoming) -> Incoming:
        uploads, metrics = incoming.privacy.noised(incoming.uploads, incoming.round_index,
                                                   codec.symmetric_names(incoming.wire))
        return replace(incoming, uploads=uploads, metrics={**incoming.metrics, **metrics})


@dataclass(frozen=True)
class Pipeline:
    """The stages of a fit's protocol, in round order, and the federation's settings they come
    from (`Pipeline.of`)."""

    stages: tuple[Stage, ...]
    federation: Federation = Federation()

    ORDER: ClassVar[tuple[type[ProtocolStage], ...]] = (Sample, Drop, Compress, Clip, Lie, Mask, Aggregate, Noise)
    NAMES: ClassVar[tuple[str, ...]] = tuple(kind.name for kind in ORDER)

    @classmethod
    def of(cls, federation: Federation, extra: Iterable[Stage] = ()) -> Pipeline:
        """The stages `federation` turns on, and the `extra` ones (the config's `stages:`), each
        after the built-in stage it names (`Stage.after`), in round order."""
        on = {Sample: federation.sample_rate < 1, Drop: federation.dropout > 0, Compress: federation.compresses,
              Clip: federation.feature_clip > 0 or federation.client_level_dp,
              Lie: federation.adversary_fraction > 0, Mask: federation.secure_aggregation,
              Aggregate: federation.aggregation != "mean", Noise: federation.dp_sigma > 0 or federation.client_level_dp}
        ranked: list[tuple[int, Stage]] = [(2 * i, kind(federation)) for i, kind in enumerate(cls.ORDER) if on[kind]]
        for stage in extra:
            if isinstance(stage, ProtocolStage):
                raise TypeError(f"stages: lists stages of one's own; {type(stage).__name__} is built in and comes "
                                "from the federation's settings (federation.*)")
            if not isinstance(stage, Stage):
                raise TypeError(f"stages: lists stages of one's own (workbench.federation.stages.Stage subclasses), "
                                f"got {type(stage).__name__}")
            if not dataclasses.is_dataclass(stage):
                raise TypeError(f"the stage {type(stage).__name__} must be a dataclass of its settings "
                                "(@dataclass(frozen=True)): they are what a checkpoint and the run's hparams record")
            if stage.after not in cls.NAMES:
                raise ValueError(f"{type(stage).__name__}.after = {stage.after!r} names no stage: one of "
                                 f"{', '.join(cls.NAMES)}")
            ranked.append((2 * cls.NAMES.index(stage.after) + 1, stage))
        return cls(tuple(stage for _, stage in sorted(ranked, key=lambda pair: pair[0])), federation)  # stable

    @classmethod
    def for_node(cls, clip_norm: float | None, federation: Federation = Federation()) -> Pipeline:
        """A remote node's client side: the client stages of the fit's `federation` that the node
        was told of (`node_settings`) and what each round's message tells it (the clip norm); the
        rest runs on the server, and nodes sum what they send."""
        return cls.of(replace(federation, dp_clip=clip_norm if clip_norm is not None else 0.0))

    def node_settings(self) -> Federation:
        """What a remote node runs of this protocol from the start of a fit (its client state
        depends on it): the compression and its error feedback."""
        return Federation(compression=self.federation.compression, error_feedback=self.federation.error_feedback)

    def own(self) -> list[Stage]:
        """The stages of one's own (the config's `stages:`), in order."""
        return [stage for stage in self.stages if not isinstance(stage, ProtocolStage)]

    def under(self, federation: Federation) -> Pipeline:
        """The same stages of one's own under other settings (over-selection's larger cohort)."""
        return Pipeline.of(federation, self.own())

    def names(self) -> list[str]:
        return [stage.name for stage in self.stages]

    def describe(self) -> list[str]:
        """Each stage's description, in round order (none: every upload summed as sent)."""
        return [described for stage in self.stages if (described := stage.describe())]

    def line(self) -> str:
        """The descriptions on one line, `a → b` ("" for none)."""
        return " → ".join(self.describe())

    def get(self, kind: type[Stage]) -> Stage | None:
        return next((stage for stage in self.stages if isinstance(stage, kind)), None)

    def check(self, setting: Setting) -> None:
        """Every stage's refusals, before any work: the built-in stages' in round order, then those
        of one's own (which may rely on the built-in checks)."""
        for stage in self.stages:
            if isinstance(stage, ProtocolStage):
                stage.check(setting)
        for stage in self.own():
            if setting.remote and stage.runs_on_clients:
                raise ValueError(f"the stage {type(stage).__name__} runs on the clients, and a remote transport's "
                                 "nodes run their own code: drop it from stages: there (or fit in process)")
            stage.check(setting)

    def statistics_noise(self, clients: int) -> float:
        """The standard deviation of the noise on each coordinate of a round's summed statistics
        when `clients` clients upload (0: none)."""
        return sum(stage.statistics_variance(clients) for stage in self.stages) ** 0.5

    def identity(self) -> list[dict]:
        """The stages of one's own with their settings, in order (a checkpoint's, to compare on resume)."""
        return [{"stage": f"{type(stage).__module__}.{type(stage).__qualname__}", "settings": plain(stage)}
                for stage in self.own()]

    # ---- client side ------------------------------------------------------------------------
    def keep_state(self, half: ClientHalf, spec: codec.Spec) -> None:
        """Give a freshly set-up client half the state its clients keep for the stages (each
        stage's `client_state` for the method's uploads `spec`): checkpointed with the half, kept
        by a Flower node between messages."""
        half.protocol_state = nn.ModuleDict({stage.key: nn.ModuleDict(state) for stage in self.stages
                                             if (state := stage.client_state(spec))})

    def client_rows(self, rows: ClientRows) -> ClientRows:
        for stage in self.stages:
            rows = stage.client_rows(rows)
        return rows

    def wire(self, spec: codec.Spec) -> dict[str, codec.Upload]:
        """The uploads as they travel: the method's, shaped for the server's combination, and the
        protocol's own beside them."""
        for stage in self.stages:
            spec = stage.wire(spec)
        return dict(spec)

    def client_message(self, outgoing: Outgoing) -> Outgoing:
        """A run of clients' message from what their client half computed: each client's model
        updates through `client_update`, summed over the clients unless they travel one row each,
        then through `client_send`."""
        if outgoing.clip_norm is not None and self.get(Clip) is None:
            raise ValueError("the round asks its clients to clip their updates (client-level DP), and their protocol "
                             "has no clip stage: build the clients with the fit's federation (its dp_clip)")
        outgoing = replace(outgoing, federation=self.federation)
        for stage in self.stages:
            outgoing = stage.client_update(outgoing)
        sent, updates = self.wire(outgoing.spec), codec.model_update_names(outgoing.spec)
        uploads = {name: value.sum(0) if name in updates and not sent[name].stacked else value
                   for name, value in outgoing.uploads.items()}
        outgoing = replace(outgoing, uploads=uploads, wire=sent)
        for stage in self.stages:
            outgoing = stage.client_send(outgoing)
        return outgoing

    # ---- server side ------------------------------------------------------------------------
    def cohort(self, round_index: int, available: Tensor) -> Tensor:
        for stage in self.stages:
            available = stage.cohort(round_index, available)
        return available

    def lost(self, round_index: int, cohort: Tensor, num_clients: int) -> Tensor:
        lost = torch.zeros(len(cohort), dtype=torch.bool, device=cohort.device)
        for stage in self.stages:
            lost = lost | stage.lost(round_index, cohort, num_clients)
        return lost

    def combine(self, incoming: Incoming) -> Incoming:
        for stage in self.stages:
            incoming = stage.combine(incoming)
        return incoming



#: the protocol with none of its parts: every upload summed as sent
NO_PROTOCOL = Pipeline(())
