"""Backbone features, extracted once and cached on disk.

A cache file holds the features of one (dataset, split, backbone, weights, transform); its
name carries a hash of all of these and the file repeats the full key, so a file is only
ever used for exactly the inputs that produced it. For a text backbone the transform is the
tokenizer (a hash of it), max_length, pooling and normalization. Writes are atomic
(`workbench.files`); a corrupt or mismatched file is reported and rebuilt.

Every file carries a digest of each tensor's bytes (xxh3-128, `payload_digest`), checked on every
read: `torch.load` does not check the zip's CRCs, so without it a flipped bit on disk would change
the features silently. A damaged file is rebuilt with a warning naming it. xxh3 because it is
fast enough to check on every hit: on a 496 MB cache it adds 17 ms to a 272 ms `torch.load`
(6 %), where blake2b would add 171 % (benchmarks/results/cache_digest.md).

A full disk is found before the extraction: `check_cache_room` compares the bytes the missing
files will take with the folder's free space (the data module calls it before its first
extraction, and so before the run folder exists).

Precision: the forward runs in float32, or with `precision="bf16"` under bfloat16 autocast
(convolutions and matrix products in bfloat16, other ops as torch.autocast decides); features
are stored float32 either way. bf16 is not the default: on CPUs without native bfloat16
instructions it is several times slower (benchmarks/backbones.py measures it). The precision
enters the key only when it is not float32, so float32 keys are the ones written before the
option existed and old caches stay valid.

Multi-depth features (`backbone.feature_layers`, see `workbench.backbones.layers`) enter the key
the same way: as `layers` only when some are chosen, so last-layer keys are unchanged. So do the
input maps of a trainable tail (`backbone.tail_input`, `workbench.backbones.tail`): as `tail_input`,
the module whose input they are, stored flattened (N, C·H·W).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
import xxhash
from torch import Tensor
from tqdm.auto import tqdm

from workbench.files import NoRoom, check_room, existing_parent, out_of_room, replaced_atomically

CACHE_FORMAT = 1  # bump when the file layout or the preprocessing changes
PRECISIONS = ("float32", "bf16")


def preprocess(images: Tensor, input_size: int, mean: tuple | Tensor, std: tuple | Tensor) -> Tensor:
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
    std_t = torch.as_tensor(std, dtype=x.dtype, device=x.device)  # (tuples, or tensors already there)
    x = x * (1 / (255 * std_t)) - torch.as_tensor(mean, dtype=x.dtype, device=x.device) / std_t  # (B, S, S, 3)
    return x.permute(0, 3, 1, 2)


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    return precision


def autocast(precision: str, device: str) -> AbstractContextManager:
    """bfloat16 autocast for `bf16`, a no-op context for `float32`."""
    if check_precision(precision) == "float32":
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


GATHER_BYTES = 1 << 28  # features kept on the device between copies to the host


class HostRows:
    """Features computed on the device, gathered there and copied into the host's `out` in pieces of
    `GATHER_BYTES`: the host waits for the device once per piece, not once per batch (and no large
    page-locked buffer is needed). `rows[i]`: the row of `out` that the i-th gathered row fills
    (default i)."""

    def __init__(self, out: Tensor, rows: Tensor | None = None) -> None:
        self.out, self.rows = out, rows
        self.gathered: list[Tensor] = []
        self.copied = self.pending_bytes = 0

    def add(self, features: Tensor) -> None:
        self.gathered.append(features.float())
        self.pending_bytes += self.gathered[-1].numel() * 4
        if self.pending_bytes >= GATHER_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.gathered:
            return
        piece = torch.cat(self.gathered).cpu()  # one copy; the host waits for the device here
        where = slice(self.copied, self.copied + len(piece))
        self.out[where if self.rows is None else self.rows[where]] = piece
        self.copied += len(piece)
        self.gathered, self.pending_bytes = [], 0


def to_device(batch: Tensor, device: str) -> Tensor:
    """A host batch to the device without the host waiting: from page-locked memory on CUDA."""
    if torch.device(device).type == "cuda":
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)


@torch.inference_mode()
def extract_features(backbone, images: Tensor, batch_size: int = 256, device: str = "cpu",
                     desc: str = "features", precision: str = "float32") -> Tensor:
    """Run the frozen backbone over uint8 `images` (N, H, W[, 3]) -> float32 features (N, D)."""
    # channels_last: convolution kernels on CPU run several times faster in this layout.
    model = backbone.model.to(device, memory_format=torch.channels_last).eval()
    out = torch.empty(len(images), backbone.feature_dim, dtype=torch.float32)
    features = HostRows(out)
    mean, std = (torch.tensor(v, dtype=torch.float32, device=device) for v in (backbone.mean, backbone.std))
    start = time.perf_counter()
    with tqdm(total=len(images), desc=desc, unit="img", leave=False) as bar, autocast(precision, device):
        for lo in range(0, len(images), batch_size):
            # uint8 to the device (a quarter of float32's bytes), preprocessed there
            batch = preprocess(to_device(images[lo:lo + batch_size], device), backbone.input_size, mean, std)
            features.add(model(batch.contiguous(memory_format=torch.channels_last)))
            bar.update(len(batch))
    features.flush()
    rate = len(images) / max(time.perf_counter() - start, 1e-9)
    print(f"[workbench] extracted {desc}: {len(images)} images, {rate:.0f} images/s")
    return out


@torch.inference_mode()
def extract_text_features(backbone, texts: Sequence[str], batch_size: int = 64, device: str = "cpu",
                          desc: str = "features", precision: str = "float32") -> Tensor:
    """Run a frozen TextBackbone over `texts` (N strings) -> float32 features (N, D).

    Texts are tokenized once (right-padded), then batched in order of token count and cut to the
    batch's longest, so a batch carries little padding; rows come back in the input order.
    """
    model = backbone.model.to(device).eval()
    out = torch.empty(len(texts), backbone.feature_dim, dtype=torch.float32)
    if not len(texts):
        return out
    start = time.perf_counter()
    tokens = backbone.tokenize(texts)  # input_ids, attention_mask: (N, L)
    lengths = tokens["attention_mask"].sum(dim=1)
    order = torch.argsort(lengths, stable=True)
    features = HostRows(out, rows=order)  # computed by token count, stored in the input order
    with tqdm(total=len(texts), desc=desc, unit="text", leave=False) as bar, autocast(precision, device):
        for lo in range(0, len(texts), batch_size):
            rows = order[lo:lo + batch_size]
            width = int(lengths[rows].max())
            batch = {name: to_device(t[rows, :width], device) for name, t in tokens.items()}
            features.add(model(**batch))
            bar.update(len(rows))
    features.flush()
    rate = len(texts) / max(time.perf_counter() - start, 1e-9)
    print(f"[workbench] extracted {desc}: {len(texts)} texts, {rate:.0f} texts/s")
    return out


def cache_key(**fields) -> str:
    """A stable hash of everything that determines the features."""
    text = json.dumps({"format": CACHE_FORMAT, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def cache_path(cache_dir: str | Path, dataset: str, split: str, backbone: str, key: str) -> Path:
    return Path(cache_dir).expanduser() / _safe(dataset) / f"{split}-{_safe(backbone)}-{key[:16]}.pt"


def all_finite(tensor: Tensor) -> bool:
    """Whether no value is NaN or ±inf. By the extremes, which NaN and ±inf reach: one pass with no
    temporaries, where `isfinite(x).all()` makes four of x's size (26 ms against 844 ms on 496 MB)."""
    return tensor.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(tensor))).all())


