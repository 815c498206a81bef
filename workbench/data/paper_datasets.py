"""The seed papers' image datasets, read from their official files in `data_dir`.

| dataset | files in `data_dir` | download (`data.download=true`) |
|---|---|---|
| cifar10 | `cifar-10-batches-py/`: `data_batch_1..5`, `test_batch`, `batches.meta` | 170 MB tar.gz |
| cifar100 | `cifar-100-python/`: `train`, `test`, `meta` (fine labels) | 169 MB tar.gz |
| svhn | `train_32x32.mat`, `test_32x32.mat` (`extra` is unused) | 246 MB |
| tiny_imagenet | `tiny-imagenet-200/`: `wnids.txt`, `train/<wnid>/images/*.JPEG`, `val/` | 248 MB zip |

The readers are ours rather than torchvision's: torchvision's CIFAR and SVHN classes check every
file's MD5 sum (`_check_integrity`) and refuse anything but the exact official files, so no test
fixture in the official format could go through them; these readers parse the same formats
(pickled batches, MATLAB `.mat`) and read the official files the same way, and the tests write
tiny files in those formats. The MD5 sums are checked where they belong, on a download: each
archive is fetched with a timeout into a temporary folder in `data_dir`, checked against its
pinned size and MD5 (torchvision's values for CIFAR and SVHN), extracted there, and only then
renamed into place, so an interrupted or failed download leaves nothing behind.

Tiny-ImageNet's 110,000 JPEGs take about 40 s to decode on one core (0.35 ms each, measured on
64x64 JPEGs; threads share it out over the cores), so the decoded arrays are cached once in
`tiny-imagenet-200/workbench_decoded.npz` (1.35 GB, uncompressed, loaded in seconds), keyed by the
folder's file names, sizes and labels; a data_dir that cannot hold it only costs the decoding again.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import pickle
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench.data.datasets import DIGIT_CLASSES, ImageDataset, ImageSplit
from workbench.data.registry import register_dataset
from workbench.files import NoRoom, check_room, out_of_room, replaced_atomically

# Seconds a download waits on its connection (to connect, or for the next bytes) before giving up.
DOWNLOAD_TIMEOUT_S = 60.0
DOWNLOAD_SETTING = "data.download=true"
ROOM_FIX = "free some space there or point data.data_dir elsewhere"


@dataclass(frozen=True)
class Archive:
    """One official file to download: where from, its name, size in bytes and MD5 sum."""

    url: str
    filename: str
    size: int
    md5: str

    @property
    def megabytes(self) -> str:
        return f"{self.size / 1e6:.0f} MB"


CIFAR10_ARCHIVE = Archive("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "cifar-10-python.tar.gz",
                          170_498_071, "c58f30108f718f92721af3b95e74349a")
CIFAR100_ARCHIVE = Archive("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", "cifar-100-python.tar.gz",
                           169_001_437, "eb9058c3a382ffc7106e4002c42a8d85")
SVHN_FILES = {
    "train": Archive("http://ufldl.stanford.edu/housenumbers/train_32x32.mat", "train_32x32.mat",
                     182_040_794, "e26dedcc434d2e4c54c9b2d4a06d8373"),
    "test": Archive("http://ufldl.stanford.edu/housenumbers/test_32x32.mat", "test_32x32.mat",
                    64_275_384, "eb5a983be6a315427106f1b164d9cef3"),
}
TINY_IMAGENET_ARCHIVE = Archive("http://cs231n.stanford.edu/tiny-imagenet-200.zip", "tiny-imagenet-200.zip",
                                248_100_043, "90528d7ca1a48142e341f4ef8d21d0de")


class DownloadError(OSError):
    """A dataset that could not be downloaded: the URL, the reason, and what to do instead."""

    def __str__(self) -> str:  # the message alone
        return str(self.args[0])


def not_found(name: str, folder: Path, missing: str, size: str, manual: str) -> FileNotFoundError:
    return FileNotFoundError(f"{name} is not in {folder} ({missing}); set {DOWNLOAD_SETTING} to download it "
                             f"({size}, needs internet) or {manual}")


# --------------------------------------------------------------------------- download


def fetch(archive: Archive, destination: Path, timeout: float | None = None) -> None:
    """Downloads `archive` to `destination` and checks its size and MD5; DownloadError if it cannot."""
    timeout = DOWNLOAD_TIMEOUT_S if timeout is None else timeout
    print(f"downloading {archive.url} ({archive.megabytes}) to {destination.parent}", file=sys.stderr)
    digest, size = hashlib.md5(usedforsecurity=False), 0
    request = urllib.request.Request(archive.url, headers={"User-Agent": "workbench"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response, open(destination, "wb") as file:
            while chunk := response.read(1 << 20):
                file.write(chunk)
                digest.update(chunk)
                size += len(chunk)
    except (OSError, http.client.HTTPException) as error:  # HTTPError, a refused, timed-out or cut connection
        if out_of_room(error):
            raise NoRoom(archive.filename, destination.parent, archive.size, ROOM_FIX) from None
        reason = error if isinstance(error, urllib.error.HTTPError) else getattr(error, "reason", error)
        raise DownloadError(f"cannot download {archive.url} ({reason}); copy {archive.filename} onto this machine "
                            f"instead") from None
    if size != archive.size or digest.hexdigest() != archive.md5:
        raise DownloadError(f"{archive.url} gave {size} bytes with MD5 {digest.hexdigest()}, not the official "
                            f"{archive.size} bytes with MD5 {archive.md5}; try again later")


def download_and_extract(archive: Archive, data_dir: Path, folder: str) -> None:
    """Fetches a .tar.gz or .zip `archive` and puts its top folder `folder` in `data_dir`, all or nothing."""
    data_dir.mkdir(parents=True, exist_ok=True)
    check_room(data_dir, 2 * archive.size, f"{archive.filename} and its contents", ROOM_FIX)  # both at once
    with tempfile.TemporaryDirectory(dir=data_dir, prefix=f".{folder}.") as work:
        staging = Path(work)
        fetched = staging / archive.filename
        fetch(archive, fetched)
        if archive.filename.endswith(".zip"):
            with zipfile.ZipFile(fetched) as zipped:
                zipped.extractall(staging / "extracted")  # member names are sanitized by zipfile
        else:
            with tarfile.open(fetched, "r:gz") as tarred:
                if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12: no member may write outside
                    tarred.extractall(staging / "extracted", filter="data")
                else:  # pragma: no cover
                    tarred.extractall(staging / "extracted")
        extracted = staging / "extracted" / folder
        if not extracted.is_dir():
            raise DownloadError(f"{archive.url} holds no folder {folder}/")
        if (data_dir / folder).exists():  # an incomplete copy: the download replaces it
            shutil.rmtree(data_dir / folder)
        os.replace(extracted, data_dir / folder)


def download_file(archive: Archive, data_dir: Path) -> None:
    """Fetches `archive` into `data_dir` under its own name, all or nothing."""
    data_dir.mkdir(parents=True, exist_ok=True)
    check_room(data_dir, archive.size, archive.filename, ROOM_FIX)
    with replaced_atomically(data_dir / archive.filename) as temporary:
        fetch(archive, temporary)


# --------------------------------------------------------------------------- CIFAR


# What a pickled NumPy array refers to (NumPy 1 names its modules numpy.core, NumPy 2 numpy._core),
# and _codecs.encode, which Python 3 writes for bytes at pickle protocol 2.
_NUMPY_GLOBALS = frozenset({("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"), *(
    (f"numpy.{core}.{module}", name) for core in ("core", "_core")
    for module, name in (("multiarray", "_reconstruct"), ("multiarray", "scalar"), ("numeric", "_frombuffer")))})


class _ArraysOnly(pickle.Unpickler):
    """Unpickles CIFAR's batches (dicts of lists, strings and NumPy arrays) and refuses any other
    object, so a file in `data_dir` cannot run code when it is read."""

    def find_class(self, module: str, name: str):
        if (module, name) not in _NUMPY_GLOBALS:
            raise pickle.UnpicklingError(f"refuses to load {module}.{name}")
        return super().find_class(module, name)


def _text(value) -> str:
    return value.decode("latin1") if isinstance(value, bytes) else str(value)


def read_cifar_pickle(path: Path) -> dict:
    """One of CIFAR's pickled files as a dict with str keys (the official files, pickled by Python 2,
    have str keys; written by Python 3 they may be bytes)."""
    try:
        with open(path, "rb") as file:
            # latin1: how Python 2's pickles of NumPy arrays are read (NumPy's documented choice)
            loaded = _ArraysOnly(file, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as error:
        raise ValueError(f"{path}: not a CIFAR batch ({error})") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: not a CIFAR batch (holds a {type(loaded).__name__}, not a dict)")
    return {_text(key): value for key, value in loaded.items()}


def _cifar_split(folder: Path, files: tuple[str, ...], label_key: str) -> ImageSplit:
    images, labels = [], []
    for name in files:
        batch = read_cifar_pickle(folder / name)
        data, batch_labels = batch.get("data"), batch.get(label_key)
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
            shape = getattr(data, "shape", None)
            raise ValueError(f"{folder / name}: 'data' must be uint8 of shape (N, 3072), got {shape}")
        if batch_labels is None or len(batch_labels) != len(data):
            raise ValueError(f"{folder / name}: {len(data)} images but {label_key!r} holds "
                             f"{'none' if batch_labels is None else len(batch_labels)}")
        # Each row is the red, green then blue 32x32 plane, row-major: to (N, 32, 32, 3).
        images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        labels.append(np.asarray(batch_labels, dtype=np.int64))
    return ImageSplit(torch.from_numpy(np.ascontiguousarray(np.concatenate(images))),
                      torch.from_numpy(np.concatenate(labels)))


def _load_cifar(name: str, data_dir: Path, download: bool, archive: Archive, folder_name: str,
                train: tuple[str, ...], test: tuple[str, ...], meta: str, label_key: str,
                names_key: str) -> ImageDataset:
    folder = data_dir / folder_name
    expected = (*train, *test, meta)
    missing = [file for file in expected if not (folder / file).is_file()]
    if missing and download:
        download_and_extract(archive, data_dir, folder_name)
        missing = [file for file in expected if not (folder / file).is_file()]
    if len(missing) == len(expected):
        what = "no such folder" if not folder.is_dir() else f"none of {', '.join(expected)}"
        raise not_found(name, folder, what, f"{archive.filename}, {archive.megabytes}",
                        f"extract that archive into {data_dir}")
    if missing:
        raise FileNotFoundError(f"{folder} lacks {', '.join(missing)} of {name}; extract {archive.filename} "
                                f"again, or set {DOWNLOAD_SETTING} to download it")
    classes = tuple(_text(label) for label in read_cifar_pickle(folder / meta).get(names_key, ()))
    if not classes:
        raise ValueError(f"{folder / meta}: no {names_key!r} (the class names)")
    return ImageDataset(name=name, train=_cifar_split(folder, train, label_key),
                        test=_cifar_split(folder, test, label_key), classes=classes,
                        source=f"{folder} (official pickled batches)")


@register_dataset("cifar10")
def _load_cifar10(data_dir: Path, download: bool) -> ImageDataset:
    """CIFAR-10, 50000 train / 10000 test RGB images of (32, 32, 3), from cifar-10-batches-py/."""
    return _load_cifar("cifar10", data_dir, download, CIFAR10_ARCHIVE, "cifar-10-batches-py",
                       tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), "batches.meta",
                       "labels", "label_names")


@register_dataset("cifar100")
def _load_cifar100(data_dir: Path, download: bool) -> ImageDataset:
    """CIFAR-100 (fine labels), 50000 train / 10000 test RGB images of (32, 32, 3), from cifar-100-python/."""
    return _load_cifar("cifar100", data_dir, download, CIFAR100_ARCHIVE, "cifar-100-python", ("train",),
                       ("test",), "meta", "fine_labels", "fine_label_names")


# --------------------------------------------------------------------------- SVHN


def _svhn_split(path: Path) -> ImageSplit:
    from scipy.io import loadmat

    try:
        mat = loadmat(path, variable_names=["X", "y"])
    except (OSError, ValueError, TypeError, NotImplementedError) as error:
        raise ValueError(f"{path}: not a readable .mat file ({error})") from None
    images, labels = mat.get("X"), mat.get("y")
    if images is None or images.dtype != np.uint8 or images.ndim != 4 or images.shape[:3] != (32, 32, 3):
        raise ValueError(f"{path}: X must be uint8 of shape (32, 32, 3, N), got {getattr(images, 'shape', None)}")
    if labels is None or labels.size != images.shape[3]:
        raise ValueError(f"{path}: {images.shape[3]} images but y holds {getattr(labels, 'size', 0)} labels")
    labels = labels.reshape(-1).astype(np.int64)
    if labels.min(initial=1) < 1 or labels.max(initial=10) > 10:
        raise ValueError(f"{path}: labels must be 1..10 (10 is the digit 0), got {labels.min()}..{labels.max()}")
    # X is (row, column, channel, index); the label 10 stands for the digit 0.
    return ImageSplit(torch.from_numpy(np.ascontiguousarray(images.transpose(3, 0, 1, 2))),
                      torch.from_numpy(labels % 10))


@register_dataset("svhn")
def _load_svhn(data_dir: Path, download: bool) -> ImageDataset:
    """SVHN cropped digits, 73257 train / 26032 test RGB images of (32, 32, 3); extra is unused."""
    missing = [archive for archive in SVHN_FILES.values() if not (data_dir / archive.filename).is_file()]
    if missing and download:
        for archive in missing:
            download_file(archive, data_dir)
        missing = []
    if missing:
        size = sum(archive.size for archive in missing) / 1e6
        names = ", ".join(archive.filename for archive in missing)
        raise not_found("svhn", data_dir, f"no {names}", f"{size:.0f} MB", f"copy {names} there")
    return ImageDataset(name="svhn", train=_svhn_split(data_dir / SVHN_FILES["train"].filename),
                        test=_svhn_split(data_dir / SVHN_FILES["test"].filename), classes=DIGIT_CLASSES,
                        source=f"{data_dir} (official .mat files)")


# --------------------------------------------------------------------------- Tiny-ImageNet

TINY_IMAGENET_FOLDER = "tiny-imagenet-200"
TINY_IMAGENET_CACHE = "workbench_decoded.npz"
TINY_IMAGENET_SIZE = 64
_CACHE_VERSION = "1"


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:  # a val image that the annotations name: its decoding says so
        return -1


def _tiny_imagenet_files(folder: Path) -> tuple[list[str], list[tuple[str, int]], list[tuple[str, int]], str]:
    """The class ids, the (path, label) of every train and val image in a fixed order (the classes
    in wnids.txt's order, each class's images by file name; val in its annotations' order), and a
    digest of the images' names, sizes and labels, which any change to the folder changes.

    Paths are strings and sizes come from the directory scan: 110,000 pathlib objects cost seconds."""
    wnids = [line.strip() for line in (folder / "wnids.txt").read_text().splitlines() if line.strip()]
    if not wnids or len(set(wnids)) != len(wnids):
        raise ValueError(f"{folder / 'wnids.txt'} must list distinct class ids, one a line")
    label_of = {wnid: label for label, wnid in enumerate(wnids)}
    listed = [f"v{_CACHE_VERSION} {' '.join(wnids)}"]
    train = []
    for label, wnid in enumerate(wnids):
        images = os.path.join(folder, "train", wnid, "images")
        try:
            found = sorted((entry.name, entry.stat().st_size) for entry in os.scandir(images)
                           if entry.name.endswith(".JPEG"))
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"{folder} lacks train/{wnid}/images/ (a class of wnids.txt)") from None
        train += [(os.path.join(images, name), label) for name, _ in found]
        listed += [f"{name}\t{size}\t{label}" for name, size in found]
    annotations = folder / "val" / "val_annotations.txt"
    if not annotations.is_file():
        raise FileNotFoundError(f"{folder} lacks val/val_annotations.txt (the labels of the test split)")
    val_images = os.path.join(folder, "val", "images")
    val = []
    for number, line in enumerate(annotations.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in label_of:
            raise ValueError(f"{annotations}:{number}: expected `<file>\\t<wnid of wnids.txt>\\t...`, got {line!r}")
        path = os.path.join(val_images, fields[0])
        val.append((path, label_of[fields[1]]))
        listed.append(f"val/{fields[0]}\t{_size(path)}\t{label_of[fields[1]]}")
    return wnids, train, val, hashlib.sha256("\n".join(listed).encode()).hexdigest()


def _class_names(folder: Path, wnids: list[str]) -> tuple[str, ...]:
    """Each class's first name in words.txt (`n01443537\\tgoldfish, Carassius auratus`), else its id."""
    names: dict[str, str] = {}
    if (folder / "words.txt").is_file():
        for line in (folder / "words.txt").read_text(encoding="utf-8", errors="replace").splitlines():
            wnid, _, words = line.partition("\t")
            names[wnid] = words.split(",")[0].strip()
    return tuple(names.get(wnid) or wnid for wnid in wnids)


def _decode(path: str) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))  # some official images are grayscale JPEGs
    except (OSError, ValueError) as error:  # missing, truncated or not an image
        raise ValueError(f"cannot read {path} ({error})") from None
    if pixels.shape != (TINY_IMAGENET_SIZE, TINY_IMAGENET_SIZE, 3):
        raise ValueError(f"{path} is {pixels.shape[1]}x{pixels.shape[0]}, expected 64x64")
    return pixels


