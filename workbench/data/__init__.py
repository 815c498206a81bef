"""Data: raw datasets, backbone feature cache, partitions, the federated data modules (one dataset
partitioned, `FederatedDataModule`; sites holding their own files, `SiteData`), and the boundary
everything else reads the data through (`Population`, `ClientData`: `population`).

Importing the package imports the loader modules (`datasets` and `paper_datasets` for images,
`text` for texts), so every dataset is in the registry (`workbench.data.registry`) whenever
anything here is used.
"""
from workbench.data import datasets, paper_datasets, text  # noqa: F401  (register the datasets)
from workbench.data.datamodule import FederatedDataModule, SyntheticBlobs
from workbench.data.federated import FederatedData
from workbench.data.population import ClientData, Population, Rows
from workbench.data.sites import SiteData

__all__ = ["ClientData", "FederatedData", "FederatedDataModule", "Population", "Rows", "SiteData", "SyntheticBlobs"]