def payload_digest(tensor: Tensor) -> str:
    """`xxh3_128:<hex>` of a tensor's bytes (its values in memory order; not its shape or dtype)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data  # a view, not a copy
    return "xxh3_128:" + xxhash.xxh3_128_hexdigest(data)


def _blob(key: str, features: Tensor, labels: Tensor) -> dict:
    """What a cache file holds: its key, the features (N, D) float32, the labels (N,) and their digests."""
    return {"key": key, "features": features, "labels": labels,
            "digests": {"features": payload_digest(features), "labels": payload_digest(labels)}}


def _read(path: Path, key: str, labels: Tensor, feature_dim: int, rows: Tensor | None = None) -> tuple[Tensor, bool]:
    """The cached features if `path` holds exactly these, and whether the file had digests to check
    them by; raises ValueError saying why not. With `rows`, those rows alone (a copy), the file
    memory-mapped so that only they are read, and its digests (every row's bytes) not checked."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True, mmap=rows is not None)
    except Exception as error:  # a truncated or foreign file fails in many ways
        raise ValueError(f"unreadable ({type(error).__name__}: {error})") from error
    if not isinstance(blob, dict) or blob.get("key") != key:
        raise ValueError("its key does not match this dataset/backbone/transform")
    features, stored_labels = blob.get("features"), blob.get("labels")
    if not isinstance(features, Tensor) or features.dtype != torch.float32 \
            or tuple(features.shape) != (len(labels), feature_dim):
        raise ValueError(f"features have the wrong shape or dtype, expected ({len(labels)}, {feature_dim}) float32")
    if not isinstance(stored_labels, Tensor):
        raise ValueError("it holds no labels")
    digests = blob.get("digests") if rows is None else None
    if digests is not None:  # files written before digests have none (cached_features adds them)
        for name, tensor in (("features", features), ("labels", stored_labels)):
            if not isinstance(digests, dict) or digests.get(name) != payload_digest(tensor):
                raise ValueError(f"its {name} do not match the digest written with them: the file was damaged")
    if not torch.equal(stored_labels, labels):
        raise ValueError("its labels differ from the dataset's")
    if rows is not None:
        features = features[rows].clone()
    if not all_finite(features):
        raise ValueError("features contain NaN or inf")
    return features, digests is not None


def _add_digests(path: Path, key: str, features: Tensor, labels: Tensor) -> None:
    """Rewrites a file of the time before digests with them. Such a file is kept, not rebuilt: it
    passed every check the old reader made, nothing says it is damaged, and its extraction may
    have taken hours; from now on its digests catch any later damage."""
    try:
        with replaced_atomically(path) as temporary:
            _save(_blob(key, features, labels.clone()), temporary)
    except OSError as error:  # a read-only cache: used as before, unchecked
        print(f"[workbench] feature cache {path} has no digests and cannot be rewritten with them "
              f"({error.strerror}); using it unchecked, as before digests existed")
        return
    print(f"[workbench] feature cache {path} predates digests: it passed the other checks and now carries them")


def check_writable(cache_dir: str | Path, dataset: str) -> None:
    """Before anything is built: PermissionError naming the fix when `dataset`'s features would
    have to be written to a cache folder that cannot be written. A read-only cache that holds
    features of the dataset passes (which ones is known only once the backbone is built; a
    missing file then fails before its extraction)."""
    folder = Path(cache_dir).expanduser() / _safe(dataset)
    existing = existing_parent(folder)
    try:  # a nameless file, gone when closed: the honest test (os.access trusts root, not mounts)
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as error:
        if not (folder.is_dir() and any(folder.glob("*.pt"))):
            raise PermissionError(
                f"the feature cache {folder} cannot be written ({error.strerror} in {existing}) and holds no "
                f"features of {dataset}: set data.cache_dir to a writable folder") from None


def _claim(temporary: Path) -> None:
    """Creates the file the features will go to, so a cache that cannot be written fails now,
    not after the extraction."""
    try:
        temporary.touch()
    except OSError as error:
        raise PermissionError(f"the feature cache {temporary.parent} cannot be written ({error.strerror}): "
                              "set data.cache_dir to a writable folder") from error


def _save(blob: dict, temporary: Path) -> None:
    with open(temporary, "wb") as f:
        torch.save(blob, f)
        f.flush()
        os.fsync(f.fileno())


def is_text_backbone(backbone) -> bool:
    """Duck-typed (a TextBackbone tokenizes), so this module need not import the backbones."""
    return hasattr(backbone, "tokenize")


def transform_fields(backbone) -> dict:
    """What turns one raw input into the backbone's input, for the cache key."""
    if is_text_backbone(backbone):
        return {"tokenizer": backbone.tokenizer_id, "max_length": backbone.max_length,
                "pooling": backbone.pooling, "normalize": backbone.normalize}
    return {"input_size": backbone.input_size, "mean": list(backbone.mean), "std": list(backbone.std),
            "resize": "bilinear-antialias", "gray": "repeat-3"}


def feature_file_bytes(num_samples: int, feature_dim: int) -> int:
    """What one cache file takes on disk: float32 features, int64 labels and the archive's few kB."""
    return num_samples * (4 * feature_dim + 8) + (1 << 16)


def cache_file(backbone, labels: Tensor, *, cache_dir: str | Path, dataset: str, split: str, source: str,
               precision: str = "float32") -> tuple[str, Path]:
    """The key of these features and the file that holds (or will hold) them."""
    fields = dict(dataset=dataset, source=source, split=split, num_samples=len(labels),
                  backbone=backbone.name, weights=backbone.weights_id,
                  transform=transform_fields(backbone))
    if check_precision(precision) != "float32":
        fields["precision"] = precision
    if getattr(backbone, "feature_layers", ()):
        fields["layers"] = list(backbone.feature_layers)
    if getattr(backbone, "tail_input", ""):
        fields["tail_input"] = backbone.tail_input
    key = cache_key(**fields)
    return key, cache_path(cache_dir, dataset, split, backbone.name, key)


def check_cache_room(backbone, splits: dict[str, Tensor], *, cache_dir: str | Path, dataset: str,
                     source: str, precision: str = "float32") -> None:
    """Before any extraction: NoRoom unless the cache folder has room for the features of every
    split ({name: labels}) it does not hold yet, so a full disk is known before hours of work."""
    missing = {name: labels for name, labels in splits.items()
               if not cache_file(backbone, labels, cache_dir=cache_dir, dataset=dataset, split=name,
                                 source=source, precision=precision)[1].exists()}
    if missing:
        needed = sum(feature_file_bytes(len(labels), backbone.feature_dim) for labels in missing.values())
        check_room(Path(cache_dir).expanduser() / _safe(dataset), needed,
                   f"the {backbone.name} features of {dataset} ({', '.join(missing)})",
                   "free some space, or set data.cache_dir to a folder with room")


def cached_features(backbone, inputs: Tensor | Sequence[str], labels: Tensor, *,
                    cache_dir: str | Path, dataset: str, split: str, source: str,
                    batch_size: int = 256, device: str = "cpu", precision: str = "float32") -> Tensor:
    """Features of `inputs` from the cache, extracting and storing them when absent.

    inputs: uint8 images (N, ...) for an image backbone, N strings for a text backbone. When the
    disk fills up during the extraction (`check_cache_room` found room before it), the features
    are used from memory this once, with a warning, instead of being lost.
    """
    key, path = cache_file(backbone, labels, cache_dir=cache_dir, dataset=dataset, split=split, source=source,
                           precision=precision)
    features: Tensor | None  # None until extracted, below
    if path.exists():
        try:
            features, checked = _read(path, key, labels, backbone.feature_dim)
            if not checked:
                _add_digests(path, key, features, labels)
            return features
        except ValueError as why:
            warnings.warn(f"feature cache {path} is corrupt or mismatched ({why}); rebuilding it",
                          stacklevel=2)
    # the kind of `inputs` (strings or images) follows the backbone's, which mypy cannot tie together
    extract: Callable[..., Tensor] = extract_text_features if is_text_backbone(backbone) else extract_features
    features = None
    try:
        with replaced_atomically(path) as temporary:  # (its folder is made; check_writable ran first)
            _claim(temporary)
            features = extract(backbone, inputs, batch_size, device, desc=f"{dataset}/{split}", precision=precision)
            _save(_blob(key, features, labels.clone()), temporary)
    except (OSError, RuntimeError) as error:
        if features is None or not out_of_room(error):
            raise
        needed = feature_file_bytes(len(labels), backbone.feature_dim)
        warnings.warn(f"{NoRoom(path.name, path.parent, needed, 'free some space to cache them')}; the "
                      "features just extracted are used from memory for this run", stacklevel=2)
    return features


def cached_rows(backbone, inputs: Tensor | Sequence[str], labels: Tensor, rows: Tensor, *,
                cache_dir: str | Path, dataset: str, split: str, source: str,
                batch_size: int = 256, device: str = "cpu", precision: str = "float32") -> Tensor:
    """Features of `inputs[rows]` alone (a node's own rows): read from the split's cache file where
    it holds them — memory-mapped, so only those rows are read; its key, shape and labels are
    checked, its digest (every row's bytes) is not — else extracted for those rows only and not
    stored (a cache file holds a whole split). Extracted in other batches than the whole split's,
    they can differ from its cached rows in the last bits."""
    key, path = cache_file(backbone, labels, cache_dir=cache_dir, dataset=dataset, split=split, source=source,
                           precision=precision)
    if path.exists():
        try:
            return _read(path, key, labels, backbone.feature_dim, rows)[0]
        except ValueError as why:
            warnings.warn(f"feature cache {path} cannot give these rows ({why}); extracting them", stacklevel=2)
    extract: Callable[..., Tensor] = extract_text_features if is_text_backbone(backbone) else extract_features
    chosen = inputs[rows] if isinstance(inputs, Tensor) else [inputs[row] for row in rows.tolist()]
    return extract(backbone, chosen, batch_size, device, desc=f"{dataset}/{split} ({len(rows)} rows)",
                   precision=precision)


def client_sums(features: Tensor, client_ids: Tensor, num_clients: int) -> tuple[Tensor, Tensor, Tensor]:
    """What each client sends for the standardization: Σx (K, d), Σx² (K, d), n (K,), float64."""
    x = features.double()
    sums = torch.zeros(num_clients, x.shape[1], dtype=torch.float64).index_add_(0, client_ids, x)
    squares = torch.zeros_like(sums).index_add_(0, client_ids, x * x)
    counts = torch.bincount(client_ids, minlength=num_clients).double()
    return sums, squares, counts


def standardization(sums: Tensor, squares: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """The server's mean and std (d,), float64, from the clients' summed Σx, Σx², n.

    Equal to the centralized per-feature mean and (population) std of the pooled training rows.
    A feature that is constant over them (std ≤ 1e-6 of the largest std: EfficientNet-Lite0 has
    channels that stay at zero on grayscale images) keeps scale 1, so it is centered, not blown up.
    """
    n = counts.sum()
    mean = sums.sum(0) / n
    var = (squares.sum(0) / n - mean * mean).clamp(min=0)
    std = var.sqrt()
    return mean, torch.where(std > 1e-6 * std.max(), std, torch.ones_like(std))
