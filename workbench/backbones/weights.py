"""Local weights files: content hash for cache keys, reading, strict loading with clear errors."""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from workbench.backbones.base import BackboneWeightsError

WHAT_TO_DO = (
    "pass weights_path: /path/to/weights (a state dict or checkpoint saved from the same "
    "architecture), or pretrained: false for a random-init smoke test"
)

# Checkpoints often nest the state dict under one of these keys.
_CHECKPOINT_KEYS = ("state_dict", "model", "module", "model_state_dict")
# Wrappers (DDP, FrozenFeatureExtractor) add these prefixes to every key.
_WRAPPER_PREFIXES = ("module.", "net.")


def file_weights_id(path: str | os.PathLike) -> str:
    """Returns "file-sha256:<first 16 hex of the file's sha256>", cached per path+mtime+size."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    return f"file-sha256:{_sha256_prefix(str(resolved), stat.st_mtime_ns, stat.st_size)}"


@functools.lru_cache(maxsize=64)
def _sha256_prefix(path: str, mtime_ns: int, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def check_weights_file(path: str | os.PathLike) -> Path:
    """Returns `path` as a Path, or raises BackboneWeightsError if it is not a readable file."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise BackboneWeightsError(f"weights_path '{path}' is not a file; {WHAT_TO_DO}")
    return file


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Reads a state dict from a `.safetensors` file or a torch checkpoint.

    Unwraps a checkpoint's nested state dict ("state_dict", "model", ...) and strips a
    "module."/"net." prefix shared by every key.
    """
    file = check_weights_file(path)
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            loaded: object = load_file(str(file), device="cpu")
        else:
            # weights_only: a weights file must not be able to run code on load.
            loaded = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:
        raise BackboneWeightsError(
            f"weights_path '{path}' could not be read as a weights file ({type(err).__name__}: "
            f"{err}); save a plain state dict with torch.save(model.state_dict(), path), or "
            f"{WHAT_TO_DO}"
        ) from err

    for key in _CHECKPOINT_KEYS:
        if isinstance(loaded, Mapping) and isinstance(loaded.get(key), Mapping):
            loaded = loaded[key]
            break
    if not isinstance(loaded, Mapping):
        raise BackboneWeightsError(
            f"weights_path '{path}' holds a {type(loaded).__name__}, not a state dict; {WHAT_TO_DO}"
        )
    state = {k: v for k, v in loaded.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    if not state:
        raise BackboneWeightsError(f"weights_path '{path}' holds no tensors; {WHAT_TO_DO}")
    return _strip_wrapper_prefixes(state)


def _strip_wrapper_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    stripped = True
    while stripped and state:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if all(key.startswith(prefix) for key in state):
                state = {key[len(prefix):]: value for key, value in state.items()}
                stripped = True
    return state


def load_backbone_weights(
    net: nn.Module,
    state: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    backbone_name: str,
    head_prefixes: Iterable[str] = (),
) -> None:
    """Strictly loads `state` into `net`, ignoring classifier-head keys the headless `net` lacks.

    Raises BackboneWeightsError naming the file and the first missing, unexpected and mis-shaped
    keys when the file does not fit the architecture.
    """
    expected = net.state_dict()
    heads = tuple(f"{prefix}." for prefix in head_prefixes)
    state = {k: v for k, v in state.items() if k in expected or not k.startswith(heads)}

    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    mis_shaped = [
        f"{key} (file {tuple(state[key].shape)}, model {tuple(value.shape)})"
        for key, value in expected.items()
        if key in state and state[key].shape != value.shape
    ]
    if missing or unexpected or mis_shaped:
        found = {"missing": missing, "unexpected": unexpected, "mis-shaped": mis_shaped}
        problems = "; ".join(
            f"{len(keys)} {kind} keys, e.g. {', '.join(keys[:3])}"
            for kind, keys in found.items()
            if keys
        )
        raise BackboneWeightsError(
            f"weights_path '{path}' does not fit backbone '{backbone_name}': {problems}. "
            f"Point weights_path at weights saved from the '{backbone_name}' architecture "
            f"(timm parameter names; a classifier head is ignored), or pick the backbone name "
            f"that matches the file."
        )
    net.load_state_dict(state, strict=True)
