"""A full disk is one line naming the folder, the bytes needed and those free: found before the
extraction where the size is known (the feature cache), and after a failed write anywhere else
(hparams.yaml, metrics.csv, a checkpoint), with nothing half-written left behind. The checkpoint's
case is in test_bad_input.py; a real full file system is tried where one can be mounted."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, CountingNet, FakeBackbone
from workbench.__main__ import main
from workbench.data import features

SYNTHETIC = ["--model=FedAvg", "--model.architecture=linear", "--model.num_rounds=3",
             "--data=FederatedDataModule", "--data.dataset=synthetic", "--data.num_clients=4",
             "--data.partition=iid", "--data.synthetic.train_size=240", "--data.synthetic.test_size=60",
             "--data.synthetic.dim=8", "--data.synthetic.num_classes=3", "--trainer.enable_progress_bar=false",
             "--wandb=disabled"]
IMAGES = ["--config", str(ROOT / "configs/demo.yaml"), "--trainer.enable_progress_bar=false", "--wandb=disabled"]


def one_error(capsys, *args: str) -> str:
    """Runs `fit` with `args`; asserts exit 2 and the error's two lines; returns them."""
    status = main(["fit", *args])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 2, err
    return err


def full(free: int):
    """shutil.disk_usage as on a disk with `free` bytes left."""
    real = shutil.disk_usage

    def usage(path):
        total, used, _ = real(path)
        return type(real(path))(total, used, free)

    return usage


def test_a_cache_folder_without_room_for_the_features_stops_before_the_extraction(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", full(1_000_000))
    cache, runs = tmp_path / "cache", tmp_path / "runs"
    err = one_error(capsys, *IMAGES, f"--data.cache_dir={cache}", f"--run_dir={runs}")
    # mnist5k through EfficientNet-Lite0: 4,000 + 1,000 rows of 1,280 float32 features and their labels
    needed = (4000 + 1000) * (4 * 1280 + 8) + 2 * (1 << 16)
    assert (f"error: no room for the efficientnet_lite0 features of mnist5k (train, test) in {cache / 'mnist5k'} "
            f"({needed / 1e6:,.1f} MB needed, 1.0 MB free): free some space, or set data.cache_dir") in err
    assert not cache.exists() and not runs.exists()  # nothing extracted, no run folder


@pytest.fixture
def images():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (50, 12, 12), dtype=torch.uint8, generator=gen), torch.arange(50) % 5


def test_a_cache_hit_needs_no_room(images, tmp_path, monkeypatch):
    backbone, (x, y) = FakeBackbone(CountingNet()), images
    where = dict(cache_dir=tmp_path, dataset="toy", source="unit-test")
    features.cached_features(backbone, x, y, split="train", **where)
    monkeypatch.setattr(shutil, "disk_usage", full(0))
    features.check_cache_room(backbone, {"train": y}, **where)  # cached already: nothing to write
    with pytest.raises(OSError, match=r"no room for the counting-net features of toy \(test\)"):
        features.check_cache_room(backbone, {"train": y, "test": y}, **where)


def test_a_disk_that_fills_during_the_extraction_keeps_the_features_in_memory(images, tmp_path, monkeypatch):
    backbone, (x, y) = FakeBackbone(CountingNet()), images
    expected = features.extract_features(backbone, x)

    def full_disk(blob, temporary):
        temporary.write_bytes(b"\0" * 100)  # what torch's writer got out before the disk was full
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 896 vs 790")

    monkeypatch.setattr(features, "_save", full_disk)
    with pytest.warns(UserWarning, match=r"no room for train-counting-net-\w+\.pt in .*used from memory"):
        got = features.cached_features(backbone, x, y, cache_dir=tmp_path, dataset="toy", split="train",
                                       source="unit-test")
    assert torch.equal(got, expected)
    assert not list(tmp_path.rglob("*.*"))  # no temporary, no half file


def no_space(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_no_room_for_hparams_leaves_no_empty_file_and_no_empty_folder(capsys, tmp_path, monkeypatch):
    from lightning.pytorch.loggers import csv_logs

    def write_nothing(path, hparams, *args, **kwargs):
        Path(path).write_bytes(b"")  # Lightning's writer opened the file, then the disk was full
        raise no_space(path)

    monkeypatch.setattr(csv_logs, "save_hparams_to_yaml", write_nothing)
    runs = tmp_path / "runs"
    err = one_error(capsys, *SYNTHETIC, f"--run_dir={runs}")
    assert f"error: no room for hparams.yaml in {runs / 'fedavg-synthetic-iid-k4' / 'version_0'} (" in err
    assert not list(runs.iterdir())  # it held nothing: its version and run name folders removed


def test_no_room_for_the_first_metrics_leaves_no_run_folder(capsys, tmp_path, monkeypatch):
    """Full before the first checkpoint: the version folder (its config, hparams and a 0-byte
    metrics.csv) held nothing to keep or resume, and no status.json could say so: removed."""
    from lightning.fabric.loggers.csv_logs import _ExperimentWriter

    def full(self):
        Path(self.metrics_file_path).write_bytes(b"")
        raise no_space(self.metrics_file_path)

    monkeypatch.setattr(_ExperimentWriter, "save", full)
    runs = tmp_path / "runs"
    err = one_error(capsys, *SYNTHETIC, f"--run_dir={runs}", "--checkpoint_every_round=false")
    assert "error: no room for metrics.csv in " in err
    assert not list(runs.iterdir())


def test_no_room_for_the_metrics_mid_run_is_one_line_with_the_last_checkpoint_whole(capsys, tmp_path, monkeypatch):
    from lightning.fabric.loggers.csv_logs import _ExperimentWriter

    save, saves = _ExperimentWriter.save, []

    def full_after_a_round(self):
        if not (Path(self.log_dir) / "last.ckpt").exists():
            return save(self)
        saves.append(self)
        raise no_space(self.metrics_file_path)

    monkeypatch.setattr(_ExperimentWriter, "save", full_after_a_round)
    runs = tmp_path / "runs"
    err = one_error(capsys, *SYNTHETIC, f"--run_dir={runs}")
    (version,) = runs.glob("*/version_0")
    assert f"error: no room for metrics.csv in {version} (" in err and "last.ckpt, if it has one, is whole" in err
    assert saves and torch.load(version / "last.ckpt", weights_only=False)["workbench"]  # whole
    assert not [p for p in version.iterdir() if p.name.endswith(".tmp")]


def mounted_full_disk(tmp_path: Path) -> Path:
    """A 1 MB tmpfs under `tmp_path`, or a skip where mounting is not allowed."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    return folder


@pytest.mark.subprocess
def test_a_real_full_disk_under_the_run_folder(tmp_path):
    disk = mounted_full_disk(tmp_path)
    try:
        with open(disk / "filler", "wb", buffering=0) as filler, pytest.raises(OSError):  # fill it up
            while True:
                filler.write(b"\0" * 4096)
        done = subprocess.run([sys.executable, "-m", "workbench", "fit", *SYNTHETIC, f"--run_dir={disk / 'runs'}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 2 and lines[0].startswith("error: no room for "), done.stderr
        assert not [p for p in disk.rglob("*") if p.is_file() and p.name != "filler"]  # nothing half-written
    finally:
        subprocess.run(["umount", str(disk)], check=False)
