"""Data: raw datasets, backbone feature cache, partitions, and the federated data module."""
from workbench.data.datamodule import FederatedDataModule, SyntheticBlobs

__all__ = ["FederatedDataModule", "SyntheticBlobs"]
