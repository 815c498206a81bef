"""Frozen pretrained feature extractors: a small registry on top of timm.

    backbone = build_backbone("efficientnet_lite0")            # packaged ImageNet weights
    backbone = build_backbone("resnet18", pretrained=False)    # any timm model name
    features = backbone.model(images)  # (B, 3, S, S) normalized, S = backbone.input_size
                                       # -> (B, backbone.feature_dim)
"""

from workbench.backbones import efficientnet_lite as _efficientnet_lite  # noqa: F401  (registers)
from workbench.backbones.base import Backbone, BackboneWeightsError, FrozenFeatureExtractor
from workbench.backbones.registry import build_backbone, list_backbones, register_backbone

__all__ = [
    "Backbone",
    "BackboneWeightsError",
    "FrozenFeatureExtractor",
    "build_backbone",
    "list_backbones",
    "register_backbone",
]
