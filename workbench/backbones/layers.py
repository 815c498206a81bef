"""Multi-depth features: pooled outputs of chosen inner layers, concatenated with the final vector.

Linear probes gain from features taken at several depths, above all on data far from the
backbone's pretraining images (grayscale digits and clothes for an ImageNet CNN): early stages
keep local shape and texture that the last layers discard. `with_layers(backbone, layers)`
returns the backbone whose forward returns

    [pool(layer_1), ..., pool(layer_k), final pooled vector]      (B, Σ widths + feature_dim)

from one forward pass (forward hooks; no second pass per layer). Pooling per layer:
- CNN feature maps (B, C, H, W): global average over H, W.
- ViT token sequences (B, T, D): the CLS token when the model pools by `token`, else the mean of
  the patch tokens (prefix tokens left out), as the model pools its own output.
- Text backbones: the hidden states after layer i (0 = the embeddings), pooled like the final
  states (attention-masked mean, CLS or last token); only the final vector is L2-normalized.

Layer names: module paths of the timm network (`blocks.3`, `layer2`, ...), or the preset
`all_stages`: every stage of a CNN (`blocks.<i>` of an EfficientNet/MobileNet, timm's
`feature_info` modules otherwise, less a last one that feeds the pool directly) and every
transformer block of a ViT but the last (whose pooled output is the final vector). For a text
backbone, layer indices (`3` or `"3"`) or `all_stages` (every transformer layer but the last).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from workbench.backbones.base import FrozenFeatureExtractor, pooled_feature_dim

if TYPE_CHECKING:
    from workbench.backbones.text import FrozenTextEncoder

PRESETS = ("all_stages",)


def _is_text(backbone) -> bool:
    return hasattr(backbone, "tokenize")


def _image_stage_names(net: nn.Module) -> list[str]:
    blocks = getattr(net, "blocks", None)
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)) and len(blocks) > 1:
        names = [f"blocks.{i}" for i in range(len(blocks))]
        # A ViT's last block feeds the final norm and pool: its output is the final vector already.
        return names[:-1] if hasattr(net, "num_prefix_tokens") else names
    info = list(getattr(net, "feature_info", None) or [])
    if not info:
        raise ValueError(f"cannot tell the stages of {type(net).__name__}: set data.feature_layers to "
                         "module names of the network (e.g. 'layer2')")
    # A last stage as wide as the pooled vector feeds the pool directly (ResNet's layer4): skip it.
    if info[-1].get("num_chs") == pooled_feature_dim(net):
        info = info[:-1]
    return [entry["module"] for entry in info]


def resolve_layers(backbone, layers: Sequence[str | int] | str | None) -> tuple[str, ...]:
    """The checked, canonical layer names for `backbone` (() for none); ValueError naming the
    choices for a name the network does not have."""
    if layers is None:
        return ()
    if isinstance(layers, (str, int)):
        layers = [layers]
    names: list[str] = []
    if _is_text(backbone):
        depth = int(backbone.model.net.config.num_hidden_layers)
        for layer in layers:
            if layer in PRESETS:
                names += [str(i) for i in range(1, depth)]
                continue
            try:
                index = int(layer)
            except (TypeError, ValueError):
                index = -1
            if not 0 <= index <= depth:
                raise ValueError(f"data.feature_layers: {layer!r} is not a layer of '{backbone.name}'; use "
                                 f"indices 0 (embeddings) to {depth} or 'all_stages'")
            names.append(str(index))
    else:
        net = backbone.model.net
        modules = dict(net.named_modules())
        for layer in layers:
            if layer in PRESETS:
                names += _image_stage_names(net)
            elif isinstance(layer, str) and layer and layer in modules:
                names.append(layer)
            else:
                raise ValueError(f"data.feature_layers: {layer!r} is not a module of '{backbone.name}'; use "
                                 f"'all_stages' or module names such as {_image_stage_names(net)[:4]}")
    if len(set(names)) != len(names):
        raise ValueError(f"data.feature_layers names a layer twice: {list(layers)}")
    return tuple(names)


def _pool_tokens(tokens: Tensor, net: nn.Module) -> Tensor:
    """(B, T, D) -> (B, D): as the ViT pools its output (CLS for `token`, else the patch mean)."""
    if getattr(net, "global_pool", "") == "token":
        return tokens[:, 0]
    return tokens[:, getattr(net, "num_prefix_tokens", 0):].mean(dim=1)


class MultiDepthImageExtractor(nn.Module):
    """A frozen image network -> [pooled chosen layers..., final pooled vector], one pass."""

    def __init__(self, frozen: FrozenFeatureExtractor, layers: tuple[str, ...]):
        super().__init__()
        self.frozen, self.layers = frozen, layers
        self._pooled: dict[str, Tensor] = {}
        modules = dict(frozen.net.named_modules())
        for name in layers:
            modules[name].register_forward_hook(self._hook(name))
        self.requires_grad_(False)
        self.eval()

    def _hook(self, name: str):
        def store(module: nn.Module, inputs, output: Tensor) -> None:
            output = output[0] if isinstance(output, (tuple, list)) else output
            # Pool here, so the full feature map is freed as the forward goes on.
            self._pooled[name] = (output.float().mean(dim=(2, 3)) if output.ndim == 4
                                  else _pool_tokens(output.float(), self.frozen.net))
        return store

    def train(self, mode: bool = True) -> MultiDepthImageExtractor:
        return super().train(False)

    def forward(self, images: Tensor) -> Tensor:
        self._pooled.clear()
        final = self.frozen(images)
        pooled = [self._pooled.pop(name) for name in self.layers]
        return torch.cat([*pooled, final.float()], dim=1)


class MultiDepthTextEncoder(nn.Module):
    """A frozen text encoder -> [pooled hidden states of chosen layers..., final features]."""

    def __init__(self, encoder: FrozenTextEncoder, layers: tuple[str, ...]):
        super().__init__()
        self.encoder, self.layers = encoder, tuple(int(i) for i in layers)
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> MultiDepthTextEncoder:
        return super().train(False)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        from workbench.backbones.text import pool_hidden_states

        encoder = self.encoder
        out = encoder.net(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        final = pool_hidden_states(out.last_hidden_state, attention_mask, encoder.pooling)
        final = nn.functional.normalize(final, dim=-1) if encoder.normalize else final
        pooled = [pool_hidden_states(out.hidden_states[i], attention_mask, encoder.pooling) for i in self.layers]
        return torch.cat([*pooled, final], dim=1)


@torch.inference_mode()
def _layer_widths(backbone, model: nn.Module) -> int:
    """Width of the multi-depth vector, from one tiny forward."""
    if _is_text(backbone):
        tokens = backbone.tokenize(["width probe"])
        return int(model(**tokens).shape[1])
    size = backbone.input_size
    return int(model(torch.zeros(1, 3, size, size)).shape[1])


def with_layers(backbone, layers: Sequence[str | int] | str | None):
    """`backbone` whose features are the pooled `layers` followed by its final pooled vector;
    `backbone` itself when `layers` is empty. The result's `feature_layers` enter the cache key."""
    names = resolve_layers(backbone, layers)
    if not names:
        return backbone
    if getattr(backbone, "feature_layers", ()):
        raise ValueError("with_layers: the backbone already has feature_layers")
    wrapper = MultiDepthTextEncoder if _is_text(backbone) else MultiDepthImageExtractor
    model = wrapper(backbone.model, names)
    return dataclasses.replace(backbone, model=model, feature_dim=_layer_widths(backbone, model),
                               feature_layers=names)
