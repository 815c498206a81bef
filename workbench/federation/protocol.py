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
- `dp_sigma`: the server adds Gaussian noise N(0, σ²) to every aggregated statistic before it
  solves (symmetric noise for symmetric uploads such as Gram matrices,
  `workbench.federation.privacy`).

In a config, a top-level section:

    federation:
      dropout: 0.2
      secure_aggregation: true
      dp_sigma: 0.0
      seed: 0
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

# Independent random streams of one round, derived from (seed, round, stream). The pairwise masks
# of secure aggregation derive theirs from (seed, round, client pair).
DROPOUT_STREAM, NOISE_STREAM = 0, 1


@dataclass(frozen=True)
class Federation:
    """Protocol settings applied by the runtime to every round.

    Args:
        dropout: the fraction of the K clients that fail to upload in each round, in [0, 1).
        secure_aggregation: mask each client's upload so the server sees only the sum.
        fixed_point_bits: fractional bits of the fixed-point encoding used by secure
            aggregation (a value x is sent as round(x · 2^bits)); the encoding error is at most
            2^-(bits+1) per number and client.
        dp_sigma: standard deviation σ ≥ 0 of the Gaussian noise the server adds to each
            aggregated statistic (0 = none).
        seed: seed of the dropouts, the pairwise masks and the noise (each round draws anew).
    """

    dropout: float = 0.0
    secure_aggregation: bool = False
    fixed_point_bits: int = 32
    dp_sigma: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.dropout < 1:
            raise ValueError(f"federation.dropout must be in [0, 1) (a fraction of the clients), got {self.dropout}")
        if not self.dp_sigma >= 0:
            raise ValueError(f"federation.dp_sigma must be ≥ 0 (the noise's standard deviation), got {self.dp_sigma}")
        if not 0 <= self.fixed_point_bits <= 52:
            raise ValueError(f"federation.fixed_point_bits must be in 0..52 (float64 has 52 fraction bits), "
                             f"got {self.fixed_point_bits}")
        if not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"federation.seed must be an integer in [0, 2⁶³), got {self.seed}")

    def generator(self, round_index: int, stream: int) -> torch.Generator:
        """The CPU generator of one random stream of one round: the same on every process."""
        state = np.random.SeedSequence([self.seed, round_index, stream]).generate_state(1, np.uint64)[0]
        return torch.Generator().manual_seed(int(state))

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
