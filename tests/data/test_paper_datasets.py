"""The paper datasets (CIFAR-10/100, SVHN, Tiny-ImageNet) read from tiny fixtures written in each
dataset's official on-disk format, their not-found messages, and their downloads from a local
HTTP server (no internet): what was written is what loads, pixel for pixel and channel for channel."""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import pickle
import socket
import struct
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import last_run, metrics
from workbench.data import paper_datasets
from workbench.data.datasets import load_dataset
from workbench.data.paper_datasets import Archive, DownloadError

# --------------------------------------------------------------------------- official formats


def planes(images: np.ndarray) -> np.ndarray:
    """(N, 32, 32, 3) images as CIFAR's rows: the red, green then blue 32x32 planes, row-major."""
    return images.transpose(0, 3, 1, 2).reshape(len(images), 3072)


def cifar_images(count: int, seed: int) -> np.ndarray:
    images = np.random.default_rng(seed).integers(0, 256, (count, 32, 32, 3), dtype=np.uint8)
    images[0] = 0
    images[0, :, :, 0] = 255  # the first image pure red: channel order is visible
    return images


def python2_pickle(value) -> bytes:
    """`value` as the official files hold it, pickled by Python 2's cPickle at protocol 2: text as a
    Python 2 str (BINSTRING), a uint8 array as NumPy 1 reduces it (its bytes a str too)."""

    def put(item) -> bytes:
        if item is None:
            return b"N"
        if isinstance(item, bytes):
            return b"T" + struct.pack("<I", len(item)) + item
        if isinstance(item, int):
            return b"J" + struct.pack("<i", item)
        if isinstance(item, tuple):
            return b"(" + b"".join(map(put, item)) + b"t"
        if isinstance(item, list):
            return b"](" + b"".join(map(put, item)) + b"e"
        if isinstance(item, dict):
            return b"}(" + b"".join(put(key) + put(entry) for key, entry in item.items()) + b"u"
        assert isinstance(item, np.ndarray) and item.dtype == np.uint8
        dtype = b"cnumpy\ndtype\n" + put((b"u1", 0, 1)) + b"R" + put((3, b"|", None, None, None, -1, -1, 0)) + b"b"
        return (b"cnumpy.core.multiarray\n_reconstruct\n(cnumpy\nndarray\n" + put((0,)) + put(b"b") + b"tR"
                + b"(" + put(1) + put(item.shape) + dtype + b"\x89" + put(item.tobytes()) + b"tb")

    return b"\x80\x02" + put(value) + b"."


