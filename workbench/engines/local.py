"""Clients in this process: one client half serves a set of whole clients, vectorized.

The in-process and multi-process engines run their clients through `LocalClients`: a round's
cohort is one `client_update` call over every asked client this process serves (the speed of a
vectorized round: 1000 clients cost little more than 10). Under secure aggregation each client
must mask its own upload, so the clients run one by one. Dropped clients run too (their own
state stays current, e.g. DeepAFL's Φ) but what they send is lost.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from workbench.federation import codec
from workbench.federation.privacy import clip_features
from workbench.federation.secure_aggregation import SecureAggregator
from workbench.methods.base import ClientHalf, Cohort, FederatedMethod, check_upload_names


@dataclass
class Replies:
    """What reached the server from one round's surviving clients (of this process).

    uploads: their combined plain uploads (summed / stacked in client order), or None when masked;
    masked: the ring sum of their masked messages under secure aggregation, else None;
    one_client: one client's upload shapes (zeros; for the byte count and the mask layout);
    metric_sums: the clients' metrics summed over them; client_s: the clients' compute seconds.
    """

    uploads: dict[str, Tensor] | None = None
    masked: Tensor | None = None
    one_client: dict[str, Tensor] | None = None
    metric_sums: dict[str, float] = field(default_factory=dict)
    client_s: float = 0.0

    def keep_uploads(self, uploads: Mapping[str, Tensor], spec: Mapping) -> None:
        """The combined plain uploads, and one client's shapes of them (`one_client`)."""
        self.uploads = dict(uploads)
        self.one_client = zeros_like(codec.one_client(self.uploads, spec))


def zeros_like(upload: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An upload's layout (names, shapes, dtypes) as zeros."""
    return {name: torch.zeros_like(value) for name, value in upload.items()}


def add_metrics(total: dict[str, float], metrics: Mapping[str, float]) -> dict[str, float]:
    for name, value in metrics.items():
        total[name] = total.get(name, 0.0) + float(value)
    return total


class LocalClients:
    """The clients `served` (sorted ids), with their training rows, in this process.

    features: (n, *input_shape), labels: (n,), client_ids: (n,) ordered by client: the rows of
    the served clients only. The client half is `self.half` (a module the engine registers, so
    checkpoints keep the clients' state).
    """

    def __init__(self, method: FederatedMethod, features: Tensor, labels: Tensor, client_ids: Tensor,
                 served: Tensor, batch_size: int) -> None:
        self.method = method
        self.half: ClientHalf = method.client_half()
        self.half.setup_clients(served, len(labels))
        clip = method.federation.feature_clip
        if clip > 0:  # each client bounds its own rows, so the noise's sensitivity holds by construction
            features = clip_features(features, clip)
        positions = torch.arange(len(labels), device=labels.device)
        self.data = Cohort(features, labels, client_ids, served, positions, batch_size)
        counts = torch.bincount(client_ids, minlength=method.num_clients)
        self.ends = torch.cumsum(counts, 0)
        self.starts = self.ends - counts

    @property
    def served(self) -> Tensor:
        return self.data.clients

    def cohort(self, clients: Tensor) -> Cohort:
        """The rows of `clients` (sorted ids this process serves)."""
        if len(clients) == len(self.served) and torch.equal(clients, self.served):
            return self.data
        if len(clients) == 1:  # one client's rows are one slice: no copy
            k = int(clients[0])
            rows = slice(int(self.starts[k]), int(self.ends[k]))
            data = self.data
            return Cohort(data.features[rows], data.labels[rows], data.client_ids[rows], clients,
                          data.sample_index[rows], data.batch_size)
        return self.data.of(clients)

    def update(self, round_index: int, broadcast: Mapping[str, Tensor], survivors: Tensor, lost: Tensor,
               secure: SecureAggregator | None) -> Replies:
        """Runs the round on this process's `survivors` (whose uploads count) and `lost` (dropped:
        they compute, their uploads never arrive)."""
        spec, replies = self.method.uploads, Replies()
        start = time.perf_counter()
        mine = self._mine(survivors)
        if len(lost_here := self._mine(lost)):
            self.half.client_update(round_index, broadcast, self.cohort(lost_here))
        if secure is None:
            if len(mine):
                uploads, metrics = self.half.client_update(round_index, broadcast, self.cohort(mine))
                check_upload_names(self.method, uploads)
                replies.keep_uploads(uploads, spec)
                replies.metric_sums = dict(metrics)
        else:
            for client in mine:
                upload, metrics = self.half.client_update(round_index, broadcast, self.cohort(client[None]))
                check_upload_names(self.method, upload)
                secure.add(int(client), upload)
                add_metrics(replies.metric_sums, metrics)
                replies.one_client = replies.one_client or zeros_like(upload)
            replies.masked = secure.total
        replies.client_s = time.perf_counter() - start
        return replies

    def _mine(self, clients: Tensor) -> Tensor:
        return clients[torch.isin(clients, self.served.to(clients.device))]

    def finish(self, broadcast: Mapping[str, Tensor]) -> tuple[dict[str, float], float]:
        """Every served client's local work after the final broadcast: (metric sums, seconds)."""
        if type(self.half).finish is ClientHalf.finish:  # no local work
            return {}, 0.0
        start = time.perf_counter()
        metrics = self.half.finish(broadcast, self.data)
        return dict(metrics), time.perf_counter() - start

    def predict(self, features: Tensor, client_ids: Tensor) -> Tensor:
        """Each sample under its own client's model (personalized methods)."""
        return self.half.predict(features, client_ids)
