"""Backbone features, extracted once and cached on disk.

A cache file holds the features of one (dataset, split, backbone, weights, transform); its
name carries a hash of all of these and the file repeats the full key, so a file is only
ever used for exactly the inputs that produced it. Writes are atomic (temp file + rename);
a corrupt or mismatched file is reported and rebuilt.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

CACHE_FORMAT = 1  # bump when the file layout or the preprocessing changes


def preprocess(images: Tensor, input_size: int, mean: tuple, std: tuple) -> Tensor:
    """uint8 images (B, H, W) or (B, H, W, 3) -> normalized float (B, 3, S, S), channels_last.

    Grayscale is repeated to three channels; resizing is bilinear with antialiasing. The work
    is ordered to be cheap beside the backbone: resize before expanding grayscale, and scale
    and normalize in one broadcast that writes the channels_last layout the backbone reads.
    """
    x = images.float()
    x = x.unsqueeze(-1) if x.ndim == 3 else x  # (B, H, W, c), c = 1 or 3
    if x.shape[1:3] != (input_size, input_size):
        x = F.interpolate(x.permute(0, 3, 1, 2), size=(input_size, input_size), mode="bilinear",
                          antialias=True, align_corners=False).permute(0, 2, 3, 1)
    std_t = torch.tensor(std, dtype=x.dtype)
    x = x * (1 / (255 * std_t)) - torch.tensor(mean, dtype=x.dtype) / std_t  # (B, S, S, 3)
    return x.permute(0, 3, 1, 2)


@torch.inference_mode()
def extract_features(backbone, images: Tensor, batch_size: int = 256, device: str = "cpu",
                     desc: str = "features") -> Tensor:
    """Run the frozen backbone over uint8 `images` (N, H, W[, 3]) -> float32 features (N, D)."""
    # channels_last: convolution kernels on CPU run several times faster in this layout.
    model = backbone.model.to(device, memory_format=torch.channels_last).eval()
    out = torch.empty(len(images), backbone.feature_dim, dtype=torch.float32)
    start = time.perf_counter()
    with tqdm(total=len(images), desc=desc, unit="img", leave=False) as bar:
        for lo in range(0, len(images), batch_size):
            batch = preprocess(images[lo:lo + batch_size], backbone.input_size, backbone.mean, backbone.std)
            batch = batch.to(device, memory_format=torch.channels_last)
            out[lo:lo + len(batch)] = model(batch).float().cpu()
            bar.update(len(batch))
    rate = len(images) / max(time.perf_counter() - start, 1e-9)
    print(f"[workbench] extracted {desc}: {len(images)} images, {rate:.0f} images/s")
    return out


def cache_key(**fields) -> str:
    """A stable hash of everything that determines the features."""
    text = json.dumps({"format": CACHE_FORMAT, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def cache_path(cache_dir: str | Path, dataset: str, split: str, backbone: str, key: str) -> Path:
    return Path(cache_dir).expanduser() / _safe(dataset) / f"{split}-{_safe(backbone)}-{key[:16]}.pt"


def _read(path: Path, key: str, labels: Tensor, feature_dim: int) -> Tensor:
    """The cached features if `path` holds exactly these; raises ValueError saying why not."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file fails in many ways
        raise ValueError(f"unreadable ({type(error).__name__}: {error})") from error
    if not isinstance(blob, dict) or blob.get("key") != key:
        raise ValueError("its key does not match this dataset/backbone/transform")
    features = blob.get("features")
    if not isinstance(features, Tensor) or features.dtype != torch.float32 \
            or tuple(features.shape) != (len(labels), feature_dim):
        raise ValueError(f"features have the wrong shape or dtype, expected ({len(labels)}, {feature_dim}) float32")
    if not torch.equal(blob.get("labels"), labels):
        raise ValueError("its labels differ from the dataset's")
    if not torch.isfinite(features).all():
        raise ValueError("features contain NaN or inf")
    return features


def _write_atomic(path: Path, blob: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(blob, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached_features(backbone, images: Tensor, labels: Tensor, *, cache_dir: str | Path,
                    dataset: str, split: str, source: str, batch_size: int = 256,
                    device: str = "cpu") -> Tensor:
    """Features of `images` (N, ...) from the cache, extracting and storing them when absent."""
    key = cache_key(dataset=dataset, source=source, split=split, num_samples=len(labels),
                    backbone=backbone.name, weights=backbone.weights_id,
                    transform={"input_size": backbone.input_size, "mean": list(backbone.mean),
                               "std": list(backbone.std), "resize": "bilinear-antialias",
                               "gray": "repeat-3"})
    path = cache_path(cache_dir, dataset, split, backbone.name, key)
    if path.exists():
        try:
            return _read(path, key, labels, backbone.feature_dim)
        except ValueError as why:
            warnings.warn(f"feature cache {path} is corrupt or mismatched ({why}); rebuilding it",
                          stacklevel=2)
    features = extract_features(backbone, images, batch_size, device, desc=f"{dataset}/{split}")
    _write_atomic(path, {"key": key, "features": features, "labels": labels.clone()})
    return features
