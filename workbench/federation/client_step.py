"""One client-side step, the same wherever clients run: in process (many clients at once, or one
by one under secure aggregation) and on a Flower node.

1. The client half computes the cohort's uploads from the broadcast (`ClientHalf.client_update`).
2. The protocol's part on the client, outside the method (as Flower's mods sit around a
   ClientApp): the model-update uploads (`Upload(model_update=True)`) come as one row per client;
   under client-level DP each client's rows, as one vector, are clipped to the round's norm C and
   the count of clients within C travels beside them (`privacy.WITHIN_CLIP`); then the rows are
   summed over the cohort (kept, one per client, under robust aggregation). Under the screen
   (`workbench.federation.screen`) a step serves one client, whose uploads travel as its own
   row beside its count of training rows.
3. What its clients' messages cost on the wire, from the spec (`codec.client_bytes`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from workbench.federation import codec
from workbench.federation.privacy import WITHIN_CLIP, clip_client_updates
from workbench.federation.robust import CENTERS
from workbench.federation.screen import ROWS

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


def wire_spec(spec: codec.Spec, client_level_dp: bool, aggregation: str = "mean") -> dict[str, codec.Upload]:
    """The method's upload spec plus the protocol's own uploads (client-level DP's count, the
    screen's row count), as the server's `aggregation` needs them: one row per client for the model
    updates under robust aggregation, for every upload under the screen."""
    screened = aggregation == "screen"
    sent = {name: replace(upload, stacked=True) if screened or (aggregation in CENTERS and upload.model_update)
            else upload for name, upload in spec.items()}
    if screened:
        sent[ROWS] = codec.STACKED
    return {**sent, WITHIN_CLIP: codec.SUMMED} if client_level_dp else sent


def client_step(half: ClientHalf, spec: codec.Spec, round_index: int, broadcast: Mapping[str, Tensor],
                cohort: Cohort, clip_norm: float | None = None, aggregation: str = "mean") -> ClientMessage:
    """Round `round_index` of the cohort's clients under the method's upload `spec`, with
    client-level DP's norm `clip_norm` (None: no clipping), for the server's `aggregation`: under
    robust aggregation the model updates stay one row per client (`workbench.federation.robust`);
    under the screen the cohort is one client, whose every upload is one row
    (`workbench.federation.screen`)."""
    uploads, metrics = half.client_update(round_index, broadcast, cohort)
    unknown = sorted(set(uploads) - set(spec))
    if unknown:
        raise KeyError(f"{type(half).__name__} uploads {unknown}, which its method's `uploads` spec does not "
                       f"name ({sorted(spec)})")
    uploads = dict(uploads)
    updates = {name: uploads[name] for name in codec.model_update_names(spec) if name in uploads}
    if updates:
        if clip_norm is not None:
            updates, uploads[WITHIN_CLIP] = clip_client_updates(updates, clip_norm)
        uploads.update(updates if aggregation in CENTERS else {name: rows.sum(0) for name, rows in updates.items()})
    if aggregation == "screen":
        uploads = {name: value if spec[name].stacked else value[None] for name, value in uploads.items()}
        uploads[ROWS] = torch.tensor([len(cohort.labels)], device=cohort.labels.device)
    sent = wire_spec(spec, clip_norm is not None, aggregation)
    bytes_up = codec.upload_bytes(uploads, sent) * len(cohort.clients) if uploads else 0
    return ClientMessage(uploads, {name: float(value) for name, value in metrics.items()}, bytes_up)
