"""Frozen pretrained feature extractors: a small registry on top of timm and transformers.

    backbone = build_backbone("efficientnet_lite0")            # packaged ImageNet weights
    backbone = build_backbone("resnet18", pretrained=False)    # any timm model name
    features = backbone.model(images)  # (B, 3, S, S) normalized, S = backbone.input_size
                                       # -> (B, backbone.feature_dim)
    text = build_backbone("all_minilm_l6_v2")                  # a TextBackbone
    features = text.model(**text.tokenize(["a text"]))         # (1, 384)
"""

from workbench.backbones import efficientnet_lite as _efficientnet_lite  # noqa: F401  (registers)
from workbench.backbones import text as _text  # noqa: F401  (registers the text backbones)
from workbench.backbones.base import Backbone, BackboneWeightsError, FrozenFeatureExtractor
from workbench.backbones.registry import (
    BACKBONES,
    backbone_modality,
    build_backbone,
    list_backbones,
    register_backbone,
)
from workbench.backbones.text import TextBackbone

__all__ = [
    "BACKBONES",
    "Backbone",
    "BackboneWeightsError",
    "FrozenFeatureExtractor",
    "TextBackbone",
    "backbone_modality",
    "build_backbone",
    "list_backbones",
    "register_backbone",
]
