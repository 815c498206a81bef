"""Adversarial clients: a seeded share of the federation that lies in what it sends.

`federation.adversary_fraction` f makes round(f·K) of the K clients adversarial for the whole fit
(drawn from the federation's seed); `federation.attack` says how they lie:

- `label_flip`: they train or compute on labels y → C − 1 − y (data poisoning: every method; an
  analytic method receives the statistics of flipped labels);
- `sign_flip`: every floating upload negated (a model update, or an analytic method's Gram and
  cross-covariance);
- `scale`: every floating upload multiplied by `attack_scale` s (s < 0: a scaled sign flip);
- `noise`: N(0, s²) added to each coordinate of every adversary's model update (methods that
  send model updates).

Sign flips and scaling are linear, so a cohort of adversaries computed together and poisoned as
one sum sends exactly what each poisoning its own would; their noise is drawn per adversary and
summed. The server is not told who they are.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from workbench.federation import codec

ATTACKS = ("label_flip", "sign_flip", "scale", "noise")
#: the attacks on what a client sends (the others act on its data)
UPLOAD_ATTACKS = ("sign_flip", "scale", "noise")


def flip_labels(labels: Tensor, num_classes: int) -> Tensor:
    """y → C − 1 − y: every label moved, the class structure kept (a permutation of the classes)."""
    return num_classes - 1 - labels


def poison(uploads: Mapping[str, Tensor], spec: codec.Spec, attack: str, scale: float, adversaries: int,
           generator: torch.Generator) -> dict[str, Tensor]:
    """The uploads `adversaries` clients computed together, as they send them under `attack`
    (`spec`: how they travel — a stacked upload holds one row per adversary)."""
    poisoned = dict(uploads)
    for name, value in uploads.items():
        if not value.is_floating_point():
            continue
        if attack == "sign_flip":
            poisoned[name] = -value
        elif attack == "scale":
            poisoned[name] = scale * value
        elif attack == "noise" and spec[name].model_update:  # N(0, s²) per adversary: on its row, or summed
            spread = scale if spec[name].stacked else scale * adversaries ** 0.5
            noise = torch.randn(value.shape, generator=generator, dtype=torch.float64) * spread
            poisoned[name] = value + noise.to(value.device, value.dtype)
    return poisoned


def segments(clients: Tensor, adversarial: Tensor) -> list[tuple[Tensor, bool]]:
    """`clients` (sorted ids) cut into runs of consecutive clients of one kind, in order: (the run,
    whether adversarial). Stacked uploads stay in client order when the runs are combined in turn."""
    if not len(clients):
        return []
    kinds = adversarial[clients.cpu()].tolist()
    runs, start = [], 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start]:
            runs.append((clients[start:i], bool(kinds[start])))
            start = i
    return runs