def _decode_all(entries: list[tuple[str, int]]) -> tuple[np.ndarray, np.ndarray]:
    images = np.empty((len(entries), TINY_IMAGENET_SIZE, TINY_IMAGENET_SIZE, 3), dtype=np.uint8)
    # Pillow decodes without the GIL, so threads use every core.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for index, pixels in enumerate(pool.map(_decode, [path for path, _ in entries])):
            images[index] = pixels
    return images, np.asarray([label for _, label in entries], dtype=np.int64)


def _read_cache(path: Path, fingerprint: str) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path) as cached:
            if str(cached["fingerprint"]) != fingerprint:
                return None
            return {key: cached[key] for key in ("train_images", "train_labels", "test_images", "test_labels")}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError):  # absent or damaged: decode again
        return None


def _write_cache(path: Path, arrays: dict[str, np.ndarray], fingerprint: str) -> None:
    contents: dict[str, Any] = {"fingerprint": np.asarray(fingerprint), **arrays}
    try:
        with replaced_atomically(path) as temporary, open(temporary, "wb") as file:
            np.savez(file, **contents)
    except OSError as error:  # a read-only or full data_dir: the data loads all the same, only slower next time
        warnings.warn(f"could not cache the decoded Tiny-ImageNet in {path} ({error}); the next load decodes "
                      f"the JPEGs again", stacklevel=3)


