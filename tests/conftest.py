"""Shared test fixtures: tiny synthetic problems, offline logging."""
from __future__ import annotations

import os

import pytest
import torch
from lightning import Trainer

from workbench.engines import LightningEngine

os.environ["WANDB_MODE"] = "disabled"  # tests never talk to W&B
os.environ.setdefault("WANDB_SILENT", "true")


def quiet_trainer(method, **settings) -> Trainer:
    """A Lightning Trainer for a method's full fit, with no logs, bars or checkpoints."""
    return Trainer(**{"max_epochs": max(method.num_rounds, 1), "logger": False, "enable_checkpointing": False,
                      "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
                      **settings})


def fit(method, datamodule, federation=None):
    """Run a method's full fit in process through a quiet Lightning Trainer; returns the engine
    (`engine.fit_metrics`, `engine.trainer`)."""
    engine = LightningEngine(method, federation)
    quiet_trainer(method).fit(engine, datamodule=datamodule)
    return engine


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
def add_dataset():
    """`add_dataset(name, loader, modality="image")` registers a dataset for one test only."""
    from contextlib import ExitStack

    from workbench.data.registry import DATASETS

    with ExitStack() as registered:
        yield lambda name, loader, modality="image": registered.enter_context(
            DATASETS.temporarily(name, loader, modality))


# ---- what was skipped, for `.ci/run` to run again once the extras are installed ----------------
SKIPPED_LOG = os.environ.get("WORKBENCH_SKIPPED_TESTS")


def _note_skipped(report) -> None:
    if SKIPPED_LOG and report.skipped:
        with open(SKIPPED_LOG, "a") as log:
            log.write(report.nodeid + "\n")


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call"):
        _note_skipped(report)


def pytest_collectreport(report):  # a module skipped as a whole (pytest.importorskip at its top)
    _note_skipped(report)
