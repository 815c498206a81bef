"""Choosing a ridge γ on the clients' own hold-outs: one extra small round.

With a grid of more than one γ, an analytic method's solve round also uploads the statistics
of each client's hold-out rows (a seeded 10 % per class of its training data, drawn by the
client alone from the seed and its id, `client_holdout`). The server fits one candidate per γ
on the other rows (the pooled statistics minus the hold-out's, exact as the full fit is),
broadcasts them, and every client uploads how many of its hold-out rows each candidate gets
right and how many it holds; summed, these are the pooled hold-out accuracies. The server keeps
the γ of the best one (ties: the smaller γ) and solves once more on all the rows with it. The
choice depends only on which rows are held out, never on how they are split into clients, and
never on the test split.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from workbench.data.partition import holdout_sizes, stratified_holdout
from workbench.linalg import counts_of
from workbench.methods.base import SUMMED, SYMMETRIC

if TYPE_CHECKING:
    from workbench.data.population import Population

HOLDOUT_STREAM = 2  # the seed stream of the clients' hold-outs (AnaPFL: 0 is P_g, 1 is P_l)
#: the uploads of a method choosing γ: the hold-out's statistics (solve round), its scores (next round)
SELECTION_UPLOADS = {"holdout_gram": SYMMETRIC, "holdout_cross": SUMMED,
                     "holdout_correct": SUMMED, "holdout_count": SUMMED}


def checked_grid(values: Sequence[float] | None, setting: str = "gamma_grid") -> list[float]:
    """The sorted grid (ties go to the smaller γ); [] for None. Every value must be > 0."""
    if values is None:
        return []
    grid = sorted(float(value) for value in values)
    if len(grid) == 0 or any(not value > 0 for value in grid):
        raise ValueError(f"{setting} must be a non-empty list of ridges > 0 (e.g. [1, 10, 100, 1000]) or "
                         f"null for the fixed gamma_out, got {list(values)}")
    return grid


def holdout_seed(seed: int, client: int) -> int:
    """The seed of client `client`'s hold-out draw (`stratified_holdout` of its own rows)."""
    return int(np.random.SeedSequence([seed, HOLDOUT_STREAM, client]).generate_state(1, np.uint64)[0]
               >> np.uint64(1))


def client_holdout(labels: Tensor, client_ids: Tensor, clients: Tensor, fraction: float, seed: int) -> Tensor:
    """Every client's own stratified hold-out of its rows: (n,), (n,) ordered by client, (m,) -> (n,) bool.

    Client k holds out `stratified_holdout(its labels, fraction, holdout_seed(seed, k))`: the same
    rows whichever other clients are computed with it.
    """
    # drawn on the host by each client's own generator: the labels are read once (8 bytes a row)
    counts = counts_of(torch.searchsorted(clients, client_ids), len(clients)).tolist()
    parts = [stratified_holdout(part, fraction, holdout_seed(seed, k))
             for part, k in zip(labels.cpu().split(counts), clients.tolist(), strict=True) if len(part)]
    mask = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)
    return mask.to(labels.device)


def holdout_correct(logits: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """The upload of the scoring round: (Γ, n, C) logits of the hold-out rows under each candidate,
    (n,) labels -> {"holdout_correct": (Γ,), "holdout_count": ()}."""
    correct = logits.argmax(dim=2).eq(labels).sum(dim=1).to(logits.dtype)
    return {"holdout_correct": correct, "holdout_count": logits.new_tensor(float(len(labels)))}


NO_HOLDOUT = ("no client holds out a row for choosing γ (each holds round(holdout_fraction · class size) of "
              "every class): raise holdout_fraction or set a single gamma_out")


def check_holdout_rows(method, data: Population) -> None:
    """Before a fit of a method that chooses γ_out on hold-out rows (`gamma_grid` of more than one):
    ValueError (`NO_HOLDOUT`) when `client_holdout` would hold out no row at all (`holdout_sizes`)."""
    if len(getattr(method, "gamma_grid", ())) > 1 and \
            not holdout_sizes(data.train.labels, method.holdout_fraction, data.client_ids).sum() > 0:
        raise ValueError(NO_HOLDOUT)


def choose_gamma(grid: Sequence[float], uploads: dict[str, Tensor], prefix: str) -> tuple[float, dict[str, float]]:
    """The γ of the best pooled hold-out accuracy (the first maximum: the smaller γ) and its metrics."""
    count = float(uploads["holdout_count"])
    if not count >= 0.5:
        raise ValueError(NO_HOLDOUT)
    accuracy = uploads["holdout_correct"] / count
    best = int(accuracy.argmax())
    return grid[best], {f"{prefix}/gamma": grid[best], f"{prefix}/holdout_acc": float(accuracy[best])}
