"""Robust aggregation of the clients' model updates: what the server takes instead of their mean.

With `federation.aggregation` other than `mean`, each client's model update reaches the server as
its own row (the uploads marked `model_update`, stacked instead of summed) and the server combines
the m rows u_1 … u_m into one center c, handing the method m·c where it would get Σ u_i (so a
method that divides by m steps on c):

- `median`: the coordinate-wise median (the mean of the two middle values for even m);
- `trimmed_mean`: per coordinate, the ⌊β·m⌋ largest and smallest values dropped, the rest averaged
  (β = `aggregation_trim`, < 1/2; Yin et al. 2018);
- `krum`: the update whose m − f − 2 nearest others are closest (sum of squared distances),
  f = ⌊β·m⌋ assumed adversaries, needing m > 2f + 2 (Blanchard et al. 2017); `multi_krum`: the mean
  of the m − f best-scored updates;
- `norm_bound`: each update scaled to norm ≤ B (`aggregation_norm`), then the mean (Sun et al. 2019).

They need each update in the clear: not under secure aggregation or client-level DP's noised sum,
and only for methods that send model updates (the analytic methods send statistics).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from workbench.federation import codec

#: the robust centers of model updates (`federation.aggregation`, beside `mean`)
CENTERS = ("median", "trimmed_mean", "krum", "multi_krum", "norm_bound")
AGGREGATIONS = ("mean", *CENTERS)


def center(rows: Tensor, aggregation: str, trim: float = 0.1, norm: float = 1.0) -> Tensor:
    """The robust center of the clients' updates `rows` (m, ...) -> (...)."""
    m = len(rows)
    flat = rows.reshape(m, -1)
    if aggregation == "median":
        ordered = flat.sort(0).values
        middle = (ordered[(m - 1) // 2] + ordered[m // 2]) / 2
    elif aggregation == "trimmed_mean":
        cut = math.floor(trim * m)
        if m - 2 * cut < 1:
            raise RuntimeError(f"trimmed mean of {m} updates cutting {cut} at each end leaves none: lower "
                               "federation.aggregation_trim")
        middle = flat.sort(0).values[cut:m - cut].mean(0)
    elif aggregation in ("krum", "multi_krum"):
        f = math.floor(trim * m)
        neighbours = m - f - 2
        if neighbours < 1:
            raise RuntimeError(f"Krum needs more than 2f + 2 updates; the round has {m} with f = {f} "
                               f"(federation.aggregation_trim = {trim}): lower it, or ask more clients a round")
        distances = torch.cdist(flat.double(), flat.double()).square()
        scores = distances.sort(1).values[:, 1:neighbours + 1].sum(1)  # (itself, at 0, left out)
        best = torch.argsort(scores, stable=True)
        middle = flat[best[0]] if aggregation == "krum" else flat[best[:m - f]].mean(0)
    elif aggregation == "norm_bound":
        norms = flat.double().norm(dim=1, keepdim=True)
        middle = (flat * torch.clamp(norm / norms.clamp_min(1e-30), max=1.0).to(flat.dtype)).mean(0)
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}; one of {AGGREGATIONS}")
    return middle.reshape(rows.shape[1:])


def aggregate(uploads: Mapping[str, Tensor], spec: codec.Spec, aggregation: str, trim: float,
              norm: float) -> dict[str, Tensor]:
    """The round's uploads with each stacked model update (m, ...) replaced by m × its robust
    center: where the method expects the sum of the m updates."""
    updates = {name: uploads[name] for name in codec.model_update_names(spec) if name in uploads}
    if not updates:
        return dict(uploads)
    m = len(next(iter(updates.values())))
    rows = codec.update_rows(updates)  # one vector per client, as clipped
    return {**uploads, **codec.split_rows(center(rows, aggregation, trim, norm) * m, updates)}
