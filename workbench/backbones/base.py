"""The `Backbone` record and the helpers every backbone builder shares.

A backbone is a frozen feature extractor: images `(B, 3, H, W)`, resized to `input_size` and
normalized with `mean`/`std`, map to pooled features `(B, feature_dim)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

RGB = tuple[float, float, float]


class BackboneWeightsError(RuntimeError, OSError):
    """Weights for a backbone could not be found, read, fetched or matched to its architecture.

    An OSError too, like the missing-file errors of huggingface_hub and transformers, so that the
    command line reports it as a wrong input (its message, exit status 2), not as a bug.
    """


@dataclass(frozen=True)
class Backbone:
    """A frozen feature extractor and the preprocessing its weights expect.

    Attributes:
        name: the name it was built from (a registered name or a timm model name).
        model: eval mode, no trainable parameters; `(B, 3, input_size, input_size)` float images,
            normalized with `mean`/`std`, -> `(B, feature_dim)` pooled features.
        feature_dim: width of the pooled features.
        input_size: square side the images are resized to.
        mean, std: per-channel RGB normalization for images scaled to [0, 1].
        weights_id: identifies the exact weights, for feature-cache keys:
            "file-sha256:<16 hex>" for a weights file, "timm:<architecture>.<tag>" for timm hub
            weights, "random-init:seed=<s>" for a random init.
        feature_layers: inner layers whose pooled outputs precede the final vector in the
            features (`workbench.backbones.layers.with_layers`); () for the final vector only.
        tail_input: for the features of a trainable tail (`workbench.backbones.tail.with_tail_input`),
            the module whose input map the features are, flattened; "" for pooled features.
        feature_shape: the shape of one feature row before flattening ((C, H, W) for a tail's
            input map); () for a vector.
    """

    name: str
    model: nn.Module
    feature_dim: int
    input_size: int
    mean: RGB
    std: RGB
    weights_id: str
    feature_layers: tuple[str, ...] = ()
    tail_input: str = ""
    feature_shape: tuple[int, ...] = ()


class FrozenFeatureExtractor(nn.Module):
    """Wraps a pooled-feature network so it stays frozen inside a trainable parent module.

    `train()` on a parent (as Lightning does at the start of fit) would otherwise switch
    BatchNorm to batch statistics and update its running stats, silently changing the features.
    """

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> FrozenFeatureExtractor:
        return super().train(False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) normalized images -> (B, feature_dim) pooled features."""
        return self.net(images)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seeds torch's CPU generator for the block and restores the caller's RNG state after it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def random_init_id(seed: int) -> str:
    return f"random-init:seed={seed}"


def pooled_feature_dim(net: nn.Module) -> int:
    """Width of the output of a timm model created with `num_classes=0`."""
    # Models with a pre-logits head (e.g. MobileNetV3) return `head_hidden_size` features.
    width = getattr(net, "head_hidden_size", None) or getattr(net, "num_features", None)
    if not width:
        raise ValueError(f"cannot tell the pooled feature width of {type(net).__name__}")
    return int(width)


def make_backbone(
    name: str,
    net: nn.Module,
    weights_id: str,
    input_size: int,
    mean: Sequence[float],
    std: Sequence[float],
) -> Backbone:
    """Freezes `net` and records it with its default preprocessing."""
    return Backbone(
        name=name,
        model=FrozenFeatureExtractor(net),
        feature_dim=pooled_feature_dim(net),
        input_size=_check_input_size(input_size),
        mean=_check_rgb("mean", mean),
        std=_check_rgb("std", std, positive=True),
        weights_id=weights_id,
    )


def with_preprocessing(
    backbone: Backbone,
    input_size: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> Backbone:
    """Returns `backbone` with the given preprocessing fields replaced (None keeps the default)."""
    changes: dict[str, Any] = {}
    if input_size is not None:
        changes["input_size"] = _check_input_size(input_size)
        cfg = getattr(getattr(backbone.model, "net", None), "pretrained_cfg", None) or {}
        if cfg.get("fixed_input_size") and changes["input_size"] != backbone.input_size:
            raise ValueError(
                f"backbone '{backbone.name}' only accepts input_size {backbone.input_size} "
                f"(its position embedding is fixed), got {input_size}"
            )
    if mean is not None:
        changes["mean"] = _check_rgb("mean", mean)
    if std is not None:
        changes["std"] = _check_rgb("std", std, positive=True)
    return dataclasses.replace(backbone, **changes)


def _check_input_size(input_size: int) -> int:
    if isinstance(input_size, bool) or int(input_size) != input_size or input_size < 1:
        raise ValueError(f"input_size must be a positive integer, got {input_size!r}")
    return int(input_size)


def _check_rgb(field: str, values: Sequence[float], positive: bool = False) -> RGB:
    rgb = tuple(float(v) for v in values)
    if len(rgb) != 3 or not all(math.isfinite(v) for v in rgb):
        raise ValueError(f"{field} must be 3 finite floats (R, G, B), got {values!r}")
    if positive and min(rgb) <= 0:
        raise ValueError(f"{field} must be positive, got {values!r}")
    return rgb
