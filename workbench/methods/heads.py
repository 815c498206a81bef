"""Trainable models of the gradient methods: heads on cached features, a small CNN on pixels.

Every model is BatchNorm- and dropout-free, so its forward is a pure function of
(parameters, input): `torch.func.vmap` can then train many clients' copies at once and the
OS-FED snapshot fit can differentiate the parameter gradient with respect to the input.

- `linear`: logits = x W + b, on (n, d) features (other inputs are flattened).
- `mlp`: logits = relu(x W₁ + b₁) W₂ + b₂, hidden width `hidden_dim`.
- `cnn`: for (n, c, H, W) images with H, W divisible by 4: two 5×5 stride-2 convolutions
  (c → 16 → 32 channels, ReLU), then a linear layer on the (32, H/4, W/4) map. Strided
  convolutions instead of max-pooling: cheaper on CPU and smooth for double backprop.
- `tail`: the backbone's last stage(s) with their pretrained weights, then a linear layer:
  logits = tail(x) W + b on the cached (n, C, H, W) input maps of the tail (`data.trainable_tail`,
  `workbench.backbones.tail`: BatchNorms folded into trainable per-channel affines, so it is pure
  too). The tail's parameters are in w, so in every update and in the bytes; the analytic start
  (`init_from`) fits the last layer on body(x) = tail(x), the backbone's pooled features.
"""

from __future__ import annotations

import copy
import math
from typing import Literal

import torch
from torch import nn

Architecture = Literal["linear", "mlp", "cnn", "tail"]
ARCHITECTURES = ("linear", "mlp", "cnn", "tail")


def linear_head(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def mlp_head(input_shape: tuple[int, ...], num_classes: int, hidden_dim: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), hidden_dim),
        nn.ReLU(),
        nn.Linear(hidden_dim, num_classes),
    )


def small_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if len(input_shape) != 3 or input_shape[1] % 4 or input_shape[2] % 4:
        raise ValueError(
            f"architecture cnn needs images (c, H, W) with H and W divisible by 4, got input "
            f"shape {input_shape}: set data.inputs=images (e.g. mnist5k 28×28, cifar10 32×32)"
        )
    channels, height, width = input_shape
    return nn.Sequential(
        nn.Conv2d(channels, 16, 5, stride=2, padding=2),
        nn.ReLU(),
        nn.Conv2d(16, 32, 5, stride=2, padding=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * (height // 4) * (width // 4), num_classes),
    )


def tail_model(tail: nn.Module | None, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """nn.Sequential(a copy of `tail`, Linear(width, C)): the tail's pretrained weights, a fresh head."""
    if tail is None:
        raise ValueError(f"architecture tail trains the backbone's last stages on their cached input maps, and "
                         f"this data holds inputs of shape {input_shape} without a tail: set data.trainable_tail "
                         "(e.g. 1: EfficientNet's last stage, ResNet's layer4)")
    body = copy.deepcopy(tail).requires_grad_(True)
    with torch.no_grad():
        width = body(torch.zeros(1, *input_shape, dtype=next(body.parameters()).dtype)).shape[1]
    return nn.Sequential(body, nn.Linear(int(width), num_classes))


def build_model(
    architecture: Architecture,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    hidden_dim: int = 256,
    seed: int = 0,
    tail: nn.Module | None = None,
) -> nn.Module:
    """A freshly initialized model (PyTorch's default init, seeded): input_shape -> C logits.
    `tail`: the data's trainable tail (`Problem.tail`), which architecture `tail` copies."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if architecture == "tail":
            return tail_model(tail, input_shape, num_classes)
        if architecture == "linear":
            return linear_head(input_shape, num_classes)
        if architecture == "mlp":
            return mlp_head(input_shape, num_classes, hidden_dim)
        if architecture == "cnn":
            return small_cnn(input_shape, num_classes)
    raise ValueError(f"unknown architecture {architecture!r}; choose linear, mlp, cnn or tail")