@register_dataset("tiny_imagenet")
def _load_tiny_imagenet(data_dir: Path, download: bool) -> ImageDataset:
    """Tiny-ImageNet, 100000 train / 10000 test (its val split) RGB images of (64, 64, 3), 200 classes."""
    folder = data_dir / TINY_IMAGENET_FOLDER
    if not (folder / "wnids.txt").is_file() and download:
        download_and_extract(TINY_IMAGENET_ARCHIVE, data_dir, TINY_IMAGENET_FOLDER)
    if not (folder / "wnids.txt").is_file():
        archive = TINY_IMAGENET_ARCHIVE
        raise not_found("tiny_imagenet", folder, "no wnids.txt", f"{archive.filename}, {archive.megabytes}",
                        f"unzip it into {data_dir}")
    wnids, train, val, fingerprint = _tiny_imagenet_files(folder)
    arrays = _read_cache(folder / TINY_IMAGENET_CACHE, fingerprint)
    if arrays is None:
        (train_images, train_labels), (test_images, test_labels) = _decode_all(train), _decode_all(val)
        arrays = {"train_images": train_images, "train_labels": train_labels,
                  "test_images": test_images, "test_labels": test_labels}
        _write_cache(folder / TINY_IMAGENET_CACHE, arrays, fingerprint)
    return ImageDataset(
        name="tiny_imagenet",
        train=ImageSplit(torch.from_numpy(arrays["train_images"]), torch.from_numpy(arrays["train_labels"])),
        test=ImageSplit(torch.from_numpy(arrays["test_images"]), torch.from_numpy(arrays["test_labels"])),
        classes=_class_names(folder, wnids),
        source=f"{folder} (val split as test)",
    )
