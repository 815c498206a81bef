"""Backbone registry: named builders, with any timm model name as the fallback.

Each name has a modality: `image` backbones (timm, EfficientNet-Lite0) take preprocessing
options (input_size, mean, std), `text` backbones (workbench.backbones.text) take tokenization
options (max_length, pooling).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from workbench.backbones.base import Backbone, with_preprocessing
from workbench.backbones.timm_models import build_timm_backbone, is_timm_model
from workbench.registry import Modality, Registry


class BackboneBuilder(Protocol):
    """Image builders take the three keywords; text builders also `max_length` and `pooling`."""

    def __call__(self, *, pretrained: bool, weights_path: str | None, seed: int) -> Any: ...


BACKBONES: Registry[BackboneBuilder] = Registry("backbone")


def register_backbone(
    name: str, modality: Modality = "image"
) -> Callable[[BackboneBuilder], BackboneBuilder]:
    """Decorator registering `builder(*, pretrained, weights_path, seed) -> Backbone` under `name`.

    A `text` builder also takes `max_length` and `pooling` (None: its default) and returns a
    TextBackbone. A registered name takes precedence over a timm model of the same name.
    """
    return BACKBONES.register(name, modality)


def list_backbones(pattern: str = "*", modality: Modality | None = None) -> list[str]:
    """Registered backbone names matching the shell-style `pattern` (and `modality`), sorted.

    Any timm model name also works with `build_backbone` (see `timm.list_models()`, or
    `timm.list_pretrained()` for names with a weights tag such as "vit_base_patch16_224.mae").
    """
    return BACKBONES.names(pattern, modality)


def backbone_modality(name: str) -> Modality:
    """`image` or `text` for a backbone name, without building it; ValueError for unknown names."""
    if name in BACKBONES:
        return BACKBONES.modality(name)
    _check_timm_name(name)
    return "image"


def _check_timm_name(name: str) -> None:
    if not is_timm_model(name):
        raise ValueError(
            f"unknown backbone '{name}': not registered (list_backbones() gives "
            f"{list_backbones()}) and not a timm model name (see timm.list_models())"
        )


def build_backbone(
    name: str,
    pretrained: bool = True,
    weights_path: str | None = None,
    input_size: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    seed: int = 0,
    max_length: int | None = None,
    pooling: str | None = None,
) -> Backbone | Any:
    """Builds a frozen feature extractor `(B, 3, input_size, input_size) -> (B, feature_dim)`,
    or for a text backbone a TextBackbone `(input_ids, attention_mask) -> (B, feature_dim)`.

    Args:
        name: a registered name (`list_backbones()`) or any timm model name.
        pretrained: load pretrained weights: `weights_path` if given, else the backbone's default
            source (a packaged file for efficientnet_lite0 and all_minilm_l6_v2, the Hugging Face
            hub for gpt2, the timm hub otherwise). Weights that cannot be loaded raise
            BackboneWeightsError; there is no silent random fallback. False gives a random init
            seeded by `seed`.
        weights_path: local weights file (state dict or checkpoint) overriding the default source;
            for a text backbone, a model directory written by `save_pretrained`.
        input_size, mean, std: override the preprocessing the weights were trained with
            (image backbones only).
        seed: seed of the random init (the global RNG state is left untouched).
        max_length, pooling: tokens kept per text and how token states are pooled (text
            backbones only; None: the backbone's default).

    Raises:
        ValueError: unknown name, weights_path without pretrained, invalid preprocessing, or
            options of the other modality.
        BackboneWeightsError: weights missing, unreadable, unfetchable or not fitting the model.
    """
    if not pretrained and weights_path is not None:
        raise ValueError(
            f"weights_path '{weights_path}' is set but pretrained is false; set pretrained: true "
            f"to load it, or drop weights_path for a random init"
        )
    modality = backbone_modality(name)
    image_options: dict[str, Any] = {"input_size": input_size, "mean": mean, "std": std}
    text_options = {"max_length": max_length, "pooling": pooling}
    foreign = image_options if modality == "text" else text_options
    if any(value is not None for value in foreign.values()):
        expected = "max_length, pooling" if modality == "text" else "input_size, mean, std"
        raise ValueError(
            f"'{name}' is {'a text' if modality == 'text' else 'an image'} backbone: "
            f"{', '.join(k for k, v in foreign.items() if v is not None)} do not apply to it "
            f"(its options are {expected})"
        )
    builder = BACKBONES[name] if name in BACKBONES else functools.partial(build_timm_backbone, name)
    if modality == "text":
        return builder(pretrained=pretrained, weights_path=weights_path, seed=seed, **text_options)
    backbone = builder(pretrained=pretrained, weights_path=weights_path, seed=seed)
    return with_preprocessing(backbone, **image_options)
