"""The data boundary: what the methods, the engines, Flower's nodes and the references know of a
federation's data, and all they read of it.

- `Rows`: inputs (n, *input_shape) — feature vectors, images or a tail's input maps — their labels
  (n,), and, for rows that belong to clients, each row's client id (n,), the rows ordered by client.
- `ClientData`: one client's share: its training rows, and its hold-out and local test rows where
  the data has them (a remote node serves one).
- `Population`: every client's training rows, the hold-outs (the clients' own, or a pool no client
  holds), the global test split and the clients' local test splits; K, the classes, the input
  shape, the backbone's trainable tail; the rows a chunked computation or an evaluation batch
  takes; and the settings that decide the rows (`identity`, what a checkpoint must match) with
  their short labels (`names`, for run names and tables).

A `FederatedDataModule` assembles one once set up (`datamodule.population()`); its tensors are the
data module's own, not copies. `population_of` takes either.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Rows:
    """features (n, *input_shape), labels (n,), client_ids (n,) ordered by client, or None for rows
    no client holds (the global test split, a pooled hold-out)."""

    features: Tensor
    labels: Tensor
    client_ids: Tensor | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def of(self, client: int) -> Rows:
        """Client `client`'s rows: one slice, no copy (the rows are ordered by client)."""
        if self.client_ids is None:
            raise ValueError("these rows belong to no client (a global split)")
        bounds = torch.tensor([client, client + 1], dtype=self.client_ids.dtype, device=self.client_ids.device)
        start, end = torch.searchsorted(self.client_ids, bounds).tolist()
        return Rows(self.features[start:end], self.labels[start:end], self.client_ids[start:end])


@dataclass(frozen=True)
class ClientData:
    """Client `client`'s share: its training rows, its own hold-out rows (None where the hold-out
    is pooled or there is none) and its local test rows (None outside the personalized protocol)."""

    client: int
    train: Rows
    holdout: Rows | None = None
    local_test: Rows | None = None


@dataclass(frozen=True)
class Population:
    """A federation's data: K clients over `num_classes` classes.

    train: every client's training rows, ordered by client (a client may hold none);
    test: the global test split; holdout: the validation rows (the clients' own, with client ids,
        or a pool no client holds), None without; local_test: each client's own test rows (the
        personalized protocol), None without;
    batch_size: rows per evaluation batch, and per chunk where a client computes in chunks;
    tail: the backbone's trainable last stages the inputs still pass through (None: the inputs are
        what a model reads); identity: the settings that decide the rows, labels, clients and splits
        (plain values by dotted key); names: short labels (dataset, backbone, partition,
        num_clients).
    """

    train: Rows
    test: Rows
    num_clients: int
    num_classes: int
    batch_size: int
    holdout: Rows | None = None
    local_test: Rows | None = None
    tail: nn.Module | None = None
    identity: Mapping[str, Any] = field(default_factory=dict)
    names: Mapping[str, str] = field(default_factory=dict)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One input's shape: (d,) for features, (c, H, W) for images and a tail's input maps."""
        return tuple(self.train.features.shape[1:])

    @property
    def feature_dim(self) -> int:
        """Numbers per input."""
        return int(torch.Size(self.input_shape).numel())

    @property
    def client_ids(self) -> Tensor:
        """(n,) the training rows' clients, ordered."""
        assert self.train.client_ids is not None  # (training rows always belong to clients)
        return self.train.client_ids

    @property
    def clients(self) -> Tensor:
        """The ids of the clients that hold training rows, sorted."""
        return torch.unique(self.client_ids)

    def rows_per_client(self) -> Tensor:
        """(K,) each client's training rows."""
        return torch.bincount(self.client_ids.cpu(), minlength=self.num_clients)

    def split(self, name: str) -> Rows | None:
        """The rows of split `name`: `train`, `holdout`, `test` or `local_test`."""
        if name not in ("train", "holdout", "test", "local_test"):
            raise ValueError(f"no split {name!r}: train, holdout, test or local_test")
        rows: Rows | None = getattr(self, name)
        return rows

    def client(self, client: int) -> ClientData:
        """Client `client`'s share (slices of the population's rows)."""
        if not 0 <= client < self.num_clients:
            raise ValueError(f"client {client} is outside the federation's [0, {self.num_clients})")
        holdout = self.holdout.of(client) if self.holdout is not None and self.holdout.client_ids is not None else None
        local_test = self.local_test.of(client) if self.local_test is not None else None
        return ClientData(client, self.train.of(client), holdout, local_test)

    def only(self, client: int) -> Population:
        """The population as the node serving `client` sees it: that client's rows of every split
        (a pooled hold-out and the global test split belong to no client: none of them)."""
        share = self.client(client)
        nothing = Rows(self.test.features[:0], self.test.labels[:0])
        return replace(self, train=share.train, holdout=share.holdout, local_test=share.local_test, test=nothing)


def population_of(data: Any) -> Population:
    """The population of `data`: a `Population`, or a set-up data module that assembles one."""
    if isinstance(data, Population):
        return data
    assemble = getattr(data, "population", None)
    if not callable(assemble):
        raise TypeError(f"a federated method fits a Population or a FederatedDataModule (`data:` in the config), "
                        f"got {type(data).__name__}")
    population = assemble()
    assert isinstance(population, Population)
    return population
