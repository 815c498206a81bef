"""Local differential privacy: each client noises its own statistics before they leave it.

`dp_sigma` (`workbench.federation.privacy`) has the server noise the sum: the server is trusted
with the exact sum (secure aggregation keeps it from seeing any client's). Here the server is not
trusted at all: client k sends S_k + E_k, E_k ~ N(0, σ²) entrywise (symmetric for symmetric
uploads such as Gram matrices, rounded for counts), so every upload on its own is the Gaussian
mechanism on that client's data, and the server sums

    Σ_k (S_k + E_k) = Σ_k S_k + E,     E ~ N(0, m σ²) over the m clients that uploaded.

Guarantee, per client: with its rows clipped to norm ≤ B (`federation.feature_clip`) one row moves
the client's statistics by at most Δ (`FederatedMethod.statistics_sensitivity`, as for `dp_sigma`),
so after r rounds its uploads are (ε, δ)-DP for ε = `gaussian_epsilon(σ/√r, Δ, δ)` at
`federation.dp_delta`, against anyone who sees them, the server included: `privacy/local_epsilon`
(an upper bound for a client that sat rounds out). The price is the sum's noise, √m times the
central mechanism's at the same σ: AFL's ridge γ_out must then outweigh σ√m(2√d + 8).

A stage of the protocol (`workbench.federation.stages`) added from the config, after the liars
and before the masks:

    stages:
      - class_path: workbench.federation.local_noise.LocalNoise
        init_args: {sigma: 0.5}

Noise is drawn per message, from (seed, round, the message's first client), the seed the
federation's unless the stage names one: a client alone (one by one under secure aggregation)
draws its own; clients computed together in process send their sum with one draw of N(0, m σ²),
the same distribution (up to the rounding of counts).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

from workbench.federation import codec
from workbench.federation.privacy import add_gaussian_noise, gaussian_epsilon
from workbench.federation.stages import Incoming, Outgoing, Setting, Stage
from workbench.linalg import stream_generator

LOCAL_NOISE_STREAM = 5  # (beside the federation's streams of one round, `protocol.DROPOUT_STREAM` ...)


@dataclass(frozen=True)
class LocalNoise(Stage):
    """Each client adds N(0, σ²) to every statistic it sends (σ = `sigma` > 0), drawn from `seed`
    (None: the federation's, so that a sweep over `federation.seed` draws anew)."""

    sigma: float
    seed: int | None = None

    name = "local_noise"
    after = "lie"  # on what a client sends (a liar's lie included), before it is masked

    def __post_init__(self) -> None:
        if not self.sigma > 0:
            raise ValueError(f"LocalNoise.sigma must be > 0 (the noise's standard deviation), got {self.sigma}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"LocalNoise.seed must be an integer in [0, 2⁶³), got {self.seed}")

    def describe(self) -> str:
        return f"each client noises its statistics, σ = {self.sigma:g}"

    def check(self, setting: Setting) -> None:
        stacked = sorted(codec.stacked_names(setting.spec))
        if stacked or setting.federation.aggregation != "mean":
            raise ValueError(f"LocalNoise noises statistics that are summed; {setting.method} sends "
                             + (f"per-client uploads {stacked}" if stacked else
                                f"each upload apart (federation.aggregation={setting.federation.aggregation})")
                             + ": drop LocalNoise from stages:, or use federation.aggregation=mean")
        if codec.model_update_names(setting.spec):
            raise ValueError(f"LocalNoise noises statistics with a stated sensitivity; {setting.method} sends model "
                             "updates: use client-level DP (federation.dp_clip, dp_noise_multiplier) for them")
        if setting.sensitivity is None:
            warnings.warn(f"LocalNoise: {setting.method}'s statistics have no stated sensitivity here (set "
                          "federation.feature_clip, so each row's effect is bounded), so no privacy/local_epsilon "
                          "is reported", stacklevel=2)

    def statistics_variance(self, clients: int) -> float:
        return clients * self.sigma ** 2

    def client_send(self, outgoing: Outgoing) -> Outgoing:
        seed = self.seed if self.seed is not None else outgoing.federation.seed
        generator = stream_generator(seed, outgoing.round_index, LOCAL_NOISE_STREAM, int(outgoing.clients[0]))
        mine = {name: outgoing.uploads[name] for name in outgoing.spec if name in outgoing.uploads}
        noised = add_gaussian_noise(mine, self.sigma * len(outgoing.clients) ** 0.5, generator,
                                    symmetric=codec.symmetric_names(outgoing.spec))
        return replace(outgoing, uploads={**outgoing.uploads, **noised})

    def combine(self, incoming: Incoming) -> Incoming:
        sensitivity, rounds = incoming.setting.sensitivity, incoming.round_index + 1
        if sensitivity is None:
            return incoming
        epsilon = gaussian_epsilon(self.sigma / rounds ** 0.5, sensitivity, incoming.setting.federation.dp_delta)
        return replace(incoming, metrics={**incoming.metrics, "privacy/local_epsilon": epsilon})
