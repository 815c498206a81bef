"""How a fit over Flower waits for its SuperNodes (`--flower.*`; plain data: no Flower import).

A SuperNode can die, stall or lose its link in the middle of a fit. The server sends each round's
messages and waits at most `deadline_s` for the replies: a client whose reply has not come by then
is dropped from the round, as a client that drops out after being asked (the round completes
with the others: the analytic methods exactly on them; under secure aggregation the lost client's
masks are recovered from its neighbours' shares). Flower's own report that a node stopped sending
heartbeats drops it at once. A dropped node's client stays out of later rounds until a SuperNode
holding its partition connects again (a restarted node), which then serves it from the next round.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class FlowerSettings:
    """deadline_s: seconds a round (or the final broadcast, or a local test) waits for its clients'
    replies; those that miss it are dropped from the round. connect_s: seconds the fit waits for
    every SuperNode to connect and answer its first message (which may set up the node's data).
    client_cpus: CPUs per ClientApp in a local simulation (at most cores / client_cpus at once)."""

    deadline_s: float = 600.0
    connect_s: float = 600.0
    client_cpus: float = 1.0

    def __post_init__(self) -> None:
        for name in ("deadline_s", "connect_s", "client_cpus"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"flower.{name} must be a number of {'CPUs' if name == 'client_cpus' else 'seconds'} "
                                 f"> 0, got {value!r}")
