"""Protocol settings of a federation: who uploads, how uploads are protected, what noise is added.

These are properties of the deployment, not hyperparameters of a method: the same `Federation`
applies to every method, and the runtime (`workbench.methods.base`) enforces it round by round:

- `dropout`: each round, round(dropout · K) clients, drawn uniformly and seeded by
  (seed, round), fail to upload: their uploads are lost and they do not count. An analytic
  method's round then equals the centralized solution on the other clients' data, and
  multi-round methods continue with whoever uploads.
- `secure_aggregation`: each client masks its own upload with pairwise additive masks in a
  fixed-point integer ring (`workbench.federation.secure_aggregation`); the server only holds
  masked uploads and their exact sum. Dropped clients' masks are removed Bonawitz-style.
  `secure_aggregation_graph: sparse` runs SecAgg+ instead (Bell et al. 2020): masks along a
  random graph of degree k = O(log n), self-masks, and dropout recovery from t-of-k Shamir shares.
- `dp_sigma`: the server adds Gaussian noise N(0, σ²) to every aggregated statistic before it
  solves (symmetric noise for symmetric uploads such as Gram matrices,
  `workbench.federation.privacy`); `feature_clip` B makes each client clip its feature rows to
  norm ≤ B first, so the statistics' sensitivity holds by construction.
- `sample_rate`, `sampling`: each round's cohort, seeded by (seed, round): `fixed` takes
  max(1, round(q·K)) of the K clients with data uniformly without replacement, `poisson` takes
  each client independently with probability q.
- `adversary_fraction`, `attack`: a seeded share of the clients lies in what it sends (flipped
  labels, sign-flipped or scaled uploads, noised updates: `workbench.federation.adversaries`).
- `compression`, `error_feedback`: each client compresses its model updates before they leave
  (top-k, b-bit quantization, the scaled sign: `workbench.federation.compression`) and carries
  what compression lost into its next round's update.
- `aggregation`: how the server combines the clients' model updates — their mean, or a robust
  center (median, trimmed mean, Krum, Multi-Krum, norm bounding: `workbench.federation.robust`);
  for the analytic methods' statistics, their sum, or `screen`: each client's checked first and
  the implausible left out (`workbench.federation.screen`).
- `dp_clip`, `dp_noise_multiplier` (client-level DP for gradient methods, DP-FedAvg): each
  sampled client clips its update to norm ≤ C (`dp_clip_quantile` moves C each round towards
  that quantile of the update norms, Andrew et al. 2021); the server adds N(0, (zC)²) to the sum.
  `privacy/epsilon` at `dp_delta` is computed by `dp-accounting`; `target_epsilon` refuses a
  run that would spend more before its first round.

In a config, a top-level section:

    federation:
      dropout: 0.2
      secure_aggregation: true
      dp_sigma: 0.0
      sample_rate: 0.1          # cohort sampling
      sampling: poisson
      dp_clip: 1.0              # client-level DP
      dp_noise_multiplier: 1.0
      target_epsilon: 8.0
      compression:              # of the model updates
        kind: topk
        topk_fraction: 0.01
      seed: 0
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from workbench.federation.compression import Compression, ErrorFeedback
from workbench.federation.robust import AGGREGATIONS
from workbench.linalg import stream_generator

# Independent random streams of one round, derived from (seed, round, stream). The pairwise masks
# of secure aggregation derive theirs from (seed, round, client pair).
DROPOUT_STREAM, NOISE_STREAM, SAMPLING_STREAM, ADVERSARY_STREAM, ATTACK_STREAM = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class Federation:
    """Protocol settings applied by the runtime to every round.

    Args:
        dropout: the fraction of the K clients that fail to upload in each round, in [0, 1).
        secure_aggregation: mask each client's upload so the server sees only the sum.
        fixed_point_bits: fractional bits of the fixed-point encoding used by secure
            aggregation (a value x is sent as round(x · 2^bits)); the encoding error is at most
            2^-(bits+1) per number and client.
        secure_aggregation_graph: `complete` (all-pairs masks: n − 1 mask streams per client) or
            `sparse` (SecAgg+: k + 1 streams and 2k Shamir shares per client).
        secagg_degree: SecAgg+'s k, an even number ≥ 2 (None: chosen per round for its n
            clients, `workbench.federation.secure_aggregation.secagg_plus_parameters`).
        secagg_threshold: SecAgg+'s t, the shares that reconstruct a secret, ≤ k (None: chosen
            with k).
        secagg_corrupt_fraction: γ, the fraction of clients that may collude with the server,
            which the choice of k and t protects against (with `dropout` as the dropout rate).
        dp_sigma: standard deviation σ ≥ 0 of the Gaussian noise the server adds to each
            aggregated statistic (0 = none).
        feature_clip: B > 0: each client scales every feature row to norm ≤ B before it computes
            anything (0 = off), so one sample's effect on statistics is bounded by construction.
        sample_rate: q in (0, 1], the share of the clients with data asked each round.
        sampling: `fixed` (max(1, round(q·K)) clients without replacement) or `poisson` (each
            client independently with probability q; the DP-FedAvg accounting's assumption).
        dp_clip: C > 0: client-level DP — every client clips its update to L2 norm ≤ C (the
            initial C under adaptive clipping); 0 = off.
        dp_noise_multiplier: z: the server adds N(0, (zC)²) to each coordinate of the clipped sum.
        dp_clip_quantile: γ in (0, 1) for adaptive clipping (C moves towards the γ-quantile of
            the update norms), None for a fixed C.
        dp_clip_lr: η_C, the geometric step of adaptive clipping: C ← C·exp(−η_C (b̃ − γ)).
        dp_count_stddev: σ_b, the noise on the count of unclipped clients (adaptive clipping);
            None: the expected cohort / 20, as Andrew et al. recommend.
        dp_delta: δ at which `privacy/epsilon` is reported.
        target_epsilon: a budget: a run whose ε after its last round would exceed it is refused
            before its first round (None = no budget).
        adversary_fraction: f in [0, 1): round(f·K) clients, drawn once from `seed`, lie in what
            they send (`workbench.federation.adversaries`); 0 = none.
        attack: how they lie: `label_flip`, `sign_flip`, `scale` or `noise`.
        attack_scale: s, the factor of `scale` (negative: a scaled sign flip) and the noise's
            standard deviation of `noise`.
        aggregation: how the server combines the clients' model updates: `mean`, `median`,
            `trimmed_mean`, `krum`, `multi_krum` or `norm_bound` (`workbench.federation.robust`);
            or their statistics (analytic methods): `mean` (their sum) or `screen`
            (`workbench.federation.screen`).
        aggregation_trim: β: the share cut at each end by `trimmed_mean`, and the share of
            adversaries (f = ⌊β·m⌋) Krum assumes.
        aggregation_norm: B, the norm `norm_bound` scales each update to at most.
        aggregation_threshold: τ > 1: the screen rejects a client whose Grams' trace per row is
            more than τ times, or less than 1/τ of, the round's median client's.
        compression: how each client's model updates travel (`Compression`: kind none, topk,
            quantize or sign; topk_fraction, quantize_bits, quantize_symmetric).
        error_feedback: each client's carry of what compression lost (`ErrorFeedback`: enabled,
            bound, decay); read only when `compression` is lossy.
        seed: seed of the dropouts, the pairwise masks and the noise (each round draws anew), and
            of who the adversaries are.
    """

    dropout: float = 0.0
    secure_aggregation: bool = False
    fixed_point_bits: int = 32
    secure_aggregation_graph: Literal["complete", "sparse"] = "complete"
    secagg_degree: int | None = None
    secagg_threshold: int | None = None
    secagg_corrupt_fraction: float = 0.05
    dp_sigma: float = 0.0
    feature_clip: float = 0.0
    sample_rate: float = 1.0
    sampling: Literal["fixed", "poisson"] = "fixed"
    dp_clip: float = 0.0
    dp_noise_multiplier: float = 0.0
    dp_clip_quantile: float | None = None
    dp_clip_lr: float = 0.2
    dp_count_stddev: float | None = None
    dp_delta: float = 1e-5
    target_epsilon: float | None = None
    adversary_fraction: float = 0.0
    attack: Literal["label_flip", "sign_flip", "scale", "noise"] = "sign_flip"
    attack_scale: float = 10.0
    aggregation: Literal["mean", "median", "trimmed_mean", "krum", "multi_krum", "norm_bound", "screen"] = "mean"
    aggregation_trim: float = 0.1
    aggregation_norm: float = 1.0
    aggregation_threshold: float = 4.0
    compression: Compression = Compression()
    error_feedback: ErrorFeedback = ErrorFeedback()
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.dropout < 1:
            raise ValueError(f"federation.dropout must be in [0, 1) (a fraction of the clients), got {self.dropout}")
        if not self.dp_sigma >= 0:
            raise ValueError(f"federation.dp_sigma must be ≥ 0 (the noise's standard deviation), got {self.dp_sigma}")
        if not 0 <= self.fixed_point_bits <= 52:
            raise ValueError(f"federation.fixed_point_bits must be in 0..52 (float64 has 52 fraction bits), "
                             f"got {self.fixed_point_bits}")
        self._check_secure_aggregation()
        self._check_privacy()
        if not 0 <= self.adversary_fraction < 1:
            raise ValueError(f"federation.adversary_fraction must be in [0, 1) (a fraction of the clients), got "
                             f"{self.adversary_fraction}")
        if self.attack not in ("label_flip", "sign_flip", "scale", "noise"):
            raise ValueError(f"federation.attack must be label_flip, sign_flip, scale or noise, got {self.attack!r}")
        if self.attack_scale == 0 or (self.attack == "noise" and not self.attack_scale > 0):
            raise ValueError(f"federation.attack_scale must be nonzero (> 0 for noise, its standard deviation), "
                             f"got {self.attack_scale}")
        self._check_aggregation()
        self._check_compression()
        if not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"federation.seed must be an integer in [0, 2⁶³), got {self.seed}")

    def _check_secure_aggregation(self) -> None:
        if self.secure_aggregation_graph not in ("complete", "sparse"):
            raise ValueError(f"federation.secure_aggregation_graph must be complete or sparse (SecAgg+), "
                             f"got {self.secure_aggregation_graph!r}")
        sparse_only = [name for name in ("secagg_degree", "secagg_threshold") if getattr(self, name) is not None]
        if self.secure_aggregation_graph == "sparse" and not self.secure_aggregation:
            raise ValueError("federation.secure_aggregation_graph=sparse configures secure aggregation: set "
                             "federation.secure_aggregation=true too")
        if sparse_only and self.secure_aggregation_graph != "sparse":
            raise ValueError(f"federation.{sparse_only[0]} configures SecAgg+: set "
                             "federation.secure_aggregation_graph=sparse, or drop it")
        if self.secagg_degree is not None and not (self.secagg_degree >= 2 and self.secagg_degree % 2 == 0):
            raise ValueError(f"federation.secagg_degree must be an even number ≥ 2 (k/2 neighbours on each side "
                             f"of the random ring), got {self.secagg_degree}: use {max(2, self.secagg_degree + 1)}")
        if self.secagg_threshold is not None and not self.secagg_threshold >= 1:
            raise ValueError(f"federation.secagg_threshold must be ≥ 1 (shares per secret), got "
                             f"{self.secagg_threshold}")
        if (self.secagg_degree is not None and self.secagg_threshold is not None
                and self.secagg_threshold > self.secagg_degree):
            raise ValueError(f"federation.secagg_threshold = {self.secagg_threshold} exceeds secagg_degree = "
                             f"{self.secagg_degree}, the shares each secret has: lower the threshold or raise "
                             "the degree")
        if not 0 <= self.secagg_corrupt_fraction < 0.5:
            raise ValueError(f"federation.secagg_corrupt_fraction must be in [0, 0.5) (a fraction of the clients), "
                             f"got {self.secagg_corrupt_fraction}")

    def _check_privacy(self) -> None:
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"federation.sample_rate must be in (0, 1] (the share of clients per round), "
                             f"got {self.sample_rate}")
        if self.sampling not in ("fixed", "poisson"):
            raise ValueError(f"federation.sampling must be fixed or poisson, got {self.sampling!r}")
        for name in ("feature_clip", "dp_clip", "dp_noise_multiplier", "dp_clip_lr"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"federation.{name} must be ≥ 0, got {getattr(self, name)}")
        if self.dp_noise_multiplier > 0 and self.dp_clip == 0:
            raise ValueError("federation.dp_noise_multiplier needs a clip norm: set federation.dp_clip > 0 "
                             "(the noise's scale is z·dp_clip)")
        if self.dp_clip_quantile is not None and not (0 < self.dp_clip_quantile < 1 and self.dp_clip > 0):
            raise ValueError(f"federation.dp_clip_quantile must be in (0, 1) with dp_clip > 0 (the initial clip "
                             f"norm), got {self.dp_clip_quantile} and dp_clip = {self.dp_clip}")
        if self.dp_count_stddev is not None and not self.dp_count_stddev > 0:
            raise ValueError(f"federation.dp_count_stddev must be > 0, got {self.dp_count_stddev}")
        if not 0 < self.dp_delta < 1:
            raise ValueError(f"federation.dp_delta must be in (0, 1), got {self.dp_delta}")
        noised = self.dp_sigma > 0 or self.dp_clip > 0
        if self.target_epsilon is not None and not (self.target_epsilon > 0 and noised):
            raise ValueError(f"federation.target_epsilon = {self.target_epsilon} needs a noised protocol and a "
                             "positive budget: set dp_clip and dp_noise_multiplier (gradient methods) or "
                             "dp_sigma and feature_clip (analytic methods)")

    def _check_aggregation(self) -> None:
        if self.aggregation not in (*AGGREGATIONS, "screen"):
            raise ValueError(f"federation.aggregation must be mean, median, trimmed_mean, krum, multi_krum, "
                             f"norm_bound (model updates) or screen (statistics), got {self.aggregation!r}")
        if not 0 <= self.aggregation_trim < 0.5:
            raise ValueError(f"federation.aggregation_trim must be in [0, 0.5) (a share cut at each end), got "
                             f"{self.aggregation_trim}")
        if not self.aggregation_norm > 0:
            raise ValueError(f"federation.aggregation_norm must be > 0, got {self.aggregation_norm}")
        if not self.aggregation_threshold > 1:
            raise ValueError(f"federation.aggregation_threshold must be > 1 (a factor from the median client), got "
                             f"{self.aggregation_threshold}")
        if self.aggregation != "mean" and self.secure_aggregation:
            raise ValueError(f"federation.aggregation={self.aggregation} needs each client's upload, and secure "
                             "aggregation shows the server only their sum: set one of them to its default")
        if self.screens and self.dp_sigma > 0:
            raise ValueError("federation.aggregation=screen keeps or rejects a client by its data, which "
                             "dp_sigma's accounting (one row's effect on the sum) does not cover: set one of them to "
                             "its default")
        if self.robust and self.client_level_dp:
            raise ValueError(f"federation.aggregation={self.aggregation} combines the updates one by one; "
                             "client-level DP noises their sum: set dp_clip=0, or aggregation=mean")

    def _check_compression(self) -> None:
        if not isinstance(self.compression, Compression) or not isinstance(self.error_feedback, ErrorFeedback):
            raise TypeError("federation.compression and federation.error_feedback take their keys (kind, "
                            "topk_fraction, ...; enabled, bound, decay), e.g. federation.compression.kind=topk")
        compression = self.compression
        if (compression.kind == "quantize" and not compression.quantize_symmetric and compression.quantize_bits < 4
                and self.error_feedback.enabled):
            raise ValueError(f"{compression.quantize_bits}-bit min-max quantization is not contractive (no level at "
                             "0), so its error feedback can grow without bound: set "
                             "federation.compression.quantize_symmetric=true (or compression.kind=sign for 1 bit), "
                             "or federation.error_feedback.enabled=false")
        if compression.lossy and self.secure_aggregation:
            raise ValueError(f"federation.compression.kind={compression.kind} saves bytes only on a sparse or "
                             "low-bit message, and secure aggregation's masks make every entry of it a full ring "
                             "element: set compression.kind=none or secure_aggregation=false")

    @property
    def compresses(self) -> bool:
        """Clients compress their model updates (lossily) before they leave."""
        return self.compression.lossy

    @property
    def robust(self) -> bool:
        """The server combines the model updates otherwise than by their mean."""
        return self.aggregation not in ("mean", "screen")

    @property
    def screens(self) -> bool:
        """The server checks each client's statistics before it sums them."""
        return self.aggregation == "screen"

    @property
    def client_level_dp(self) -> bool:
        """Clients clip their updates (DP-FedAvg); noise is added when dp_noise_multiplier > 0."""
        return self.dp_clip > 0

    def sampled_clients(self, round_index: int, available: Tensor) -> Tensor:
        """(m,) sorted ids of round `round_index`'s cohort among `available` (sorted ids), seeded
        by (seed, round) so every process draws the same."""
        if self.sample_rate == 1:
            return available
        generator = self.generator(round_index, SAMPLING_STREAM)
        if self.sampling == "poisson":
            chosen = torch.rand(len(available), generator=generator) < self.sample_rate
            return available[chosen.to(available.device)]
        m = max(1, round(self.sample_rate * len(available)))
        order = torch.randperm(len(available), generator=generator)[:m]
        return available[order.sort().values.to(available.device)]

    def generator(self, round_index: int, stream: int) -> torch.Generator:
        """The CPU generator of one random stream of one round: the same on every process."""
        return stream_generator(self.seed, round_index, stream)

    def adversaries(self, num_clients: int) -> Tensor:
        """(K,) bool: the round(adversary_fraction · K) adversarial clients, the same every round."""
        chosen = torch.zeros(num_clients, dtype=torch.bool)
        count = round(self.adversary_fraction * num_clients)
        if count:
            chosen[torch.randperm(num_clients, generator=self.generator(0, ADVERSARY_STREAM))[:count]] = True
        return chosen

    def dropped_clients(self, round_index: int, num_clients: int) -> Tensor:
        """(K,) bool: the clients that fail to upload in round `round_index`.

        round(dropout · K) clients, uniformly without replacement, seeded by (seed, round), so a
        run is reproducible and every process of a multi-process run draws the same set.
        """
        dropped = torch.zeros(num_clients, dtype=torch.bool)
        count = round(self.dropout * num_clients)
        if count:
            dropped[torch.randperm(num_clients, generator=self.generator(round_index, DROPOUT_STREAM))[:count]] = True
        return dropped


@dataclass(frozen=True)
class ProtocolView:
    """What a method knows of the protocol it runs under, read-only: the federation's settings;
    whether more than they decide who takes part each round (`participation_varies`: systems
    profiles' stragglers and offline clients, the screen's rejections), so a client may have missed
    earlier broadcasts; whether its clients can miss a round without notice
    (`clients_may_go_missing`: remote nodes), so a server that keeps sums across rounds asks for
    them again; the standard deviation of the noise on each coordinate of its summed statistics
    when every client uploads (`statistics_noise`: `dp_sigma` and the clients' own, 0 for none),
    which a failed solve names. Given by the protocol once it has checked a fit
    (`FitProtocol.check`)."""

    federation: Federation = Federation()
    participation_varies: bool = False
    clients_may_go_missing: bool = False
    statistics_noise: float = 0.0
