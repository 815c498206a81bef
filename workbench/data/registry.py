"""The dataset registry: names -> loaders, each an `image` or a `text` dataset.

The loaders live in `workbench.data.datasets` (images) and `workbench.data.text` (texts), which
register themselves here when imported; `workbench.data` imports both, so every dataset is
registered as soon as anything in the package is used. This module imports neither, which keeps
the package's imports free of cycles.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.registry import Modality, Registry

if TYPE_CHECKING:  # annotations only: no import at run time
    from workbench.data.datasets import ImageDataset
    from workbench.data.text import TextDataset

__all__ = [
    "DATASETS",
    "DEFAULT_DATA_DIR",
    "DatasetLoader",
    "Modality",
    "dataset_modality",
    "list_datasets",
    "load_dataset",
    "register_dataset",
]

DEFAULT_DATA_DIR = "~/.cache/workbench/data"

DatasetLoader = Callable[[Path, bool], "ImageDataset | TextDataset"]
DATASETS: Registry[DatasetLoader] = Registry("dataset")


def register_dataset(
    name: str, modality: Modality = "image"
) -> Callable[[DatasetLoader], DatasetLoader]:
    """Register `loader(data_dir: Path, download: bool) -> ImageDataset` under `name`
    (`-> TextDataset` with modality `text`)."""
    return DATASETS.register(name, modality)


def list_datasets() -> list[str]:
    """Names accepted by `load_dataset`, sorted."""
    return DATASETS.names()


def dataset_modality(name: str) -> Modality:
    """`image` or `text` for a registered dataset name, without loading it."""
    return DATASETS.modality(name)


def load_dataset(
    name: str, data_dir: str | Path = DEFAULT_DATA_DIR, download: bool = False
) -> ImageDataset | TextDataset:
    """Load dataset `name` from `data_dir`, downloading it first only if `download` is set."""
    return DATASETS[name](Path(data_dir).expanduser(), download)
