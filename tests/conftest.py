"""Shared test fixtures: tiny synthetic problems, offline logging."""
from __future__ import annotations

import os

import pytest
import torch
from lightning import Trainer

os.environ["WANDB_MODE"] = "disabled"  # tests never talk to W&B
os.environ.setdefault("WANDB_SILENT", "true")


def fit(method, datamodule):
    """Run a method's full fit through a quiet Lightning Trainer; returns the trainer."""
    trainer = Trainer(max_epochs=method.num_rounds, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(method, datamodule=datamodule)
    return trainer


@pytest.fixture
def fit_method():
    return fit


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny problems (`pytestmark = pytest.mark.usefixtures("one_thread")`): one
    thread spares every op the thread pool's wake-up cost."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def add_dataset(monkeypatch):
    """`add_dataset(name, loader, modality="image")` registers a dataset for one test only."""
    from workbench.data import datasets

    def add(name: str, loader, modality: str = "image") -> None:
        monkeypatch.setitem(datasets._REGISTRY, name, loader)
        monkeypatch.setitem(datasets._MODALITIES, name, modality)

    return add
