"""What the tests share: quiet fits, references, stand-in backbones, the tiers and their guards.

Tiers (markers; `pyproject.toml` runs the fast one by default, `.ci/run` every one):
`subprocess` starts interpreters (the command line as a process, several processes, sweeps),
`ray` runs a Flower simulation on Ray, `browser` renders a page in Chromium, `slow` is a long check
in process. Helpers a folder's tests share sit in that folder's `conftest.py`.
"""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from lightning import Callback, Trainer

from workbench.data import FederatedDataModule
from workbench.engines import LightningEngine

ROOT = Path(__file__).resolve().parents[1]  # the repository

os.environ["WANDB_MODE"] = "disabled"  # tests never talk to W&B
os.environ.setdefault("WANDB_SILENT", "true")


def quiet_trainer(**settings) -> Trainer:
    """A Lightning Trainer for a method's full fit (the engine sets its epochs from the rounds),
    with no logs, bars or checkpoints (a round is one step: with a logger, every round is logged)."""
    return Trainer(**{"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                      "enable_model_summary": False, "num_sanity_val_steps": 0, "log_every_n_steps": 1, **settings})


class InterruptAfter(Callback):
    """Stops a fit after `rounds` rounds as an interruption would: unfitted, resumable from its
    checkpoint (a Trainer limited to fewer epochs than the rounds is refused)."""

    def __init__(self, rounds: int):
        self.rounds = rounds

    def on_train_epoch_end(self, trainer: Trainer, module) -> None:
        if trainer.current_epoch + 1 >= self.rounds:
            trainer.should_stop = True


def fit(method, datamodule, federation=None):
    """Run a method's full fit in process through a quiet Lightning Trainer; returns the engine
    (`engine.fit_metrics`, `engine.trainer`)."""
    engine = LightningEngine(method, federation)
    quiet_trainer().fit(engine, datamodule=datamodule)
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


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()  # a comparison: no autograd graph (nor its warning)
    scale = torch.linalg.norm(b)
    return float(torch.linalg.norm(a - b) / scale) if scale > 0 else float(torch.linalg.norm(a))


class CountingNet(torch.nn.Module):
    """A tiny stand-in backbone that counts its forward passes: (B, 3, S, S) -> (B, 8)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.proj(x.mean(dim=(2, 3)))


@dataclass(frozen=True)
class FakeBackbone:
    model: torch.nn.Module
    name: str = "counting-net"
    feature_dim: int = 8
    input_size: int = 16
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.25, 0.25, 0.25)
    weights_id: str = "random-init:seed=0"


def centralized_ridge(dm: FederatedDataModule, gamma_out: float, bias: bool = False) -> torch.Tensor:
    x = dm.train_features.double()
    if bias:
        x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    y = torch.nn.functional.one_hot(dm.train_labels, dm.num_classes).double()
    return torch.linalg.solve(x.T @ x + gamma_out * torch.eye(x.shape[1], dtype=x.dtype), x.T @ y)


def last_run(run_dir: Path) -> Path:
    return max(run_dir.glob("*/version_*"), key=lambda p: p.stat().st_mtime)


def metrics(run: Path) -> dict[str, float]:
    merged = {}
    for row in csv.DictReader((run / "metrics.csv").open()):
        merged.update({k: float(v) for k, v in row.items() if v})
    return merged


def save_tiny_gpt2(directory: Path, sentences: list[str], *, layers: int, vocab_size: int):
    """A GPT-2 `layers` deep and 32 wide (random weights from torch's current seed) and a byte-level
    BPE tokenizer trained on `sentences`, saved into `directory` with save_pretrained, as GPT-2's
    own files are: (the model, the tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2Model, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(sentences * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                        bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    eos = tokenizer.eos_token_id
    config = GPT2Config(n_layer=layers, n_embd=32, n_head=2, n_positions=64, vocab_size=len(tokenizer),
                        bos_token_id=eos, eos_token_id=eos)
    net = GPT2Model(config).eval()
    net.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return net, tokenizer


# ---- no test writes outside its temporary folder -----------------------------------------------
#: where a test could leave files behind: the repository and the workbench's default caches
WATCHED = (ROOT, Path("~/.cache/workbench").expanduser())
#: what the tools themselves keep in the repository
TOOL_FILES = {".git", ".venv", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", "workbench.egg-info"}


def _files() -> set[Path]:
    found = set()
    for root in WATCHED:
        for folder, subfolders, files in os.walk(root):
            subfolders[:] = [name for name in subfolders if name not in TOOL_FILES]
            found |= {Path(folder, name) for name in files}
    return found


def pytest_sessionstart(session) -> None:
    session.config.stash[_BEFORE] = _files()


def pytest_sessionfinish(session, exitstatus) -> None:
    """The run fails when a test left a file in the repository or the default caches."""
    before = session.config.stash.get(_BEFORE, None)
    if before is None or hasattr(session.config, "workerinput"):
        return
    left = sorted(_files() - before)
    if left:
        shown = "\n  ".join(str(path) for path in left[:20])
        print(f"\nthe tests wrote {len(left)} file(s) outside their temporary folders:\n  {shown}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[set]()
