"""One client-side step, the same wherever clients run: in process (many clients at once, or one
by one under secure aggregation and the screen, and liars apart from the honest) and on a Flower
node.

1. The client half computes the cohort's uploads from the broadcast (`ClientHalf.client_update`).
2. The protocol's part on the client, outside the method (as Flower's mods sit around a
   ClientApp): the client hooks of the protocol's stages (`workbench.federation.stages`) — each
   client's model updates (`Upload(model_update=True)`, one row per client) clipped under
   client-level DP, summed over the cohort unless the server's aggregation needs them one row each,
   a liar's message poisoned, the screen's row count added.
3. What its clients' messages cost on the wire, from the wire spec (`codec.client_bytes`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from workbench.federation import codec
from workbench.federation.stages import Outgoing, Pipeline

if TYPE_CHECKING:
    from workbench.methods.base import ClientHalf, Cohort


@dataclass
class ClientMessage:
    """What a cohort of clients sends in one round.

    uploads: combined over its clients (summed, or stacked in client order), model updates
        clipped (under client-level DP) and summed; metrics: sums over its clients;
    bytes_up: its clients' messages on the wire, all together.
    """

    uploads: dict[str, Tensor]
    metrics: dict[str, float]
    bytes_up: int


def client_step(half: ClientHalf, spec: codec.Spec, round_index: int, broadcast: Mapping[str, Tensor],
                cohort: Cohort, clip_norm: float | None = None, pipeline: Pipeline | None = None,
                liars: bool = False, attack_noise: torch.Generator | None = None) -> ClientMessage:
    """Round `round_index` of the cohort's clients under the method's upload `spec` and the
    protocol's `pipeline` (None: what a remote node knows of it, `Pipeline.for_node`), with
    client-level DP's norm `clip_norm` (None: no clipping); `liars`: every client of the cohort
    lies (`attack_noise`: the round's stream for their noise)."""
    uploads, metrics = half.client_update(round_index, broadcast, cohort)
    unknown = sorted(set(uploads) - set(spec))
    if unknown:
        raise KeyError(f"{type(half).__name__} uploads {unknown}, which its method's `uploads` spec does not "
                       f"name ({sorted(spec)})")
    pipeline = pipeline if pipeline is not None else Pipeline.for_node(clip_norm)
    outgoing = pipeline.client_message(Outgoing(dict(uploads), spec, round_index, cohort.clients, len(cohort.labels),
                                                clip_norm, liars, attack_noise, state=half.protocol_state))
    assert outgoing.wire is not None  # (set by client_message)
    bytes_up = codec.upload_bytes(outgoing.uploads, outgoing.wire) * len(cohort.clients) if outgoing.uploads else 0
    metrics = {**metrics, **outgoing.metrics}  # the half's and the stages' own
    return ClientMessage(outgoing.uploads, {name: float(value) for name, value in metrics.items()}, bytes_up)
