"""Any timm model as a frozen pooled-feature backbone.

Models are created with `num_classes=0`, so their forward returns pooled features. Input size,
mean and std come from the model's timm pretrained config. MAE ViTs (`vit_*.mae`) are created
with `global_pool='token'`: the CLS token after the final norm, as in the MAE linear-probe
protocol (timm's ViT default today, pinned so a changed default cannot switch to mean pooling).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import timm
import torch
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
from workbench.backbones.hub import hub_access, hub_cache_dir, not_cached_message, short_error
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

    With `hub_weights` the pretrained weights are loaded by timm itself: from the Hugging Face
    hub cache (HF_HUB_CACHE; downloaded there when the hub is reachable) for tags with an
    `hf_hub_id`, else from the tag's URL through torch's hub cache. Any failure raises
    BackboneWeightsError naming the tag and the cache folder, rather than falling back to random
    weights; an unreachable hub fails at once (`workbench.backbones.hub.hub_access`).
    """
    kwargs = {"num_classes": 0, **timm_create_kwargs(name), **kwargs}
    with seeded(seed):
        if not hub_weights:
            return timm.create_model(name, pretrained=False, **kwargs)
        with hub_access() as offline:
            try:
                return timm.create_model(name, pretrained=True, **kwargs)
            except Exception as err:  # not cached offline, HTTP errors, no weights for the tag
                raise BackboneWeightsError(hub_failure_message(name, err, offline)) from err


def hub_failure_message(name: str, error: BaseException, offline: str | None) -> str:
    """Why timm could not load the pretrained weights of `name`, where it looked, what to do."""
    cfg = get_pretrained_cfg(name)
    architecture, tag = (cfg.architecture, cfg.tag) if cfg is not None else (name, "")
    tagged = f"{architecture}.{tag}" if tag else name
    what = f"pretrained weights for '{name}'"
    shown_tag = tagged if tagged != name else ""
    download = f"timm.create_model('{tagged}', pretrained=True)"
    fix = (f"pass weights_path: /path/to/weights (data.weights_path: a file saved from the "
           f"'{architecture}' architecture), or pretrained: false for a random-init smoke test")
    hub_id = cfg.hf_hub_id if cfg is not None else None
    if hub_id and offline and isinstance(error, FileNotFoundError):  # not in the hub cache
        return not_cached_message(what, hub_id, offline, download, fix, tag=shown_tag)
    what += f" (timm tag {shown_tag})" if shown_tag else ""
    if hub_id:
        where = f"the Hugging Face hub repo '{hub_id}' (cache {hub_cache_dir()})"
    elif cfg is not None and cfg.url:
        where = f"{cfg.url} (cache {Path(torch.hub.get_dir()) / 'checkpoints'})"
    else:
        where = "timm (no weights source is registered for this tag)"
    return (f"{what} could not be loaded from {where} ({short_error(error)}). Download them once "
            f"on a machine with network access ({download}) and copy its cache folder here, or "
            f"{fix}")


def hub_weights_id(net: nn.Module) -> str:
    cfg: dict[str, Any] = net.pretrained_cfg  # type: ignore[assignment]  # set by timm, a plain attribute
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
