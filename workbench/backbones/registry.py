"""Backbone registry: named builders, with any timm model name as the fallback."""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Sequence
from typing import Protocol

from workbench.backbones.base import Backbone, with_preprocessing
from workbench.backbones.timm_models import build_timm_backbone, is_timm_model


class BackboneBuilder(Protocol):
    def __call__(self, *, pretrained: bool, weights_path: str | None, seed: int) -> Backbone: ...


_BUILDERS: dict[str, BackboneBuilder] = {}


def register_backbone(name: str) -> Callable[[BackboneBuilder], BackboneBuilder]:
    """Decorator registering `builder(*, pretrained, weights_path, seed) -> Backbone` under `name`.

    A registered name takes precedence over a timm model of the same name.
    """

    def decorate(builder: BackboneBuilder) -> BackboneBuilder:
        if name in _BUILDERS:
            raise ValueError(f"backbone '{name}' is already registered")
        _BUILDERS[name] = builder
        return builder

    return decorate


def list_backbones(pattern: str = "*") -> list[str]:
    """Registered backbone names matching the shell-style `pattern`, sorted.

    Any timm model name also works with `build_backbone` (see `timm.list_models()`, or
    `timm.list_pretrained()` for names with a weights tag such as "vit_base_patch16_224.mae").
    """
    return sorted(fnmatch.filter(_BUILDERS, pattern))


def build_backbone(
    name: str,
    pretrained: bool = True,
    weights_path: str | None = None,
    input_size: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    seed: int = 0,
) -> Backbone:
    """Builds a frozen feature extractor `(B, 3, input_size, input_size) -> (B, feature_dim)`.

    Args:
        name: a registered name (`list_backbones()`) or any timm model name.
        pretrained: load pretrained weights: `weights_path` if given, else the backbone's default
            source (a packaged file for registered backbones, the timm hub otherwise). Weights
            that cannot be loaded raise BackboneWeightsError; there is no silent random fallback.
            False gives a random init seeded by `seed`.
        weights_path: local weights file (state dict or checkpoint) overriding the default source.
        input_size, mean, std: override the preprocessing the weights were trained with.
        seed: seed of the random init (the global RNG state is left untouched).

    Raises:
        ValueError: unknown name, weights_path without pretrained, or invalid preprocessing.
        BackboneWeightsError: weights missing, unreadable, unfetchable or not fitting the model.
    """
    if not pretrained and weights_path is not None:
        raise ValueError(
            f"weights_path '{weights_path}' is set but pretrained is false; set pretrained: true "
            f"to load it, or drop weights_path for a random init"
        )
    builder = _BUILDERS.get(name)
    if builder is None:
        if not is_timm_model(name):
            raise ValueError(
                f"unknown backbone '{name}': not registered (list_backbones() gives "
                f"{list_backbones()}) and not a timm model name (see timm.list_models())"
            )
        builder = functools.partial(build_timm_backbone, name)
    backbone = builder(pretrained=pretrained, weights_path=weights_path, seed=seed)
    return with_preprocessing(backbone, input_size=input_size, mean=mean, std=std)
