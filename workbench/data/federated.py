"""`FederatedData`: what every data module of a federation gives the engines, the command line
and Flower's nodes — the interface `data:` in a config names.

- `FederatedDataModule`: one dataset, its features extracted or read from the cache, partitioned
  across the clients by the server's settings (a simulation; a partition node builds its share).
- `SiteData`: a cross-silo federation: each site holds its own file and no machine the whole data.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from workbench.data.population import Population


class FeatureBatches(Dataset):
    """Contiguous slices of in-memory tensors; one item is one whole batch (no per-sample collate)."""

    def __init__(self, batch_size: int, **tensors: Tensor) -> None:
        self.tensors, self.batch_size = tensors, batch_size
        self.length = len(next(iter(tensors.values())))

    def __len__(self) -> int:
        return -(-self.length // self.batch_size)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        window = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return {name: t[window] for name, t in self.tensors.items()}


class FederatedData(LightningDataModule):
    """A federation's data: K clients, the population once set up, short labels and identity."""

    @property
    def num_clients(self) -> int:
        raise NotImplementedError

    @property
    def has_validation(self) -> bool:
        """Whether validation rows are held out (the stopping rule and `validate` need them)."""
        raise NotImplementedError

    @property
    def learns_from_nodes(self) -> bool:
        """Whether the server learns the population from its nodes' introductions (cross-silo
        sites): the checks against the data wait for them."""
        return False

    def population(self, client: int | None = None, path: str | None = None) -> Population:
        """The data across the boundary; with `client`, what the node serving it holds (`path`: the
        node's own file, its node config's data-path, for data that a site holds)."""
        raise NotImplementedError

    def learn(self, sizes: Sequence[int], feature_dim: int) -> None:
        """What the nodes told the server at their introduction (`learns_from_nodes`): each client's
        training rows and their width."""
        raise NotImplementedError(f"{type(self).__name__} knows its clients' rows without asking its nodes")

    def describe(self) -> dict[str, str]:
        """Short labels (dataset, backbone, partition, num_clients), for run names, tags and tables."""
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        """The settings that decide the rows: what a checkpoint made on this data must match."""
        raise NotImplementedError

    def train_dataloader(self) -> DataLoader:
        """One item per epoch: an epoch is one communication round, and the engine reads the
        clients' training rows itself, through the data's `population()` (ordered by client),
        whole clients per process."""
        # a list is a map-style dataset (__getitem__ and __len__), which the stubs do not accept
        return DataLoader([{"round": torch.zeros((), dtype=torch.long)}], batch_size=None)  # type: ignore[arg-type]
