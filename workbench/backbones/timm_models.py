"""Any timm model as a frozen pooled-feature backbone.

Models are created with `num_classes=0`, so their forward returns pooled features. Input size,
mean and std come from the model's timm pretrained config. MAE ViTs (`vit_*.mae`) are created
with `global_pool='token'`: the CLS token after the final norm, as in the MAE linear-probe
protocol (timm's ViT default today, pinned so a changed default cannot switch to mean pooling).
"""

from __future__ import annotations

from typing import Any

import timm
from timm.data import resolve_data_config
from timm.models import get_pretrained_cfg, split_model_name_tag
from torch import nn

from workbench.backbones.base import (
    Backbone,
    BackboneWeightsError,
    make_backbone,
    random_init_id,
    seeded,
)
from workbench.backbones.weights import (
    file_weights_id,
    load_backbone_weights,
    read_state_dict,
)


def is_timm_model(name: str) -> bool:
    """True for a timm architecture name, optionally with a registered pretrained tag."""
    architecture, tag = split_model_name_tag(name)
    if not timm.is_model(architecture):
        return False
    if not tag:
        return True
    try:
        get_pretrained_cfg(name, allow_unregistered=False)
    except RuntimeError:  # unknown tag for a known architecture
        return False
    return True


def timm_create_kwargs(name: str) -> dict[str, Any]:
    """Extra `timm.create_model` arguments some models need to return the intended features."""
    architecture, tag = split_model_name_tag(name)
    if architecture.startswith("vit_") and tag == "mae":
        return {"global_pool": "token"}
    return {}


def create_timm_net(name: str, seed: int, hub_weights: bool = False, **kwargs: Any) -> nn.Module:
    """Creates `name` with `num_classes=0`, initialised under `seed`, global RNG untouched.

    With `hub_weights` the pretrained weights are fetched through timm (Hugging Face hub or URL);
    any failure raises BackboneWeightsError rather than falling back to random weights.
    """
    kwargs = {"num_classes": 0, **timm_create_kwargs(name), **kwargs}
    with seeded(seed):
        if not hub_weights:
            return timm.create_model(name, pretrained=False, **kwargs)
        try:
            return timm.create_model(name, pretrained=True, **kwargs)
        except Exception as err:  # offline hub, missing cache, HTTP errors, no weights for the tag
            raise BackboneWeightsError(
                f"pretrained weights for '{name}' could not be fetched from the timm hub "
                f"({type(err).__name__}: {err}). Download them once where there is network access "
                f"and pass weights_path: /path/to/weights, or set pretrained: false for a "
                f"random-init smoke test."
            ) from err


def hub_weights_id(net: nn.Module) -> str:
    cfg = net.pretrained_cfg
    tag = f".{cfg['tag']}" if cfg.get("tag") else ""
    return f"timm:{cfg['architecture']}{tag}"


def head_prefixes(net: nn.Module) -> tuple[str, ...]:
    """Module names of the classifier head(s) in timm's full model, e.g. ("fc",) for ResNet."""
    classifier = (getattr(net, "pretrained_cfg", None) or {}).get("classifier") or ()
    return (classifier,) if isinstance(classifier, str) else tuple(classifier)


def build_timm_backbone(
    name: str, *, pretrained: bool, weights_path: str | None, seed: int
) -> Backbone:
    """Builds timm model `name` as a frozen backbone.

    pretrained with weights_path: strict load of the file's backbone keys (head keys ignored).
    pretrained without: timm hub weights, BackboneWeightsError when they cannot be fetched.
    not pretrained: random init seeded by `seed`.
    """
    if pretrained and weights_path is not None:
        state = read_state_dict(weights_path)  # read first: a bad path fails before model creation
        net = create_timm_net(name, seed)
        load_backbone_weights(net, state, weights_path, name, head_prefixes(net))
        weights_id = file_weights_id(weights_path)
    elif pretrained:
        net = create_timm_net(name, seed, hub_weights=True)
        weights_id = hub_weights_id(net)
    else:
        net = create_timm_net(name, seed)
        weights_id = random_init_id(seed)

    data_cfg = resolve_data_config({}, model=net)
    return make_backbone(
        name,
        net,
        weights_id,
        input_size=data_cfg["input_size"][-1],
        mean=data_cfg["mean"],
        std=data_cfg["std"],
    )
