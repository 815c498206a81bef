"""Clients in this process: one client half serves a set of whole clients, vectorized.

The in-process and multi-process engines run their clients through `LocalClients`: a round's
cohort is one `client_step` over every asked client this process serves (the speed of a
vectorized round: 1000 clients cost little more than 10). Under secure aggregation each client
must mask its own message, and under the screen (`workbench.federation.screen`) send its own
statistics, so the clients run one by one. Dropped clients run too (their own
state stays current, e.g. DeepAFL's Φ) but what they send is lost. Adversarial clients
(`federation.adversary_fraction`) train on flipped labels, or run apart from the honest ones and
poison what they send (the protocol's `Lie` stage, `workbench.federation.stages`).
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from workbench.engines.round import Calibration, Replies, RoundRequest, add_metrics, layout_of
from workbench.federation import codec
from workbench.federation.adversaries import segments
from workbench.federation.client_step import client_step
from workbench.federation.protocol import ATTACK_STREAM, Federation
from workbench.federation.stages import ClientRows, Lie, Pipeline, Stage
from workbench.methods.base import ClientHalf, Cohort, FederatedMethod


class LocalClients:
    """The clients `served` (sorted ids), with their training rows, in this process (a `Transport`).

    features: (n, *input_shape), labels: (n,), client_ids: (n,) ordered by client: the rows of
    the served clients only; `federation` and `stages` (of one's own): the protocol, whose client
    hooks (`workbench.federation.stages`) run here. The client half is `self.half` (a module the engine
    registers, so checkpoints keep the clients' state).
    """

    def __init__(self, method: FederatedMethod, features: Tensor, labels: Tensor, client_ids: Tensor,
                 served: Tensor, batch_size: int, federation: Federation | None = None,
                 stages: Sequence[Stage] = ()) -> None:
        self.method = method
        self.federation = federation or Federation()
        self.pipeline = Pipeline.of(self.federation, stages)  # its client hooks run here
        rows = self.pipeline.client_rows(ClientRows(features, labels, client_ids, method.num_classes,
                                                    method.num_clients))  # clipped rows, flipped labels
        self.half: ClientHalf = method.client_half()
        self.half.setup_clients(served, len(rows.labels))
        self.pipeline.keep_state(self.half, method.uploads)  # (the compressor's error feedback)
        lie = self.pipeline.get(Lie)
        # (K,) bool: who poisons what it sends (none by default)
        self.liars = (lie.adversaries(method.num_clients) if isinstance(lie, Lie) and lie.poisons_uploads
                      else torch.zeros(method.num_clients, dtype=torch.bool))
        positions = torch.arange(len(rows.labels), device=rows.labels.device)
        self.data = Cohort(rows.features, rows.labels, rows.client_ids, served, positions, batch_size)
        counts = torch.bincount(rows.client_ids, minlength=method.num_clients)
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

    def step(self, request: RoundRequest, clients: Tensor, liars: bool = False,
             attack_noise: torch.Generator | None = None):
        """The client step of `clients` (sorted ids this process serves) in `request`'s round
        (`liars`: they all lie, drawing their noise from `attack_noise`)."""
        return client_step(self.half, self.method.uploads, request.round_index, request.broadcast,
                           self.cohort(clients), request.clip_norm, self.pipeline, liars, attack_noise)

    def update(self, request: RoundRequest) -> Replies:
        """Runs the round on this process's survivors (whose uploads count) and lost clients
        (dropped: they compute, their uploads never arrive)."""
        if request.pipeline != self.pipeline:  # its client hooks ran on these clients' rows, and run on their uploads
            raise ValueError(f"these in-process clients were built under another protocol "
                             f"({self.pipeline.line() or 'none of its parts'}) than the fit's "
                             f"({request.pipeline.line() or 'none of its parts'}): build LocalClients with the "
                             "fit's federation and stages")
        replies, secure = Replies(), request.secure
        start = time.perf_counter()
        mine = self._mine(request.survivors)
        if len(lost_here := self._mine(request.lost)):
            self.step(request, lost_here)
        federation = self.federation
        lying = bool(self.liars[mine.cpu()].any())
        attack_noise = federation.generator(request.round_index, ATTACK_STREAM) if lying else None
        if secure is None:
            if len(mine) and not lying and not federation.screens:  # the usual round: one vectorized step
                message = self.step(request, mine)
                replies.uploads, replies.metric_sums, replies.bytes_up = (message.uploads, message.metrics,
                                                                          message.bytes_up)
            elif len(mine):  # honest and lying clients apart (the screened one by one), in client order
                parts = []
                runs = ([(client[None], bool(self.liars[int(client)])) for client in mine]
                        if federation.screens else segments(mine, self.liars))
                for run, adversarial in runs:
                    message = self.step(request, run, adversarial, attack_noise)
                    parts.append(message.uploads)
                    add_metrics(replies.metric_sums, message.metrics)
                    replies.bytes_up += message.bytes_up
                replies.uploads = codec.combine(parts, request.spec)
        else:
            for client in mine:
                message = self.step(request, client[None], bool(self.liars[int(client)]), attack_noise)
                secure.add(int(client), message.uploads)
                add_metrics(replies.metric_sums, message.metrics)
                replies.layout = replies.layout or layout_of(message.uploads)
                replies.bytes_up += secure.bytes_per_client
            replies.masked = secure.total
        replies.client_s = time.perf_counter() - start
        return replies

    def calibrate(self, request: RoundRequest, client: int, repeats: int = 5) -> Calibration:
        """`client`'s step of `request`'s round on a throwaway copy of the client half (the
        clients' own state untouched), timed: the fastest of `repeats` after one untimed (the
        first call's allocations are not the step's), each on a fresh copy; `repeats` 0: the
        untimed one only (its message's size; seconds inf)."""
        clients = torch.tensor([client], device=self.served.device)
        seconds, message = math.inf, None
        for attempt in range(repeats + 1):
            half = self.method.client_half()
            half.setup_clients(self.served, len(self.data.labels))
            self.pipeline.keep_state(half, self.method.uploads)
            start = time.perf_counter()
            message = client_step(half, self.method.uploads, request.round_index, request.broadcast,
                                  self.cohort(clients), request.clip_norm, self.pipeline)
            if attempt:  # the first one warms up
                seconds = min(seconds, time.perf_counter() - start)
        assert message is not None
        return Calibration(layout_of(message.uploads), message.bytes_up, seconds,
                           int(self.ends[client] - self.starts[client]))

    def _mine(self, clients: Tensor) -> Tensor:
        return clients[torch.isin(clients, self.served.to(clients.device))]

    def finish(self, broadcast: Mapping[str, Tensor]) -> tuple[dict[str, float], float]:
        """Every served client's local work after the final broadcast: (metric sums, seconds)."""
        if type(self.half).finish is ClientHalf.finish:  # no local work
            return {}, 0.0
        start = time.perf_counter()
        metrics = self.half.finish(broadcast, self.data)
        return {name: float(value) for name, value in metrics.items()}, time.perf_counter() - start

    def predict(self, features: Tensor, client_ids: Tensor) -> Tensor:
        """Each sample under its own client's model (personalized methods)."""
        return self.half.predict(features, client_ids)