def dump(path: Path, content: dict, protocol: int | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(python2_pickle(content) if isinstance(protocol, str) else pickle.dumps(content, protocol=protocol))


def write_cifar10(root: Path, per_batch: int = 2, n_test: int = 3,
                  protocol: int | str = "python2") -> dict[str, np.ndarray]:
    """cifar-10-batches-py/ with data_batch_1..5, test_batch and batches.meta; returns what it wrote."""
    folder = root / "cifar-10-batches-py"
    train = cifar_images(5 * per_batch, seed=0)
    train_labels = np.arange(5 * per_batch) % 10
    for batch in range(5):
        rows = slice(batch * per_batch, (batch + 1) * per_batch)
        dump(folder / f"data_batch_{batch + 1}", {b"batch_label": f"training batch {batch + 1} of 5".encode(),
                                                  b"labels": train_labels[rows].tolist(), b"data": planes(train[rows]),
                                                  b"filenames": [b"x.png"] * per_batch}, protocol)
    test, test_labels = cifar_images(n_test, seed=1), (9 - np.arange(n_test)) % 10
    dump(folder / "test_batch", {b"batch_label": b"testing batch 1 of 1", b"labels": test_labels.tolist(),
                                 b"data": planes(test)}, protocol)
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    dump(folder / "batches.meta", {b"label_names": names, b"num_cases_per_batch": per_batch, b"num_vis": 3072},
         protocol)
    return {"train": train, "train_labels": train_labels, "test": test, "test_labels": test_labels}


def write_cifar100(root: Path) -> dict[str, np.ndarray]:
    folder = root / "cifar-100-python"
    written = {"train": cifar_images(6, seed=2), "train_labels": np.array([0, 99, 5, 42, 7, 99]),
               "test": cifar_images(2, seed=3), "test_labels": np.array([98, 1])}
    for split in ("train", "test"):
        fine = written[f"{split}_labels"]
        dump(folder / split, {b"filenames": [b"x.png"] * len(fine), b"fine_labels": fine.tolist(),
                              b"coarse_labels": (fine // 5).tolist(), b"data": planes(written[split])}, "python2")
    dump(folder / "meta", {b"fine_label_names": [f"fine{i}".encode() for i in range(100)],
                           b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)]}, "python2")
    return written


def write_svhn(root: Path) -> dict[str, np.ndarray]:
    """train_32x32.mat / test_32x32.mat: X (32, 32, 3, N) uint8 and y (N, 1), 10 standing for 0."""
    from scipy.io import savemat

    root.mkdir(parents=True, exist_ok=True)
    written: dict[str, np.ndarray] = {}
    for split, count, seed in (("train", 4, 4), ("test", 3, 5)):
        images = cifar_images(count, seed)  # (N, 32, 32, 3)
        digits = np.arange(count) % 10
        savemat(root / f"{split}_32x32.mat", {"X": images.transpose(1, 2, 3, 0),
                                                 "y": np.where(digits == 0, 10, digits).astype(np.uint8)[:, None]})
        written |= {split: images, f"{split}_labels": digits}
    return written


TINY_WNIDS = ("n01443537", "n01629819", "n02123045")
TINY_WORDS = {"n01443537": "goldfish, Carassius auratus", "n01629819": "European fire salamander, Salamandra",
              "n02123045": "tabby, tabby cat", "n00001740": "entity"}  # words.txt covers more than the 200


def _jpeg(path: Path, color: tuple[int, ...]) -> None:
    """A 64x64 JPEG of one color: RGB, or grayscale for a 1-tuple (as some official images are)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "L" if len(color) == 1 else "RGB"
    Image.new(mode, (64, 64), color if mode == "RGB" else color[0]).save(path, "JPEG", quality=95)


def write_tiny_imagenet(root: Path, per_class: int = 2) -> dict:
    """A tiny tiny-imagenet-200/: wnids.txt, words.txt, train/<wnid>/images/*.JPEG (the first one
    grayscale) with its boxes file, val/images/ with val_annotations.txt, and an unlabelled test/."""
    folder = root / "tiny-imagenet-200"
    folder.mkdir(parents=True)
    (folder / "wnids.txt").write_text("".join(f"{wnid}\n" for wnid in TINY_WNIDS))
    (folder / "words.txt").write_text("".join(f"{wnid}\t{words}\n" for wnid, words in TINY_WORDS.items()))
    train = []
    for label, wnid in enumerate(TINY_WNIDS):
        for index in range(per_class):
            color = (77,) if (label, index) == (0, 0) else (40 + 60 * label, 200 - 40 * index, 20 + 90 * index)
            path = folder / "train" / wnid / "images" / f"{wnid}_{index}.JPEG"
            _jpeg(path, color)
            train.append((path, label, color))
        (folder / "train" / wnid / f"{wnid}_boxes.txt").write_text(f"{wnid}_0.JPEG\t0\t0\t63\t63\n")
    val, lines = [], []
    for index, label in enumerate((2, 0, 1, 2)):  # the annotations' order, not the classes'
        path, color = folder / "val" / "images" / f"val_{index}.JPEG", (10 + 50 * index, 250 - 60 * label, 128)
        _jpeg(path, color)
        val.append((path, label, color))
        lines.append(f"val_{index}.JPEG\t{TINY_WNIDS[label]}\t1\t2\t60\t61\n")
    (folder / "val" / "val_annotations.txt").write_text("".join(lines))
    _jpeg(folder / "test" / "images" / "test_0.JPEG", (1, 2, 3))
    return {"train": train, "val": val}


def decoded(path: Path) -> torch.Tensor:
    with Image.open(path) as image:
        return torch.from_numpy(np.array(image.convert("RGB")))


def assert_split(split, images: np.ndarray, labels: np.ndarray) -> None:
    assert split.images.dtype == torch.uint8 and split.images.is_contiguous()
    assert split.labels.dtype == torch.int64
    assert torch.equal(split.images, torch.from_numpy(images))
    assert split.labels.tolist() == labels.tolist()


# --------------------------------------------------------------------------- the readers


@pytest.mark.parametrize("protocol", ["python2", 2, pickle.HIGHEST_PROTOCOL])
def test_cifar10_reads_the_official_pickled_batches(tmp_path, protocol):
    written = write_cifar10(tmp_path, protocol=protocol)
    cifar = load_dataset("cifar10", tmp_path)
    assert_split(cifar.train, written["train"], written["train_labels"])
    assert_split(cifar.test, written["test"], written["test_labels"])
    assert cifar.train.images.shape == (10, 32, 32, 3)
    assert cifar.train.images[0, :, :, 0].eq(255).all() and cifar.train.images[0, :, :, 1:].eq(0).all()  # red
    assert cifar.classes[:3] == ("airplane", "automobile", "bird") and len(cifar.classes) == 10
    assert cifar.name == "cifar10" and str(tmp_path / "cifar-10-batches-py") in cifar.source


def test_torchvision_refuses_the_fixture_so_the_reader_is_ours(tmp_path):
    """Why the workbench reads CIFAR itself: torchvision checks each file's MD5 sum."""
    import torchvision.datasets

    write_cifar10(tmp_path)
    with pytest.raises(RuntimeError, match="not found or corrupted"):
        torchvision.datasets.CIFAR10(str(tmp_path), train=True)


def test_cifar100_reads_the_fine_labels(tmp_path):
    written = write_cifar100(tmp_path)
    cifar = load_dataset("cifar100", tmp_path)
    assert_split(cifar.train, written["train"], written["train_labels"])
    assert_split(cifar.test, written["test"], written["test_labels"])
    assert len(cifar.classes) == 100 and cifar.classes[99] == "fine99"


def test_svhn_reads_the_official_mat_files(tmp_path):
    written = write_svhn(tmp_path)
    svhn = load_dataset("svhn", tmp_path)
    assert_split(svhn.train, written["train"], written["train_labels"])  # label 10 read as the digit 0
    assert_split(svhn.test, written["test"], written["test_labels"])
    assert svhn.train.labels[0] == 0 and svhn.train.images[0, :, :, 0].eq(255).all()
    assert svhn.classes == tuple("0123456789")


def test_tiny_imagenet_reads_the_official_tree(tmp_path):
    written = write_tiny_imagenet(tmp_path)
    tiny = load_dataset("tiny_imagenet", tmp_path)
    assert tiny.classes == ("goldfish", "European fire salamander", "tabby")
    for split, entries in ((tiny.train, written["train"]), (tiny.test, written["val"])):
        assert split.images.shape == (len(entries), 64, 64, 3) and split.images.dtype == torch.uint8
        assert split.labels.tolist() == [label for _, label, _ in entries]
        for image, (path, _, color) in zip(split.images, entries, strict=True):
            assert torch.equal(image, decoded(path))  # exactly Pillow's decoding of the file
            expected = torch.tensor(color * 3 if len(color) == 1 else color, dtype=torch.int16)
            assert (image.to(torch.int16) - expected).abs().max() <= 3  # and the color written, in RGB order
    gray = tiny.train.images[0]
    assert torch.equal(gray[..., 0], gray[..., 1]) and torch.equal(gray[..., 0], gray[..., 2])


def test_tiny_imagenet_caches_the_decoded_images_until_the_folder_changes(tmp_path, monkeypatch):
    write_tiny_imagenet(tmp_path)
    first = load_dataset("tiny_imagenet", tmp_path)
    cache = tmp_path / "tiny-imagenet-200" / paper_datasets.TINY_IMAGENET_CACHE
    assert cache.is_file() and not list(cache.parent.glob(".*.tmp"))

    def no_decoding(path):
        raise AssertionError(f"decoded {path} again")

    with monkeypatch.context() as patch:
        patch.setattr(paper_datasets, "_decode", no_decoding)
        again = load_dataset("tiny_imagenet", tmp_path)
    assert torch.equal(again.train.images, first.train.images) and torch.equal(again.test.labels, first.test.labels)

    _jpeg(tmp_path / "tiny-imagenet-200" / "train" / TINY_WNIDS[1] / "images" / "extra.JPEG", (0, 0, 255))
    changed = load_dataset("tiny_imagenet", tmp_path)
    assert len(changed.train) == len(first.train) + 1 and changed.train.labels.tolist().count(1) == 3


def test_tiny_imagenet_loads_where_its_cache_cannot_be_written(tmp_path, monkeypatch):
    import contextlib

    @contextlib.contextmanager
    def read_only(path):
        raise PermissionError(13, "Permission denied", str(path))
        yield  # pragma: no cover

    written = write_tiny_imagenet(tmp_path)
    monkeypatch.setattr(paper_datasets, "replaced_atomically", read_only)
    with pytest.warns(UserWarning, match=r"could not cache the decoded Tiny-ImageNet in .*Permission denied"):
        tiny = load_dataset("tiny_imagenet", tmp_path)
    assert len(tiny.train) == len(written["train"])
    assert not (tmp_path / "tiny-imagenet-200" / paper_datasets.TINY_IMAGENET_CACHE).exists()


@pytest.mark.parametrize("damage, message", [
    ("truncated", r"cannot read .*n01443537_1.JPEG"),
    ("small", r"n01443537_1.JPEG is 32x32, expected 64x64"),
    ("unknown class", r"val_annotations.txt:1: expected"),
    ("no annotations", r"lacks val/val_annotations.txt"),
])
def test_tiny_imagenet_damage_is_one_error_naming_the_file(tmp_path, damage, message):
    write_tiny_imagenet(tmp_path)
    folder = tmp_path / "tiny-imagenet-200"
    image = folder / "train" / TINY_WNIDS[0] / "images" / f"{TINY_WNIDS[0]}_1.JPEG"
    if damage == "truncated":
        image.write_bytes(image.read_bytes()[:100])
    elif damage == "small":
        Image.new("RGB", (32, 32)).save(image, "JPEG")
    elif damage == "unknown class":
        (folder / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn99999999\t0\t0\t1\t1\n")
    else:
        (folder / "val" / "val_annotations.txt").unlink()
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_dataset("tiny_imagenet", tmp_path)


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    write_cifar10(tmp_path)

    class Payload:
        def __reduce__(self):
            return os.system, ("echo pwned",)

    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps({b"data": Payload()}))
    with pytest.raises(ValueError, match=r"test_batch: not a CIFAR batch \(refuses to load (posix|nt).system\)"):
        load_dataset("cifar10", tmp_path)


# --------------------------------------------------------------------------- not found

NOT_FOUND = {  # dataset: the folder it names (under data_dir), the download size
    "cifar10": ("cifar-10-batches-py", "cifar-10-python.tar.gz, 170 MB"),
    "cifar100": ("cifar-100-python", "cifar-100-python.tar.gz, 169 MB"),
    "svhn": ("", "246 MB"),
    "tiny_imagenet": ("tiny-imagenet-200", "tiny-imagenet-200.zip, 248 MB"),
}


@pytest.mark.parametrize("name", sorted(NOT_FOUND))
def test_absent_files_are_one_short_error_naming_the_folder_the_setting_and_the_size(tmp_path, name):
    folder, size = NOT_FOUND[name]
    with pytest.raises(FileNotFoundError) as error:
        load_dataset(name, tmp_path, download=False)
    message = str(error.value)
    assert message.startswith(f"{name} is not in {tmp_path / folder} (no ")
    assert "set data.download=true to download it" in message and f"({size}, needs internet)" in message
    assert "\n" not in message and len(message.replace(str(tmp_path), "DIR")) < 200, message
    assert error.value.__traceback__ is not None and not list(tmp_path.iterdir())  # nothing written


def test_an_incomplete_cifar_folder_names_the_missing_files(tmp_path):
    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match=r"cifar-10-batches-py lacks test_batch of cifar10; extract"):
        load_dataset("cifar10", tmp_path)


def test_the_command_line_prints_the_not_found_message(tmp_path, capsys):
    from workbench.__main__ import main

    status = main(["fit", "--model=FedAvg", "--data=FederatedDataModule", "--data.dataset=tiny_imagenet",
                   f"--data.data_dir={tmp_path / 'data'}", "--data.inputs=images", f"--run_dir={tmp_path / 'runs'}",
                   "--trainer.enable_progress_bar=false", "--wandb=disabled"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert err.startswith(f"error: tiny_imagenet is not in {tmp_path / 'data' / 'tiny-imagenet-200'} (no wnids.txt)")


# --------------------------------------------------------------------------- downloads, offline


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def http_folder(tmp_path, monkeypatch):
    """(folder, base URL): a local HTTP server serving `folder`."""
    monkeypatch.setenv("no_proxy", "127.0.0.1")  # never through a proxy of the environment
    served = tmp_path / "served"
    served.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield served, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def serve(monkeypatch, attribute: str, path: Path, base_url: str, md5: str | None = None) -> None:
    """Points the archive `paper_datasets.<attribute>` at `path` as served at `base_url`."""
    data = path.read_bytes()
    archive = Archive(f"{base_url}/{path.name}", path.name, len(data), md5 or hashlib.md5(data).hexdigest())
    monkeypatch.setattr(paper_datasets, attribute, archive)


def test_tiny_imagenet_downloads_and_extracts_the_zip(tmp_path, http_folder, monkeypatch):
    served, url = http_folder
    written = write_tiny_imagenet(tmp_path / "source")
    with zipfile.ZipFile(served / "tiny-imagenet-200.zip", "w") as zipped:
        for path in sorted((tmp_path / "source").rglob("*")):
            zipped.write(path, path.relative_to(tmp_path / "source").as_posix())
    serve(monkeypatch, "TINY_IMAGENET_ARCHIVE", served / "tiny-imagenet-200.zip", url)
    data_dir = tmp_path / "data"
    tiny = load_dataset("tiny_imagenet", data_dir, download=True)
    assert len(tiny.train) == len(written["train"]) and len(tiny.test) == len(written["val"])
    assert sorted(p.name for p in data_dir.iterdir()) == ["tiny-imagenet-200"]  # no archive or temporary left
    assert (data_dir / "tiny-imagenet-200" / "test" / "images" / "test_0.JPEG").is_file()  # the whole zip


def test_cifar10_downloads_and_extracts_the_tarball(tmp_path, http_folder, monkeypatch):
    served, url = http_folder
    written = write_cifar10(tmp_path / "source")
    with tarfile.open(served / "cifar-10-python.tar.gz", "w:gz") as tarred:
        tarred.add(tmp_path / "source" / "cifar-10-batches-py", "cifar-10-batches-py")
    serve(monkeypatch, "CIFAR10_ARCHIVE", served / "cifar-10-python.tar.gz", url)
    data_dir = tmp_path / "data"
    cifar = load_dataset("cifar10", data_dir, download=True)
    assert_split(cifar.test, written["test"], written["test_labels"])
    assert sorted(p.name for p in data_dir.iterdir()) == ["cifar-10-batches-py"]


def test_svhn_downloads_both_files(tmp_path, http_folder, monkeypatch):
    served, url = http_folder
    written = write_svhn(served)
    files = {split: Archive(f"{url}/{split}_32x32.mat", f"{split}_32x32.mat", (served / f"{split}_32x32.mat").stat()
                            .st_size, hashlib.md5((served / f"{split}_32x32.mat").read_bytes()).hexdigest())
             for split in ("train", "test")}
    monkeypatch.setattr(paper_datasets, "SVHN_FILES", files)
    svhn = load_dataset("svhn", tmp_path / "data", download=True)
    assert_split(svhn.train, written["train"], written["train_labels"])
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["test_32x32.mat", "train_32x32.mat"]


def test_a_download_with_the_wrong_checksum_leaves_nothing(tmp_path, http_folder, monkeypatch):
    served, url = http_folder
    (served / "tiny-imagenet-200.zip").write_bytes(b"not the official zip")
    serve(monkeypatch, "TINY_IMAGENET_ARCHIVE", served / "tiny-imagenet-200.zip", url, md5="0" * 32)
    with pytest.raises(DownloadError, match=r"gave 20 bytes with MD5 [0-9a-f]{32}, not the official 20 bytes"):
        load_dataset("tiny_imagenet", tmp_path / "data", download=True)
    assert not list((tmp_path / "data").iterdir())


def test_a_missing_file_on_the_server_is_one_clear_error(tmp_path, http_folder, monkeypatch):
    _, url = http_folder
    monkeypatch.setattr(paper_datasets, "SVHN_FILES", {
        split: Archive(f"{url}/{split}_32x32.mat", f"{split}_32x32.mat", 1, "0") for split in ("train", "test")})
    with pytest.raises(DownloadError, match=r"cannot download .*/train_32x32.mat \(HTTP Error 404: File not found\)"):
        load_dataset("svhn", tmp_path / "data", download=True)
    assert not list((tmp_path / "data").iterdir())


def test_an_unreachable_server_is_one_clear_error(tmp_path, monkeypatch):
    with socket.socket() as probe:  # a port nobody listens on: the connection is refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    monkeypatch.setattr(paper_datasets, "TINY_IMAGENET_ARCHIVE",
                        Archive(f"http://127.0.0.1:{port}/tiny-imagenet-200.zip", "tiny-imagenet-200.zip", 1, "0"))
    with pytest.raises(DownloadError, match=rf"cannot download http://127.0.0.1:{port}/tiny-imagenet-200.zip \("
                                            r".*refused.*\); copy tiny-imagenet-200.zip onto this machine instead"):
        load_dataset("tiny_imagenet", tmp_path / "data", download=True)
    assert not list((tmp_path / "data").iterdir())


def test_a_silent_server_times_out_instead_of_hanging(tmp_path, monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    monkeypatch.setattr(paper_datasets, "DOWNLOAD_TIMEOUT_S", 0.3)
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        port = silent.getsockname()[1]
        url = f"http://127.0.0.1:{port}/cifar-10-python.tar.gz"
        monkeypatch.setattr(paper_datasets, "CIFAR10_ARCHIVE", Archive(url, "cifar-10-python.tar.gz", 1, "0"))
        start = time.monotonic()
        with pytest.raises(DownloadError, match=r"cannot download .*cifar-10-python.tar.gz \(.*timed out"):
            load_dataset("cifar10", tmp_path / "data", download=True)
    assert time.monotonic() - start < 5
    assert not list((tmp_path / "data").iterdir())


# --------------------------------------------------------------------------- end to end


def test_fit_on_the_cifar10_fixture_from_the_command_line(tmp_path):
    """`python -m workbench fit` in process on the tiny CIFAR-10 files: FedAvg's small CNN on the
    raw 32x32 images (`data.inputs=images`), two clients, one round."""
    from workbench.__main__ import main

    write_cifar10(tmp_path / "data", per_batch=4, n_test=4)
    status = main(["fit", "--model=FedAvg", "--model.architecture=cnn", "--model.num_rounds=1",
                   "--model.local.batch_size=4", "--data=FederatedDataModule", "--data.dataset=cifar10",
                   f"--data.data_dir={tmp_path / 'data'}", f"--data.cache_dir={tmp_path / 'cache'}",
                   "--data.inputs=images", "--data.num_clients=2", "--data.partition=iid",
                   "--data.min_partition_size=1", f"--run_dir={tmp_path / 'runs'}",
                   "--trainer.enable_progress_bar=false", "--wandb=disabled"])
    assert status == 0
    logged = metrics(last_run(tmp_path / "runs"))
    assert 0 <= logged["test/acc"] <= 1 and logged["comm/rounds"] == 1
