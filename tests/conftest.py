"""Shared test fixtures: tiny synthetic problems, offline logging."""
from __future__ import annotations

import os

import pytest
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
